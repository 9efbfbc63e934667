// The engine's CPU kernels (host/engine/kernels.py builds them into one module, module.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor ctx, int64_t base,
                     torch::Tensor starts, torch::Tensor windows, torch::Tensor frozen, double scale);

std::tuple<torch::Tensor, torch::Tensor> layer_stack(
    torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& norms,
    const std::vector<torch::Tensor>& skinny, const std::vector<torch::Tensor>& blocked,
    const std::vector<std::optional<torch::Tensor>>& biases, int64_t skinny_rows, torch::Tensor final_norm, torch::Tensor kv,
    torch::Tensor slot_mapping, torch::Tensor ctx, int64_t base, torch::Tensor starts, torch::Tensor windows,
    torch::Tensor frozen, const std::vector<double>& scaling, double eps, int64_t heads, int64_t kv_heads,
    int64_t inter);

torch::Tensor skinny_pack(torch::Tensor weight);

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor packed, const std::optional<torch::Tensor>& bias, int64_t n);

std::tuple<torch::Tensor, torch::Tensor> residual_norm(torch::Tensor x, const std::optional<torch::Tensor>& delta,
                                                       torch::Tensor weight, double eps);

torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv,
                         torch::Tensor slots, int64_t heads, int64_t kv_heads);

torch::Tensor silu_mul(torch::Tensor gate_up, int64_t inter);
