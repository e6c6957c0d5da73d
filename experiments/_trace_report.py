"""The engine's host timeline (:mod:`trainstream._trace`'s spans) as a ``chrome://tracing`` / Perfetto
document and as figures per phase: used by ``bench_train.py --trace`` (not part of the library)."""

from __future__ import annotations

from typing import Any

from trainstream._trace import Span


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
    kernels = ("update", "accumulate", "sumsq")
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
