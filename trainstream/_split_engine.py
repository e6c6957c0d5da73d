"""``hybrid`` mode: the host engine and the zero-copy engine side by side, one slot each.

Every parameter's optimizer state lives in host memory either way; what differs is who
updates it. By default the first parameters in registration order (the ones the next
forward needs first), up to ``gpu_elems`` elements, go to the
:class:`~trainstream._gpu_engine.GpuEngine` (their update kernel reads and writes the state
over PCIe at ``step()``, or from their gradient hooks on the eager path); the rest go to
the :class:`~trainstream._engine.Engine` (host threads, overlapping backward and the next
forward). The caller may instead say per parameter which engine takes it (``gpu=``: the
torch adapter's ``gpu_params="last"``). Both paths run at once, so a step's update takes about the larger of the two
shares instead of the sum. The two modes run the same contract (``torch``/``cuda``) on
CUDA, so each parameter gets its mode's bits; the one difference between modes stays:
micro-batch gradients of a GPU-share fp16/bf16 parameter are summed by torch in its dtype.

Clipping: the global norm is ``sqrt(gpu_sumsq + host_sumsq)``, each engine's float64 sum
of squares in its own fixed order (``trainstream/kernels/grad_sumsq.cu`` for the GPU
share, slot and block order for the host share), then the GPU share's plus the host
share's. Like the other modes' it does not depend on threads or chunk size; unlike theirs
it depends on the split (``gpu_share``): the three modes' norms may differ in the last
bits, and with them the float32 clip coefficient. Given the same coefficient every mode
gives the same bits.

Imports neither torch nor jax; no arithmetic lives here.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from . import _contract as C
from . import _trace

__all__ = ["SplitEngine"]


class SplitEngine:
    """Dispatches slot ``sid`` to its engine; slot ids are global (registration order)."""

    def __init__(self, cpu: Any, gpu: Any, gpu_elems: int):
        self.cpu = cpu
        self.gpu = gpu
        self._gpu_budget = int(gpu_elems)
        self._gpu_used = 0
        self._where: list[tuple[bool, int]] = []  # slot -> (on the gpu engine, its local id)
        self._numel: list[int] = []
        self._last_norm: float | None = None

    # -- slots ----------------------------------------------------------------------------

    def add_param(self, param: Any, numel: int, dtype: str, platform: str, host: bool = False,
                  gpu: bool | None = None) -> int:
        """Register a parameter: on the GPU engine if ``gpu`` says so or, with ``gpu=None``,
        if it fits in the share left (and not ``host``, e.g. a frozen one); else on the
        host engine."""
        if gpu is None:
            on_gpu = not host and self._gpu_used + int(numel) <= self._gpu_budget
        else:
            on_gpu = bool(gpu) and not host
        engine = self.gpu if on_gpu else self.cpu
        local = engine.add_param(param, numel, dtype, platform)
        if on_gpu:
            self._gpu_used += int(numel)
        self._where.append((on_gpu, local))
        self._numel.append(int(numel))
        return len(self._where) - 1

    def on_gpu(self, sid: int) -> bool:
        return self._where[sid][0]

    def _local(self, sid: int) -> tuple[Any, int]:
        on_gpu, local = self._where[sid]
        return (self.gpu if on_gpu else self.cpu), local

    def truncate(self, n: int) -> None:
        keep = self._where[:n]
        for engine, on in ((self.cpu, False), (self.gpu, True)):
            engine.truncate(sum(1 for g, _ in keep if g == on))
        self._gpu_used -= sum(k for (g, _), k in zip(self._where[n:], self._numel[n:]) if g)
        del self._where[n:]
        del self._numel[n:]

    def get_step(self, sid: int) -> int:
        engine, local = self._local(sid)
        return engine.get_step(local)

    # -- the host path ----------------------------------------------------------------------

    def _cpu_only(self, sid: int) -> int:
        on_gpu, local = self._where[sid]
        if on_gpu:
            raise RuntimeError(f"TrainStream hybrid mode: slot {sid} is updated by the GPU kernel, not the host")
        return local

    def offload_grad(self, sid: int, grad: Any, grad_dtype: str, update: C.AdamWHyperParams | None = None) -> None:
        self.cpu.offload_grad(self._cpu_only(sid), grad, grad_dtype, update)

    def has_grad(self, sid: int) -> bool:
        return self.cpu.has_grad(self._cpu_only(sid))

    def discard_grads(self) -> None:
        self.cpu.discard_grads()

    # -- steps ------------------------------------------------------------------------------

    def step_gpu_eager(self, gpu_updates: Sequence[tuple[int, C.AdamWHyperParams, Any, str]],
                       max_blocks: int | None = None) -> None:
        """Launch the update of GPU-share slots whose gradients backward has just
        produced (the eager path: no clipping); :meth:`step` then leaves them out."""
        self.gpu.step([(self._where[sid][1], hp, g, gd) for sid, hp, g, gd in gpu_updates],
                      eager=True, max_blocks=max_blocks)

    def step(self, cpu_updates: Sequence[tuple[int, C.AdamWHyperParams]],
             gpu_updates: Sequence[tuple[int, C.AdamWHyperParams, Any, str]],
             max_grad_norm: float | None = None) -> float | None:
        """Launch the GPU share's kernels and queue the host share's updates, the share
        that holds the lowest slot (the parameter the next forward needs first) first.
        Launching is not free: the 120 kernel launches of GPT-125M's default share took
        5-6 ms of the calling thread (experiments/RESULTS.md, session 7), and with the GPU
        share always first the host workers, holding the tied embedding that the forward
        needs first, sat idle for that long. (Since session 8 the GPU engine puts several
        tensors into each launch: ``step()`` returned after 14 ms instead of 34 there.) With ``max_grad_norm`` both first wait for
        the global norm (module docstring), which is returned. If the second share fails
        to queue after the first did, the error is raised and also left sticky (as a
        worker failure is) when the host share went first."""
        self.cpu.check_error()  # raise before any kernel is queued, not between the two
        gpu_local = [(self._where[sid][1], hp, g, gd) for sid, hp, g, gd in gpu_updates]
        cpu_local = [(self._cpu_only(sid), hp) for sid, hp in cpu_updates]
        self.gpu.check_grads(gpu_local)  # a bad gradient raises before either share is queued
        coef = None
        norm = None
        if max_grad_norm is not None:
            sumsq = self.gpu.grad_sumsq(gpu_local)
            sumsq += self.cpu.grad_sumsq([sid for sid, _ in cpu_local])
            norm = math.sqrt(self.cpu.backend.all_reduce_sum(sumsq))
            self._last_norm = norm
            coef = C.clip_coefficient(norm, max_grad_norm)
        # The host share's first slot that this step updates (frozen parameters, unused
        # ones and those already updated eagerly hold no gradient and do not count).
        host_sids = [sid for sid, _ in cpu_updates if self.cpu.has_grad(self._where[sid][1])]
        host_first = bool(host_sids) and (
            not gpu_updates or min(host_sids) < min(u[0] for u in gpu_updates))
        if not host_first:
            self._step_gpu(gpu_local, coef)
            self._step_host(cpu_local, coef)
            return norm
        self._step_host(cpu_local, coef)
        try:
            self._step_gpu(gpu_local, coef)
        except BaseException as exc:
            # The host share has taken this step and the GPU share has not: make that
            # sticky, as a worker failure is (reload a checkpoint to go on).
            self.cpu._record_error(RuntimeError(
                "hybrid step: the GPU share's update failed after the host share's was "
                f"queued ({type(exc).__name__}: {exc})"))
            raise
        return norm

    def _step_gpu(self, gpu_local, coef) -> None:
        if gpu_local:
            t0 = time.perf_counter()
            self.gpu.step(gpu_local, clip_coef=coef)
            _trace.add("step.gpu_share", t0, time.perf_counter(), -1)

    def _step_host(self, cpu_local, coef) -> None:
        # Not a second error check: a worker error that came after the first one raises at
        # the next call, instead of leaving one share stepped and the other not.
        t0 = time.perf_counter()
        self.cpu.step(cpu_local, clip_coef=coef, check_errors=False)
        _trace.add("step.host_share", t0, time.perf_counter(), -1)

    def wait_ready(self, sids: Sequence[int]) -> None:
        gpu = [self._where[s][1] for s in sids if self._where[s][0]]
        cpu = [self._where[s][1] for s in sids if not self._where[s][0]]
        if gpu:
            self.gpu.wait_ready(gpu)
        if cpu:
            self.cpu.wait_ready(cpu)

    def check_error(self) -> None:
        self.cpu.check_error()

    def clear_error(self) -> None:
        self.cpu.clear_error()
        self.gpu.clear_error()

    def drain(self) -> None:
        self.gpu.drain()
        self.cpu.drain()

    def synchronize(self) -> None:
        self.gpu.synchronize()
        self.cpu.synchronize()

    def last_grad_norm(self) -> float | None:
        """The global norm of the last step that clipped (None before one)."""
        return self._last_norm

    # -- state ------------------------------------------------------------------------------

    def state(self, sid: int):
        engine, local = self._local(sid)
        return engine.state(local)

    def load_state(self, sid: int, exp_avg, exp_avg_sq, step, master=None) -> None:
        engine, local = self._local(sid)
        engine.load_state(local, exp_avg, exp_avg_sq, step, master)

    def stats(self) -> dict[str, float]:
        """The host engine's counters, plus the GPU share's: ``gpu_params``,
        ``gpu_numel``, ``gpu_update_launch_ms_total``; state bytes summed."""
        st = dict(self.cpu.stats())
        g = self.gpu.stats()
        st["params"] += g["params"]
        st["numel"] += g["numel"]
        st["gpu_mode"] = 0.5
        for k in ("host_state_bytes", "pinned_state_bytes"):
            st[k] += g[k]
        st["steps"] = max(st["steps"], g["steps"])
        st["ready_stall_ms_total"] += g["ready_stall_ms_total"]
        st["eager_updates"] += g["eager_updates"]
        st["gpu_params"] = g["params"]
        st["gpu_numel"] = g["numel"]
        st["gpu_update_launch_ms_total"] = g["update_ms_total"]
        return st

    def close(self) -> None:
        try:
            self.gpu.close()
        finally:
            self.cpu.close()
