# Run (GPU machine): python experiments/bench_jax_gpt.py --sizes 1.3b,3b,7b --rounds 2 --json $OUT/bench_jax_gpt.json  (add --scan: the blocks under nnx.scan)
"""Issue 36's JAX benchmark: a flax nnx GPT (``models_jax.nnx_gpt``: the torch benchmark's shapes, bf16 parameters
(``--param-dtype fp32``: float32 parameters, bf16 compute), float32 logits, every block rematerialised) trained by a jitted step with donation, ``--batch`` x ``--seq`` random
tokens, with each optimizer placement:

  optax_hbm    optax.adamw, state in GPU memory
  jax_pinned   optax.adamw, state in ``pinned_host`` memory moved in and out inside the jitted step (MaxText's
               ``optimizer_memory_host_offload`` scheme)
  ts_gpu       trainstream.jax.offload_adamw(mode="gpu"): state in pinned host memory, the kernel on XLA's stream
  ts_cpu       offload_adamw(mode="cpu"): the host's cores update
  ts_cpu_res   offload_adamw(mode="cpu", gpu_state_bytes="auto"): the state that fits stays in GPU memory

offload_adamw keeps optax.adamw's bf16 state (no master): the same bits as optax.adamw (``--check`` compares a digest
of the weights after 2 steps; on a GPU add ``--deterministic``: XLA's embedding-gradient scatter is not deterministic
otherwise). Every (size, setup) runs in its own process (its peak GPU and host memory; an out-of-memory error is "does
not fit"), the setups of a size one after another, ``--rounds`` times in turn (interleaved: the host's memory
bandwidth drifts between runs); the step is the median of the rounds' medians. Prints step time, tokens/s, MFU (6 x
parameters x tokens / step / ``--peak-tflops``), peak GPU memory, host memory high-water mark, and the largest size
each setup trained. On a GPU ``ts_cpu`` and ``ts_cpu_res`` compute XLA:GPU's lines in IEEE arithmetic (within the
contract's bound: their digest differs from optax's). CPU smoke test: ``--device cpu --sizes tiny --batch 2 --seq 32 --setups optax_hbm,ts_cpu --check``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SIZES, VOCAB, git_commit  # noqa: E402

LR = 1e-4
SETUPS = ("optax_hbm", "jax_pinned", "ts_gpu", "ts_cpu", "ts_cpu_res")
PEAK_TFLOPS = 989.0  # H200 / H100 SXM, bf16 tensor cores, dense
GIB = 2**30
OOM = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError", "OOM")


def _status(key: str) -> float:
    """``/proc/self/status``'s ``key`` (VmHWM, VmRSS) in bytes; 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration):
        return 0


def _build(setup: str, params, loss_fn, dev):
    """``(jitted step(params, state, x, y) -> (params, state), state)`` of ``setup`` (module docstring)."""
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    if setup.startswith("ts_"):
        import trainstream.jax as tsj  # noqa: PLC0415

        kw = {"mode": setup.split("_")[1]} | ({"gpu_state_bytes": "auto"} if setup.endswith("_res") else {})
        tx = tsj.offload_adamw(LR, **kw)
        return jax.jit(lambda p, s, x, y: tx.step(jax.grad(loss_fn)(p, x, y), s, p), donate_argnums=(0, 1)), \
            tx.init(params)
    opt = optax.adamw(LR)
    if setup == "optax_hbm":
        def step(p, s, x, y):
            u, s = opt.update(jax.grad(loss_fn)(p, x, y), s, p)
            return optax.apply_updates(p, u), s

        return jax.jit(step, donate_argnums=(0, 1)), opt.init(params)
    if setup != "jax_pinned":
        raise ValueError(f"unknown setup {setup!r}: one of {', '.join(SETUPS)}")
    on = lambda kind: jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)  # noqa: E731
    state = opt.init(params)
    host = jax.tree.map(lambda _: on("pinned_host"), state)

    def pinned(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)
        s = jax.device_put(s, jax.tree.map(lambda _: on("device"), s))
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), jax.device_put(s, jax.tree.map(lambda _: on("pinned_host"), s))

    out = (jax.tree.map(lambda _: on("device"), params), host)
    return jax.jit(pinned, donate_argnums=(0, 1), out_shardings=out), jax.device_put(state, host)


def child(args) -> dict:
    """One (size, setup) in this process: build, ``--check`` digest after 2 steps, warm up, time."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from models_jax import nnx_gpt  # noqa: PLC0415

    size, setup = args._child.split(":")
    dev = jax.devices()[0]
    t0 = time.perf_counter()
    with jax.default_device(dev):
        pdt = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[args.param_dtype]
        graphdef, params = nnx.split(nnx_gpt(*SIZES[size], vocab=args.vocab, ctx=args.seq, remat=not args.no_remat, scan=args.scan,
                                             param_dtype=pdt), nnx.Param)

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, p)(x), y).mean()

    tokens = np.random.default_rng(1).integers(0, args.vocab, (args.batch, args.seq + 1))
    x, y = (jax.device_put(jnp.asarray(t, jnp.int32), dev) for t in (tokens[:, :-1], tokens[:, 1:]))
    n = sum(leaf.size for leaf in jax.tree.leaves(params))
    step, state = _build(setup, params, loss_fn, dev)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    params, state = step(params, state, x, y)
    jax.block_until_ready(params)
    first_s = time.perf_counter() - t0
    params, state = step(params, state, x, y)
    digest = None
    if args.check:  # the weights' bits after 2 steps, in the tree's order
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(params):
            h.update(np.asarray(leaf).tobytes())
        digest = h.hexdigest()[:16]
    for _ in range(args.warmup):
        params, state = step(params, state, x, y)
    jax.block_until_ready(params)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        params, state = step(params, state, x, y)
        jax.block_until_ready(params)
        times.append((time.perf_counter() - t0) * 1e3)
    stats = dev.memory_stats() or {}
    if setup.startswith("ts_"):
        import trainstream.jax as tsj  # noqa: PLC0415

        tsj.close(state)
    ms = statistics.median(times)
    return {"size": size, "setup": setup, "params": n, "ms": ms, "ms_min": min(times),
            "tokens_per_s": args.batch * args.seq / ms * 1e3,
            "mfu": 6 * n * args.batch * args.seq / (ms / 1e3) / (args.peak_tflops * 1e12),
            "gpu_peak_gib": stats.get("peak_bytes_in_use", 0) / GIB, "host_hwm_gib": _status("VmHWM") / GIB,
            "build_s": build_s, "first_step_s": first_s, "digest": digest,
            "params_dtype": str(jax.tree.leaves(params)[0].dtype), "scan": args.scan,
            "leaves": len(jax.tree.leaves(params))}


def _run_child(size: str, setup: str, args) -> dict:
    """``child`` in a fresh process; ``{"error", "fits": False}`` for an out-of-memory error or a timeout."""
    argv = [sys.executable, __file__, "--_child", f"{size}:{setup}", "--batch", str(args.batch), "--seq",
            str(args.seq), "--vocab", str(args.vocab), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--peak-tflops", str(args.peak_tflops), "--param-dtype", args.param_dtype] + ["--no-remat"] * args.no_remat + ["--scan"] * args.scan + ["--check"] * args.check
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    if args.deterministic:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"size": size, "setup": setup, "error": f"timeout after {args.timeout} s", "fits": False}
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode == 0 and rows:
        return json.loads(rows[-1])
    text = (done.stderr or done.stdout)[-3000:]
    return {"size": size, "setup": setup, "error": text.strip().splitlines()[-1] if text.strip() else
            f"exit {done.returncode}", "fits": not any(k in text for k in OOM), "log_tail": text}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.3b,3b,7b", help="comma list of _common.SIZES")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="the setups in turn, this many times")
    ap.add_argument("--no-remat", action="store_true")
    ap.add_argument("--scan", action="store_true",
                    help="the blocks stacked and run by nnx.scan (MaxText's layout): 12 leaves instead of 12 per block")
    ap.add_argument("--param-dtype", choices=["bf16", "fp32"], default="bf16",
                    help="fp32: float32 parameters (and optax's float32 state), bf16 compute")
    ap.add_argument("--check", action="store_true", help="a digest of the weights after 2 steps, compared")
    ap.add_argument("--deterministic", action="store_true", help="XLA_FLAGS=--xla_gpu_deterministic_ops=true")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per (size, setup) process")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: a smoke test of the script")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for s in args.setups.split(","):
        if s not in SETUPS:
            ap.error(f"unknown setup {s!r}: one of {', '.join(SETUPS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args._child:
        print("ROW " + json.dumps(child(args)), flush=True)
        return 0
    sizes, setups = args.sizes.split(","), args.setups.split(",")
    t_start, runs = time.time(), {}
    for r in range(args.rounds):
        for size in sizes:
            for setup in setups:
                if runs.get((size, setup)) and "error" in runs[(size, setup)][-1]:
                    continue  # did not fit (or failed) in an earlier round
                row = _run_child(size, setup, args)
                runs.setdefault((size, setup), []).append(row)
                print(f"[{time.time() - t_start:6.0f} s] round {r + 1} {size:5s} {setup:11s} " + (
                    f"{row['ms']:9.1f} ms  GPU peak {row['gpu_peak_gib']:6.2f} GiB  host HWM {row['host_hwm_gib']:6.2f}"
                    f" GiB  digest {row['digest']}" if "error" not in row else
                    f"{'does not fit' if not row['fits'] else 'FAILED'}: {row['error'][:200]}"), flush=True)
                if args.json:  # every run so far, should a later one outlast the caller's time limit
                    _dump(args.json, args, [r for rows in runs.values() for r in rows], partial=True)
    table = []
    for (size, setup), rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        row = dict(ok[-1] if ok else rows[-1], rounds=len(ok))
        if ok:
            row["ms"] = statistics.median(r["ms"] for r in ok)
            row["tokens_per_s"] = args.batch * args.seq / row["ms"] * 1e3
            row["mfu"] = 6 * row["params"] * args.batch * args.seq / (row["ms"] / 1e3) / (args.peak_tflops * 1e12)
        table.append(row)
    print(f"\n{'size':5s} {'setup':11s} {'step ms':>9s} {'vs hbm':>7s} {'tok/s':>8s} {'MFU':>6s} {'GPU GiB':>8s} "
          f"{'host GiB':>8s}  bits vs optax_hbm")
    for row in table:
        if "error" in row:
            print(f"{row['size']:5s} {row['setup']:11s} {'does not fit' if not row['fits'] else 'FAILED'}")
            continue
        ref = next((r for r in table if r["size"] == row["size"] and r["setup"] == "optax_hbm" and "ms" in r), None)
        same = "-" if not (ref and row["digest"]) else ("same" if row["digest"] == ref["digest"] else "DIFFER")
        row["vs_optax_hbm"] = row["ms"] / ref["ms"] if ref else None
        print(f"{row['size']:5s} {row['setup']:11s} {row['ms']:9.1f} "
              f"{row['vs_optax_hbm'] if ref else float('nan'):6.2f}x {row['tokens_per_s']:8.0f} "
              f"{row['mfu'] * 100:5.1f}% {row['gpu_peak_gib']:8.2f} {row['host_hwm_gib']:8.2f}  {same}")
    for setup in setups:
        fit = [r["size"] for r in table if r["setup"] == setup and "error" not in r]
        print(f"largest trained, {setup}: {fit[-1] if fit else 'none'} (of {args.sizes})")
    if args.json:
        _dump(args.json, args, table)
    return 0


def _dump(path: str, args, rows: list, partial: bool = False) -> None:
    """The JSON: ``rows`` (each run while ``partial``, else the table of medians)."""
    with open(path, "w") as f:
        json.dump({"args": vars(args), "commit": git_commit(), "partial": partial, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
