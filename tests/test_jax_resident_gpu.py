"""offload_adamw(gpu_state_bytes=...) on a CUDA GPU: the leaves whose state fits keep it in GPU memory (not
pinned_host) and have optax.adamw's bits jitted on the GPU; the others' state stays in pinned host memory, with the
bits of the host path over those leaves alone (mode="gpu": optax's too). One state, donated, step and update; bf16
leaves with optax's bf16 state or an fp32 master; "auto" from the device's memory statistics.

    python -m pytest -q -p no:cacheprovider tests/test_jax_resident_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import trainstream.jax as tsj  # noqa: E402

pytestmark = pytest.mark.gpu


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU")


# b and e: the same shape and dtype, b's state in GPU memory and e's in host memory (donation pairs by both)
SHAPES = {"a": (37, 19), "b": (256, 64), "c": (10007,), "d": (4,), "e": (256, 64)}
BUDGET = 8 * (37 * 19 + 256 * 64)  # fp32 state: a and b; c, d, e in host memory
RESIDENT, HOST = ("a", "b"), ("c", "d", "e")
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, 50, 1e-4)


def _mask(params):
    return {k: k != "d" for k in params}


def _params(dev, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {k: jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32), dtype), dev)
            for k, s in SHAPES.items()}


def _grads(params, n, dev):
    rng = np.random.default_rng(1)
    return [{k: jax.device_put(jnp.asarray(rng.standard_normal(p.shape).astype(np.float32) * 0.1, p.dtype), dev)
             for k, p in params.items()} for _ in range(n)]


def _bits(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.itemsize])


def _same(got, want, what):
    for k in want:
        bad = int((_bits(got[k]) != _bits(want[k])).sum())
        assert bad == 0, f"{what} {k}: {bad} of {np.size(want[k])} elements differ"


def _run(tx, params, gs, via="update"):
    """Jitted steps, params and state donated (in and out in the same order): ``(params, state)``."""
    def body(p, s, g):
        if via == "step":
            return tx.step(g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(body, donate_argnums=(0, 1))
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    for g in gs:
        p, s = step(p, s, {k: g[k] for k in p})
    return jax.block_until_ready((p, s))


def _sub(tree, keys):
    return {k: tree[k] for k in keys}


def _kinds(s, keys):
    return {x.sharding.memory_kind for k in keys for x in (s.mu[k], s.nu[k])}


@pytest.mark.parametrize("via", ["step", "update"])
@pytest.mark.parametrize("mode", ["gpu", "cpu"], ids=["mode_gpu", "mode_cpu"])
def test_resident_state_in_gpu_memory_with_optax_bits(mode, via):
    dev = _gpu()
    params, kw = _params(dev), dict(weight_decay=1e-2, mask=_mask)
    gs = _grads(params, 6, dev)
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=BUDGET, mode=mode, **kw)
    plan = tx.host_memory_plan(params)
    assert plan["gpu_state_leaves"] == 2 and plan["gpu_state_bytes"] == BUDGET
    p, s = _run(tx, params, gs, via)
    assert _kinds(s, RESIDENT) == {"device"} and _kinds(s, HOST) == {"pinned_host"}
    ref_p, ref_s = _run(optax.adamw(SCHEDULE, **kw), params, gs)
    adam = optax.tree_utils.tree_get(ref_s, "ScaleByAdamState")
    what = f"{mode} {via}"
    _same(_sub(p, RESIDENT), _sub(ref_p, RESIDENT), what + " resident weights")
    _same(_sub(s.mu, RESIDENT), _sub(adam.mu, RESIDENT), what + " resident mu")
    _same(_sub(s.nu, RESIDENT), _sub(adam.nu, RESIDENT), what + " resident nu")
    host_p, host_s = _run(tsj.offload_adamw(SCHEDULE, mode=mode, **kw), _sub(params, HOST), gs, via)
    _same(_sub(p, HOST), host_p, what + " host leaves")
    _same(_sub(s.mu, HOST), host_s.mu, what + " host mu")
    if mode == "gpu":  # the whole tree: optax's bits
        _same(p, ref_p, what + " weights")
    assert int(s.count) == len(gs)


def test_bf16_leaves_resident():
    """bf16 leaves: optax's bf16 state in GPU memory (which the host path refuses on a GPU) beside fp32 leaves in
    host memory; with master_weights=True, the fp32 masters in GPU memory too, with the host path's bits."""
    dev = _gpu()
    params = {k: v.astype(jnp.bfloat16) if k in RESIDENT else v for k, v in _params(dev).items()}
    gs = _grads(params, 4, dev)
    kw = dict(weight_decay=1e-2, mask=_mask)
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=BUDGET // 2, mode="gpu", **kw)  # bf16 state: 4 bytes each
    p, s = _run(tx, params, gs)
    assert _kinds(s, RESIDENT) == {"device"} and s.mu["a"].dtype == jnp.bfloat16
    ref_p, _ = _run(optax.adamw(SCHEDULE, **kw), params, gs)
    _same(p, ref_p, "bf16 state")
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=BUDGET * 3 // 2, mode="gpu", master_weights=True, **kw)
    p, s = _run(tx, params, gs, "step")
    assert {s.master[k].sharding.memory_kind for k in RESIDENT} == {"device"} and _kinds(s, RESIDENT) == {"device"}
    ref_p, ref_s = _run(tsj.offload_adamw(SCHEDULE, mode="gpu", master_weights=True, **kw), params, gs, "step")
    _same(p, ref_p, "master weights")
    _same(_sub(s.master, RESIDENT), _sub(ref_s.master, RESIDENT), "fp32 masters")
    _same(s.mu, ref_s.mu, "master mu")


def test_auto_takes_the_free_gpu_memory():
    """"auto": this small model's state all fits: optax.adamw itself, all of it in GPU memory."""
    dev = _gpu()
    params, kw = _params(dev), dict(weight_decay=1e-2, mask=_mask)
    stats = dev.memory_stats()
    assert stats and stats["bytes_limit"] > 0
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes="auto", **kw)
    assert tx.host_memory_plan(params)["gpu_state_leaves"] == len(SHAPES)
    p, s = _run(tx, params, _grads(params, 3, dev))
    assert _kinds(s, SHAPES) == {"device"}
    _same(p, _run(optax.adamw(SCHEDULE, **kw), params, _grads(params, 3, dev))[0], "auto")
