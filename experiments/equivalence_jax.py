# Run: python experiments/equivalence_jax.py [--quick] [--steps 300] [--devices cpu,gpu] [--out experiments/out/equivalence_jax]
"""Numerical equivalence of trainstream.jax.offload_adamw with optax.adamw, in training.

The pure-JAX GPT of ``models_jax.py``, byte-level, trained on text generated here for N
steps under ``jax.jit``, each pair from identical weights on identical batches, with a
warmup-cosine schedule and a weight-decay mask (no decay on vectors) in every setting:

* reference: ``optax.adamw`` in one jitted train step on the same backend (XLA:CPU); with
  clipping, ``optax.chain(optax.clip_by_global_norm(M), optax.adamw(...))``;
* TrainStream: ``offload_adamw(..., max_grad_norm=M)``: ``tx.step`` jitted with the gradient,
  called eagerly, and optax's ``tx.update`` + ``optax.apply_updates`` (exact where ``new - p``
  is, see ``offload_adamw``'s docstring);
* fp32 weights; bf16 (and fp16) weights against fp32 masters fed the upcast gradients of the
  reference's own half model (the upcast in a program of its own: inside the update's
  program XLA would fuse it, see "Fused gradients" in the contract);
* with and without clipping. The global norm's float32 value depends on the program that
  computes it (XLA's reduction order follows the fusion with the gradient); offload_adamw
  computes it where its step runs. The promised rows compare with a reference whose norm
  comes from the same kind of program; the rows against the plain reference carry none.

Unpromised rows: ``optax.adamw`` jitted vs op by op; on a GPU, optax on XLA:GPU vs XLA:CPU and
offload_adamw (``mode="gpu"``, ``"cpu"``) vs optax on the GPU (approximate square root and
division: the contract bounds each step in ULPs). Where runs differ, max ULP and max rel
come from weights near zero that change sign (chiefly the key third of the qkv biases,
whose gradient is rounding noise: softmax ignores it). Outputs (``--out``):
``equivalence_jax.json`` and ``equivalence_jax.md``.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import trainstream.jax as tsj

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, fill_defaults, provenance, run_study, study_args, summarize, text_windows, train_pairs  # noqa: E402
from models_jax import VOCAB, gpt_loss, init_gpt  # noqa: E402

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
F32 = jnp.float32
DEFAULT_OUT = REPO / "experiments" / "out" / "equivalence_jax"
TITLE = "trainstream.jax.offload_adamw vs optax.adamw: numerical equivalence in training"
REF_JIT, REF_EAGER, TS_JIT, TS_EAGER, TS_UPDATE = (
    "optax.adamw [jit]", "optax.adamw [eager]", "offload_adamw step [jit]", "offload_adamw step [eager]",
    "offload_adamw update+apply_updates [jit]")
UPDATE_NOTE = "optax API: apply_updates(p, new - p)"
NORM_IN_GRAD = "ref's norm from its gradient's program"
NORM_SEPARATE = "ref's norm from a program of its own"
NORM_OTHER = "ref's norm from another program"
GPU_NOTE = "XLA:GPU's approximate sqrt/division: bounded per step, not per trajectory"


def decay_mask(params):
    """Weight decay on matrices (embeddings, projections) only."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def flat(tree, dtype=np.float32) -> np.ndarray:
    """The leaves of ``tree`` as one flat NumPy array (``dtype=None``: their own dtype)."""
    return np.concatenate([np.asarray(x, dtype).reshape(-1) for x in jax.tree.leaves(tree)])


def _upcast(tree):
    return jax.tree.map(lambda x: x.astype(F32), tree)


@functools.lru_cache(maxsize=None)
def _shared(heads: int, dtype: str):
    """The jitted functions that depend only on the model and the dtype (compiled once for
    both clip settings): the loss, the casts, the gradient, the global norm, and (loss,
    gradient) with the norm of its float32 upcast in one program (where offload_adamw's
    jitted train step computes its norm)."""
    loss_fn = gpt_loss(heads)

    def grad_and_norm(p, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        return (loss, g), optax.tree.norm(_upcast(g))

    return (loss_fn, jax.jit(_upcast), jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype), t)),
            jax.jit(jax.value_and_grad(loss_fn)), jax.jit(lambda g: optax.tree.norm(_upcast(g))),
            jax.jit(grad_and_norm))


class Programs:
    """The optimizers and jitted functions of one (dtype, clip) setting, shared by its
    trainers (compiling dominates a short run)."""

    def __init__(self, args, dtype, clip: float | None):
        self.args, self.dtype, self.clip, self.half = args, dtype, clip, dtype != F32
        loss_fn, self.upcast, self.downcast, self.grad_fn, self.norm, self.grad_norm_fn = _shared(
            args.heads, jnp.dtype(dtype).name)
        self.loss_fn = loss_fn
        self.schedule = optax.warmup_cosine_decay_schedule(
            0.1 * args.lr, args.lr, warmup_steps=max(1, args.steps // 10), decay_steps=max(2, args.steps),
            end_value=0.1 * args.lr)
        self.hp = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask)
        adamw = optax.adamw(self.schedule, **self.hp)
        ref_opt = self.ref_opt = adamw if clip is None else optax.chain(optax.clip_by_global_norm(clip), adamw)

        def full_step(p, s, batch):  # the user's fp32 train step, jitted as a whole
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            u, s = ref_opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        def update(master, s, g32):  # fp32 master fed materialised fp32 gradients
            u, s = ref_opt.update(g32, s, master)
            return optax.apply_updates(master, u), s

        def update_given_norm(master, s, g32, g_norm):
            """chain(clip_by_global_norm, adamw) with optax's clip arithmetic on a given norm."""
            trigger = jnp.squeeze(g_norm < clip)
            g32 = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * clip), g32)
            u, s_adamw = adamw.update(g32, s[1], master)
            return optax.apply_updates(master, u), (s[0], s_adamw)

        self.ref_full_step, self.ref_update = jax.jit(full_step), jax.jit(update)
        self.ref_update_given_norm = jax.jit(update_given_norm) if clip is not None else None
        self.ref_update_eager = update  # called under jax.disable_jit()


class OptaxTrainer:
    """optax.adamw (chained after clip_by_global_norm when clipping), jitted or ``eager``.

    fp32 jitted: the whole train step as one program. Otherwise: the gradient (jitted), its
    upcast (half weights: fp32 masters, rounded into the model after), the update jitted or
    op by op. ``norm_from`` (clipping): None, optax's own norm; ``"grad"``, the norm computed
    in the gradient's program; ``"separate"``, in a program of its own; the update then runs
    ``clip_by_global_norm``'s arithmetic on it. ``track_norm``: also record the global norm
    each step (from a separate program)."""

    def __init__(self, kind, progs: Programs, init, *, eager=False, device=None, track_norm=False, norm_from=None):
        self.kind, self.progs, self.eager, self.track_norm, self.norm_from = kind, progs, eager, track_norm, norm_from
        self.device, self.device_type, self.last_norm = device, "cpu" if device is None else device.platform, None
        self.put = (lambda t: jax.device_put(t, device)) if device is not None else (lambda t: t)
        init32 = jax.tree.map(lambda x: jnp.asarray(x, F32), init)
        # half weights: the fp32 master starts as the rounded weights (as TrainStream's)
        self.master = self.put(progs.upcast(progs.downcast(init32)) if progs.half else init32)
        self.state = self.put(progs.ref_opt.init(self.master))
        self.model = progs.downcast(self.master) if progs.half else self.master

    @property
    def label(self) -> str:
        return self.kind if self.device is None else self.kind.replace("]", f", {self.device_type}]")

    def step(self, batch) -> float:
        pr, batch = self.progs, self.put(batch)
        if self.track_norm:
            self.last_norm = float(pr.norm(pr.grad_fn(self.model, batch)[1]))
        if not pr.half and not self.eager and self.norm_from is None:
            self.master, self.state, loss = pr.ref_full_step(self.master, self.state, batch)
            self.model = self.master
            return float(loss)
        if self.norm_from == "grad":
            (loss, g), norm = pr.grad_norm_fn(self.model, batch)
        else:
            loss, g = pr.grad_fn(self.model, batch)
            norm = pr.norm(g) if self.norm_from == "separate" else None
        g32 = pr.upcast(g) if pr.half else g
        if norm is not None:
            self.master, self.state = pr.ref_update_given_norm(self.master, self.state, g32, norm)
            self.last_norm = float(norm)
        elif self.eager:
            with jax.disable_jit():
                self.master, self.state = pr.ref_update_eager(self.master, self.state, g32)
        else:
            self.master, self.state = pr.ref_update(self.master, self.state, g32)
        self.model = pr.downcast(self.master) if pr.half else self.master
        return float(loss)

    def weights(self):
        """(fp32 master weights, the model's weights in their dtype), flat, on the host."""
        return flat(self.master), flat(self.model, None)

    def close(self) -> None:
        pass


class OffloadTrainer:
    """offload_adamw: TS_JIT, ``tx.step`` jitted with the gradient (the usual train step);
    TS_EAGER, ``tx.step`` called eagerly on the jitted gradient; TS_UPDATE, ``tx.update`` +
    ``optax.apply_updates`` jitted on it. The fp32 master is the engine's (``state_dict``)."""

    def __init__(self, kind, progs: Programs, init, *, device=None, mode="cpu"):
        self.kind, self.progs, self.device, self.mode, self.last_norm = kind, progs, device, mode, None
        self.device_type = "cpu" if device is None else device.platform
        self.tx = tsj.offload_adamw(progs.schedule, **progs.hp, max_grad_norm=progs.clip, threads=progs.args.threads,
                                    mode=mode, master_weights=True)
        self.params = jax.tree.map(lambda x: jnp.asarray(x, F32).astype(progs.dtype), init)
        if device is not None:
            self.params = jax.device_put(self.params, device)
        self.state = self.tx.init(self.params)
        tx, loss_fn = self.tx, progs.loss_fn

        def train_step(p, s, batch):
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            return *tx.step(g, s, p), loss

        def update_step(g, s, p):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        self.train_step = jax.jit(train_step) if kind == TS_JIT else None
        self.opt_step = tx.step if kind == TS_EAGER else jax.jit(update_step)

    @property
    def label(self) -> str:
        return self.kind if self.device is None else self.kind.replace("]", f", mode={self.mode}, {self.device_type}]")

    def step(self, batch) -> float:
        if self.device is not None:
            batch = jax.device_put(batch, self.device)
        if self.train_step is not None:
            self.params, self.state, loss = self.train_step(self.params, self.state, batch)
        else:
            loss, g = self.progs.grad_fn(self.params, batch)
            self.params, self.state = self.opt_step(g, self.state, self.params)
        return float(loss)

    def weights(self):
        model = flat(self.params, None)
        if not self.progs.half:
            return model, model
        return flat(tsj.state_dict(self.state, self.params)["master"]), model

    def close(self) -> None:
        tsj.close(self.state)


def plan_setting(progs: Programs, init, gpu_devices: list):
    """The trainers and compared pairs ``(kind, a, b, promised, note)`` of one setting."""
    trainers = []

    def add(t):
        trainers.append(t)
        return t

    ref = add(OptaxTrainer(REF_JIT, progs, init, track_norm=progs.clip is not None))
    ts_jit, ts_eager, ts_upd = (add(OffloadTrainer(k, progs, init)) for k in (TS_JIT, TS_EAGER, TS_UPDATE))
    eager = add(OptaxTrainer(REF_EAGER, progs, init, eager=True))
    pairs = [("trainstream-vs-reference", ts_jit, ref, True, ""), ("trainstream-vs-reference", ts_eager, ref, True, "")]
    if progs.clip is not None:
        ref_sep = add(OptaxTrainer(REF_JIT, progs, init, norm_from="separate"))
        pairs = [("trainstream-vs-reference", ts_eager, ref_sep, True, NORM_SEPARATE),
                 ("trainstream-vs-reference", ts_eager, ref, False, NORM_OTHER)]
        if progs.half:  # the fp32 train step computes the norm where offload_adamw's does
            ref_grad = add(OptaxTrainer(REF_JIT, progs, init, norm_from="grad"))
            pairs += [("trainstream-vs-reference", ts_jit, ref_grad, True, NORM_IN_GRAD),
                      ("trainstream-vs-reference", ts_jit, ref, False, NORM_OTHER)]
        else:
            pairs.append(("trainstream-vs-reference", ts_jit, ref, True, ""))
    pairs += [("trainstream-vs-trainstream", ts_upd, ts_jit, False, UPDATE_NOTE),
              ("reference-vs-reference", eager, ref, False, "")]
    for dev in gpu_devices:
        gpu_ref = add(OptaxTrainer(REF_JIT, progs, init, device=dev))
        pairs.append(("reference-vs-reference", gpu_ref, ref, False, ""))
        for mode in ("gpu", "cpu"):
            pairs.append(("trainstream-vs-reference", add(OffloadTrainer(TS_JIT, progs, init, device=dev, mode=mode)),
                          gpu_ref, False, GPU_NOTE))
    return trainers, pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    study_args(ap, DEFAULT_OUT, "comma list of cpu,gpu (default: what JAX sees)")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="the clipping setting's max_grad_norm (default 1.0; --quick: the median gradient norm of "
                         "the initial model over a few batches, so that some of its few steps clip)")
    return fill_defaults(ap.parse_args(argv), dict(dtypes="fp32,bf16"), dict(max_grad_norm=1.0))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if jax.config.jax_enable_x64:
        raise SystemExit("run with jax_enable_x64 off (the references are float32 programs)")
    try:
        gpus = list(jax.devices("gpu"))
    except RuntimeError:
        gpus = []
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["gpu"] if gpus else [])
    if "cpu" not in devices or not set(devices) <= {"cpu", "gpu"} or ("gpu" in devices and not gpus):
        raise SystemExit(f"--devices {','.join(devices)}: expected cpu, or cpu,gpu where JAX sees a GPU")
    gpu_devices = gpus[:1] if "gpu" in devices else []
    skipped = [] if gpu_devices else [
        "CUDA rows (optax.adamw on XLA:GPU vs XLA:CPU; offload_adamw mode='gpu' and mode='cpu' on the GPU): "
        + (f"no GPU visible to JAX (jax.devices() = {jax.devices()})" if not gpus else "--devices leaves gpu out")]
    with jax.default_device(jax.devices("cpu")[0]):
        init = init_gpt(args.layers, args.d_model, args.ctx, args.seed)
        n_params = sum(x.size for x in jax.tree.leaves(init))
        batches = [(x.astype(np.int32), y.astype(np.int32)) for x, y in text_windows(args.steps, args.batch, args.ctx, args.seed)]
        if args.max_grad_norm is None:
            progs = Programs(args, F32, None)
            norms = [float(progs.norm(progs.grad_fn(init, (x.astype(np.int32), y.astype(np.int32)))[1]))
                     for x, y in text_windows(8, args.batch, args.ctx, args.seed + 100)]
            args.max_grad_norm = float(f"{np.median(norms):.3g}")
        settings = [(dt, clip) for dt in args.dtypes for clip in (None, args.max_grad_norm)]
        print(f"GPT (pure JAX) {n_params / 1e6:.3f}M parameters (d={args.d_model}, layers={args.layers}, "
              f"ctx={args.ctx}), batch {args.batch}; {args.steps} steps; devices {','.join(devices)}; "
              f"{len(settings)} settings; max_grad_norm {args.max_grad_norm}")
        meta = dict(
            provenance("equivalence_jax.py", argv),
            versions=dict(jax=jax.__version__, optax=optax.__version__, numpy=np.__version__,
                          python=platform.python_version()),
            gpu=str(gpu_devices[0].device_kind) if gpu_devices else None,
            devices=devices, dtypes=args.dtypes, steps=args.steps, params=n_params,
            model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads, ctx=args.ctx, vocab=VOCAB),
            batch=args.batch, max_grad_norm=args.max_grad_norm, lr=args.lr, schedule="warmup_cosine_decay",
            b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, threads=args.threads, skipped=skipped)
        about = (f"GPT in pure JAX, {n_params:,} parameters ({meta['model']}), batch {args.batch}, {args.steps} steps, "
                 f"lr {args.lr} (optax warmup + cosine), weight decay 0.1 masked to matrices; clip = `max_grad_norm` "
                 "(the references: `optax.chain(optax.clip_by_global_norm(clip), optax.adamw(...))`). [jit]: under "
                 "`jax.jit`, with the gradient in one program for `offload_adamw step [jit]` and fp32 `optax.adamw "
                 "[jit]`, else on the gradient of a separate jitted program; [eager]: outside jit. Notes on clipped "
                 "rows name the program the reference's global norm came from (see the script's docstring).")

        def train_setting(setting):
            dt_name, clip = setting
            trainers, pairs = plan_setting(Programs(args, DTYPES[dt_name], clip), init, gpu_devices)
            desc = f"{dt_name} clip={'off' if clip is None else clip}"
            records = train_pairs(trainers, pairs, args.steps, batches.__getitem__, desc, args.no_progress,
                                  dtype=dt_name, clip=clip)
            for rec in records:
                ps = rec["per_step"]  # optax clips where not (norm < M); the optax reference's norm is norm_b
                norms = [n for n in ps["norm_b"] if n is not None] or [n for n in ps["norm_a"] if n is not None]
                rec["summary"] = summarize(ps, sum(n >= clip for n in norms) if clip is not None and norms else None)
            return records, desc

        return run_study("equivalence_jax", TITLE, about, meta, args, settings, train_setting, t_start)


if __name__ == "__main__":
    main()
