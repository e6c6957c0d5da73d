"""offload_adamw(gpu_state_bytes=...) on XLA:CPU: the leaves whose state fits the budget are updated by optax.adamw's
own transformation (state in device memory), the others through the host callback; the state is one pytree. Each
split is checked bit for bit against optax.adamw on the whole tree, jitted, and which leaves went through the host
callback is observed (on the CPU device memory is host memory: the GPU test is tests/test_jax_resident_gpu.py)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import trainstream.jax as tsj  # noqa: E402
from trainstream.jax import _plan, _resident  # noqa: E402

from _jax_helpers import BF16, F32, MODELS, SCHEDULE, _copy, assert_tree_bits, decay_mask  # noqa: E402

if jax.default_backend() != "cpu":  # pragma: no cover - the CI runs JAX on the CPU
    pytest.skip("these tests run JAX on the CPU backend", allow_module_level=True)

init, loss, batch = MODELS["mlp"]
PARAMS = init(np.random.default_rng(3))
# the MLP's leaves in tree order: dense0 bias (48), kernel (12x48), dense1 bias (32), kernel (48x32), dense2 bias (5),
# kernel (32x5), scale (1); fp32 state 8 bytes per element. 2,000 bytes: first fit keeps all but the two large kernels
BUDGET = 2000
HOST_NUMELS = (12 * 48, 48 * 32)
KW = dict(weight_decay=0.05, mask=decay_mask)


@pytest.fixture
def host_leaves(monkeypatch):
    """The element counts of the leaves each traced update hands to the host callback."""
    seen, real = [], _plan.plan_for

    def spy(cfg, kinds, numels, *a, **k):
        seen.append(tuple(numels))
        return real(cfg, kinds, numels, *a, **k)

    monkeypatch.setattr(_plan, "plan_for", spy)
    return seen


_GRAD = jax.jit(jax.grad(loss))


def _train(opt, steps, params=PARAMS, moments=False, apart=False):
    """``steps`` jitted steps of update + apply_updates, the gradient in the same jit (``apart``: in a jit of its own,
    materialised): the weights after each (with ``moments``: and ``(mu, nu)``)."""
    @jax.jit
    def step(p, s, b):
        u, s = opt.update(b if apart else jax.grad(loss)(p, b), s, p)
        return optax.apply_updates(p, u), s

    p, s, rng, out = _copy(params), opt.init(params), np.random.default_rng(4), []
    for _ in range(steps):
        b = batch(rng)
        p, s = step(p, s, _GRAD(p, b) if apart else b)
        out.append((p, (optax.tree_utils.tree_get(s, "mu"), optax.tree_utils.tree_get(s, "nu"))) if moments else p)
    return out, s


def _same(ours, ref, what):
    for t, (a, b) in enumerate(zip(ours, ref)):
        assert_tree_bits(a, b, f"{what} step {t + 1}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_matches_optax_adamw(dtype, host_leaves):
    """A schedule, a decay mask: the resident leaves by optax, the two kernels by the host, weights and moments bit for
    bit; the state one OffloadAdamWState; host_memory_plan counts the split."""
    params = jax.tree.map(lambda x: x.astype(dtype), PARAMS)
    budget = BUDGET if dtype == "float32" else BUDGET // 2  # bf16 state: 4 bytes per element
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=budget, **KW)
    apart = dtype != "float32"  # (bf16: the gradient materialised, no FMA pairing to read: a shorter test)
    ours, s = _train(tx, 3, params, moments=True, apart=apart)
    ref, _ = _train(optax.adamw(SCHEDULE, **KW), 3, params, moments=True, apart=apart)
    _same(ours, ref, f"split {dtype}")
    assert host_leaves == [HOST_NUMELS]  # one trace, the two kernels through the host callback
    assert isinstance(s, tsj.OffloadAdamWState) and int(s.count) == 3
    assert all(x.dtype == dtype for x in jax.tree.leaves((s.mu, s.nu)))
    plan = tx.host_memory_plan(params)
    item = 4 if dtype == "float32" else 2
    assert plan["gpu_state_leaves"] == 5
    assert plan["gpu_state_bytes"] == 2 * item * (48 + 32 + 5 + 32 * 5 + 1)
    # on the CPU device memory is host memory: the plan counts all the state
    assert plan["needed"] == tsj.offload_adamw(SCHEDULE, **KW).host_memory_plan(params)["needed"]


def test_no_budget_and_a_budget_over_all_state(host_leaves):
    """None or 0: the host path itself (no split); a budget over all the state: optax.adamw itself, no callback."""
    for b in (None, 0):
        assert type(tsj.offload_adamw(1e-3, gpu_state_bytes=b).init.__self__).__name__ == "_Impl"
    tx = tsj.offload_adamw(1e-3, gpu_state_bytes=10**9, **KW)
    ours, s = _train(tx, 2, moments=True)
    _same(ours, _train(optax.adamw(1e-3, **KW), 2, moments=True)[0], "all resident")
    assert host_leaves == [] and tx.host_memory_plan(PARAMS)["gpu_state_leaves"] == 7
    assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(s))


def test_step_donated_clipped_and_eager(host_leaves):
    """step() jitted with the params and state donated and max_grad_norm=1 (the norm over the whole tree, XLA's
    M == 1 case): chain(clip_by_global_norm, adamw)'s bits; update outside jit: the jitted update's."""
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=BUDGET, max_grad_norm=1.0, **KW)
    want, _ = _train(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE, **KW)), 3)
    step = jax.jit(lambda p, s, b: tx.step(jax.grad(loss)(p, b), s, p), donate_argnums=(0, 1))
    p, s, rng = _copy(PARAMS), tx.init(PARAMS), np.random.default_rng(4)
    for t in range(3):
        p, s = step(p, s, batch(rng))
        assert_tree_bits(p, want[t], f"step donated {t + 1}")
    g = jax.jit(jax.grad(loss))(p, batch(rng))
    assert_tree_bits(tx.update(g, s, p), jax.jit(tx.update)(g, s, p), "eager update")
    assert all(h == HOST_NUMELS for h in host_leaves)


@pytest.mark.parametrize("wrap", ["multisteps_inject", "masked_adam"])
def test_compositions(wrap, host_leaves):
    """optax's wrappers take the split state as optax.adamw's, bit for bit: MultiSteps around inject_hyperparams
    (gpu_state_bytes in static_args; the gradients' running mean fused into optax's moment lines), and masked around
    offload_adam (the update sees the three matrices: the host path is told the tree it is part of)."""
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    if wrap == "multisteps_inject":
        def make(f, **k):
            inj = optax.inject_hyperparams(f, static_args=("gpu_state_bytes",) if k else ())
            return optax.MultiSteps(inj(learning_rate=SCHEDULE, b1=0.85, weight_decay=0.05, **k), 2)
    else:
        def make(f, **k):
            return optax.masked((tsj.offload_adam if k else optax.adam)(1e-3, b2=0.98, **k), mask)
    budget = BUDGET if wrap == "multisteps_inject" else 8 * (12 * 48 + 32 * 5)  # masked: dense0's and dense2's kernels
    ours, _ = _train(make(tsj.offload_adamw, gpu_state_bytes=budget), 4)
    _same(ours, _train(make(optax.adamw), 4)[0], wrap)
    assert host_leaves and all(h == (HOST_NUMELS if wrap == "multisteps_inject" else (48 * 32,)) for h in host_leaves)


def test_nnx_optimizer():
    """flax's nnx.Optimizer over the split state."""
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(12, 32, rngs=rngs)
            self.l2 = nnx.Linear(32, 5, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.gelu(self.l1(x)))

    def train(tx):
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x, y):
            opt.update(model, nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))

        rng = np.random.default_rng(1)
        for _ in range(3):
            x, y = rng.standard_normal((16, 12)), rng.standard_normal((16, 5))
            step(model, opt, jnp.asarray(x, F32), jnp.asarray(y, F32))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param)), opt

    want, _ = train(optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask))
    got, opt = train(tsj.offload_adamw(1e-2, weight_decay=0.1, mask=decay_mask, gpu_state_bytes=8 * (32 + 5 + 32 * 5)))
    assert_tree_bits(got, want, "nnx.Optimizer")
    assert int(opt.opt_state.count[...]) == 3


def test_master_weights_resident_equals_host():
    """bf16 leaves with master_weights=True and max_grad_norm: a resident leaf's fp32 master and moments are
    optax.adamw's on the master fed the upcast gradients, materialised, as the host path's (itself tested against
    that reference)."""
    params = jax.tree.map(lambda x: x.astype(BF16) if x.ndim > 1 else x, PARAMS)
    kw = dict(KW, master_weights=True, max_grad_norm=0.5)
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=12 * 12 * 48 + 8 * (48 + 32), **kw)
    assert tx.host_memory_plan(params)["gpu_state_leaves"] == 3  # dense0's kernel (bf16, a master) and two biases
    ours, s = _train(tx, 3, params, moments=True, apart=True)  # (the upcast still in the program: materialised)
    ref, s_ref = _train(tsj.offload_adamw(SCHEDULE, **kw), 3, params, moments=True, apart=True)
    _same(ours, ref, "master_weights resident")
    assert_tree_bits(s.master, s_ref.master, "fp32 masters")
    assert s.master["dense0"]["kernel"].dtype == F32 and s.master["dense0"]["bias"] is None


def test_checkpoints_of_the_split_state(tmp_path):
    """state_dict / load_state_dict and orbax take the split state and resume bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=BUDGET, **KW)
    step = jax.jit(lambda p, s, b: tx.step(jax.grad(loss)(p, b), s, p))
    rng = np.random.default_rng(5)
    bs = [batch(rng) for _ in range(5)]
    p, s = _copy(PARAMS), tx.init(PARAMS)
    for b in bs[:3]:
        p, s = step(p, s, b)
    sd, ck = tsj.state_dict(s, p), ocp.StandardCheckpointer()
    ck.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
    ck.wait_until_finished()
    p1, s1 = p, s
    for b in bs[3:]:
        p1, s1 = step(p1, s1, b)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": PARAMS, "opt_state": tx.init(PARAMS)})
    r = ck.restore(tmp_path / "ckpt", abstract)
    tx2 = tsj.offload_adamw(SCHEDULE, gpu_state_bytes=BUDGET, **KW)  # a fresh transformation: its own split
    step2 = jax.jit(lambda p, s, b: tx2.step(jax.grad(loss)(p, b), s, p))
    for p2, s2 in ((r["params"], r["opt_state"]), (_copy(p), tx2.load_state_dict(tx2.init(PARAMS), sd))):
        for b in bs[3:]:
            p2, s2 = step2(p2, s2, b)
        assert_tree_bits(p2, p1, "resumed weights")
        assert_tree_bits(s2, s1, "resumed state")


def test_bad_budgets():
    """Messages as the torch adapter's; "auto" needs a device that reports its memory; a traced budget
    (inject_hyperparams without static_args) raises at the update's trace."""
    for bad in (-1, 1.5, True, "all", [1]):
        with pytest.raises(ValueError, match=r"Invalid gpu_state_bytes: .* \(must be an int >= 0, in bytes, or 'auto'"):
            tsj.offload_adamw(1e-3, gpu_state_bytes=bad)
    with pytest.raises(ValueError, match="Invalid gpu_state_bytes"):
        tsj.offload_adam(1e-3, gpu_state_bytes=-5)
    assert _resident.check_budget(np.int64(7)) == 7 and _resident.check_budget(jnp.asarray(7)) == 7
    tx = tsj.offload_adamw(1e-3, gpu_state_bytes="auto")
    for call in (tx.init, tx.host_memory_plan):
        with pytest.raises(NotImplementedError, match=r"'auto' .*memory_stats\(\).*platform cpu.*number of bytes"):
            call(PARAMS)
    opt = optax.inject_hyperparams(tsj.offload_adamw)(learning_rate=1e-3, gpu_state_bytes=BUDGET)
    s = opt.init(PARAMS)  # a concrete array here
    with pytest.raises(ValueError, match="gpu_state_bytes is traced.*static_args"):
        jax.jit(opt.update)(PARAMS, s, PARAMS)
    with pytest.raises(RuntimeError, match="mode='gpu'.*needs a CUDA GPU"):
        tsj.offload_adamw(1e-3, mode="gpu", gpu_state_bytes=10**9).init(PARAMS)
    tx = tsj.offload_adamw(1e-3, gpu_state_bytes=10**9)
    s = tx.init(PARAMS)
    with pytest.raises(NotImplementedError, match="jax.vmap"):
        jax.vmap(lambda g: tx.update(g, s, PARAMS))(jax.tree.map(lambda x: x[None], PARAMS))


def test_resident_rule():
    """First fit in tree order over the state bytes per device (optax's dtypes, a master's 4 bytes)."""
    assert _resident.resident([10, 50, 20, 5], 40) == [True, False, True, True]
    assert _resident.resident([10, 50], 0) == [False, False]
    fam = tsj._config.Family
    assert _resident.state_bytes(10, fam("float32", "float32", False)) == 80
    assert _resident.state_bytes(10, fam("bfloat16", "bfloat16", False)) == 40
    assert _resident.state_bytes(10, fam("float32", "float32", True)) == 120


def test_auto_budget():
    """"auto": the least over the leaves' devices of bytes_limit less the peak in use, less a tenth of bytes_limit."""
    class Dev:
        platform = "gpu"

        def __init__(self, i, peak):
            self.id, self.peak = i, peak

        def memory_stats(self):
            return {"bytes_limit": 1000, "bytes_in_use": 100, "peak_bytes_in_use": self.peak}

    class Leaf:
        def __init__(self, *devs):
            self.sharding = type("S", (), {"addressable_devices": devs})()

    assert _resident.auto_budget([Leaf(Dev(0, 300))]) == 1000 - 300 - 100
    assert _resident.auto_budget([Leaf(Dev(0, 300), Dev(1, 850))]) == 1000 - 850 - 100
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(NotImplementedError, match="'auto' over several processes"):
            _resident.auto_budget([Leaf(Dev(0, 300))])


# -- the GPU path, its CUDA calls simulated on XLA:CPU (tests/_jax_gpu_sim.py) ------------------------------------


@pytest.mark.parametrize("mode", ["gpu", "cpu"], ids=["mode_gpu", "mode_cpu"])  # (an id "gpu" is the GPU marker's)
def test_gpu_path_simulated(monkeypatch, mode):
    """On a GPU the resident leaves' state is in device memory and the others' in pinned host memory, in one state;
    update reads the split from it. Resident leaves (bf16 ones with optax's bf16 state too, which the host path
    refuses on a GPU) are optax.adamw's; the others those of the host path over them alone; step and update,
    donated; a state whose placement differs from init's raises."""
    from _jax_gpu_sim import simulate_gpu

    sim = simulate_gpu(monkeypatch)
    next(sim)
    rng = np.random.default_rng(0)
    shapes = {"a": ((37, 19), F32), "b": ((64, 16), F32), "c": ((1001,), F32), "d": ((4,), BF16), "e": ((3, 5), BF16)}
    params = {k: jnp.asarray(rng.standard_normal(s), d) for k, (s, d) in shapes.items()}
    gs = [{k: jnp.asarray(rng.standard_normal(p.shape) * 0.1, p.dtype) for k, p in params.items()} for _ in range(2)]
    kw = dict(weight_decay=0.05, mask=lambda p: {k: k != "d" for k in p})
    # a: 703 * 8 bytes; b and c do not fit after it; d and e: bf16 state, 4 bytes per element
    tx = tsj.offload_adamw(1e-2, gpu_state_bytes=703 * 8 + 4 * 19, mode=mode, threads=2, **kw)
    plan = tx.host_memory_plan(params)
    assert plan["gpu_state_leaves"] == 3 and plan["gpu_state_bytes"] == 703 * 8 + 4 * 19
    host_keys, res_keys = ("b", "c"), ("a", "d", "e")
    ref_host = tsj.offload_adamw(1e-2, mode=mode, threads=2, **kw)  # the host path over b and c alone
    ref_opt = optax.adamw(1e-2, **kw)

    def run(opt, p, via):
        def body(p, s, g):
            if via == "step":
                return opt.step(g, s, p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        step, p, s = jax.jit(body, donate_argnums=(0, 1)), _copy(p), opt.init(p)
        for g in gs:
            p, s = step(p, s, {k: g[k] for k in p})
        return p, s

    sub = lambda t, keys: {k: t[k] for k in keys}  # noqa: E731
    want_res = run(ref_opt, params, "update")
    for via in ("step", "update"):
        want_host = run(ref_host, sub(params, host_keys), via)
        p, s = run(tx, params, via)
        kinds = {k: (s.mu[k].sharding.memory_kind, s.nu[k].sharding.memory_kind) for k in params}
        assert kinds == {k: ("pinned_host",) * 2 if k in host_keys else ("device",) * 2 for k in params}, kinds
        assert_tree_bits(sub(p, host_keys), want_host[0], f"{mode} {via} host leaves")
        assert_tree_bits(sub(s.mu, host_keys), want_host[1].mu, f"{mode} {via} host mu")
        assert_tree_bits(sub(p, res_keys), sub(want_res[0], res_keys), f"{mode} {via} resident leaves")
        assert_tree_bits(sub(s.nu, res_keys), sub(optax.tree_utils.tree_get(want_res[1], "nu"), res_keys), "nu")
    assert_tree_bits(tx.update(gs[0], s, p), jax.jit(tx.update)(gs[0], s, p), f"{mode} eager update")
    moved = s._replace(mu=dict(s.mu, a=jax.device_put(s.mu["a"], jax.memory.Space.Host)))
    with pytest.raises(ValueError, match=r"mu of leaf \['a'\] is in host memory, its nu is not"):
        jax.jit(tx.update)(gs[0], moved, p)
    next(sim, None)
