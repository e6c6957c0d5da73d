"""Pageable host arrays backed by 2 MiB pages (transparent huge pages), where the OS has them.

The host update streams 28 B per element through four arrays at once (master, two moments,
gradient). With 4 KiB pages that is a TLB miss, and a page walk, every 1024 fp32 elements
of each array; with 2 MiB pages one every 512 Ki. ``torch.empty`` on the CPU takes its
memory from glibc with the kernel's default pages, which are 4 KiB unless
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``; most distributions ship
``madvise``, which gives huge pages only to mappings that ask (NumPy asks for its large
arrays; torch does only under ``THP_MEM_ALLOC_ENABLE=1``). :func:`empty` asks. Measured
effect: ``experiments/host_pages.py`` and ``experiments/RESULTS.md``.

No torch, no JAX: the engine core may use it and every backend wraps its arrays.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

HUGE_PAGE = 2 << 20
_MADV = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def host_pages_setting() -> str:
    """``TRAINSTREAM_HOST_PAGES``: ``huge`` (default) or ``default`` (the allocator's own)."""
    v = os.environ.get("TRAINSTREAM_HOST_PAGES", "huge").strip() or "huge"
    if v not in ("huge", "default"):
        raise ValueError(f"TRAINSTREAM_HOST_PAGES must be 'huge' or 'default', got {v!r}")
    return v


def empty(numel: int, dtype) -> np.ndarray:
    """An uninitialised 1-D array of ``numel`` elements, 2 MiB-aligned and advised
    ``MADV_HUGEPAGE`` when it spans at least one huge page and the OS supports the advice;
    a plain :func:`numpy.empty` otherwise. The array owns its mapping (freed with it)."""
    dt = np.dtype(dtype)
    nbytes = int(numel) * dt.itemsize
    if _MADV is None or nbytes < HUGE_PAGE:
        return np.empty(int(numel), dt)
    # Over-map by one huge page to place the data on a 2 MiB boundary: the kernel backs
    # only whole, aligned 2 MiB ranges with huge pages.
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mm, np.uint8)  # keeps ``mm`` alive as long as any view of it
    off = (-raw.ctypes.data) % HUGE_PAGE
    try:
        mm.madvise(_MADV, 0, len(mm))
    except OSError:  # kernels without THP: the mapping still works, with small pages
        pass
    return raw[off:off + nbytes].view(dt)
