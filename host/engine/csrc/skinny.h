// The column blocks of the few-row products (skinny_linear.cpp, block_linear.cpp): sized to the
// target's registers (vec.h's vf is one). GCC keeps an array of vectors in registers only when
// every index is known at compile time, hence the row-count templates of the kernels.
#pragma once

#include "vec.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace pie {

#if defined(__AVX512F__)
constexpr int kVecs = 4;  // a block is 64 columns
constexpr int kRows = 6;  // 24 accumulators of 32 registers
#else
constexpr int kVecs = 1;   // a block is 8 columns
constexpr int kRows = 12;  // 12 accumulators of 16 registers
#endif

constexpr int64_t kBlock = kLanes * kVecs;  // output columns a block holds

constexpr int64_t kPrefetch = 1024;  // weights ahead: 4 KiB of float32, 2 KiB of bfloat16

// kLanes weights from the blocks, as float32
inline vf load_w(const float* p) { return load(p); }

inline vf load_w(const at::BFloat16* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#else
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// R rows' accumulators, + bias, into cols (<= kBlock) columns of y: every product's last step
template <int R>
void store_rows(const vf (&acc)[R][kVecs], float* __restrict y, int64_t y_stride, int64_t cols,
                const float* __restrict bias) {
  for (int m = 0; m < R; ++m) {
    float out[kBlock];
    std::memcpy(out, acc[m], sizeof out);
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) out[c] += bias[c];
    std::memcpy(y + m * y_stride, out, cols * sizeof(float));
  }
}

// R rows of x times one block over all K, into cols (<= kBlock) columns of y
template <int R, typename W>
void block_rows(const W* __restrict w, const float* __restrict x, int64_t k, float* __restrict y,
                int64_t y_stride, int64_t cols, const float* __restrict bias) {
  vf acc[R][kVecs];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < kVecs; ++j) acc[m][j] = vf{};
  for (int64_t i = 0; i < k; ++i) {
    const W* wi = w + i * kBlock;
    prefetch(reinterpret_cast<const float*>(wi + kPrefetch), kBlock * sizeof(W) / sizeof(float));
    vf wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = load_w(wi + kLanes * j);
    for (int m = 0; m < R; ++m) {
      const float xv = x[m * k + i];
      for (int j = 0; j < kVecs; ++j) acc[m][j] = fmadd(wv[j], xv, acc[m][j]);
    }
  }
  store_rows<R>(acc, y, y_stride, cols, bias);
}

template <int R = kRows, typename W>
void float_tile(int rows, const W* w, const float* x, int64_t k, float* y, int64_t y_stride, int64_t cols,
          const float* bias) {
  if constexpr (R > 1) {
    if (rows < R) return float_tile<R - 1>(rows, w, x, k, y, y_stride, cols, bias);
  }
  block_rows<R>(w, x, k, y, y_stride, cols, bias);
}

// R rows times kc k's of one float block w ([kc, kBlock]), each row's multiply-add chain carried
// on from acc (row r at acc + r * kBlock; first: from zero). Chained over consecutive chunks of k
// this is block_rows' chain, stored and reloaded between chunks: the same bits.
template <int R>
void chain_rows(const float* __restrict w, const float* __restrict x, int64_t x_stride, int64_t kc,
                float* __restrict acc, bool first) {
  vf a[R][kVecs];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < kVecs; ++j) a[m][j] = first ? vf{} : load(acc + m * kBlock + kLanes * j);
  for (int64_t i = 0; i < kc; ++i) {
    vf wv[kVecs];
    for (int j = 0; j < kVecs; ++j) {
      wv[j] = load(w + i * kBlock + kLanes * j);
#if defined(__AVX__)
      asm("" : "+v"(wv[j]));  // in a register: GCC would fold a load into each row's multiply-add,
#endif                        // R loads of each vector where the load ports are the limit
    }
    for (int m = 0; m < R; ++m) {
      const float xv = x[m * x_stride + i];
      for (int j = 0; j < kVecs; ++j) a[m][j] = fmadd(wv[j], xv, a[m][j]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < kVecs; ++j) store(acc + m * kBlock + kLanes * j, a[m][j]);
}

template <int R = kRows>
void chain_tile(int rows, const float* w, const float* x, int64_t x_stride, int64_t kc, float* acc, bool first) {
  if constexpr (R > 1) {
    if (rows < R) return chain_tile<R - 1>(rows, w, x, x_stride, kc, acc, first);
  }
  chain_rows<R>(w, x, x_stride, kc, acc, first);
}

// rows cut into tiles of at most `most` rows, as even as they go (8 rows by 6: 4 + 4, not 6 + 2)
inline int64_t tile_rows(int64_t rows, int64_t most = kRows) {
  const int64_t tiles = (rows + most - 1) / most;
  return (rows + tiles - 1) / tiles;
}

// An empty tensor backed by 2 MiB pages where the kernel offers them (skinny_linear.cpp)
at::Tensor huge_page_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace pie
