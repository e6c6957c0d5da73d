"""A host timeline of the TrainStream engine, for finding where an offloaded step loses time: used by
``bench_train.py --trace`` (not part of the library).

Off by default. :func:`start` wraps the engine's methods from outside (restored by :func:`stop`) to record
spans of its worker jobs (``update``: the kernel of one chunk, ``wait.copies``: the chunk's wait for the
gradient copy and the previous upload before it, ``upload``: the batch's weight upload) and of the training
thread's calls into it (``offload_grad``, ``wait_ready``, ``wait_step``, ``step.host_share``,
``step.device_share``, ``launch_eager``); a benchmark adds its own phases with :func:`span`.
:func:`chrome_trace` turns the spans into a ``chrome://tracing`` / Perfetto document, :func:`summary` into
figures per phase.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator, NamedTuple

__all__ = ["Span", "start", "stop", "active", "add", "span", "chrome_trace", "summary"]


class Span(NamedTuple):
    name: str  # e.g. "update", "wait.copies", "offload_grad", "forward"
    thread: str  # the recording thread's name
    t0: float  # time.perf_counter() seconds
    t1: float
    sid: int  # parameter slot (of its placement), or -1


_spans: list[Span] | None = None
_patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to restore
_job = threading.local()  # a worker's current chunk: (its start, its slot); a caller's: inside update_external


def add(name: str, t0: float, t1: float, sid: int = -1) -> None:
    """Record one span of the calling thread (no-op while off)."""
    spans = _spans
    if spans is not None:
        spans.append(Span(name, threading.current_thread().name, t0, t1, sid))


@contextlib.contextmanager
def span(name: str, sid: int = -1) -> Iterator[None]:
    """``with span("forward"): ...`` records the block as one span."""
    if _spans is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(name, t0, time.perf_counter(), sid)


def active() -> bool:
    return _spans is not None


def _patch(owner: Any, attr: str, make) -> None:
    orig = getattr(owner, attr)
    _patched.append((owner, attr, orig))
    setattr(owner, attr, make(orig))


def _timed(owner: Any, attr: str, name, sid=lambda args: -1) -> None:
    """Record each call of ``owner.attr`` as a span ``name`` (or ``name(kwargs)``; None: not recorded)."""
    def make(orig):
        def call(self, *args, **kwargs):
            label = name(kwargs) if callable(name) else name
            if _spans is None or label is None:
                return orig(self, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return orig(self, *args, **kwargs)
            finally:
                add(label, t0, time.perf_counter(), sid(args))
        return call
    _patch(owner, attr, make)


def _instrument() -> None:
    from trainstream import _host_kernels
    from trainstream.core import _host

    def submit(orig):  # the worker side: every batch of the host placement goes through _submit
        def call(self, numel, priority, landed, body, finalize, record, done):
            external = getattr(_job, "external", False)  # an update_external item k (as -1-k); finalize: finished
            sid = -1 - int(priority) if external else int(priority)

            def traced_body(c, b, e):
                _job.chunk = (time.perf_counter(), sid)
                try:
                    body(c, b, e)
                finally:
                    _job.chunk = None

            def traced_finalize():
                with span("upload", sid):
                    finalize()
            orig(self, numel, priority, landed, traced_body, finalize if external else finalize and traced_finalize,
                 record, done)
        return call

    def external(orig):  # marks the _submit calls it makes
        def call(self, *args, **kwargs):
            _job.external = True
            try:
                return orig(self, *args, **kwargs)
            finally:
                _job.external = False
        return call

    def kernel(orig):  # the update kernel of one chunk, and the chunk's waits before it
        def call(*args):
            t0, (start, sid) = time.perf_counter(), getattr(_job, "chunk", None) or (None, -1)
            if start is not None and t0 > start:
                add("wait.copies", start, t0, sid)
            try:
                return orig(*args)
            finally:
                add("update", t0, time.perf_counter(), sid)
        return call

    _patch(_host.HostPlacement, "_submit", submit)
    _patch(_host_kernels, "adamw_chunk", kernel)
    _patch(_host.HostPlacement, "update_external", external)
    _timed(_host.HostPlacement, "offload_grad", "offload_grad", lambda a: a[0] if a else -1)
    _timed(_host.HostPlacement, "wait_ready", "wait_ready", lambda a: a[0][0] if a and len(a[0]) else -1)
    _timed(_host.HostPlacement, "wait_step", "wait_step")
    _timed(_host.HostPlacement, "step", "step.host_share")
    try:
        from trainstream.core import _device
    except ImportError:  # no CUDA driver bindings: no device placement to trace
        return
    _timed(_device.DevicePlacement, "step", lambda kw: "launch_eager" if kw.get("eager") else "step.device_share")


def start() -> None:
    """Start recording (drops anything recorded before); wraps the engine's methods, all or none."""
    global _spans
    if not _patched:
        try:
            _instrument()
        except BaseException:
            stop()
            raise
    _spans = []


def stop() -> list[Span]:
    """Stop recording, restore the engine's methods and return the spans, ordered by start time."""
    global _spans
    out, _spans = (_spans or []), None
    while _patched:
        owner, attr, orig = _patched.pop()
        setattr(owner, attr, orig)
    return sorted(out, key=lambda s: s.t0)


def chrome_trace(spans: list[Span]) -> dict[str, Any]:
    """The spans as a Chrome trace-event document (``json.dump`` it to a file)."""
    origin = min((s.t0 for s in spans), default=0.0)
    tids = {name: i for i, name in enumerate(sorted({s.thread for s in spans}))}
    meta = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": name}} for name, i in tids.items()]
    return {"traceEvents": meta + [{"name": s.name, "ph": "X", "pid": 0, "tid": tids[s.thread],
                                    "ts": (s.t0 - origin) * 1e6, "dur": max(0.0, (s.t1 - s.t0) * 1e6),
                                    "args": {"slot": s.sid}} for s in spans]}


def _overlap(s: Span, a: float, b: float) -> float:
    return max(0.0, min(s.t1, b) - max(s.t0, a))


def summary(spans: list[Span], phases: tuple[str, ...] = ("forward", "backward", "step"),
            workers_prefix: str = "trainstream-worker") -> dict[str, Any]:
    """Figures in ms per phase span (each occurrence of a name in ``phases``): its length; the
    workers' time inside it in kernels, in waits (``wait.*``) and launching uploads, and their
    utilisation (kernel time / (length x workers)); the training threads' ``wait_ready`` and
    ``offload_grad`` calls (count, total, largest); for ``step``, how long the workers ran on after it.
    """
    work = [s for s in spans if s.thread.startswith(workers_prefix)]
    workers = sorted({s.thread for s in work})
    out: dict[str, Any] = {"workers": len(workers), "phases": []}
    calls = [s for s in spans if not s.thread.startswith(workers_prefix) and s.name not in phases]
    kernels = ("update", "accumulate")
    phase_spans = [s for s in spans if s.name in phases]
    origin = min((s.t0 for s in phase_spans), default=0.0)
    for ph in phase_spans:
        a, b = ph.t0, ph.t1
        k = sum(_overlap(s, a, b) for s in work if s.name in kernels)
        row: dict[str, Any] = {
            "phase": ph.name, "t0_ms": (a - origin) * 1e3, "ms": (b - a) * 1e3, "worker_kernel_ms": k * 1e3,
            "worker_wait_ms": sum(_overlap(s, a, b) for s in work if s.name.startswith("wait.")) * 1e3,
            "worker_upload_ms": sum(_overlap(s, a, b) for s in work if s.name == "upload") * 1e3,
            "worker_util": k / ((b - a) * len(workers)) if workers and b > a else 0.0}
        for name in ("wait_ready", "offload_grad"):
            inside = [s for s in calls if s.name == name and a <= s.t0 < b]
            row[name] = {"n": len(inside), "total_ms": sum(s.t1 - s.t0 for s in inside) * 1e3,
                         "max_ms": max((s.t1 - s.t0 for s in inside), default=0.0) * 1e3}
        if ph.name == "step":
            later = [s.t1 for s in work if s.t0 >= a]
            row["host_tail_ms"] = (max(later) - b) * 1e3 if later else 0.0
        out["phases"].append(row)
    return out
