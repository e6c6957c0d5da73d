"""The models of the JAX experiments, one definition for all of them (equivalence_jax.py,
bench_jax_offload.py), in pure JAX (parameters are a dict of arrays):

* a pre-LN GPT (untied head, attention written out) for the training studies: ``SIZES``
  names the benchmark's configurations, the study builds a small one;
* a deep stack of square dense layers (tanh) on a small batch: a step dominated by the
  optimizer, the case offloading must make cheap.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

SIZES = {"tiny": (2, 64, 4), "125m": (12, 768, 12), "350m": (24, 1024, 16), "1.3b": (24, 2048, 16)}
VOCAB = 128  # bytes of ASCII text


def init_gpt(layers: int, d: int, ctx: int, seed: int = 0, vocab: int = VOCAB) -> dict:
    """Float32 weights of the GPT, as NumPy arrays."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale if scale is not None else 1 / math.sqrt(shape[0]))).astype(np.float32)

    def ln():
        return {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)}

    def dense(a, b, scale=None):
        return {"w": w(a, b, scale=scale), "b": (0.02 * rng.standard_normal(b)).astype(np.float32)}

    blocks = [{"ln1": ln(), "qkv": dense(d, 3 * d), "proj": dense(d, d, scale=0.5 / math.sqrt(d)),
               "ln2": ln(), "fc": dense(d, 4 * d), "out": dense(4 * d, d, scale=0.5 / math.sqrt(4 * d))}
              for _ in range(layers)]
    return {"tok": w(vocab, d, scale=0.1), "pos": w(ctx, d, scale=0.1), "blocks": blocks, "ln_f": ln(),
            "head": dense(d, vocab)}


def _layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def gpt_loss(heads: int):
    """``loss(params, (x, y))``: mean next-token cross-entropy (in float32) of the GPT, which
    computes in the weights' dtype."""

    def loss_fn(params, batch):
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
            att = jax.nn.softmax(jnp.where(mask, att, -1e4).astype(jnp.float32), axis=-1).astype(h.dtype)
            h = h + (att @ v).transpose(0, 2, 1, 3).reshape(h.shape) @ b["proj"]["w"] + b["proj"]["b"]
            z = jax.nn.gelu(_layer_norm(h, b["ln2"]) @ b["fc"]["w"] + b["fc"]["b"])
            h = h + z @ b["out"]["w"] + b["out"]["b"]
        logits = _layer_norm(h, params["ln_f"]) @ params["head"]["w"] + params["head"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    return loss_fn


def init_mlp(n_params: int, width: int, device, seed: int = 0) -> dict:
    """``round(n_params / width**2)`` float32 ``width x width`` layers, created on ``device``."""
    keys = jax.random.split(jax.random.PRNGKey(seed), max(1, round(n_params / (width * width))))
    init = jax.jit(lambda k: jax.random.normal(k, (width, width), jnp.float32) * (1.0 / np.sqrt(width)))
    return {f"w{i:02d}": jax.device_put(init(k), device) for i, k in enumerate(keys)}


def mlp_loss(params, x):
    h = x
    for k in sorted(params):
        h = jnp.tanh(h @ params[k])
    return jnp.mean(h**2)


def nnx_gpt(layers: int, d: int, heads: int, *, vocab: int, ctx: int = 1024, dtype=jnp.bfloat16, remat: bool = True,
            seed: int = 0, param_dtype=None, scan: bool = False):
    """The flax nnx counterpart of ``models_torch.GPT`` (``_common.SIZES``' shapes and parameter count): pre-LN,
    learned positions, tied head, GELU (tanh), causal attention (``jax.nn.dot_product_attention``: cuDNN on a GPU);
    computed in ``dtype``, parameters in ``param_dtype`` (default: ``dtype``), logits in float32; ``remat``: each block rematerialised in backward (the torch
    benchmark's activation checkpointing); ``scan``: the blocks' parameters stacked (one leaf per kind, ``layers``
    first) and run by ``nnx.scan`` (MaxText's layout: one block's program, 12 leaves instead of 12 per block).
    Built on JAX's default device. Returns the nnx module."""
    from flax import nnx  # noqa: PLC0415 - flax only where this model is built

    init = nnx.initializers.normal(0.02)
    pdt = dtype if param_dtype is None else param_dtype

    class Block(nnx.Module):
        def __init__(self, rngs):
            lin = lambda a, b: nnx.Linear(a, b, param_dtype=pdt, dtype=dtype, kernel_init=init, rngs=rngs)  # noqa: E731
            self.ln1, self.ln2 = (nnx.LayerNorm(d, param_dtype=pdt, dtype=dtype, rngs=rngs) for _ in range(2))
            self.qkv, self.proj, self.fc, self.out = lin(d, 3 * d), lin(d, d), lin(d, 4 * d), lin(4 * d, d)

        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, t, 3 * heads, d // heads), 3, axis=2)
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.wte = nnx.Embed(vocab, d, param_dtype=pdt, dtype=dtype, embedding_init=init, rngs=rngs)
            self.wpe = nnx.Embed(ctx, d, param_dtype=pdt, dtype=dtype, embedding_init=init, rngs=rngs)
            if scan:
                @nnx.split_rngs(splits=layers)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def stacked(rngs):
                    return Block(rngs)
                self.blocks = stacked(rngs)
            else:
                self.blocks = getattr(nnx, "List", list)([Block(rngs) for _ in range(layers)])  # flax >= 0.12
            self.ln = nnx.LayerNorm(d, param_dtype=pdt, dtype=dtype, rngs=rngs)

        def __call__(self, x):
            h = self.wte(x) + self.wpe(jnp.arange(x.shape[1]))
            block = nnx.remat(lambda blk, h: blk(h)) if remat else (lambda blk, h: blk(h))
            if scan:
                h = nnx.scan(block, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, h)
            else:
                for blk in self.blocks:
                    h = block(blk, h)
            return self.wte.attend(self.ln(h)).astype(jnp.float32)  # the tied head; float32 logits

    return GPT(nnx.Rngs(seed))
