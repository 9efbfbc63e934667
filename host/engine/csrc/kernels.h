// The engine's CPU kernels (host/engine/kernels.py builds them into one module, module.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv, torch::Tensor ctx, int64_t base,
                     torch::Tensor starts, torch::Tensor windows, torch::Tensor frozen, double scale);

std::tuple<torch::Tensor, torch::Tensor> layer_stack(
    torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<torch::Tensor>& weights,
    const std::vector<std::optional<torch::Tensor>>& biases, torch::Tensor final_norm, torch::Tensor kv,
    torch::Tensor slot_mapping, torch::Tensor ctx, int64_t base, torch::Tensor starts, torch::Tensor windows,
    torch::Tensor frozen, const std::vector<double>& scaling, double eps, int64_t heads, int64_t kv_heads,
    int64_t inter);
