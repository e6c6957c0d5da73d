"""The JAX adapter on XLA:GPU: the state in pinned host memory (:func:`init`), three callbacks per update.

XLA refuses one custom call whose outputs mix host and GPU memory (``E1200``, jax 0.11.2:
``experiments/data/2026-12-02_h200_jax_state_flow.md``), so :func:`apply` makes each update of three calls:

* ``own(params) -> w`` (device only): buffers for the new weights (``step``: aliased to the params) or updates (fresh);
* ``update(S, t, grads, w, [params], mu, nu, masters, token) -> (mu', nu', masters', token')`` (host only, the
  state aliased in place): runs :class:`_Update`, writing ``w``, which XLA treats as read only: safe as ``w`` is this
  update's own buffer, used only by ``update`` then ``order``, ordered by the token (verified with jax 0.10.2 on
  XLA:CPU with the CUDA calls simulated, ``lax.scan`` included, and 0.11.2 on an H200);
* ``order(w, token') -> w'`` (device only, aliased): every use of the new weights comes after ``update``.

``update`` goes through the engine (:mod:`trainstream.core`): ``mode="gpu"`` has the device placement of the buffers'
CUDA device launch the kernels on XLA's stream (``Engine.launch_external``), ``mode="cpu"`` has the host workers update
the state (``Engine.update_external``) from the gradients copied down through the device's staging ring (a few pinned
buffers, :class:`trainstream.core.HostRing`).
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from .. import contract as C
from ..backends import jax as xb
from ..core import DeviceUpdate, Engine, HostRing, StagedLeaf
from ._sharding import host_zeros
from ._state import OffloadAdamWState

__all__ = ["apply", "device_engine", "init"]

def init(params, leaves, families):
    """The state of ``params`` on one CUDA device (the count on it, the rest in its pinned host memory), each leaf's
    as its :class:`~trainstream.jax._config.Family` says (mu's and nu's dtypes, an fp32 master or none)."""
    if any(isinstance(x, jax.core.Tracer) for x in leaves):  # init inside a program
        host, xp, count = jax.memory.Space.Host, jnp, jnp.zeros([], jnp.int32)
        to_f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    else:
        dev = next(iter(leaves[0].devices())) if leaves else jax.local_devices(backend="gpu")[0]
        host, xp = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"), np
        to_f32 = lambda x: np.asarray(jax.device_get(x)).astype(np.float32)  # noqa: E731
        count = jax.device_put(jnp.zeros([], jnp.int32), dev)
    treedef = jax.tree.structure(params)
    col = lambda f: jax.tree.unflatten(treedef, [f(x, fam) for x, fam in zip(leaves, families)])  # noqa: E731
    # XLA's own buffers: an array aliasing NumPy's memory cannot be donated (the zeros: _sharding.host_zeros)
    put = (lambda a: jax.device_put(a, host)) if xp is jnp else (lambda a: jax.device_put(a, host, may_alias=False))
    if xp is jnp:
        zeros = lambda x, dt: put(jnp.zeros(jnp.shape(x), jnp.dtype(dt)))  # noqa: E731
    else:
        zeros = lambda x, dt: host_zeros(np.shape(x), jnp.dtype(dt), host)  # noqa: E731
    return OffloadAdamWState(count, col(lambda x, f: zeros(x, f.mu)), col(lambda x, f: zeros(x, f.nu)),
                             col(lambda x, f: put(to_f32(x)) if f.master else None))


def _noop(ctx, outs, *ins) -> None:
    """``own`` and ``order``: XLA has put the operands into the aliased outputs already."""


def apply(plan, scalars, count_inc, g_leaves, p_leaves, mu, nu, masters):
    """The update of ``plan`` (:class:`trainstream.jax._plan.Plan`) on a GPU over one device's leaves:
    ``(firsts, mu', nu', masters')``, ``firsts`` the new weights or, with ``plan.emit_u``, ``u`` of float32
    leaves and the rounded new weights of fp16/bf16 ones."""
    n, sds, f32 = plan.n, jax.ShapeDtypeStruct, jnp.float32
    if plan.emit_u:  # fresh buffers: u (optax's update dtype), or the rounded weights (of an fp32 master)
        like = [sds(np.shape(p), jnp.dtype(plan.u_kinds[i]) if i not in plan.halves else p.dtype)
                for i, p in enumerate(p_leaves)]
        # the gradients as operands, else XLA may hoist the call out of a loop (every iteration into one buffer)
        w = buffer_callback(_noop, like)(*g_leaves) if n else []
        reads = [p for i, p in enumerate(p_leaves) if i not in plan.halves]  # the kernel reads them
    else:
        like = [sds(np.shape(p), p.dtype) for p in p_leaves]
        w = buffer_callback(_noop, like, input_output_aliases={i: i for i in range(n)})(*p_leaves) if n else []
        reads = []
    state_in = [*mu, *nu, *masters, jax.device_put(jnp.zeros((1,), f32), jax.memory.Space.Host)]  # last: a token
    ops = [scalars, count_inc, *g_leaves, *w, *reads, *state_in]
    base = len(ops) - len(state_in)
    res = [sds(np.shape(x), x.dtype) for x in state_in]
    outs = buffer_callback(plan.gpu, res, input_output_aliases={base + j: j for j in range(len(state_in))})(*ops)
    outs = [jax.device_put(x, jax.memory.Space.Host) for x in outs]  # host avals: the outputs stay there
    firsts = buffer_callback(_noop, like, input_output_aliases={i: i for i in range(n)})(*w, outs[-1]) if n else []
    return list(firsts), outs[:n], outs[n:2 * n], outs[2 * n:-1]  # the last: the token


_device_engines: dict = {}  # CUDA device -> the engine of mode="gpu" on it, for the process
_host_rings: dict = {}  # CUDA device -> the staging ring of mode="cpu" on it, for the process
_lock = threading.Lock()  # creates them


def _once(cache: dict, key, lock, make):
    """``cache[key]``, made by ``make()`` under ``lock`` the first time (no lock once it exists)."""
    if key not in cache:
        with lock:
            if key not in cache:
                cache[key] = make()
    return cache[key]


def device_engine(device: int) -> Engine:
    """The engine of ``mode="gpu"`` on CUDA device ``device``, shared by every plan: no slots, the device placement
    (kernels compiled at its first update, then a 72 MiB staging ring of GPU memory; zero-copy where refused)."""
    return _once(_device_engines, device, _lock,
                 lambda: Engine(None, mode="gpu", convention="optax", device_index=device))


def host_ring(device: int) -> HostRing:
    """The staging ring of ``mode="cpu"`` on CUDA device ``device`` (:class:`trainstream.core.HostRing`), shared by
    every plan, kept for the process: its pinned buffers grow to the largest update's need (:func:`trainstream.core.host_ring_bytes`)."""
    return _once(_host_rings, device, _lock, lambda: HostRing(device))


class _Update:
    """``update(ctx, outs, S, t, grads, w, [params], mu, nu, masters, token)`` on XLA:GPU (``t``: unused)."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, ctx, outs, scal, count, *ins) -> None:
        plan, n = self.plan, self.plan.n
        if n == 0:
            return
        grads, w, reads = ins[:n], ins[n:2 * n], ins[2 * n:]  # reads: float32 weights (emit_u); the state: outs
        mus, nus = outs[:n], outs[n:2 * n]
        masters = dict(zip(plan.halves, outs[2 * n:2 * n + len(plan.halves)]))
        weights = dict(zip([i for i in range(n) if i not in plan.halves], reads)) if plan.emit_u else {}
        run = self._launch if plan.mode == "gpu" else self._host
        run(xb.buffer_device(grads[0]), xb.stream_of(ctx), scal, grads, w, weights, mus, nus, masters)

    def _launch(self, device, stream, scal, grads, w, weights, mus, nus, masters) -> None:
        """``mode="gpu"``: every leaf's update by the device placement of ``device``
        (:meth:`trainstream.core.Engine.launch_external`: launches of up to ``MULTI_MAX`` per dtype, a row of scalars
        each; the state staged through the device's ring, XLA's stream waiting for its copies back; no ring: read in
        host memory)."""
        plan, ptr, row, s0 = self.plan, xb.buffer_ptr, 4 * C.N_SCALARS, xb.buffer_ptr(scal)
        items = []
        for i, (kind, numel) in enumerate(zip(plan.kinds, plan.numels)):
            if i in masters:  # reads the fp32 master, writes it and the rounded weights into w
                weights_ptr, master, u = ptr(w[i]), ptr(masters[i]), 0
            elif plan.emit_u:  # reads the weights, writes u into w
                weights_ptr, master, u = ptr(weights[i]), 0, ptr(w[i])
            else:  # the weights in place (w holds the params)
                weights_ptr, master, u = ptr(w[i]), 0, 0
            items.append(DeviceUpdate(weights_ptr, ptr(grads[i]), ptr(mus[i]), ptr(nus[i]), master, u, numel, kind,
                                      kind, s0 + row * i, plan.mu_kinds[i], plan.nu_kinds[i]))
        device_engine(device).launch_external(items, stream)

    def _host(self, device, stream, scal, grads, w, weights, mus, nus, masters) -> None:
        """``mode="cpu"``: the engine's host workers update each leaf's state in place, piece by piece through the
        device's staging ring (:meth:`trainstream.core.HostRing.update`: the gradients and the weights without a
        master down, the new weights or ``u`` up into ``w``). Returns once the host work is done (XLA's stream waits
        for the copies up)."""
        plan, ptr = self.plan, xb.buffer_ptr
        leaves = []
        for i, (kind, numel) in enumerate(zip(plan.kinds, plan.numels)):
            state = [xb.host_view(ptr(a), numel, np.float32 if k == "float32" else np.uint16)
                     for a, k in ((mus[i], plan.mu_kinds[i]), (nus[i], plan.nu_kinds[i]))]
            if i in masters:  # the rounded weights go up into w
                weights_ptr, master = 0, xb.host_view(ptr(masters[i]), numel, np.float32)
            else:  # the weights (optax's own state): w holds the params (step), or read them (update, u into w)
                weights_ptr, master = ptr(weights[i] if plan.emit_u else w[i]), None
            leaves.append(StagedLeaf(ptr(grads[i]), kind, weights_ptr, master, *state, ptr(w[i]),
                                     plan.emit_u and i not in masters, numel))
        host_ring(device).update(plan.engine, leaves, ptr(scal), stream)
