# Run: python experiments/equivalence_jax.py [--quick] [--steps 300] [--devices cpu,gpu] [--out experiments/out/equivalence_jax]
"""Numerical equivalence of trainstream.jax.offload_adamw with optax.adamw, in training.

A small GPT-style byte-level language model written in pure JAX, trained on text
generated here (nothing is downloaded), for N steps under ``jax.jit`` with TrainStream's
optax transformation beside the references, every pair from identical weights on
identical batches. Every setting uses a warmup-cosine schedule and a weight-decay mask
(no decay on vectors: biases and LayerNorm gains):

* reference: ``optax.adamw`` in one jitted train step (gradient, ``update``,
  ``apply_updates``), on the same backend (XLA:CPU); with clipping,
  ``optax.chain(optax.clip_by_global_norm(M), optax.adamw(...))``;
* TrainStream: ``offload_adamw(..., max_grad_norm=M)`` (``convention="optax"``) through
  ``tx.step`` (the exact weights) jitted with the gradient, the same step called eagerly
  (outside ``jax.jit``), and optax's usage ``tx.update`` + ``optax.apply_updates``
  (exact where ``new - p`` is, see ``offload_adamw``'s docstring);
* fp32 weights; bf16 (and fp16) weights against an fp32-master reference: the reference
  trains fp32 masters with optax, fed the upcast gradients of its own half model, whose
  weights are the rounded master (the upcast is its own program: inside the update's
  program XLA would fuse it into the moment update, see "Fused gradients" in
  ``trainstream/contract.py``);
* with and without clipping. The global norm is an input that only XLA computes, and its
  float32 value depends on the program that computes it (XLA's reduction order follows
  the fusion with the gradient and the leaves' dtype). offload_adamw computes it where
  its step runs: inside the jitted train step, or, eagerly, in a program of its own.
  The promised rows compare with a reference whose norm comes from the same kind of
  program (for fp32 [jit], optax's own train step); the rows against the plain reference,
  whose norm comes from another program, carry no promise and show what a last-bit
  difference in the norm does.

Reference-vs-reference rows show the size of differences users already accept:
``optax.adamw`` jitted vs run eagerly (op by op, under ``jax.disable_jit()``; gradients
from the same jitted function), and, if torch is importable, TrainStream's ``torch``
convention (which reproduces ``torch.optim.AdamW`` bit for bit: its own row against a
real ``torch.optim.AdamW`` fed the same JAX gradients) against optax on the same data.
On a machine where JAX sees a GPU, ``optax.adamw`` on XLA:GPU vs XLA:CPU, and TrainStream
on the GPU (``mode="gpu"`` and ``mode="cpu"``, jitted) vs ``optax.adamw`` jitted on the GPU:
no promise of bit-identity there (XLA:GPU's approximate square root and division; the
contract bounds each step in ULPs), the rows show how far the trajectories drift.

Per step: the loss of each, the fraction of (fp32 master) weights that are bit-identical
(and of the model's own weights, for fp16/bf16), the max distance in float32 ULPs (on the
ordered-integer line) and the max relative error ``|a - b| / max(|a|, |b|)``. Where two
runs differ at all, the last two are set by weights near zero that change sign: chiefly
the key third of the qkv biases, whose gradient is zero up to rounding (softmax is
invariant to it), so that Adam moves them by about ``lr`` on the sign of rounding noise.

Outputs (``--out``): ``equivalence_jax.json`` (everything), ``equivalence_jax.md``
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

import jax
import jax.numpy as jnp
import optax

import trainstream.jax as tsj
from trainstream import contract as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO, cpu_name, empty_per_step, generated_text, git_commit, record_step, summarize, tqdm, save_result,
)
from _common import fmt_frac as _fmt_frac  # noqa: E402

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
F32 = jnp.float32
DEFAULT_OUT = REPO / "experiments" / "out" / "equivalence_jax"
VOCAB = 128

# Trainer kinds
REF_JIT, REF_EAGER, TS_JIT, TS_EAGER, TS_UPDATE, TS_TORCH, TORCH = (
    "optax.adamw [jit]", "optax.adamw [eager]", "offload_adamw step [jit]", "offload_adamw step [eager]",
    "offload_adamw update+apply_updates [jit]", "offload_adamw convention=torch [jit]", "torch.optim.AdamW")
TS_KINDS = (TS_JIT, TS_EAGER, TS_UPDATE, TS_TORCH)
# Notes on rows
UPDATE_NOTE = "optax API: apply_updates(p, new - p), exact where new - p is (Sterbenz)"
OWN_NORM = "torch.optim.AdamW reference clips with its own clip_grad_norm_"
NORM_IN_GRAD = ("reference clips by the norm computed in its gradient's program, as offload_adamw's "
                "jitted train step computes it")
NORM_SEPARATE = ("reference clips by the norm computed from the gradients in a program of its own, "
                 "as offload_adamw's eager path computes it")
NORM_OTHER = ("reference computes its norm in another program: XLA's reduction order differs, "
              "so the float32 norm can differ in the last bit")
CONVENTIONS_NOTE = "convention='torch' (== torch.optim.AdamW) vs 'optax' on the same data"
GPU_NOTE = ("XLA:GPU's optax uses approximate sqrt/division: the contract bounds each step in ULPs "
            "(tests/test_jax_gpu.py), not the trajectory")


# -- model and data (pure JAX) ---------------------------------------------------------------


def init_params(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Float32 weights of a pre-LN GPT (untied head), as NumPy arrays."""
    rng = np.random.default_rng(seed)
    d = args.d_model

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale if scale is not None else 1 / math.sqrt(shape[0]))).astype(np.float32)

    def ln():
        return {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)}

    def dense(a, b, scale=None):
        return {"w": w(a, b, scale=scale), "b": (0.02 * rng.standard_normal(b)).astype(np.float32)}

    blocks = [{"ln1": ln(), "qkv": dense(d, 3 * d), "proj": dense(d, d, scale=0.5 / math.sqrt(d)),
               "ln2": ln(), "fc": dense(d, 4 * d), "out": dense(4 * d, d, scale=0.5 / math.sqrt(4 * d))}
              for _ in range(args.layers)]
    return {"tok": w(VOCAB, d, scale=0.1), "pos": w(args.ctx, d, scale=0.1), "blocks": blocks,
            "ln_f": ln(), "head": dense(d, VOCAB)}


def _layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def make_loss(heads: int):
    def loss_fn(params, batch):
        """Mean next-byte cross-entropy (in float32) of a causal transformer; the model
        computes in the weights' dtype."""
        x, y = batch
        n = x.shape[1]
        h = params["tok"][x] + params["pos"][:n]
        d = h.shape[-1]
        mask = jnp.tril(jnp.ones((n, n), bool))
        for b in params["blocks"]:
            q, k, v = jnp.split(_layer_norm(h, b["ln1"]) @ b["qkv"]["w"] + b["qkv"]["b"], 3, axis=-1)
            split = lambda t: t.reshape(t.shape[0], n, heads, d // heads).transpose(0, 2, 1, 3)  # noqa: E731
            q, k, v = split(q), split(k), split(v)
            att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(d // heads))
            att = jax.nn.softmax(jnp.where(mask, att, -1e4).astype(F32), axis=-1).astype(h.dtype)
            o = (att @ v).transpose(0, 2, 1, 3).reshape(h.shape)
            h = h + o @ b["proj"]["w"] + b["proj"]["b"]
            z = jax.nn.gelu(_layer_norm(h, b["ln2"]) @ b["fc"]["w"] + b["fc"]["b"])
            h = h + z @ b["out"]["w"] + b["out"]["b"]
        logits = _layer_norm(h, params["ln_f"]) @ params["head"]["w"] + params["head"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), y).mean()

    return loss_fn


def decay_mask(params):
    """Weight decay on matrices (embeddings, projections) only, as equivalence_torch.py."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_batches(n: int, batch: int, ctx: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    data = np.frombuffer(generated_text(max(2000, n * batch * ctx // 40), seed), np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(n):
        ix = rng.integers(0, len(data) - ctx - 1, batch)
        out.append((np.stack([data[i:i + ctx] for i in ix]), np.stack([data[i + 1:i + ctx + 1] for i in ix])))
    return out


def make_schedule(args: argparse.Namespace):
    """Linear warmup from 10% to the peak, cosine decay to 10%."""
    return optax.warmup_cosine_decay_schedule(0.1 * args.lr, args.lr, warmup_steps=max(1, args.steps // 10),
                                              decay_steps=max(2, args.steps), end_value=0.1 * args.lr)


def flat(tree) -> np.ndarray:
    """The leaves of ``tree`` as one flat float32 NumPy array (on the host)."""
    return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(tree)])


def flat_native(tree) -> np.ndarray:
    """The leaves of ``tree`` in their own dtype, flat (bit patterns compared)."""
    return np.concatenate([np.asarray(x).reshape(-1) for x in jax.tree.leaves(tree)])


# -- the jitted programs of one setting, shared by its trainers --------------------------------


_SHARED: dict[tuple, dict[str, Any]] = {}


def _grad_and_norm(loss_fn, p, batch):
    """(loss, gradient) and the global norm of the gradient's float32 upcast, in one program
    (where offload_adamw's jitted train step computes its norm)."""
    loss, g = jax.value_and_grad(loss_fn)(p, batch)
    return (loss, g), optax.tree.norm(jax.tree.map(lambda x: x.astype(F32), g))


def shared_programs(heads: int, dtype) -> dict[str, Any]:
    """Jitted functions that depend only on the model and the dtype (compiled once for
    both clip settings): the gradient, the up/down casts, the global norm."""
    key = (heads, jnp.dtype(dtype).name)
    if key not in _SHARED:
        loss_fn = make_loss(heads)
        _SHARED[key] = dict(
            loss_fn=loss_fn,
            grad_fn=jax.jit(jax.value_and_grad(loss_fn)),
            upcast=jax.jit(lambda t: jax.tree.map(lambda x: x.astype(F32), t)),
            downcast=jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dtype), t)),
            norm=jax.jit(lambda g: optax.tree.norm(jax.tree.map(lambda x: x.astype(F32), g))),
            grad_norm_fn=jax.jit(lambda p, b: _grad_and_norm(loss_fn, p, b)),
        )
    return _SHARED[key]


class Programs:
    """The optimizers and jitted functions of one (dtype, clip) setting, shared by its
    trainers (compiling dominates a short run)."""

    def __init__(self, args: argparse.Namespace, dtype, clip: float | None):
        self.args, self.dtype, self.clip = args, dtype, clip
        self.half = dtype != F32
        sh = shared_programs(args.heads, dtype)
        self.loss_fn, self.grad_fn, self.upcast, self.downcast, self.norm, self.grad_norm_fn = (
            sh[k] for k in ("loss_fn", "grad_fn", "upcast", "downcast", "norm", "grad_norm_fn"))
        self.schedule = make_schedule(args)
        self.hp = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay_mask)
        adamw = optax.adamw(self.schedule, **self.hp)
        self.ref_opt = adamw if clip is None else optax.chain(optax.clip_by_global_norm(clip), adamw)
        ref_opt, loss_fn = self.ref_opt, self.loss_fn

        def ref_full_step(p, s, batch):  # the user's fp32 train step, jitted as a whole
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            u, s = ref_opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        def ref_update(master, s, g32):  # fp32 master fed materialised fp32 gradients
            u, s = ref_opt.update(g32, s, master)
            return optax.apply_updates(master, u), s

        def ref_update_given_norm(master, s, g32, g_norm):
            """chain(clip_by_global_norm, adamw) with clip_by_global_norm's arithmetic
            (optax's code) on a norm computed elsewhere (see OptaxTrainer's norm_from)."""
            trigger = jnp.squeeze(g_norm < clip)
            g32 = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * clip), g32)
            u, s_adamw = adamw.update(g32, s[1], master)
            return optax.apply_updates(master, u), (s[0], s_adamw)

        self.ref_full_step = jax.jit(ref_full_step)
        self.ref_update = jax.jit(ref_update)
        self.ref_update_given_norm = jax.jit(ref_update_given_norm) if clip is not None else None
        self.ref_update_eager = ref_update  # called under jax.disable_jit()
        # the torch convention's learning rate, computed as the adapter computes it in-graph
        sched = self.schedule
        self.neg_lr = jax.jit(lambda count: jnp.asarray(-1 * sched(count), jnp.float32))

    def offload(self, convention: str = "optax", mode: str = "cpu"):
        return tsj.offload_adamw(self.schedule, **self.hp, max_grad_norm=self.clip, convention=convention,
                                 threads=self.args.threads, mode=mode)

    def ts_train_step(self, tx):
        """The TrainStream train step in one jitted program: gradient, then ``tx.step``."""
        loss_fn = self.loss_fn

        def step(p, s, batch):
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            p, s = tx.step(g, s, p)
            return p, s, loss

        return jax.jit(step)

    @staticmethod
    def ts_update(tx, api: str):
        """A jitted optimizer step on a (materialised) gradient: ``tx.step`` (``api="step"``)
        or optax's ``tx.update`` + ``optax.apply_updates`` (``api="update"``)."""

        def step(g, s, p):
            if api == "step":
                return tx.step(g, s, p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.jit(step)


# -- trainers ------------------------------------------------------------------------------------


class Trainer:
    """One model and one optimizer, stepped on the same batches as the others."""

    device_type = "cpu"

    def __init__(self, kind: str, progs: Programs):
        self.kind, self.progs = kind, progs
        self.last_norm: float | None = None

    @property
    def label(self) -> str:
        return self.kind

    def step(self, batch) -> float:
        raise NotImplementedError

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """(fp32 master weights, the model's weights in their dtype), flat, on the host."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class OptaxTrainer(Trainer):
    """optax.adamw (chained after clip_by_global_norm when clipping), jitted or eagerly.

    fp32: ``jit`` runs the whole train step as one program. Half weights: fp32 masters;
    the half model's gradient (jitted), its upcast (its own program), the optax update on
    the masters (jitted, or op by op) and the rounding of the masters into the model.
    ``eager``: the gradient from the same jitted function, then ``update`` and
    ``apply_updates`` op by op under ``jax.disable_jit()``. ``track_norm``: also compute
    the global gradient norm each step (from a separate program, not the train step).

    ``norm_from`` (clipping): where the global norm comes from. None: optax's own (in the
    fp32 train step, or in the update's program from the materialised fp32 gradients).
    ``"grad"``: ``optax.tree.norm`` of the float32 upcast of the gradient, computed in the
    gradient's program, as offload_adamw's jitted train step computes it. ``"separate"``:
    the same expression in a program of its own on the materialised gradient, as
    offload_adamw's eager path computes it. XLA reduces the sum of squares in an order that
    depends on the program (fusion with the gradient, dtype of the leaves), so the three
    float32 norms can differ in the last bit, and with them every clipped weight. The
    update then runs ``clip_by_global_norm``'s arithmetic on that norm, jitted apart from
    the gradient.
    """

    def __init__(self, kind: str, progs: Programs, init, *, eager: bool = False, device=None,
                 track_norm: bool = False, norm_from: str | None = None):
        super().__init__(kind, progs)
        self.eager, self.track_norm, self.norm_from = eager, track_norm, norm_from
        self.device = device
        self.device_type = "cpu" if device is None else device.platform
        put = (lambda t: jax.device_put(t, device)) if device is not None else (lambda t: jax.tree.map(jnp.asarray, t))
        self.put = put
        init32 = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float32)), init)
        # half weights: the fp32 master starts as the rounded weights (as TrainStream's)
        self.master = put(progs.upcast(progs.downcast(init32)) if progs.half else init32)
        self.state = put(progs.ref_opt.init(self.master))
        self.model = progs.downcast(self.master) if progs.half else self.master

    @property
    def label(self) -> str:
        return self.kind if self.device is None else self.kind.replace("]", f", {self.device_type}]")

    def step(self, batch) -> float:
        pr = self.progs
        batch = self.put(batch) if self.device is not None else batch
        if self.track_norm:  # from a separate gradient program, not the train step's
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
        return flat(self.master), flat_native(self.model)


class OffloadTrainer(Trainer):
    """trainstream.jax.offload_adamw. TS_JIT: ``tx.step`` jitted together with the gradient
    (one program, the usual train step); TS_EAGER: ``tx.step`` called eagerly on the jitted
    gradient; TS_UPDATE: ``tx.update`` + ``optax.apply_updates`` jitted, on the jitted
    gradient; TS_TORCH: ``convention="torch"``, ``tx.step`` jitted, on the jitted gradient
    (the optimizer programs apart from the gradient compile in a fraction of the time; the
    adapter reads materialised gradients either way). The model's weights are in the
    setting's dtype; the fp32 master is the engine's (``state_dict``)."""

    def __init__(self, kind: str, progs: Programs, init, *, device=None, mode: str = "cpu"):
        super().__init__(kind, progs)
        self.device, self.mode = device, mode
        self.device_type = "cpu" if device is None else device.platform
        self.tx = progs.offload("torch" if kind == TS_TORCH else "optax", mode=mode)
        self.params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float32)).astype(progs.dtype), init)
        if device is not None:
            self.params = jax.device_put(self.params, device)
        self.state = self.tx.init(self.params)
        self.train_step = progs.ts_train_step(self.tx) if kind == TS_JIT else None
        if kind == TS_EAGER:
            self.opt_step = self.tx.step
        elif kind in (TS_UPDATE, TS_TORCH):
            self.opt_step = progs.ts_update(self.tx, "update" if kind == TS_UPDATE else "step")

    @property
    def label(self) -> str:
        if self.device is None:
            return self.kind
        return self.kind.replace("]", f", mode={self.mode}, {self.device.platform}]")

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
        model = flat_native(self.params)
        if not self.progs.half:
            return model, model
        return flat(tsj.state_dict(self.state, self.params)["master"]), model

    def close(self) -> None:
        tsj.close(self.state)


class TorchTrainer(Trainer):
    """``torch.optim.AdamW`` (default: the single-tensor path on the CPU) on fp32 weights,
    fed the gradients of the same JAX model (its half model's, upcast, for fp16/bf16);
    two param groups for the decay mask; the learning rate of each step is the schedule's
    float32 value computed as the adapter computes it. With clipping it calls
    ``clip_grad_norm_`` itself (torch's float32 norm)."""

    def __init__(self, progs: Programs, init):
        super().__init__(TORCH, progs)
        import torch

        self.torch = torch
        init32 = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float32)), init)
        if progs.half:  # the fp32 master starts as the rounded weights
            init32 = progs.upcast(progs.downcast(init32))
        leaves = [np.array(x, np.float32) for x in jax.tree.leaves(init32)]
        self.treedef = jax.tree.structure(init)
        self.masters = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in leaves]
        decays = jax.tree.leaves(decay_mask(init))
        hp = progs.hp
        groups = [{"params": [m for m, d in zip(self.masters, decays) if d], "weight_decay": hp["weight_decay"]},
                  {"params": [m for m, d in zip(self.masters, decays) if not d], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=0.0, betas=(hp["b1"], hp["b2"]), eps=hp["eps"])
        self.count = 0
        self.model = self._model()

    def _model(self):
        tree = jax.tree.unflatten(self.treedef, [jnp.asarray(m.detach().numpy().copy()) for m in self.masters])
        return self.progs.downcast(tree) if self.progs.half else tree

    def step(self, batch) -> float:
        pr, torch = self.progs, self.torch
        loss, g = pr.grad_fn(self.model, batch)
        g32 = pr.upcast(g) if pr.half else g
        for m, gl in zip(self.masters, jax.tree.leaves(g32)):
            m.grad = torch.from_numpy(np.array(gl, np.float32))
        if pr.clip is not None:
            self.last_norm = float(torch.nn.utils.clip_grad_norm_(self.masters, pr.clip))
        lr = -float(np.float32(pr.neg_lr(jnp.asarray(self.count, jnp.int32))))
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.count += 1
        self.model = self._model()
        return float(loss)

    def weights(self):
        master = np.concatenate([m.detach().numpy().reshape(-1) for m in self.masters])
        return master, flat_native(self.model)


# -- metrics -------------------------------------------------------------------------------------


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 bit patterns on the ordered-integer line (+0 and -0 both 0), as int64."""
    i = np.ascontiguousarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


def compare(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    (ma, wa), (mb, wb) = a, b
    same = _bits(ma) == _bits(mb)
    same_model = _bits(wa) == _bits(wb)
    ulp = np.abs(_ordered(ma) - _ordered(mb))
    a64, b64 = ma.astype(np.float64), mb.astype(np.float64)
    den = np.maximum(np.abs(a64), np.abs(b64))
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(same | (den == 0), 0.0, np.abs(a64 - b64) / np.where(den == 0, 1.0, den))
    return {
        "bitid": float(same.mean()),
        "bitid_model": float(same_model.mean()),
        "max_ulp": int(ulp.max()),
        "max_rel": float(rel.max()),
    }


# -- the experiment ------------------------------------------------------------------------------


def plan_setting(progs: Programs, init, args: argparse.Namespace, torch_ok: bool, gpu_devices: list):
    """The trainers and compared pairs of one (dtype, clip) setting."""
    trainers: list[Trainer] = []
    pairs: list[tuple[str, Trainer, Trainer, bool, str]] = []  # (kind, a, b, promised, note)

    def add(t):
        trainers.append(t)
        return t

    ref = add(OptaxTrainer(REF_JIT, progs, init, track_norm=progs.clip is not None))
    ts_jit = add(OffloadTrainer(TS_JIT, progs, init))
    ts_eager = add(OffloadTrainer(TS_EAGER, progs, init))
    ts_upd = add(OffloadTrainer(TS_UPDATE, progs, init))
    eager = add(OptaxTrainer(REF_EAGER, progs, init, eager=True))
    if progs.clip is not None:
        # The global norm is an input that only XLA computes, and its float32 value depends
        # on the program that computes it. The promised rows compare with a reference whose
        # norm comes from the same kind of program as offload_adamw's; the rows against the
        # plain reference, whose norm comes from another program, carry no promise.
        ref_sep = add(OptaxTrainer(REF_JIT, progs, init, norm_from="separate"))
        if progs.half:
            ref_grad = add(OptaxTrainer(REF_JIT, progs, init, norm_from="grad"))
            pairs += [("trainstream-vs-reference", ts_jit, ref_grad, True, NORM_IN_GRAD),
                      ("trainstream-vs-reference", ts_jit, ref, False, NORM_OTHER)]
        else:  # the fp32 train step computes the norm where offload_adamw's does
            pairs += [("trainstream-vs-reference", ts_jit, ref, True, "")]
        pairs += [("trainstream-vs-reference", ts_eager, ref_sep, True, NORM_SEPARATE),
                  ("trainstream-vs-reference", ts_eager, ref, False, NORM_OTHER)]
    else:
        pairs += [
            ("trainstream-vs-reference", ts_jit, ref, True, ""),
            ("trainstream-vs-reference", ts_eager, ref, True, ""),
        ]
    pairs += [
        ("trainstream-vs-trainstream", ts_upd, ts_jit, False, UPDATE_NOTE),
        ("reference-vs-reference", eager, ref, False, ""),
    ]
    if torch_ok:
        ts_torch = add(OffloadTrainer(TS_TORCH, progs, init))
        torch_ref = add(TorchTrainer(progs, init))
        pairs += [
            ("trainstream-vs-reference", ts_torch, torch_ref, progs.clip is None,
             OWN_NORM if progs.clip is not None else ""),
            ("reference-vs-reference", ts_torch, ref, False, CONVENTIONS_NOTE),
        ]
    for dev in gpu_devices:
        gpu_ref = add(OptaxTrainer(REF_JIT, progs, init, device=dev))
        pairs.append(("reference-vs-reference", gpu_ref, ref, False, ""))
        for mode in ("gpu", "cpu"):
            ts_dev = add(OffloadTrainer(TS_JIT, progs, init, device=dev, mode=mode))
            pairs.append(("trainstream-vs-reference", ts_dev, gpu_ref, False, GPU_NOTE))
    return trainers, pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; --quick: 4)")
    ap.add_argument("--quick", action="store_true", help="CI size: a few steps of a tiny model")
    ap.add_argument("--devices", default=None, help="comma list of cpu,gpu (default: what JAX sees)")
    ap.add_argument("--dtypes", default=None, help="comma list of fp32,bf16,fp16 (default all; --quick: fp32,bf16)")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="the clipping setting's max_grad_norm (default 1.0, which clips the first "
                         "steps and some later ones; --quick: the median gradient norm of the initial "
                         "model over a few batches, so that some of its few steps clip)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (default 8; --quick: 4)")
    ap.add_argument("--ctx", type=int, default=None, help="context length (default 64; --quick: 32)")
    ap.add_argument("--d-model", type=int, default=None, help="width (default 64; --quick: 32)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default 2; --quick: 2)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, cosine to 10%%)")
    ap.add_argument("--threads", type=int, default=None, help="offload_adamw worker threads (default: its own)")
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch-convention rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    quick = dict(steps=4, batch=4, ctx=32, d_model=32, layers=2, dtypes="fp32,bf16")
    full = dict(steps=300, batch=8, ctx=64, d_model=64, layers=2, dtypes="fp32,bf16,fp16")
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_grad_norm is None and not args.quick:
        args.max_grad_norm = 1.0
    return args


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def _gpu_devices() -> list:
    try:
        return list(jax.devices("gpu"))
    except RuntimeError:
        return []


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if jax.config.jax_enable_x64:
        raise SystemExit("run with jax_enable_x64 off (the references are float32 programs)")
    gpus = _gpu_devices()
    if args.devices is None:
        devices = ["cpu"] + (["gpu"] if gpus else [])
    else:
        devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    for d in devices:
        if d not in ("cpu", "gpu"):
            raise SystemExit(f"unknown device {d!r} (expected cpu or gpu)")
        if d == "gpu" and not gpus:
            raise SystemExit("--devices names gpu, but JAX sees no GPU")
    if "cpu" not in devices:
        raise SystemExit("--devices must include cpu (offload_adamw runs with JAX on the CPU backend)")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r} (expected some of {', '.join(DTYPES)})")

    skipped: list[str] = []
    torch_ok = not args.no_torch and importlib.util.find_spec("torch") is not None
    if args.no_torch:
        skipped.append("convention='torch' rows: --no-torch")
    elif not torch_ok:
        skipped.append("convention='torch' rows (torch.optim.AdamW vs optax): torch is not installed")
    gpu_devices = [gpus[0]] if "gpu" in devices else []
    if not gpu_devices:
        skipped.append("CUDA rows (optax.adamw on XLA:GPU vs XLA:CPU; offload_adamw mode='gpu' and mode='cpu' "
                       "on the GPU): " +
                       ("no GPU visible to JAX (jax.devices() = " + str(jax.devices()) + ")" if not gpus
                        else "--devices leaves gpu out"))
    for s in skipped:
        print(f"skipped: {s}")

    cpu = jax.devices("cpu")[0]
    comparisons = []
    with jax.default_device(cpu):
        init = init_params(args, args.seed)
        n_params = sum(x.size for x in jax.tree.leaves(init))
        batches = make_batches(args.steps, args.batch, args.ctx, args.seed)
        if args.max_grad_norm is None:
            sh = shared_programs(args.heads, F32)
            norms = [float(sh["norm"](sh["grad_fn"](init, b)[1]))
                     for b in make_batches(8, args.batch, args.ctx, args.seed + 100)]
            args.max_grad_norm = float(f"{np.median(norms):.3g}")
        settings = [(dt, clip) for dt in dtypes for clip in (None, args.max_grad_norm)]
        print(f"GPT (pure JAX) {n_params / 1e6:.3f}M parameters (d={args.d_model}, layers={args.layers}, "
              f"ctx={args.ctx}), batch {args.batch}; {args.steps} steps; devices {','.join(devices)}; "
              f"{len(settings)} settings; max_grad_norm {args.max_grad_norm}")

        def write(complete: bool) -> dict[str, Any]:
            """The JSON and Markdown of the comparisons so far (after every setting: a run
            cut short keeps what it did)."""
            runtime = time.perf_counter() - t_start
            torch_version = None
            if torch_ok:
                import torch

                torch_version = torch.__version__
            meta = dict(
                script="experiments/equivalence_jax.py",
                command="python " + " ".join(["experiments/equivalence_jax.py", *(argv if argv is not None else sys.argv[1:])]),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=git_commit(), jax=jax.__version__, jaxlib=_jaxlib_version(),
                optax=optax.__version__, torch=torch_version, numpy=np.__version__, python=platform.python_version(),
                cpu=cpu_name(), cores=os.cpu_count(), gpu=str(gpu_devices[0].device_kind) if gpu_devices else None,
                devices=devices, dtypes=dtypes, steps=args.steps, params=n_params,
                model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads, ctx=args.ctx, vocab=VOCAB),
                batch=args.batch, max_grad_norm=args.max_grad_norm, lr=args.lr, schedule="warmup_cosine_decay",
                b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, threads=args.threads,
                runtime_s=runtime, skipped=skipped, complete=complete,
            )
            result = dict(meta=meta, comparisons=comparisons)
            save_result(args.out, "equivalence_jax", result, markdown_table(result))
            return result

        for dt_name, clip in settings:
            progs = Programs(args, DTYPES[dt_name], clip)
            trainers, pairs = plan_setting(progs, init, args, torch_ok, gpu_devices)
            records = [dict(kind=k, a=a.label, b=b.label,
                            device=a.device_type if a.device_type == b.device_type else f"{a.device_type} vs {b.device_type}",
                            dtype=dt_name, clip=clip, promised=prom, note=note, per_step=empty_per_step())
                       for k, a, b, prom, note in pairs]
            desc = f"{dt_name} clip={'off' if clip is None else clip}"
            bar = tqdm(range(args.steps), desc=desc, disable=args.no_progress, leave=False, file=sys.stderr)
            try:
                for step in bar:
                    batch = batches[step]
                    losses = {t: t.step(batch) for t in trainers}
                    weights = {t: t.weights() for t in trainers}
                    worst = record_step(records, pairs, weights, losses, compare)
                    if hasattr(bar, "set_postfix"):
                        bar.set_postfix(loss=f"{losses[trainers[0]]:.3f}", max_ulp=worst)
            finally:
                for t in trainers:
                    t.close()
            for rec in records:
                ps = rec["per_step"]
                # optax clips where not (norm < M); the optax reference's norm is norm_b
                norms = [n for n in ps["norm_b"] if n is not None] or [n for n in ps["norm_a"] if n is not None]
                rec["summary"] = summarize(ps, sum(n >= clip for n in norms) if clip is not None and norms else None)
                comparisons.append(rec)
            write(False)
            print(f"  {desc}: {len(records)} comparisons, {time.perf_counter() - t_start:.1f} s so far "
                  f"(partial results in {args.out})", flush=True)

    result = write(True)
    out = Path(args.out)
    table = markdown_table(result)
    plots = [] if args.no_plots else make_plots(result, out)
    result["files"] = [str(out / "equivalence_jax.json"), str(out / "equivalence_jax.md"), *map(str, plots)]
    print()
    print(table)
    broken = [c for c in comparisons if c["promised"] and c["summary"]["min_bitid"] < 1.0]
    print(f"{len(comparisons)} comparisons, {sum(c['promised'] for c in comparisons)} promised bit-identical, "
          f"{len(broken)} of those not; {time.perf_counter() - t_start:.1f} s; outputs in {out}")
    return result


def markdown_table(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        "# trainstream.jax.offload_adamw vs optax.adamw: numerical equivalence in training",
        "",
        f"`{m['command']}`  ",
        f"{m['date']}, commit `{m['commit']}`, jax {m['jax']}, optax {m['optax']}"
        + (f", torch {m['torch']}" if m["torch"] else "") + f", CPU {m['cpu']} ({m['cores']} cores)"
        + (f", GPU {m['gpu']}" if m["gpu"] else "") + f"; training and comparisons took {m['runtime_s']:.1f} s"
        + ("" if m.get("complete", True) else " (**partial**: the run had not finished every setting)") + "  ",
        f"GPT in pure JAX, {m['params']:,} parameters ({m['model']}), batch {m['batch']}, {m['steps']} steps, "
        f"lr {m['lr']} (optax warmup + cosine), b1 {m['b1']}, b2 {m['b2']}, weight decay {m['weight_decay']} "
        f"masked to matrices; clip = `max_grad_norm` (the optax references: "
        f"`optax.chain(optax.clip_by_global_norm(clip), optax.adamw(...))`). [jit]: the optimizer under "
        f"`jax.jit`, in one program with the gradient for `offload_adamw step [jit]` and for "
        f"`optax.adamw [jit]` on fp32 weights, else on the gradient of a separate jitted program (the "
        f"fp16/bf16 references upcast it in a program of their own); [eager]: the optimizer called "
        f"outside jit (optax: op by op under `jax.disable_jit()`) on the jitted gradient.",
        "",
        "Bit-identical: fraction of fp32 (master) weights equal bit for bit after the last step (for "
        "fp16/bf16, `model` is the fraction of the model's own half weights). Max ULP: the largest distance "
        "in float32 ULPs over all weights and steps; max rel: the largest `|a-b|/max(|a|,|b|)`. "
        "Promised: the contract promises bit-identity for this row. Where two runs differ at all, max ULP "
        "and max rel are set by weights near zero that change sign, chiefly the key third of the qkv "
        "biases, whose gradient is zero up to rounding (softmax ignores it), so that Adam moves them by "
        "about lr on the sign of rounding noise: the bit-identical fractions and losses say more there.",
        "",
        "| comparison (a vs b) | device | dtype | clip | promised | steps | bit-identical | model | max ULP | max rel err | final loss a / b |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        s = c["summary"]
        name = f"{c['a']} vs {c['b']}" + (f" ({c['note']})" if c["note"] else "")
        lines.append(
            f"| {name} | {c['device']} | {c['dtype']} | {'off' if c['clip'] is None else c['clip']} | "
            f"{'yes' if c['promised'] else 'no'} | {s['steps']} | {_fmt_frac(s['final_bitid'])} | "
            f"{_fmt_frac(s['final_bitid_model'])} | {s['max_ulp']} | {s['max_rel']:.3g} | "
            f"{s['final_loss_a']:.4f} / {s['final_loss_b']:.4f} |")
    clipped = [c["summary"]["clip_active_steps"] for c in result["comparisons"]
               if c["clip"] is not None and c["summary"]["clip_active_steps"] is not None and c["b"] == REF_JIT]
    if clipped:
        lines += ["", f"Clipping was active (optax's global norm >= clip) on {min(clipped)}-{max(clipped)} of "
                      f"{m['steps']} steps of the reference."]
    if m["skipped"]:
        lines += ["", "Not run:"] + [f"- {s}" for s in m["skipped"]]
    return "\n".join(lines) + "\n"


_SHORT_NOTES = {NORM_IN_GRAD: "ref's norm from its gradient's program", NORM_SEPARATE: "ref's norm from a program of its own",
                NORM_OTHER: "ref's norm from another program",
                OWN_NORM: "torch clips by its own norm", UPDATE_NOTE: "", CONVENTIONS_NOTE: ""}


def _plot_label(c: dict[str, Any]) -> str:
    note = _SHORT_NOTES.get(c["note"], c["note"])
    return f"{c['a']} vs {c['b']}" + (f" ({note})" if note else "")


def make_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []
    comps = result["comparisons"]
    for dt in result["meta"]["dtypes"]:
        mine = [c for c in comps if c["dtype"] == dt]
        settings = sorted({c["clip"] is not None for c in mine})
        n_labels = len({_plot_label(c) for c in mine})
        height = 6 + 0.2 * n_labels
        fig, axes = plt.subplots(2, len(settings), figsize=(5.5 * len(settings), height), squeeze=False, sharex=True)
        handles = {}
        labels = list(dict.fromkeys(_plot_label(c) for c in mine))  # one colour per comparison
        colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
        for j, clipped in enumerate(settings):
            for c in (c for c in mine if (c["clip"] is not None) == clipped):
                ps = c["per_step"]
                steps = np.arange(1, len(ps["max_ulp"]) + 1)
                label = _plot_label(c)
                # solid: promised bit-identical; dotted: TrainStream vs a different
                # reference or API; dashed: reference vs reference. Markers keep
                # overlapping zero lines visible.
                style = "-" if c["promised"] else ("--" if c["kind"] == "reference-vs-reference" else ":")
                marker = "ox^sdv*P"[labels.index(label) % 8]
                kw = dict(lw=1.2, color=colors[label], marker=marker, markersize=3,
                          markevery=max(1, len(steps) // 12), label=label)
                h, = axes[0, j].plot(steps, ps["max_ulp"], style, **kw)
                axes[1, j].plot(steps, ps["max_rel"], style, **kw)
                handles.setdefault(label, h)
            axes[1, j].xaxis.set_major_locator(MaxNLocator(integer=True))
            clip = next((c["clip"] for c in mine if (c["clip"] is not None) == clipped), None)
            axes[0, j].set_title(f"{dt}, clip {'off' if clip is None else clip}", fontsize=9)
            axes[0, j].set_yscale("symlog", linthresh=1)
            axes[1, j].set_yscale("symlog", linthresh=1e-9)
            axes[1, j].set_xlabel("step")
        axes[0, 0].set_ylabel("max distance (float32 ULPs)")
        axes[1, 0].set_ylabel("max relative error")
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=1, fontsize=7, frameon=False)
        fig.suptitle(f"offload_adamw vs optax.adamw, {dt} (0 = bit-identical; solid: promised bit-identical, "
                     "dashed: reference vs reference)", fontsize=10)
        fig.tight_layout(rect=(0, (0.15 + 0.17 * len(handles)) / height, 1, 0.96))
        path = out / f"divergence_{dt}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


if __name__ == "__main__":
    main()
