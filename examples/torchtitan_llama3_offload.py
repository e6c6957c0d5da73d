"""A torchtitan (0.3.0) config registry: its Llama3 configs with ``trainstream.torch.OffloadAdamW`` in place of
``torch.optim.AdamW`` (the same param groups and arguments: lr, betas, eps, weight_decay, ``fused`` from
``optimizer.implementation``), the optimizer state in host memory. torchtitan's configs are Python functions
(a ``config_registry``); its command line selects one with ``--module`` and ``--config``. From this repository's
root (see docs/torchtitan.md):

    torchrun --nproc_per_node=8 -m torchtitan.train --module examples.torchtitan_llama3_offload \\
        --config llama3_8b_offload

The command line can also do it without this file: ``--module llama3 --config llama3_8b
--training.disable_cuda_graphs --override.imports trainstream.torch.torchtitan.offload_adamw``.
"""

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.trainer import Trainer

from trainstream.torch.torchtitan import offload_optimizers


def _offload(config: Trainer.Config, **offload_arguments) -> Trainer.Config:
    # Every "AdamW" param group becomes "OffloadAdamW" with the same pattern and arguments.
    config.optimizer = offload_optimizers(config.optimizer, **offload_arguments)
    # torchtitan captures forward and backward in a CUDA graph by default; the gradient hooks that copy each
    # gradient to the host as backward produces it run at capture, not at replays, so OffloadAdamW refuses it.
    config.training.disable_cuda_graphs = True
    return config


def llama3_8b_offload() -> Trainer.Config:
    """torchtitan's ``llama3_8b`` with OffloadAdamW (host threads update: ``mode="cpu"``)."""
    return _offload(llama3_8b())


def llama3_8b_offload_hybrid() -> Trainer.Config:
    """The same with 30% of the elements updated by a GPU kernel reading their host state (``mode="hybrid"``)."""
    return _offload(llama3_8b(), mode="hybrid", gpu_share=0.3)


def llama3_debugmodel_offload() -> Trainer.Config:
    """torchtitan's small ``llama3_debugmodel`` with OffloadAdamW, to try the setup."""
    return _offload(llama3_debugmodel())
