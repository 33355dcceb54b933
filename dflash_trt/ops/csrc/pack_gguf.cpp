// Exact GGUF block formats for the packed linear (csrc/packed_linear.cpp): find, for a float32 weight
// W [N, K], the GGUF Q4_1 or Q8_0 blocks (32 inputs along K) it was dequantized from, and pack them in
// the kernel's panel layout. A weight that is not EXACTLY such blocks (one value off by one bit) gives
// no result, and the caller packs it in another format: the kernel's output never changes.
//
// Q4_1 (ggml-quants.c, dequantize_row_q4_1): w = d * q + m, q in 0..15, d and m float16, evaluated in
// float32. The quantizer sets m = fp16(block min) and d = fp16((max - min) / 15), so the smallest value
// of a block has q = 0 (w = m) and the largest q = 15; d * q is exact in float32 (11 + 4 bits), so
// d * q + m has one rounding whether or not it is fused.
// Q8_0 (dequantize_row_q8_0): w = d * q, q in -127..127 (the quantizer never writes -128), d float16;
// the largest |w| has |q| = 127 and d * q is exact.
//
// Outputs (the layouts of packed_linear.cpp), P = ceil(N / 32), rows past N all zero:
//   pack_q4_1: uint8 [P, K, 16] (byte j of panel p at k: q of row 32p + j in the low nibble, of row
//              32p + 16 + j in the high one) and float16 [P, K / 32, 2, 32] (d of the 32 rows, then m).
//   pack_q8_0: int8 [P, K, 32] and float16 [P, K / 32, 32] (d).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <torch/types.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kPanel = 32;
constexpr int kBlock = 32;

inline uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// v as float16 when that is exact (finite, same bits back), else false.
inline bool exact_half(float v, c10::Half* out) {
  const c10::Half h(v);
  if (!std::isfinite(v) || bits(static_cast<float>(h)) != bits(v)) return false;
  *out = h;
  return true;
}

// One block of 32 values as Q4_1: q[32], d, m; false when not exact.
inline bool block_q4_1(const float* w, uint8_t* q, c10::Half* d, c10::Half* m) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < kBlock; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  if (!exact_half(lo, m)) return false;
  const float df = static_cast<float>(c10::Half((hi - lo) / 15.0f));
  if (!std::isfinite(df)) return false;
  *d = c10::Half(df);
  for (int i = 0; i < kBlock; ++i) {
    const float qf = df > 0.0f ? std::min(15.0f, std::max(0.0f, std::nearbyint((w[i] - lo) / df))) : 0.0f;
    if (bits(df * qf + lo) != bits(w[i])) return false;
    q[i] = static_cast<uint8_t>(qf);
  }
  return true;
}

// One block of 32 values as Q8_0: q[32], d; false when not exact.
inline bool block_q8_0(const float* w, int8_t* q, c10::Half* d) {
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(w[i]));
  if (!exact_half(amax / 127.0f, d)) return false;
  const float df = static_cast<float>(*d);
  for (int i = 0; i < kBlock; ++i) {
    const float qf = df > 0.0f ? std::min(127.0f, std::max(-127.0f, std::nearbyint(w[i] / df))) : 0.0f;
    if (bits(df * qf) != bits(w[i])) return false;
    q[i] = static_cast<int8_t>(qf);
  }
  return true;
}

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(),
              "pack: a contiguous float32 [N, K] CPU weight expected");
  TORCH_CHECK(w.size(1) % kBlock == 0, "pack: in_features must be divisible by 32, got ", w.size(1));
}

// Shared driver: every (panel, row, block) through `block`, which writes its q and scales; [] when
// any block is not exact.
template <typename Block>
bool for_each_block(const at::Tensor& w, Block block) {
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  const float* src = w.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end && ok.load(std::memory_order_relaxed); ++p) {
      for (int j = 0; j < kPanel && 32 * p + j < N; ++j) {
        const int64_t n = 32 * p + j;
        for (int64_t kb = 0; kb < K / kBlock; ++kb) {
          if (!block(src + n * K + kb * kBlock, p, j, kb)) {
            ok.store(false, std::memory_order_relaxed);
            return;
          }
        }
      }
    }
  });
  return ok.load();
}

std::vector<at::Tensor> pack_q4_1(const at::Tensor& w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, 16}, w.options().dtype(at::kByte));
  at::Tensor scales = at::zeros({panels, K / kBlock, 2, kPanel}, w.options().dtype(at::kHalf));
  uint8_t* pk = packed.data_ptr<uint8_t>();
  c10::Half* sc = scales.data_ptr<c10::Half>();
  const bool ok = for_each_block(w, [&](const float* block, int64_t p, int j, int64_t kb) {
    uint8_t q[kBlock];
    c10::Half* s = sc + (p * (K / kBlock) + kb) * 2 * kPanel;
    if (!block_q4_1(block, q, s + j, s + kPanel + j)) return false;
    for (int i = 0; i < kBlock; ++i) {
      uint8_t& byte = pk[(p * K + kb * kBlock + i) * 16 + (j % 16)];
      byte |= j < 16 ? q[i] : static_cast<uint8_t>(q[i] << 4);
    }
    return true;
  });
  if (!ok) return {};
  return {packed, scales};
}

std::vector<at::Tensor> pack_q8_0(const at::Tensor& w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options().dtype(at::kChar));
  at::Tensor scales = at::zeros({panels, K / kBlock, kPanel}, w.options().dtype(at::kHalf));
  int8_t* pk = packed.data_ptr<int8_t>();
  c10::Half* sc = scales.data_ptr<c10::Half>();
  const bool ok = for_each_block(w, [&](const float* block, int64_t p, int j, int64_t kb) {
    int8_t q[kBlock];
    if (!block_q8_0(block, q, sc + (p * (K / kBlock) + kb) * kPanel + j)) return false;
    for (int i = 0; i < kBlock; ++i) pk[(p * K + kb * kBlock + i) * kPanel + j] = q[i];
    return true;
  });
  if (!ok) return {};
  return {packed, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash_trt, m) {
  m.def("pack_q4_1(Tensor w) -> Tensor[]");
  m.def("pack_q8_0(Tensor w) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(dflash_trt, CPU, m) {
  m.impl("pack_q4_1", &pack_q4_1);
  m.impl("pack_q8_0", &pack_q8_0);
}
