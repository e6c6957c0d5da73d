"""``OffloadAdamW``: the ``torch.optim.Optimizer`` over the engine.

No arithmetic lives here: the update is the engine's (``trainstream.core``), whose
arithmetic is the contract's (``trainstream.contract``). This module speaks
``torch.optim.Optimizer``; buffers, streams and copies are :mod:`._backend`'s.
"""

from __future__ import annotations

import contextlib
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
from ._backend import _DTYPE_NAME, TorchBackend, torch_cpu_code

__all__ = ["OffloadAdamW"]


_HINT = ("fewer parameters' state per process (FSDP2, or zero_stage=1 under DDP: each rank holds its share), "
         "mode='gpu' or 'hybrid' (no staging for the GPU share: 12 instead of 14 bytes per bf16 parameter, "
         "8 instead of 16 per float32 one)")
#: Plan entries added up over the parameter groups (the others are the last check's).
_SUMMED = {*(f"{p}_{k}" for p in _budget.PARTS for k in ("pinned", "pageable")), "pinned", "pageable", "needed"}


def _resident(flat, budget: int, used: int = 0) -> list[bool]:
    """The engine's resident rule (:func:`trainstream.core._budget.resident`) on parameters."""
    return _budget.resident([(D.local(p).numel(), _DTYPE_NAME.get(p.dtype, "float32"), p.requires_grad)
                             for p in flat], budget, used)


def _hybrid_elems(flat, share: float, resident_bytes: int) -> int:
    """hybrid's budget of device elements: ``share`` of the trainable elements whose state is
    not resident in GPU memory."""
    res = _resident(flat, resident_bytes)
    return round(share * sum(D.local(p).numel() for p, r in zip(flat, res) if p.requires_grad and not r))


def _host_plan(flat, mode: str, budget: int, last: bool, used: int, pin_moments: bool, margin, device=None,
               resident_bytes: int = 0, resident_used: int = 0):
    """The host-memory plan of registering ``flat`` (:func:`trainstream.core._budget.plan`) and
    hybrid's split: the parameters whose state is resident in GPU memory first (they take
    no host memory), then of the rest by fit in what ``used`` leaves of ``budget``, from the
    last parameter backwards with ``last``. Parameters that registration will refuse are
    left out."""
    res = _resident(flat, resident_bytes, resident_used)
    order = [i for i in (range(len(flat) - 1, -1, -1) if last else range(len(flat))) if not res[i]]
    dev = _budget.place([(D.local(flat[i]).numel(), flat[i].requires_grad, None) for i in order], mode, budget, used)
    on_gpu = [False] * len(flat)
    for i, d in zip(order, dev):
        on_gpu[i] = d
    device = device or next((D.local(p).device for p in flat), None)
    cuda = device is not None and device.type == "cuda"
    slots = [(D.local(p).numel(), _DTYPE_NAME[p.dtype], "device" if g else "host")
             for p, g, r in zip(flat, on_gpu, res) if p.dtype in _DTYPE_NAME and not r]
    plan = _budget.plan(slots, margin=margin, pin_moments=pin_moments, can_pin=cuda,
                        weights_in_grad_stage=TorchBackend.weights_in_grad_stage,
                        pinned_size=TorchBackend.pinned_size if cuda else None)
    return plan, on_gpu


def _check_placement(mode: str, gpu_share, gpu_params: str, gpu_state_bytes) -> None:
    """Refuse the placement arguments :class:`OffloadAdamW` (and its ``host_memory_plan``)
    do not take."""
    if mode not in ("cpu", "gpu", "hybrid"):
        raise ValueError(f"OffloadAdamW mode must be 'cpu', 'gpu' or 'hybrid', got {mode!r}")
    if isinstance(gpu_share, bool) or not isinstance(gpu_share, numbers.Real) or not 0.0 <= gpu_share <= 1.0:
        raise ValueError(f"Invalid gpu_share: {gpu_share!r} (must be a fraction in [0, 1])")
    if isinstance(gpu_state_bytes, str) and gpu_state_bytes == "auto":
        raise NotImplementedError(
            "OffloadAdamW(gpu_state_bytes='auto') is not built: the GPU memory free after the first step "
            "is known only once the state of every parameter has been placed, and moving state between "
            "placements is not built. Pass a number of bytes (e.g. what torch.cuda.mem_get_info() shows "
            "free after a step, less some headroom)")
    if isinstance(gpu_state_bytes, bool) or not isinstance(gpu_state_bytes, numbers.Integral) or gpu_state_bytes < 0:
        raise ValueError(f"Invalid gpu_state_bytes: {gpu_state_bytes!r} (must be an int >= 0, in bytes)")
    if gpu_params not in ("first", "last"):
        raise ValueError(f"Invalid gpu_params: {gpu_params!r} (must be 'first' or 'last')")
    if gpu_params != "first" and mode != "hybrid":
        raise ValueError(f"gpu_params={gpu_params!r} applies to mode='hybrid' only (mode={mode!r})")


class _Owned:
    """What one :class:`OffloadAdamW` releases, once: its hooks and its engine."""

    def __init__(self, *hook_dicts: dict):
        self.hook_dicts = hook_dicts
        self.handles: list[Any] = []
        self.engine: Engine | None = None

    def release(self) -> None:
        for d in self.hook_dicts:
            for h in d.values():
                h.remove()
            d.clear()
        for h in self.handles:
            h.remove()
        if self.engine is not None:
            self.engine.close()


def _local_value(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a loaded state tensor ``t`` of parameter ``p``: for a DTensor
    parameter the local tensor of a DTensor ``t`` (what torch.distributed.checkpoint's
    ``set_optimizer_state_dict`` passes, also of a full state dict)."""
    if D.is_dtensor(p) and not D.is_dtensor(t):
        raise ValueError(
            "OffloadAdamW.load_state_dict: the state of a DTensor (FSDP2) parameter must be a DTensor laid out "
            "as the parameter (torch.distributed.checkpoint's set_optimizer_state_dict gives that, also from "
            f"a full state dict); got a {type(t).__name__} of shape {tuple(t.shape)}")
    return D.local(t.detach())


_GROUP_FLAGS = dict(
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
)


def _check_group(group: dict[str, Any]) -> None:
    """Refuse what OffloadAdamW does not implement, before any state changes."""
    for flag in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
        if group.get(flag):
            raise NotImplementedError(f"OffloadAdamW does not implement {flag}=True")
    if not group.get("decoupled_weight_decay", True):
        raise NotImplementedError("OffloadAdamW implements decoupled weight decay only")
    C.validate_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])


class _State(Mapping):
    """``OffloadAdamW.state``: per parameter that has been updated, its state as
    ``torch.optim.AdamW`` keeps it (``step``, ``exp_avg``, ``exp_avg_sq``; fp16/bf16 also
    ``master_param``), as views of the optimizer's host buffers, read once the parameter's
    queued update has run. A parameter without state gives ``{}``. Each lookup builds a
    new dict: assigning into it changes nothing (Lightning's ``_optimizer_to_device``
    then only makes passing copies); change the tensors in place, or ``load_state_dict``.
    """

    def __init__(self, opt: "OffloadAdamW"):
        self._opt = weakref.ref(opt)  # no cycle: the optimizer stays collectable

    def _slots(self) -> list[int]:
        opt = self._opt()
        if opt is None or opt._closed or opt._engine is None:
            return []
        return [sid for sid in range(len(opt._params_of_slot)) if opt._engine.get_step(sid) > 0]

    def __getitem__(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        opt = self._opt()
        sid = None if opt is None or opt._closed else opt._slot_of.get(param)
        if sid is None:
            raise KeyError(param)
        return opt._state_of(sid)

    def __iter__(self):
        opt = self._opt()
        return iter([opt._params_of_slot[sid] for sid in self._slots()])

    def __len__(self) -> int:
        return len(self._slots())

    def __contains__(self, param: object) -> bool:
        opt = self._opt()
        sid = None if opt is None else opt._slot_of.get(param)  # type: ignore[call-overload]
        return sid is not None and not opt._closed and opt._engine.get_step(sid) > 0


class OffloadAdamW(Optimizer):
    r"""AdamW with its state in host memory, bit-identical to ``torch.optim.AdamW``.

    A drop-in replacement: the same arguments, param groups, LR schedulers,
    ``zero_grad``, ``step(closure)``, ``state`` and ``state_dict`` (state keys ``step``,
    ``exp_avg``, ``exp_avg_sq``, so checkpoints move to and from ``torch.optim.AdamW``).
    The fp32 master weights (for fp16/bf16 parameters) and both moments live in host
    memory (of the share that ``gpu_state_bytes`` keeps there: in GPU memory). In the loop
    a user already has, it changes memory and speed, nothing else:

    * Gradients stay where autograd puts them (``param.grad``, summed over micro-batches in
      the parameter's dtype, as with ``torch.optim.AdamW``). As backward produces each
      one, a post-accumulate-grad hook copies it to pinned host memory asynchronously;
      ``step()`` uses that copy, or copies ``param.grad`` again where it changed since
      (``clip_grad_norm_``, ``GradScaler``, an edit by hand), and skips parameters whose
      ``grad`` is ``None`` (``module.zero_grad()``). Clipping (``max_grad_norm``,
      :meth:`clip_grad_norm`) and ``GradScaler``'s unscaling are torch's own operations on
      ``param.grad``; the host applies the same multiplier to its copy, bit for bit.
    * The weights are current whenever user code can see them: ``step()`` returns once the
      host update has run, and with CUDA parameters makes the current stream wait, on the
      GPU, for the uploads of the new weights (the host does not wait for the transfers).
      No ``synchronize()`` needed.
    * Weights changed outside the optimizer (an in-place edit, ``model.load_state_dict``,
      ``p.data = ...`` of the same shape, dtype and device) are what it updates next: a
      changed ``param._version`` or storage is re-read into the host copy (fp16/bf16: an
      element keeps its fp32 master where that still rounds to the weight). A change
      through ``p.data.mul_(...)`` does not advance ``_version``: it is not seen.

    Two opt-ins trade a rule above for speed:

    * ``with opt.last_micro_batch(): loss.backward()`` (the *eager* path) starts each
      update from its gradient hook during backward and takes the gradient (``param.grad``
      is ``None`` after it: GPU memory is freed at once, but ``clip_grad_norm_`` and
      ``GradScaler`` find nothing to act on);
    * ``overlap_forward=model`` lets the next forward of ``model`` start before the
      update has finished: each of its modules waits for its own weights (forward
      pre-hooks, outside Dynamo's graphs); reads of the weights outside that forward
      (``state_dict``, an EMA) then need :meth:`synchronize`.

    Several processes (``torch.distributed``), each rank offloading only what it updates:

    * FSDP2 (``fully_shard``): build it on the sharded model's parameters (DTensors, kept
      in ``param_groups``); each rank registers its local shard (uneven or empty shards
      included). FSDP2 runs the gradient hooks itself, after its reduce-scatter, on the
      sharded gradient. Clipping is torch's norm of the DTensor gradients, a collective
      every rank joins. In-place foreach ops on DTensor gradients (a user's
      ``clip_grad_norm_``) move no version counter in torch 2.13, so a DTensor gradient is
      copied again at ``step()`` unless this optimizer's own clipping (``max_grad_norm``,
      :meth:`clip_grad_norm`) or unscaling made the only change since its hook: with
      ``max_grad_norm`` the hook's copies serve, otherwise the hook copies nothing and
      ``step()`` copies each shard's gradient. ``state`` and ``state_dict()`` hold
      DTensor views (the parameter's mesh and placements) of the host state:
      torch.distributed.checkpoint saves and loads them under the original FQNs, in both
      directions with ``torch.optim.AdamW``. HSDP meshes and ``MixedPrecisionPolicy``
      (whose sharded parameters stay fp32) need nothing more. Not with FSDP2's
      ``CPUOffloadPolicy`` (one or the other) or ``overlap_forward``.
    * DistributedDataParallel, or any reduction of the gradients after backward (by hand,
      e.g. an all-reduce of ``param.grad``): in a run of several processes the gradients
      of plain (non-DTensor) parameters are taken at ``step()``, after that reduction,
      never by the hook (which would see this rank's unreduced gradient). Each rank
      updates every parameter (as ``torch.optim.AdamW`` under DDP does), or with
      ``zero_stage=1`` only its partition. Not with :meth:`last_micro_batch`.

    Args:
      params: parameters or param groups, as for ``torch.optim.AdamW``; float32,
        float16 or bfloat16, contiguous, dense, all on one device (CUDA, or CPU).
      lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
      max_grad_norm: if set, ``step()`` first clips the gradients of these parameters by
        their global norm: :meth:`clip_grad_norm` (``clip_grad_norm_`` over the parameters
        in param-group order, the same bits), without copying the gradients to the host
        again.
      mode: ``"cpu"`` (update on host threads), ``"gpu"`` (a GPU kernel; the copy engines
        stream the host-memory state through a 72 MiB ring of GPU buffers,
        ``stats()["staging_ring_bytes"]``) or ``"hybrid"`` (both at once: up to
        ``gpu_share`` of the trainable elements by the GPU kernel, reading their state over
        PCIe, the rest by the host threads; the state of all of them in host memory; CUDA
        parameters). Each parameter gets the bits of the mode that
        updates it (both are ``torch.optim.AdamW``'s on CUDA).
      overlap_forward: a module (the model) whose next forward may overlap the update:
        see above. Default ``None``: ``step()`` makes the weights current for every reader.
      gpu_state_bytes: a budget of GPU memory, in bytes, for optimizer state kept there
        (any mode; CUDA parameters): the trainable parameters whose state (8 bytes per
        element, 12 for fp16/bf16: the moments and the master) fits in what is left of
        it, taken in order (also those of a later ``add_param_group``), keep it in GPU
        memory and are updated there by the zero-copy kernel's arithmetic, with no PCIe
        traffic (the same bits); the rest as ``mode`` says. Their updates run at
        ``step()`` (under :meth:`last_micro_batch` from their gradient hooks in ``gpu``
        mode, and in ``hybrid`` mode with ``gpu_params="last"``). ``state`` and
        ``state_dict()`` hold host copies of their state; ``load_state_dict`` copies it
        back. The memory is allocated outside torch's caching allocator (``stats()``:
        ``gpu_state_bytes``), at construction, and freed by :meth:`close`. Default 0:
        no state in GPU memory. ``"auto"`` (what is free after the first step) is not
        built: the first step would have to move state between placements; nor is it for
        FSDP2's DTensor parameters (refused: not through its GPU tests yet).
      gpu_share: ``hybrid`` mode: the fraction of the trainable elements (of the
        parameters given here) whose state is not kept in GPU memory
        (``gpu_state_bytes``) updated by the zero-copy kernel. Parameters are taken in
        the order ``gpu_params`` says; each goes to the kernel if it fits in what is left
        of the share (also one added later with ``add_param_group``), else to the host. The
        default, 0.3, was the fastest or near it for GPT-style models of 125M-1.3B
        parameters on an H200 with a 16-core host (0.2 at 1.3B; see
        ``experiments/RESULTS.md``); the best value depends on the host's memory
        bandwidth against the PCIe link's.
      gpu_params: ``hybrid`` mode: which parameters make up the GPU share. ``"first"``
        (default): from the first in order on, the ones the next forward usually needs
        first, updated at ``step()`` while the host threads take the rest. ``"last"``:
        from the last one backwards, whose gradients backward usually produces first;
        with :meth:`last_micro_batch` their kernels then run during the rest of backward
        and the host share's update starts when its gradients arrive.
      threads: host worker threads. Default: this process's share of the host's cores
        (its CPU affinity divided by the local world size, torchrun's ``LOCAL_WORLD_SIZE``,
        else the world size of torch.distributed when initialised), less one; at least 1.
        With ``worker_cores``: its cores less one.
      worker_cores: bind the host workers (and the first touch of the host state) to
        cores: ``None`` (default, unbound), ``"auto"`` (this local rank's disjoint slice of
        the cores: of the cores of its GPU's NUMA node where ``/sys`` tells it and each
        local rank r drives GPU r, else of this process's cores in rank order) or a list
        of CPU ids. Linux; elsewhere ignored.
      zero_stage: ``0`` (default) or ``1``: ZeRO stage 1 over the default process group
        (plain parameters replicated on every rank, e.g. under DDP): each rank holds the
        state of, and updates, only its partition (ZeroRedundancyOptimizer's: per group,
        largest parameters first, each to the least loaded rank), then every owner
        broadcasts its new weights (a collective in ``step()``). ``state_dict()`` follows
        ZeroRedundancyOptimizer's protocol: :meth:`consolidate_state_dict` on every rank,
        then ``state_dict()`` on the receiving rank, in ``torch.optim.AdamW``'s format;
        ``load_state_dict`` takes such a dict on every rank.
      chunk_size: elements per work item of the worker pool.
      worker_nice: the host workers' nice value (``cpu`` and ``hybrid`` modes; Linux
        applies it per thread). The default, 5, lets them yield the CPU to the threads
        that drive the GPU. With ``mode="hybrid"`` and :meth:`last_micro_batch`, 19 is
        faster (measured on the H200 machine, 350M GPT: 103-120 ms per step back to back,
        0.62x torchao, against 161 ms at nice 5); for the other paths 19 measured no
        different, and it would starve the workers beside a busy data loader at nice 0.
      eager_blocks: ``gpu`` mode and ``hybrid``'s GPU share under
        :meth:`last_micro_batch`: the grid cap, in blocks, of the zero-copy kernels
        launched from gradient hooks during backward (the bits do not depend on it).
        ``None`` (default): a quarter of the GPU's multiprocessor count, which leaves
        backward most of the GPU (measured on the H200, 350M GPT: 131 ms per step with
        16-33 blocks against 156 ms with the full grid).
      pin_moments: keep ``exp_avg``/``exp_avg_sq`` page-locked (``cpu`` mode), where all
        pinned memory stays within half of the available host memory (else pageable:
        ``stats()["host_plan_pin_moments"]`` says which).
      host_margin: before allocating anything, the host memory the state, masters and
        staging will take (:meth:`host_memory_plan`) is checked against what the host has
        less this fraction of it: ``MemoryError`` naming the bytes where it does not fit.
        None: no check.
      convention: ``"torch"`` (default) or ``"optax"``; see ``trainstream.contract``.
    """

    # GradScaler hands step() its scale and inf flag instead of unscaling the gradients
    # itself (the protocol of torch's fused optimizers): see _amp().
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        mode: str = "cpu",
        overlap_forward: torch.nn.Module | None = None,
        threads: int | None = None,
        worker_cores: Any = None,
        zero_stage: int = 0,
        chunk_size: int = 1 << 20,
        worker_nice: int = 5,
        eager_blocks: int | None = None,
        gpu_state_bytes: int = 0,
        gpu_share: float = 0.3,
        gpu_params: str = "first",
        pin_moments: bool = False,
        host_margin: float | None = _budget.MARGIN,
        convention: str = "torch",
        amsgrad: bool = False,
        maximize: bool = False,
    ):
        if isinstance(lr, torch.Tensor):
            raise TypeError("OffloadAdamW: a Tensor lr is not supported; pass a float")
        C.validate_hyperparams(lr, betas, eps, weight_decay)
        if amsgrad:
            raise NotImplementedError("OffloadAdamW does not implement amsgrad")
        if maximize:
            raise NotImplementedError("OffloadAdamW does not implement maximize")
        if max_grad_norm is not None and not (max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be > 0 or None)")
        if overlap_forward is not None and not isinstance(overlap_forward, torch.nn.Module):
            raise TypeError(f"overlap_forward must be a torch.nn.Module or None, got {type(overlap_forward).__name__}")
        _check_placement(mode, gpu_share, gpu_params, gpu_state_bytes)
        self._gpu_share = float(gpu_share)
        self._gpu_budget = 0
        self._gpu_state_bytes = int(gpu_state_bytes)
        self._gpu_params = gpu_params
        # Registration waits until torch has read every group (add_param_group only checks
        # them): the host memory is checked over all of them, and hybrid's split needs the
        # total of the elements.
        self._deferred = True
        self._host_margin = host_margin
        self._host_plan: dict[str, float] = {}
        _budget.plan([], margin=host_margin)  # a bad margin raises here
        if isinstance(worker_nice, bool) or not isinstance(worker_nice, int):
            raise ValueError(f"Invalid worker_nice: {worker_nice!r} (must be an int)")
        if eager_blocks is not None and (isinstance(eager_blocks, bool) or not isinstance(eager_blocks, int)
                                         or eager_blocks < 1):
            raise ValueError(f"Invalid eager_blocks: {eager_blocks!r} (must be an int >= 1 or None)")
        if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
            raise ValueError(f"Invalid zero_stage: {zero_stage!r} (0, or 1 for ZeRO stage 1)")
        self._rank, world = D.world()
        self._zero = None  # zero_stage=1: which rank owns (holds the state of) each parameter
        if zero_stage:
            dist = torch.distributed
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("OffloadAdamW(zero_stage=1) partitions the parameters between the ranks of "
                                 "torch.distributed's default process group: initialise it first")
            if overlap_forward is not None:
                raise NotImplementedError("OffloadAdamW: overlap_forward with zero_stage=1 is not built (each "
                                          "owner broadcasts its new weights in step(), after their uploads)")
            self._zero = D.ZeroPartition(world)
        self._consolidated: dict[str, Any] | None = None  # zero_stage=1: consolidate_state_dict()'s
        self._worker_cores = worker_cores
        self._cores: list[int] | None = None  # resolved with the first parameter's device
        if worker_cores is not None:
            D.worker_cores(worker_cores, torch.device("cpu"))  # a bad value raises here, not at the first parameter
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.mode = mode
        self._engine: Engine | None = None
        self._engine_args = dict(
            threads=threads, chunk_elems=chunk_size, convention=convention, pin_moments=pin_moments,
            worker_nice=worker_nice,
        )
        self._slot_of: dict[torch.Tensor, int] = {}
        self._params_of_slot: list[torch.Tensor] = []
        self._group_of: list[int] = []  # slot -> index of its param group
        # Per slot, what the engine last saw of its parameter: the storage it writes, the
        # parameter's _version then (the engine's own writes leave it alone), and
        # (dtype, shape, device); a change of either means the weights changed outside.
        self._engine_param_ptr: list[int] = []
        self._param_version: list[int] = []
        self._param_meta: list[tuple] = []
        # Host slots: the gradient its hook copied, as [weakref to the tensor, its _version,
        # the multiplier torch applied to it since (None: none)]. step() uses the copy only
        # while param.grad is still that tensor at that version.
        self._staged: dict[int, list] = {}
        self._last_norm: torch.Tensor | None = None
        self._hooks: dict[int, Any] = {}  # host-engine slot -> its gradient hook's handle
        # GPU-engine slots (gpu mode; hybrid's GPU share with gpu_params="last"): one hook
        # each, registered by the first last_micro_batch(), launching the slot's kernel as
        # its gradient is ready.
        self._gpu_hooks: dict[int, Any] = {}
        self._eager_blocks = eager_blocks
        self._eager_done: set[int] = set()  # slots updated eagerly since the last step()
        self._eager = False
        # overlap_forward: slots whose update the gated forward has not waited for yet;
        # modules seen running forward, and per module the slots its forward waits for:
        # its own parameters and those of descendants whose forward never runs (e.g.
        # MultiheadAttention reads out_proj.weight without calling out_proj).
        self._gated = overlap_forward is not None
        self._pending: set[int] = set()
        self._pending_lock = threading.Lock()
        self._called: weakref.WeakSet = weakref.WeakSet()
        self._wait_sets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._device: torch.device | None = None
        self._closed = False
        # Released once, by close() or when this optimizer itself is collected: never by a
        # wrapper that copies its attributes (Lightning's LightningOptimizer).
        self._owned = _Owned(self._hooks, self._gpu_hooks)
        self._release = weakref.finalize(self, self._owned.release)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **_GROUP_FLAGS)
        super().__init__(params, defaults)
        self.state = _State(self)  # type: ignore[assignment]  # the engine's, per parameter
        self._deferred = False
        mine = [(p, gi) for gi, g in enumerate(self.param_groups) for p in g["params"] if self._mine(p)]
        flat = [p for p, _ in mine]
        if mode == "hybrid":
            self._gpu_budget = _hybrid_elems(flat, self._gpu_share, self._gpu_state_bytes)
        on_gpu = self._reserve(flat, last=self._gpu_params == "last")  # raises before anything is allocated
        try:
            for (p, gi), gpu in zip(mine, on_gpu):
                self._register(p, gpu)
                self._group_of.append(gi)
        except BaseException:
            if self._engine is not None:
                self._engine.close()
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
            if opt._pending:
                opt._wait_module(module)

        for m in model.modules():
            self._owned.handles.append(m.register_forward_pre_hook(pre_hook))

    # -- parameters -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        n_groups, n_slots = len(self.param_groups), len(self._params_of_slot)
        super().add_param_group(param_group)
        listed = self.param_groups[-1]["params"]
        if len({id(p) for p in listed}) != len(listed):
            del self.param_groups[n_groups:]
            raise ValueError(
                f"OffloadAdamW: parameter group {n_groups} lists a parameter more than once "
                "(torch.optim.AdamW would update it once per listing, and warns that this will "
                "become an error); list each parameter once"
            )
        sizes = None if self._zero is None else list(self._zero.sizes)
        host_plan, pin = self._host_plan, self._engine_args["pin_moments"]  # as _reserve found them
        try:
            _check_group(self.param_groups[-1])
            if self._zero is not None:
                if any(D.is_dtensor(p) for p in listed):
                    raise ValueError("OffloadAdamW: zero_stage=1 is for replicated parameters (DDP); FSDP2's "
                                     "DTensor parameters are sharded already: use zero_stage=0")
                self._zero.add_group(listed)
            if self._deferred:  # inside __init__: registered once every group is known
                return
            mine = [p for p in listed if self._mine(p)]
            for p, gpu in zip(mine, self._reserve(mine)):
                self._register(p, gpu)
                self._group_of.append(len(self.param_groups) - 1)
        except BaseException:
            # Leave the optimizer exactly as it was.
            del self.param_groups[n_groups:]
            if sizes is not None:
                self._zero.sizes[:] = sizes
                for p in listed:
                    self._zero.owner.pop(p, None)
            for p in self._params_of_slot[n_slots:]:
                self._slot_of.pop(p, None)
            for lst in (self._params_of_slot, self._group_of, self._engine_param_ptr,
                        self._param_version, self._param_meta):
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
        """Check the host memory that registering ``flat`` takes (:func:`_host_plan`) before
        anything is allocated, fall back to pageable moments where pinned ones would not
        fit, keep the plan for :meth:`stats`; returns hybrid's split (per parameter: on the GPU).
        Each parameter is checked first (:meth:`_check_new`): one that registration would
        refuse raises its own error, not a plan's."""
        n = len(self._params_of_slot)
        for i, p in enumerate(flat):
            self._check_new(p, n + i, self._device or D.local(flat[0]).device)
        host = self._engine.host if self._engine is not None else None
        pin = host.pin_moments if host is not None else self._engine_args["pin_moments"]
        used = self._engine.device_elems_used if self._engine is not None else 0
        res_used = self._engine.resident_bytes_used if self._engine is not None else 0
        plan, on_gpu = _host_plan(flat, self.mode, self._gpu_budget, last, used, pin, self._host_margin, self._device,
                                  self._gpu_state_bytes, res_used)
        _budget.check(plan, _HINT + (", pin_moments=False (torch rounds each pinned buffer up to a power of two)"
                                     if plan["pin_moments"] else ""))
        if pin and not plan["pin_moments"]:  # pinned moments would not fit: pageable from here on
            self._engine_args["pin_moments"] = False
            if host is not None:
                host.pin_moments = False
        old = self._host_plan
        self._host_plan = {k: v + old.get(k, 0.0) if k in _SUMMED else v for k, v in plan.items()}
        return on_gpu

    @staticmethod
    def host_memory_plan(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *, mode: str = "cpu",
                         gpu_share: float = 0.3, gpu_params: str = "first", gpu_state_bytes: int = 0,
                         pin_moments: bool = False, host_margin: float | None = _budget.MARGIN) -> dict[str, float]:
        """The host memory ``OffloadAdamW(params, ...)`` with these arguments will take, and
        what the host has, without allocating anything: bytes per part (``state_pinned``,
        ``state_pageable``, ``masters_*``, ``staging_*``), ``pinned``, ``pageable``,
        ``needed``, ``available``, ``usable``, ``pin_moments`` and ``fits`` (see
        :func:`trainstream.core._budget.plan`). After construction the same figures are in
        :meth:`stats` as ``host_plan_*``."""
        _check_placement(mode, gpu_share, gpu_params, gpu_state_bytes)
        groups = list(params)
        flat = [p for g in groups for p in ([g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])] \
            if groups and isinstance(groups[0], dict) else groups
        budget = _hybrid_elems(flat, gpu_share, gpu_state_bytes) if mode == "hybrid" else 0
        return _host_plan(flat, mode, budget, gpu_params == "last", 0, pin_moments, host_margin,
                          resident_bytes=gpu_state_bytes)[0]

    def _mine(self, p: torch.Tensor) -> bool:
        """Whether this rank holds ``p``'s state and updates it (all but zero_stage=1's
        parameters of other ranks)."""
        return self._zero is None or self._zero.owner[p] == self._rank

    @staticmethod
    def _meta(p: torch.Tensor) -> tuple:
        loc = D.local(p)
        return loc.dtype, tuple(loc.shape), loc.device

    def _check_new(self, p: torch.Tensor, index: int, device: torch.device) -> None:
        """Refuse parameter ``p`` (slot ``index``) where registering it would fail, before
        anything is planned or allocated: its dtype, layout, FSDP2 setup, a device other
        than ``device`` (that of the parameters before it), a CPU parameter where ``mode``
        or ``gpu_state_bytes`` needs CUDA ones."""
        loc = D.local(p)
        if p.dtype not in _DTYPE_NAME:
            raise TypeError(
                "OffloadAdamW supports float32, float16 and bfloat16 parameters; parameter "
                f"{index} has dtype {p.dtype}"
            )
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"OffloadAdamW: parameter {index} is not a dense strided tensor")
        if not loc.is_contiguous():
            raise ValueError(
                f"OffloadAdamW: parameter {index} is not contiguous; make it contiguous "
                "before building the optimizer"
            )
        if loc.device.type not in ("cuda", "cpu"):
            raise ValueError(f"OffloadAdamW: parameter {index} is on unsupported device {loc.device}")
        if loc is not p:
            self._check_dtensor(p, index)
        if self.mode != "cpu" and loc.device.type != "cuda":
            raise ValueError(
                f"OffloadAdamW mode={self.mode!r} needs CUDA parameters; parameter {index} is on {loc.device}"
            )
        if self._gpu_state_bytes and loc.device.type != "cuda":
            raise ValueError(
                f"OffloadAdamW gpu_state_bytes={self._gpu_state_bytes} keeps state in GPU memory and needs "
                f"CUDA parameters; parameter {index} is on {loc.device}")
        if loc.device != device:
            raise ValueError(
                f"OffloadAdamW: all parameters must be on one device; parameter {index} is on "
                f"{loc.device}, earlier ones on {device}"
            )

    def _register(self, p: torch.Tensor, gpu: bool | None = None) -> None:
        """Give ``p`` (checked by :meth:`_check_new`) a slot (hybrid: on the GPU engine if
        ``gpu``; ``None``: by fit). For a DTensor (FSDP2) the slot is its local shard, which
        may have 0 elements."""
        index = len(self._params_of_slot)
        loc = D.local(p)
        if self._device is None:
            tc_code = 0
            if loc.device.type == "cpu" and self._engine_args["convention"] == "torch":
                tc_code = torch_cpu_code()
            self._cores = D.worker_cores(self._worker_cores, loc.device)
            args = dict(self._engine_args)
            if args["threads"] is None:  # this rank's share of the host
                args["threads"] = _cores.default_threads(D.local_world()[1], self._cores)
            try:
                self._engine = Engine(TorchBackend(loc.device), placement=self.mode, device_elems=self._gpu_budget,
                                      resident_bytes=self._gpu_state_bytes, tc_code=tc_code,
                                      eager_blocks=self._eager_blocks, cores=self._cores, **args)
            except ImportError as exc:
                raise ImportError(
                    f"OffloadAdamW mode={self.mode!r}{' with gpu_state_bytes' if self._gpu_state_bytes else ''} "
                    "needs CuPy: pip install 'trainstream[cuda12]' or "
                    f"'trainstream[cuda13]' ({exc})"
                ) from exc
            self._owned.engine = self._engine
            self._device = loc.device
        platform = "cuda" if loc.device.type == "cuda" else "cpu"
        # The engine writes through loc.data: its own writes advance no _version.
        # hybrid: a frozen parameter takes none of the GPU share.
        with _cores.bound(self._cores):  # the host state's first touch: on the workers' cores
            sid = self._engine.add_param(loc.data.view(-1), loc.numel(), _DTYPE_NAME[p.dtype], platform,
                                         trainable=p.requires_grad, on_device=gpu)
        assert sid == index
        self._engine_param_ptr.append(loc.data_ptr())
        self._param_version.append(D.version(p))
        self._param_meta.append(self._meta(p))
        self._slot_of[p] = sid
        self._params_of_slot.append(p)
        self._hook_if_trainable(sid)

    def _check_dtensor(self, p: torch.Tensor, index: int) -> None:
        """What OffloadAdamW does not take of an FSDP2 (DTensor) parameter."""
        if p.device_mesh.device_type != D.local(p).device.type:
            raise ValueError(
                f"OffloadAdamW: parameter {index} is a DTensor on a {p.device_mesh.device_type} mesh whose "
                f"shard lives on {D.local(p).device.type} (FSDP2's CPUOffloadPolicy?): use either "
                "CPUOffloadPolicy or OffloadAdamW, not both")
        if self._gpu_state_bytes:
            raise NotImplementedError(
                "OffloadAdamW: gpu_state_bytes with FSDP2 (DTensor) parameters is not built: the GPU-resident "
                "state of local shards has not passed its GPU tests yet. Leave gpu_state_bytes=0 under FSDP2.")
        if self._gated:
            raise NotImplementedError(
                "OffloadAdamW: overlap_forward with FSDP2 (DTensor) parameters is not built: FSDP's all-gather "
                "reads the shards before a module's forward could wait for them (the gate would have to "
                "wait on FSDP's all-gather copy-in stream). Leave overlap_forward unset: step() orders "
                "the uploads before FSDP's next all-gather.")

    def _check_param(self, sid: int) -> None:
        """Follow a change of parameter ``sid`` made outside the optimizer: new values are
        read into the host copy, a new storage of the same shape, dtype and device is
        written from now on; any other change raises, naming what changed."""
        p = self._params_of_slot[sid]
        loc = D.local(p)
        ptr = loc.data_ptr()
        if ptr == self._engine_param_ptr[sid]:
            ver = D.version(p)
            if ver != self._param_version[sid]:
                self._engine.reload_param(sid)
                self._param_version[sid] = ver
            return
        was, now = self._param_meta[sid], self._meta(p)
        if now != was or not loc.is_contiguous():
            what = ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(("dtype", "shape", "device"), was, now)
                             if a != b) or "made non-contiguous"
            hint = (" (float64 is not supported: float32, float16 or bfloat16)"
                    if p.dtype not in _DTYPE_NAME else "")
            raise RuntimeError(
                f"OffloadAdamW: parameter {sid} (group {self._group_of[sid]}) was replaced after the "
                f"optimizer was built: {what}{hint} (model.double()/.half()/.to(), p.data = ...). "
                "Build the optimizer after converting or moving the model."
            )
        self._engine.reload_param(sid, loc.data.view(-1))
        self._engine_param_ptr[sid] = ptr
        self._param_version[sid] = D.version(p)

    def _hook_if_trainable(self, sid: int) -> None:
        p = self._params_of_slot[sid]
        if self._host_slot(sid) and p.requires_grad and sid not in self._hooks:
            self._hooks[sid] = p.register_post_accumulate_grad_hook(self._make_hook(sid))

    def _host_slot(self, sid: int) -> bool:
        """Whether slot ``sid``'s gradient goes to the host placement (through a hook)."""
        return not self._engine.on_device(sid)

    def _group_of_slot(self, sid: int) -> dict[str, Any]:
        return self.param_groups[self._group_of[sid]]

    @staticmethod
    def _hp(group: dict[str, Any]) -> C.AdamWHyperParams:
        return C.validate_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _take_eager(self, sid: int) -> C.AdamWHyperParams:
        """Under ``last_micro_batch()``: slot ``sid`` is updated from its hook, now."""
        if sid in self._eager_done:
            raise RuntimeError(
                "OffloadAdamW: a second backward inside last_micro_batch() before "
                f"step() (parameter {sid}); only the last micro-batch's backward "
                "belongs in that block"
            )
        self._check_param(sid)  # an edited weight is re-read before the update
        self._eager_done.add(sid)
        return self._hp(self._group_of_slot(sid))

    def _make_hook(self, sid: int):
        """The gradient hook of host-engine slot ``sid``: copies its gradient to the host
        (on the eager path with the update queued behind it, the gradient taken)."""
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is None or opt._closed or p.grad is None:
                return
            if D.local(p).data_ptr() != opt._engine_param_ptr[sid]:
                opt._check_param(sid)  # e.g. model.double(): a clear error, not the engine's
            if opt._eager and opt.max_grad_norm is None:
                opt._staged.pop(sid, None)
                opt._offload_grad(sid, p, opt._take_eager(sid))
                return
            if not opt._hook_copies(p):
                return  # step() copies it
            grad = p.grad
            opt._offload_grad(sid, p)
            opt._staged[sid] = [weakref.ref(grad), D.version(grad), None]

        return hook

    def _hook_copies(self, p: torch.Tensor) -> bool:
        """Whether the gradient hook copies ``p.grad`` for ``step()`` to use. A plain
        parameter in a run of several processes: no (DDP, or the loop, reduces its
        gradient after the hook; ``step()`` copies it). A DTensor (FSDP2): where a later
        change of the gradient would show (version counters that in-place foreach ops
        move), or where the only change to come is ``max_grad_norm``'s clipping, whose
        multiplier the host applies to its copy; otherwise ``step()`` copies it."""
        if D.is_dtensor(p):
            return self.max_grad_norm is not None or D.foreach_moves_versions(p.device_mesh)
        return D.world()[1] == 1

    def _gpu_slots(self) -> list[int]:
        """The slots whose zero-copy kernels start from gradient hooks under
        :meth:`last_micro_batch`: every slot in ``gpu`` mode, hybrid's GPU share with
        ``gpu_params="last"``. With ``"first"`` that share's gradients come at the end of
        backward, and it runs at ``step()`` with the full grid (measured faster there)."""
        if self.mode == "gpu" or self._gpu_params == "last":
            return [sid for sid in range(len(self._params_of_slot)) if self._engine.on_device(sid)]
        return []

    def _hook_gpu_slots(self) -> None:
        """Give each trainable GPU-engine slot without one its eager hook (one per
        parameter: a hook firing proves that its own parameter's gradient is complete,
        and these gradients stay in ``param.grad`` across micro-batches)."""
        for sid in self._gpu_slots():
            p = self._params_of_slot[sid]
            if p.requires_grad and sid not in self._gpu_hooks:
                self._gpu_hooks[sid] = p.register_post_accumulate_grad_hook(self._make_gpu_hook(sid))

    def _make_gpu_hook(self, sid: int):
        """Under ``last_micro_batch()`` (no clipping): launch slot ``sid``'s update kernel
        now, behind the backward work that produced its gradient."""
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = ref()
            if opt is None or opt._closed or p.grad is None or not opt._eager or opt.max_grad_norm is not None:
                return
            hp = opt._take_eager(sid)
            opt._engine.launch_eager([(sid, hp, *opt._device_grad(sid))])
            if opt._gated:
                with opt._pending_lock:
                    opt._pending.add(sid)
            # Taken, as on the host path: an in-place change of it from here on (clipping
            # by hand, a second backward) would race the kernel that reads it. The engine
            # keeps its memory alive until the compute stream has waited for the kernel.
            p.grad = None

        return hook

    def _offload_grad(self, sid: int, p: torch.Tensor, update: C.AdamWHyperParams | None = None) -> None:
        """Copy ``p.grad`` to slot ``sid``'s host staging (``update``: the eager path, the
        update queued behind the copy and the gradient taken)."""
        grad, loc = D.local(p.grad), D.local(p)
        if grad.is_sparse:
            raise RuntimeError(f"OffloadAdamW does not support sparse gradients (parameter {sid})")
        if grad.dtype != loc.dtype or grad.shape != loc.shape:
            raise TypeError(
                f"OffloadAdamW: gradient of parameter {sid} is {grad.dtype}{tuple(grad.shape)}, "
                f"the parameter is {loc.dtype}{tuple(loc.shape)}" + (" (local shards)" if loc is not p else "")
            )
        if grad.device != loc.device:
            raise ValueError(f"OffloadAdamW: gradient of parameter {sid} is on {grad.device}, parameter on {loc.device}")
        # A contiguous gradient is copied as it is; another layout is first made
        # contiguous on the compute stream (the engine's copy is ordered after it).
        # (Each torch call releases and retakes the GIL, which under busy workers costs
        # far more than the call: only the ones needed.)
        if grad.requires_grad:
            grad = grad.detach()
        if not grad.is_contiguous():
            grad = grad.contiguous()
        self._engine.offload_grad(sid, grad, _DTYPE_NAME[grad.dtype], update)
        if update is not None:
            if self._gated:
                with self._pending_lock:
                    self._pending.add(sid)
            p.grad = None  # taken: the engine keeps it alive until its copy landed

    # -- the user API -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OffloadAdamW is closed")

    @contextlib.contextmanager
    def last_micro_batch(self):
        """Mark the backward inside this block as the last micro-batch of the step.

        Each gradient's update then starts as soon as the gradient is ready, overlapping
        the rest of backward: on the host threads once it is on the host (``cpu`` mode,
        ``hybrid``'s host share), or by its zero-copy kernel on the update stream
        (``gpu`` mode; ``hybrid``'s GPU share with ``gpu_params="last"``; with the
        default ``"first"`` that share still runs at ``step()``). The gradients are taken:
        ``param.grad`` is ``None`` after that backward for the parameters it updated (the
        GPU memory of each is freed as soon as its copy or kernel is done), so nothing
        may change them after backward: no ``clip_grad_norm_`` (it would find no
        gradient), no ``GradScaler`` (``step()`` raises). Each update uses its group's
        ``lr`` as it is during backward (set a schedule's ``lr`` before it). Not with
        ``max_grad_norm``: clipping needs every gradient first, and the block then has no
        effect. Between this backward and ``step()``, ``state_dict()`` and
        ``load_state_dict()`` raise.

        The host threads then run during backward, beside the thread that launches its
        kernels: with ``mode="hybrid"`` on a 350M GPT, workers at the default nice 5
        made the step slower than without this block, at nice 19 (``worker_nice=19``)
        faster (experiments/RESULTS.md, session 6).
        """
        self._check_open()
        if D.world()[1] > 1 and not all(D.is_dtensor(p) for p in self._params_of_slot):
            raise NotImplementedError(
                "OffloadAdamW.last_micro_batch() in a run of several processes with plain (non-DTensor) "
                "parameters is not built: their gradient hooks run before DDP's all-reduce (or any "
                "reduction after backward), so the updates would use this rank's unreduced gradients. "
                "Leave it out: step() takes the reduced gradients (FSDP2's DTensor parameters may use it).")
        if self.max_grad_norm is None and self.mode in ("gpu", "hybrid"):
            self._hook_gpu_slots()  # parameters added since the last time included
        self._eager = True
        try:
            yield self
        finally:
            self._eager = False

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter with a gradient, in group order (zero_stage=1: every rank's)."""
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _multiply(self, op, mult: dict[torch.dtype, float]) -> None:
        """Run ``op``, torch's in-place multiplication of the ``param.grad`` of ``self``'s
        parameters; a host copy still equal to its gradient before it gets the same
        multiplier, ``mult[grad dtype]`` (the contract's ``c``; a dtype not in ``mult``,
        or a second multiplication: copied again at ``step()``)."""
        valid = {sid: rec for sid, rec in self._staged.items() if self._fresh(self._params_of_slot[sid], rec)}
        op()
        for sid, rec in valid.items():
            grad = self._params_of_slot[sid].grad
            c = mult.get(grad.dtype)
            if c is None or rec[2] is not None:
                continue
            rec[1], rec[2] = D.version(grad), c

    @staticmethod
    def _fresh(p: torch.Tensor, rec: list) -> bool:
        """Whether ``p.grad`` is the tensor a staged copy (``rec``) was taken of, at the
        same version."""
        grad = p.grad
        return grad is not None and rec[0]() is grad and rec[1] == D.version(grad)

    def _trusted(self, p: torch.Tensor, rec: list) -> bool:
        """Whether a staged copy (``rec``) is ``p.grad`` as it is now: :meth:`_fresh`, and
        for a DTensor gradient whose in-place foreach changes move no version counter,
        multiplied since by this optimizer alone (see :meth:`_hook_copies`)."""
        if not self._fresh(p, rec):
            return False
        return rec[2] is not None or not D.is_dtensor(p) or D.foreach_moves_versions(p.device_mesh)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                       foreach: bool | None = None, *, parameters: Iterable[torch.Tensor] | None = None
                       ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(parameters, max_norm, ...)`` (the same norm, the
        same clipped ``param.grad``, the same bits after ``step()``), without copying the
        gradients to the host again: the host multiplies its copies by the same
        coefficient. Returns the total norm (a tensor, as ``clip_grad_norm_``).

        ``parameters``: default, this optimizer's, in param-group order (as Lightning's
        clipping lists them). torch sums the per-tensor norms in the order given, so for
        the bits of ``clip_grad_norm_(model.parameters(), ...)`` pass ``model.parameters()``
        where the groups list them in another order (e.g. weight decay groups).
        """
        self._check_open()
        if self._eager_done:
            raise RuntimeError("OffloadAdamW.clip_grad_norm() after a last_micro_batch() backward: its "
                               "gradients were taken by their updates (use max_grad_norm=, which turns "
                               "the eager path off)")
        if parameters is None:
            params = self._grads()
        else:
            params = [p for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite, foreach)
        if params:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s lines
            self._multiply(lambda: torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach),
                           {coef.dtype: float(D.local(coef))})
        self._last_norm = total
        return total

    def _amp(self) -> bool:
        """GradScaler's ``step(opt)``: it set ``grad_scale`` (None once the user unscaled
        the gradients, in place) and ``found_inf``. Returns whether to skip the step;
        otherwise unscales ``param.grad`` as ``GradScaler.unscale_`` does."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        if self._eager_done:
            raise RuntimeError(
                "OffloadAdamW: GradScaler with last_micro_batch(): the updates started during "
                "backward used the scaled gradients. Do not use last_micro_batch() with a "
                "GradScaler; reload a checkpoint (load_state_dict) to continue."
            )
        if found_inf.item():
            return True  # skipped, as GradScaler skips torch.optim.AdamW's step
        scale = getattr(self, "grad_scale", None)
        if scale is None:  # unscaled in place by GradScaler.unscale_ (no _version change)
            self._staged.clear()
            return False
        inv = scale.double().reciprocal().float()
        by_kind: dict = {}
        for p in self._grads():
            grad = D.local(p.grad)  # a DTensor's shard: the same bits, no dispatch
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)

        def unscale():
            for (dev, _), grads in by_kind.items():
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, torch.zeros(1, device=dev), inv.to(dev))

        self._multiply(unscale, dict.fromkeys(_DTYPE_NAME, float(inv)))
        return False

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter whose ``grad`` is not ``None`` (see the class docstring
        for when the new weights are visible)."""
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
            if self._host_slot(sid):
                self._hook_if_trainable(sid)  # unfrozen after construction
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
                    updates.append((sid, hp, *self._device_grad(sid)))
                    continue
                rec = staged.get(sid)
                if rec is not None and self._trusted(p, rec):
                    if rec[2] is not None:
                        coefs[sid] = rec[2]
                else:
                    self._offload_grad(sid, p)  # changed since its hook copied it, or set by hand
                updates.append((sid, hp))
        if self._gated:
            # Marked before the engine runs, so that also when it raises part-way (e.g.
            # hybrid's GPU share failed after its host share was queued) the next forward
            # waits for whatever was queued. Waiting on a slot that queued nothing is harmless.
            with self._pending_lock:
                self._pending.update(u[0] for u in updates)
        if self._engine is not None:
            try:
                self._engine.step(updates, coefs=coefs)
            finally:
                if not self._gated:
                    self._engine.wait_step()  # every reader on the current stream sees the new weights
        if self._zero is not None:  # after the uploads (the current stream waits for them)
            D.broadcast_from_owners([p for g in self.param_groups for p in g["params"]], self._zero.owner)
        return loss

    def _device_grad(self, sid: int) -> tuple[torch.Tensor, str]:
        p = self._params_of_slot[sid]
        grad, loc = D.local(p.grad), D.local(p)
        if grad.is_sparse:
            raise RuntimeError(f"OffloadAdamW does not support sparse gradients (parameter {sid})")
        if grad.device != loc.device:
            raise ValueError(f"OffloadAdamW: gradient of parameter {sid} is on {grad.device}, parameter on {loc.device}")
        if grad.dtype not in _DTYPE_NAME:
            raise TypeError(f"OffloadAdamW: gradient of parameter {sid} has unsupported dtype {grad.dtype}")
        return grad.detach().contiguous().view(-1), _DTYPE_NAME[grad.dtype]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; the host copies of the gradients are
        forgotten too."""
        self._check_open()
        if self._gated and self._pending and not set_to_none:
            self.synchronize()  # the update may still read param.grad: zero it after
        super().zero_grad(set_to_none=set_to_none)
        self._staged.clear()
        if self._engine is not None:
            self._engine.discard_grads()

    def _module_slots(self, module: torch.nn.Module) -> list[int]:
        sids = self._wait_sets.get(module)
        if sids is None:
            sids = []
            todo = [module]
            while todo:
                mod = todo.pop()
                sids.extend(self._slot_of[p] for p in mod._parameters.values() if p in self._slot_of)
                todo.extend(c for c in mod.children() if c not in self._called)
            self._wait_sets[module] = sids
        return sids

    def _wait_module(self, module: torch.nn.Module) -> None:
        pending = self._pending
        sids = [sid for sid in self._module_slots(module) if sid in pending]
        if sids:
            self._engine.wait_ready(sids)
            with self._pending_lock:
                self._pending.difference_update(sids)

    def synchronize(self) -> None:
        """Block until every queued update has landed in the parameters (only needed
        with ``overlap_forward``, before reading weights outside that model's forward)."""
        self._check_open()
        if self._engine is not None:
            self._engine.synchronize()  # host-blocks on every upload: nothing left to wait for
            with self._pending_lock:
                self._pending.clear()

    def last_grad_norm(self) -> float | None:
        """The total gradient norm of the last :meth:`clip_grad_norm` (``max_grad_norm``)."""
        return None if self._last_norm is None else float(D.local(self._last_norm))

    def stats(self) -> dict[str, float]:
        """This rank's counters: bytes moved, host state bytes (``host_state_bytes``, of
        them ``pinned_state_bytes``), the host memory plan checked at construction
        (``host_plan_*``: see :meth:`host_memory_plan`), GPU state bytes (``gpu_state_bytes``,
        of ``resident_params`` parameters; ``staging_ring_bytes``: the GPU buffers through which
        ``gpu`` mode streams the host state, 72 MiB once used), update and stall times, worker ``threads``, and where
        the rank sits: ``rank``, ``world_size``, ``local_rank``, ``local_world_size``,
        ``worker_cores`` (cores the workers are bound to; 0: unbound). A benchmark sums
        them over the ranks itself (e.g. ``all_gather_object``)."""
        self._check_open()
        (rank, world), (lrank, lworld) = D.world(), D.local_world()
        where = dict(rank=rank, world_size=world, local_rank=lrank, local_world_size=lworld,
                     worker_cores=len(self._cores or ()))
        plan = {f"host_plan_{k}": v for k, v in self._host_plan.items()}
        return {**({} if self._engine is None else self._engine.stats()), **plan,
                **{k: float(v) for k, v in where.items()}}

    # -- checkpoints ------------------------------------------------------------------------

    def _check_no_eager_in_flight(self, what: str) -> None:
        """Between a ``last_micro_batch()`` backward and ``step()`` some parameters have
        already taken this step's update and others not: no consistent state to save or
        to replace."""
        if self._eager_done:
            raise RuntimeError(
                f"OffloadAdamW.{what}() between a last_micro_batch() backward and step(): "
                f"{len(self._eager_done)} parameters are already updated for this step; call "
                "step() first"
            )

    def _state_of(self, sid: int) -> dict[str, torch.Tensor]:
        """Slot ``sid``'s state as ``torch.optim.AdamW`` keeps it, once its queued work has
        run: ``step`` (float32 scalar), ``exp_avg``, ``exp_avg_sq`` and for fp16/bf16
        ``master_param``: views of the host buffers (gpu-placed slots: copies). Empty
        before its first update."""
        master, m, v, step = self._engine.state(sid, copy=False)
        if step == 0:
            return {}
        p = self._params_of_slot[sid]
        shape = D.local(p).shape

        def view(a: np.ndarray) -> torch.Tensor:  # FSDP2: a DTensor laid out as the parameter
            t = torch.from_numpy(a).view(shape)
            return D.state_view(p, t) if D.is_dtensor(p) else t

        entry = {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": view(m), "exp_avg_sq": view(v)}
        if p.dtype != torch.float32:
            entry["master_param"] = view(master)
        return entry

    def state_dict(self) -> dict[str, Any]:
        """A ``torch.optim.AdamW``-compatible state dict: its state tensors are views of
        the optimizer's (as ``torch.optim.AdamW``'s are its own), see :attr:`state`;
        DTensors for FSDP2's parameters, laid out as they are.

        Per parameter: ``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq``
        (float32, the parameter's shape) and, for fp16/bf16 parameters, ``master_param``
        (the fp32 master, so that resuming is bit-exact). With ``zero_stage=1``: the
        whole state gathered by the last :meth:`consolidate_state_dict` to this rank
        (copies; a ``step()`` since discards them).
        """
        self._check_open()
        self._check_no_eager_in_flight("state_dict")
        if self._zero is None:
            return self._own_state_dict()
        if self._consolidated is None:
            raise RuntimeError(
                "OffloadAdamW(zero_stage=1).state_dict(): each rank holds only its partition of the state. "
                "Call consolidate_state_dict(to=rank) on every rank first (ZeroRedundancyOptimizer's "
                "protocol), then state_dict() on that rank (not since a step())")
        return self._consolidated

    def _own_state_dict(self) -> dict[str, Any]:
        """This rank's state (views), keyed by each parameter's index in the groups."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for sid, p in enumerate(self._params_of_slot):
            entry = self._state_of(sid)
            if entry:
                state[index[p]] = entry
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index[p] for p in g["params"]]
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """``zero_stage=1``: gather every rank's partition of the state on rank ``to``,
        whose :meth:`state_dict` then returns all of it in ``torch.optim.AdamW``'s format
        (ZeroRedundancyOptimizer's protocol; Lightning calls it wherever it exists). A
        collective: every rank calls it. Without ``zero_stage=1`` a no-op: ``state_dict()``
        holds this rank's state."""
        self._check_open()
        self._check_no_eager_in_flight("consolidate_state_dict")
        if self._zero is None:
            return
        own = self._own_state_dict()
        shares = D.gather_to(own["state"], to)  # pickled: copies of the views
        self._consolidated = None
        if shares is not None:
            state = {i: entry for share in shares for i, entry in share.items()}
            self._consolidated = {"state": dict(sorted(state.items())), "param_groups": own["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``OffloadAdamW`` or ``torch.optim.AdamW`` (DTensor values
        included: torch.distributed.checkpoint passes it by keyword). With
        ``zero_stage=1`` every rank takes the whole dict and keeps its partition."""
        self._check_open()
        self._check_no_eager_in_flight("load_state_dict")
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer has "
                f"{len(self.param_groups)}"
            )
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict's parameter group {i} has {len(sg['params'])} parameters, "
                    f"the optimizer's has {len(g['params'])}"
                )
        id_map = {}
        for g, sg in zip(self.param_groups, saved_groups):
            for p, saved_id in zip(g["params"], sg["params"]):
                id_map[saved_id] = p
        # Validate every entry before changing anything: a bad checkpoint loses no state.
        loads = []
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in id_map:
                raise ValueError(f"loaded state dict has state for unknown parameter id {saved_id}")
            p = id_map[saved_id]
            if p not in self._slot_of:
                continue  # another rank's (zero_stage=1)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key not in entry:
                    raise ValueError(f"loaded state for parameter {saved_id} lacks '{key}'")
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in entry and tuple(entry[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"loaded state '{key}' of parameter {saved_id} has shape "
                        f"{tuple(entry[key].shape)}, the parameter has {tuple(p.shape)}"
                    )
            step = entry["step"]
            step = float(step.item() if isinstance(step, torch.Tensor) else step)
            if step < 0 or step != int(step):
                raise ValueError(f"loaded state of parameter {saved_id} has invalid step {step}")

            def f32(t, p=p):
                return _local_value(t, p).to("cpu", torch.float32).contiguous().view(-1).numpy()

            master = None
            if "master_param" in entry and p.dtype != torch.float32:
                saved = _local_value(entry["master_param"], p).to("cpu", torch.float32)
                # Keep the fp32 master only if it still rounds to the live weights: a
                # checkpoint that went through torch.optim.AdamW carries a stale one.
                if torch.equal(saved.to(p.dtype), D.local(p).detach().to("cpu")):
                    master = saved.contiguous().view(-1).numpy()
                else:
                    warnings.warn(
                        f"OffloadAdamW.load_state_dict: the saved fp32 master of parameter "
                        f"{saved_id} does not round to the current weights (the checkpoint was "
                        "trained further without it); the master is re-read from the weights",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            loads.append((self._slot_of[p], f32(entry["exp_avg"]), f32(entry["exp_avg_sq"]), int(step), master))
        for sg in saved_groups:
            _check_group({**self.defaults, **sg})
        for sid in range(len(self._params_of_slot)):
            self._check_param(sid)  # a replaced storage first (the masters are checked against it)
        self._consolidated = None
        if self._engine is not None:
            self._engine.drain()
            loaded = {sid for sid, *_ in loads}
            for sid, m, v, step, master in loads:
                self._engine.load_state(sid, m, v, step, master)
            for sid, p in enumerate(self._params_of_slot):
                if sid not in loaded:  # no saved state: a fresh parameter, as in torch
                    zeros = np.zeros(D.local(p).numel(), np.float32)
                    self._engine.load_state(sid, zeros, zeros, 0, None)
            self._engine.clear_error()  # every slot is consistent again
        self._param_version = [D.version(p) for p in self._params_of_slot]  # the masters follow them
        with self._pending_lock:
            self._pending.clear()
        self._eager_done.clear()
        for g, sg in zip(self.param_groups, saved_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued work, stop the worker threads, free host memory, remove hooks."""
        if self._closed:
            return
        self._closed = True
        self._release()  # drains queued work; a worker failure was raised already
