# python .diag/diag.py : where cpu mode departs from torch (GradScaler + fused fp32; fused fp16 amsgrad) on CUDA
import copy, sys
import torch
sys.path.insert(0, "tests")
from _torch_helpers import make_model, batches, loss_of
from trainstream.torch import OffloadAdamW
DEV = "cuda"

def diff(a, b):
    out = []
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        d = (p.detach().view(-1).float() != q.detach().view(-1).float()) & ~(p.detach().view(-1).isnan() & q.detach().view(-1).isnan())
        if d.any():
            i = int(d.nonzero()[0])
            out.append(f"{n}: {int(d.sum())}/{p.numel()} first {i} ref {p.view(-1)[i].item()!r} ours {q.view(-1)[i].item()!r}")
    return out

for case in ("scaler-f32", "scaler-f16", "f16-amsgrad"):
    dtype = torch.float32 if case == "scaler-f32" else torch.float16
    kw = dict(fused=True, weight_decay=0.1) if case.startswith("scaler") else dict(fused=True, amsgrad=True)
    ref_model = make_model(dtype=dtype).to(DEV); ts_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, **kw)
    ts = OffloadAdamW(ts_model.parameters(), lr=1e-2, mode="cpu", **kw)
    scalers = [torch.amp.GradScaler("cuda", init_scale=1024.0) for _ in range(2)]
    for t, x in enumerate(batches(6)):
        x = x.to(DEV)
        info = []
        for model, opt, sc in ((ref_model, ref, scalers[0]), (ts_model, ts, scalers[1])):
            opt.zero_grad()
            loss = loss_of(model, x)
            if case.startswith("scaler"):
                sc.scale(loss).backward()
                info.append(("grads None", sum(p.grad is None for p in model.parameters())))
                sc.step(opt)
                info.append(("found_inf", getattr(opt, "found_inf", None), "scale", sc.get_scale()))
                sc.update()
            else:
                loss.backward(); opt.step()
        ts.synchronize()
        print(case, "step", t, info, "nan ref", sum(int(p.isnan().sum()) for p in ref_model.parameters()),
              "nan ours", sum(int(p.isnan().sum()) for p in ts_model.parameters()))
        for line in diff(ref_model, ts_model)[:4]:
            print("   ", line)
    ts.close()
