"""#37: the machine profiles of the training benchmarks (experiments/_profile.py) and the largest-model search
(experiments/largest_model.py): the search's logic against a stand-in runner, resumed over calls; one CPU run end
to end through bench_train's processes, the profile's host watchdog, cores and host limit applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from _experiments import EXPERIMENTS, load_script  # noqa: E402

LM = load_script("largest_model")
PROFILE = sys.modules["_profile"]  # imported by largest_model from experiments/


def test_profiles_parse_and_refuse():
    p = PROFILE.parse("24g64")
    assert (p.gpu_bytes, p.host_bytes, p.cores) == (24564 << 20, 64 << 30, 8)
    assert PROFILE.parse("whole") == PROFILE.Profile("whole")
    q = PROFILE.parse("1.5g0.5c1")
    assert (q.gpu_bytes, q.host_bytes, q.cores) == (int(1.5 * 2**30), 2**29, 1)
    for bad in ("24g", "g64", "0g1", "1g1c0", "big"):
        with pytest.raises(ValueError, match="profile"):
            PROFILE.parse(bad)
    with pytest.raises(ValueError, match="cores"):
        PROFILE.cores_of(PROFILE.parse(f"1g1c{len(os.sched_getaffinity(0)) + 1}"))
    kw = PROFILE.spawn_kwargs(q)
    assert kw["env"]["TRAINSTREAM_HOST_LIMIT"] == str(2**29) and kw["env"]["OMP_NUM_THREADS"] == "1"
    assert "preexec_fn" in kw and "preexec_fn" not in PROFILE.spawn_kwargs(PROFILE.parse("whole"))


def test_tree_rss_counts_the_session():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"],
                             start_new_session=True)
    try:
        for _ in range(100):
            if PROFILE.tree_rss(child.pid) > 64 << 20:
                break
            subprocess.run(["sleep", "0.05"])
        assert PROFILE.tree_rss(child.pid) > 64 << 20
        assert PROFILE.tree_rss(child.pid + 10**7) == 0
    finally:
        child.kill()
        child.wait()


def test_next_index_gallops_and_bisects():
    n = 10
    assert LM.next_index({}, n, 4) == 4
    assert LM.next_index({4: True}, n, 4) == 5
    assert LM.next_index({4: True, 5: True}, n, 4) == 7  # galloping
    assert LM.next_index({4: True, 5: True, 7: False}, n, 4) == 6
    assert LM.next_index({4: True, 5: True, 6: True, 7: False}, n, 4) is None
    assert LM.next_index({4: False}, n, 4) == 3
    assert LM.next_index({4: False, 3: False}, n, 4) == 1
    assert LM.next_index({0: False}, n, 0) is None
    assert LM.next_index({9: True}, n, 9) is None  # the top of the ladder
    assert LM.next_index({2: True, 9: False}, n, 2) == 5


def _fake_runner(limits: dict, calls: list, cut: set):
    """Fits where the parameters stay below ``limits[(profile, setup base)]`` (billions); ``cut``: specs to answer
    as cut short by the budget (once)."""
    from _common import param_count

    def run(spec, timeout, log):
        calls.append((spec["profile"], spec["setup"], spec["size"]))
        base = spec["setup"].split("~res")[0]
        p = param_count(spec["size"]) / 1e9
        row = {"setup": spec["setup"], "size": spec["size"], "batch": spec["batch"], "wall_s": 1.0,
               "profile": {"gpu_total_gib": 139.8, "allocator_peak_reserved_gib": 2.6 * p, "context_gib": 0.6}}
        key = (spec["profile"], spec["setup"], spec["size"])
        if key in cut:
            cut.discard(key)
            return dict(row, failure="timeout", error="timeout: killed")
        if p <= limits[(spec["profile"], base)]:
            return dict(row, step_ms_median=100 * p, steps_timed=2)
        return dict(row, failure="host_oom", error="MemoryError: host memory")
    return run


def test_search_finds_the_boundary_resumes_and_redoes_cut_attempts(tmp_path):
    state = str(tmp_path / "largest.json")
    limits = {("24g64c1", "ts_cpu_eager"): 7.0, ("24g64c1", "bf16_fused"): 1.5, ("2g1c1", "ts_cpu_eager"): 0.0}
    calls: list = []
    argv = ["--profiles", "24g64c1", "--setups", "ts_cpu,bf16_fused,ts_cpu_res", "--state", state, "--budget", "0"]
    assert LM.main(argv, run=_fake_runner(limits, calls, set())) == 0
    doc = json.loads(open(state).read())
    labels = {a["label"] for a in doc["attempts"]}
    assert labels == {"ts_cpu", "bf16_fused", "ts_cpu_res"}
    search = LM.Search(LM.argparse.Namespace(sizes=",".join(LM.LADDER), batch=8, seq=1024, vocab=LM.VOCAB), doc, None)
    assert search.largest("24g64c1", "ts_cpu") == "7b" and search.largest("24g64c1", "bf16_fused") == "1.3b"
    assert search.largest("24g64c1", "ts_cpu_res") == "7b"
    assert len(search.attempts("24g64c1", "ts_cpu")) <= 5
    # ts_cpu_res: gpu_state_bytes from ts_cpu's measured peak, scaled, at most the state's 4 B/param
    res = [c[1] for c in calls if c[1].startswith("ts_cpu_eager~res")]
    gib = [float(r.split("~res")[1]) for r in res]
    assert gib and all(0 <= g <= 4 * 30 for g in gib) and max(gib) > 0  # 0: no room left beside the model
    common = {c["label"]: c for c in doc["common"]}
    assert set(common) == {"ts_cpu", "bf16_fused", "ts_cpu_res"} and {c["size"] for c in common.values()} == {"1.3b"}
    assert doc["meta"]["complete"] is True
    n = len(calls)
    assert LM.main(argv, run=_fake_runner(limits, calls, set())) == 0  # resumed: nothing left to do
    assert len(calls) == n
    # an attempt cut by the call's budget (a timeout shorter than --timeout) is redone by the next call
    state2 = str(tmp_path / "cut.json")
    argv2 = ["--profiles", "2g1c1", "--setups", "ts_cpu", "--state", state2, "--budget", "0", "--sizes", "125m,350m"]

    def cut_run(spec, timeout, log):
        calls.append(spec["size"])
        return {"setup": spec["setup"], "size": spec["size"], "failure": "timeout", "error": "timeout"}
    args_budget = argv2 + ["--timeout", "100"]
    real_attempt = LM.Search.attempt

    def short(self, profile, label, size, timeout, steps, warmup):  # as if the budget left 10 s of the 100
        return real_attempt(self, profile, label, size, 10.0, steps, warmup)
    LM.Search.attempt = short
    try:
        LM.main(args_budget, run=cut_run)
    finally:
        LM.Search.attempt = real_attempt
    doc2 = json.loads(open(state2).read())
    assert all(a["failure"] == "budget" for a in doc2["attempts"])
    LM.main(argv2, run=_fake_runner(limits, calls, set()))
    doc2 = json.loads(open(state2).read())
    assert [a.get("failure") for a in doc2["attempts"]][-1] == "host_oom"
    plots = load_script("plot_results")
    path = plots.plot_largest(state, str(tmp_path))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_largest_model_cpu_end_to_end(tmp_path):
    """Through bench_train's processes on the CPU: a profile with room trains the tiny GPT on one core within the
    host limit it hands TrainStream; one of 0.1 GiB is killed by the host watchdog; a second call resumes."""
    repo = EXPERIMENTS.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    state = tmp_path / "largest.json"
    cmd = [sys.executable, str(EXPERIMENTS / "largest_model.py"), "--device", "cpu", "--profiles", "8g16c1,1g0.1c1",
           "--sizes", "tiny", "--setups", "ts_cpu", "--batch", "2", "--seq", "32", "--vocab", "256",
           "--state", str(state)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0 and "complete" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(state.read_text())
    ok, killed = doc["attempts"]
    assert ok["step_ms_median"] > 0 and ok["threads"] == 1
    applied = ok["profile_applied"]
    assert applied["affinity"] == sorted(os.sched_getaffinity(0))[:1] and applied["torch_threads"] == 1
    assert applied["host_limit_env"] == str(16 << 30) and applied["gpu_cap"] == "not applied (no CUDA)"
    assert killed["failure"] == "host_oom" and "profile violation" in killed["error"]
    assert doc["common"][0]["from_search"] is True
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and len(json.loads(state.read_text())["attempts"]) == 2


def test_gpu_cap_arithmetic_and_violation(monkeypatch):
    """The allocator's share of a GPU profile (its bytes less the context, the resident state and the context's
    growth) and the violation of a device peak above it, with torch.cuda's calls stood in for (no GPU here)."""
    import torch

    gib, total = 2**30, 80 * 2**30
    free = [total - gib]  # the context: 1 GiB
    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free[0], total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, *a: got.setdefault("fraction", f))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 5 * gib)
    threads = torch.get_num_threads()
    try:
        cap = PROFILE.GpuCap(PROFILE.parse("24g64c1"), resident_bytes=3 * gib, interval=0.001)
        assert torch.get_num_threads() == 1
        allow = 24 * gib - gib - 3 * gib - PROFILE.CONTEXT_GROWTH
        assert got["fraction"] == allow / total and cap.info["allocator_cap_gib"] == allow / gib
        free[0] = total - 25 * gib  # the device's used memory passes the profile
        import time

        time.sleep(0.05)
        info = cap.report()
        assert info["gpu_peak_used_gib"] == 25 and "above the profile's 24.00 GiB" in info["violation"]
        assert info["allocator_peak_reserved_gib"] == 5
        with pytest.raises(MemoryError, match="no GPU memory left"):
            PROFILE.GpuCap(PROFILE.parse("4g64c1"), resident_bytes=3 * gib)
    finally:
        torch.set_num_threads(threads)
