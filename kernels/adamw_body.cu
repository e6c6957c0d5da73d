// TrainStream's AdamW on the GPU, part 2 of 4 (after adamw.cu): one tensor's element loop and the launch of
// up to TS_MULTI_MAX tensors, for any element arithmetic M (adamw_variants.cu, adamw_torch.cu).
//
// M, the arithmetic of one element (a struct of static members):
//   kTorchCvt   true: values are stored with torch's CUDA conversions (ts_put<true, T>), else the contract's
//   kWritesGrad true: with TS_F_GRAD_SCALE the gradient is written back (fused with GradScaler)
//   prepare(c)  once per tensor and thread, before its elements (e.g. fused's bias corrections)
//   el<G>(p, g, m, v, x, ams, c, idx, u): p the weight (fp32 master) in and out; g the gradient as read in,
//     out the value written back (kWritesGrad); m, v, x (max_exp_avg_sq, with ams) the state in and out, as
//     floats (16-bit state: its exact value; M rounds what it stores as the reference rounds); idx the
//     element's index in the whole tensor; u: optax's update before the learning rate (EMIT_U kernels)

// What one tensor's elements share: its scalars and flags, its first element's index, and what M::prepare sets.
struct TsCtx {
  TsScalars s;
  int flags;
  long long base;
  float bc1, bc2s, ss;  // fused: 1 - b1^t, sqrt(1 - b2^t), lr / bc1 (the device's powf)
};

// u's storage with EMIT_U: the weights' 16-bit dtype where the state is in it too (optax's update of fp16/bf16
// state), else float32.
template <typename P, typename S>
struct TsUpd {
  typedef float type;
};
template <>
struct TsUpd<ts_f16, ts_f16> {
  typedef ts_f16 type;
};
template <>
struct TsUpd<ts_bf16, ts_bf16> {
  typedef ts_bf16 type;
};

// P: weight storage (float, ts_f16, ts_bf16); G: gradient storage; S: state storage (m, max_exp_avg_sq); SV: v's
// (default S; optax's mu_dtype makes them differ). Weights and state: fp32 weights are their own master; 16-bit
// weights with fp32 state have an fp32 master (`master`; MASTER); 16-bit weights with 16-bit state have none
// (torch's and optax's own schemes). EMIT_U (optax): the weights are read, not written, and `master` receives u
// (as TsUpd's type).
template <class M, typename P, typename G, typename S, bool EMIT_U, typename SV = S,
          bool MASTER = (sizeof(P) == 2 && sizeof(S) == 4)>
struct TsTensor {
  static constexpr bool kMaster = MASTER;
  typedef typename TsUpd<P, S>::type U;

  static __device__ __forceinline__ void one(const TsMultiItem& t, const TsCtx& c, const bool ams,
                                             const bool gw, const long long i) {
    P* param = static_cast<P*>(t.param);
    float p = kMaster ? t.master[i] : ts_to_f32(param[i]);
    float g = ts_to_f32(static_cast<const G*>(t.grad)[i]);
    S* m = static_cast<S*>(t.m);
    SV* v = static_cast<SV*>(t.v);
    S* x = static_cast<S*>(t.vmax);
    float mi = ts_to_f32(m[i]), vi = ts_to_f32(v[i]), xi = ams ? ts_to_f32(x[i]) : 0.0f, u = 0.0f;
    M::template el<G>(p, g, mi, vi, xi, ams, c, c.base + i, u);
    m[i] = TsPut<M::kTorchCvt, S>::put(mi);
    v[i] = TsPut<M::kTorchCvt, SV>::put(vi);
    if (ams) x[i] = TsPut<M::kTorchCvt, S>::put(xi);
    if (gw) const_cast<G*>(static_cast<const G*>(t.grad))[i] = TsPut<M::kTorchCvt, G>::put(g);
    if (EMIT_U) {
      reinterpret_cast<U*>(t.master)[i] = TsPut<M::kTorchCvt, U>::put(u);
    } else {
      if (kMaster) t.master[i] = p;
      param[i] = TsPut<M::kTorchCvt, P>::put(p);
    }
  }

  static __device__ __forceinline__ void four(const TsMultiItem& t, const TsCtx& c, const bool ams,
                                              const bool gw, const long long i) {
    P* param = static_cast<P*>(t.param);
    G* grad = const_cast<G*>(static_cast<const G*>(t.grad));
    S* m = static_cast<S*>(t.m);
    SV* v = static_cast<SV*>(t.v);
    S* x = static_cast<S*>(t.vmax);
    float p[4], g[4], mi[4], vi[4], xi[4] = {0.0f, 0.0f, 0.0f, 0.0f}, u[4];
    ts_load4(m + i, mi);
    ts_load4(v + i, vi);
    if (ams) ts_load4(x + i, xi);
    if (kMaster) ts_load4(t.master + i, p);
    else ts_load4(param + i, p);
    ts_load4(grad + i, g);
#pragma unroll
    for (int j = 0; j < 4; ++j) M::template el<G>(p[j], g[j], mi[j], vi[j], xi[j], ams, c, c.base + i + j, u[j]);
    ts_store4<M::kTorchCvt>(m + i, mi);
    ts_store4<M::kTorchCvt>(v + i, vi);
    if (ams) ts_store4<M::kTorchCvt>(x + i, xi);
    if (gw) ts_store4<M::kTorchCvt>(grad + i, g);
    if (EMIT_U) {
      ts_store4<M::kTorchCvt>(reinterpret_cast<U*>(t.master) + i, u);
    } else {
      if (kMaster) ts_store4<M::kTorchCvt>(t.master + i, p);
      ts_store4<M::kTorchCvt>(param + i, p);
    }
  }

  // Grid-stride over this tensor's `nblocks` blocks; the bits depend neither on the grid nor on the path an
  // element takes. Vector path: `head` scalar elements bring m to a 4-element boundary; the body runs in groups
  // of 4 if every array is then aligned for its 4-wide access, else everything goes through the scalar path.
  static __device__ __forceinline__ void run(const TsMultiItem& t, const TsCtx& c, const long long block) {
    const bool ams = t.vmax != nullptr;
    const bool gw = M::kWritesGrad && (c.flags & TS_F_GRAD_SCALE);
    const long long n = t.n;
    constexpr unsigned long long kS = sizeof(S);
    long long head = (long long)(((4ull * kS - ((unsigned long long)t.m % (4ull * kS))) % (4ull * kS)) / kS);
    if (head > n) head = n;
    const char* m0 = static_cast<const char*>(t.m) + head * kS;
    const char* v0 = static_cast<const char*>(t.v) + head * sizeof(SV);
    const bool vec = ts_aligned(m0, 4 * kS) && ts_aligned(v0, 4 * sizeof(SV)) &&
                     (!ams || ts_aligned(static_cast<const char*>(t.vmax) + head * kS, 4 * kS)) &&
                     (!kMaster || ts_aligned(t.master + head, 16)) &&
                     (!EMIT_U || ts_aligned(reinterpret_cast<const U*>(t.master) + head, 4 * sizeof(U))) &&
                     ts_aligned(static_cast<const P*>(t.param) + head, 4 * sizeof(P)) &&
                     ts_aligned(static_cast<const G*>(t.grad) + head, 4 * sizeof(G));
    if (!vec) head = n;
    const long long nvec = (n - head) >> 2;
    const long long tail = head + (nvec << 2);
    const long long tid = block * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)t.nblocks * blockDim.x;
    for (long long i = tid; i < head; i += nthreads) one(t, c, ams, gw, i);
    for (long long k = tid; k < nvec; k += nthreads) four(t, c, ams, gw, head + (k << 2));
    for (long long i = tail + tid; i < n; i += nthreads) one(t, c, ams, gw, i);
  }
};

// The launch: block b belongs to the last item whose block_start <= b (never an unused one: TS_UNUSED_BLOCK is
// above every block index), which grid-strides over its nblocks blocks from there.
template <class M, typename P, typename G, typename S, bool EMIT_U, typename SV = S,
          bool MASTER = (sizeof(P) == 2 && sizeof(S) == 4)>
__device__ __forceinline__ void ts_multi(const TsMultiBatch& batch) {
  int lo = 0, hi = TS_MULTI_MAX - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if ((long long)batch.items[mid].block_start <= (long long)blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const TsMultiItem& t = batch.items[lo];
  const long long block = (long long)blockIdx.x - t.block_start;
  if (block < 0 || block >= t.nblocks) return;  // a grid larger than the table
  TsCtx c;
  if (t.scalars_dev != nullptr) {  // the optax convention's row of TS_N_SCALARS (JAX: of its scalar matrix)
#pragma unroll
    for (int k = 0; k < TS_N_SCALARS; ++k) c.s.s[k] = t.scalars_dev[k];
  } else {
    c.s = batch.sets[t.sidx];
  }
  c.flags = t.flags;
  c.base = t.base;
  c.bc1 = c.bc2s = c.ss = 0.0f;
  M::prepare(c);
  TsTensor<M, P, G, S, EMIT_U, SV, MASTER>::run(t, c, block);
}

// extern "C" entry point NAME: arithmetic M, weights P, gradient G, state S.
#define TS_KERNEL(NAME, M, P, G, S, EMIT_U)                                                       \
  extern "C" __global__ void __launch_bounds__(TS_ADAMW_THREADS) NAME(const TsMultiBatch batch) { \
    ts_multi<M, P, G, S, EMIT_U>(batch);                                                          \
  }
// The same with mu in S and nu in SV, no master (optax's state as it keeps it: mu_dtype, fp16/bf16 leaves).
#define TS_KERNEL_STATE(NAME, M, P, G, S, SV, EMIT_U)                                             \
  extern "C" __global__ void __launch_bounds__(TS_ADAMW_THREADS) NAME(const TsMultiBatch batch) { \
    ts_multi<M, P, G, S, EMIT_U, SV, false>(batch);                                               \
  }
