"""Host cores per rank: the default worker count, a disjoint core slice per local rank (NUMA-local
where ``/sys`` tells the GPU's node), and binding threads to it. Binding and NUMA: Linux only
(elsewhere "all cores, unbound"). No torch, no JAX.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["usable_cores", "default_threads", "rank_cores", "pci_numa_node", "bind_current_thread", "bound"]


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask), ascending."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def default_threads(local_world: int = 1, cores: list[int] | None = None) -> int:
    """Worker threads of one rank: its share of the usable cores (or ``cores``) less one; at least 1."""
    n = len(cores) if cores is not None else len(usable_cores()) // max(1, int(local_world))
    return max(1, n - 1)


def pci_numa_node(bus_id: str | None) -> int | None:
    """The NUMA node of a PCI device (``"0000:3b:00.0"``) from ``/sys``; None if unknown."""
    if not bus_id:
        return None
    try:
        with open(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node") as f:
            node = int(f.read())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _node_cores(node: int) -> list[int]:
    """The CPU ids of NUMA node ``node``, from its kernel cpulist (``"0-3,8,10-11"``); [] if unknown."""
    try:
        with open(f"/sys/devices/system/node/node{node}/cpulist") as f:
            spans = [part.partition("-") for part in f.read().strip().split(",") if part]
        return [c for lo, _, hi in spans for c in range(int(lo), int(hi or lo) + 1)]
    except (OSError, ValueError):
        return []


def rank_cores(local_rank: int, local_world: int, nodes: list[int | None] | None = None) -> list[int]:
    """A disjoint, non-empty slice of the usable cores for ``local_rank`` of ``local_world`` ranks.
    ``nodes``: the NUMA node of each rank's GPU (None: unknown); the ranks of a known node with
    usable cores split its cores, otherwise all ranks split the usable cores in rank order."""
    cores = usable_cores()
    local_world = max(1, int(local_world))
    node = nodes[local_rank] if nodes is not None and local_rank < len(nodes) else None
    if node is not None:
        on_node = [c for c in _node_cores(node) if c in set(cores)]
        peers = [r for r in range(local_world) if nodes[r] == node]
        if on_node and len(on_node) >= len(peers):
            cores, local_world, local_rank = on_node, len(peers), peers.index(local_rank)
    k = max(1, len(cores) // local_world)
    part = cores[local_rank * k:(local_rank + 1) * k]
    return part or cores[-k:]


def bind_current_thread(cores: list[int] | None) -> None:
    """Bind the calling thread to ``cores`` (Linux; a no-op elsewhere or when refused)."""
    if cores:
        try:
            os.sched_setaffinity(0, cores)  # pid 0: the calling thread
        except (AttributeError, OSError, ValueError):
            pass


@contextlib.contextmanager
def bound(cores: list[int] | None):
    """Run the block with the calling thread bound to ``cores`` (memory first touched in it lands on
    their NUMA node), then restore its mask."""
    try:
        before = sorted(os.sched_getaffinity(0)) if cores else None
    except (AttributeError, OSError):
        before = None  # nothing to restore: left unbound
    bind_current_thread(cores if before else None)
    try:
        yield
    finally:
        bind_current_thread(before)
