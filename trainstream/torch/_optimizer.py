"""``OffloadAdam`` and ``OffloadAdamW``: the ``torch.optim.Optimizer`` classes over the engine (``trainstream.core``),
whose arithmetic is the contract's (``trainstream.contract``). This module is the torch.optim API (torch's
signatures, hooks, copies); it delegates torch's validation and what a param group asks for to :mod:`._recipe`,
state dicts to :mod:`._checkpoint`,
the param groups as they are now (parameters added or replaced) to :mod:`._groups`, parameter registration and placement to :mod:`._params`, gradient capture to :mod:`._grads`, ``overlap_forward``'s
gate to :mod:`._gate`, the state as torch shows it to :mod:`._state` and torch.distributed's part to :mod:`._dist`.
No arithmetic lives here; buffers, streams and copies are :mod:`trainstream.backends.torch`'s.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Any, Iterable

import torch
from torch.optim import Optimizer

from ..core import _budget
from . import _dist as D
from . import _fit as F
from . import _params as P
from . import _recipe as R
from . import _state as S
from ._checkpoint import Checkpoints
from ._gate import Gate
from ._grads import GradCapture
from ._groups import ParamGroups

__all__ = ["OffloadAdam", "OffloadAdamW"]


def _release(slots: P.Slots, gate: Gate) -> None:
    """What one optimizer releases, once, by close() or its collection (not a copy's, e.g. LightningOptimizer's):
    its hooks and its engine (queued work finished first)."""
    gate.remove()
    slots.release()


class OffloadAdam(ParamGroups, Checkpoints, Optimizer):
    r"""``torch.optim.Adam`` with its state in host memory, bit-identical to it; :class:`OffloadAdamW` is
    ``torch.optim.AdamW``'s counterpart (the same machinery, as torch's ``AdamW`` subclasses ``Adam``). The user's
    guide, with every rule of a loop and of torch.distributed: ``docs/torch.md``.

    A drop-in replacement: torch's arguments in torch's order, its validation and exception types, param groups
    (named parameters too), LR schedulers, ``zero_grad``, ``step(closure)``, every ``Optimizer`` hook, ``state`` and
    ``state_dict`` (keys ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``: checkpoints move to and from
    torch's optimizer), ``copy.deepcopy`` and pickling. Each param group's implementation (``foreach``, single-tensor,
    ``fused``), flags (``amsgrad``, ``maximize``, a Tensor ``lr``, Adam's L2 or decoupled decay) and dtype select the
    arithmetic reproduced (:class:`trainstream.contract.TorchRecipe`). Gradients stay in ``param.grad``; ``step()``
    returns with the new weights in place (on CUDA: the current stream waits for their upload). What cannot be
    offered raises ``NotImplementedError`` naming why, where it is set (constructor, ``add_param_group``,
    ``load_state_dict``, or the ``step()`` after a group edit): ``differentiable=True``, ``capturable=True``, Tensor
    ``betas``, a Tensor ``lr`` on a CUDA device, CUDA ``fused=True`` with Adam's L2 decay on the host, a group edit
    that changes the state's layout (``amsgrad`` toggled).

    Args:
      params, lr, betas, eps, weight_decay, amsgrad, foreach, maximize, capturable, differentiable, fused,
        decoupled_weight_decay: as ``torch.optim.Adam``'s (parameters float32, float16 or bfloat16, contiguous,
        dense, all on one device).
      master_weights: fp16/bf16 parameters get an fp32 master and fp32 moments, their micro-batch gradients summed
        in fp32 on the host, instead of state in their dtype as torch keeps it. Default False.
      max_grad_norm: if set, ``step()`` first runs :meth:`clip_grad_norm` over the parameters in group order.
      mode: ``"cpu"`` (host threads update), ``"gpu"`` (a GPU kernel, the host state streamed through a ring of GPU
        buffers) or ``"hybrid"`` (``gpu_share`` of the trainable elements, in ``gpu_params`` order, by the kernel
        reading host state over PCIe, the rest by the host threads); the last two need CUDA parameters and CuPy.
      overlap_forward: a module whose next forward may start before the update has finished (each module waits
        for its own weights); other reads of the weights then need :meth:`synchronize`.
      gpu_state_bytes: GPU memory, in bytes, for the state of the parameters that fit, in order (same bits), or
        ``"auto"``: what is free after the first step, less ``AUTO_GPU_HEADROOM`` of the total.
      threads, worker_cores, worker_nice, eager_blocks: the host workers (count, binding, nice value) and the grid
        cap of the kernels launched from hooks under :meth:`last_micro_batch` (the bits do not depend on them).
      zero_stage: ``1``: ZeRO stage 1 over the default process group (DDP); checkpoints via
        :meth:`consolidate_state_dict`.
      pin_moments, host_margin: page-locked moments (``cpu`` mode, while pinned memory stays within half of the
        available memory); the fraction of host memory left free by the check before allocating (``MemoryError``
        naming the bytes; None: no check).
      speculate: host updates start during backward and ``step()`` commits or redoes them exactly (docs/torch.md),
        keeping copies of the weights and state (12 bytes per float32 parameter, 6 per fp16/bf16 one). None: where
        host memory has room for them after ``host_margin``; True: always; False: never (updates at ``step()``).
        Inside :meth:`last_micro_batch` the host updates run in place instead, without copies (faster, and not
        speculative: ``step()`` refuses a gradient the loop changed after that backward, as for GPU slots): with
        False, and with None once a step has seen every such gradient unchanged at ``step()`` (the first step, and
        every step after a refusal, speculates); True keeps speculating there.
        Their weights are uploaded at ``step()`` in a loop that says nothing of its last micro-batch (the weights
        read between backward and ``step()``, by a forward or any other reader, are torch's: the old ones); during
        backward under :meth:`last_micro_batch` and where Accelerate's gradient state marks the last micro-batch
        (HF Trainer and ``accelerator.accumulate`` with gradient accumulation): there a module's forward before
        ``step()`` rolls those updates back first (it reads the old weights; ``step()`` redoes them), a second
        backward raises, and other reads of the parameters in between see the new weights.
      bounded_staging: host memory of the host updates bounded by their state (4 bytes per bf16 parameter with
        torch's bf16 state, 12 with ``master_weights``, 8 per float32 one) plus a ring of pinned chunks
        (``stream_ring_bytes``): the gradient and the weights are read from the GPU chunk by chunk as each update
        runs, inside :meth:`last_micro_batch` during backward (not speculative: as GPU slots there), else at
        ``step()``; nothing speculative, no copy of the weights or gradients kept (docs/memory.md). With
        ``master_weights`` (one process, plain parameters) one backward per ``step()``: the scheme's fp32 sum is
        that gradient; a second backward, ``max_grad_norm``/:meth:`clip_grad_norm` and GradScaler's unscaling
        inside ``step()`` (not ``fused``) raise ``NotImplementedError`` before anything changes. Not with
        ``mode="gpu"`` (nothing staged). Default False.
      grad_copies: how ``step()`` checks a speculated gradient on a GPU that the loop changed in place after its
        hook (every trainer's ``clip_grad_norm_`` moves its version, even multiplying by 1.0; ``GradScaler.unscale_``):
        True: the hook keeps a GPU copy of the gradient (``clone``) until ``step()`` compares ``param.grad`` with it
        on the GPU (the speculated gradients' bytes once more in GPU memory from backward to ``step()``: 2 per
        bf16/fp16 parameter, 4 per float32 one); False: ``step()`` compares with the gradient's host copy sent back
        over PCIe (no GPU memory; those bytes over PCIe at ``step()``). Copies are kept only in steps after one
        whose check compared bits (a loop that never changes gradients in place keeps none). None (default): True
        where, at the first copy, the GPU's free memory (the driver's and torch's cached) less a tenth of its total
        holds the copies and the gradients not allocated yet, else False with a warning; an out-of-memory copy
        turns them off, with a warning. CPU parameters need none. Not with ``speculate=False`` or
        ``bounded_staging`` (nothing speculated). Both give torch's bits.
    """

    _step_supports_amp_scaling = True  # GradScaler leaves unscaling to step() (fused optimizers' protocol): _amp()
    _torch_name = "Adam"  # the torch.optim class it reproduces
    _force_decoupled = False  # OffloadAdamW: decoupled weight decay, re-forced on every loaded group (as AdamW)

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, *, foreach: bool | None = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool = False, master_weights: bool = False,
                 max_grad_norm: float | None = None, mode: str = "cpu", overlap_forward: torch.nn.Module | None = None,
                 gpu_state_bytes: int | str = 0, gpu_share: float = 0.3, gpu_params: str = "first",
                 threads: int | None = None, worker_cores: Any = None, zero_stage: int = 0, worker_nice: int = 5,
                 eager_blocks: int | None = None, pin_moments: bool = False,
                 host_margin: float | None = _budget.MARGIN, speculate: bool | None = None,
                 bounded_staging: bool = False, grad_copies: bool | None = None):
        # What __setstate__ (copy.deepcopy, pickle) rebuilds the optimizer from.
        self._init_kwargs = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, foreach=foreach,
            maximize=maximize, capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay, master_weights=master_weights,
            max_grad_norm=max_grad_norm, mode=mode, overlap_forward=overlap_forward, gpu_state_bytes=gpu_state_bytes,
            gpu_share=gpu_share, gpu_params=gpu_params, threads=threads, worker_cores=worker_cores,
            zero_stage=zero_stage, worker_nice=worker_nice, eager_blocks=eager_blocks, pin_moments=pin_moments,
            host_margin=host_margin, speculate=speculate, bounded_staging=bounded_staging, grad_copies=grad_copies)
        betas = R.validate(lr, betas, eps, weight_decay, foreach, capturable)
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
        if not isinstance(master_weights, bool):
            raise ValueError(f"Invalid master_weights: {master_weights!r} (must be a bool)")
        if speculate is not None and not isinstance(speculate, bool):
            raise ValueError(f"Invalid speculate: {speculate!r} (must be None, True or False)")
        if grad_copies is not None and not isinstance(grad_copies, bool):
            raise ValueError(f"Invalid grad_copies: {grad_copies!r} (must be None, True or False)")
        if grad_copies and (speculate is False or bounded_staging):
            raise ValueError("grad_copies=True keeps copies for the check of speculative updates, which "
                             f"{'speculate=False' if speculate is False else 'bounded_staging=True'} never makes "
                             "(leave grad_copies unset)")
        P.check_bounded(bounded_staging, mode, master_weights, speculate, max_grad_norm)
        D.worker_cores(worker_cores, torch.device("cpu"))  # a bad value raises here, not at the first parameter
        gated = overlap_forward is not None
        self.master_weights = master_weights
        self._zero = D.ZeroPartition(gated) if zero_stage else None  # zero_stage=1: which rank owns each parameter
        self._consolidated: dict[str, Any] | None = None  # zero_stage=1: consolidate_state_dict()'s
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.mode, self._gpu_params = mode, gpu_params
        self._slots = P.Slots(mode=mode, gpu_state_bytes=gpu_state_bytes, gpu_share=gpu_share, gpu_params=gpu_params,
                              host_margin=host_margin, worker_cores=worker_cores, threads=threads,
                              pin_moments=pin_moments, worker_nice=worker_nice, eager_blocks=eager_blocks, gated=gated,
                              bounded=bounded_staging)
        self._state_view = S.StateView(self._slots)  # opt.state: the engine's, per parameter
        self._gate = Gate(self._slots, gated)
        ref = weakref.ref(self)
        self._grads = GradCapture(self._slots, self._gate, clipping=self.max_grad_norm is not None,
                                  slot_hyper=lambda rec: ref()._slot_hyper(rec), speculate=speculate,
                                  grad_copies=grad_copies)
        self._last_norm: torch.Tensor | None = None
        # Released once, by close() or collection of this object (not of a copy, e.g. LightningOptimizer's).
        self._release = weakref.finalize(self, _release, self._slots, self._gate)
        self._deferred = True  # add_param_group inside __init__: registered once every group is known (one plan)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        try:
            super().__init__(params, defaults)
            if fused:  # torch's checks, after the parameters'
                if differentiable:
                    raise RuntimeError("`fused` does not support `differentiable`")
                if foreach:
                    raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
            self._deferred = False
            self._sync()  # every parameter registered at once (one plan)
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

    @property
    def state(self) -> S.StateView:
        """Per parameter, its state as torch shows it (views of the host state; :class:`~._state.StateView`)."""
        return self._state_view

    @state.setter
    def state(self, value: Any) -> None:
        # Optimizer.__init__'s empty defaultdict, or a user's reset (opt.state = defaultdict(dict)): fresh state.
        if value is self.__dict__.get("_state_view"):
            return
        if isinstance(value, Mapping) and len(value) == 0:
            if self._engine is not None:
                self._check_open("state")
                self._load({}, {})
            return
        raise NotImplementedError(f"{type(self).__name__}.state cannot be replaced by another mapping (the state "
                                  "lives in the engine): use load_state_dict(), or assign an empty mapping to reset it")

    @staticmethod
    def host_memory_plan(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *, mode: str = "cpu",
                         gpu_share: float = 0.3, gpu_params: str = "first", gpu_state_bytes: int = 0,
                         pin_moments: bool = False, host_margin: float | None = _budget.MARGIN,
                         amsgrad: bool = False, master_weights: bool = False, bounded_staging: bool = False,
                         threads: int | None = None, host_memory: int | None = None,
                         options: bool = False) -> dict[str, Any]:
        """The host memory ``OffloadAdamW(params, ...)`` will take, and what the host has, without allocating
        anything: bytes per part (``state_pinned``, ``state_pageable``, ``masters_*``, ``staging_*``), ``pinned``,
        ``pageable``, ``needed``, ``available``, ``usable``, ``pin_moments`` and ``fits`` (see
        :func:`trainstream.core._budget.plan`); after construction also in :meth:`stats` as ``host_plan_*``. Pass the
        optimizer's ``amsgrad``, ``master_weights``, ``bounded_staging`` and ``threads`` (the state's layout, the
        stream ring's size; a group's own ``amsgrad`` counts). ``host_memory``: plan for a machine with that many
        bytes available instead of this one. ``options=True`` adds ``options``: per setup (torch's state or
        ``master_weights``; ``cpu``, ``hybrid``, ``gpu``; ``bounded_staging``; with this ``gpu_state_bytes``) its
        ``needed`` bytes, ``fits``, ``bytes_per_param``, ``fixed_bytes`` and ``max_params``, the largest model of
        these proportions that fits; and ``fitting``, the first setup that fits (docs/memory.md). ``params`` may be on
        the ``meta`` device (a model not built: planned as on CUDA)."""
        return F.host_memory_plan(params, mode=mode, gpu_share=gpu_share, gpu_params=gpu_params,
                                  gpu_state_bytes=gpu_state_bytes, pin_moments=pin_moments, host_margin=host_margin,
                                  amsgrad=amsgrad, master_weights=master_weights, bounded_staging=bounded_staging,
                                  threads=threads, host_memory=host_memory, options=options)

    def _params_with_grads(self) -> list[torch.Tensor]:
        """Every parameter with a gradient, in group order (zero_stage=1: every rank's)."""
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    # -- the user API -----------------------------------------------------------------------

    def _check_open(self, what: str | None = None) -> None:
        """Refuse calls once closed, and checkpoint method ``what`` between a last_micro_batch() backward and step()."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if what is not None and self._grads.refused and what != "load_state_dict":
            raise RuntimeError(self._grads.refused)
        if what is not None and self._grads.done and not self._grads.refused:
            raise RuntimeError(f"{type(self).__name__}.{what}() between a last_micro_batch() backward and step(): "
                               f"{len(self._grads.done)} parameters are updated already; call step() first")

    @contextlib.contextmanager
    def last_micro_batch(self):
        """Mark the backward inside this block as the last micro-batch of the step (an explicit hint;
        ``docs/torch.md``). Host updates start as each gradient is ready and upload their weights at once (no
        forward or backward may run before ``step()``); ``param.grad`` stays. The first step's are speculative:
        ``clip_grad_norm_``, ``GradScaler`` and in-place edits give torch's bits (``step()`` commits or redoes).
        Where that step found every gradient unchanged at ``step()``, the next ones run in place, without kept
        copies (``speculate=None``; ``False``: from the first): ``step()``, ``clip_grad_norm_``, GradScaler and
        ``zero_grad()`` then refuse a gradient changed or dropped since (reload a checkpoint), and the next step
        speculates again; ``speculate=True`` always speculates. GPU slots (``gpu`` mode; ``hybrid``'s with ``gpu_params="last"``) launch their kernels from the hooks, not
        speculatively: ``step()`` refuses a gradient changed since (none launched with ``max_grad_norm``).
        ``state_dict()`` and ``load_state_dict()`` raise until ``step()``. Not with several processes and plain
        (non-DTensor) parameters. With ``hybrid`` it is faster at ``worker_nice=19``."""
        self._check_open()
        self._sync()  # a parameter that left the groups is not updated from its hook
        if D.world()[1] > 1 and not all(D.is_dtensor(rec.param) for rec in self._slots):
            raise NotImplementedError(f"{type(self).__name__}.last_micro_batch() with plain (non-DTensor) parameters "
                                      "in a run of several processes is not built: the updates would use this rank's "
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
        Returns the total norm (a tensor); raises where GPU kernels were launched under :meth:`last_micro_batch`
        (``mode="gpu"``: they cannot be redone), and with ``master_weights`` and ``bounded_staging`` (the fp32 sums'
        norm is not read chunk by chunk). ``parameters``: default,
        this optimizer's in param-group order (as Lightning lists them); torch sums the norms in the order given, so
        pass ``model.parameters()`` for the bits of ``clip_grad_norm_(model.parameters(), ...)`` if groups reorder."""
        self._check_open()
        params = self._params_with_grads() if parameters is None else [p for p in parameters if p.grad is not None]
        self._last_norm = self._grads.clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return self._last_norm

    def _amp(self) -> tuple[bool, dict[int, float]]:
        """GradScaler's protocol (``_step_supports_amp_scaling``): whether to skip this step, and the fused slots'
        scales (their kernels divide, as torch's fused step); the others' ``param.grad`` is unscaled as
        ``GradScaler.unscale_`` does (:meth:`trainstream.torch._grads.GradCapture.amp`)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False, {}
        try:
            return self._grads.amp(found_inf, getattr(self, "grad_scale", None), self._params_with_grads())
        except BaseException:  # GradScaler deletes them after a step() that returns only: not left for the next
            for name in ("found_inf", "grad_scale"):
                self.__dict__.pop(name, None)
            raise

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter whose ``grad`` is not ``None`` (the class docstring says when it is visible)."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync()  # the groups as they are now: parameters added, replaced or removed since
        changes = self._check_groups()  # refused before anything changes
        engine = self._engine
        if engine is None and self._zero is None:
            return loss
        if engine is not None:
            engine.check_error()
            self._follow(changes)
        skip, grad_div = self._amp()
        if skip:
            return loss
        self._consolidated = None
        for rec in self._slots:
            self._slots.follow(rec)
            self._grads.hook(rec)  # a host slot unfrozen after construction
        if self.max_grad_norm is not None:
            self.clip_grad_norm(self.max_grad_norm)
        updates, coefs, eager = self._grads.updates(self.param_groups, R.hyper)
        self._gate.mark(u[0] for u in updates)  # first: if the engine raises part-way, what it queued is waited for
        if engine is not None:
            try:
                engine.step(updates, coefs=coefs, grad_div={u[0]: grad_div[u[0]] for u in updates
                                                             if u[0] in grad_div})
            finally:
                if not self._gate.active:
                    engine.wait_step()  # every reader on the current stream sees the new weights
            self._grads.prefetch()
        if self._zero is not None:  # after the uploads (the current stream waits for them)
            self._zero.broadcast(self.param_groups)
        if self._slots.auto_gpu_state and engine is not None and (updates or eager):
            self._slots.move_auto()  # after a step that updated: torch's pool holds its peak
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; the host copies of the gradients are forgotten too."""
        self._check_open()
        self._grads.check_zero_grad()
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
        ``local_rank``, ``local_world_size``, ``worker_cores`` (cores the workers are bound to; 0: unbound); the
        speculation counters (docs/torch.md), of them ``spec_checks_device``/``spec_checks_staged``: gradients
        compared bit for bit with a GPU copy / with their host copy, ``spec_copy_peak_bytes``: the most bytes of GPU
        copies held at once (``grad_copies``)."""
        self._check_open()
        where = dict(zip(("rank", "world_size", "local_rank", "local_world_size", "worker_cores"),
                         (*D.world(), *D.local_world(), len(self._slots.cores or ()))))
        copies = self._grads.copies
        return {**({} if self._engine is None else self._engine.stats()),
                "spec_checks_device": float(copies.checked["device"]),
                "spec_checks_staged": float(copies.checked["staged"]),
                "spec_copy_peak_bytes": float(copies.peak),
                **{f"host_plan_{k}": v for k, v in self._slots.host_plan.items()},
                **{k: float(v) for k, v in where.items()}}

    # -- copies -----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickling copy: the constructor's arguments, the param groups (their parameters)
        and the state per parameter (views, copied by them). The copy is an independent optimizer, as torch's."""
        self._check_open("__getstate__")
        if self._zero is not None:
            raise NotImplementedError(f"copy.deepcopy/pickle of {type(self).__name__}(zero_stage=1): each rank holds "
                                      "only its partition; save consolidate_state_dict() + state_dict() instead")
        state = {rec.param: entry for rec in self._slots.live() if (entry := S.entry(self._slots, rec))}
        state.update(self._state_view.pending)  # entries moved to parameters not registered yet
        return {"init_kwargs": self._init_kwargs, "param_groups": [dict(g) for g in self.param_groups],
                "state": state, "extras": dict(self._state_view.extras)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Build the optimizer a :meth:`__getstate__` describes (its own engine and workers), then load its state."""
        if "init_kwargs" not in state:
            raise TypeError(f"{type(self).__name__}.__setstate__: not a state of {type(self).__name__}.__getstate__ "
                            "(use load_state_dict for a state dict)")
        OffloadAdam.__init__(self, state["param_groups"], **state["init_kwargs"])
        loads = {}
        for p, entry in state["state"].items():
            rec = self._slots.of(p)
            if rec is not None:
                loads[rec.sid] = S.parse_entry(rec.sid, entry, p, rec.recipe)
        self._load(loads, state["extras"])
        for p, entry in state["state"].items():  # a parameter in no group keeps its entry, as in torch's copy
            if self._slots.of(p) is None:
                self._state_view.pending[p] = dict(entry)

    def __copy__(self):
        raise NotImplementedError(f"copy.copy of {type(self).__name__}: a shallow copy would share the host state "
                                  "with this optimizer; use copy.deepcopy (an independent optimizer) or this one")

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued work, stop the worker threads, free host memory, remove hooks."""
        self._release()  # once; drains queued work (a worker failure was raised already)


class OffloadAdamW(OffloadAdam):
    r"""``torch.optim.AdamW`` with its state in host memory, bit-identical to it: :class:`OffloadAdam` with decoupled
    weight decay (``weight_decay`` default 0.01; no ``decoupled_weight_decay`` argument, as ``AdamW``), the arguments
    in ``torch.optim.AdamW``'s order. Everything else (``master_weights``, modes, refusals, the loop's rules) is
    :class:`OffloadAdam`'s."""

    _torch_name = "AdamW"
    _force_decoupled = True

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool = False, max_grad_norm: float | None = None, mode: str = "cpu",
                 overlap_forward: torch.nn.Module | None = None, gpu_state_bytes: int | str = 0,
                 gpu_share: float = 0.3, gpu_params: str = "first", threads: int | None = None,
                 worker_cores: Any = None, zero_stage: int = 0, worker_nice: int = 5,
                 eager_blocks: int | None = None, pin_moments: bool = False,
                 host_margin: float | None = _budget.MARGIN, speculate: bool | None = None,
                 bounded_staging: bool = False, grad_copies: bool | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights, max_grad_norm=max_grad_norm,
                         mode=mode, overlap_forward=overlap_forward, gpu_state_bytes=gpu_state_bytes,
                         gpu_share=gpu_share, gpu_params=gpu_params, threads=threads, worker_cores=worker_cores,
                         zero_stage=zero_stage, worker_nice=worker_nice, eager_blocks=eager_blocks,
                         pin_moments=pin_moments, host_margin=host_margin, speculate=speculate,
                         bounded_staging=bounded_staging, grad_copies=grad_copies)
