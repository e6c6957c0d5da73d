# Run (GPU machine; resumable, repeat the same command until it prints "complete"): python experiments/largest_model.py --profiles 24g64 --state $OUT/largest.json --budget 540 --prebuild-ds
"""The largest GPT (``_common.SIZES``, 125M to 30B) each setup trains within each machine profile (#37 item 3),
then the step time of every setup at the largest size that all of them fit.

Setups (``--setups``; bench_train.py's, which builds and times them):
  ts_cpu          OffloadAdamW mode="cpu", torch's bf16 state on the host, eager path  (ts_cpu_eager)
  ts_cpu_bounded  the same with bounded_staging=True (the host keeps the moments only)  (ts_cpu_eager~bounded)
  ts_cpu_master   the same with master_weights=True (fp32 master and moments)       (ts_cpu_eager~master)
  ts_cpu_res      the same as ts_cpu with gpu_state_bytes: what the profile's GPU memory has left beside the
                  model (the GPU peak of ts_cpu at the nearest size measured, scaled by the parameters)
  bf16_fused, amp_fused      torch.optim.AdamW(fused=True) in GPU memory, bf16 weights / fp32 weights with AMP
  torchao_bf16, torchao_fp32 torchao CPUOffloadOptimizer, bf16 / fp32 state
  ds_zero_offload, ds_zero_offload_bf16  DeepSpeed ZeRO-2 offload, fp32 / bf16 optimizer states

Every attempt is one bench_train setup in its own process (``--steps`` timed steps after ``--warmup``, activation
checkpointing, ``--batch`` x ``--seq`` tokens) within the profile (``_profile.py``: GPU cap, host memory
watchdog and ``TRAINSTREAM_HOST_LIMIT``, cores), killed after ``--timeout`` s. A size fits where its steps ran
without an out-of-memory error, a profile violation or a timeout. The search per (profile, setup) starts at the
size a memory estimate (:data:`BYTES_PER_PARAM`) predicts, gallops up while sizes fit, down while they do not,
then bisects: a few attempts each. Every attempt is appended to ``--state`` (JSON) as it ends; a later call with
the same file goes on where the last stopped (an attempt cut by ``--budget`` is redone), so several 10-minute
calls make one search. A failure that is not about memory (an import error, a crash) stops that setup's search,
its log named in the summary; ``--retry-errors`` drops such attempts and tries again. When every search of a profile is done, each setup runs at the largest size all fitted
(a search attempt at that size counts). ``python experiments/plot_results.py --largest STATE.json`` plots it.
CPU smoke test (seconds): ``python experiments/largest_model.py --device cpu --profiles 8g16c1 --sizes tiny,mini
--state /tmp/largest.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _profile  # noqa: E402
from _common import SIZES, VOCAB, git_commit, param_count  # noqa: E402

GIB = 2**30
#: label -> bench_train setup (``{res}``: ts_cpu_res's gpu_state_bytes in GiB, per attempt)
SETUPS = {"ts_cpu": "ts_cpu_eager", "ts_cpu_bounded": "ts_cpu_eager~bounded", "ts_cpu_master": "ts_cpu_eager~master", "ts_cpu_res": "ts_cpu_eager~res{res}",
          "bf16_fused": "bf16_fused", "amp_fused": "amp_fused", "torchao_bf16": "torchao_bf16",
          "torchao_fp32": "torchao_fp32", "ds_zero_offload_bf16": "ds_zero_offload_bf16",
          "ds_zero_offload": "ds_zero_offload"}
CPU_SETUPS = ("ts_cpu", "ts_cpu_bounded", "ts_cpu_master", "bf16_fused", "amp_fused")
#: label -> (GPU, host) bytes per parameter, for the search's first size only (RESULTS' 3B-13B figures, rounded up)
BYTES_PER_PARAM = {"ts_cpu": (2.5, 10), "ts_cpu_bounded": (2.5, 4.5), "ts_cpu_master": (2.5, 20), "ts_cpu_res": (2.5, 10), "bf16_fused": (8.5, 0),
                   "amp_fused": (18.5, 0), "torchao_bf16": (4.5, 10), "torchao_fp32": (10.5, 17.5),
                   "ds_zero_offload_bf16": (4.5, 10), "ds_zero_offload": (4.5, 24)}
LADDER = ("125m", "350m", "1.3b", "2b", "3b", "4b", "5b", "6b", "7b", "8b", "9b", "10b", "11b", "13b", "15b", "18b",
          "20b", "23b", "25b", "27b", "30b")


def activation_bytes(size: str, batch: int, seq: int, vocab: int) -> float:
    """GPU bytes of checkpointed activations: each block's bf16 input, one block recomputed, the fp32 logits."""
    layers, d, _ = SIZES[size]
    return 2 * batch * seq * d * (layers + 20) + 10 * batch * seq * vocab


def predicted_fit(label: str, params: float, act: float, profile: _profile.Profile, gpu_total: float | None) -> bool:
    """Whether :data:`BYTES_PER_PARAM` says ``label`` fits ``profile`` (the search's first guess only)."""
    gpu = profile.gpu_bytes or gpu_total or math.inf
    host = profile.host_bytes or math.inf
    g, h = BYTES_PER_PARAM[label]
    need_gpu, need_host = g * params + act + GIB, h * params + 4 * GIB
    if label == "ts_cpu_res":  # the state (4 B/param) moves to what the GPU has left
        need_host -= min(4 * params, max(0.0, gpu - need_gpu))
    return need_gpu <= gpu and need_host <= host


def next_index(results: dict[int, bool], n: int, start: int) -> int | None:
    """The next rung of a ladder of ``n`` sizes to try, given ``results`` (rung -> fits), starting at ``start``:
    gallop up from the largest fit while nothing above it failed, down from the smallest failure while nothing
    fitted, else bisect between them. None: done."""
    fits = [i for i, ok in results.items() if ok]
    lo = max(fits, default=None)
    fails = [i for i, ok in results.items() if not ok and (lo is None or i > lo)]
    hi = min(fails, default=None)
    if lo is None and hi is None:
        return min(max(start, 0), n - 1)
    if hi is None:
        return None if lo == n - 1 else min(n - 1, lo + 2 ** (len(fits) - 1))
    if lo is None:
        return None if hi == 0 else max(0, hi - 2 ** (len(fails) - 1))
    return None if hi - lo <= 1 else (lo + hi) // 2


def attempt_fit(row: dict) -> bool | None:
    """True: trained within the profile; False: out of GPU or host memory, a profile violation or a timeout;
    None: inconclusive (cut by the budget, or a failure that is not about memory: the search of that setup stops)."""
    if row.get("failure") == "budget":
        return None
    if "step_ms_median" in row:
        return not row.get("profile_applied", {}).get("violation")
    return False if row.get("failure") in ("gpu_oom", "host_oom", "timeout") else None


class Search:
    """The resumable search: ``state`` (the JSON document) and the bench runner ``run(spec, timeout) -> row``."""

    def __init__(self, args, state: dict, run):
        self.args, self.state, self.run = args, state, run
        self.ladder = [s for s in args.sizes.split(",") if s]
        self.params = {s: param_count(s, args.vocab, max(args.seq, 1024)) for s in self.ladder}
        self.ladder.sort(key=self.params.get)

    def attempts(self, profile: str, label: str) -> list[dict]:
        return [a for a in self.state["attempts"] if a["profile"] == profile and a["label"] == label]

    def results(self, profile: str, label: str) -> dict[int, bool]:
        out = {}
        for a in self.attempts(profile, label):
            fit = attempt_fit(a)
            if fit is not None and a["size"] in self.ladder:
                out[self.ladder.index(a["size"])] = fit
        return out

    def stopped(self, profile: str, label: str) -> str | None:
        """Why the search of ``label`` stopped without an answer: its last attempt failed not for memory."""
        last = (self.attempts(profile, label) or [{}])[-1]
        return None if not last or last.get("failure") == "budget" or attempt_fit(last) is not None else \
            f"{last.get('failure')}: {last.get('error', '')[:200]} (log {last.get('log')})"

    def gpu_total(self) -> float | None:
        tot = [a["profile_applied"]["gpu_total_gib"] * GIB for a in self.state["attempts"]
               if "gpu_total_gib" in a.get("profile_applied", {})]
        return max(tot) if tot else None

    def next_size(self, profile: _profile.Profile, label: str) -> str | None:
        if self.stopped(profile.name, label):
            return None
        start = max((i for i, s in enumerate(self.ladder) if predicted_fit(
            label, self.params[s], activation_bytes(s, self.args.batch, self.args.seq, self.args.vocab), profile,
            self.gpu_total())), default=0)
        i = next_index(self.results(profile.name, label), len(self.ladder), start)
        return None if i is None else self.ladder[i]

    def largest(self, profile: str, label: str) -> str | None:
        fits = [i for i, ok in self.results(profile, label).items() if ok]
        return self.ladder[max(fits)] if fits else None

    def res_gib(self, profile: _profile.Profile, size: str) -> float:
        """ts_cpu_res's gpu_state_bytes at ``size``: the profile's GPU memory less ts_cpu's allocator peak at the
        nearest size measured (scaled up by the parameters), its context, a margin; at most the state's 4 B/param."""
        cap = profile.gpu_bytes or self.gpu_total()
        ref = [a for a in self.attempts(profile.name, "ts_cpu") if "allocator_peak_reserved_gib" in
               a.get("profile_applied", {}) and attempt_fit(a)]
        if cap is None:
            return 0.0
        p = self.params[size]
        if ref:
            r = min(ref, key=lambda a: abs(math.log(self.params[a["size"]] / p)))
            peak = r["profile_applied"]["allocator_peak_reserved_gib"] * GIB * max(1.0, p / self.params[r["size"]])
            ctx = r["profile_applied"].get("context_gib", 0.6) * GIB
        else:
            peak = BYTES_PER_PARAM["ts_cpu"][0] * p + activation_bytes(size, self.args.batch, self.args.seq,
                                                                        self.args.vocab)
            ctx = 0.6 * GIB
        left = cap - ctx - _profile.CONTEXT_GROWTH - 1.08 * peak - GIB
        return round(max(0.0, min(left, 4.0 * p)) / GIB, 1)

    def attempt(self, profile: _profile.Profile, label: str, size: str, timeout: float, steps: int,
                warmup: int) -> dict:
        setup = SETUPS[label].format(res=self.res_gib(profile, size) if "{res}" in SETUPS[label] else "")
        a = self.args
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{profile.name}_{size}_{setup}")
        spec = dict(setup=setup, size=size, batch=a.batch, seq=a.seq, steps=steps, warmup=warmup, device=a.device,
                    trace_dir=None, stream_steps=0, ckpt=True, lean=True, vocab=a.vocab, peak_flops=989e12,
                    out=os.path.join(a.log_dir, name + ".row.json"), profile=profile.name)
        row = self.run(spec, timeout, os.path.join(a.log_dir, name + ".log"))
        if row.get("failure") == "timeout" and timeout < a.timeout - 1:
            row["failure"] = "budget"  # cut by the call's budget, not the attempt's timeout: redone next call
        keep = ("setup", "size", "batch", "params_M", "step_ms_median", "step_ms_min", "steps_timed", "peak_gib",
                "host_tree_peak_gib", "host_used_peak_gib", "host_state_gib", "gpu_state_gib", "device", "failure",
                "error", "wall_s", "build_s", "first_step_s", "threads", "log")
        out = {k: row[k] for k in keep if k in row}
        out.update(profile=profile.name, label=label, profile_applied=row.get("profile", {}),
                   params_b=self.params[size] / 1e9, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return out


def summary(search: Search, profiles: list[str], labels: list[str]) -> str:
    """Per profile: each setup's largest size and attempts; the step times at the common size."""
    lines = []
    for p in profiles:
        lines.append(f"profile {p}:")
        for label in labels:
            big, n = search.largest(p, label), len(search.attempts(p, label))
            why = search.stopped(p, label)
            top = big is not None and big == search.ladder[-1]
            lines.append(f"  {label:22s} largest {(('>= ' if top else '') + big) if big else 'none':>8s} "
                         f"({search.params[big] / 1e9 if big else 0:7.3g} B) in {n} attempts"
                         + (f"; STOPPED: {why}" if why else ""))
        rows = [c for c in search.state["common"] if c["profile"] == p and "step_ms_median" in c]
        if rows:
            fastest = min(c["step_ms_median"] for c in rows)
            lines.append(f"  at the common size {rows[0]['size']}: " + ", ".join(
                f"{c['label']} {c['step_ms_median']:.0f} ms ({c['step_ms_median'] / fastest:.2f}x)" for c in rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None, run=None) -> int:
    """The command line (``argv``); ``run(spec, timeout, log) -> row``: bench_train's ``run_isolated`` unless given
    (the tests' stand-in)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="24g64,80g128,whole", help="comma list of _profile.py's profiles")
    ap.add_argument("--setups", default=None, help=f"comma list of {', '.join(SETUPS)} (default all; cpu: "
                    f"{', '.join(CPU_SETUPS)})")
    ap.add_argument("--sizes", default=None, help="the ladder, comma list of _common.SIZES (default 125m to 30b)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per attempt (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per attempt")
    ap.add_argument("--budget", type=float, default=540, help="seconds for this call (0: none)")
    ap.add_argument("--min-attempt", type=float, default=60, help="start no attempt with less of the budget left")
    ap.add_argument("--no-common", action="store_true", help="only the searches, not the common size's step times")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--host-reserve-gib", type=float, default=2.5)
    ap.add_argument("--prebuild-ds", action="store_true", help="build DeepSpeed's cpu_adam in the background first")
    ap.add_argument("--state", required=True, help="the JSON of attempts: read, extended, rewritten after each")
    ap.add_argument("--log-dir", default=None, help="each attempt's log (default: STATE.logs)")
    ap.add_argument("--retry-errors", action="store_true",
                    help="drop the state's attempts that failed not for memory (a search stops at one) and go on")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cpu = args.device == "cpu"
    labels = [s for s in (args.setups or ",".join(CPU_SETUPS if cpu else SETUPS)).split(",") if s]
    args.sizes = args.sizes or ",".join(LADDER)
    bad = [x for x in labels if x not in SETUPS or (cpu and x not in CPU_SETUPS)]
    bad += [s for s in args.sizes.split(",") if s and s not in SIZES]
    if bad:
        ap.error(f"unknown (or CUDA-only with --device cpu): {', '.join(bad)}")
    profiles = [_profile.parse(p) for p in args.profiles.split(",") if p]
    for p in profiles:
        _profile.cores_of(p)  # more cores than this machine: refused now
    args.log_dir = args.log_dir or args.state + ".logs"
    os.makedirs(args.log_dir, exist_ok=True)
    state = {"meta": {}, "attempts": [], "common": []}
    if os.path.exists(args.state):
        with open(args.state) as f:
            state = json.load(f)
    if args.retry_errors:
        state["attempts"] = [a for a in state["attempts"] if attempt_fit(a) is not None]
    state["meta"].setdefault("calls", []).append({"argv": sys.argv[1:] if argv is None else argv,
                                                  "commit": git_commit(), "started_utc": time.strftime("%FT%TZ")})

    def save():
        with open(args.state + ".tmp", "w") as f:
            json.dump(state, f, indent=1)
        os.replace(args.state + ".tmp", args.state)

    def run_bench(spec, timeout, log):
        import bench_train  # noqa: PLC0415 - imports torch: only once an attempt runs

        return bench_train.run_isolated(spec, timeout, log, args.host_reserve_gib)

    run = run or run_bench
    search = Search(args, state, run)
    prebuild = None
    if args.prebuild_ds and not cpu and any(x.startswith("ds_") for x in labels):
        log = open(os.path.join(args.log_dir, "prebuild_ds.log"), "w")
        prebuild = subprocess.Popen([sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; "
                                     "CPUAdamBuilder().load()"], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=lambda: os.nice(19))

    cut = []  # an attempt cut by the budget: this call ends there

    def left():
        return 0.0 if cut else args.budget - (time.perf_counter() - t0) if args.budget else math.inf

    def go(profile, label, size, steps, warmup):
        if label.startswith("ds_") and prebuild is not None:
            try:
                prebuild.wait(timeout=max(1.0, left() - args.min_attempt))
            except subprocess.TimeoutExpired:
                pass
        a = search.attempt(profile, label, size, min(args.timeout, left()), steps, warmup)
        print(f"[{time.perf_counter() - t0:5.0f} s] {profile.name:7s} {label:22s} {size:5s} "
              + (f"fits, {a['step_ms_median']:.0f} ms" if attempt_fit(a) else
                 f"{'does not fit' if attempt_fit(a) is False else 'no answer'} ("
                 f"{(a.get('error') or a['profile_applied'].get('violation', ''))[:150]})")
              + f", wall {a.get('wall_s', 0):.0f} s", flush=True)
        if a.get("failure") == "budget":
            cut.append(a)
        return a

    done = True
    for profile in profiles:
        for label in labels:
            while (size := search.next_size(profile, label)) is not None:
                if left() < args.min_attempt:
                    done = False
                    break
                state["attempts"].append(go(profile, label, size, args.steps, args.warmup))
                save()
            done = done and search.next_size(profile, label) is None
        if args.no_common or not done:
            continue
        sizes = [search.largest(profile.name, x) for x in labels]
        sizes = [s for s in sizes if s is not None]
        if not sizes:
            continue
        common = min(sizes, key=search.params.get)
        for label in labels:
            if any(c["profile"] == profile.name and c["label"] == label and attempt_fit(c) is not None
                   for c in state["common"]):
                continue
            prior = [a for a in search.attempts(profile.name, label) if a["size"] == common and attempt_fit(a)]
            if prior:
                state["common"].append(dict(prior[-1], from_search=True))
            elif left() < args.min_attempt:
                done = False
                break
            else:
                state["common"].append(go(profile, label, common, args.steps, args.warmup))
            save()
    if prebuild is not None and prebuild.poll() is None:
        prebuild.kill()
    state["meta"]["complete"] = done
    save()
    print(summary(search, [p.name for p in profiles], labels))
    print(("complete" if done else "NOT complete: run the same command again to go on")
          + f" ({time.perf_counter() - t0:.0f} s; state {args.state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
