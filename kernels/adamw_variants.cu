// TrainStream's AdamW on the GPU, part 4 of 4 (after adamw_torch.cu): the contract's conventions on the cuda
// platform, with fp32 state (and an fp32 master for 16-bit weights): each line of maths quotes the contract
// (trainstream.contract) line it implements.
//
//   adamw_torch_cuda_<p>_<g>      torch/cuda: torch's foreach arithmetic on the fp32 master (TsOps of
//                                 adamw_torch.cu with fp32 state, decay always applied, the gradient times
//                                 S_CLIP unrounded; the launcher sets TS_F_DECAY)
//   adamw_optax_cuda_<p>_<g>      optax/cuda: XLA:GPU's square root and division
//   adamw_u_optax_cuda_f32_<g>    the same on fp32 weights (read only), writing u (the JAX adapter's update)
// <p>, <g> in {f32, f16, bf16}: 9 + 9 + 3 kernels.

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

// optax/cuda, one element (u: the update before the learning rate).
struct TsOptax {
  static constexpr bool kTorchCvt = false;
  static constexpr bool kWritesGrad = false;
  static __device__ __forceinline__ void prepare(TsCtx&) {}

  template <typename G>
  static __device__ __forceinline__ void el(float& p, float& graw, float& m, float& v, float&, const bool,
                                            const TsCtx& c, const long long, float& u) {
    const float* s = c.s.s;
    // g = g * c; with OX_CLIP (optax.clip_by_global_norm): g = RN(xla_div(g, norm) * max_norm)
    const float g = (((int)s[TS_S_OX_CODE]) & TS_OX_CLIP)
                        ? __fmul_rn(xla_gpu_div(graw, s[TS_S_CLIP_DIV]), s[TS_S_CLIP])
                        : __fmul_rn(graw, s[TS_S_CLIP]);
    // m = f(1-b1) * g + f(b1) * m
    m = __fadd_rn(__fmul_rn(s[TS_S_OMB1], g), __fmul_rn(s[TS_S_BETA1], m));
    // v = f(1-b2) * (g * g) + f(b2) * v
    v = __fadd_rn(__fmul_rn(s[TS_S_OMB2], __fmul_rn(g, g)), __fmul_rn(s[TS_S_BETA2], v));
    // u = m / (bc1 * (sqrt(v / bc2) + f(eps)))       XLA:GPU sqrt and division
    u = xla_gpu_div(
        m, __fmul_rn(s[TS_S_BC1], __fadd_rn(xla_gpu_sqrt(xla_gpu_div(v, s[TS_S_BC2_OPTAX])), s[TS_S_EPS])));
    // u = u + f(wd) * p
    u = __fadd_rn(u, __fmul_rn(s[TS_S_WD], p));
    // p = p + u * f(-lr)
    p = __fadd_rn(p, __fmul_rn(u, s[TS_S_NEG_LR]));
  }
};

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
