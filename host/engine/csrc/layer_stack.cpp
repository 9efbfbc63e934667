// The layer stack of host/engine/stack.py, the same operators in the same order, called from C++.
//
// A one-row decode pass makes some 1,900 operator calls; from Python each costs about half a
// microsecond more than from C++ (argument parsing), and the Python between them costs more.
// This loop calls the very same ATen and oneDNN operators with the same arguments, so its
// results are bit-identical to stack.py's (tests/test_engine_stack.py checks it); it is taken
// only where every product is oneDNN-packed and every window is short (paged_attention.cpp).
#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace {

using torch::Tensor;

// linear.py's packed_linear: oneDNN's product over a weight reordered once
Tensor packed_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                        c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), c10::string_view(""));
}

// stack.py's _norm: transformers' RMSNorm
Tensor norm(const Tensor& x, const Tensor& weight, double eps) {
  Tensor h = x.to(torch::kFloat32);
  h = h * at::rsqrt(h.pow(2).mean({-1}, true) + eps);
  return weight * h.to(x.scalar_type());
}

}  // namespace

// weights: per layer norm1, qkv, o, norm2, gate_up, down (the products' packed weights);
// biases: per layer qkv, o, gate_up, down. cos, sin: [T, 1, head_dim], sin sign-folded as in
// stack.py. kv: the whole pool, [layers, 2, kv_heads, slots, head_dim]. The attention arguments
// are paged_attention's, for the batch's one group of short windows.
std::tuple<Tensor, Tensor> layer_stack(Tensor x, Tensor cos, Tensor sin, const std::vector<Tensor>& weights,
                                       const std::vector<std::optional<Tensor>>& biases, Tensor final_norm,
                                       Tensor kv, Tensor slot_mapping, Tensor ctx, int64_t base, Tensor starts,
                                       Tensor windows, Tensor frozen, const std::vector<double>& scaling, double eps,
                                       int64_t heads, int64_t kv_heads, int64_t inter) {
  const int64_t layers = static_cast<int64_t>(scaling.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * layers && static_cast<int64_t>(biases.size()) == 4 * layers,
              "layer_stack: six weights and four biases per layer");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) >= layers, "layer_stack: the pool is [layers, 2, kv_heads, slots, D]");
  const int64_t t = x.size(0), hd = kv.size(4), half = hd / 2, q_end = heads * hd, k_end = (heads + kv_heads) * hd;
  for (int64_t i = 0; i < layers; ++i) {
    const Tensor* w = &weights[6 * i];
    const std::optional<Tensor>* b = &biases[4 * i];
    const Tensor qkv = packed_linear(norm(x, w[0], eps), w[1], b[0]);
    Tensor qk = qkv.slice(1, 0, k_end).view({t, heads + kv_heads, hd});
    qk = qk * cos + at::roll(qk, {half}, {-1}) * sin;
    const Tensor q = qk.slice(1, 0, heads).transpose(0, 1);  // [heads, T, head_dim]
    const Tensor pool = kv[i];
    pool[0].index_copy_(1, slot_mapping, qk.slice(1, heads).transpose(0, 1));
    pool[1].index_copy_(1, slot_mapping, qkv.slice(1, k_end).view({t, kv_heads, hd}).transpose(0, 1));
    const Tensor out = at::empty({t, heads, hd}, q.options());  // token-major: [T, heads * D] is a view
    paged_attention(out.transpose(0, 1), q, pool, ctx, base, starts, windows, frozen, scaling[i]);
    x = x + packed_linear(out.view({t, q_end}), w[2], b[1]);
    const Tensor gu = packed_linear(norm(x, w[3], eps), w[4], b[2]);
    x = x + packed_linear(at::silu(gu.slice(1, 0, inter)) * gu.slice(1, inter), w[5], b[3]);
  }
  return {x, norm(x, final_norm, eps)};
}
