"""offload_adamw composed as optax's adamw is: optax wrappers, flax nnx, orbax, and the
program's own conditions (params passed in, x64, pmap, vmap, no growth), each bit for bit
against the same program around optax.adamw on XLA:CPU."""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import trainstream.jax as tsj  # noqa: E402

from _jax_helpers import (  # noqa: E402
    MODELS,
    SCHEDULE,
    _copy,
    assert_tree_bits,
    decay_mask,
)

if jax.default_backend() != "cpu":  # pragma: no cover - the CI runs JAX on the CPU
    pytest.skip("these tests run JAX on the CPU backend", allow_module_level=True)


def _moments(state):
    """The adamw state's ``(mu, nu)`` within a composition's state (ours or optax's)."""
    return optax.tree_utils.tree_get(state, "mu"), optax.tree_utils.tree_get(state, "nu")


def _train(opt, model, steps, seed=4, params=None, edit=None, moments=False):
    """``steps`` jitted steps of update + apply_updates, the gradient computed in the same jit (as users write it);
    the weights after each step (with ``moments``: ``(weights, (mu, nu))``)."""
    init, loss, batch = MODELS[model]
    params = init(np.random.default_rng(3)) if params is None else params

    @jax.jit
    def step(p, s, b):
        g = jax.grad(loss)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = _copy(params), opt.init(params)
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        if edit is not None:
            p = edit(t, p)
        p, s = step(p, s, batch(rng))
        out.append((p, _moments(s)) if moments else p)
    return out, s


def _same(ours, ref, what):
    for t, (a, b) in enumerate(zip(ours, ref)):
        assert_tree_bits(a, b, f"{what} step {t + 1}")


KW = dict(weight_decay=0.05)


# The forced-ISA reruns (tests/test_portability.py) take the MLP's variants only: CI time.
_BOTH = [pytest.param("mlp", marks=pytest.mark.isa), "transformer"]


@pytest.mark.parametrize("model, max_norm", [pytest.param("mlp", 1.0, marks=pytest.mark.isa), ("mlp", 0.05),
                                             ("transformer", 0.05)])
def test_chain_clip_by_global_norm(model, max_norm):
    """chain(clip_by_global_norm(M), ours) == chain(clip_by_global_norm(M), optax.adamw), weights and moments, with
    no argument: XLA:CPU copies the clip's select into optax's moment loops (another FMA pairing), read at trace
    time (trainstream.jax._detect)."""
    ref = optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(1e-3, **KW))
    ours = optax.chain(optax.clip_by_global_norm(max_norm), tsj.offload_adamw(1e-3, **KW))
    _same(_train(ours, model, 12, moments=True)[0], _train(ref, model, 12, moments=True)[0], f"chain clip {model}")


def test_gradients_used_after_the_update():
    """The gradients' norm logged after the update in the same jit (a consumer the trace has not reached when the
    pairing is read): XLA still fuses optax's update as without it, bit for bit."""
    init, loss, batch = MODELS["mlp"]
    params = init(np.random.default_rng(3))

    def run(tx):
        @jax.jit
        def step(p, s, b):
            g = jax.grad(loss)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, optax.tree.norm(g)

        p, s, rng, out = params, tx.init(params), np.random.default_rng(4), []
        for _ in range(6):
            p, s, n = step(p, s, batch(rng))
            out.append((p, _moments(s), n))
        return out

    chain = lambda tx: optax.chain(optax.clip_by_global_norm(0.05), tx)  # noqa: E731
    _same(run(chain(tsj.offload_adamw(1e-3, **KW))), run(chain(optax.adamw(1e-3, **KW))), "norm logged after")


def test_chain_of_element_wise_transformations():
    """chain(zero_nans(), clip(0.01), ours): optax's element-wise transformations before ours, computed through
    nested jits (jnp.where, jnp.clip) that XLA inlines and copies into optax's moment loops."""
    def wrap(tx):
        return optax.chain(optax.zero_nans(), optax.clip(0.01), tx)

    _same(_train(wrap(tsj.offload_adamw(1e-3, **KW)), "mlp", 6, moments=True)[0],
          _train(wrap(optax.adamw(1e-3, **KW)), "mlp", 6, moments=True)[0], "chain zero_nans clip")


@pytest.mark.parametrize("model", _BOTH)
def test_multisteps(model):
    """optax.MultiSteps(ours, 3): the inner update runs at every micro-step (as optax's) and
    its state is kept only when it emits; the running mean of the gradients is fused into
    the reference's moment update (read at trace time, no argument)."""
    ref = optax.MultiSteps(optax.adamw(1e-3, **KW), 3)
    ours = optax.MultiSteps(tsj.offload_adamw(1e-3, **KW), 3)
    a, sa = _train(ours, model, 9, moments=True)
    b, sb = _train(ref, model, 9, moments=True)
    _same(a, b, f"MultiSteps {model}")
    assert int(sa.inner_opt_state.count) == int(sb.inner_opt_state[0].count) == 3


_ELEMENTWISE = {  # optax's test_optimization problems (its alias tests), and a few small leaves: (params, loss)
    "parabola": (jnp.array([-1.0, 10.0, 1.0]), lambda x, b: jnp.sum(jnp.abs(x - jnp.array([1.0, -1.0, 1.0])) ** 2)),
    "rosenbrock": (jnp.array([0.0, 0.0]), lambda x, b: (1.0 - x[0]) ** 2 + 100.0 * (x[1] - x[0] ** 2) ** 2),
    "leaves": ({"v": jnp.array([0.3, -1.2, 2.0, 0.7, -0.1]), "one": jnp.array([1.5]), "s": jnp.array(-0.8)},
               lambda p, b: jnp.sum(3.0 * p["v"] * p["v"]) + jnp.sum(p["one"] ** 3) / 3.0 + 3.0 * p["s"] * p["s"]),
    "cube": (jnp.array([0.3, -1.2, 2.0, 0.7, -0.1]), lambda x, b: jnp.sum(x ** 3)),
}


def _run_elementwise(opt, problem, steps, params=None):
    """``steps`` jitted steps on a problem of _ELEMENTWISE (the gradient in the same jit; ``params``: its own by
    default): ``(weights, (mu, nu))`` after each."""
    params, loss = _ELEMENTWISE[problem] if params is None else (params, _ELEMENTWISE[problem][1])

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(loss)(p, None), s, p)
        return optax.apply_updates(p, u), s

    p, s, out = params, opt.init(params), []
    for _ in range(steps):
        p, s = step(p, s)
        out.append((p, _moments(s)))
    return out


@pytest.mark.parametrize("problem", ["parabola", "rosenbrock", "leaves"])
def test_gradient_elementwise_in_the_params(problem):
    """A gradient element-wise in the parameters (optax's parabola and Rosenbrock, small leaves, a (1,) and a
    scalar leaf), computed in the same jit: XLA:CPU recomputes it inside optax's moment loops; 300 steps of
    weights and moments bit for bit against optax.adamw with no argument."""
    _same(_run_elementwise(tsj.offload_adamw(0.1, weight_decay=1e-4), problem, 300),
          _run_elementwise(optax.adamw(0.1, weight_decay=1e-4), problem, 300), problem)


def test_gradient_from_inside_checkpoint():
    """Float32 weights computed in bf16 inside ``jax.checkpoint`` (nnx.remat, flax's mixed precision): each
    gradient leaves the checkpoint's backward as a bf16 -> float32 conversion, which XLA inlines and fuses into
    optax's moment loops. The probe walks into the checkpoint (JAX's ``remat2``): 4 steps of weights and moments
    bit for bit against optax.adamw, with no warning (before, every step after the first differed silently)."""
    import warnings  # noqa: PLC0415

    rng = np.random.default_rng(5)
    params = {"w1": jnp.asarray(rng.normal(0, 0.3, (64, 128)), jnp.float32),
              "b1": jnp.asarray(rng.normal(0, 0.1, (128,)), jnp.float32),
              "w2": jnp.asarray(rng.normal(0, 0.3, (128, 16)), jnp.float32)}
    x = jnp.asarray(rng.normal(0, 1, (32, 64)), jnp.bfloat16)

    @jax.checkpoint
    def block(p, x):
        bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
        return jnp.tanh(x @ bf["w1"] + bf["b1"]) @ bf["w2"]

    def loss(p):
        return jnp.mean(block(p, x).astype(jnp.float32) ** 2)

    def run(opt):
        @jax.jit
        def step(p, s):
            u, s = opt.update(jax.grad(loss)(p), s, p)
            return optax.apply_updates(p, u), s

        p, s, out = _copy(params), opt.init(params), []
        for _ in range(4):
            p, s = step(p, s)
            out.append((p, _moments(s)))
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = run(tsj.offload_adamw(1e-2, weight_decay=0.05))
    _same(ours, run(optax.adamw(1e-2, weight_decay=0.05)), "checkpoint")


@pytest.mark.parametrize("dtype, kw", [(jnp.bfloat16, {}), (jnp.float16, {}),
                                       (jnp.bfloat16, dict(mu_dtype=jnp.float32)), (jnp.bfloat16, dict(nesterov=True))])
def test_gradient_elementwise_half_state(dtype, kw):
    """optax's fp16/bf16 state (mu_dtype=float32 and nesterov too): the probe reads (or, with no FMA in the lines,
    checks) the pairing of a gradient computed in the same jit; weights and moments bit for bit, alone and under
    MultiSteps, with no warning."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="TrainStream", category=RuntimeWarning)
        for problem, wrap in (("leaves", lambda t: t), ("parabola", lambda t: optax.MultiSteps(t, 2))):
            params = jax.tree.map(lambda x: x.astype(dtype), _ELEMENTWISE[problem][0])
            got, want = (_run_elementwise(wrap(f(0.1, weight_decay=1e-4, **kw)), problem, 30, params)
                         for f in (tsj.offload_adamw, optax.adamw))
            _same(got, want, f"{problem} {jnp.dtype(dtype).name} {kw}")


def test_untrusted_families_are_warned(monkeypatch):
    """The float32 lines of nesterov, eps == 0 and mu_dtype=bfloat16: the probe's pairing is a best guess there
    (a fused gradient changes more than the moments' pairing): one warning naming the bound."""
    from trainstream.jax import _detect
    monkeypatch.setattr(_detect, "_warned", set())
    with pytest.warns(RuntimeWarning, match=f"best guess.*up to {_detect.FUSED_MAX_ULP:g} ULP per step"):
        _run_elementwise(optax.MultiSteps(tsj.offload_adamw(0.1, weight_decay=1e-4, nesterov=True), 2), "parabola", 2)


def test_a_wrong_pairing_fails(monkeypatch):
    """The comparisons above can fail: with the contract's default pairing instead of the one read from XLA (what
    the adapter did before detection), optax's parabola differs from optax.adamw's."""
    from trainstream.jax import _detect
    monkeypatch.setattr(_detect, "fused_codes", lambda codes, *a: list(codes))
    with pytest.raises(AssertionError, match="elements differ"):
        _same(_run_elementwise(tsj.offload_adamw(0.1, weight_decay=1e-4), "parabola", 20),
              _run_elementwise(optax.adamw(0.1, weight_decay=1e-4), "parabola", 20), "wrong pairing")


def test_a_gradient_no_pairing_reproduces_is_warned_once():
    """sum(x ** 3)'s gradient 3 * x ** 2: XLA:CPU folds its constant with the moment line's (a rounding no contract
    line has): the probe finds no pairing, the adapter warns once with the bound it measured, and the weights stay
    within it (a few ULP per step)."""
    with pytest.warns(RuntimeWarning, match=r"matches no FMA pairing.*up to \d ULP per step") as rec:
        got = _run_elementwise(tsj.offload_adamw(0.1, weight_decay=1e-4), "cube", 3)[-1][0]
    assert len([w for w in rec if "TrainStream" in str(w.message)]) == 1
    want = _run_elementwise(optax.adamw(0.1, weight_decay=1e-4), "cube", 3)[-1][0]
    assert np.max(np.abs(np.asarray(got).view(np.int32) - np.asarray(want).view(np.int32))) <= 3 * 3


def test_pairings_never_told_apart_are_warned(monkeypatch):
    """A gradient computed in the jit whose probe inputs never tell the pairings apart (here ``p * 0``: 0 on every
    input; before, a float16 global norm that overflowed on the probe's random inputs) gets one warning naming the
    bound, not a pairing read from nothing (the fuzzer's seed 2007)."""
    from trainstream.jax import _detect
    monkeypatch.setattr(_detect, "_warned", set())
    tx = tsj.offload_adamw(0.1)
    params = {"w": jnp.ones((3, 4)), "b": jnp.ones((5,))}

    @jax.jit
    def step(p, s):
        u, s = tx.update(jax.tree.map(lambda x: x * 0.0, p), s, p)
        return optax.apply_updates(p, u), s

    with pytest.warns(RuntimeWarning, match=f"never told their FMA pairings apart.*up to "
                                            f"{_detect.FUSED_MAX_ULP:g} ULP per step"):
        step(params, tx.init(params))


def test_probe_cached_and_fallback_warned_once(monkeypatch):
    """The pairing probe runs once per program structure and configuration (a second optimizer tracing the same
    step hits the cache); a graph over MAX_EQNS operations is read from the part nearest the gradients, with a
    warning; where the producers cannot be read (another JAX), the default pairing and one warning naming the
    contract's bound."""
    from trainstream.jax import _detect
    before = dict(_detect.stats)
    for _ in range(2):
        _run_elementwise(tsj.offload_adamw(0.1, weight_decay=1e-3), "rosenbrock", 2)
    assert _detect.stats["probes"] - before["probes"] <= 1 and _detect.stats["hits"] > before["hits"]

    monkeypatch.setattr(_detect, "MAX_EQNS", 3)  # a graph larger than that: read from its 3 nearest operations
    with pytest.warns(RuntimeWarning, match="read from the 3 nearest the gradients"):
        _run_elementwise(tsj.offload_adamw(0.1, weight_decay=1e-3), "rosenbrock", 2)

    def unavailable(*a):
        raise _detect.Unavailable("test")

    monkeypatch.setattr(_detect, "_trace_graph", unavailable)
    monkeypatch.setattr(_detect, "_warned", set())
    with pytest.warns(RuntimeWarning, match=f"up to {_detect.FUSED_MAX_ULP:g} ULP per step") as rec:
        _run_elementwise(tsj.offload_adamw(0.1, weight_decay=1e-3), "parabola", 2)
        _run_elementwise(optax.MultiSteps(tsj.offload_adamw(0.1, weight_decay=1e-3), 2), "rosenbrock", 2)
    assert len([w for w in rec if "TrainStream" in str(w.message)]) == 1


@pytest.mark.isa
@pytest.mark.parametrize("model", ["mlp"])
def test_inject_hyperparams(model):
    """inject_hyperparams(ours): learning rate from a schedule and weight decay as float32
    arrays in the state (the scalars are then float32 arithmetic, as in optax)."""
    ref = optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.05, b1=0.85)
    ours = optax.inject_hyperparams(tsj.offload_adamw)(learning_rate=SCHEDULE, weight_decay=0.05, b1=0.85)
    a, sa = _train(ours, model, 12)
    b, sb = _train(ref, model, 12)
    _same(a, b, f"inject_hyperparams {model}")
    np.testing.assert_array_equal(np.asarray(sa.hyperparams["learning_rate"]),
                                  np.asarray(sb.hyperparams["learning_rate"]))


@pytest.mark.isa
@pytest.mark.parametrize("model", ["mlp"])
def test_masked(model):
    """optax.masked(ours, matrices only): the masked-out leaves get their gradient back."""
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    _same(_train(optax.masked(tsj.offload_adamw(1e-3, **KW), mask), model, 10)[0],
          _train(optax.masked(optax.adamw(1e-3, **KW), mask), model, 10)[0], f"masked {model}")


def test_update_and_step_equal_and_honour_the_params_passed_in():
    """Weights replaced between steps (a params tree edited outside the optimizer) are
    the ones updated, as with optax: update, step and the reference agree bit for bit."""
    def edit(t, p):
        return jax.tree.map(lambda x: x * 0.5 if t == 3 else x, p)

    ref, _ = _train(optax.adamw(SCHEDULE, **KW), "mlp", 8, edit=edit)
    tx = tsj.offload_adamw(SCHEDULE, **KW)
    ours, _ = _train(tx, "mlp", 8, edit=edit)
    _same(ours, ref, "update, params edited")
    init, loss, batch = MODELS["mlp"]
    step = jax.jit(lambda p, s, b: tx.step(jax.grad(loss)(p, b), s, p))
    p, s = init(np.random.default_rng(3)), tx.init(init(np.random.default_rng(3)))
    rng = np.random.default_rng(4)
    for t in range(8):
        p, s = step(edit(t, p), s, batch(rng))
        assert_tree_bits(p, ref[t], f"step, params edited, step {t + 1}")


def test_bf16_master_gives_way_to_replaced_weights():
    """fp16/bf16 leaves: where the state's master no longer rounds to the weights passed
    in, the weights are taken (upcast) as the master; elsewhere the master is kept."""
    init, loss, batch = MODELS["mlp"]
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init(np.random.default_rng(3)))
    tx = tsj.offload_adamw(1e-3, **KW, master_weights=True)
    step = jax.jit(lambda p, s, b: tx.step(jax.grad(loss)(p, b), s, p))
    rng = np.random.default_rng(4)
    p, s = step(params, tx.init(params), batch(rng))
    p, s = step(p, s, batch(rng))
    new = jax.tree.map(lambda x: (x * 3).astype(jnp.bfloat16), p)  # replaced weights
    b = batch(rng)
    got, _ = step(new, s, b)
    fresh = tx.init(new)  # their master is the weights themselves
    want, _ = step(new, fresh._replace(count=s.count, mu=s.mu, nu=s.nu), b)
    assert_tree_bits(got, want, "replaced bf16 weights")
    kept, s_kept = step(p, s, b)  # untouched weights: the state's master is used
    assert not all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16))
                   for a, c in zip(jax.tree.leaves(s_kept.master),
                                   jax.tree.leaves(jax.tree.map(lambda x: x.astype(jnp.float32), kept))))


# -- flax nnx and orbax ---------------------------------------------------------------------------


def test_nnx_optimizer():
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
            g = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            opt.update(model, g)

        rng = np.random.default_rng(1)
        for _ in range(10):
            step(model, opt, jnp.asarray(rng.standard_normal((16, 12)), jnp.float32),
                 jnp.asarray(rng.standard_normal((16, 5)), jnp.float32))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param)), opt

    want, _ = train(optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask))
    got, opt = train(tsj.offload_adamw(1e-2, weight_decay=0.1, mask=decay_mask))
    assert_tree_bits(got, want, "nnx.Optimizer")
    assert int(opt.opt_state.count[...]) == 10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_saves_and_restores_the_state_as_it_is(tmp_path, dtype):
    """The state goes through orbax like optax's (moments, masters, the count) and a
    restored state resumes bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    init, loss, batch = MODELS["mlp"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x.astype(dtype) if x.ndim > 1 else x, init(rng))
    tx = tsj.offload_adamw(SCHEDULE, weight_decay=0.1, mask=decay_mask, max_grad_norm=1.0, master_weights=True)

    @jax.jit
    def step(p, s, b):
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        return optax.apply_updates(p, u), s

    bs = [batch(rng) for _ in range(10)]
    p, s = params, tx.init(params)
    for b in bs[:5]:
        p, s = step(p, s, b)
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
    ck.wait_until_finished()
    for b in bs[5:]:
        p, s = step(p, s, b)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": tx.init(params)})
    r = ck.restore(tmp_path / "ckpt", abstract)
    assert isinstance(r["opt_state"], tsj.OffloadAdamWState) and int(r["opt_state"].count) == 5
    p2, s2 = r["params"], r["opt_state"]
    for b in bs[5:]:
        p2, s2 = step(p2, s2, b)
    assert_tree_bits(p2, p, "resumed weights")
    assert_tree_bits(s2, s, "resumed state")


# -- x64, pmap, vmap, no growth -----------------------------------------------------------------


_X64 = textwrap.dedent('''
    import sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np, jax.numpy as jnp, optax
    sys.path.insert(0, {tests!r})
    import trainstream.jax as tsj
    from _jax_helpers import MODELS, SCHEDULE, _copy, assert_tree_bits, decay_mask
    init, loss, batch = MODELS["mlp"]
    params = jax.tree.map(lambda x: x.astype(jnp.float32), init(np.random.default_rng(0)))
    cases = {{
        "schedule": (optax.adamw(SCHEDULE, weight_decay=0.1, mask=decay_mask),
                     tsj.offload_adamw(SCHEDULE, weight_decay=0.1, mask=decay_mask)),
        "clip": (optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3)),
                 tsj.offload_adamw(1e-3, max_grad_norm=0.5)),
    }}
    for name, pair in cases.items():
        res = []
        for opt in pair:
            @jax.jit
            def f(p, s, b, opt=opt):
                u, s = opt.update(jax.grad(loss)(p, b), s, p)
                return optax.apply_updates(p, u), s
            p, s = _copy(params), opt.init(params)
            r = np.random.default_rng(1)
            res.append([])
            for t in range(10):
                p, s = f(p, s, batch(r))
                res[-1].append(p)
        for t in range(10):
            assert_tree_bits(res[1][t], res[0][t], f"x64 {{name}} step {{t + 1}}")
    print("x64 ok")
''')


def test_x64_mode():
    """With jax_enable_x64 (optax's bias corrections are float64 powers cast per leaf)."""
    code = _X64.format(tests=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "x64 ok" in r.stdout, r.stdout + r.stderr[-3000:]


_PMAP = textwrap.dedent('''
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import numpy as np, jax, jax.numpy as jnp, optax
    from jax.sharding import Mesh, PartitionSpec as P
    sys.path.insert(0, {tests!r})
    import trainstream.jax as tsj
    from _jax_helpers import MODELS, assert_tree_bits
    init, loss, batch = MODELS["mlp"]
    params = init(np.random.default_rng(0))
    rep = lambda t: jax.tree.map(lambda x: jnp.stack([x, x]), t)
    moments = lambda s: (optax.tree_utils.tree_get(s, "mu"), optax.tree_utils.tree_get(s, "nu"))
    grad = jax.jit(jax.grad(loss))
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    runs = {{"passed in": [], "pmean": [], "shard_map": []}}
    for opt in (optax.adamw(1e-3, weight_decay=0.1), tsj.offload_adamw(1e-3, weight_decay=0.1, threads=2)):
        def f(g, p, s):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        step = jax.pmap(f, axis_name="i")
        def with_pmean(p, s, b):
            g = jax.lax.pmean(jax.grad(loss)(p, b), "i")
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        step2 = jax.pmap(with_pmean, axis_name="i")
        def with_psum(p, s, x, y):
            g = jax.tree.map(lambda t: jax.lax.psum(t, "d") / 2, jax.grad(loss)(p, (x, y)))
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        step3 = jax.jit(jax.shard_map(with_psum, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                      out_specs=(P(), P()), check_vma=False))
        r = np.random.default_rng(1)
        batches = [[batch(r) for _ in range(2)] for _ in range(6)]
        p, s = rep(params), rep(opt.init(params))
        for bs in batches:  # gradients passed in, materialised
            g = jax.tree.map(lambda a, b: jnp.stack([a, b]), grad(params, bs[0]), grad(params, bs[1]))
            p, s = step(g, p, s)
            runs["passed in"].append((p, moments(s)))
        p, s = rep(params), rep(opt.init(params))
        for bs in batches:  # lax.pmean of the gradients in the update's program
            p, s = step2(p, s, jax.tree.map(lambda *x: jnp.stack(x), *bs))
            runs["pmean"].append((p, moments(s)))
        p, s = params, opt.init(params)
        for bs in batches:  # shard_map: psum / 2 of each device's half-batch gradient
            p, s = step3(p, s, *jax.tree.map(lambda *x: jnp.concatenate(x), *bs))
            runs["shard_map"].append((p, moments(s)))
    for name, run in runs.items():
        n = len(run) // 2
        for t in range(n):
            assert_tree_bits(run[n + t], run[t], f"{{name}} step {{t + 1}}")
    print("pmap ok")
''')


def test_pmap_and_shard_map_reductions():
    """Two CPU devices: pmap with the gradients passed in (every replica's callback on its own buffers), pmap with
    lax.pmean of the gradients in the step, and shard_map with psum / 2 in the step: weights and moments bit for bit
    against optax.adamw in the same program (XLA folds the mean's 1/2 into the moment lines: read at trace time)."""
    code = _PMAP.format(tests=os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "pmap ok" in r.stdout, r.stdout + r.stderr[-3000:]


def test_vmap_raises_a_clear_error_at_trace_time():
    init, _, _ = MODELS["mlp"]
    params = init(np.random.default_rng(0))
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), params)
    tx = tsj.offload_adamw(1e-3)
    states = jax.vmap(tx.init)(stacked)  # init is array code: it batches
    for fn in (tx.update, tx.step):
        with pytest.raises(NotImplementedError, match="under jax.vmap"):
            jax.eval_shape(jax.vmap(fn), stacked, states, stacked)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc")
def test_no_growth_across_init_step_close():
    """Cycles of a new optimizer, init, a jitted step, close: the process does not grow
    (nothing is kept between calls; the callbacks of equal configurations are shared).
    A probe measured 100 cycles (experiments/RESULTS.md, data/2026-12-02_jax_no_growth_cpu.json)."""
    init, loss, batch = MODELS["mlp"]
    params = init(np.random.default_rng(0))
    b = batch(np.random.default_rng(1))

    def cycle():
        tx = tsj.offload_adamw(1e-3, weight_decay=0.1)
        step = jax.jit(lambda p, s, b: tx.step(jax.grad(loss)(p, b), s, p))
        s = tx.init(params)
        p, s = step(params, s, b)
        jax.block_until_ready(p)
        tx.close(s)

    for _ in range(6):  # warm up (compilation caches, allocator pools)
        cycle()
    # A leak grows every window; the allocator's one-off growth (its history depends on the tests this
    # worker ran before) lands in one, so the quietest of three windows of 10 cycles is the measure.
    grown = []
    for _ in range(3):
        gc.collect()
        before = _rss()
        for _ in range(10):
            cycle()
        gc.collect()
        grown.append(_rss() - before)
    assert min(grown) < 10 * 64 * 1024, f"grew {[g // 1024 for g in grown]} KiB over each 10 cycles"
