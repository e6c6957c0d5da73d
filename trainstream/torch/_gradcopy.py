"""Device copies of speculated gradients (``OffloadAdamW(grad_copies=)``): what speculation's bitwise check at
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
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from ..core import _budget
from ._params import AUTO_GPU_HEADROOM

__all__ = ["COPY_DEVICES", "GradCopies", "HEADROOM", "device_memory"]

#: Device types whose gradients get copies (a private seam: the tests add ``"cpu"`` to run this path without a
#: GPU; the CPU needs none, its check reads the staging in host memory).
COPY_DEVICES = frozenset({"cuda"})
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


class GradCopies:
    """The copies of one optimizer's speculated gradients, by slot id (module docstring). ``choice``: the
    constructor's ``grad_copies`` (None: decided at the first copy, then True or False)."""

    def __init__(self, choice: bool | None):
        self.choice = choice
        self.want = False  # the last step's check compared bits: keep copies in this one
        self._copies: dict[int, torch.Tensor] = {}
        self.held = 0  # bytes held now
        self.peak = 0  # the most bytes held at once
        self.checked = {"device": 0, "staged": 0}  # gradients compared with a copy / with their staged host copy

    def __len__(self) -> int:
        return len(self._copies)

    def keep(self, sid: int, grad: torch.Tensor, need: Callable[[torch.device], tuple[int, int]]
             ) -> torch.Tensor | None:
        """At slot ``sid``'s speculating hook: a copy of ``grad`` (local, contiguous), kept for :meth:`pop`, or None
        where none is kept. ``need(device)``: the bytes of the copies of every speculable gradient on ``device`` and
        of those gradients not allocated yet (the decision of ``grad_copies=None``)."""
        if self.choice is False or not self.want or grad.device.type not in COPY_DEVICES:
            return None
        if self.choice is None:
            self.choice = self._fits(grad.device, *need(grad.device))
            if not self.choice:
                return None
        try:
            copy = grad.clone()
        except torch.cuda.OutOfMemoryError:
            self.release()
            self.choice = False
            warnings.warn(f"OffloadAdamW: out of GPU memory for a copy of a gradient ({_nbytes(grad):,} bytes) that "
                          "speculation's bitwise check would compare on the GPU; the copies are released and from "
                          "now on the check compares with the gradients' host copies sent back over PCIe "
                          "(grad_copies=False silences this)", RuntimeWarning, stacklevel=2)
            return None
        self.pop(sid)
        self._copies[sid] = copy
        self.held += _nbytes(copy)
        self.peak = max(self.peak, self.held)
        return copy

    def pop(self, sid: int) -> torch.Tensor | None:
        """Slot ``sid``'s copy, no longer held here (the caller drops it once its comparison is read), or None."""
        copy = self._copies.pop(sid, None)
        if copy is not None:
            self.held -= _nbytes(copy)
        return copy

    def release(self) -> None:
        """Drop every copy (the step consumed them, the gradients were zeroed, the state reloaded)."""
        self._copies.clear()
        self.held = 0

    @staticmethod
    def _fits(device: torch.device, copies: int, pending: int) -> bool:
        """``grad_copies=None``'s decision, once (module docstring); a warning naming the choice where they do
        not fit."""
        mem = device_memory(device)
        if mem is None:
            return True
        free, total = mem
        if _budget.device_copies_fit(copies + pending, free, total, HEADROOM):
            return True
        warnings.warn(f"OffloadAdamW: GPU copies of the speculated gradients for the bitwise check of gradients "
                      f"changed in place between backward and step() (the loop's clip_grad_norm_) need {copies:,} "
                      f"bytes of GPU memory (with the {pending:,} bytes of gradients this backward has yet to "
                      f"allocate), more than the {free:,} bytes free on {device} less {HEADROOM:.0%} of its "
                      f"{total:,}; the check sends the gradients' host copies back over PCIe instead. "
                      "grad_copies=True keeps the copies anyway, grad_copies=False silences this.",
                      RuntimeWarning, stacklevel=3)
        return False
