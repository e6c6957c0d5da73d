// TrainStream's AdamW on the GPU, part 4 of 4 (after adamw_torch.cu): the contract's conventions on the cuda
// platform, with fp32 state (and an fp32 master for 16-bit weights): each line of maths quotes the contract
// (trainstream.contract) line it implements.
//
//   adamw_torch_cuda_<p>_<g>      torch/cuda: torch's foreach arithmetic on the fp32 master (TsOps of
//                                 adamw_torch.cu with fp32 state, decay always applied, the gradient times
//                                 S_CLIP unrounded; the launcher sets TS_F_DECAY)
//   adamw_optax_cuda_<p>_<g>      optax/cuda: XLA:GPU's square root and division
//   adamw_u_optax_cuda_f32_<g>    the same on fp32 weights (read only), writing u (the JAX adapter's update)
//   adamw_[u_]optax_cuda_<p>_<g>_s<mu>_<nu>   optax/cuda with optax's own 16-bit state (no master)
// <p>, <g> in {f32, f16, bf16}: 9 + 9 + 3 + 24 kernels.

// optax/cuda: XLA:GPU calls libdevice __nv_sqrtf with __CUDA_PREC_SQRT unset and __CUDA_FTZ = xla_gpu_ftz =
// false, i.e. the approximate square root without .ftz.
__device__ __forceinline__ float xla_gpu_sqrt(float x) {
  float r;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// optax/cuda: XLA:GPU runs LLVM's NVPTX backend with -nvptx-prec-divf32=1, which lowers every f32 division to
// div.full.f32 (full-range approximation, <= 2 ulp), not to the IEEE div.rn.f32.
__device__ __forceinline__ float xla_gpu_div(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// optax/cuda on XLA:GPU: f32 rsqrt is libdevice __nv_rsqrtf, rsqrt.approx.f32 (no .ftz).
__device__ __forceinline__ float xla_gpu_rsqrt(float x) {
  float r;
  asm("rsqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// optax/cuda, one element: trainstream.contract._optax_cuda's lines (the code's bits choose them; H: the 16-bit
// dtype of TS_OX_HALF's lines, R(x) its rounding, B(x) bfloat16's). p, g, m, v in; p, m (unrounded with
// TS_OX_MU_BF16: the store rounds it), v and u (the update before the learning rate, in optax's dtype) out.
template <typename H>
__device__ __forceinline__ void ts_optax_lines(const float* s, float& p, const float graw, float& m, float& v,
                                               float& u) {
  const int code = (int)s[TS_S_OX_CODE];
  const float c1 = s[TS_S_OMB1], b1 = s[TS_S_BETA1], c2 = s[TS_S_OMB2], b2 = s[TS_S_BETA2], eps = s[TS_S_EPS];
  const float wd = s[TS_S_WD], nlr = s[TS_S_NEG_LR], d1 = s[TS_S_BC1], d2 = s[TS_S_BC2_OPTAX], d1n = s[TS_S_BC1_NEXT];
  // g = g * c; with OX_CLIP (optax.clip_by_global_norm): g = RN(xla_div(g, norm) * max_norm)
  const float g = (code & TS_OX_CLIP) ? __fmul_rn(xla_gpu_div(graw, s[TS_S_CLIP_DIV]), s[TS_S_CLIP])
                                      : __fmul_rn(graw, s[TS_S_CLIP]);
  if ((code & TS_OX_HALF) && (code & TS_OX_MU_F32)) {  // bf16 leaf, float32 mu
    // m = B(B(1-b1) g) + b1 m
    m = __fadd_rn(ts_round<ts_bf16>(__fmul_rn(g, c1)), __fmul_rn(m, b1));
    // v = B(B(B(g g) B(1-b2)) + B(v B(b2)))
    v = ts_round<ts_bf16>(__fadd_rn(ts_round<ts_bf16>(__fmul_rn(ts_round<ts_bf16>(__fmul_rn(g, g)), c2)),
                                    ts_round<ts_bf16>(__fmul_rn(v, b2))));
    // u = m / (d1 B(B(sqrt(v / d2)) + B(eps)))
    const float den = ts_round<ts_bf16>(__fadd_rn(ts_round<ts_bf16>(xla_gpu_sqrt(xla_gpu_div(v, d2))), eps));
    u = xla_gpu_div(m, __fmul_rn(d1, den));
    // u = u + B(B(wd) p)
    u = __fadd_rn(u, ts_round<ts_bf16>(__fmul_rn(p, wd)));
    // p = B(p + u (-lr))
    p = ts_round<ts_bf16>(__fadd_rn(p, __fmul_rn(u, nlr)));
    return;
  }
  if (code & TS_OX_HALF) {  // fp16/bf16 leaf, state in its dtype: every operation rounded to H
    // m = R(R(1-b1 g) + R(b1 m))
    m = ts_round<H>(__fadd_rn(ts_round<H>(__fmul_rn(g, c1)), ts_round<H>(__fmul_rn(m, b1))));
    // v = R(R(R(g g) (1-b2)) + R(v b2))
    v = ts_round<H>(__fadd_rn(ts_round<H>(__fmul_rn(ts_round<H>(__fmul_rn(g, g)), c2)),
                              ts_round<H>(__fmul_rn(v, b2))));
    if (code & TS_OX_RSQRT) {
      // fp16, eps 0 in fp16: u = R(R(m / R(d1)) R(rsqrt(R(v / R(d2)))))
      const float h = ts_round<H>(xla_gpu_div(v, ts_round<H>(d2)));
      u = ts_round<H>(__fmul_rn(ts_round<H>(xla_gpu_div(m, ts_round<H>(d1))), ts_round<H>(xla_gpu_rsqrt(h))));
    } else if (code & TS_OX_NESTEROV) {
      // bf16: u = R(R(R(b1 R(m / d1n)) + R(1-b1 R(g / d1))) / R(R(sqrt(v / d2)) + eps))
      const float num = ts_round<H>(__fadd_rn(ts_round<H>(__fmul_rn(b1, ts_round<H>(xla_gpu_div(m, d1n)))),
                                              ts_round<H>(__fmul_rn(c1, ts_round<H>(xla_gpu_div(g, d1))))));
      u = ts_round<H>(
          xla_gpu_div(num, ts_round<H>(__fadd_rn(ts_round<H>(xla_gpu_sqrt(xla_gpu_div(v, d2))), eps))));
    } else {
      // bf16: u = R(m / R(R(d1) R(R(sqrt(v / d2)) + eps)))
      const float den = ts_round<H>(__fadd_rn(ts_round<H>(xla_gpu_sqrt(xla_gpu_div(v, d2))), eps));
      u = ts_round<H>(xla_gpu_div(m, ts_round<H>(__fmul_rn(ts_round<H>(d1), den))));
    }
    // u = R(u + R(wd p))
    u = ts_round<H>(__fadd_rn(u, ts_round<H>(__fmul_rn(p, wd))));
    // p = R(p + R(u (-lr)))
    p = ts_round<H>(__fadd_rn(p, ts_round<H>(__fmul_rn(u, nlr))));
    return;
  }
  // float32 lines. m = f(1-b1) * g + f(b1) * m; with OX_MU_BF16: f(b1) * m is B(m * B(b1))
  const float bm = (code & TS_OX_MU_BF16) ? ts_round<ts_bf16>(__fmul_rn(m, s[TS_S_BETA1_MU])) : __fmul_rn(b1, m);
  m = __fadd_rn(__fmul_rn(c1, g), bm);
  // v = f(1-b2) * (g * g) + f(b2) * v
  v = __fadd_rn(__fmul_rn(c2, __fmul_rn(g, g)), __fmul_rn(b2, v));
  // h = v / d2 + f(eps_root)      (eps_root 0: h's bits unchanged, v >= +0)
  const float h = __fadd_rn(xla_gpu_div(v, d2), s[TS_S_EPS_ROOT]);
  if (code & TS_OX_NESTEROV) {
    // u = (f(b1) * (m / d1n) + f(1-b1) * (g / d1)) / (sqrt(h) + f(eps))
    const float num = __fadd_rn(__fmul_rn(b1, xla_gpu_div(m, d1n)), __fmul_rn(c1, xla_gpu_div(g, d1)));
    u = xla_gpu_div(num, __fadd_rn(xla_gpu_sqrt(h), eps));
  } else if (code & TS_OX_RSQRT) {
    // eps == 0: u = (m / d1) * rsqrt(h)
    u = __fmul_rn(xla_gpu_div(m, d1), xla_gpu_rsqrt(h));
  } else {
    // u = m / (d1 * (sqrt(h) + f(eps)))       XLA folds (m/d1)/(...) into one divide
    u = xla_gpu_div(m, __fmul_rn(d1, __fadd_rn(xla_gpu_sqrt(h), eps)));
  }
  // u = u + f(wd) * p
  u = __fadd_rn(u, __fmul_rn(wd, p));
  // p = p + u * f(-lr)
  p = __fadd_rn(p, __fmul_rn(u, nlr));
}

// optax/cuda, one element: H, the 16-bit dtype of the lines (TS_OX_HALF's; bfloat16 for mu_dtype=bfloat16);
// CVT, how values are stored: false, the contract's conversions (float32 state, the fp32 master's rounding to
// fp16/bf16 weights); true, XLA:GPU's (cvt.rn, as torch's on CUDA: optax's own 16-bit state).
template <typename H, bool CVT>
struct TsOptaxT {
  static constexpr bool kTorchCvt = CVT;
  static constexpr bool kWritesGrad = false;
  static __device__ __forceinline__ void prepare(TsCtx&) {}

  template <typename G>
  static __device__ __forceinline__ void el(float& p, float& graw, float& m, float& v, float&, const bool,
                                            const TsCtx& c, const long long, float& u) {
    ts_optax_lines<H>(c.s.s, p, graw, m, v, u);
  }
};
typedef TsOptaxT<ts_bf16, false> TsOptax;  // float32 state
template <typename H>
using TsOptaxState = TsOptaxT<H, true>;  // optax's own state

// torch/cuda, one element: the contract's lines are TsOps' with fp32 state and TS_F_DECAY:
//   p1 = p * f(1 - lr*wd); m = fma(f(1-b1), g - m, m) (weight < 0.5) or fma(f(1-b1) - 1, g - m, g);
//   v = fma(f(1-b2), g * g, v * f(b2)); d = sqrt(v) / f(sqrt(bc2)) + f(eps); p = fma(f(-lr/bc1), m / d, p1)
typedef TsOps<float, false> TsTorchCuda;

#define TS_VARIANT_GRADS(VN, M, PN, P)                              \
  TS_KERNEL(adamw_##VN##_##PN##_f32, M, P, float, float, false)     \
  TS_KERNEL(adamw_##VN##_##PN##_f16, M, P, ts_f16, float, false)    \
  TS_KERNEL(adamw_##VN##_##PN##_bf16, M, P, ts_bf16, float, false)

#define TS_VARIANT(VN, M)                  \
  TS_VARIANT_GRADS(VN, M, f32, float)      \
  TS_VARIANT_GRADS(VN, M, f16, ts_f16)     \
  TS_VARIANT_GRADS(VN, M, bf16, ts_bf16)

TS_VARIANT(torch_cuda, TsTorchCuda)
TS_VARIANT(optax_cuda, TsOptax)

// adamw_u_optax_cuda_f32_<grad>: fp32 weights read from each item's `param`, u written to its `master` slot,
// the moments updated: the JAX adapter's `update`, whose program then scales u by the learning rate as optax.
TS_KERNEL(adamw_u_optax_cuda_f32_f32, TsOptax, float, float, float, true)
TS_KERNEL(adamw_u_optax_cuda_f32_f16, TsOptax, float, ts_f16, float, true)
TS_KERNEL(adamw_u_optax_cuda_f32_bf16, TsOptax, float, ts_bf16, float, true)

// adamw_[u_]optax_cuda_<p>_<g>_s<mu>_<nu>: optax's own state, no master (mu, nu: their storage): fp16/bf16 leaves
// with theirs, bf16 leaves with mu_dtype=float32, float32 leaves with mu_dtype=bfloat16; u (EMIT_U) in optax's
// update dtype (the leaf's for 16-bit state, else float32).
#define TS_OPTAX_STATE_GRADS(PN, P, MN, S, VN, SV, H)                                                       \
  TS_KERNEL_STATE(adamw_optax_cuda_##PN##_f32_s##MN##_##VN, TsOptaxState<H>, P, float, S, SV, false)      \
  TS_KERNEL_STATE(adamw_optax_cuda_##PN##_f16_s##MN##_##VN, TsOptaxState<H>, P, ts_f16, S, SV, false)     \
  TS_KERNEL_STATE(adamw_optax_cuda_##PN##_bf16_s##MN##_##VN, TsOptaxState<H>, P, ts_bf16, S, SV, false)   \
  TS_KERNEL_STATE(adamw_u_optax_cuda_##PN##_f32_s##MN##_##VN, TsOptaxState<H>, P, float, S, SV, true)     \
  TS_KERNEL_STATE(adamw_u_optax_cuda_##PN##_f16_s##MN##_##VN, TsOptaxState<H>, P, ts_f16, S, SV, true)    \
  TS_KERNEL_STATE(adamw_u_optax_cuda_##PN##_bf16_s##MN##_##VN, TsOptaxState<H>, P, ts_bf16, S, SV, true)

TS_OPTAX_STATE_GRADS(f16, ts_f16, f16, ts_f16, f16, ts_f16, ts_f16)
TS_OPTAX_STATE_GRADS(bf16, ts_bf16, bf16, ts_bf16, bf16, ts_bf16, ts_bf16)
TS_OPTAX_STATE_GRADS(bf16, ts_bf16, f32, float, bf16, ts_bf16, ts_bf16)
TS_OPTAX_STATE_GRADS(f32, float, bf16, ts_bf16, f32, float, ts_bf16)
