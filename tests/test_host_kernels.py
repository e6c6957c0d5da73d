"""The Numba host kernels' AdamW updates against the NumPy statement of the contract (bit for bit): every variant,
gradient and output kind, sizes and uneven chunks, the weights written into the gradient buffer, the raw entry
point's checks. The torch/cpu and optax/cpu codes, the real references, the conversions and the machine code are
test_host_kernels_codes.py's.

Every specialisation compiled here costs Numba compile time (cached on disk afterwards),
so each test compiles only the specialisations it checks.
"""

import threading

import numpy as np
import pytest

from trainstream import contract as C
from trainstream import _host_kernels as K
from trainstream._cpu_sqrt import available_modes as sqrt_modes_here

from _kernel_checks import HP_A, HP_B, assert_bits_equal, half_to_f32, make_grad, round_bits_torch, uneven_chunks

VARIANTS = [
    ("torch", "cpu"),
    ("torch", "cuda"),
    ("optax", "cpu"),
    ("optax", "cuda"),
]
KINDS = [K.KIND_F32, K.KIND_F16, K.KIND_BF16]
KIND_NAMES = {K.KIND_F32: "f32", K.KIND_F16: "f16", K.KIND_BF16: "bf16"}
GRAD_DTYPE = {K.KIND_F32: "float32", K.KIND_F16: "float16", K.KIND_BF16: "bfloat16"}
SIZES = [1, 7, 4095, 4097, 10007, 65537]  # 7 and 10007 are primes


# -- AdamW --------------------------------------------------------------------------------------


def _run_adamw_case(conv, plat, gkind, okind, n, hp, steps, seed):
    """Run ``steps`` updates three ways (one chunk, uneven chunks, NumPy) and compare."""
    variant = C.variant_id(conv, plat)
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n).astype(np.float32)
    if okind != K.KIND_F32:  # fp16/bf16 parameter: the master starts as its weights
        p0 = half_to_f32(round_bits_torch(p0, okind), okind)
    ref = [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    whole = [a.copy() for a in ref]
    chunked = [a.copy() for a in ref]
    out_whole = np.full(n, 0xFFFF, np.uint16) if okind else None
    out_chunked = np.full(n, 0xFFFF, np.uint16) if okind else None
    chunks = uneven_chunks(rng, n)
    for t in range(1, steps + 1):
        gbuf, g32 = make_grad(rng, n, gkind, t)
        clip = np.float32(rng.uniform(0.1, 1.0)) if t % 2 else np.float32(1.0)
        s = C.step_scalars(hp, t, conv, plat, clip=clip)
        K.adamw_chunk(variant, *whole, gbuf, gkind, out_whole, okind, 0, n, s)
        for b, e in chunks:
            K.adamw_chunk(variant, *chunked, gbuf, gkind, out_chunked, okind, b, e, s)
        ref = list(C.reference_update(*ref, g32, s, conv, plat, grad_dtype=GRAD_DTYPE[gkind]))
        tag = f"{conv}/{plat} g={KIND_NAMES[gkind]} out={KIND_NAMES[okind]} n={n} step {t}"
        for name, got, want in zip("pmv", whole, ref):
            assert_bits_equal(got, want, f"{name} {tag}")
        for name, got, want in zip("pmv", chunked, whole):
            assert_bits_equal(got, want, f"{name} chunked vs whole, {tag}")
        if okind:
            np.testing.assert_array_equal(out_whole, round_bits_torch(whole[0], okind), err_msg=f"out16 {tag}")
            np.testing.assert_array_equal(out_chunked, out_whole, err_msg=f"out16 chunked, {tag}")


#: (gradient kind, weights' kind out) as the callers pair them: the gradient in the parameter's dtype or float32 (the
#: engine's fp32 sum of micro-batches); the weights out in the parameter's dtype, or none (float32: fp32 weights, or
#: an fp32 master alone). An fp16 gradient with bf16 weights out (or the reverse) is no caller's, and each of its
#: conversions is checked in the pairings here (each one a specialisation: Numba compile time).
PAIRS = [pytest.param(g, o, id=f"g_{KIND_NAMES[g]}-out_{KIND_NAMES[o]}") for g in KINDS for o in KINDS
         if g == o or K.KIND_F32 in (g, o)]


@pytest.mark.parametrize("gkind,okind", PAIRS)
@pytest.mark.parametrize("conv,plat", VARIANTS, ids=lambda x: x)
def test_adamw_matches_reference(conv, plat, gkind, okind):
    for n in SIZES:
        _run_adamw_case(conv, plat, gkind, okind, n, HP_A, steps=3, seed=n)
    _run_adamw_case(conv, plat, gkind, okind, 4097, HP_B, steps=3, seed=1)


@pytest.mark.parametrize("conv,plat", VARIANTS, ids=lambda x: x)
def test_adamw_many_steps_fp32(conv, plat):
    _run_adamw_case(conv, plat, K.KIND_F32, K.KIND_F32, 1009, HP_A, steps=50, seed=50)


@pytest.mark.parametrize("conv,plat", VARIANTS, ids=lambda x: x)
def test_adamw_nonfinite_gradients_propagate(conv, plat):
    """Inf/NaN gradients poison m, v, p exactly as the reference does (no guard)."""
    variant = C.variant_id(conv, plat)
    n = 64
    rng = np.random.default_rng(3)
    p = rng.standard_normal(n).astype(np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    ref = [p.copy(), m.copy(), v.copy()]
    g = rng.standard_normal(n).astype(np.float32)
    g[[1, 5, 9]] = [np.inf, -np.inf, np.nan]
    s = C.step_scalars(HP_A, 1, conv, plat, clip=0.5)
    K.adamw_chunk(variant, p, m, v, g, 0, None, 0, 0, n, s)
    ref = C.reference_update(*ref, g, s, conv, plat)
    for name, got, want in zip("pmv", (p, m, v), ref):
        assert_bits_equal(got, want, name)
    assert np.isnan(p[[1, 5, 9]]).all()


@pytest.mark.parametrize("kind", [K.KIND_F16, K.KIND_BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("conv,plat,mode", [(c, p, md) for c, p in VARIANTS for md in (
    sqrt_modes_here()[:2] if (c, p) == ("torch", "cpu") else (0,))], ids=str)
def test_adamw_weights_into_gradient_buffer(conv, plat, mode, kind):
    """``out16 is g``: the update is the same bits as with a separate output buffer, and
    the gradient buffer ends up holding the rounded weights (the engine's upload source).
    The codes that change the loop, not only its arithmetic (each one compiled twice here): torch/cpu's
    IEEE root (one pass) and the first of MKL's roots (blocked: the roots in a pass of their own, the weights
    written in a third); the other sqrt modes and the optax/cpu codes are the same loops (their arithmetic is
    test_host_kernels_codes.py's)."""
    variant = C.variant_id(conv, plat)
    rng = np.random.default_rng(7)
    n = 10007
    p0 = half_to_f32(round_bits_torch(rng.standard_normal(n).astype(np.float32), kind), kind)
    sep = [p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    inp = [a.copy() for a in sep]
    out = np.full(n, 0xFFFF, np.uint16)
    chunks = uneven_chunks(rng, n)
    for t in range(1, 4):
        gbuf, _ = make_grad(rng, n, kind, t)
        s = C.step_scalars(HP_B, t, conv, plat, clip=np.float32(0.75))
        if conv == "optax" and plat == "cpu":
            s[C.S_OX_CODE] = mode
        K.adamw_chunk(variant, *sep, gbuf, kind, out, kind, 0, n, s, mode if plat == "cpu" else 0)
        g_in = gbuf.copy()
        for b, e in chunks:
            K.adamw_chunk(variant, *inp, g_in, kind, g_in, kind, b, e, s, mode if plat == "cpu" else 0)
        for name, got, want in zip("pmv", inp, sep):
            assert_bits_equal(got, want, f"{name} {conv}/{plat} mode {mode} step {t}")
        np.testing.assert_array_equal(g_in, out, err_msg=f"weights in g, step {t}")
    with pytest.raises(ValueError, match="keep its kind"):
        other = K.KIND_BF16 if kind == K.KIND_F16 else K.KIND_F16
        K.adamw_chunk(variant, *inp, g_in, kind, g_in, other, 0, n, s)


def test_adamw_empty_range_and_none_output_write_nothing():
    n = 100
    p, m, v = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    g = np.ones(n, np.float32)
    s = C.step_scalars(HP_A, 1, "torch", "cpu")
    K.adamw_chunk(0, p, m, v, g, 0, None, 0, 40, 40, s)
    assert (p == 1).all() and (m == 0).all()
    # okind != 0 with out16=None: the update runs, nothing else is written
    K.adamw_chunk(0, p, m, v, g, 0, None, K.KIND_BF16, 10, 20, s)
    assert (p[10:20] != 1).all() and (p[:10] == 1).all() and (p[20:] == 1).all()


def test_adamw_threads_release_the_gil():
    """Disjoint chunks from several threads give the single-call result."""
    n = 200_003
    rng = np.random.default_rng(7)
    base = [rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    g = rng.standard_normal(n).astype(np.float32)
    s = C.step_scalars(HP_A, 1, "torch", "cpu", clip=0.3)
    one = [a.copy() for a in base]
    K.adamw_chunk(0, *one, g, 0, None, 0, 0, n, s)
    many = [a.copy() for a in base]
    bounds = np.linspace(0, n, 5).astype(int)
    ts = [threading.Thread(target=K.adamw_chunk, args=(0, *many, g, 0, None, 0, int(b), int(e), s))
          for b, e in zip(bounds[:-1], bounds[1:])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for a, b in zip(one, many):
        assert_bits_equal(a, b)


def test_adamw_unknown_codes_rejected():
    a = np.zeros(4, np.float32)
    s = C.step_scalars(HP_A, 1, "torch", "cpu")
    with pytest.raises(ValueError, match="no specialisation"):
        K.adamw_chunk(7, a, a.copy(), a.copy(), a.copy(), 0, None, 0, 0, 4, s)
    with pytest.raises(ValueError, match="no specialisation"):
        K.adamw_chunk(0, a, a.copy(), a.copy(), a.copy(), 3, None, 0, 0, 4, s)



# -- the validating wrapper ----------------------------------------------------------------------


def _good(n=16):
    rng = np.random.default_rng(0)
    return dict(
        p=rng.standard_normal(n).astype(np.float32),
        m=np.zeros(n, np.float32),
        v=np.zeros(n, np.float32),
        g=rng.standard_normal(n).astype(np.float32),
        scalars=C.step_scalars(HP_A, 1, "torch", "cpu"),
    )


def test_adamw_chunk_matches_reference_gradient_kinds_and_subrange():
    a = _good(1000)
    v = C.VARIANT_TORCH_CPU
    want = C.reference_update(a["p"], a["m"], a["v"], a["g"], a["scalars"], "torch", "cpu")
    b = {k: x.copy() for k, x in a.items()}
    K.adamw_chunk(v, b["p"], b["m"], b["v"], b["g"], K.KIND_F32, None, K.KIND_F32, 0, 1000, b["scalars"])
    for got, w in zip((b["p"], b["m"], b["v"]), want):
        assert_bits_equal(got, w)
    # float16 gradient, float16 output
    g16 = a["g"].astype(np.float16)
    want = C.reference_update(a["p"], a["m"], a["v"], g16.astype(np.float32), a["scalars"], "torch", "cpu")
    b = {k: x.copy() for k, x in a.items()}
    out = np.empty(1000, np.uint16)
    K.adamw_chunk(v, b["p"], b["m"], b["v"], g16.view(np.uint16), K.KIND_F16, out, K.KIND_F16, 0, 1000, b["scalars"])
    assert_bits_equal(b["p"], want[0])
    np.testing.assert_array_equal(out, round_bits_torch(b["p"], K.KIND_F16))
    # bfloat16 bits, a sub-range
    gb = C.f32_to_bf16_bits(a["g"])
    b = {k: x.copy() for k, x in a.items()}
    outb = np.zeros(1000, np.uint16)
    K.adamw_chunk(v, b["p"], b["m"], b["v"], gb, K.KIND_BF16, outb, K.KIND_BF16, 100, 900, b["scalars"])
    want = C.reference_update(a["p"], a["m"], a["v"], C.bf16_bits_to_f32(gb), a["scalars"], "torch", "cpu")
    assert_bits_equal(b["p"][100:900], want[0][100:900])
    assert_bits_equal(b["p"][:100], a["p"][:100])
    np.testing.assert_array_equal(outb[100:900], C.f32_to_bf16_bits(b["p"][100:900]))
    assert (outb[:100] == 0).all()



def test_optax_cuda_clip_by_global_norm_matches_reference():
    """optax/cuda with OX_CLIP: g = (g / n) * M, host kernel bit-identical to the contract."""
    rng = np.random.default_rng(5)
    n = 10007
    hp = HP_A
    p = rng.standard_normal(n).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    ref = [p.copy(), m.copy(), v.copy()]
    variant = C.variant_id("optax", "cuda")
    for t in range(1, 6):
        g, g32 = make_grad(rng, n, K.KIND_F32, t)
        bc1, bc2 = C.optax_bias_corrections(hp.beta1, hp.beta2, t)
        s = C.optax_step_scalars(hp, bc1, bc2, clip=np.float32(0.7), clip_div=np.float32(3.3), code=C.OX_CLIP)
        K.adamw_chunk(variant, p, m, v, g, K.KIND_F32, None, 0, 0, n, s, 0)
        ref = list(C.reference_update(*ref, g32, s, "optax", "cuda"))
        for got, want, what in zip((p, m, v), ref, ("p", "m", "v")):
            assert_bits_equal(got, want, f"step {t} {what}")
        # and it is not the g * c form
        alt = C.reference_update(*ref, g32, C.optax_step_scalars(hp, bc1, bc2, clip=np.float32(0.7 / 3.3)), "optax", "cuda")
        assert not np.array_equal(alt[1], C.reference_update(*ref, g32, s, "optax", "cuda")[1])
