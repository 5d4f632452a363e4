// bfloat16 linear layer for CPUs with AVX512-BF16: y [M, N] = x [M, K] W^T (+ bias), float32 sums.
//
// At decode batch sizes (M of 1-64 rows) every weight byte is used M times and then not again
// until the next step: the weights stream from DRAM, and a layer's matmul is short enough that
// the fork/join, packing and cache misses of a general GEMM cost as much as the arithmetic. This
// kernel is built for that shape:
//   - W is repacked once into panels of 32 output columns, k-pairs interleaved
//     ([N/32][K/2][32][2]), so one panel is one contiguous stream and each 64-byte load feeds one
//     AVX512-BF16 dot instruction (16 columns x 2 k values);
//   - a panel (32 x K bf16, 36 KB at K = 576) stays in L1 while every block of up to 12 rows of x
//     runs over it: 24 float32 accumulators live in registers and each x pair is a broadcast;
//   - while a thread works on one panel it prefetches its next one, so the DRAM stream overlaps
//     the arithmetic instead of stalling it;
//   - panels are split over threads once per call (static, no work queue).
// Each output is a sum over k in a fixed order that does not depend on M: a row gets the same
// result whatever else is in the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;    // output columns per panel: two 16-lane registers
constexpr int64_t kMaxRows = 12;  // rows of x per register block: 24 accumulators

#if defined(__AVX512BF16__)
// One block of R rows against one panel. x rows are read as 32-bit (bf16 pair) broadcasts.
template <int R>
inline void panel_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t kpairs,
                       const float* bias, c10::BFloat16* y, int64_t ldy, int64_t cols, const c10::BFloat16* prefetch) {
  __m512 acc[R][2];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t ldx_pairs = ldx / 2;
  for (int64_t p = 0; p < kpairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kPanel + kPanel);
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kPanel + kPanel), _MM_HINT_T0);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[r * ldx_pairs + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    // float32 -> bfloat16 rounds to nearest even, as torch's conversion does
    _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
    _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
  }
}

using PanelRowsFn = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, const float*,
                             c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*);

template <int... Rs>
constexpr std::array<PanelRowsFn, sizeof...(Rs)> make_table(std::integer_sequence<int, Rs...>) {
  return {&panel_rows<Rs + 1>...};
}
constexpr auto kPanelRows = make_table(std::make_integer_sequence<int, kMaxRows>{});
#endif

}  // namespace

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// W [N, K] bf16 -> panels [ceil(N/32)][ceil(K/2)][32][2], zero-padded.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "pack: weight must be 2-D bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_pad = (n + kPanel - 1) / kPanel * kPanel, k_pad = (k + 1) / 2 * 2;
  auto padded = torch::zeros({n_pad, k_pad}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({n_pad / kPanel, kPanel, k_pad / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 contiguous, packed from pack(), bias [N] float32 or None -> y [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "linear: x must be 2-D bfloat16");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), kpairs = packed.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && (k + 1) / 2 == kpairs, "linear: packed weight does not match x");
  TORCH_CHECK(packed.size(0) * kPanel >= n, "linear: packed weight has fewer than n rows");
  const float* b = nullptr;
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    // padded to whole panels so the last panel's bias load stays in bounds
    bias32 = torch::zeros({packed.size(0) * kPanel}, x.options().dtype(torch::kFloat32));
    bias32.narrow(0, 0, n).copy_(*bias);
    b = bias32.data_ptr<float>();
  }
  torch::Tensor xin = x;
  if (k % 2) xin = torch::constant_pad_nd(x, {0, 1});  // the pair of the last k meets zero weights
  auto y = torch::empty({m, n}, x.options());
  const auto* xd = xin.data_ptr<c10::BFloat16>();
  const auto* wd = packed.data_ptr<c10::BFloat16>();
  auto* yd = y.data_ptr<c10::BFloat16>();
  const int64_t ldx = xin.size(1), panel_elems = kpairs * 2 * kPanel;
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const c10::BFloat16* w = wd + panel * panel_elems;
      const c10::BFloat16* next = panel + 1 < end ? w + panel_elems : nullptr;
      const int64_t col = panel * kPanel, cols = std::min(kPanel, n - col);
      for (int64_t row = 0; row < m; row += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - row);
        // the first row block pulls the panel into L1 and prefetches the next one
        kPanelRows[rows - 1](xd + row * ldx, ldx, w, kpairs, b ? b + col : nullptr, yd + row * n + col, n, cols,
                             row == 0 ? next : nullptr);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX512-BF16");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the AVX512-BF16 kernel");
  m.def("pack", &pack, "repack a bf16 weight [N, K] into the kernel's panels");
  m.def("linear", &linear, "y = x W^T (+ bias) from packed panels, bf16 in and out");
}
