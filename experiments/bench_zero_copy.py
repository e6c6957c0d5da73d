# python experiments/bench_zero_copy.py --numel 268435456 --out $OUT/bench_zero_copy.json
"""The zero-copy AdamW kernel (``gpu`` mode) beside the PCIe ceiling and torch's in-GPU AdamW.

In one process, on one GPU:

* ``memcpy``: pinned (mapped) host <-> device ``cudaMemcpyAsync`` of ``--copy-mib`` MiB:
  host-to-device alone, device-to-host alone, and both at once on two streams; the last
  one, in total GB/s over both directions, is the ceiling the kernel is measured against
  (it reads and writes its state over PCIe in equal amounts);
* ``zero-copy fp32``: :func:`benchmark_zero_copy_adamw` (below), fp32
  weights and gradients in GPU memory, m and v in mapped host memory: 16 B/element over
  PCIe (m, v read and written). Target: >= 0.95 of the bidirectional memcpy rate;
* ``zero-copy bf16+master``: bf16 weights and gradients, fp32 master, m and v in mapped host
  memory: 24 B/element over PCIe. Target: >= 0.90;
* ``staged``: :func:`benchmark_staged_adamw` (below), the same kernel on GPU-memory state:
  m and v (and the master) stay in pinned host memory and stream through a ring of
  ``--depth`` device slots of ``--chunk-mib`` MiB per array, H2D copy -> kernel -> D2H copy
  on three streams (the copy engines, not the SMs, move the state): the staged gpu mode of
  issue #22 item 4, measured against zero-copy before anything is built;
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


# -- the zero-copy kernel's timing (checked against the contract first) ---------------------

_CONVENTION_OF = {C.VARIANT_TORCH_CPU: ("torch", "cpu"), C.VARIANT_TORCH_CUDA: ("torch", "cuda"),
                  C.VARIANT_OPTAX_CPU: ("optax", "cpu"), C.VARIANT_OPTAX_CUDA: ("optax", "cuda")}


def _check_sample(variant, p_before, m_before, v_before, g, scalars, p_after, m_after, v_after, param_after, pd):
    conv, plat = _CONVENTION_OF[variant]
    rp, rm, rv = C.reference_update(p_before, m_before, v_before, g, scalars, conv, plat)
    problems = []
    for name, got, want in (("exp_avg", m_after, rm), ("exp_avg_sq", v_after, rv)):
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        if bad.size:
            problems.append(f"{name}: {bad.size} of {got.size} sampled elements differ, e.g. {got[bad[0]]!r} vs {want[bad[0]]!r}")
    if variant == C.VARIANT_OPTAX_CUDA:
        ulps = C.update_ulps(p_after, rp, p_before)
        if ulps.max(initial=0) > C.OPTAX_CUDA_MAX_ULP:
            problems.append(f"param: {float(ulps.max()):.3g} ULPs (of max(|p|, |update|, |p_new|)) from the "
                            f"contract (bound {C.OPTAX_CUDA_MAX_ULP})")
    else:
        bad = np.flatnonzero(p_after.view(np.uint32) != rp.view(np.uint32))
        if bad.size:
            problems.append(f"param: {bad.size} of {p_after.size} sampled elements differ, e.g. {p_after[bad[0]]!r} vs {rp[bad[0]]!r}")
    if pd != "float32":
        want = C.round_to(p_after, pd)
        if not np.array_equal(param_after.view(np.uint32), want.view(np.uint32)):
            problems.append(f"{pd} weights are not the rounded master weights")
    if problems:
        raise AssertionError(
            f"zero-copy AdamW ({dk._VARIANT_NAMES[variant]}, {pd} weights) does not match "
            "trainstream.contract.reference_update:\n  " + "\n  ".join(problems)
        )


def benchmark_zero_copy_adamw(
    numel: int,
    device: int = 0,
    *,
    param_dtype: str = "float32",
    grad_dtype: str | None = None,
    variant: int = C.VARIANT_TORCH_CUDA,
    iters: int = 5,
    repeats: int = 7,
) -> dict:
    """Time the zero-copy AdamW kernel on ``numel`` elements: weights and gradient in GPU
    memory, m and v (and the fp32 master for fp16/bf16 weights) in mapped host memory.

    First checks one update against :func:`trainstream.contract.reference_update` on a
    sample of elements (``AssertionError`` if it differs), then times ``repeats`` runs of
    ``iters`` back-to-back launches with CUDA events and reports the median:
    ``{"ms", "gelems_per_s", "pcie_gbps", "numel", "bytes_per_elem", ...}``.
    ``pcie_gbps`` counts the state traffic: m and v read and written (16 B/element), plus
    the master (24 B/element) for fp16/bf16 weights.
    """
    cp = dk._cupy()
    numel = int(numel)
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    pd = dk._dtype_name(param_dtype)
    gd = dk._dtype_name(grad_dtype or pd)
    conv, plat = _CONVENTION_OF[variant]
    hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
    scalars = C.step_scalars(hp, 1, conv, plat)
    frees = []
    with cp.cuda.Device(device):
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            rng = cp.random.default_rng(1234)
            p32 = rng.standard_normal(numel, dtype=cp.float32)
            g32 = rng.standard_normal(numel, dtype=cp.float32) * cp.float32(1e-2)
            param = _to_storage_cupy(cp, p32, pd)
            grad = _to_storage_cupy(cp, g32, gd)
            del g32
            m_host, m_dev, free_m = dk.alloc_mapped(4 * numel, device)
            frees.append(free_m)
            v_host, v_dev, free_v = dk.alloc_mapped(4 * numel, device)
            frees.append(free_v)
            master_host = master_dev = 0
            if pd != "float32":
                master_host, master_dev, free_w = dk.alloc_mapped(4 * numel, device)
                frees.append(free_w)
                cp.cuda.runtime.memcpy(master_host, p32.data.ptr, 4 * numel, cp.cuda.runtime.memcpyDeviceToHost)
            del p32
            m_np, v_np = dk.host_view(m_host, numel), dk.host_view(v_host, numel)
            m_np.fill(np.float32(1e-3))
            v_np.fill(np.float32(1e-6))
            # a sample with random state: the ends (head/tail paths) and random interior points
            hrng = np.random.default_rng(5678)
            idx = np.unique(np.concatenate([
                np.arange(min(numel, 4096)), np.arange(max(0, numel - 4096), numel),
                hrng.integers(0, numel, 65536),
            ]))
            m_np[idx] = hrng.standard_normal(idx.size).astype(np.float32) * np.float32(1e-2)
            v_np[idx] = np.abs(hrng.standard_normal(idx.size)).astype(np.float32) * np.float32(1e-4)
            cidx = cp.asarray(idx)
            p_before = (dk.host_view(master_host, numel)[idx].copy() if master_host
                        else cp.asnumpy(param[cidx]).astype(np.float32))
            g_before = _from_storage_np(cp.asnumpy(grad[cidx]), gd)
            m_before, v_before = m_np[idx].copy(), v_np[idx].copy()

            def step():
                dk.launch_adamw(variant, param.data.ptr, pd, grad.data.ptr, gd, master_dev, m_dev, v_dev,
                             numel, scalars, stream.ptr, device=device)

            step()
            stream.synchronize()
            param_after = _from_storage_np(cp.asnumpy(param[cidx]), pd)
            p_after = dk.host_view(master_host, numel)[idx].copy() if master_host else param_after
            _check_sample(variant, p_before, m_before, v_before, g_before, scalars,
                          p_after, m_np[idx].copy(), v_np[idx].copy(), param_after, pd)
            del m_np, v_np

            samples = _timed(cp, step, stream, stream, iters, repeats)
            dk.check_stream(stream.ptr, device)
            ms = statistics.median(samples)
            bytes_per_elem = 16 if pd == "float32" else 24
            grid = dk._grid_for(numel, dk._kernel(int(device), dk.adamw_kernel_name(variant, pd, gd)).max_grid)
            return {
                "ms": ms,
                "gelems_per_s": numel / (ms * 1e-3) / 1e9,
                "pcie_gbps": numel * bytes_per_elem / (ms * 1e-3) / 1e9,
                "numel": numel,
                "bytes_per_elem": bytes_per_elem,
                "param_dtype": pd,
                "grad_dtype": gd,
                "variant": dk._VARIANT_NAMES[variant],
                "grid": grid,
                "ms_samples": samples,
            }
        finally:
            try:
                cp.cuda.Device(device).synchronize()
            finally:
                for free in frees:
                    free()


def benchmark_staged_adamw(
    numel: int,
    device: int = 0,
    *,
    param_dtype: str = "float32",
    chunk_mib: int = 32,
    depth: int = 3,
    variant: int = C.VARIANT_TORCH_CUDA,
    iters: int = 5,
    repeats: int = 7,
) -> dict:
    """Time AdamW with the state staged through GPU memory: per chunk of ``chunk_mib`` MiB
    (of one fp32 array), m, v (and the master for bf16/fp16 weights) are copied host ->
    ring slot on one stream, updated there by the zero-copy kernel with device pointers on
    a second, and copied back on a third; a slot is refilled only after its copy-back.
    Checked against the contract on a sample first, like :func:`benchmark_zero_copy_adamw`;
    ``pcie_gbps`` counts the same state bytes. ``ring_mib``: the device memory it uses."""
    cp = dk._cupy()
    pd = dk._dtype_name(param_dtype)
    conv, plat = _CONVENTION_OF[variant]
    scalars = C.step_scalars(C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01), 1, conv, plat)
    chunk = (int(chunk_mib) << 20) // 4
    arrays = 2 if pd == "float32" else 3  # m, v (, master)
    frees = []
    with cp.cuda.Device(device):
        try:
            rng = cp.random.default_rng(1234)
            p32 = rng.standard_normal(numel, dtype=cp.float32)
            param = _to_storage_cupy(cp, p32, pd)
            grad = _to_storage_cupy(cp, rng.standard_normal(numel, dtype=cp.float32) * cp.float32(1e-2), pd)
            host = []  # m, v (, master): pinned host memory, copied by the copy engines only
            for _ in range(arrays):
                h, _, free = dk.alloc_mapped(4 * numel, device)
                frees.append(free)
                host.append(h)
            dk.host_view(host[0], numel).fill(np.float32(1e-3))
            dk.host_view(host[1], numel).fill(np.float32(1e-6))
            if arrays == 3:
                cp.cuda.runtime.memcpy(host[2], p32.data.ptr, 4 * numel, cp.cuda.runtime.memcpyDeviceToHost)
            hrng = np.random.default_rng(5678)
            idx = np.unique(np.concatenate([np.arange(min(numel, 4096)), hrng.integers(0, numel, 65536)]))
            m_np, v_np = dk.host_view(host[0], numel), dk.host_view(host[1], numel)
            m_np[idx] = hrng.standard_normal(idx.size).astype(np.float32) * np.float32(1e-2)
            v_np[idx] = np.abs(hrng.standard_normal(idx.size)).astype(np.float32) * np.float32(1e-4)
            cidx = cp.asarray(idx)
            p_before = dk.host_view(host[2], numel)[idx].copy() if arrays == 3 else cp.asnumpy(p32[cidx])
            g_before = _from_storage_np(cp.asnumpy(grad[cidx]), pd)
            m_before, v_before = m_np[idx].copy(), v_np[idx].copy()
            del p32
            ring = [[cp.empty(chunk, cp.float32) for _ in range(arrays)] for _ in range(depth)]
            h2d, run, d2h = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
            loaded = [cp.cuda.Event(disable_timing=True) for _ in range(depth)]
            updated = [cp.cuda.Event(disable_timing=True) for _ in range(depth)]
            freed = [None] * depth  # the copy-back event of the slot's last chunk
            rt = cp.cuda.runtime
            pbytes = 4 if pd == "float32" else 2

            def step():
                for i, lo in enumerate(range(0, numel, chunk)):
                    n, k = min(chunk, numel - lo), i % depth
                    slot = ring[k]
                    if freed[k] is not None:
                        h2d.wait_event(freed[k])
                    for a in range(arrays):
                        rt.memcpyAsync(slot[a].data.ptr, host[a] + 4 * lo, 4 * n, rt.memcpyHostToDevice, h2d.ptr)
                    loaded[k].record(h2d)
                    run.wait_event(loaded[k])
                    dk.launch_adamw(variant, param.data.ptr + pbytes * lo, pd, grad.data.ptr + pbytes * lo, pd,
                                    slot[2].data.ptr if arrays == 3 else 0, slot[0].data.ptr, slot[1].data.ptr,
                                    n, scalars, run.ptr, device=device)
                    updated[k].record(run)
                    d2h.wait_event(updated[k])
                    for a in range(arrays):
                        rt.memcpyAsync(host[a] + 4 * lo, slot[a].data.ptr, 4 * n, rt.memcpyDeviceToHost, d2h.ptr)
                    freed[k] = cp.cuda.Event(disable_timing=True)
                    freed[k].record(d2h)

            step()
            cp.cuda.Device(device).synchronize()
            param_after = _from_storage_np(cp.asnumpy(param[cidx]), pd)
            p_after = dk.host_view(host[2], numel)[idx].copy() if arrays == 3 else param_after
            _check_sample(variant, p_before, m_before, v_before, g_before, scalars,
                          p_after, m_np[idx].copy(), v_np[idx].copy(), param_after, pd)
            del m_np, v_np
            samples = _timed(cp, step, h2d, d2h, iters, repeats)
            dk.check_stream(d2h.ptr, device)
            ms = statistics.median(samples)
            bytes_per_elem = 16 if pd == "float32" else 24
            return {"ms": ms, "gelems_per_s": numel / (ms * 1e-3) / 1e9,
                    "pcie_gbps": numel * bytes_per_elem / (ms * 1e-3) / 1e9, "numel": numel,
                    "bytes_per_elem": bytes_per_elem, "param_dtype": pd, "chunk_mib": chunk_mib, "depth": depth,
                    "ring_mib": depth * arrays * chunk_mib, "ms_samples": samples}
        finally:
            try:
                cp.cuda.Device(device).synchronize()
            finally:
                for free in frees:
                    free()


def _timed(cp, step, first, last, iters: int, repeats: int) -> list[float]:
    """``repeats`` CUDA-event timings (ms per ``step()``) of ``iters`` calls, after a
    warm-up: from an event on stream ``first`` to one on ``last``."""
    step()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(max(1, int(repeats))):
        start.record(first)
        for _ in range(max(1, int(iters))):
            step()
        stop.record(last)
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) / max(1, int(iters)))
    return samples


def _to_storage_cupy(cp, x32, dtype: str):
    """fp32 CuPy array -> storage (float32, float16 bits or bfloat16 bits as uint16)."""
    if dtype == "float32":
        return x32
    if dtype == "float16":
        return x32.astype(cp.float16).view(cp.uint16)
    u = x32.view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> cp.uint32(16)) & cp.uint32(1))) >> cp.uint32(16)).astype(cp.uint16)


def _from_storage_np(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return a.astype(np.float32)
    if dtype == "float16":
        return a.view(np.float16).astype(np.float32)
    return C.bf16_bits_to_f32(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 28, help="elements per update (default 2**28)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--iters", type=int, default=5, help="launches per timed run")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs (the median is reported)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of each memcpy (MiB)")
    ap.add_argument("--out", type=Path, default=Path("experiments/out/bench_zero_copy.json"))
    ap.add_argument("--no-torch", action="store_true", help="skip torch's fused AdamW")
    ap.add_argument("--staged", default="8x3,32x2,32x3,64x3",
                    help="staged rings to time, CHUNK_MIBxDEPTH comma-separated ('' for none)")
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
        zero_copy[pd] = benchmark_zero_copy_adamw(
            args.numel, args.device, param_dtype=pd, variant=C.VARIANT_TORCH_CUDA,
            iters=args.iters, repeats=args.repeats,
        )
        cp.get_default_memory_pool().free_all_blocks()
    staged = {}
    for pd in ("float32", "bfloat16"):
        for ring in filter(None, args.staged.split(",")):
            chunk_mib, depth = map(int, ring.split("x"))
            staged[f"{pd} {ring}"] = benchmark_staged_adamw(
                args.numel, args.device, param_dtype=pd, chunk_mib=chunk_mib, depth=depth,
                iters=args.iters, repeats=args.repeats)
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
    for key, r in staged.items():
        rows.append((f"staged {key}", r["ms"], r["gelems_per_s"], r["bytes_per_elem"], r["pcie_gbps"],
                     r["pcie_gbps"] / bidir, None))
    if fused is not None:
        rows.append(("torch fused AdamW (HBM)", fused["ms"], fused["gelems_per_s"], 28, fused["hbm_gbps"],
                     None, None))

    print(f"{name}, numel {args.numel:,}, CuPy {cp.__version__}")
    header = f"{'case':<30} {'ms':>9} {'Gelem/s':>9} {'B/elem':>7} {'GB/s':>8} {'of bidir':>9} {'target':>7}  ok"
    print(header)
    print("-" * len(header))
    missed = []
    for label, ms, ge, bpe, gbps, frac, target in rows:
        ok = "" if target is None else ("yes" if frac >= target else "NO")
        if ok == "NO":
            missed.append(label)
        cell = lambda x, f: (format(x, f) if x is not None else "-")  # noqa: E731
        print(f"{label:<30} {cell(ms, '9.3f'):>9} {cell(ge, '9.2f'):>9} {cell(bpe, '7d'):>7} "
              f"{cell(gbps, '8.1f'):>8} {cell(frac, '9.3f'):>9} {cell(target, '7.2f'):>7}  {ok}")
    for key, r in staged.items():
        pd = key.split()[0]
        print(f"staged {key} ({r['ring_mib']} MiB ring) / zero-copy: {r['ms'] / zero_copy[pd]['ms']:.3f}x the time")
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
        "staged": staged,
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
