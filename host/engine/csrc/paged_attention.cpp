// Paged attention of query windows (decode rows, verification windows, prompts) on the CPU, in float32.
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

// A row's context is cut into segments of this many rows, each its own task, merged at the end
// as a flash-decoding kernel does: a one-row pass has work for every thread. The cut depends on
// the row's context length alone, so the row's arithmetic does too.
constexpr int64_t kSegment = 128;
constexpr int64_t kMaxChunks = 256 / kLanes;  // head_dim up to 256

// Window rows per block at most: a block's scores (rows x group x kSegment) stay in L2.
constexpr int64_t kBlockRows = 32;

// Context rows per tile of the weighted sum: 64 value rows of 64 floats fill half of a 32 KiB L1.
constexpr int64_t kTile = 64;

// a[0..n) += p[j] * value row slot[j], for j in [j0, j1), in order; n vectors per row, slices of
// N in registers. Rows before `ahead` are fetched kAhead rows before their reading.
template <int N>
inline void weigh_slices(vf* a, int64_t n, const float* p, const float* values, const int64_t* slot, int64_t d,
                         int64_t j0, int64_t j1, int64_t ahead) {
  for (int64_t c0 = 0; c0 < n; c0 += N) {
    vf r[N];
    for (int c = 0; c < N; ++c) r[c] = a[c0 + c];
    for (int64_t j = j0; j < j1; ++j) {
      if (c0 == 0 && j + kAhead < ahead) prefetch(values + slot[j + kAhead] * d, d);
      const float* v = values + slot[j] * d + c0 * kLanes;
      for (int c = 0; c < N; ++c) r[c] = fmadd(load(v + c * kLanes), p[j], r[c]);
    }
    for (int c = 0; c < N; ++c) a[c0 + c] = r[c];
  }
}

inline void weigh(vf* a, int64_t n, const float* p, const float* values, const int64_t* slot, int64_t d,
                  int64_t j0, int64_t j1, int64_t ahead) {
  if (n % 8 == 0) return weigh_slices<8>(a, n, p, values, slot, d, j0, j1, ahead);
  if (n % 4 == 0) return weigh_slices<4>(a, n, p, values, slot, d, j0, j1, ahead);
  if (n % 2 == 0) return weigh_slices<2>(a, n, p, values, slot, d, j0, j1, ahead);
  weigh_slices<1>(a, n, p, values, slot, d, j0, j1, ahead);
}

}  // namespace

// For each pass b, each row i < windows[b] of its window, and each query head h:
//   out[h, starts[b] + i] = attention of q[h, starts[b] + i] (a [D] row) over the first
//   frozen[b] + i + 1 rows of pass b's context (causal within the window),
// where context row j is pool slot ctx[b, j], or base + j when ctx is empty (one pass whose
// context is one run of slots). kv: one layer's pool, [2, kv_heads, slots, D], contiguous. q and
// out: [heads, T, D] with any strides but the last; query head h reads kv head h / (heads / kv_heads).
// One task is one pass, one kv head, a block of the window's rows and one segment of the context:
// a context row is read once for all the block's rows and heads. Scores are taken kLanes context
// rows at a time (lane_sums), the weighted values a tile at a time. A batch of few passes is cut
// into blocks of fewer rows, so that every thread gets work. A row's arithmetic is that of a
// one-row pass with frozen[b] + i rows, whatever its block.
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor kv, at::Tensor ctx, int64_t base,
                     at::Tensor starts, at::Tensor windows, at::Tensor frozen, double scale) {
  RECORD_FUNCTION("pie::paged_attention", std::vector<c10::IValue>());  // named in profiles
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "paged_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && kv.dim() == 4 && kv.is_contiguous() && q.sizes() == out.sizes(),
              "paged_attention: shapes");
  const int64_t heads = q.size(0), t = q.size(1), d = q.size(2), kv_heads = kv.size(1), slots = kv.size(2);
  TORCH_CHECK(kv.size(0) == 2 && kv.size(3) == d && d % kLanes == 0 && d <= kMaxChunks * kLanes &&
                  heads % kv_heads == 0,
              "paged_attention: head_dim must be a multiple of ", kLanes, " up to ", kMaxChunks * kLanes,
              ", and heads of kv_heads");
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
  const int64_t segs = (longest + kSegment - 1) / kSegment;
  // blocks per window: enough tasks for every thread a few times over, none of them empty
  const int64_t want = 4 * at::get_num_threads();
  const int64_t per_block = passes * kv_heads * segs;
  const int64_t blocks = std::min(widest, std::max<int64_t>((widest + kBlockRows - 1) / kBlockRows,
                                                          (want + per_block - 1) / per_block));
  const int64_t block = (widest + blocks - 1) / blocks;
  // per (row, head, segment): the segment's weighted values [d], its largest score, its weights' sum
  const int64_t part_len = d + 2;
  std::vector<float> parts(t * heads * segs * part_len);
  auto part = [&](int64_t row, int64_t head, int64_t seg) {
    return parts.data() + ((row * heads + head) * segs + seg) * part_len;
  };

  at::parallel_for(0, passes * kv_heads * blocks * segs, 1, [&](int64_t begin, int64_t end) {
    // per (block row, head) r = (i - i0) * group + h: its scores, its running sum of weighted values
    std::vector<float> score(block * group * kSegment);
    std::vector<vf> acc(block * group * chunks);
    std::vector<int64_t> slot(kSegment);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t sg = task % segs, tb = task / segs;
      const int64_t b = tb / (kv_heads * blocks), g = tb / blocks % kv_heads, f = fp[b];
      const int64_t i0 = tb % blocks * block, i1 = std::min(wp[b], i0 + block);
      const int64_t a = sg * kSegment, e = std::min(f + i1, a + kSegment);  // the task's context rows [a, e)
      if (i0 >= i1 || a >= e) continue;  // a window shorter than the widest, a context shorter than the longest
      const int64_t n = e - a, groups = (n + kLanes - 1) / kLanes;
      for (int64_t j = 0; j < n; ++j) slot[j] = runs ? base + a + j : cp[b * ctx_len + a + j];
      // the last group's lanes past the context read a real row; their scores are masked below
      for (int64_t j = n; j < groups * kLanes; ++j) slot[j] = slot[n - 1];
      const float* keys = kp + g * slots * d;
      const float* values = vp + g * slots * d;
      auto query = [&](int64_t i, int64_t h) { return qp + (g * group + h) * qs_h + (sp[b] + i) * qs_t; };
      auto row = [&](int64_t i, int64_t h) { return (i - i0) * group + h; };
      const int64_t first = std::max(a - f, i0);  // the block's first row that sees row a
      // scores, kLanes context rows at a time: row i needs the groups up to its own row f + i
      for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
        for (int64_t j = j0 + kAhead; j < std::min(j0 + kAhead + kLanes, n); ++j) prefetch(keys + slot[j] * d, d);
        const float* k[kLanes];
        for (int l = 0; l < kLanes; ++l) k[l] = keys + slot[j0 + l] * d;
        for (int64_t i = std::max(a + j0 - f, i0); i < i1; ++i) {
          for (int64_t h = 0; h < group; ++h) {
            const float* qi = query(i, h);
            vf s[kLanes];
            const vf q0 = load(qi);
            for (int l = 0; l < kLanes; ++l) s[l] = q0 * load(k[l]);
            for (int64_t c = 1; c < chunks; ++c) {
              const vf qc = load(qi + c * kLanes);
              for (int l = 0; l < kLanes; ++l) s[l] = fmadd(qc, load(k[l] + c * kLanes), s[l]);
            }
            store(score.data() + row(i, h) * kSegment + j0, lane_sums(s) * splat(sc));
          }
        }
      }
      // softmax weights over the segment, unnormalised: row i sees its rows [a, f + i + 1)
      for (int64_t i = first; i < i1; ++i) {
        const int64_t seen = std::min(f + i + 1, e) - a, padded = (seen + kLanes - 1) / kLanes * kLanes;
        for (int64_t h = 0; h < group; ++h) {
          float* s = score.data() + row(i, h) * kSegment;
          for (int64_t j = seen; j < padded; ++j) s[j] = -std::numeric_limits<float>::infinity();
          vf m = load(s);
          for (int64_t j = kLanes; j < padded; j += kLanes) {
            vf x = load(s + j);
            m = x > m ? x : m;
          }
          const float top = hmax(m);
          vf sum{};
          for (int64_t j = 0; j < padded; j += kLanes) {
            vf w = exp_nonpositive(load(s + j) - splat(top));
            if (j + kLanes > seen) w = kIota < static_cast<int32_t>(seen - j) ? w : vf{};
            store(s + j, w);
            sum += w;
          }
          float* pt = part(sp[b] + i, g * group + h, sg);
          pt[d] = top;
          pt[d + 1] = hsum(sum);
        }
      }
      // the weighted sum of the values, a tile of context rows at a time (kept in L1 for every
      // row that sees it), each row's sums in registers across the tile; a row adds its context
      // rows in order, whatever the tiles
      std::fill(acc.begin(), acc.begin() + (i1 - i0) * group * chunks, vf{});
      for (int64_t j = 0; j < std::min(kAhead, n); ++j) prefetch(values + slot[j] * d, d);
      for (int64_t j0 = 0; j0 < n; j0 += kTile) {
        const int64_t j1 = std::min(n, j0 + kTile), from = std::max(a + j0 - f, i0);  // rows that see row a + j0
        for (int64_t i = from; i < i1; ++i) {
          const int64_t stop = std::min(j1, f + i + 1 - a);
          for (int64_t h = 0; h < group; ++h) {
            const int64_t r = row(i, h);
            // the tile's first row fetches ahead for the rest, into the next tile
            const int64_t ahead = i == from && h == 0 ? std::min(n, j1 + kAhead) : 0;
            weigh(acc.data() + r * chunks, chunks, score.data() + r * kSegment, values, slot.data(), d, j0, stop, ahead);
          }
        }
      }
      for (int64_t i = first; i < i1; ++i)
        for (int64_t h = 0; h < group; ++h)
          std::memcpy(part(sp[b] + i, g * group + h, sg), acc.data() + row(i, h) * chunks, d * sizeof(float));
    }
  });

  // each row's segments merged in order: sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s, m = max_s m_s
  // (one segment: acc / l, as a softmax over the whole context)
  std::vector<std::pair<int64_t, int64_t>> rows;  // (flat row, its visible context length)
  for (int64_t b = 0; b < passes; ++b)
    for (int64_t i = 0; i < wp[b]; ++i) rows.emplace_back(sp[b] + i, fp[b] + i + 1);
  at::parallel_for(0, static_cast<int64_t>(rows.size()) * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const auto [r, seen] = rows[task / heads];
      const int64_t h = task % heads, n = (seen + kSegment - 1) / kSegment;
      float top = part(r, h, 0)[d];
      for (int64_t s = 1; s < n; ++s) top = std::max(top, part(r, h, s)[d]);
      float total = 0;
      vf o[kMaxChunks] = {};
      for (int64_t s = 0; s < n; ++s) {
        const float* pt = part(r, h, s);
        const float w = exp_nonpositive(splat(pt[d] - top))[0];  // exactly 1 where m_s = m
        total += w * pt[d + 1];
        for (int64_t c = 0; c < chunks; ++c) o[c] = fmadd(load(pt + c * kLanes), w, o[c]);
      }
      const vf inv = splat(1.0f / total);
      float* dst = op + h * os_h + r * os_t;
      for (int64_t c = 0; c < chunks; ++c) store(dst + c * kLanes, o[c] * inv);
    }
  });
}
