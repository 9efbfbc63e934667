// The column blocks of the few-row products (skinny_linear.cpp, block_linear.cpp): sized to the
// target's registers (vec.h's vf is one). GCC keeps an array of vectors in registers only when
// every index is known at compile time, hence the row-count templates of the kernels.
#pragma once

#include "vec.h"

#include <ATen/ATen.h>

namespace pie {

#if defined(__AVX512F__)
constexpr int kVecs = 4;  // a block is 64 columns
constexpr int kRows = 6;  // 24 accumulators of 32 registers
#else
constexpr int kVecs = 1;   // a block is 8 columns
constexpr int kRows = 12;  // 12 accumulators of 16 registers
#endif

constexpr int64_t kBlock = kLanes * kVecs;  // output columns a block holds

// An empty tensor backed by 2 MiB pages where the kernel offers them (skinny_linear.cpp)
at::Tensor huge_page_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace pie
