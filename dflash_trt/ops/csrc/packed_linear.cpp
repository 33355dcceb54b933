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
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then + bias. A 1-row call runs the 8 segments
// as 8 interleaved memory streams (one stream reads ~10 GB/s on the dev machine, 8 match MKL's
// single-row 12 GB/s); more rows run up to 12 rows per pass over a panel, prefetching ahead.
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

// One segment [k0, k1) of MR rows: acc[m] = sum_k x[m][k] * P[k][:] (FMA, increasing k).
template <int MR>
inline void segment_rows(const float* x, int64_t ldx, const float* panel, int k0, int k1, __m512 (*out)[2]) {
  __m512 a[MR][2];
  for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
  for (int k = k0; k < k1; ++k) {
    const float* pk = panel + static_cast<int64_t>(k) * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(pk + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pk + kPrefetch + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(pk), w1 = _mm512_loadu_ps(pk + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * ldx + k]);
      a[m][0] = _mm512_fmadd_ps(b, w0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(b, w1, a[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) { out[m][0] = a[m][0]; out[m][1] = a[m][1]; }
}

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

// One row, 8 segments streamed together; per segment the same FMA order as segment_rows.
void panel_one_row(const float* x, const float* panel, int K, float* y, const float* bias, int n0, int valid) {
  int b[kSegments + 1];
  for (int s = 0; s <= kSegments; ++s) b[s] = seg_begin(K, s);
  int common = K;
  for (int s = 0; s < kSegments; ++s) common = std::min(common, b[s + 1] - b[s]);
  __m512 a[kSegments][2];
  for (int s = 0; s < kSegments; ++s) a[s][0] = a[s][1] = _mm512_setzero_ps();
  for (int i = 0; i < common; ++i) {
    for (int s = 0; s < kSegments; ++s) {
      const int k = b[s] + i;
      const float* pk = panel + static_cast<int64_t>(k) * kPanel;
      const __m512 xb = _mm512_set1_ps(x[k]);
      a[s][0] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(pk), a[s][0]);
      a[s][1] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(pk + 16), a[s][1]);
    }
  }
  for (int s = 0; s < kSegments; ++s) {  // segments longer than the common length (K % 4 != 0)
    for (int k = b[s] + common; k < b[s + 1]; ++k) {
      const float* pk = panel + static_cast<int64_t>(k) * kPanel;
      const __m512 xb = _mm512_set1_ps(x[k]);
      a[s][0] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(pk), a[s][0]);
      a[s][1] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(pk + 16), a[s][1]);
    }
  }
  store_panel(y, combine(&a[0][0], 2), combine(&a[0][1], 2), bias, n0, valid);
}

template <int MR>
void panel_rows(const float* x, int64_t ldx, const float* panel, int K, float* y, int64_t ldy, const float* bias,
                int n0, int valid) {
  __m512 part[kSegments][MR][2];
  for (int s = 0; s < kSegments; ++s) segment_rows<MR>(x, ldx, panel, seg_begin(K, s), seg_begin(K, s + 1), part[s]);
  for (int m = 0; m < MR; ++m) {
    store_panel(y + m * ldy, combine(&part[0][m][0], MR * 2), combine(&part[0][m][1], MR * 2), bias, n0, valid);
  }
}

void panel_any_rows(const float* x, int64_t M, int K, const float* panel, float* y, int64_t ldy, const float* bias,
                    int n0, int valid) {
  if (M == 1) {
    panel_one_row(x, panel, K, y, bias, n0, valid);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    const float* xm = x + m0 * K;
    float* ym = y + m0 * ldy;
    switch (mr) {
      case 1: panel_rows<1>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 2: panel_rows<2>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 3: panel_rows<3>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 4: panel_rows<4>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 5: panel_rows<5>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 6: panel_rows<6>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 7: panel_rows<7>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 8: panel_rows<8>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 9: panel_rows<9>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 10: panel_rows<10>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      case 11: panel_rows<11>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
      default: panel_rows<12>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
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
