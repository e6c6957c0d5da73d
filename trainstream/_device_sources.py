"""The sources of the ``gpu`` mode kernels (the checkout's ``kernels/*.cu``, the package data ``trainstream/kernels/``
once installed), their constants checked against :mod:`trainstream.contract`, and the launch layout the kernels take
(ctypes mirrors of ``TsMultiItem`` / ``TsMultiBatch``). No GPU, no CuPy: :mod:`trainstream._device_kernels` compiles
and launches. Import these names from there."""

from __future__ import annotations

import ctypes
import re
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import _device_recipes as R
from . import contract as C

#: The CUDA source holding the constants and the launch layout (:func:`check_kernel_constants`).
ADAMW_SOURCE = "adamw.cu"
#: The sources of the one program, in the order NVRTC compiles them (:func:`program_source`).
KERNEL_SOURCES = ("adamw.cu", "adamw_body.cu", "adamw_torch.cu", "adamw_variants.cu")

#: Block size; the .cu file defines the same number (checked at load time).
ADAMW_THREADS = 256
#: The variants with CUDA kernels (``TS_VARIANT_*`` in the source): the cuda platform of each convention.
_VARIANT_NAMES = {C.VARIANT_TORCH_CUDA: "torch_cuda", C.VARIANT_OPTAX_CUDA: "optax_cuda"}


class _Scalars(ctypes.Structure):
    """``struct TsScalars { float s[TS_N_SCALARS]; }``: one scalar vector of a launch."""
    _fields_ = [("s", ctypes.c_float * R.N_SCALARS)]


#: Tensors per multi-tensor launch (``TS_MULTI_MAX`` in the kernel source).
MULTI_MAX = 32
#: Distinct scalar vectors per launch (``TS_SCALAR_SETS``): more go into another launch.
SCALAR_SETS = 8
#: ``block_start`` of a launch's unused items (``TS_UNUSED_BLOCK``): above every block index.
_UNUSED_BLOCK = 2**31 - 1


class _MultiItem(ctypes.Structure):
    """``struct TsMultiItem``: one tensor of a launch (88 bytes)."""
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("master", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("v", ctypes.c_void_p), ("vmax", ctypes.c_void_p),
                ("scalars_dev", ctypes.c_void_p), ("n", ctypes.c_longlong), ("base", ctypes.c_longlong),
                ("block_start", ctypes.c_int), ("nblocks", ctypes.c_int), ("sidx", ctypes.c_int),
                ("flags", ctypes.c_int)]


class _MultiBatch(ctypes.Structure):
    """``struct TsMultiBatch``: the kernel's by-value parameter (3584 bytes, within the 4 KiB that every CUDA
    driver accepts for a launch's parameters): :data:`SCALAR_SETS` scalar vectors, then :data:`MULTI_MAX` items;
    the unused items after the tensors have ``block_start`` :data:`_UNUSED_BLOCK`."""
    _fields_ = [("sets", _Scalars * SCALAR_SETS), ("items", _MultiItem * MULTI_MAX)]


class KernelItem(NamedTuple):
    """One checked tensor of :func:`launch_items`: device pointers (0 where unused), elements, its scalars (a
    float32 vector of :data:`trainstream._device_recipes.N_SCALARS`, or an ``int``, a device pointer to the optax
    convention's slots), the index of its first element in the whole tensor, its ``TS_F_*`` flags."""
    param: int
    grad: int
    master: int
    m: int
    v: int
    vmax: int
    n: int
    scalars: np.ndarray | int
    base: int = 0
    flags: int = 0


def program_source() -> str:
    """The one NVRTC program: :data:`KERNEL_SOURCES` in order."""
    return "\n".join(kernel_source(name) for name in KERNEL_SOURCES)


def kernel_source(name: str) -> str:
    """The text of the CUDA source ``name`` (one of :data:`KERNEL_SOURCES`; no GPU needed), read from the package data
    ``trainstream/kernels/`` (a wheel, also read-only, or a strict editable install: setuptools maps the checkout's
    top-level ``kernels/`` there), else from the top-level ``kernels/`` of the source checkout this package is in (a
    checkout on ``sys.path``, or setuptools' default editable install, which imports the checkout's ``trainstream/``).
    ``FileNotFoundError`` naming the places looked at if absent."""
    packaged = resources.files("trainstream") / "kernels" / name
    places = [packaged]
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():  # a source checkout, not site-packages
        places.append(root / "kernels" / name)
    for path in places:
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            continue
    raise FileNotFoundError(f"TrainStream CUDA source {name} not found in {', '.join(map(str, places))}: the "
                            f"install lacks the package data trainstream/kernels/{name}; reinstall from the wheel or "
                            "the checkout")


_DEFINE = re.compile(r"^#define\s+(TS_\w+)\s+(\d+)\s*(?://.*)?$", re.MULTILINE)


def check_kernel_constants() -> None:
    """Check the ``#define``\\ s of :data:`ADAMW_SOURCE` against :mod:`trainstream.contract`: every scalar index
    (``TS_S_*``, ``TS_N_SCALARS``: the contract's, and the plan's that :mod:`trainstream._device_recipes` adds until
    the contract has them), the variants of :func:`adamw_kernel_name` (``TS_VARIANT_*``) and the optax code bits the cuda
    platform reads (``TS_OX_*`` of :data:`trainstream.contract.OX_CUDA_BITS`) must be defined with the contract's value, any other ``TS_OX_*`` too;
    also the recipes' flags (``TS_F_*``), :data:`ADAMW_THREADS` and the launch layout (``TS_MULTI_MAX``,
    ``TS_SCALAR_SETS``, ``TS_UNUSED_BLOCK``). ``RuntimeError`` listing every difference (no GPU)."""
    adamw = {k: int(v) for k, v in _DEFINE.findall(kernel_source(ADAMW_SOURCE))}
    contract = {"TS_" + name: getattr(C, name) for name in dir(C)
                if name.startswith(("VARIANT_", "OX_")) and isinstance(getattr(C, name), int)}
    contract.update({"TS_" + name: v for name, v in R.SCALAR_INDEX.items()})
    contract.update({"TS_" + name: getattr(R, name) for name in R.__all__ if name.startswith("F_")})
    required = {"TS_N_SCALARS": R.N_SCALARS, "TS_ADAMW_THREADS": ADAMW_THREADS, "TS_MULTI_MAX": MULTI_MAX,
                "TS_SCALAR_SETS": SCALAR_SETS, "TS_UNUSED_BLOCK": _UNUSED_BLOCK}
    required.update({k: v for k, v in contract.items() if k.startswith("TS_OX_") and v & C.OX_CUDA_BITS == v
                     and bin(v).count("1") == 1})
    required.update({k: v for k, v in contract.items() if k.startswith(("TS_S_", "TS_F_"))})
    required.update({f"TS_VARIANT_{name.upper()}": v for v, name in _VARIANT_NAMES.items()})
    problems = [f"{ADAMW_SOURCE}: {key} is {adamw.get(key)}, the contract says {want}"
                for key, want in sorted({**contract, **required}.items())
                if (key in required or key in adamw) and adamw.get(key) != want]
    problems += [f"{ADAMW_SOURCE}: {key} has no counterpart in trainstream.contract" for key in sorted(adamw)
                 if key.startswith(("TS_S_", "TS_VARIANT_", "TS_OX_", "TS_F_")) and key not in contract]
    if problems:
        raise RuntimeError("TrainStream kernels out of sync with the contract:\n  " + "\n  ".join(problems))


