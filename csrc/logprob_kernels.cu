// Row kernels of the fused LM-head log-prob / entropy (hybridengine/kernels/logprob.py).
//
// A chunk is a contiguous row-major [rows, cols] block of logits: tokens x a run of this rank's
// vocabulary whose first column is global token id `col_offset`. Columns >= n_valid are
// vocabulary padding: never read by the statistics, zero in the gradient. z = logits / T.
//
//   logprob_stats_update  merges the chunk into running per-row statistics (natural-log units)
//                           m = max z,  s = sum e^(z-m),  d = sum e^(z-m) (z-m),
//                           zt += z[target]   (only the chunk holding the target adds)
//   logprob_grad_inplace  overwrites the chunk with dL/dlogits:
//                           (p (g_ent (E[z] - z) - g_logp) + g_logp [j = target]) / T,
//                           p = e^(z - log Z),  E[z] - z = (log Z - z) - H
//
// Plain CUDA, no torch headers: `nvcc -c` alone compiles it (CI); csrc/logprob_bindings.cpp
// wraps the two launchers for torch. Internally the exponentials are base 2 (u = z log2 e,
// one ex2.approx per element); math in fp32 whatever the logits' dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// The max of a row that has seen nothing yet: finite, so that rebasing an empty state computes
// 0 * (m - M) = 0 rather than 0 * inf = nan.
constexpr float kEmptyMax = -1e30f;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;           // 16-byte loads in flight per thread
constexpr int64_t kWarpRowsFrom = 4096;  // from this many rows on, one warp per row

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 16 bytes of logits: one vectorised load / store.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// Online softmax statistics of values u (base 2): m = max u, s = sum 2^(u-m), d = sum 2^(u-m)(u-m).
struct Stats {
  float m, s, d;
};

__device__ __forceinline__ Stats empty_stats() { return {kEmptyMax, 0.f, 0.f}; }

// Re-express `a` relative to a larger reference max `ref`.
__device__ __forceinline__ void rebase(Stats& a, float ref) {
  const float r = fast_exp2(a.m - ref);
  a.d = (a.d + a.s * (a.m - ref)) * r;
  a.s *= r;
  a.m = ref;
}

__device__ __forceinline__ Stats combine(Stats a, Stats b) {
  const float ref = fmaxf(a.m, b.m);
  rebase(a, ref);
  rebase(b, ref);
  return {ref, a.s + b.s, a.d + b.d};
}

__device__ __forceinline__ void push(Stats& st, float u) {
  if (u > st.m) rebase(st, u);  // rare after the first few values of a row
  const float t = u - st.m;
  const float e = fast_exp2(t);
  st.s += e;
  st.d = fmaf(e, t, st.d);
}

__device__ __forceinline__ Stats shfl_xor(const Stats& a, int offset) {
  return {__shfl_xor_sync(0xffffffffu, a.m, offset), __shfl_xor_sync(0xffffffffu, a.s, offset),
          __shfl_xor_sync(0xffffffffu, a.d, offset)};
}

// Combine the statistics of the kLanes threads of a row; every thread of the row gets the result.
// kLanes is 32 (a warp per row) or kThreads (the block per row: every thread must call this).
template <int kLanes>
__device__ __forceinline__ Stats reduce_row(Stats st) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) st = combine(st, shfl_xor(st, offset));
  if constexpr (kLanes > 32) {
    constexpr int kWarps = kLanes / 32;
    __shared__ Stats partial[kWarps];
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = st;
    __syncthreads();
    st = partial[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) st = combine(st, partial[w]);
  }
  return st;
}

template <bool kStore, typename T, typename Ptr, typename Fn>
__device__ __forceinline__ void visit(Ptr row, int64_t j, Fn& fn) {
  const float y = fn(j, to_float(row[j]));
  if constexpr (kStore) row[j] = from_float<T>(y);
}

// Calls y = fn(column, value) on row[0, n), lanes striding; with kStore, writes y back. The body
// goes in aligned 16-byte packs, kUnroll loads issued before use; the unaligned head (rows of a
// chunk whose width is not a multiple of the pack) and the tail go element by element.
template <bool kStore, int kLanes, typename T, typename Fn>
__device__ __forceinline__ void walk_row(std::conditional_t<kStore, T*, const T*> row, int64_t n,
                                         int lane, Fn fn) {
  using PackPtr = std::conditional_t<kStore, Pack<T>*, const Pack<T>*>;
  constexpr int V = Pack<T>::kSize;
  const int misalign = static_cast<int>((reinterpret_cast<uintptr_t>(row) % 16) / sizeof(T));
  const int64_t head = n < (V - misalign) % V ? n : (V - misalign) % V;
  for (int64_t j = lane; j < head; j += kLanes) visit<kStore, T>(row, j, fn);

  PackPtr body = reinterpret_cast<PackPtr>(row + head);
  const int64_t num_packs = (n - head) / V;
  for (int64_t p0 = lane; p0 < num_packs; p0 += static_cast<int64_t>(kLanes) * kUnroll) {
    Pack<T> buf[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t p = p0 + static_cast<int64_t>(k) * kLanes;
      if (p < num_packs) buf[k] = body[p];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t p = p0 + static_cast<int64_t>(k) * kLanes;
      if (p >= num_packs) break;
      const int64_t col = head + p * V;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float y = fn(col + i, to_float(buf[k].v[i]));
        if constexpr (kStore) buf[k].v[i] = from_float<T>(y);
      }
      if constexpr (kStore) body[p] = buf[k];
    }
  }
  for (int64_t j = head + num_packs * V + lane; j < n; j += kLanes) visit<kStore, T>(row, j, fn);
}

template <typename T, int kRowsPerBlock>
__global__ void __launch_bounds__(kThreads)
    stats_update_kernel(const T* __restrict__ logits, int64_t rows, int64_t cols, int64_t n_valid,
                        const int64_t* __restrict__ targets, int64_t col_offset, float inv_temp,
                        float* __restrict__ m, float* __restrict__ s, float* __restrict__ d,
                        float* __restrict__ zt) {
  constexpr int kLanes = kThreads / kRowsPerBlock;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const int lane = threadIdx.x % kLanes;
  const bool active = row < rows;  // inactive threads still join reduce_row
  const float scale = inv_temp * kLog2e;
  const T* x = logits + (active ? row : 0) * cols;

  Stats st = empty_stats();
  if (active) {
    walk_row<false, kLanes, T>(x, n_valid, lane, [&](int64_t, float v) {
      push(st, v * scale);
      return 0.f;
    });
  }
  st = reduce_row<kLanes>(st);
  if (!active || lane != 0) return;
  // The running state is in natural-log units (shared with the torch path).
  const Stats old{m[row] * kLog2e, s[row], d[row] * kLog2e};
  const Stats merged = combine(old, st);
  m[row] = merged.m * kLn2;
  s[row] = merged.s;
  d[row] = merged.d * kLn2;
  const int64_t t = targets[row] - col_offset;
  if (t >= 0 && t < n_valid) zt[row] += to_float(x[t]) * inv_temp;
}

template <typename T, int kRowsPerBlock>
__global__ void __launch_bounds__(kThreads)
    grad_inplace_kernel(T* __restrict__ logits, int64_t rows, int64_t cols, int64_t n_valid,
                        const int64_t* __restrict__ targets, int64_t col_offset, float inv_temp,
                        const float* __restrict__ log_z, const float* __restrict__ entropy,
                        const float* __restrict__ g_logp, const float* __restrict__ g_ent) {
  constexpr int kLanes = kThreads / kRowsPerBlock;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (row >= rows) return;
  const int lane = threadIdx.x % kLanes;
  const float scale = inv_temp * kLog2e;
  const float log2_z = log_z[row] * kLog2e;
  const float gl = g_logp[row];
  // With a = log2 Z - u (so p = 2^-a and log Z - z = a ln 2):
  //   p (g_ent (E[z] - z) - g_logp) = p (k1 a - k0),  k1 = g_ent ln 2,  k0 = g_ent H + g_logp.
  const float k1 = g_ent[row] * kLn2;
  const float k0 = fmaf(g_ent[row], entropy[row], gl);
  const int64_t t = targets[row] - col_offset;
  walk_row<true, kLanes, T>(logits + row * cols, cols, lane, [&](int64_t j, float v) {
    if (j >= n_valid) return 0.f;
    const float a = fmaf(-v, scale, log2_z);
    float g = fast_exp2(-a) * fmaf(k1, a, -k0);
    if (j == t) g += gl;
    return g * inv_temp;
  });
}

template <template <typename, int> class Launch, typename T, typename... Args>
cudaError_t launch_rows(int64_t rows, cudaStream_t stream, Args... args) {
  if (rows == 0) return cudaSuccess;
  if (rows >= kWarpRowsFrom) {
    constexpr int kRows = kThreads / 32;
    const unsigned grid = static_cast<unsigned>((rows + kRows - 1) / kRows);
    Launch<T, kRows>::run(grid, stream, rows, args...);
  } else {
    Launch<T, 1>::run(static_cast<unsigned>(rows), stream, rows, args...);
  }
  return cudaGetLastError();
}

template <typename T, int kRows>
struct StatsLaunch {
  template <typename... Args>
  static void run(unsigned grid, cudaStream_t stream, int64_t rows, const void* logits,
                  Args... args) {
    stats_update_kernel<T, kRows>
        <<<grid, kThreads, 0, stream>>>(static_cast<const T*>(logits), rows, args...);
  }
};

template <typename T, int kRows>
struct GradLaunch {
  template <typename... Args>
  static void run(unsigned grid, cudaStream_t stream, int64_t rows, void* logits, Args... args) {
    grad_inplace_kernel<T, kRows><<<grid, kThreads, 0, stream>>>(static_cast<T*>(logits), rows,
                                                                 args...);
  }
};

}  // namespace

namespace hybridengine {

// dtype: 0 float32, 1 float16, 2 bfloat16. All [rows] vectors are fp32 except targets (int64).
cudaError_t logprob_stats_update(const void* logits, int dtype, int64_t rows, int64_t cols,
                                 int64_t n_valid, const int64_t* targets, int64_t col_offset,
                                 float inv_temp, float* m, float* s, float* d, float* zt,
                                 cudaStream_t stream) {
  switch (dtype) {
    case 0:
      return launch_rows<StatsLaunch, float>(rows, stream, logits, cols, n_valid, targets,
                                             col_offset, inv_temp, m, s, d, zt);
    case 1:
      return launch_rows<StatsLaunch, __half>(rows, stream, logits, cols, n_valid, targets,
                                              col_offset, inv_temp, m, s, d, zt);
    case 2:
      return launch_rows<StatsLaunch, __nv_bfloat16>(rows, stream, logits, cols, n_valid,
                                                     targets, col_offset, inv_temp, m, s, d, zt);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t logprob_grad_inplace(void* logits, int dtype, int64_t rows, int64_t cols,
                                 int64_t n_valid, const int64_t* targets, int64_t col_offset,
                                 float inv_temp, const float* log_z, const float* entropy,
                                 const float* g_logp, const float* g_ent, cudaStream_t stream) {
  switch (dtype) {
    case 0:
      return launch_rows<GradLaunch, float>(rows, stream, logits, cols, n_valid, targets,
                                            col_offset, inv_temp, log_z, entropy, g_logp, g_ent);
    case 1:
      return launch_rows<GradLaunch, __half>(rows, stream, logits, cols, n_valid, targets,
                                             col_offset, inv_temp, log_z, entropy, g_logp, g_ent);
    case 2:
      return launch_rows<GradLaunch, __nv_bfloat16>(rows, stream, logits, cols, n_valid, targets,
                                                    col_offset, inv_temp, log_z, entropy, g_logp,
                                                    g_ent);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace hybridengine
