// Float vectors for the engine's CPU kernels: GCC's vector extensions, one of the target's
// registers wide (16 floats on AVX-512, 8 on AVX2 and elsewhere). Wider than a register, GCC
// keeps arrays of them on the stack and a kernel runs several times slower.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pie {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float x) { return vf{} + x; }

// kLanes float16 values as float32 (exact)
inline vf halves(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf v;
  for (int l = 0; l < kLanes; ++l) {
    c10::Half h;
    std::memcpy(&h, p + 2 * l, 2);
    v[l] = static_cast<float>(h);
  }
  return v;
#endif
}

// the cache lines (64 bytes) of the n floats at p, fetched ahead of their reading
inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
}

// acc + w * x in one rounding, spelled out: left to itself GCC contracts a multiply and an add
// in some loops and not in others, and the same row could then get other bits elsewhere
inline vf fmadd(vf w, float x, vf acc) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)w, _mm512_set1_ps(x), (__m512)acc);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)w, _mm256_set1_ps(x), (__m256)acc);
#else
  for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(w[l], x, acc[l]);
  return acc;
#endif
}

// acc + a * b, lane by lane, in one rounding (as fmadd above)
inline vf fmadd(vf a, vf b, vf acc) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(a[l], b[l], acc[l]);
  return acc;
#endif
}

namespace detail {
template <int... I>
inline vf pair_sums(vf x, vf y, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, y, (2 * I)...) + __builtin_shufflevector(x, y, (2 * I + 1)...);
}
}  // namespace detail

// kLanes vectors in, one out: lane l holds the sum of v[l]'s lanes. Every input is summed by the
// same tree (neighbouring lanes first), whatever its place, so a sum does not depend on the
// vectors it was reduced with. A few shuffles for kLanes sums, where hsum takes a store and
// kLanes - 1 scalar adds for one. v is overwritten.
inline vf lane_sums(vf* v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // hadd pairs neighbours within each 128-bit half: two rounds leave each input's two half-sums
  // in the two halves, and one add of the halves finishes them
  __m256 t[4], u[2];
  for (int k = 0; k < 4; ++k) t[k] = _mm256_hadd_ps((__m256)v[2 * k], (__m256)v[2 * k + 1]);
  for (int k = 0; k < 2; ++k) u[k] = _mm256_hadd_ps(t[2 * k], t[2 * k + 1]);
  return (vf)_mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
#else
  // each round sums neighbouring lanes of two vectors into one: [x0+x1, x2+x3, ..., y0+y1, ...]
  for (int n = kLanes; n > 1; n /= 2)
    for (int k = 0; k < n / 2; ++k)
      v[k] = detail::pair_sums(v[2 * k], v[2 * k + 1], std::make_integer_sequence<int, kLanes>{});
  return v[0];
#endif
}

// the lanes summed as a tree of halves: ((l0 + l8) + (l4 + l12)) + ... on 16 lanes
inline float hsum(vf v) {
  float l[kLanes];
  std::memcpy(l, &v, sizeof l);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) l[i] += l[i + w];
  return l[0];
}

// 0, 1, ..., kLanes - 1
inline vi iota() {
  vi v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// exp(x) for x <= 0 (attention scores minus their maximum, silu's exp(-|x|)): Cephes' expf, range-reduced by ln 2 in two
// parts, a degree-5 polynomial, and the power of two put into the exponent bits. Within ~2 ulp;
// inputs below -87 give ~1e-38 instead of a denormal.
inline vf exp_nonpositive(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  vf t = x * splat(1.44269504088896341f) + splat(0.5f);
  vi n = __builtin_convertvector(t, vi);  // truncates toward zero: floor for t >= 0
  n = n + (__builtin_convertvector(n, vf) > t);  // mask is -1 where truncation went up: floor
  vf fn = __builtin_convertvector(n, vf);
  vf r = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
  vf z = r * r;
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * z + r + splat(1.0f);
  vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace pie
