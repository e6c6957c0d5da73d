"""optax's own alias tests for adam/adamw on a GPU (issue 35 item 3): the cases of ``optax/_src/alias_test.py`` with
``alias.adam``/``alias.adamw`` swapped for ``offload_adam``/``offload_adamw`` in ``mode="gpu"``, and their bitwise
companions against ``optax.adam``/``optax.adamw`` jitted on the same GPU: the parameterised hyper-parameters (fp32,
fp16/bf16 state as optax keeps it, ``mu_dtype``, ``nesterov``, ``eps_root``, ``eps == 0``), ``test_optimization``'s
problems, ``inject_hyperparams``, ``lax.cond`` with dtype preservation, the state's dtypes. A configuration whose
XLA:GPU lines are not derived is refused, naming itself (tests/test_jax_optax_alias.py runs the same on XLA:CPU).
"""

import functools
import unittest

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import trainstream.jax as tsj  # noqa: E402

from _jax_helpers import assert_tree_bits  # noqa: E402
from _optax_alias import (alias_cases, alias_test_module, compare, compare_lax_cond, compare_optimization, pair,  # noqa: E402
                          problem)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _on_gpu():
    """Every array on the GPU (optax's tests make theirs with jnp: the default device)."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX sees no GPU")
    with jax.default_device(dev):
        yield


#: what mode="gpu" refuses among optax's parameters: complex and float64 (every mode); no case of optax's grid needs a
#: line that is not derived
RECOMPILE = "Optimizer recompiles on second call"
REFUSED = ("supports float32, float16 and bfloat16", "mu_dtype=complex64", "mu_dtype=float64")


@pytest.mark.parametrize("name,params", alias_cases(), ids=lambda x: str(x))
def test_optax_alias_case_in_gpu_mode(monkeypatch, name, params):
    """Each adam/adamw case of optax's alias tests passes with ours in mode="gpu", or (complex, float64: every mode)
    fails with our refusal naming what is not reproduced."""
    at = alias_test_module()
    monkeypatch.setattr(at.alias, "adam", functools.partial(tsj.offload_adam, mode="gpu"))
    monkeypatch.setattr(at.alias, "adamw", functools.partial(tsj.offload_adamw, mode="gpu"))
    result = unittest.TestResult()
    at.AliasTest(name).run(result)
    text = "\n".join(tb for _, tb in result.errors + result.failures)
    refused = {str(params.get(k)) for k in ("dtype", "params_dtype", "state_dtype")} & {"complex64", "complex128",
                                                                                       "float64"}
    if refused:
        assert text and any(r in text for r in REFUSED), f"{name} {params}: expected a refusal, got:\n{text}"
    elif name.startswith("test_optimization") and RECOMPILE in text and text.count("Error") <= 2:
        pass  # its uncommitted params meet our committed state: one compile more (test_second_call_compiles_*)
    else:
        assert not text, f"{name} {params}:\n{text}"
        assert not result.skipped, result.skipped


# optax.adam/adamw's keyword arguments, per parameter dtype: XLA:GPU lines of every family of the contract
HYPER = [
    ("adamw", {}, "float32"),
    ("adam", {}, "float32"),
    ("adamw", {}, "bfloat16"),
    ("adamw", {}, "float16"),  # eps=1e-8 is 0 in float16: m * rsqrt(v)
    ("adam", {}, "bfloat16"),
    ("adamw", dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3), "bfloat16"),
    ("adamw", dict(nesterov=True), "float32"),
    ("adamw", dict(nesterov=True, eps_root=1e-6), "float32"),
    ("adam", dict(eps=0.0), "float32"),
    ("adamw", dict(eps_root=1e-8), "float32"),
    ("adamw", dict(b1=0.5, b2=0.5, weight_decay=0.3), "float32"),
    ("adamw", dict(mu_dtype=jnp.bfloat16), "float32"),
    ("adamw", dict(nesterov=True, one_element=False), "bfloat16"),
    ("adamw", dict(mu_dtype=jnp.float32), "bfloat16"),
]
NOT_DERIVED = [
    ("adamw", dict(mu_dtype=jnp.float32, nesterov=True), "float16"),
    ("adamw", dict(eps=1e-3), "float16"),
    ("adamw", dict(eps_root=1e-8), "bfloat16"),
    ("adamw", dict(mu_dtype=jnp.bfloat16, nesterov=True), "float32"),
    ("adamw", dict(nesterov=True), "bfloat16"),  # its one-element leaf (2 bfloat16 ulps at step 5 on an H100)
]


@pytest.mark.parametrize("name,kwargs,dtype", HYPER, ids=lambda x: str(x))
def test_hyperparameters_bitwise_on_gpu(name, kwargs, dtype):
    """Params, updates, mu and nu (in optax's dtypes) bit for bit with optax jitted on the GPU, six steps, over a
    multi-element, a vector and a one-element leaf."""
    kwargs = dict(kwargs)
    one = kwargs.pop("one_element", True)
    ref, ours = pair(name, 1e-2, mode="gpu", **kwargs)
    params, grads = problem(dtype, one_element=one)
    compare(ref, ours, params, grads, f"{name} {kwargs} {dtype}")


@pytest.mark.parametrize("name,kwargs,dtype", NOT_DERIVED, ids=lambda x: str(x))
def test_lines_not_derived_refused_on_gpu(name, kwargs, dtype):
    _, ours = pair(name, 1e-2, mode="gpu", **kwargs)
    with pytest.raises(NotImplementedError, match="not derived"):
        ours.init(problem(dtype)[0])


@pytest.mark.parametrize("target", ["parabola", "rosenbrock"])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_optimization_bitwise_on_gpu(name, target):
    """test_optimization's problems, 300 steps with learning rate 0.1: params, mu and nu bit for bit per step."""
    compare_optimization(name, target, mode="gpu")


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_inject_hyperparams_bitwise_on_gpu(name):
    """Ours plain and under optax.inject_hyperparams (every number an array) equal optax's, bit for bit."""
    params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
    ref, ours = {"adam": (optax.adam, tsj.offload_adam), "adamw": (optax.adamw, tsj.offload_adamw)}[name]
    ours = functools.partial(ours, mode="gpu")
    outs = []
    for f in (ours, ref):
        for opt in (f(learning_rate=0.1), optax.inject_hyperparams(f)(learning_rate=0.1)):
            s = jax.jit(opt.init)(params)
            for _ in range(3):
                u, s = jax.jit(opt.update)(grads, s, params)
            outs.append((u, optax.tree.get(s, "mu"), optax.tree.get(s, "nu")))
    assert_tree_bits(outs[0], outs[2], f"{name} plain")
    assert_tree_bits(outs[1], outs[3], f"{name} inject_hyperparams")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_lax_cond_and_preserve_dtype_bitwise_on_gpu(dtype):
    """test_state_shape_dtype_shard_stability's program (the update inside lax.cond) and test_preserve_dtype's: the
    update in the gradient's dtype, params and state bit for bit."""
    compare_lax_cond(dtype, mode="gpu")


@pytest.mark.parametrize("mu_dtype", [None, "bfloat16", "float32"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_state_dtypes_as_optax_on_gpu(dtype, mu_dtype):
    """test_explicit_dtype on the GPU: the state's shapes and dtypes as optax's, in pinned host memory (float16 leaves
    with mu_dtype other than their own: refused, no lines)."""
    params = {"a": jnp.zeros((3, 2), dtype), "b": jnp.zeros((1,), dtype)}
    ref, ours = pair("adamw", 0.1, mode="gpu", mu_dtype=mu_dtype)
    if dtype == "float16" and mu_dtype is not None:
        with pytest.raises(NotImplementedError, match="mu_dtype"):
            ours.init(params)
        return
    want, got = ref.init(params), ours.init(params)
    for part in ("mu", "nu"):
        w, g = optax.tree.get(want, part), optax.tree.get(got, part)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), g) == jax.tree.map(lambda x: (x.shape, x.dtype), w), part
        assert {x.sharding.memory_kind for x in jax.tree.leaves(g)} == {"pinned_host"}
    np.testing.assert_array_equal(optax.tree.get(got, "count"), 0)


@pytest.mark.parametrize("commit", [True, False])
def test_second_call_compiles_only_with_uncommitted_params(commit):
    """optax's test_optimization asserts that its jitted step does not compile again on its second call. On a GPU the
    state lives in pinned host memory, committed to the device (JAX commits every array put into a memory kind), so a
    step called with uncommitted params (``jnp.array(...)``) returns them committed and compiles once more on the
    second call, never after; params committed to the device (``jax.device_put``) compile once."""
    opt = tsj.offload_adam(0.1, mode="gpu")
    params = jnp.array([-1.0, 10.0, 1.0])
    if commit:
        params = jax.device_put(params, jax.devices("gpu")[0])

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(lambda x: jnp.sum((x - 1.0) ** 2))(p), s, p)
        return optax.apply_updates(p, u), s

    state, compiled = opt.init(params), []
    for _ in range(4):
        n = step._cache_size()
        params, state = step(params, state)
        compiled.append(step._cache_size() > n)
    assert compiled == ([True, False, False, False] if commit else [True, True, False, False])
