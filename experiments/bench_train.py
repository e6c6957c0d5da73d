# Run (GPU machine): python experiments/bench_train.py --configs 125m:8,350m:8,1.3b:8,1.3b:24 --json $OUT/bench_train.json
"""End-to-end training benchmark: the GPT of models_torch.py (``_common.SIZES``: 125M to 20B; bf16
matmuls) on batches of B x ``--seq`` tokens, every optimizer placement at the same
numerics; per setup step time, tokens/s, MFU, peak GPU memory and peak host memory.

Setups (``--setups``):
  amp_fused        fp32 weights + bf16 autocast + torch.optim.AdamW(fused=True) in GPU memory
  bf16_fused       bf16 weights + torch.optim.AdamW(fused=True) in GPU memory
  ts_cpu           bf16 weights, OffloadAdamW mode="cpu" (torch's bf16 state on the host, 4 B/param)
  ts_gpu           bf16 weights, OffloadAdamW mode="gpu"
  ts_hybrid        bf16 weights, OffloadAdamW mode="hybrid"
  ts_*_eager       the same, the update started during backward (``last_micro_batch()``)
  torchao_fp32     fp32 weights + autocast + torchao CPUOffloadOptimizer (fp32 host state: our numerics)
  torchao_bf16     bf16 weights + torchao CPUOffloadOptimizer (its recommended bf16 setup)
  ds_zero_offload  DeepSpeed ZeRO-2 with offload_optimizer=cpu (DeepSpeedCPUAdam), bf16
  ds_zero_offload_bf16  the same with bf16 master weights, gradients and optimizer states on the host
                   (``bf16_optimizer_states``: ~6 instead of ~16 bytes per parameter; not torch's bits)
A TrainStream setup may end in ``@N`` (N host threads) and in options: ``~niceN``
(worker_nice, default 5), ``~ebN`` (eager_blocks), ``~shareF`` (gpu_share), ``~resG``
(gpu_state_bytes of G GiB), ``~gc0``/``~gc1`` (grad_copies=False/True), ``~spec0``/``~spec1``
(speculate=False/True), ``~auto`` (gpu_state_bytes="auto"), ``~overlap``
(overlap_forward=model), ``~fused`` (fused=True: bf16_fused's bits), ``~master``
(master_weights=True: fp32 master and moments), ``~bounded`` (bounded_staging=True: the gradient and weights
read per chunk through a pinned ring, the host holding the moments alone), ``~base`` (OffloadAdamW from an earlier tree for an A/B:
``git archive COMMIT trainstream | tar -x -C .base_tree && mv .base_tree/trainstream
.base_tree/trainstream_base``). Any setup: ``~clipX`` (TrainStream max_grad_norm=X, in-GPU
setups clip_grad_norm_; not torchao or DeepSpeed).

Each setup runs in a fresh subprocess with ``--timeout`` seconds, within ``--budget`` for the
whole run; the JSON is rewritten after every setup. "step ms": median of ``--steps`` steps
after ``--warmup``, each ended by a device synchronize; "stream": ``--stream-steps`` steps back
to back with one drain at the end (counted: an upper bound). Host memory: the drop of the
machine's ``MemAvailable`` during the setup, sampled by the parent every 0.1 s
(``host_used_peak_gib``), the child's high-water mark (``host``) and TrainStream's
``host_state_gib``; below ``--host-reserve-gib`` the setup is killed as a host OOM. MFU =
6 x params x tokens / step time / ``--peak-tflops`` (H200 bf16 dense: 989). ``--ckpt``
checkpoints every block's activations in every setup; ``--lean`` keeps only the timed steps
(no per-phase memory step, forward probe or back-to-back steps). ``--trace SETUPS``: two more steps with the engine's host timeline (``_trace_report.py``), a Chrome trace file
per setup in ``--trace-dir``. ``~lclipX`` (TrainStream setups): the loop itself calls
``clip_grad_norm_(params, X)`` between backward and ``step()``, as trainers do (#42: speculation validates it);
the row then carries the speculation counters (steps committed / redone, redo ms). ``--device cpu`` is a smoke test (CUDA-only setups skipped):
``python experiments/bench_train.py --device cpu --configs tiny:2 --seq 64 --vocab 512 --steps 2 --warmup 1 --lean``.
``--profile 24g64`` / ``80g128`` / ``whole``: every setup held to a smaller machine's GPU memory, host memory and
cores (``_profile.py`` says how); the row's ``profile`` entry says what was applied and any violation.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _trace_report as _trace  # noqa: E402
import _profile  # noqa: E402
from _common import SIZES, VOCAB, git_commit  # noqa: E402
from models_torch import GPT  # noqa: E402

PEAK_TFLOPS = 989.0  # H200 SXM, bf16 tensor cores, dense
HP = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
IN_GPU = ("bf16_fused", "amp_fused")
CUDA_ONLY = ("ts_gpu", "ts_hybrid", "torchao", "ds_")
#: ``~option`` prefix -> (OffloadAdamW argument, value from the option's rest)
TS_OPTIONS = {"nice": ("worker_nice", int), "eb": ("eager_blocks", int), "share": ("gpu_share", float),
              "res": ("gpu_state_bytes", lambda v: int(float(v) * 2**30)),
              "gc": ("grad_copies", lambda v: bool(int(v))), "spec": ("speculate", lambda v: bool(int(v)))}


def host_copy_gbs(nbytes: int = 2**30, rounds: int = 4) -> float:
    """The host's memory bandwidth as torch's threads copy ``nbytes`` (read + write, GB/s, the best of ``rounds``):
    which host a run got (the cpu mode's updates are bound by it; the machines lent differ 2x from run to run)."""
    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * nbytes / (time.perf_counter() - t) / 1e9)
    return best


def _base_name(setup: str) -> str:
    return setup.split("~")[0].split("@")[0]


def deepspeed_engine(model, batch: int, clip: float | None = None, bf16_states: bool = False):
    """DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam), bf16; ``bf16_states``: bf16
    master weights, gradients and Adam moments on the host (DeepSpeed's ``bf16_optimizer_states``)."""
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import deepspeed  # noqa: PLC0415

    bf16 = {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                if bf16_states else {})}
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "bf16": bf16,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "overlap_comm": True, "contiguous_gradients": True},
           "optimizer": {"type": "AdamW", "params": {"lr": HP["lr"], "betas": list(HP["betas"]),
                                                     "weight_decay": HP["weight_decay"]}},
           "steps_per_print": 10**9, **({"gradient_clipping": clip} if clip is not None else {})}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def build(setup: str, size: str, device, batch=8, ckpt=False, vocab=VOCAB, seq=1024):
    """``(model, optimizer or None, autocast, eager, clip_fn)`` of ``setup`` (module docstring);
    the model created on ``device`` in its dtype (fp32 for amp_fused and torchao_fp32, else bf16)."""
    name, *opts = setup.split("~")
    name, _, threads = name.partition("@")

    def opt_value(prefix):
        return next((o[len(prefix):] for o in opts if o.startswith(prefix) and o[len(prefix):][:1].isdigit()), None)

    unknown = [o for o in opts if o not in ("base", "auto", "overlap", "fused", "master", "bounded") and not any(
        o.startswith(p) and o[len(p):][:1].isdigit() for p in ("clip", "lclip", *TS_OPTIONS))]
    if unknown:
        raise ValueError(f"{setup}: unknown option(s) {', '.join('~' + o for o in unknown)} (see the module docstring)")
    clip = float(opt_value("clip")) if opt_value("clip") is not None else None
    lclip = float(opt_value("lclip")) if opt_value("lclip") is not None else None
    if lclip is not None and (clip is not None or not name.startswith("ts_")):
        raise ValueError(f"{setup}: ~lclip is for TrainStream setups without ~clip (in-GPU setups: ~clip is the loop's)")
    if clip is not None and name.endswith("_eager"):
        raise ValueError(f"{setup}: the eager path is off with clipping (use the setup without _eager)")
    torch.manual_seed(0)
    dtype = torch.float32 if name in ("amp_fused", "torchao_fp32") else torch.bfloat16
    layers, d, heads = SIZES[size]
    model = GPT(layers, d, heads, vocab=vocab, ctx=max(seq, 1024), device=device, dtype=dtype, ckpt=ckpt)
    params = list(model.parameters())
    opt = None
    if name in IN_GPU:
        opt = torch.optim.AdamW(params, fused=True, **HP)
    elif name.startswith("ts_"):
        if "base" in opts:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".base_tree"))
            from trainstream_base.torch import OffloadAdamW
        else:
            from trainstream.torch import OffloadAdamW
        extra = {"worker_nice": 5}
        for prefix, (arg, parse) in TS_OPTIONS.items():
            if opt_value(prefix) is not None:
                extra[arg] = parse(opt_value(prefix))
        extra.update({"gpu_state_bytes": "auto"} if "auto" in opts else {})
        extra.update({"overlap_forward": model} if "overlap" in opts else {})
        extra.update({"fused": True} if "fused" in opts else {})
        extra.update({"master_weights": True} if "master" in opts else {})
        extra.update({"bounded_staging": True} if "bounded" in opts else {})
        mode = name[3:].removesuffix("_eager")
        if mode not in ("cpu", "gpu", "hybrid"):
            raise ValueError(f"unknown setup {setup!r}")
        opt = OffloadAdamW(params, mode=mode, threads=int(threads) if threads else None, max_grad_norm=clip,
                           **extra, **HP)
    elif clip is not None:
        raise ValueError(f"~clip is not implemented for {setup}")
    elif name in ("ds_zero_offload", "ds_zero_offload_bf16"):
        model = deepspeed_engine(model, batch, bf16_states=name.endswith("_bf16"))
    elif name in ("torchao_fp32", "torchao_bf16"):
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **HP)
    else:
        raise ValueError(f"unknown setup {setup!r}")
    clip_fn = None
    if clip is not None and not name.startswith("ts_"):
        clip_fn = lambda: torch.nn.utils.clip_grad_norm_(params, clip)  # noqa: E731
    if lclip is not None:
        clip_fn = lambda: torch.nn.utils.clip_grad_norm_(params, lclip)  # noqa: E731
    return model, opt, name in ("amp_fused", "torchao_fp32"), name.endswith("_eager"), clip_fn


def host_memory_self() -> dict:
    """This process's host memory, GiB: ``ru_maxrss``, and ``VmHWM``, ``VmRSS``, ``VmLck``, ``VmPin``."""
    import resource  # noqa: PLC0415

    out = {"ru_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
    try:
        for line in open("/proc/self/status"):
            if line.split(":")[0] in ("VmHWM", "VmRSS", "VmLck", "VmPin"):
                out[f"{line.split(':')[0]}_gib"] = int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return out


def run(setup, size, batch, seq, steps, warmup, device, trace_dir=None, stream_steps=0, ckpt=False, lean=False,
        vocab=VOCAB, peak_flops=PEAK_TFLOPS * 1e12) -> dict:
    """Build ``setup`` at ``size``, time ``steps`` steps after ``warmup``, return its row."""
    cuda = torch.device(device).type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def allocated(peak=False):
        return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) if cuda else 0

    gc.collect()
    base = allocated()  # what an earlier setup left allocated (torchao keeps its model): subtracted
    t_build = time.perf_counter()
    model, opt, autocast, eager, clip_fn = build(setup, size, device, batch, ckpt=ckpt, vocab=vocab, seq=seq)
    sync()
    build_s = time.perf_counter() - t_build
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, vocab, (batch, seq), device=device, generator=torch.Generator(device=device).manual_seed(1))

    def forward():
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=autocast):
            return F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())

    def backward(loss):
        if opt is None:  # DeepSpeed's engine
            model.backward(loss)
        elif eager:
            with opt.last_micro_batch():
                loss.backward()
        else:
            loss.backward()

    def update():
        if opt is None:
            model.step()
            return
        if clip_fn is not None:
            clip_fn()
        opt.step()
        opt.zero_grad()

    def one_step():
        with _trace.span("forward"):
            loss = forward()
        with _trace.span("backward"):
            backward(loss)
        with _trace.span("step"):
            update()

    def timed(fn) -> float:
        """Seconds of ``fn()`` from one device synchronize to the next."""
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    times, stats0 = [], None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if i == warmup and hasattr(opt, "stats"):
            stats0 = opt.stats()
        times.append(timed(one_step))
    first_step_s, times = times[0], times[warmup:]
    row = {}
    peak = allocated(peak=True)
    if not lean:  # one more step: the memory at the end of each phase and the peak within it
        phases, out = {}, None
        for phase, fn in (("forward", forward), ("backward", backward), ("step", update)):
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out = fn(out) if phase == "backward" else fn()  # the loss, kept until its backward
            sync()
            phases[phase] = {"end_gib": (allocated() - base) / 2**30, "peak_gib": (allocated(True) - base) / 2**30}
        del out
        row["mem_phases"] = phases
        if stream_steps:  # back to back, as a training loop runs; one drain at the end, counted
            def stream():
                for _ in range(stream_steps):
                    one_step()
                if hasattr(opt, "synchronize"):
                    opt.synchronize()

            row["step_ms_stream"] = 1e3 * timed(stream) / stream_steps
        if _base_name(setup) in IN_GPU:  # the forward alone: the clipping target's term
            row["forward_ms"] = 1e3 * statistics.median(timed(forward) for _ in range(3))
    if trace_dir is not None:
        try:
            _trace.start()  # until stop(): the engine's methods wrapped to record spans
            for _ in range(2):
                with _trace.span("sync"):
                    sync()
                one_step()
            with _trace.span("sync"):
                sync()
            if hasattr(opt, "synchronize"):
                opt.synchronize()
        finally:
            spans = _trace.stop()
        os.makedirs(trace_dir, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{size}x{batch}_{setup}")
        with open(os.path.join(trace_dir, f"trace_{name}.json"), "w") as f:
            json.dump(_trace.chrome_trace(spans), f)
        row["host_trace"] = _trace.summary(spans, phases=("forward", "backward", "step", "sync"))
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    sync()
    row["peak_gib"] = (max(peak, allocated(True)) - base) / 2**30
    if cuda:
        row.update(device=torch.cuda.get_device_name(), gpu_total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    if hasattr(opt, "stats"):
        st = opt.stats()
        row["peak_gib"] += st.get("gpu_state_bytes", 0.0) / 2**30  # GPU memory outside torch's allocator
        row.update(threads=st.get("threads", 0.0), host_update_wall_ms_last=st.get("last_step_wall_ms", 0.0))
        for k in ("host_state_bytes", "pinned_state_bytes", "gpu_state_bytes"):
            row[k.replace("_bytes", "_gib")] = st.get(k, 0.0) / 2**30
        n = max(st["steps"] - stats0["steps"], 1.0)  # per step since stats0, the extra steps counted
        row["worker_update_cpu_ms_per_step"] = (st["update_ms_total"] - stats0["update_ms_total"]) / n
        for k in ("spec_steps_committed", "spec_steps_redone", "redo_ms_total", "backup_ms_total",
                  "precopy_ms_total"):  # #42's counters, whole run (copies kept by the updates / taken ahead)
            if k in st:
                row[k] = st[k]
    row["host"] = host_memory_self()  # before the teardown: the state is still there
    if hasattr(opt, "close"):
        opt.close()
    med = statistics.median(times)
    return {"setup": setup, "size": size, "params_M": n_params / 1e6, "batch": batch, "seq": seq, "ckpt": ckpt,
            "step_ms_median": 1e3 * med, "step_ms_min": 1e3 * min(times), "steps_timed": len(times),
            "tokens_per_s": batch * seq / med, "mfu": 6 * n_params * batch * seq / med / peak_flops,
            "left_by_earlier_setups_gib": base / 2**30, "build_s": build_s, "first_step_s": first_step_s, **row}


def _failure_kind(text: str) -> str:
    if re.search(r"\bMemoryError|host memory|pinned|cudaHostAlloc|cudaHostRegister|Cannot allocate memory|bad_alloc", text, re.I):
        return "host_oom"
    return "gpu_oom" if "out of memory" in text.lower() else "error"


def child_main(spec: dict) -> None:
    """One setup in this fresh process: its row, or its failure, to ``spec["out"]``."""
    try:  # a host OOM must kill this process, not the benchmark's parent
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 2000))  # DeepSpeed's one-process group
    if spec["device"] == "cuda":
        torch.zeros(1, device="cuda")  # the context, outside the setup's timings
    profile, cap = _profile.parse(spec.get("profile", "whole")), None
    try:
        opts = spec["setup"].split("~")[1:]
        if "auto" in opts and profile.gpu_bytes is not None:
            raise ValueError(f"{spec['setup']}: gpu_state_bytes='auto' reads the device's free memory, not the "
                             f"profile's GPU cap ({profile.name}): give ~resG instead")
        res = next((TS_OPTIONS["res"][1](o[3:]) for o in opts if o.startswith("res")), 0)
        cap = _profile.GpuCap(profile, resident_bytes=res)
        row = run(**{k: v for k, v in spec.items() if k not in ("out", "profile")})
    except BaseException as exc:  # noqa: BLE001 - the row says what failed
        text = f"{type(exc).__name__}: {exc}"
        row = {"setup": spec["setup"], "size": spec["size"], "batch": spec["batch"], "error": text[:600],
               "failure": _failure_kind(text), "host": host_memory_self()}
    if cap is not None:
        row["profile"] = cap.report()
    with open(spec["out"], "w") as f:
        json.dump(row, f)


def _meminfo_available() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_isolated(spec: dict, timeout: float, log_path: str, reserve_gib: float) -> dict:
    """``spec`` in a fresh subprocess (its own session) within its profile (``_profile.spawn_kwargs``): the
    parent samples ``MemAvailable`` and the session's resident memory every 0.1 s and kills the child below
    ``reserve_gib`` or above the profile's host memory (a host OOM) or after ``timeout``."""
    if os.path.exists(spec["out"]):
        os.remove(spec["out"])
    profile = _profile.parse(spec.get("profile", "whole"))
    avail0 = _meminfo_available()
    min_avail, killed, t0, tree_peak = avail0, None, time.perf_counter(), 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                **_profile.spawn_kwargs(profile))
        while proc.poll() is None:
            time.sleep(0.1)
            avail = _meminfo_available()
            tree_peak = max(tree_peak, _profile.tree_rss(proc.pid))
            if profile.host_bytes is not None and tree_peak > profile.host_bytes:
                killed = (f"host_oom: profile violation: the setup's processes held {tree_peak / 2**30:.1f} GiB, above "
                          f"the {profile.name} profile's {profile.host_bytes / 2**30:g} GiB of host memory, killed")
            if avail is not None:
                min_avail = min(min_avail, avail)
                if avail < reserve_gib * 2**30:
                    killed = f"host_oom: MemAvailable {avail / 2**30:.1f} GiB < {reserve_gib} GiB, killed by the benchmark"
            if killed is None and time.perf_counter() - t0 > timeout:
                killed = f"timeout: still running after {timeout:.0f} s, killed"
            if killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                break
    row = None
    if killed is None and os.path.exists(spec["out"]):
        with open(spec["out"]) as f:
            row = json.load(f)
    if row is None:
        rc = proc.returncode
        kind, why = (killed.split(":")[0], killed) if killed else (
            ("host_oom", "SIGKILL from outside (the kernel's OOM killer, most likely)") if rc == -9 else
            ("crash", f"exited with {rc} without a row"))
        with open(log_path, errors="replace") as f:
            tail = f.read()[-1500:]
        row = {"setup": spec["setup"], "size": spec["size"], "batch": spec["batch"], "error": why, "failure": kind,
               "returncode": rc, "log_tail": tail}
    row.update(wall_s=time.perf_counter() - t0, log=log_path, host_tree_peak_gib=tree_peak / 2**30)
    if avail0 is not None:
        row["host_used_peak_gib"] = (avail0 - min_avail) / 2**30  # the machine's, above the start
    return row


def one_line(r: dict, elapsed: float) -> str:
    """The row as one line: time, throughput, MFU, memory, or why it has none."""
    head = f"[{elapsed:6.0f} s] {r['size'] + ' x' + str(r['batch']):9s} {r['setup']:18s}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if "step_ms_median" not in r:
        fits = "DOES NOT FIT" if r.get("failure") in ("gpu_oom", "host_oom") else "FAILED"
        return f"{head} {fits} ({r.get('failure')}): {r.get('error', '')[:160]} [host +{r.get('host_used_peak_gib', 0):.1f} GiB]"
    return (f"{head} {r['step_ms_median']:9.1f} ms {r['tokens_per_s']:9.0f} tok/s MFU {100 * r['mfu']:5.1f}% | "
            f"GPU peak {r['peak_gib']:6.2f} GiB | host +{r.get('host_used_peak_gib', math.nan):.1f} GiB "
            f"(RSS HWM {r['host'].get('VmHWM_gib', math.nan):.1f}) | build {r['build_s']:.1f} s, "
            f"1st step {r['first_step_s']:.1f} s, wall {r.get('wall_s', math.nan):.0f} s")


def print_tables(rows: list) -> None:
    """Step times against bf16 in-GPU and torchao fp32; the clipping target; memory by phase; traces."""
    print(f"\n{'config':10s} {'setup':20s} {'step ms':>8s} {'MFU':>5s} {'peak GiB':>8s} {'host GiB':>8s} {'vs bf16':>7s} "
          f"{'vs ao32':>7s} {'host wall':>9s} {'stream':>7s}")
    for r in rows:
        same = {q["setup"]: q for q in rows if (q["size"], q["batch"]) == (r["size"], r["batch"])}
        b, t = (same.get(k, {}).get("step_ms_median", math.nan) for k in ("bf16_fused", "torchao_fp32"))
        ms = r["step_ms_median"]
        print(f"{r['size'] + 'x' + str(r['batch']):10s} {r['setup']:20s} {ms:8.1f} {100 * r['mfu']:5.1f} {r['peak_gib']:8.2f} "
              f"{r.get('host_used_peak_gib', math.nan):8.1f} {ms / b:7.2f} {ms / t:7.2f} "
              f"{r.get('host_update_wall_ms_last', math.nan):9.1f} {r.get('step_ms_stream', math.nan):7.1f}")
        clip = next((o.removeprefix("l") for o in r["setup"].split("~")[1:] if o.startswith(("clip", "lclip"))), None)
        ref = same.get(f"bf16_fused~{clip}")
        if ref and r["setup"].startswith("ts_"):
            print(f"  vs bf16_fused~{clip} (in-GPU, the loop clips): {ms / ref['step_ms_median']:.3f}x")
        if "spec_steps_committed" in r:
            print(f"  speculation: {r['spec_steps_committed']:.0f} steps committed, {r['spec_steps_redone']:.0f} redone, "
                  f"{r['redo_ms_total']:.1f} ms in redos (whole run)")
        if r["setup"].startswith("ts_") and clip and ref and "forward_ms" in ref:
            host = r.get("host_update_wall_ms_last", math.nan)
            target = (ref["step_ms_median"] + max(0.0, host - ref["forward_ms"])) * 1.05
            print(f"  clipping target: (bf16 {ref['step_ms_median']:.1f} + max(0, host update {host:.1f} - forward "
                  f"{ref['forward_ms']:.1f})) x 1.05 = {target:.1f} ms; measured {ms / target:.2f}x the target")
        if "mem_phases" in r:
            print("  GPU memory by phase, GiB at the end / peak within: " + ", ".join(
                f"{k} {v['end_gib']:.2f} / {v['peak_gib']:.2f}" for k, v in r["mem_phases"].items()))
        for p in r.get("host_trace", {}).get("phases", []):  # --trace: the engine's host timeline
            print(f"  trace {p['phase']:9s} {p['ms']:7.1f} ms: workers {p['worker_util']:.2f} busy, "
                  f"wait_ready {p['wait_ready']['n']} x / {p['wait_ready']['total_ms']:.1f} ms, "
                  f"gradient hooks {p['offload_grad']['n']} x / {p['offload_grad']['total_ms']:.1f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="350m:8", help="comma list of model:batch")
    ap.add_argument("--setups", default="bf16_fused,amp_fused,ts_cpu,ts_cpu_eager,ts_gpu,torchao_fp32,torchao_bf16,ds_zero_offload")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stream-steps", type=int, default=6, help="steps back to back after the timed ones (0: off)")
    ap.add_argument("--trace", default="", help="comma list of setups to trace (2 more steps): host timeline")
    ap.add_argument("--trace-dir", default=".", help="where the Chrome trace files of --trace go")
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing of every block, in every setup")
    ap.add_argument("--lean", action="store_true", help="only the timed steps")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the MFU's peak (default: H200 bf16 dense)")
    ap.add_argument("--order", choices=["config", "setup"], default="config",
                    help="every setup of a config, then the next config; or every config of a setup, then the next")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per setup before it is killed")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--host-reserve-gib", type=float, default=2.5, help="kill a setup below this MemAvailable")
    ap.add_argument("--prebuild-ds", action="store_true", help="build DeepSpeed's cpu_adam in the background first")
    ap.add_argument("--profile", default="whole", help="a machine to emulate: 24g64, 80g128, whole (_profile.py)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child is not None:
        return child_main(json.loads(args._child))
    t_start = time.perf_counter()
    try:
        _profile.cores_of(_profile.parse(args.profile))
    except ValueError as exc:
        ap.error(str(exc))
    cfgs = [(c.partition(":")[0], int(c.partition(":")[2] or 8)) for c in args.configs.split(",") if c]
    for size, _ in cfgs:
        if size not in SIZES:
            ap.error(f"unknown model size {size!r} (known: {', '.join(SIZES)})")
    log_dir = (args.json + ".logs") if args.json else f"/tmp/bench_train_{os.getpid()}"
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    meta = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
            "commit": git_commit(), "peak_flops": args.peak_tflops * 1e12, "host_copy_gbs": host_copy_gbs()}
    print(f"host: {meta['host_copy_gbs']:.0f} GB/s, best of 4 copies of 1 GiB (read + write; the H200 machine's "
          "in-place a += s*b: 112-117 GB/s; session s's H100s, whose cpu-mode updates took 2.5x session r's: 57-84)",
          flush=True)
    prebuild = None
    if args.prebuild_ds and args.device == "cuda" and "ds_" in args.setups:
        prebuild = subprocess.Popen([sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; "
                                     "CPUAdamBuilder().load()"], stdout=open(os.path.join(log_dir, "prebuild_ds.log"), "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=lambda: os.nice(19))

    def remaining():
        return args.budget - (time.perf_counter() - t_start) if args.budget else float("inf")

    def save():
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump({"args": vars(args), "meta": meta, "rows": rows}, f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    setups = [s for s in args.setups.split(",") if s]
    plan = [(c, s) for c in cfgs for s in setups] if args.order == "config" else [(c, s) for s in setups for c in cfgs]
    for (size, batch), setup in plan:
        row = {"setup": setup, "size": size, "batch": batch}
        if args.device != "cuda" and _base_name(setup).startswith(CUDA_ONLY):
            row["skipped"] = "needs CUDA"
        elif remaining() < 15:
            row["skipped"] = f"time budget ({args.budget:.0f} s) spent"
        else:
            if prebuild is not None and _base_name(setup) not in IN_GPU:  # wait for DeepSpeed's build
                try:
                    prebuild.wait(timeout=max(1.0, min(remaining(), 900)))
                    prebuild = None
                except subprocess.TimeoutExpired:
                    pass
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{size}x{batch}_{setup}")
            spec = dict(setup=setup, size=size, batch=batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
                        device=args.device, trace_dir=args.trace_dir if setup in args.trace.split(",") else None,
                        stream_steps=args.stream_steps, ckpt=args.ckpt, lean=args.lean, vocab=args.vocab,
                        peak_flops=args.peak_tflops * 1e12, out=os.path.join(log_dir, name + ".row.json"),
                        profile=args.profile)
            row = run_isolated(spec, min(args.timeout, remaining()), os.path.join(log_dir, name + ".log"),
                               args.host_reserve_gib)
        rows.append(row)
        print(one_line(row, time.perf_counter() - t_start), flush=True)
        save()
    if prebuild is not None:  # never waited for: stop it
        prebuild.kill()
    done = [r for r in rows if "step_ms_median" in r]
    if done:
        print_tables(done)
    save()
    print(f"total {time.perf_counter() - t_start:.0f} s" + (f"; JSON {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
