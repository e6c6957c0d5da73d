# Run (CPU): python3 experiments/replay_cuda_log.py --research /work/wt/research
"""The recipe kernels' lines (tests/_cuda_recipes_ref.py) against a recorded GPU check: replays the runs of the
research's verify_cuda.py (its emulations emu_cuda.py, its H100 log verify_cuda_h100.log: torch 2.11 on an H100,
10 steps of 4099 elements per configuration, each step from torch's state) with our emulation standing in for torch.
If our lines are torch's, the research emulations' mismatch counts against them equal the log's against torch, row for
row (foreach, single, and fused with the device's powf; the host's powf stands in for it, equal at t <= 10)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [("default", {}), ("lr=0.01", {"lr": 0.01}), ("wd=0.1", {"weight_decay": 0.1}),
           ("wd=0.1,maximize", {"weight_decay": 0.1, "maximize": True}),
           ("wd=0.1,amsgrad", {"weight_decay": 0.1, "amsgrad": True}),
           ("betas=(0.3,0.5),wd=0.05", {"betas": (0.3, 0.5), "weight_decay": 0.05}), ("Tensor lr (cpu)", {"lr": "T"})]


def replay(E, X, R, C, cls, dtype, impl, kw, n=4099, steps=10):
    """verify_cuda.run's data and loop, our emulation as torch: {array: the research emulation's mismatches}."""
    rng = np.random.default_rng(0)
    p0 = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 0.5, n)).astype(np.float32)
    grads = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype(np.float32) for _ in range(steps)]
    lr_t = kw.get("lr") == "T"
    o = dict(lr=float(np.float32(1e-3)) if lr_t else kw.get("lr", 1e-3), betas=kw.get("betas", (0.9, 0.999)),
             eps=1e-8, weight_decay=kw.get("weight_decay", 1e-2 if cls == "AdamW" else 0.0),
             amsgrad=kw.get("amsgrad", False), maximize=kw.get("maximize", False), decoupled=cls == "AdamW",
             lr_tensor=lr_t)
    rec = R.TorchRecipe(impl, "cuda", dtype, False, o["amsgrad"], o["maximize"], o["decoupled"], lr_t)
    hp = C.AdamWHyperParams(o["lr"], *o["betas"], o["eps"], o["weight_decay"])
    st = dict(p=X.rnd(p0, dtype), m=np.zeros(n, np.float32), v=np.zeros(n, np.float32))
    if o["amsgrad"]:
        st["vmax"] = np.zeros(n, np.float32)
    emulate = {"foreach": E.foreach_step, "single": E.single_step, "fused": E.fused_opmath_step}[impl]
    tot = {}
    for t in range(1, steps + 1):
        g = X.rnd(grads[t - 1], dtype)
        s, fl = R.cuda_scalars(rec, hp, t), R.recipe_flags(rec, hp, torch_vec=n % 4 == 0)
        p, m, v, x, _ = X.recipe_step(rec, st["p"], g, st["m"], st["v"], st.get("vmax"), s, fl)
        ours = dict(p=p, m=m, v=v, **({"vmax": x} if o["amsgrad"] else {}))
        with np.errstate(all="ignore"):
            theirs = emulate(dtype, o, {k: a.copy() for k, a in st.items()}, g, t)
        for k, a in ours.items():
            b = theirs[k]
            tot[k] = tot.get(k, 0) + int((~((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b)))).sum())
        st = ours
    return tot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--research", required=True, help="folder of emu.py, emu_cuda.py, verify_cuda_h100.log")
    args = ap.parse_args()
    for p in (args.research, str(ROOT), str(ROOT / "tests")):
        sys.path.insert(0, p)
    import _cuda_recipes_ref as X  # noqa: PLC0415
    import emu_cuda as E  # noqa: PLC0415
    from trainstream import _device_recipes as R  # noqa: PLC0415
    from trainstream import contract as C  # noqa: PLC0415
    log = {}
    pat = re.compile(r"(OK |BAD) (\w+)\s+(\w+)\s+(\w+)\s+(.+?)\s{2,}(foreach|single|fused opmath \(2.13\), device powf)"
                     r"\s+(\{.*\})")
    for line in (Path(args.research) / "verify_cuda_h100.log").read_text().splitlines():
        m = pat.match(line)
        if m:
            log[m.group(2, 3, 4) + (m.group(5).strip(),)] = eval(m.group(7))  # noqa: S307 - the log's dict reprs
    same = differ = 0
    for cls in ("AdamW", "Adam"):
        for dtype in ("float32", "bfloat16", "float16"):
            for desc, kw in CONFIGS:
                for impl in (("single", "fused") if kw.get("lr") == "T" else ("foreach", "single", "fused")):
                    got, want = replay(E, X, R, C, cls, dtype, impl, kw), log.get((cls, dtype, impl, desc))
                    same, differ = same + (got == want), differ + (got != want)
                    print(f"{'same' if got == want else 'DIFF'} {cls:5s} {dtype:8s} {impl:7s} {desc:26s} "
                          f"replay {got} log {want}")
    print(f"{same} rows as the H100 log, {differ} not")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
