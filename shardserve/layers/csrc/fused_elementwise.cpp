// Fused residual-add + RMSNorm for CPU decode steps, where each small torch op costs more to dispatch
// than to compute. It computes what the unfused torch code computes, row by row (so results
// do not depend on the batch), in float32 internally, rounding where the reference rounds.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>

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

}  // namespace

torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  const int64_t hidden = residual.size(-1), rows = residual.numel() / hidden;
  auto out = torch::empty_like(residual);
  torch::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == residual.sizes() && d.scalar_type() == residual.scalar_type(), "delta must match residual");
  }
  if (residual.scalar_type() == torch::kFloat32) {
    add_rms_norm_impl<float>(residual.data_ptr<float>(), d.defined() ? d.data_ptr<float>() : nullptr,
                             weight.data_ptr<float>(), out.data_ptr<float>(), rows, hidden, static_cast<float>(eps));
  } else if (residual.scalar_type() == torch::kBFloat16) {
    add_rms_norm_impl<c10::BFloat16>(residual.data_ptr<c10::BFloat16>(),
                                     d.defined() ? d.data_ptr<c10::BFloat16>() : nullptr,
                                     weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, hidden,
                                     static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "add_rms_norm supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; return rms_norm(residual)");
}
