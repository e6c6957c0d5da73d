"""The host kernels' torch/cpu and optax/cpu codes against the NumPy statement of the contract, the kernels against
the real references (torch.optim.AdamW on the CPU, optax.adamw jitted on XLA:CPU), the kernels' own fp16/bf16
conversions (exhaustive) and their machine code (bit for bit; the AdamW sweeps are test_host_kernels.py's).

Every specialisation compiled here costs Numba compile time (cached on disk afterwards),
so each test compiles only the specialisations it checks.
"""

import functools
import re
from collections import Counter

import numba
import numpy as np
import pytest
from numba import types

from trainstream import contract as C
from trainstream import _host_kernels as K
from trainstream._cpu_sqrt import available_modes as sqrt_modes_here

from _kernel_checks import HP_A, HP_B, assert_bits_equal, half_to_f32, round_bits_torch, torch


# -- the real references ---------------------------------------------------------------------


@pytest.mark.isa
def test_torch_cpu_kernel_matches_torch_adamw():
    if torch is None:
        pytest.skip("torch not installed")
    from trainstream.backends.torch import torch_cpu_code

    sqrt_mode = torch_cpu_code()
    n, steps = 4097, 50
    rng = np.random.default_rng(11)
    p0 = rng.standard_normal(n).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([tp], lr=HP_A.lr, betas=(HP_A.beta1, HP_A.beta2), eps=HP_A.eps,
                            weight_decay=HP_A.weight_decay)
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for t in range(1, steps + 1):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        clip = np.float32(rng.uniform(0.1, 1.0))
        tp.grad = torch.from_numpy(g.copy()).mul_(torch.tensor(clip))
        opt.step()
        s = C.step_scalars(HP_A, t, "torch", "cpu", clip=clip)
        K.adamw_chunk(C.VARIANT_TORCH_CPU, p, m, v, g, 0, None, 0, 0, n, s, sqrt_mode)
        st = opt.state[tp]
        assert_bits_equal(m, st["exp_avg"].numpy(), f"exp_avg step {t}")
        assert_bits_equal(v, st["exp_avg_sq"].numpy(), f"exp_avg_sq step {t}")
        assert_bits_equal(p, tp.detach().numpy(), f"param step {t}")


def _xla_cpu_fma():
    from trainstream.backends.jax import xla_cpu_fma as probe

    return probe()


@pytest.mark.isa
@pytest.mark.parametrize("code", [c for c in C.TC_CODES if (c & ~C.TC_NO_FMA) in sqrt_modes_here()])
def test_torch_cpu_codes_match_reference(code):
    """Every torch/cpu code this target compiles (sqrt mode x fused/unfused lerp and
    addcmul) against the contract, with that mode's root, on both lerp branches."""
    from trainstream import _cpu_sqrt as S

    mode = code & ~C.TC_NO_FMA
    rng = np.random.default_rng(200 + code)
    n = 4099
    p = rng.standard_normal(n).astype(np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for t, hp in ((1, HP_A), (2, HP_B), (3, HP_A)):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        s = C.step_scalars(hp, t, "torch", "cpu", clip=np.float32(0.6))
        want = C.reference_update(p, m, v, g, s, "torch", "cpu", sqrt=lambda x: S.sqrt_array(x, mode),
                                  fma=not code & C.TC_NO_FMA)
        got = [p.copy(), m.copy(), v.copy()]
        K.adamw_chunk(C.VARIANT_TORCH_CPU, *got, g, K.KIND_F32, None, 0, 0, n, s, code)
        for name, a, b in zip("pmv", got, want):
            assert_bits_equal(a, b, f"{name} code {code} step {t}")
        p, m, v = got


@pytest.fixture
def jax_on_cpu():
    """JAX with the CPU as its default device: these references are optax jitted on XLA:CPU
    (on the GPU machine JAX's default device is the GPU, whose arithmetic differs)."""
    jax = pytest.importorskip("jax")
    with jax.default_device(jax.devices("cpu")[0]):
        yield jax


@pytest.mark.isa
def test_optax_cpu_kernel_matches_jitted_optax(jax_on_cpu):
    """A single-leaf pytree (form R); the clip coefficient applied to the gradient first."""
    jax = jax_on_cpu
    optax = pytest.importorskip("optax")
    jnp = jax.numpy
    n, steps = 4097, 50
    rng = np.random.default_rng(12)
    p0 = rng.standard_normal(n).astype(np.float32)
    opt = optax.adamw(HP_A.lr, b1=HP_A.beta1, b2=HP_A.beta2, eps=HP_A.eps, weight_decay=HP_A.weight_decay)

    @jax.jit
    def step(params, state, grad):
        updates, state = opt.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    jp = jnp.asarray(p0)
    state = opt.init(jp)
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for t in range(1, steps + 1):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        clip = np.float32(rng.uniform(0.1, 1.0))
        jp, state = step(jp, state, jnp.asarray(g * clip))
        bc1, bc2 = C.optax_bias_corrections(HP_A.beta1, HP_A.beta2, t, xp=jnp)
        s = C.optax_step_scalars(HP_A, np.float32(bc1), np.float32(bc2), clip=clip,
                                 code=C.optax_cpu_code(1, n, fma=_xla_cpu_fma()))
        K.adamw_chunk(C.VARIANT_OPTAX_CPU, p, m, v, g, 0, None, 0, 0, n, s)
        assert_bits_equal(m, np.asarray(state[0].mu), f"mu step {t}")
        assert_bits_equal(v, np.asarray(state[0].nu), f"nu step {t}")
        assert_bits_equal(p, np.asarray(jp), f"params step {t}")


def _wide_range(rng, n):
    """Values from 1e-13 to 1e4, zeros of both signs, denormals and a few Inf."""
    x = rng.standard_normal(n).astype(np.float32) * (10.0 ** rng.uniform(-13, 4, n)).astype(np.float32)
    x[rng.random(n) < 0.03] = 0.0
    x[rng.random(n) < 0.03] = -0.0
    x[rng.random(n) < 0.03] = np.float32(1e-40) * np.sign(rng.standard_normal())
    x[rng.random(n) < 0.002] = np.inf
    return x.astype(np.float32)


#: optax/cpu codes of the float32 family, each flag picking one line of the kernel (FORM_R the corrections'
#: reciprocals, NU_SWAP and MU_SWAP the moments' FMA pairings, CLIP the gradient's division, NO_FMA every FMA in two
#: roundings): every pair of flags in all four on/off combinations (a covering array: 9 codes, not the 32; each code
#: is a specialisation, ~4 s of Numba compile). 0, 1, 6, 8, 10 and 14 are the codes the JAX tests compile anyway.
OX_PAIRWISE = (0, 1, 4, 6, 8, 10, 14, 16, 31)


@pytest.mark.parametrize("code", OX_PAIRWISE)
def test_optax_cpu_codes_match_reference_flush_to_zero(code):
    """optax/cpu's float32 codes (every pair of flags), decay on/off, on data full of denormals (FTZ/DAZ
    emulation)."""
    rng = np.random.default_rng(100 + code)
    n = 4099
    p, m, v = _wide_range(rng, n), _wide_range(rng, n) * np.float32(0.1), np.abs(_wide_range(rng, n))
    for t, decay in ((1, True), (2, False), (3, True)):
        g = _wide_range(rng, n)
        d1, d2 = C.optax_bias_corrections(0.9, 0.999, t)
        div, mul = (np.float32(0.37), np.float32(2.5)) if t != 2 else (np.float32(1), np.float32(1))
        s = C.optax_step_scalars(HP_A, d1, d2, clip=mul, clip_div=div, code=code, decay=decay)
        want = C.reference_update(p, m, v, g, s, "optax", "cpu")
        got = [p.copy(), m.copy(), v.copy()]
        K.adamw_chunk(C.VARIANT_OPTAX_CPU, *got, g, K.KIND_F32, None, 0, 0, n, s)
        for name, a, b in zip("pmv", got, want):
            assert_bits_equal(a, b, f"{name} code {code} step {t}")
        p, m, v = got


@pytest.mark.isa
def test_optax_cpu_multi_leaf_clip_mask_matches_jitted_optax(jax_on_cpu):
    """Kernel + contract scalars vs chain(clip_by_global_norm, adamw(mask=)) jitted on CPU."""
    jax = jax_on_cpu
    optax = pytest.importorskip("optax")
    jnp = jax.numpy
    rng = np.random.default_rng(13)
    shapes = {"a": (1,), "b": (33,), "c": (300,)}
    mask = {"a": False, "b": True, "c": True}
    hp = HP_A
    for max_norm in (1.0, 0.05):
        params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        opt = optax.chain(optax.clip_by_global_norm(max_norm),
                          optax.adamw(hp.lr, b1=hp.beta1, b2=hp.beta2, eps=hp.eps,
                                      weight_decay=hp.weight_decay, mask=mask))

        @jax.jit
        def step(params, state, grads):
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        norm_fn = jax.jit(optax.tree.norm)
        jp = jax.tree.map(jnp.asarray, params)
        state = opt.init(jp)
        mine = {k: [params[k].ravel().copy(), np.zeros(params[k].size, np.float32),
                    np.zeros(params[k].size, np.float32)] for k in shapes}
        for t in range(1, 21):
            grads = {k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 0)).astype(np.float32)
                     for k, s in shapes.items()}
            jg = jax.tree.map(jnp.asarray, grads)
            jp, state = step(jp, state, jg)
            d1, d2 = C.optax_bias_corrections(hp.beta1, hp.beta2, t, xp=jnp)
            div, mul = C.optax_clip_scalars(np.float32(norm_fn(jg)), max_norm)
            for k in shapes:
                n = params[k].size
                s = C.optax_step_scalars(hp, np.float32(d1), np.float32(d2), clip=mul, clip_div=div,
                                         code=C.optax_cpu_code(len(shapes), n, max_norm, fma=_xla_cpu_fma()),
                                         decay=mask[k])
                K.adamw_chunk(C.VARIANT_OPTAX_CPU, *mine[k], grads[k].ravel(), 0, None, 0, 0, n, s)
                assert_bits_equal(mine[k][0], np.asarray(jp[k]).ravel(), f"{k} params M={max_norm} step {t}")
            mu = optax.tree_utils.tree_get(state, "mu")
            for k in shapes:
                assert_bits_equal(mine[k][1], np.asarray(mu[k]).ravel(), f"{k} mu step {t}")



# -- conversions -------------------------------------------------------------------------------

ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


@functools.cache
def _cast_kernel(widen: bool, kind: int):
    """The kernels' own per-element conversions (``K._load``, ``K._round16``; ``kind`` a
    compile-time constant as in the kernels) over ``[begin, end)``: widen to float32, or round."""
    @numba.njit(**dict(K._OPTS, cache=False))  # the kernels' own options
    def cast(dst, src, begin, end):
        for i in range(begin, end):
            if widen:
                dst[i] = K._load(src[i], kind)
            else:
                dst[i] = K._round16(src[i], kind)
    return cast


def convert_to_f32(dst, src, kind, begin, end):
    _cast_kernel(True, kind)(dst, src, begin, end)


def round_from_f32(dst, src, kind, begin, end):
    _cast_kernel(False, kind)(dst, src, begin, end)


def test_f16_to_f32_exhaustive():
    out = np.empty(65536, np.float32)
    convert_to_f32(out, ALL16, K.KIND_F16, 0, 65536)
    assert_bits_equal(out, ALL16.view(np.float16).astype(np.float32), "f16 -> f32")
    if torch is not None:
        want = torch.from_numpy(ALL16.view(np.int16)).view(torch.float16).float().numpy()
        assert_bits_equal(out, want, "f16 -> f32 vs torch")


def test_bf16_to_f32_exhaustive():
    out = np.empty(65536, np.float32)
    convert_to_f32(out, ALL16, K.KIND_BF16, 0, 65536)
    assert_bits_equal(out, C.bf16_bits_to_f32(ALL16), "bf16 -> f32")
    np.testing.assert_array_equal(out.view(np.uint32) >> 16, ALL16)  # every bit kept, NaN too


def test_f32_copy_kind0():
    src = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    dst = np.zeros_like(src)
    convert_to_f32(dst, src, K.KIND_F32, 3, 998)
    assert_bits_equal(dst[3:998], src[3:998])
    assert (dst[:3] == 0).all() and (dst[998:] == 0).all()


def _rounding_inputs():
    """Every upper half-word with lower half-words at and around the rounding ties."""
    hi = np.arange(65536, dtype=np.uint32) << 16
    lows = np.array([0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x7FFF, 0x8000, 0x8001, 0xEFFF,
                     0xF000, 0xFFFF], np.uint32)
    return (hi[:, None] | lows[None, :]).ravel().view(np.float32)


@pytest.mark.parametrize("kind", [K.KIND_F16, K.KIND_BF16], ids=["f16", "bf16"])
def test_round_from_f32_exhaustive(kind):
    x = _rounding_inputs()
    n = x.size
    out = np.empty(n, np.uint16)
    round_from_f32(out, x, kind, 0, n)
    want = round_bits_torch(x, kind)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[~nan], want[~nan])
    assert np.isnan(half_to_f32(out[nan], kind)).all()
    if kind == K.KIND_BF16:
        np.testing.assert_array_equal(out, C.f32_to_bf16_bits(x))  # NaN -> 0x7FC0 exactly
    # round trip of every half value is the identity (NaN stays NaN)
    up = half_to_f32(ALL16, kind)
    back = np.empty(65536, np.uint16)
    round_from_f32(back, up, kind, 0, 65536)
    keep = ~np.isnan(up)
    np.testing.assert_array_equal(back[keep], ALL16[keep])
    assert np.isnan(half_to_f32(back[~keep], kind)).all()



# -- the machine code ---------------------------------------------------------------------------
# A packed arithmetic instruction on a ymm/zmm register (moves and broadcasts excluded).
_PACKED_OP = re.compile(r"^\s+(v(?!mov|broadcast|zeroupper|extract|insert|perm|shuf|unpck|blend|xor|pxor)\w+)"
                        r"\s[^\n]*%[yz]mm", re.M)


def _vectorisation_report(specs) -> list[dict]:
    """Compile *uncached* copies of kernel specialisations ``(kernel, key)`` (cached ones have no
    inspectable assembly) and summarise their machine code, one dict each: ``vector`` (packed
    arithmetic on ymm/zmm registers) and ``packed_ops`` (instruction -> count)."""
    f32, u16, i64 = types.float32[::1], types.uint16[::1], types.int64
    rows = []
    for kernel, key in specs:
        fn = K._BUILDERS[kernel](*key, cache=False)
        if kernel == "torch":  # (p, w, m, v, vmax, g, begin, end, s, tail)
            st = f32 if key[1] == K.KIND_F32 else u16
            sig = (f32, u16, st, st, st, f32 if key[3] == K.KIND_F32 else u16, i64, i64, f32, types.boolean)
        else:
            src = f32 if key[1] == K.KIND_F32 else u16  # the gradient
            sig = (f32, f32, f32, src, u16, i64, i64, f32)
        fn.compile(sig)
        asm = fn.inspect_asm(fn.signatures[0])
        ops = Counter(_PACKED_OP.findall(asm))
        rows.append({"kernel": kernel, "key": key, "vector": sum(ops.values()) > 0, "packed_ops": dict(ops)})
    return rows


def _target_has_avx2():
    from trainstream._jit import target_features

    return "fma" in target_features()  # Numba's target (forced narrower ones included)


@pytest.mark.skipif(not _target_has_avx2(), reason="checks AVX2/AVX-512 code generation")
def test_kernels_vectorise():
    """A few specialisations (uncached copies) carry packed sqrt/div/fma or conversions."""
    rows = _vectorisation_report([
        ("torch", K.torch_key(C.TorchRecipe(), K.KIND_F32, 0)),
        ("torch", K.torch_key(C.TorchRecipe("foreach", "cuda", "float16", master=True), K.KIND_BF16, 1)),
        ("adamw", (C.VARIANT_OPTAX_CPU, K.KIND_F32, K.KIND_F32, C.OX_CLIP | C.OX_NU_SWAP)),
        ("torch", K.torch_key(C.TorchRecipe("single", "cpu", "bfloat16", decoupled=False), K.KIND_BF16, 3)),
        ("torch", K.torch_key(C.TorchRecipe("fused", "cpu", "float16", amsgrad=True), K.KIND_F16, 3)),
    ])
    for r in rows:
        assert r["vector"], r
    # (torch/cpu: no vsqrtps check, torch_cpu_sqrt may become an emulation of ATen's sqrt)
    ops = rows[0]["packed_ops"]
    assert ops.get("vdivps") and any(k.startswith("vfmadd") for k in ops), ops
    ops = rows[1]["packed_ops"]
    assert ops.get("vsqrtps") and ops.get("vdivps") and any(k.startswith("vfmadd") for k in ops), ops
    ops = rows[2]["packed_ops"]  # optax/cpu: IEEE sqrt/div, FMAs, and the FTZ emulation
    assert ops.get("vsqrtps") and ops.get("vdivps") and any(k.startswith("vfmadd") for k in ops), ops
    for r in rows[3:]:  # fp16/bf16 state: the conversions and the root vectorise too
        assert r["packed_ops"].get("vsqrtps") and r["packed_ops"].get("vdivps"), r

