"""A host-side timeline of the engine, for finding where an offloaded step loses time.

Off by default (one ``is None`` test per recording site). While on, the engine records spans of its
worker jobs and of the training thread's calls into it; a benchmark adds its own phases with
:func:`span` (``experiments/_trace_report.py`` turns the spans into a Chrome trace and figures per
phase). Imports neither torch nor jax.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, NamedTuple

__all__ = ["Span", "start", "stop", "active", "add", "span"]


class Span(NamedTuple):
    name: str  # e.g. "update", "wait.landed", "offload_grad", "forward"
    thread: str  # the recording thread's name
    t0: float  # time.perf_counter() seconds
    t1: float
    sid: int  # parameter slot, or -1


_spans: list[Span] | None = None


def start() -> None:
    """Start recording (drops anything recorded before)."""
    global _spans
    _spans = []


def stop() -> list[Span]:
    """Stop recording and return the spans, ordered by start time."""
    global _spans
    out, _spans = (_spans or []), None
    return sorted(out, key=lambda s: s.t0)


def active() -> bool:
    return _spans is not None


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
