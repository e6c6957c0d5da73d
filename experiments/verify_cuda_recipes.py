# Run (GPU machine, repo root): python3 experiments/verify_cuda_recipes.py [--quick] [--steps 6] [-k SUBSTR] [--out FILE]
"""The device kernels of torch's CUDA recipes (kernels/adamw_torch.cu) against torch.optim.AdamW / Adam on CUDA, bit
for bit: one OK/BAD line per case (dtype x implementation x configuration x size x memory), then the placement's
staged, zero-copy and GPU-resident updates over several steps, then the fused kernels' bias corrections against
torch.pow on the device. Exit status 1 if anything differs.

Per case and step the kernel starts from torch's own state (so each step is checked on its own): torch steps, the
kernel updates copies of the same weights and state with the same gradient, and every array is compared bitwise
(NaN equal to NaN; a NaN payload difference is counted apart as ``nan``). A mismatch prints its diagnosis: whether
the NumPy emulation (tests/_cuda_recipes_ref.py, the kernel's lines) reproduces torch from the same state (then the
kernel departs from its lines) or not (then the lines are wrong), with fused's mismatches by torch's register index
ii. tests/test_device_recipes_gpu.py runs the same cases under pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

import _cuda_recipes_ref as X  # noqa: E402
from trainstream import _device_kernels as dk  # noqa: E402
from trainstream import _device_recipes as R  # noqa: E402
from trainstream import contract as C  # noqa: E402

DEV = "cuda"  # the torch device of the references (a dry run on CPU sets "cpu")
TD = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: name -> (torch class, its arguments); fp16 gets eps=0.1 as torch's own fp16 inputs, except "*eps8"
CONFIGS = {
    "adamw": ("AdamW", {}),
    "adamw_lr.01_wd.1": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    "adam_l2": ("Adam", {"weight_decay": 0.1}),
    "adam_l2_max": ("Adam", {"weight_decay": 0.1, "maximize": True}),
    "adamw_ams": ("AdamW", {"weight_decay": 0.1, "amsgrad": True}),
    "adam_l2_ams_max": ("Adam", {"weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    "adamw_betas.3.5": ("AdamW", {"betas": (0.3, 0.5), "weight_decay": 0.05}),
    "adam_nowd": ("Adam", {}),
    "tensor_lr": ("AdamW", {"lr": "T"}),
    "adam_tensor_lr_l2": ("Adam", {"lr": "T", "weight_decay": 0.1}),
    "adamw_eps8": ("AdamW", {"eps": 1e-8}),
}
SIZES = (4099, 4096, 131077)  # fused: torch's scalar path, its 4-wide path, three 65536-element chunks


def _bits(t: torch.Tensor) -> np.ndarray:
    """A CUDA tensor's stored bits as uint32 (fp32) or uint16 (fp16/bf16)."""
    if t.dtype == torch.float32:
        return t.detach().contiguous().view(torch.int32).cpu().numpy().view(np.uint32).copy()
    return t.detach().contiguous().view(torch.int16).cpu().numpy().view(np.uint16).copy()


def _values(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return bits.view(np.float32).copy()
    return bits.view(np.float16).astype(np.float32) if dtype == "float16" else C.bf16_bits_to_f32(bits)


def _differ(a: np.ndarray, b: np.ndarray, dtype: str) -> tuple[int, int]:
    """(elements whose bits differ, not both NaN; NaN-payload-only differences)."""
    va, vb = _values(a, dtype), _values(b, dtype)
    ne = a != b
    nan = ne & np.isnan(va) & np.isnan(vb)
    return int((ne & ~nan).sum()), int(nan.sum())


def recipe_of(cls: str, kw: dict, impl: str, dtype: str, master: bool = False):
    """(TorchRecipe, hyper-parameters, torch optimizer kwargs) of a configuration."""
    kw = dict(kw)
    lr_t = kw.pop("lr", 1e-3) if kw.get("lr") == "T" else None
    lr = float(np.float32(1e-3)) if lr_t is not None else kw.pop("lr", 1e-3)
    eps = kw.pop("eps", 0.1 if dtype == "float16" else 1e-8)
    b1, b2 = kw.pop("betas", (0.9, 0.999))
    wd = kw.pop("weight_decay", 1e-2 if cls == "AdamW" else 0.0)
    rec = R.TorchRecipe(impl, "cuda", dtype, master, kw.get("amsgrad", False), kw.get("maximize", False),
                        cls == "AdamW", lr_t is not None)
    opt_kw = dict(lr=torch.tensor(1e-3) if lr_t is not None else lr, betas=(b1, b2), eps=eps, weight_decay=wd, **kw)
    opt_kw.update({"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl])
    return rec, C.AdamWHyperParams(lr, b1, b2, eps, wd), opt_kw


class _Buffers:
    """The kernel's state arrays: mapped pinned host memory (``mapped``, ``mapped+1``: one element off alignment)
    or GPU memory (``device``)."""

    def __init__(self, memory: str, n: int, dtype: str):
        self.memory, self.n, self.dtype, self.frees, self.keep = memory, n, dtype, [], []
        self.np = np.float32 if dtype == "float32" else np.uint16

    def new(self, dtype=None):
        dtype = dtype or self.dtype
        npd = np.float32 if dtype == "float32" else np.uint16
        if self.memory == "device":
            t = torch.zeros(self.n, dtype=TD[dtype], device=DEV)
            self.keep.append(t)
            return t, t.data_ptr()
        off = 1 if self.memory == "mapped+1" else 0
        isz = np.dtype(npd).itemsize
        host, dev, free = dk.alloc_mapped((self.n + off) * isz + 64)
        self.frees.append(free)
        return dk.host_view(host + off * isz, self.n, npd), dev + off * isz

    @staticmethod
    def write(buf, bits: np.ndarray):
        if isinstance(buf, torch.Tensor):
            src = torch.from_numpy(bits.view(np.int32 if bits.dtype == np.uint32 else np.int16).copy())
            buf.view(src.dtype).copy_(src.to(buf.device))
        else:
            buf[:] = bits.view(buf.dtype)

    @staticmethod
    def read(buf) -> np.ndarray:
        if isinstance(buf, torch.Tensor):
            return _bits(buf)
        a = buf.copy()
        return a.view(np.uint32) if a.dtype == np.float32 else a

    def close(self):
        torch.cuda.synchronize()
        for f in self.frees:
            f()


def device_bias(s: np.ndarray):
    """The fused kernels' (bc1, bc2s, lr/bc1) for scalar vector ``s``, from the kernel's own code on the GPU."""
    import cupy as cp  # noqa: PLC0415
    fn = dk.program_function("adamw_torch_fused_bias_corrections")
    out = cp.zeros(3, cp.float32)
    S = R.SCALAR_INDEX
    fn((1,), (32,), (np.float32(s[S["S_BETA1"]]), np.float32(s[S["S_BETA2"]]), np.float32(-s[S["S_NEG_LR"]]),
                     cp.asarray([s[S["S_STEP"]]], cp.float32), out, np.int32(1)))
    return tuple(np.float32(x) for x in out.get())


def run_case(dtype, impl, config, n, memory="mapped", steps=6, seed=0, master=False, grad_scale=None) -> dict:
    """One case, ``steps`` steps: returns ``{"bad": {array: elements}, "nan": n, "diag": [lines]}``."""
    cls, kw = CONFIGS[config]
    rec, hp, opt_kw = recipe_of(cls, kw, impl, dtype, master)
    sd = R.state_dtype(rec)
    tdt = "float32" if master else dtype  # torch's parameter: the master of a master recipe
    rng = np.random.default_rng([seed, n, len(dtype), len(impl)])
    p0 = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 0.5, n)).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p0).to(DEV, TD[tdt]))
    opt = getattr(torch.optim, cls)([tp], **opt_kw)
    bufs = _Buffers(memory, n, sd)
    arrays = {k: bufs.new() for k in STATE_KEYS[:3 if rec.amsgrad else 2]}
    mbuf = bufs.new("float32") if master else None
    ours_p = torch.empty(n, dtype=TD[dtype], device=DEV)
    ours_g = torch.empty(n, dtype=TD[dtype], device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    bad, nan, diag = {}, 0, []
    for t in range(1, steps + 1):
        g32 = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype(np.float32)
        g = torch.from_numpy(g32).to(DEV, TD[dtype])
        st = opt.state.get(tp, {})
        prev = {k: _bits(st[k]) if k in st else np.zeros(n, np.uint32 if sd == "float32" else np.uint16)
                for k in arrays}
        prev_p = _bits(tp)
        for k, (buf, _) in arrays.items():
            bufs.write(buf, prev[k])
        if master:
            bufs.write(mbuf[0], prev_p)
            ours_p.copy_(tp.detach().to(TD[dtype]))
        else:
            ours_p.copy_(tp.detach())
        ours_g.copy_(g)
        tp.grad = g.to(TD[tdt]).clone()
        if grad_scale is not None:
            opt.grad_scale = torch.full((), grad_scale, dtype=torch.float32, device=DEV)  # as GradScaler.step
            opt.found_inf = torch.zeros((), dtype=torch.float32, device=DEV)
        tvec = (n % 4 == 0) if master else R.torch_vector_path(n, C.ITEMSIZE[dtype], tp.data_ptr(), tp.grad.data_ptr())
        opt.step()
        s = R.cuda_scalars(rec, hp, t, grad_div=grad_scale or 1.0)
        flags = R.recipe_flags(rec, hp, grad_scale=grad_scale is not None, torch_vec=tvec)
        item = R.TorchItem(ours_p.data_ptr(), ours_g.data_ptr(), mbuf[1] if master else 0, arrays["exp_avg"][1],
                           arrays["exp_avg_sq"][1], arrays["max_exp_avg_sq"][1] if rec.amsgrad else 0, n, s, flags)
        R.launch_torch_multi(rec, dtype, [item], stream=stream)
        torch.cuda.synchronize()
        st = opt.state[tp]
        got = {k: bufs.read(b) for k, (b, _) in arrays.items()}
        want = {k: _bits(st[k]) for k in arrays}
        got["param"], want["param"] = _bits(ours_p), _bits(tp.detach().to(TD[dtype]))
        if master:
            got["master"], want["master"] = bufs.read(mbuf[0]), _bits(tp)
        if grad_scale is not None:
            got["grad"], want["grad"] = _bits(ours_g), _bits(tp.grad)
        step_bad = {}
        for k in want:
            kdt = "float32" if k == "master" or (k in arrays and sd == "float32") else dtype
            d, dn = _differ(got[k], want[k], kdt)
            nan += dn
            if d:
                step_bad[k] = d
                bad[k] = bad.get(k, 0) + d
        if step_bad and not diag:
            diag = _diagnose(rec, hp, t, s, flags, prev, prev_p, g32, want, got, sd, tdt, dtype, grad_scale)
    bufs.close()
    return {"bad": bad, "nan": nan, "diag": diag}


def _diagnose(rec, hp, t, s, flags, prev, prev_p, g32, want, got, sd, tdt, dtype, grad_scale) -> list[str]:
    """Lines saying whether the emulation reproduces torch's step from torch's state, and where."""
    st = {k: _values(b, sd) for k, b in prev.items()}
    p = _values(prev_p, tdt)
    g = X.rnd(g32, dtype)
    bias = device_bias(s) if rec.impl == "fused" else None
    ep, em, ev, ex, eg = X.recipe_step(rec, p, g, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"), s,
                                       flags, grad_dtype=dtype, bias=bias)
    emu = {"exp_avg": em, "exp_avg_sq": ev, "max_exp_avg_sq": ex, "grad": eg,
           "param": X.rnd(ep, dtype), "master": ep}
    lines = [f"first differing step {t}: kernel {dict((k, int((got[k] != want[k]).sum())) for k in want)}"]
    for k in want:
        kdt = "float32" if k == "master" or (k in prev and sd == "float32") else dtype
        e = R._round_to_state(emu[k], kdt)
        e = e.view(np.uint32) if e.dtype == np.float32 else e
        d_emu, _ = _differ(e, want[k], kdt)
        d_ker, _ = _differ(got[k], e, kdt)
        lines.append(f"  {k}: emulation vs torch {d_emu}, kernel vs emulation {d_ker}")
        if d_emu and rec.impl == "fused":
            idx = np.flatnonzero(e != want[k])
            by_vec = np.bincount(idx & 3, minlength=4).tolist()
            by_slow = np.bincount((idx >> 9) & 3, minlength=4).tolist()
            lines.append(f"    emulation's misses by ii: vector path (i % 4) {by_vec}, scalar path "
                         f"((i / 512) % 4) {by_slow}; flags {flags}")
    return lines


def cases(quick: bool = False):
    """(name, kwargs of run_case) of the matrix."""
    dtypes, sizes = ("float32", "bfloat16", "float16"), (SIZES[:2] if quick else SIZES)
    for dtype in dtypes:
        for impl in ("foreach", "single", "fused"):
            for config, (cls, kw) in CONFIGS.items():
                if kw.get("lr") == "T" and impl == "foreach":
                    continue  # torch refuses a Tensor lr with foreach unless capturable
                if config == "adamw_eps8" and dtype != "float16":
                    continue
                for n in sizes:
                    memory = ("mapped", "device", "mapped+1")[(n + len(config)) % 3]
                    yield f"{dtype} {impl} {config} n={n} {memory}", dict(dtype=dtype, impl=impl, config=config,
                                                                          n=n, memory=memory)
    for dtype in ("bfloat16", "float16"):  # master_weights=True: the recipe on an fp32 master
        for impl in ("foreach", "single", "fused"):
            for config in ("adamw", "adam_l2_max", "adamw_ams"):
                yield f"{dtype} {impl} {config} master n=4099", dict(dtype=dtype, impl=impl, config=config, n=4099,
                                                                     master=True)
    for dtype in ("float32", "bfloat16", "float16"):  # fused with GradScaler's grad_scale (written back)
        for config in ("adamw", "adam_l2", "adam_l2_max"):
            for n in (4099, 4096):
                yield f"{dtype} fused {config} grad_scale n={n}", dict(dtype=dtype, impl="fused", config=config, n=n,
                                                                       grad_scale=1024.0)


PLACEMENT_SLOTS = [  # (dtype, n, impl, config, master): one DevicePlacement, several kernels and launches
    ("float32", 4099, "foreach", "adamw", False), ("bfloat16", 70001, "fused", "adam_l2_max", False),
    ("float16", 4096, "single", "adamw_ams", False), ("bfloat16", 300001, "fused", "adamw", False),
    ("bfloat16", 5000, "foreach", "adamw_lr.01_wd.1", True), ("float32", 1, "fused", "adamw_ams", False),
    ("float32", 131077, "single", "adam_l2", False), ("float16", 9, "fused", "tensor_lr", False)]


def run_placement(mode: str, steps: int = 5, seed: int = 1) -> dict:
    """The slots of :data:`PLACEMENT_SLOTS` in one DevicePlacement (``mode``: staged through a small ring, zero-copy,
    or GPU-resident), ``steps`` steps on their own state beside one torch optimizer per slot: ``{"bad": {slot
    array: elements}}`` (weights every step, the state dicts at the end)."""
    from trainstream.backends.torch import TorchBackend  # noqa: PLC0415
    from trainstream.core import _ring  # noqa: PLC0415
    from trainstream.core._device import DevicePlacement  # noqa: PLC0415
    ring_elems, _ring.RING_ELEMS = _ring.RING_ELEMS, 1 << 14  # 192 KiB buffers: tensors span several
    try:
        device = torch.device(DEV, torch.cuda.current_device()) if DEV == "cuda" else torch.device(DEV)
        eng = DevicePlacement(TorchBackend(device), staged=mode == "staged")
        rng = np.random.default_rng(seed)
        slots = []
        for k, (dtype, n, impl, config, master) in enumerate(PLACEMENT_SLOTS):
            cls, kw = CONFIGS[config]
            rec, hp, opt_kw = recipe_of(cls, kw, impl, dtype, master)
            p0 = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 0.5, n)).astype(np.float32)
            tp = torch.nn.Parameter(torch.from_numpy(p0).to(DEV, TD["float32" if master else dtype]))
            ours = tp.detach().to(TD[dtype]).clone()
            sid = eng.add_param(ours, n, dtype, "cuda", gpu_state=mode == "resident", recipe=rec)
            if master:  # torch's fp32 parameter is the master, not the weights' upcast
                zeros = np.zeros(n, np.float32)
                eng.load_state(sid, {"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros, "master": p0,
                                     **({"max_exp_avg_sq": zeros} if rec.amsgrad else {})})
            slots.append((k, rec, hp, tp, getattr(torch.optim, cls)([tp], **opt_kw), ours, sid, dtype))
        bad = {}
        for _ in range(steps):
            updates = []
            for k, rec, hp, tp, opt, ours, sid, dtype in slots:
                g = torch.from_numpy((rng.standard_normal(ours.numel()) * 10.0 ** rng.uniform(-6, 1)).astype(
                    np.float32)).to(DEV, TD[dtype])
                tp.grad = g.to(tp.dtype)
                opt.step()
                updates.append((sid, hp, g.clone(), dtype))
            eng.step(updates)
            eng.wait_all()
            torch.cuda.synchronize()
            for k, rec, hp, tp, opt, ours, sid, dtype in slots:
                d, _ = _differ(_bits(ours), _bits(tp.detach().to(TD[dtype])), dtype)
                if d:
                    bad[f"slot{k}.param"] = bad.get(f"slot{k}.param", 0) + d
        for k, rec, hp, tp, opt, ours, sid, dtype in slots:
            st, tst = eng.state(sid), opt.state[tp]
            sd = R.state_dtype(rec)
            for key, arr in st.items():
                if key == "step":
                    if arr != int(tst["step"].item()):
                        bad[f"slot{k}.step"] = 1
                    continue
                want = _bits(tp) if key == "master" else _bits(tst[key])
                got = arr.view(np.uint32) if arr.dtype == np.float32 else arr
                d, _ = _differ(got, want, "float32" if key == "master" else sd)
                if d:
                    bad[f"slot{k}.{key}"] = d
        eng.close()
        return {"bad": bad}
    finally:
        _ring.RING_ELEMS = ring_elems


def check_bias_corrections(tmax: int = 20000) -> dict:
    """The fused kernels' (1 - b1^t, sqrt(1 - b2^t), lr / (1 - b1^t)) for t = 1..tmax against torch's float ops on
    the device (torch.pow(float, float) is CUDA's powf, as in ATen's fused kernel): ``{betas: differing steps}``."""
    import cupy as cp  # noqa: PLC0415
    fn = dk.program_function("adamw_torch_fused_bias_corrections")
    out = {}
    steps = np.arange(1, tmax + 1, dtype=np.float32)
    for b1, b2, lr in ((0.9, 0.999, 1e-3), (0.3, 0.5, 1e-2), (0.95, 0.9999, 3e-4), (0.5, 0.99, 0.1)):
        res = cp.zeros(3 * tmax, cp.float32)
        fn(((tmax + 255) // 256,), (256,), (np.float32(b1), np.float32(b2), np.float32(lr), cp.asarray(steps), res,
                                            np.int32(tmax)))
        got = res.get().reshape(tmax, 3)
        t = torch.from_numpy(steps).cuda()
        one = torch.ones((), device=DEV)
        bc1 = one - torch.pow(torch.full_like(t, float(np.float32(b1))), t)
        bc2s = torch.sqrt(one - torch.pow(torch.full_like(t, float(np.float32(b2))), t))
        ss = torch.full_like(t, float(np.float32(lr))) / bc1
        want = torch.stack([bc1, bc2s, ss], 1).cpu().numpy()
        out[f"({b1}, {b2}, lr={lr})"] = int((got.view(np.uint32) != want.view(np.uint32)).any(1).sum())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes 4099 and 4096 only")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("-k", default="", help="only the cases whose name contains this")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, git {torch.version.git_version[:8]}), "
          f"{torch.cuda.get_device_name()}", flush=True)
    t0, results, nbad = time.time(), {}, 0
    dk.compile_kernels()
    print(f"kernels compiled in {time.time() - t0:.1f} s", flush=True)
    for name, kw in cases(args.quick):
        if args.k not in name:
            continue
        r = run_case(steps=args.steps, **kw)
        ok = not r["bad"]
        nbad += not ok
        results[name] = r
        print(f"{'OK ' if ok else 'BAD'} {name:52s} {r['bad'] or ''}{' nan-payload ' + str(r['nan']) if r['nan'] else ''}",
              flush=True)
        for line in r["diag"]:
            print("      " + line, flush=True)
    if not args.k:
        for mode in ("staged", "zero-copy", "resident"):
            r = run_placement(mode)
            nbad += bool(r["bad"])
            results[f"placement {mode}"] = r
            print(f"{'OK ' if not r['bad'] else 'BAD'} placement {mode:10s} {r['bad'] or ''}", flush=True)
        bc = check_bias_corrections()
        nbad += any(bc.values())
        results["fused bias corrections vs torch.pow"] = bc
        print(f"{'OK ' if not any(bc.values()) else 'BAD'} fused bias corrections vs torch.pow, steps 1..20000: {bc}")
    print(f"{len(results)} checks, {nbad} BAD, {time.time() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if nbad else 0


if __name__ == "__main__":
    sys.exit(main())
