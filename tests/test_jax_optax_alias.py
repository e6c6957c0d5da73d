"""optax's own alias tests for adam/adamw (optax/_src/alias_test.py, shipped in optax's wheel) run against
``offload_adam``/``offload_adamw`` on XLA:CPU, and their computations compared bit for bit with optax's: the
parameterised hyper-parameters, ``test_optimization`` on its small problems, dtype preservation and explicit
``mu_dtype``, no recompilation on the second call, ``inject_hyperparams``, ``lax.cond`` stability, ``MultiSteps``.

optax's tests check tolerances only; the bitwise companions below run the same inputs through both and compare
params, updates, mu and nu. The gradients are arguments of the compared programs: where XLA fuses a gradient's producer
into optax's update (``test_optimization``'s own step), the pairing is chosen at trace time (issue 35, item 2).
"""

import functools
import os
import unittest

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import trainstream.jax as tsj  # noqa: E402

from _jax_helpers import assert_tree_bits  # noqa: E402
from _optax_alias import alias_cases as _cases  # noqa: E402
from _optax_alias import alias_test_module as _alias_test_module  # noqa: E402
from _optax_alias import compare as _compare  # noqa: E402
from _optax_alias import compare_lax_cond, compare_optimization  # noqa: E402
from _optax_alias import pair as _pair  # noqa: E402
from _optax_alias import problem as _problem  # noqa: E402
from _optax_alias import run as _run  # noqa: E402

if jax.default_backend() != "cpu":  # pragma: no cover - the CI runs JAX on the CPU
    pytest.skip("these tests run JAX on the CPU backend", allow_module_level=True)

#: complex, float64 leaves or mu_dtype: refused by the adapter with a message naming the dtypes it keeps
REFUSED = ("supports float32, float16 and bfloat16", "mu_dtype=complex64", "mu_dtype=float64")


def _refused(params: dict) -> bool:
    dts = {str(params.get(k)) for k in ("dtype", "params_dtype", "state_dtype")}
    return bool(dts & {"complex64", "complex128", "float64"})


@pytest.fixture
def alias_module(monkeypatch):
    """optax's alias_test with ``alias.adam``/``alias.adamw`` swapped for ours, as a user would swap them in."""
    at = _alias_test_module()
    monkeypatch.setattr(at.alias, "adam", tsj.offload_adam)
    monkeypatch.setattr(at.alias, "adamw", tsj.offload_adamw)
    return at


@pytest.mark.parametrize("name,params", _cases(), ids=lambda x: str(x))
def test_optax_alias_case(alias_module, name, params):
    """Each adam/adamw case of optax's alias tests passes with ours, or (complex, float64) fails with our refusal."""
    at = alias_module
    assert hasattr(at.AliasTest, name), f"optax's alias_test has no {name}: the grid of _cases() moved"
    result = unittest.TestResult()
    at.AliasTest(name).run(result)
    problems = result.errors + result.failures
    text = "\n".join(tb for _, tb in problems)
    if _refused(params):
        assert problems and any(r in text for r in REFUSED), f"{name} {params}: expected a refusal, got:\n{text}"
    else:
        assert not problems, f"{name} {params}:\n{text}"
        assert not result.skipped, result.skipped


# -- bit for bit against optax --------------------------------------------------------------------------------------
#: every configuration's kernel compiles in 5 s (float32) to 50 s (fp16/bf16 state) on a cold Numba cache: the CI
#: runs those the alias cases compile anyway, TRAINSTREAM_OPTAX_GRID=1 all
FULL = os.environ.get("TRAINSTREAM_OPTAX_GRID") == "1"
_full = pytest.mark.skipif(not FULL, reason="its own kernel's compile: TRAINSTREAM_OPTAX_GRID=1 runs it")

# optax.adam/adamw's keyword arguments, per parameter dtype (each a code family of the contract)
HYPER = [
    ("adamw", {}, "float32"),
    ("adam", {}, "float32"),
    ("adamw", {}, "bfloat16"),
    ("adamw", dict(one_element=False), "float16"),  # the fp16 kernel the alias cases compile
    pytest.param("adam", {}, "float16", marks=_full),  # and the one-element leaf's (OX_HALF_DIV)
    pytest.param("adamw", dict(nesterov=True, eps_root=1e-6), "float32", marks=_full),
    pytest.param("adam", dict(eps=0.0), "float32", marks=_full),
    pytest.param("adamw", dict(b1=0.5, b2=0.5, weight_decay=0.3), "float32", marks=_full),
    pytest.param("adamw", dict(mu_dtype=jnp.bfloat16), "float32", marks=_full),
    pytest.param("adamw", dict(nesterov=True), "bfloat16", marks=_full),
    pytest.param("adamw", dict(mu_dtype=jnp.float32), "bfloat16", marks=_full),
    pytest.param("adamw", dict(mu_dtype=jnp.float32, nesterov=True), "float16", marks=_full),
    pytest.param("adamw", dict(b1=0.5, b2=0.5), "float16", marks=_full),
    # a bare array as the pytree: XLA's reciprocal form (contract.OX_FORM_R), v*r2 + eps_root contracted
    ("adamw", dict(eps_root=1e-8, single=True), "float32"),
    # nesterov with b1 == 0.5 (fuzzer --full seed 8): XLA's numerator (mn + gn) * b1, g*r1 contracted into the sum
    ("adamw", dict(nesterov=True, b1=0.5, single=True), "float32"),
    pytest.param("adamw", dict(nesterov=True, b1=0.5, mu_dtype=jnp.bfloat16, single=True), "float32", marks=_full),
    # nesterov with b2 == 0.5 (fuzzer --full seed 9): (1-b1) * gn is the product fused
    pytest.param("adam", dict(nesterov=True, b1=0.8, b2=0.5), "float32", marks=_full),
    # float16 with float32 mu and b2 == 0.5: the update's loop recomputes v (a subnormal g*g: inf before)
    pytest.param("adamw", dict(b1=0.8, b2=0.5, mu_dtype=jnp.float32, one_element=False), "float16", marks=_full),
    # eps == 0 with decay and mu_dtype=bfloat16 (fuzzer --full seed 7): wd * p is the product fused
    pytest.param("adamw", dict(b1=0.5, b2=0.5, eps=0.0, eps_root=1e-8, mu_dtype=jnp.bfloat16, weight_decay=0.1,
                               single=True), "float32", marks=_full),
    pytest.param("adamw", dict(mu_dtype=jnp.float32, weight_decay=0.1, single=True), "bfloat16", marks=_full),
    pytest.param("adamw", dict(mu_dtype=jnp.float32, nesterov=True, single=True), "float16", marks=_full),
]


@pytest.mark.parametrize("name,kwargs,dtype", HYPER, ids=lambda x: str(x))
def test_hyperparameters_bitwise(name, kwargs, dtype):
    """optax.adam/adamw's arguments on float32, bfloat16 and float16 leaves: params, updates, mu and nu bit for bit
    (the state in optax's dtypes)."""
    kwargs = dict(kwargs)
    one = kwargs.pop("one_element", True)
    single = kwargs.pop("single", False)
    ref, ours = _pair(name, 1e-2, **kwargs)
    half_b = dtype != "float32" and 0.5 in (kwargs.get("b1"), kwargs.get("b2"))  # one-element leaves refused there
    params, grads = _problem(dtype, one_element=one and not half_b)
    if single:
        params, grads = params["w"], [g["w"] for g in grads]
    _compare(ref, ours, params, grads, f"{name} {kwargs} {dtype}")


@pytest.mark.parametrize("dtype,nesterov", [("bfloat16", False), ("float16", True)])
def test_mu_float32_lines_take_xla_form_per_tree(dtype, nesterov):
    """mu_dtype=float32 on fp16/bf16 leaves: in a pytree of one leaf XLA:CPU rewrites optax's ``m / d1`` (nesterov:
    ``m / d1n``) into ``m * (1/d1)``, in a larger one it keeps ``m / (d1 * den)``. The contract's lines with each
    leaf's :func:`~trainstream.contract.optax_cpu_code` (``OX_FORM_R`` for the bare array only) reproduce jitted
    optax.adamw's mu, nu, updates and params bit for bit; the other form does not. The NumPy lines (no kernel
    compile; the kernels are held to them in tests/test_host_kernels_optax.py, the adapter in the grid above)."""
    from trainstream import contract as C
    f32 = lambda x: np.asarray(x, np.float32).ravel()  # noqa: E731
    wrong = 0
    for single in (True, False):
        hp = dict(learning_rate=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
        tx = optax.adamw(**hp, mu_dtype=jnp.float32, nesterov=nesterov)
        params, grads = _problem(dtype, steps=3, one_element=False)
        if single:
            params, grads = params["w"], [g["w"] for g in grads]
        leaves = jax.tree.leaves(params)
        codes = [C.optax_cpu_code(len(leaves), x.size, dtype=dtype, mu_dtype="float32", nesterov=nesterov,
                                  b1=0.9, b2=0.999, eps=1e-8) for x in leaves]
        assert [bool(c & C.OX_FORM_R) for c in codes] == [single] * len(leaves)
        scalars = jax.jit(lambda count, codes=codes: C.optax_scalar_matrix(
            count, codes, [True] * len(codes), **hp, dtypes=[dtype] * len(codes), xp=jnp).scalars)
        s = tx.init(params)
        prev = (params, optax.tree.get(s, "mu"), optax.tree.get(s, "nu"))
        for t, ((p_new, u, mu, nu), g) in enumerate(zip(_run(tx, params, grads), grads)):
            sc = np.asarray(scalars(jnp.int32(t)))
            old = [jax.tree.leaves(x) for x in (*prev, g)]
            want = [jax.tree.leaves(x) for x in (p_new, mu, nu, u)]
            for i in range(len(leaves)):
                for code in (codes[i], codes[i] ^ C.OX_FORM_R):
                    row = sc[i].copy()
                    row[C.S_OX_CODE] = code
                    rp, rm, rv, ru = C.optax_reference_update(*(f32(x[i]) for x in old), row, dtype)
                    got = (rp, rm, rv, ru * np.float32(-hp["learning_rate"]))  # optax's update: -lr * u
                    same = all(np.array_equal(f32(a).view(np.uint32), f32(w[i]).view(np.uint32))
                               for a, w in zip(got, want))
                    if code == codes[i]:
                        assert same, f"{dtype} nesterov={nesterov} single={single} step {t + 1} leaf {i}"
                    wrong += not same
            prev = (p_new, mu, nu)
    assert wrong > 0  # the form matters: the other one differs somewhere


@pytest.mark.parametrize("kw,tree,warned", [
    (dict(mu_dtype=jnp.bfloat16), "pair", True), (dict(b1=0.5, b2=0.5), "pair", True),
    (dict(mu_dtype=jnp.bfloat16), "single", False), (dict(b1=0.5, b2=0.5, weight_decay=0.0), "pair", False),
    (dict(), "pair", False)])
def test_eps_zero_decay_pairing_by_outputs_warned(kw, tree, warned):
    """eps == 0 with weight decay, mu_dtype=bfloat16 or b1 == b2 == 0.5, in a tree of several leaves: XLA:CPU pairs
    m * rsqrt(v) + wd * p by what the program outputs (the weights or the update alone: wd * p fused; both: the
    other), which update cannot see: one warning at trace (none where the pairing is the same for every program)."""
    import warnings  # noqa: PLC0415

    from trainstream.jax import _detect  # noqa: PLC0415
    _detect._warned.discard("outputs")
    params = {"w": jnp.ones((3, 4)), "b": jnp.ones((5,))} if tree == "pair" else jnp.ones((3, 4))
    tx = tsj.offload_adamw(1e-3, eps=0.0, **{"weight_decay": 0.1, **kw})

    def step(p, s):
        u, s = tx.update(p, s, p)
        return optax.apply_updates(p, u), s

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        jax.jit(step).trace(params, tx.init(params))  # traced only: no kernel compiled
    got = [str(w.message) for w in rec if "rsqrt(v) + weight_decay * p" in str(w.message)]
    assert len(got) == int(warned), got


def test_refused_configuration_names_itself():
    """A one-element fp16/bf16 leaf with b1 == 0.5 (XLA's lines there not read): NotImplementedError naming it."""
    params = {"s": jnp.ones((1,), jnp.bfloat16)}
    tx = tsj.offload_adamw(1e-2, b1=0.5)
    with pytest.raises(NotImplementedError, match=r"one-element bfloat16 leaf with b1 == 0.5"):
        jax.jit(tx.update)(params, tx.init(params), params)


def test_bf16_mu_float32_eps_zero_refused():
    """A bfloat16 leaf with mu_dtype=float32 and eps == 0: XLA compiles optax's division otherwise (no lines read
    yet): NotImplementedError naming it, not silently different bits."""
    params = jnp.ones((3, 4), jnp.bfloat16)
    tx = tsj.offload_adamw(1e-2, eps=0.0, mu_dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match=r"bfloat16 leaf with mu_dtype float32 and eps == 0"):
        jax.jit(tx.update)(params, tx.init(params), params)


def test_positional_order_is_optax():
    """The fifth positional argument is eps_root and the sixth mu_dtype, as optax's (not weight_decay)."""
    params, grads = _problem("float32", steps=3)
    ref = optax.adamw(0.1, 0.9, 0.999, 1e-8, 1e-6, None, 0.3)
    ours = tsj.offload_adamw(0.1, 0.9, 0.999, 1e-8, 1e-6, None, 0.3)
    _compare(ref, ours, params, grads, "positional")
    with pytest.raises(TypeError, match="weight_decay"):
        tsj.offload_adam(0.1, weight_decay=0.1)  # optax.adam has none


@pytest.mark.parametrize("target", ["parabola", "rosenbrock"])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_optimization_bitwise(name, target):
    """test_optimization's problems, 300 steps with learning_rate 0.1: the gradient computed in its own program,
    fed to the update (params, mu and nu bit for bit at every step)."""
    compare_optimization(name, target)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_inject_hyperparams_bitwise(name):
    """test_optimizers_can_be_wrapped_in_inject_hyperparams' inputs: updates and states of ours plain and injected
    equal optax's plain and injected, bit for bit."""
    params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
    factory = {"adam": (optax.adam, tsj.offload_adam), "adamw": (optax.adamw, tsj.offload_adamw)}[name]
    outs = []
    for f in factory:
        for opt in (f(learning_rate=0.1), optax.inject_hyperparams(f)(learning_rate=0.1)):
            u, s = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
            outs.append((u, optax.tree.get(s, "mu"), optax.tree.get(s, "nu")))
    assert_tree_bits(outs[2], outs[0], f"{name} plain")
    assert_tree_bits(outs[3], outs[1], f"{name} inject_hyperparams")


def test_inject_hyperparams_one_element_leaves():
    """The fuzzer's seed 2002: with b2 an array (inject_hyperparams' state), XLA pairs nu's line of a one-element leaf
    of rank >= 1 swapped, a rank-0 leaf's not: 8 steps of params, updates, mu and nu bit for bit."""
    rng = np.random.default_rng(5)
    shapes = {"w": (1,), "m": (1, 1), "s": (), "b": (5,)}
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(rng.standard_normal(s) * 10.0 ** rng.uniform(-1, 1), jnp.float32)
              for k, s in shapes.items()} for _ in range(8)]
    kw = dict(learning_rate=0.01, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)
    _compare(optax.inject_hyperparams(optax.adamw)(**kw), optax.inject_hyperparams(tsj.offload_adamw)(**kw), params,
             grads, "inject_hyperparams, one-element leaves")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_lax_cond_and_preserve_dtype_bitwise(dtype):
    """test_state_shape_dtype_shard_stability's program (the update inside lax.cond) and test_preserve_dtype's:
    the update in the gradient's dtype, params and state bit for bit."""
    compare_lax_cond(dtype)


@pytest.mark.parametrize("mu_dtype", [None, "bfloat16", "float32"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_state_dtypes_as_optax(dtype, mu_dtype):
    """test_explicit_dtype: the state's dtypes and shapes as optax's, for every supported pairing (float16 leaves
    with mu_dtype=bfloat16 are refused: optax computes that mu in float32 and rounds it, lines not built here)."""
    params = {"a": jnp.zeros((3, 2), dtype), "b": jnp.zeros((1,), dtype)}
    ref, ours = _pair("adamw", 0.1, mu_dtype=mu_dtype)
    if dtype == "float16" and mu_dtype == "bfloat16":
        with pytest.raises(NotImplementedError, match="mu_dtype=bfloat16"):
            ours.init(params)
        return
    want, got = ref.init(params), ours.init(params)
    for part in ("mu", "nu"):
        w, g = optax.tree.get(want, part), optax.tree.get(got, part)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), g) == jax.tree.map(lambda x: (x.shape, x.dtype), w), part
    assert optax.tree.get(got, "count").dtype == optax.tree.get(want, "count").dtype


def test_master_weights_opt_in():
    """master_weights=True: fp16/bf16 leaves keep a float32 master and float32 moments (optax.adamw on the upcast
    master, the weights its rounding), the previous scheme."""
    params, grads = _problem("bfloat16", steps=3)
    ours = tsj.offload_adamw(1e-2, master_weights=True)
    state = ours.init(params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state.mu, state.nu, state.master)))
    ref = optax.adamw(1e-2)
    master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ref_state = ref.init(master)
    @jax.jit
    def ref_step(g, s, p):
        u, s = ref.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(ours.step)
    for g in grads:
        params, state = step(g, state, params)
        g32 = jax.tree.map(lambda x: np.asarray(x).astype(np.float32), g)  # upcast outside (else a fused convert)
        master, ref_state = ref_step(g32, ref_state, master)
        assert_tree_bits(state.master, master, "master")
        assert_tree_bits(params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), master), "weights")
    with pytest.raises(NotImplementedError, match="master_weights=True keeps mu in float32"):
        tsj.offload_adamw(1e-2, mu_dtype=jnp.bfloat16, master_weights=True).init(params)


def test_extra_args_through_chain():
    """optax's extra-arguments protocol: update(..., **extra) accepted and ignored, in a chain too."""
    params, grads = _problem("float32", steps=2)
    for opt in (tsj.offload_adamw(0.1), optax.chain(optax.scale(1.0), tsj.offload_adam(0.1))):
        assert isinstance(opt, optax.GradientTransformationExtraArgs)
        s = opt.init(params)
        u, s = jax.jit(functools.partial(opt.update, value=jnp.float32(1.0)))(grads[0], s, params)
        assert jax.tree.structure(u) == jax.tree.structure(params)
