// KV injection (DFlash paper sec. 3.2; z-lab/dflash dflash/model.py), fused for NVIDIA GPUs.
//
// The CUDA twin of kv_inject.cpp. The context tokens' fused target features H went through every
// drafter layer's OWN k_proj / v_proj in one matrix product (done by the caller); this kernel then
// applies k_norm (RMSNorm over head_dim) and RoPE (rotate-half, NeoX) to K and writes K and V into the
// drafter's context cache at each token's absolute position, for all layers in one launch.
//
// Plain CUDA behind a C ABI (no torch headers), so that one compiled library serves both the torch op
// (`dflash_trt.ops.cuda`, which passes tensor pointers and torch's current stream) and a TensorRT
// plugin's enqueue (which passes its bindings and stream). All pointers are device pointers; T is the
// model dtype (float32, float16 or bfloat16):
//
//   kv        [n, c, L * 2 * H * D] T, contiguous: per token, layer l's K (H * D values) then its V
//   k_norm    [L, D] T: layer l's k_norm weight
//   eps       k_norm's epsilon
//   cos, sin  [n, c, D] float32: RoPE of each token's position (RotaryEmbedding)
//   cache     [2, L, B, H, cap, D] T (KVCache.buffer), written in place
//   rows      [n] int64: the cache row of each of the n sequences
//   positions [n, c] int64: the slot (absolute position) of each token, < cap
//
// Rounding follows the PyTorch reference (DFlashDrafter.context_kv + KVCache.write) op by op: the
// norm in float32 rounded to T, times the weight rounded to T, cos/sin rounded to T, each RoPE product
// and their sum rounded to T. Only the mean of squares is summed in another order (a tree here), so K
// may differ from the reference in its last bit; V is copied exactly. A row or position outside the
// cache stops `dflash_kv_inject` (the torch op's entry point) with a device-side assertion, as torch's
// indexing kernels do. `dflash_kv_inject_guarded` (the TensorRT plugin's) skips such a token instead,
// writing nothing for it: TensorRT's builder may time a plugin on random inputs and trtexec fills inputs
// with random data, and a device-side assertion leaves a sticky error that kills the CUDA context.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cassert>
#include <cstdint>

namespace {

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// x rounded to T and back: what a torch op computing in float and storing T keeps
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_float<T>(from_float<T>(x)); }

// One thread block per (token, layer, KV head); thread d < D/2 handles the RoPE pair (d, d + D/2). The
// block is D/2 rounded up to whole warps; the extra lanes only add zeros to the sum of squares.
template <typename T>
__global__ void kv_inject_kernel(const T* __restrict__ kv, const T* __restrict__ k_norm, float eps,
                                 const float* __restrict__ cos, const float* __restrict__ sin, T* __restrict__ cache,
                                 const int64_t* __restrict__ rows, const int64_t* __restrict__ positions, int64_t c,
                                 int64_t L, int64_t B, int64_t H, int64_t cap, int64_t D, bool skip_outside) {
  extern __shared__ float partial[];  // one float per warp
  const int64_t i = blockIdx.x;       // token (sequence r = i / c, i % c within it)
  const int64_t l = blockIdx.y;
  const int64_t h = blockIdx.z;
  const int64_t half = D / 2;
  const int64_t d = threadIdx.x;
  const bool lane = d < half;  // a RoPE pair of this head, not a padding lane
  const int64_t row = rows[i / c];
  const int64_t pos = positions[i];
  // `skip_outside` (the guarded entry point): a token whose row or position is outside the cache writes
  // nothing. row and pos depend on blockIdx only (one block per (token, layer, head)), so they are uniform
  // across the block and the whole block returns here together, before the full-warp shuffles and the
  // __syncthreads below: no thread is left waiting at a barrier or a shuffle.
  if (skip_outside && (row < 0 || row >= B || pos < 0 || pos >= cap)) return;
  assert(row >= 0 && row < B && "kv_inject: a row outside the cache");
  assert(pos >= 0 && pos < cap && "kv_inject: a position outside the cache's capacity");

  const T* k = kv + i * (L * 2 * H * D) + l * 2 * H * D + h * D;
  const T* v = k + H * D;
  const float k1 = lane ? to_float<T>(k[d]) : 0.0f;
  const float k2 = lane ? to_float<T>(k[d + half]) : 0.0f;

  // mean of squares over the head: warp shuffles, then one partial per warp through shared memory. Products and
  // sums here and below are __fmul_rn / __fadd_rn: nvcc would otherwise contract a product and a sum into one fused
  // multiply-add (one rounding where torch's separate ops round twice), which for float32 made K differ from the
  // reference by up to half an ulp of the larger product, more than the result's own ulp where the two cancel.
  float ss = __fadd_rn(__fmul_rn(k1, k1), __fmul_rn(k2, k2));
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const int warps = (blockDim.x + 31) / 32;
  if (warps > 1) {
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int w = 0; w < warps; ++w) ss += partial[w];
  }
  const float inv = rsqrtf(ss / static_cast<float>(D) + eps);
  if (!lane) return;

  const T* w = k_norm + l * D;
  const float a = rnd<T>(__fmul_rn(to_float<T>(w[d]), rnd<T>(__fmul_rn(k1, inv))));  // k_norm, first half
  const float b = rnd<T>(__fmul_rn(to_float<T>(w[d + half]), rnd<T>(__fmul_rn(k2, inv))));
  const float* cr = cos + i * D;
  const float* sr = sin + i * D;
  // x * cos + rotate_half(x) * sin, each product and the sum rounded to T
  const float out1 = __fadd_rn(rnd<T>(__fmul_rn(a, rnd<T>(cr[d]))), rnd<T>(__fmul_rn(-b, rnd<T>(sr[d]))));
  const float out2 = __fadd_rn(rnd<T>(__fmul_rn(b, rnd<T>(cr[d + half]))), rnd<T>(__fmul_rn(a, rnd<T>(sr[d + half]))));

  // cache strides: [2, L, B, H, cap, D]
  const int64_t s_head = cap * D, s_row = H * s_head, s_layer = B * s_row, s_kv = L * s_layer;
  T* k_dst = cache + l * s_layer + row * s_row + h * s_head + pos * D;
  T* v_dst = k_dst + s_kv;
  k_dst[d] = from_float<T>(out1);
  k_dst[d + half] = from_float<T>(out2);
  v_dst[d] = v[d];
  v_dst[d + half] = v[d + half];
}

template <typename T>
cudaError_t launch(const void* kv, const void* k_norm, float eps, const float* cos, const float* sin, void* cache,
                   const int64_t* rows, const int64_t* positions, int64_t n, int64_t c, int64_t L, int64_t B,
                   int64_t H, int64_t cap, int64_t D, bool skip_outside, cudaStream_t stream) {
  const unsigned warps = static_cast<unsigned>((D / 2 + 31) / 32);
  const unsigned threads = warps * 32;
  dim3 grid(static_cast<unsigned>(n * c), static_cast<unsigned>(L), static_cast<unsigned>(H));
  kv_inject_kernel<T><<<grid, threads, warps * sizeof(float), stream>>>(
      static_cast<const T*>(kv), static_cast<const T*>(k_norm), eps, cos, sin, static_cast<T*>(cache), rows,
      positions, c, L, B, H, cap, D, skip_outside);
  return cudaGetLastError();
}

// dtype codes of `dflash_kv_inject` and `dflash_kv_inject_guarded`
enum { DFLASH_FLOAT32 = 0, DFLASH_FLOAT16 = 1, DFLASH_BFLOAT16 = 2 };

// Both entry points: the arguments checked, then one launch of the dtype's kernel.
int inject(int dtype, const void* kv, const void* k_norm, float eps, const float* cos, const float* sin, void* cache,
           const int64_t* rows, const int64_t* positions, int64_t n, int64_t c, int64_t L, int64_t B, int64_t H,
           int64_t cap, int64_t D, void* stream, bool skip_outside) {
  if (D <= 0 || D % 2 != 0 || D > 2048 || L <= 0 || L > 65535 || H <= 0 || H > 65535 || n < 0 || c < 0 ||
      n * c > 2147483647LL)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n * c == 0) return static_cast<int>(cudaSuccess);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DFLASH_FLOAT32:
      return launch<float>(kv, k_norm, eps, cos, sin, cache, rows, positions, n, c, L, B, H, cap, D, skip_outside, s);
    case DFLASH_FLOAT16:
      return launch<__half>(kv, k_norm, eps, cos, sin, cache, rows, positions, n, c, L, B, H, cap, D, skip_outside,
                            s);
    case DFLASH_BFLOAT16:
      return launch<__nv_bfloat16>(kv, k_norm, eps, cos, sin, cache, rows, positions, n, c, L, B, H, cap, D,
                                   skip_outside, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

extern "C" {

// Launch the fused KV injection on `stream` (a cudaStream_t; 0 = the legacy default stream). Returns
// cudaSuccess (0) or the launch's cudaError_t; cudaErrorInvalidValue for a dtype code outside the enum,
// a head_dim that is odd or above 2048 (at most 1024 threads of RoPE pairs), or more than 2^31 - 1
// tokens, 65535 layers or 65535 KV heads (the grid's limits).
// Nothing is launched for n * c == 0. A row or position outside the cache stops the kernel with a
// device-side assertion (the torch op's entry point, dflash_trt/ops/cuda.py).
int dflash_kv_inject(int dtype, const void* kv, const void* k_norm, float eps, const float* cos, const float* sin,
                     void* cache, const int64_t* rows, const int64_t* positions, int64_t n, int64_t c, int64_t L,
                     int64_t B, int64_t H, int64_t cap, int64_t D, void* stream) {
  return inject(dtype, kv, k_norm, eps, cos, sin, cache, rows, positions, n, c, L, B, H, cap, D, stream, false);
}

// `dflash_kv_inject`, except that a token whose row is outside [0, B) or whose position is outside
// [0, cap) is skipped (nothing written for it) instead of asserting: the TensorRT plugin's entry point,
// since TensorRT may run a plugin on random inputs (builder timing, trtexec) and a device-side assertion
// would kill the CUDA context. Same arguments, same return codes.
int dflash_kv_inject_guarded(int dtype, const void* kv, const void* k_norm, float eps, const float* cos,
                             const float* sin, void* cache, const int64_t* rows, const int64_t* positions, int64_t n,
                             int64_t c, int64_t L, int64_t B, int64_t H, int64_t cap, int64_t D, void* stream) {
  return inject(dtype, kv, k_norm, eps, cos, sin, cache, rows, positions, n, c, L, B, H, cap, D, stream, true);
}

// cudaGetErrorString of a code `dflash_kv_inject` returned (a static string)
const char* dflash_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
