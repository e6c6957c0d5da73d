"""The one CUDA layer, through ctypes: the driver calls of both adapters and of the device placement
(events, asynchronous copies, stream waits, mapped pinned host memory, GPU memory, synchronisation).
CuPy only compiles and launches the kernels (:mod:`trainstream._device_kernels`). Imports neither
torch nor jax; loads ``libcuda`` on first use.

Not torch's ``Tensor.copy_``/``torch.cuda.Event``: in ``cpu`` mode every gradient hook and finished
update copies and records an event, from many threads at once, and through torch's dispatcher and
pinned-allocator lock each took 0.5-1.6 ms (H200, 1.3B GPT, 15 workers); a ctypes call, microseconds.
Calls that return at once go through ``ctypes.PyDLL``, which keeps the GIL (taking it back may wait
for a busy worker: with it released, 0.2-0.6 ms a hook); blocking calls and allocations through
``ctypes.CDLL``, which releases it. Streams are the frameworks' (runtime and driver share handles and
the primary context). A failed call raises :class:`CudaDriverError` naming it and the error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

__all__ = ["CudaDriverError", "Context", "DeviceMemory", "Event", "Mapped", "available", "context", "pointer_device"]

_CU_EVENT_BLOCKING_SYNC = 0x1  # waiters sleep instead of spinning (workers yield the CPU)
_CU_EVENT_DISABLE_TIMING = 0x2  # cheaper record/query
_CUDA_ERROR_NOT_READY = 600
_CU_MEMHOSTALLOC_PORTABLE = 0x1  # usable from every context
_CU_MEMHOSTALLOC_DEVICEMAP = 0x2  # mapped into the device address space
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9

_lib = None  # CDLL: releases the GIL during the call (blocking calls)
_fast = None  # PyDLL: keeps the GIL (calls that return at once)
_lib_lock = threading.Lock()


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the driver's error)."""


def _load():
    global _lib, _fast
    with _lib_lock:
        if _lib is None:
            name = ctypes.util.find_library("cuda") or "libcuda.so.1"
            try:
                lib, fast = ctypes.CDLL(name), ctypes.PyDLL(name)
            except OSError as exc:
                raise CudaDriverError(f"cannot load the CUDA driver library ({name}): {exc}") from exc
            _declare(lib)
            _declare(fast)
            _check(lib.cuInit(0), "cuInit", lib)
            _lib, _fast = lib, fast
    return _lib


def _declare(lib) -> None:
    vp, u64, sz, ui, ci = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
    pvp, pu64, pstr = ctypes.POINTER(vp), ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_char_p)
    for fn, args in (
        ("cuInit", [ui]), ("cuDeviceGet", [ctypes.POINTER(ci), ci]), ("cuDevicePrimaryCtxRetain", [pvp, ci]),
        ("cuDevicePrimaryCtxRelease_v2", [ci]), ("cuCtxGetCurrent", [pvp]), ("cuCtxPushCurrent_v2", [vp]),
        ("cuCtxPopCurrent_v2", [pvp]), ("cuEventCreate", [pvp, ui]), ("cuEventDestroy_v2", [vp]),
        ("cuEventRecord", [vp, vp]), ("cuEventSynchronize", [vp]), ("cuEventQuery", [vp]),
        ("cuStreamWaitEvent", [vp, vp, ui]), ("cuMemcpyHtoDAsync_v2", [u64, vp, sz, vp]),
        ("cuMemcpyDtoHAsync_v2", [vp, u64, sz, vp]), ("cuStreamSynchronize", [vp]), ("cuStreamCreate", [pvp, ui]),
        ("cuStreamDestroy_v2", [vp]), ("cuMemHostAlloc", [pvp, sz, ui]),
        ("cuMemHostGetDevicePointer_v2", [pu64, vp, ui]), ("cuMemFreeHost", [vp]), ("cuMemAlloc_v2", [pu64, sz]),
        ("cuMemFree_v2", [u64]), ("cuMemsetD32Async", [u64, ui, sz, vp]), ("cuPointerGetAttribute", [vp, ui, u64]),
        ("cuGetErrorName", [ci, pstr]), ("cuGetErrorString", [ci, pstr]),
    ):
        f = getattr(lib, fn)
        f.argtypes = args
        f.restype = ctypes.c_int


def _check(res: int, what: str, lib=None) -> None:
    if res == 0:
        return
    lib = lib or _lib
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    try:
        lib.cuGetErrorName(res, ctypes.byref(name))
        lib.cuGetErrorString(res, ctypes.byref(text))
    except Exception:  # noqa: BLE001 - describing the error must not hide it
        pass
    raise CudaDriverError(f"{what} failed: {(name.value or b'?').decode()} ({res}): {(text.value or b'').decode()}")


def available() -> bool:
    """Whether the CUDA driver library loads and initialises here."""
    try:
        return _load() is not None
    except CudaDriverError:
        return False


def pointer_device(ptr: int) -> int:
    """The ordinal of the device that ``ptr`` belongs to: device memory, or host memory
    registered with a device's context (e.g. a buffer XLA hands to a callback)."""
    _load()
    dev = ctypes.c_int()
    _check(_fast.cuPointerGetAttribute(ctypes.byref(dev), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(ptr)),
           f"cuPointerGetAttribute({int(ptr):#x}, DEVICE_ORDINAL)")
    return int(dev.value)


class Context:
    """The primary context of one device (torch's runtime's); each call pushes it for the call where the
    thread's current context is another device's (torch's current device stays)."""

    def __init__(self, device: int):
        lib = _load()
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), int(device)), f"cuDeviceGet({device})")
        ctx = ctypes.c_void_p()
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.device, self._dev, self.handle = int(device), dev.value, ctx.value

    def _enter(self) -> bool:
        """Make this context current on the calling thread; True if pushed (:meth:`_leave` pops it)."""
        cur = ctypes.c_void_p()
        _check(_fast.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value == self.handle:
            return False
        _check(_fast.cuCtxPushCurrent_v2(self.handle), "cuCtxPushCurrent")
        return True

    @staticmethod
    def _leave(pushed: bool) -> None:
        if pushed:
            _fast.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def call(self, name: str, *args, release_gil: bool = False) -> int:
        """Driver function ``name``'s result code, run in this context (``release_gil``: GIL released)."""
        pushed = self._enter()
        try:
            return getattr(_lib if release_gil else _fast, name)(*args)
        finally:
            self._leave(pushed)

    def call_checked(self, name: str, *args, release_gil: bool = False) -> None:
        """:meth:`call`, raising :class:`CudaDriverError` (naming ``name`` less ``_v2``) for an error."""
        _check(self.call(name, *args, release_gil=release_gil), name.removesuffix("_v2"))

    def memcpy_dtoh_async(self, dst_host: int, src_device: int, nbytes: int, stream: int) -> None:
        """Queue ``nbytes`` from device memory to pinned host memory on ``stream``."""
        self.call_checked("cuMemcpyDtoHAsync_v2", dst_host, src_device, nbytes, stream)

    def memcpy_htod_async(self, dst_device: int, src_host: int, nbytes: int, stream: int) -> None:
        """Queue ``nbytes`` from pinned host memory to device memory on ``stream``
        (pinned only: from pageable memory the driver would block with the GIL held)."""
        self.call_checked("cuMemcpyHtoDAsync_v2", dst_device, src_host, nbytes, stream)

    def stream_wait_event(self, stream: int, event: "Event") -> None:
        """Make ``stream``'s later work wait for ``event`` (on the device; the host goes on)."""
        self.call_checked("cuStreamWaitEvent", stream, event.handle, 0)

    def create_stream(self) -> int:
        """A new non-blocking stream of this context (``destroy_stream`` releases it)."""
        st = ctypes.c_void_p()
        self.call_checked("cuStreamCreate", ctypes.byref(st), 1)  # CU_STREAM_NON_BLOCKING
        return st.value

    def destroy_stream(self, stream: int) -> None:
        """Release a stream of :meth:`create_stream` (its queued work still completes)."""
        self.call_checked("cuStreamDestroy_v2", stream)

    def stream_synchronize(self, stream: int) -> None:
        """Block (GIL released) until ``stream``'s queued work is done."""
        self.call_checked("cuStreamSynchronize", stream, release_gil=True)

    def _alloc(self, name: str, out, nbytes: int, what: str, *flags) -> int:
        """Allocate ``nbytes`` (returned) into ``out`` through ``name``, GIL released; ``MemoryError``
        naming the size and ``what`` when the driver refuses."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        res = self.call(name, ctypes.byref(out), nbytes, *flags, release_gil=True)
        try:
            _check(res, name.removesuffix("_v2"))
        except CudaDriverError as exc:
            raise MemoryError(f"could not allocate {nbytes} bytes of {what}: {exc}") from None
        return nbytes

    def alloc_mapped(self, nbytes: int) -> "Mapped":
        """``nbytes`` of pinned host memory mapped into the device address space (portable: usable
        from every context). ``MemoryError`` naming the size when the driver refuses."""
        host = ctypes.c_void_p()
        nbytes = self._alloc("cuMemHostAlloc", host, nbytes, "mapped pinned host memory",
                             _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP)
        buf = Mapped(self, host.value, nbytes)
        dev = ctypes.c_uint64()
        try:
            self.call_checked("cuMemHostGetDevicePointer_v2", ctypes.byref(dev), host.value, 0)
        except BaseException:
            buf.free()
            raise
        buf.dev_ptr = dev.value
        return buf

    def alloc_device(self, nbytes: int) -> DeviceMemory:
        """``nbytes`` of device memory (``cuMemAlloc``: outside the framework's allocator, which
        does not count it). ``MemoryError`` naming the size when the driver refuses."""
        ptr = ctypes.c_uint64()
        nbytes = self._alloc("cuMemAlloc_v2", ptr, nbytes, f"GPU memory on cuda:{self.device}")
        return DeviceMemory(self, ptr.value, nbytes)

    def __del__(self):
        lib, dev = _lib, getattr(self, "_dev", None)
        if lib is not None and dev is not None:
            try:
                lib.cuDevicePrimaryCtxRelease_v2(dev)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class Event:
    """A CUDA event recorded once on a stream; waiters sleep (blocking sync). Once seen complete it
    remembers it: the chunk jobs of a batch wait on the same events, and after the first a wait costs
    no driver call (nor a GIL re-acquired against busy workers)."""
    __slots__ = ("handle", "_ctx", "_done")

    def __init__(self, ctx: Context, stream: int):
        self._ctx, self.handle, self._done = ctx, None, False
        pushed = ctx._enter()
        try:
            ev = ctypes.c_void_p()
            flags = _CU_EVENT_BLOCKING_SYNC | _CU_EVENT_DISABLE_TIMING
            _check(_fast.cuEventCreate(ctypes.byref(ev), flags), "cuEventCreate")
            self.handle = ev.value
            _check(_fast.cuEventRecord(self.handle, stream), "cuEventRecord")
        finally:
            ctx._leave(pushed)

    def synchronize(self) -> None:
        """Block until the event's work is done: a query (GIL kept) first, then the GIL-releasing wait."""
        if self.query():
            return
        _check(self._ctx.call("cuEventSynchronize", self.handle, release_gil=True), "cuEventSynchronize")
        self._done = True

    def query(self) -> bool:
        """Whether the event's work is done (never blocks)."""
        if self._done:
            return True
        res = self._ctx.call("cuEventQuery", self.handle)
        if res == _CUDA_ERROR_NOT_READY:
            return False
        _check(res, "cuEventQuery")
        self._done = True
        return True

    def __del__(self):
        # Safe while the event is still pending: the driver frees it once it completes.
        h, self.handle = getattr(self, "handle", None), None
        if h is not None and _fast is not None:
            try:
                self._ctx.call("cuEventDestroy_v2", h)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class _Memory:
    """Memory of one context; :meth:`free` (idempotent; also when collected) releases the pointer
    in attribute ``_PTR`` through driver function ``_FREE``."""
    __slots__ = ("__weakref__", "_ctx", "_lock", "dev_ptr", "nbytes")
    _PTR = _FREE = ""

    def __init__(self, ctx: Context, dev_ptr: int, nbytes: int):
        self._ctx, self.dev_ptr, self.nbytes, self._lock = ctx, dev_ptr, nbytes, threading.Lock()

    def free(self) -> None:
        with self._lock:
            ptr = getattr(self, self._PTR)
            setattr(self, self._PTR, None)
        if ptr is not None and _lib is not None:
            self._ctx.call(self._FREE, ptr, release_gil=True)

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass


class Mapped(_Memory):
    """Pinned host memory mapped into the device address space (:meth:`Context.alloc_mapped`): ``host_ptr`` and
    ``dev_ptr`` address the same bytes (equal under UVA). Drop every view of it before :meth:`free`."""
    __slots__ = ("host_ptr",)
    _PTR, _FREE = "host_ptr", "cuMemFreeHost"

    def __init__(self, ctx: Context, host_ptr: int, nbytes: int):
        super().__init__(ctx, 0, nbytes)
        self.host_ptr = host_ptr


class DeviceMemory(_Memory):
    """Device memory of one context (:meth:`Context.alloc_device`). Its copies from and to host memory
    (pinned or pageable) and ``zero`` are queued on ``stream`` and block, GIL released, until done."""
    __slots__ = ()
    _PTR, _FREE = "dev_ptr", "cuMemFree_v2"

    def _span(self, nbytes: int) -> int:
        nbytes = int(nbytes)
        if self.dev_ptr is None:
            raise CudaDriverError("device memory used after free()")
        if not 0 <= nbytes <= self.nbytes:
            raise ValueError(f"a copy of {nbytes} bytes does not fit a device buffer of {self.nbytes}")
        return nbytes

    def _copy(self, name: str, dst: int, src: int, nbytes: int, stream: int) -> None:
        nbytes = self._span(nbytes)
        if nbytes:
            self._ctx.call_checked(name, dst, src, nbytes, stream, release_gil=True)
            self._ctx.stream_synchronize(stream)

    def to_host(self, host_ptr: int, nbytes: int, stream: int) -> None:
        """Copy the first ``nbytes`` into host memory at ``host_ptr``; returns once done."""
        self._copy("cuMemcpyDtoHAsync_v2", host_ptr, self.dev_ptr, nbytes, stream)

    def from_host(self, host_ptr: int, nbytes: int, stream: int) -> None:
        """Copy ``nbytes`` of host memory at ``host_ptr`` into the first bytes; returns once done."""
        self._copy("cuMemcpyHtoDAsync_v2", self.dev_ptr, host_ptr, nbytes, stream)

    def zero(self, stream: int) -> None:
        """Set every byte to zero; returns once done."""
        self._span(0)
        if self.nbytes % 4:
            raise ValueError(f"zero() needs a multiple of 4 bytes, the buffer has {self.nbytes}")
        self._ctx.call_checked("cuMemsetD32Async", self.dev_ptr, 0, self.nbytes // 4, stream)
        self._ctx.stream_synchronize(stream)


_contexts: dict[int, Context] = {}
_contexts_lock = threading.Lock()


def context(device: int) -> Context:
    """The (cached) :class:`Context` of ``device``: its primary context, retained once."""
    with _contexts_lock:
        if int(device) not in _contexts:
            _contexts[int(device)] = Context(int(device))
        return _contexts[int(device)]
