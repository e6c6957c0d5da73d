// TrainStream's AdamW on the GPU, part 1 of 4: the constants, the launch layout and the storage helpers.
// trainstream/_device_kernels.py compiles the four parts as one NVRTC program, in this order:
//   adamw.cu          constants (one block, checked against trainstream.contract), layout, conversions
//   adamw_body.cu     one tensor's element loop (scalar head, 4-wide body, scalar tail) and the launch
//   adamw_variants.cu the contract's conventions: torch/cuda (fp32 state) and optax/cuda (+ optax's u)
//   adamw_torch.cu    torch's CUDA recipes: op-by-op (foreach, single-tensor) and fused, any state dtype
// Shipped in the wheel as package data, trainstream/kernels/*.cu (pyproject.toml maps this folder there).
//
//   weights   GPU memory, updated in place: fp32, fp16 or bf16
//   gradient  GPU memory, read (fused with GradScaler: written back unscaled): fp32, fp16 or bf16
//   m, v      exp_avg / exp_avg_sq (+ max_exp_avg_sq with amsgrad): fp32, or the weights' 16-bit dtype;
//             mapped pinned host memory (zero-copy: each element read and written once over PCIe), or
//             GPU memory (the staging ring's copy, or state kept resident there)
//   master    fp32 master weights of fp16/bf16 weights with fp32 state (master_weights=True); else unused
//
// Rounding is explicit: every float operation is an _rn intrinsic, fused (__fmaf_rn) exactly where the
// reference fuses, so the bits do not depend on nvcc/NVRTC contraction (-fmad); the loader pins --ftz=false.
// No #include: compiled by NVRTC through CuPy.

#define TS_ADAMW_THREADS 256

// ---- constants checked by trainstream._device_kernels.check_kernel_constants --------------------------------
// the per-step float32 scalar vector: indices are trainstream.contract.S_*
#define TS_N_SCALARS 24
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
#define TS_S_GRAD_DIV 16
#define TS_S_L2 17
#define TS_S_INV_SQRT_BC2 18
#define TS_S_NEG_LR_WD 19
#define TS_S_STEP 20
#define TS_S_EPS_ROOT 21
#define TS_S_BC1_NEXT 22
#define TS_S_BETA1_MU 23
// the optax code's bits that optax/cuda reads (scalars[TS_S_OX_CODE]): trainstream.contract.OX_CUDA_BITS
#define TS_OX_CLIP 8
#define TS_OX_NESTEROV 32
#define TS_OX_RSQRT 64
#define TS_OX_HALF 1024
#define TS_OX_MU_F32 2048
#define TS_OX_MU_BF16 4096
// the kernel variants: trainstream.contract.VARIANT_TORCH_CUDA, VARIANT_OPTAX_CUDA
#define TS_VARIANT_TORCH_CUDA 1
#define TS_VARIANT_OPTAX_CUDA 3
// the launch layout (trainstream._device_kernels: MULTI_MAX, SCALAR_SETS, _UNUSED_BLOCK)
#define TS_MULTI_MAX 32
#define TS_SCALAR_SETS 8
#define TS_UNUSED_BLOCK 2147483647
// per-tensor flags of torch's recipes (trainstream._device_recipes.F_*)
#define TS_F_L2 1          // Adam's L2 decay: g += wd * p (weight_decay != 0, not decoupled)
#define TS_F_DECAY 2       // decoupled decay (AdamW; weight_decay != 0)
#define TS_F_MAXIMIZE 4    // maximize (the sign is in S_CLIP; fused's L2 rounding depends on it)
#define TS_F_GRAD_SCALE 8  // fused with GradScaler: g / S_GRAD_DIV, written back to the gradient
#define TS_F_TORCH_VEC 16  // fused: torch's kernel takes its 4-wide path for this tensor (see adamw_torch.cu)
#define TS_F_SINGLE 32     // op-by-op: the single-tensor path (division by a host scalar as a reciprocal)
// ---- end of the checked constants ---------------------------------------------------------------------------

// The scalar vector (TS_N_SCALARS floats).
struct TsScalars {
  float s[TS_N_SCALARS];
};

// One tensor of a launch (88 bytes; trainstream/_device_kernels.py mirrors it, _MultiItem).
struct TsMultiItem {
  void* param;               // weights, GPU memory (P*)
  const void* grad;          // gradient, GPU memory (G*)
  float* master;             // fp32 master (16-bit weights, fp32 state), or optax's u output; else nullptr
  void* m;                   // exp_avg (S*)
  void* v;                   // exp_avg_sq (S*)
  void* vmax;                // max_exp_avg_sq (S*), amsgrad; nullptr: no amsgrad
  const float* scalars_dev;  // the scalars in device memory (JAX), or nullptr: sets[sidx]
  long long n;               // elements
  long long base;            // index in the whole tensor of element 0 (a staged piece starts later)
  int block_start;           // first block of the grid that is this tensor's (unused: TS_UNUSED_BLOCK)
  int nblocks;               // blocks that are this tensor's (> 0; unused: 0)
  int sidx;                  // its scalar set
  int flags;                 // TS_F_* (torch's recipes; the conventions' kernels ignore them)
};

// The kernel's one by-value parameter (3584 bytes: within the 4 KiB every CUDA driver accepts): up to
// TS_SCALAR_SETS distinct scalar vectors (a launch's tensors share a few: one per group and step count),
// then the tensors by increasing block_start, then the unused items.
struct TsMultiBatch {
  TsScalars sets[TS_SCALAR_SETS];
  TsMultiItem items[TS_MULTI_MAX];
};

// 16-bit storage types, as raw bits (no cuda_fp16.h / cuda_bf16.h needed).
struct ts_f16 {
  unsigned short bits;
};
struct ts_bf16 {
  unsigned short bits;
};

// ---- conversions: to float (exact), and back --------------------------------------------------------------
__device__ __forceinline__ float ts_to_f32(float x) { return x; }
__device__ __forceinline__ float ts_to_f32(ts_bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }
__device__ __forceinline__ float ts_to_f32(ts_f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

// f32 -> fp16: round to nearest even, overflow to Inf (numpy's astype(float16), c10::Half on CUDA)
__device__ __forceinline__ unsigned short ts_f16_bits(float x) {
  unsigned short b;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return b;
}
// f32 -> bf16 as the contract (contract.f32_to_bf16_bits, c10::BFloat16 on the CPU): RN-even, NaN -> 0x7FC0
__device__ __forceinline__ unsigned short ts_bf16_bits_contract(float x) {
  const unsigned int u = __float_as_uint(x);
  return (x != x) ? (unsigned short)0x7FC0u : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// f32 -> bf16 as torch on CUDA (c10::BFloat16(float): __float2bfloat16, cvt.rn.bf16.f32 from sm_80: RN-even,
// NaN -> 0x7FFF; before sm_80 c10's round_to_nearest_even, the contract's)
__device__ __forceinline__ unsigned short ts_bf16_bits_torch(float x) {
#if __CUDA_ARCH__ >= 800
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return b;
#else
  return ts_bf16_bits_contract(x);
#endif
}

// ts_put<TORCH, T>(x): x stored as T; TORCH: torch's CUDA conversion (recipes), else the contract's.
template <bool TORCH, typename T>
struct TsPut;
template <bool TORCH>
struct TsPut<TORCH, float> {
  static __device__ __forceinline__ float put(float x) { return x; }
};
template <bool TORCH>
struct TsPut<TORCH, ts_f16> {
  static __device__ __forceinline__ ts_f16 put(float x) {
    ts_f16 r;
    r.bits = ts_f16_bits(x);
    return r;
  }
};
template <bool TORCH>
struct TsPut<TORCH, ts_bf16> {
  static __device__ __forceinline__ ts_bf16 put(float x) {
    ts_bf16 r;
    r.bits = TORCH ? ts_bf16_bits_torch(x) : ts_bf16_bits_contract(x);
    return r;
  }
};

// r(x): x rounded to T's precision, as torch on CUDA rounds a result stored in a T tensor (identity for float)
template <typename T>
__device__ __forceinline__ float ts_round(float x) {
  return ts_to_f32(TsPut<true, T>::put(x));
}

// ---- 4 consecutive elements as one 16-byte (fp32) or 8-byte (fp16/bf16) access --------------------------
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
template <bool TORCH>
__device__ __forceinline__ void ts_store4(float* p, const float in[4]) {
  float4 q;
  q.x = in[0];
  q.y = in[1];
  q.z = in[2];
  q.w = in[3];
  *reinterpret_cast<float4*>(p) = q;
}
template <bool TORCH, typename H>
__device__ __forceinline__ void ts_store4(H* p, const float in[4]) {
  ushort4 q;
  q.x = TsPut<TORCH, H>::put(in[0]).bits;
  q.y = TsPut<TORCH, H>::put(in[1]).bits;
  q.z = TsPut<TORCH, H>::put(in[2]).bits;
  q.w = TsPut<TORCH, H>::put(in[3]).bits;
  *reinterpret_cast<ushort4*>(p) = q;
}

__device__ __forceinline__ bool ts_aligned(const void* p, unsigned long long bytes) {
  return ((unsigned long long)p) % bytes == 0ull;
}
