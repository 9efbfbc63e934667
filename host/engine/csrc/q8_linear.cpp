// y = x @ W^T + b with 8-bit activations: a second arithmetic, chosen explicitly (a model imported
// with --activations q8), never the default. The weight stays in its file's blocks (Q8_0, Q4_0,
// Q4_1, and the K-quants Q4_K, Q5_K, Q6_K); each row of x is quantized per 32 k as llama.cpp's Q8_1 does (d = max|x| / 127,
// q = x / d rounded to nearest even, s = d * sum q), and a group's products are integer dot
// products, exact and order-free:
//
//   acc = fma(float(sum_k qw * qx - offset * sum_k qx), dw * dx, acc)   then, for Q4_1, Q4_K, Q5_K,
//   acc = fma(mw, sx, acc)                                               over groups in order,
//
// then + b. A row's result depends on that row alone (its own scales, its own integer sums), so a
// row gets the same bits in a pass of one as of forty, and speculative output still equals plain
// output in this mode; the AVX-512 (VNNI or not), AVX2 and scalar paths give the same bits
// (tests/test_q8_linear.py). It is not the float32 product of the dequantized weight: the
// activations lose about 8 bits, as llama.cpp's quantized products do.
//
// where a group is the k one set of the weight's scales covers (32; 16 for Q6_K, whose two groups
// share an activation group's dx). Layout (blocks.py's repack_q8), column blocks of kLanes
// outputs, [ceil(N / kLanes), K / group, bytes]: per group, the columns' d (and m: Q4_1's, or a
// K-quant's negated min), float16 for the legacy formats and float32 for the K-quants, then the
// quants four k at a time, each column's four side by side (the operand of one 4-way byte dot
// product): for byte quants group / 4 runs of kLanes * 4 bytes, for 4-bit ones four, run p
// holding k 4p..4p+3 in the low nibbles and k 4p+16..4p+19 in the high ones.
#include "kernels.h"
#include "packed.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace pie;

constexpr int64_t kActGroup = 32;  // k an activation scale covers, as a legacy block's
constexpr int64_t kC = kLanes;   // columns in a block: one int32 lane each
#if defined(__AVX512F__)
constexpr int kTile = 8;  // rows a tile: an int and a float accumulator each, in registers
#elif defined(__AVX2__)
constexpr int kTile = 4;
#else
constexpr int kTile = 4;
#endif

// The rows of x quantized per group: q [m, K] int8, d and s (= d * sum q) [m, K / 32] float32,
// sum [m, K / 32] int32
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
};

// one group of 32 values: amax, its scale, and 32 quants rounded to nearest even
void quantize_group(const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  float amax = 0.0f;
  for (int i = 0; i < kActGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  int32_t total = 0;
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), iv);
    const __m512i r = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i*)(q + 16 * h), _mm512_cvtepi32_epi8(r));
    total += _mm512_reduce_add_epi32(r);
  }
#else
  for (int i = 0; i < kActGroup; ++i) {
    const int32_t r = static_cast<int32_t>(std::nearbyint(x[i] * inv));  // the default rounding: to even
    q[i] = static_cast<int8_t>(r);
    total += r;
  }
#endif
  *d = scale;
  *sum = total;
  *s = scale * static_cast<float>(total);
}

void quantize(const float* x, int64_t m, int64_t k, Quantized& out) {
  const int64_t groups = k / kActGroup;
  out.q.resize(m * k);
  out.d.resize(m * groups);
  out.s.resize(m * groups);
  out.sum.resize(m * groups);
  // a prompt pass's rows are many: its threads share them (each group is quantized alone)
  at::parallel_for(0, m * groups, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_group(x + i * kActGroup, out.q.data() + i * kActGroup, &out.d[i], &out.s[i], &out.sum[i]);
  });
}

inline int32_t word(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// the scalar statement of the two below: the weights' bytes read as Byte (uint8_t or int8_t)
template <class Byte>
[[maybe_unused]] inline vi dot_scalar(vi acc, const vi& w, const int8_t* x) {
  for (int l = 0; l < kLanes; ++l) {
    const Byte* b = reinterpret_cast<const Byte*>(&w) + 4 * l;
    for (int t = 0; t < 4; ++t) acc[l] += static_cast<int32_t>(b[t]) * x[t];
  }
  return acc;
}

// acc[c] += sum over the 4 bytes of lane c: unsigned weights u times signed activations x (the
// four bytes at x, the same for every lane)
inline vi dot_u(vi acc, const vi& u, const int8_t* x) {
#if defined(__AVX512VNNI__)
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, _mm512_set1_epi32(word(x)));
#elif defined(__AVX512BW__)
  const __m512i p = _mm512_maddubs_epi16((__m512i)u, _mm512_set1_epi32(word(x)));  // u <= 15: no saturation
  return acc + (vi)_mm512_madd_epi16(p, _mm512_set1_epi16(1));
#elif defined(__AVX2__)
  const __m256i p = _mm256_maddubs_epi16((__m256i)u, _mm256_set1_epi32(word(x)));
  return acc + (vi)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
#else
  return dot_scalar<uint8_t>(acc, u, x);
#endif
}

// acc[c] += sum over the 4 bytes of lane c: signed weights w times signed activations x (as
// llama.cpp: |w| times x with w's sign, so the unsigned-by-signed product takes them)
inline vi dot_s(vi acc, const vi& w, const int8_t* x) {
#if defined(__AVX512BW__)
  const __m512i wv = (__m512i)w, xv = _mm512_set1_epi32(word(x));
  const __m512i xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
#if defined(__AVX512VNNI__)
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, _mm512_abs_epi8(wv), xs);
#else
  return acc + (vi)_mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(wv), xs), _mm512_set1_epi16(1));
#endif
#elif defined(__AVX2__)
  const __m256i wv = (__m256i)w, xv = _mm256_set1_epi32(word(x));
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  return acc + (vi)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
#else
  return dot_scalar<int8_t>(acc, w, x);
#endif
}

inline vi load_i(const uint8_t* p) {
  vi v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A format in the q8 layout: Scales scales per column (d; d, m), float16 (the legacy formats) or
// float32 (a K-quant's group scale, its super-block's float16 times its own small integer, exact);
// quants 4-bit (Nibbles), or a byte each, unsigned (Q5_K's 0..31) or signed; Group k a set of
// scales covers (32; Q6_K 16, half an activation group); Offset what a quant's value is less (Q4_0: 8)
template <int Scales, bool F32, bool Nibbles, bool Signed, int Offset, int64_t Group>
struct Format {
  static constexpr int64_t kGroup = Group;
  static constexpr int64_t kHeader = (F32 ? 4 : 2) * Scales * kC;
  static constexpr int64_t kBytes = kHeader + (Nibbles ? Group / 2 : Group) * kC;
  static constexpr bool kMin = Scales == 2;
  static constexpr int kOffset = Offset;

  static vf scale(const uint8_t* h, int which) {
    if constexpr (F32) return load(reinterpret_cast<const float*>(h) + which * kC);
    return halves(h + 2 * which * kC);
  }

  // isum[r] = sum over the group's k of quant * x_r, for R rows (x_r = x + r * k)
  template <int R>
  static void dots(const uint8_t* qp, const int8_t* x, int64_t k, vi* isum) {
    if constexpr (Nibbles) {
      static_assert(Group == 32, "4-bit runs pair k 4p.. with 4p + 16..");
      const vi mask = vi{} + 0x0F0F0F0F;
      for (int p = 0; p < 4; ++p) {
        const vi v = load_i(qp + p * 4 * kC);
        const vi lo = v & mask, hi = (v >> 4) & mask;  // per 32-bit lane: shift, then drop other bytes' bits
        for (int r = 0; r < R; ++r) {
          isum[r] = dot_u(isum[r], lo, x + r * k + 4 * p);
          isum[r] = dot_u(isum[r], hi, x + r * k + 4 * p + 16);
        }
      }
    } else {
      for (int p = 0; p < Group / 4; ++p) {
        const vi v = load_i(qp + p * 4 * kC);
        for (int r = 0; r < R; ++r)
          isum[r] = Signed ? dot_s(isum[r], v, x + r * k + 4 * p) : dot_u(isum[r], v, x + r * k + 4 * p);
      }
    }
  }

  // the widened weights of one group's columns c0..c1-1, exactly as gguf-py's formulas: out(c, i)
  template <class Out>
  static void widen(const uint8_t* gp, int64_t c0, int64_t c1, Out out) {
    for (int64_t c = c0; c < c1; ++c) {
      const float d = scale(gp, 0)[c], m = kMin ? scale(gp, 1)[c] : 0.0f;
      const uint8_t* qp = gp + kHeader;
      for (int64_t i = 0; i < Group; ++i) {
        int q;
        if constexpr (Nibbles) {
          const int byte = qp[((i % 16) / 4) * 4 * kC + 4 * c + i % 4];
          q = (i < 16 ? byte & 0x0F : byte >> 4) - Offset;
        } else {
          const uint8_t byte = qp[(i / 4) * 4 * kC + 4 * c + (i % 4)];
          q = Signed ? static_cast<int8_t>(byte) : byte;
        }
        out(c, i, kMin ? std::fma(d, static_cast<float>(q), m) : d * static_cast<float>(q));
      }
    }
  }
};

using Q8_0 = Format<1, false, false, true, 0, 32>;
using Q4_0 = Format<1, false, true, false, 8, 32>;
using Q4_1 = Format<2, false, true, false, 0, 32>;
using Q4_K = Format<2, true, true, false, 0, 32>;    // m stored negated: d * q + m
using Q5_K = Format<2, true, false, false, 0, 32>;   // quants 0..31
using Q6_K = Format<1, true, false, true, 0, 16>;    // quants -32..31, groups of 16

// R rows (from row0 of the quantized x) times one column block, into cols (<= kC) columns of y
template <int R, class F>
void q8_tile(const uint8_t* __restrict w, const Quantized& a, int64_t row0, int64_t k, float* __restrict y,
             int64_t y_stride, int64_t cols, const float* __restrict bias) {
  const int64_t groups = k / F::kGroup, act_groups = k / kActGroup;
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vf{};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = w + g * F::kBytes;
    __builtin_prefetch(gp + 4096);
    vi isum[R];
    for (int r = 0; r < R; ++r) isum[r] = vi{};
    F::template dots<R>(gp + F::kHeader, a.q.data() + row0 * k + g * F::kGroup, k, isum);
    const vf dw = F::scale(gp, 0), mw = F::kMin ? F::scale(gp, 1) : vf{};
    const int64_t ag = g * F::kGroup / kActGroup;  // the activations' group
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * act_groups + ag;
      vi s = isum[r];
      if constexpr (F::kOffset != 0) s -= F::kOffset * a.sum[at];
      const vf dd = dw * splat(a.d[at]);
      acc[r] = fmadd(__builtin_convertvector(s, vf), dd, acc[r]);
      if constexpr (F::kMin) acc[r] = fmadd(mw, a.s[at], acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kC];
    std::memcpy(out, &acc[r], sizeof out);
    for (int64_t c = 0; c < cols; ++c) y[r * y_stride + c] = bias == nullptr ? out[c] : out[c] + bias[c];
  }
}

template <class F, int R = kTile>
void tile(int rows, const uint8_t* w, const Quantized& a, int64_t row0, int64_t k, float* y, int64_t y_stride,
          int64_t cols, const float* bias) {
  if constexpr (R > 1) {
    if (rows < R) return tile<F, R - 1>(rows, w, a, row0, k, y, y_stride, cols, bias);
  }
  q8_tile<R, F>(w, a, row0, k, y, y_stride, cols, bias);
}

template <class Fn>
void by_format(int64_t format, Fn fn) {
  const bool known = by_block_format<Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K>(format - kQ8Activations, fn);
  TORCH_CHECK(known, "format ", format, " has no kernel with 8-bit activations");
}

// the format's packed shape, checked against the weight
PackedShape checked(const at::Tensor& packed, int64_t format, int64_t n, const char* who) {
  PackedShape shape{};
  by_format(format, [&](auto f) { shape = shape_of<decltype(f)>(kC); });
  shape = check_packed(packed, shape, format, n, who);
  TORCH_CHECK(shape.k % kActGroup == 0, who, ": K is whole groups of ", kActGroup);
  return shape;
}

}  // namespace

int64_t q8_block() { return kC; }

at::Tensor q8_linear(at::Tensor x, at::Tensor packed, int64_t format, const std::optional<at::Tensor>& bias,
                     int64_t n) {
  RECORD_FUNCTION("pie::q8_linear", std::vector<c10::IValue>());
  const PackedShape s = checked(packed, format, n, "q8_linear");
  check_operands(x, s.k, bias, n, "q8_linear");
  const int64_t k = s.k, m = x.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  thread_local Quantized kept;  // the caller's, kept across products: no allocation per product
  Quantized& a = kept;           // a reference: in the workers, the name would be their own copy
  quantize(xc.data_ptr<float>(), m, k, a);
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  by_format(format, [&](auto f) {
    using F = decltype(f);
    const int64_t stride = (k / F::kGroup) * F::kBytes;
    at::parallel_for(0, s.blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t c0 = b * kC, cols = std::min(kC, n - c0);
        for (int64_t r = 0; r < m; r += kTile)
          tile<F>(static_cast<int>(std::min<int64_t>(kTile, m - r)), wp + b * stride, a, r, k, yp + r * n + c0, n,
                  cols, bp == nullptr ? nullptr : bp + c0);
      }
    });
  });
  return y;
}

at::Tensor q8_dense(at::Tensor packed, int64_t format, int64_t n) {
  const PackedShape s = checked(packed, format, n, "q8_dense");
  at::Tensor out;
  by_format(format, [&](auto f) {
    using F = decltype(f);
    out = widen_dense(packed, s, n, [](auto... a) { F::widen(a...); });
  });
  return out;
}

at::Tensor q8_gather(at::Tensor packed, int64_t format, int64_t n, at::Tensor ids) {
  const PackedShape s = checked(packed, format, n, "q8_gather");
  at::Tensor out;
  by_format(format, [&](auto f) {
    using F = decltype(f);
    out = widen_rows(packed, s, n, ids, "q8_gather", [](auto... a) { F::widen(a...); });
  });
  return out;
}
