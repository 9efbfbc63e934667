// Float vectors for the engine's CPU kernels: GCC's vector extensions, 16 floats wide. The
// compiler lowers them to the target's registers (one AVX-512 register, two AVX ones, four SSE
// ones), so one source serves them all.
#pragma once

#include <cstdint>
#include <cstring>

namespace pie {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float x) { return vf{} + x; }

inline float hsum(vf v) {
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
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
