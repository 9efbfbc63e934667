// What the two products over a file's blocks share (block_linear.cpp: float32 activations;
// q8_linear.cpp: 8-bit ones): their argument checks, and the loops that widen a packed weight
// back into rows (a dense copy, or the rows of some ids: an embedding's lookup). Each layout
// brings its own widening of one group, `widen(group, c0, c1, out)` calling out(c, i, weight)
// for columns c0 <= c < c1 of the group's column block and its k i.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace pie {

// ggml's type numbers (gguf-py's GGMLQuantizationType), as blocks.py names the formats
enum Ggml : int64_t { kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30 };

// fn(the layout's type for it) for the six block formats both layouts read (the types in the
// order of the template's names); false for another number
template <class Q8_0, class Q4_0, class Q4_1, class Q4_K, class Q5_K, class Q6_K, class Fn>
bool by_block_format(int64_t ggml, Fn&& fn) {
  switch (ggml) {
    case kQ8_0: fn(Q8_0{}); return true;
    case kQ4_0: fn(Q4_0{}); return true;
    case kQ4_1: fn(Q4_1{}); return true;
    case kQ4_K: fn(Q4_K{}); return true;
    case kQ5_K: fn(Q5_K{}); return true;
    case kQ6_K: fn(Q6_K{}); return true;
    default: return false;
  }
}

// A layout's packed weight as a kernel reads it: `block` columns a column block, `group` k a
// group, `bytes` a group
struct PackedShape {
  int64_t block, group, bytes;
  int64_t k = 0, blocks = 0;  // read off the tensor by check_packed
};

// a format type's shape in a layout of `block` columns: its kGroup k a group, kBytes bytes
template <class F>
PackedShape shape_of(int64_t block) {
  return {block, F::kGroup, F::kBytes};
}

// packed is uint8 [column blocks, K / group, group bytes] whose blocks hold n outputs
inline PackedShape check_packed(const at::Tensor& packed, PackedShape shape, int64_t format, int64_t n,
                                const char* who) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.device().is_cpu(),
              who, ": the weight is blocks.py's packed uint8 blocks");
  TORCH_CHECK(packed.size(2) == shape.bytes, who, ": format ", format, " groups are ", shape.bytes,
              " bytes, not ", packed.size(2));
  shape.k = packed.size(1) * shape.group;
  shape.blocks = packed.size(0);
  TORCH_CHECK(n > (shape.blocks - 1) * shape.block && n <= shape.blocks * shape.block, who, ": ", n,
              " outputs do not fit the weight's ", shape.blocks, " blocks");
  return shape;
}

// x is CPU float32 [rows, k], bias float32 [n] or none
inline void check_operands(const at::Tensor& x, int64_t k, const std::optional<at::Tensor>& bias, int64_t n,
                           const char* who) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), who,
              ": x is CPU float32 [rows, K]");
  TORCH_CHECK(x.size(1) == k, who, ": x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n &&
                                    bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              who, ": bias is float32 [", n, "]");
}

// the packed weight widened back into float32 [n, K]
template <class Widen>
at::Tensor widen_dense(const at::Tensor& packed, const PackedShape& s, int64_t n, Widen widen) {
  at::Tensor out = at::empty({n, s.k}, at::kFloat);
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t groups = s.k / s.group;
  at::parallel_for(0, s.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g)
        widen(wp + (b * groups + g) * s.bytes, 0, std::min(s.block, n - b * s.block),
              [&](int64_t c, int64_t i, float w) { op[(b * s.block + c) * s.k + g * s.group + i] = w; });
  });
  return out;
}

// rows ids of the packed weight (each id < n), widened: float32 [T, K]
template <class Widen>
at::Tensor widen_rows(const at::Tensor& packed, const PackedShape& s, int64_t n, const at::Tensor& ids,
                      const char* who, Widen widen) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), who,
              ": ids are CPU int64 [T]");
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < idc.size(0); ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < n, who, ": id ", ip[t], " is outside the ", n, " rows");
  at::Tensor out = at::empty({idc.size(0), s.k}, at::kFloat);
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t groups = s.k / s.group;
  at::parallel_for(0, idc.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = ip[t] / s.block, col = ip[t] % s.block;
      for (int64_t g = 0; g < groups; ++g)
        widen(wp + (b * groups + g) * s.bytes, col, col + 1,
              [&](int64_t, int64_t i, float w) { op[t * s.k + g * s.group + i] = w; });
    }
  });
  return out;
}

}  // namespace pie
