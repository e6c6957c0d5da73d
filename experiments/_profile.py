"""Machine profiles for the training benchmarks (#37): a run on the big GPU machine constrained to a
smaller machine's GPU memory, host memory and cores, every setup held to the same limits.

Profiles (``--profile``): ``24g64`` (a 24 GB card, 24,564 MiB as an RTX 4090 reports it, with 64 GiB
of host memory and 8 cores), ``80g128`` (an H100 80 GB box: 81,559 MiB, 128 GiB, 16 cores), ``whole``
(no constraint), or ``<GPU GiB>g<host GiB>[c<cores>]`` (e.g. ``1g0.5c1``, for tests).

How each limit is applied, in the setup's own process (:func:`spawn_kwargs` in the parent,
:class:`GpuCap` in the child):

* GPU memory: ``torch.cuda.set_per_process_memory_fraction`` caps torch's caching allocator at the
  profile's bytes less what the process holds when the cap is set (the CUDA context), less the
  GPU-resident state a TrainStream setup asks for (``~resG``: allocated outside torch's allocator),
  less :data:`CONTEXT_GROWTH` (kernel modules and library handles loaded later, outside the
  allocator, as on the smaller card). A thread samples the device's used memory (``cudaMemGetInfo``:
  the whole device, this benchmark being its only user) every 10 ms; a peak above the profile is
  a violation in the row (``profile.violation``). ``gpu_state_bytes="auto"`` reads the device's free
  memory, not the cap: refused under a GPU cap (``~resG`` instead).
* Host memory: the parent watches the setup's process tree (its session: every process it started)
  every 0.1 s and kills it where the sum of their resident memory (``VmRSS``: pinned memory
  included, CUDA's ``cudaHostAlloc`` too, as measured on the H200 machine) passes the profile: a
  ``host_oom`` row, ``profile violation`` in its error. The setup's process also gets
  ``TRAINSTREAM_HOST_LIMIT`` (the library's budget: a TrainStream setup that cannot fit is refused
  with its figures before it allocates). ``RLIMIT_AS`` is not used (CUDA reserves address space far
  beyond its memory), nor a cgroup (not available in every container): the watchdog holds every
  setup to the same figure, with a sampling window of 0.1 s. A real machine of the profile's size
  also keeps 2-4 GiB for its OS: the profile's figure is the whole machine's, an upper bound.
* Cores: the setup's process runs on the first N usable cores (``os.sched_setaffinity`` before it
  starts: its threads and children inherit it), with ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` N and
  ``torch.set_num_threads(N)``; TrainStream's default ``threads`` follow the affinity (N - 1 workers),
  DeepSpeed's CPU Adam its OpenMP threads.

No torch import at module level (the parent's watchdog does not need it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading

GIB = 2**30
#: GPU memory the CUDA context gains after the cap is set (lazily loaded kernel modules, cuBLAS / cuDNN
#: handles), outside torch's allocator: left out of the allocator's share.
CONTEXT_GROWTH = 512 << 20
HOST_ENV = "TRAINSTREAM_HOST_LIMIT"  # trainstream._hostmem.LIMIT_ENV (not imported: the parent needs no trainstream)


@dataclasses.dataclass(frozen=True)
class Profile:
    """A machine: GPU memory, host memory (bytes) and cores; None: the machine's own."""

    name: str
    gpu_bytes: int | None = None
    host_bytes: int | None = None
    cores: int | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


PROFILES = {
    "24g64": Profile("24g64", 24564 << 20, 64 * GIB, 8),
    "80g128": Profile("80g128", 81559 << 20, 128 * GIB, 16),
    "whole": Profile("whole"),
}


def parse(name: str) -> Profile:
    """A named profile of :data:`PROFILES`, or ``<GPU GiB>g<host GiB>[c<cores>]``."""
    if name in PROFILES:
        return PROFILES[name]
    m = re.fullmatch(r"([0-9.]+)g([0-9.]+)(?:c([0-9]+))?", name)
    try:
        gpu, host, cores = float(m.group(1)), float(m.group(2)), int(m.group(3)) if m.group(3) else None
    except (AttributeError, ValueError):
        gpu = host = 0.0
        cores = None
    if gpu <= 0 or host <= 0 or cores == 0:
        raise ValueError(f"profile {name!r}: expected one of {', '.join(PROFILES)} or <GPU GiB>g<host GiB>[c<cores>] "
                         "with positive figures (e.g. 24g64c8)")
    return Profile(name, int(gpu * GIB), int(host * GIB), cores)


def cores_of(profile: Profile) -> list[int] | None:
    """The cores a setup of ``profile`` runs on: the first N usable ones; None: unconstrained."""
    if profile.cores is None:
        return None
    usable = sorted(os.sched_getaffinity(0))
    if profile.cores > len(usable):
        raise ValueError(f"profile {profile.name}: {profile.cores} cores, this machine lets this process use "
                         f"{len(usable)}")
    return usable[:profile.cores]


def spawn_kwargs(profile: Profile) -> dict:
    """``subprocess.Popen`` arguments that start a setup's process within ``profile``: ``env`` (threads, the
    library's host limit) and ``preexec_fn`` (the core affinity)."""
    env = dict(os.environ)
    cores = cores_of(profile)
    if cores is not None:
        env.update(OMP_NUM_THREADS=str(len(cores)), MKL_NUM_THREADS=str(len(cores)))
    if profile.host_bytes is not None:
        env[HOST_ENV] = str(profile.host_bytes)
    out = {"env": env}
    if cores is not None:
        out["preexec_fn"] = lambda: os.sched_setaffinity(0, cores)
    return out


def tree_rss(root: int, proc: str = "/proc") -> int:
    """Resident bytes of the processes of session ``root`` (a child started with ``start_new_session``: it and
    everything it started), from ``/proc/<pid>/statm``. Pages shared between them count once per process."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(f"{proc}/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != root:  # the fields after the name: state, ppid, pgrp, session
                continue
            with open(f"{proc}/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return total


class GpuCap:
    """In the setup's process, after its CUDA context exists: the profile's GPU cap on torch's allocator
    (``resident_bytes``: GPU memory the setup allocates outside it) and a sampler of the device's used memory.
    :meth:`report` stops the sampler and returns the row's ``profile`` entry."""

    def __init__(self, profile: Profile, resident_bytes: int = 0, interval: float = 0.01):
        import torch  # noqa: PLC0415

        self.profile, self.torch = profile, torch
        self.cuda = torch.cuda.is_available()
        cores = cores_of(profile)
        if cores is not None:
            torch.set_num_threads(len(cores))
        self.info = {**profile.as_dict(), "affinity": sorted(os.sched_getaffinity(0)),
                     "torch_threads": torch.get_num_threads(), "host_limit_env": os.environ.get(HOST_ENV)}
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = None
        if not self.cuda:
            self.info["gpu_cap"] = "not applied (no CUDA)"
            return
        free, total = torch.cuda.mem_get_info()
        self.total, self.start_used = total, total - free
        if profile.gpu_bytes is not None:
            allow = profile.gpu_bytes - self.start_used - int(resident_bytes) - CONTEXT_GROWTH
            if allow <= 0:
                raise MemoryError(f"profile {profile.name}: no GPU memory left for torch's allocator "
                                  f"({profile.gpu_bytes / GIB:.2f} GiB less {self.start_used / GIB:.2f} in use and "
                                  f"{resident_bytes / GIB:.2f} of resident state)")
            torch.cuda.set_per_process_memory_fraction(allow / total)
            self.info.update(allocator_cap_gib=allow / GIB, resident_gib=resident_bytes / GIB)
        self.info.update(gpu_total_gib=total / GIB, context_gib=self.start_used / GIB)
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.is_set():
            free, total = self.torch.cuda.mem_get_info()
            self.peak_used = max(self.peak_used, total - free)
            self._stop.wait(interval)

    def report(self) -> dict:
        """The profile as applied, the device's peak used memory and, where it passed the profile, why."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.info.update(gpu_peak_used_gib=self.peak_used / GIB,
                             allocator_peak_reserved_gib=self.torch.cuda.max_memory_reserved() / GIB)
            cap = self.profile.gpu_bytes
            if cap is not None and self.peak_used > cap:
                self.info["violation"] = (f"GPU: the device's used memory peaked at {self.peak_used / GIB:.2f} GiB, "
                                          f"above the profile's {cap / GIB:.2f} GiB")
        return self.info
