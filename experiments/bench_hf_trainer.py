# Run (GPU machine): python experiments/bench_hf_trainer.py --sizes 3b,7b --accum 1,4 --json $OUT/bench_hf_trainer.json
"""Issue 42 item 5: transformers' ``Trainer`` with its default arguments (``optim="adamw_torch_fused"``,
``max_grad_norm=1.0``, linear schedule, no weight decay) on a GPT-2 model (``GPT2LMHeadModel``, the shapes of
``_common.SIZES``, bf16 weights, ``gradient_checkpointing=True``), 24 x 1024 tokens per optimizer step, with
``gradient_accumulation_steps`` 1 and 4, trained twice: with its default optimizer (state in GPU memory) and with
``optimizer_cls_and_kwargs=(OffloadAdamW, {"fused": True})`` (the documented swap: the Trainer builds its
param groups and schedule as for its own). Nothing else changes: the Trainer calls backward and clips itself.
Random tokens at initialisation clip at 1.0 on every step (every speculative update redone: the redo cost);
``--max-grad-norm 1e9`` gives steps that compute the norm and do not clip (most steps of a real run).

Each setup runs in its own subprocess. Step time: the median interval between consecutive ``on_step_end``
callbacks (each after a device synchronize) over ``--steps`` steps after ``--warmup``; the peak GPU memory; for
OffloadAdamW its speculation counters (steps committed / redone, ms lost to redos). ``--device cpu`` is a
smoke test: ``python experiments/bench_hf_trainer.py --device cpu --sizes tiny --accum 1,4 --tokens 256 --seq 64
--vocab 256 --steps 2 --warmup 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SIZES, VOCAB, git_commit  # noqa: E402

SETUPS = ("default", "offload")


def child(size: str, setup: str, accum: int, args) -> dict:
    """One Trainer run; returns its row."""
    import transformers  # noqa: PLC0415

    from trainstream.torch import OffloadAdamW  # noqa: PLC0415

    cuda = args.device == "cuda"
    layers, d, heads = SIZES[size]
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=d, n_layer=layers, n_head=heads,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.GPT2LMHeadModel._from_config(cfg, torch_dtype=torch.bfloat16)
    batch = args.tokens // args.seq // accum
    n = batch * accum * (args.warmup + args.steps)
    ids = torch.randint(0, args.vocab, (n, args.seq), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": r, "labels": r} for r in ids]
    times = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_a, **_k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
            max_steps=args.warmup + args.steps, gradient_checkpointing=True, save_strategy="no", report_to=[],
            use_cpu=not cuda, disable_tqdm=True, seed=0, data_seed=0, dataloader_pin_memory=cuda,
            **({} if args.max_grad_norm is None else {"max_grad_norm": args.max_grad_norm}))
        kw = {"optimizer_cls_and_kwargs": (OffloadAdamW, {"fused": True, "lr": targs.learning_rate})} \
            if setup == "offload" else {}
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[Clock()], **kw)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        row = {"size": size, "setup": setup, "accum": accum, "micro_batch": batch, "seq": args.seq,
               "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
               "step_ms_median": 1e3 * statistics.median(b - a for a, b in zip(times[args.warmup:], times[args.warmup + 1:])),
               "optim": str(targs.optim), "max_grad_norm": targs.max_grad_norm,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
        if isinstance(opt, OffloadAdamW):
            st = opt.stats()
            row.update({k: st.get(k) for k in ("spec_steps_committed", "spec_steps_redone", "redo_ms_total",
                                                "host_state_bytes", "gpu_state_bytes", "spec_uploads_early",
                                                "spec_checks_device", "spec_checks_staged", "spec_copy_peak_bytes",
                                                "backup_ms_total", "precopy_ms_total")})
            opt.close()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="3b")
    ap.add_argument("--accum", default="1,4")
    ap.add_argument("--tokens", type=int, default=24 * 1024, help="tokens per optimizer step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="override the Trainer's default (1.0): a large value shows the cost of steps that do not clip")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        size, setup, accum = args._child.split(":")
        print("ROW " + json.dumps(child(size, setup, int(accum), args)), flush=True)
        return
    rows, passthrough, argv = [], [], iter(sys.argv[1:])
    for a in argv:  # the children write no JSON: --json and its value (or --json=...) are left out
        if a == "--json":
            next(argv, None)
        elif not a.startswith("--json="):
            passthrough.append(a)
    for size in args.sizes.split(","):
        for accum in map(int, args.accum.split(",")):
            for setup in SETUPS:
                t0 = time.perf_counter()
                try:
                    p = subprocess.run([sys.executable, __file__, *passthrough, "--_child", f"{size}:{setup}:{accum}"],
                                       capture_output=True, text=True, timeout=args.timeout)
                    found = [ln for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
                    row = json.loads(found[-1][4:]) if found else {"size": size, "setup": setup, "accum": accum,
                                                                   "error": p.stderr[-2000:]}
                except subprocess.TimeoutExpired:
                    row = {"size": size, "setup": setup, "accum": accum, "error": "timeout"}
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
                ref = next((r for r in rows if (r["size"], r["accum"], r["setup"]) == (size, accum, "default")
                            and "step_ms_median" in r), None)
                if "error" in row:
                    print(f"{size} accum {accum} {setup}: FAILED {row['error'][-400:]}", flush=True)
                    continue
                ratio = row["step_ms_median"] / ref["step_ms_median"] if ref else float("nan")
                spec = (f", speculation {row['spec_steps_committed']:.0f} committed / {row['spec_steps_redone']:.0f} "
                        f"redone / {row['redo_ms_total']:.0f} ms") if "spec_steps_committed" in row else ""
                print(f"{size} accum {accum} {setup:8s} {row['step_ms_median']:8.1f} ms ({ratio:.3f}x default), "
                      f"GPU peak {row['peak_gib']:.1f} GiB{spec}", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"commit": git_commit(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
