# python experiments/contention.py --threads 0,4,8,12,15 --json $OUT/contention.json
"""Do the host AdamW threads and the PCIe copies slow each other down?

In ``cpu`` mode the host update (28 B per element of DRAM traffic) runs while the DMA
engines copy gradients down and weights up through the same host memory. This script
runs, for each thread count N of ``--threads``, for ``--seconds``:

* N threads looping the host AdamW kernel (torch/cuda variant, fp32, each on its own
  range of ``--numel`` elements): Gelem/s over the window;
* at the same time, pinned ``cudaMemcpyAsync`` host->device and device->host of
  ``--copy-mib`` MiB on two streams, back to back: GB/s of each direction.

N = 0 gives the copies alone; the host-alone figures come from a window with the copies
off (``--no-copy`` rows). Needs torch with CUDA and numba.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np


def host_loop(p, m, v, g, scalars, begin, end, stop, counter, lock):
    """Update [begin, end) over and over until ``stop`` is set; count elements."""
    from trainstream import contract as C
    from trainstream._host_kernels import adamw_chunk

    done = 0
    while not stop.is_set():
        adamw_chunk(C.VARIANT_TORCH_CUDA, p, m, v, g, 0, None, 0, begin, end, scalars, 0)
        done += end - begin
    with lock:
        counter[0] += done


def window(torch, threads, arrays, scalars, seconds, copy_bytes):
    """One measurement window: ``threads`` host workers, copies on or off."""
    p, m, v, g = arrays
    n = p.size
    stop, lock, counter = threading.Event(), threading.Lock(), [0]
    bounds = [n * k // max(threads, 1) // 16 * 16 for k in range(max(threads, 1) + 1)]
    bounds[-1] = n
    workers = [threading.Thread(target=host_loop, args=(p, m, v, g, scalars, bounds[k], bounds[k + 1], stop, counter, lock))
               for k in range(threads)]
    copies = {"h2d": 0, "d2h": 0}
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    if copy_bytes:
        dev = torch.device("cuda")
        h_src = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
        h_dst = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
        d_a = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
        d_b = torch.ones(copy_bytes, dtype=torch.uint8, device=dev)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        while time.perf_counter() - t0 < seconds:
            with torch.cuda.stream(s1):
                d_a.copy_(h_src, non_blocking=True)
            with torch.cuda.stream(s2):
                h_dst.copy_(d_b, non_blocking=True)
            s1.synchronize()
            s2.synchronize()
            copies["h2d"] += copy_bytes
            copies["d2h"] += copy_bytes
    else:
        time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    dt = time.perf_counter() - t0
    return {
        "threads": threads,
        "copies": bool(copy_bytes),
        "seconds": dt,
        "host_gelems_per_s": counter[0] / dt / 1e9,
        "host_gbps_28B": counter[0] * 28 / dt / 1e9,
        "h2d_gbps": copies["h2d"] / dt / 1e9,
        "d2h_gbps": copies["d2h"] / dt / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="0,4,8,12,15")
    ap.add_argument("--numel", type=int, default=1 << 27)
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("contention.py needs a CUDA GPU")
    from trainstream import contract as C

    hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
    scalars = C.step_scalars(hp, 1, "torch", "cuda", np.float32(1.0))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(args.numel, dtype=np.float32) for _ in range(4)]
    arrays[2] = np.abs(arrays[2])
    rows = []
    for n in [int(t) for t in args.threads.split(",")]:
        for copy in ((True, False) if n else (True,)):
            row = window(torch, n, arrays, scalars, args.seconds, args.copy_mib << 20 if copy else 0)
            rows.append(row)
            print(f"threads {n:2d} copies {'on ' if copy else 'off'}: host {row['host_gelems_per_s']:5.2f} Gelem/s "
                  f"({row['host_gbps_28B']:6.1f} GB/s)  H2D {row['h2d_gbps']:5.1f}  D2H {row['d2h_gbps']:5.1f} GB/s",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
