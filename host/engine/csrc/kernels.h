// The engine's CPU kernels (host/engine/kernels.py builds them into one module, module.cpp).
#pragma once

// ATen alone, not torch/extension.h: it compiles in a fraction of the time (module.cpp binds)
#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor kv, at::Tensor ctx, int64_t base,
                     at::Tensor starts, at::Tensor windows, at::Tensor frozen, double scale);

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> layer_stack(
    at::Tensor x, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& norms,
    const std::vector<int64_t>& parts, const std::vector<at::Tensor>& skinny, const std::vector<int64_t>& formats,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& outputs,
    at::Tensor final_norm, at::Tensor kv,
    at::Tensor slot_mapping, at::Tensor ctx, int64_t base, at::Tensor starts, at::Tensor windows,
    at::Tensor frozen, const std::vector<double>& scaling, double eps, int64_t heads, int64_t kv_heads,
    int64_t inter, const std::vector<int64_t>& capture);

at::Tensor skinny_pack(at::Tensor weight);

at::Tensor skinny_linear(at::Tensor x, at::Tensor packed, const std::optional<at::Tensor>& bias, int64_t n);

int64_t skinny_block();

at::Tensor block_linear(at::Tensor x, at::Tensor packed, int64_t format, const std::optional<at::Tensor>& bias,
                        int64_t n);

at::Tensor block_dense(at::Tensor packed, int64_t format, int64_t n);

at::Tensor block_gather(at::Tensor packed, int64_t format, int64_t n, at::Tensor ids);

// a format number from here on is kQ8Activations + a legacy ggml type: its blocks in q8_linear.cpp's
// layout, products with 8-bit activations (blocks.py's Q8_ACTIVATIONS)
constexpr int64_t kQ8Activations = 256;

int64_t q8_block();

at::Tensor q8_linear(at::Tensor x, at::Tensor packed, int64_t format, const std::optional<at::Tensor>& bias,
                     int64_t n);

at::Tensor q8_dense(at::Tensor packed, int64_t format, int64_t n);

at::Tensor q8_gather(at::Tensor packed, int64_t format, int64_t n, at::Tensor ids);

std::tuple<at::Tensor, at::Tensor> residual_norm(at::Tensor x, const std::optional<at::Tensor>& delta,
                                                       at::Tensor weight, double eps);

at::Tensor rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor kv,
                         at::Tensor slots, int64_t heads, int64_t kv_heads);

at::Tensor silu_mul(at::Tensor gate_up, int64_t inter);
