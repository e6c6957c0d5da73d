"""Shared by the tests of the torch recipes (contract, host kernels, engine): the real torch optimizer run step by
step, the recipe of its arguments, data, the host kernel over a slot's buffers, bit comparisons, and the spec's
CUDA lines restated independently of the contract (:func:`emulate_cuda`: the checks of the contract against the
emulation where no GPU is present; the GPU tests hold both to torch on CUDA)."""

from __future__ import annotations

import numpy as np

from trainstream import _host_kernels as K
from trainstream import contract as C

try:
    import torch
except ImportError:  # the kernels do not need torch
    torch = None

F = np.float32
TD = {} if torch is None else {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bits(x, dtype: str) -> np.ndarray:
    """float32 values -> the buffer a slot keeps: float32, or the uint16 bits of fp16/bf16 (torch's rounding)."""
    x = np.ascontiguousarray(x, F)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    return C.f32_to_bf16_bits(x)


def values(b, dtype: str) -> np.ndarray:
    """A slot's buffer -> float32 values."""
    b = np.asarray(b)
    if dtype == "float32":
        return b.astype(F)
    if dtype == "float16":
        return b.view(np.float16).astype(F)
    return C.bf16_bits_to_f32(b)


def nbad(a, b) -> int:
    """Elements whose float32 bits differ (NaN matches NaN)."""
    a, b = np.asarray(a, F).reshape(-1), np.asarray(b, F).reshape(-1)
    return int((~((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b)))).sum())


def data(n: int, steps: int, seed: int = 0):
    """Weights and gradients of a spread of magnitudes, with exact zeros (as the research verification)."""
    rng = np.random.default_rng(seed)
    p0 = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 0.5, n)).astype(F)
    grads = []
    for _ in range(steps):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype(F)
        g[rng.random(n) < 0.02] = 0.0
        grads.append(g)
    return p0, grads


def recipe_of(opt, impl: str, platform: str = "cpu", master: bool = False):
    """``(TorchRecipe, AdamWHyperParams)`` of a torch optimizer's first group (a Tensor lr: its float32 value)."""
    g0 = opt.param_groups[0]
    p = g0["params"][0]
    lr_t = isinstance(g0["lr"], torch.Tensor)
    recipe = C.check_recipe(C.TorchRecipe(impl, platform, str(p.dtype)[6:], master=master, amsgrad=g0["amsgrad"],
                                          maximize=g0["maximize"], decoupled=g0["decoupled_weight_decay"],
                                          lr_tensor=lr_t))
    lr = float(g0["lr"])
    hp = C.AdamWHyperParams(lr, float(g0["betas"][0]), float(g0["betas"][1]), g0["eps"], g0["weight_decay"])
    return recipe, hp


def make_opt(cls: str, dtype: str, impl: str, kw: dict, p0: np.ndarray, device: str = "cpu"):
    """``torch.optim.<cls>`` over one parameter of ``p0`` in ``dtype``, the implementation forced as ``impl``."""
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()).to(device, TD[dtype]))
    kwargs = dict(kw)
    if impl == "fused":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = impl == "foreach"
    return p, getattr(torch.optim, cls)([p], **kwargs)


def torch_state(p, opt) -> dict:
    """The parameter and its optimizer state as float32 values (``p``, ``m``, ``v``, ``vmax``)."""
    st = opt.state[p]
    out = {"p": p.detach().float().cpu().numpy().copy(), "m": st["exp_avg"].float().cpu().numpy().copy(),
           "v": st["exp_avg_sq"].float().cpu().numpy().copy()}
    if "max_exp_avg_sq" in st:
        out["vmax"] = st["max_exp_avg_sq"].float().cpu().numpy().copy()
    return out


class HostSlot:
    """One parameter's buffers as the host placement keeps them for ``recipe``, updated by the host kernel."""

    def __init__(self, recipe, p0: np.ndarray, tc_code: int = 0):
        self.recipe, self.code = recipe, tc_code
        self.sd = C.state_dtype(recipe)
        n = p0.size
        w = C.round_to(p0, recipe.dtype)
        self.master = w.copy() if self.sd == "float32" else None
        self.w = bits(w, recipe.dtype) if recipe.dtype != "float32" else None
        zero = bits(np.zeros(n, F), self.sd)
        self.m, self.v = zero.copy(), zero.copy()
        self.vmax = zero.copy() if recipe.amsgrad else None

    def step(self, g_bits, gdtype: str, s, threads: int = 1, chunks=None):
        n = self.m.size
        tails = C.torch_cpu_tails(self.recipe, n, self.code, threads)
        kind = K.KIND[self.recipe.dtype]
        for b, e in chunks or [(0, n)]:
            K.adamw_chunk(0, self.master, self.m, self.v, g_bits, K.KIND[gdtype], self.w, kind, b, e, s, self.code,
                          recipe=self.recipe, vmax=self.vmax, tails=tails)

    def state(self) -> dict:
        out = {"m": values(self.m, self.sd), "v": values(self.v, self.sd)}
        if self.vmax is not None:
            out["vmax"] = values(self.vmax, self.sd)
        out["p"] = values(self.w, self.recipe.dtype) if self.master is None else self.master.copy()
        if self.w is not None:
            out["weights"] = values(self.w, self.recipe.dtype)
        return out


# -- the spec's CUDA lines (torch_adamw_spec.md section 5, with the H100's corrections), restated ------------
def _fma(a, b, c):
    return C.fma_f32(a, b, c)


def _lerp(m, g, w):
    d = (g - m).astype(F)
    return _fma(w, d, m) if abs(F(w)) < 0.5 else _fma(F(F(w) - F(1)), d, g)


def emulate_cuda(impl: str, dtype: str, o: dict, st: dict, g: np.ndarray, t: int, bias=None) -> dict:
    """torch on CUDA per the research spec, written apart from the contract: ``o`` holds ``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``amsgrad``, ``maximize``, ``decoupled``, ``lr_tensor`` (a CPU tensor), ``grad_scale``; ``st``
    float32 values ``p``, ``m``, ``v`` (``vmax``); ``bias``: fused's ``(1 - powf(B1, t), 1 - powf(B2, t))``."""
    R = (lambda x: np.asarray(x, F)) if dtype == "float32" else (lambda x: C.round_to(x, dtype))
    lr, (b1, b2), eps, wd = o["lr"], o["betas"], o["eps"], o["weight_decay"]
    p, m, v = (np.asarray(st[k], F) for k in ("p", "m", "v"))
    g = np.asarray(g, F)
    with np.errstate(all="ignore"):
        if impl == "fused":
            LR, B1, B2, WD, EPS = F(lr), F(b1), F(b2), F(wd), F(eps)
            if bias is None:
                bias = (F(1) - np.power(B1, F(t)), F(1) - np.power(B2, F(t)))
            bc1, bc2s = F(bias[0]), F(np.sqrt(F(bias[1])))
            if o.get("grad_scale") is not None:
                g = (g / F(o["grad_scale"])).astype(F)
            if o["maximize"]:
                g = -g
            if wd != 0:
                if o["decoupled"]:
                    p = _fma(-F(LR * WD), p, p)
                elif o["maximize"] and not o["amsgrad"] and o.get("grad_scale") is None:  # not contracted (H100 SASS)
                    g = (g + (p * WD).astype(F)).astype(F)
                else:  # (without maximize torch's positional split: kernels/adamw_torch.cu; the host refuses it)
                    g = _fma(p, WD, g)
            m = _fma(B1, m, _fma(-B1, g, g))
            gg = (g * g).astype(F)
            v = _fma(B2, v, _fma(-B2, gg, gg))
            out = {}
            src = v
            if o["amsgrad"]:
                src = out["vmax"] = np.where(st["vmax"] < v, v, st["vmax"]).astype(F)
            d = (np.sqrt(src) / bc2s + EPS).astype(F)
            p = (p - ((F(LR / bc1) * m).astype(F) / d)).astype(F)
            out.update(p=R(p), m=R(m), v=R(v))
            if "vmax" in out:
                out["vmax"] = R(out["vmax"])
            return out
        bc1, bc2 = 1 - b1 ** float(t), 1 - b2 ** float(t)
        if o["maximize"]:
            g = -g
        if wd != 0:
            if o["decoupled"]:
                decay = F(F(1) - F(F(lr) * F(wd))) if o.get("lr_tensor") else F(1 - lr * wd)
                p = R(p * decay)
            else:
                g = R(_fma(F(wd), p, g))
        m = R(_lerp(m, g, F(1 - b1)))
        v = R(v * F(b2))
        v = R(_fma(F(1 - b2), (g * g).astype(F), v))
        out = {"m": m, "v": v}
        src = v
        if o["amsgrad"]:
            src = out["vmax"] = np.where(np.isnan(st["vmax"]) | np.isnan(v), st["vmax"] + v,
                                         np.maximum(st["vmax"], v)).astype(F)
        q = R(np.sqrt(src))
        d = R(q * F(1.0 / bc2 ** 0.5)) if impl == "single" else R(q / F(bc2 ** 0.5))
        d = R(d + F(eps))
        neg = F(-F(F(lr) / F(bc1))) if o.get("lr_tensor") else F(-(lr / bc1))
        out["p"] = R(_fma(neg, (m / d).astype(F), p))
        return out
