"""The experiment scripts run end to end in CI size, and their tables show bit-identity
where the contract promises it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from _experiments import EXPERIMENTS, load_script  # noqa: E402


@pytest.fixture(scope="module")
def torch_equivalence(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence_torch")
    script = load_script("equivalence_torch")
    result = script.main(["--quick", "--steps", "3", "--devices", "cpu", "--threads", "2",
                          "--out", str(out), "--no-progress"])
    return out, result


def test_equivalence_torch_first_line_is_its_command():
    first = (EXPERIMENTS / "equivalence_torch.py").read_text().splitlines()[0]
    assert first.startswith("# Run: python experiments/equivalence_torch.py")


def test_equivalence_torch_writes_json_and_markdown(torch_equivalence):
    out, result = torch_equivalence
    saved = json.loads((out / "equivalence_torch.json").read_text())
    assert saved["comparisons"] == json.loads(json.dumps(result["comparisons"]))
    assert saved["meta"]["steps"] == 3
    table = (out / "equivalence_torch.md").read_text()
    assert table.count("\n| ") == len(result["comparisons"]) + 1  # header + one row each


def test_equivalence_torch_promised_rows_bit_identical(torch_equivalence):
    _, result = torch_equivalence
    promised = [c for c in result["comparisons"]
                if c["kind"] == "trainstream-vs-reference" and c["promised"]]
    # OffloadAdamW (cpu mode, and its eager path without clipping) vs torch default, on the
    # CPU, for fp32 and half-vs-fp32-master, with and without clipping and accumulation.
    covered = {(c["a"], c["dtype"], c["clip"] is not None, c["accum"]) for c in promised}
    for dt in ("fp32", "bf16", "fp16"):
        for clip in (False, True):
            for accum in (1, 2):
                assert ("OffloadAdamW cpu [cpu]", dt, clip, accum) in covered
                if not clip:
                    assert ("OffloadAdamW cpu eager [cpu]", dt, clip, accum) in covered
    for c in promised:
        assert c["b"] == "torch default [cpu]" and c["device"] == "cpu"
        ps, what = c["per_step"], f"{c['a']} vs {c['b']} {c['dtype']} clip={c['clip']} accum={c['accum']}"
        assert len(ps["bitid"]) == 3
        assert ps["bitid"] == [1.0] * 3, what
        assert ps["bitid_model"] == [1.0] * 3, what
        assert ps["max_ulp"] == [0] * 3 and ps["max_rel"] == [0.0] * 3, what
        assert ps["loss_a"] == ps["loss_b"], what
        assert c["summary"]["final_bitid"] == 1.0
    table = (torch_equivalence[0] / "equivalence_torch.md").read_text()
    assert "| OffloadAdamW cpu [cpu] vs torch default [cpu] | cpu | bf16 | 0.5 | 2 | yes | 3 | 100% | 100% | 0 | 0 |" in table


def test_equivalence_torch_has_reference_rows(torch_equivalence):
    _, result = torch_equivalence
    fused = [c for c in result["comparisons"]
             if c["kind"] == "reference-vs-reference" and c["a"] == "torch default [cpu]"
             and c["b"] == "torch fused [cpu]"]
    assert {(c["dtype"], c["clip"] is not None, c["accum"]) for c in fused} == {
        (dt, clip, accum) for dt in ("fp32", "bf16", "fp16") for clip in (False, True) for accum in (1, 2)}
    for c in fused:
        assert not c["promised"] and len(c["per_step"]["max_ulp"]) == 3
    # every TrainStream row is promised: its reference is the loop a user writes (its own
    # clip_grad_norm_, micro-batches summed in param.grad)
    assert all(c["promised"] for c in result["comparisons"] if c["kind"] == "trainstream-vs-reference")


# -- issue #22: bench_train at sizes where offloading is needed, the host benchmark, plots ------


def _run_bench_train(tmp_path, *extra, timeout=300):
    import os
    import subprocess
    import sys

    repo = EXPERIMENTS.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_train.py"), "--device", "cpu", "--seq", "32",
                        "--vocab", "256", "--steps", "2", "--warmup", "1", "--json", str(out), *extra],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def test_bench_train_cpu_smoke_subprocess_per_setup_and_scaling_plots(tmp_path):
    doc, stdout = _run_bench_train(tmp_path, "--configs", "tiny:2", "--ckpt", "--lean", "--order", "setup",
                                   "--budget", "250", "--setups", "bf16_fused,ts_cpu_eager,ts_hybrid")
    rows = {r["setup"]: r for r in doc["rows"]}
    assert rows["ts_hybrid"]["skipped"] == "needs CUDA"
    for name in ("bf16_fused", "ts_cpu_eager"):
        r = rows[name]
        assert r["step_ms_median"] > 0 and r["steps_timed"] == 2 and r["ckpt"] is True
        assert r["mfu"] == pytest.approx(6 * r["params_M"] * 1e6 * 2 * 32 / (r["step_ms_median"] / 1e3) / 989e12)
        assert r["host"]["VmHWM_gib"] > 0 and "host_used_peak_gib" in r and r["wall_s"] > 0
        assert "mem_phases" not in r and "step_ms_stream" not in r  # --lean
        assert any(line.split("]", 1)[1].split()[:3] == ["tiny", "x2", name] for line in stdout.splitlines() if "]" in line)
    assert rows["ts_cpu_eager"]["host_state_gib"] > 0
    plots = load_script("plot_results")
    for path in plots.plot_scaling([str(tmp_path / "bench.json")], str(tmp_path)):
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_train_host_oom_is_recorded_not_fatal(tmp_path):
    doc, _ = _run_bench_train(tmp_path, "--configs", "tiny:2", "--lean", "--setups", "ts_cpu",
                              "--host-reserve-gib", "1e9")
    (row,) = doc["rows"]
    assert row["failure"] == "host_oom" and "MemAvailable" in row["error"] and "step_ms_median" not in row


def test_bench_host_adamw_interleaved(tmp_path):
    script = load_script("bench_host_adamw")
    out = tmp_path / "host.json"
    assert script.main(["--numel", "65536", "--threads", "2", "--rounds", "2", "--repeats", "2", "--gap", "0",
                        "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert set(res) == {"ceiling", "ceiling_plain", "ours", "ours_bf16", "torch_fused"}
    for r in res.values():
        assert len(r["round_medians_ms"]) == 2 and r["bytes_per_element"] == 28
    assert res["torch_fused"]["x_torch_median"] == 1.0 and res["ceiling"]["of_ceiling_median"] == 1.0
    assert len(doc["summary"]["ours_x_torch_per_round"]) == 2
    assert doc["env"]["thp_enabled"] is None or "[" in doc["env"]["thp_enabled"]


def test_bench_host_adamw_cases_check_themselves():
    """The cases check their first pass (the kernels against the contract's reference) before
    they are timed, over uneven ranges."""
    script = load_script("bench_host_adamw")
    assert script.split_ranges(100, 3) == [(0, 32), (32, 64), (64, 100)]
    with script.Team(3) as team:
        for case in (script.AdamWCase(team, 10_007), script.AdamWCase(team, 10_007, bf16=True),
                     script.CeilingCase(team, 10_007), script.CeilingCase(team, 10_007, prefetch=False)):
            case()
    with pytest.raises(ValueError, match="threads must be >= 1"):
        script.Team(0)
