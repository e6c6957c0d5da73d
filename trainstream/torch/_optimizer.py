"""``OffloadAdamW``: the ``torch.optim.Optimizer`` over the engine (``trainstream.core``), whose arithmetic is the
contract's (``trainstream.contract``). This module is the torch.optim API; it delegates to parameter
registration and placement (:mod:`._params`), gradient capture (:mod:`._grads`), ``overlap_forward``'s gate
(:mod:`._gate`), the state as torch shows it (:mod:`._state`) and torch.distributed's part (:mod:`._dist`).
No arithmetic lives here; buffers, streams and copies are :mod:`trainstream.backends.torch`'s.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable

import numpy as np
import torch
from torch.optim import Optimizer

from .. import contract as C
from ..core import _budget
from . import _dist as D
from . import _params as P
from . import _state as S
from ._gate import Gate
from ._grads import GradCapture

__all__ = ["OffloadAdamW"]

_GROUP_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                    decoupled_weight_decay=True)


def _check_group(group: dict[str, Any]) -> None:
    """Refuse what OffloadAdamW does not implement, before any state changes."""
    for flag in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
        if group.get(flag):
            raise NotImplementedError(f"OffloadAdamW does not implement {flag}")
    if not group.get("decoupled_weight_decay", True):
        raise NotImplementedError("OffloadAdamW implements decoupled weight decay only")
    _hp(group)


def _hp(group: dict[str, Any]) -> C.AdamWHyperParams:
    """A param group's hyper-parameters, as the contract takes them."""
    return C.validate_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])


def _release(slots: P.Slots, gate: Gate) -> None:
    """What one :class:`OffloadAdamW` releases, once, by close() or its collection (not a copy's, e.g.
    LightningOptimizer's): its hooks and its engine (queued work finished first)."""
    gate.remove()
    slots.release()


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
      worker_nice: the host workers' nice value (``cpu``, ``hybrid``; Linux); the default 5 yields to the threads
        driving the GPU, 19 is faster with ``hybrid`` and :meth:`last_micro_batch` unless a busy loader starves them.
      eager_blocks: the grid cap, in blocks, of the kernels launched from hooks under :meth:`last_micro_batch`
        (the bits do not depend on it). ``None``: a quarter of the GPU's multiprocessors, leaving backward the rest.
      pin_moments: keep the moments page-locked (``cpu`` mode) while all pinned memory stays within half of the
        available host memory, else pageable (``stats()["host_plan_pin_moments"]``). Default False.
      host_margin: the host memory the optimizer will take (:meth:`host_memory_plan`) must fit in what the host
        has less this fraction, checked before allocating: else ``MemoryError`` naming the bytes. None: no check.
      amsgrad, maximize: ``True`` raises ``NotImplementedError``.

    Invalid arguments raise ``ValueError`` (``TypeError``: a Tensor ``lr``, a non-Module ``overlap_forward``, an
    unsupported parameter dtype).
    """

    _step_supports_amp_scaling = True  # GradScaler leaves unscaling to step() (fused optimizers' protocol): _amp()

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 max_grad_norm: float | None = None, mode: str = "cpu", overlap_forward: torch.nn.Module | None = None,
                 threads: int | None = None, worker_cores: Any = None, zero_stage: int = 0, worker_nice: int = 5,
                 eager_blocks: int | None = None, gpu_state_bytes: int = 0, gpu_share: float = 0.3,
                 gpu_params: str = "first", pin_moments: bool = False, host_margin: float | None = _budget.MARGIN,
                 amsgrad: bool = False, maximize: bool = False):
        if isinstance(lr, torch.Tensor):
            raise TypeError("OffloadAdamW: a Tensor lr is not supported; pass a float")
        C.validate_hyperparams(lr, betas, eps, weight_decay)
        _check_group(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize))
        if max_grad_norm is not None and not (max_grad_norm > 0):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (must be > 0 or None)")
        if overlap_forward is not None and not isinstance(overlap_forward, torch.nn.Module):
            raise TypeError(f"overlap_forward must be a torch.nn.Module or None, got {type(overlap_forward).__name__}")
        P.check_placement(mode, gpu_share, gpu_params, gpu_state_bytes)
        _budget.plan([], margin=host_margin)  # a bad margin raises here
        if isinstance(worker_nice, bool) or not isinstance(worker_nice, int):
            raise ValueError(f"Invalid worker_nice: {worker_nice!r} (must be an int)")
        if eager_blocks is not None and (isinstance(eager_blocks, bool) or not isinstance(eager_blocks, int)
                                         or eager_blocks < 1):
            raise ValueError(f"Invalid eager_blocks: {eager_blocks!r} (must be an int >= 1 or None)")
        if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
            raise ValueError(f"Invalid zero_stage: {zero_stage!r} (0, or 1 for ZeRO stage 1)")
        D.worker_cores(worker_cores, torch.device("cpu"))  # a bad value raises here, not at the first parameter
        gated = overlap_forward is not None
        self._zero = D.ZeroPartition(gated) if zero_stage else None  # zero_stage=1: which rank owns each parameter
        self._consolidated: dict[str, Any] | None = None  # zero_stage=1: consolidate_state_dict()'s
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.mode, self._gpu_params = mode, gpu_params
        self._slots = P.Slots(mode=mode, gpu_state_bytes=gpu_state_bytes, gpu_share=gpu_share, gpu_params=gpu_params,
                              host_margin=host_margin, worker_cores=worker_cores, threads=threads,
                              pin_moments=pin_moments, worker_nice=worker_nice, eager_blocks=eager_blocks, gated=gated)
        self._gate = Gate(self._slots, gated)
        ref = weakref.ref(self)
        self._grads = GradCapture(self._slots, self._gate, clipping=self.max_grad_norm is not None,
                                  group_hyper=lambda i: _hp(ref().param_groups[i]))
        self._last_norm: torch.Tensor | None = None
        # Released once, by close() or collection of this object (not of a copy, e.g. LightningOptimizer's).
        self._release = weakref.finalize(self, _release, self._slots, self._gate)
        self._deferred = True  # add_param_group inside __init__: registered once every group is known (one plan)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **_GROUP_FLAGS))
        self.state = S.StateView(self._slots)  # type: ignore[assignment]  # the engine's, per parameter
        self._deferred = False
        try:
            self._slots.start([(p, gi) for gi, g in enumerate(self.param_groups) for p in g["params"]
                               if self._mine(p)], hook=self._grads.hook)
        except BaseException:  # nothing of a half-built optimizer stays on the parameters
            self._release()
            raise
        if gated:
            self._gate.install(overlap_forward)

    @property
    def _engine(self):
        """The engine holding the state (None until a parameter of this rank is registered)."""
        return self._slots.engine

    @property
    def _closed(self) -> bool:
        return self._slots.closed

    # -- parameters -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        n_groups = len(self.param_groups)
        super().add_param_group(param_group)
        listed = self.param_groups[-1]["params"]
        zero = None if self._zero is None else self._zero.snapshot()
        try:
            if len({id(p) for p in listed}) != len(listed):
                raise ValueError(f"OffloadAdamW: parameter group {n_groups} lists a parameter more than once "
                                 "(torch.optim.AdamW would update it once per listing); list each parameter once")
            _check_group(self.param_groups[-1])
            if self._zero is not None:
                self._zero.add_group(listed)
            if self._deferred:  # inside __init__
                return
            self._slots.add([(p, n_groups) for p in listed if self._mine(p)], hook=self._grads.hook)
        except BaseException:  # leave the optimizer exactly as it was (the registry unwinds itself)
            del self.param_groups[n_groups:]
            if zero is not None:
                self._zero.restore(zero)
            raise
        self._gate.forget_modules()

    @staticmethod
    def host_memory_plan(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *, mode: str = "cpu",
                         gpu_share: float = 0.3, gpu_params: str = "first", gpu_state_bytes: int = 0,
                         pin_moments: bool = False, host_margin: float | None = _budget.MARGIN) -> dict[str, float]:
        """The host memory ``OffloadAdamW(params, ...)`` will take, and what the host has, without allocating
        anything: bytes per part (``state_pinned``, ``state_pageable``, ``masters_*``, ``staging_*``), ``pinned``,
        ``pageable``, ``needed``, ``available``, ``usable``, ``pin_moments`` and ``fits`` (see
        :func:`trainstream.core._budget.plan`); after construction also in :meth:`stats` as ``host_plan_*``."""
        return P.host_memory_plan(params, mode=mode, gpu_share=gpu_share, gpu_params=gpu_params,
                                  gpu_state_bytes=gpu_state_bytes, pin_moments=pin_moments, host_margin=host_margin)

    def _mine(self, p: torch.Tensor) -> bool:
        """Whether this rank holds ``p``'s state (all but zero_stage=1's parameters of other ranks)."""
        return self._zero is None or self._zero.mine(p)

    def _params_with_grads(self) -> list[torch.Tensor]:
        """Every parameter with a gradient, in group order (zero_stage=1: every rank's)."""
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    # -- the user API -----------------------------------------------------------------------

    def _check_open(self, what: str | None = None) -> None:
        """Refuse calls once closed, and checkpoint method ``what`` between a last_micro_batch() backward and step()."""
        if self._closed:
            raise RuntimeError("OffloadAdamW is closed")
        if what is not None and self._grads.done:
            raise RuntimeError(f"OffloadAdamW.{what}() between a last_micro_batch() backward and step(): "
                               f"{len(self._grads.done)} parameters are updated already; call step() first")

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
        if D.world()[1] > 1 and not all(D.is_dtensor(rec.param) for rec in self._slots):
            raise NotImplementedError("OffloadAdamW.last_micro_batch() with plain (non-DTensor) parameters in a "
                                      "run of several processes is not built: the updates would use this rank's "
                                      "unreduced gradients (before DDP's all-reduce). Leave it out (FSDP2 may use it).")
        if self.max_grad_norm is None and (self.mode == "gpu" or self._gpu_params == "last"):
            # GPU slots' eager hooks (hybrid with gpu_params="first": at step(), with the full grid: faster), new
            # parameters included. A hook firing proves its gradient complete (they stay in param.grad).
            for rec in self._slots:
                self._grads.hook(rec, gpu=True)
        self._grads.eager = True
        try:
            yield self
        finally:
            self._grads.eager = False

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
        params = self._params_with_grads() if parameters is None else [p for p in parameters if p.grad is not None]
        self._last_norm = self._grads.clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return self._last_norm

    def _amp(self) -> bool:
        """GradScaler's protocol (``_step_supports_amp_scaling``): whether to skip this step; else ``param.grad`` is
        unscaled as ``GradScaler.unscale_`` does (:meth:`trainstream.torch._grads.GradCapture.amp`)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        return self._grads.amp(found_inf, getattr(self, "grad_scale", None), self._params_with_grads())

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter whose ``grad`` is not ``None`` (the class docstring says when it is visible)."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._engine
        if engine is None and self._zero is None:
            return loss
        if engine is not None:
            engine.check_error()
        if self._amp():
            return loss
        self._consolidated = None
        for rec in self._slots:
            self._slots.follow(rec)
            self._grads.hook(rec)  # a host slot unfrozen after construction
        if self.max_grad_norm is not None:
            self.clip_grad_norm(self.max_grad_norm)
        updates, coefs, eager = self._grads.updates(self.param_groups, _hp)
        self._gate.mark(u[0] for u in updates)  # first: if the engine raises part-way, what it queued is waited for
        if engine is not None:
            try:
                engine.step(updates, coefs=coefs)
            finally:
                if not self._gate.active:
                    engine.wait_step()  # every reader on the current stream sees the new weights
        if self._zero is not None:  # after the uploads (the current stream waits for them)
            self._zero.broadcast(self.param_groups)
        if self._slots.auto_gpu_state and engine is not None and (updates or eager):
            self._slots.move_auto()  # after a step that updated: torch's pool holds its peak
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; the host copies of the gradients are forgotten too."""
        self._check_open()
        if self._gate.active and self._gate.pending and not set_to_none:
            self.synchronize()  # the update may still read param.grad: zero it after
        super().zero_grad(set_to_none=set_to_none)
        self._grads.forget()
        if self._engine is not None:
            self._engine.discard_grads()

    def synchronize(self) -> None:
        """Wait for every queued update to land (needed only with ``overlap_forward``, to read weights elsewhere)."""
        self._check_open()
        if self._engine is not None:
            self._engine.synchronize()  # host-blocks on every upload: nothing left to wait for
            self._gate.clear()

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
                         (*D.world(), *D.local_world(), len(self._slots.cores or ()))))
        return {**({} if self._engine is None else self._engine.stats()),
                **{f"host_plan_{k}": v for k, v in self._slots.host_plan.items()},
                **{k: float(v) for k, v in where.items()}}

    # -- checkpoints ------------------------------------------------------------------------

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
        state = {index[rec.param]: entry for rec in self._slots if (entry := S.entry(self._slots, rec))}
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
        state = D.gather_state(own["state"], to)
        self._consolidated = None if state is None else {"state": state, "param_groups": own["param_groups"]}

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
            rec = self._slots.of(id_map[saved_id])
            if rec is not None:  # else another rank's (zero_stage=1)
                loads[rec.sid] = S.parse_entry(saved_id, entry, id_map[saved_id])
        for rec in self._slots:
            self._slots.follow(rec)  # a replaced storage first (the masters are checked against it)
        self._consolidated = None
        engine = self._engine
        if engine is not None:
            engine.drain()
            for rec in self._slots:  # no saved state: a fresh parameter, as in torch
                zeros = np.zeros(D.local(rec.param).numel(), np.float32)
                engine.load_state(rec.sid, *loads.get(rec.sid, (zeros, zeros, 0, None)))
            engine.clear_error()  # every slot is consistent again
        for rec in self._slots:  # the masters follow the weights as they are now
            rec.version = D.version(rec.param)
        self._gate.clear()
        self._grads.done.clear()
        for g, sg in zip(self.param_groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued work, stop the worker threads, free host memory, remove hooks."""
        self._release()  # once; drains queued work (a worker failure was raised already)
