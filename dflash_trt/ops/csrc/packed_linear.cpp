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
// Weight formats (chosen at pack time, dflash_trt/ops/packed_linear.py; each one EXACT for the weights
// it is used for, so every format gives the float32 format's results bit for bit):
//   float32:  P [ceil(N/32), K, 32] float.
//   bfloat16: P [ceil(N/32), K, 32] bf16, for weights that are bf16 values (a bf16 checkpoint run in float32).
//   q8_0:     P [ceil(N/32), K, 32] int8 q and D [ceil(N/32), K/32, 32] fp16 d: W = d * q (GGUF Q8_0, the
//             product is exact in float32).
//   q4_1:     P [ceil(N/32), K, 16] uint8: byte j holds q of output j (low nibble) and j + 16 (high), and
//             S [ceil(N/32), K/32, 2, 32] fp16 (d, then m): W = d * q + m (GGUF Q4_1; d * q is exact, one rounding).
// Up to 16 rows (decode, verify, a draft block) dequantize a non-float32 panel in registers, 8 rows per
// pass (fused_panel_rows); more rows (a prefill) expand it to float32 once in a per-thread cache-resident
// buffer and run the float32 path on it. A call reads 2x (bf16) to 6.4x (q4_1) fewer bytes from memory.
//
// Arithmetic (identical for every row count M and thread count, so results are batch-invariant
// bit for bit): K is cut into 8 segments [K s / 8, K (s + 1) / 8); within a segment each output
// accumulates x[k] * W[n][k] with fused multiply-adds in increasing k from 0.0f; the output is
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then + bias. How many segments are read at once
// (memory streams) and how many rows share a pass (up to 12) change only the speed (panel_any_rows).
//
// Instruction sets: one build per CPU (dflash_trt/ops/__init__.py picks the flags): AVX-512F (a panel is
// two 16-float vectors) or AVX2 + FMA + F16C (four 8-float vectors, e.g. AMD Zen 2/3). Every output lane
// runs the same operations in the same order in both (loads, the exact dequantization, the FMA chains,
// the combine, the bias add), so both builds give the same bits; only rows per pass and streams differ.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kPanel = 32;   // outputs per panel: two 16-float AVX-512 vectors, or four 8-float AVX2 ones
constexpr int kSegments = 8;

inline int seg_begin(int K, int s) { return static_cast<int>(static_cast<int64_t>(K) * s / kSegments); }

enum class Format { kF32, kBF16, kQ8_0, kQ4_1 };

// Each ISA section below defines the same kernels (store/expand a panel, the fused few-row pass, the
// any-row float32 pass) and the row thresholds the op uses; the arithmetic of every output lane is the
// same in both, so both give the same bits.
#if defined(__AVX512F__)

constexpr int kMaxRows = 12;  // rows per pass: 24 accumulators of the 32 zmm registers (8: prefill 7% slower)
constexpr int kPrefetch = 1024;  // floats ahead (4 KiB) in each stream

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

// One panel's K x 32 weights as float32 into out[K][32], exactly (see the formats above).
void expand_panel(Format fmt, const void* data, const at::Half* scales, int K, float* out) {
  if (fmt == Format::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(data);
    for (int64_t i = 0; i < static_cast<int64_t>(K) * kPanel; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    return;
  }
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales);
  for (int kb = 0; kb < K / kPanel; ++kb) {
    if (fmt == Format::kQ8_0) {
      const int8_t* q = static_cast<const int8_t*>(data) + static_cast<int64_t>(kb) * kPanel * kPanel;
      const uint16_t* d = sc + kb * kPanel;
      const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
      const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + 16)));
      for (int k = 0; k < kPanel; ++k) {
        const int8_t* qk = q + k * kPanel;
        float* o = out + (static_cast<int64_t>(kb) * kPanel + k) * kPanel;
        const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qk)));
        const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qk + 16)));
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d0));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d1));
      }
    } else {  // kQ4_1
      const uint8_t* q = static_cast<const uint8_t*>(data) + static_cast<int64_t>(kb) * kPanel * 16;
      const uint16_t* dm = sc + kb * 2 * kPanel;
      const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm)));
      const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 16)));
      const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 32)));
      const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + 48)));
      const __m512i low = _mm512_set1_epi32(0xF);
      for (int k = 0; k < kPanel; ++k) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16)));
        float* o = out + (static_cast<int64_t>(kb) * kPanel + k) * kPanel;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d0, m0));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d1, m1));
      }
    }
  }
}

// The weights of 32 outputs at input k, as float32 (two vectors), for a quantized or bf16 panel; the
// same values expand_panel writes. Scales (d, m) are those of k's block, loaded by the caller.
template <Format F>
inline void weights_at(const char* data, int k, __m512 d0, __m512 d1, __m512 m0, __m512 m1, __m512* w0, __m512* w1) {
  if constexpr (F == Format::kQ4_1) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + k * 16)));
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))), d0, m0);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d1, m1);
  } else if constexpr (F == Format::kQ8_0) {
    const char* q = data + k * kPanel;
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), d0);
    *w1 = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), d1);
  } else {  // kBF16
    const uint16_t* h = reinterpret_cast<const uint16_t*>(data) + k * kPanel;
    *w0 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))), 16));
    *w1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16))), 16));
  }
}

// MR <= 4 rows x one quantized / bf16 panel without expanding it: each weight is computed in registers
// and used at once (a decode step or a short verify: fewer instructions and no buffer round trip). The
// same segments, FMA chains and combine as panel_rows, over the same float32 weights: the same bits.
template <int MR, Format F>
void fused_panel_rows(const float* x, int64_t ldx, const char* data, const uint16_t* sc, int K, float* y, int64_t ldy,
                      const float* bias, int n0, int valid) {
  constexpr int bytes_per_k = F == Format::kQ4_1 ? 16 : F == Format::kQ8_0 ? kPanel : 2 * kPanel;
  __m512 part[kSegments][MR][2];
  __m512 d0 = _mm512_setzero_ps(), d1 = d0, m0 = d0, m1 = d0;
  for (int s = 0; s < kSegments; ++s) {
    __m512 a[MR][2];
    for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
    const int end = seg_begin(K, s + 1);
    for (int k = seg_begin(K, s); k < end;) {
      const int block_end = F == Format::kBF16 ? end : std::min(end, (k / kPanel + 1) * kPanel);
      if constexpr (F != Format::kBF16) {
        const uint16_t* blk = sc + (k / kPanel) * (F == Format::kQ4_1 ? 2 : 1) * kPanel;
        d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
        if constexpr (F == Format::kQ4_1) {
          m0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
          m1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 48)));
        }
      }
      for (; k < block_end; ++k) {
        _mm_prefetch(data + static_cast<int64_t>(k) * bytes_per_k + 4096, _MM_HINT_T0);
        __m512 w0, w1;
        weights_at<F>(data, k, d0, d1, m0, m1, &w0, &w1);
        for (int m = 0; m < MR; ++m) {
          const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
          a[m][0] = _mm512_fmadd_ps(xb, w0, a[m][0]);
          a[m][1] = _mm512_fmadd_ps(xb, w1, a[m][1]);
        }
      }
    }
    for (int m = 0; m < MR; ++m) { part[s][m][0] = a[m][0]; part[s][m][1] = a[m][1]; }
  }
  for (int m = 0; m < MR; ++m)
    store_panel(y + m * ldy, combine(&part[0][m][0], MR * 2), combine(&part[0][m][1], MR * 2), bias, n0, valid);
}

// Streams per pass (measured on the dev machine, 210 SmolLM2 matrices, 1 thread): 1 row reads 8
// segments at once (one stream alone reads ~10 GB/s, MKL's GEMV ~12), 2-4 rows 4 at once (34-35 ms vs
// 37-38 with one stream and prefetching), 5-12 rows one segment at a time with software prefetch.
// A chunk of mr <= kMaxRows rows of x (K apart) x one float32 panel into y (ldy apart).
void panel_chunk(int mr, const float* xm, int K, const float* panel, float* ym, int64_t ldy, const float* bias,
                 int n0, int valid) {
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

#else  // AVX2 + FMA + F16C: the same kernels on 8-float vectors, a panel being four of them

constexpr int kLanes = 8;
constexpr int kVecs = kPanel / kLanes;
constexpr int kMaxRows = 3;  // rows per float32 pass (prefill: 4 or 8 spill registers and run 1.6-2.7x slower)
constexpr int kPrefetch = 1024;  // floats ahead (4 KiB) in each stream

inline void store_panel(float* y, const __m256* v, const float* bias, int n0, int valid) {
  if (valid >= kPanel) {
    for (int i = 0; i < kVecs; ++i)
      _mm256_storeu_ps(y + i * kLanes, bias == nullptr ? v[i] : _mm256_add_ps(v[i], _mm256_loadu_ps(bias + n0 + i * kLanes)));
    return;
  }
  alignas(32) float tmp[kPanel];  // a ragged last panel: the same single float add, lane by lane
  for (int i = 0; i < kVecs; ++i) _mm256_store_ps(tmp + i * kLanes, v[i]);
  for (int j = 0; j < valid; ++j) y[j] = bias == nullptr ? tmp[j] : tmp[j] + bias[n0 + j];
}

// part[s * stride] is segment s's vector: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
inline __m256 combine(const __m256* v, int stride) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[stride]), _mm256_add_ps(v[2 * stride], v[3 * stride])),
                       _mm256_add_ps(_mm256_add_ps(v[4 * stride], v[5 * stride]), _mm256_add_ps(v[6 * stride], v[7 * stride])));
}

inline __m256 load_half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Vector V (outputs 8 V .. 8 V + 7) of the panel's weights at input k as float32, from a quantized or
// bf16 panel: the values of the AVX-512 section, lane for lane. d, m: vector V's scales of k's block.
template <Format F, int V>
inline __m256 weight_vec(const char* data, int k, __m256 d, __m256 m) {
  if constexpr (F == Format::kQ4_1) {
    // byte j holds output j (low nibble) and output 16 + j (high): V = 0, 1 low nibbles of bytes 0-7, 8-15;
    // V = 2, 3 their high nibbles
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + k * 16 + (V & 1) * kLanes));
    if constexpr (V >= 2) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(0xF));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, m);
  } else if constexpr (F == Format::kQ8_0) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + k * kPanel + V * kLanes));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
  } else {  // kBF16
    const uint16_t* h = reinterpret_cast<const uint16_t*>(data) + k * kPanel + V * kLanes;
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))), 16));
  }
}

// Vector V's scales of k's block: d (and m for q4_1).
template <Format F, int V>
inline void block_scales(const uint16_t* sc, int k, __m256* d, __m256* m) {
  const uint16_t* blk = sc + (k / kPanel) * (F == Format::kQ4_1 ? 2 : 1) * kPanel;
  *d = load_half8(blk + V * kLanes);
  if constexpr (F == Format::kQ4_1) *m = load_half8(blk + kPanel + V * kLanes);
}

template <Format F>
void expand_panel_as(const char* data, const uint16_t* sc, int K, float* out) {
  __m256 d[kVecs] = {}, m[kVecs] = {};
  for (int k = 0; k < K; ++k) {
    float* o = out + static_cast<int64_t>(k) * kPanel;
    if (F != Format::kBF16 && k % kPanel == 0) {
      block_scales<F, 0>(sc, k, &d[0], &m[0]);
      block_scales<F, 1>(sc, k, &d[1], &m[1]);
      block_scales<F, 2>(sc, k, &d[2], &m[2]);
      block_scales<F, 3>(sc, k, &d[3], &m[3]);
    }
    _mm256_storeu_ps(o, weight_vec<F, 0>(data, k, d[0], m[0]));
    _mm256_storeu_ps(o + kLanes, weight_vec<F, 1>(data, k, d[1], m[1]));
    _mm256_storeu_ps(o + 2 * kLanes, weight_vec<F, 2>(data, k, d[2], m[2]));
    _mm256_storeu_ps(o + 3 * kLanes, weight_vec<F, 3>(data, k, d[3], m[3]));
  }
}

// One panel's K x 32 weights as float32 into out[K][32], exactly.
void expand_panel(Format fmt, const void* data, const at::Half* scales, int K, float* out) {
  const char* p = static_cast<const char*>(data);
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales);
  if (fmt == Format::kBF16) expand_panel_as<Format::kBF16>(p, sc, K, out);
  else if (fmt == Format::kQ8_0) expand_panel_as<Format::kQ8_0>(p, sc, K, out);
  else expand_panel_as<Format::kQ4_1>(p, sc, K, out);
}

// S consecutive segments of MR float32 rows streamed together; part[s][m][v] gets segment s's sums
// (an FMA chain in increasing k from 0, whatever S and MR).
template <int MR, int S>
inline void segments(const float* x, int64_t ldx, const float* panel, const int* b, __m256 (*part)[kMaxRows][kVecs]) {
  __m256 a[S][MR][kVecs];
  for (int i = 0; i < S; ++i)
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kVecs; ++v) a[i][r][v] = _mm256_setzero_ps();
  // the streams advance together over their common length, then each finishes its own (K % 8 != 0)
  int common = b[1] - b[0];
  for (int i = 1; i < S; ++i) common = std::min(common, b[i + 1] - b[i]);
  auto step = [&](int i, int k) {
    const float* pk = panel + static_cast<int64_t>(k) * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(pk + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pk + kPrefetch + 16), _MM_HINT_T0);
    __m256 xb[MR];
    for (int r = 0; r < MR; ++r) xb[r] = _mm256_set1_ps(x[r * ldx + k]);
    for (int v = 0; v < kVecs; ++v) {
      const __m256 w = _mm256_loadu_ps(pk + v * kLanes);
      for (int r = 0; r < MR; ++r) a[i][r][v] = _mm256_fmadd_ps(xb[r], w, a[i][r][v]);
    }
  };
  for (int kk = 0; kk < common; ++kk)
    for (int i = 0; i < S; ++i) step(i, b[i] + kk);
  for (int i = 0; i < S; ++i)
    for (int k = b[i] + common; k < b[i + 1]; ++k) step(i, k);
  for (int i = 0; i < S; ++i)
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < kVecs; ++v) part[i][r][v] = a[i][r][v];
}

template <int MR, int S>
void panel_rows(const float* x, int64_t ldx, const float* panel, int K, float* y, int64_t ldy, const float* bias,
                int n0, int valid) {
  int b[kSegments + 1];
  for (int s = 0; s <= kSegments; ++s) b[s] = seg_begin(K, s);
  __m256 part[kSegments][kMaxRows][kVecs];
  for (int s0 = 0; s0 < kSegments; s0 += S) segments<MR, S>(x, ldx, panel, b + s0, part + s0);
  for (int r = 0; r < MR; ++r) {
    __m256 out[kVecs];
    for (int v = 0; v < kVecs; ++v) out[v] = combine(&part[0][r][v], kMaxRows * kVecs);
    store_panel(y + r * ldy, out, bias, n0, valid);
  }
}

// A chunk of mr <= kMaxRows rows of x (K apart) x one float32 panel into y (ldy apart).
void panel_chunk(int mr, const float* xm, int K, const float* panel, float* ym, int64_t ldy, const float* bias,
                 int n0, int valid) {
  switch (mr) {
    case 1: panel_rows<1, 2>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
    case 2: panel_rows<2, 1>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
    default: panel_rows<3, 1>(xm, K, panel, K, ym, ldy, bias, n0, valid); break;
  }
}

// Segment [k0, k1) of MR rows x vectors V0 .. V0 + VB - 1 of a quantized / bf16 panel: each weight is
// dequantized in registers and used at once by every row; part[r][v] receives the FMA chains (from 0,
// in increasing k). MR x VB accumulators stay in registers (at most 8 of the 16), so the passes a call
// needs are chosen by fused_panel_rows.
template <int MR, Format F, int V0, int VB>
inline void fused_vectors(const float* x, int64_t ldx, const char* data, const uint16_t* sc, int k0, int k1,
                          __m256 (*part)[kVecs]) {
  constexpr int bytes_per_k = F == Format::kQ4_1 ? 16 : F == Format::kQ8_0 ? kPanel : 2 * kPanel;
  __m256 a[MR][VB], d[VB], m[VB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < VB; ++j) a[r][j] = _mm256_setzero_ps();
  for (int j = 0; j < VB; ++j) d[j] = m[j] = _mm256_setzero_ps();
  for (int k = k0; k < k1;) {
    const int block_end = F == Format::kBF16 ? k1 : std::min(k1, (k / kPanel + 1) * kPanel);
    if constexpr (F != Format::kBF16) {
      block_scales<F, V0>(sc, k, &d[0], &m[0]);
      if constexpr (VB >= 2) block_scales<F, V0 + 1>(sc, k, &d[1], &m[1]);
      if constexpr (VB == 4) {
        block_scales<F, V0 + 2>(sc, k, &d[2], &m[2]);
        block_scales<F, V0 + 3>(sc, k, &d[3], &m[3]);
      }
    }
    for (; k < block_end; ++k) {
      if constexpr (V0 == 0) _mm_prefetch(data + static_cast<int64_t>(k) * bytes_per_k + 4096, _MM_HINT_T0);
      __m256 w[VB];
      w[0] = weight_vec<F, V0>(data, k, d[0], m[0]);
      if constexpr (VB >= 2) w[1] = weight_vec<F, V0 + 1>(data, k, d[1], m[1]);
      if constexpr (VB == 4) {
        w[2] = weight_vec<F, V0 + 2>(data, k, d[2], m[2]);
        w[3] = weight_vec<F, V0 + 3>(data, k, d[3], m[3]);
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_set1_ps(x[r * ldx + k]);
        for (int j = 0; j < VB; ++j) a[r][j] = _mm256_fmadd_ps(xb, w[j], a[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < VB; ++j) part[r][V0 + j] = a[r][j];
}

// MR rows x one quantized / bf16 panel without expanding it (a decode step, a verify, a draft block):
// per segment, the panel's four vectors in passes of VB = 8 / MR (1-2 rows: all four at once, 3-4 rows:
// two, 5-8 rows: one), so the accumulators never spill; the same chains and combine as panel_rows.
template <int MR, Format F>
void fused_panel_rows(const float* x, int64_t ldx, const char* data, const uint16_t* sc, int K, float* y, int64_t ldy,
                      const float* bias, int n0, int valid) {
  __m256 part[kSegments][MR][kVecs];
  for (int s = 0; s < kSegments; ++s) {
    const int k0 = seg_begin(K, s), k1 = seg_begin(K, s + 1);
    if constexpr (MR <= 2) {
      fused_vectors<MR, F, 0, 4>(x, ldx, data, sc, k0, k1, part[s]);
    } else if constexpr (MR <= 4) {
      fused_vectors<MR, F, 0, 2>(x, ldx, data, sc, k0, k1, part[s]);
      fused_vectors<MR, F, 2, 2>(x, ldx, data, sc, k0, k1, part[s]);
    } else {
      fused_vectors<MR, F, 0, 1>(x, ldx, data, sc, k0, k1, part[s]);
      fused_vectors<MR, F, 1, 1>(x, ldx, data, sc, k0, k1, part[s]);
      fused_vectors<MR, F, 2, 1>(x, ldx, data, sc, k0, k1, part[s]);
      fused_vectors<MR, F, 3, 1>(x, ldx, data, sc, k0, k1, part[s]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    __m256 out[kVecs];
    for (int v = 0; v < kVecs; ++v) out[v] = combine(&part[0][r][v], MR * kVecs);
    store_panel(y + r * ldy, out, bias, n0, valid);
  }
}

#endif  // ISA sections

// M rows x one float32 panel: chunks of kMaxRows rows (the ISA section's panel_chunk).
void panel_any_rows(const float* x, int64_t M, int K, const float* panel, float* y, int64_t ldy, const float* bias,
                    int n0, int valid) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
    panel_chunk(static_cast<int>(std::min<int64_t>(kMaxRows, M - m0)), x + m0 * K, K, panel, y + m0 * ldy, ldy, bias,
                n0, valid);
}

template <Format F>
void fused_any_rows(int64_t M, const float* x, int K, const char* data, const uint16_t* sc, float* y, int64_t ldy,
                    const float* bias, int n0, int valid) {
  switch (M) {
    case 1: fused_panel_rows<1, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
    case 2: fused_panel_rows<2, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
    case 3: fused_panel_rows<3, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
    case 4: fused_panel_rows<4, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
    case 5: fused_panel_rows<5, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
    case 6: fused_panel_rows<6, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
    case 7: fused_panel_rows<7, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
    default: fused_panel_rows<8, F>(x, K, data, sc, K, y, ldy, bias, n0, valid); break;
  }
}

constexpr int kFusedMaxRows = 8;       // rows per fused pass (AVX-512: 16 accumulators + the block's scales in registers;
                                       // AVX2 spills, yet 1-8 rows cost the same: the dequantization bounds a pass)
constexpr int kFusedMaxCallRows = 16;  // more rows (a prefill): expand each panel once and share it

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& scales,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_linear: float32 only, got ", x.scalar_type(), " input");
  Format fmt;
  int bytes_per_k;  // of one panel
  switch (packed.scalar_type()) {
    case at::kFloat: fmt = Format::kF32; bytes_per_k = 4 * kPanel; break;
    case at::kBFloat16: fmt = Format::kBF16; bytes_per_k = 2 * kPanel; break;
    case at::kChar: fmt = Format::kQ8_0; bytes_per_k = kPanel; break;
    case at::kByte: fmt = Format::kQ4_1; bytes_per_k = kPanel / 2; break;
    default: TORCH_CHECK(false, "packed_linear: packed weights are float32, bfloat16, int8 (q8_0) or uint8 (q4_1), got ",
                         packed.scalar_type());
  }
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) * packed.element_size() == bytes_per_k && packed.is_contiguous(),
              "packed_linear: packed weight must be a contiguous [ceil(N/32), K, ", fmt == Format::kQ4_1 ? 16 : 32,
              "] tensor");
  const int64_t K = packed.size(1);
  const at::Half* sp = nullptr;
  if (fmt == Format::kQ8_0 || fmt == Format::kQ4_1) {
    const int64_t per_block = fmt == Format::kQ4_1 ? 2 * kPanel : kPanel;
    TORCH_CHECK(K % kPanel == 0, "packed_linear: a quantized weight needs in_features divisible by 32, got ", K);
    TORCH_CHECK(scales.has_value() && scales->defined() && scales->scalar_type() == at::kHalf &&
                    scales->is_contiguous() && scales->numel() == packed.size(0) * (K / kPanel) * per_block,
                "packed_linear: a quantized weight needs contiguous float16 scales of ", per_block,
                " per panel and 32 inputs");
    sp = scales->data_ptr<at::Half>();
  }
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
  const char* pp = static_cast<const char*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t panels = packed.size(0);
  const int64_t scales_per_panel = fmt == Format::kQ4_1 ? 2 * K : K;
  if (M > 0) {
    at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> expanded(fmt == Format::kF32 || M <= kFusedMaxCallRows ? 0 : K * kPanel);  // one panel, in cache
      for (int64_t p = begin; p < end; ++p) {
        const int n0 = static_cast<int>(p * kPanel);
        const int valid = static_cast<int>(std::min<int64_t>(kPanel, out_features - n0));
        const char* data = pp + p * K * bytes_per_k;
        const float* panel = reinterpret_cast<const float*>(data);
        const uint16_t* ps = sp == nullptr ? nullptr : reinterpret_cast<const uint16_t*>(sp + p * scales_per_panel);
        if (fmt != Format::kF32 && M <= kFusedMaxCallRows) {
          const int k = static_cast<int>(K);
          for (int64_t m0 = 0; m0 < M; m0 += kFusedMaxRows) {
            const int64_t mr = std::min<int64_t>(kFusedMaxRows, M - m0);
            const float* xm = xp + m0 * K;
            float* ym = yp + m0 * out_features + n0;
            if (fmt == Format::kQ4_1) fused_any_rows<Format::kQ4_1>(mr, xm, k, data, ps, ym, out_features, b, n0, valid);
            else if (fmt == Format::kQ8_0) fused_any_rows<Format::kQ8_0>(mr, xm, k, data, ps, ym, out_features, b, n0, valid);
            else fused_any_rows<Format::kBF16>(mr, xm, k, data, ps, ym, out_features, b, n0, valid);
          }
          continue;
        }
        if (fmt != Format::kF32) {
          expand_panel(fmt, data, reinterpret_cast<const at::Half*>(ps), static_cast<int>(K), expanded.data());
          panel = expanded.data();
        }
        panel_any_rows(xp, M, static_cast<int>(K), panel, yp + n0, out_features, b, n0, valid);
      }
    });
  }
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(dflash_trt, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? scales, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_trt, CPU, m) { m.impl("packed_linear", &packed_linear); }
