"""Memory as a budget: where each slot goes (:func:`assign`: its state kept in GPU memory by
:func:`gpu_state_fits`, else updated on the device or on the host by the policy's :func:`place`), and the host
bytes an optimizer will allocate (:func:`host_bytes`), checked against the host (:func:`plan`, :func:`check`)
before any state is allocated. An adapter asks :func:`assign` once for the parameters it registers, plans the
host memory from its answer and hands each slot's answer to ``Engine.add_param(where=)``. Imports neither torch
nor jax.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .. import _hostmem
from .. import contract as C
from ..contract import ITEMSIZE as _ITEMSIZE

__all__ = ["LAYOUTS", "MARGIN", "PARTS", "PINNED_FRACTION", "RING_ITEM", "WHERE", "assign", "check",
           "device_copies_fit", "host_bytes", "hybrid_elems", "place", "plan", "gpu_state_fits", "slot_layout",
           "speculation_fits", "state_bytes", "stream_ring_bytes"]

#: Where :func:`assign` puts a slot: its state kept in GPU memory (a device slot, resident), the device
#: placement (state in host memory, updated by the GPU kernel) or the host placement. The last two are
#: also :func:`host_bytes`' layouts of those slots.
WHERE = ("gpu_state", "device", "host")
LAYOUTS = ("host", "streamed", "device", "arrays", "staged")
PARTS = ("state", "masters", "staging")
#: The default ``host_margin``: the fraction of the available host memory left to the rest of the
#: process and the host (the framework, data loading, a checkpoint being written).
MARGIN = 0.1
#: ``pin_moments`` pins the moments only while all pinned memory stays within this fraction of the
#: available memory (pinned pages are never reclaimed or swapped); else pageable.
PINNED_FRACTION = 0.5
#: Bytes per element of a chunk buffer of the stream ring (:mod:`trainstream.core._stream`): a gradient and a weight
#: chunk, each up to 4 bytes per element (float32).
RING_ITEM = 8


def stream_ring_bytes(threads: int, chunk: int) -> int:
    """The stream ring's host bytes (pinned where the backend pins): one buffer of ``chunk`` elements of
    :data:`RING_ITEM` bytes per worker thread (a worker holds one while it updates a chunk)."""
    return int(threads) * int(chunk) * RING_ITEM


def state_bytes(numel: int, dtype: str, recipe: C.TorchRecipe | None = None) -> int:
    """A device slot's state bytes (what a resident slot takes of ``gpu_state_bytes``): the moments in the
    recipe's state dtype (a third buffer with amsgrad) and an fp32 master where it keeps one (no recipe: two fp32
    moments and, for fp16/bf16 weights, an fp32 master), each buffer at least 4 bytes."""
    if recipe is None:
        return max(4, 4 * int(numel)) * (2 if dtype == "float32" else 3)
    item = _ITEMSIZE[C.state_dtype(recipe)]
    moments = (3 if recipe.amsgrad else 2) * max(4, item * int(numel))
    return moments + (max(4, 4 * int(numel)) if recipe.master and dtype != "float32" else 0)


def slot_layout(recipe: C.TorchRecipe | None, dtype: str, grad_sums: bool = False,
                streamed: bool = False) -> dict[str, tuple[str, str]]:
    """A host slot's buffers (:class:`~trainstream.core._hostslot.HostSlot`'s names) -> ``(dtype, kind)``, kind
    ``"state"`` (moments: pageable, pinned with ``pin_moments``), ``"pinned"`` or ``"pageable"``. ``recipe`` None:
    the fp32-master layout (the optax convention, and torch callers that name no recipe). ``grad_sums``: a master's
    fp32 gradient sums. A master's weight staging is not listed (the backend's ``weights_in_grad_stage``).
    ``streamed`` (bounded staging, :mod:`trainstream.core._stream`): the moments alone, and an fp16/bf16 parameter's
    fp32 master; the gradient and the weights pass through the stream ring, chunk by chunk."""
    sd = "float32" if recipe is None else C.state_dtype(recipe)
    out = {"exp_avg": (sd, "state"), "exp_avg_sq": (sd, "state")}
    if recipe is not None and recipe.amsgrad:
        out["max_exp_avg_sq"] = (sd, "state")
    if streamed:
        if grad_sums:
            raise ValueError("slot_layout: a streamed slot keeps no fp32 gradient sum")
        if dtype != "float32" and sd == "float32":
            out["master"] = ("float32", "pageable")
        return out
    if dtype == "float32":
        out["master"] = ("float32", "pinned")
    elif sd == "float32":
        out["master"] = ("float32", "pageable")
        if grad_sums:
            out["grad_sum"] = ("float32", "pageable")
    else:
        out["weights"] = (dtype, "pinned")
    out["grad_stage"] = (dtype, "pinned")
    return out


#: The part of :data:`PARTS` each buffer of :func:`slot_layout` counts in.
BUFFER_PART = {"exp_avg": "state", "exp_avg_sq": "state", "max_exp_avg_sq": "state", "master": "masters",
               "weights": "masters", "grad_stage": "staging", "param_stage": "staging", "grad_sum": "staging"}


def gpu_state_fits(slots: Iterable[tuple], budget: int, used: int = 0) -> list[bool]:
    """Which ``(numel, dtype, trainable[, recipe])`` slots keep their state in GPU memory (the engine's rule,
    before the policy's): in order, each trainable slot whose :func:`state_bytes` fit in what
    ``used`` leaves of ``budget``."""
    out = []
    for numel, dtype, trainable, *rest in slots:
        need = state_bytes(numel, dtype, *rest[:1])
        out.append(bool(trainable) and budget > 0 and used + need <= budget)
        used += need if out[-1] else 0
    return out


def place(slots: Iterable[tuple[int, bool, bool | None]], placement: str, device_elems: int = 0,
          used: int = 0) -> list[bool]:
    """Which ``(numel, trainable, on_device)`` slots the policy ``placement`` puts on the device:
    ``cpu`` none, ``gpu`` all, ``hybrid`` a trainable slot where ``on_device`` says or, where it is
    None, while it fits in what ``used`` leaves of ``device_elems``, in order."""
    out = []
    for numel, trainable, on_device in slots:
        if placement != "hybrid":
            dev = placement == "gpu"
        else:
            dev = bool(trainable) and (used + int(numel) <= device_elems if on_device is None else bool(on_device))
        used += int(numel) if dev else 0
        out.append(dev)
    return out


def assign(slots: Sequence[tuple], mode: str, *, device_elems: int = 0, device_used: int = 0,
           gpu_state_bytes: int = 0, gpu_state_used: int = 0, last: bool = False,
           on_device: Sequence[bool | None] | None = None) -> list[str]:
    """Where (:data:`WHERE`) each of the ``(numel, dtype, trainable[, recipe])`` slots goes, registered after those
    that took ``gpu_state_used`` bytes of ``gpu_state_bytes`` and ``device_used`` elements of
    ``device_elems``: ``"gpu_state"`` where its state fits (:func:`gpu_state_fits`, in slot order), else the
    policy ``mode`` (:func:`place`): ``"device"`` or ``"host"``. ``hybrid`` fills ``device_elems`` in slot
    order, or with ``last`` from the last slot backwards (its gradient comes first), except where
    ``on_device`` (one entry per slot) says."""
    slots = list(slots)
    resident = gpu_state_fits(slots, gpu_state_bytes, gpu_state_used)
    order = [i for i in (range(len(slots) - 1, -1, -1) if last else range(len(slots))) if not resident[i]]
    choice = [None] * len(slots) if on_device is None else list(on_device)
    dev = dict(zip(order, place([(slots[i][0], slots[i][2], choice[i]) for i in order], mode, device_elems,
                                device_used)))
    return ["gpu_state" if resident[i] else "device" if dev[i] else "host" for i in range(len(slots))]


def hybrid_elems(slots: Iterable[tuple], share: float, gpu_state_bytes: int = 0) -> int:
    """``hybrid``'s ``device_elems``: ``share`` of the trainable elements of the ``(numel, dtype,
    trainable[, recipe])`` slots whose state does not fit in ``gpu_state_bytes`` (:func:`gpu_state_fits`)."""
    slots = list(slots)
    resident = gpu_state_fits(slots, gpu_state_bytes)
    return round(share * sum(int(s[0]) for s, r in zip(slots, resident) if s[2] and not r))


def host_bytes(slots: Iterable[tuple], *, pin_moments: bool = False, can_pin: bool = True,
               weights_in_grad_stage: bool = True, ring_bytes: int = 0) -> dict[str, int]:
    """Host bytes of ``(numel, dtype, layout[, recipe[, grad_sums]])`` slots as ``{part}_pinned`` and
    ``{part}_pageable`` per part of :data:`PARTS`: ``state`` (moments), ``masters`` (the weights the host updates:
    fp32 masters and weights, or fp16/bf16 weights' own bits), ``staging`` (transfers, a master's fp32 gradient
    sums). Layouts:

    * ``"host"`` (:meth:`~trainstream.core._host.HostPlacement.add_param`): :func:`slot_layout`'s buffers of the
      ``recipe`` (None: the fp32-master layout): moments pageable (pinned with ``pin_moments``; all pageable with
      ``can_pin`` False: torch with CPU parameters), the weights and the gradient staging pinned, a master
      pageable, and for a master a pinned weight staging unless the backend has ``weights_in_grad_stage``;
    * ``"streamed"`` (bounded staging: ``HostPlacement.add_param(streamed=True)``): the moments (as ``"host"``'s) and
      a master of fp16/bf16 weights, nothing staged per slot; the stream ring they share is ``ring_bytes``
      (:func:`stream_ring_bytes`; counted once, in ``staging``, pinned where ``can_pin``);
    * ``"device"`` (:meth:`~trainstream.core._device.DevicePlacement.add_param`, JAX ``mode="gpu"``):
      moments and the fp32 master of fp16/bf16 weights in pinned (mapped) memory;
    * ``"arrays"``: that state as pageable arrays, nothing staged (JAX on XLA:CPU);
    * ``"staged"``: the state of ``"device"``, staged through a ring shared by the slots (JAX ``mode="cpu"`` on a
      GPU): ``ring_bytes``, the pinned bytes of the rings (:func:`trainstream.core._hostring.host_ring_bytes` per
      device), counted once in ``staging``.

    A slot of these three layouts may add its recipe (torch: the recipe's state dtype, ``max_exp_avg_sq``, a master
    only for fp32 state of fp16/bf16 weights) or ``(mu dtype, nu dtype, master)`` (JAX: the optax state it keeps);
    default the fp32-master layout."""
    out = {f"{p}_{k}": 0 for p in PARTS for k in ("pinned", "pageable")}

    def add(part: str, nbytes: int, pinned: bool, host: bool = False) -> None:
        out[f"{part}_{'pinned' if pinned and (can_pin or not host) else 'pageable'}"] += nbytes

    if ring_bytes:
        add("staging", int(ring_bytes), True, True)

    for numel, dtype, layout, *rest in slots:
        if layout not in LAYOUTS or dtype not in _ITEMSIZE:
            raise ValueError(f"host_bytes: unknown layout {layout!r} or dtype {dtype!r}")
        numel, item, half = int(numel), _ITEMSIZE[dtype], dtype != "float32"
        if layout in ("host", "streamed"):
            recipe, sums = (rest + [None, False])[:2]
            bufs = slot_layout(recipe, dtype, bool(sums), layout == "streamed")
            for name, (bdtype, kind) in bufs.items():
                add(BUFFER_PART[name], _ITEMSIZE[bdtype] * numel, pin_moments if kind == "state" else kind == "pinned",
                    True)
            if "master" in bufs and half and not weights_in_grad_stage and layout == "host":
                add("staging", item * numel, True, True)
            continue
        pinned = layout != "arrays"
        extra = rest[0] if rest else None
        if isinstance(extra, C.TorchRecipe):  # a torch device slot: its recipe's state (DevicePlacement.add_param)
            sd = C.state_dtype(extra)
            moments, master = [sd] * (3 if extra.amsgrad else 2), half and sd == "float32"
        else:
            mu, nu, master = extra if extra is not None else ("float32", "float32", half)
            moments = [mu, nu]

        def size(d: str) -> int:  # DevicePlacement maps >= 4 B
            return max(4, _ITEMSIZE[d] * numel) if layout == "device" else _ITEMSIZE[d] * numel
        add("state", sum(size(d) for d in moments), pinned)
        if master:
            add("masters", size("float32"), pinned)
    return out


def plan(slots: Iterable[tuple[int, str, str]], *, margin: float | None = MARGIN, pin_moments: bool = False,
         available: int | None = None, **kwargs) -> dict[str, float]:
    """:func:`host_bytes` of ``slots`` (``kwargs``: its options) against what the host has
    (:func:`trainstream._hostmem.available`, or ``available`` bytes: planning for another machine): the parts and
    ``pinned``, ``pageable``, ``needed`` (totals, bytes), ``available`` (-1: unknown), ``usable`` (``available`` less
    ``margin`` of it; -1: not checked, as with ``margin=None``), ``margin``, ``pin_moments`` (0 also where pinning
    would take more than :data:`PINNED_FRACTION` of ``available``) and ``fits`` (1: fits or not checked)."""
    if margin is not None and not 0.0 <= margin < 1.0:
        raise ValueError(f"host_margin must be a fraction in [0, 1) or None, got {margin!r}")
    slots = list(slots)
    avail = _hostmem.available() if available is None else int(available)
    got = host_bytes(slots, pin_moments=pin_moments, **kwargs)
    pinned = sum(got[f"{p}_pinned"] for p in PARTS)
    if pin_moments and avail is not None and pinned > PINNED_FRACTION * avail:
        pin_moments = False
        got = host_bytes(slots, pin_moments=False, **kwargs)
        pinned = sum(got[f"{p}_pinned"] for p in PARTS)
    needed = sum(got.values())
    usable = -1 if margin is None or avail is None else int(avail * (1.0 - margin))
    return {**{k: float(v) for k, v in got.items()}, "pinned": float(pinned), "pageable": float(needed - pinned),
            "needed": float(needed), "available": float(-1 if avail is None else avail), "usable": float(usable),
            "margin": float(-1 if margin is None else margin), "pin_moments": float(pin_moments),
            "fits": float(usable < 0 or needed <= usable)}


def check(p: dict[str, float], hint: str) -> None:
    """Raise ``MemoryError`` where plan ``p`` does not fit, with its figures and ``hint`` (the
    adapter's ways to fit)."""
    if p["fits"]:
        return
    parts = "; ".join(f"{k} {p[k + '_pinned']:,.0f} pinned + {p[k + '_pageable']:,.0f} pageable" for k in PARTS)
    raise MemoryError(
        f"TrainStream: the optimizer needs {p['needed']:,.0f} bytes ({p['needed'] / 2**30:.2f} GiB) of host "
        f"memory ({parts}; {p['pinned']:,.0f} pinned in all), and {p['available']:,.0f} bytes "
        f"({p['available'] / 2**30:.2f} GiB) are available (the least of MemAvailable, this process's cgroup "
        f"memory limit less its usage and {_hostmem.LIMIT_ENV} less its resident memory), of which it may take "
        f"{p['usable']:,.0f} (host_margin={p['margin']:g} is left to the rest). None of it was allocated. To fit: "
        f"{hint}; or host_margin=None to skip this check where that figure is wrong (e.g. a VM whose memory grows "
        "as it is used).")


def speculation_fits(nbytes: int, margin: float | None = MARGIN) -> bool:
    """Whether ``nbytes`` more host memory (speculation's kept copies, :mod:`trainstream.core._speculate`) fits in
    what the host has now (:func:`trainstream._hostmem.available`) less ``margin`` of it; True where unknown or
    unchecked (``margin`` None)."""
    avail = _hostmem.available()
    return margin is None or margin < 0 or avail is None or nbytes <= avail * (1.0 - margin)


def device_copies_fit(nbytes: int, free: int, total: int, headroom: float) -> bool:
    """Whether ``nbytes`` more device memory (speculation's gradient copies, ``trainstream.torch._gradcopy``) fits
    in the ``free`` bytes of a device of ``total`` bytes, less ``headroom`` of ``total``."""
    return nbytes <= free - headroom * total
