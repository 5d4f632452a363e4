// A decode step's whole layer stack in one call: the kernels FlatLayers.forward calls from Python
// (models/flat_layers.py), called here through the dispatcher in the same order with the same
// arguments, so the results are the same bits. At batch 1 a layer is eight kernel calls of a few
// microseconds of work each; from Python each call cost ~3 us of argument parsing and dispatch,
// plus the loop around them: ~1 ms of a 4-5 ms step. From C++ a call costs a fraction of that.
//
// The kernels stay in their own extensions (looked up by name on the first call: Python loads
// them before it builds a stack); this file holds no arithmetic of its own.
//
//   x            [T, hidden] residual stream, updated in place; every row a decode
//   tensors      per layer: input norm, post-attention norm, qkv, o, gate_up, down weights
//                (packed as their kernels pack them)
//   kv_caches    per layer: [2, ...] keys and values, as the attention backend takes them
//   ints         per layer and linear (qkv, o, gate_up, down): kind, format, out features;
//                kind 0: block_linear (format = GGUF kernel format), 1: panel linear,
//                2: panel linear with SwiGLU fused (gate_up only)
//   qkv_biases   per layer: qkv bias or None
// Returns (x, the last layer's MLP output, still to be added), as FlatLayers.forward does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using OptTensor = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using T = at::Tensor;

// the registered functions' own signatures (the dispatcher checks them)
struct Kernels {
  c10::TypedOperatorHandle<T(T, T, int64_t, OptTensor, int64_t, bool)> block_linear =
      op<T(T, T, int64_t, OptTensor, int64_t, bool)>("shardserve_block_linear::block_linear");
  c10::TypedOperatorHandle<T(T, T, OptTensor, int64_t)> panel_linear =
      op<T(T, T, OptTensor, int64_t)>("shardserve_panel_linear::linear");
  c10::TypedOperatorHandle<T(T, T, int64_t)> panel_silu_mul =
      op<T(T, T, int64_t)>("shardserve_panel_linear::linear_silu_mul");
  c10::TypedOperatorHandle<T(T, OptTensor, T, double)> add_rms_norm =
      op<T(T, OptTensor, T, double)>("shardserve_fused_elementwise::add_rms_norm");
  c10::TypedOperatorHandle<std::tuple<T, T>(T, T, T, T, T, T, int64_t)> rotary_kv =
      op<std::tuple<T, T>(T, T, T, T, T, T, int64_t)>("shardserve_fused_elementwise::rotary_kv");
  c10::TypedOperatorHandle<T(T)> silu_mul = op<T(T)>("shardserve_fused_elementwise::silu_mul");
  c10::TypedOperatorHandle<T(T, T, T, T, T, double)> attention =
      op<T(T, T, T, T, T, double)>("shardserve_paged_decode_attention::paged_decode_attention");
};

const Kernels& kernels() {
  static const Kernels k;  // looked up once: the extensions are loaded by then
  return k;
}

constexpr int64_t kBlock = 0, kPanel = 1, kPanelSiluMul = 2;

at::Tensor linear(const Kernels& k, const at::Tensor& x, const at::Tensor& w, const int64_t* spec, const OptTensor& bias) {
  if (spec[0] == kBlock) return k.block_linear.call(x, w, spec[1], bias, spec[2], false);
  return k.panel_linear.call(x, w, bias, spec[2]);
}

std::tuple<at::Tensor, at::Tensor> decode_stack(at::Tensor x, std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                                                std::vector<OptTensor> qkv_biases, std::vector<at::Tensor> kv_caches, at::Tensor cos, at::Tensor sin,
                                                at::Tensor slots, at::Tensor block_table, at::Tensor context_lens,
                                                int64_t num_heads, int64_t head_dim, double scale, double eps) {
  constexpr size_t kTensors = 6, kInts = 12;
  const size_t layers = qkv_biases.size();
  TORCH_CHECK(tensors.size() == layers * kTensors && ints.size() == layers * kInts && kv_caches.size() == layers, "decode_stack: malformed layer lists");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_stack: x must be a contiguous [T, hidden]");
  const Kernels& k = kernels();
  const int64_t num_tokens = x.size(0);
  OptTensor delta;
  for (size_t l = 0; l < layers; ++l) {
    at::Tensor* t = &tensors[l * kTensors];
    const int64_t* spec = &ints[l * kInts];
    at::Tensor h = k.add_rms_norm.call(x, delta, t[0], eps);
    at::Tensor qkv = linear(k, h, t[2], spec, qkv_biases[l]).view({num_tokens, -1, head_dim});
    at::Tensor keys = kv_caches[l][0], values = kv_caches[l][1];
    at::Tensor q = std::get<0>(k.rotary_kv.call(qkv, cos, sin, keys, values, slots, num_heads));
    at::Tensor out = k.attention.call(q, keys, values, block_table, context_lens, scale);
    h = k.add_rms_norm.call(x, linear(k, out.reshape({num_tokens, -1}), t[3], spec + 3, c10::nullopt), t[1], eps);
    const int64_t* gate_up = spec + 6;
    at::Tensor act = gate_up[0] == kPanelSiluMul ? k.panel_silu_mul.call(h, t[4], gate_up[2] / 2)
                                                 : k.silu_mul.call(linear(k, h, t[4], gate_up, c10::nullopt));
    delta = linear(k, act, t[5], spec + 9, c10::nullopt);
  }
  return {x, delta.value_or(at::Tensor())};
}

}  // namespace

TORCH_LIBRARY(shardserve_decode_stack, m) {
  m.def("decode_stack(Tensor(a!) x, Tensor[] tensors, int[] ints, Tensor?[] qkv_biases, Tensor[] kv_caches, Tensor cos, Tensor sin, "
        "Tensor slots, Tensor block_table, Tensor context_lens, int num_heads, int head_dim, float scale, float eps) "
        "-> (Tensor, Tensor)",
        &decode_stack);
}
