// y = x @ W^T + b for few rows of x (decode rows, verification windows), CPU float32.
//
// Such a product is bound by reading W once from memory. The weight is packed once into
// column blocks, [ceil(N / 64), K, 64]: a block's 64 outputs at one k are one contiguous
// 256-byte run, so a block is a single forward stream that the loop prefetches ahead of itself,
// and each k costs four vector loads and one multiply-add per row and vector.
//
// Each output is one multiply-add chain over k = 0..K-1 in order, then + b, whatever the row
// count and wherever the row sits: a row gets the same bits in a batch of one as in a batch of
// thirty, which the verification of a draft window relies on (tests/test_skinny_linear.py).
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstring>

namespace {

typedef float vec16 __attribute__((vector_size(64)));

constexpr int64_t kBlock = 64;           // output columns a block holds
constexpr int kVecs = kBlock / 16;       // vectors a block's k-run holds
constexpr int kRows = 6;                 // rows a pass over a block computes: 24 accumulators
constexpr int64_t kPrefetch = 16 * kBlock;  // floats ahead: 16 k-steps, 4 KiB

// rows (<= kRows) of x times one block over all K, into cols (<= kBlock) columns of y
inline void block_rows(const float* __restrict w, const float* __restrict x, int64_t k, float* __restrict y,
                       int64_t y_stride, int rows, int64_t cols, const float* __restrict bias) {
  vec16 acc[kRows][kVecs];
  for (int m = 0; m < kRows; ++m)
    for (int j = 0; j < kVecs; ++j) acc[m][j] = vec16{};
  for (int64_t i = 0; i < k; ++i) {
    const float* wi = w + i * kBlock;
    for (int j = 0; j < kVecs; ++j) __builtin_prefetch(wi + kPrefetch + 16 * j);
    vec16 wv[kVecs];
    for (int j = 0; j < kVecs; ++j) std::memcpy(&wv[j], wi + 16 * j, 64);
    for (int m = 0; m < kRows; ++m) {
      if (m < rows) {
        const float xv = x[m * k + i];
        for (int j = 0; j < kVecs; ++j) acc[m][j] += wv[j] * xv;
      }
    }
  }
  for (int m = 0; m < rows; ++m) {
    float out[kBlock];
    std::memcpy(out, acc[m], sizeof out);
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) out[c] += bias[c];
    std::memcpy(y + m * y_stride, out, cols * sizeof(float));
  }
}

}  // namespace

torch::Tensor skinny_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "skinny_pack: a CPU float32 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({blocks * kBlock, k}, weight.options());
  padded.slice(0, 0, n).copy_(weight);
  return padded.view({blocks, kBlock, k}).transpose(1, 2).contiguous();
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor packed, const std::optional<torch::Tensor>& bias,
                            int64_t n) {
  RECORD_FUNCTION("pie::skinny_linear", std::vector<c10::IValue>());  // named in profiles
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "skinny_linear: x is CPU float32 [rows, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.scalar_type() == torch::kFloat32 &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "skinny_linear: the weight is skinny_pack's");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "skinny_linear: x has ", k, " columns, the weight ", packed.size(1));
  TORCH_CHECK(n > (blocks - 1) * kBlock && n <= blocks * kBlock, "skinny_linear: ", n,
              " outputs do not fit the weight's ", blocks, " blocks");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n &&
                                    bias->scalar_type() == torch::kFloat32 && bias->is_contiguous()),
              "skinny_linear: bias is float32 [", n, "]");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * kBlock, cols = std::min(kBlock, n - c0);
      for (int64_t r = 0; r < m; r += kRows)
        block_rows(wp + b * k * kBlock, xp + r * k, k, yp + r * n + c0, n, static_cast<int>(std::min<int64_t>(kRows, m - r)),
                   cols, bp == nullptr ? nullptr : bp + c0);
    }
  });
  return y;
}
