// y = x @ W^T + b over a weight kept in its file's block format (GGUF's Q8_0, Q4_0, Q4_1 and the
// K-quants Q4_K, Q5_K, Q6_K), or in bfloat16 or float16 as a checkpoint stores it, CPU.
//
// The weight stays in its blocks: a group of k (32; 16 for Q6_K) shares scales, each weight a
// few bits. blocks.py repacks them into skinny_linear's column blocks, [ceil(N / kBlock),
// K / group, bytes]: per group, the kBlock columns' scales, then each k's kBlock quants side by
// side (two 4-bit quants a byte: column c's low nibble, column c + kBlock / 2's high one). A
// K-quant's scales are its super-block's float16 scale times the group's 6- or 8-bit one, as
// float32: each product exact, as gguf-py computes it. A pass widens each k's quants in
// registers with gguf-py's own formulas (gguf/quants.py):
//   Q8_0 d * q,  Q4_0 d * (q - 8),  Q6_K d * q,  Q4_1 d * q + m,  Q4_K and Q5_K d * q - m,
// the last three with one rounding (d * q is exact), the rest products of a scale and a small
// integer, one rounding as gguf's: every widened weight is the float32 that gguf.dequantize gives,
// and the multiply-add chain over k is skinny_linear's: the output has the bits of the float32
// kernel over the dequantized weight, for any row count and wherever the row sits
// (tests/test_block_linear.py). Format numbers from kQ8Activations on name the same blocks read
// with 8-bit activations, another arithmetic: q8_linear.cpp.
#include "kernels.h"
#include "packed.h"
#include "skinny.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace pie;

constexpr int64_t kAhead = 4096;  // bytes the stream is prefetched ahead

// kLanes int8 quants as float32
inline vf signed_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(static_cast<int8_t>(p[l]));
  return v;
#endif
}

// one k's kBlock 4-bit quants (kBlock / 2 bytes), minus `offset`, as float32 vectors
inline void nibbles(const uint8_t* p, int offset, vf* q) {
#if defined(__AVX512F__)
  static_assert(kVecs == 4, "two vectors of low nibbles, two of high");
  const __m512i mask = _mm512_set1_epi32(0x0F), off = _mm512_set1_epi32(offset);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
    q[h] = (vf)_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, mask), off));
    q[2 + h] = (vf)_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), off));
  }
#elif defined(__AVX2__)
  static_assert(kVecs == 1, "one vector: four low nibbles, then four high");
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_set1_epi32(static_cast<int>(word)));  // bytes 0-3, twice
  const __m256i shifted = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  q[0] = (vf)_mm256_cvtepi32_ps(
      _mm256_sub_epi32(_mm256_and_si256(shifted, _mm256_set1_epi32(0x0F)), _mm256_set1_epi32(offset)));
#else
  for (int c = 0; c < kBlock; ++c) {
    const int byte = p[c % (kBlock / 2)];
    q[c / kLanes][c % kLanes] = static_cast<float>((c < kBlock / 2 ? byte & 0x0F : byte >> 4) - offset);
  }
#endif
}

// A format's group: its header (the columns' scales: d, then m where there is one, each kBlock
// float16 or float32 values), then kGroup steps of kStep bytes (one k's quants: 4-bit pairs or
// int8). Weights are d * q, or d * q + m in one rounding (blocks.py stores a K-quant's -min).
template <bool F32, int Scales, bool Nibbles, int Offset, int64_t Group>
struct Blocks {
  static constexpr int64_t kGroup = Group;
  static constexpr int64_t kScaleBytes = F32 ? 4 : 2;
  static constexpr int64_t kHeader = Scales * kScaleBytes * kBlock, kStep = Nibbles ? kBlock / 2 : kBlock;
  static constexpr int64_t kBytes = kHeader + kGroup * kStep;
  // accumulators + weights + scales in registers
  static constexpr int kRowsMax = kVecs == 4 ? (Scales == 2 ? 4 : 5) : 10;
  // float16 scales are widened once a group, into registers; float32 ones are read where they
  // are used (an operand of the multiply-add from L1): kept in registers beside a tile's
  // accumulators they pushed those out to the stack (2x slower)
  static void scales(const uint8_t* h, vf* d, vf* m) {
    if constexpr (!F32) {
      for (int j = 0; j < kVecs; ++j) d[j] = halves(h + kScaleBytes * kLanes * j);
      if constexpr (Scales == 2)
        for (int j = 0; j < kVecs; ++j) m[j] = halves(h + kScaleBytes * (kBlock + kLanes * j));
    }
  }
  static void weights(const uint8_t* h, const uint8_t* p, const vf* d, const vf* m, vf* w) {
    if constexpr (Nibbles) {
      nibbles(p, Offset, w);
    } else {
      for (int j = 0; j < kVecs; ++j) w[j] = signed_bytes(p + kLanes * j);
    }
    for (int j = 0; j < kVecs; ++j) {
      const vf dj = F32 ? load(reinterpret_cast<const float*>(h) + kLanes * j) : d[j];
      if constexpr (Scales == 2) {
        w[j] = fmadd(dj, w[j], F32 ? load(reinterpret_cast<const float*>(h) + kBlock + kLanes * j) : m[j]);
      } else {
        w[j] = dj * w[j];
      }
    }
  }
};

// bfloat16 and float16 weights, kept as stored: no scales, each k's kBlock values side by side,
// widened exactly (a bfloat16 is a float32's upper half; F16C converts a float16 exactly)
template <bool BF16>
struct Wide16 {
  static constexpr int64_t kGroup = 32, kHeader = 0, kStep = 2 * kBlock, kBytes = kGroup * kStep;
  static constexpr int kRowsMax = kVecs == 4 ? 6 : 10;
  static void scales(const uint8_t*, vf*, vf*) {}
  static void weights(const uint8_t*, const uint8_t* p, const vf*, const vf*, vf* w) {
    for (int j = 0; j < kVecs; ++j) {
      if constexpr (BF16) {
        w[j] = load_w(reinterpret_cast<const at::BFloat16*>(p) + kLanes * j);
      } else {
        w[j] = halves(p + 2 * kLanes * j);
      }
    }
  }
};

using Q8_0 = Blocks<false, 1, false, 0, 32>;
using Q4_0 = Blocks<false, 1, true, 8, 32>;
using Q4_1 = Blocks<false, 2, true, 0, 32>;
using Q4_K = Blocks<true, 2, true, 0, 32>;   // quants 0..15
using Q5_K = Blocks<true, 2, false, 0, 32>;  // quants 0..31, a byte each
using Q6_K = Blocks<true, 1, false, 0, 16>;  // quants -32..31, a byte each
using F16 = Wide16<false>;
using BF16 = Wide16<true>;

// R rows of x times one column block over all K, into cols (<= kBlock) columns of y
template <int R, class F>
void block_tile(const uint8_t* __restrict w, const float* __restrict x, int64_t k, float* __restrict y,
                int64_t y_stride, int64_t cols, const float* __restrict bias) {
  vf acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) acc[r][j] = vf{};
  for (int64_t g = 0; g < k / F::kGroup; ++g) {
    const uint8_t* gp = w + g * F::kBytes;
    vf d[kVecs], m[kVecs];
    F::scales(gp, d, m);
    const uint8_t* qp = gp + F::kHeader;
    const float* xg = x + g * F::kGroup;
    for (int64_t i = 0; i < F::kGroup; ++i) {
      __builtin_prefetch(qp + i * F::kStep + kAhead);
      vf wv[kVecs];
      F::weights(gp, qp + i * F::kStep, d, m, wv);
      for (int r = 0; r < R; ++r) {
        const float xv = xg[r * k + i];
        for (int j = 0; j < kVecs; ++j) acc[r][j] = fmadd(wv[j], xv, acc[r][j]);
      }
    }
  }
  store_rows<R>(acc, y, y_stride, cols, bias);
}

template <class F, int R = F::kRowsMax>
void tile(int rows, const uint8_t* w, const float* x, int64_t k, float* y, int64_t y_stride, int64_t cols,
          const float* bias) {
  if constexpr (R > 1) {
    if (rows < R) return tile<F, R - 1>(rows, w, x, k, y, y_stride, cols, bias);
  }
  block_tile<R, F>(w, x, k, y, y_stride, cols, bias);
}

// the widened weights of one group's columns c0..c1-1 (packed.h's widening): out(c, i, weight)
template <class F, class Out>
void widen(const uint8_t* gp, int64_t c0, int64_t c1, const Out& out) {
  vf d[kVecs], m[kVecs];
  F::scales(gp, d, m);
  for (int64_t i = 0; i < F::kGroup; ++i) {
    vf wv[kVecs];
    F::weights(gp, gp + F::kHeader + i * F::kStep, d, m, wv);
    float w[kBlock];
    std::memcpy(w, wv, sizeof w);
    for (int64_t c = c0; c < c1; ++c) out(c, i, w[c]);
  }
}

// A tile of rows widens every weight in registers as it reads it (block_tile), where the widening
// overlaps the multiply-adds; a pass of more rows than kRegisterTiles tiles hold widens each column
// block a chunk of k at a time into a per-thread buffer that stays in L1, and every row tile
// carries its chains over it (chain_rows): each weight widened once per pass, the same
// multiply-add order, the same bits. Measured on Zen 4 (bench.linear): 16 rows are as fast
// either way, prompt passes 1.1x to 1.3x faster than widening per product for oneDNN.
constexpr int64_t kRegisterTiles = 4;
constexpr int64_t kChunk = 64;  // k widened at a time: 16 KiB of float32 on AVX-512

template <class F>
void run_chunked(const uint8_t* w, const float* x, const float* bias, float* y, int64_t m, int64_t k, int64_t n,
                 int64_t cols, std::vector<float>& scratch) {
  constexpr int64_t per_chunk = kChunk / F::kGroup;
  const int64_t groups = k / F::kGroup, step = tile_rows(m);
  scratch.resize(std::max<size_t>(scratch.size(), (kChunk + m) * kBlock));
  float* wide = scratch.data();
  float* acc = wide + kChunk * kBlock;
  for (int64_t g0 = 0; g0 < groups; g0 += per_chunk) {
    const int64_t g1 = std::min(groups, g0 + per_chunk);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = w + g * F::kBytes;
      vf d[kVecs], mins[kVecs];
      F::scales(gp, d, mins);
      float* out = wide + (g - g0) * F::kGroup * kBlock;
      for (int64_t i = 0; i < F::kGroup; ++i) {
        vf wv[kVecs];
        F::weights(gp, gp + F::kHeader + i * F::kStep, d, mins, wv);
        for (int j = 0; j < kVecs; ++j) store(out + i * kBlock + kLanes * j, wv[j]);
      }
    }
    for (int64_t r = 0; r < m; r += step)
      chain_tile(static_cast<int>(std::min(step, m - r)), wide, x + r * k + g0 * F::kGroup, k, (g1 - g0) * F::kGroup,
                 acc + r * kBlock, g0 == 0);
  }
  for (int64_t r = 0; r < m; ++r) {
    float* out = y + r * n;
    const float* a = acc + r * kBlock;
    for (int64_t c = 0; c < cols; ++c) out[c] = bias == nullptr ? a[c] : a[c] + bias[c];
  }
}

template <class F>
void run(const uint8_t* wp, const float* xp, const float* bp, float* yp, int64_t m, int64_t k, int64_t n,
         int64_t blocks) {
  const int64_t stride = (k / F::kGroup) * F::kBytes, step = tile_rows(m, F::kRowsMax);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> scratch;  // one per thread, kept across products and passes
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * kBlock, cols = std::min(kBlock, n - c0);
      const float* bias = bp == nullptr ? nullptr : bp + c0;
      if (m <= kRegisterTiles * F::kRowsMax) {
        for (int64_t r = 0; r < m; r += step)
          tile<F>(static_cast<int>(std::min(step, m - r)), wp + b * stride, xp + r * k, k, yp + r * n + c0, n,
                  cols, bias);
      } else {
        run_chunked<F>(wp + b * stride, xp, bias, yp + c0, m, k, n, cols, scratch);
      }
    }
  });
}

template <class Fn>
void by_format(int64_t format, Fn fn) {
  if (by_block_format<Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K>(format, fn)) return;
  switch (format) {
    case kF16: return fn(F16{});
    case kBF16: return fn(BF16{});
    default: TORCH_CHECK(false, "block format ", format, " has no kernel");
  }
}

// the format's packed shape, checked against the weight
PackedShape checked(const at::Tensor& packed, int64_t format, int64_t n, const char* who) {
  PackedShape shape{};
  by_format(format, [&](auto f) { shape = shape_of<decltype(f)>(kBlock); });
  return check_packed(packed, shape, format, n, who);
}

}  // namespace

int64_t skinny_block() { return kBlock; }

at::Tensor block_linear(at::Tensor x, at::Tensor packed, int64_t format, const std::optional<at::Tensor>& bias,
                        int64_t n) {
  if (format >= kQ8Activations) return q8_linear(x, packed, format, bias, n);
  RECORD_FUNCTION("pie::block_linear", std::vector<c10::IValue>());
  const PackedShape s = checked(packed, format, n, "block_linear");
  check_operands(x, s.k, bias, n, "block_linear");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  by_format(format, [&](auto f) {
    run<decltype(f)>(packed.data_ptr<uint8_t>(), xc.data_ptr<float>(), bp, y.data_ptr<float>(), x.size(0), s.k, n,
                     s.blocks);
  });
  return y;
}

at::Tensor block_dense(at::Tensor packed, int64_t format, int64_t n) {
  if (format >= kQ8Activations) return q8_dense(packed, format, n);
  const PackedShape s = checked(packed, format, n, "block_dense");
  at::Tensor out;
  by_format(format, [&](auto f) {
    using F = decltype(f);
    out = widen_dense(packed, s, n, [](auto... a) { widen<F>(a...); });
  });
  return out;
}

at::Tensor block_gather(at::Tensor packed, int64_t format, int64_t n, at::Tensor ids) {
  if (format >= kQ8Activations) return q8_gather(packed, format, n, ids);
  const PackedShape s = checked(packed, format, n, "block_gather");
  at::Tensor out;
  by_format(format, [&](auto f) {
    using F = decltype(f);
    out = widen_rows(packed, s, n, ids, "block_gather", [](auto... a) { widen<F>(a...); });
  });
  return out;
}
