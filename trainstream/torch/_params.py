"""Parameter registration and placement for :class:`~trainstream.torch.OffloadAdamW`: the checks of a new
parameter, the engine (built by the first one), where each parameter's state goes (asked once of the core's
budget, :func:`trainstream.core._budget.assign`, whose answer the engine takes), the host memory plan checked
before anything is allocated, one :class:`Slot` record per registered parameter, and following weights that
were changed or replaced outside the optimizer (:meth:`Slots.follow`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import _cores
from ..backends.torch import _DTYPE_NAME, TorchBackend, torch_cpu_code
from ..core import Engine, _budget, _host
from . import _dist as D
from . import _recipe as R

__all__ = ["AUTO_GPU_HEADROOM", "Slot", "Slots", "check_bounded", "check_placement", "master_refusal",
           "ring_bytes"]

#: ``gpu_state_bytes="auto"`` leaves this fraction of the GPU's memory free (for the caching allocator's later
#: growth, other processes, fragmentation).
AUTO_GPU_HEADROOM = 0.1

_HINT = ("less state per process (FSDP2, or zero_stage=1 under DDP: each rank holds its share), mode='gpu' or "
         "'hybrid' (no staging for the GPU share: 12 instead of 14 bytes per bf16 parameter, 8 instead of 16 per fp32)")
#: Plan entries added up over the parameter groups (the others are the last check's).
_SUMMED = {*(f"{p}_{k}" for p in _budget.PARTS for k in ("pinned", "pageable")), "pinned", "pageable", "needed"}


def check_placement(mode: str, gpu_share, gpu_params: str, gpu_state_bytes) -> None:
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


def _facts(flat: Sequence[torch.Tensor], recipes: Sequence[R.TorchRecipe] | None = None) -> list[tuple]:
    """What the core's budget knows of parameters: ``(numel, dtype, trainable, recipe)`` of each (local) tensor
    (the recipe sizes its state: :func:`trainstream.core._budget.state_bytes`)."""
    recipes = [None] * len(flat) if recipes is None else recipes
    return [(D.local(p).numel(), _DTYPE_NAME.get(p.dtype, "float32"), p.requires_grad, r) for p, r in zip(flat, recipes)]


def grad_sums(p: torch.Tensor, recipe: R.TorchRecipe, where: str) -> bool:
    """Whether ``p``'s slot sums its micro-batch gradients in fp32 on the host (``master_weights=True``): a host
    slot of a master, a plain parameter in a single process (its hook sees each micro-batch's gradient; FSDP2 and
    DDP accumulate ``param.grad`` themselves, in its dtype)."""
    return recipe.master and where == "host" and not D.is_dtensor(p) and D.world()[1] == 1


def ring_bytes(threads: int | None, chunk: int | None = None) -> int:
    """The stream ring's bytes (bounded staging) for ``threads`` workers (None: this rank's default) and ``chunk``
    elements per job (None: the engine's default)."""
    threads = _cores.default_threads(D.local_world()[1]) if threads is None else threads
    chunk = _host.CHUNK_SIZE if chunk is None else chunk
    return _budget.stream_ring_bytes(threads, -(-chunk // _host.CHUNK_ALIGN) * _host.CHUNK_ALIGN)


def _plan(flat: Sequence[torch.Tensor], where: Sequence[str], recipes: Sequence[R.TorchRecipe], pin_moments: bool,
          margin: float | None, device: torch.device | None, streamed: bool = False, ring: int = 0,
          available: int | None = None) -> dict[str, float]:
    """The host memory plan (:func:`trainstream.core._budget.plan`) of registering ``flat`` with ``recipes`` where
    :func:`~trainstream.core._budget.assign` put them (resident state takes none; unsupported dtypes left out);
    ``streamed``: host slots with bounded staging, whose ring (``ring`` bytes) is new; ``available``: the host's
    memory (None: this host's)."""
    device = device or next((D.local(p).device for p in flat), None)
    cuda = device is not None and device.type in ("cuda", "meta")  # meta: a model planned, not built
    slots = [(D.local(p).numel(), _DTYPE_NAME[p.dtype], "streamed" if streamed and w == "host" else w, r,
              grad_sums(p, r, w) and not streamed)
             for p, w, r in zip(flat, where, recipes) if p.dtype in _DTYPE_NAME and w != "gpu_state"]
    ring = ring if streamed and any(s[2] == "streamed" for s in slots) else 0
    return _budget.plan(slots, margin=margin, pin_moments=pin_moments, can_pin=cuda,
                        weights_in_grad_stage=TorchBackend.weights_in_grad_stage, ring_bytes=ring,
                        available=available)


def check_bounded(bounded: Any, mode: str, master_weights: bool, speculate: bool | None,
                  max_grad_norm: float | None = None) -> None:
    """Refuse ``bounded_staging`` where it cannot apply (:class:`OffloadAdamW`, ``host_memory_plan``), and with
    ``master_weights`` what its fp32 gradient sums need the whole gradient for (``max_grad_norm``:
    :func:`master_refusal`)."""
    if not isinstance(bounded, bool):
        raise ValueError(f"Invalid bounded_staging: {bounded!r} (must be a bool)")
    if not bounded:
        return
    if mode == "gpu":
        raise ValueError("bounded_staging=True applies to the host updates (mode='cpu', hybrid's host share); "
                         "mode='gpu' stages nothing in host memory")
    if master_weights and max_grad_norm is not None:
        raise NotImplementedError(master_refusal(
            "max_grad_norm=", "clips the fp32 gradient sums with torch's norm of them, computed on the host over "
            "whole fp32 tensors, and multiplies them by the coefficient in float32"))
    if speculate:
        raise ValueError("speculate=True with bounded_staging=True: speculation keeps the staged gradient and copies "
                         "of the weights and state in host memory, which bounded staging does without (leave "
                         "speculate unset)")


def master_refusal(what: str, why: str, after: str = "Nothing was changed.", instead: Sequence[str] = ()) -> str:
    """The message refusing ``what`` (``why``: what the master scheme does there) with ``master_weights=True`` and
    ``bounded_staging=True``, whose update reads one backward's fp16/bf16 gradient chunk by chunk from the device:
    the scheme's fp32 sum is then that gradient converted, and nothing else of it is reproduced. ``after``: what
    was changed; ``instead``: what to do, before the two choices every refusal offers."""
    options = [*instead, "bounded_staging=False for this loop (the fp32 sums in host memory: 18 bytes per "
               "parameter)", "master_weights=False"]
    return (f"OffloadAdamW(master_weights=True, bounded_staging=True): {what} is not built: the master scheme "
            f"{why}, which a gradient read chunk by chunk from the device as each update runs cannot reproduce (the "
            "streamed update reproduces the scheme where one backward precedes each step(): its fp32 sum is that "
            f"gradient, as the loop left param.grad). {after} Instead: " + "; ".join(options) + ".")


@dataclass(eq=False)
class Slot:
    """One registered parameter: its engine slot, what the engine last saw of it (:meth:`Slots.follow`) and
    its gradient capture's part (:mod:`trainstream.torch._grads`)."""

    sid: int  # its slot id in the engine (registration order)
    param: torch.Tensor
    group: int | None  # the index of its param group; None: it left every group (its state kept, as torch keeps it)
    ptr: int  # data_ptr() of the (local) storage the engine writes
    version: Any  # D.version(param) when the engine last read it (the engine's own writes move none)
    meta: tuple  # (dtype, shape, device) of the local tensor
    recipe: R.TorchRecipe  # its arithmetic, fixed at registration (trainstream.torch._recipe)
    staged: Any = None  # _grads.StagedCopy: the hook's copy of param.grad in the engine's staging, or None
    sums: bool = False  # master_weights of fp16/bf16 weights: micro-batch gradients summed in fp32 on the host
    once: bool = False  # the same with bounded_staging: one backward per step, its gradient read from the device
    summed: int = 0  # the micro-batch gradients in that sum since the last step (0: none)
    touched: bool = False  # a fused step GradScaler skipped before the first update (torch made the entry then)
    hook: Any = None  # handle of its gradient hook (a host slot's, _grads.GradCapture.hook)
    gpu_hook: Any = None  # handle of a GPU slot's eager hook (installed by last_micro_batch)
    pre_hook: Any = None  # with sums: handle of the hook that lets the next micro-batch's gradient replace param.grad
    broken: bool = False  # with sums: param.grad was changed in place between micro-batches (step() refuses)
    released: bool = False  # its state freed (Slots.drop): the record stays only to keep the slot ids
    views: list = field(default_factory=list)  # weak references to its host state handed out as views (_state.entry)

    def holds_state(self, engine: Engine) -> bool:
        """Whether torch would hold a state entry for it (updated once, or a fused step GradScaler skipped)."""
        return not self.released and (self.touched or engine.get_step(self.sid) > 0)

    def views_held(self) -> bool:
        """Whether views of its host state handed out (``opt.state``, ``state_dict()``) are still alive: they may be
        changed in place at any time, so the engine takes no copies of that state ahead of an update."""
        if self.views:  # (a gradient hook asks every step: nothing to do where none was handed out)
            self.views = [r for r in self.views if r() is not None]
        return bool(self.views)

    def remove_hooks(self) -> None:
        for handle in (self.hook, self.gpu_hook, self.pre_hook):
            if handle is not None:
                handle.remove()
        self.hook = self.gpu_hook = self.pre_hook = None


class Slots:
    """The registered parameters of one optimizer, in slot order, the engine holding their state (built by the
    first one) and the host memory plan checked so far (``host_plan``). Iterating gives the *members* (parameters
    in a param group as of the optimizer's last look, :meth:`ParamGroups._sync`); :meth:`live` adds the records
    whose parameter left every group but whose state torch would keep. Holds nothing of the optimizer: its
    finalizer releases it (:meth:`release`)."""

    def __init__(self, *, mode: str, gpu_state_bytes: int | str, gpu_share: float, gpu_params: str,
                 host_margin: float | None, worker_cores: Any, threads: int | None, pin_moments: bool,
                 worker_nice: int, eager_blocks: int | None, gated: bool, bounded: bool = False):
        self.mode, self.gpu_share, self.gpu_params = mode, float(gpu_share), gpu_params
        self.auto_gpu_state = gpu_state_bytes == "auto"  # none at first, then what the GPU has free (move_auto)
        self.gpu_state_bytes = 0 if self.auto_gpu_state else int(gpu_state_bytes)
        self.device_elems = 0  # hybrid's budget of device elements, sized at construction (start)
        self.host_margin, self.worker_cores, self.eager_blocks = host_margin, worker_cores, eager_blocks
        self.gated = gated  # overlap_forward is set (refused with DTensor parameters)
        self.bounded = bounded  # bounded_staging: host slots streamed (trainstream.core._stream)
        self.engine_args = dict(threads=threads, pin_moments=pin_moments, worker_nice=worker_nice)
        self.engine: Engine | None = None
        self.device: torch.device | None = None  # the parameters' device, set with the engine
        self.cores: list[int] | None = None  # the workers' cores (worker_cores), set with the engine
        self.host_plan: dict[str, float] = {}
        self.launched: dict[int, Any] = {}  # slot ids updated from this step's hooks for good (_grads.GradCapture)
        self.closed = False
        self._records: list[Slot] = []
        self._of: dict[torch.Tensor, Slot] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Slot]:
        return iter([rec for rec in self._records if rec.group is not None])

    def live(self) -> list[Slot]:
        """The records holding a slot: members, and parameters that left every group with their state."""
        return [rec for rec in self._records if not rec.released]

    def empty(self) -> bool:
        """Whether no record holds a slot (nothing registered yet, or every one dropped)."""
        return not self.live()

    def leave(self, rec: Slot) -> None:
        """``rec``'s parameter left every param group: its hooks go (it is never updated again unless it comes
        back); its state stays where torch would keep one (:meth:`Slot.holds_state`), else it is freed (:meth:`drop`)."""
        rec.remove_hooks()
        rec.staged, rec.summed, rec.broken, rec.group = None, 0, False, None
        if not rec.holds_state(self.engine):
            self.drop(rec)

    def drop(self, rec: Slot) -> None:
        """Free ``rec``'s slot and forget its parameter (the id stays taken). Once no slot is held, the engine is
        closed: the next parameter starts a new one (e.g. on the device the model was moved to)."""
        rec.remove_hooks()
        self.engine.release(rec.sid)
        self._of.pop(rec.param, None)
        rec.released, rec.group, rec.param, rec.staged = True, None, None, None
        if self.empty():
            engine, self.engine, self.device, self.cores = self.engine, None, None, None
            self._records, self.host_plan = [], {}
            engine.close()

    def __getitem__(self, sid: int) -> Slot:
        return self._records[sid]

    def of(self, p: torch.Tensor) -> Slot | None:
        """``p``'s record, or None where it is not registered (e.g. another rank's under zero_stage=1)."""
        return self._of.get(p)

    def start(self, pairs: Sequence[tuple[torch.Tensor, int, R.TorchRecipe]],
              hook: Callable[[Slot], None] | None = None, names: Sequence[str] | None = None) -> list[Slot]:
        """Register the ``(parameter, group index, recipe)`` triples of a new optimizer, or the first ones after every
        slot was dropped (:meth:`add`): hybrid's share sized over them, the GPU share from the last parameter
        backwards with ``gpu_params="last"``."""
        if self.mode == "hybrid":
            self.device_elems = _budget.hybrid_elems(_facts([p for p, _, _ in pairs], [r for _, _, r in pairs]),
                                                     self.gpu_share,
                                                     self.gpu_state_bytes)
        return self.add(pairs, last=self.gpu_params == "last", hook=hook, names=names)

    def add(self, pairs: Sequence[tuple[torch.Tensor, int, R.TorchRecipe]], last: bool = False,
            hook: Callable[[Slot], None] | None = None, names: Sequence[str] | None = None) -> list[Slot]:
        """Register ``(parameter, group index, recipe)`` triples, all or none: each is checked, then the host memory
        (pinned moments that would not fit become pageable), before anything is allocated; ``hook(record)`` after
        each (its gradient hook); ``names``: how errors name each (default ``parameter <slot id>``). Returns the
        records."""
        n, plan, pin = len(self._records), self.host_plan, self.engine_args["pin_moments"]
        flat = [p for p, _, _ in pairs]
        try:
            where = self._reserve(flat, [r for _, _, r in pairs], last, names)
            for (p, group, recipe), w in zip(pairs, where):
                rec = self._register(p, group, w, recipe)
                if hook is not None:
                    hook(rec)
        except BaseException:  # leave the registry exactly as it was
            self.truncate(n)
            self.host_plan = plan
            self._pin_moments(pin)
            raise
        return self._records[n:]

    def truncate(self, n: int) -> None:
        """Drop the records (their hooks) and engine slots registered after the first ``n``."""
        for rec in self._records[n:]:
            rec.remove_hooks()
            self._of.pop(rec.param, None)
        del self._records[n:]
        if self.engine is not None:
            self.engine.truncate(n)

    def release(self) -> None:
        """Once, by close() or the optimizer's collection: remove the hooks, finish queued work, close the engine."""
        self.closed = True
        for rec in self._records:
            rec.remove_hooks()
        if self.engine is not None:
            self.engine.close()

    def _pin_moments(self, pin: bool) -> None:
        self.engine_args["pin_moments"] = pin
        if self.engine is not None and self.engine.host is not None:
            self.engine.host.pin_moments = pin

    def _reserve(self, flat: list[torch.Tensor], recipes: list[R.TorchRecipe], last: bool,
                 names: Sequence[str] | None = None) -> list[str]:
        """Check each new parameter (:meth:`_check_new`), ask the core where each goes and check the host memory
        that takes; returns where each goes (:data:`trainstream.core._budget.WHERE`)."""
        for j, (i, p) in enumerate(enumerate(flat, len(self._records))):
            self._check_new(p, names[j] if names else f"parameter {i}", self.device or D.local(flat[0]).device)
        eng, pin = self.engine, self.engine_args["pin_moments"]
        where = _budget.assign(_facts(flat, recipes), self.mode, device_elems=self.device_elems,
                               device_used=eng.device_elems_used if eng is not None else 0,
                               gpu_state_bytes=self.gpu_state_bytes,
                               gpu_state_used=eng.gpu_state_used if eng is not None else 0, last=last)
        ring = 0
        if self.bounded and (eng is None or eng.host is None or eng.host._ring is None):  # allocated with the first
            cores = D.worker_cores(self.worker_cores, self.device or D.local(flat[0]).device) if flat else None
            threads = self.engine_args["threads"] or _cores.default_threads(D.local_world()[1], cores)
            ring = ring_bytes(eng.threads if eng is not None and eng.host is not None else threads)
        if self.bounded:  # master_weights without fp32 sums (FSDP2, DDP) is not streamed
            for j, (p, w, r) in enumerate(zip(flat, where, recipes)):
                if w == "host" and r.master and not grad_sums(p, r, w):
                    name = names[j] if names else f"parameter {len(self._records) + j}"
                    raise NotImplementedError(
                        f"OffloadAdamW(master_weights=True, bounded_staging=True) is built for one process with plain "
                        f"parameters, where the scheme's fp32 gradient sum of one backward is the gradient read from "
                        f"the device; {name} is a DTensor or in a run of several processes, whose gradients FSDP2/DDP "
                        "reduce and accumulate in param.grad (the master path staged there is not verified against "
                        "the streamed one). Use bounded_staging=False, or master_weights=False.")
        plan = _plan(flat, where, recipes, pin, self.host_margin, self.device, self.bounded, ring)
        _budget.check(plan, _HINT + (", pin_moments=False" if plan["pin_moments"] else "")
                      + ("" if self.bounded else ", bounded_staging=True (no staging as large as the model)"))
        if pin and not plan["pin_moments"]:  # pinned moments would not fit: pageable from here on
            self._pin_moments(False)
        self.host_plan = {k: v + self.host_plan.get(k, 0.0) if k in _SUMMED else v for k, v in plan.items()}
        return where

    def _check_new(self, p: torch.Tensor, name: str, device: torch.device) -> None:
        """Refuse parameter ``p`` (``name``: how to name it) before anything is allocated; ``device``: the earlier
        parameters'."""
        loc = D.local(p)
        if p.dtype not in _DTYPE_NAME:
            raise TypeError(f"OffloadAdamW supports float32, float16 and bfloat16 parameters; {name} has dtype "
                            f"{p.dtype}")
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"OffloadAdamW: {name} is not a dense strided tensor")
        if not loc.is_contiguous():
            raise ValueError(f"OffloadAdamW: {name} is not contiguous; make it contiguous first")
        if loc.device.type not in ("cuda", "cpu"):
            raise ValueError(f"OffloadAdamW: {name} is on unsupported device {loc.device}")
        if loc is not p and p.device_mesh.device_type != loc.device.type:
            raise ValueError(f"OffloadAdamW: {name} is a DTensor on a {p.device_mesh.device_type} mesh "
                             f"whose shard is on {loc.device.type} (FSDP2's CPUOffloadPolicy?): use either "
                             "CPUOffloadPolicy or OffloadAdamW, not both")
        if loc is not p and self.gated:
            raise NotImplementedError("OffloadAdamW: overlap_forward with FSDP2 (DTensor) parameters is not built "
                                      "(FSDP's all-gather reads the shards before a forward could wait); leave it "
                                      "unset: step() orders the uploads before FSDP's next all-gather.")
        if loc.device.type != "cuda" and (self.mode != "cpu" or self.gpu_state_bytes or self.auto_gpu_state):
            budget = "'auto'" if self.auto_gpu_state else self.gpu_state_bytes
            what = (f"mode={self.mode!r}" if self.mode != "cpu"
                    else f"gpu_state_bytes={budget} keeps state in GPU memory and")
            raise ValueError(f"OffloadAdamW {what} needs CUDA parameters; {name} is on {loc.device}")
        if loc.device != device:
            raise ValueError(f"OffloadAdamW: all parameters must be on one device; {name} is on "
                             f"{loc.device}, earlier ones on {device}")

    def _build_engine(self, device: torch.device) -> None:
        self.cores = D.worker_cores(self.worker_cores, device)
        args = dict(self.engine_args)
        if args["threads"] is None:  # this rank's share of the host
            args["threads"] = _cores.default_threads(D.local_world()[1], self.cores)
        try:
            self.engine = Engine(TorchBackend(device), mode=self.mode, device_elems=self.device_elems,
                                 gpu_state_bytes=self.gpu_state_bytes, gpu_state_later=self.auto_gpu_state,
                                 tc_code=torch_cpu_code() if device.type == "cpu" else 0,
                                 eager_blocks=self.eager_blocks, cores=self.cores, **args)
        except ImportError as exc:
            gs = " with gpu_state_bytes" if self.gpu_state_bytes or self.auto_gpu_state else ""
            raise ImportError(f"OffloadAdamW mode={self.mode!r}{gs} needs CuPy: pip install 'trainstream[cuda12]' "
                              f"or 'trainstream[cuda13]' ({exc})") from exc
        self.device = device

    def _register(self, p: torch.Tensor, group: int, where: str, recipe: R.TorchRecipe) -> Slot:
        """Give ``p`` (checked) of param group ``group`` a slot ``where`` the core said, with the arithmetic of
        ``recipe``; for a DTensor its local shard, maybe empty. The first one builds the engine."""
        loc = D.local(p)
        if self.engine is None:
            self._build_engine(loc.device)
        # Through loc.data: the engine's own writes move no _version.
        with _cores.bound(self.cores):  # the host state's first touch: on the workers' cores
            streamed = self.bounded and where == "host"
            once = grad_sums(p, recipe, where) and streamed  # the fp32 sum: one gradient, read from the device
            sums = grad_sums(p, recipe, where) and not streamed
            sid = self.engine.add_param(loc.data.view(-1), loc.numel(), _DTYPE_NAME[p.dtype], loc.device.type,
                                        trainable=p.requires_grad, where=where, grad_sums=sums, streamed=streamed,
                                        **R.engine_kwargs(recipe))
        assert sid == len(self._records)
        rec = Slot(sid, p, group, loc.data_ptr(), D.version(p), (loc.dtype, tuple(loc.shape), loc.device), recipe,
                   sums=sums, once=once)
        self._records.append(rec)
        self._of[p] = rec
        return rec

    def follow(self, rec: Slot) -> None:
        """Follow a change of ``rec``'s parameter made outside the optimizer: new values are re-read, a new storage
        of the same shape, dtype and device is written from now on; any other change raises, naming it."""
        p = rec.param
        loc, ver = D.local(p), D.version(p)
        if loc.data_ptr() == rec.ptr:
            if ver != rec.version:
                self.engine.reload_param(rec.sid)
        else:
            now = (loc.dtype, tuple(loc.shape), loc.device)
            if now != rec.meta or not loc.is_contiguous():
                what = ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(("dtype", "shape", "device"), rec.meta, now)
                                 if a != b) or "made non-contiguous"
                hint = " (float64 is not supported: float32, float16 or bfloat16)" if p.dtype not in _DTYPE_NAME else ""
                raise RuntimeError(f"OffloadAdamW: parameter {rec.sid} (group {rec.group}) was replaced after "
                                   f"the optimizer was built: {what}{hint} (model.double()/.half()/.to(), p.data = "
                                   "...). Build the optimizer after converting or moving the model.")
            self.engine.reload_param(rec.sid, loc.data.view(-1))
            rec.ptr = loc.data_ptr()
        rec.version = ver

    def move_auto(self) -> None:
        """``gpu_state_bytes="auto"`` after the first step that updated (OffloadAdamW's docstring says what moves):
        the slots moved are updated at step() from ``param.grad`` from now on, without their hooks' copies."""
        self.auto_gpu_state = False
        free, total = torch.cuda.mem_get_info(self.device)
        try:
            self.engine.move_state_to_gpu(max(0, int(free - AUTO_GPU_HEADROOM * total)))
        finally:  # also the slots moved before a failure
            self.gpu_state_bytes = self.engine.gpu_state_budget  # what parameters added later may take
            for rec in self._records:
                if rec.hook is not None and self.engine.on_device(rec.sid):
                    for handle in (rec.hook, rec.pre_hook):
                        if handle is not None:
                            handle.remove()
                    rec.hook = rec.pre_hook = rec.staged = None
                    rec.sums, rec.summed, rec.once = False, 0, False
