"""A host slot's buffers, laid out by its recipe (:class:`~trainstream.contract.TorchRecipe`), and its state as
dicts (:func:`slot_state`, :func:`load_slot_state`, :func:`reload_weights`); the host placement (``_host.py``)
runs the pipeline over them. No torch or jax import.

Buffers per recipe (:func:`trainstream.core._budget.host_bytes` counts the same):

* float32 parameters: ``master`` (the weights, pinned: the upload source), ``exp_avg``, ``exp_avg_sq`` (and
  ``max_exp_avg_sq``) float32, the pinned gradient staging;
* a master (``master=True``, fp16/bf16 parameters): an fp32 ``master`` and moments, pageable; the pinned gradient
  staging, into which the updated weights are written for the upload where the backend allows
  (``weights_in_grad_stage``), else a pinned weight staging; with ``grad_sums`` an fp32 gradient sum;
* fp16/bf16 without a master: ``weights``, the parameter's bits (pinned: updated in place and uploaded; re-read
  where the weights change outside the optimizer), the moments in the parameter's dtype, the pinned gradient
  staging;
* a *streamed* slot (bounded staging, :mod:`trainstream.core._stream`): the moments, and an fp16/bf16 parameter's
  fp32 master; no weights or staging of its own: each update reads the gradient and the weights from the device
  chunk by chunk through the placement's stream ring and uploads each chunk's new weights from it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import _hostmem
from .. import contract as C
from ._budget import slot_layout

__all__ = ["STATE_KEYS", "DevicePowers", "HostSlot", "PreCopy", "SlotStateIO", "Speculation", "check_host_recipe", "load_slot_state", "new_slot",
           "reload_weights", "slot_state", "to_state_array"]

#: The keys of a slot's state dict (``max_exp_avg_sq`` with amsgrad, ``master`` with a master).
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
#: The buffers an update writes (those a slot has), kept by a speculative update.
_UPDATED = ("master", "weights", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@dataclass(eq=False)
class HostSlot:
    id: int
    param: Any
    numel: int
    dtype: str
    platform: str
    recipe: C.TorchRecipe | None  # None: the optax convention (fp32 master layout)
    master: Any  # HostBuffer: fp32 master, or a float32 parameter's weights; None without a master
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any = None
    weights: Any = None  # fp16/bf16 without a master: the weights' bits (updated in place, uploaded)
    grad_stage: Any = None
    param_stage: Any = None  # a master's rounded weights to upload; may be grad_stage
    grad_sum: Any = None  # a master's fp32 micro-batch gradient sums
    streamed: bool = False  # bounded staging: gradient and weights through the stream ring (module docstring)
    step: int = 0
    # The gradient staging, as the caller made it: whether that copy is still the gradient to update from is
    # the caller's to decide (the torch adapter's per-parameter record), never this slot's. ``staged``: an
    # offload_grad since the slot's last update or discard_grads (step() updates only such a slot); ``summed``:
    # the gradients since then are in grad_sum (offload_grad(accumulate=True)).
    staged: bool = False
    summed: bool = False
    landed: Any = None  # completion event of the last gradient copy
    grad_keep: Any = None  # the device gradient, alive until its copy completed
    ready: Any = None  # completion event of the last weight upload
    inflight: int = 0  # batches queued, running or chained
    chain: collections.deque = field(default_factory=collections.deque)  # batches waiting for the running one
    cond: threading.Condition = field(default_factory=threading.Condition)
    nbytes: tuple[int, int] = (0, 0)  # the pinned and pageable bytes of its buffers, as counted
    # Speculation (``_host.py``'s module docstring): the pre-step copies of the weights and state an update from a
    # gradient hook wrote over (name -> array, allocated at the first one), and that update's record while it is
    # neither committed nor rolled back.
    backup: dict | None = None
    spec: "Speculation | None" = None
    pre: "PreCopy | None" = None  # the copies being taken ahead of the next speculative update (prefetch_backups)

    @property
    def upload_src(self) -> Any:
        """The buffer the new weights are uploaded from."""
        if self.weights is not None:
            return self.weights
        return self.master if self.param_stage is None else self.param_stage

    @property
    def live(self) -> bool:
        return self.exp_avg is not None

    @property
    def speculable(self) -> bool:
        """Whether an update of this slot can be speculative: its gradient staging is only read by the update (not
        a master's, which the rounded weights overwrite and whose fp32 sums the update reads)."""
        return (self.live and self.grad_stage is not None and self.grad_sum is None
                and (self.weights is not None or self.dtype == "float32"))

    def backed_up(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(live, copy)`` of every buffer an update writes (the weights, the moments), the copies allocated once
        (pageable: only the workers read them)."""
        names = [n for n in _UPDATED if getattr(self, n) is not None]
        if self.backup is None:  # on huge pages where the OS gives them, as the state's
            self.backup = {n: _hostmem.empty(getattr(self, n).array.size, getattr(self, n).array.dtype) for n in names}
        return [(getattr(self, n).array, self.backup[n]) for n in names]

    def backup_bytes(self) -> int:
        """Host bytes of :meth:`backed_up`'s copies (allocated or not)."""
        return sum(getattr(self, n).array.nbytes for n in _UPDATED if getattr(self, n) is not None)

    def free(self) -> None:
        self.nbytes, self.staged, self.summed = (0, 0), False, False
        self.master = self.exp_avg = self.exp_avg_sq = self.max_exp_avg_sq = self.weights = None
        self.grad_stage = self.param_stage = self.grad_sum = self.grad_keep = self.ready = self.landed = None
        self.param = self.backup = self.spec = self.pre = None


@dataclass(eq=False)
class Speculation:
    """A slot's update queued from a gradient hook before ``step()`` knew its gradient was final: the step count
    before it, whether its weights were uploaded (``upload``: at once; else at ``commit``), the seconds its chunks
    took (lost if it is rolled back) and whether it completed; ``done``, ``committed`` and ``after`` are read and
    written under the slot's ``cond`` (the last chunk and :meth:`~trainstream.core._speculate.Speculative.commit`
    agree there which of them uploads the weights of an update committed while it ran)."""

    step: int
    upload: bool
    seconds: list = field(default_factory=list)
    done: bool = False  # every chunk ran (a failed one leaves the copies partial: never restored)
    committed: bool = False  # committed before it finished: its last chunk uploads the weights, after ``after``
    after: Any = None


#: What each buffer is, in allocation errors.
_WHAT = {"master": "adamw.master_fp32", "exp_avg": "adamw.exp_avg", "exp_avg_sq": "adamw.exp_avg_sq",
         "max_exp_avg_sq": "adamw.max_exp_avg_sq", "weights": "adamw.weights", "grad_stage": "grad.staging",
         "grad_sum": "grad.sum_fp32"}
#: CUDA fused's device powers are fetched this many steps ahead (one device round trip per block).
_POW_BLOCK = 1024


def new_slot(sid: int, param: Any, numel: int, dtype: str, platform: str, recipe: C.TorchRecipe | None,
             grad_sums: bool, alloc: Callable, pin_moments: bool, weights_in_grad_stage: bool, backend: Any,
             streamed: bool = False) -> HostSlot:
    """A slot with the buffers of :func:`~trainstream.core._budget.slot_layout` (``alloc(numel, dtype, pinned,
    what, tally)``), moments zeroed, the weights read in where it keeps them (module docstring)."""
    tally = [0, 0]  # counted once all are allocated (a failure drops them)
    bufs = {}
    for name, (bdtype, kind) in slot_layout(recipe, dtype, grad_sums, streamed).items():
        bufs[name] = alloc(numel, bdtype, pin_moments if kind == "state" else kind == "pinned", _WHAT[name], tally)
    for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        if name in bufs:
            bufs[name].array[:] = 0
    stage = None
    if "master" in bufs and dtype != "float32" and not streamed:
        stage = bufs["grad_stage"] if weights_in_grad_stage else alloc(numel, dtype, True, "param.staging", tally)
    s = HostSlot(sid, param, numel, dtype, platform, recipe, param_stage=stage, streamed=streamed, **{
        k: bufs.get(k) for k in ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "weights", "grad_stage",
                                 "grad_sum")})
    if s.weights is not None:
        read_weights(backend, param, s.weights.array, dtype)
    elif s.master is not None:
        backend.param_to_host_f32(param, s.master.array)
    s.nbytes = (tally[0], tally[1])
    return s


class DevicePowers:
    """CUDA fused's ``(1 - powf(B1, t), 1 - powf(B2, t))`` as the parameters' device computes them: the backend's
    ``device_pow(base, t0, count)`` (float32 ``powf(f(base), t)`` for ``t0 <= t < t0 + count``), fetched
    :data:`_POW_BLOCK` steps ahead; without one (or for other recipes) None: the host's powf, an emulation."""

    def __init__(self, backend: Any):
        self._fn = getattr(backend, "device_pow", None)
        self._tables: dict[float, tuple[int, np.ndarray]] = {}
        self._lock = threading.Lock()

    def bias(self, recipe: C.TorchRecipe | None, step: int, hp: C.AdamWHyperParams):
        if self._fn is None or recipe is None or C.torch_family(recipe) != "cuda_fused":
            return None
        t = min(step, C.TORCH_MAX_STEP)
        out = []
        with self._lock:  # eager updates come from hook threads
            for b in (hp.beta1, hp.beta2):
                key = float(np.float32(b))
                t0, table = self._tables.get(key, (0, None))
                if table is None or not t0 <= t < t0 + table.size:
                    t0, table = t, np.asarray(self._fn(key, t, _POW_BLOCK), np.float32).reshape(-1)
                    self._tables[key] = (t0, table)
                out.append(np.float32(1) - table[t - t0])
        return out[0], out[1]


def _bits_of(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the uint16 bits of ``dtype`` (rounded to nearest even, as torch casts)."""
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).view(np.uint16)
    return C.f32_to_bf16_bits(values)


def to_state_array(a: Any, dtype: str, numel: int, what: str) -> np.ndarray:
    """A loaded state array as the slot keeps it: float32, or the uint16 bits of fp16/bf16 (uint16 input is taken
    as those bits; a float array is cast as torch's ``load_state_dict`` casts state to the parameter's dtype)."""
    arr = np.asarray(a).reshape(-1)
    if arr.size != numel:
        raise ValueError(f"load_state: {what} has {arr.size} elements, expected {numel}")
    if dtype == "float32":
        return arr.astype(np.float32, copy=False)
    if arr.dtype == np.uint16:
        return arr
    return _bits_of(arr.astype(np.float32, copy=False), dtype)


def read_weights(backend: Any, param: Any, out: np.ndarray, dtype: str) -> None:
    """The parameter's bits into ``out`` (uint16 for fp16/bf16): the backend's ``param_to_host`` where it has one,
    else through float32 (exact: fp16/bf16 values are float32 values)."""
    direct = getattr(backend, "param_to_host", None)
    if direct is not None:
        direct(param, out)
        return
    tmp = np.empty(out.size, np.float32)
    backend.param_to_host_f32(param, tmp)
    out[:] = _bits_of(tmp, dtype)


def slot_state(s: HostSlot, copy: bool = True) -> dict[str, Any]:
    """The slot's state dict: ``step``; ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad) in the state
    dtype (float32, or the uint16 bits of fp16/bf16); ``master`` (float32) with a master. Copies, or the buffers
    themselves (``copy=False``: changing them changes the state)."""
    out: dict[str, Any] = {"step": s.step}
    bufs = [("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq), ("max_exp_avg_sq", s.max_exp_avg_sq)]
    if s.master is not None and s.dtype != "float32":
        bufs.append(("master", s.master))
    for key, buf in bufs:
        if buf is not None:
            out[key] = buf.array.copy() if copy else buf.array
    return out


def load_slot_state(s: HostSlot, state: Mapping, backend: Any) -> None:
    """Replace the slot's state by ``state`` (the keys of :func:`slot_state`; checked by the engine). Without
    ``master`` a master is re-read from the weights; without a master the weights' bits are re-read too."""
    sd = C.state_dtype(s.recipe) if s.recipe is not None else "float32"
    for key, buf in (("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq), ("max_exp_avg_sq", s.max_exp_avg_sq)):
        if buf is not None:
            buf.array[:] = to_state_array(state[key], sd, s.numel, key)
    master = state.get("master")
    if s.weights is not None:
        read_weights(backend, s.param, s.weights.array, s.dtype)
    elif master is not None and s.dtype != "float32":
        s.master.array[:] = np.asarray(master, np.float32).reshape(-1)
    elif s.master is not None:  # (a streamed slot without a master reads the weights at each update)
        backend.param_to_host_f32(s.param, s.master.array)
    s.step = int(state["step"])  # a staged gradient stays staged: the caller says whether to update from it


def reload_weights(s: HostSlot, backend: Any) -> None:
    """The weights were changed outside the engine: re-read them (a master keeps an fp16/bf16 element's fp32 value
    where it still rounds to the weight: :func:`trainstream.contract.merge_master`)."""
    if s.weights is not None:
        read_weights(backend, s.param, s.weights.array, s.dtype)
        return
    if s.master is None:  # a streamed slot without a master: its updates read the weights from the device
        return
    weights = np.empty(s.numel, np.float32)
    backend.param_to_host_f32(s.param, weights)
    C.merge_master(s.master.array, weights, s.dtype)


@dataclass(eq=False)
class PreCopy:
    """The kept copies of a slot taken ahead of its next speculative update, in the background
    (:meth:`~trainstream.core._speculate.Speculative.prefetch_backups`): per chunk of the update, :data:`FREE`,
    :data:`COPYING` or :data:`COPIED`, read and written under the slot's ``cond``; ``queued``: its batch submitted."""

    chunks: bytearray
    queued: bool = False


#: A :class:`PreCopy` chunk's states.
FREE, COPYING, COPIED = 0, 1, 2


def check_host_recipe(recipe: C.TorchRecipe | None, hp: C.AdamWHyperParams, grad_div: float | None) -> None:
    """``NotImplementedError`` for the one update the host's kernels do not reproduce: CUDA's fused Adam with L2
    decay, without amsgrad, GradScaler or maximize, rounds ``grad + param * weight_decay`` twice at some positions of
    torch's unrolled loop and once elsewhere, the positions depending on the tensors' alignment on the GPU
    (``kernels/adamw_torch.cu``); the device kernels reproduce it."""
    if (recipe is not None and recipe.platform == "cuda" and recipe.impl == "fused" and not recipe.decoupled
            and float(hp.weight_decay) != 0.0 and not recipe.amsgrad and not recipe.maximize and grad_div is None):
        raise NotImplementedError(
            "Adam's L2 weight decay with fused=True on CUDA parameters (no amsgrad, maximize or GradScaler) is not "
            "reproduced on the host: torch's fused CUDA kernel rounds grad + param*weight_decay differently at "
            "positions that depend on the tensors' alignment on the GPU. Use mode='gpu' (the device kernels "
            "reproduce it), AdamW (decoupled decay), or fused=False.")


class SlotStateIO:
    """The state methods of :class:`~trainstream.core._host.HostPlacement` (its slots, checks and waits): what a
    slot's state is, and its replacement; a speculative update still pending is rolled back first."""

    def state(self, sid: int, copy: bool = True) -> dict[str, Any]:
        """Slot ``sid``'s state dict once its queued work has run (:func:`~trainstream.core._hostslot.slot_state`):
        copies, or with ``copy=False`` the buffers themselves (changing them changes the state)."""
        self._check_open()
        s = self._slot(sid)
        self._unspeculate(s, settle=True)
        if not copy:  # the caller may change them: copies taken ahead would be stale
            self._halt_precopy(s)
        self._wait_idle(s)
        self.errors.check()
        return slot_state(s, copy)

    def set_recipe(self, sid: int, recipe: C.TorchRecipe) -> None:
        """Slot ``sid``'s updates queued from now on follow ``recipe`` (:meth:`Engine.set_recipe` checks it)."""
        self._check_open()
        self._unspeculate(self._slot(sid), settle=True)  # updated in another arithmetic than the step's
        self._slot(sid).recipe = recipe

    def grad_sum(self, sid: int) -> np.ndarray | None:
        """Slot ``sid``'s fp32 gradient sum once its queued work has run (the buffer itself: scaling it in place
        scales the gradient the next update uses), or None where its staged gradient is not a sum."""
        self._check_open()
        s = self._slot(sid)
        self._wait_idle(s)
        self.errors.check()
        return s.grad_sum.array if s.summed else None

    def reload_param(self, sid: int, param: Any = None) -> None:
        """The weights of slot ``sid`` were changed outside the engine (or its parameter replaced by
        ``param``, same size and dtype): re-read them (:func:`~trainstream.core._hostslot.reload_weights`)."""
        self._check_open()
        s = self._slot(sid)
        self._unspeculate(s)  # from the weights before the change
        self._halt_precopy(s)
        self._settle(s)
        if param is not None:
            s.param = param
        reload_weights(s, self.backend)

    def load_state(self, sid: int, state: Mapping) -> None:
        """:meth:`Engine.load_state`, which checks the arguments."""
        self._check_open()
        s = self._slot(sid)
        self._unspeculate(s)
        self._halt_precopy(s)
        self._settle(s)
        load_slot_state(s, state, self.backend)
