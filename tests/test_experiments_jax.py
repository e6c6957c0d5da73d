"""experiments/equivalence_jax.py runs end to end in CI size, and its table shows
bit-identity where the contract promises it (offload_adamw vs jitted optax.adamw)."""

from __future__ import annotations

import json

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")

if jax.default_backend() != "cpu":  # pragma: no cover - the CI runs JAX on the CPU
    pytest.skip("the quick run compares on JAX's CPU backend", allow_module_level=True)

from _experiments import EXPERIMENTS, load_script  # noqa: E402
STEPS = 3


@pytest.fixture(scope="module")
def jax_equivalence(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence_jax")
    script = load_script("equivalence_jax")
    result = script.main(["--quick", "--steps", str(STEPS), "--devices", "cpu", "--threads", "2",
                          "--out", str(out), "--no-progress"])
    return out, result


def test_equivalence_jax_first_line_is_its_command():
    first = (EXPERIMENTS / "equivalence_jax.py").read_text().splitlines()[0]
    assert first.startswith("# Run: python experiments/equivalence_jax.py")


def test_equivalence_jax_writes_json_and_markdown(jax_equivalence):
    out, result = jax_equivalence
    saved = json.loads((out / "equivalence_jax.json").read_text())
    assert saved["comparisons"] == json.loads(json.dumps(result["comparisons"]))
    assert saved["meta"]["steps"] == STEPS
    assert saved["meta"]["dtypes"] == ["fp32", "bf16"]
    table = (out / "equivalence_jax.md").read_text()
    assert table.count("\n| ") == len(result["comparisons"]) + 1  # header + one row each
    # no GPU in CI: the CUDA rows are skipped with a printed reason
    if not saved["meta"]["gpu"]:
        assert any("CUDA rows" in s and "no GPU visible" in s for s in saved["meta"]["skipped"])


def test_equivalence_jax_promised_rows_bit_identical(jax_equivalence):
    out, result = jax_equivalence
    comps = result["comparisons"]
    promised = [c for c in comps if c["promised"]]
    # offload_adamw (tx.step jitted with the gradient, and called eagerly) vs optax.adamw
    # jitted on the same backend: fp32, and bf16 against an fp32-master reference, with and
    # without clipping (optax.chain(clip_by_global_norm, adamw)); schedule and mask on.
    covered = {(c["a"], c["b"], c["dtype"], c["clip"] is not None) for c in promised}
    for dt in ("fp32", "bf16"):
        for clip in (False, True):
            for ts in ("offload_adamw step [jit]", "offload_adamw step [eager]"):
                assert (ts, "optax.adamw [jit]", dt, clip) in covered, (ts, dt, clip)
    for c in promised:
        assert c["device"] == "cpu"
        ps, what = c["per_step"], f"{c['a']} vs {c['b']} {c['dtype']} clip={c['clip']} ({c['note']})"
        assert len(ps["bitid"]) == STEPS
        assert ps["bitid"] == [1.0] * STEPS, what
        assert ps["bitid_model"] == [1.0] * STEPS, what
        assert ps["max_ulp"] == [0] * STEPS and ps["max_rel"] == [0.0] * STEPS, what
        assert ps["loss_a"] == ps["loss_b"], what
        assert c["summary"]["final_bitid"] == 1.0 and c["summary"]["min_bitid"] == 1.0
    table = (out / "equivalence_jax.md").read_text()
    assert f"| offload_adamw step [jit] vs optax.adamw [jit] | cpu | fp32 | off | yes | {STEPS} | 100% | 100% | 0 | 0 |" in table
    # the clip setting clips on at least one step of the reference
    clipped = [c["summary"]["clip_active_steps"] for c in comps
               if c["clip"] is not None and c["b"] == "optax.adamw [jit]" and c["summary"]["clip_active_steps"] is not None]
    assert clipped and max(clipped) >= 1


def test_equivalence_jax_has_reference_rows(jax_equivalence):
    _, result = jax_equivalence
    comps = result["comparisons"]
    refs = [c for c in comps if c["kind"] == "reference-vs-reference"]
    assert refs and not any(c["promised"] for c in refs)
    eager = [c for c in refs if c["a"] == "optax.adamw [eager]" and c["b"] == "optax.adamw [jit]"]
    assert {(c["dtype"], c["clip"] is not None) for c in eager} == {
        (dt, clip) for dt in ("fp32", "bf16") for clip in (False, True)}
    for c in refs:
        assert len(c["per_step"]["max_ulp"]) == STEPS
    # optax's API (update + apply_updates) beside the exact tx.step, without promise
    upd = [c for c in comps if c["a"] == "offload_adamw update+apply_updates [jit]"]
    assert upd and not any(c["promised"] for c in upd)


def test_bench_jax_offload_runs_on_cpu(tmp_path):
    """The (a)-(d) benchmark script in CI size: the setups that exist on the CPU run and
    agree with optax in HBM; gpu mode is reported as needing a GPU."""
    import subprocess
    import sys

    script = EXPERIMENTS / "bench_jax_offload.py"
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(script), "--params", "1M", "--width", "256", "--steps", "2",
                        "--warmup", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    for name in ("optax_hbm", "jax_pinned", "ts_cpu"):
        assert res[name]["ms"] > 0
        assert res[name]["check_vs_optax_hbm"]["frac_off_by_1pct_lr"] == 0.0, name
    assert "needs a CUDA GPU" in res["ts_gpu"]["error"] and "needs a CUDA GPU" in res["ts_gpu_zc"]["error"]


@pytest.mark.parametrize("param_dtype,scan", [("bf16", False), ("fp32", False), ("fp32", True)])
def test_bench_jax_gpt_child_steps_with_optax_bits(param_dtype, scan):
    """experiments/bench_jax_gpt.py (#36): its first line is its command; one (size, setup) child run in this
    process for optax.adamw and for offload_adamw(mode="cpu") on the flax GPT with bf16 (optax's bf16 state, no
    master) and float32 parameters, its blocks in a Python loop or stacked under nnx.scan (``--scan``: one leaf per
    kind, the same parameter count): timed rows, and the same weights after 2 steps."""
    pytest.importorskip("flax")
    assert (EXPERIMENTS / "bench_jax_gpt.py").read_text().splitlines()[0].startswith(
        "# Run (GPU machine): python experiments/bench_jax_gpt.py")
    bench = load_script("bench_jax_gpt")
    rows = {}
    for setup in ("optax_hbm", "ts_cpu"):
        args = bench.parse(["--device", "cpu", "--sizes", "tiny", "--batch", "2", "--seq", "16", "--vocab", "512",
                            "--steps", "1",
                            "--warmup", "0", "--check", "--param-dtype", param_dtype, "--_child", f"tiny:{setup}"]
                           + ["--scan"] * scan)
        rows[setup] = bench.child(args)
    assert rows["ts_cpu"]["digest"] == rows["optax_hbm"]["digest"] is not None
    assert rows["ts_cpu"]["params_dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[param_dtype]
    from _common import param_count  # the torch GPT's count: the same shapes

    assert all(r["ms"] > 0 and r["params"] == param_count("tiny", vocab=512, ctx=16) for r in rows.values())
    # _common.SIZES["tiny"]: 2 blocks of 12 leaves (stacked: 12 in all), and 4 outside them
    assert rows["ts_cpu"]["leaves"] == (12 + 4 if scan else 2 * 12 + 4)


def test_probe_xla_gpu_optax_records_the_programs_bits(tmp_path):
    """experiments/probe_xla_gpu_optax.py (#35 item 4's data, recorded on a GPU): its first line is its command; on
    XLA:CPU (``--device cpu``) every configuration's recorded outputs are what optax.adamw's jitted step gives for the
    recorded inputs, bit for bit, and each program's HLO is written."""
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    assert (EXPERIMENTS / "probe_xla_gpu_optax.py").read_text().splitlines()[0].startswith(
        "# Run (GPU machine): python experiments/probe_xla_gpu_optax.py")
    probe = load_script("probe_xla_gpu_optax")
    out, hlo = tmp_path / "x.npz", tmp_path / "x.txt"
    assert probe.main(["--device", "cpu", "--numel", "64", "--configs", "bf16,fp32_mu16", "--out", str(out),
                       "--hlo", str(hlo)]) == 0
    assert [line.split()[1] for line in hlo.read_text().splitlines() if line.startswith("==== ")] == ["bf16", "fp32_mu16"]
    rec = np.load(out)
    for name in ("bf16", "fp32_mu16"):
        opt, step = probe.program(name)
        for count in probe.COUNTS:
            dtypes = dict(s.split(":") for s in rec[f"{name}/{count}/dtypes"])
            a = {k: jnp.asarray(rec[f"{name}/{count}/{k}"].view(jnp.dtype(dtypes[k]))) for k in dtypes}
            s0 = opt.init(a["p"])
            s = (s0[0]._replace(count=jnp.asarray(count, jnp.int32), mu=a["mu"], nu=a["nu"]), *s0[1:])
            new_p, u, new_s = step(a["p"], s, a["g"])
            for k, x in (("new_p", new_p), ("u", u), ("new_mu", new_s[0].mu), ("new_nu", new_s[0].nu)):
                want = rec[f"{name}/{count}/{k}"]
                assert np.array_equal(np.asarray(x).view(want.dtype), want), (name, count, k)
