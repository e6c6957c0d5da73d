"""Updates over buffers the caller owns (trainstream.core._external), through an engine made
without a framework backend (the JAX adapter's): on the host workers the contract's bits, on
the device placement the launches grouped by kind with the items' pointers (launcher
simulated: no CuPy, no GPU); what such an engine refuses."""

from __future__ import annotations

import numpy as np
import pytest

from trainstream import _device_kernels as dk
from trainstream import contract as C
from trainstream.core import DeviceUpdate, Engine, ExternalUpdate
from trainstream.core import _external

HP = C.AdamWHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.05)


def _bits(a):
    return np.asarray(a).view(np.uint32)


def test_host_updates_of_caller_buffers_are_the_contract_and_nothing_else_is_taken():
    rng = np.random.default_rng(0)
    eng = Engine(None, mode="cpu", threads=2, convention="optax", chunk_size=4096)
    try:
        sizes = (5000, 3, 9000)
        p = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        m = [np.zeros(n, np.float32) for n in sizes]
        v = [np.zeros(n, np.float32) for n in sizes]
        want = [(a.copy(), b.copy(), c.copy()) for a, b, c in zip(p, m, v)]
        finished = []
        for step in (1, 2):
            s = C.step_scalars(HP, step, "optax", "cuda")
            g = [rng.standard_normal(n).astype(np.float32) for n in sizes]
            eng.update_external([ExternalUpdate(p[k], m[k], v[k], g[k], "float32", None, None, s,
                                                finished=lambda k=k: finished.append(k)) for k in range(3)], "cuda")
            want = [C.reference_update(*w, gk, s, "optax", "cuda") for w, gk in zip(want, g)]
        for k in range(3):
            for got, ref in zip((p[k], m[k], v[k]), want[k]):
                assert np.array_equal(_bits(got), _bits(ref))
        assert sorted(finished) == [0, 0, 1, 1, 2, 2]
        with pytest.raises(RuntimeError, match="no framework backend.*holds no parameters"):
            eng.add_param(None, 4, "float32", "cpu")
        with pytest.raises(RuntimeError, match="launch_external runs on the device placement, and this engine has none"):
            eng.launch_external([], 0)
        with pytest.raises(ValueError, match="item 0: v has 2 elements, m has 3"):
            eng.update_external([ExternalUpdate(p[1], m[1], v[1][:2], p[1], "float32", None, None, s)], "cuda")
    finally:
        eng.close()


def _item(k, dtype="float32", u=0, master=None, numel=10):
    base = 1 << 20 + k
    if master is None:
        master = 0 if dtype == "float32" else base + 0x400
    return DeviceUpdate(base, base + 0x100, base + 0x200, base + 0x300, master, u, numel, dtype, dtype, base + 0x500)


def test_device_items_group_by_kind_in_first_seen_order():
    items = [_item(0, "bfloat16"), _item(1), _item(2, u=1 << 30), _item(3, "bfloat16"), _item(4)]
    groups = _external.device_groups(items)
    assert list(groups) == [("w", "bfloat16", "bfloat16", None), ("w", "float32", "float32", None),
                            ("u", "float32", "float32", None)]
    assert [len(g) for g in groups.values()] == [2, 2, 1]
    (state, n, item, wait), = groups[("u", "float32", "float32", None)]
    assert state == ((items[2].m, 4), (items[2].v, 4)) and n == 10 and wait is None
    # elements 4.. of the item at staged addresses d: u and the pointers advanced by 4 elements
    d = (7000, 8000)
    assert item(4, 6, d) == (items[2].weights + 16, items[2].grad + 16, (1 << 30) + 16, 7000, 8000, 6,
                             items[2].scalars)
    (state, _, item, _) = groups[("w", "bfloat16", "bfloat16", None)][0]
    assert state == ((items[0].m, 4), (items[0].v, 4), (items[0].master, 4))
    assert item(2, 8, (1, 2, 3)) == (items[0].weights + 4, items[0].grad + 4, 3, 1, 2, 8, items[0].scalars)
    with pytest.raises(TypeError, match="item 0 has dtypes float64"):
        _external.device_groups([_item(0)._replace(dtype="float64")])
    with pytest.raises(ValueError, match="item 1: bfloat16 weights with float32/float32 state take a master and no u"):
        _external.device_groups([_item(0), _item(1, "bfloat16", master=0)])
    with pytest.raises(ValueError, match="item 0: float32 weights with float32/float32 state take no master"):
        _external.device_groups([_item(0, master=64)])


def test_device_items_with_optax_own_state():
    """optax's own state (bf16 leaves' in bf16, mu_dtype): no master, the state's bytes per element to the ring, u
    in optax's update dtype (the weights' with 16-bit state, float32 with a float32 mu)."""
    half = _item(0, "bfloat16", master=0)._replace(mdtype="bfloat16", vdtype="bfloat16")
    half_u = half._replace(u=1 << 30)
    mu32_u = _item(1, "bfloat16", master=0, u=1 << 31)._replace(mdtype="float32", vdtype="bfloat16")
    mu16 = _item(2)._replace(mdtype="bfloat16")
    groups = _external.device_groups([half, half_u, mu32_u, mu16])
    assert list(groups) == [("w", "bfloat16", "bfloat16", ("bfloat16", "bfloat16")),
                            ("u", "bfloat16", "bfloat16", ("bfloat16", "bfloat16")),
                            ("u", "bfloat16", "bfloat16", ("float32", "bfloat16")),
                            ("w", "float32", "float32", ("bfloat16", "float32"))]
    (state, _, item, _), = groups[("u", "bfloat16", "bfloat16", ("bfloat16", "bfloat16"))]
    assert state == ((half.m, 2), (half.v, 2)) and item(4, 6, (1, 2))[2] == (1 << 30) + 8  # u: 2 bytes each
    (state, _, item, _), = groups[("u", "bfloat16", "bfloat16", ("float32", "bfloat16"))]
    assert state == ((mu32_u.m, 4), (mu32_u.v, 2)) and item(4, 6, (1, 2))[2] == (1 << 31) + 16  # u: float32
    with pytest.raises(ValueError, match="bfloat16 weights with bfloat16/bfloat16 state take no master"):
        _external.device_groups([half._replace(master=64)])


def test_device_placement_launches_caller_items_zero_copy(monkeypatch):
    """Without its ring (zero-copy) the items of one kind go in launches of up to MULTI_MAX,
    on the caller's stream, the state at the items' own addresses."""
    launches = []

    def multi(variant, pd, gd, items, stream=0, *, device=None, state=None):
        assert state is None
        launches.append(("w", variant, pd, gd, list(items), stream, device))

    def u_multi(variant, gd, items, stream=0, *, device=None, param_dtype="float32", state=None):
        assert state is None and param_dtype == "float32"
        launches.append(("u", variant, gd, list(items), stream, device))

    monkeypatch.setattr(dk, "compile_kernels", lambda device=None: {})
    monkeypatch.setattr(dk, "multiprocessor_count", lambda device=None: 132)
    monkeypatch.setattr(dk, "launch_adamw_multi", multi)
    monkeypatch.setattr(dk, "launch_adamw_u_multi", u_multi)
    monkeypatch.setattr(dk, "MULTI_MAX", 2)
    eng = Engine(None, mode="gpu", convention="optax", device_index=3)
    eng.device.staged = False  # zero-copy: the ring has its own tests (test_device_launches.py)
    items = [_item(k) for k in range(3)] + [_item(3, u=1 << 30)]
    eng.launch_external(items, 77)
    w = [x for x in launches if x[0] == "w"]
    assert [len(x[4]) for x in w] == [2, 1] and {(x[1], x[2], x[3], x[5], x[6]) for x in w} == \
        {(C.VARIANT_OPTAX_CUDA, "float32", "float32", 77, 3)}
    assert w[0][4][1] == (items[1].weights, items[1].grad, 0, items[1].m, items[1].v, 10, items[1].scalars)
    (u,) = [x for x in launches if x[0] == "u"]
    assert u[1:3] == (C.VARIANT_OPTAX_CUDA, "float32") and u[3] == [
        (items[3].weights, items[3].grad, 1 << 30, items[3].m, items[3].v, 10, items[3].scalars)]
    with pytest.raises(RuntimeError, match="no framework backend.*holds no parameters"):
        eng.add_param(None, 4, "float32", "cuda")
    with pytest.raises(RuntimeError, match="update_external runs on the host placement, and this engine has none"):
        eng.update_external([], "cuda")
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.launch_external(items, 77)
