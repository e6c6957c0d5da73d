# Run (GPU machine): python experiments/spec_profile.py 3b ingpu spec spechost specgpu eager [nospec specov specgpuov]
"""Where a plain loop's step goes (issue 42): the GPT of models_torch.py at SIZE, bf16, activation checkpointing,
24 x 1024 tokens, the loop ``forward; backward; clip_grad_norm_(params, 1e9); step; zero_grad`` with each phase
ended by a device synchronize, for each SETUP: ``ingpu`` torch.optim.AdamW(fused=True) in GPU memory; ``spec``
OffloadAdamW(fused=True, mode="cpu") (updates during backward, validated at step(); ``grad_copies`` at its default:
GPU copies of the gradients where the GPU's free memory holds them); ``spechost`` the same with grad_copies=False
(the check sends the staged gradients back over PCIe); ``specgpu`` with grad_copies=True; ``nospec`` with
speculate=False; ``eager`` with backward inside last_micro_batch() (the weights uploaded during backward, as where
Accelerate's gradient state marks the last micro-batch); ``specov``/``specgpuov`` as ``spec``/``specgpu`` with
``overlap_forward=model`` (the weights' upload overlaps the next forward). Prints the medians of steps 3-7 (ms)
and, as ``w_*``, the host wall time inside the optimizer's step() parts (GradCapture.updates, its _verdicts: the
bitwise checks; Engine.commit and its uploads: _upload_many, copy_many_to_device, record_compute; Engine.step/...;
``w_keep``: the gradient copies' clones in the hooks, during backward), the speculation counters
(``spec_checks_device``/``spec_checks_staged``: gradients compared with a GPU copy / over PCIe), ``peak_gib``: the
GPU memory peak of the setup's steps (``torch.cuda.max_memory_allocated``, reset per setup), ``copy_peak_gib``: the
copies' own peak (``spec_copy_peak_bytes``), and ``bb``: the mean step of 5 more steps run back to back with one
synchronize at the end (no phase boundaries: what ``overlap_forward`` can hide shows only here).
"""
import functools
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import SIZES, VOCAB  # noqa: E402
from models_torch import GPT  # noqa: E402

import trainstream.torch._grads as G  # noqa: E402
import trainstream.torch._gradcopy as GC  # noqa: E402
import trainstream.torch._validate as V  # noqa: E402
from trainstream.backends import torch as TB  # noqa: E402
from trainstream.core import _engine as E  # noqa: E402
from trainstream.core import _speculate as SP  # noqa: E402
from trainstream.torch import OffloadAdamW  # noqa: E402

T = {}
def wrap(cls, name):
    f = getattr(cls, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T["w_" + name] = T.get("w_" + name, 0.0) + time.perf_counter() - t
    setattr(cls, name, w)
wrap(V.SpeculationPolicy, "_verdicts")
wrap(G.GradCapture, "updates")
for n in ("step", "commit", "rollback", "staged_grad", "synchronize", "wait_step"):
    if hasattr(E.Engine, n): wrap(E.Engine, n)
wrap(SP.Speculative, "_upload_many")
wrap(TB.TorchBackend, "copy_many_to_device")
wrap(TB.TorchBackend, "record_compute")
wrap(GC.GradCopies, "keep")
SETUPS = {"spec": {}, "spechost": dict(grad_copies=False), "specgpu": dict(grad_copies=True),
          "nospec": dict(speculate=False), "eager": {}, "specov": {}, "specgpuov": dict(grad_copies=True)}
size = sys.argv[1]
out = {}
for setup in sys.argv[2:]:
    torch.manual_seed(0)
    L, d, h = SIZES[size]
    model = GPT(L, d, h, vocab=VOCAB, device="cuda", dtype=torch.bfloat16, ckpt=True)
    params = list(model.parameters())
    HP = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    if setup == "ingpu":
        opt = torch.optim.AdamW(params, **HP)
    else:
        opt = OffloadAdamW(params, mode="cpu", worker_nice=5, **SETUPS[setup],
                           overlap_forward=model if setup.endswith("ov") else None, **HP)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    x = torch.randint(0, VOCAB, (24, 1024), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    rows = []
    for i in range(7):
        T.clear()
        ph = {}
        torch.cuda.synchronize(); t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        torch.cuda.synchronize(); t1 = time.perf_counter()
        if setup == "eager":
            with opt.last_micro_batch():
                loss.backward()
        else:
            loss.backward()
        torch.cuda.synchronize(); t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1e9)
        torch.cuda.synchronize(); t3 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize(); t4 = time.perf_counter()
        opt.zero_grad()
        torch.cuda.synchronize(); t5 = time.perf_counter()
        rows.append(dict(fwd=t1-t0, bwd=t2-t1, clip=t3-t2, step=t4-t3, zero=t5-t4, total=t5-t0, **{k: v for k, v in T.items()}))
    med = {k: 1e3 * statistics.median(r.get(k, 0.0) for r in rows[2:]) for k in rows[-1]}
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for i in range(5):  # back to back: one synchronize at the end
        loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        if setup == "eager":
            with opt.last_micro_batch():
                loss.backward()
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1e9)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    med["bb"] = 1e3 * (time.perf_counter() - t0) / 5
    st = opt.stats() if hasattr(opt, "stats") else {}
    med.update({k: st.get(k) for k in ("spec_steps_committed", "spec_steps_redone", "redo_ms_total", "host_state_bytes",
                                       "spec_checks_device", "spec_checks_staged", "spec_uploads_early",
                                       "backup_ms_total", "precopy_ms_total")})
    med["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    med["copy_peak_gib"] = st.get("spec_copy_peak_bytes", 0.0) / 2 ** 30
    print(size, setup, json.dumps({k: (round(v, 2 if k.endswith("gib") else 1) if isinstance(v, float) else v)
                                   for k, v in med.items()}), flush=True)
    out[setup] = med
    if hasattr(opt, "close"): opt.close()
    del opt, model, params, x, loss
    gc.collect(); torch.cuda.empty_cache()
