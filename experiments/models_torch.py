"""The GPT of the torch experiments, one definition for all of them (train_demo.py,
bench_train.py, bench_fsdp.py, equivalence_torch.py): GPT-2-shaped, pre-LN, tied head.

``_common.SIZES`` (readable without torch) names the benchmarks' configurations (layers,
width, heads); the studies build small ones directly. ``sdpa=False`` writes attention out
(matmul, mask, softmax): the same deterministic kernels on every device, so that two models
with identical weights compute identical gradients (the equivalence study compares such pairs).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from _common import VOCAB, text_windows


class Block(nn.Module):
    def __init__(self, d: int, heads: int, sdpa: bool = True, **factory):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1 = nn.LayerNorm(d, **factory)
        self.qkv = nn.Linear(d, 3 * d, **factory)
        self.proj = nn.Linear(d, d, **factory)
        self.ln2 = nn.LayerNorm(d, **factory)
        self.fc = nn.Linear(d, 4 * d, **factory)
        self.out = nn.Linear(4 * d, d, **factory)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-shaped decoder with a tied head. ``device``/``dtype``: where and in which type
    the parameters are created (a 7B bf16 model directly on the GPU, no host copy);
    ``ckpt``: activation checkpointing of every block; ``sdpa``: see the module docstring."""

    def __init__(self, layers: int, d: int, heads: int, vocab: int = VOCAB, ctx: int = 1024, *,
                 device=None, dtype=None, ckpt: bool = False, sdpa: bool = True):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.ckpt = ckpt
        self.wte = nn.Embedding(vocab, d, **factory)
        self.wpe = nn.Embedding(ctx, d, **factory)
        self.blocks = nn.ModuleList(Block(d, heads, sdpa, **factory) for _ in range(layers))
        self.ln = nn.LayerNorm(d, **factory)
        for m in self.modules():  # GPT-2's initialisation (the tied head needs small embeddings)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            if self.ckpt and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return F.linear(self.ln(x), self.wte.weight)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in float32."""
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def text_batches(n: int, batch: int, ctx: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, next-byte targets) batches of generated ASCII text (vocabulary 128)."""
    return [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in text_windows(n, batch, ctx, seed)]

