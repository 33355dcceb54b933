// CPU float32 linear layer over "panel-packed" weights, for the few-row products of speculative
// decoding (a 1-token decode, a 2-16 token verify, a 16-position draft block).
//
// Why: torch's CPU BLAS reads weights at memory speed for 1 row but is 1.3-2x slower for 2-16 rows
// (a verify pass of the target; measured on the 2-core dev machines, see docs/kernels.md), while
// these products are still memory-bound: every weight is read once per call whatever the row count.
//
// Layout: W [N, K] (nn.Linear, row-major) packed as P [ceil(N / 32), K, 32]:
//   P[p][k][j] = W[32 p + j][k]  (rows past N are zero),
// so one panel p streams 32 outputs' weights contiguously in k order.
//
// Arithmetic (identical for every row count M and thread count, so results are batch-invariant
// bit for bit): K is cut into 8 segments [K s / 8, K (s + 1) / 8); within a segment each output
// accumulates x[k] * W[n][k] with fused multiply-adds in increasing k from 0.0f; the output is
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then + bias. How many segments are read at once
// (memory streams) and how many rows share a pass (up to 12) change only the speed (panel_any_rows).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kPanel = 32;   // outputs per panel: two 16-float AVX-512 vectors
constexpr int kSegments = 8;
constexpr int kMaxRows = 12;  // rows per pass: 24 accumulators of the 32 zmm registers (8: prefill 7% slower)
constexpr int kPrefetch = 1024;  // floats ahead (4 KiB) in each stream

inline int seg_begin(int K, int s) { return static_cast<int>(static_cast<int64_t>(K) * s / kSegments); }

inline void store_panel(float* y, __m512 v0, __m512 v1, const float* bias, int n0, int valid) {
  if (bias != nullptr) {
    const __mmask16 m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const __mmask16 m1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
    v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, bias + n0));
    v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, bias + n0 + 16));
  }
  if (valid >= kPanel) {
    _mm512_storeu_ps(y, v0);
    _mm512_storeu_ps(y + 16, v1);
  } else {
    const __mmask16 m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const __mmask16 m1 = valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
    _mm512_mask_storeu_ps(y, m0, v0);
    _mm512_mask_storeu_ps(y + 16, m1, v1);
  }
}

// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): the one summation order of every path.
inline __m512 combine(const __m512* v, int stride) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[stride]), _mm512_add_ps(v[2 * stride], v[3 * stride])),
                       _mm512_add_ps(_mm512_add_ps(v[4 * stride], v[5 * stride]), _mm512_add_ps(v[6 * stride], v[7 * stride])));
}

// S consecutive segments of MR rows streamed together (S memory streams): per segment, acc = sum_k
// x[m][k] * P[k][:] over its k range with FMAs in increasing k from 0 (the same chain whatever S and
// MR), so S and MR only change speed. part[s][m][v] receives segment s's sums.
template <int MR, int S, bool kPrefetchAhead>
inline void segments(const float* x, int64_t ldx, const float* panel, const int* b, __m512 (*part)[kMaxRows][2]) {
  __m512 a[S][MR][2];
  for (int i = 0; i < S; ++i)
    for (int m = 0; m < MR; ++m) a[i][m][0] = a[i][m][1] = _mm512_setzero_ps();
  int common = b[1] - b[0];
  for (int i = 1; i < S; ++i) common = std::min(common, b[i + 1] - b[i]);
  for (int kk = 0; kk < common; ++kk) {
    for (int i = 0; i < S; ++i) {
      const int k = b[i] + kk;
      const float* pk = panel + static_cast<int64_t>(k) * kPanel;
      if (kPrefetchAhead) {
        _mm_prefetch(reinterpret_cast<const char*>(pk + kPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(pk + kPrefetch + 16), _MM_HINT_T0);
      }
      const __m512 w0 = _mm512_loadu_ps(pk), w1 = _mm512_loadu_ps(pk + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
        a[i][m][0] = _mm512_fmadd_ps(xb, w0, a[i][m][0]);
        a[i][m][1] = _mm512_fmadd_ps(xb, w1, a[i][m][1]);
      }
    }
  }
  for (int i = 0; i < S; ++i) {  // segments longer than the common length (K % 8 != 0)
    for (int k = b[i] + common; k < b[i + 1]; ++k) {
      const float* pk = panel + static_cast<int64_t>(k) * kPanel;
      const __m512 w0 = _mm512_loadu_ps(pk), w1 = _mm512_loadu_ps(pk + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
        a[i][m][0] = _mm512_fmadd_ps(xb, w0, a[i][m][0]);
        a[i][m][1] = _mm512_fmadd_ps(xb, w1, a[i][m][1]);
      }
    }
  }
  for (int i = 0; i < S; ++i)
    for (int m = 0; m < MR; ++m) { part[i][m][0] = a[i][m][0]; part[i][m][1] = a[i][m][1]; }
}

// MR rows x one panel: all 8 segments, S at a time, then the fixed combine + bias.
template <int MR, int S, bool kPrefetchAhead>
void panel_rows(const float* x, int64_t ldx, const float* panel, int K, float* y, int64_t ldy, const float* bias,
                int n0, int valid) {
  int b[kSegments + 1];
  for (int s = 0; s <= kSegments; ++s) b[s] = seg_begin(K, s);
  __m512 part[kSegments][kMaxRows][2];
  for (int s0 = 0; s0 < kSegments; s0 += S) segments<MR, S, kPrefetchAhead>(x, ldx, panel, b + s0, part + s0);
  for (int m = 0; m < MR; ++m)
    store_panel(y + m * ldy, combine(&part[0][m][0], kMaxRows * 2), combine(&part[0][m][1], kMaxRows * 2), bias, n0,
                valid);
}

// Streams per pass (measured on the dev machine, 210 SmolLM2 matrices, 1 thread): 1 row reads 8
// segments at once (one stream alone reads ~10 GB/s, MKL's GEMV ~12), 2-4 rows 4 at once (34-35 ms vs
// 37-38 with one stream and prefetching), 5-12 rows one segment at a time with software prefetch.
void panel_any_rows(const float* x, int64_t M, int K, const float* panel, float* y, int64_t ldy, const float* bias,
                    int n0, int valid) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    const float* xm = x + m0 * K;
    float* ym = y + m0 * ldy;
    switch (mr) {
      case 1: panel_rows<1, 8, false>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 2: panel_rows<2, 4, false>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 3: panel_rows<3, 4, false>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 4: panel_rows<4, 4, false>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 5: panel_rows<5, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 6: panel_rows<6, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 7: panel_rows<7, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 8: panel_rows<8, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 9: panel_rows<9, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 10: panel_rows<10, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 11: panel_rows<11, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      default: panel_rows<12, 1, true>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
    }
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "packed_linear: float32 only, got ", x.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear: packed weight must be a contiguous [ceil(N/32), K, 32] tensor");
  const int64_t K = packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "packed_linear: input has ", x.size(-1), " features, the weight expects ", K);
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
              "packed_linear: out_features ", out_features, " does not match ", packed.size(0), " panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features,
                "packed_linear: bias must be a contiguous float32 [out_features] tensor");
    b = bias->data_ptr<float>();
  }
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty({M, out_features}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panels = packed.size(0);
  if (M > 0) {
    at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int n0 = static_cast<int>(p * kPanel);
        const int valid = static_cast<int>(std::min<int64_t>(kPanel, out_features - n0));
        panel_any_rows(xp, M, static_cast<int>(K), pp + p * K * kPanel, yp + n0, out_features, b, n0, valid);
      }
    });
  }
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(dflash_trt, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_trt, CPU, m) { m.impl("packed_linear", &packed_linear); }
