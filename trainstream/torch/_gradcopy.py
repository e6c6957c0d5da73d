"""Device copies for speculation: of the speculated gradients (``OffloadAdamW(grad_copies=)``, :class:`GradCopies`)
and shadows of the speculated weights (``weight_shadows=``, :class:`WeightShadows`).

Gradient copies are what speculation's bitwise check at
``step()`` (:mod:`~trainstream.torch._validate`) compares a gradient with, where the loop changed it in place
between backward and ``step()`` (every trainer's ``clip_grad_norm_`` moves its version, even multiplying by 1.0).

Without a copy that check sends the gradient's staged host copy back up over PCIe (its bytes once more: 6.2 GB,
156 ms at 3B bf16 on an H100, experiments/RESULTS.md). With one, the hook that starts a speculative update clones
``param.grad`` on the stream that produced it, before anything later on that stream can change it, and stages
the clone (the gradient's host copy reads the clone, so the clone holds exactly the bits the update reads);
``step()`` compares ``param.grad`` with the clone times the multiplier assumed, on the GPU, every slot's at once
with one synchronisation, and drops the clones as the verdicts are read. They cost GPU memory: the speculated
gradients' bytes once more at the end of backward, until ``step()``.

Which (:class:`GradCopies`): ``grad_copies=True`` keeps them, ``False`` never (the host copy over PCIe), ``None``
(the default) decides once, where the first copy would be kept, as speculation's host budget is decided: kept
where the device's free memory (the driver's, plus what torch's caching allocator holds unused) less
:data:`HEADROOM` of its total holds the copies of every speculable gradient on it and the gradients this backward
has yet to allocate; else the host copy, with a warning. Copies are kept only in steps after one whose check
compared bits (a loop that never changes its gradients in place keeps none: the version check suffices) and
only for gradients on a GPU (a CPU gradient is compared with its staging in host memory, no transfer); a copy the
allocator cannot give (out of memory) turns them off, with a warning, and that step compares over PCIe.

Weight shadows: in a loop that gives no sign that a backward is the last before ``step()`` (no
``last_micro_batch()``, no trusted Accelerate signal), a speculative update may not write the parameter before
``step()``: a read in between (another forward, the loop's own code) must see the old weights. Without a shadow its
new weights are uploaded at ``step()``, over PCIe, on the step's critical path (3B bf16: 6.2 GB, ~130 ms on an H100,
1.15x the in-GPU step; experiments/RESULTS.md). With one, the finished update uploads them at once, during backward,
into a device buffer shaped as the parameter that nothing else reads, and ``step()`` commits them with one device
copy (:meth:`~trainstream.core._speculate.Speculative.commit`: the GPU's bandwidth, a few milliseconds); a redo drops
the shadow, the parameter untouched. They cost the speculated weights' bytes once more on the GPU from each hook to
``step()``; ``weight_shadows`` decides as ``grad_copies`` does (one decision for both where both are None: the bytes
of both must fit). Not for CPU parameters (the upload there is a host copy at ``step()`` anyway).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from ..core import _budget
from ._params import AUTO_GPU_HEADROOM

__all__ = ["COPY_DEVICES", "GradCopies", "HEADROOM", "SHADOW_DEVICES", "WeightShadows", "device_memory"]

#: Device types whose gradients get copies (a private seam: the tests add ``"cpu"`` to run this path without a
#: GPU; the CPU needs none, its check reads the staging in host memory).
COPY_DEVICES = frozenset({"cuda"})
#: Device types whose speculated weights get shadows (the same kind of seam).
SHADOW_DEVICES = frozenset({"cuda"})
#: The fraction of the device's memory the copies leave free (as ``gpu_state_bytes="auto"``).
HEADROOM = AUTO_GPU_HEADROOM


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """``(free, total)`` bytes of ``device``: the driver's free memory plus what torch's caching allocator holds
    unused (its cached blocks serve a copy first), and the device's total; None where unknown (not CUDA)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached)), int(total)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _DeviceCopies:
    """Device buffers of one optimizer's speculated parameters by slot id, dropped at ``step()``. ``choice``: the
    constructor's argument (None: decided at the first buffer, from the free device memory, then True or False)."""

    what = "device copies"
    noun = "copies"
    arg = ""
    devices = frozenset()  # the device types that get them

    def __init__(self, choice: bool | None):
        self.choice = choice
        self._copies: dict[int, torch.Tensor] = {}
        self.held = 0  # bytes held now
        self.peak = 0  # the most bytes held at once

    def __len__(self) -> int:
        return len(self._copies)

    def _wanted(self, t: torch.Tensor) -> bool:
        return self.choice is not False and t.device.type in self.devices

    def _make(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, sid: int, t: torch.Tensor, need: Callable[[torch.device], tuple[int, int]]
             ) -> torch.Tensor | None:
        """At slot ``sid``'s speculating hook: a buffer for ``t`` (local, contiguous), kept for :meth:`pop`, or None
        where none is kept. ``need(device)``: the bytes of every such buffer on ``device`` and of the gradients not
        allocated yet (the decision of ``choice=None``)."""
        if not self._wanted(t):
            return None
        if self.choice is None:
            self.choice = self._fits(t.device, *need(t.device))
            if not self.choice:
                return None
        try:
            buf = self._make(t)
        except torch.cuda.OutOfMemoryError:
            self.release()
            self.choice = False
            warnings.warn(f"OffloadAdamW: out of GPU memory for {self.what} ({_nbytes(t):,} bytes); they are "
                          f"released and from now on {self.fallback} ({self.arg}=False silences this)",
                          RuntimeWarning, stacklevel=3)
            return None
        self.pop(sid)
        self._copies[sid] = buf
        self.held += _nbytes(buf)
        self.peak = max(self.peak, self.held)
        return buf

    def pop(self, sid: int) -> torch.Tensor | None:
        """Slot ``sid``'s buffer, no longer held here (the caller drops it once it is read), or None."""
        buf = self._copies.pop(sid, None)
        if buf is not None:
            self.held -= _nbytes(buf)
        return buf

    def release(self) -> None:
        """Drop every buffer (the step consumed them, the gradients were zeroed, the state reloaded)."""
        self._copies.clear()
        self.held = 0

    def _fits(self, device: torch.device, nbytes: int, pending: int) -> bool:
        """``choice=None``'s decision, once (module docstring); a warning naming the choice where they do not fit."""
        mem = device_memory(device)
        if mem is None:
            return True
        free, total = mem
        if _budget.device_copies_fit(nbytes + pending, free, total, HEADROOM):
            return True
        warnings.warn(f"OffloadAdamW: {self.what} need {nbytes:,} bytes of GPU memory (with the {pending:,} bytes "
                      f"of gradients this backward has yet to allocate), more than the {free:,} bytes free on {device} "
                      f"less {HEADROOM:.0%} of its {total:,}; {self.fallback} instead. {self.arg}=True keeps the "
                      f"{self.noun} anyway, {self.arg}=False silences this.", RuntimeWarning, stacklevel=4)
        return False


class GradCopies(_DeviceCopies):
    """Copies of the speculated gradients for ``step()``'s check (module docstring)."""

    what = ("GPU copies of the speculated gradients for the bitwise check of gradients changed in place between "
            "backward and step() (the loop's clip_grad_norm_)")
    fallback = "the check sends the gradients' host copies back over PCIe"
    arg = "grad_copies"

    @property
    def devices(self) -> frozenset:
        return COPY_DEVICES

    def __init__(self, choice: bool | None):
        super().__init__(choice)
        self.want = False  # the last step's check compared bits: keep copies in this one
        self.checked = {"device": 0, "staged": 0}  # gradients compared with a copy / with their staged host copy

    def _wanted(self, t: torch.Tensor) -> bool:
        return self.want and super()._wanted(t)

    def _make(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()


class WeightShadows(_DeviceCopies):
    """Shadows of the speculated weights, uploaded during backward and moved into the parameters at ``step()``
    (module docstring)."""

    what = ("GPU shadows of the speculated weights (uploaded during backward, moved into the parameters at step() "
            "by a device copy)")
    fallback = "the weights of updates speculated during backward are uploaded at step(), over PCIe"
    noun = "shadows"
    arg = "weight_shadows"

    @property
    def devices(self) -> frozenset:
        return SHADOW_DEVICES

    def _make(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, memory_format=torch.contiguous_format)
