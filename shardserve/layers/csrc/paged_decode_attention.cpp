// Paged decode attention on CPU: one query token per sequence, keys and values read straight
// from the block pool (no gather copy). Work items are (sequence, kv head) pairs, spread over
// OpenMP threads; the G query heads that share a kv head are handled together, so each cached
// key and value row is read from memory once for all G heads. Accumulation is in float32 whatever
// the cache dtype.
//
// With AVX-512 an item is attention_rows::attend_rows over its G heads as G query rows: the
// arithmetic the prefill kernel runs for the same token, so a token decoded here and one
// recomputed by a prefill (a resumed request) get the same bits. The next block's keys and values
// are prefetched while one is used, and a thread's next item's keys while it reads this item's
// values (the cache reads come from DRAM at decode batch sizes). With AVX2 and no AVX-512 (head_dim
// a multiple of 8) an item is attention_avx2::attend_one, again the arithmetic the prefill kernel
// runs on such CPUs; otherwise a portable loop does the same math in another order.
//
//   q            [B, H, D]                 (float32 or bfloat16, contiguous)
//   k/v cache    [KV, num_blocks, bs, D]   (same dtype, contiguous)
//   block_table  [B, max_blocks] int64     context_lens [B] int64
//   out          [B, H, D]
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include "vector_math.h"
#endif
#if defined(__AVX512F__)
#include "attention_rows.h"
#endif
#include "attention_avx2.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
void attend_one_portable(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
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
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t context_len,
                int64_t kv_head, int64_t num_blocks, int64_t block_size, int64_t group, int64_t head_dim,
                float scale, T* out, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                std::vector<float>& tile) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (attention_avx2::supported(head_dim)) {
    attention_avx2::attend_one<T>(q, k_cache, v_cache, table, context_len, kv_head, num_blocks, block_size, group,
                                  head_dim, scale, out, scores, acc, qf);
    return;
  }
#endif
  attend_one_portable<T>(q, k_cache, v_cache, table, context_len, kv_head, num_blocks, block_size, group, head_dim,
                         scale, out, scores, acc, qf, tile);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_table, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
#if defined(__AVX512F__)
  const bool rows_kernel = attention_rows::supported(head_dim);
#else
  const bool rows_kernel = false;
#endif
  // Sequences longest first, each thread taking the next item not yet taken, so threads finish
  // together when contexts differ (a static split in batch order left one thread with most of
  // the long ones). An item's result does not depend on which thread computes it.
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  const int64_t num_items = num_seqs * num_kv_heads;
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next_item{0};
#if defined(__AVX512F__)
  auto upcoming = [&](int64_t item) {
    attention_rows::Upcoming<T> next;
    if (item < num_items) {
      const int64_t seq = order[item / num_kv_heads];
      next.k_base = k_ptr + (item % num_kv_heads) * num_blocks * block_size * head_dim;
      next.table = table_ptr + seq * max_blocks;
      next.context_len = len_ptr[seq];
    }
    return next;
  };
#endif
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, qf(group * head_dim), tile(block_size * head_dim);
#if defined(__AVX512F__)
    attention_rows::Workspace ws;
    std::vector<const T*> q_rows(group);
    std::vector<T*> out_rows(group);
    std::vector<int64_t> row_pos(group);
#endif
    for (int64_t w = begin; w < end; ++w) {
      // the item after this one is taken now, so that its keys can be prefetched during this one
      for (int64_t item = next_item++, following; item < num_items; item = following) {
        following = next_item++;
        const int64_t seq = order[item / num_kv_heads], kv_head = item % num_kv_heads;
        const int64_t offset = (seq * num_heads + kv_head * group) * head_dim;
        const int64_t* table = table_ptr + seq * max_blocks;
#if defined(__AVX512F__)
        if (rows_kernel) {  // the G heads as G query rows at the sequence's last position
          const int64_t head_elems = num_blocks * block_size * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            q_rows[g] = q_ptr + offset + g * head_dim;
            out_rows[g] = out_ptr + offset + g * head_dim;
            row_pos[g] = len_ptr[seq] - 1;
          }
          attention_rows::attend_rows<T>(q_rows.data(), group, row_pos.data(), k_ptr + kv_head * head_elems,
                                         v_ptr + kv_head * head_elems, table, len_ptr[seq], block_size, head_dim,
                                         static_cast<float>(scale), ws, out_rows.data(), upcoming(following));
          continue;
        }
#endif
        attend_one<T>(q_ptr + offset, k_ptr, v_ptr, table, len_ptr[seq], kv_head, num_blocks, block_size, group,
                      head_dim, static_cast<float>(scale), out_ptr + offset, scores, acc, qf, tile);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_table, at::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_table and context_lens must be int64");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_cache, v_cache, block_table.contiguous(), context_lens.contiguous(), scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q, k_cache, v_cache, block_table.contiguous(), context_lens.contiguous(), scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

// Registered as torch ops (not a pybind module: torch/extension.h alone took 24 s of each
// compile, ATen and the op registry 8 s). A torch op call lets go of the GIL, as a server
// running the engine in a thread beside its HTTP event loop needs.
TORCH_LIBRARY(shardserve_paged_decode_attention, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor context_lens, float scale) -> Tensor", &paged_decode_attention);
}
