// TrainStream's AdamW on the GPU, part 3 of 4 (after adamw_body.cu): torch.optim.AdamW / Adam as torch 2.11
// computes them on CUDA, one arithmetic per implementation (trainstream.contract.TorchRecipe.impl), for every
// weight dtype, with the state in the weights' dtype (torch's own scheme) or fp32 (master_weights=True):
//
//   adamw_torch_ops_<p>_<g>_<s>    foreach (torch's CUDA default) and single-tensor (foreach=False, or a
//                                  Tensor lr): one kernel per tensor op in torch, each result rounded to the
//                                  state dtype; TS_F_SINGLE selects the single-tensor division
//   adamw_torch_fused_<p>_<g>_<s>  fused=True: float math on the unrounded values, each state rounded once
//
// <p>, <g>: weights, gradient in {f32, f16, bf16}; <s>: state, f32 or <p> (16-bit weights with f32 state have
// an fp32 master). Sources: torch 2.11.0+cu130 (git 70d99e99, the GPU image's), its sm_90 SASS read with
// cuobjdump/nvdisasm (libtorch_cuda.so: FusedAdamMathFunctor, the foreach functors, lerp/addcmul/addcdiv),
// its host code (div_true_kernel_cuda) with objdump, and fused_adam_utils.cuh (ATen, the opmath version).

// ---- op by op: torch/optim/adam.py's _multi_tensor_adam (foreach) and _single_tensor_adam ----------------------
// D: the state dtype, to which every op's result is rounded (fp32: no rounding). ROUND_G: the gradient times
// S_CLIP rounded to its dtype, as torch's in-place multiplications of param.grad round it (false: the
// contract's torch/cuda kernels, adamw_variants.cu, which leave it unrounded).
template <typename D, bool ROUND_G>
struct TsOps {
  static constexpr bool kTorchCvt = ROUND_G;
  static constexpr bool kWritesGrad = false;
  static __device__ __forceinline__ void prepare(TsCtx&) {}

  template <typename G>
  static __device__ __forceinline__ void el(float& p, float& graw, float& m, float& v, float& x, const bool ams,
                                            const TsCtx& c, const long long, float&) {
    const float* s = c.s.s;
    // g = r(g * c): clip_grad_norm_/GradScaler.unscale_ on param.grad; maximize is c < 0 (exact)
    float g = __fmul_rn(graw, s[TS_S_CLIP]);
    if (ROUND_G) g = ts_round<G>(g);
    // Adam: g = r(fma(f(wd), p, g))            foreach: _foreach_add(grads, params, alpha=wd); single: grad.add
    if (c.flags & TS_F_L2) g = ts_round<D>(__fmaf_rn(s[TS_S_L2], p, g));
    // AdamW: p1 = r(p * f(1 - lr*wd))         _foreach_mul_ / param.mul_ by a host scalar
    const float p1 = (c.flags & TS_F_DECAY) ? ts_round<D>(__fmul_rn(p, s[TS_S_DECAY])) : p;
    // m = r(lerp(m, g, w)), w = f(1-b1):      fma(w, g - m, m) for |w| < 0.5, else fma(w - 1, g - m, g)
    const float diff = __fsub_rn(g, m);
    if (s[TS_S_LERP_SMALL] != 0.0f) m = ts_round<D>(__fmaf_rn(s[TS_S_OMB1], diff, m));
    else m = ts_round<D>(__fmaf_rn(__fsub_rn(s[TS_S_OMB1], 1.0f), diff, g));
    // v = r(fma(f(1-b2), g*g, r(v * f(b2))))   mul_(b2), then addcmul_(g, g, value=1-b2)
    v = ts_round<D>(__fmaf_rn(s[TS_S_OMB2], __fmul_rn(g, g), ts_round<D>(__fmul_rn(v, s[TS_S_BETA2]))));
    float src = v;
    if (ams) {  // vmax = maximum(vmax, v), NaN-propagating (_foreach_maximum_ / torch.maximum)
      x = (x != x || x > v) ? x : v;
      src = x;
    }
    const float q = ts_round<D>(__fsqrt_rn(src));  // _foreach_sqrt / sqrt: IEEE
    // d1 = r(q / f(sqrt(bc2)))                 foreach: _foreach_div_ by a scalar list, a true division
    // d1 = r(q * f(1 / sqrt(bc2)))             single: tensor / host scalar = times the reciprocal, which
    //                                            div_true_kernel_cuda forms in double and casts to float
    const float d1 = (c.flags & TS_F_SINGLE) ? ts_round<D>(__fmul_rn(q, s[TS_S_INV_SQRT_BC2]))
                                             : ts_round<D>(__fdiv_rn(q, s[TS_S_SQRT_BC2]));
    const float d = ts_round<D>(__fadd_rn(d1, s[TS_S_EPS]));  // add_(eps): f(eps), never cast to the dtype
    // p = r(fma(f(-lr/bc1), m / d, p1))       addcdiv_(m, d, value=-step_size)
    p = ts_round<D>(__fmaf_rn(s[TS_S_NEG_STEP], __fdiv_rn(m, d), p1));
  }
};

// ---- fused: ATen's FusedAdamMathFunctor / adam_math ------------------------------------------------------------
// Scalars in float: LR = f(lr) (= -S_NEG_LR; a Tensor lr's float32 value), B1, B2, EPS, WD = S_L2, the float32
// step t = S_STEP after its increment; the bias corrections on the device with its powf, as torch's kernel.
//
// Adam's L2 line `grad += param * weight_decay` is not always one FMA in torch 2.11's compiled kernel (SASS of
// FusedAdamMathFunctor<T, 4, ORIGINAL, amsgrad=false>, T = float, Half, BFloat16, both of its paths): without
// a grad_scale, nvcc hoisted the product of the unrolled loop's first element (ii = 0) above the maximize
// branch, so that element is RN(g + RN(p*wd)), and with maximize every element is (a select between p*wd and
// -0 blocks the contraction); ii = 1..3 without maximize, every element with a grad_scale, and every element
// of the amsgrad instantiations are fma(p, wd, g). ii is the element's position in torch's 4-wide register
// array: i % 4 on the vector path (numel % 4 == 0 and every tensor 4-element aligned, TS_F_TORCH_VEC), else
// (i / 512) % 4 (kBlockSize 512, kILP 4; chunks of 65536 are multiples of 2048). AdamW's decay line and the
// moments are FMAs everywhere.
struct TsFused {
  static constexpr bool kTorchCvt = true;
  static constexpr bool kWritesGrad = true;
  static __device__ __forceinline__ void prepare(TsCtx& c) {
    const float t = c.s.s[TS_S_STEP];
    c.bc1 = __fsub_rn(1.0f, powf(c.s.s[TS_S_BETA1], t));              // 1 - pow_(beta1, step)
    c.bc2s = __fsqrt_rn(__fsub_rn(1.0f, powf(c.s.s[TS_S_BETA2], t)));  // std::sqrt(1 - pow_(beta2, step))
    c.ss = __fdiv_rn(-c.s.s[TS_S_NEG_LR], c.bc1);                      // step_size = lr / bias_correction1
  }

  template <typename G>
  static __device__ __forceinline__ void el(float& p, float& graw, float& m, float& v, float& x, const bool ams,
                                            const TsCtx& c, const long long idx, float&) {
    const float* s = c.s.s;
    const int f = c.flags;
    float g = graw;
    if (f & TS_F_GRAD_SCALE) {
      g = __fdiv_rn(g, s[TS_S_GRAD_DIV]);  // grad /= *grad_scale_ptr
      graw = g;                            // grad_to_store, written back (before maximize)
    }
    g = __fmul_rn(g, s[TS_S_CLIP]);  // maximize: c = -1 (exact); a clip on param.grad (c != +-1, no grad_scale)
    if (!(f & TS_F_GRAD_SCALE)) g = ts_round<G>(g);  // is rounded to its dtype, as TsOps; g / scale is not
    if (f & TS_F_L2) {
      const int ii = (f & TS_F_TORCH_VEC) ? (int)(idx & 3) : (int)((idx >> 9) & 3);
      if (!ams && !(f & TS_F_GRAD_SCALE) && ((f & TS_F_MAXIMIZE) || ii == 0))
        g = __fadd_rn(g, __fmul_rn(p, s[TS_S_L2]));  // RN(g + RN(p*wd)): see above
      else
        g = __fmaf_rn(p, s[TS_S_L2], g);  // grad += param * weight_decay, contracted
    }
    if (f & TS_F_DECAY) p = __fmaf_rn(s[TS_S_NEG_LR_WD], p, p);  // param -= lr*wd*param: fma(-RN(lr*wd), p, p)
    const float b1 = s[TS_S_BETA1], b2 = s[TS_S_BETA2];
    m = __fmaf_rn(b1, m, __fmaf_rn(-b1, g, g));  // std::fma(beta1, exp_avg, std::fma(-beta1, grad, grad))
    const float gg = __fmul_rn(g, g);
    v = __fmaf_rn(b2, v, __fmaf_rn(-b2, gg, gg));
    float src = v;
    if (ams) {  // std::max(max_exp_avg_sq, exp_avg_sq) = (vmax < v) ? v : vmax
      x = (x < v) ? v : x;
      src = x;
    }
    const float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(src), c.bc2s), s[TS_S_EPS]);
    p = __fsub_rn(p, __fdiv_rn(__fmul_rn(c.ss, m), d));  // param -= step_size * exp_avg / denom
  }
};

// adamw_torch_<impl>_<p>_<g>_<s>, 2 x 5 x 3 = 30 kernels
typedef TsOps<float, true> TsOpsF32;
typedef TsOps<ts_f16, true> TsOpsF16;
typedef TsOps<ts_bf16, true> TsOpsBF16;

#define TS_TORCH_GRADS(IMPL, OPS, PN, P, SN, S)                             \
  TS_KERNEL(adamw_torch_##IMPL##_##PN##_f32_##SN, OPS, P, float, S, false)  \
  TS_KERNEL(adamw_torch_##IMPL##_##PN##_f16_##SN, OPS, P, ts_f16, S, false) \
  TS_KERNEL(adamw_torch_##IMPL##_##PN##_bf16_##SN, OPS, P, ts_bf16, S, false)

#define TS_TORCH_IMPL(IMPL, M32, M16, MB16)              \
  TS_TORCH_GRADS(IMPL, M32, f32, float, f32, float)      \
  TS_TORCH_GRADS(IMPL, M16, f16, ts_f16, f16, ts_f16)    \
  TS_TORCH_GRADS(IMPL, MB16, bf16, ts_bf16, bf16, ts_bf16) \
  TS_TORCH_GRADS(IMPL, M32, f16, ts_f16, f32, float)     \
  TS_TORCH_GRADS(IMPL, M32, bf16, ts_bf16, f32, float)

TS_TORCH_IMPL(ops, TsOpsF32, TsOpsF16, TsOpsBF16)
TS_TORCH_IMPL(fused, TsFused, TsFused, TsFused)

// adamw_torch_fused_bias_corrections: out[3k..3k+2] = (1 - b1^t, sqrt(1 - b2^t), lr / (1 - b1^t)) for
// t = steps[k], as the fused kernels form them (TsFused::prepare): the GPU tests compare them with torch.pow.
extern "C" __global__ void adamw_torch_fused_bias_corrections(const float b1, const float b2, const float lr,
                                                              const float* steps, float* out, const int n) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= n) return;
  TsCtx c;
  c.s.s[TS_S_STEP] = steps[k];
  c.s.s[TS_S_BETA1] = b1;
  c.s.s[TS_S_BETA2] = b2;
  c.s.s[TS_S_NEG_LR] = -lr;
  TsFused::prepare(c);
  out[3 * k] = c.bc1;
  out[3 * k + 1] = c.bc2s;
  out[3 * k + 2] = c.ss;
}
