// Paged attention of short query windows (decode rows, verification windows) on the CPU, in float32.
//
// SDPA over the paged pool needs each pass's context gathered into a padded copy first: the
// copy is written and read again, three times the traffic of reading the context once. This
// kernel reads each context row where it lies in the pool. Each query row is computed alone, in
// an order that does not depend on the rest of the batch: a row gets the same result in a
// one-row decode pass and inside a batch or a verification window.
#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace pie;

const vi kIota = iota();

// Context rows lie in pages scattered over the pool, where the hardware prefetcher does not
// follow: each row is fetched a page (16 rows, the default page size) before it is read.
constexpr int64_t kAhead = 16;

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

}  // namespace

// For each pass b, each row i < windows[b] of its window, and each query head h:
//   out[h, starts[b] + i] = attention of q[h, starts[b] + i] (a [D] row) over the first
//   frozen[b] + i + 1 rows of pass b's context (causal within the window),
// where context row j is pool slot ctx[b, j], or base + j when ctx is empty (one pass whose
// context is one run of slots). kv: one layer's pool, [2, kv_heads, slots, D], contiguous. q and
// out: [heads, T, D] with any strides but the last; query head h reads kv head h / (heads / kv_heads).
// One task is one pass, one kv head and a block of the window's rows: a context row is read once
// for all the block's rows and heads. A batch of few passes is cut into blocks of fewer rows,
// so that every thread gets work. A row's arithmetic is that of a one-row pass with frozen[b] + i
// rows, whatever its block.
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor kv, at::Tensor ctx, int64_t base,
                     at::Tensor starts, at::Tensor windows, at::Tensor frozen, double scale) {
  RECORD_FUNCTION("pie::paged_attention", std::vector<c10::IValue>());  // named in profiles
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "paged_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && kv.dim() == 4 && kv.is_contiguous() && q.sizes() == out.sizes(),
              "paged_attention: shapes");
  const int64_t heads = q.size(0), t = q.size(1), d = q.size(2), kv_heads = kv.size(1), slots = kv.size(2);
  TORCH_CHECK(kv.size(0) == 2 && kv.size(3) == d && d % kLanes == 0 && heads % kv_heads == 0,
              "paged_attention: head_dim must be a multiple of ", kLanes, " and heads of kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: q and out need a unit last stride");
  for (const auto& x : {starts, windows, frozen})
    TORCH_CHECK(x.scalar_type() == at::kLong && x.is_contiguous() && x.numel() == starts.numel(),
                "paged_attention: starts, windows and frozen are one int64 entry per pass");
  const int64_t passes = starts.numel(), group = heads / kv_heads, chunks = d / kLanes;
  const bool runs = ctx.numel() == 0;
  TORCH_CHECK(runs || (ctx.scalar_type() == at::kLong && ctx.is_contiguous() && ctx.dim() == 2 &&
                       ctx.size(0) == passes),
              "paged_attention: ctx is [passes, longest context] int64, or empty");
  const int64_t ctx_len = runs ? 0 : ctx.size(1);
  const int64_t *sp = starts.data_ptr<int64_t>(), *wp = windows.data_ptr<int64_t>(), *fp = frozen.data_ptr<int64_t>();
  const int64_t* cp = runs ? nullptr : ctx.data_ptr<int64_t>();
  int64_t longest = 0, widest = 0;
  for (int64_t b = 0; b < passes; ++b) {
    const int64_t len = fp[b] + wp[b];
    TORCH_CHECK(wp[b] >= 1 && fp[b] >= 0 && sp[b] >= 0 && sp[b] + wp[b] <= t, "paged_attention: bad window");
    TORCH_CHECK(runs ? base >= 0 && base + len <= slots : len <= ctx_len, "paged_attention: the visible context is past the pool or ctx");
    for (int64_t j = 0; !runs && j < len; ++j)
      TORCH_CHECK(cp[b * ctx_len + j] >= 0 && cp[b * ctx_len + j] < slots, "paged_attention: a slot past the pool");
    longest = std::max(longest, len);
    widest = std::max(widest, wp[b]);
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = kv.data_ptr<float>();
  const float* vp = kp + kv_heads * slots * d;
  const int64_t qs_h = q.stride(0), qs_t = q.stride(1), os_h = out.stride(0), os_t = out.stride(1);
  const float sc = static_cast<float>(scale);
  const int64_t width = (longest + kLanes - 1) / kLanes * kLanes;
  // blocks per window: enough tasks for every thread a few times over, none of them empty
  const int64_t want = 4 * at::get_num_threads();
  const int64_t blocks = std::min(widest, std::max<int64_t>(1, (want + passes * kv_heads - 1) / (passes * kv_heads)));
  const int64_t block = (widest + blocks - 1) / blocks;

  at::parallel_for(0, passes * kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    // per (block row, head) r = (i - i0) * group + h: its scores, its running sum of weighted values
    std::vector<float> score(block * group * width);
    std::vector<vf> acc(block * group * chunks);
    std::vector<int64_t> slot(longest);
    std::vector<float> total(block * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (kv_heads * blocks), g = task / blocks % kv_heads, f = fp[b];
      const int64_t i0 = task % blocks * block, i1 = std::min(wp[b], i0 + block), len = f + i1;
      if (i0 >= i1) continue;  // a window shorter than the widest
      for (int64_t j = 0; j < len; ++j) slot[j] = runs ? base + j : cp[b * ctx_len + j];
      const float* keys = kp + g * slots * d;
      const float* values = vp + g * slots * d;
      auto query = [&](int64_t i, int64_t h) { return qp + (g * group + h) * qs_h + (sp[b] + i) * qs_t; };
      auto row = [&](int64_t i, int64_t h) { return (i - i0) * group + h; };
      // scores: context row j is seen by window rows i >= j - f
      for (int64_t j = 0; j < len; ++j) {
        if (j + kAhead < len) prefetch(keys + slot[j + kAhead] * d, d);
        const float* k = keys + slot[j] * d;
        for (int64_t i = std::max(j - f, i0); i < i1; ++i) {
          for (int64_t h = 0; h < group; ++h) {
            const float* qi = query(i, h);
            vf s = load(qi) * load(k);
            for (int64_t c = 1; c < chunks; ++c) s += load(qi + c * kLanes) * load(k + c * kLanes);
            score[row(i, h) * width + j] = hsum(s) * sc;
          }
        }
      }
      // softmax weights, unnormalised, over each row's f + i + 1 rows; the padding weighs 0
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t seen = f + i + 1, padded = (seen + kLanes - 1) / kLanes * kLanes;
        for (int64_t h = 0; h < group; ++h) {
          float* s = score.data() + row(i, h) * width;
          for (int64_t j = seen; j < padded; ++j) s[j] = -std::numeric_limits<float>::infinity();
          vf m = load(s);
          for (int64_t j = kLanes; j < padded; j += kLanes) {
            vf x = load(s + j);
            m = x > m ? x : m;
          }
          const vf top = splat(hmax(m));
          vf sum{};
          for (int64_t j = 0; j < padded; j += kLanes) {
            vf e = exp_nonpositive(load(s + j) - top);
            if (j + kLanes > seen) e = kIota < static_cast<int32_t>(seen - j) ? e : vf{};
            store(s + j, e);
            sum += e;
          }
          total[row(i, h)] = hsum(sum);
        }
      }
      // the weighted sum of the values, each value row read once for the rows that see it
      std::fill(acc.begin(), acc.begin() + (i1 - i0) * group * chunks, vf{});
      for (int64_t j = 0; j < len; ++j) {
        if (j + kAhead < len) prefetch(values + slot[j + kAhead] * d, d);
        const float* v = values + slot[j] * d;
        for (int64_t r = row(std::max(j - f, i0), 0); r < row(i1, 0); ++r) {
          const vf p = splat(score[r * width + j]);
          vf* a = acc.data() + r * chunks;
          for (int64_t c = 0; c < chunks; ++c) a[c] += p * load(v + c * kLanes);
        }
      }
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t h = 0; h < group; ++h) {
          const int64_t r = row(i, h);
          const vf inv = splat(1.0f / total[r]);
          float* o = op + (g * group + h) * os_h + (sp[b] + i) * os_t;
          for (int64_t c = 0; c < chunks; ++c) store(o + c * kLanes, acc[r * chunks + c] * inv);
        }
      }
    }
  });
}
