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
CUDA device launch the kernels on XLA's stream (``Engine.launch_external``), ``mode="cpu"`` copies the gradients to
pinned staging and has the host workers update the state (``Engine.update_external``).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from .. import contract as C
from ..backends import jax as xb
from ..core import DeviceUpdate, Engine, ExternalUpdate
from ._state import OffloadAdamWState

__all__ = ["apply", "device_engine", "init"]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def init(params, leaves):
    """The state of ``params`` on one CUDA device (the count on it, the rest in its pinned host memory)."""
    if any(isinstance(x, jax.core.Tracer) for x in leaves):  # init inside a program
        host, xp, count = jax.memory.Space.Host, jnp, jnp.zeros([], jnp.int32)
        to_f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    else:
        dev = next(iter(leaves[0].devices())) if leaves else jax.local_devices(backend="gpu")[0]
        host, xp = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"), np
        to_f32 = lambda x: np.asarray(jax.device_get(x)).astype(np.float32)  # noqa: E731
        count = jax.device_put(jnp.zeros([], jnp.int32), dev)
    zeros = lambda x: jax.device_put(xp.zeros(xp.shape(x), xp.float32), host)  # noqa: E731
    master = lambda x: None if np.dtype(x.dtype) == np.float32 else jax.device_put(to_f32(x), host)  # noqa: E731
    return OffloadAdamWState(count, *(jax.tree.map(f, params) for f in (zeros, zeros, master)))


def _noop(ctx, outs, *ins) -> None:
    """``own`` and ``order``: XLA has put the operands into the aliased outputs already."""


def apply(plan, scalars, count_inc, g_leaves, p_leaves, mu, nu, masters):
    """The update of ``plan`` (:class:`trainstream.jax._plan.Plan`) on a GPU over one device's leaves:
    ``(firsts, mu', nu', masters')``, ``firsts`` the new weights or, with ``plan.emit_u``, ``u`` of float32
    leaves and the rounded new weights of fp16/bf16 ones."""
    n, sds, f32 = plan.n, jax.ShapeDtypeStruct, jnp.float32
    if plan.emit_u:  # fresh buffers: u (float32 leaves), the rounded weights (fp16/bf16)
        like = [sds(np.shape(p), f32 if i not in plan.halves else p.dtype) for i, p in enumerate(p_leaves)]
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
    res = [sds(np.shape(x), f32) for x in state_in]
    outs = buffer_callback(plan.gpu, res, input_output_aliases={base + j: j for j in range(len(state_in))})(*ops)
    outs = [jax.device_put(x, jax.memory.Space.Host) for x in outs]  # host avals: the outputs stay there
    firsts = buffer_callback(_noop, like, input_output_aliases={i: i for i in range(n)})(*w, outs[-1]) if n else []
    return list(firsts), outs[:n], outs[n:2 * n], outs[2 * n:-1]  # the last: the token


_device_engines: dict = {}  # CUDA device -> the engine of mode="gpu" on it, for the process
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


class _Staging:
    """Pinned host buffers of one device for ``mode="cpu"``, each ``(address, flat NumPy view)``, freed with the plan:
    the scalars, and per leaf the gradient and (float32 leaves) the weights and (``update``) the update."""

    def __init__(self, plan, device: int):
        self.pinned = xb.Staging(device, "JAX mode='cpu'")
        self.lock = threading.Lock()
        alloc = self.pinned.alloc
        self.scalars_ptr, scalars = alloc(C.N_SCALARS * max(plan.n, 1), np.float32, "the scalars")
        self.scalars = scalars.reshape(-1, C.N_SCALARS)
        self.grads, self.weights, self.updates = [], {}, {}  # weights, updates: of the float32 leaves
        for i, (kind, numel) in enumerate(zip(plan.kinds, plan.numels)):
            self.grads.append(alloc(numel, np.float32 if kind == "float32" else np.uint16, f"gradient {i}"))
            if kind == "float32":
                self.weights[i] = alloc(numel, np.float32, f"weights {i}")
                if plan.emit_u:  # the update goes to a buffer of its own, the weights are read
                    self.updates[i] = alloc(numel, np.float32, f"update {i}")


class _Update:
    """``update(ctx, outs, S, t, grads, w, [params], mu, nu, masters, token)`` on XLA:GPU (``t``: unused)."""

    def __init__(self, plan):
        self.plan = plan
        self._staging: dict[int, _Staging] = {}
        self._lock = threading.Lock()

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
            elif plan.emit_u:  # reads the float32 weights, writes u into w
                weights_ptr, master, u = ptr(weights[i]), 0, ptr(w[i])
            else:  # the float32 weights in place (w holds the params)
                weights_ptr, master, u = ptr(w[i]), 0, 0
            items.append(DeviceUpdate(weights_ptr, ptr(grads[i]), ptr(mus[i]), ptr(nus[i]), master, u, numel, kind,
                                      kind, s0 + row * i))
        device_engine(device).launch_external(items, stream)

    def _host(self, device, stream, scal, grads, w, weights, mus, nus, masters) -> None:
        """``mode="cpu"``: each gradient (and float32 weights) copied to pinned staging with an event; the
        engine's host workers update each leaf as its copy lands (the state's host memory in place) and queue its
        upload into ``w`` (:meth:`trainstream.core.Engine.update_external`). Returns once the host work is done (the
        uploads run before XLA's next work)."""
        plan, ptr = self.plan, xb.buffer_ptr
        st = _once(self._staging, device, self._lock, lambda: _Staging(plan, device))
        with st.lock:  # one update of this plan on this device at a time (its staging)
            pinned = st.pinned
            pinned.to_host(st.scalars_ptr, ptr(scal), 4 * C.N_SCALARS * plan.n, stream)
            events = []
            for i in range(plan.n):
                kind, numel = plan.kinds[i], plan.numels[i]
                pinned.to_host(st.grads[i][0], ptr(grads[i]), numel * _ITEMSIZE[kind], stream)
                if kind == "float32":  # the weights: w holds the params (step), or read them (update)
                    src = weights[i] if plan.emit_u else w[i]
                    pinned.to_host(st.weights[i][0], ptr(src), 4 * numel, stream)
                events.append(pinned.event(stream))
            items = []
            for i in range(plan.n):
                kind, numel = plan.kinds[i], plan.numels[i]
                m = xb.host_view(ptr(mus[i]), numel, np.float32)
                v = xb.host_view(ptr(nus[i]), numel, np.float32)
                g_ptr, g = st.grads[i]
                if i in masters:  # the rounded weights overwrite the staged gradient, then go up
                    p = xb.host_view(ptr(masters[i]), numel, np.float32)
                    out, out_kind, up_src, up_bytes = g, kind, g_ptr, numel * _ITEMSIZE[kind]
                elif plan.emit_u:  # u goes up from its own buffer
                    p, (up_src, out) = st.weights[i][1], st.updates[i]
                    out_kind, up_bytes = "u", 4 * numel
                else:  # the new weights go up from the staged weights
                    (up_src, p), out, out_kind, up_bytes = st.weights[i], None, None, 4 * numel
                upload = functools.partial(pinned.to_device, ptr(w[i]), up_src, up_bytes, stream)
                items.append(ExternalUpdate(p, m, v, g, kind, out, out_kind, st.scalars[i], events[i], upload))
            plan.engine.update_external(items, "cuda")
