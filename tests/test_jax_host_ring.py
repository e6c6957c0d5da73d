"""The staging ring of ``mode="cpu"`` on a GPU (trainstream.core._hostring), its CUDA calls simulated on the host
(tests/_jax_gpu_sim.py): pieces through a few pinned buffers give the bits of the same update without staging, the
ring grows to what an update needs and stays usable after a worker's failure, and ``host_memory_plan`` counts it once
(a 7B model's host bytes per parameter: its state and a constant)."""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import trainstream.jax as tsj  # noqa: E402
from trainstream import _host_kernels as K  # noqa: E402
from trainstream import contract as C  # noqa: E402
from trainstream.core import ExternalUpdate, HostRing, StagedLeaf, WorkerError, _hostring  # noqa: E402
from trainstream.jax._plan import host_engine  # noqa: E402

from _jax_gpu_sim import _Context, _Mapped, simulate_gpu  # noqa: E402


#: The ring's geometry as shipped (the simulation makes it small).
GEOMETRY = {k: getattr(_hostring, k) for k in ("HOST_RING_ELEMS", "HOST_RING_DEPTH", "_ALIGN")}


@pytest.fixture
def simulated_gpu(monkeypatch):
    yield from simulate_gpu(monkeypatch)


def _scalars(n, t, lr=1e-2, wd=0.05):
    decays = [k % 3 != 2 for k in range(n)]
    return np.asarray(C.optax_scalar_matrix(np.int32(t), [0] * n, decays, learning_rate=lr, b1=0.9, b2=0.999, eps=1e-8,
                                            weight_decay=wd).scalars, np.float32)


class _Leaf:
    """One leaf's "GPU" buffers (host arrays: the simulated copies memmove) and its host state."""

    def __init__(self, rng, numel, kind, emit_u):
        f32 = lambda: rng.standard_normal(numel).astype(np.float32)  # noqa: E731
        self.kind, self.emit_u, self.numel = kind, emit_u, numel
        self.m, self.v = np.abs(f32()) * 0.1, np.abs(f32()) * 0.01
        self.grad = f32() * 0.1
        if kind == "float32":
            self.weights, self.master = f32(), None
            self.out = np.full(numel, np.nan, np.float32)
        else:  # bfloat16 weights with an fp32 master
            self.master, self.weights = f32(), None
            self.grad = (self.grad.view(np.uint32) >> 16).astype(np.uint16)
            self.out = np.zeros(numel, np.uint16)

    def staged(self):
        ptr = lambda a: a.ctypes.data  # noqa: E731
        return StagedLeaf(ptr(self.grad), self.kind, ptr(self.weights) if self.weights is not None else 0,
                          self.master, self.m, self.v, ptr(self.out), self.emit_u, self.numel)

    def direct(self, s):
        """The same update without staging (the engine on the arrays themselves), on copies: ``(p, m, v, out)``."""
        p, m, v = (x.copy() if x is not None else None for x in (
            self.weights if self.weights is not None else self.master, self.m, self.v))
        out, kind = None, None
        if self.kind != "float32":
            out, kind = self.grad.copy(), self.kind
        elif self.emit_u:
            out, kind = np.empty(self.numel, np.float32), "u"
        g = out if self.kind != "float32" else self.grad
        host_engine(2, 5).update_external([ExternalUpdate(p, m, v, g, self.kind, out, kind, s)], "cuda")
        return p, m, v, out


def _run(ring, leaves, t):
    s = _scalars(len(leaves), t)
    want = [lf.direct(s[i]) for i, lf in enumerate(leaves)]
    ring.update(host_engine(2, 5), [lf.staged() for lf in leaves], s.ctypes.data, 0)
    for lf, (p, m, v, out) in zip(leaves, want):
        np.testing.assert_array_equal(lf.m.view(np.uint32), m.view(np.uint32))
        np.testing.assert_array_equal(lf.v.view(np.uint32), v.view(np.uint32))
        if lf.kind != "float32":  # the master in place, the rounded weights up
            np.testing.assert_array_equal(lf.master.view(np.uint32), p.view(np.uint32))
            np.testing.assert_array_equal(lf.out, out)
        elif lf.emit_u:  # u up, the weights untouched
            np.testing.assert_array_equal(lf.out.view(np.uint32), out.view(np.uint32))
        else:  # the new weights up (the "GPU" weights are only read)
            np.testing.assert_array_equal(lf.out.view(np.uint32), p.view(np.uint32))


def test_ring_pieces_give_the_unstaged_bits_and_grow_to_the_update(simulated_gpu):
    rng = np.random.default_rng(0)
    ring, live0 = HostRing(0), _Mapped.live
    small = [_Leaf(rng, n, k, u)
             for n, k, u in ((100, "float32", True), (37, "bfloat16", False), (5, "float32", False))]
    _run(ring, small, 0)
    assert (ring.elems, len(ring.bufs)) == (112, 3) and ring.nbytes == _hostring.host_ring_bytes([100, 37, 5])
    # larger leaves (pieces of 256, buffers reused), more of them: the ring grows, its buffers replaced
    big = [_Leaf(rng, n, k, u) for n, k, u in ((1000, "float32", True), (777, "float32", False), (3, "float32", True),
                                               (600, "bfloat16", True), (0, "float32", False))]
    for t in range(2):
        _run(ring, big, t)
    assert (ring.elems, len(ring.bufs)) == (256, 3)
    assert ring.nbytes == _hostring.host_ring_bytes([lf.numel for lf in big])
    assert _Mapped.live - live0 == ring.nbytes
    _run(ring, small, 2)  # a smaller update takes what is there
    assert ring.nbytes == _hostring.host_ring_bytes([lf.numel for lf in big])
    ring.close()
    assert _Mapped.live == live0 and ring.nbytes == 0


def test_ring_raises_a_worker_failure_and_stays_usable(simulated_gpu, monkeypatch):
    rng = np.random.default_rng(1)
    ring = HostRing(0)
    leaves = [_Leaf(rng, n, "float32", False) for n in (900, 700, 300)]  # 9 pieces through 3 buffers
    calls, real = [0], K.adamw_chunk

    def fails_once(*args):
        calls[0] += 1
        if calls[0] == 4:
            raise FloatingPointError("simulated kernel failure")
        return real(*args)

    monkeypatch.setattr(K, "adamw_chunk", fails_once)
    ups = len([c for c in _Context.copies if c[0] == "h2d"])
    with pytest.raises(WorkerError, match="simulated kernel failure"):
        ring.update(host_engine(2, 5), [lf.staged() for lf in leaves], _scalars(3, 0).ctypes.data, 0)
    assert len([c for c in _Context.copies if c[0] == "h2d"]) - ups == 8  # every piece but the failed one went up
    assert all(sem.acquire(blocking=False) for sem in ring.free)  # no buffer left held
    for sem in ring.free:
        sem.release()
    monkeypatch.setattr(K, "adamw_chunk", real)
    _run(ring, [_Leaf(rng, n, "float32", True) for n in (900, 5)], 1)
    ring.close()


def _gpt_shapes(layers, d, vocab):
    """A decoder's parameter shapes (fp32): embeddings, per block attention, MLP and norms (scanned: stacked)."""
    return {"embed": (vocab, d), "qkv": (layers, d, 3 * d), "proj": (layers, d, d), "up": (layers, d, 4 * d),
            "down": (layers, 4 * d, d), "norms": (layers, 2, d), "final_norm": (d,), "head": (d, vocab)}


def test_plan_of_a_7b_model_is_its_state_and_a_constant(simulated_gpu, monkeypatch):
    """host_memory_plan on shapes alone: mode="cpu" holds the state and the ring (before: 12 more bytes per parameter
    of staging, 82 GB here), mode="gpu" the state."""
    for k, value in GEOMETRY.items():
        monkeypatch.setattr(_hostring, k, value)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in _gpt_shapes(32, 4096, 50304).items()}
    n = sum(math.prod(s.shape) for s in params.values())
    assert 6.8e9 < n < 7.0e9
    for mode in ("cpu", "gpu"):
        plan = tsj.offload_adamw(1e-3, mode=mode).host_memory_plan(params)
        assert plan["state_pinned"] == 8 * n and plan["masters_pinned"] == 0
        ring = plan["staging_pinned"]
        if mode == "cpu":
            elems, depth = _hostring.HOST_RING_ELEMS, _hostring.HOST_RING_DEPTH
            assert ring == depth * 12 * elems + 4 * C.N_SCALARS * len(params) < 0.41e9
        else:
            assert ring == 0
        assert plan["needed"] == 8 * n + ring and plan["needed"] / n < 8.06
