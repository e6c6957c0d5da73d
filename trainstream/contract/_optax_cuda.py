"""The optax/cuda lines of :mod:`trainstream.contract` beyond the float32 default: XLA:GPU's arithmetic for
``optax.adamw``'s fp16/bf16 state, ``mu_dtype``, ``nesterov``, ``eps_root`` and ``eps == 0``. :func:`optax_cuda_code`
names a leaf's lines (or refuses those not derived), :func:`optax_cuda_reference_update` computes them in NumPy
float32 with IEEE stand-ins for XLA:GPU's approximate ``sqrt``, ``rsqrt`` and division (the CUDA kernels,
``kernels/adamw_variants.cu``, run the instructions themselves: ``sqrt.approx.f32``, ``rsqrt.approx.f32``,
``div.full.f32``).

Where the lines come from: ``experiments/derive_xla_gpu_lines.py`` follows the optimised HLO that
``experiments/probe_xla_gpu_optax.py`` recorded on an H100 (jax 0.11.2) operation by operation and matches every
moment and 16-bit output of the recording with these lines. A 16-bit HLO operation is computed in float32 and
rounded to its type (``R``), no FMA contraction, each constant in its operation's type (the scalar matrix's
families, :func:`~trainstream.contract.optax_family`). The bias corrections ``d1``, ``d2``, ``d1n`` come float32
(``optax_scalar_matrix(..., platform="cuda")``): XLA:GPU's ``simplify-fp-conversions`` removes some of optax's
``astype`` round trips, so each line rounds them where XLA keeps the rounding (``R(d1)``, ``R(d2)`` below). Import
these names from :mod:`trainstream.contract`.

fp16/bf16 leaf, state in its dtype (:data:`OX_HALF`)::

    m  = R(R(f(1-b1) g) + R(f(b1) m))                     v = R(R(R(g g) f(1-b2)) + R(v f(b2)))
    bf16:            u = R(m / R(R(d1) R(R(sqrt(v / d2)) + f(eps))))       (f(b2) = 1.0 at b2 = 0.999: XLA drops it)
    bf16, nesterov:  u = R(R(R(f(b1) R(m / d1n)) + R(f(1-b1) R(g / d1))) / R(R(sqrt(v / d2)) + f(eps)))
    fp16, f(eps)=0:  u = R(R(m / R(d1)) R(rsqrt(R(v / R(d2)))))          (XLA's rewrite of m / sqrt(v))
    u = R(u + R(f(wd) p));  p = R(p + R(u f(-lr)))

bf16 leaf, ``mu_dtype=float32`` (:data:`OX_HALF` | :data:`OX_MU_F32`; ``B``: bfloat16 rounding)::

    m = B(B(1-b1) g) + b1 m                               v = B(B(B(g g) B(1-b2)) + B(v B(b2)))
    u = m / (d1 B(B(sqrt(v / d2)) + B(eps)));  u = u + B(B(wd) p);  p = B(p + u (-lr))

float32 leaf (an fp16/bf16 leaf's fp32 master too); ``mu_dtype=bfloat16`` (:data:`OX_MU_BF16`): ``f(b1) m`` is
``B(m B(b1))`` and mu is stored ``B(m)`` while the update reads ``m``::

    m = f(1-b1) g + f(b1) m;  v = f(1-b2) (g g) + f(b2) v;  h = v / d2 + f(eps_root)
    u = m / (d1 (sqrt(h) + f(eps)))                                            (the default)
    u = (f(b1) (m / d1n) + f(1-b1) (g / d1)) / (sqrt(h) + f(eps))             (nesterov, OX_NESTEROV)
    u = (m / d1) rsqrt(h)                                                      (eps == 0, OX_RSQRT)
    u = u + f(wd) p;  p = p + u f(-lr)

With ``optax.clip_by_global_norm(M)`` first (:data:`OX_CLIP`, float32 gradients' lines only): ``g = (g / n) M``.
``u`` above is the update before the learning rate in optax's dtype for it (the leaf's for fp16/bf16 state, else
float32): the JAX adapter's ``update`` returns it for its program to scale as optax does.

Not derived, refused by :func:`optax_cuda_code`: clipping or ``eps_root != 0`` with fp16/bf16 state, or ``b1``/``b2``
near 0.5 (``1 - b`` and ``b`` equal in the dtype); fp16 state
with ``eps`` not 0 in float16, or with nesterov; bf16 state with ``eps == 0``, or with nesterov on a one-element
leaf; ``mu_dtype=float32`` on fp16 leaves,
or with nesterov or ``eps_root``; ``mu_dtype=bfloat16`` with nesterov, ``eps_root`` or ``eps == 0``; nesterov with
``eps == 0``; array hyper-parameters with fp16/bf16 state (as on the CPU).
"""

from __future__ import annotations

import numpy as np

from ._reference import bf16_bits_to_f32, f32_to_bf16_bits
from ._scalars import (OX_CLIP, OX_HALF, OX_MU_BF16, OX_MU_F32, OX_NESTEROV, OX_RSQRT, S_BC1, S_BC1_NEXT, S_BC2_OPTAX,
                       S_BETA1, S_BETA1_MU, S_BETA2, S_CLIP, S_CLIP_DIV, S_EPS, S_EPS_ROOT, S_NEG_LR, S_OMB1, S_OMB2,
                       S_OX_CODE, S_WD)

_F32 = np.float32

#: The bits of an optax/cuda code (the others are optax/cpu's).
OX_CUDA_BITS = OX_CLIP | OX_NESTEROV | OX_RSQRT | OX_HALF | OX_MU_F32 | OX_MU_BF16
#: The line sets :func:`optax_cuda_code` gives, :data:`OX_CLIP` aside (the kernels read it at run time).
OX_CUDA_LINES: tuple[int, ...] = (0, OX_NESTEROV, OX_RSQRT, OX_MU_BF16, OX_HALF, OX_HALF | OX_RSQRT,
                                  OX_HALF | OX_NESTEROV, OX_HALF | OX_MU_F32)


def optax_cuda_code(dtype: str, mu: str, nu: str, master: bool, *, nesterov: bool, eps_zero: bool, eps_root: bool,
                    clip: bool, numel: int = 2, b_half: bool = False) -> int:
    """The optax/cuda code of a leaf of ``dtype`` whose state is ``mu``/``nu`` (dtype names; ``master``: an fp32
    master with float32 moments), ``eps_zero``: ``eps`` is a number that is 0 in the dtype the update adds it in
    (the leaf's for fp16/bf16 state, else float32); ``eps_root``: ``eps_root`` may be non-zero; ``numel``: the
    leaf's elements on the device (XLA:GPU compiles a one-element leaf's nesterov line otherwise: 2 bfloat16 ulps
    measured); ``b_half``: ``1 - b`` and ``b`` round alike in the state's 16-bit dtype for ``b1`` or ``b2`` (XLA
    factors ``(1-b) x + b y`` into ``(x + y) b`` there, as on the CPU: not derived on the GPU). Raises
    ``NotImplementedError`` naming the configuration where XLA:GPU's lines are not derived (module docstring)."""
    half = dtype != "float32" and not master and nu == dtype
    code = (OX_CLIP if clip else 0) | (OX_NESTEROV if nesterov else 0) | (OX_RSQRT if eps_zero else 0)
    why = None
    if not half:
        if mu == "bfloat16":
            code |= OX_MU_BF16
            if nesterov or eps_root or eps_zero:
                why = "mu_dtype=bfloat16 with nesterov, eps_root or eps == 0"
        elif mu != "float32" or nu != "float32":
            why = f"state {mu}/{nu} on a {dtype} leaf"
        elif nesterov and eps_zero:
            why = "nesterov with eps == 0"
        return _checked(code, why)
    code |= OX_HALF
    if clip or eps_root:
        why = f"clip_by_global_norm or eps_root with {dtype} state"
    elif b_half:
        why = f"{dtype} state with b1 or b2 whose 1 - b rounds to b in {dtype} (b near 0.5)"
    elif mu == "float32":
        code |= OX_MU_F32
        if dtype != "bfloat16" or nesterov or eps_zero:
            why = f"mu_dtype=float32 on a {dtype} leaf" + (" with nesterov or eps == 0" if dtype == "bfloat16" else "")
    elif mu != dtype:
        why = f"mu_dtype={mu} on a {dtype} leaf"
    elif dtype == "float16" and (nesterov or not eps_zero):
        why = "float16 state with nesterov or an eps that is not 0 in float16"
    elif dtype == "bfloat16" and eps_zero:
        why = "bfloat16 state with eps == 0"
    elif nesterov and numel == 1:
        why = f"nesterov on a one-element {dtype} leaf with {dtype} state"
    return _checked(code, why)


def _checked(code: int, why: str | None) -> int:
    if why is not None:
        raise NotImplementedError(f"XLA:GPU's lines of optax.adamw for {why} are not derived (issue 35: "
                                  "experiments/derive_xla_gpu_lines.py records and derives them); the GPU kernels do "
                                  "not run them")
    return code


def _rounder(dtype: str):
    if dtype == "bfloat16":
        return lambda x: bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, _F32)))
    if dtype == "float16":
        return lambda x: np.asarray(x, _F32).astype(np.float16).astype(_F32)
    return lambda x: np.asarray(x, _F32)


def optax_cuda_reference_update(p, m, v, g, scalars, dtype: str = "float32"):
    """One optax/cuda update of one leaf of ``dtype`` (the module docstring's lines, IEEE stand-ins for XLA:GPU's
    approximate operations): ``(p, m, v, u)`` as float32 arrays holding values of their dtypes (``m``: the stored
    mu's, ``u``: the update before the learning rate). ``scalars``: the leaf's row of
    ``optax_scalar_matrix(..., platform="cuda")``, its code (:func:`optax_cuda_code`) at ``S_OX_CODE``."""
    s = np.asarray(scalars, _F32)
    code = int(s[S_OX_CODE])
    f = lambda x: np.asarray(x, _F32)  # noqa: E731
    B = _rounder("bfloat16")
    p, m, v, g = (f(a) for a in (p, m, v, g))
    c1, b1, b1mu, c2, b2, eps, er, wd, nlr = (s[k] for k in (S_OMB1, S_BETA1, S_BETA1_MU, S_OMB2, S_BETA2, S_EPS,
                                                            S_EPS_ROOT, S_WD, S_NEG_LR))
    d1, d2, d1n = s[S_BC1], s[S_BC2_OPTAX], s[S_BC1_NEXT]
    with np.errstate(all="ignore"):
        g = f(f(g / s[S_CLIP_DIV]) * s[S_CLIP]) if code & OX_CLIP else f(g * s[S_CLIP])
        if code & OX_HALF and code & OX_MU_F32:  # bf16 leaf, float32 mu
            m = f(B(g * c1) + f(m * b1))
            v = B(B(B(g * g) * c2) + B(v * b2))
            u = f(m / f(d1 * B(B(np.sqrt(f(v / d2))) + eps)))
            u = f(u + B(p * wd))
            return B(p + f(u * nlr)), m, v, u
        if code & OX_HALF:
            R = _rounder(dtype)
            m = R(R(g * c1) + R(m * b1))
            v = R(R(R(g * g) * c2) + R(v * b2))
            if code & OX_RSQRT:
                u = R(R(m / R(d1)) * R(_F32(1) / np.sqrt(R(v / R(d2)))))
            elif code & OX_NESTEROV:
                u = R(R(R(b1 * R(m / d1n)) + R(c1 * R(g / d1))) / R(R(np.sqrt(f(v / d2))) + eps))
            else:
                u = R(m / R(R(d1) * R(R(np.sqrt(f(v / d2))) + eps)))
            u = R(u + R(p * wd))
            return R(p + R(u * nlr)), m, v, u
        mu = B(m * b1mu) if code & OX_MU_BF16 else f(m * b1)
        m = f(f(g * c1) + mu)
        v = f(f(f(g * g) * c2) + f(v * b2))
        h = f(f(v / d2) + er)
        if code & OX_NESTEROV:
            u = f(f(f(b1 * f(m / d1n)) + f(c1 * f(g / d1))) / f(f(np.sqrt(h)) + eps))
        elif code & OX_RSQRT:
            u = f(f(m / d1) * f(_F32(1) / f(np.sqrt(h))))
        else:
            u = f(m / f(d1 * f(f(np.sqrt(h)) + eps)))
        u = f(u + f(p * wd))
        return f(p + f(u * nlr)), (B(m) if code & OX_MU_BF16 else m), v, u
