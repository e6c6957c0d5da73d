"""The optax/cpu host kernels of every dtype family (:mod:`trainstream._host_kernels._optax`) bit for bit against the
contract's NumPy lines (:func:`trainstream.contract.optax_reference_update`): float32 state with eps_root, nesterov,
XLA's rsqrt and b == 0.5 factoring, mu as bfloat16; fp16/bf16 state rounded per operation; fp16/bf16 with float32
mu. Each code compiles its own kernel (5 s for float32, up to 50 s for fp16/bf16 on a cold Numba cache): the CI runs
those the JAX adapter's tests compile anyway, ``TRAINSTREAM_OPTAX_GRID=1`` every one below."""

import os

import numpy as np
import pytest

import trainstream._host_kernels as K
import trainstream.contract as C

FULL = os.environ.get("TRAINSTREAM_OPTAX_GRID") == "1"
_full = pytest.mark.skipif(not FULL, reason="its own kernel's compile: TRAINSTREAM_OPTAX_GRID=1 runs it")
HP = dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)


def _bits(a, dtype):
    a = np.asarray(a, np.float32)
    if dtype == "float32":
        return a.copy()
    return C.f32_to_bf16_bits(a) if dtype == "bfloat16" else a.astype(np.float16).view(np.uint16)


def _values(b, dtype):
    if dtype == "float32":
        return b
    return C.bf16_bits_to_f32(b) if dtype == "bfloat16" else b.view(np.float16).astype(np.float32)


def _data(rng, n, dtype):
    """Values over 7 decades, zeros of both signs, float32 denormals (flushed), in ``dtype``."""
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype(np.float32)
    x[rng.random(n) < 0.03] = 0.0
    x[rng.random(n) < 0.03] = -0.0
    x[rng.random(n) < 0.01] = np.float32(1e-40)
    return C.round_xla(x, dtype)


CASES = [
    (0, "float32", {}),
    (C.OX_FORM_R, "float32", {}),
    (C.OX_HALF, "bfloat16", {}),
    (C.OX_HALF | C.OX_RSQRT, "float16", {}),
    pytest.param(C.OX_NESTEROV, "float32", dict(eps_root=1e-3), marks=_full),
    pytest.param(C.OX_NESTEROV | C.OX_FORM_R, "float32", {}, marks=_full),
    pytest.param(C.OX_RSQRT, "float32", dict(eps=0.0), marks=_full),
    pytest.param(C.OX_RSQRT | C.OX_RSQRT_DIV | C.OX_FORM_R, "float32", dict(eps=0.0), marks=_full),
    # rsqrt with decay, wd * p the product fused (contract.optax_rsqrt_decay_last)
    pytest.param(C.OX_RSQRT | C.OX_MU_BF16 | C.OX_FORM_R, "float32", dict(eps=0.0, weight_decay=0.1), marks=_full),
    pytest.param(C.OX_RSQRT | C.OX_B1_HALF | C.OX_B2_HALF, "float32", dict(eps=0.0, b1=0.5, b2=0.5,
                                                                            weight_decay=0.1), marks=_full),
    pytest.param(C.OX_B1_HALF | C.OX_B2_HALF, "float32", dict(b1=0.5, b2=0.5), marks=_full),
    pytest.param(C.OX_MU_BF16, "float32", {}, marks=_full),
    pytest.param(C.OX_MU_BF16 | C.OX_NESTEROV | C.OX_NUM_SWAP, "float32", {}, marks=_full),
    # nesterov with b1 == 0.5: the numerator (mn + gn) * b1, in form R g*r1 contracted into the sum
    pytest.param(C.OX_NESTEROV | C.OX_FORM_R | C.OX_B1_HALF, "float32", dict(b1=0.5), marks=_full),
    pytest.param(C.OX_MU_BF16 | C.OX_NESTEROV | C.OX_FORM_R | C.OX_B1_HALF, "float32", dict(b1=0.5), marks=_full),
    pytest.param(C.OX_HALF | C.OX_NESTEROV, "bfloat16", dict(eps_root=1e-3), marks=_full),
    pytest.param(C.OX_HALF | C.OX_RSQRT | C.OX_NESTEROV, "float16", {}, marks=_full),
    pytest.param(C.OX_HALF | C.OX_RSQRT | C.OX_B1_HALF | C.OX_B2_HALF, "float16", dict(b1=0.5, b2=0.5), marks=_full),
    pytest.param(C.OX_HALF | C.OX_MU_F32, "bfloat16", {}, marks=_full),
    pytest.param(C.OX_HALF | C.OX_MU_F32 | C.OX_NESTEROV, "bfloat16", {}, marks=_full),
    pytest.param(C.OX_HALF | C.OX_MU_F32, "float16", {}, marks=_full),
    pytest.param(C.OX_HALF | C.OX_MU_F32 | C.OX_FORM_R, "bfloat16", {}, marks=_full),
    pytest.param(C.OX_HALF | C.OX_MU_F32 | C.OX_FORM_R | C.OX_NESTEROV, "float16", {}, marks=_full),
    # float16 with float32 mu, b2 == 0.5: the update's loop recomputes v, as fp16 state's
    pytest.param(C.OX_HALF | C.OX_MU_F32 | C.OX_B2_HALF | C.OX_NESTEROV, "float16", dict(b2=0.5), marks=_full),
    # nesterov's numerator with (1-b1) * gn the product fused (b2 == 0.5 on a leaf of several elements)
    pytest.param(C.OX_NESTEROV | C.OX_B2_HALF | C.OX_NUM_SWAP, "float32", dict(b1=0.8, b2=0.5), marks=_full),
    pytest.param(C.OX_HALF | C.OX_HALF_DIV, "bfloat16", {}, marks=_full),
    pytest.param(C.OX_HALF | C.OX_HALF_DIV | C.OX_RSQRT | C.OX_NESTEROV, "float16", {}, marks=_full),
    pytest.param(C.OX_HALF | C.OX_HALF_DIV | C.OX_MU_F32 | C.OX_NESTEROV, "bfloat16", {}, marks=_full),
]


@pytest.mark.parametrize("code,dtype,hyper", CASES)
def test_optax_family_kernel_matches_reference(code, dtype, hyper):
    """4 steps over 517 elements (several strips and a tail), ``update``'s kernel (u out, the JAX adapter's) with
    the weights the reference gives; p, mu, nu and u bit for bit."""
    hp = {**HP, **hyper}
    eps_root = hp.pop("eps_root", 0.0)
    rng = np.random.default_rng(code)
    n, half = 517, bool(code & C.OX_HALF)
    g_dt, _, mu_dt, u_dt = C.optax_family(code, dtype)
    p_dt = dtype if half else "float32"
    p, m, v = _data(rng, n, p_dt), np.zeros(n, np.float32), np.zeros(n, np.float32)
    kp, km, kv = _bits(p, p_dt), _bits(m, mu_dt), _bits(v, g_dt)
    for t in range(4):
        g = _data(rng, n, dtype)
        sc = np.asarray(C.optax_scalar_matrix(t, [code], [t != 2], eps_root=eps_root, dtypes=[dtype], **hp).scalars[0])
        want = C.optax_reference_update(p, m, v, g, sc, dtype, rsqrt_estimate=K.rsqrt_estimate_array)
        out = np.zeros(n, np.uint16 if u_dt != "float32" else np.float32)
        K.adamw_chunk(C.VARIANT_OPTAX_CPU, kp, km, kv, _bits(g, dtype), K.KIND[dtype], out, K.OUT_U, 0, n, sc)
        for name, got, w, dt in (("u", out, want[3], u_dt), ("mu", km, want[1], mu_dt), ("nu", kv, want[2], g_dt)):
            bad = np.flatnonzero(_values(got, dt).view(np.uint32) != np.asarray(w, np.float32).view(np.uint32))
            assert bad.size == 0, f"code {code} {dtype} step {t + 1} {name}: {bad.size} differ, first {bad[:3]}"
        p, m, v = want[:3]
        kp = _bits(p, p_dt)


def test_out_u_dtype_checked():
    """``OUT_U`` takes u in optax's update dtype: the leaf's bits for fp16/bf16 state, else float32."""
    s = np.asarray(C.optax_scalar_matrix(0, [C.OX_HALF], [True], dtypes=["bfloat16"], **HP).scalars[0])
    a = np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="writes u into a uint16 out"):
        K.adamw_chunk(C.VARIANT_OPTAX_CPU, a, a.copy(), a.copy(), a.copy(), K.KIND_BF16, np.zeros(4, np.float32),
                      K.OUT_U, 0, 4, s)


#: optax/cuda's lines (trainstream.contract._optax_cuda), one case per line set of OX_CUDA_LINES: dtype, arguments.
CUDA_CASES = {
    0: ("float32", dict(eps_root=1e-3)),
    C.OX_NESTEROV: ("float32", {}),
    C.OX_RSQRT: ("float32", dict(eps=0.0)),
    C.OX_MU_BF16: ("float32", {}),
    C.OX_HALF: ("bfloat16", {}),
    C.OX_HALF | C.OX_RSQRT: ("float16", dict(eps=0.0)),
    C.OX_HALF | C.OX_NESTEROV: ("bfloat16", {}),
    C.OX_HALF | C.OX_MU_F32: ("bfloat16", {}),
}


def test_cuda_cases_cover_every_line_set():
    assert sorted(CUDA_CASES) == sorted(C.OX_CUDA_LINES)


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("code", sorted(CUDA_CASES))
def test_optax_cuda_kernel_matches_reference(code, clip):
    """The host's optax/cuda lines (mode="cpu" on a GPU): 3 steps over 517 elements, the weights in place (``step``)
    and u out (``update``), p, mu, nu and u bit for bit against the contract's NumPy lines; ``clip``: float32 lines
    after ``clip_by_global_norm`` (OX_CLIP, read at run time: no kernel of its own)."""
    dtype, hyper = CUDA_CASES[code]
    if clip and code & C.OX_HALF:
        pytest.skip("clipping with fp16/bf16 state is refused (optax_cuda_code)")
    hp = {**HP, **hyper}
    eps_root = hp.pop("eps_root", 0.0)
    rng = np.random.default_rng(code + 1)
    n, half = 517, bool(code & C.OX_HALF)
    p_dt = dtype if half else "float32"
    mu_dt = "bfloat16" if code & C.OX_MU_BF16 else "float32" if code & C.OX_MU_F32 or not half else dtype
    u_dt = dtype if half and not code & C.OX_MU_F32 else "float32"
    p = _data(rng, n, p_dt)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for t in range(3):
        g = _data(rng, n, dtype)
        norm = dict(global_norm=np.float32(3.3 + t), max_norm=0.7) if clip else {}
        sc = np.asarray(C.optax_scalar_matrix(t, [code | (C.OX_CLIP if clip else 0)], [t != 1], eps_root=eps_root,
                                              dtypes=[dtype], platform="cuda", **norm, **hp).scalars[0])
        want = C.optax_cuda_reference_update(p, m, v, g, sc, dtype)
        for via in ("step", "update"):
            kp, km, kv = _bits(p, p_dt), _bits(m, mu_dt), _bits(v, p_dt)
            out = np.zeros(n, np.uint16 if u_dt != "float32" else np.float32) if via == "update" else None
            K.adamw_chunk(C.VARIANT_OPTAX_CUDA, kp, km, kv, _bits(g, dtype), K.KIND[dtype], out,
                          K.OUT_U if out is not None else 0, 0, n, sc)
            got = [("mu", km, want[1], mu_dt), ("nu", kv, want[2], p_dt)]
            got += [("u", out, want[3], u_dt)] if via == "update" else [("p", kp, want[0], p_dt)]
            for name, x, w, dt in got:
                bad = np.flatnonzero(_values(x, dt).view(np.uint32) != np.asarray(w, np.float32).view(np.uint32))
                assert bad.size == 0, f"code {code} {dtype} {via} step {t + 1} {name}: {bad.size} differ, {bad[:3]}"
        p, m, v = want[:3]


def test_optax_cuda_refuses_combinations_not_derived():
    """An fp16 leaf with float32 mu (the derived line rounds to bf16), fp16/bf16 state on a float32 gradient or with
    its weights out elsewhere: no kernel (optax_cuda_code refuses them before; this is the kernels' own guard)."""
    a16, a32 = np.zeros(4, np.uint16), np.zeros(4, np.float32)
    for code, gkind, out, okind in ((C.OX_HALF | C.OX_MU_F32, K.KIND_F16, None, 0),
                                    (C.OX_HALF, K.KIND_F32, None, 0), (C.OX_HALF, K.KIND_BF16, a16.copy(), K.KIND_F16)):
        s = np.zeros(C.N_SCALARS, np.float32)
        s[C.S_OX_CODE] = code
        with pytest.raises(ValueError, match="no specialisation"):
            K.adamw_chunk(C.VARIANT_OPTAX_CUDA, a16.copy(), a32.copy(), a16.copy(), a16.copy(), gkind, out, okind,
                          0, 4, s)
