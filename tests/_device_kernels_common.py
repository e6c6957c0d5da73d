"""Shared by the tests of the `gpu` mode kernels (tests/test_device_kernels.py: the sources and the contract;
tests/test_device_kernels_refs.py: torch and optax on the GPU, mapped memory, the benchmark): the cases, NumPy
helpers, mismatch reports, and the GPU fixtures (``cp``, ``mapped``) that skip without CuPy or a CUDA device."""

from __future__ import annotations

import os

# JAX (the XLA comparison) shares the GPU with CuPy and torch in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from trainstream import contract as C  # noqa: E402
from trainstream import _device_kernels as dk  # noqa: E402

gpu = pytest.mark.gpu
STEPS = int(os.environ.get("TRAINSTREAM_GPU_TEST_STEPS", "50"))
#: optax/cuda vs the IEEE host reference: the contract's bound, unless overridden (see
#: test_adamw_matches_contract for the unit).
OPTAX_CUDA_BOUND = float(os.environ.get("TRAINSTREAM_OPTAX_CUDA_MAX_ULP", C.OPTAX_CUDA_MAX_ULP))

HPS = [
    C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01),
    C.AdamWHyperParams(3e-2, 0.3, 0.95, 1e-6, 0.0),  # lerp weight >= 0.5
    C.AdamWHyperParams(1e-2, 0.5, 0.99, 1e-8, 0.1),  # lerp weight exactly 0.5
]
VARIANTS = {  # the variants with CUDA kernels (the cpu platforms' arithmetic is the host kernels')
    C.VARIANT_TORCH_CUDA: ("torch", "cuda"),
    C.VARIANT_OPTAX_CUDA: ("optax", "cuda"),
}
VNAME = {v: f"{c}/{p}" for v, (c, p) in VARIANTS.items()}
DTYPE_COMBOS = [  # (weights, gradient)
    ("float32", "float32"),
    ("float32", "bfloat16"),
    ("float32", "float16"),
    ("bfloat16", "bfloat16"),
    ("bfloat16", "float32"),
    ("float16", "float16"),
    ("float16", "float32"),
]
# element offsets of (param, grad, master, m, v) from an aligned allocation
LAYOUTS = {
    "aligned": (0, 0, 0, 0, 0),
    "shifted": (1, 1, 1, 1, 1),  # same misalignment everywhere: scalar head, then vectors
    "mixed": (0, 0, 0, 1, 2),  # m and v mutually misaligned: all scalar
    "grad_odd": (0, 1, 0, 0, 0),  # gradient misaligned: all scalar
}
SIZES_LAYOUTS = [(1, "aligned"), (1, "shifted"), (3, "aligned"), (3, "shifted")] + [
    (n, lay) for n in (4095, 4097) for lay in LAYOUTS
] + [(1000003, "shifted")]


# -- helpers (NumPy only) ----------------------------------------------------------------


def _storage_np(dtype: str):
    return np.float32 if dtype == "float32" else np.uint16


def _to_storage(x32: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return np.asarray(x32, np.float32)
    if dtype == "float16":
        return np.asarray(x32, np.float32).astype(np.float16).view(np.uint16)
    return C.f32_to_bf16_bits(x32)


def _from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return np.asarray(a, np.float32)
    if dtype == "float16":
        return np.asarray(a, np.uint16).view(np.float16).astype(np.float32)
    return C.bf16_bits_to_f32(a)


def _ulps(a, b) -> np.ndarray:
    """float32 ULP distance on the ordered integer line (equal NaNs: 0)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    ia = a.view(np.int32).astype(np.int64)
    ib = b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(2**31) - ia, ia)
    ib = np.where(ib < 0, -(2**31) - ib, ib)
    return np.where(np.isnan(a) & np.isnan(b), 0, np.abs(ia - ib))


def _fmt(x) -> str:
    x = np.float32(x)
    return f"{float(x)!r} (0x{int(x.view(np.uint32)):08x})"


def _regions(n, m_ptr, v_ptr, master_ptr, param_ptr, p_item, grad_ptr, g_item):
    """The kernel's split of [0, n): (head, vectorised?, tail start), as kernels/adamw.cu."""
    head = min(n, ((16 - (m_ptr & 15)) & 15) // 4)
    vec = ((m_ptr + 4 * head) % 16 == 0 and (v_ptr + 4 * head) % 16 == 0
           and (master_ptr == 0 or (master_ptr + 4 * head) % 16 == 0)
           and (param_ptr + p_item * head) % (4 * p_item) == 0
           and (grad_ptr + g_item * head) % (4 * g_item) == 0)
    if not vec:
        head = n
    return head, vec, head + ((n - head) // 4) * 4


def _where(i, regions) -> str:
    head, vec, tail = regions
    if not vec:
        return "scalar path (arrays not mutually aligned)"
    return "scalar head" if i < head else ("vector body" if i < tail else "scalar tail")


def _distance(got, want, prev=None) -> np.ndarray:
    """ULPs of the result; with `prev` (the weight before the step), ULPs of the larger
    operand of p + update, max(|prev|, |want|): the sound measure for an approximate update
    (1 ULP of the update is many ULPs of a result that cancels to near zero)."""
    return _ulps(got, want) if prev is None else C.update_ulps(got, want, prev)


def _mismatch_report(title, name, got, want, inputs, regions=None, ulp_bound=0, limit=6, prev=None):
    """A readable account of where `got` and `want` differ, with each element's inputs."""
    d = _distance(got, want, prev)
    bad = np.flatnonzero(d > ulp_bound)
    unit = "ULP" if prev is None else "ULP of max(|p|, |update|, |p_new|)"
    lines = [f"{title}: {name} differs from the reference in {bad.size} of {got.size} elements "
             f"(max {float(d.max(initial=0)):.4g} {unit}, bound {ulp_bound})"]
    if prev is not None or ulp_bound:
        edges = [0, 1, 2, 4, 16, np.inf]
        hist = np.histogram(d[d > 0], bins=edges)[0]
        lines.append("  distances of the differing elements: " + ", ".join(
            f"({lo:g}, {hi:g}]: {c}" for lo, hi, c in zip(edges[:-1], edges[1:], hist))
            + f"; plain ULPs of the result: max {int(_ulps(got, want).max(initial=0))}")
    for i in bad[:limit]:
        where = f" [{_where(int(i), regions)}]" if regions else ""
        ins = ", ".join(f"{k}={_fmt(v[i])}" for k, v in inputs.items())
        lines.append(f"  [{i}]{where} got {_fmt(got[i])} want {_fmt(want[i])} "
                     f"({float(d[i]):.4g} {unit}); inputs: {ins}")
    return "\n".join(lines)


# -- GPU fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        pytest.skip(f"no usable CUDA device: {e}")
    if count < 1:
        pytest.skip("no CUDA device")
    dk.compile_kernels()
    return cupy


@pytest.fixture
def mapped(cp):
    """make(n, offset, dtype) -> (numpy view on the host, device pointer), freed at teardown."""
    frees = []

    def make(n, offset=0, dtype=np.float32):
        item = np.dtype(dtype).itemsize
        host, dev, free = dk.alloc_mapped((n + offset) * item + 64)
        frees.append(free)
        return dk.host_view(host + offset * item, n, dtype), dev + offset * item

    yield make
    cp.cuda.Device().synchronize()
    for free in frees:
        free()


def _device_array(cp, values: np.ndarray, offset: int):
    """A CuPy array holding `values`, starting `offset` elements past an aligned block."""
    buf = cp.zeros(values.size + offset + 8, dtype=values.dtype)
    arr = buf[offset:offset + values.size]
    arr.set(values)
    return arr


def _stream(cp) -> int:
    return cp.cuda.get_current_stream().ptr
