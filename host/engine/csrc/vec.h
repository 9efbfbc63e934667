// Float vectors for the engine's CPU kernels: GCC's vector extensions, one of the target's
// registers wide (16 floats on AVX-512, 8 on AVX2 and elsewhere). Wider than a register, GCC
// keeps arrays of them on the stack and a kernel runs several times slower.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
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
