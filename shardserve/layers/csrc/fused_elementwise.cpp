// Fused elementwise ops for CPU steps, where each small torch op costs more to dispatch than to
// compute: residual-add + RMSNorm, rotary embedding + the KV-cache write, and SwiGLU's silu * up.
// Each computes what the unfused torch code computes, row by row (so results do not depend on the
// batch), in float32 internally, rounding where the reference rounds.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include "vector_math.h"
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T round_to(float x) { return static_cast<T>(x); }

// residual += delta (when given); out = weight * T(x * rsqrt(mean(x^2) + eps)), x = residual
template <typename T>
void add_rms_norm_impl(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = residual + r * hidden;
      if (delta != nullptr) {
        const T* d = delta + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) x[i] = round_to<T>(to_float(x[i]) + to_float(d[i]));
      }
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < hidden; ++i) sum_sq += to_float(x[i]) * to_float(x[i]);
      const float inv = 1.f / std::sqrt(sum_sq / hidden + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = round_to<T>(to_float(weight[i]) * to_float(round_to<T>(to_float(x[i]) * inv)));
    }
  });
}

// x * cos + rotated * sin, each product and the sum rounded to T as torch rounds them
template <typename T>
inline T rotate(T x, float rotated, T cos, T sin) {
  const float a = to_float(round_to<T>(to_float(x) * to_float(cos)));
  const float b = to_float(round_to<T>(rotated * to_float(sin)));
  return round_to<T>(a + b);
}

#if defined(__AVX512F__)
// rotate() on 16 lanes for one head of dim = 2 * half (half a multiple of 16): the same products,
// sums and roundings, so the result is bit for bit the scalar one
template <typename T>
inline void rotate_head16(const T* x, const T* c, const T* s, T* o, int64_t half) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
    const __m512 lo = _mm512_add_ps(as_stored(T(), _mm512_mul_ps(x1, load16(c + i))),
                                    as_stored(T(), _mm512_mul_ps(_mm512_xor_ps(x2, sign), load16(s + i))));
    const __m512 hi = _mm512_add_ps(as_stored(T(), _mm512_mul_ps(x2, load16(c + half + i))),
                                    as_stored(T(), _mm512_mul_ps(x1, load16(s + half + i))));
    store16(o + i, lo);
    store16(o + half + i, hi);
  }
}
#endif

// Per token t: rotate its H query and KV key heads (x * cos + rotate_half(x) * sin, rotate_half(x)
// = [-x2, x1], each product and the sum rounded to T as torch rounds them) into q_out / k_out,
// and store the rotated keys and the values at cache slot slots[t] of every kv head.
template <typename T>
void rotary_kv_impl(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* q_out, T* k_out,
                    T* k_cache, T* v_cache, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                    int64_t slots_per_head) {
  const int64_t half = dim / 2, row_heads = heads + 2 * kv_heads;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    // The cache rows written are cold (a decode step's slots lie in as many blocks as sequences):
    // ask for all of them first, so their misses overlap instead of each store waiting on its own
    for (int64_t t = begin; t < end; ++t)
      for (int64_t kv = 0; kv < kv_heads; ++kv)
        for (int64_t i = 0; i < row_bytes; i += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k_cache + (kv * slots_per_head + slots[t]) * dim) + i, 1, 3);
          __builtin_prefetch(reinterpret_cast<const char*>(v_cache + (kv * slots_per_head + slots[t]) * dim) + i, 1, 3);
        }
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * row_heads * dim;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* x = row + h * dim;
        T* o = h < heads ? q_out + (t * heads + h) * dim : k_out + (t * kv_heads + h - heads) * dim;
#if defined(__AVX512F__)
        if (half % 16 == 0) {
          rotate_head16(x, c, s, o, half);
        } else
#endif
        {  // the two halves in two loops: without the branch, each vectorizes
          for (int64_t i = 0; i < half; ++i) o[i] = rotate(x[i], -to_float(x[i + half]), c[i], s[i]);
          for (int64_t i = half; i < dim; ++i) o[i] = rotate(x[i], to_float(x[i - half]), c[i], s[i]);
        }
        if (h >= heads) std::memcpy(k_cache + ((h - heads) * slots_per_head + slots[t]) * dim, o, dim * sizeof(T));
      }
      for (int64_t kv = 0; kv < kv_heads; ++kv)
        std::memcpy(v_cache + (kv * slots_per_head + slots[t]) * dim, row + (heads + kv_heads + kv) * dim, dim * sizeof(T));
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                                     at::Tensor v_cache, at::Tensor slots, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "qkv [T, H + 2 KV, D], cos and sin [T, D] must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.scalar_type() == at::kLong,
              "caches must be contiguous and slots int64");
  const int64_t tokens = qkv.size(0), dim = qkv.size(2), kv_heads = (qkv.size(1) - heads) / 2;
  TORCH_CHECK(dim % 2 == 0 && k_cache.size(0) == kv_heads && k_cache.size(-1) == dim, "shape mismatch");
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim && slots.numel() == tokens, "shape mismatch");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && k_cache.scalar_type() == qkv.scalar_type(), "dtype mismatch");
  auto q_out = at::empty({tokens, heads, dim}, qkv.options());
  auto k_out = at::empty({tokens, kv_heads, dim}, qkv.options());
  const int64_t slots_per_head = k_cache.numel() / (kv_heads * dim);
  auto s = slots.contiguous();
  if (qkv.scalar_type() == at::kFloat) {
    rotary_kv_impl<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), s.data_ptr<int64_t>(),
                          q_out.data_ptr<float>(), k_out.data_ptr<float>(), k_cache.data_ptr<float>(),
                          v_cache.data_ptr<float>(), tokens, heads, kv_heads, dim, slots_per_head);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    rotary_kv_impl<B>(qkv.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(), s.data_ptr<int64_t>(),
                      q_out.data_ptr<B>(), k_out.data_ptr<B>(), k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), tokens,
                      heads, kv_heads, dim, slots_per_head);
  } else {
    TORCH_CHECK(false, "rotary_kv supports float32 and bfloat16");
  }
  return {q_out, k_out};
}

// out = T(T(silu(gate)) * up) for the halves [gate | up] of each row of gate_up [rows, 2d], as
// F.silu(gate) * up rounds. silu(x) = x * sigmoid(x), sigmoid from e^-|x| (no overflow either way).
template <typename T>
void silu_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t d) {
  // threads only for enough rows to repay waking them (a tiny model's rows run serially)
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * d;
      const T* up = gate + d;
      T* o = out + r * d;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= d; i += 16) store16(o + i, silu_mul16<T>(load16(gate + i), load16(up + i)));
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= d; i += 8) {
        const __m256 x = load8(gate + i);
        const __m256 neg_abs = _mm256_or_ps(x, _mm256_set1_ps(-0.f));
        const __m256 e = exp_nonpositive(neg_abs);
        const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        // sigmoid(x) = 1 / (1 + e^-|x|) for x >= 0, e^-|x| / (1 + e^-|x|) below
        const __m256 sigmoid = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
        const __m256 silu = as_stored(T(), _mm256_mul_ps(x, sigmoid));
        store8(o + i, _mm256_mul_ps(silu, load8(up + i)));
      }
#endif
      for (; i < d; ++i) {
        const float x = to_float(gate[i]);
        o[i] = round_to<T>(to_float(round_to<T>(x / (1.f + std::exp(-x)))) * to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "gate_up must be contiguous, of even width");
  const int64_t d = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, d);
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_impl<c10::BFloat16>(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, d);
  } else {
    TORCH_CHECK(false, "silu_mul supports float32 and bfloat16");
  }
  return out;
}

at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  const int64_t hidden = residual.size(-1), rows = residual.numel() / hidden;
  auto out = at::empty_like(residual);
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == residual.sizes() && d.scalar_type() == residual.scalar_type(), "delta must match residual");
  }
  if (residual.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(residual.data_ptr<float>(), d.defined() ? d.data_ptr<float>() : nullptr,
                             weight.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, static_cast<float>(eps));
  } else if (residual.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16>(residual.data_ptr<c10::BFloat16>(),
                                     d.defined() ? d.data_ptr<c10::BFloat16>() : nullptr,
                                     weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, hidden,
                                     static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "add_rms_norm supports float32 and bfloat16");
  }
  return out;
}

// Registered as torch ops (not a pybind module: torch/extension.h alone took 24 s of each
// compile, ATen and the op registry 8 s). A torch op call lets go of the GIL, as a server
// running the engine in a thread beside its HTTP event loop needs.
TORCH_LIBRARY(shardserve_fused_elementwise, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("rotary_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int heads) -> (Tensor, Tensor)", &rotary_kv);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
}
