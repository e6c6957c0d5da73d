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

import numpy as np

HUGE_PAGE = 2 << 20
_MADV = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_NOMADV = getattr(mmap, "MADV_NOHUGEPAGE", None)


def aligned_empty(numel: int, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised 1-D NumPy array whose data is ``align``-byte aligned."""
    dt = np.dtype(dtype)
    nbytes = int(numel) * dt.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dt)


def empty(numel: int, dtype, *, align: int = 64) -> np.ndarray:
    """An uninitialised 1-D array of ``numel`` elements.

    At least one huge page long, and where the OS takes the advice: 2 MiB-aligned, its
    whole 2 MiB pages advised ``MADV_HUGEPAGE`` and the rest of its mapping (the
    alignment slack before it, the partial page after it) ``MADV_NOHUGEPAGE``, so that
    no huge page is faulted in for the slack (up to 2 MiB of resident memory per array
    otherwise). Else a NumPy array whose data is ``align``-byte aligned. The array owns
    its memory (freed with its last view).
    """
    dt = np.dtype(dtype)
    nbytes = int(numel) * dt.itemsize
    if _MADV is None or nbytes < HUGE_PAGE:
        return aligned_empty(numel, dt, align)
    # Over-map by one huge page to place the data on a 2 MiB boundary: the kernel backs
    # only whole, aligned 2 MiB ranges with huge pages.
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mm, np.uint8)  # keeps ``mm`` alive as long as any view of it
    off = (-raw.ctypes.data) % HUGE_PAGE  # a multiple of the base page size
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        mm.madvise(_MADV, off, whole)
        if _NOMADV is not None:  # also under THP "always": no huge page for the slack
            if off:
                mm.madvise(_NOMADV, 0, off)
            if len(mm) > off + whole:
                mm.madvise(_NOMADV, off + whole, len(mm) - off - whole)
    except OSError:  # kernels without THP: the mapping still works, with small pages
        pass
    return raw[off:off + nbytes].view(dt)
