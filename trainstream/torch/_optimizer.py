"""``OffloadAdamW``: the ``torch.optim.Optimizer`` over the engine (``trainstream.core``), whose arithmetic is the
contract's (``trainstream.contract``). No arithmetic lives here; buffers, streams and copies are :mod:`trainstream.backends.torch`'s.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Mapping
import threading
import warnings
import weakref
from typing import Any, Iterable

import numpy as np
import torch
from torch.optim import Optimizer

from .. import _cores
from .. import contract as C
from ..core import Engine, _budget
from . import _dist as D
from ..backends.torch import _DTYPE_NAME, TorchBackend, torch_cpu_code

__all__ = ["OffloadAdamW"]


#: ``gpu_state_bytes="auto"`` leaves this fraction of the GPU's memory free (for the caching allocator's later
#: growth, other processes, fragmentation).
AUTO_GPU_HEADROOM = 0.1

_HINT = ("less state per process (FSDP2, or zero_stage=1 under DDP: each rank holds its share), mode='gpu' or "
         "'hybrid' (no staging for the GPU share: 12 instead of 14 bytes per bf16 parameter, 8 instead of 16 per fp32)")
#: Plan entries added up over the parameter groups (the others are the last check's).
_SUMMED = {*(f"{p}_{k}" for p in _budget.PARTS for k in ("pinned", "pageable")), "pinned", "pageable", "needed"}


def _gpu_state_fits(flat, budget: int, used: int = 0) -> list[bool]:
    """The engine's resident rule (:func:`trainstream.core._budget.gpu_state_fits`) on parameters."""
    return _budget.gpu_state_fits([(D.local(p).numel(), _DTYPE_NAME.get(p.dtype, "float32"), p.requires_grad)
                             for p in flat], budget, used)


def _hybrid_elems(flat, share: float, gpu_state_bytes: int) -> int:
    """hybrid's budget of device elements: ``share`` of the trainable elements whose state is not GPU-resident."""
    res = _gpu_state_fits(flat, gpu_state_bytes)
    return round(share * sum(D.local(p).numel() for p, r in zip(flat, res) if p.requires_grad and not r))


def _host_plan(flat, mode: str, budget: int, last: bool, used: int, pin_moments: bool, margin, device=None,
               gpu_state_bytes: int = 0, gpu_state_used: int = 0):
    """The host plan of registering ``flat`` (:func:`trainstream.core._budget.plan`, refused parameters left out) and
    hybrid's split: GPU-resident ones first, then by fit in what ``used`` leaves of ``budget`` (``last``: backwards)."""
    res = _gpu_state_fits(flat, gpu_state_bytes, gpu_state_used)
    order = [i for i in (range(len(flat) - 1, -1, -1) if last else range(len(flat))) if not res[i]]
    dev = dict(zip(order, _budget.place([(D.local(flat[i]).numel(), flat[i].requires_grad, None) for i in order],
                                        mode, budget, used)))
    on_gpu = [dev.get(i, False) for i in range(len(flat))]
    device = device or next((D.local(p).device for p in flat), None)
    cuda = device is not None and device.type == "cuda"
    slots = [(D.local(p).numel(), _DTYPE_NAME[p.dtype], "device" if g else "host")
             for p, g, r in zip(flat, on_gpu, res) if p.dtype in _DTYPE_NAME and not r]
    plan = _budget.plan(slots, margin=margin, pin_moments=pin_moments, can_pin=cuda,
                        weights_in_grad_stage=TorchBackend.weights_in_grad_stage,
                        pinned_size=TorchBackend.pinned_size if cuda else None)
    return plan, on_gpu


def _check_placement(mode: str, gpu_share, gpu_params: str, gpu_state_bytes) -> None:
    """Refuse placement arguments :class:`OffloadAdamW` (and ``host_memory_plan``) do not take."""
    if mode not in ("cpu", "gpu", "hybrid"):
        raise ValueError(f"OffloadAdamW mode must be 'cpu', 'gpu' or 'hybrid', got {mode!r}")
    if isinstance(gpu_share, bool) or not isinstance(gpu_share, numbers.Real) or not 0.0 <= gpu_share <= 1.0:
        raise ValueError(f"Invalid gpu_share: {gpu_share!r} (must be a fraction in [0, 1])")
    if not (isinstance(gpu_state_bytes, str) and gpu_state_bytes == "auto") and (isinstance(gpu_state_bytes, bool)
            or not isinstance(gpu_state_bytes, numbers.Integral) or gpu_state_bytes < 0):
        raise ValueError(f"Invalid gpu_state_bytes: {gpu_state_bytes!r} (must be an int >= 0, in bytes, or 'auto')")
    if gpu_params not in ("first", "last"):
        raise ValueError(f"Invalid gpu_params: {gpu_params!r} (must be 'first' or 'last')")
    if gpu_params != "first" and mode != "hybrid":
        raise ValueError(f"gpu_params={gpu_params!r} applies to mode='hybrid' only (mode={mode!r})")


class _Owned:
    """What one :class:`OffloadAdamW` releases, once: its hooks and its engine."""

    def __init__(self, *hook_dicts: dict):
        self.hook_dicts, self.handles, self.engine = hook_dicts, [], None

    def release(self) -> None:
        for h in [*self.handles, *(h for d in self.hook_dicts for h in d.values())]:
            h.remove()
        for d in self.hook_dicts:
            d.clear()
        if self.engine is not None:
            self.engine.close()


def _local_value(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a loaded state tensor ``t`` of parameter ``p``, float32 on the CPU (for a DTensor ``p``,
    the local tensor of a DTensor ``t``, as torch.distributed.checkpoint's ``set_optimizer_state_dict`` passes it)."""
    if D.is_dtensor(p) and not D.is_dtensor(t):
        raise ValueError("OffloadAdamW.load_state_dict: a DTensor (FSDP2) parameter's state must be a DTensor laid "
                         "out as it (torch.distributed.checkpoint's set_optimizer_state_dict gives that, also from a "
                         f"full state dict); got a {type(t).__name__} of shape {tuple(t.shape)}")
    return D.local(t.detach()).to("cpu", torch.float32)


_GROUP_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                    decoupled_weight_decay=True)


def _check_group(group: dict[str, Any]) -> None:
    """Refuse what OffloadAdamW does not implement, before any state changes."""
    for flag in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
        if group.get(flag):
            raise NotImplementedError(f"OffloadAdamW does not implement {flag}")
    if not group.get("decoupled_weight_decay", True):
        raise NotImplementedError("OffloadAdamW implements decoupled weight decay only")
    C.validate_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])


class _State(Mapping):
    """``OffloadAdamW.state``: per updated parameter its :meth:`OffloadAdamW.state_dict` entry once its update has run,
    else ``{}``. A new dict per lookup: assigning into it changes nothing (edit tensors in place or load_state_dict)."""

    def __init__(self, opt: "OffloadAdamW"):
        self._opt = weakref.ref(opt)  # no cycle: the optimizer stays collectable

    def _sid(self, param: object) -> tuple["OffloadAdamW", int | None]:
        opt = self._opt()
        return opt, (None if opt is None or opt._closed else opt._slot_of.get(param))  # type: ignore[call-overload]

    def __getitem__(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        opt, sid = self._sid(param)
        if sid is None:
            raise KeyError(param)
        return opt._state_of(sid)

    def __iter__(self):
        opt = self._opt()
        if opt is None or opt._closed or opt._engine is None:
            return iter(())
        return iter([p for sid, p in enumerate(opt._params_of_slot) if opt._engine.get_step(sid) > 0])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, param: object) -> bool:
        opt, sid = self._sid(param)
        return sid is not None and opt._engine.get_step(sid) > 0


class OffloadAdamW(Optimizer):
    r"""AdamW with its state in host memory, bit-identical to ``torch.optim.AdamW``.

    A drop-in replacement: the same arguments, param groups, LR schedulers, ``zero_grad``, ``step(closure)``,
    ``state`` and ``state_dict`` (keys ``step``, ``exp_avg``, ``exp_avg_sq``: checkpoints move to and from
    ``torch.optim.AdamW``). The moments and the fp32 masters of fp16/bf16 parameters live in host memory (or,
    within ``gpu_state_bytes``, in GPU memory). In an existing loop it changes memory and speed, nothing else
    (:meth:`last_micro_batch` and ``overlap_forward`` are opt-ins that trade a rule below for speed):

    * Gradients stay in ``param.grad`` (summed over micro-batches in the parameter's dtype). A hook copies each to
      pinned host memory as backward produces it; ``step()`` uses that copy, copies ``param.grad`` again where it
      changed since (``clip_grad_norm_``, ``GradScaler``, by hand) and skips parameters whose ``grad`` is ``None``.
      Clipping (``max_grad_norm``, :meth:`clip_grad_norm`) and ``GradScaler``'s unscaling act on ``param.grad``
      as torch's own ops; the host copy gets the same multiplier, bit for bit.
    * ``step()`` returns once the host update has run and, with CUDA parameters, makes the current stream wait
      (on the GPU) for the uploads of the new weights: no ``synchronize()`` needed.
    * Weights changed outside the optimizer (in place, ``model.load_state_dict``, ``p.data = ...`` of the same shape,
      dtype and device) are what it updates next (fp16/bf16: an element keeps its fp32 master where that still
      rounds to the weight). It sees a changed ``param._version`` or storage, so not ``p.data.mul_(...)``.

    Several processes (``torch.distributed``), each rank offloading only what it updates:

    * FSDP2 (``fully_shard``): build it on the sharded parameters (DTensors); each rank registers its local shard
      (uneven or empty included), hooked after FSDP2's reduce-scatter. Clipping is a collective (torch's DTensor
      norm). Unless ``max_grad_norm`` is set, ``step()``, not the hook, copies each shard's gradient (torch 2.13's
      in-place foreach ops move no DTensor version counter). ``state`` and ``state_dict()`` hold DTensor views of
      the host state, laid out as the parameters, for torch.distributed.checkpoint (also to and from
      ``torch.optim.AdamW``). HSDP, ``MixedPrecisionPolicy`` and ``gpu_state_bytes`` (per rank, the local shards
      that fit) need nothing more. Not with ``CPUOffloadPolicy`` or ``overlap_forward``.
    * DDP (any reduction after backward): plain parameters' gradients are taken at ``step()``, never by the hook.
      Each rank updates every parameter, or with ``zero_stage=1`` its partition. Not with :meth:`last_micro_batch`.

    Args:
      params: parameters or param groups, as for ``torch.optim.AdamW``: float32, float16 or bfloat16,
        contiguous, dense, all on one device (CUDA, or CPU).
      lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (``lr`` a float, not a Tensor).
      max_grad_norm: if set, ``step()`` first runs :meth:`clip_grad_norm` over the parameters in group order.
      mode: ``"cpu"`` (default: host threads update), ``"gpu"`` (a GPU kernel; the host state streams through a
        72 MiB ring of GPU buffers, ``stats()["staging_ring_bytes"]``) or ``"hybrid"`` (up to ``gpu_share`` of the
        trainable elements by the GPU kernel reading their host state over PCIe, beside the host threads); the last
        two need CUDA parameters. Each parameter gets its updating mode's bits (both ``torch.optim.AdamW``'s on CUDA).
      overlap_forward: a module (the model) whose next forward may start before the update has finished, each
        module waiting for its own weights (forward pre-hooks, outside Dynamo's graphs); reads of the weights
        outside that forward (``state_dict``, an EMA) then need :meth:`synchronize`.
      gpu_state_bytes: GPU memory, in bytes, for optimizer state (any mode; CUDA parameters; default 0). Trainable
        parameters whose state (8 bytes per element, 12 for fp16/bf16) fits in what is left, in order (also of a
        later ``add_param_group``), keep and update it there (same bits, no PCIe traffic) at ``step()``, or under
        :meth:`last_micro_batch` from their hooks (``gpu`` mode; ``hybrid`` with ``gpu_params="last"``). Allocated
        at construction outside torch's caching allocator (``stats()["gpu_state_bytes"]``), freed by :meth:`close`;
        ``state``/``state_dict()`` hold host copies, ``load_state_dict`` copies back. ``"auto"``: all state offloaded
        at first (as the host memory check assumes: for the largest model pass bytes); after the first ``step()``
        that updates, what fits in the GPU memory then free (the step's peak held by torch's pool) less
        ``AUTO_GPU_HEADROOM`` (a tenth) of the total moves there, same bits, freeing its host memory (pinned: to
        torch's cache); that step is not overlapped.
      gpu_share: ``hybrid``: the fraction of the trainable elements not kept in GPU memory that the kernel updates;
        parameters, in ``gpu_params`` order (also later ones), go to it while they fit, else to the host. The default
        0.3 was near the fastest for 125M-1.3B GPTs on an H200 with 16 host cores (depends on host memory vs PCIe).
      gpu_params: ``hybrid``: ``"first"`` (default): the GPU share from the first parameter on (what the next
        forward needs first). ``"last"``: from the last backwards (their gradients come first); with
        :meth:`last_micro_batch` their kernels run during the rest of backward.
      threads: host worker threads. Default: this process's share of its CPU affinity (divided by torchrun's
        ``LOCAL_WORLD_SIZE``, else the world size) less one, at least 1; with ``worker_cores``, its cores less one.
      worker_cores: bind the host workers (and the host state's first touch): ``None`` (default), ``"auto"``
        (this local rank's disjoint slice, of its GPU's NUMA node where ``/sys`` tells it and local rank r
        drives GPU r) or a list of CPU ids. Linux only; elsewhere ignored.
      zero_stage: ``0`` (default) or ``1``: ZeRO stage 1 over the default process group for replicated plain
        parameters (DDP): each rank holds the state of, and updates, only its partition (ZeroRedundancyOptimizer's),
        then broadcasts its new weights in ``step()``. Checkpoints: :meth:`consolidate_state_dict`.
      chunk_size: elements per work item of the worker pool (default 2**20).
      worker_nice: the host workers' nice value (``cpu``, ``hybrid``; Linux); the default 5 yields to the threads
        driving the GPU, 19 is faster with ``hybrid`` and :meth:`last_micro_batch` unless a busy loader starves them.
      eager_blocks: the grid cap, in blocks, of the kernels launched from hooks under :meth:`last_micro_batch`
        (the bits do not depend on it). ``None``: a quarter of the GPU's multiprocessors, leaving backward the rest.
      pin_moments: keep the moments page-locked (``cpu`` mode) while all pinned memory stays within half of the
        available host memory, else pageable (``stats()["host_plan_pin_moments"]``). Default False.
      host_margin: the host memory the optimizer will take (:meth:`host_memory_plan`) must fit in what the host
        has less this fraction, checked before allocating: else ``MemoryError`` naming the bytes. None: no check.
      convention: ``"torch"`` (default) or ``"optax"``; see ``trainstream.contract``.
      amsgrad, maximize: ``True`` raises ``NotImplementedError``.

    Invalid arguments raise ``ValueError`` (``TypeError``: a Tensor ``lr``, a non-Module ``overlap_forward``, an
    unsupported parameter dtype).
    """

    _step_supports_amp_scaling = True  # GradScaler leaves unscaling to step() (fused optimizers' protocol): _amp()

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 max_grad_norm: float | None = None, mode: str = "cpu", overlap_forward: torch.nn.Module | None = None,
                 threads: int | None = None, worker_cores: Any = None, zero_stage: int = 0, chunk_size: int = 1 << 20,
                 worker_nice: int = 5, eager_blocks: int | None = None, gpu_state_bytes: int = 0,
                 gpu_share: float = 0.3, gpu_params: str = "first", pin_moments: bool = False,
                 host_margin: float | None = _budget.MARGIN, convention: str = "torch", amsgrad: bool = False,
                 maximize: bool = False):
        if isinstance(lr, torch.Tensor):
            raise TypeError("OffloadAdamW: a Tensor lr is not supported; pass a float")
        C.validate_hyperparams(lr, betas, eps, weight_decay)
        _check_group(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize))
        if max_grad_norm is not None and not (max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be > 0 or None)")
        if overlap_forward is not None and not isinstance(overlap_forward, torch.nn.Module):
            raise TypeError(f"overlap_forward must be a torch.nn.Module or None, got {type(overlap_forward).__name__}")
        _check_placement(mode, gpu_share, gpu_params, gpu_state_bytes)
        _budget.plan([], margin=host_margin)  # a bad margin raises here
        if isinstance(worker_nice, bool) or not isinstance(worker_nice, int):
            raise ValueError(f"Invalid worker_nice: {worker_nice!r} (must be an int)")
        if eager_blocks is not None and (isinstance(eager_blocks, bool) or not isinstance(eager_blocks, int)
                                         or eager_blocks < 1):
            raise ValueError(f"Invalid eager_blocks: {eager_blocks!r} (must be an int >= 1 or None)")
        if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
            raise ValueError(f"Invalid zero_stage: {zero_stage!r} (0, or 1 for ZeRO stage 1)")
        D.worker_cores(worker_cores, torch.device("cpu"))  # a bad value raises here, not at the first parameter
        self._rank, world = D.world()
        self._zero = None  # zero_stage=1: which rank owns each parameter's state
        if zero_stage:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise ValueError("OffloadAdamW(zero_stage=1) partitions the parameters between the ranks of "
                                 "torch.distributed's default process group: initialise it first")
            if overlap_forward is not None:
                raise NotImplementedError("OffloadAdamW: overlap_forward with zero_stage=1 is not built (each "
                                          "owner broadcasts its new weights in step(), after their uploads)")
            self._zero = D.ZeroPartition(world)
        self._consolidated: dict[str, Any] | None = None  # zero_stage=1: consolidate_state_dict()'s
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.mode = mode
        self._auto_gpu_state = gpu_state_bytes == "auto"  # none at first, then what the GPU has free (_place_auto)
        self._gpu_state_bytes = 0 if self._auto_gpu_state else int(gpu_state_bytes)
        self._gpu_params, self._gpu_budget = gpu_params, 0  # budget: hybrid's device elements (_hybrid_elems)
        self._deferred, self._host_margin, self._host_plan = True, host_margin, {}  # _deferred: see add_param_group
        self._worker_cores = worker_cores
        self._cores, self._engine, self._device = None, None, None  # set by the first parameter (_register)
        self._engine_args = dict(threads=threads, chunk_size=chunk_size, convention=convention,
                                 pin_moments=pin_moments, worker_nice=worker_nice)
        self._slot_of: dict[torch.Tensor, int] = {}
        # Per slot: its parameter, param group index and what the engine last saw of it (_check_param): the storage
        # it writes, its _version (the engine's writes move none), (dtype, shape, device).
        self._params_of_slot, self._group_of, self._engine_param_ptr, self._param_version, self._param_meta = \
            [], [], [], [], []
        self._staged: dict[int, list] = {}  # the hook's copies: [grad weakref, its _version, multiplier since/None]
        self._last_norm: torch.Tensor | None = None
        self._hooks, self._gpu_hooks = {}, {}  # slot -> gradient hook handle (_hook): host slots', GPU slots' eager
        self._eager_blocks, self._eager, self._eager_done = eager_blocks, False, set()  # done: since the last step()
        self._gated, self._closed = overlap_forward is not None, False
        self._pending, self._pending_lock = set(), threading.Lock()  # overlap_forward: slots not waited for yet
        self._called, self._wait_sets = weakref.WeakSet(), weakref.WeakKeyDictionary()  # see _module_slots
        # Released once, by close() or collection of this object (not of a copy, e.g. LightningOptimizer's).
        self._owned = _Owned(self._hooks, self._gpu_hooks)
        self._release = weakref.finalize(self, self._owned.release)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **_GROUP_FLAGS))
        self.state = _State(self)  # type: ignore[assignment]  # the engine's, per parameter
        self._deferred = False
        mine = [(p, gi) for gi, g in enumerate(self.param_groups) for p in g["params"] if self._mine(p)]
        flat = [p for p, _ in mine]
        if mode == "hybrid":
            self._gpu_budget = _hybrid_elems(flat, float(gpu_share), self._gpu_state_bytes)
        on_gpu = self._reserve(flat, last=self._gpu_params == "last")  # raises before anything is allocated
        try:
            for (p, gi), gpu in zip(mine, on_gpu):
                self._register(p, gi, gpu)
        except BaseException:  # nothing of a half-built optimizer stays on the parameters
            self._closed = True
            self._owned.release()
            raise
        if overlap_forward is not None:
            self._gate(overlap_forward)

    def _gate(self, model: torch.nn.Module) -> None:
        """``overlap_forward``: before each module of ``model`` runs, wait for its weights."""
        ref = weakref.ref(self)

        @torch.compiler.disable  # runs eagerly, outside any graph Dynamo traces
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            opt = ref()
            if opt is None or opt._closed:
                return
            if module not in opt._called:
                opt._called.add(module)
                opt._wait_sets.clear()
            sids = [sid for sid in opt._module_slots(module) if sid in opt._pending] if opt._pending else None
            if sids:
                opt._engine.wait_ready(sids)
                with opt._pending_lock:
                    opt._pending.difference_update(sids)
        for m in model.modules():
            self._owned.handles.append(m.register_forward_pre_hook(pre_hook))

    # -- parameters -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        n_groups, n_slots = len(self.param_groups), len(self._params_of_slot)
        super().add_param_group(param_group)
        listed = self.param_groups[-1]["params"]
        zero = None if self._zero is None else (list(self._zero.sizes), dict(self._zero.owner))
        host_plan, pin = self._host_plan, self._engine_args["pin_moments"]  # as _reserve found them
        try:
            if len({id(p) for p in listed}) != len(listed):
                raise ValueError(f"OffloadAdamW: parameter group {n_groups} lists a parameter more than once "
                                 "(torch.optim.AdamW would update it once per listing); list each parameter once")
            _check_group(self.param_groups[-1])
            if self._zero is not None:
                if any(D.is_dtensor(p) for p in listed):
                    raise ValueError("OffloadAdamW: zero_stage=1 is for replicated parameters (DDP); FSDP2's "
                                     "DTensor parameters are sharded already: use zero_stage=0")
                self._zero.add_group(listed)
            if self._deferred:  # inside __init__: registered once every group is known (one host plan for all)
                return
            mine = [p for p in listed if self._mine(p)]
            for p, gpu in zip(mine, self._reserve(mine)):
                self._register(p, n_groups, gpu)
        except BaseException:  # leave the optimizer exactly as it was
            del self.param_groups[n_groups:]
            if zero is not None:
                self._zero.sizes, self._zero.owner = zero
            for p in self._params_of_slot[n_slots:]:
                self._slot_of.pop(p, None)
            for lst in (self._params_of_slot, self._group_of, self._engine_param_ptr, self._param_version,
                        self._param_meta):
                del lst[n_slots:]
            for sid in [k for k in self._hooks if k >= n_slots]:
                self._hooks.pop(sid).remove()
            if self._engine is not None:
                self._engine.truncate(n_slots)
            self._host_plan, self._engine_args["pin_moments"] = host_plan, pin
            if self._engine is not None and self._engine.host is not None:
                self._engine.host.pin_moments = pin
            raise
        self._wait_sets.clear()  # cached per-module wait lists predate these parameters

    def _reserve(self, flat: list[torch.Tensor], last: bool = False) -> list[bool]:
        """Before anything is allocated, check each parameter (:meth:`_check_new`), then the host memory
        (:func:`_host_plan`; pinned moments that would not fit become pageable); returns hybrid's split."""
        for i, p in enumerate(flat, len(self._params_of_slot)):
            self._check_new(p, i, self._device or D.local(flat[0]).device)
        eng, pin = self._engine, self._engine_args["pin_moments"]
        used, res_used = (eng.device_elems_used, eng.gpu_state_used) if eng is not None else (0, 0)
        plan, on_gpu = _host_plan(flat, self.mode, self._gpu_budget, last, used, pin, self._host_margin, self._device,
                                  self._gpu_state_bytes, res_used)
        _budget.check(plan, _HINT + (", pin_moments=False (torch rounds each pinned buffer up to a power of two)"
                                     if plan["pin_moments"] else ""))
        if pin and not plan["pin_moments"]:  # pinned moments would not fit: pageable from here on
            self._engine_args["pin_moments"] = False
            if eng is not None and eng.host is not None:
                eng.host.pin_moments = False
        self._host_plan = {k: v + self._host_plan.get(k, 0.0) if k in _SUMMED else v for k, v in plan.items()}
        return on_gpu

    @staticmethod
    def host_memory_plan(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *, mode: str = "cpu",
                         gpu_share: float = 0.3, gpu_params: str = "first", gpu_state_bytes: int = 0,
                         pin_moments: bool = False, host_margin: float | None = _budget.MARGIN) -> dict[str, float]:
        """The host memory ``OffloadAdamW(params, ...)`` will take, and what the host has, without allocating
        anything: bytes per part (``state_pinned``, ``state_pageable``, ``masters_*``, ``staging_*``), ``pinned``,
        ``pageable``, ``needed``, ``available``, ``usable``, ``pin_moments`` and ``fits`` (see
        :func:`trainstream.core._budget.plan`); after construction also in :meth:`stats` as ``host_plan_*``."""
        _check_placement(mode, gpu_share, gpu_params, gpu_state_bytes)
        groups = list(params)
        flat = [p for g in groups for p in ([g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])] \
            if groups and isinstance(groups[0], dict) else groups
        resident = 0 if gpu_state_bytes == "auto" else gpu_state_bytes  # "auto": all offloaded at first
        budget = _hybrid_elems(flat, gpu_share, resident) if mode == "hybrid" else 0
        return _host_plan(flat, mode, budget, gpu_params == "last", 0, pin_moments, host_margin,
                          gpu_state_bytes=resident)[0]

    def _mine(self, p: torch.Tensor) -> bool:
        """Whether this rank holds ``p``'s state (all but zero_stage=1's parameters of other ranks)."""
        return self._zero is None or self._zero.owner[p] == self._rank

    def _check_new(self, p: torch.Tensor, index: int, device: torch.device) -> None:
        """Refuse parameter ``p`` (slot ``index``) before anything is allocated; ``device``: the earlier parameters'."""
        loc = D.local(p)
        if p.dtype not in _DTYPE_NAME:
            raise TypeError("OffloadAdamW supports float32, float16 and bfloat16 parameters; parameter "
                            f"{index} has dtype {p.dtype}")
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"OffloadAdamW: parameter {index} is not a dense strided tensor")
        if not loc.is_contiguous():
            raise ValueError(f"OffloadAdamW: parameter {index} is not contiguous; make it contiguous first")
        if loc.device.type not in ("cuda", "cpu"):
            raise ValueError(f"OffloadAdamW: parameter {index} is on unsupported device {loc.device}")
        if loc is not p and p.device_mesh.device_type != loc.device.type:
            raise ValueError(f"OffloadAdamW: parameter {index} is a DTensor on a {p.device_mesh.device_type} mesh "
                             f"whose shard is on {loc.device.type} (FSDP2's CPUOffloadPolicy?): use either "
                             "CPUOffloadPolicy or OffloadAdamW, not both")
        if loc is not p and self._gated:
            raise NotImplementedError("OffloadAdamW: overlap_forward with FSDP2 (DTensor) parameters is not built "
                                      "(FSDP's all-gather reads the shards before a forward could wait); leave it "
                                      "unset: step() orders the uploads before FSDP's next all-gather.")
        if loc.device.type != "cuda" and (self.mode != "cpu" or self._gpu_state_bytes or self._auto_gpu_state):
            budget = "'auto'" if self._auto_gpu_state else self._gpu_state_bytes
            what = (f"mode={self.mode!r}" if self.mode != "cpu"
                    else f"gpu_state_bytes={budget} keeps state in GPU memory and")
            raise ValueError(f"OffloadAdamW {what} needs CUDA parameters; parameter {index} is on {loc.device}")
        if loc.device != device:
            raise ValueError(f"OffloadAdamW: all parameters must be on one device; parameter {index} is on "
                             f"{loc.device}, earlier ones on {device}")

    def _register(self, p: torch.Tensor, group: int, gpu: bool | None = None) -> None:
        """Give ``p`` (checked by :meth:`_check_new`) of param group ``group`` a slot, on the device if ``gpu``
        (``None``: by fit); for a DTensor its local shard, maybe empty. The first one builds the engine."""
        loc = D.local(p)
        if self._device is None:
            tc_code = torch_cpu_code() if loc.device.type == "cpu" and self._engine_args["convention"] == "torch" else 0
            self._cores = D.worker_cores(self._worker_cores, loc.device)
            args = dict(self._engine_args)
            if args["threads"] is None:  # this rank's share of the host
                args["threads"] = _cores.default_threads(D.local_world()[1], self._cores)
            try:
                self._engine = Engine(TorchBackend(loc.device), mode=self.mode, device_elems=self._gpu_budget,
                                      gpu_state_bytes=self._gpu_state_bytes, gpu_state_later=self._auto_gpu_state,
                                      tc_code=tc_code, eager_blocks=self._eager_blocks, cores=self._cores, **args)
            except ImportError as exc:
                gs = " with gpu_state_bytes" if self._gpu_state_bytes or self._auto_gpu_state else ""
                raise ImportError(f"OffloadAdamW mode={self.mode!r}{gs} needs CuPy: pip install 'trainstream[cuda12]' "
                                  f"or 'trainstream[cuda13]' ({exc})") from exc
            self._owned.engine = self._engine
            self._device = loc.device
        # Through loc.data: the engine's own writes move no _version. hybrid: a frozen parameter takes no GPU share.
        with _cores.bound(self._cores):  # the host state's first touch: on the workers' cores
            sid = self._engine.add_param(loc.data.view(-1), loc.numel(), _DTYPE_NAME[p.dtype], loc.device.type,
                                         trainable=p.requires_grad, on_device=gpu)
        assert sid == len(self._params_of_slot)
        self._engine_param_ptr.append(loc.data_ptr())
        self._param_version.append(D.version(p))
        self._param_meta.append((loc.dtype, tuple(loc.shape), loc.device))
        self._slot_of[p] = sid
        self._params_of_slot.append(p)
        self._group_of.append(group)
        self._hook(sid)

    def _check_param(self, sid: int) -> None:
        """Follow a change of parameter ``sid`` made outside the optimizer: new values are re-read, a new storage
        of the same shape, dtype and device is written from now on; any other change raises, naming it."""
        p = self._params_of_slot[sid]
        loc, ver = D.local(p), D.version(p)
        if loc.data_ptr() == self._engine_param_ptr[sid]:
            if ver != self._param_version[sid]:
                self._engine.reload_param(sid)
        else:
            was, now = self._param_meta[sid], (loc.dtype, tuple(loc.shape), loc.device)
            if now != was or not loc.is_contiguous():
                what = ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(("dtype", "shape", "device"), was, now)
                                 if a != b) or "made non-contiguous"
                hint = " (float64 is not supported: float32, float16 or bfloat16)" if p.dtype not in _DTYPE_NAME else ""
                raise RuntimeError(f"OffloadAdamW: parameter {sid} (group {self._group_of[sid]}) was replaced after "
                                   f"the optimizer was built: {what}{hint} (model.double()/.half()/.to(), p.data = "
                                   "...). Build the optimizer after converting or moving the model.")
            self._engine.reload_param(sid, loc.data.view(-1))
            self._engine_param_ptr[sid] = loc.data_ptr()
        self._param_version[sid] = ver

    def _hook(self, sid: int, gpu: bool = False) -> None:
        """Give trainable slot ``sid`` its gradient hook (:meth:`_grad_ready`) once; ``gpu``: a GPU slot's (eager)."""
        p, hooks = self._params_of_slot[sid], (self._gpu_hooks if gpu else self._hooks)
        if self._engine.on_device(sid) != gpu or not p.requires_grad or sid in hooks:
            return
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            opt = ref()
            if opt is not None and not opt._closed and param.grad is not None:
                opt._grad_ready(sid, param)
        hooks[sid] = p.register_post_accumulate_grad_hook(hook)

    @staticmethod
    def _hp(group: dict[str, Any]) -> C.AdamWHyperParams:
        return C.validate_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _mark_pending(self, sids: Iterable[int]) -> None:
        """``overlap_forward``: the gated forward waits for these slots' updates."""
        if self._gated:
            with self._pending_lock:
                self._pending.update(sids)

    def _grad_ready(self, sid: int, p: torch.Tensor) -> None:
        """Slot ``sid``'s gradient hook: under ``last_micro_batch()`` (no clipping) take the gradient and start its
        update (behind its copy; a GPU slot's kernel behind backward), else copy a host slot's gradient for step()."""
        on_device, eager = self._engine.on_device(sid), self._eager and self.max_grad_norm is None
        if on_device and not eager:
            return  # a GPU slot's update runs at step()
        if D.local(p).data_ptr() != self._engine_param_ptr[sid]:
            self._check_param(sid)  # e.g. model.double(): a clear error, not the engine's
        if eager:
            self._staged.pop(sid, None)
            if sid in self._eager_done:
                raise RuntimeError(f"OffloadAdamW: a second backward inside last_micro_batch() before step() "
                                   f"(parameter {sid}); only the last micro-batch's backward belongs in that block")
            self._check_param(sid)  # an edited weight is re-read before the update
            self._eager_done.add(sid)
            hp = self._hp(self.param_groups[self._group_of[sid]])
            if on_device:
                self._engine.launch_eager([(sid, hp, *self._local_grad(sid, p, host=False))])
            else:
                self._engine.offload_grad(sid, *self._local_grad(sid, p), hp)
            self._mark_pending([sid])
            p.grad = None  # taken: the engine keeps it alive until read (an in-place change would race the update)
        elif self._hook_copies(p):  # else step() copies it
            grad = p.grad
            self._engine.offload_grad(sid, *self._local_grad(sid, p), None)
            self._staged[sid] = [weakref.ref(grad), D.version(grad), None]

    def _hook_copies(self, p: torch.Tensor) -> bool:
        """Whether the hook copies ``p.grad`` for ``step()``: not for a plain parameter with several processes (reduced
        later); for a DTensor if foreach ops move version counters or ``max_grad_norm`` (applied to the copy) is set."""
        if D.is_dtensor(p):
            return self.max_grad_norm is not None or D.foreach_moves_versions(p.device_mesh)
        return D.world()[1] == 1

    def _local_grad(self, sid: int, p: torch.Tensor, host: bool = True) -> tuple[torch.Tensor, str]:
        """``p.grad``'s local tensor, detached and contiguous (flat with ``host=False``: GPU slots), and its dtype's
        name; refuses a sparse gradient, one on another device than ``p``, for a host slot another dtype or shape."""
        grad, loc = D.local(p.grad), D.local(p)
        if grad.is_sparse:
            raise RuntimeError(f"OffloadAdamW does not support sparse gradients (parameter {sid})")
        if host and (grad.dtype != loc.dtype or grad.shape != loc.shape):
            raise TypeError(f"OffloadAdamW: gradient of parameter {sid} is {grad.dtype}{tuple(grad.shape)}, the "
                            f"parameter is {loc.dtype}{tuple(loc.shape)}" + (" (local shards)" if loc is not p else ""))
        if grad.device != loc.device:
            raise ValueError(f"OffloadAdamW: parameter {sid} is on {loc.device}, its gradient on {grad.device}")
        if grad.dtype not in _DTYPE_NAME:
            raise TypeError(f"OffloadAdamW: gradient of parameter {sid} has unsupported dtype {grad.dtype}")
        if not host:
            return grad.detach().contiguous().view(-1), _DTYPE_NAME[grad.dtype]
        # Only the torch calls needed: each releases and retakes the GIL, costly under busy workers.
        if grad.requires_grad:
            grad = grad.detach()
        if not grad.is_contiguous():
            grad = grad.contiguous()
        return grad, _DTYPE_NAME[grad.dtype]

    # -- the user API -----------------------------------------------------------------------

    def _check_open(self, what: str | None = None) -> None:
        """Refuse calls once closed, and checkpoint method ``what`` between a last_micro_batch() backward and step()."""
        if self._closed:
            raise RuntimeError("OffloadAdamW is closed")
        if what is not None and self._eager_done:
            raise RuntimeError(f"OffloadAdamW.{what}() between a last_micro_batch() backward and step(): "
                               f"{len(self._eager_done)} parameters are updated already; call step() first")

    @contextlib.contextmanager
    def last_micro_batch(self):
        """Mark the backward inside this block as the last micro-batch of the step.

        Each update then starts as soon as its gradient is ready, overlapping the rest of backward: on the host
        threads (``cpu`` mode, ``hybrid``'s host share) or by its kernel (``gpu`` mode; ``hybrid``'s GPU share with
        ``gpu_params="last"``, else at ``step()``). The gradients it updates from are taken (``param.grad`` is
        ``None`` after that backward, its GPU memory freed once copied or read), so nothing may change them: no
        ``clip_grad_norm_`` or ``GradScaler`` (``step()`` raises). Each update uses its group's ``lr`` as it is during
        backward. No effect with ``max_grad_norm`` (clipping needs every gradient). ``state_dict()`` and
        ``load_state_dict()`` raise until ``step()``. Not with several processes and plain (non-DTensor) parameters.
        With ``hybrid`` it is faster at ``worker_nice=19``; at the default 5 it can be slower than without."""
        self._check_open()
        if D.world()[1] > 1 and not all(D.is_dtensor(p) for p in self._params_of_slot):
            raise NotImplementedError("OffloadAdamW.last_micro_batch() with plain (non-DTensor) parameters in a "
                                      "run of several processes is not built: the updates would use this rank's "
                                      "unreduced gradients (before DDP's all-reduce). Leave it out (FSDP2 may use it).")
        if self.max_grad_norm is None and (self.mode == "gpu" or self._gpu_params == "last"):
            # GPU slots' eager hooks (hybrid with gpu_params="first": at step(), with the full grid: faster), new
            # parameters included. A hook firing proves its gradient complete (they stay in param.grad).
            for sid in range(len(self._params_of_slot)):
                self._hook(sid, gpu=True)
        self._eager = True
        try:
            yield self
        finally:
            self._eager = False

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter with a gradient, in group order (zero_stage=1: every rank's)."""
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _multiply(self, op, mult: dict[torch.dtype, float]) -> None:
        """Run ``op``, torch's in-place multiplication of ``param.grad``s; a staged copy equal to its gradient before
        gets the same multiplier ``mult[grad dtype]`` (the contract's ``c``; else, or on a second one: re-copied)."""
        valid = {sid: rec for sid, rec in self._staged.items() if self._fresh(self._params_of_slot[sid], rec)}
        op()
        for sid, rec in valid.items():
            grad = self._params_of_slot[sid].grad
            c = mult.get(grad.dtype)
            if c is not None and rec[2] is None:
                rec[1], rec[2] = D.version(grad), c

    @staticmethod
    def _fresh(p: torch.Tensor, rec: list, trusted: bool = False) -> bool:
        """Whether ``p.grad`` is the tensor the staged copy ``rec`` was taken of, at that version; with ``trusted``
        also, for a DTensor whose in-place foreach ops move no version counter, multiplied since by this one alone."""
        grad = p.grad
        if grad is None or rec[0]() is not grad or rec[1] != D.version(grad):
            return False
        return not trusted or rec[2] is not None or not D.is_dtensor(p) or D.foreach_moves_versions(p.device_mesh)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                       foreach: bool | None = None, *, parameters: Iterable[torch.Tensor] | None = None
                       ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(parameters, max_norm, ...)`` (the same norm, ``param.grad`` and bits after
        ``step()``); the host multiplies its gradient copies by the same coefficient instead of copying them again.
        Returns the total norm (a tensor); raises after a :meth:`last_micro_batch` backward. ``parameters``: default,
        this optimizer's in param-group order (as Lightning lists them); torch sums the norms in the order given, so
        pass ``model.parameters()`` for the bits of ``clip_grad_norm_(model.parameters(), ...)`` if groups reorder."""
        self._check_open()
        if self._eager_done:
            raise RuntimeError("OffloadAdamW.clip_grad_norm() after a last_micro_batch() backward: its gradients "
                               "were taken by their updates (use max_grad_norm=, which turns the eager path off)")
        params = self._grads() if parameters is None else [p for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite, foreach)
        if params:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s lines
            self._multiply(lambda: torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach),
                           {coef.dtype: float(D.local(coef))})
        self._last_norm = total
        return total

    def _amp(self) -> bool:
        """GradScaler's ``step(opt)`` set ``found_inf`` and ``grad_scale`` (None once the user unscaled in place):
        returns whether to skip the step, else unscales ``param.grad`` as ``GradScaler.unscale_`` does."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        if self._eager_done:
            raise RuntimeError("OffloadAdamW: GradScaler with last_micro_batch(): the updates used the scaled "
                               "gradients. Use one or the other; reload a checkpoint (load_state_dict) to continue.")
        if found_inf.item():
            return True  # skipped, as GradScaler skips torch.optim.AdamW's step
        scale = getattr(self, "grad_scale", None)
        if scale is None:  # unscaled in place by GradScaler.unscale_ (no _version change)
            self._staged.clear()
            return False
        inv = scale.double().reciprocal().float()
        by_kind: dict = {}
        for grad in (D.local(p.grad) for p in self._grads()):  # a DTensor's shard: the same bits, no dispatch
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)

        def unscale():
            for (dev, _), grads in by_kind.items():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1, device=dev), inv.to(dev))
        self._multiply(unscale, dict.fromkeys(_DTYPE_NAME, float(inv)))
        return False

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter whose ``grad`` is not ``None`` (the class docstring says when it is visible)."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._engine is None and self._zero is None:
            return loss
        if self._engine is not None:
            self._engine.check_error()
        if self._amp():
            return loss
        self._consolidated = None
        for sid in range(len(self._params_of_slot)):
            self._check_param(sid)
            self._hook(sid)  # a host slot unfrozen after construction
        if self.max_grad_norm is not None:
            self.clip_grad_norm(self.max_grad_norm)
        eager_done, self._eager_done = self._eager_done, set()
        staged, self._staged = self._staged, {}
        updates, coefs = [], {}
        for group in self.param_groups:
            hp = self._hp(group)
            for p in group["params"]:
                sid = self._slot_of.get(p)  # None: another rank's (zero_stage=1)
                if sid is None or p.grad is None or sid in eager_done:
                    continue  # no gradient: no update, as torch's
                if self._engine.on_device(sid):
                    updates.append((sid, hp, *self._local_grad(sid, p, host=False)))
                    continue
                rec = staged.get(sid)
                if rec is None or not self._fresh(p, rec, trusted=True):
                    self._engine.offload_grad(sid, *self._local_grad(sid, p), None)  # changed since, or set by hand
                elif rec[2] is not None:
                    coefs[sid] = rec[2]
                updates.append((sid, hp))
        self._mark_pending(u[0] for u in updates)  # first: if the engine raises part-way, what it queued is waited for
        if self._engine is not None:
            try:
                self._engine.step(updates, coefs=coefs)
            finally:
                if not self._gated:
                    self._engine.wait_step()  # every reader on the current stream sees the new weights
        if self._zero is not None:  # after the uploads (the current stream waits for them)
            # Every parameter from its owner (p.data: no version moves), all issued, then waited for (NCCL: on GPU).
            works = [torch.distributed.broadcast(p.data, src=self._zero.owner[p], async_op=True)
                     for g in self.param_groups for p in g["params"]]
            for work in works:
                work.wait()
        if self._auto_gpu_state and self._engine is not None and (updates or eager_done):
            self._place_auto()  # after a step that updated: torch's pool holds its peak
        return loss

    def _place_auto(self) -> None:
        """``gpu_state_bytes="auto"`` after the first step that updated (the class docstring says what moves)."""
        self._auto_gpu_state = False
        free, total = torch.cuda.mem_get_info(self._device)
        try:
            self._engine.move_state_to_gpu(max(0, int(free - AUTO_GPU_HEADROOM * total)))
        finally:  # also the slots moved before a failure: updated at step() from param.grad from now on
            self._gpu_state_bytes = self._engine.gpu_state_budget  # what parameters added later may take
            for sid in [sid for sid in self._hooks if self._engine.on_device(sid)]:
                self._hooks.pop(sid).remove()
                self._staged.pop(sid, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; the host copies of the gradients are forgotten too."""
        self._check_open()
        if self._gated and self._pending and not set_to_none:
            self.synchronize()  # the update may still read param.grad: zero it after
        super().zero_grad(set_to_none=set_to_none)
        self._staged.clear()
        if self._engine is not None:
            self._engine.discard_grads()

    def _module_slots(self, module: torch.nn.Module) -> list[int]:
        """The slots ``module``'s forward waits for: its own parameters' and those of descendants whose forward
        never runs (e.g. MultiheadAttention reads ``out_proj.weight`` without calling ``out_proj``)."""
        sids = self._wait_sets.get(module)
        if sids is None:
            sids, todo = [], [module]
            while todo:
                mod = todo.pop()
                sids.extend(self._slot_of[p] for p in mod._parameters.values() if p in self._slot_of)
                todo.extend(c for c in mod.children() if c not in self._called)
            self._wait_sets[module] = sids
        return sids

    def synchronize(self) -> None:
        """Wait for every queued update to land (needed only with ``overlap_forward``, to read weights elsewhere)."""
        self._check_open()
        if self._engine is not None:
            self._engine.synchronize()  # host-blocks on every upload: nothing left to wait for
            with self._pending_lock:
                self._pending.clear()

    def last_grad_norm(self) -> float | None:
        """The total gradient norm of the last :meth:`clip_grad_norm` (``max_grad_norm``)."""
        return None if self._last_norm is None else float(D.local(self._last_norm))

    def stats(self) -> dict[str, float]:
        """This rank's counters: bytes moved, host state bytes (``host_state_bytes``, of them ``pinned_state_bytes``),
        the host memory plan checked at construction (``host_plan_*``: see :meth:`host_memory_plan`), GPU state
        bytes (``gpu_state_bytes``, of ``gpu_state_params`` parameters; ``staging_ring_bytes``: ``gpu`` mode's ring),
        update and stall times, worker ``threads``, and where the rank sits: ``rank``, ``world_size``,
        ``local_rank``, ``local_world_size``, ``worker_cores`` (cores the workers are bound to; 0: unbound)."""
        self._check_open()
        where = dict(zip(("rank", "world_size", "local_rank", "local_world_size", "worker_cores"),
                         (*D.world(), *D.local_world(), len(self._cores or ()))))
        return {**({} if self._engine is None else self._engine.stats()),
                **{f"host_plan_{k}": v for k, v in self._host_plan.items()}, **{k: float(v) for k, v in where.items()}}

    # -- checkpoints ------------------------------------------------------------------------

    def _state_of(self, sid: int) -> dict[str, torch.Tensor]:
        """Slot ``sid``'s :meth:`state_dict` entry once its queued work has run (GPU-resident: copies), or ``{}``."""
        master, m, v, step = self._engine.state(sid, copy=False)
        if step == 0:
            return {}
        p = self._params_of_slot[sid]

        def view(a: np.ndarray) -> torch.Tensor:  # FSDP2: a DTensor laid out as the parameter
            t = torch.from_numpy(a).view(D.local(p).shape)
            return D.state_view(p, t) if D.is_dtensor(p) else t
        entry = {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": view(m), "exp_avg_sq": view(v)}
        if p.dtype != torch.float32:
            entry["master_param"] = view(master)
        return entry

    def state_dict(self) -> dict[str, Any]:
        """A ``torch.optim.AdamW``-compatible state dict whose tensors are views of the host state, as torch's are of
        its own (DTensors laid out as FSDP2's parameters). Per parameter: ``step`` (float32 scalar tensor), ``exp_avg``,
        ``exp_avg_sq`` (float32, the parameter's shape) and, for fp16/bf16 parameters, ``master_param`` (the fp32
        master: resuming is bit-exact). With ``zero_stage=1``: copies of the whole state gathered to this rank by the
        last :meth:`consolidate_state_dict` (a ``step()`` since discards them; ``RuntimeError`` without them)."""
        self._check_open("state_dict")
        if self._zero is None:
            return self._own_state_dict()
        if self._consolidated is None:
            raise RuntimeError("OffloadAdamW(zero_stage=1).state_dict(): each rank holds only its partition. Call "
                               "consolidate_state_dict(to=rank) on every rank first, then state_dict() on that rank "
                               "(with no step() between)")
        return self._consolidated

    def _own_state_dict(self) -> dict[str, Any]:
        """This rank's state (views), keyed by each parameter's index in the groups."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {index[p]: entry for sid, p in enumerate(self._params_of_slot) if (entry := self._state_of(sid))}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """``zero_stage=1``: gather every rank's partition of the state on rank ``to``, whose :meth:`state_dict` then
        returns all of it in ``torch.optim.AdamW``'s format (ZeroRedundancyOptimizer's protocol; Lightning calls it
        wherever it exists). A collective: every rank calls it. Otherwise a no-op."""
        self._check_open("consolidate_state_dict")
        if self._zero is None:
            return
        own = self._own_state_dict()
        rank, world = D.world()
        shares = [None] * world if rank == to else None
        torch.distributed.gather_object(own["state"], shares, dst=to)  # pickled: copies of the views
        self._consolidated = None
        if shares is not None:
            state = {i: entry for share in shares for i, entry in share.items()}
            self._consolidated = {"state": dict(sorted(state.items())), "param_groups": own["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``OffloadAdamW`` or ``torch.optim.AdamW`` (DTensor values included:
        torch.distributed.checkpoint passes it by keyword). Every entry is checked before anything changes
        (``ValueError``). With ``zero_stage=1`` every rank takes the whole dict and keeps its partition."""
        self._check_open("load_state_dict")
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer has "
                             f"{len(self.param_groups)}")
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"loaded state dict's parameter group {i} has {len(sg['params'])} parameters, "
                                 f"the optimizer's has {len(g['params'])}")
            _check_group({**self.defaults, **sg})
        id_map = {saved_id: p for g, sg in zip(self.param_groups, saved_groups)
                  for p, saved_id in zip(g["params"], sg["params"])}
        loads = {}  # slot -> (exp_avg, exp_avg_sq, step, master or None)
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in id_map:
                raise ValueError(f"loaded state dict has state for unknown parameter id {saved_id}")
            p = id_map[saved_id]
            if p not in self._slot_of:
                continue  # another rank's (zero_stage=1)
            if missing := [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in entry]:
                raise ValueError(f"loaded state for parameter {saved_id} lacks '{missing[0]}'")
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in entry and tuple(entry[key].shape) != tuple(p.shape):
                    raise ValueError(f"loaded state '{key}' of parameter {saved_id} has shape "
                                     f"{tuple(entry[key].shape)}, the parameter has {tuple(p.shape)}")
            step = float(entry["step"].item() if isinstance(entry["step"], torch.Tensor) else entry["step"])
            if not math.isfinite(step) or step < 0 or step != int(step):
                raise ValueError(f"loaded state of parameter {saved_id} has invalid step {step}")
            master = None
            if "master_param" in entry and p.dtype != torch.float32:
                saved = _local_value(entry["master_param"], p)
                # Kept only if it still rounds to the live weights: one through torch.optim.AdamW is stale.
                if torch.equal(saved.to(p.dtype), D.local(p).detach().to("cpu")):
                    master = saved.contiguous().view(-1).numpy()
                else:
                    warnings.warn(f"OffloadAdamW.load_state_dict: the saved fp32 master of parameter {saved_id} does "
                                  "not round to the current weights (trained further without it); re-read from the "
                                  "weights", RuntimeWarning, stacklevel=2)
            m, v = (_local_value(entry[k], p).contiguous().view(-1).numpy() for k in ("exp_avg", "exp_avg_sq"))
            loads[self._slot_of[p]] = (m, v, int(step), master)
        for sid in range(len(self._params_of_slot)):
            self._check_param(sid)  # a replaced storage first (the masters are checked against it)
        self._consolidated = None
        if self._engine is not None:
            self._engine.drain()
            for sid, p in enumerate(self._params_of_slot):  # no saved state: a fresh parameter, as in torch
                zeros = np.zeros(D.local(p).numel(), np.float32)
                self._engine.load_state(sid, *loads.get(sid, (zeros, zeros, 0, None)))
            self._engine.clear_error()  # every slot is consistent again
        self._param_version = [D.version(p) for p in self._params_of_slot]  # the masters follow them
        with self._pending_lock:
            self._pending.clear()
        self._eager_done.clear()
        for g, sg in zip(self.param_groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued work, stop the worker threads, free host memory, remove hooks."""
        if self._closed:
            return
        self._closed = True
        self._release()  # drains queued work; a worker failure was raised already
