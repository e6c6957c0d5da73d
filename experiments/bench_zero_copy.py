# Run (GPU machine): python experiments/bench_zero_copy.py --numel 268435456 --out $OUT/bench_zero_copy.json
"""The device AdamW kernel (``gpu`` mode) beside the PCIe ceiling and torch's in-GPU AdamW.

In one process, on one GPU:

* ``memcpy``: pinned host <-> device ``cudaMemcpyAsync`` of ``--copy-mib`` MiB: H2D alone,
  D2H alone, and both at once on two streams; the last, in GB/s over both directions, is
  the ceiling (the update reads and writes its state over PCIe in equal amounts);
* ``zero-copy``: :func:`benchmark_zero_copy_adamw`, weights and gradients in GPU memory, the
  moments (and the fp32 master of bf16 weights) in mapped host memory, read and written by
  the kernel over PCIe: 16 B/element (fp32), 24 (bf16 + master). Targets: 0.95 / 0.90;
* ``staged``: :func:`benchmark_staged_adamw`, the same kernel on GPU memory: the state
  streams through a ring of ``depth`` slots of ``chunk_mib`` MiB per array, H2D copy ->
  kernel -> D2H copy on three streams (the copy engines move the state), for each ring of
  ``--staged`` (the library's ring: 8x3);
* ``torch fused``: ``torch.optim.AdamW(fused=True)`` all in GPU memory (skipped without torch).

Each kernel run first checks one update against the contract's reference on a sample
(torch/cuda convention). Times are CUDA-event medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from trainstream import _device_kernels as dk
from trainstream import contract as C

TARGETS = {"float32": 0.95, "bfloat16": 0.90}
VARIANT = C.VARIANT_TORCH_CUDA
SCALARS = C.step_scalars(C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01), 1, "torch", "cuda")


def _timed(cp, step, first, last, iters: int, repeats: int) -> list[float]:
    """``repeats`` CUDA-event timings (ms per ``step()``) of ``iters`` calls after a warm-up,
    from an event on stream ``first`` to one on ``last``."""
    step()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(max(1, repeats)):
        start.record(first)
        for _ in range(max(1, iters)):
            step()
        stop.record(last)
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) / max(1, iters))
    return samples


def bench_memcpy(cp, device: int, nbytes: int, repeats: int) -> dict:
    """Pinned-memory copy rates in GB/s: H2D alone, D2H alone, both at once (total)."""
    rt, frees = cp.cuda.runtime, []
    try:
        (h_src, _, f1), (h_dst, _, f2) = dk.alloc_mapped(nbytes, device), dk.alloc_mapped(nbytes, device)
        frees += [f1, f2]
        d_dst, d_src = cp.empty(nbytes, cp.uint8), cp.ones(nbytes, cp.uint8)
        s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

        def h2d(stream=s1):
            rt.memcpyAsync(d_dst.data.ptr, h_src, nbytes, rt.memcpyHostToDevice, stream.ptr)

        def d2h(stream=s1):
            rt.memcpyAsync(h_dst, d_src.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)

        def both():
            s2.wait_event(s1.record())
            h2d(s1)
            d2h(s2)
            s1.wait_event(s2.record())

        ms = {k: statistics.median(_timed(cp, f, s1, s1, 1, repeats)) for k, f in (("h2d", h2d), ("d2h", d2h), ("both", both))}
        return {"bytes": nbytes, "ms": ms, "h2d_gbps": nbytes / ms["h2d"] / 1e6, "d2h_gbps": nbytes / ms["d2h"] / 1e6,
                "bidirectional_gbps": 2 * nbytes / ms["both"] / 1e6}
    finally:
        cp.cuda.Device(device).synchronize()
        for free in frees:
            free()


def bench_torch_fused(device: int, numel: int, iters: int, repeats: int) -> dict | None:
    """torch.optim.AdamW(fused=True), fp32, everything in GPU memory (28 B/element of HBM traffic)."""
    try:
        import torch
    except ImportError:
        return None
    dev = torch.device("cuda", device)
    p = torch.nn.Parameter(torch.randn(numel, device=dev))
    p.grad = torch.randn(numel, device=dev) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    samples = []
    for _ in range(repeats + 1):  # the first: warm-up (and the state's creation)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            opt.step()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / iters)
    ms = statistics.median(samples[1:])
    del opt, p
    torch.cuda.empty_cache()
    return {"ms": ms, "gelems_per_s": numel / ms / 1e6, "hbm_gbps": numel * 28 / ms / 1e6, "torch": torch.__version__}


class _Case:
    """One update's buffers (made with ``device`` current; freed on leaving ``with``): weights and
    gradient (``param_dtype``) in GPU memory, m, v (and the fp32 master of half weights) in mapped
    pinned host memory, a sample's values before the first update; :meth:`measure` checks that
    update against the contract, then times."""

    def __init__(self, cp, numel: int, device: int, param_dtype: str):
        self.cp, self.numel, self.device, self.pd = cp, int(numel), device, dk._dtype_name(param_dtype)
        if self.numel < 1:
            raise ValueError(f"numel must be >= 1, got {numel}")
        self.frees, self.host, self.dev_ptrs = [], [], []
        rng = cp.random.default_rng(1234)
        p32 = rng.standard_normal(self.numel, dtype=cp.float32)
        self.param = _to_storage(cp, p32, self.pd)
        self.grad = _to_storage(cp, rng.standard_normal(self.numel, dtype=cp.float32) * cp.float32(1e-2), self.pd)
        for _ in range(2 if self.pd == "float32" else 3):  # m, v (, master)
            h, d, free = dk.alloc_mapped(4 * self.numel, device)
            self.frees.append(free)
            self.host.append(h)
            self.dev_ptrs.append(d)
        m, v = self.view(0), self.view(1)
        m.fill(np.float32(1e-3))
        v.fill(np.float32(1e-6))
        if self.pd != "float32":
            cp.cuda.runtime.memcpy(self.host[2], p32.data.ptr, 4 * self.numel, cp.cuda.runtime.memcpyDeviceToHost)
        hrng = np.random.default_rng(5678)  # the ends (head/tail paths) and random interior points
        n = self.numel
        self.idx = np.unique(np.concatenate([np.arange(min(n, 4096)), np.arange(max(0, n - 4096), n),
                                             hrng.integers(0, n, 65536)]))
        m[self.idx] = hrng.standard_normal(self.idx.size).astype(np.float32) * np.float32(1e-2)
        v[self.idx] = np.abs(hrng.standard_normal(self.idx.size)).astype(np.float32) * np.float32(1e-4)
        self.cidx = cp.asarray(self.idx)
        self.before = [self._weights32(), m[self.idx].copy(), v[self.idx].copy(),  # p, m, v, g
                       _from_storage(cp.asnumpy(self.grad[self.cidx]), self.pd)]

    def view(self, k: int) -> np.ndarray:
        return dk.host_view(self.host[k], self.numel)

    def _weights32(self) -> np.ndarray:
        """The fp32 weights of the sample (the master of half weights)."""
        return self.view(2)[self.idx].copy() if len(self.host) == 3 else _from_storage(
            self.cp.asnumpy(self.param[self.cidx]), self.pd)

    def launch(self, lo: int, n: int, state_ptrs: list[int], stream: int) -> None:
        """The kernel on elements ``[lo, lo + n)``, the state at ``state_ptrs`` (m, v, master)."""
        b = 4 if self.pd == "float32" else 2
        dk.launch_adamw(VARIANT, self.param.data.ptr + b * lo, self.pd, self.grad.data.ptr + b * lo, self.pd,
                        state_ptrs[2] if len(state_ptrs) == 3 else 0, state_ptrs[0], state_ptrs[1], n, SCALARS,
                        stream, device=self.device)

    def check(self) -> None:
        """The first update equals the contract's reference bit for bit on the sample."""
        p, m, v = C.reference_update(*self.before, SCALARS, "torch", "cuda")
        param = _from_storage(self.cp.asnumpy(self.param[self.cidx]), self.pd)
        got = {"exp_avg": self.view(0)[self.idx], "exp_avg_sq": self.view(1)[self.idx], "param": self._weights32()}
        bad = [k for k, want in zip(got, (m, v, p)) if not np.array_equal(got[k].view(np.uint32), want.view(np.uint32))]
        if self.pd != "float32" and not np.array_equal(param, C.round_to(p, self.pd)):
            bad.append(f"{self.pd} weights (not the rounded master)")
        if bad:
            raise AssertionError(f"AdamW kernel ({self.pd} weights) does not match the contract on: {', '.join(bad)}")

    def measure(self, step, first, last, iters: int, repeats: int, **extra) -> dict:
        """One ``step()`` checked (:meth:`check`), then :func:`_timed` from stream ``first`` to ``last``."""
        step()
        self.cp.cuda.Device(self.device).synchronize()
        self.check()
        samples = _timed(self.cp, step, first, last, iters, repeats)
        dk.check_stream(last.ptr, self.device)
        ms = statistics.median(samples)
        bpe = 16 if self.pd == "float32" else 24
        return {"ms": ms, "gelems_per_s": self.numel / ms / 1e6, "pcie_gbps": self.numel * bpe / ms / 1e6,
                "numel": self.numel, "bytes_per_elem": bpe, "param_dtype": self.pd, "ms_samples": samples, **extra}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.cp.cuda.Device(self.device).synchronize()
        finally:
            for free in self.frees:
                free()


def benchmark_zero_copy_adamw(numel: int, device: int = 0, *, param_dtype: str = "float32", iters: int = 5,
                              repeats: int = 7) -> dict:
    """The kernel reading and writing the state in mapped host memory over PCIe: checked on a
    sample, then ``repeats`` timings of ``iters`` launches; ``pcie_gbps`` counts the state."""
    cp = dk._cupy()
    with cp.cuda.Device(device), _Case(cp, numel, device, param_dtype) as case:
        stream = cp.cuda.Stream(non_blocking=True)
        return case.measure(lambda: case.launch(0, case.numel, case.dev_ptrs, stream.ptr), stream, stream, iters, repeats)


def benchmark_staged_adamw(numel: int, device: int = 0, *, param_dtype: str = "float32", chunk_mib: int = 32,
                           depth: int = 3, iters: int = 5, repeats: int = 7) -> dict:
    """The state copied host -> ring slot (one stream), updated there (a second), copied back
    (a third), per chunk of ``chunk_mib`` MiB of one fp32 array; a slot is refilled only after
    its copy-back. Checked like :func:`benchmark_zero_copy_adamw`; ``ring_mib``: its GPU memory."""
    cp = dk._cupy()
    rt = cp.cuda.runtime
    with cp.cuda.Device(device), _Case(cp, numel, device, param_dtype) as case:
        chunk, arrays = (int(chunk_mib) << 20) // 4, len(case.host)
        ring = [[cp.empty(chunk, cp.float32) for _ in range(arrays)] for _ in range(depth)]
        h2d, run, d2h = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
        freed = [None] * depth  # the copy-back event of the slot's last chunk

        def step():
            for i, lo in enumerate(range(0, case.numel, chunk)):
                n, k = min(chunk, case.numel - lo), i % depth
                if freed[k] is not None:
                    h2d.wait_event(freed[k])
                for a in range(arrays):
                    rt.memcpyAsync(ring[k][a].data.ptr, case.host[a] + 4 * lo, 4 * n, rt.memcpyHostToDevice, h2d.ptr)
                run.wait_event(h2d.record())
                case.launch(lo, n, [s.data.ptr for s in ring[k]], run.ptr)
                d2h.wait_event(run.record())
                for a in range(arrays):
                    rt.memcpyAsync(case.host[a] + 4 * lo, ring[k][a].data.ptr, 4 * n, rt.memcpyDeviceToHost, d2h.ptr)
                freed[k] = d2h.record()

        return case.measure(step, h2d, d2h, iters, repeats, chunk_mib=chunk_mib, depth=depth,
                            ring_mib=depth * arrays * chunk_mib)


def _to_storage(cp, x32, dtype: str):
    """fp32 CuPy array -> storage (float32, or bfloat16 / float16 bits as uint16)."""
    if dtype == "float32":
        return x32
    if dtype == "float16":
        return x32.astype(cp.float16).view(cp.uint16)
    u = x32.view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> cp.uint32(16)) & cp.uint32(1))) >> cp.uint32(16)).astype(cp.uint16)


def _from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return a.astype(np.float32)
    return a.view(np.float16).astype(np.float32) if dtype == "float16" else C.bf16_bits_to_f32(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 28, help="elements per update (default 2**28)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--iters", type=int, default=5, help="launches per timed run")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs (the median is reported)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of each memcpy (MiB)")
    ap.add_argument("--out", type=Path, default=Path("experiments/out/bench_zero_copy.json"))
    ap.add_argument("--no-torch", action="store_true", help="skip torch's fused AdamW")
    ap.add_argument("--staged", default="8x3,32x2,32x3,64x3", help="rings CHUNK_MIBxDEPTH, comma-separated ('': none)")
    args = ap.parse_args(argv)
    cp = dk._cupy()
    props = cp.cuda.runtime.getDeviceProperties(args.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    dk.compile_kernels(args.device)
    memcpy = bench_memcpy(cp, args.device, args.copy_mib << 20, args.repeats)
    bidir = memcpy["bidirectional_gbps"]
    runs = {}
    for pd in ("float32", "bfloat16"):
        runs[f"zero-copy {pd}"] = benchmark_zero_copy_adamw(args.numel, args.device, param_dtype=pd, iters=args.iters,
                                                            repeats=args.repeats)
        for ring in filter(None, args.staged.split(",")):
            chunk_mib, depth = map(int, ring.split("x"))
            runs[f"staged {pd} {ring}"] = benchmark_staged_adamw(args.numel, args.device, param_dtype=pd, chunk_mib=chunk_mib,
                                                                 depth=depth, iters=args.iters, repeats=args.repeats)
            cp.get_default_memory_pool().free_all_blocks()
    fused = None if args.no_torch else bench_torch_fused(args.device, args.numel, args.iters, args.repeats)
    print(f"{name}, numel {args.numel:,}, CuPy {cp.__version__}; memcpy GB/s: H2D {memcpy['h2d_gbps']:.1f}, "
          f"D2H {memcpy['d2h_gbps']:.1f}, both at once {bidir:.1f}")
    print(f"{'case':<28} {'ms':>9} {'Gelem/s':>9} {'B/elem':>7} {'GB/s':>8} {'of bidir':>9} {'target':>7}")
    for key, r in runs.items():
        target = TARGETS[r["param_dtype"]] if key.startswith("zero-copy") else None
        r["of_bidirectional"] = r["pcie_gbps"] / bidir
        print(f"{key:<28} {r['ms']:9.3f} {r['gelems_per_s']:9.2f} {r['bytes_per_elem']:7d} {r['pcie_gbps']:8.1f} "
              f"{r['of_bidirectional']:9.3f} {target if target is not None else '-':>7}")
    if fused is not None:
        print(f"{'torch fused AdamW (HBM)':<28} {fused['ms']:9.3f} {fused['gelems_per_s']:9.2f} {28:7d} {fused['hbm_gbps']:8.1f}")
    result = {"device": name, "cupy": cp.__version__, "numel": args.numel, "memcpy": memcpy, "runs": runs,
              "torch_fused": fused, "targets": TARGETS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
