# Run (any machine): python experiments/derive_xla_gpu_lines.py --npz experiments/data/2026-12-07_s_h100/xla_gpu_optax.npz
"""Issue 35 item 4: XLA:GPU's lines for the ``optax.adamw`` configurations TrainStream's GPU kernels lack, derived
from the optimised HLO that ``probe_xla_gpu_optax.py`` recorded on an H100 (``xla_gpu_optax_hlo.txt`` beside the
data) and checked here, on any machine, against the bits it recorded.

Each line below follows its program's one fused loop, operation by operation: a 16-bit HLO operation is computed in
float32 and rounded to its type (``B``: bfloat16, ``H``: float16; for two 16-bit operands of a product or a sum that
is the one rounding native 16-bit arithmetic gives), no FMA contraction, constants in the operation's type
(optax's weak-typed Python floats), and ``1 - b^t`` from XLA's float32 ``power``. XLA:GPU's float32 ``sqrt``,
``rsqrt`` and division are approximate (``sqrt.approx.f32``, ``rsqrt.approx.f32``, ``div.full.f32``: what the
device kernels run); here they are IEEE stand-ins, so a 16-bit result must match exactly (where a stand-in differs
by an ulp of float32 the rounding to 16 bits almost never sees it) and a float32 result may differ by the
approximations alone (the table shows how far).

Findings (H100, jax 0.11.2): every moment of every configuration and every 16-bit output match bit for bit;
float32 updates differ by at most a few ulp where the approximate instructions decide (except fp32_nesterov at
count 4, whose numerator cancels); the structure differs from the float32 default line (kernels/adamw_variants.cu):

  bf16, fp16          mu, nu, the update, in the leaf's dtype; ``b2`` rounds to 1.0 in bfloat16 (XLA drops
                      ``b2 * nu``); fp16's ``eps`` rounds to 0, so XLA writes ``m/sqrt(v)`` as ``m * rsqrt(v)``
                      with both bias corrections divided in float16 (0 * inf = NaN where mu = nu = 0, as optax)
  bf16_mu32           mu float32 with ``1-b1`` bfloat16 times g rounded to bfloat16 first; ``bc1 * den`` float32
  bf16_nesterov       the numerator ``b1 * B(m/bc1(t+1)) + (1-b1) * B(g/bc1(t))`` in bfloat16
  fp32_mu16           mu's sum in float32 (the division reads it unrounded), stored in bfloat16
  fp32_nesterov       as bf16_nesterov in float32: ``(b1 * (m / bc1(t+1)) + (1-b1) * (g / bc1)) / (sqrt(v/bc2)+eps)``
  fp32_eps_root       ``sqrt(v / bc2 + eps_root)``
  fp32_eps0           ``(m / bc1) * rsqrt(v / bc2)``
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
from _common import _ordered  # noqa: E402
from trainstream import contract as C  # noqa: E402
from trainstream.contract import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

F = np.float32
LR, WD, B1, B2, EPS, EPS_ROOT = 1e-3, 1e-4, 0.9, 0.999, 1e-8, 1e-8  # probe_xla_gpu_optax.py's programs


def f(x):
    return np.asarray(x, F)


def B(x):
    return bf16_bits_to_f32(f32_to_bf16_bits(f(x)))


def H(x):
    return f(x).astype(np.float16).astype(F)


def bias(b: float, t: int) -> F:
    """``1 - b^t`` as XLA computes it: float32 ``power`` (correctly rounded here), then the subtraction."""
    return F(F(1) - F(np.float64(F(b)) ** t))


def lines(name: str, p, g, m, v, t: int):
    """``(new p, u, new mu, new nu)`` of configuration ``name`` at step ``t`` (float32 arrays holding each
    output's dtype's values), the HLO's operations in order."""
    d1, d2, d1n = bias(B1, t), bias(B2, t), bias(B1, t + 1)
    with np.errstate(all="ignore"):
        if name in ("bf16", "fp16"):
            R = B if name == "bf16" else H
            c1, b1, c2, b2, eps, wd, nlr = (R(F(x)) for x in (1 - B1, B1, 1 - B2, B2, EPS, WD, -LR))
            m1 = R(R(g * c1) + R(m * b1))                       # mu = (1-b1) g + b1 mu
            v1 = R(R(R(g * g) * c2) + R(v * b2))                # nu = (1-b2) g^2 + b2 nu (b2: 1.0 in bfloat16)
            if name == "bf16":                                  # u = m / (B(d1) * (B(sqrt(v / d2)) + eps))
                u0 = R(m1 / R(R(d1) * R(R(np.sqrt(f(v1 / d2))) + eps)))
            else:                                               # eps == 0 in float16: (m / d1) * rsqrt(v / d2)
                u0 = R(R(m1 / R(d1)) * R(F(1) / np.sqrt(R(v1 / R(d2)))))
            u = R(R(u0 + R(p * wd)) * nlr)                      # u = (u + wd p) * -lr
            return R(p + u), u, m1, v1
        if name == "bf16_mu32":
            m1 = f(B(g * B(F(1 - B1))) + f(m * F(B1)))          # mu float32: B((1-b1) g) + b1 mu
            v1 = B(B(B(g * g) * B(F(1 - B2))) + v)
            u0 = f(m1 / f(d1 * B(B(np.sqrt(f(v1 / d2))) + B(F(EPS)))))
            u = f(f(u0 + B(p * B(F(WD)))) * F(-LR))
            return B(p + u), u, m1, v1
        if name == "bf16_nesterov":
            m1 = B(B(g * B(F(1 - B1))) + B(m * B(F(B1))))
            v1 = B(B(B(g * g) * B(F(1 - B2))) + v)
            num = B(B(B(F(B1)) * B(m1 / d1n)) + B(B(F(1 - B1)) * B(g / d1)))
            u0 = B(num / B(B(np.sqrt(f(v1 / d2))) + B(F(EPS))))
            u = B(B(u0 + B(p * B(F(WD)))) * B(F(-LR)))
            return B(p + u), u, m1, v1
        mu = B(m * B(F(B1))) if name == "fp32_mu16" else f(m * F(B1))
        m1 = f(f(g * F(1 - B1)) + mu)
        v1 = f(f(f(g * g) * F(1 - B2)) + f(v * F(B2)))
        vh = f(v1 / d2)
        if name == "fp32_nesterov":
            u0 = f(f(f(F(B1) * f(m1 / d1n)) + f(F(1 - B1) * f(g / d1))) / f(f(np.sqrt(vh)) + F(EPS)))
        elif name == "fp32_eps0":
            u0 = f(f(m1 / d1) * f(F(1) / f(np.sqrt(vh))))
        else:
            if name == "fp32_eps_root":
                vh = f(vh + F(EPS_ROOT))
            u0 = f(m1 / f(d1 * f(f(np.sqrt(vh)) + F(EPS))))
        u = f(f(u0 + f(p * F(WD))) * F(-LR))
        return f(p + u), u, (B(m1) if name == "fp32_mu16" else m1), v1


#: Each configuration as optax.adamw's arguments: (leaf dtype, mu_dtype, nesterov, eps, eps_root).
CONFIGS = {"bf16": ("bfloat16", None, False, EPS, 0.0), "fp16": ("float16", None, False, EPS, 0.0),
           "bf16_mu32": ("bfloat16", "float32", False, EPS, 0.0), "bf16_nesterov": ("bfloat16", None, True, EPS, 0.0),
           "fp32_mu16": ("float32", "bfloat16", False, EPS, 0.0), "fp32_nesterov": ("float32", None, True, EPS, 0.0),
           "fp32_eps_root": ("float32", None, False, EPS, EPS_ROOT), "fp32_eps0": ("float32", None, False, 0.0, 0.0)}


def contract_lines(name: str, p, g, m, v, t: int):
    """:func:`lines`' outputs from the contract's optax/cuda lines (``trainstream.contract.optax_cuda_reference_update``
    over ``optax_cuda_code`` and the scalar matrix's row, its corrections XLA's float32 ``power`` as :func:`bias`)."""
    dtype, mu, nesterov, eps, eps_root = CONFIGS[name]
    mu = mu or dtype
    eps_zero = float(C.round_to(np.float32(eps), dtype)) == 0  # eps in nu's dtype, the leaf's here
    code = C.optax_cuda_code(dtype, mu, dtype, False, nesterov=nesterov, eps_zero=eps_zero, eps_root=eps_root != 0,
                             clip=False)
    row = C.optax_scalar_matrix(t - 1, [code], [True], learning_rate=LR, b1=B1, b2=B2, eps=eps, weight_decay=WD,
                                eps_root=eps_root, dtypes=[dtype], platform="cuda").scalars[0].copy()
    row[C.S_BC1], row[C.S_BC2_OPTAX], row[C.S_BC1_NEXT] = bias(B1, t), bias(B2, t), bias(B1, t + 1)
    new_p, m1, v1, u = C.optax_cuda_reference_update(p, m, v, g, row, dtype)
    R = (lambda x: C.round_to(x, dtype)) if C.optax_family(code, dtype)[3] != "float32" else f  # noqa: E731
    return new_p, R(u * row[C.S_NEG_LR]), m1, v1


def _values(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_bits_to_f32(bits)
    return bits.view(np.float16).astype(F) if dtype == "float16" else bits.view(F)


def ulps(a, b) -> np.ndarray:
    """Distance in float32 ulps (NaN and NaN: 0)."""
    d = np.abs(_ordered(a) - _ordered(b))
    d[np.isnan(f(a)) & np.isnan(f(b))] = 0
    return d


def check(npz, lines=lines) -> dict:
    """Per ``(config, count, output)``: ``(elements differing, max ulps, output dtype)`` of ``lines`` (this script's
    derivation, or :func:`contract_lines`) against the recording."""
    out = {}
    configs = sorted({k.split("/")[0] for k in npz.files if "/" in k})
    for name in configs:
        counts = sorted({int(k.split("/")[1]) for k in npz.files if k.startswith(name + "/")})
        for c in counts:
            dt = dict(s.split(":") for s in npz[f"{name}/{c}/dtypes"])
            a = {k: _values(npz[f"{name}/{c}/{k}"], d) for k, d in dt.items()}
            got = lines(name, a["p"], a["g"], a["mu"], a["nu"], c + 1)
            for key, x in zip(("new_p", "u", "new_mu", "new_nu"), got):
                d = ulps(x, a[key])
                out[(name, c, key)] = (int((d > 0).sum()), int(d.max()), dt[key])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--npz", default=os.path.join(HERE, "data", "2026-12-07_s_h100", "xla_gpu_optax.npz"))
    args = ap.parse_args(argv)
    exact16 = True
    for what, fn in (("derived here", lines), ("trainstream.contract's optax/cuda lines", contract_lines)):
        print(f"-- {what}\n{'config':15s} {'count':>5s} {'output':7s} {'dtype':9s} {'differ':>7s} {'max ulp':>8s}")
        for (name, c, key), (n, mx, dtype) in check(np.load(args.npz), fn).items():
            print(f"{name:15s} {c:5d} {key:7s} {dtype:9s} {n:7d} {mx:8d}")
            exact16 &= n == 0 or (dtype == "float32" and key in ("u", "new_p"))
    print("every moment and every 16-bit output bit-identical:", exact16)
    return 0 if exact16 else 1


if __name__ == "__main__":
    sys.exit(main())
