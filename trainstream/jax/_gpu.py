"""The JAX adapter on XLA:GPU: the state in pinned host memory (:func:`init`), three callbacks per update.

XLA refuses one custom call whose outputs mix host and GPU memory (``E1200``, jax 0.11.2:
``experiments/data/2026-12-02_h200_jax_state_flow.md``), so :func:`apply` makes each update of three calls:

* ``own(params) -> w`` (device only): buffers for the new weights (``step``: aliased to the params) or updates (fresh);
* ``update(S, t, grads, w, [params], mu, nu, masters, token) -> (mu', nu', masters', token')`` (host only, the
  state aliased in place): runs :class:`_Update`, writing ``w``, which XLA treats as read only: safe as ``w`` is this
  update's own buffer, used only by ``update`` then ``order``, ordered by the token (verified with jax 0.10.2 on
  XLA:CPU with the CUDA calls simulated, ``lax.scan`` included, and 0.11.2 on an H200);
* ``order(w, token') -> w'`` (device only, aliased): every use of the new weights comes after ``update``.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from .. import _cuda
from .. import contract as C
from ..core import ExternalUpdate, staging_ring

__all__ = ["apply", "init"]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def init(params, leaves):
    """The state of ``params`` on one CUDA device (the count on it, the rest in its pinned host memory)."""
    from ._transform import OffloadAdamWState  # noqa: PLC0415
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
    """The update of ``plan`` (``trainstream.jax._transform._Plan``) on a GPU over one device's leaves:
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


_rings: dict = {}  # device -> StagingRing (or None: refused), one per device for the process
_lock = threading.Lock()  # creates the rings


def _once(cache: dict, key, lock, make):
    """``cache[key]``, made by ``make()`` under ``lock`` the first time (no lock once it exists)."""
    if key not in cache:
        with lock:
            if key not in cache:
                cache[key] = make()
    return cache[key]


def _ring(device: int):
    """The staging ring of ``device`` for ``mode="gpu"`` (72 MiB of GPU memory from its first update on, shared
    by every plan), or None when refused."""
    from .. import _device_kernels as dk  # noqa: PLC0415
    return _once(_rings, device, _lock, lambda: staging_ring(device, dk, "JAX mode='gpu'"))


def _ptr(buf) -> int:
    """The device address of a buffer XLA hands to a callback (host memory: its UVA address)."""
    return int(buf.__cuda_array_interface__["data"][0])


def _stream(ctx) -> int:
    """XLA's compute stream of this execution (a ``CUstream``)."""
    return int(ctx.stream)


class _Staging:
    """Pinned host buffers of one device for ``mode="cpu"``, each ``(address, flat NumPy view)``, freed with the plan:
    the scalars and count, and per leaf the gradient and (float32 leaves) the weights and (``update``) the update."""

    def __init__(self, plan, device: int):
        from .. import _device_kernels as dk  # noqa: PLC0415
        self.ctx = _cuda.context(device)
        self.lock = threading.Lock()
        self._buffers: list = []  # _cuda.Mapped, freed when collected (with the plan)

        def alloc(numel: int, dtype, what: str, extra: int = 0) -> tuple:
            try:
                buf = self.ctx.alloc_mapped(max(64, numel * np.dtype(dtype).itemsize + extra))
            except MemoryError as exc:
                raise MemoryError(f"TrainStream JAX mode='cpu': pinned staging for {what}: {exc}") from exc
            self._buffers.append(buf)
            return buf.host_ptr, dk.host_view(buf.host_ptr, numel, dtype)

        rows = C.N_SCALARS * max(plan.n, 1)
        self.scalars_ptr, scalars = alloc(rows, np.float32, "the scalars", extra=64)  # the count after them
        self.scalars = scalars.reshape(-1, C.N_SCALARS)
        self.count_ptr = self.scalars_ptr + 4 * rows
        self.count = dk.host_view(self.count_ptr, 1, np.int32)
        self.grads, self.weights, self.updates = [], {}, {}  # weights, updates: of the float32 leaves
        for i, (kind, numel) in enumerate(zip(plan.kinds, plan.numels)):
            self.grads.append(alloc(numel, np.float32 if kind == "float32" else np.uint16, f"gradient {i}"))
            if kind == "float32":
                self.weights[i] = alloc(numel, np.float32, f"weights {i}")
                if plan.emit_u:  # the update goes to a buffer of its own, the weights are read
                    self.updates[i] = alloc(numel, np.float32, f"update {i}")


class _Update:
    """``update(ctx, outs, S, t, grads, w, [params], mu, nu, masters, token)`` on XLA:GPU."""

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
        run(_cuda.pointer_device(_ptr(grads[0])), _stream(ctx), scal, count, grads, w, weights, mus, nus, masters)

    def _launch(self, device, stream, scal, count, grads, w, weights, mus, nus, masters) -> None:
        """``mode="gpu"``: :func:`trainstream._device_kernels.launch_adamw_multi` (``launch_adamw_u_multi`` for
        ``update``'s float32 leaves) over every leaf in launches of up to ``MULTI_MAX`` per dtype, a row of scalars
        each; the state staged through the device's :class:`trainstream.core.StagingRing` (:func:`_ring`), XLA's
        stream waiting for its copies back (no ring: read in host memory). ``count``: unused."""
        from .. import _device_kernels as dk  # noqa: PLC0415
        plan, row, s0 = self.plan, 4 * C.N_SCALARS, _ptr(scal)
        groups: dict[tuple, list] = {}
        for i in range(plan.n):
            kind, numel = plan.kinds[i], plan.numels[i]
            moments = (_ptr(mus[i]), _ptr(nus[i]))
            if i in masters:  # reads the fp32 master, writes it and the rounded weights into w
                key, state, wp, up = ("w", kind), moments + (_ptr(masters[i]),), _ptr(w[i]), None
            elif plan.emit_u:  # reads the float32 weights, writes u into w
                key, state, wp, up = ("u", kind), moments, _ptr(weights[i]), _ptr(w[i])
            else:  # the float32 weights in place (w holds the params)
                key, state, wp, up = ("w", kind), moments, _ptr(w[i]), None

            def item(lo, n, d, wp=wp, up=up, gp=_ptr(grads[i]), b=_ITEMSIZE[kind], sc=s0 + row * i,
                     master=i in masters):
                """The kernel item of elements lo:lo+n, the state at ``d`` (m, v[, master])."""
                third = d[2] if master else (up + 4 * lo if up else 0)
                return (wp + b * lo, gp + b * lo, third, d[0], d[1], n, sc)

            groups.setdefault(key, []).append((state, numel, item, None))
        ring = _ring(device)
        after = _cuda.Event(ring.ctx, stream) if ring is not None else None  # XLA's work before: the state's writers
        for (what, kind), entries in groups.items():
            dtypes = (kind,) if what == "u" else (kind, kind)  # u: the gradient's; w: the weights' and gradient's
            launch = functools.partial(dk.launch_adamw_u_multi if what == "u" else dk.launch_adamw_multi,
                                       C.VARIANT_OPTAX_CUDA, *dtypes, stream=stream, device=device)
            if ring is not None:
                ring.run(launch, entries, stream, after)
                after = None
            else:
                for k in range(0, len(entries), dk.MULTI_MAX):
                    launch([item(0, n, state) for state, n, item, _ in entries[k:k + dk.MULTI_MAX]])
        if ring is not None and ring.last is not None:
            ring.ctx.stream_wait_event(stream, ring.last)  # XLA's later readers see the state copied back

    def _host(self, device, stream, scal, count, grads, w, weights, mus, nus, masters) -> None:
        """``mode="cpu"``: each gradient (and float32 weights) copied to pinned staging with an event; the
        engine's host workers update each leaf as its copy lands (the state's host memory in place) and queue its
        upload into ``w``. Returns once the host work is done (the uploads run before XLA's next work)."""
        from .. import _device_kernels as dk  # noqa: PLC0415
        plan = self.plan
        st = _once(self._staging, device, self._lock, lambda: _Staging(plan, device))
        with st.lock:  # one update of this plan on this device at a time (its staging)
            cx = st.ctx
            cx.memcpy_dtoh_async(st.scalars_ptr, _ptr(scal), 4 * C.N_SCALARS * plan.n, stream)
            cx.memcpy_dtoh_async(st.count_ptr, _ptr(count), 4, stream)
            events = []
            for i in range(plan.n):
                kind, numel = plan.kinds[i], plan.numels[i]
                cx.memcpy_dtoh_async(st.grads[i][0], _ptr(grads[i]), numel * _ITEMSIZE[kind], stream)
                if kind == "float32":  # the weights: w holds the params (step), or read them (update)
                    src = weights[i] if plan.emit_u else w[i]
                    cx.memcpy_dtoh_async(st.weights[i][0], _ptr(src), 4 * numel, stream)
                events.append(_cuda.Event(cx, stream))
            scalars = st.scalars
            if plan.convention == "torch":  # host float64 scalars from the count and the norm
                events[-1].synchronize()
                scalars = plan.torch_scalars(st.scalars[:plan.n].copy(), int(st.count[0]),
                                             [(g, kind, None) for (_, g), kind in zip(st.grads, plan.kinds)])
            items = []
            for i in range(plan.n):
                kind, numel = plan.kinds[i], plan.numels[i]
                m = dk.host_view(_ptr(mus[i]), numel, np.float32)
                v = dk.host_view(_ptr(nus[i]), numel, np.float32)
                g_ptr, g = st.grads[i]
                if i in masters:  # the rounded weights overwrite the staged gradient, then go up
                    p = dk.host_view(_ptr(masters[i]), numel, np.float32)
                    out, out_kind, up_src, up_bytes = g, kind, g_ptr, numel * _ITEMSIZE[kind]
                elif plan.emit_u:  # u goes up from its own buffer
                    p, (up_src, out) = st.weights[i][1], st.updates[i]
                    out_kind, up_bytes = "u", 4 * numel
                else:  # the new weights go up from the staged weights
                    (up_src, p), out, out_kind, up_bytes = st.weights[i], None, None, 4 * numel
                upload = functools.partial(cx.memcpy_htod_async, _ptr(w[i]), up_src, up_bytes, stream)
                items.append(ExternalUpdate(p, m, v, g, kind, out, out_kind, scalars[i], events[i], upload))
            plan.engine.update_external(items, "cuda")
