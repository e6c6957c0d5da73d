# Run: python experiments/equivalence_torch.py [--quick] [--steps 300] [--devices cpu,cuda] [--out experiments/out/equivalence_torch]
"""Numerical equivalence of TrainStream's OffloadAdamW with torch.optim.AdamW, in training.

A small GPT-style byte-level language model, trained on text generated here (nothing is
downloaded), for N steps with every TrainStream setting beside the references:

* references: ``torch.optim.AdamW`` default (single-tensor on CPU, foreach on CUDA) and
  ``fused=True``;
* TrainStream: ``OffloadAdamW(mode="cpu")``, the same with the eager path
  (``last_micro_batch()``, without clipping only), and ``mode="gpu"`` and
  ``mode="hybrid"`` on CUDA when CuPy is present (skipped with a printed reason otherwise);
* fp32 weights; bf16 and fp16 weights against an fp32-master reference (the reference
  trains fp32 master copies fed the upcast gradients of its own half model, whose weights
  are the rounded master; micro-batches summed in the half ``param.grad``, as autograd
  sums them);
* with and without clipping (``max_grad_norm``; the reference calls ``clip_grad_norm_``)
  and gradient accumulation.

Each comparison is a pair of trainers that start from identical weights and see
identical batches; every TrainStream setting is compared with the reference loop a user
would write with ``torch.optim.AdamW``.

Per step: the loss of each, the fraction of (fp32 master) weights that are bit-identical
(and of the model's own weights, for fp16/bf16), the max distance in float32 ULPs (on the
ordered-integer line) and the max relative error ``|a - b| / max(|a|, |b|)``. The reference-vs-reference rows (default vs fused on one
device; CPU vs CUDA) show the size of the differences that users already accept.

Outputs (``--out``): ``equivalence_torch.json`` (everything), ``equivalence_torch.md``
(one row per comparison) and ``divergence_<dtype>.png`` (max ULP / max rel err per step).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from trainstream.torch import OffloadAdamW

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO, cpu_name, empty_per_step, generated_text, git_commit, record_step, summarize, tqdm, save_result,
)
from _common import fmt_frac as _fmt_frac  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_OUT = REPO / "experiments" / "out" / "equivalence_torch"

# Trainer kinds
DEFAULT, FUSED, TS_CPU, TS_EAGER, TS_GPU, TS_HYBRID = "torch default", "torch fused", "OffloadAdamW cpu", \
    "OffloadAdamW cpu eager", "OffloadAdamW gpu", "OffloadAdamW hybrid"
TS_KINDS = (TS_CPU, TS_EAGER, TS_GPU, TS_HYBRID)
_MODE = {TS_CPU: "cpu", TS_EAGER: "cpu", TS_GPU: "gpu", TS_HYBRID: "hybrid"}
# Notes on rows whose reference differs from the plain one


# -- model and data ------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block. Attention is written out (matmul, mask, softmax): the
    same deterministic kernels on every device, so that a pair of models whose weights
    are identical computes identical gradients."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def make_batches(n: int, batch: int, ctx: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.tensor(list(generated_text(max(2000, n * batch * ctx // 40), seed)), dtype=torch.long)
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n):
        ix = torch.randint(0, len(data) - ctx - 1, (batch,), generator=g)
        out.append((torch.stack([data[i:i + ctx] for i in ix]), torch.stack([data[i + 1:i + ctx + 1] for i in ix])))
    return out


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def ordered_params(model: nn.Module) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Parameters in the optimizer's order (decayed matrices first) and the two groups."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return decay + no_decay, [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


# -- trainers ------------------------------------------------------------------------------


class Trainer:
    """One model and one optimizer.

    ``kind``: torch default / fused, or an OffloadAdamW setting. For fp16/bf16 models the
    torch trainers keep fp32 master copies: each step, after the half model's own
    backward (micro-batches summed in ``param.grad``, in the parameter dtype) and, with
    clipping, ``torch.nn.utils.clip_grad_norm_`` on those half gradients (parameters in
    the optimizer's order), they upcast the gradients, step AdamW on the masters and round
    them into the model: the loop a user writes, and what OffloadAdamW must give.
    """

    def __init__(self, kind: str, device: torch.device, dtype: torch.dtype, init: dict[str, torch.Tensor],
                 args: argparse.Namespace, *, clip: float | None, accum: int):
        self.kind, self.device, self.dtype = kind, device, dtype
        self.clip, self.accum = clip, accum
        self.model = build_model(args)
        self.model.load_state_dict(init)
        self.model.to(device=device, dtype=dtype)
        self.params, groups = ordered_params(self.model)
        self.half = dtype != torch.float32
        self.last_norm: float | None = None
        self.norms: list[float | None] = []
        hp = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        self.masters = None
        if kind in TS_KINDS:
            self.opt = OffloadAdamW(groups, **hp, max_grad_norm=clip, mode=_MODE[kind], threads=args.threads)
        else:
            if self.half:
                self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
                n_decay = len(groups[0]["params"])
                groups = [{"params": self.masters[:n_decay]},
                          {"params": self.masters[n_decay:], "weight_decay": 0.0}]
            self.opt = torch.optim.AdamW(groups, **hp, fused=True if kind == FUSED else None)
        warm = max(1, args.steps // 10)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))

    @property
    def label(self) -> str:
        return f"{self.kind} [{self.device.type}]"

    # one optimizer step over ``accum`` micro-batches; returns the mean loss
    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        micro = [(x.to(self.device), y.to(self.device)) for x, y in micro]
        n = len(micro)
        losses = []
        if self.kind in TS_KINDS:
            self.opt.zero_grad()
            for i, (x, y) in enumerate(micro):
                loss = loss_of(self.model, x, y) / n
                if self.kind == TS_EAGER and i == n - 1:
                    with self.opt.last_micro_batch():
                        loss.backward()
                else:
                    loss.backward()
                losses.append(loss.detach())
            self.opt.step()
            self.last_norm = self.opt.last_grad_norm() if self.clip is not None else None
        else:
            self.opt.zero_grad()
            if self.half:
                for p in self.params:
                    p.grad = None
            for x, y in micro:
                loss = loss_of(self.model, x, y) / n
                loss.backward()
                losses.append(loss.detach())
            if self.clip is not None:
                self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip))
            if self.half:
                for m, p in zip(self.masters, self.params):
                    m.grad = p.grad.float()
                    p.grad = None
            self.opt.step()
            if self.half:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters):
                        p.copy_(m)  # round to nearest even, as Tensor.to(dtype)
        self.sched.step()
        self.norms.append(self.last_norm)
        return float(sum(losses).item())

    def synchronize(self) -> None:
        if isinstance(self.opt, OffloadAdamW):
            self.opt.synchronize()

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 master weights, the model's weights), flat, on the CPU."""
        model = torch.cat([p.detach().reshape(-1).cpu() for p in self.params])
        if not self.half:
            return model, model
        if self.masters is not None:
            master = torch.cat([m.detach().reshape(-1).cpu() for m in self.masters])
        else:
            state = self.opt.state_dict()["state"]
            master = torch.cat([state[i]["master_param"].reshape(-1) if i in state else p.detach().float().reshape(-1).cpu()
                                for i, p in enumerate(self.params)])
        return master, model

    def close(self) -> None:
        if isinstance(self.opt, OffloadAdamW):
            self.opt.close()


def build_model(args: argparse.Namespace) -> TinyGPT:
    return TinyGPT(vocab=128, d=args.d_model, layers=args.layers, heads=args.heads, ctx=args.ctx)


# -- metrics -------------------------------------------------------------------------------


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns on the ordered-integer line (+0 and -0 both 0), as int64."""
    i = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def compare(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    (ma, wa), (mb, wb) = a, b
    same = ma.view(torch.int32) == mb.view(torch.int32)
    same_model = (wa.view(torch.int16) == wb.view(torch.int16)) if wa.dtype != torch.float32 \
        else (wa.view(torch.int32) == wb.view(torch.int32))
    ulp = (_ordered(ma) - _ordered(mb)).abs()
    a64, b64 = ma.double(), mb.double()
    den = torch.maximum(a64.abs(), b64.abs())
    rel = torch.where(same | (den == 0), torch.zeros_like(den), (a64 - b64).abs() / den)
    return {
        "bitid": float(same.double().mean()),
        "bitid_model": float(same_model.double().mean()),
        "max_ulp": int(ulp.max()),
        "max_rel": float(rel.max()),
    }


# -- the experiment ------------------------------------------------------------------------


def plan_setting(devices: list[torch.device], dtype: torch.dtype, clip: float | None, accum: int,
                 init: dict[str, torch.Tensor], args: argparse.Namespace, gpu_ok: bool):
    """The trainers and compared pairs of one (dtype, clip, accum) setting."""
    trainers: list[Trainer] = []
    pairs: list[tuple[str, Trainer, Trainer, bool, str]] = []  # (kind, a, b, promised, note)

    def new(kind, dev, **kw):
        t = Trainer(kind, dev, dtype, init, args, clip=clip, accum=accum, **kw)
        trainers.append(t)
        return t

    ts_trainers = []
    own = {}
    for dev in devices:
        ts_kinds = [TS_CPU] + ([TS_EAGER] if clip is None else [])
        if dev.type == "cuda" and gpu_ok:
            ts_kinds += [TS_GPU, TS_HYBRID]
        default = new(DEFAULT, dev)
        own[dev.type] = default
        for kind in ts_kinds:
            ts = new(kind, dev)
            ts_trainers.append(ts)
            pairs.append(("trainstream-vs-reference", ts, default, True, ""))
        fused = new(FUSED, dev)
        pairs.append(("reference-vs-reference", default, fused, False, ""))
    if len(devices) > 1 and "cpu" in own and "cuda" in own:
        pairs.append(("reference-vs-reference", own["cuda"], own["cpu"], False, ""))
    return trainers, pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; --quick: 4)")
    ap.add_argument("--quick", action="store_true", help="CI size: a few steps of a tiny model")
    ap.add_argument("--devices", default=None, help="comma list of cpu,cuda (default: what exists)")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--max-grad-norm", type=float, default=0.5, help="the clipping setting's max_grad_norm")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches of the accumulation setting")
    ap.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 8; --quick: 4)")
    ap.add_argument("--ctx", type=int, default=None, help="context length (default 64; --quick: 32)")
    ap.add_argument("--d-model", type=int, default=None, help="width (default 64; --quick: 32)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default 2; --quick: 2)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, cosine to 10%%)")
    ap.add_argument("--threads", type=int, default=None, help="OffloadAdamW worker threads (default: its own)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1: small matrices, no contention with the "
                         "OffloadAdamW workers; 0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    quick = dict(steps=4, batch=4, ctx=32, d_model=32, layers=2)
    full = dict(steps=300, batch=8, ctx=64, d_model=64, layers=2)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    for d in devices:
        if d not in ("cpu", "cuda"):
            raise SystemExit(f"unknown device {d!r} (expected cpu or cuda)")
        if d == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--devices names cuda, but torch sees no CUDA device")
    devs = [torch.device(d) for d in devices]
    if "cuda" in devices:
        # Identical weights must give identical gradients: deterministic kernels, one
        # cuBLAS workspace configuration.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r} (expected some of {', '.join(DTYPES)})")

    skipped: list[str] = []
    gpu_ok = False
    if "cuda" in devices:
        if importlib.util.find_spec("cupy") is None:
            skipped.append("OffloadAdamW mode='gpu' and 'hybrid': CuPy is not installed (pip install 'trainstream[cuda12]' or '[cuda13]')")
        else:
            try:
                probe = nn.Parameter(torch.zeros(4, device="cuda"))
                OffloadAdamW([probe], mode="gpu").close()
                OffloadAdamW([probe], mode="hybrid").close()
                gpu_ok = True
            except Exception as exc:  # noqa: BLE001 - report why and go on without it
                skipped.append(f"OffloadAdamW mode='gpu' and 'hybrid': {type(exc).__name__}: {exc}")
    else:
        skipped.append("CUDA rows (torch foreach/fused on CUDA, OffloadAdamW with CUDA parameters, "
                       "mode='gpu', CPU vs CUDA): no CUDA device" if not torch.cuda.is_available()
                       else "CUDA rows: --devices leaves cuda out")
    for s in skipped:
        print(f"skipped: {s}")

    torch.manual_seed(args.seed)
    init = {k: v.clone() for k, v in build_model(args).state_dict().items()}
    n_params = sum(v.numel() for v in init.values())
    max_accum = max(1, args.accum)
    batches = make_batches(args.steps * max_accum, args.batch, args.ctx, args.seed)
    settings = [(dt, clip, acc) for dt in dtypes for clip in (None, args.max_grad_norm)
                for acc in sorted({1, max_accum})]
    print(f"TinyGPT {n_params / 1e6:.3f}M parameters (d={args.d_model}, layers={args.layers}, ctx={args.ctx}), "
          f"batch {args.batch}; {args.steps} steps; devices {','.join(devices)}; {len(settings)} settings")

    comparisons = []
    for dt_name, clip, acc in settings:
        dtype = DTYPES[dt_name]
        trainers, pairs = plan_setting(devs, dtype, clip, acc, init, args, gpu_ok)
        records = [dict(kind=k, a=a.label, b=b.label, device=a.device.type if a.device == b.device else
                        f"{a.device.type} vs {b.device.type}", dtype=dt_name, clip=clip, accum=acc,
                        promised=prom, note=note, per_step=empty_per_step())
                   for k, a, b, prom, note in pairs]
        desc = f"{dt_name} clip={'off' if clip is None else clip} accum={acc}"
        bar = tqdm(range(args.steps), desc=desc, disable=args.no_progress, leave=False, file=sys.stderr)
        try:
            for step in bar:
                micro = batches[step * max_accum: step * max_accum + acc]
                losses = {t: t.step(micro) for t in trainers}
                for t in trainers:
                    t.synchronize()
                weights = {t: t.weights() for t in trainers}
                worst = record_step(records, pairs, weights, losses, compare)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{losses[trainers[0]]:.3f}", max_ulp=worst)
        finally:
            for t in trainers:
                t.close()
        for rec in records:
            ps = rec["per_step"]
            norms = [n for n in ps["norm_a"] if n is not None]
            rec["summary"] = summarize(ps, sum(n > clip for n in norms) if clip is not None else None)
            comparisons.append(rec)
        # Written after every setting, so that a run cut short (a time limit) keeps what it did.
        write_outputs(args, argv, devices, dtypes, n_params, comparisons, skipped, t_start, complete=False)
        print(f"  {desc}: {len(records)} comparisons, {time.perf_counter() - t_start:.1f} s so far "
              f"(partial results in {args.out})", flush=True)
    result = write_outputs(args, argv, devices, dtypes, n_params, comparisons, skipped, t_start, complete=True)
    out = Path(args.out)
    plots = [] if args.no_plots else make_plots(result, out)
    result["files"] = [str(out / "equivalence_torch.json"), str(out / "equivalence_torch.md"), *map(str, plots)]
    print()
    print(markdown_table(result))
    broken = [c for c in comparisons if c["promised"] and c["summary"]["min_bitid"] < 1.0]
    print(f"{len(comparisons)} comparisons, {sum(c['promised'] for c in comparisons)} promised bit-identical, "
          f"{len(broken)} of those not; {time.perf_counter() - t_start:.1f} s; outputs in {out}")
    return result


def write_outputs(args, argv, devices, dtypes, n_params, comparisons, skipped, t_start, complete: bool) -> dict[str, Any]:
    """The JSON and the Markdown table of the comparisons so far (``complete``: all settings ran)."""
    runtime = time.perf_counter() - t_start
    meta = dict(
        script="experiments/equivalence_torch.py",
        command="python " + " ".join(["experiments/equivalence_torch.py", *(argv if argv is not None else sys.argv[1:])]),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(), torch=torch.__version__, numpy=np.__version__, python=platform.python_version(),
        cpu=cpu_name(), cores=os.cpu_count(),
        cuda=torch.cuda.get_device_name(0) if "cuda" in devices else None,
        devices=devices, dtypes=dtypes, steps=args.steps, params=n_params,
        model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads, ctx=args.ctx, vocab=128),
        batch=args.batch, accum=args.accum, max_grad_norm=args.max_grad_norm, lr=args.lr,
        betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, torch_threads=torch.get_num_threads(),
        runtime_s=runtime, skipped=skipped, complete=complete,
    )
    result = dict(meta=meta, comparisons=comparisons)
    save_result(args.out, "equivalence_torch", result, markdown_table(result))
    return result


def markdown_table(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        "# OffloadAdamW vs torch.optim.AdamW: numerical equivalence in training",
        "",
        f"`{m['command']}`  ",
        f"{m['date']}, commit `{m['commit']}`, torch {m['torch']}, CPU {m['cpu']} ({m['cores']} cores)"
        + (f", GPU {m['cuda']}" if m["cuda"] else "") + f"; training and comparisons took {m['runtime_s']:.1f} s"
        + ("" if m.get("complete", True) else " (**partial**: the run had not finished every setting)") + "  ",
        f"TinyGPT {m['params']:,} parameters ({m['model']}), batch {m['batch']}, {m['steps']} steps, "
        f"lr {m['lr']} (warmup + cosine), betas {tuple(m['betas'])}, weight decay {m['weight_decay']} on matrices; "
        f"clip = max_grad_norm; accum = micro-batches per step.",
        "",
        "Bit-identical: fraction of fp32 (master) weights equal bit for bit after the last step (for "
        "fp16/bf16, `model` is the fraction of the model's own half weights). Max ULP: the largest distance "
        "in float32 ULPs over all weights and steps; max rel: the largest `|a-b|/max(|a|,|b|)`. "
        "Promised: the contract promises bit-identity for this row.",
        "",
        "| comparison (a vs b) | device | dtype | clip | accum | promised | steps | bit-identical | model | max ULP | max rel err | final loss a / b |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        s = c["summary"]
        name = f"{c['a']} vs {c['b']}" + (f" ({c['note']})" if c["note"] else "")
        lines.append(
            f"| {name} | {c['device']} | {c['dtype']} | {'off' if c['clip'] is None else c['clip']} | {c['accum']} | "
            f"{'yes' if c['promised'] else 'no'} | {s['steps']} | {_fmt_frac(s['final_bitid'])} | "
            f"{_fmt_frac(s['final_bitid_model'])} | {s['max_ulp']} | {s['max_rel']:.3g} | "
            f"{s['final_loss_a']:.4f} / {s['final_loss_b']:.4f} |")
    if m["skipped"]:
        lines += ["", "Not run:"] + [f"- {s}" for s in m["skipped"]]
    return "\n".join(lines) + "\n"


def _plot_label(c: dict[str, Any]) -> str:
    return f"{c['a']} vs {c['b']}" + (f" ({c['note']})" if c["note"] else "")


def make_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []
    comps = result["comparisons"]
    for dt in result["meta"]["dtypes"]:
        mine = [c for c in comps if c["dtype"] == dt]
        settings = sorted({(c["clip"] is not None, c["accum"]) for c in mine})
        fig, axes = plt.subplots(2, len(settings), figsize=(4.2 * len(settings), 7), squeeze=False, sharex=True)
        handles = {}
        labels = list(dict.fromkeys(_plot_label(c) for c in mine))  # one colour per comparison
        colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
        for j, (clipped, acc) in enumerate(settings):
            for c in (c for c in mine if (c["clip"] is not None, c["accum"]) == (clipped, acc)):
                ps = c["per_step"]
                steps = np.arange(1, len(ps["max_ulp"]) + 1)
                label = _plot_label(c)
                # solid: promised bit-identical; dotted: TrainStream vs a different
                # reference; dashed: reference vs reference. Markers keep overlapping
                # zero lines visible.
                style = "-" if c["promised"] else (":" if c["kind"] == "trainstream-vs-reference" else "--")
                marker = "ox^sdv*P"[labels.index(label) % 8]
                kw = dict(lw=1.2, color=colors[label], marker=marker, markersize=3,
                          markevery=max(1, len(steps) // 12), label=label)
                h, = axes[0, j].plot(steps, ps["max_ulp"], style, **kw)
                axes[1, j].plot(steps, ps["max_rel"], style, **kw)
                handles.setdefault(label, h)
            axes[1, j].xaxis.set_major_locator(MaxNLocator(integer=True))
            title = f"{dt}, clip {'on' if clipped else 'off'}, accum {acc}"
            axes[0, j].set_title(title, fontsize=9)
            axes[0, j].set_yscale("symlog", linthresh=1)
            axes[1, j].set_yscale("symlog", linthresh=1e-9)
            axes[1, j].set_xlabel("step")
        axes[0, 0].set_ylabel("max distance (float32 ULPs)")
        axes[1, 0].set_ylabel("max relative error")
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=2, fontsize=8, frameon=False)
        fig.suptitle(f"OffloadAdamW vs torch.optim.AdamW, {dt} (0 = bit-identical; solid: promised bit-identical, dashed: reference vs reference)",
                     fontsize=10)
        fig.tight_layout(rect=(0, 0.04 + 0.025 * math.ceil(len(handles) / 2), 1, 0.97))
        path = out / f"divergence_{dt}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


if __name__ == "__main__":
    main()
