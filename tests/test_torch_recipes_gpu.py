"""OffloadAdamW/OffloadAdam on CUDA parameters with the recipes trainers run (``fused=True``, ``foreach=False``,
fp16/bf16 state as torch keeps it, amsgrad, maximize, Adam's L2, GradScaler) against ``torch.optim.AdamW``/``Adam``
on the same CUDA parameters, bit for bit, in ``cpu`` (the host reproduces torch's CUDA arithmetic) and ``gpu`` mode
(the device kernels). GPU only."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from _torch_helpers import assert_same, batches, loss_of, make_model  # noqa: E402

from trainstream.torch import OffloadAdam, OffloadAdamW  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
DEV = torch.device("cuda")

CASES = {  # name: (torch class, dtype, kwargs)
    "fused-f32": ("AdamW", torch.float32, dict(fused=True, weight_decay=0.1)),
    "fused-bf16": ("AdamW", torch.bfloat16, dict(fused=True, weight_decay=0.1)),
    "fused-f16-amsgrad": ("AdamW", torch.float16, dict(fused=True, amsgrad=True, eps=0.1)),  # eps: fp16 v underflows
    "foreach-bf16": ("AdamW", torch.bfloat16, dict(weight_decay=0.1)),
    "single-f32": ("AdamW", torch.float32, dict(foreach=False, weight_decay=0.1)),
    "single-bf16-maximize": ("AdamW", torch.bfloat16, dict(foreach=False, maximize=True)),
    "adam-l2-foreach-f32": ("Adam", torch.float32, dict(weight_decay=0.1)),
    "adam-l2-fused-maximize": ("Adam", torch.float32, dict(fused=True, weight_decay=0.1, maximize=True)),
    "adam-l2-fused-gpu-only": ("Adam", torch.float32, dict(fused=True, weight_decay=0.1)),
}
OURS = {"AdamW": OffloadAdamW, "Adam": OffloadAdam}


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_recipe_bit_identical_on_cuda(case, mode):
    cls, dtype, kw = CASES[case]
    ref_model = make_model(dtype=dtype).to(DEV)
    ts_model = copy.deepcopy(ref_model)
    ref = getattr(torch.optim, cls)(ref_model.parameters(), lr=1e-2, **kw)
    ts = OURS[cls](ts_model.parameters(), lr=1e-2, mode=mode, **kw)
    for t, x in enumerate(batches(8)):
        x = x.to(DEV)
        for model, opt in ((ref_model, ref), (ts_model, ts)):
            opt.zero_grad()
            loss_of(model, x).backward()
        ref.step()
        if case.endswith("gpu-only") and mode == "cpu":
            with pytest.raises(NotImplementedError, match="mode='gpu'"):
                ts.step()
            ts.close()
            return
        ts.step()
        ts.synchronize()
        assert_same(ref_model, ts_model)
    sd, rsd = ts.state_dict(), ref.state_dict()
    for k, st in rsd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in st:
                assert torch.equal(sd["state"][k][key].cpu(), st[key].cpu()), (k, key)
    ts.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_with_grad_scaler_bit_identical(mode, dtype):
    """GradScaler's protocol with fused=True: the kernel divides by the scale (torch's fused step). (fp16: CUDA's
    GradScaler does not unscale bf16 gradients.)"""
    ref_model = make_model(dtype=dtype).to(DEV)
    ts_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True, weight_decay=0.1)
    ts = OffloadAdamW(ts_model.parameters(), lr=1e-2, fused=True, weight_decay=0.1, mode=mode)
    scalers = [torch.amp.GradScaler("cuda", init_scale=1024.0) for _ in range(2)]
    for x in batches(6):
        x = x.to(DEV)
        for model, opt, sc in ((ref_model, ref, scalers[0]), (ts_model, ts, scalers[1])):
            opt.zero_grad()
            sc.scale(loss_of(model, x)).backward()
            sc.step(opt)
            sc.update()
        ts.synchronize()
        assert_same(ref_model, ts_model)
    ts.close()
