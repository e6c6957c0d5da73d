"""The JAX adapter over a device mesh (``NamedSharding`` parameters).

``init`` reads each leaf's spec from the concrete parameters (a traced array carries none) as the pytree's
:class:`Layout` and gives the state the same shardings (``count`` replicated), so orbax handles it as optax.adamw's.
The scalars and global norm stay in the user's program, which GSPMD partitions as optax's; the update runs per shard
(:func:`per_device`), nothing gathered. One engine per configuration and process serves every local device; GPU
resources are keyed by the buffers' CUDA device, never by ``device.id`` (ids differ between processes).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ._state import OffloadAdamWState

__all__ = ["Layout", "check_traced", "in_manual_mesh", "init_state", "layout_of", "per_device"]


class Layout(NamedTuple):
    """The mesh and the PartitionSpec of each leaf of a sharded parameter pytree."""

    mesh: Any  # jax.sharding.Mesh
    specs: tuple  # PartitionSpec per leaf


def layout_of(leaves, paths) -> Layout | None:
    """The layout of concrete leaves: None for single-device arrays (and tracers), else every leaf must be a
    ``NamedSharding`` over one mesh."""
    if not leaves or any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    shardings = [getattr(x, "sharding", None) for x in leaves]
    if not any(isinstance(s, NamedSharding) for s in shardings):
        for s, path in zip(shardings, paths):
            if s is not None and len(s.device_set) > 1:
                raise NotImplementedError(f"TrainStream offload_adamw: leaf {path} has a {type(s).__name__} over "
                                          f"{len(s.device_set)} devices; sharded parameters must be NamedSharding "
                                          "arrays (jax.device_put(params, NamedSharding(mesh, spec)))")
        return None
    mesh = next(s.mesh for s in shardings if isinstance(s, NamedSharding))
    for s, path in zip(shardings, paths):
        if not isinstance(s, NamedSharding):
            raise ValueError(f"TrainStream offload_adamw: leaf {path} is a {type(s).__name__} array while other "
                             f"leaves are sharded over the mesh {dict(mesh.shape)}: place every leaf on that mesh "
                             "(NamedSharding(mesh, PartitionSpec()) replicates one)")
        if s.mesh != mesh:
            raise ValueError(f"TrainStream offload_adamw: leaf {path} is sharded over the mesh {dict(s.mesh.shape)} "
                             f"{s.mesh.devices.ravel().tolist()}, other leaves over {dict(mesh.shape)} "
                             f"{mesh.devices.ravel().tolist()}: every leaf must be on one mesh")
    return Layout(mesh, tuple(s.spec for s in shardings))


def in_manual_mesh() -> bool:
    """Whether the caller traces inside its own ``shard_map`` (or ``pmap``), every mesh axis manual. A partly
    manual mesh is refused: the arrays would still be partitioned over the other axes, unseen per shard."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    if not manual:
        return False
    auto = [a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1]
    if auto:
        raise NotImplementedError(f"TrainStream offload_adamw inside a shard_map that leaves the mesh axes {auto} "
                                  "automatic: make all axes manual (its axis_names) or call it outside the shard_map")
    return True


def check_traced(leaves, paths) -> None:
    """Refuses traced arrays of a multi-device mesh whose layout init never saw concretely."""
    for x, path in zip(leaves, paths):
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not getattr(mesh, "empty", True) and math.prod(mesh.shape.values()) > 1:
            raise ValueError(f"TrainStream offload_adamw: leaf {path} lives on a mesh of {dict(mesh.shape)} devices, "
                             "and tx.init never saw these parameters as arrays: it takes their PartitionSpecs from the "
                             "concrete arrays (a traced array carries none); call tx.init(params) outside jit first")


def host_zeros(shape, dtype, sharding: SingleDeviceSharding):
    """Zeros of ``shape``/``dtype`` in ``sharding``'s memory (pinned host), XLA's own buffer: made on its device and
    copied, waited for, so that one transient device array lives at a time. (Suspected, session u: on an H100
    NumPy's bfloat16 zeros put there with ``may_alias=False`` could not be donated;
    ``experiments/diag_jax_bf16_donation.py``.)"""
    x = jax.device_put(jnp.zeros(shape, dtype, device=next(iter(sharding.device_set))), sharding)
    x.block_until_ready()
    return x


def init_state(params, leaves, layout: Layout, host_memory: bool, families=None):
    """``OffloadAdamWState`` of sharded ``params``, put shard by shard (this process's shards only; the masters from
    host memory, the moments' zeros through :func:`host_zeros` where ``host_memory``). ``families``: per leaf
    ``(mu dtype, nu dtype, has a master)`` (default: float32 moments, a master for fp16/bf16 leaves)."""
    mesh, kind = layout.mesh, "pinned_host" if host_memory else None
    fams = families or [("float32", "float32", np.dtype(x.dtype) != np.float32) for x in leaves]
    of = {id(x): f for x, f in zip(leaves, fams)}

    def put(x, spec, shard_of):
        """The array of ``shard_of(addressable shard of x)`` per device, each copied into XLA's buffers (an array
        aliasing NumPy's memory cannot be donated)."""
        shards = [jax.device_put(shard_of(s), SingleDeviceSharding(s.device, memory_kind=kind), may_alias=False)
                  for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(np.shape(x), NamedSharding(mesh, spec, memory_kind=kind),
                                                        shards)

    def zeros(x, spec, which=0):
        local = NamedSharding(mesh, spec).shard_shape(np.shape(x))
        dt = jnp.dtype(of[id(x)][which])
        if not host_memory:
            return put(x, spec, lambda _: np.zeros(local, dt))
        shards = [host_zeros(local, dt, SingleDeviceSharding(s.device, memory_kind=kind)) for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(np.shape(x), NamedSharding(mesh, spec, memory_kind=kind),
                                                        shards)

    def master(x, spec):
        return put(x, spec, lambda s: np.asarray(s.data).astype(np.float32)) if of[id(x)][2] else None

    treedef = jax.tree.structure(params)
    col = lambda f: jax.tree.unflatten(treedef, [f(x, s) for x, s in zip(leaves, layout.specs)])  # noqa: E731
    count = jax.make_array_from_callback((), NamedSharding(mesh, PartitionSpec()), lambda _: np.zeros((), np.int32))
    return OffloadAdamWState(count, col(zeros), col(lambda x, s: zeros(x, s, 1)), col(master))


def per_device(fn, layout: Layout, first_specs, halves):
    """``fn(scalars, count, grads, params, mu, nu, masters) -> (firsts, mu', nu', masters')`` (lists of leaves)
    in a ``shard_map`` over the layout's mesh: XLA calls each device's callback on that device's thread with its
    local shards (replicated leaves: every copy). Scalars and count replicated; ``first_specs``: the specs of
    ``firsts``; ``halves``: the leaf of each master."""
    specs, rep = list(layout.specs), PartitionSpec()
    mspecs = [specs[i] for i in halves]
    return jax.shard_map(fn, mesh=layout.mesh, in_specs=(rep, rep, specs, specs, specs, specs, mspecs),
                         out_specs=(list(first_specs), specs, specs, mspecs), check_vma=False)  # no varying-axes types


def _local_processes() -> int:
    """The JAX processes on this host (XLA gives one host's devices one ``slice_index``): they share its cores."""
    if jax.process_count() == 1:
        return 1
    mine = {getattr(d, "slice_index", 0) for d in jax.local_devices()}
    return max(1, len({d.process_index for d in jax.devices() if getattr(d, "slice_index", 0) in mine}))
