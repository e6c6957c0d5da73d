"""The engine's host timeline (experiments/_trace_report.py): what it records and how it sums."""

import json

import torch

from _experiments import load_script
from trainstream import _host_kernels
from trainstream.core import _host
from trainstream.torch import OffloadAdamW

trace = load_script("_trace_report")


def _run_traced(eager: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    opt = OffloadAdamW(model.parameters(), threads=2, overlap_forward=model)
    x = torch.randn(4, 64)
    trace.start()
    try:
        for _ in range(2):
            with trace.span("forward"):
                loss = model(x).square().mean()
            with trace.span("backward"):
                if eager:
                    with opt.last_micro_batch():
                        loss.backward()
                else:
                    loss.backward()
            with trace.span("step"):
                opt.step()
                opt.zero_grad()
        opt.synchronize()
    finally:
        spans = trace.stop()
        opt.close()
    return spans


def test_off_by_default_records_nothing_and_stop_restores_the_engine():
    hp = _host.HostPlacement
    names = ("_submit", "offload_grad", "wait_ready", "wait_step", "step", "update_external")
    originals = [getattr(hp, n) for n in names] + [_host_kernels.adamw_chunk]
    assert not trace.active()
    trace.add("update", 0.0, 1.0)  # no-op while off
    with trace.span("forward"):
        pass
    trace.start()
    assert trace.active() and all(getattr(hp, n) is not o for n, o in zip(names, originals))
    assert trace.stop() == []
    assert [getattr(hp, n) for n in names] + [_host_kernels.adamw_chunk] == originals


def test_eager_spans_and_summary():
    spans = _run_traced(eager=True)
    names = {s.name for s in spans}
    assert {"forward", "backward", "step", "offload_grad", "update", "upload", "wait_ready",
            "step.host_share"} <= names
    updates = [s for s in spans if s.name == "update"]
    assert all(s.thread.startswith("trainstream-worker") for s in updates)
    assert all(s.t1 >= s.t0 for s in spans)
    assert {s.sid for s in updates} == set(range(6))  # 3 weights + 3 biases, both steps
    summ = trace.summary(spans)
    # the worker threads that ran updates (both of them, or one where the host is busy)
    assert summ["workers"] == len({s.thread for s in updates}) in (1, 2)
    phases = [p["phase"] for p in summ["phases"]]
    assert phases == ["forward", "backward", "step"] * 2
    # The eager path offloads every gradient inside backward, one hook call per parameter.
    for p in summ["phases"]:
        if p["phase"] == "backward":
            assert p["offload_grad"]["n"] == 6
        else:
            assert p["offload_grad"]["n"] == 0
    # The second forward waits for the first step's updates (CPU params: on the host).
    assert summ["phases"][3]["wait_ready"]["n"] >= 1
    kernel_total = sum(s.t1 - s.t0 for s in updates) * 1e3
    in_phases = sum(p["worker_kernel_ms"] for p in summ["phases"])
    assert in_phases <= kernel_total + 1e-6


def test_chrome_trace_document():
    spans = _run_traced(eager=False)
    doc = json.loads(json.dumps(trace.chrome_trace(spans)))
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(spans)
    assert min(e["ts"] for e in events) == 0.0
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert "MainThread" in threads and any(t.startswith("trainstream-worker") for t in threads)


def test_jax_updates_are_labelled_apart_from_slots():
    """The JAX adapter's items (``update_external``) are recorded as -1-k, and their ``finished`` is no upload."""
    import jax
    import jax.numpy as jnp
    import optax
    from trainstream import jax as tsj

    params = {"a": jnp.ones((300,)), "b": jnp.ones((4, 5))}
    tx = tsj.offload_adamw(1e-3, threads=2)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    trace.start()
    try:
        updates, state = tx.update(grads, state, params)
        optax.apply_updates(params, updates)["a"].block_until_ready()
    finally:
        spans = trace.stop()
    updates = [s for s in spans if s.name == "update"]
    assert updates and {s.sid for s in updates} == {-1, -2}
    assert not [s for s in spans if s.name == "upload"]
