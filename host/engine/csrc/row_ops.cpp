// The layer stack's elementwise steps, each one call instead of a chain of torch operators: the
// residual add with RMSNorm, RoPE with the K/V rows' write into the pool, and SiLU(gate) * up.
//
// A one-row decode pass through torch's operators makes some 50 calls per layer, and on a CPU
// each costs microseconds whatever its size; these three replace about 35 of them. Each row is
// computed alone, in an order that does not depend on the rest of the batch. RoPE computes
// torch's expression x * cos + roll(x) * sin with the same roundings (no fused multiply-add),
// so its bits are torch's; the norm's sum of squares and SiLU's exp round differently from
// torch's own kernels, within float tolerance (tests/test_row_ops.py).
#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>

using namespace pie;

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(1) == 1,
              name, ": CPU float32 [rows, n] with unit column stride");
}

// norm of one row: out = weight * (h * rsqrt(mean(h^2) + eps)), both products rounded as torch's
void norm_row(const float* __restrict h, const float* __restrict w, float* __restrict out, int64_t n, float eps) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = load(h + i);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += h[i] * h[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf scaled = load(h + i) * inv;
    store(out + i, load(w + i) * scaled);
  }
  for (; i < n; ++i) {
    const float scaled = h[i] * inv;
    out[i] = w[i] * scaled;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> residual_norm(at::Tensor x, const std::optional<at::Tensor>& delta,
                                                       at::Tensor weight, double eps) {
  RECORD_FUNCTION("pie::residual_norm", std::vector<c10::IValue>());
  check_rows(x, "residual_norm: x");
  const int64_t t = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(), "residual_norm: weight is float32 [", n, "]");
  at::Tensor h = x.contiguous();
  if (delta.has_value()) {
    check_rows(*delta, "residual_norm: delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "residual_norm: delta is ", delta->sizes(), ", x ", x.sizes());
    h = at::empty_like(h);
  }
  at::Tensor y = at::empty({t, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), ds = delta.has_value() ? delta->stride(0) : 0;
  float* hp = h.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* hr = hp + r * n;
      if (dp != nullptr) {
        const float* a = xp + r * xs;
        const float* b = dp + r * ds;
        for (int64_t i = 0; i < n; ++i) hr[i] = a[i] + b[i];
      }
      norm_row(hr, wp, yp + r * n, n, static_cast<float>(eps));
    }
  });
  return {h, y};
}

// x * cos + roll(x, D / 2) * sin with sin's first half negated (stack.py's sign-folded table):
// three roundings, as torch's three operators make, so no multiply-add may be contracted here.
__attribute__((optimize("fp-contract=off"))) static void rope_row(const float* __restrict x,
                                                                  const float* __restrict cos,
                                                                  const float* __restrict sin,
                                                                  float* __restrict out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i < half ? i + half : i - half] * sin[i];
    out[i] = a + b;
  }
}

at::Tensor rope_store(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor kv,
                         at::Tensor slots, int64_t heads, int64_t kv_heads) {
  RECORD_FUNCTION("pie::rope_store", std::vector<c10::IValue>());
  check_rows(qkv, "rope_store: qkv");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.size(1) == kv_heads && kv.is_contiguous() &&
                  kv.scalar_type() == at::kFloat,
              "rope_store: kv is one layer's pool, float32 [2, ", kv_heads, ", slots, D]");
  const int64_t t = qkv.size(0), d = kv.size(3), pool = kv.size(2);
  TORCH_CHECK(d % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * d, "rope_store: qkv has ", qkv.size(1),
              " columns, not (", heads, " + 2 * ", kv_heads, ") * ", d);
  const at::Tensor c = cos.contiguous().view({-1}), s = sin.contiguous().view({-1});
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && c.numel() == t * d &&
                  s.numel() == t * d, "rope_store: cos and sin are float32 [T, 1, ", d, "]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == t && slots.scalar_type() == at::kLong,
              "rope_store: one int64 slot per row");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < pool, "rope_store: slot ", sp[r], " is outside the pool's ", pool);
  at::Tensor q = at::empty({t, heads, d}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* snp = s.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = kv.data_ptr<float>();
  float* vp = kp + kv_heads * pool * d;
  const int64_t xs = qkv.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * xs;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* out = h < heads ? qp + (r * heads + h) * d : kp + ((h - heads) * pool + sp[r]) * d;
        rope_row(row + h * d, cp + r * d, snp + r * d, out, d);
      }
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(vp + (h * pool + sp[r]) * d, row + (heads + kv_heads + h) * d, d * sizeof(float));
    }
  });
  return q;
}

at::Tensor silu_mul(at::Tensor gate_up, int64_t inter) {
  RECORD_FUNCTION("pie::silu_mul", std::vector<c10::IValue>());
  check_rows(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) == 2 * inter, "silu_mul: gate_up has ", gate_up.size(1), " columns, not 2 * ", inter);
  const int64_t t = gate_up.size(0), gs = gate_up.stride(0);
  at::Tensor y = at::empty({t, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // silu(g) = g / (1 + e^-g) = g e^g / (1 + e^g): the exponent is -|g| either way, never positive
  const auto silu = [](vf g) {
    const vf neg = g < splat(0.0f) ? g : -g;
    const vf e = exp_nonpositive(neg);
    const vf num = g < splat(0.0f) ? g * e : g;
    return num / (splat(1.0f) + e);
  };
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + inter;
      float* out = yp + r * inter;
      int64_t i = 0;
      for (; i + kLanes <= inter; i += kLanes) store(out + i, silu(load(g + i)) * load(u + i));
      if (i < inter) {  // the tail through a padded vector
        float gt[kLanes] = {}, ut[kLanes] = {}, ot[kLanes];
        std::memcpy(gt, g + i, (inter - i) * sizeof(float));
        std::memcpy(ut, u + i, (inter - i) * sizeof(float));
        store(ot, silu(load(gt)) * load(ut));
        std::memcpy(out + i, ot, (inter - i) * sizeof(float));
      }
    }
  });
  return y;
}
