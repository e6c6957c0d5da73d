# python experiments/host_pages.py --numel 268435456 --threads 15 --json $OUT/host_pages.json
"""Does the page size of the host state change the host AdamW update's speed?

The engine's fp32 master and moments are pageable host memory. ``torch.empty`` on the CPU
takes them from glibc with 4 KiB pages (unless the kernel's transparent huge pages are
``always``, or torch's ``THP_MEM_ALLOC_ENABLE=1``), while NumPy advises the kernel to back
its large arrays with 2 MiB pages (``MADV_HUGEPAGE``). The update streams 28 B per
element through 3-4 arrays at once; with 4 KiB pages it needs a page walk every 1024
elements of each array. For each way of allocating p, m, v (``--modes``), ``--threads``
threads loop the host kernel (torch/cuda variant, bf16 gradient, weights rounded into the
gradient buffer: the engine's bf16 path) over their own range in 1 Mi-element chunks for
``--seconds``; the gradient buffer is pinned (as the engine's staging) in every mode.
Prints Gelem/s per mode and the kernel's transparent-huge-page setting and the
AnonHugePages that each mode's arrays received. Needs numba and torch (CPU is enough).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import threading
import time

import numpy as np

_HUGE = 2 << 20


def _meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _thp_setting() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def alloc(mode: str, numel: int, keep: list):
    """An fp32 array of ``numel`` elements allocated as ``mode`` says (first touch: zeros)."""
    import torch

    try:
        from numpy._core import multiarray as ma  # NumPy 2
    except ImportError:
        from numpy.core import multiarray as ma

    if mode == "numpy":  # NumPy's default: madvise(MADV_HUGEPAGE) for large arrays
        ma._set_madvise_hugepage(True)
        a = np.empty(numel, np.float32)
    elif mode == "numpy_nohuge":
        ma._set_madvise_hugepage(False)
        a = np.empty(numel, np.float32)
        ma._set_madvise_hugepage(True)
    elif mode == "torch":  # what the engine's TorchBackend.host_empty does today
        t = torch.empty(numel, dtype=torch.float32)
        keep.append(t)
        a = t.numpy()
    elif mode == "torch_pinned":
        t = torch.empty(numel, dtype=torch.float32, pin_memory=torch.cuda.is_available())
        keep.append(t)
        a = t.numpy()
    elif mode == "mmap_huge":  # 2 MiB-aligned anonymous mapping, all of it advised MADV_HUGEPAGE
        # (as session 7 ran it; trainstream._hostmem now advises only the whole pages)
        nbytes = numel * 4
        mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = np.frombuffer(mm, np.uint8).ctypes.data
        off = (-addr) % _HUGE
        mm.madvise(mmap.MADV_HUGEPAGE, 0, nbytes + _HUGE)
        keep.append(mm)
        a = np.frombuffer(mm, np.float32, count=numel, offset=off)
    elif mode == "huge_registered":  # mmap_huge, then page-locked with cudaHostRegister
        from trainstream import _hostmem

        a = _hostmem.empty(numel, np.float32)
        a[:] = 0.0
        if torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(a.ctypes.data, a.nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {rc}")
            keep.append(("registered", a.ctypes.data))
    elif mode == "trainstream":  # trainstream._hostmem.empty (what the engine now uses)
        from trainstream import _hostmem

        a = _hostmem.empty(numel, np.float32)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    a[:] = 0.0
    return a


def run_mode(mode, numel, threads, seconds, chunk):
    import torch
    from trainstream import contract as C
    from trainstream._host_kernels import KIND_BF16, adamw_chunk

    keep: list = []
    huge0 = _meminfo_kib("AnonHugePages")
    p, m, v = (alloc(mode, numel, keep) for _ in range(3))
    huge1 = _meminfo_kib("AnonHugePages")
    rng = np.random.default_rng(0)
    p[:] = rng.standard_normal(numel, dtype=np.float32)
    gt = torch.empty(numel, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    gt.copy_(torch.from_numpy(p) * 1e-3)
    g = gt.view(torch.uint16).numpy() if hasattr(torch, "uint16") else gt.view(torch.int16).numpy().view(np.uint16)
    hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
    s = C.step_scalars(hp, 1, "torch", "cuda", np.float32(1.0))
    adamw_chunk(C.VARIANT_TORCH_CUDA, p, m, v, g, KIND_BF16, g, KIND_BF16, 0, min(numel, chunk), s)  # compile
    bounds = [numel * k // threads // chunk * chunk for k in range(threads + 1)]
    bounds[-1] = numel
    stop, lock, count = threading.Event(), threading.Lock(), [0]

    def work(b, e):
        done = 0
        while not stop.is_set():
            for c in range(b, e, chunk):
                adamw_chunk(C.VARIANT_TORCH_CUDA, p, m, v, g, KIND_BF16, g, KIND_BF16, c, min(e, c + chunk), s)
                done += min(e, c + chunk) - c
                if stop.is_set():
                    break
        with lock:
            count[0] += done

    ws = [threading.Thread(target=work, args=(bounds[k], bounds[k + 1])) for k in range(threads)]
    t0 = time.perf_counter()
    for w in ws:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in ws:
        w.join()
    dt = time.perf_counter() - t0
    row = {"mode": mode, "gelems_per_s": count[0] / dt / 1e9, "gbps_28B": count[0] * 28 / dt / 1e9,
           "anon_huge_mib_of_state": (huge1 - huge0) / 1024, "state_mib": 3 * numel * 4 / 2**20}
    for k in keep:
        if isinstance(k, tuple) and k[0] == "registered":
            torch.cuda.cudart().cudaHostUnregister(k[1])
    del p, m, v, g, gt, keep
    gc.collect()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--chunk", type=int, default=1 << 20)
    ap.add_argument("--modes", default="torch,trainstream,numpy_nohuge,numpy,torch_pinned,huge_registered,torch,trainstream")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"transparent_hugepage/enabled: {_thp_setting()}; numel {args.numel}, threads {args.threads}", flush=True)
    rows = []
    for mode in args.modes.split(","):
        row = run_mode(mode, args.numel, args.threads, args.seconds, args.chunk)
        rows.append(row)
        print(f"{mode:14s} {row['gelems_per_s']:5.2f} Gelem/s ({row['gbps_28B']:6.1f} GB/s at 28 B/elem)  "
              f"AnonHugePages gained: {row['anon_huge_mib_of_state']:.0f} of {row['state_mib']:.0f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "thp": _thp_setting(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
