"""The trainers' default AdamW, end to end (issue 34 item 5): transformers' Trainer with its default optimizer
(``adamw_torch_fused``) against the same run with ``OffloadAdamW(fused=True)`` given to it, fp32 and bf16 models,
gradient accumulation 1 and 4, clipping and a checkpoint resume: every checkpoint's weights bit-identical, or the swap
refused at construction with ``NotImplementedError`` naming why (a skip with that reason). With accumulation the
Trainer's gradient state marks the last micro-batch: its host updates upload their weights during backward (issue
42)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from trainstream.torch import OffloadAdamW  # noqa: E402


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")]
PLACES = [pytest.param("cpu", "cpu", id="cpu")] + [pytest.param("cuda", m, id=f"cuda-{m}", marks=_CUDA)
                                                   for m in ("cpu", "gpu")]


@pytest.mark.parametrize("device,mode", PLACES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("accum", [1, 4])
def test_default_optimizer_swapped_for_offload_adamw_fused(tmp_path, dtype, device, mode, accum):
    default_optim = transformers.TrainingArguments(output_dir=str(tmp_path / "probe"), report_to=[]).optim
    assert getattr(default_optim, "value", default_optim) == "adamw_torch_fused"  # what "the default" means here
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": r, "labels": r} for r in ids]

    stats = []

    def run(out, ours, resume=None):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).to(dtype)
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=accum, max_steps=4,
            save_steps=2, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="linear",
            warmup_steps=0, logging_steps=1, report_to=[], use_cpu=device == "cpu", seed=0, data_seed=0,
            disable_tqdm=True)
        kw = {"optimizer_cls_and_kwargs": (OffloadAdamW, dict(lr=1e-2, fused=True, threads=2, mode=mode))} if ours else {}
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, **kw)
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            opt = getattr(trainer.optimizer, "optimizer", None)
            if isinstance(opt, OffloadAdamW):
                stats.append(opt.stats())
                opt.close()
        return trainer

    try:  # refused where set: at construction (before the reference's run, which would be wasted)
        OffloadAdamW([torch.nn.Parameter(torch.zeros(2, dtype=dtype, device=device))], fused=True, threads=1,
                     mode=mode).close()
    except NotImplementedError as exc:
        pytest.skip(f"refused: {exc}")
    ref = run(tmp_path / "ref", ours=False)
    run(tmp_path / "ours", ours=True)
    resumed = run(tmp_path / "ours", ours=True, resume=str(tmp_path / "ours" / "checkpoint-2"))
    for ck in ("checkpoint-2", "checkpoint-4"):  # checkpoint-4: the resumed run's
        want = safetensors.load_file(tmp_path / "ref" / ck / "model.safetensors")
        got = safetensors.load_file(tmp_path / "ours" / ck / "model.safetensors")
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), f"{ck}: {k}"
    for a, b in zip(ref.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    if mode == "cpu":  # every step speculated (uploading during backward where the Trainer marks the last micro-batch)
        for st in stats:
            steps = st["spec_steps_committed"] + st["spec_steps_redone"]
            assert steps > 0 and st["spec_updates"] == steps * st["params"]
            assert st["spec_uploads_early"] == (st["spec_updates"] if accum > 1 else 0)
