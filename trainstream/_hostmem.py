"""Pageable host arrays on 2 MiB pages (transparent huge pages) where the OS has them, and
:func:`available`, the host memory this process can still take (:mod:`trainstream.core._budget`),
within the limit that :data:`LIMIT_ENV` may set (:func:`host_limit`). No torch, no JAX.

The host update streams four arrays at once: 4 KiB pages cost a TLB miss every 1024 fp32 elements
of each, 2 MiB pages one every 512 Ki. Under THP's usual ``madvise`` only mappings that ask get huge
pages (``torch.empty`` does not, unless ``THP_MEM_ALLOC_ENABLE=1``): :func:`empty` asks. Measured:
``experiments/RESULTS.md``.
"""

from __future__ import annotations

import mmap
import os
import re

import numpy as np

HUGE_PAGE = 2 << 20
_MADV = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_NOMADV = getattr(mmap, "MADV_NOHUGEPAGE", None)
#: The environment variable that limits the host memory this process may hold in all (its resident memory,
#: pinned memory included), where neither ``MemAvailable`` nor a cgroup says so: a share of a machine that
#: other jobs use, or a smaller machine emulated on a larger one. Bytes, or a number with a binary suffix
#: ``K``, ``M``, ``G``, ``T`` (or ``KiB``, ``MiB``, ``GiB``, ``TiB``), e.g. ``64G``.
LIMIT_ENV = "TRAINSTREAM_HOST_LIMIT"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def empty(numel: int, dtype, *, align: int = 64) -> np.ndarray:
    """An uninitialised 1-D array of ``numel`` elements, owning its memory (freed with its last
    view). At least one huge page long, and where the OS takes the advice: 2 MiB-aligned, its whole
    2 MiB pages advised ``MADV_HUGEPAGE`` and the slack around them ``MADV_NOHUGEPAGE`` (no huge page
    faulted in for it: up to 2 MiB per array). Else a NumPy array whose data is ``align``-byte aligned.
    """
    dt = np.dtype(dtype)
    nbytes = int(numel) * dt.itemsize
    if _MADV is None or nbytes < HUGE_PAGE:
        raw = np.empty(nbytes + align, np.uint8)
        off = (-raw.ctypes.data) % align
        return raw[off:off + nbytes].view(dt)
    # over-map by one huge page to start the data on a 2 MiB boundary (only such ranges get huge pages)
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


#: Per cgroup version: its limit, usage and reclaimable-cache (``memory.stat``) names.
_CGROUP = {"v2": ("memory.max", "memory.current", "inactive_file"),
           "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def host_limit(value: str | None = None) -> int | None:
    """The limit of :data:`LIMIT_ENV` in bytes (``value``: that text instead of the environment's); None where
    unset or empty. Raises ``ValueError`` naming the variable where it is not a positive size."""
    text = os.environ.get(LIMIT_ENV, "") if value is None else value
    if not text.strip():
        return None
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(?:([KMGT])(?:iB)?)?\s*", text, re.IGNORECASE)
    nbytes = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]) if m else 0
    if nbytes <= 0:
        raise ValueError(f"{LIMIT_ENV}={text!r}: expected a positive number of bytes, optionally with a binary "
                         "suffix K, M, G, T or KiB, MiB, GiB, TiB (e.g. 64G), or unset for no limit")
    return nbytes


def resident(proc: str = "/proc") -> int | None:
    """This process's resident memory in bytes (``VmRSS``: pinned memory included, CUDA's too); None where
    unknown."""
    try:
        with open(os.path.join(proc, "self", "status")) as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), None)
    except (OSError, ValueError):
        return None


def available(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory this process can still allocate; None where unknown (not Linux).

    The least of ``MemAvailable`` (``/proc/meminfo``: what the kernel can hand out without swapping,
    reclaimable cache included), for this process's cgroup and each ancestor visible to it, the
    limit less the usage not counting the inactive file cache (a container's limit, which
    ``MemAvailable`` does not see), and where :data:`LIMIT_ENV` is set, that limit less this process's
    resident memory (:func:`resident`). ``proc``, ``cgroup``: where those file systems are mounted.
    Pinned memory is part of this figure: CUDA's page-locked allocations (torch's, XLA's, CuPy's)
    are not counted against ``RLIMIT_MEMLOCK`` (measured on the H200 machine: 4 GiB pinned by torch
    and 2 GiB by CuPy under a 64 KiB limit).
    """
    left = []
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            left.append(next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None))
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, names = cgroup, _CGROUP["v2"]
        elif "memory" in controllers.split(","):
            base, names = os.path.join(cgroup, "memory"), _CGROUP["v1"]
        else:
            continue
        d = os.path.normpath(base + path)
        while True:  # its own group (absent in a container's namespace: the mount is its own) up to the mount
            left.append(_cgroup_left(d, *names))
            if len(d) <= len(base):
                break
            d = os.path.dirname(d)
    limit = host_limit()
    if limit is not None:
        used = resident(proc)
        left.append(max(0, limit - (used or 0)))
    return min((x for x in left if x is not None), default=None)


def _cgroup_left(d: str, limit: str, usage: str, inactive: str) -> int | None:
    try:
        with open(os.path.join(d, limit)) as f:
            lim = f.read().strip()
        if lim == "max":
            return None
        with open(os.path.join(d, usage)) as f:
            used = int(f.read())
        with open(os.path.join(d, "memory.stat")) as f:
            cache = next((int(v) for k, v in (line.split() for line in f) if k == inactive), 0)
    except (OSError, ValueError):
        return None
    return max(0, int(lim) - used + cache)
