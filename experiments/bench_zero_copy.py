# python experiments/bench_zero_copy.py --numel 268435456 --out $OUT/bench_zero_copy.json
"""The zero-copy AdamW kernel (``gpu`` mode) beside the PCIe ceiling and torch's in-GPU AdamW.

In one process, on one GPU:

* ``memcpy``: pinned (mapped) host <-> device ``cudaMemcpyAsync`` of ``--copy-mib`` MiB:
  host-to-device alone, device-to-host alone, and both at once on two streams; the last
  one, in total GB/s over both directions, is the ceiling the kernel is measured against
  (it reads and writes its state over PCIe in equal amounts);
* ``zero-copy fp32``: :func:`trainstream._device_kernels.benchmark_zero_copy_adamw`, fp32
  weights and gradients in GPU memory, m and v in mapped host memory: 16 B/element over
  PCIe (m, v read and written). Target: >= 0.95 of the bidirectional memcpy rate;
* ``zero-copy bf16+master``: bf16 weights and gradients, fp32 master, m and v in mapped host
  memory: 24 B/element over PCIe. Target: >= 0.90;
* ``torch fused``: ``torch.optim.AdamW(fused=True)`` with everything in GPU memory (28 B/
  element of HBM traffic), the in-GPU speed the offloaded update gives up; skipped without
  torch.

Each zero-copy run first checks one update against the contract's NumPy reference on a
sample (torch/cuda convention). Times are CUDA-event medians. ``--out`` gets the JSON;
``--strict`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

from trainstream import contract as C
from trainstream import _device_kernels as dk

TARGETS = {"float32": 0.95, "bfloat16": 0.90}


def bench_memcpy(cp, device: int, nbytes: int, repeats: int) -> dict:
    """Pinned-memory copy rates in GB/s: H2D alone, D2H alone, both at once (total)."""
    rt = cp.cuda.runtime
    frees = []
    try:
        h_src, _, f1 = dk.alloc_mapped(nbytes, device)
        frees.append(f1)
        h_dst, _, f2 = dk.alloc_mapped(nbytes, device)
        frees.append(f2)
        dk.host_view(h_src, nbytes // 4).fill(np.float32(1.0))
        d_dst = cp.empty(nbytes, cp.uint8)
        d_src = cp.ones(nbytes, cp.uint8)
        s1 = cp.cuda.Stream(non_blocking=True)
        s2 = cp.cuda.Stream(non_blocking=True)

        def h2d(stream):
            rt.memcpyAsync(d_dst.data.ptr, h_src, nbytes, rt.memcpyHostToDevice, stream.ptr)

        def d2h(stream):
            rt.memcpyAsync(h_dst, d_src.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)

        def timed(one_way):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            out = []
            for _ in range(repeats + 1):  # the first is a warm-up
                start.record(s1)
                one_way(s1)
                stop.record(s1)
                stop.synchronize()
                out.append(cp.cuda.get_elapsed_time(start, stop))
            return statistics.median(out[1:])

        def both():
            out = []
            for _ in range(repeats + 1):
                cp.cuda.Device(device).synchronize()
                start, e1, e2 = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
                start.record(s1)
                s2.wait_event(start)
                h2d(s1)
                d2h(s2)
                e1.record(s1)
                e2.record(s2)
                e1.synchronize()
                e2.synchronize()
                out.append(max(cp.cuda.get_elapsed_time(start, e1), cp.cuda.get_elapsed_time(start, e2)))
            return statistics.median(out[1:])

        ms_h2d, ms_d2h, ms_both = timed(h2d), timed(d2h), both()
        return {
            "bytes": nbytes,
            "h2d_gbps": nbytes / (ms_h2d * 1e-3) / 1e9,
            "d2h_gbps": nbytes / (ms_d2h * 1e-3) / 1e9,
            "bidirectional_gbps": 2 * nbytes / (ms_both * 1e-3) / 1e9,
            "ms": {"h2d": ms_h2d, "d2h": ms_d2h, "both": ms_both},
        }
    finally:
        cp.cuda.Device(device).synchronize()
        for free in frees:
            free()


def bench_torch_fused(device: int, numel: int, iters: int, repeats: int) -> dict | None:
    """torch.optim.AdamW(fused=True), fp32, everything in GPU memory."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", device)
    p = torch.nn.Parameter(torch.randn(numel, device=dev))
    p.grad = torch.randn(numel, device=dev) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    opt.step()  # creates the state
    opt.step()
    torch.cuda.synchronize(dev)
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            opt.step()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / iters)
    ms = statistics.median(samples)
    result = {
        "ms": ms,
        "gelems_per_s": numel / (ms * 1e-3) / 1e9,
        "hbm_gbps": numel * 28 / (ms * 1e-3) / 1e9,
        "bytes_per_elem": 28,
        "numel": numel,
        "torch": torch.__version__,
        "ms_samples": samples,
    }
    del opt, p
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 28, help="elements per update (default 2**28)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--iters", type=int, default=5, help="launches per timed run")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs (the median is reported)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of each memcpy (MiB)")
    ap.add_argument("--out", type=Path, default=Path("experiments/out/bench_zero_copy.json"))
    ap.add_argument("--no-torch", action="store_true", help="skip torch's fused AdamW")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args(argv)

    cp = dk._cupy()
    props = cp.cuda.runtime.getDeviceProperties(args.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    dk.compile_kernels(args.device)

    memcpy = bench_memcpy(cp, args.device, args.copy_mib << 20, args.repeats)
    bidir = memcpy["bidirectional_gbps"]
    zero_copy = {}
    for pd in ("float32", "bfloat16"):
        zero_copy[pd] = dk.benchmark_zero_copy_adamw(
            args.numel, args.device, param_dtype=pd, variant=C.VARIANT_TORCH_CUDA,
            iters=args.iters, repeats=args.repeats,
        )
        cp.get_default_memory_pool().free_all_blocks()
    fused = None if args.no_torch else bench_torch_fused(args.device, args.numel, args.iters, args.repeats)

    rows = [
        ("memcpy H2D (pinned)", None, None, None, memcpy["h2d_gbps"], None, None),
        ("memcpy D2H (pinned)", None, None, None, memcpy["d2h_gbps"], None, None),
        ("memcpy H2D+D2H, 2 streams", None, None, None, bidir, 1.0, None),
    ]
    fractions = {}
    for pd, label in (("float32", "zero-copy fp32"), ("bfloat16", "zero-copy bf16+master")):
        r = zero_copy[pd]
        fractions[pd] = r["pcie_gbps"] / bidir
        rows.append((label, r["ms"], r["gelems_per_s"], r["bytes_per_elem"], r["pcie_gbps"],
                     fractions[pd], TARGETS[pd]))
    if fused is not None:
        rows.append(("torch fused AdamW (HBM)", fused["ms"], fused["gelems_per_s"], 28, fused["hbm_gbps"],
                     None, None))

    print(f"{name}, numel {args.numel:,}, CuPy {cp.__version__}")
    header = f"{'case':<28} {'ms':>9} {'Gelem/s':>9} {'B/elem':>7} {'GB/s':>8} {'of bidir':>9} {'target':>7}  ok"
    print(header)
    print("-" * len(header))
    missed = []
    for label, ms, ge, bpe, gbps, frac, target in rows:
        ok = "" if target is None else ("yes" if frac >= target else "NO")
        if ok == "NO":
            missed.append(label)
        cell = lambda x, f: (format(x, f) if x is not None else "-")  # noqa: E731
        print(f"{label:<28} {cell(ms, '9.3f'):>9} {cell(ge, '9.2f'):>9} {cell(bpe, '7d'):>7} "
              f"{cell(gbps, '8.1f'):>8} {cell(frac, '9.3f'):>9} {cell(target, '7.2f'):>7}  {ok}")
    if fused is not None:
        for pd in ("float32", "bfloat16"):
            print(f"zero-copy {pd} step / torch fused step: {zero_copy[pd]['ms'] / fused['ms']:.1f}x")

    result = {
        "device": name,
        "host": platform.node(),
        "cupy": cp.__version__,
        "numel": args.numel,
        "memcpy": memcpy,
        "zero_copy": zero_copy,
        "torch_fused": fused,
        "fraction_of_bidirectional": fractions,
        "targets": TARGETS,
        "missed": missed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 1 if (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
