"""torchtitan (0.3.0) pieces shared by tests/test_torch_torchtitan.py and experiments/bench_titan.py: a synthetic
token dataloader and a tokenizer that only reports its vocabulary size (neither torchtitan's test dataset nor a
tokenizer ships in its wheel, and the GPU machines reach no dataset), and Llama3 trainer configs built from
torchtitan's own registry (``torchtitan.models.llama3``). Imports torchtitan: import it after choosing the device
(torchtitan picks its device type when first imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.common import Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.rope import ComplexRoPE
from torchtitan.models.llama3 import _build_llama3_layers, model_registry
from torchtitan.models.llama3 import config_registry
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.trainer import Trainer


class VocabOnlyTokenizer(BaseTokenizer):
    """A tokenizer that knows its vocabulary size only (the synthetic data needs no text)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 256

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("VocabOnlyTokenizer has no text encoding: the synthetic data needs none")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("VocabOnlyTokenizer has no text decoding: the synthetic data needs none")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class _Tokens(IterableDataset):
    """Random token sequences, the i-th of data-parallel rank r drawn from seed ``1000003 * r + i``; its state (i)
    is saved and loaded with torchtitan's checkpoint, so a resumed run reads the batches the uninterrupted one read."""

    def __init__(self, vocab_size: int, seq_len: int, dp_rank: int) -> None:
        self.vocab_size, self.seq_len, self.dp_rank, self.index = vocab_size, seq_len, dp_rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000003 * self.dp_rank + self.index)
            self.index += 1
            tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = state["index"]


class SyntheticTokensLoader(ParallelAwareDataloader):
    """torchtitan dataloader of :class:`_Tokens` (causal attention over whole sequences: no positions)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        vocab_size: int = 256

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs) -> None:
        super().__init__(_Tokens(config.vocab_size, seq_len, dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size, snapshot_every_n_steps=snapshot_every_n_steps)


def _sdpa(model: Llama3Model.Config) -> None:
    """Every layer's attention through ``F.scaled_dot_product_attention``, causal (FlexAttention has no backward
    on the CPU; the synthetic sequences are one document each)."""
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _synthetic(config: Trainer.Config, vocab_size: int) -> Trainer.Config:
    config.tokenizer = VocabOnlyTokenizer.Config(vocab_size=vocab_size)
    config.dataloader = SyntheticTokensLoader.Config(vocab_size=vocab_size)
    config.loss.loss_fn.global_vocab_size = vocab_size
    config.validator.enable = False
    return config


def tiny_llama3(*, dim: int = 64, n_layers: int = 2, n_heads: int = 4, vocab_size: int = 256) -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` trainer config (AdamW ``fused``, warmup and linear decay, selective
    activation checkpointing, FSDP2 with bf16 compute), its model shrunk to ``dim`` x ``n_layers`` over
    ``vocab_size`` tokens, on synthetic data."""
    config = config_registry.llama3_debugmodel()
    model = Llama3Model.Config(
        dim=dim, vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size,
                              param_init={"weight": torch.nn.init.normal_, "bias": torch.nn.init.zeros_}),
        layers=_build_llama3_layers(
            n_layers=n_layers, dim=dim, n_heads=n_heads, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=dim),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=4096, theta=500000, scaling="llama"),
            attn_backend="flex"))
    _sdpa(model)
    config.model_spec.model = model
    return _synthetic(config, vocab_size)


def llama3(flavor: str, *, n_layers: int | None = None) -> Trainer.Config:
    """torchtitan's Llama3 ``flavor`` ("1B", "3B", "8B", ...) in its ``llama3_debugmodel`` trainer config
    (AdamW ``fused``, selective activation checkpointing, FSDP2 with bf16 compute), optionally its first
    ``n_layers`` layers only, on synthetic data."""
    config = config_registry.llama3_debugmodel()
    spec = model_registry(flavor)
    if n_layers is not None:
        spec.model.layers = spec.model.layers[:n_layers]
    _sdpa(spec.model)
    config.model_spec = spec
    return _synthetic(config, spec.model.vocab_size)
