// The layer stack of host/engine/stack.py, the same calls in the same order, made from C++.
//
// From Python each call of a decode pass costs more (argument parsing, and the Python between
// calls). This loop makes stack.py's calls with the CPU kernels (row_ops.cpp, skinny_linear.cpp,
// block_linear.cpp, paged_attention.cpp), with the same arguments, so its results are
// bit-identical to stack.py's (tests/test_engine_stack.py checks it); it is taken only where
// every product is packed (linear.py) and every window is short (paged_attention.cpp).
#include "kernels.h"

namespace {

using at::Tensor;

// linear.py's packed_linear: skinny_linear, or block_linear for a weight in its file's blocks
Tensor packed_linear(const Tensor& x, const Tensor& skinny, int64_t format, const std::optional<Tensor>& bias,
                     int64_t outputs) {
  return format != 0 ? block_linear(x, skinny, format, bias, outputs) : skinny_linear(x, skinny, bias, outputs);
}

}  // namespace

// norms: per layer norm1, norm2. parts: per layer, how many packed weights each product (qkv, o,
// gate_up, down) is, side by side (one when its siblings are fused; q, k and v apart when their
// formats differ). skinny, formats, biases, outputs: each part's, as linear.py packs it (format
// 0: a float weight; else its blocks' ggml type). cos, sin: [T, 1, head_dim], sin sign-folded as
// in stack.py. kv: the whole pool, [layers, 2, kv_heads, slots, head_dim]. The attention
// arguments are paged_attention's, for the batch's one group of short windows. capture: layer
// indices in [0, layers] whose input (the residual stream entering the layer; `layers`: the last
// layer's output before the final norm) is returned too, in that order.
std::tuple<Tensor, Tensor, std::vector<Tensor>> layer_stack(Tensor x, Tensor cos, Tensor sin, const std::vector<Tensor>& norms,
                                       const std::vector<int64_t>& parts, const std::vector<Tensor>& skinny,
                                       const std::vector<int64_t>& formats,
                                       const std::vector<std::optional<Tensor>>& biases,
                                       const std::vector<int64_t>& outputs, Tensor final_norm, Tensor kv,
                                       Tensor slot_mapping, Tensor ctx, int64_t base, Tensor starts, Tensor windows,
                                       Tensor frozen, const std::vector<double>& scaling, double eps, int64_t heads,
                                       int64_t kv_heads, int64_t inter, const std::vector<int64_t>& capture) {
  const int64_t layers = static_cast<int64_t>(scaling.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(parts.size()) == 4 * layers,
              "layer_stack: two norms and four products per layer");
  std::vector<int64_t> first(parts.size() + 1, 0);  // product p's parts are first[p] .. first[p + 1] - 1
  for (size_t p = 0; p < parts.size(); ++p) first[p + 1] = first[p] + parts[p];
  const auto n = static_cast<size_t>(first.back());
  TORCH_CHECK(skinny.size() == n && formats.size() == n && biases.size() == n && outputs.size() == n,
              "layer_stack: a weight, format, bias and output count for each part");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) >= layers, "layer_stack: the pool is [layers, 2, kv_heads, slots, D]");
  const int64_t t = x.size(0), hd = kv.size(4), q_end = heads * hd;
  for (const int64_t c : capture) TORCH_CHECK(c >= 0 && c <= layers, "layer_stack: capture layer ", c, " of ", layers);
  std::vector<Tensor> captured(capture.size());
  const auto keep = [&](int64_t layer, const Tensor& h) {  // h is never written after: kept, not copied
    for (size_t j = 0; j < capture.size(); ++j)
      if (capture[j] == layer) captured[j] = h;
  };
  std::optional<Tensor> delta;  // what the last layer adds to x, before the next norm
  for (int64_t i = 0; i < layers; ++i) {
    const auto product = [&](const Tensor& in, int j) {
      const int64_t p0 = first[4 * i + j], p1 = first[4 * i + j + 1];
      if (p1 - p0 == 1) return packed_linear(in, skinny[p0], formats[p0], biases[p0], outputs[p0]);
      std::vector<Tensor> ys;
      for (int64_t p = p0; p < p1; ++p) ys.push_back(packed_linear(in, skinny[p], formats[p], biases[p], outputs[p]));
      return at::cat(ys, 1);
    };
    auto [h, normed] = residual_norm(x, delta, norms[2 * i], eps);
    keep(i, h);
    const Tensor pool = kv[i];
    const Tensor q = rope_store(product(normed, 0), cos, sin, pool, slot_mapping, heads, kv_heads);
    const Tensor out = at::empty({t, heads, hd}, q.options());  // token-major: [T, heads * D] is a view
    paged_attention(out.transpose(0, 1), q.transpose(0, 1), pool, ctx, base, starts, windows, frozen, scaling[i]);
    std::tie(x, normed) = residual_norm(h, product(out.view({t, q_end}), 1), norms[2 * i + 1], eps);
    delta = product(silu_mul(product(normed, 2), inter), 3);
  }
  auto [last, normed] = residual_norm(x, delta, final_norm, eps);
  keep(layers, last);
  return {last, normed, captured};
}
