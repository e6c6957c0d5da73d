"""optax's alias tests (``optax/_src/alias_test.py``, shipped in optax's wheel) and the bitwise companions of them:
shared by tests/test_jax_optax_alias.py (XLA:CPU) and tests/test_jax_optax_alias_gpu.py (XLA:GPU) (a helper module,
not collected by pytest)."""

import itertools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import trainstream.jax as tsj

from _jax_helpers import assert_tree_bits


def alias_test_module():
    """optax's alias_test (its sklearn import is for the L-BFGS tests only: a stub is enough, removed from
    ``sys.modules`` right after the import, since a module without ``__spec__`` breaks ``importlib.util.find_spec``
    for the tests after this one in the process, torch's dynamo among them)."""
    stubs = [n for n in ("sklearn", "sklearn.datasets", "sklearn.linear_model") if n not in sys.modules]
    for name in stubs:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["sklearn"].datasets = sys.modules["sklearn.datasets"]
    sys.modules["sklearn"].linear_model = sys.modules["sklearn.linear_model"]
    try:
        from optax._src import alias_test  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - optax without its tests or absl
        pytest.skip(f"optax's alias_test is not importable: {exc}")
    finally:
        for name in stubs:
            del sys.modules[name]
    return alias_test


def alias_cases() -> list[tuple[str, dict]]:
    """(absl's method name, its parameters) of the adam/adamw cases, in absl.parameterized.product's order."""
    at = alias_test_module()
    opts = at._OPTIMIZERS_UNDER_TEST
    grids = {
        "test_optimization": (opts, dict(target=("parabola", "rosenbrock"), dtype=("float32", "complex64"))),
        "test_optimizers_accept_extra_args": (opts, {}),
        "test_optimizers_can_be_wrapped_in_inject_hyperparams": (opts, {}),
        "test_explicit_dtype": (None, dict(params_dtype=("bfloat16", "float32", "complex64", None),
                                           state_dtype=("bfloat16", "float32", "complex64", None),
                                           opt_name=("sgd_mom", "adam", "adamw"))),
        "test_preserve_dtype": (opts, dict(dtype=("bfloat16", "float32"))),
        "test_state_shape_dtype_shard_stability": (opts, dict(dtype=("float16", "bfloat16", "float32", "float64",
                                                                     "complex64", "complex128"))),
        "test_gradient_accumulation": (opts, dict(dtype=("bfloat16", "float32"))),
    }
    out = []
    for name, (seq, grid) in grids.items():
        axes = ([list(seq)] if seq is not None else []) + [[{k: v} for v in vals] for k, vals in grid.items()]
        for i, combo in enumerate(itertools.product(*axes)):
            d = {}
            for c in combo:
                d.update(c)
            if d.get("opt_name") in ("adam", "adamw"):
                out.append((f"{name}{i}", d))
    return out


# -- bit for bit against optax (``mode``: ours) --------------------------------------------------------------------
def pair(name: str, *args, mode: str = "cpu", **kwargs):
    ref, ours = (optax.adam, tsj.offload_adam) if name == "adam" else (optax.adamw, tsj.offload_adamw)
    return ref(*args, **kwargs), ours(*args, mode=mode, **kwargs)


def run(opt, params, grads, jit_update=True):
    """Jitted update + apply_updates over the gradients: (params, updates, mu, nu) after each step."""
    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    p, s, out = params, opt.init(params), []
    for g in grads:
        p, s, u = step(p, s, g)
        mu = optax.tree.get(s, "mu")
        nu = optax.tree.get(s, "nu")
        out.append((p, u, mu, nu))
    return out


def compare(ref, ours, params, grads, what):
    for t, (a, b) in enumerate(zip(run(ours, params, grads), run(ref, params, grads))):
        for k, part in enumerate(("params", "updates", "mu", "nu")):
            assert_tree_bits(a[k], b[k], f"{what} step {t + 1} {part}")


def problem(dtype, steps=6, seed=0, one_element=True):
    """A 3-leaf tree (multi-element, vector, one element) and gradients over 5 decades."""
    rng = np.random.default_rng(seed)
    shapes = {"w": (9, 7), "b": (5,), "s": (1,)} if one_element else {"w": (9, 7), "b": (5,)}
    params = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(rng.standard_normal(s) * 10.0 ** rng.uniform(-4, 1), dtype) for k, s in shapes.items()}
             for _ in range(steps)]
    return params, grads


def compare_optimization(name: str, target: str, mode: str = "cpu") -> None:
    """optax's test_optimization problems, 300 steps with learning rate 0.1, the gradient computed in its own program
    and fed to the update: params, mu and nu of ours (``mode``) and optax's bit for bit at every step."""
    at = alias_test_module()
    init, _, objective = getattr(at, f"_setup_{target}")(jnp.float32)
    grad = jax.jit(jax.grad(objective))
    ref, ours = pair(name, 0.1, mode=mode)
    runs = []
    for opt in (ours, ref):
        @jax.jit
        def step(p, s, g, opt=opt):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p, s, hist = init, opt.init(init), []
        for _ in range(300):
            p, s = step(p, s, grad(p))
            hist.append((p, optax.tree.get(s, "mu"), optax.tree.get(s, "nu")))
        runs.append(hist)
    for t, (a, b) in enumerate(zip(*runs)):
        assert_tree_bits(a, b, f"{name} {target} step {t + 1}")


def compare_lax_cond(dtype: str, mode: str = "cpu") -> None:
    """test_state_shape_dtype_shard_stability's program (the update inside lax.cond) and test_preserve_dtype's: the
    update in the gradient's dtype; params, updates and state of ours (``mode``) and optax's bit for bit."""
    p0, fin = jnp.array([-1.0, 10.0, 1.0], dtype), jnp.array([1.0, -1.0, 1.0], dtype)

    def objective(x):
        return jnp.sum(jnp.abs(x - fin) ** 2)

    runs = []
    for opt in pair("adamw", 0.1, mode=mode):
        @jax.jit
        def step(params, state, opt=opt):
            updates = jax.grad(objective)(params)
            cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
            updates, state = jax.lax.cond(cond, lambda: opt.update(updates, state, params), lambda: (params, state))
            return optax.apply_updates(params, updates), state, updates

        p, s, hist = p0, opt.init(p0), []
        for _ in range(3):
            p, s, u = step(p, s)
            assert u.dtype == jnp.dtype(dtype) and p.dtype == jnp.dtype(dtype)
            hist.append((p, u, optax.tree.get(s, "mu"), optax.tree.get(s, "nu")))
        runs.append(hist)
    for t, (a, b) in enumerate(zip(*runs)):
        assert_tree_bits(a, b, f"{dtype} lax.cond step {t + 1}")
