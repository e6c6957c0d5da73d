// TrainStream: deterministic global sum of squares of all gradients, for clipping
// without a host synchronisation (`gpu` mode). The result, a float64 in device memory,
// is read by the AdamW kernel (adamw_zero_copy.cu), which turns it into the clip
// coefficient of trainstream.contract.clip_coefficient.
//
// Two stages, no atomics, so the same inputs give the same bits on every run:
//   1. ts_sumsq_partials_<g>, once per gradient tensor: a grid-stride pass in which each
//      thread sums g*g in float64 in a fixed order, then a fixed-shape shared-memory tree
//      per block; block b writes partials[b] (the launcher passes the tensor's slice of
//      one partials array). The block count is a function of the tensor size only
//      (_device_kernels.blocks_for), never of the GPU.
//   2. ts_sumsq_finalize, one block: sums all partials in a fixed order into *out.
// Every element is read with a scalar load, so the order of the sum does not depend on
// the alignment of the gradient either.
//
// Launch both with blockDim.x == TS_SUMSQ_THREADS (a block of another size writes NaN).
// No #include: compiled by NVRTC through CuPy (trainstream/_device_kernels.py).

#define TS_SUMSQ_THREADS 256

// 16-bit gradients as raw bits (no cuda_fp16.h / cuda_bf16.h needed).
struct ts_f16 {
  unsigned short bits;
};
struct ts_bf16 {
  unsigned short bits;
};

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

// Sum of sh[0..TS_SUMSQ_THREADS) into sh[0]: a fixed-shape tree (the same pairs every run).
__device__ __forceinline__ void ts_block_tree_sum(double* sh) {
  __syncthreads();
#pragma unroll
  for (int stride = TS_SUMSQ_THREADS / 2; stride > 0; stride >>= 1) {
    if ((int)threadIdx.x < stride) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + stride]);
    __syncthreads();
  }
}

template <typename G>
__device__ __forceinline__ void ts_sumsq_partials(const G* __restrict__ grad, const long long n,
                                                  double* __restrict__ partials) {
  __shared__ double sh[TS_SUMSQ_THREADS];
  if (blockDim.x != TS_SUMSQ_THREADS) {  // the order of the sum assumes this block size
    if (threadIdx.x == 0) partials[blockIdx.x] = __longlong_as_double(0x7FF8000000000000ll);
    return;
  }
  const long long stride = (long long)gridDim.x * TS_SUMSQ_THREADS;
  double acc = 0.0;
  for (long long i = (long long)blockIdx.x * TS_SUMSQ_THREADS + threadIdx.x; i < n; i += stride) {
    // x = g as float64 (exact)
    const double x = (double)ts_to_f32(grad[i]);
    // acc = acc + x*x   (x*x is exact in float64: 24-bit significands)
    acc = __dadd_rn(acc, __dmul_rn(x, x));
  }
  sh[threadIdx.x] = acc;
  ts_block_tree_sum(sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}

extern "C" __global__ void __launch_bounds__(TS_SUMSQ_THREADS)
    ts_sumsq_partials_f32(const float* __restrict__ grad, long long n, double* __restrict__ partials) {
  ts_sumsq_partials<float>(grad, n, partials);
}
extern "C" __global__ void __launch_bounds__(TS_SUMSQ_THREADS)
    ts_sumsq_partials_f16(const ts_f16* __restrict__ grad, long long n, double* __restrict__ partials) {
  ts_sumsq_partials<ts_f16>(grad, n, partials);
}
extern "C" __global__ void __launch_bounds__(TS_SUMSQ_THREADS)
    ts_sumsq_partials_bf16(const ts_bf16* __restrict__ grad, long long n, double* __restrict__ partials) {
  ts_sumsq_partials<ts_bf16>(grad, n, partials);
}

// One block: out[0] = the sum of partials[0..count) (thread t sums t, t+256, ... in order,
// then the fixed tree).
extern "C" __global__ void __launch_bounds__(TS_SUMSQ_THREADS)
    ts_sumsq_finalize(const double* __restrict__ partials, long long count, double* __restrict__ out) {
  __shared__ double sh[TS_SUMSQ_THREADS];
  if (blockDim.x != TS_SUMSQ_THREADS || gridDim.x != 1) {
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = __longlong_as_double(0x7FF8000000000000ll);
    return;
  }
  double acc = 0.0;
  for (long long i = threadIdx.x; i < count; i += TS_SUMSQ_THREADS) {
    // acc = acc + partials[i]
    acc = __dadd_rn(acc, partials[i]);
  }
  sh[threadIdx.x] = acc;
  ts_block_tree_sum(sh);
  if (threadIdx.x == 0) out[0] = sh[0];
}
