"""What :class:`~trainstream.torch.OffloadAdamW` needs of ``torch.distributed``: FSDP2's DTensor parameters
(and their state's checkpoint values), the process's place among its host's ranks (worker threads and cores),
and ZeRO-1 (``zero_stage=1``): the partition, the broadcast of the new weights, the gathered state dict.
``torch.distributed.tensor`` is looked up, never imported: a DTensor exists only once it is.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import torch

from .. import _cores

__all__ = ["is_dtensor", "local", "version", "foreach_moves_versions", "state_view", "local_value", "world",
           "local_world", "worker_cores", "ZeroPartition", "gather_state"]


# -- FSDP2: DTensor parameters ---------------------------------------------------------------

def is_dtensor(t: Any) -> bool:
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2: this rank's shard, maybe empty, which the all-gather reads), else ``t``."""
    return t._local_tensor if is_dtensor(t) else t


def version(t: torch.Tensor) -> Any:
    """``t``'s version counter; for a DTensor also its local tensor's (FSDP2's ``load_state_dict`` and
    ``set_model_state_dict`` move only the first, an edit of ``to_local()`` only the second)."""
    return (t._version, t._local_tensor._version) if is_dtensor(t) else t._version


_FOREACH_VERSIONS: list[bool] = []  # the probe's answer, once


def foreach_moves_versions(mesh: Any) -> bool:
    """Whether an in-place ``torch._foreach_*`` op on DTensors (``clip_grad_norm_``'s) moves a version counter (none
    in torch 2.13: pytorch/pytorch#197502); probed once per process on a 1-element replicated DTensor of ``mesh``."""
    if not _FOREACH_VERSIONS:
        from torch.distributed.tensor import DTensor, Replicate  # noqa: PLC0415 (imported by then)
        with torch.no_grad():
            t = DTensor.from_local(torch.zeros(1, device=mesh.device_type), mesh,
                                   [Replicate()] * mesh.ndim, run_check=False)
            before = version(t)
            torch._foreach_mul_([t], 2.0)
            _FOREACH_VERSIONS.append(version(t) != before)
    return _FOREACH_VERSIONS[0]


def state_view(param: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host`` (this rank's shard of a state tensor, in host memory) as a DTensor view laid out as ``param``
    (mesh, placements, global shape and stride), which torch.distributed.checkpoint saves and loads in place.
    Built as FSDP2 builds its CPU-offloaded shards (``DTensor.from_local`` would copy it to the mesh's device)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: PLC0415
    meta = TensorMeta(param.shape, param.stride(), host.dtype)
    return DTensor(host, DTensorSpec(param.device_mesh, tuple(param.placements), tensor_meta=meta),
                   requires_grad=False)


def local_value(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a loaded state tensor ``t`` of parameter ``p``, on the CPU in its dtype (for a DTensor ``p``,
    the local tensor of a DTensor ``t``, as torch.distributed.checkpoint's ``set_optimizer_state_dict`` passes it)."""
    if is_dtensor(p) and not is_dtensor(t):
        raise ValueError("OffloadAdamW.load_state_dict: a DTensor (FSDP2) parameter's state must be a DTensor laid "
                         "out as it (torch.distributed.checkpoint's set_optimizer_state_dict gives that, also from a "
                         f"full state dict); got a {type(t).__name__} of shape {tuple(t.shape)}")
    return local(t.detach()).to("cpu")


# -- ranks and host resources ----------------------------------------------------------------

def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_world() -> tuple[int, int]:
    """``(local rank, local world size)`` on this host: torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, else
    :func:`world` (all ranks counted as local: never more threads than cores)."""
    try:
        return int(os.environ["LOCAL_RANK"]), max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return world()


def _gpu_numa_node(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    bus, dev = getattr(props, "pci_bus_id", None), getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return None
    return _cores.pci_numa_node(f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{dev:02x}.0")


def worker_cores(spec: Any, device: torch.device) -> list[int] | None:
    """The cores ``OffloadAdamW(worker_cores=spec)`` binds its workers to (see its docstring and
    :func:`trainstream._cores.rank_cores`); raises ``ValueError`` for a bad ``spec``."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(f"worker_cores must be None, 'auto' or a list of CPU ids, got {spec!r}")
        lrank, lworld = local_world()
        gpu_r = device.type == "cuda" and device.index == lrank and torch.cuda.device_count() >= lworld
        return _cores.rank_cores(lrank, lworld, [_gpu_numa_node(r) for r in range(lworld)] if gpu_r else None)
    try:
        cores = sorted({int(c) for c in spec})
    except (TypeError, ValueError):
        raise ValueError(f"worker_cores must be None, 'auto' or a list of CPU ids, got {spec!r}") from None
    usable = set(_cores.usable_cores())
    if not cores or not set(cores) <= usable:
        raise ValueError(f"worker_cores {cores} must be a non-empty subset of this process's cores {sorted(usable)}")
    return cores


# -- ZeRO-1 ----------------------------------------------------------------------------------

class ZeroPartition:
    """ZeroRedundancyOptimizer's partition over the default process group (this rank: ``rank``): per param group
    in order, its parameters largest first (a stable sort), each to the lowest rank holding the fewest elements so
    far. A group added later continues from the counts so far, as ZeroRedundancyOptimizer's repartition from
    scratch gives."""

    def __init__(self, gated: bool = False):
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError("OffloadAdamW(zero_stage=1) partitions the parameters between the ranks of "
                             "torch.distributed's default process group: initialise it first")
        if gated:
            raise NotImplementedError("OffloadAdamW: overlap_forward with zero_stage=1 is not built (each "
                                      "owner broadcasts its new weights in step(), after their uploads)")
        self.rank, world_size = world()
        self.sizes = [0] * world_size
        self.owner: dict[torch.Tensor, int] = {}

    def add_group(self, params: Sequence[torch.Tensor]) -> None:
        if any(is_dtensor(p) for p in params):
            raise ValueError("OffloadAdamW: zero_stage=1 is for replicated parameters (DDP); FSDP2's "
                             "DTensor parameters are sharded already: use zero_stage=0")
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            r = self.sizes.index(min(self.sizes))
            self.owner[p] = r
            self.sizes[r] += p.numel()

    def mine(self, p: torch.Tensor) -> bool:
        """Whether this rank holds ``p``'s state and updates it."""
        return self.owner[p] == self.rank

    def snapshot(self) -> tuple[list[int], dict[torch.Tensor, int]]:
        return list(self.sizes), dict(self.owner)

    def restore(self, snap: tuple[list[int], dict[torch.Tensor, int]]) -> None:
        self.sizes, self.owner = snap

    def broadcast(self, groups: Sequence[dict[str, Any]]) -> None:
        """Every parameter from its owner (``p.data``: no version moves), all issued, then waited for (NCCL: on the
        GPU); call it after the uploads of this rank's new weights (the current stream waits for them)."""
        works = [torch.distributed.broadcast(p.data, src=self.owner[p], async_op=True)
                 for g in groups for p in g["params"]]
        for work in works:
            work.wait()


def gather_state(state: dict[int, Any], to: int) -> dict[int, Any] | None:
    """``consolidate_state_dict``'s collective: every rank's ``state`` entries (pickled: copies of the views), merged
    in parameter-index order on rank ``to``; None on the other ranks."""
    rank, world_size = world()
    shares = [None] * world_size if rank == to else None
    torch.distributed.gather_object(state, shares, dst=to)
    if shares is None:
        return None
    return dict(sorted({i: entry for share in shares for i, entry in share.items()}.items()))
