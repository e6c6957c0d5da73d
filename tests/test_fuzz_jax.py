"""The JAX adapter's differential fuzzer in CI (issue 40 item 5): offload_adamw / offload_adam against optax.adamw /
optax.adam on random pytrees, dtypes, hyper-parameters and compositions (tests/_fuzz_jax.py says which), jitted and
eager; every step's params and updates bitwise equal, or both raised, or ours refused naming why; updates whose tree
structure, shape or dtype differ from init's get a clear error. Derandomized (the same cases every run); a failure
prints hypothesis' shrunk case. ``TRAINSTREAM_FUZZ_EXAMPLES`` sets the count, ``TRAINSTREAM_FUZZ_FULL=1`` adds the
hyper-parameters whose kernels no other CI test compiles; the longer run is experiments/fuzz.py."""

from __future__ import annotations

import os

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

import _fuzz_jax as F  # noqa: E402

if jax.default_backend() != "cpu":  # pragma: no cover - the CI runs JAX on the CPU
    pytest.skip("the fuzzer runs JAX on the CPU backend", allow_module_level=True)

#: float16 cases, where XLA:CPU compiles float16 (not at a forced SSE4.2 level: optax cannot run either)
FLOAT16 = pytest.mark.skipif(not F.xla_float16(), reason="XLA:CPU cannot compile float16 at this ISA level "
                             "(--xla_cpu_max_isa=SSE4_2: __extendhfsf2 not linked), optax.adamw included")

pytestmark = pytest.mark.isa  # also under the forced ISA levels: XLA:CPU's fusions (the probe's codes) differ there

#: no "explain" phase: a failure prints the shrunk case at once (explaining re-runs it ~100 times)
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
EXAMPLES = int(os.environ.get("TRAINSTREAM_FUZZ_EXAMPLES", "30"))


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=True,
          phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=F.configs(), tree=F.trees(), steps=st.integers(1, 3), scales=F.scales(), mismatch=F.mismatches())
def test_sequences_match_optax(cfg, tree, steps, scales, mismatch):
    outcome, detail = F.run_sequence(cfg, tree, steps, scales, mismatch)  # raises a Finding otherwise
    assert outcome in F.OUTCOMES, (outcome, detail)


@FLOAT16
def test_one_element_fp16_leaf_with_a_subnormal_eps():
    """The fuzzer's first finding: a (1,) float16 leaf whose eps is a float16 subnormal (1e-6) and whose nu is 0:
    XLA divides mu by the product d1 * (sqrt(nu_hat) + eps) in float16 (a subnormal, rounded), not (mu / d1) by the
    sum; the update was 11% off optax's."""
    cfg = F.Config(name="adamw", lr=0.01, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.0, composition="plain")
    tree = F.Tree(layout="dict", shapes=(2, 0), dtypes=("float16", "float16"), seed=3)
    assert F.run_sequence(cfg, tree, 2, (1e-3,)) == ("identical", "")


def test_array_hyperparameters_with_half_leaves_refused():
    """The fuzzer's second finding: inject_hyperparams' arrays with a bfloat16/float16 leaf (optax computes it in the
    arrays' dtype: the update was off up to a sign flip) are refused, naming the leaf; float32 trees run as optax."""
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    import trainstream.jax as tsj  # noqa: PLC0415

    params = {"w": jnp.ones((3, 4), jnp.bfloat16), "b": jnp.ones((5,), jnp.float32)}
    tx = optax.inject_hyperparams(tsj.offload_adamw)(learning_rate=0.01)
    with pytest.raises(NotImplementedError, match=r"given as arrays .* bfloat16 leaf \['w'\]"):
        jax.jit(tx.update)(params, tx.init(params), params)
    cfg = F.Config(composition="inject")
    assert F.run_sequence(cfg, F.Tree("dict", (0, 1), ("float32", "float32")), 2) == ("identical", "")


def test_state_of_another_tree_refused():
    """The fuzzer's third finding: optax.masked(ours) updated with params of another tree with as many unmasked
    leaves went through on the old state; now a ValueError naming both structures, as optax raises."""
    cfg = F.Config(name="adam", composition="masked")
    outcome, detail = F.run_sequence(cfg, F.Tree("nested", (2, 2), ("float32", "float32")), 2,
                                     mismatch=F.Mismatch("params", 1, 3))
    assert outcome == "mismatch refused" and "another structure" in detail, detail


@FLOAT16
def test_clip_with_a_float16_leaf_pairing_read():
    """Seed 2007's findings (default mode): clip_by_global_norm over a float32 and a float16 leaf, jitted. The probe's
    random float16 gradients overflowed the global norm (squares in float16), so every clipped gradient was 0 and
    every pairing exact: it kept the default where XLA swaps nu's (1 ULP in nu, then in the update)."""
    cfg = F.Config(name="adam", lr=0.1, b1=0.8, b2=0.999, eps=1e-6, composition="clip")
    tree = F.Tree(layout="nested", shapes=(0, 3), dtypes=("float32", "float16"))
    assert F.run_sequence(cfg, tree, 3, (30.0,)) == ("identical", "")


def test_a_cached_programs_warning_counts(monkeypatch):
    """--full seeds 7 and 8 reported warned sequences as silent: the adapter warns when it traces a program, and a
    sequence re-running a program of an earlier one (JAX's cache) saw no warning. Now a program's warning counts for
    every sequence that runs it (here a wrong pairing, warned at trace: both runs are "warned")."""
    import warnings  # noqa: PLC0415

    from trainstream import contract as C  # noqa: PLC0415
    from trainstream.jax import _detect  # noqa: PLC0415

    traced = _detect.fused_codes

    def wrong(codes, *args, **kwargs):
        warnings.warn("TrainStream offload_adamw: a test's wrong pairing", RuntimeWarning)
        return [c ^ C.OX_NU_SWAP ^ C.OX_MU_SWAP for c in traced(codes, *args, **kwargs)]

    monkeypatch.setattr(_detect, "fused_codes", wrong)
    monkeypatch.setattr(F, "_TRACE_WARNINGS", {}, raising=False)
    cfg = F.Config(name="adamw", lr=0.1, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, mask="first")
    tree = F.Tree(layout="list", shapes=(0, 1), dtypes=("float32", "float32"), seed=1)
    try:
        # "warned" or, where the pairing does not change the bits (no FMA: XLA:CPU's AVX level), "warned identical"
        assert [F.run_sequence(cfg, tree, 3)[0].split()[0] for _ in range(2)] == ["warned", "warned"]
    finally:
        F._programs.cache_clear()  # the programs traced with the wrong pairing
