// y = x @ W^T + b, CPU float32, for every row count the engine runs: decode rows, verification
// windows, prompt passes.
//
// A product of few rows is bound by reading W once from memory; one of many rows by arithmetic,
// and then each column block stays in cache while every row passes over it. The weight is packed once into
// column blocks, [ceil(N / B), K, B] with B = kBlock: a block's B outputs at one k are one
// contiguous run, so a block is a single forward stream that the loop prefetches ahead of
// itself, and each k costs one vector load per vector of the block and one multiply-add per
// row and vector. B and the rows a pass takes are set by the target's registers (below).
//
// Each output is one multiply-add chain over k = 0..K-1 in order, then + b, whatever the row
// count and wherever the row sits: a row gets the same bits in a batch of one as in a batch of
// thirty, which the verification of a draft window relies on (tests/test_skinny_linear.py).
//
// The blocks may hold bfloat16 (a weight whose float32 values are all bfloat16 values, as a
// draft head's read from a bfloat16 checkpoint): half the bytes to read, each widened to the same
// float32 exactly, so the product has the same bits as over the float32 blocks.
#include "kernels.h"
#include "skinny.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstdint>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

using namespace pie;

// the dtypes blocks hold: skinny_pack takes a weight of one, skinny_linear reads blocks of one
inline bool block_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

template <typename W>
void run_blocks(const W* wp, const float* xp, const float* bp, float* yp, int64_t m, int64_t k, int64_t n,
                int64_t blocks) {
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * kBlock, cols = std::min(kBlock, n - c0);
      for (int64_t r = 0; r < m; r += kRows)
        float_tile(static_cast<int>(std::min<int64_t>(kRows, m - r)), wp + b * k * kBlock, xp + r * k, k,
             yp + r * n + c0, n, cols, bp == nullptr ? nullptr : bp + c0);
    }
  });
}

}  // namespace

namespace pie {

// An empty tensor on its own mapping, asked to be backed by 2 MiB pages (transparent huge pages
// in "madvise" mode, the usual default): a pass streams every weight once, and on 4 KiB pages it
// misses the TLB each 4 KiB while the prefetchers stop at each page's end. Where the kernel has
// no huge pages the advice is ignored and the mapping is an ordinary one.
at::Tensor huge_page_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHuge = size_t{2} << 20;
  size_t bytes = options.dtype().itemsize();
  for (const int64_t s : sizes) bytes *= static_cast<size_t>(s);
  if (bytes >= kHuge) {
    const size_t len = bytes + kHuge;  // room to start at a 2 MiB boundary; untouched slack costs no memory
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      void* start = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(kHuge - 1));
      madvise(start, bytes, MADV_HUGEPAGE);  // before the first touch: faults then take whole 2 MiB pages
      return at::from_blob(start, sizes, [base, len](void*) { munmap(base, len); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace pie

using namespace pie;

at::Tensor skinny_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && block_dtype(weight),
              "skinny_pack: a CPU float32 or bfloat16 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlock - 1) / kBlock;
  auto padded = at::zeros({blocks * kBlock, k}, weight.options());
  padded.slice(0, 0, n).copy_(weight);
  at::Tensor packed = huge_page_empty({blocks, k, kBlock}, weight.options());
  packed.copy_(padded.view({blocks, kBlock, k}).transpose(1, 2));
  return packed;
}

at::Tensor skinny_linear(at::Tensor x, at::Tensor packed, const std::optional<at::Tensor>& bias,
                            int64_t n) {
  RECORD_FUNCTION("pie::skinny_linear", std::vector<c10::IValue>());  // named in profiles
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "skinny_linear: x is CPU float32 [rows, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous() && packed.device().is_cpu() &&
                  block_dtype(packed),
              "skinny_linear: the weight is skinny_pack's");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "skinny_linear: x has ", k, " columns, the weight ", packed.size(1));
  TORCH_CHECK(n > (blocks - 1) * kBlock && n <= blocks * kBlock, "skinny_linear: ", n,
              " outputs do not fit the weight's ", blocks, " blocks");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n &&
                                    bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "skinny_linear: bias is float32 [", n, "]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (packed.scalar_type() == at::kBFloat16)
    run_blocks(packed.data_ptr<at::BFloat16>(), xp, bp, yp, m, k, n, blocks);
  else
    run_blocks(packed.data_ptr<float>(), xp, bp, yp, m, k, n, blocks);
  return y;
}
