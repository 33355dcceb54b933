// KV injection (DFlash paper sec. 3.2; z-lab/dflash dflash/model.py), fused for the CPU (its CUDA twin: kv_inject.cu).
//
// The context tokens' fused target features H go through every drafter layer's OWN k_proj / v_proj
// (one matrix product over the concatenated weights, done by the caller), and then, per layer and KV
// head, this op applies k_norm (RMSNorm over head_dim) and RoPE (rotate-half, NeoX) to K and writes K
// and V into the drafter's context cache at each token's absolute position: one pass over the
// projections instead of, per layer, a norm, a rotation, two transposes and two index_put's.
//
//   kv        [n, c, L * 2 * H * D] float32, contiguous: per token, layer l's K (H * D values) then its V
//   k_norm    [L, D] float32: layer l's k_norm weight
//   eps       k_norm's epsilon
//   cos, sin  [n, c, D] float32: RoPE of each token's position (RotaryEmbedding)
//   cache     [2, L, B, H, cap, D] float32 (KVCache.buffer), written in place
//   rows      [n] int64: the cache row of each of the n sequences
//   positions [n, c] int64: the slot (absolute position) of each token, < cap
//
// Every argument is checked before the first write: a dtype, layout or shape it does not take is a
// RuntimeError naming the tensor, a row or position outside the cache an IndexError naming its index.
//
// Same arithmetic as the PyTorch reference (DFlashDrafter.context_kv + KVCache.write): the mean of
// squares is summed in double (the reference sums float32 in its own order), so K may differ from it in
// the last bit; V is copied exactly.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <utility>

namespace {

void kv_inject(const at::Tensor& kv, const at::Tensor& k_norm, double eps, const at::Tensor& cos,
               const at::Tensor& sin, at::Tensor cache, const at::Tensor& rows, const at::Tensor& positions) {
  // each argument checked by name: a message naming the tensor, its dtype or its layout
  const std::pair<const char*, const at::Tensor*> tensors[] = {
      {"kv", &kv}, {"k_norm", &k_norm}, {"cos", &cos}, {"sin", &sin}, {"cache", &cache}, {"rows", &rows},
      {"positions", &positions}};
  for (const auto& [name, t] : tensors) {
    const bool index = t == &rows || t == &positions;
    const at::ScalarType want = index ? at::kLong : at::kFloat;
    TORCH_CHECK(t->scalar_type() == want, "kv_inject: ", name, " must be ", index ? "int64" : "float32", ", got ",
                t->scalar_type());
    TORCH_CHECK(t->is_contiguous(), "kv_inject: ", name, " must be contiguous (",
                t == &cache ? "it is written in place: allocate it so" : "call .contiguous() on it", "), got strides ",
                t->strides(), " for sizes ", t->sizes());
  }
  TORCH_CHECK(cache.dim() == 6 && cache.size(0) == 2, "kv_inject: cache must be [2, L, B, H, cap, D], got ",
              cache.sizes());
  const int64_t L = cache.size(1), B = cache.size(2), H = cache.size(3), cap = cache.size(4), D = cache.size(5);
  TORCH_CHECK(D % 2 == 0, "kv_inject: head_dim must be even for RoPE, got ", D);
  TORCH_CHECK(positions.dim() == 2, "kv_inject: positions must be [n, c], got ", positions.sizes());
  const int64_t n = positions.size(0), c = positions.size(1);
  TORCH_CHECK(kv.dim() == 3 && kv.size(0) == n && kv.size(1) == c && kv.size(2) == L * 2 * H * D,
              "kv_inject: kv must be [n, c, L * 2 * H * D] = [", n, ", ", c, ", ", L * 2 * H * D, "], got ", kv.sizes());
  TORCH_CHECK(k_norm.dim() == 2 && k_norm.size(0) == L && k_norm.size(1) == D, "kv_inject: k_norm must be [L, D] = [",
              L, ", ", D, "], got ", k_norm.sizes());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == n && cos.size(1) == c &&
                  cos.size(2) == D,
              "kv_inject: cos and sin must be [n, c, D] = [", n, ", ", c, ", ", D, "], got ", cos.sizes(), " and ",
              sin.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == n, "kv_inject: rows must be [n] = [", n, "], got ", rows.sizes());
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_INDEX(row[r] >= 0 && row[r] < B, "kv_inject: rows[", r, "]: row ", row[r], " outside the cache's ", B,
                      " rows");
    for (int64_t t = 0; t < c; ++t) {
      const int64_t p = pos[r * c + t];
      TORCH_CHECK_INDEX(p >= 0 && p < cap, "kv_inject: positions[", r, ", ", t, "]: position ", p,
                        " outside the cache's capacity ", cap);
    }
  }
  const float* src = kv.data_ptr<float>();
  const float* wn = k_norm.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* out = cache.data_ptr<float>();
  const int64_t half = D / 2;
  const float epsf = static_cast<float>(eps);
  // cache strides: [2, L, B, H, cap, D]
  const int64_t s_pos = D, s_head = cap * D, s_row = H * s_head, s_layer = B * s_row, s_kv = L * s_layer;
  at::parallel_for(0, n * c, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / c;
      const float* tok = src + i * (L * 2 * H * D);
      const float* cr = cs + i * D;
      const float* sr = sn + i * D;
      const int64_t base = row[r] * s_row + pos[i] * s_pos;
      for (int64_t l = 0; l < L; ++l) {
        const float* k_src = tok + l * 2 * H * D;
        const float* v_src = k_src + H * D;
        const float* w = wn + l * D;
        for (int64_t h = 0; h < H; ++h) {
          const float* k = k_src + h * D;
          double ss = 0.0;
          for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(k[d]) * k[d];
          const float mean = static_cast<float>(ss / static_cast<double>(D));
          const float inv = 1.0f / std::sqrt(mean + epsf);
          float* k_dst = out + l * s_layer + h * s_head + base;
          float* v_dst = k_dst + s_kv;
          for (int64_t d = 0; d < half; ++d) {
            const float a = w[d] * (k[d] * inv);                 // k_norm, first half
            const float b = w[d + half] * (k[d + half] * inv);   // second half
            k_dst[d] = a * cr[d] + (-b) * sr[d];                 // x * cos + rotate_half(x) * sin
            k_dst[d + half] = b * cr[d + half] + a * sr[d + half];
          }
          const float* v = v_src + h * D;
          for (int64_t d = 0; d < D; ++d) v_dst[d] = v[d];
        }
      }
    }
  });
}

}  // namespace

// This kernel under its own name, `kv_inject_cpu`. The public op `kv_inject` (schema and CPU / CUDA kernels
// registered in dflash_trt/ops/__init__.py, shared with kv_inject.cu) calls it for CPU tensors, loading this
// library first (building it once), so a call made before the library is loaded runs, or says why it cannot.
TORCH_LIBRARY_FRAGMENT(dflash_trt, m) {
  m.def("kv_inject_cpu(Tensor kv, Tensor k_norm, float eps, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor rows, "
        "Tensor positions) -> ()");
}

TORCH_LIBRARY_IMPL(dflash_trt, CPU, m) { m.impl("kv_inject_cpu", &kv_inject); }
