# Run: PYTHONPATH=. python experiments/bench_precopy.py [--numel 50000000] [--dtype float32] [--forward-ms 300] [--steps 5]
"""Issue 42: what the copies taken ahead (``prefetch_backups``) take off a speculative update's path, on this host's
CPU alone (no GPU: the engine on CPU tensors). Per step: a speculative update of one large slot, its commit, then
(with ``ahead``) the next step's copies queued, a sleep standing for the forward, and the next speculative update
timed from its gradient's hand-over to its end. Prints the update's wall time with and without the copies ahead,
their ratio, and the engine's ``backup_ms_total``/``precopy_ms_total``. Both setups in one process, interleaved."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainstream import contract as C
from trainstream.backends.torch import TorchBackend
from trainstream.core import _engine as E

HP = C.AdamWHyperParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--forward-ms", type=float, default=300.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    engines = {}
    for ahead in (False, True):
        eng = E.Engine(TorchBackend(torch.device("cpu")), mode="cpu", threads=a.threads)
        p = torch.randn(a.numel).to(dt)
        recipe = C.TorchRecipe(C.resolve_impl("cpu"), "cpu", a.dtype)
        engines[ahead] = (eng, eng.add_param(p, a.numel, a.dtype, "cpu", recipe=recipe))
    grads = [(torch.randn(a.numel) * 1e-2).to(dt) for _ in range(2)]
    times = {False: [], True: []}
    for step in range(a.steps + 1):
        for ahead, (eng, sid) in engines.items():
            t = time.perf_counter()
            eng.offload_grad(sid, grads[step % 2], a.dtype, HP, speculate=True, upload=False)
            eng.synchronize()
            if step:  # the first allocates the copies
                times[ahead].append(time.perf_counter() - t)
            eng.commit([sid])
            eng.synchronize()
            if ahead:
                eng.prefetch_backups([sid])
            time.sleep(a.forward_ms / 1e3)  # the forward
    print(f"# numel {a.numel:,} {a.dtype}, forward {a.forward_ms:.0f} ms, {a.steps} steps, threads "
          f"{engines[True][0].stats()['threads']:.0f}")
    for ahead, (eng, _) in engines.items():
        st = eng.stats()
        print(f"{'copies ahead' if ahead else 'copies in the update':22s} update wall median "
              f"{1e3 * statistics.median(times[ahead]):8.1f} ms  backup_ms_total {st['backup_ms_total']:8.1f}  "
              f"precopy_ms_total {st['precopy_ms_total']:8.1f}")
        eng.close()
    print(f"ratio (ahead / in the update): {statistics.median(times[True]) / statistics.median(times[False]):.3f}")


if __name__ == "__main__":
    main()
