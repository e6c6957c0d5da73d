// TrainStream's AdamW on the GPU: the `gpu` mode update of up to TS_MULTI_MAX tensors per
// launch (a single tensor is a launch of one). Shipped in the wheel as package data,
// trainstream/kernels/adamw.cu (pyproject.toml maps this folder there).
//
//   weights   GPU memory, updated in place: fp32, fp16 or bf16
//   gradient  GPU memory, read once: fp32, fp16 or bf16
//   m, v      fp32 exp_avg / exp_avg_sq: mapped pinned host memory (device pointers to
//             host memory, each element read once and written once over PCIe: zero-copy),
//             or GPU memory (the staging ring's copy, or state kept resident there)
//   master    fp32 master weights, in either memory too, for fp16/bf16 weights only;
//             fp32 weights are their own master (pass nullptr)
//
// The arithmetic is the AdamW contract (trainstream.contract) on the cuda platform, one
// branch per convention: torch/cuda and optax/cuda, the variants the library launches (the
// cpu platforms' arithmetic is the host kernels'). Each line of maths below quotes the
// contract line it implements. Rounding is explicit: every float operation is an _rn
// intrinsic, fused (__fmaf_rn) exactly where the contract writes fma(), so the bits do not
// depend on nvcc/NVRTC contraction (-fmad). The loader also pins --ftz=false, which the _rn
// intrinsics do obey.
//
// Kernels: adamw_<variant>_<param>_<grad>, e.g. adamw_torch_cuda_bf16_f32,
// with <variant> in {torch_cuda, optax_cuda} and <param>, <grad> in
// {f32, f16, bf16}, each taking a TsMultiBatch (see the end). Launch with blockDim.x ==
// TS_ADAMW_THREADS and a grid of the sum of the tensors' nblocks (a larger one is
// harmless, a smaller one leaves the last tensors out).
//
// No #include: compiled by NVRTC through CuPy (trainstream/_device_kernels.py).

#define TS_ADAMW_THREADS 256

// ---- the per-step float32 scalar vector: indices are trainstream.contract.S_* ----
// (trainstream/_device_kernels.py checks these against the contract when it loads this file)
#define TS_N_SCALARS 16
#define TS_S_CLIP 0
#define TS_S_OMB1 1
#define TS_S_BETA2 2
#define TS_S_OMB2 3
#define TS_S_EPS 4
#define TS_S_DECAY 5
#define TS_S_LERP_SMALL 6
#define TS_S_SQRT_BC2 7
#define TS_S_NEG_STEP 8
#define TS_S_BETA1 9
#define TS_S_BC1 10
#define TS_S_BC2_OPTAX 11
#define TS_S_WD 12
#define TS_S_NEG_LR 13
#define TS_S_CLIP_DIV 14
#define TS_S_OX_CODE 15

// ---- the optax code's bit that optax/cuda reads (scalars[TS_S_OX_CODE]): trainstream.contract.OX_CLIP ----
#define TS_OX_CLIP 8

// ---- the kernel variants: trainstream.contract.VARIANT_TORCH_CUDA, VARIANT_OPTAX_CUDA ----
#define TS_VARIANT_TORCH_CUDA 1
#define TS_VARIANT_OPTAX_CUDA 3

// The scalar vector, passed by value (64 bytes of kernel parameters).
struct TsScalars {
  float s[TS_N_SCALARS];
};

// 16-bit storage types, as raw bits (no cuda_fp16.h / cuda_bf16.h needed).
struct ts_f16 {
  unsigned short bits;
};
struct ts_bf16 {
  unsigned short bits;
};

// ------------------------------------------------------------------------------------------
// optax/cuda: XLA:GPU's square root and division (torch/cuda's are the IEEE _rn ones)
// ------------------------------------------------------------------------------------------

// optax/cuda: XLA:GPU calls libdevice __nv_sqrtf with __CUDA_PREC_SQRT unset and
// __CUDA_FTZ = xla_gpu_ftz = false, i.e. the approximate square root without .ftz.
__device__ __forceinline__ float xla_gpu_sqrt(float x) {
  float r;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// optax/cuda: XLA:GPU runs LLVM's NVPTX backend with -nvptx-prec-divf32=1, which
// lowers every f32 division to div.full.f32 (full-range approximation, <= 2 ulp), not
// to the IEEE div.rn.f32.
__device__ __forceinline__ float xla_gpu_div(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ------------------------------------------------------------------------------------------
// Storage conversions (all exact except the final rounding of the weights)
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ float ts_to_f32(float x) { return x; }
// bf16 -> f32: the bits are the high half of the float (exact)
__device__ __forceinline__ float ts_to_f32(ts_bf16 x) {
  return __uint_as_float(((unsigned int)x.bits) << 16);
}
// f16 -> f32: exact
__device__ __forceinline__ float ts_to_f32(ts_f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <typename T>
__device__ __forceinline__ T ts_from_f32(float x);

template <>
__device__ __forceinline__ float ts_from_f32<float>(float x) {
  return x;
}
// f32 -> bf16: round to nearest even, NaN -> 0x7FC0 (contract.f32_to_bf16_bits, c10::BFloat16)
template <>
__device__ __forceinline__ ts_bf16 ts_from_f32<ts_bf16>(float x) {
  const unsigned int u = __float_as_uint(x);
  ts_bf16 r;
  r.bits = (x != x) ? (unsigned short)0x7FC0u
                    : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return r;
}
// f32 -> f16: round to nearest even, overflow to Inf (numpy's astype(float16))
template <>
__device__ __forceinline__ ts_f16 ts_from_f32<ts_f16>(float x) {
  ts_f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

// 4 consecutive elements as one 16-byte (fp32) or 8-byte (fp16/bf16) access.
__device__ __forceinline__ void ts_load4(const float* p, float out[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  out[0] = q.x;
  out[1] = q.y;
  out[2] = q.z;
  out[3] = q.w;
}
template <typename H>
__device__ __forceinline__ void ts_load4(const H* p, float out[4]) {
  const ushort4 q = *reinterpret_cast<const ushort4*>(p);
  H h;
  h.bits = q.x;
  out[0] = ts_to_f32(h);
  h.bits = q.y;
  out[1] = ts_to_f32(h);
  h.bits = q.z;
  out[2] = ts_to_f32(h);
  h.bits = q.w;
  out[3] = ts_to_f32(h);
}
__device__ __forceinline__ void ts_store4(float* p, const float in[4]) {
  float4 q;
  q.x = in[0];
  q.y = in[1];
  q.z = in[2];
  q.w = in[3];
  *reinterpret_cast<float4*>(p) = q;
}
template <typename H>
__device__ __forceinline__ void ts_store4(H* p, const float in[4]) {
  ushort4 q;
  q.x = ts_from_f32<H>(in[0]).bits;
  q.y = ts_from_f32<H>(in[1]).bits;
  q.z = ts_from_f32<H>(in[2]).bits;
  q.w = ts_from_f32<H>(in[3]).bits;
  *reinterpret_cast<ushort4*>(p) = q;
}

__device__ __forceinline__ bool ts_aligned(const void* p, unsigned long long bytes) {
  return ((unsigned long long)p) % bytes == 0ull;
}

// The gradient as the update reads it. optax/cuda with OX_CLIP:
//   g = RN(xla_div(g, s[S_CLIP_DIV]) * c)
// else g = g * c. c is s[S_CLIP], or the device clip coefficient.
template <int VARIANT>
__device__ __forceinline__ float ts_grad_in(const float graw, const float c, const TsScalars& s) {
  if (VARIANT == TS_VARIANT_OPTAX_CUDA && (((int)s.s[TS_S_OX_CODE]) & TS_OX_CLIP)) {
    // optax/cuda, optax.clip_by_global_norm: g = RN(xla_div(g, norm) * max_norm)
    return __fmul_rn(xla_gpu_div(graw, s.s[TS_S_CLIP_DIV]), c);
  }
  return __fmul_rn(graw, c);
}

// ------------------------------------------------------------------------------------------
// One element of AdamW: the contract, line by line
// ------------------------------------------------------------------------------------------

// p: fp32 master weight, m, v: moments (all updated in place), g: fp32 gradient as
// ts_grad_in returned it (clipped). u: optax's update before the learning rate (`u` of the
// contract; torch leaves it unset).
template <int VARIANT>
__device__ __forceinline__ void ts_adamw_math(float& p, float& m, float& v, const float g,
                                              const TsScalars& s, float& u) {
  if (VARIANT == TS_VARIANT_TORCH_CUDA) {
    // p1 = p * f(1 - lr*wd)
    const float p1 = __fmul_rn(p, s.s[TS_S_DECAY]);
    // g - m   (lerp: end - self)
    const float diff = __fsub_rn(g, m);
    if (s.s[TS_S_LERP_SMALL] != 0.0f) {
      // m = fma(f(1-b1), g - m, m)            lerp, weight < 0.5
      m = __fmaf_rn(s.s[TS_S_OMB1], diff, m);
    } else {
      // m = fma(f(1-b1) - 1, g - m, g)        lerp, weight >= 0.5
      m = __fmaf_rn(__fsub_rn(s.s[TS_S_OMB1], 1.0f), diff, g);
    }
    // v = fma(f(1-b2), g * g, v * f(b2))
    v = __fmaf_rn(s.s[TS_S_OMB2], __fmul_rn(g, g), __fmul_rn(v, s.s[TS_S_BETA2]));
    // d = sqrt(v) / f(sqrt(bc2)) + f(eps)       (_foreach_div_ by a scalar list: true division)
    const float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.s[TS_S_SQRT_BC2]), s.s[TS_S_EPS]);
    // p = fma(f(-lr/bc1), m / d, p1)
    p = __fmaf_rn(s.s[TS_S_NEG_STEP], __fdiv_rn(m, d), p1);
  } else {  // optax/cuda
    // m = f(1-b1) * g + f(b1) * m
    m = __fadd_rn(__fmul_rn(s.s[TS_S_OMB1], g), __fmul_rn(s.s[TS_S_BETA1], m));
    // v = f(1-b2) * (g * g) + f(b2) * v
    v = __fadd_rn(__fmul_rn(s.s[TS_S_OMB2], __fmul_rn(g, g)), __fmul_rn(s.s[TS_S_BETA2], v));
    // u = m / (bc1 * (sqrt(v / bc2) + f(eps)))       XLA:GPU sqrt and division
    u = xla_gpu_div(m, __fmul_rn(s.s[TS_S_BC1],
                                       __fadd_rn(xla_gpu_sqrt(xla_gpu_div(v, s.s[TS_S_BC2_OPTAX])),
                                                 s.s[TS_S_EPS])));
    // u = u + f(wd) * p
    u = __fadd_rn(u, __fmul_rn(s.s[TS_S_WD], p));
    // p = p + u * f(-lr)
    p = __fadd_rn(p, __fmul_rn(u, s.s[TS_S_NEG_LR]));
  }
}

// ------------------------------------------------------------------------------------------
// The kernel body
// ------------------------------------------------------------------------------------------

// P: weight storage type (float, ts_f16, ts_bf16); G: gradient storage type.
// For fp32 weights `param` holds the master weights and `master` is unused, except with
// EMIT_U (optax, fp32 weights only: the JAX adapter's `update`): then `param` is
// read, not written, and `master` receives u, the update before the learning rate.
template <int VARIANT, typename P, typename G, bool EMIT_U = false>
__device__ __forceinline__ void ts_adamw_tensor(P* __restrict__ param,
                                                   const G* __restrict__ grad,
                                                   float* __restrict__ master,
                                                   float* __restrict__ m,
                                                   float* __restrict__ v, const long long n,
                                                   const TsScalars& scalars,
                                                   const float* __restrict__ scalars_dev,
                                                   const long long block, const long long nblocks) {
  constexpr bool kOwnMaster = sizeof(P) == sizeof(float);  // fp32 weights are the master
  // the per-step scalars: by value, or from device memory when a pointer is given (JAX)
  TsScalars s = scalars;
  if (scalars_dev != nullptr) {
#pragma unroll
    for (int k = 0; k < TS_N_SCALARS; ++k) s.s[k] = scalars_dev[k];
  }
  // c: the gradient's multiplier (1.0, or a coefficient the framework computed)
  const float c = s.s[TS_S_CLIP];

  // Vector path: `head` scalar elements bring m to a 16-byte boundary; the body runs in
  // groups of 4 if every array is then aligned for its 4-wide access, else everything
  // goes through the scalar path (head = n). m is a float*, so 4-byte aligned.
  long long head = (long long)(((16ull - ((unsigned long long)m & 15ull)) & 15ull) >> 2);
  if (head > n) head = n;
  const bool vec = ts_aligned(m + head, 16) && ts_aligned(v + head, 16) &&
                   ((kOwnMaster && !EMIT_U) || ts_aligned(master + head, 16)) &&
                   ts_aligned(param + head, 4 * sizeof(P)) &&
                   ts_aligned(grad + head, 4 * sizeof(G));
  if (!vec) head = n;
  const long long nvec = (n - head) >> 2;  // groups of 4 in the body
  const long long tail = head + (nvec << 2);  // first element of the scalar tail

  // grid-stride over this tensor's `nblocks` blocks (the whole grid, or a multi-tensor
  // launch's share of it); the bits do not depend on the grid
  const long long tid = block * blockDim.x + threadIdx.x;
  const long long nthreads = nblocks * blockDim.x;

  // scalar head (and the whole tensor when the arrays are not mutually aligned)
  for (long long i = tid; i < head; i += nthreads) {
    float p;
    if (kOwnMaster) p = ts_to_f32(param[i]);
    else p = master[i];
    float mi = m[i];
    float vi = v[i];
    // g = g * c (optax with OX_CLIP: see ts_grad_in)
    const float g = ts_grad_in<VARIANT>(ts_to_f32(grad[i]), c, s);
    float u;
    ts_adamw_math<VARIANT>(p, mi, vi, g, s, u);
    m[i] = mi;
    v[i] = vi;
    if (EMIT_U) {
      master[i] = u;
    } else {
      if (!kOwnMaster) master[i] = p;
      param[i] = ts_from_f32<P>(p);
    }
  }

  // vector body: every PCIe access 16 bytes wide
  for (long long k = tid; k < nvec; k += nthreads) {
    const long long i = head + (k << 2);
    float p[4], mi[4], vi[4], g[4], u[4];
    ts_load4(m + i, mi);
    ts_load4(v + i, vi);
    if (kOwnMaster) ts_load4(param + i, p);
    else ts_load4(master + i, p);
    ts_load4(grad + i, g);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // g = g * c (optax with OX_CLIP: see ts_grad_in)
      g[j] = ts_grad_in<VARIANT>(g[j], c, s);
      ts_adamw_math<VARIANT>(p[j], mi[j], vi[j], g[j], s, u[j]);
    }
    ts_store4(m + i, mi);
    ts_store4(v + i, vi);
    if (EMIT_U) {
      ts_store4(master + i, u);
    } else {
      if (!kOwnMaster) ts_store4(master + i, p);
      ts_store4(param + i, p);
    }
  }

  // scalar tail: the last (n - head) % 4 elements
  for (long long i = tail + tid; i < n; i += nthreads) {
    float p;
    if (kOwnMaster) p = ts_to_f32(param[i]);
    else p = master[i];
    float mi = m[i];
    float vi = v[i];
    // g = g * c (optax with OX_CLIP: see ts_grad_in)
    const float g = ts_grad_in<VARIANT>(ts_to_f32(grad[i]), c, s);
    float u;
    ts_adamw_math<VARIANT>(p, mi, vi, g, s, u);
    m[i] = mi;
    v[i] = vi;
    if (EMIT_U) {
      master[i] = u;
    } else {
      if (!kOwnMaster) master[i] = p;
      param[i] = ts_from_f32<P>(p);
    }
  }
}

// ------------------------------------------------------------------------------------------
// The launch: up to TS_MULTI_MAX tensors of one (weight, gradient) type pair, their
// descriptors passed by value (exactly the 4 KiB kernel-parameter limit of every driver).
// Tensor k owns blocks [block_start, block_start + nblocks) of the grid and grid-strides over
// them: the bits do not depend on nblocks. extern "C" entry points: 2 variants x 3 weight x 3
// gradient types, and optax's u for 3 gradient types (below).
// ------------------------------------------------------------------------------------------

#define TS_MULTI_MAX 32
// block_start of the unused items after the last tensor: above every block index
#define TS_UNUSED_BLOCK 2147483647

struct TsMultiItem {      // 128 bytes; trainstream/_device_kernels.py mirrors it (_MultiItem)
  void* param;            // weights, GPU memory (P*)
  const void* grad;       // gradient, GPU memory (G*)
  float* master;          // fp32 master (mapped host memory); nullptr for fp32 weights
  float* m;               // exp_avg (mapped host memory)
  float* v;               // exp_avg_sq (mapped host memory)
  long long n;            // elements
  int block_start;        // first block of the grid that is this tensor's (unused: TS_UNUSED_BLOCK)
  int nblocks;            // blocks that are this tensor's (> 0; unused: 0)
  TsScalars scalars;      // this tensor's step scalars (its own step count and lr), or
  const float* scalars_dev;  // the same TS_N_SCALARS floats in device memory (nullptr: by value; JAX)
};

struct TsMultiBatch {  // 4096 bytes
  TsMultiItem items[TS_MULTI_MAX];  // the tensors by increasing block_start, then the unused items
};

template <int VARIANT, typename P, typename G, bool EMIT_U = false>
__device__ __forceinline__ void ts_adamw_multi(const TsMultiBatch& batch) {
  // the tensor that owns this block: the last item whose block_start <= blockIdx.x (never an
  // unused one: TS_UNUSED_BLOCK is above every block index)
  int lo = 0, hi = TS_MULTI_MAX - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if ((long long)batch.items[mid].block_start <= (long long)blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const TsMultiItem& t = batch.items[lo];
  const long long block = (long long)blockIdx.x - t.block_start;
  if (block < 0 || block >= t.nblocks) return;  // bounds check: a grid larger than the table
  ts_adamw_tensor<VARIANT, P, G, EMIT_U>(static_cast<P*>(t.param), static_cast<const G*>(t.grad),
                                    t.master, t.m, t.v, t.n, t.scalars, t.scalars_dev, block,
                                    t.nblocks);
}

#define TS_DEFINE_ADAMW(VNAME, VARIANT, PNAME, P, GNAME, G)                               \
  extern "C" __global__ void __launch_bounds__(TS_ADAMW_THREADS)                              \
      adamw_##VNAME##_##PNAME##_##GNAME(                                                      \
          const TsMultiBatch batch) {                                                         \
    ts_adamw_multi<VARIANT, P, G>(batch);                                                     \
  }

#define TS_DEFINE_ADAMW_GRADS(VNAME, VARIANT, PNAME, P)         \
  TS_DEFINE_ADAMW(VNAME, VARIANT, PNAME, P, f32, float)   \
  TS_DEFINE_ADAMW(VNAME, VARIANT, PNAME, P, f16, ts_f16)  \
  TS_DEFINE_ADAMW(VNAME, VARIANT, PNAME, P, bf16, ts_bf16)

#define TS_DEFINE_ADAMW_VARIANT(VNAME, VARIANT)              \
  TS_DEFINE_ADAMW_GRADS(VNAME, VARIANT, f32, float)          \
  TS_DEFINE_ADAMW_GRADS(VNAME, VARIANT, f16, ts_f16)         \
  TS_DEFINE_ADAMW_GRADS(VNAME, VARIANT, bf16, ts_bf16)

TS_DEFINE_ADAMW_VARIANT(torch_cuda, TS_VARIANT_TORCH_CUDA)
TS_DEFINE_ADAMW_VARIANT(optax_cuda, TS_VARIANT_OPTAX_CUDA)

// adamw_u_optax_cuda_f32_<grad>: the same batch, fp32 weights read
// from each item's `param`, u (the update before the learning rate) written to its `master`
// slot, the moments updated: the JAX adapter's `update`, whose program then scales u by the
// learning rate as optax does.
#define TS_DEFINE_ADAMW_U(VNAME, VARIANT, GNAME, G)                                            \
  extern "C" __global__ void __launch_bounds__(TS_ADAMW_THREADS)                              \
      adamw_u_##VNAME##_f32_##GNAME(                                                          \
          const TsMultiBatch batch) {                                                         \
    ts_adamw_multi<VARIANT, float, G, true>(batch);                                           \
  }

TS_DEFINE_ADAMW_U(optax_cuda, TS_VARIANT_OPTAX_CUDA, f32, float)
TS_DEFINE_ADAMW_U(optax_cuda, TS_VARIANT_OPTAX_CUDA, f16, ts_f16)
TS_DEFINE_ADAMW_U(optax_cuda, TS_VARIANT_OPTAX_CUDA, bf16, ts_bf16)
