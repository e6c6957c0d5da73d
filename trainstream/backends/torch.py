"""The torch side of the engine's :class:`~trainstream.core.Backend` (host buffers, side streams, events and
copies for one device, CUDA or CPU; what the recipes read from torch at step time: ``torch.get_num_threads()``,
CUDA's ``powf``) and the probe of torch's CPU arithmetic (:func:`torch_cpu_code`).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from .. import _cpu_sqrt, _cuda, _hostmem
from .. import contract as C

__all__ = ["TorchBackend", "torch_cpu_code"]

_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: ``copy_many_to_device`` records an event after each run of uploads of at least this many bytes (64 MiB: 1.2 ms
#: at PCIe Gen5's 55 GB/s), not one per parameter.
_EVENT_BYTES = 64 << 20
_TORCH_DTYPE = {v: k for k, v in _DTYPE_NAME.items()}


class _TorchHostBuffer:
    """A flat host tensor and its NumPy view (uint16 bit patterns for fp16/bf16)."""

    __slots__ = ("handle", "array", "pinned")

    def __init__(self, tensor: torch.Tensor, pinned: bool):
        self.handle, self.pinned = tensor, pinned
        self.array = (tensor.numpy() if tensor.dtype == torch.float32
                      else tensor.view(torch.int16).numpy().view(np.uint16))


class _Pinned:
    """Page-locked host memory of exactly the bytes asked (``cuMemHostAlloc``; torch's CachingHostAllocator would
    round each buffer up to a power of two: up to 2x), kept alive by every NumPy array and tensor viewing it (it is
    their base) and freed with the last of them."""

    def __init__(self, drv: _cuda.Context, nbytes: int):
        self.mem = drv.alloc_mapped(max(1, nbytes))
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.mem.host_ptr, False),
                                    "version": 3}


class TorchBackend:
    """Pinned buffers, side streams and events for one device: on CUDA through :mod:`trainstream._cuda` (streams and
    device memory are torch's); on the CPU every copy is synchronous, with no events (testable without a GPU)."""

    copy_keeps_source_alive = True  # gradients may be dropped once their copy is queued (CPU: synchronous)
    weights_in_grad_stage = True  # fp16/bf16 weights upload from the grad's staging buffer: 6% less host traffic

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.device_index = device.index if device.index is not None else torch.cuda.current_device()
            self.d2h, self.h2d, self.upd = (torch.cuda.Stream(device=device) for _ in range(3))
            self.drv = _cuda.context(self.device_index)

    def _compute_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    # -- gpu (zero-copy) mode -------------------------------------------------------------

    def update_stream(self) -> int:
        return self.upd.cuda_stream

    def update_wait(self, event: _cuda.Event) -> None:
        self.drv.stream_wait_event(self.upd.cuda_stream, event)

    def record_update(self) -> _cuda.Event:
        return _cuda.Event(self.drv, self.upd.cuda_stream)

    @staticmethod
    def data_ptr(t: torch.Tensor) -> int:
        return t.data_ptr()

    # -- host placement -------------------------------------------------------------------

    def host_empty(self, numel: int, dtype: str, *, pinned: bool, what: str) -> _TorchHostBuffer:
        tdtype = _TORCH_DTYPE[dtype]
        pin = pinned and self.cuda
        try:
            if pin:  # exactly numel elements (_Pinned), not a power of two
                raw = np.asarray(_Pinned(self.drv, numel * tdtype.itemsize))
                t = torch.from_numpy(raw.view(np.float32 if tdtype == torch.float32 else np.int16)).view(tdtype)
            else:  # pageable host state on 2 MiB pages (trainstream._hostmem)
                t = torch.from_numpy(_hostmem.empty(numel, np.float32 if tdtype == torch.float32 else np.int16))
                t = t.view(tdtype)
        except (RuntimeError, OSError, MemoryError) as exc:  # the driver: MemoryError; mmap: OSError
            raise MemoryError(f"TrainStream could not allocate {numel * tdtype.itemsize} bytes of "
                              f"{'pinned' if pin else 'pageable'} host memory for {what}: {exc}") from exc
        return _TorchHostBuffer(t, pin)

    def param_to_host_f32(self, param: torch.Tensor, out: np.ndarray) -> None:
        torch.from_numpy(out).copy_(param.detach().reshape(-1))

    @staticmethod
    def param_to_host(param: torch.Tensor, out: np.ndarray) -> None:
        """The parameter's own bits into ``out`` (float32, or uint16 for fp16/bf16), synchronously."""
        host = torch.from_numpy(out if out.dtype == np.float32 else out.view(np.int16))
        host.view(param.dtype).copy_(param.detach().reshape(-1))

    @staticmethod
    def cpu_threads() -> int:
        """``torch.get_num_threads()`` now: the thread chunks of torch's CPU kernels (their scalar tails)."""
        return torch.get_num_threads()

    def device_pow(self, base: float, t0: int, count: int) -> np.ndarray:
        """``powf(f(base), t)`` for ``t0 <= t < t0 + count`` (float32 ``t``), computed on the parameters' device
        (CUDA's ``powf``, which the host cannot reproduce: CUDA fused's bias corrections), on a side stream."""
        def run() -> np.ndarray:
            b = torch.full((1,), float(base), dtype=torch.float32, device=self.device)
            t = torch.arange(t0, t0 + count, dtype=torch.float32, device=self.device)
            return torch.pow(b, t).cpu().numpy()
        if not self.cuda:
            return run()
        with torch.cuda.stream(self.upd):  # waits for nothing on the compute stream
            return run()

    def record_compute(self, param: torch.Tensor | None) -> _cuda.Event | None:
        return _cuda.Event(self.drv, self._compute_stream()) if self.cuda else None

    def _begin_copy(self, host: _TorchHostBuffer, dev: torch.Tensor, what: str, stream: int, *after) -> int:
        """Check a copy between ``host`` and ``dev`` (returns its bytes); ``stream`` waits for the events ``after``."""
        nbytes = dev.numel() * dev.element_size()
        if not host.pinned:  # the driver would copy synchronously, holding the GIL
            raise ValueError(f"TrainStream {what}: the host buffer is not pinned")
        if not dev.is_contiguous() or host.handle.numel() * host.handle.element_size() != nbytes:
            raise ValueError(f"TrainStream {what}: device tensor {tuple(dev.shape)} {dev.dtype} (contiguous="
                             f"{dev.is_contiguous()}) does not match its host buffer of {host.handle.numel()} elements")
        for event in after:
            if event is not None:
                self.drv.stream_wait_event(stream, event)
        return nbytes

    def copy_to_host(self, dst: _TorchHostBuffer, src: torch.Tensor, after, *, free=None):
        if not self.cuda:
            dst.handle.copy_(src.reshape(-1))
            return None
        if not src.numel():  # an empty FSDP2 shard: null pointers, nothing to copy
            return None
        stream = self.d2h.cuda_stream  # free: the last upload from dst (see weights_in_grad_stage)
        nbytes = self._begin_copy(dst, src, "gradient copy", stream, after, free)
        self.drv.memcpy_dtoh_async(dst.handle.data_ptr(), src.data_ptr(), nbytes, stream)
        src.record_stream(self.d2h)  # the engine drops src at once: its memory is reused only after this copy
        return _cuda.Event(self.drv, stream)

    def copy_to_device(self, dst: torch.Tensor, src: _TorchHostBuffer, after):
        if not self.cuda:
            dst.reshape(-1).copy_(src.handle)
            return None
        if not dst.numel():
            return None
        stream = self.h2d.cuda_stream
        nbytes = self._begin_copy(src, dst, "weight upload", stream, after)
        self.drv.memcpy_htod_async(dst.data_ptr(), src.handle.data_ptr(), nbytes, stream)
        return _cuda.Event(self.drv, stream)

    def copy_many_to_device(self, pairs: list[tuple[torch.Tensor, _TorchHostBuffer]], after) -> list:
        """Each ``dst <- src`` of ``pairs`` (as :meth:`copy_to_device`), in order, after ``after``: one stream wait,
        one copy each, and an event after each run of at least :data:`_EVENT_BYTES` and after the last; each pair's
        event is the first recorded after its copy (a reader waits at most that run longer). CPU: done, Nones."""
        if not self.cuda:
            for dst, src in pairs:
                dst.reshape(-1).copy_(src.handle)
            return [None] * len(pairs)
        stream, events, start, run = self.h2d.cuda_stream, [None] * len(pairs), 0, 0
        if after is not None and any(dst.numel() for dst, _ in pairs):
            self.drv.stream_wait_event(stream, after)  # once: the copies follow one another on the stream
        for i, (dst, src) in enumerate(pairs):
            if dst.numel():
                nbytes = self._begin_copy(src, dst, "weight upload", stream)
                self.drv.memcpy_htod_async(dst.data_ptr(), src.handle.data_ptr(), nbytes, stream)
                run += nbytes
            if run and (run >= _EVENT_BYTES or i == len(pairs) - 1):
                event = _cuda.Event(self.drv, stream)
                for j in range(start, i + 1):  # this run's pairs (empty ones: nothing to wait for)
                    if pairs[j][0].numel():
                        events[j] = event
                start, run = i + 1, 0
        return events

    def copy_range_to_host(self, dst: _TorchHostBuffer, offset: int, src: torch.Tensor, begin: int, end: int,
                           after, free=None):
        """``dst``'s bytes from ``offset`` <- ``src[begin:end]`` (flat, contiguous) after the events ``after`` and
        ``free``; the caller keeps ``src`` alive until the returned event (CPU: done, None)."""
        nbytes = (end - begin) * src.element_size()
        if offset < 0 or offset + nbytes > dst.handle.numel() * dst.handle.element_size():
            raise ValueError(f"TrainStream chunk copy: {nbytes} bytes at {offset} do not fit the host buffer")
        if not self.cuda:
            dst.handle.view(torch.uint8)[offset:offset + nbytes].view(src.dtype).copy_(src.reshape(-1)[begin:end])
            return None
        if not dst.pinned:
            raise ValueError("TrainStream chunk copy: the host buffer is not pinned")
        stream = self.d2h.cuda_stream
        for event in (after, free):
            if event is not None:
                self.drv.stream_wait_event(stream, event)
        if nbytes:
            self.drv.memcpy_dtoh_async(dst.handle.data_ptr() + offset, src.data_ptr() + begin * src.element_size(),
                                       nbytes, stream)
        return _cuda.Event(self.drv, stream)

    def copy_range_to_device(self, dst: torch.Tensor, begin: int, end: int, src: _TorchHostBuffer, offset: int,
                             after):
        """``dst[begin:end]`` (a flat parameter) <- ``src``'s bytes from ``offset``, after ``after``; returns the
        upload's event (CPU: done, None)."""
        nbytes = (end - begin) * dst.element_size()
        if offset < 0 or offset + nbytes > src.handle.numel() * src.handle.element_size():
            raise ValueError(f"TrainStream chunk upload: {nbytes} bytes at {offset} are not in the host buffer")
        if not self.cuda:
            dst.reshape(-1)[begin:end].copy_(src.handle.view(torch.uint8)[offset:offset + nbytes].view(dst.dtype))
            return None
        if not src.pinned:
            raise ValueError("TrainStream chunk upload: the host buffer is not pinned")
        stream = self.h2d.cuda_stream
        if after is not None:
            self.drv.stream_wait_event(stream, after)
        if nbytes:
            self.drv.memcpy_htod_async(dst.data_ptr() + begin * dst.element_size(), src.handle.data_ptr() + offset,
                                       nbytes, stream)
        return _cuda.Event(self.drv, stream)

    def wait_on_compute(self, event: _cuda.Event | None, param: torch.Tensor) -> None:
        if event is not None:
            self.drv.stream_wait_event(self._compute_stream(), event)

    def record_uploads(self) -> _cuda.Event | None:
        """An event after every weight upload queued so far (CPU: uploads are synchronous)."""
        return _cuda.Event(self.drv, self.h2d.cuda_stream) if self.cuda else None


def _l2_tail_width() -> int | None:
    """The scalar tail step of ATen's CPU ``bf16.add(other, alpha=)`` (``2 * Vectorized<BFloat16>::size()``: 32 with
    32-byte vectors, 64 at AVX-512), measured on 127 elements where the vector loop's one rounding and the tail's two
    differ in every element; None where all take the tail's form (ATen's DEFAULT level)."""
    rng = np.random.default_rng(5)
    alpha = C.round_to(np.float32(0.1), "bfloat16")
    for _ in range(64):  # a (p, g) pair whose two forms differ
        p, g = (C.round_to(rng.standard_normal(2).astype(np.float32), "bfloat16") for _ in range(2))
        one = C.round_to(C.fma_f32(p, alpha, g), "bfloat16")
        two = C.round_to(g + C.round_to(alpha * p, "bfloat16"), "bfloat16")
        if one[0] != two[0]:
            break
    n = 127
    tp, tg = (torch.full((n,), float(x[0]), dtype=torch.bfloat16) for x in (p, g))
    got = tg.add(tp, alpha=float(alpha)).float().numpy()
    tail = int(np.count_nonzero(got == two[0]))
    if tail == n:
        return None
    return tail + 1 if got[n - tail:].tolist() == [two[0]] * tail and tail + 1 in (32, 64) else -(tail + 1)


@functools.cache
def torch_cpu_code() -> int:
    """The contract's torch/cpu code, probed once per process: the MKL sqrt path ``torch.sqrt`` takes (``_cpu_sqrt``)
    | ``TC_NO_FMA`` if ATen's lerp is unfused | ``TC_VEC512`` if its vectors are 64 bytes (AVX-512: the scalar
    tails' lengths). If no path Numba compiles matches, the correctly rounded root (within
    ``TORCH_CPU_SQRT_MAX_ULP``) is used; for a lerp neither fused nor two roundings, the fused form; for another
    vector width, 32 bytes; one warning."""
    mode = _cpu_sqrt.detect_mode(lambda x: torch.from_numpy(x).sqrt().numpy())
    fused = _cpu_sqrt.detect_lerp_fma(lambda a, b, w: torch.from_numpy(a.copy()).lerp_(torch.from_numpy(b), w).numpy())
    width = _l2_tail_width() if fused else None
    problems = []
    if mode is None:
        problems.append("torch.sqrt matches none of the MKL paths Numba can compile here (it may use instructions "
                        f"Numba's target lacks); the correctly rounded root is used, within {C.TORCH_CPU_SQRT_MAX_ULP} "
                        "ULP of torch's")
        mode = _cpu_sqrt.IEEE
    if fused is None:
        problems.append("Tensor.lerp_ is neither fused nor two roundings; the fused form is used")
        fused = True
    if width is not None and width < 0:
        problems.append(f"ATen's fp16/bf16 vector loops step {-width} elements (not 32 or 64); fp16/bf16 Adam-L2 and "
                        "fused tails are placed as for 32-byte vectors")
    if problems:
        warnings.warn("TrainStream: updates of CPU parameters may differ from torch.optim.AdamW in the last bit on "
                      f"this host (torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
                      f"): {'; '.join(problems)}", RuntimeWarning, stacklevel=3)
    return mode | (0 if fused else C.TC_NO_FMA) | (C.TC_VEC512 if width == 64 else 0)
