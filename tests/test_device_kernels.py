"""The `gpu` mode kernels, kernels/*.cu (package data trainstream/kernels/ once installed), through
trainstream._device_kernels: the sources and their constants, the launchers' checks (CPU), and the kernels against
the contract's NumPy reference (GPU). Against torch and optax on the GPU: tests/test_device_kernels_refs.py; torch's
CUDA recipes: tests/test_device_recipes.py (CPU) and tests/test_device_recipes_gpu.py.

GPU tests carry the ``gpu`` marker and skip where CuPy or a CUDA device is missing; the
few tests without the marker need neither (source/contract consistency, lazy import,
argument checks). Every GPU comparison is per step and from identical inputs, so a
failure names the first step, array and elements that differ, with their inputs.

``TRAINSTREAM_GPU_TEST_STEPS`` (default 50) sets the number of steps of the long runs;
``TRAINSTREAM_OPTAX_CUDA_MAX_ULP`` overrides the optax/cuda bound
(``trainstream.contract.OPTAX_CUDA_MAX_ULP``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainstream import contract as C
from trainstream import _device_kernels as dk
from trainstream import _device_recipes as R
from _device_kernels_common import (  # noqa: F401 - fixtures and helpers
    gpu, STEPS, OPTAX_CUDA_BOUND, HPS, VARIANTS, VNAME, DTYPE_COMBOS, LAYOUTS, SIZES_LAYOUTS, _storage_np, _to_storage, _from_storage, _ulps, _fmt, _regions, _where, _distance,
    _mismatch_report, cp, mapped, _device_array, _stream)

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
    loader's options, defines every kernel the loader loads, and keeps its state in registers (stack frames of a
    few bytes at most)."""
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
    assert set(names) < set(dk.kernel_names()) and len(dk.kernel_names()) == len(names) + 24  # + optax's own state
    names = dk.kernel_names()
    assert set(names) <= compiled, sorted(set(names) - compiled)
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", out.stderr)]
    assert frames and max(frames) <= 16, out.stderr[-4000:]  # a few bytes at most (calls of the IEEE slow paths)


def test_launch_layout_matches_the_compiled_structs(tmp_path):
    """Where nvcc is installed: sizes and field offsets of TsMultiItem / TsMultiBatch as the compiler lays them out
    equal the ctypes mirrors the launcher fills."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    import ctypes
    fields = [name for name, _ in dk._MultiItem._fields_]
    prog = ("#include <cstdio>\n#include <cstddef>\n" + dk.program_source() + "\nint main() {\n"
            '  printf("%zu %zu %zu\\n", sizeof(TsMultiItem), sizeof(TsMultiBatch), offsetof(TsMultiBatch, items));\n'
            + "".join(f'  printf("%zu\\n", offsetof(TsMultiItem, {f}));\n' for f in fields) + "  return 0;\n}\n")
    (tmp_path / "layout.cu").write_text(prog)
    out = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-o", str(tmp_path / "layout"), str(tmp_path / "layout.cu")],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    got = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    want = [ctypes.sizeof(dk._MultiItem), ctypes.sizeof(dk._MultiBatch), dk._MultiBatch.items.offset]
    want += [getattr(dk._MultiItem, f).offset for f in fields]
    assert [int(x) for x in got] == want


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
    assert ctypes.sizeof(dk._MultiBatch) == dk.SCALAR_SETS * 4 * R.N_SCALARS + dk.MULTI_MAX * 88 == 3584 <= 4096


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
