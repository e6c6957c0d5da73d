# Run: python experiments/equivalence_torch.py [--quick] [--steps 300] [--devices cpu,cuda] [--out experiments/out/equivalence_torch]
"""Numerical equivalence of TrainStream's OffloadAdamW with torch.optim.AdamW, in training.

The GPT of ``models_torch.py`` (attention written out: deterministic kernels), byte-level,
trained on text generated here, for N steps with every TrainStream setting beside the
references, each pair from identical weights on identical batches:

* references: ``torch.optim.AdamW`` default (single-tensor on CPU, foreach on CUDA) and
  ``fused=True``;
* TrainStream: ``OffloadAdamW(mode="cpu")``, the same with the eager path
  (``last_micro_batch()``, without clipping only), and ``mode="gpu"`` and ``"hybrid"`` on
  CUDA when CuPy is present (skipped with a printed reason otherwise);
* fp32 weights; bf16 and fp16 weights against an fp32-master reference (fp32 masters fed
  the upcast gradients of the reference's own half model, whose weights are the rounded
  master; micro-batches summed in the half ``param.grad``, as autograd sums them);
* with and without clipping (``max_grad_norm``; the reference calls ``clip_grad_norm_``)
  and gradient accumulation.

Per step: the loss of each, the fraction of (fp32 master) weights bit-identical (and of
the model's own weights), the max distance in float32 ULPs and the max relative error.
Reference-vs-reference rows (default vs fused; CPU vs CUDA) show the differences users
already accept. Outputs (``--out``): ``equivalence_torch.json`` and ``equivalence_torch.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from trainstream.torch import OffloadAdamW

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, fill_defaults, provenance, run_study, study_args, summarize, train_pairs  # noqa: E402
from models_torch import GPT, loss_of, text_batches  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_OUT = REPO / "experiments" / "out" / "equivalence_torch"
VOCAB = 128
DEFAULT, FUSED, TS_CPU, TS_EAGER, TS_GPU, TS_HYBRID = (
    "torch default", "torch fused", "OffloadAdamW cpu", "OffloadAdamW cpu eager", "OffloadAdamW gpu",
    "OffloadAdamW hybrid")
TITLE = "OffloadAdamW vs torch.optim.AdamW: numerical equivalence in training"
_MODE = {TS_CPU: "cpu", TS_EAGER: "cpu", TS_GPU: "gpu", TS_HYBRID: "hybrid"}


def build_model(args: argparse.Namespace) -> GPT:
    return GPT(args.layers, args.d_model, args.heads, vocab=VOCAB, ctx=args.ctx, sdpa=False)


def ordered_params(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[dict]]:
    """Parameters in the optimizer's order (decayed matrices first) and the two groups."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return decay + no_decay, [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
    """One model and one optimizer. For fp16/bf16 models TrainStream runs ``master_weights=True`` and the torch
    trainers keep fp32 master copies: they sum each micro-batch's gradients in fp32 on the masters (as Megatron's
    fp32 main grads), clip there (``clip_grad_norm_``, parameters in the optimizer's order), step AdamW on the
    masters and round them into the model."""

    def __init__(self, kind: str, device: torch.device, dtype: torch.dtype, init: dict, args, *,
                 clip: float | None, accum: int):
        self.kind, self.device, self.device_type, self.clip, self.accum = kind, device, device.type, clip, accum
        self.model = build_model(args)
        self.model.load_state_dict(init)
        self.model.to(device=device, dtype=dtype)
        self.params, groups = ordered_params(self.model)
        self.half = dtype != torch.float32
        self.last_norm: float | None = None
        hp = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        self.masters = None
        if kind in _MODE:
            self.opt = OffloadAdamW(groups, **hp, max_grad_norm=clip, mode=_MODE[kind], threads=args.threads,
                                    master_weights=self.half)
        else:
            if self.half:
                self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
                n = len(groups[0]["params"])
                groups = [{"params": self.masters[:n]}, {"params": self.masters[n:], "weight_decay": 0.0}]
            self.opt = torch.optim.AdamW(groups, **hp, fused=True if kind == FUSED else None)
        warm = max(1, args.steps // 10)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))

    @property
    def label(self) -> str:
        return f"{self.kind} [{self.device.type}]"

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over the micro-batches; returns the summed (mean) loss."""
        micro = [(x.to(self.device), y.to(self.device)) for x, y in micro]
        losses = []
        self.opt.zero_grad()
        if self.half and self.masters is not None:
            for p in self.params:
                p.grad = None
        for i, (x, y) in enumerate(micro):
            loss = loss_of(self.model, x, y) / len(micro)
            if self.kind == TS_EAGER and i == len(micro) - 1:
                with self.opt.last_micro_batch():
                    loss.backward()
            else:
                loss.backward()
            if self.masters is not None:  # the micro-batch's gradients summed in fp32
                for m, p in zip(self.masters, self.params):
                    m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                    p.grad = None
            losses.append(loss.detach())
        if self.kind in _MODE:
            self.opt.step()
            self.last_norm = self.opt.last_grad_norm() if self.clip is not None else None
        else:
            if self.clip is not None:
                self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.masters or self.params, self.clip))
            self.opt.step()
            if self.masters is not None:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters):
                        p.copy_(m)  # round to nearest even, as Tensor.to(dtype)
        self.sched.step()
        return float(sum(losses).item())

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """(fp32 master weights, the model's weights as bits), flat, on the host."""
        if isinstance(self.opt, OffloadAdamW):
            self.opt.synchronize()
        model = torch.cat([p.detach().reshape(-1).cpu() for p in self.params])
        if not self.half:
            return model.numpy(), model.numpy()
        if self.masters is not None:
            master = torch.cat([m.detach().reshape(-1).cpu() for m in self.masters])
        else:
            state = self.opt.state_dict()["state"]
            master = torch.cat([state[i]["master_param"].reshape(-1) if i in state else p.detach().float().reshape(-1).cpu()
                                for i, p in enumerate(self.params)])
        return master.numpy(), model.view(torch.int16).numpy()

    def close(self) -> None:
        if isinstance(self.opt, OffloadAdamW):
            self.opt.close()


def plan_setting(devices, dtype, clip, accum, init, args, gpu_ok: bool):
    """The trainers and compared pairs ``(kind, a, b, promised, note)`` of one setting."""
    trainers, pairs, own = [], [], {}

    def new(kind, dev):
        trainers.append(Trainer(kind, dev, dtype, init, args, clip=clip, accum=accum))
        return trainers[-1]

    for dev in devices:
        kinds = [TS_CPU] + ([TS_EAGER] if clip is None else []) + ([TS_GPU, TS_HYBRID] if dev.type == "cuda" and gpu_ok else [])
        own[dev.type] = default = new(DEFAULT, dev)
        for kind in kinds:
            pairs.append(("trainstream-vs-reference", new(kind, dev), default, True, ""))
        pairs.append(("reference-vs-reference", default, new(FUSED, dev), False, ""))
    if "cpu" in own and "cuda" in own:
        pairs.append(("reference-vs-reference", own["cuda"], own["cpu"], False, ""))
    return trainers, pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    study_args(ap, DEFAULT_OUT, "comma list of cpu,cuda (default: what exists)")
    ap.add_argument("--max-grad-norm", type=float, default=0.5, help="the clipping setting's max_grad_norm")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches of the accumulation setting")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    return fill_defaults(ap.parse_args(argv), {}, {})


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for d in devices:
        if d not in ("cpu", "cuda") or (d == "cuda" and not torch.cuda.is_available()):
            raise SystemExit(f"device {d!r}: expected cpu or cuda (cuda needs a CUDA device torch sees)")
    if "cuda" in devices:  # identical weights must give identical gradients
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    skipped, gpu_ok = [], False
    if "cuda" not in devices:
        skipped.append("CUDA rows (torch on CUDA, OffloadAdamW with CUDA parameters, CPU vs CUDA): "
                       + ("no CUDA device" if not torch.cuda.is_available() else "--devices leaves cuda out"))
    elif importlib.util.find_spec("cupy") is None:
        skipped.append("OffloadAdamW mode='gpu' and 'hybrid': CuPy is not installed (trainstream[cuda12] or [cuda13])")
    else:
        try:
            probe = torch.nn.Parameter(torch.zeros(4, device="cuda"))
            for mode in ("gpu", "hybrid"):
                OffloadAdamW([probe], mode=mode).close()
            gpu_ok = True
        except Exception as exc:  # noqa: BLE001 - report why and go on without it
            skipped.append(f"OffloadAdamW mode='gpu' and 'hybrid': {type(exc).__name__}: {exc}")
    torch.manual_seed(args.seed)
    init = {k: v.clone() for k, v in build_model(args).state_dict().items()}
    n_params = sum(v.numel() for v in init.values())
    batches = text_batches(args.steps * args.accum, args.batch, args.ctx, args.seed)
    settings = [(dt, clip, acc) for dt in args.dtypes for clip in (None, args.max_grad_norm) for acc in sorted({1, args.accum})]
    print(f"GPT {n_params / 1e6:.3f}M parameters (d={args.d_model}, layers={args.layers}, ctx={args.ctx}), "
          f"batch {args.batch}; {args.steps} steps; devices {','.join(devices)}; {len(settings)} settings")
    meta = dict(
        provenance("equivalence_torch.py", argv),
        versions=dict(torch=torch.__version__, numpy=np.__version__, python=platform.python_version()),
        gpu=torch.cuda.get_device_name(0) if "cuda" in devices else None,
        devices=devices, dtypes=args.dtypes, steps=args.steps, params=n_params,
        model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads, ctx=args.ctx, vocab=VOCAB),
        batch=args.batch, accum=args.accum, max_grad_norm=args.max_grad_norm, lr=args.lr, betas=[0.9, 0.95],
        eps=1e-8, weight_decay=0.1, torch_threads=torch.get_num_threads(), skipped=skipped)
    about = (f"GPT {n_params:,} parameters ({meta['model']}), batch {args.batch}, {args.steps} steps, lr {args.lr} "
             "(warmup + cosine), betas (0.9, 0.95), weight decay 0.1 on matrices; clip = max_grad_norm; "
             "accum = micro-batches per step.")

    def train_setting(setting):
        dt_name, clip, acc = setting
        trainers, pairs = plan_setting([torch.device(d) for d in devices], DTYPES[dt_name], clip, acc, init, args, gpu_ok)
        desc = f"{dt_name} clip={'off' if clip is None else clip} accum={acc}"
        records = train_pairs(trainers, pairs, args.steps, lambda step: batches[step * args.accum: step * args.accum + acc],
                              desc, args.no_progress, dtype=dt_name, clip=clip, accum=acc)
        for rec in records:
            norms = [n for n in rec["per_step"]["norm_a"] if n is not None]
            rec["summary"] = summarize(rec["per_step"], sum(n > clip for n in norms) if clip is not None else None)
        return records, desc

    return run_study("equivalence_torch", TITLE, about, meta, args, settings, train_setting, t_start)


if __name__ == "__main__":
    main()
