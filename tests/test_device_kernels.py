"""The `gpu` mode kernels, kernels/adamw.cu (package data trainstream/kernels/ once
installed), through trainstream._device_kernels.

GPU tests carry the ``gpu`` marker and skip where CuPy or a CUDA device is missing; the
few tests without the marker need neither (source/contract consistency, lazy import,
argument checks). Every GPU comparison is per step and from identical inputs, so a
failure names the first step, array and elements that differ, with their inputs.

``TRAINSTREAM_GPU_TEST_STEPS`` (default 50) sets the number of steps of the long runs;
``TRAINSTREAM_OPTAX_CUDA_MAX_ULP`` overrides the optax/cuda bound
(``trainstream.contract.OPTAX_CUDA_MAX_ULP``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# JAX (the XLA comparison) shares the GPU with CuPy and torch in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

from trainstream import contract as C
from trainstream import _device_kernels as dk
from trainstream import _device_recipes as R
from _experiments import load_script

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


# -- CPU tests: no CuPy, no GPU --------------------------------------------------------------


def test_kernel_sources_match_contract_constants():
    dk.check_kernel_constants()


def test_every_kernel_name_is_defined_in_the_program():
    """Every name the loader compiles (the conventions' and the recipes') is an extern "C" kernel of the program:
    the macros' expansions, checked by reading the sources the way the preprocessor would not (names built from
    token pastes): each conventions kernel by its TS_VARIANT / TS_VARIANT_GRADS lines, each recipe kernel by
    TS_TORCH_IMPL / TS_TORCH_GRADS."""
    src = dk.program_source()
    for v in VARIANTS:
        for pd in dk.DTYPES:
            for gd in dk.DTYPES:
                vname, pname, gname = dk.adamw_kernel_name(v, pd, gd).removeprefix("adamw_").rsplit("_", 2)
                assert f"TS_VARIANT({vname}," in src
                assert f"TS_VARIANT_GRADS(VN, M, {pname}," in src and f"adamw_##VN##_##PN##_{gname}," in src
    names = dk.recipe_kernel_names()
    assert len(names) == len(set(names)) == 30
    for name in names:
        impl, p, g, st = name.removeprefix("adamw_torch_").split("_")
        assert f"TS_TORCH_IMPL({impl}," in src and f"adamw_torch_##IMPL##_##PN##_{g}_##SN," in src
        assert re.search(rf"TS_TORCH_GRADS\(IMPL, \w+, {p}, \w+, {st}, \w+\)", src), name


def test_program_compiles_for_hopper_with_nvcc(tmp_path):
    """Where nvcc is installed (no GPU needed): the program as the loader joins it compiles for sm_90 with the
    loader's options, defines every kernel the loader loads, and keeps its state in registers (no local memory)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    src = tmp_path / "adamw_program.cu"
    src.write_text(dk.program_source())
    opts = [o.replace("--fmad=", "-fmad=").replace("--ftz=", "-ftz=").replace("--prec-", "-prec-")
            for o in dk.COMPILE_OPTIONS]
    out = subprocess.run([nvcc, "-arch=sm_90", "-cubin", *opts, "-Xptxas", "-v", "-o", str(tmp_path / "a.cubin"),
                          str(src)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    compiled = set(re.findall(r"Compiling entry function '(\w+)'", out.stderr))
    names = ([dk.adamw_kernel_name(v, p, g) for v in VARIANTS for p in dk.DTYPES for g in dk.DTYPES]
             + [dk.adamw_u_kernel_name(C.VARIANT_OPTAX_CUDA, g) for g in dk.DTYPES] + dk.recipe_kernel_names())
    assert set(names) <= compiled, sorted(set(names) - compiled)
    assert "bytes stack frame" not in out.stderr or " 0 bytes stack frame" in out.stderr
    assert not re.search(r"[1-9]\d* bytes (spill stores|stack frame)", out.stderr), out.stderr[-4000:]


def test_kernel_sources_are_package_data():
    """The .cu files are read from the package data (importlib.resources; tests/test_wheel_install.py,
    test_readonly_install.py), in a checkout from its top-level kernels/; a missing one raises
    FileNotFoundError naming it."""
    root = Path(dk.__file__).resolve().parents[1]
    assert sorted(p.name for p in (root / "kernels").glob("*.cu")) == sorted(dk.KERNEL_SOURCES)
    for name in dk.KERNEL_SOURCES:
        assert dk.kernel_source(name) == (root / "kernels" / name).read_text()
    assert dk.program_source().startswith(dk.kernel_source(dk.ADAMW_SOURCE))
    with pytest.raises(FileNotFoundError, match=r"trainstream/kernels/no_such\.cu"):
        dk.kernel_source("no_such.cu")
    assert not hasattr(dk, "KERNEL_DIR")


def test_import_is_lazy_and_names_the_extras():
    code = (
        "import sys; sys.modules['cupy'] = None\n"  # makes `import cupy` fail
        "import trainstream._device_kernels as dk\n"
        "assert 'torch' not in sys.modules and 'jax' not in sys.modules\n"
        "try:\n"
        "    dk.alloc_mapped(16)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(Path(dk.__file__).resolve().parents[1]), check=False)
    assert out.returncode == 0, out.stderr
    assert "trainstream[cuda12]" in out.stdout and "trainstream[cuda13]" in out.stdout, out.stdout


@pytest.mark.parametrize("kwargs, match", [
    (dict(variant=7), "Unknown kernel variant"),
    (dict(param_dtype="int8"), "Unsupported dtype"),
    (dict(master_ptr=256), "own master"),
    (dict(param_dtype="bfloat16", master_ptr=0), "master_ptr"),
    (dict(m_ptr=258), "4-byte aligned"),
    (dict(v_ptr=0), "null pointer"),
    (dict(scalars=np.zeros(11, np.float32)), "shape"),
    (dict(scalars=None), "scalars_ptr"),
    (dict(n=-1), "n must be"),
    (dict(max_blocks=0), "max_blocks"),
    (dict(max_blocks=2.5), "max_blocks"),
])
def test_launch_adamw_rejects_bad_arguments_before_touching_cuda(kwargs, match):
    args = dict(variant=C.VARIANT_TORCH_CUDA, param_ptr=256, param_dtype="float32", grad_ptr=512,
                grad_dtype="float32", master_ptr=0, m_ptr=1024, v_ptr=2048, n=10,
                scalars=np.zeros(C.N_SCALARS, np.float32))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dk.launch_adamw(**args)


def test_launch_adamw_of_nothing_takes_null_pointers():
    """An empty parameter: its tensors' data pointers may be null; nothing is launched
    (so nothing touches CUDA either); a non-empty one still refuses them."""
    args = dict(variant=C.VARIANT_TORCH_CUDA, param_ptr=0, param_dtype="bfloat16", grad_ptr=0,
                grad_dtype="bfloat16", master_ptr=0, m_ptr=0, v_ptr=0, n=0,
                scalars=np.zeros(C.N_SCALARS, np.float32))
    assert dk.launch_adamw(**args) is None
    with pytest.raises(ValueError, match="null pointer"):
        dk.launch_adamw(**{**args, "n": 1})


def _multi_item(**kw):
    item = dict(param_ptr=256, grad_ptr=512, master_ptr=0, m_ptr=1024, v_ptr=2048, n=10,
                scalars=np.zeros(C.N_SCALARS, np.float32))
    item.update(kw)
    return tuple(item.values())


@pytest.mark.parametrize("items, kwargs, match", [
    ([_multi_item()] * (dk.MULTI_MAX + 1), {}, "at most 32 tensors"),
    ([_multi_item(), _multi_item(m_ptr=258)], {}, r"items\[1\]\.m_ptr = 0x102 is not 4-byte aligned"),
    ([_multi_item(grad_ptr=0)], {}, r"items\[0\]\.grad_ptr is a null pointer"),
    ([_multi_item(master_ptr=256)], {}, "own master"),
    ([_multi_item()], dict(param_dtype="bfloat16"), r"items\[0\]\.master_ptr \(required for bfloat16"),
    ([_multi_item(n=-1)], {}, "n must be >= 0"),
    ([_multi_item(scalars=np.zeros(3, np.float32))], {}, "scalars must have shape"),
    ([_multi_item()[:6]], {}, "expected \\(param_ptr"),
    ([_multi_item()], dict(variant=9), "Unknown kernel variant"),
])
def test_launch_adamw_multi_rejects_bad_arguments_before_touching_cuda(items, kwargs, match):
    """Every tensor is checked before anything is launched (no CuPy here: a launch would
    raise ImportError, not the ValueError naming the bad item)."""
    args = dict(variant=C.VARIANT_TORCH_CUDA, param_dtype="float32", grad_dtype="float32", items=items)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        dk.launch_adamw_multi(**args)


def test_launch_adamw_multi_of_empty_tensors_launches_nothing():
    """Empty tensors (null pointers allowed) are checked like the others, then skipped: no
    launch, so nothing touches CUDA."""
    assert dk.launch_adamw_multi(C.VARIANT_TORCH_CUDA, "bfloat16", "bfloat16", []) == 0
    empty = _multi_item(param_ptr=0, grad_ptr=0, m_ptr=0, v_ptr=0, n=0)
    assert dk.launch_adamw_multi(C.VARIANT_TORCH_CUDA, "bfloat16", "bfloat16", [empty] * 3) == 0
    with pytest.raises(ValueError, match=r"items\[1\]: scalars must have shape"):
        dk.launch_adamw_multi(C.VARIANT_TORCH_CUDA, "bfloat16", "bfloat16",
                              [empty, _multi_item(param_ptr=0, grad_ptr=0, m_ptr=0, v_ptr=0, n=0,
                                                  scalars=np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match=r"items\[0\]\.m_ptr = 0x102 is not 4-byte aligned"):
        dk.launch_adamw_multi(C.VARIANT_TORCH_CUDA, "float32", "float32", [_multi_item(n=0, m_ptr=258)])


def test_multi_batch_layout_matches_the_kernel_source():
    """ctypes mirror of TsMultiItem / TsMultiBatch: same field order, sizes, TS_MULTI_MAX (a batch within the
    4 KiB of kernel parameters that every CUDA driver accepts)."""
    import ctypes
    src = dk.kernel_source(dk.ADAMW_SOURCE)
    assert f"#define TS_MULTI_MAX {dk.MULTI_MAX}" in src
    body = src[src.index("struct TsMultiItem {"):]
    body = body[:body.index("};")]
    fields = [line.split(";")[0].split()[-1].lstrip("*") for line in body.splitlines()[1:] if ";" in line]
    assert fields == [name for name, _ in dk._MultiItem._fields_]
    assert f"#define TS_SCALAR_SETS {dk.SCALAR_SETS}" in src and "TsScalars sets[TS_SCALAR_SETS];" in src
    assert ctypes.sizeof(dk._MultiItem) == 88
    assert ctypes.sizeof(dk._MultiBatch) == dk.SCALAR_SETS * 4 * R.N_SCALARS + dk.MULTI_MAX * 88 == 3488 <= 4096


def test_dtype_names():
    assert dk.adamw_kernel_name(C.VARIANT_OPTAX_CUDA, "bf16", np.float32) == "adamw_optax_cuda_bf16_f32"
    assert dk.adamw_kernel_name(C.VARIANT_TORCH_CUDA, "torch.float16", "half") == "adamw_torch_cuda_f16_f16"


@pytest.mark.parametrize("variant", [C.VARIANT_TORCH_CPU, C.VARIANT_OPTAX_CPU])
def test_host_only_variants_have_no_cuda_kernel(variant):
    """The cpu platforms' arithmetic runs in the host kernels only: naming it for a launch says so."""
    with pytest.raises(ValueError, match="has no CUDA kernel"):
        dk.adamw_kernel_name(variant, "float32", "float32")
    with pytest.raises(ValueError, match="has no CUDA kernel"):
        dk.adamw_u_kernel_name(variant, "float32")
    with pytest.raises(ValueError, match="no kernel that writes u"):
        dk.adamw_u_kernel_name(C.VARIANT_TORCH_CUDA, "float32")


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


# -- the kernel against the contract ----------------------------------------------------------


@gpu
@pytest.mark.parametrize("n, layout", SIZES_LAYOUTS, ids=[f"n{n}-{lay}" for n, lay in SIZES_LAYOUTS])
@pytest.mark.parametrize("pd, gd", DTYPE_COMBOS, ids=[f"w{p}-g{g}" for p, g in DTYPE_COMBOS])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=[VNAME[v].replace("/", "_") for v in VARIANTS])
def test_adamw_matches_contract(cp, mapped, variant, pd, gd, n, layout):
    """STEPS updates; each step compared with reference_update from the kernel's own inputs.

    torch/cuda: bit-identical. optax/cuda: m, v bit-identical, the weights within
    OPTAX_CUDA_MAX_ULP per step (XLA:GPU's approximate sqrt/division vs the IEEE host),
    counted in ULPs of max(|p|, |update|, |p_new|): plain ULPs of p_new are unbounded where the
    update cancels the weight.
    """
    conv, plat = VARIANTS[variant]
    hp = HPS[(variant + n) % len(HPS)]
    op, og, ow, om, ov = LAYOUTS[layout]
    rng = np.random.default_rng([variant, n, len(pd), len(gd), op, og, om, ov])
    p0 = rng.standard_normal(n).astype(np.float32)
    param = _device_array(cp, _to_storage(p0, pd), op)
    grad = _device_array(cp, np.zeros(n, _storage_np(gd)), og)
    m, m_ptr = mapped(n, om)
    v, v_ptr = mapped(n, ov)
    m[:] = 0
    v[:] = 0
    master, master_ptr = (None, 0)
    if pd != "float32":
        master, master_ptr = mapped(n, ow)
        master[:] = p0
    regions = _regions(n, m_ptr, v_ptr, master_ptr, param.data.ptr, param.itemsize,
                       grad.data.ptr, grad.itemsize)
    ulp_bound = OPTAX_CUDA_BOUND if variant == C.VARIANT_OPTAX_CUDA else 0
    title = f"{VNAME[variant]} {pd} weights, {gd} grads, n={n}, layout {layout}"
    for t in range(1, STEPS + 1):
        g32 = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        g_store = _to_storage(g32, gd)
        grad.set(g_store)
        g_in = _from_storage(g_store, gd)
        clip = np.float32(rng.uniform(0.1, 1.0)) if t % 2 else np.float32(1.0)
        s = C.step_scalars(hp, t, conv, plat, clip=clip)
        p_prev = master.copy() if master is not None else param.get()
        m_prev, v_prev = m.copy(), v.copy()
        dk.launch_adamw(variant, param.data.ptr, pd, grad.data.ptr, gd, master_ptr, m_ptr, v_ptr,
                        n, s, _stream(cp))
        cp.cuda.Device().synchronize()
        rp, rm, rv = C.reference_update(p_prev, m_prev, v_prev, g_in, s, conv, plat)
        inputs = {"p": p_prev, "m": m_prev, "v": v_prev, "g": g_in}
        where = f"{title}, step {t} (scalars {s.tolist()}; regions head/vec/tail={regions})"
        got_p = master.copy() if master is not None else param.get()
        approx_prev = p_prev if ulp_bound else None
        for name, got, want, bound, prev in (
                ("exp_avg", m.copy(), rm, 0, None), ("exp_avg_sq", v.copy(), rv, 0, None),
                ("weights" if pd == "float32" else "master", got_p, rp, ulp_bound, approx_prev)):
            if _distance(got, want, prev).max(initial=0) > bound:
                pytest.fail(_mismatch_report(where, name, got, want, inputs, regions, bound, prev=prev))
        if pd != "float32":
            stored = param.get()
            want = _to_storage(got_p, pd)
            if not np.array_equal(stored, want):
                bad = np.flatnonzero(stored != want)
                pytest.fail(f"{where}: {pd} weights are not the rounded master at {bad.size} elements, "
                            f"e.g. [{bad[0]}] master {_fmt(got_p[bad[0]])}: stored 0x{int(stored[bad[0]]):04x}, "
                            f"want 0x{int(want[bad[0]]):04x}")


@gpu
@pytest.mark.parametrize("variant", list(VARIANTS), ids=[VNAME[v].replace("/", "_") for v in VARIANTS])
def test_adamw_scalars_from_a_device_pointer(cp, mapped, variant):
    """The JAX path: the scalar vector in device memory instead of by value."""
    conv, plat = VARIANTS[variant]
    n = 4097
    rng = np.random.default_rng(variant)
    p0 = rng.standard_normal(n).astype(np.float32)
    param = _device_array(cp, _to_storage(p0, "bfloat16"), 1)
    grad = _device_array(cp, np.zeros(n, np.float32), 1)
    m, m_ptr = mapped(n, 1)
    v, v_ptr = mapped(n, 1)
    w, w_ptr = mapped(n, 1)
    m[:] = 0
    v[:] = 0
    w[:] = p0
    for t in range(1, 6):
        g = rng.standard_normal(n).astype(np.float32)
        grad.set(g)
        s = C.step_scalars(HPS[0], t, conv, plat, clip=np.float32(0.5))
        s_dev = cp.asarray(s)
        prev = (w.copy(), m.copy(), v.copy())
        dk.launch_adamw(variant, param.data.ptr, "bfloat16", grad.data.ptr, "float32", w_ptr, m_ptr,
                        v_ptr, n, None, stream=_stream(cp), scalars_ptr=s_dev.data.ptr)
        cp.cuda.Device().synchronize()
        rp, rm, rv = C.reference_update(*prev, g, s, conv, plat)
        bound = OPTAX_CUDA_BOUND if variant == C.VARIANT_OPTAX_CUDA else 0
        inputs = {"p": prev[0], "m": prev[1], "v": prev[2], "g": g}
        for name, got, want, b, pv in (("exp_avg", m.copy(), rm, 0, None), ("exp_avg_sq", v.copy(), rv, 0, None),
                                       ("master", w.copy(), rp, bound, prev[0] if bound else None)):
            if _distance(got, want, pv).max(initial=0) > b:
                pytest.fail(_mismatch_report(f"{VNAME[variant]} scalars by pointer, step {t}",
                                             name, got, want, inputs, ulp_bound=b, prev=pv))


@gpu
@pytest.mark.parametrize("max_blocks", [None, 1, 7])
def test_adamw_on_a_non_default_stream_and_sync_mode(cp, mapped, max_blocks):
    """Also: a capped grid (``max_blocks``, grid-stride over the rest) gives the same bits."""
    n = 100003
    rng = np.random.default_rng(7)
    p0 = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    m, m_ptr = mapped(n)
    v, v_ptr = mapped(n)
    m[:] = 0
    v[:] = 0
    s = C.step_scalars(HPS[0], 1, "torch", "cuda")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        param = cp.asarray(p0)
        grad = cp.asarray(g)
    dk.set_sync_launches(True)
    try:
        dk.launch_adamw(C.VARIANT_TORCH_CUDA, param.data.ptr, "float32", grad.data.ptr, "float32", 0,
                        m_ptr, v_ptr, n, s, stream=stream.ptr, max_blocks=max_blocks)
    finally:
        dk.set_sync_launches(False)
    dk.check_stream(stream.ptr)
    rp, rm, rv = C.reference_update(p0, np.zeros(n, np.float32), np.zeros(n, np.float32), g, s, "torch", "cuda")
    np.testing.assert_array_equal(param.get(), rp)
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_array_equal(v, rv)


@gpu
@pytest.mark.parametrize("pd, gd", [("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32")])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=[VNAME[v].replace("/", "_") for v in VARIANTS])
@pytest.mark.parametrize("clip", ["none", "coef"])
def test_adamw_multi_is_bit_identical_to_one_launch_per_tensor(cp, mapped, variant, pd, gd, clip):
    """One multi-tensor launch of tensors of many sizes and alignments (including empty
    ones, and a grid of several waves) against one launch_adamw per tensor on copies of
    the same state: every weight, master and moment bit equal, for three steps with
    per-tensor step counts and hyper-parameters. ``clip``: none, or a coefficient in the
    scalars."""
    conv, plat = VARIANTS[variant]
    rng = np.random.default_rng([variant, len(pd), len(gd)])
    sizes = [1, 3, 4, 5, 4095, 4097, 0, 100003, 1 << 20, 7, 2_500_001]
    offsets = [0, 1, 0, 3, 1, 0, 0, 2, 0, 1, 0]
    sides = []
    for side in range(2):
        tensors = []
        for k, (n, off) in enumerate(zip(sizes, offsets)):
            r = np.random.default_rng([variant, k])
            p0 = r.standard_normal(n).astype(np.float32)
            t = {"n": n, "param": _device_array(cp, _to_storage(p0, pd), off),
                 "grad": _device_array(cp, np.zeros(n, _storage_np(gd)), off)}
            for name in ("m", "v") + (("master",) if pd != "float32" else ()):
                host, ptr = mapped(max(n, 1), off)
                host[:n] = p0 if name == "master" else (np.abs(p0) * 1e-3 if name == "v" else p0 * 1e-2)
                t[name], t[name + "_ptr"] = host, ptr
            tensors.append(t)
        sides.append(tensors)
    for step in range(1, 4):
        grads = [_to_storage((rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32), gd)
                 for n in sizes]
        for tensors in sides:
            for t, g in zip(tensors, grads):
                t["grad"].set(g)
        coef = np.float32(0.37) if clip == "coef" else np.float32(1.0)
        items_per_side = []
        for tensors in sides:
            items = []
            for k, t in enumerate(tensors):
                s = C.step_scalars(HPS[k % len(HPS)], step + k % 2, conv, plat, clip=coef)
                items.append((t["param"].data.ptr if t["n"] else 0, t["grad"].data.ptr if t["n"] else 0,
                              t.get("master_ptr", 0) if t["n"] else 0,
                              t["m_ptr"] if t["n"] else 0, t["v_ptr"] if t["n"] else 0, t["n"], s))
            items_per_side.append(items)
        for item in items_per_side[0]:
            dk.launch_adamw(variant, item[0], pd, item[1], gd, item[2], item[3], item[4], item[5], item[6],
                            _stream(cp))
        launched = dk.launch_adamw_multi(variant, pd, gd, items_per_side[1], _stream(cp))
        assert launched == sum(1 for n in sizes if n)
        cp.cuda.Device().synchronize()
        for k, (a, b) in enumerate(zip(*sides)):
            where = f"{VNAME[variant]} {pd}/{gd} clip={clip} step {step} tensor {k} (n={a['n']})"
            if not a["n"]:
                continue
            np.testing.assert_array_equal(a["param"].get(), b["param"].get(), err_msg=where + ": weights")
            for name in ("m", "v", "master"):
                if name in a:
                    np.testing.assert_array_equal(a[name].view(np.uint32), b[name].view(np.uint32),
                                                  err_msg=f"{where}: {name}")


@gpu
def test_adamw_multi_matches_the_contract(cp, mapped):
    """Not only equal to the single launches: the multi kernel against reference_update."""
    n_list = [5, 4097, 0, 33]
    hp = HPS[0]
    rng = np.random.default_rng(3)
    tensors = []
    for n in n_list:
        p0 = rng.standard_normal(n).astype(np.float32)
        m, m_ptr = mapped(max(n, 1), 1)
        v, v_ptr = mapped(max(n, 1), 1)
        w, w_ptr = mapped(max(n, 1), 1)
        m[:], v[:], w[:n] = 0, 0, p0
        tensors.append(dict(n=n, param=_device_array(cp, _to_storage(p0, "bfloat16"), 1),
                            grad=_device_array(cp, np.zeros(n, np.float32), 1),
                            m=m, m_ptr=m_ptr, v=v, v_ptr=v_ptr, w=w, w_ptr=w_ptr))
    for step in (1, 2):
        items, refs = [], []
        for t in tensors:
            n = t["n"]
            g = rng.standard_normal(n).astype(np.float32)
            t["grad"].set(g)
            s = C.step_scalars(hp, step, "torch", "cuda")
            refs.append(C.reference_update(t["w"][:n].copy(), t["m"][:n].copy(), t["v"][:n].copy(), g, s,
                                           "torch", "cuda"))
            items.append((t["param"].data.ptr if n else 0, t["grad"].data.ptr if n else 0,
                          t["w_ptr"] if n else 0, t["m_ptr"] if n else 0, t["v_ptr"] if n else 0, n, s))
        dk.launch_adamw_multi(C.VARIANT_TORCH_CUDA, "bfloat16", "float32", items, stream=_stream(cp))
        cp.cuda.Device().synchronize()
        for t, (rp, rm, rv) in zip(tensors, refs):
            n = t["n"]
            np.testing.assert_array_equal(t["w"][:n], rp)
            np.testing.assert_array_equal(t["m"][:n], rm)
            np.testing.assert_array_equal(t["v"][:n], rv)
            np.testing.assert_array_equal(t["param"].get(), _to_storage(rp, "bfloat16"))


# -- against torch.optim.AdamW on CUDA ----------------------------------------------------------


def _hypotheses_report(alternatives) -> str:
    """alternatives: [(label, {hypothesis: array}, reference array)] -> which ones reproduce it."""
    lines = []
    for label, alts, target in alternatives:
        ok = [k for k, a in alts.items()
              if np.array_equal(np.asarray(a, np.float32).view(np.uint32), target.view(np.uint32))]
        lines.append(f"  {label}: reproduced exactly by " + (" | ".join(ok) if ok else
                     "none of: " + " | ".join(alts)))
    return "\n".join(lines)


def _torch_cuda_hypotheses(p, m, v, g, hp, t, want) -> str:
    """Which formulas reproduce torch's step from torch's previous state (NumPy)."""
    f = np.float32
    with np.errstate(all="ignore"):
        bc1 = 1 - hp.beta1**t
        bc2 = 1 - hp.beta2**t
        w, omb2, b2 = f(1 - hp.beta1), f(1 - hp.beta2), f(hp.beta2)
        p1 = p * f(1 - hp.lr * hp.weight_decay)
        diff = g - m
        small = abs(float(w)) < 0.5
        m_alts = {
            "lerp as fma [contract]": C.fma_f32(w, diff, m) if small else C.fma_f32(w - f(1), diff, g),
            "lerp unfused": (m + w * diff) if small else (g - diff * (f(1) - w)),
        }
        vb2 = v * b2
        v_alts = {
            "fma(1-b2, g*g, v*b2) [contract]": C.fma_f32(omb2, g * g, vb2),
            "fma((1-b2)*g, g, v*b2)": C.fma_f32(omb2 * g, g, vb2),
            "(1-b2)*g*g + v*b2": (omb2 * g) * g + vb2,
        }
        mt, vt = want[1], want[2]  # torch's own new moments: p's formula judged alone
        d_alts = {
            "sqrt(v)*f(1/sqrt(bc2)) [single-tensor]": np.sqrt(vt) * f(1.0 / bc2**0.5) + f(hp.eps),
            "sqrt(v)*(1/f(sqrt(bc2)))": np.sqrt(vt) * (f(1) / f(bc2**0.5)) + f(hp.eps),
            "sqrt(v)/f(sqrt(bc2))": np.sqrt(vt) / f(bc2**0.5) + f(hp.eps),
        }
        step = f(-(hp.lr / bc1))
        p_alts = {}
        for dn, d in d_alts.items():
            p_alts[f"d = {dn}, p = fma(step, m/d, p1)"] = C.fma_f32(step, mt / d, p1)
            p_alts[f"d = {dn}, p = p1 + step*(m/d)"] = p1 + step * (mt / d)
    return _hypotheses_report([("exp_avg", m_alts, want[1]), ("exp_avg_sq", v_alts, want[2]),
                               ("param", p_alts, want[0])])


@gpu
@pytest.mark.parametrize("hp_i", range(len(HPS)))
@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach-True"])
def test_torch_cuda_variant_matches_torch_adamw_on_cuda(cp, mapped, foreach, hp_i):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    hp = HPS[hp_i]
    n = 100003
    rng = np.random.default_rng(hp_i)
    p0 = rng.standard_normal(n).astype(np.float32)
    dev = torch.device("cuda", cp.cuda.runtime.getDevice())
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()).to(dev))
    opt = torch.optim.AdamW([tp], lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=foreach)
    param = cp.asarray(p0)
    grad = cp.zeros(n, cp.float32)
    m, m_ptr = mapped(n)
    v, v_ptr = mapped(n)
    m[:] = 0
    v[:] = 0
    prev_t = (p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32))
    for t in range(1, STEPS + 1):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        tp.grad = torch.from_numpy(g).to(dev)
        opt.step()
        torch.cuda.synchronize(dev)
        st = opt.state[tp]
        want = (tp.detach().cpu().numpy(), st["exp_avg"].cpu().numpy(), st["exp_avg_sq"].cpu().numpy())
        grad.set(g)
        s = C.step_scalars(hp, t, "torch", "cuda")
        dk.launch_adamw(C.VARIANT_TORCH_CUDA, param.data.ptr, "float32", grad.data.ptr, "float32", 0,
                        m_ptr, v_ptr, n, s, stream=_stream(cp))
        cp.cuda.Device().synchronize()
        got = (param.get(), m.copy(), v.copy())
        for name, a, b in zip(("weights", "exp_avg", "exp_avg_sq"), got, want):
            if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
                report = _mismatch_report(
                    f"torch/cuda kernel vs torch.optim.AdamW(foreach={foreach}) on CUDA, {hp}, step {t} "
                    f"(torch {torch.__version__})", name, a, b,
                    {"p": prev_t[0], "m": prev_t[1], "v": prev_t[2], "g": g})
                pytest.fail(report + "\nwhich formulas reproduce torch's step from its previous state:\n"
                            + _torch_cuda_hypotheses(*prev_t, g, hp, t, want))
        prev_t = tuple(x.copy() for x in want)


# -- against optax.adamw under jax.jit on the GPU -----------------------------------------------

_DIAG_SRC = r"""
__device__ float dv(float a, float b, int full) {
  float r;
  if (full) asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  else r = __fdiv_rn(a, b);
  return r;
}
__device__ float sq(float x, int approx) {
  float r;
  if (approx) asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  else r = __fsqrt_rn(x);
  return r;
}
extern "C" __global__ void optax_candidates(const float* p, const float* m, const float* v,
    float bc1, float bc2, float eps, float wd, float neglr, float* out, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (int k = 0; k < 8; ++k) {
    int full = k & 1, approx = (k >> 1) & 1, fold = (k >> 2) & 1;
    float den = __fadd_rn(sq(dv(v[i], bc2, full), approx), eps);
    float u = fold ? dv(m[i], __fmul_rn(bc1, den), full) : dv(dv(m[i], bc1, full), den, full);
    u = __fadd_rn(u, __fmul_rn(wd, p[i]));
    out[k * n + i] = __fadd_rn(p[i], __fmul_rn(u, neglr));
  }
}
"""


def _optax_candidates(cp, p, m_new, v_new, s):
    n = p.size
    kern = cp.RawKernel(_DIAG_SRC, "optax_candidates", options=("--fmad=false",))
    out = cp.empty(8 * n, cp.float32)
    f = np.float32
    kern(((n + 255) // 256,), (256,), (cp.asarray(p), cp.asarray(m_new), cp.asarray(v_new),
         f(s[C.S_BC1]), f(s[C.S_BC2_OPTAX]), f(s[C.S_EPS]), f(s[C.S_WD]), f(s[C.S_NEG_LR]), out, np.int64(n)))
    out = out.get().reshape(8, n)
    names = [f"div {'full' if k & 1 else 'rn'}, sqrt {'approx' if k & 2 else 'rn'}, "
             f"{'m/(bc1*(...))' if k & 4 else '(m/bc1)/(...)'}" for k in range(8)]
    return dict(zip(names, out))


def _jax_gpu():
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX has no GPU backend here")
    return jax, gpus[0]


@gpu
@pytest.mark.parametrize("hp_i", [0, 1])
def test_optax_cuda_variant_matches_xla_gpu(cp, mapped, hp_i):
    """Bitwise against optax.adamw as XLA:GPU compiles it, with diagnostics on mismatch."""
    jax, jdev = _jax_gpu()
    import jax.numpy as jnp
    import optax

    hp = HPS[hp_i]
    n = 65537
    steps = min(STEPS, 30)
    opt = optax.adamw(hp.lr, b1=hp.beta1, b2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay)

    @jax.jit
    def xla_step(params, state, g):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def optax_bias_corrections(count):  # the expression of optax.tree_utils.tree_bias_correction
        return 1 - hp.beta1**count, 1 - hp.beta2**count

    rng = np.random.default_rng(100 + hp_i)
    p0 = rng.standard_normal(n).astype(np.float32)
    params = jax.device_put(jnp.asarray(p0), jdev)
    state = opt.init(params)
    param = cp.asarray(p0)
    grad = cp.zeros(n, cp.float32)
    m, m_ptr = mapped(n)
    v, v_ptr = mapped(n)
    m[:] = 0
    v[:] = 0
    for t in range(1, steps + 1):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        p_prev = np.asarray(params)
        m_prev, v_prev = m.copy(), v.copy()
        params, state = xla_step(params, state, jax.device_put(jnp.asarray(g), jdev))
        bc1, bc2 = (np.float32(x) for x in optax_bias_corrections(jax.device_put(jnp.int32(t), jdev)))
        want_p = np.asarray(params)
        want_m = np.asarray(optax.tree_utils.tree_get(state, "mu"))
        want_v = np.asarray(optax.tree_utils.tree_get(state, "nu"))
        s = C.optax_step_scalars(hp, bc1, bc2)
        grad.set(g)
        dk.launch_adamw(C.VARIANT_OPTAX_CUDA, param.data.ptr, "float32", grad.data.ptr, "float32", 0,
                        m_ptr, v_ptr, n, s, stream=_stream(cp))
        cp.cuda.Device().synchronize()
        got_p, got_m, got_v = param.get(), m.copy(), v.copy()
        title = f"optax/cuda kernel vs optax.adamw on XLA:GPU (jax {jax.__version__}), {hp}, step {t}"
        for name, a, b in (("mu", got_m, want_m), ("nu", got_v, want_v)):
            if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
                f32 = np.float32
                omb1, b1, omb2, b2 = (f32(1 - hp.beta1), f32(hp.beta1), f32(1 - hp.beta2), f32(hp.beta2))
                mp, vp = m_prev, v_prev
                alts = [("mu", {"(1-b1)*g + b1*m [contract]": omb1 * g + b1 * mp,
                                "fma(1-b1, g, b1*m)": C.fma_f32(omb1, g, b1 * mp),
                                "fma(b1, m, (1-b1)*g)": C.fma_f32(b1, mp, omb1 * g)}, want_m),
                        ("nu", {"(1-b2)*(g*g) + b2*v [contract]": omb2 * (g * g) + b2 * vp,
                                "fma(1-b2, g*g, b2*v)": C.fma_f32(omb2, g * g, b2 * vp),
                                "fma(b2, v, (1-b2)*(g*g))": C.fma_f32(b2, vp, omb2 * (g * g))}, want_v)]
                pytest.fail(_mismatch_report(title, name, a, b, {"g": g, "m": mp, "v": vp})
                            + "\nwhich formulas reproduce XLA's moments:\n" + _hypotheses_report(alts))
        if not np.array_equal(got_p.view(np.uint32), want_p.view(np.uint32)):
            cands = _optax_candidates(cp, p_prev, want_m, want_v, s)
            rates = ", ".join(f"[{k}]: {np.mean(c.view(np.uint32) == want_p.view(np.uint32)):.4%}"
                              for k, c in cands.items())
            pytest.fail(_mismatch_report(title, "params", got_p, want_p,
                                         {"p": p_prev, "m": want_m, "v": want_v})
                        + f"\nfraction of XLA's params reproduced by each lowering: {rates}"
                        + f"\n(bc1={_fmt(bc1)}, bc2={_fmt(bc2)}; the kernel uses div.full, "
                          "sqrt.approx, m/(bc1*(...)))")
        # the same inputs next step for both sides
        param.set(want_p)
        m[:] = want_m
        v[:] = want_v


@gpu
def test_contract_optax_bias_corrections_match_optax_on_xla_gpu():
    """The contract's jnp expression for bc1, bc2 vs optax's own (pow with an int32 count)."""
    jax, jdev = _jax_gpu()
    import jax.numpy as jnp

    counts = jax.device_put(jnp.arange(1, 20001, dtype=jnp.int32), jdev)
    for b1, b2 in ((0.9, 0.999), (0.3, 0.95), (0.5, 0.99)):
        ours = jax.jit(jax.vmap(lambda c: C.optax_bias_corrections(b1, b2, c, xp=jnp)))(counts)
        optax_like = jax.jit(jax.vmap(lambda c: (1 - b1**c, 1 - b2**c)))(counts)
        for k, name in enumerate(("bc1", "bc2")):
            a, b = np.asarray(ours[k]), np.asarray(optax_like[k])
            bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
            assert bad.size == 0, (
                f"b=({b1}, {b2}) {name}: contract.optax_bias_corrections differs from optax's "
                f"1 - b**count on XLA:GPU at {bad.size} counts, first count {bad[0] + 1}: "
                f"{_fmt(a[bad[0]])} vs {_fmt(b[bad[0]])}")


# -- mapped memory and the benchmark ---------------------------------------------------------------


@gpu
def test_alloc_mapped_failure_raises_memoryerror_naming_the_size(cp):
    with pytest.raises(MemoryError, match=rf"could not allocate {2**60} bytes of mapped pinned host memory"):
        dk.alloc_mapped(2**60)
    host, dev, free = dk.alloc_mapped(1 << 20)  # CUDA still usable afterwards
    try:
        view = dk.host_view(host, 4)
        view[:] = [1, 2, 3, 4]
        copy4 = cp.RawKernel(r'''extern "C" __global__ void ts_copy4(const float* a, float* b) {
            b[threadIdx.x] = a[threadIdx.x] * 2.0f; }''', "ts_copy4")
        out = cp.zeros(4, cp.float32)
        copy4((1,), (4,), (np.uint64(dev), out))  # the GPU reads the mapped host memory
        np.testing.assert_array_equal(out.get(), [2, 4, 6, 8])
        del view
    finally:
        free()
        free()  # idempotent


@gpu
def test_alloc_mapped_cuda_failure_leaves_no_stale_cuda_error(cp):
    """A failed allocation (from the driver) is a MemoryError, and torch's next launch
    check does not see a stale runtime error."""
    with pytest.raises(MemoryError, match=rf"could not allocate {2**60} bytes of mapped pinned host memory"):
        dk.alloc_mapped(2**60)
    host, dev, free = dk.alloc_mapped(4096)
    free()
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        x = torch.zeros(16, device=torch.device("cuda", cp.cuda.runtime.getDevice())) + 1  # launch check
        torch.cuda.synchronize()
        assert float(x.sum()) == 16.0


@gpu
@pytest.mark.parametrize("pd", ["float32", "bfloat16"])
def test_benchmark_checks_then_times(cp, pd):
    r = load_script("bench_zero_copy").benchmark_zero_copy_adamw(1 << 20, device=cp.cuda.runtime.getDevice(), param_dtype=pd,
                                     iters=2, repeats=3)
    assert r["numel"] == 1 << 20 and r["ms"] > 0
    assert r["bytes_per_elem"] == (16 if pd == "float32" else 24)
    assert r["pcie_gbps"] == pytest.approx(r["gelems_per_s"] * r["bytes_per_elem"])


@gpu
@pytest.mark.parametrize("pd", ["float32", "bfloat16"])
def test_staged_benchmark_checks_then_times(cp, pd):
    """The staged ring (experiments/bench_zero_copy.py) over several chunks and a partial last
    one: its update equals the contract's on a sample (it raises otherwise)."""
    r = load_script("bench_zero_copy").benchmark_staged_adamw((3 << 20) + 12345, device=cp.cuda.runtime.getDevice(),
                                                              param_dtype=pd, chunk_mib=1, depth=2, iters=2, repeats=2)
    assert r["ms"] > 0 and r["ring_mib"] == 2 * (2 if pd == "float32" else 3)
