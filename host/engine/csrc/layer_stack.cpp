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

// norms: per layer norm1, norm2. skinny, formats, biases: per layer the products qkv, o,
// gate_up, down, as linear.py packs them (format 0: a float weight; else its blocks' ggml type).
// cos, sin: [T, 1, head_dim], sin sign-folded as in stack.py. kv: the whole pool, [layers, 2, kv_heads, slots, head_dim]. The attention arguments
// are paged_attention's, for the batch's one group of short windows.
std::tuple<Tensor, Tensor> layer_stack(Tensor x, Tensor cos, Tensor sin, const std::vector<Tensor>& norms,
                                       const std::vector<Tensor>& skinny, const std::vector<int64_t>& formats,
                                       const std::vector<std::optional<Tensor>>& biases, Tensor final_norm,
                                       Tensor kv, Tensor slot_mapping, Tensor ctx, int64_t base, Tensor starts,
                                       Tensor windows, Tensor frozen, const std::vector<double>& scaling, double eps,
                                       int64_t heads, int64_t kv_heads, int64_t inter) {
  const int64_t layers = static_cast<int64_t>(scaling.size());
  const auto per_layer = [&](const auto& v, int64_t n) { return static_cast<int64_t>(v.size()) == n * layers; };
  TORCH_CHECK(per_layer(norms, 2) && per_layer(skinny, 4) && per_layer(formats, 4) &&
                  per_layer(biases, 4),
              "layer_stack: two norms and four products per layer");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) >= layers, "layer_stack: the pool is [layers, 2, kv_heads, slots, D]");
  const int64_t t = x.size(0), hidden = x.size(1), hd = kv.size(4), q_end = heads * hd,
                k_end = (heads + kv_heads) * hd;
  const int64_t outputs[4] = {k_end + kv_heads * hd, hidden, 2 * inter, hidden};  // qkv, o, gate_up, down
  std::optional<Tensor> delta;  // what the last layer adds to x, before the next norm
  for (int64_t i = 0; i < layers; ++i) {
    const auto product = [&](const Tensor& in, int j) {
      return packed_linear(in, skinny[4 * i + j], formats[4 * i + j], biases[4 * i + j], outputs[j]);
    };
    auto [h, normed] = residual_norm(x, delta, norms[2 * i], eps);
    const Tensor pool = kv[i];
    const Tensor q = rope_store(product(normed, 0), cos, sin, pool, slot_mapping, heads, kv_heads);
    const Tensor out = at::empty({t, heads, hd}, q.options());  // token-major: [T, heads * D] is a view
    paged_attention(out.transpose(0, 1), q.transpose(0, 1), pool, ctx, base, starts, windows, frozen, scaling[i]);
    std::tie(x, normed) = residual_norm(h, product(out.view({t, q_end}), 1), norms[2 * i + 1], eps);
    delta = product(silu_mul(product(normed, 2), inter), 3);
  }
  return residual_norm(x, delta, final_norm, eps);
}
