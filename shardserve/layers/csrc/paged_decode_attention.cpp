// Paged decode attention on CPU: one query token per sequence, keys and values read straight
// from the block pool (no gather copy). Work items are (sequence, kv head) pairs, spread over
// OpenMP threads; the G query heads that share a kv head are handled together: each cached block
// of keys (then values) is widened to float32 once into a small tile and used by all G heads.
// Accumulation is in float32 whatever the cache dtype.
//
//   q            [B, H, D]                 (float32 or bfloat16, contiguous)
//   k/v cache    [KV, num_blocks, bs, D]   (same dtype, contiguous)
//   block_table  [B, max_blocks] int64     context_lens [B] int64
//   out          [B, H, D]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t group, int64_t head_dim,
                float scale, T* out, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                std::vector<float>& tile) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(q[g * head_dim + d]) * scale;
  scores.resize(group * context_len);
  for (int64_t start = 0; start < context_len; start += block_size) {
    const int64_t n = std::min(block_size, context_len - start);
    const T* keys = k_cache + (kv_head * num_blocks + table[start / block_size]) * block_size * head_dim;
    for (int64_t i = 0; i < n * head_dim; ++i) tile[i] = to_float(keys[i]);  // widen once, use G times
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = &qf[g * head_dim];
      float* s = &scores[g * context_len + start];
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = &tile[t * head_dim];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kt[d];
        s[t] = dot;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {  // softmax per query head
    float* s = &scores[g * context_len];
    float max_score = -INFINITY;
    for (int64_t t = 0; t < context_len; ++t) max_score = std::max(max_score, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < context_len; ++t) { s[t] = std::exp(s[t] - max_score); sum += s[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
  }
  acc.assign(group * head_dim, 0.f);
  for (int64_t start = 0; start < context_len; start += block_size) {
    const int64_t n = std::min(block_size, context_len - start);
    const T* values = v_cache + (kv_head * num_blocks + table[start / block_size]) * block_size * head_dim;
    for (int64_t i = 0; i < n * head_dim; ++i) tile[i] = to_float(values[i]);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = &scores[g * context_len + start];
      float* a = &acc[g * head_dim];
      for (int64_t t = 0; t < n; ++t) {
        const float pt = p[t];
        const float* vt = &tile[t * head_dim];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += pt * vt[d];
      }
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_table, const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, qf(group * head_dim), tile(block_size * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t offset = (seq * num_heads + kv_head * group) * head_dim;
      attend_one<T>(q_ptr + offset, k_ptr, v_ptr, table_ptr + seq * max_blocks, len_ptr[seq], kv_head,
                    num_blocks, block_size, group, head_dim, static_cast<float>(scale), out_ptr + offset,
                    scores, acc, qf, tile);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_table and context_lens must be int64");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat32) {
    run<float>(q, k_cache, v_cache, block_table.contiguous(), context_lens.contiguous(), scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    run<c10::BFloat16>(q, k_cache, v_cache, block_table.contiguous(), context_lens.contiguous(), scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
