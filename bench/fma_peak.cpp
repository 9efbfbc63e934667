// This CPU's float32 multiply-add peak: 12 independent chains of vector FMAs a thread (more than
// the FMA latency times the ports), `threads` threads; bench.linear's roofline. Built for this
// machine (-march=native): the widest vectors it has.
#include <torch/extension.h>

#include <immintrin.h>

#include <chrono>
#include <thread>
#include <vector>

namespace {

#if defined(__AVX512F__)
using V = __m512;
constexpr int kLanes = 16;
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V splat(float x) { return _mm512_set1_ps(x); }
inline float sum(V v) { return _mm512_reduce_add_ps(v); }
#else
using V = __m256;
constexpr int kLanes = 8;
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V splat(float x) { return _mm256_set1_ps(x); }
inline float sum(V v) {
  float out[8];
  _mm256_storeu_ps(out, v);
  float s = 0;
  for (float x : out) s += x;
  return s;
}
#endif

float chains(int64_t iters) {
  V a[12];
  const V b = splat(1.0000001f), c = splat(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = splat(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = fma(a[i], b, c);
  }
  float s = 0;
  for (int i = 0; i < 12; ++i) s += sum(a[i]);
  return s;
}

}  // namespace

// (vector FMA instructions a second over all threads, lanes a vector)
std::tuple<double, int64_t> fma_peak(int64_t threads, int64_t iters) {
  std::vector<std::thread> ts;
  std::vector<float> sink(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t t = 0; t < threads; ++t) ts.emplace_back([&, t] { sink[t] = chains(iters); });
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = sink[0];
  (void)keep;
  return {12.0 * iters * threads / s, kLanes};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("fma_peak", &fma_peak); }
