"""The `gpu` mode kernels against the references on the GPU (marker ``gpu``): the torch/cuda convention against
torch.optim.AdamW on CUDA, optax/cuda against optax.adamw under jax.jit on XLA:GPU (with diagnostics: which formulas
reproduce the reference's step), mapped memory's failures, and the zero-copy benchmark's checks. Shared cases and
fixtures: tests/_device_kernels_common.py."""

from __future__ import annotations

import numpy as np
import pytest

from trainstream import contract as C
from trainstream import _device_kernels as dk
from _experiments import load_script
from _device_kernels_common import (  # noqa: F401 - fixtures and helpers
    gpu, STEPS, OPTAX_CUDA_BOUND, HPS, VARIANTS, VNAME, DTYPE_COMBOS, LAYOUTS, SIZES_LAYOUTS, _storage_np, _to_storage, _from_storage, _ulps, _fmt, _regions, _where, _distance,
    _mismatch_report, cp, mapped, _device_array, _stream)

# -- against torch.optim.AdamW on CUDA ----------------------------------------------------------


def _hypotheses_report(alternatives) -> str:
    """alternatives: [(label, {hypothesis: array}, reference array)] -> which ones reproduce it."""
    lines = []
    for label, alts, target in alternatives:
        ok = [k for k, a in alts.items()
              if np.array_equal(np.asarray(a, np.float32).view(np.uint32), target.view(np.uint32))]
        lines.append(f"  {label}: reproduced exactly by " + (" | ".join(ok) if ok else
                     "none of: " + " | ".join(alts)))
    return "\n".join(lines)


def _torch_cuda_hypotheses(p, m, v, g, hp, t, want) -> str:
    """Which formulas reproduce torch's step from torch's previous state (NumPy)."""
    f = np.float32
    with np.errstate(all="ignore"):
        bc1 = 1 - hp.beta1**t
        bc2 = 1 - hp.beta2**t
        w, omb2, b2 = f(1 - hp.beta1), f(1 - hp.beta2), f(hp.beta2)
        p1 = p * f(1 - hp.lr * hp.weight_decay)
        diff = g - m
        small = abs(float(w)) < 0.5
        m_alts = {
            "lerp as fma [contract]": C.fma_f32(w, diff, m) if small else C.fma_f32(w - f(1), diff, g),
            "lerp unfused": (m + w * diff) if small else (g - diff * (f(1) - w)),
        }
        vb2 = v * b2
        v_alts = {
            "fma(1-b2, g*g, v*b2) [contract]": C.fma_f32(omb2, g * g, vb2),
            "fma((1-b2)*g, g, v*b2)": C.fma_f32(omb2 * g, g, vb2),
            "(1-b2)*g*g + v*b2": (omb2 * g) * g + vb2,
        }
        mt, vt = want[1], want[2]  # torch's own new moments: p's formula judged alone
        d_alts = {
            "sqrt(v)*f(1/sqrt(bc2)) [single-tensor]": np.sqrt(vt) * f(1.0 / bc2**0.5) + f(hp.eps),
            "sqrt(v)*(1/f(sqrt(bc2)))": np.sqrt(vt) * (f(1) / f(bc2**0.5)) + f(hp.eps),
            "sqrt(v)/f(sqrt(bc2))": np.sqrt(vt) / f(bc2**0.5) + f(hp.eps),
        }
        step = f(-(hp.lr / bc1))
        p_alts = {}
        for dn, d in d_alts.items():
            p_alts[f"d = {dn}, p = fma(step, m/d, p1)"] = C.fma_f32(step, mt / d, p1)
            p_alts[f"d = {dn}, p = p1 + step*(m/d)"] = p1 + step * (mt / d)
    return _hypotheses_report([("exp_avg", m_alts, want[1]), ("exp_avg_sq", v_alts, want[2]),
                               ("param", p_alts, want[0])])


@gpu
@pytest.mark.parametrize("hp_i", range(len(HPS)))
@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach-True"])
def test_torch_cuda_variant_matches_torch_adamw_on_cuda(cp, mapped, foreach, hp_i):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    hp = HPS[hp_i]
    n = 100003
    rng = np.random.default_rng(hp_i)
    p0 = rng.standard_normal(n).astype(np.float32)
    dev = torch.device("cuda", cp.cuda.runtime.getDevice())
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()).to(dev))
    opt = torch.optim.AdamW([tp], lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=foreach)
    param = cp.asarray(p0)
    grad = cp.zeros(n, cp.float32)
    m, m_ptr = mapped(n)
    v, v_ptr = mapped(n)
    m[:] = 0
    v[:] = 0
    prev_t = (p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32))
    for t in range(1, STEPS + 1):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        tp.grad = torch.from_numpy(g).to(dev)
        opt.step()
        torch.cuda.synchronize(dev)
        st = opt.state[tp]
        want = (tp.detach().cpu().numpy(), st["exp_avg"].cpu().numpy(), st["exp_avg_sq"].cpu().numpy())
        grad.set(g)
        s = C.step_scalars(hp, t, "torch", "cuda")
        dk.launch_adamw(C.VARIANT_TORCH_CUDA, param.data.ptr, "float32", grad.data.ptr, "float32", 0,
                        m_ptr, v_ptr, n, s, stream=_stream(cp))
        cp.cuda.Device().synchronize()
        got = (param.get(), m.copy(), v.copy())
        for name, a, b in zip(("weights", "exp_avg", "exp_avg_sq"), got, want):
            if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
                report = _mismatch_report(
                    f"torch/cuda kernel vs torch.optim.AdamW(foreach={foreach}) on CUDA, {hp}, step {t} "
                    f"(torch {torch.__version__})", name, a, b,
                    {"p": prev_t[0], "m": prev_t[1], "v": prev_t[2], "g": g})
                pytest.fail(report + "\nwhich formulas reproduce torch's step from its previous state:\n"
                            + _torch_cuda_hypotheses(*prev_t, g, hp, t, want))
        prev_t = tuple(x.copy() for x in want)


# -- against optax.adamw under jax.jit on the GPU -----------------------------------------------

_DIAG_SRC = r"""
__device__ float dv(float a, float b, int full) {
  float r;
  if (full) asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  else r = __fdiv_rn(a, b);
  return r;
}
__device__ float sq(float x, int approx) {
  float r;
  if (approx) asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  else r = __fsqrt_rn(x);
  return r;
}
extern "C" __global__ void optax_candidates(const float* p, const float* m, const float* v,
    float bc1, float bc2, float eps, float wd, float neglr, float* out, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (int k = 0; k < 8; ++k) {
    int full = k & 1, approx = (k >> 1) & 1, fold = (k >> 2) & 1;
    float den = __fadd_rn(sq(dv(v[i], bc2, full), approx), eps);
    float u = fold ? dv(m[i], __fmul_rn(bc1, den), full) : dv(dv(m[i], bc1, full), den, full);
    u = __fadd_rn(u, __fmul_rn(wd, p[i]));
    out[k * n + i] = __fadd_rn(p[i], __fmul_rn(u, neglr));
  }
}
"""


def _optax_candidates(cp, p, m_new, v_new, s):
    n = p.size
    kern = cp.RawKernel(_DIAG_SRC, "optax_candidates", options=("--fmad=false",))
    out = cp.empty(8 * n, cp.float32)
    f = np.float32
    kern(((n + 255) // 256,), (256,), (cp.asarray(p), cp.asarray(m_new), cp.asarray(v_new),
         f(s[C.S_BC1]), f(s[C.S_BC2_OPTAX]), f(s[C.S_EPS]), f(s[C.S_WD]), f(s[C.S_NEG_LR]), out, np.int64(n)))
    out = out.get().reshape(8, n)
    names = [f"div {'full' if k & 1 else 'rn'}, sqrt {'approx' if k & 2 else 'rn'}, "
             f"{'m/(bc1*(...))' if k & 4 else '(m/bc1)/(...)'}" for k in range(8)]
    return dict(zip(names, out))


def _jax_gpu():
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("JAX has no GPU backend here")
    return jax, gpus[0]


@gpu
@pytest.mark.parametrize("hp_i", [0, 1])
def test_optax_cuda_variant_matches_xla_gpu(cp, mapped, hp_i):
    """Bitwise against optax.adamw as XLA:GPU compiles it, with diagnostics on mismatch."""
    jax, jdev = _jax_gpu()
    import jax.numpy as jnp
    import optax

    hp = HPS[hp_i]
    n = 65537
    steps = min(STEPS, 30)
    opt = optax.adamw(hp.lr, b1=hp.beta1, b2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay)

    @jax.jit
    def xla_step(params, state, g):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def optax_bias_corrections(count):  # the expression of optax.tree_utils.tree_bias_correction
        return 1 - hp.beta1**count, 1 - hp.beta2**count

    rng = np.random.default_rng(100 + hp_i)
    p0 = rng.standard_normal(n).astype(np.float32)
    params = jax.device_put(jnp.asarray(p0), jdev)
    state = opt.init(params)
    param = cp.asarray(p0)
    grad = cp.zeros(n, cp.float32)
    m, m_ptr = mapped(n)
    v, v_ptr = mapped(n)
    m[:] = 0
    v[:] = 0
    for t in range(1, steps + 1):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
        p_prev = np.asarray(params)
        m_prev, v_prev = m.copy(), v.copy()
        params, state = xla_step(params, state, jax.device_put(jnp.asarray(g), jdev))
        bc1, bc2 = (np.float32(x) for x in optax_bias_corrections(jax.device_put(jnp.int32(t), jdev)))
        want_p = np.asarray(params)
        want_m = np.asarray(optax.tree_utils.tree_get(state, "mu"))
        want_v = np.asarray(optax.tree_utils.tree_get(state, "nu"))
        s = C.optax_step_scalars(hp, bc1, bc2)
        grad.set(g)
        dk.launch_adamw(C.VARIANT_OPTAX_CUDA, param.data.ptr, "float32", grad.data.ptr, "float32", 0,
                        m_ptr, v_ptr, n, s, stream=_stream(cp))
        cp.cuda.Device().synchronize()
        got_p, got_m, got_v = param.get(), m.copy(), v.copy()
        title = f"optax/cuda kernel vs optax.adamw on XLA:GPU (jax {jax.__version__}), {hp}, step {t}"
        for name, a, b in (("mu", got_m, want_m), ("nu", got_v, want_v)):
            if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
                f32 = np.float32
                omb1, b1, omb2, b2 = (f32(1 - hp.beta1), f32(hp.beta1), f32(1 - hp.beta2), f32(hp.beta2))
                mp, vp = m_prev, v_prev
                alts = [("mu", {"(1-b1)*g + b1*m [contract]": omb1 * g + b1 * mp,
                                "fma(1-b1, g, b1*m)": C.fma_f32(omb1, g, b1 * mp),
                                "fma(b1, m, (1-b1)*g)": C.fma_f32(b1, mp, omb1 * g)}, want_m),
                        ("nu", {"(1-b2)*(g*g) + b2*v [contract]": omb2 * (g * g) + b2 * vp,
                                "fma(1-b2, g*g, b2*v)": C.fma_f32(omb2, g * g, b2 * vp),
                                "fma(b2, v, (1-b2)*(g*g))": C.fma_f32(b2, vp, omb2 * (g * g))}, want_v)]
                pytest.fail(_mismatch_report(title, name, a, b, {"g": g, "m": mp, "v": vp})
                            + "\nwhich formulas reproduce XLA's moments:\n" + _hypotheses_report(alts))
        if not np.array_equal(got_p.view(np.uint32), want_p.view(np.uint32)):
            cands = _optax_candidates(cp, p_prev, want_m, want_v, s)
            rates = ", ".join(f"[{k}]: {np.mean(c.view(np.uint32) == want_p.view(np.uint32)):.4%}"
                              for k, c in cands.items())
            pytest.fail(_mismatch_report(title, "params", got_p, want_p,
                                         {"p": p_prev, "m": want_m, "v": want_v})
                        + f"\nfraction of XLA's params reproduced by each lowering: {rates}"
                        + f"\n(bc1={_fmt(bc1)}, bc2={_fmt(bc2)}; the kernel uses div.full, "
                          "sqrt.approx, m/(bc1*(...)))")
        # the same inputs next step for both sides
        param.set(want_p)
        m[:] = want_m
        v[:] = want_v


@gpu
def test_contract_optax_bias_corrections_match_optax_on_xla_gpu():
    """The contract's jnp expression for bc1, bc2 vs optax's own (pow with an int32 count)."""
    jax, jdev = _jax_gpu()
    import jax.numpy as jnp

    counts = jax.device_put(jnp.arange(1, 20001, dtype=jnp.int32), jdev)
    for b1, b2 in ((0.9, 0.999), (0.3, 0.95), (0.5, 0.99)):
        ours = jax.jit(jax.vmap(lambda c: C.optax_bias_corrections(b1, b2, c, xp=jnp)))(counts)
        optax_like = jax.jit(jax.vmap(lambda c: (1 - b1**c, 1 - b2**c)))(counts)
        for k, name in enumerate(("bc1", "bc2")):
            a, b = np.asarray(ours[k]), np.asarray(optax_like[k])
            bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
            assert bad.size == 0, (
                f"b=({b1}, {b2}) {name}: contract.optax_bias_corrections differs from optax's "
                f"1 - b**count on XLA:GPU at {bad.size} counts, first count {bad[0] + 1}: "
                f"{_fmt(a[bad[0]])} vs {_fmt(b[bad[0]])}")


# -- mapped memory and the benchmark ---------------------------------------------------------------


@gpu
def test_alloc_mapped_failure_raises_memoryerror_naming_the_size(cp):
    with pytest.raises(MemoryError, match=rf"could not allocate {2**60} bytes of mapped pinned host memory"):
        dk.alloc_mapped(2**60)
    host, dev, free = dk.alloc_mapped(1 << 20)  # CUDA still usable afterwards
    try:
        view = dk.host_view(host, 4)
        view[:] = [1, 2, 3, 4]
        copy4 = cp.RawKernel(r'''extern "C" __global__ void ts_copy4(const float* a, float* b) {
            b[threadIdx.x] = a[threadIdx.x] * 2.0f; }''', "ts_copy4")
        out = cp.zeros(4, cp.float32)
        copy4((1,), (4,), (np.uint64(dev), out))  # the GPU reads the mapped host memory
        np.testing.assert_array_equal(out.get(), [2, 4, 6, 8])
        del view
    finally:
        free()
        free()  # idempotent


@gpu
def test_alloc_mapped_cuda_failure_leaves_no_stale_cuda_error(cp):
    """A failed allocation (from the driver) is a MemoryError, and torch's next launch
    check does not see a stale runtime error."""
    with pytest.raises(MemoryError, match=rf"could not allocate {2**60} bytes of mapped pinned host memory"):
        dk.alloc_mapped(2**60)
    host, dev, free = dk.alloc_mapped(4096)
    free()
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        x = torch.zeros(16, device=torch.device("cuda", cp.cuda.runtime.getDevice())) + 1  # launch check
        torch.cuda.synchronize()
        assert float(x.sum()) == 16.0


@gpu
@pytest.mark.parametrize("pd", ["float32", "bfloat16"])
def test_benchmark_checks_then_times(cp, pd):
    r = load_script("bench_zero_copy").benchmark_zero_copy_adamw(1 << 20, device=cp.cuda.runtime.getDevice(), param_dtype=pd,
                                     iters=2, repeats=3)
    assert r["numel"] == 1 << 20 and r["ms"] > 0
    assert r["bytes_per_elem"] == (16 if pd == "float32" else 24)
    assert r["pcie_gbps"] == pytest.approx(r["gelems_per_s"] * r["bytes_per_elem"])


@gpu
@pytest.mark.parametrize("pd", ["float32", "bfloat16"])
def test_staged_benchmark_checks_then_times(cp, pd):
    """The staged ring (experiments/bench_zero_copy.py) over several chunks and a partial last
    one: its update equals the contract's on a sample (it raises otherwise)."""
    r = load_script("bench_zero_copy").benchmark_staged_adamw((3 << 20) + 12345, device=cp.cuda.runtime.getDevice(),
                                                              param_dtype=pd, chunk_mib=1, depth=2, iters=2, repeats=2)
    assert r["ms"] > 0 and r["ring_mib"] == 2 * (2 if pd == "float32" else 3)
