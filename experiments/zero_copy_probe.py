# python experiments/zero_copy_probe.py --mib 1024 --json $OUT/zero_copy_probe.json
"""Can SM loads/stores to mapped pinned host memory reach the copy engines' PCIe rate?

The zero-copy AdamW kernel (``gpu`` mode) moves its state over PCIe with SM-issued loads
and stores on mapped pinned host memory and reaches ~84 GB/s in total, while pinned
``cudaMemcpyAsync`` reaches ~101 GB/s with H2D and D2H at once (~55 GB/s each alone).
This probe separates the access shape from the AdamW arithmetic. In one process, on one
GPU, over two mapped pinned host buffers A and B of ``--mib`` MiB each:

* ``memcpy`` baselines on A and B: H2D alone (A -> GPU), D2H alone (GPU -> B), both at
  once on two non-blocking streams (total GB/s of both directions);
* CUDA kernels (CuPy ``RawModule``) doing nothing but 16 B accesses on the *device*
  pointers of A and B, in five kinds:

  - ``read``: read A, fold the words into a register, one word per thread to GPU memory;
  - ``write``: store a constant into B;
  - ``rmw``: read A, add 1, write it back in place (the shape of the AdamW state: equal
    bytes in both directions);
  - ``copy``: read A, write B (a host-to-host copy through the SMs);
  - ``split``: even blocks read A, odd blocks write B (the directions on separate warps).

  Each kernel is swept over ILP (independent 16 B accesses a thread issues before it uses
  any: 1, 2, 4, 8), grid size (blocks = SMs x ``--blocks-per-sm``), block size
  (``--threads``) and, for reads of a buffer that is not written, the load path
  (``default``: ``ld.global``; ``nc``: ``ld.global.nc``, what ``__ldg`` emits).

GB/s count the bytes that crossed PCIe (read, write: the buffer; rmw, copy, split: twice
the buffer) and are compared with the matching memcpy rate: H2D for ``read``, D2H for
``write``, both at once for the rest. Times are medians of CUDA-event timings of one
launch (``--repeats`` after one warm-up). Before it is timed, every configuration runs once
on a 16 MiB prefix whose length is no multiple of any tile (so the partial last pass runs)
and its result is checked on the host, including the 48 B after the prefix that it must
leave alone. The table is sorted by kind, then GB/s; the best configuration of each kind
follows; ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from trainstream import _device_kernels as dk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_commit  # noqa: E402

KINDS = ("read", "write", "rmw", "copy", "split")
#: (kind, load path) pairs compiled and swept. ``nc`` only where the kernel never writes
#: the buffer it reads (the non-coherent path is undefined for data written meanwhile).
VARIANTS = (
    ("read", "default"),
    ("read", "nc"),
    ("write", "none"),
    ("rmw", "default"),
    ("copy", "default"),
    ("copy", "nc"),
    ("split", "default"),
)
ILPS = (1, 2, 4, 8)
#: Bytes over PCIe per byte of buffer.
PCIE_FACTOR = {"read": 1, "write": 1, "rmw": 2, "copy": 2, "split": 2}
#: The memcpy rate each kind is compared with.
BASELINE = {"read": "h2d", "write": "d2h", "rmw": "both", "copy": "both", "split": "both"}
DEFAULT_BLOCKS_PER_SM = (1, 2, 4, 8, 16)
DEFAULT_THREADS = (256,)
QUICK_ILPS = (1, 4)
QUICK_BLOCKS_PER_SM = (2, 8)
QUICK_REPEATS = 5
CHECK_MIB = 16
SENTINEL = 0xDEADBEEF
WRITE_VALUE = 0x3F800000  # 1.0f

KERNEL_SOURCE = r"""
// zero_copy_probe kernels (compiled by NVRTC through cupy.RawModule; no #include).
//
// Every uint4 pointer is the *device* pointer of a mapped pinned host allocation
// (cudaHostGetDevicePointer), page aligned, so every uint4 (16 B) access is aligned; n
// counts uint4. Only `sink` is GPU memory.
//
// Access shape: a grid-stride loop over tiles. In each pass, block b owns the tile of
// ILP * blockDim.x consecutive uint4 starting at (pass * blocks + b) * ILP * blockDim.x;
// thread t issues the ILP independent 16 B accesses t, t + blockDim.x, ... of it back to
// back and only then consumes them: each is one contiguous 512 B segment per warp, and a
// warp has ILP of them in flight per pass.

typedef long long i64;

// One 16 B load, on the default path (ld.global) or the non-coherent read-only one
// (ld.global.nc, what __ldg emits). Inline PTX so that the compiler cannot choose the path
// itself; volatile + "memory" keep the loads in program order: the ILP loads of a pass are
// all issued before the stores of that pass (the hardware only waits at the first use).
template <bool NC>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  uint4 r;
  if constexpr (NC) {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory");
  } else {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory");
  }
  return r;
}

__device__ __forceinline__ uint4 splat(unsigned int v) {
  uint4 r;
  r.x = v;
  r.y = v;
  r.z = v;
  r.w = v;
  return r;
}

// This thread's first element, and the stride of a pass, for `blocks` blocks of which this
// one is number `rank`.
template <int ILP>
__device__ __forceinline__ i64 tile_first(unsigned int rank) {
  return (i64)rank * ILP * blockDim.x + threadIdx.x;
}
template <int ILP>
__device__ __forceinline__ i64 tile_step(unsigned int blocks) {
  return (i64)blocks * ILP * blockDim.x;
}

// The loop every kernel shares: op.load(i) fetches (or makes) element i, op.use(i, v)
// consumes it. Whole passes run without bounds checks; then at most one partial pass.
template <int ILP, class Op>
__device__ __forceinline__ void sweep(Op& op, i64 n, i64 first, i64 step) {
  const i64 bd = blockDim.x;
  i64 base = first;
  for (; base + (ILP - 1) * bd < n; base += step) {
    uint4 v[ILP];
#pragma unroll
    for (int k = 0; k < ILP; ++k) v[k] = op.load(base + k * bd);
#pragma unroll
    for (int k = 0; k < ILP; ++k) op.use(base + k * bd, v[k]);
  }
#pragma unroll
  for (int k = 0; k < ILP; ++k) {
    const i64 i = base + k * bd;
    if (i < n) op.use(i, op.load(i));
  }
}

// read: every word read is added into a register, stored once per thread (so no load is
// dead code).
template <bool NC>
struct ReadOp {
  const uint4* src;
  unsigned int acc;
  __device__ __forceinline__ uint4 load(i64 i) { return load16<NC>(src + i); }
  __device__ __forceinline__ void use(i64, uint4 v) { acc += v.x + v.y + v.z + v.w; }
};

// write: a constant, no load.
struct WriteOp {
  uint4* dst;
  uint4 value;
  __device__ __forceinline__ uint4 load(i64) { return value; }
  __device__ __forceinline__ void use(i64 i, uint4 v) { dst[i] = v; }
};

// rmw: +1 on each 32-bit word, in place (the default path: the buffer is written).
struct RmwOp {
  uint4* buf;
  __device__ __forceinline__ uint4 load(i64 i) { return load16<false>(buf + i); }
  __device__ __forceinline__ void use(i64 i, uint4 v) {
    v.x += 1u;
    v.y += 1u;
    v.z += 1u;
    v.w += 1u;
    buf[i] = v;
  }
};

// copy: src -> dst, both host buffers.
template <bool NC>
struct CopyOp {
  const uint4* src;
  uint4* dst;
  __device__ __forceinline__ uint4 load(i64 i) { return load16<NC>(src + i); }
  __device__ __forceinline__ void use(i64 i, uint4 v) { dst[i] = v; }
};

__device__ __forceinline__ i64 thread_id() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }

template <int ILP, bool NC>
__device__ __forceinline__ void probe_read(const uint4* src, i64 n, unsigned int* sink) {
  ReadOp<NC> op{src, 0u};
  sweep<ILP>(op, n, tile_first<ILP>(blockIdx.x), tile_step<ILP>(gridDim.x));
  sink[thread_id()] = op.acc;
}

template <int ILP>
__device__ __forceinline__ void probe_write(uint4* dst, i64 n, unsigned int value) {
  WriteOp op{dst, splat(value)};
  sweep<ILP>(op, n, tile_first<ILP>(blockIdx.x), tile_step<ILP>(gridDim.x));
}

template <int ILP>
__device__ __forceinline__ void probe_rmw(uint4* buf, i64 n) {
  RmwOp op{buf};
  sweep<ILP>(op, n, tile_first<ILP>(blockIdx.x), tile_step<ILP>(gridDim.x));
}

template <int ILP, bool NC>
__device__ __forceinline__ void probe_copy(const uint4* src, uint4* dst, i64 n) {
  CopyOp<NC> op{src, dst};
  sweep<ILP>(op, n, tile_first<ILP>(blockIdx.x), tile_step<ILP>(gridDim.x));
}

// split: even blocks read src, odd blocks write dst, each role over its whole buffer with
// its own stride; interleaved so that every SM runs warps of both roles at once. Needs
// gridDim.x >= 2. Writers store 0 to sink.
template <int ILP, bool NC>
__device__ __forceinline__ void probe_split(const uint4* src, uint4* dst, i64 n, unsigned int* sink,
                                            unsigned int value) {
  const unsigned int role = blockIdx.x & 1u;                // 0: reader, 1: writer
  const unsigned int rank = blockIdx.x >> 1;                // index among the blocks of its role
  const unsigned int blocks = (gridDim.x + 1u - role) / 2u;  // blocks of its role
  unsigned int acc = 0u;
  if (role == 0u) {
    ReadOp<NC> op{src, 0u};
    sweep<ILP>(op, n, tile_first<ILP>(rank), tile_step<ILP>(blocks));
    acc = op.acc;
  } else {
    WriteOp op{dst, splat(value)};
    sweep<ILP>(op, n, tile_first<ILP>(rank), tile_step<ILP>(blocks));
  }
  sink[thread_id()] = acc;
}

// The entry points: probe_<kind>_<load>_ilp<ILP>, as zero_copy_probe.kernel_name() spells.
#define PROBE_KERNELS(ILP)                                                                      \
  extern "C" __global__ void probe_read_default_ilp##ILP(const uint4* src, i64 n,               \
                                                         unsigned int* sink) {                  \
    probe_read<ILP, false>(src, n, sink);                                                       \
  }                                                                                             \
  extern "C" __global__ void probe_read_nc_ilp##ILP(const uint4* src, i64 n, unsigned int* sink) { \
    probe_read<ILP, true>(src, n, sink);                                                        \
  }                                                                                             \
  extern "C" __global__ void probe_write_none_ilp##ILP(uint4* dst, i64 n, unsigned int value) { \
    probe_write<ILP>(dst, n, value);                                                            \
  }                                                                                             \
  extern "C" __global__ void probe_rmw_default_ilp##ILP(uint4* buf, i64 n) {                    \
    probe_rmw<ILP>(buf, n);                                                                     \
  }                                                                                             \
  extern "C" __global__ void probe_copy_default_ilp##ILP(const uint4* src, uint4* dst, i64 n) { \
    probe_copy<ILP, false>(src, dst, n);                                                        \
  }                                                                                             \
  extern "C" __global__ void probe_copy_nc_ilp##ILP(const uint4* src, uint4* dst, i64 n) {      \
    probe_copy<ILP, true>(src, dst, n);                                                         \
  }                                                                                             \
  extern "C" __global__ void probe_split_default_ilp##ILP(const uint4* src, uint4* dst, i64 n,  \
                                                          unsigned int* sink,                   \
                                                          unsigned int value) {                 \
    probe_split<ILP, false>(src, dst, n, sink, value);                                          \
  }

PROBE_KERNELS(1)
PROBE_KERNELS(2)
PROBE_KERNELS(4)
PROBE_KERNELS(8)
"""


# -- pure helpers (no CuPy) ---------------------------------------------------------------


def kernel_name(kind: str, load: str, ilp: int) -> str:
    """Entry point of one kernel in :data:`KERNEL_SOURCE`."""
    return f"probe_{kind}_{load}_ilp{ilp}"


def gbps(nbytes: int, ms: float) -> float:
    """Rate in GB/s (1e9 B/s) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


def pcie_bytes(kind: str, buffer_bytes: int) -> int:
    """Bytes that cross PCIe when a ``kind`` kernel sweeps a buffer of ``buffer_bytes``."""
    return PCIE_FACTOR[kind] * buffer_bytes


def kernel_args(kind: str, a_dev: int, b_dev: int, n: int, sink) -> tuple:
    """Arguments of a ``kind`` kernel over ``n`` uint4: pointers as 8-byte integers."""
    a, b, n = np.uint64(a_dev), np.uint64(b_dev), np.int64(n)
    value = np.uint32(WRITE_VALUE)
    return {
        "read": (a, n, sink),
        "write": (b, n, value),
        "rmw": (a, n),
        "copy": (a, b, n),
        "split": (a, b, n, sink, value),
    }[kind]


def make_row(kind: str, load: str, ilp: int, threads: int, blocks: int, sm_count: int,
             buffer_bytes: int, samples: list[float], memcpy: dict) -> dict:
    """One result row: median time, PCIe GB/s and the fraction of the matching memcpy rate."""
    ms = statistics.median(samples)
    rate = gbps(pcie_bytes(kind, buffer_bytes), ms)
    baseline = memcpy[BASELINE[kind] + "_gbps"]
    return {
        "kind": kind, "load": load, "ilp": ilp, "threads": threads, "blocks": blocks,
        "blocks_per_sm": blocks / sm_count, "ms": ms, "gbps": rate,
        "baseline": BASELINE[kind], "baseline_gbps": baseline, "fraction": rate / baseline,
        "pcie_bytes": pcie_bytes(kind, buffer_bytes), "ms_samples": samples,
    }


def sort_rows(rows: list[dict]) -> list[dict]:
    """Rows by kind (in :data:`KINDS` order), then fastest first."""
    return sorted(rows, key=lambda r: (KINDS.index(r["kind"]), -r["gbps"]))


def best_per_kind(rows: list[dict]) -> dict[str, dict]:
    """The fastest row of each kind present."""
    best = {}
    for row in rows:
        if row["kind"] not in best or row["gbps"] > best[row["kind"]]["gbps"]:
            best[row["kind"]] = row
    return best


def format_table(rows: list[dict]) -> str:
    """The compact text table of :func:`sort_rows` order."""
    header = (f"{'kind':<6} {'load':<8} {'ILP':>3} {'threads':>7} {'blocks':>7} {'/SM':>5} "
              f"{'ms':>8} {'GB/s':>7} {'of':>6} memcpy")
    lines = [header, "-" * len(header)]
    for r in sort_rows(rows):
        lines.append(
            f"{r['kind']:<6} {r['load']:<8} {r['ilp']:>3} {r['threads']:>7} {r['blocks']:>7} "
            f"{r['blocks_per_sm']:>5g} {r['ms']:>8.3f} {r['gbps']:>7.1f} "
            f"{r['fraction']:>6.3f} {r['baseline']}"
        )
    return "\n".join(lines)


def format_best(rows: list[dict]) -> str:
    """One line per kind: its best configuration."""
    lines = []
    for kind, r in sorted(best_per_kind(rows).items(), key=lambda kv: KINDS.index(kv[0])):
        lines.append(
            f"best {kind:<6} {r['gbps']:6.1f} GB/s = {r['fraction']:.3f} of memcpy {r['baseline']} "
            f"({r['baseline_gbps']:.1f}): load {r['load']}, ILP {r['ilp']}, {r['blocks']} x "
            f"{r['threads']} threads ({r['blocks_per_sm']:g}/SM)"
        )
    return "\n".join(lines)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _kind_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    """Command line; ``--quick`` fills in the sweep lists not given explicitly."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of each host buffer (MiB)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="timed launches (median; default 10, quick 5)")
    ap.add_argument("--ilp", type=_int_list, default=None, help=f"comma list from {ILPS}")
    ap.add_argument("--blocks-per-sm", type=_int_list, default=None, help="comma list (default 1,2,4,8,16)")
    ap.add_argument("--threads", type=_int_list, default=DEFAULT_THREADS, help="comma list (default 256)")
    ap.add_argument("--kinds", type=_kind_list, default=KINDS, help="comma list from " + ",".join(KINDS))
    ap.add_argument("--quick", action="store_true",
                    help=f"ILP {QUICK_ILPS}, blocks/SM {QUICK_BLOCKS_PER_SM}, {QUICK_REPEATS} repeats")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    args = ap.parse_args(argv)
    if args.ilp is None:
        args.ilp = QUICK_ILPS if args.quick else ILPS
    if args.blocks_per_sm is None:
        args.blocks_per_sm = QUICK_BLOCKS_PER_SM if args.quick else DEFAULT_BLOCKS_PER_SM
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else 10
    if not set(args.ilp) <= set(ILPS):
        ap.error(f"--ilp: compiled for {ILPS} only, got {args.ilp}")
    if not set(args.kinds) <= set(KINDS):
        ap.error(f"--kinds: from {KINDS}, got {args.kinds}")
    if any(t % 32 or not 32 <= t <= 1024 for t in args.threads):
        ap.error(f"--threads: multiples of 32 in [32, 1024], got {args.threads}")
    if not (args.ilp and args.blocks_per_sm and args.threads and args.kinds):
        ap.error("--ilp, --blocks-per-sm, --threads and --kinds need at least one value each")
    if args.mib < CHECK_MIB or min(args.blocks_per_sm) < 1 or args.repeats < 1:
        ap.error(f"need --mib >= {CHECK_MIB}, --blocks-per-sm >= 1, --repeats >= 1")
    return args


def sweep_configs(args: argparse.Namespace, sm_count: int) -> list[tuple[str, str, int, int, int]]:
    """(kind, load, ilp, threads, blocks) for every configuration to time, in run order."""
    return [
        (kind, load, ilp, threads, max(2, sm_count * bps))
        for kind, load in VARIANTS if kind in args.kinds
        for ilp in args.ilp
        for threads in args.threads
        for bps in args.blocks_per_sm
    ]


# -- on the GPU ----------------------------------------------------------------------------


def time_ms(cp, stream, enqueue, repeats: int) -> list[float]:
    """CUDA-event times (ms) of ``enqueue(stream)``, ``repeats`` runs after one warm-up."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for i in range(repeats + 1):
        start.record(stream)
        enqueue(stream)
        stop.record(stream)
        stop.synchronize()
        if i:
            samples.append(cp.cuda.get_elapsed_time(start, stop))
    return samples


def bench_memcpy(cp, a_host: int, b_host: int, nbytes: int, repeats: int) -> dict:
    """Pinned memcpy GB/s on the probe's buffers: A -> GPU, GPU -> B, and both at once."""
    rt = cp.cuda.runtime
    d_in, d_out = cp.empty(nbytes, cp.uint8), cp.ones(nbytes, cp.uint8)
    side = cp.cuda.Stream(non_blocking=True)
    fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)

    def h2d(stream):
        rt.memcpyAsync(d_in.data.ptr, a_host, nbytes, rt.memcpyHostToDevice, stream.ptr)

    def d2h(stream):
        rt.memcpyAsync(b_host, d_out.data.ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)

    def both(stream):
        # D2H on a second stream between the timing events of the first
        fork.record(stream)
        side.wait_event(fork)
        h2d(stream)
        d2h(side)
        join.record(side)
        stream.wait_event(join)

    main_stream = cp.cuda.Stream(non_blocking=True)
    ms = {name: statistics.median(time_ms(cp, main_stream, fn, repeats))
          for name, fn in (("h2d", h2d), ("d2h", d2h), ("both", both))}
    del d_in, d_out
    cp.get_default_memory_pool().free_all_blocks()
    return {
        "bytes": nbytes,
        "h2d_gbps": gbps(nbytes, ms["h2d"]),
        "d2h_gbps": gbps(nbytes, ms["d2h"]),
        "both_gbps": gbps(2 * nbytes, ms["both"]),
        "ms": ms,
    }


def check_kernel(cp, kind: str, launch, a_words: np.ndarray, b_words: np.ndarray, n_check: int) -> None:
    """Run ``launch(n_check)`` once on known data and check the result on the host.

    ``a_words``/``b_words``: host views (uint32) of the first ``n_check + 3`` uint4 of A
    and B; the 3 uint4 past ``n_check`` must stay untouched (and would change a read sum).
    Raises ``RuntimeError`` naming what is wrong.
    """
    words = 4 * n_check
    pattern = np.arange(words, dtype=np.uint32)
    a_words[:words] = pattern
    a_words[words:] = SENTINEL
    b_words[:] = 0
    sink = launch(n_check)
    cp.cuda.Device().synchronize()
    problems = []
    if kind in ("read", "split"):
        got = int(sink.sum(dtype=cp.uint64)) % 2**32
        want = int(pattern.sum(dtype=np.uint64)) % 2**32
        if got != want:
            problems.append(f"sum of the words read is {got}, want {want}")
    want_a = pattern + np.uint32(1) if kind == "rmw" else pattern
    want_b = {"write": np.uint32(WRITE_VALUE), "split": np.uint32(WRITE_VALUE), "copy": pattern}.get(kind, 0)
    for name, got, want in (("A", a_words[:words], want_a), ("B", b_words[:words], want_b),
                            ("A past n", a_words[words:], SENTINEL), ("B past n", b_words[words:], 0)):
        bad = np.flatnonzero(got != want)
        if bad.size:
            problems.append(f"{name}: {bad.size} words wrong, first at word {bad[0]}: {got[bad[0]]:#x}")
    if problems:
        raise RuntimeError(f"{kind} kernel check failed: " + "; ".join(problems))


def run_sweep(cp, module, args, a: tuple[int, int], b: tuple[int, int], nbytes: int,
              sm_count: int, memcpy: dict) -> list[dict]:
    """Check and time every configuration of :func:`sweep_configs`; returns the rows.

    ``a``, ``b``: (host pointer, device pointer) of the two mapped buffers. The kernels get
    the device pointers; the host pointers serve the checks only.
    """
    n_full = nbytes // 16
    n_check = (CHECK_MIB << 20) // 16 - 3  # no multiple of any tile: the partial pass runs
    a_words = dk.host_view(a[0], 4 * (n_check + 3), np.uint32)
    b_words = dk.host_view(b[0], 4 * (n_check + 3), np.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for kind, load, ilp, threads, blocks in sweep_configs(args, sm_count):
        kernel = module.get_function(kernel_name(kind, load, ilp))
        sink = cp.zeros(blocks * threads, cp.uint32)

        def launch(n, stream=stream):
            with stream:
                kernel((blocks,), (threads,), kernel_args(kind, a[1], b[1], n, sink))
            return sink

        check_kernel(cp, kind, launch, a_words, b_words, n_check)
        samples = time_ms(cp, stream, lambda s: launch(n_full, s), args.repeats)
        row = make_row(kind, load, ilp, threads, blocks, sm_count, nbytes, samples, memcpy)
        print(f"  {kind:<6} {load:<8} ILP {ilp} {blocks:>5} x {threads:<4} {row['gbps']:7.1f} GB/s",
              file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def _load_cupy(device: int):
    """CuPy and the device's properties, or a message saying what is missing."""
    try:
        import cupy as cp  # noqa: PLC0415 - CuPy is optional: the module imports without it
    except ImportError as e:
        return None, None, f"needs CuPy (pip install cupy-cuda13x or cupy-cuda12x): {e}"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as e:
        return None, None, f"no usable CUDA driver/GPU: {e}"
    if device >= count:
        return None, None, f"needs CUDA device {device}, found {count}"
    props = cp.cuda.runtime.getDeviceProperties(device)
    if not props.get("canMapHostMemory", 1):
        return None, None, f"device {device} cannot map host memory"
    return cp, props, None


def main(argv=None) -> int:
    args = parse_args(argv)
    cp, props, missing = _load_cupy(args.device)
    if missing:
        print(f"zero_copy_probe: {missing}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cp.cuda.Device(args.device).use()
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sm_count = int(props["multiProcessorCount"])
    nbytes = args.mib << 20
    module = cp.RawModule(code=KERNEL_SOURCE, options=("-std=c++17",))
    frees = []
    try:
        a_host, a_dev, free_a = dk.alloc_mapped(nbytes, args.device)
        frees.append(free_a)
        b_host, b_dev, free_b = dk.alloc_mapped(nbytes, args.device)
        frees.append(free_b)
        memcpy = bench_memcpy(cp, a_host, b_host, nbytes, args.repeats)
        print(f"{name}, {sm_count} SMs, CuPy {cp.__version__}, {args.mib} MiB buffers", flush=True)
        print(f"memcpy pinned: H2D {memcpy['h2d_gbps']:.1f}, D2H {memcpy['d2h_gbps']:.1f}, "
              f"both at once {memcpy['both_gbps']:.1f} GB/s (total)", flush=True)
        rows = run_sweep(cp, module, args, (a_host, a_dev), (b_host, b_dev), nbytes, sm_count, memcpy)
    finally:
        try:
            cp.cuda.Device(args.device).synchronize()
        finally:
            for free in frees:
                free()
    print(format_table(rows))
    print(format_best(rows))
    seconds = time.perf_counter() - t0
    print(f"{len(rows)} configurations in {seconds:.1f} s")
    if args.json is not None:
        result = {
            "device": name, "host": platform.node(), "cupy": cp.__version__, "commit": git_commit(),
            "sm_count": sm_count, "mib": args.mib, "repeats": args.repeats, "seconds": seconds,
            "sweep": {"kinds": args.kinds, "ilp": args.ilp, "blocks_per_sm": args.blocks_per_sm,
                      "threads": args.threads},
            "memcpy": memcpy, "rows": sort_rows(rows),
            "best": {k: {key: v for key, v in r.items() if key != "ms_samples"}
                     for k, r in best_per_kind(rows).items()},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
