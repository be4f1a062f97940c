// Prefill attention for bf16 and 8-bit paged caches as tiled float32 matrix products (FlashAttention style),
// through PyTorch's at::native::cpublas::brgemm (its GEMM for float32 operands).
//
// The paged kernel (cpu_paged_attention.cpp) attends one query row and one key at a time; a long query (a prompt,
// a prefill chunk) is a matrix product, and a GEMM engine runs it many times faster. For each request given here:
//   1. pack: its context's K and V, per kv head and per tile of KEY_TILE keys, are gathered from the blocks of the
//      cache (block table, in place) and widened to float32 (an 8-bit row's codes times its scale, as
//      folio.attention.kv_quant dequantises) into the layout brgemm reads as B: K transposed [D, kt] and V [kt, D];
//   2. attend: per (request, kv head, tile of query tokens), the query rows of the tile's tokens times the G query
//      heads of the kv head are stacked (rows r = token * G + g), so K and V are read once per group; per key
//      tile S = Q K^T by brgemm, then scale, soft-cap, causal and sliding-window masks and the online softmax
//      (running max and sum, float32, base 2), and O += P V by brgemm into a float32 accumulator rescaled when
//      the max grows; finally O / sum in q's dtype.
// Products are float32 (a first version ran bf16 products, on AMX tiles with K and V packed in pairs: not
// landed until measured on an AMX machine; tag amx-flash-prefill-wip).
//
// Layouts: q, out [T, Hq, D] bf16 or float32 (unit stride along D); caches [num_blocks, block_size, Hkv, R]
// contiguous: bf16 rows (R = D), or 8-bit ones (folio.attention.kv_quant: R = D + 4, D int8 codes or fp8 e4m3
// bits then the row's float32 scale);
// reqs int32 [B, 3] = (first token in the batch, query length, context length including the query);
// block_tables int32 [B, max_blocks]. Sliding window W (0: none): the query at position p sees keys
// p - W < t <= p; keys before the window of a request's first query are never read. Soft-capping (cap > 0):
// s -> cap * tanh(s / cap) after the scale.

// Only the headers needed (not torch/extension.h), as cpu_paged_attention.cpp: a faster first-use build.
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "exp2_approx.h"
#include "kv_cache_rows.h"

namespace {

constexpr int KEY_TILE = 128;  // keys per tile: the N of S = Q K^T and the K of P V
constexpr int TARGET_ROWS = 128;  // query rows (tokens x heads of a group) per tile: the M of both products
constexpr float LOG2E = 1.4426950408889634f;

using bf16 = at::BFloat16;

struct Params {
  const void* q;
  int64_t q_st, q_sh;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int32_t* reqs;
  const int32_t* block_tables;
  int64_t max_blocks;
  int block_size, Hkv, G, D;
  int row_width;  // elements of a cache row: D, or D + 4 for an 8-bit cache
  float scale_log2;  // softmax scale times log2(e): scores are kept in base 2
  int window;  // 0: none
  float softcap2, inv_softcap2;  // soft-capping of the base-2 scores: cap * log2(e) and its inverse; 0: none
};

// Where request b's packed context starts and which keys it holds: keys [kbeg, ctx) in tiles of KEY_TILE from
// kbeg; each kv head's K (and V) take tiles * KEY_TILE * D elements from offset + head * that.
struct Span {
  int kbeg, tiles;
  int64_t offset;
};

// Key t of kv head h of request b: the element offset of its row in the cache.
inline int64_t cache_row(const Params& P, int b, int h, int t) {
  const int32_t block = P.block_tables[b * P.max_blocks + t / P.block_size];
  return (((int64_t)block * P.block_size + t % P.block_size) * P.Hkv + h) * P.row_width;
}

// Tile of kt keys from t0, widened (8-bit codes times their row's scale, in float32), into kdst (K^T: [D, kt])
// and vdst (V: [kt, D]).
template <typename C>
void pack_tile(const Params& P, int b, int h, int t0, int kt, float* kdst, float* vdst) {
  const int D = P.D;
  for (int j = 0; j < kt; ++j) {
    const int64_t row = cache_row(P, b, h, t0 + j);
    const C* k = static_cast<const C*>(P.k_cache) + row;
    const C* v = static_cast<const C*>(P.v_cache) + row;
    const float ks = Cache<C>::scale(k, D), vs = Cache<C>::scale(v, D);
    for (int d = 0; d < D; ++d) kdst[(int64_t)d * kt + j] = Cache<C>::value(k[d]) * ks;
    for (int d = 0; d < D; ++d) vdst[(int64_t)j * D + d] = Cache<C>::value(v[d]) * vs;
  }
}

struct Item {
  int b, h, q0, q1;  // request, kv head, query tokens [q0, q1)
  int64_t cost;
};

// Per-thread buffers of one query tile of at most M rows.
struct TileBuffers {
  // [M, D] query rows, [M, KEY_TILE] scores (then probabilities, in place), [M, D] output accumulator,
  // running max and sum
  std::vector<float> q, s, acc, m, l;
  TileBuffers(int M, int D) : q((size_t)M * D), s((size_t)M * KEY_TILE), acc((size_t)M * D), m(M), l(M) {}
};

template <typename Q>
void attend_item(const Params& P, const Span& span, const float* kpack, const float* vpack, const Item& it,
                 TileBuffers& buf) {
  const int D = P.D, G = P.G;
  const int32_t* rq = P.reqs + 3 * it.b;
  const int qs = rq[0], L = rq[2], off = L - rq[1];
  const int M = (it.q1 - it.q0) * G;
  for (int r = 0; r < M; ++r) {
    const Q* src =
        static_cast<const Q*>(P.q) + (int64_t)(qs + it.q0 + r / G) * P.q_st + (int64_t)(it.h * G + r % G) * P.q_sh;
    for (int d = 0; d < D; ++d) buf.q[(size_t)r * D + d] = static_cast<float>(src[d]);
  }
  std::fill(buf.m.begin(), buf.m.begin() + M, -std::numeric_limits<float>::infinity());
  std::fill(buf.l.begin(), buf.l.begin() + M, 0.f);

  // key tiles from the window of the first query token to the last token (causal)
  const int kfirst = P.window ? std::max(span.kbeg, off + it.q0 - P.window + 1) : 0;
  const int kend = off + it.q1;
  const int n0 = (kfirst - span.kbeg) / KEY_TILE, n1 = (kend - 1 - span.kbeg) / KEY_TILE;
  const int64_t head_off = span.offset + (int64_t)it.h * span.tiles * KEY_TILE * D;
  for (int n = n0; n <= n1; ++n) {
    const int t0 = span.kbeg + n * KEY_TILE;
    const int kt = std::min(KEY_TILE, L - t0);
    const float* kb = kpack + head_off + (int64_t)n * KEY_TILE * D;
    const float* vb = vpack + head_off + (int64_t)n * KEY_TILE * D;
    float* S = buf.s.data();
    at::native::cpublas::brgemm(M, kt, D, D, kt, kt, false, buf.q.data(), kb, S, false);
    bool first_tile = n == n0;
    for (int r = 0; r < M; ++r) {
      const int pos = off + it.q0 + r / G;
      const int lim = std::min(kt, pos + 1 - t0);  // keys [first, lim) of this tile are the row's to see
      const int first = P.window ? std::max(0, pos - P.window + 1 - t0) : 0;
      float* s = S + (size_t)r * kt;
      float* a = buf.acc.data() + (size_t)r * D;
      if (lim <= first) {  // no key of this tile for the row (before the diagonal or past its window)
        std::fill(s, s + kt, 0.f);
        if (first_tile) std::fill(a, a + D, 0.f);
        continue;
      }
      float mt = -std::numeric_limits<float>::infinity();
      if (P.softcap2 > 0.f) {
        for (int j = first; j < lim; ++j) s[j] = P.softcap2 * std::tanh(s[j] * P.scale_log2 * P.inv_softcap2);
      } else {
        for (int j = first; j < lim; ++j) s[j] *= P.scale_log2;
      }
      // (the reductions are omp simd loops: -O3 alone does not vectorise float maxima and sums)
#pragma omp simd reduction(max : mt)
      for (int j = first; j < lim; ++j) mt = std::max(mt, s[j]);
      const float mn = std::max(buf.m[r], mt);
      for (int j = first; j < lim; ++j) s[j] = exp2_approx(s[j] - mn);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = first; j < lim; ++j) sum += s[j];
      std::fill(s, s + first, 0.f);
      std::fill(s + lim, s + kt, 0.f);
      if (first_tile) {
        std::fill(a, a + D, 0.f);
        buf.l[r] = sum;
      } else {
        const float corr = exp2_approx(buf.m[r] - mn);  // 0 while the row has seen no key (m = -inf)
        buf.l[r] = buf.l[r] * corr + sum;
        if (corr != 1.f)
          for (int d = 0; d < D; ++d) a[d] *= corr;
      }
      buf.m[r] = mn;
    }
    at::native::cpublas::brgemm(M, D, kt, kt, D, D, true, S, vb, buf.acc.data(), false);
  }
  for (int r = 0; r < M; ++r) {
    const float* a = buf.acc.data() + (size_t)r * D;
    const float inv = buf.l[r] > 0.f ? 1.f / buf.l[r] : 0.f;
    Q* dst = static_cast<Q*>(P.out) + ((int64_t)(qs + it.q0 + r / G) * P.Hkv * G + it.h * G + r % G) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<Q>(a[d] * inv);
  }
}

// Q: the element type of q and out; C: the cache's.
template <typename Q, typename C>
void run(const Params& P, int B) {
  const int D = P.D, G = P.G, Hkv = P.Hkv;
  std::vector<Span> spans(B);
  int64_t total = 0;
  for (int b = 0; b < B; ++b) {
    const int32_t* rq = P.reqs + 3 * b;
    const int L = rq[2], off = L - rq[1];
    const int kbeg = P.window ? std::max(0, off - P.window + 1) : 0;
    const int tiles = (L - kbeg + KEY_TILE - 1) / KEY_TILE;
    spans[b] = {kbeg, tiles, total};
    total += (int64_t)Hkv * tiles * KEY_TILE * D;
  }
  at::Tensor kbuf = at::empty({total}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor vbuf = at::empty({total}, at::TensorOptions().dtype(at::kFloat));
  float* kpack = kbuf.data_ptr<float>();
  float* vpack = vbuf.data_ptr<float>();

  // 1. pack every (request, kv head, key tile)
  std::vector<int64_t> first_tile(B + 1, 0);  // running count of (kv head, key tile) pairs
  for (int b = 0; b < B; ++b) first_tile[b + 1] = first_tile[b] + (int64_t)Hkv * spans[b].tiles;
  folio::parallel_for(0, first_tile[B], 1, [&](int64_t begin, int64_t end) {
    int b = (int)(std::upper_bound(first_tile.begin(), first_tile.end(), begin) - first_tile.begin()) - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (i >= first_tile[b + 1]) ++b;
      const Span& sp = spans[b];
      const int h = (int)((i - first_tile[b]) / sp.tiles), n = (int)((i - first_tile[b]) % sp.tiles);
      const int t0 = sp.kbeg + n * KEY_TILE, kt = std::min(KEY_TILE, P.reqs[3 * b + 2] - t0);
      const int64_t o = sp.offset + ((int64_t)h * sp.tiles + n) * KEY_TILE * D;
      pack_tile<C>(P, b, h, t0, kt, kpack + o, vpack + o);
    }
  });

  // 2. attend every (request, kv head, query tile), longest first, each thread taking the next item
  const int qt = std::max(1, TARGET_ROWS / G);
  std::vector<Item> items;
  for (int b = 0; b < B; ++b) {
    const int qlen = P.reqs[3 * b + 1], off = P.reqs[3 * b + 2] - qlen;
    for (int h = 0; h < Hkv; ++h)
      for (int q0 = 0; q0 < qlen; q0 += qt) {
        const int q1 = std::min(qlen, q0 + qt);
        const int keys = off + q1 - (P.window ? std::max(spans[b].kbeg, off + q0 - P.window + 1) : 0);
        items.push_back({b, h, q0, q1, (int64_t)(q1 - q0) * keys});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t n = (int64_t)items.size();
  std::atomic<int64_t> next{0};
  folio::parallel_for(0, std::min<int64_t>(n, folio::num_threads()), 1, [&](int64_t, int64_t) {
    TileBuffers buf(qt * G, D);
    for (int64_t i = next++; i < n; i = next++) attend_item<Q>(P, spans[items[i].b], kpack, vpack, items[i], buf);
  });
}

}  // namespace

// out [T, Hq, D] (written for the requests in reqs only); see the top of the file.
void flash_prefill(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor reqs,
                   at::Tensor block_tables, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "q, out must be 3-d and the caches 4-d");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK((qt == at::kBFloat16 || qt == at::kFloat) && out.scalar_type() == qt,
              "q and out must share a dtype, bfloat16 or float32");
  TORCH_CHECK((ct == at::kBFloat16 || ct == at::kChar || ct == at::kByte) && v_cache.scalar_type() == ct,
              "the caches must be bfloat16, or 8-bit rows (int8, or uint8 fp8 e4m3 bits)");
  const int64_t row_width = q.size(2) + (ct == at::kBFloat16 ? 0 : 4);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [blocks, block_size, Hkv, row]");
  TORCH_CHECK(q.stride(2) == 1 && out.is_contiguous() && out.sizes() == q.sizes(),
              "q needs unit stride along head_dim, out must be contiguous and shaped like q");
  TORCH_CHECK(k_cache.size(3) == row_width && q.size(1) % k_cache.size(2) == 0,
              "q must be [T, Hkv * G, D] for caches [.., Hkv, D] (8-bit: D + 4)");
  TORCH_CHECK(reqs.scalar_type() == at::kInt && reqs.is_contiguous() && reqs.dim() == 2 && reqs.size(1) == 3,
              "reqs must be int32 [B, 3]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == reqs.size(0), "block_tables must be int32 [B, M]");
  Params P;
  P.q = q.data_ptr();
  P.q_st = q.stride(0);
  P.q_sh = q.stride(1);
  P.out = out.data_ptr();
  P.k_cache = k_cache.data_ptr();
  P.v_cache = v_cache.data_ptr();
  P.reqs = reqs.data_ptr<int32_t>();
  P.block_tables = block_tables.data_ptr<int32_t>();
  P.max_blocks = block_tables.size(1);
  P.block_size = (int)k_cache.size(1);
  P.Hkv = (int)k_cache.size(2);
  P.D = (int)q.size(2);
  P.G = (int)(q.size(1) / P.Hkv);
  P.row_width = (int)row_width;
  P.scale_log2 = (float)scale * LOG2E;
  P.window = (int)std::max<int64_t>(0, window);
  P.softcap2 = softcap > 0 ? (float)softcap * LOG2E : 0.f;
  P.inv_softcap2 = softcap > 0 ? 1.f / P.softcap2 : 0.f;
  const int B = (int)reqs.size(0);
  const int64_t num_blocks = k_cache.size(0);
  for (int b = 0; b < B; ++b) {
    const int32_t* rq = P.reqs + 3 * b;
    TORCH_CHECK(rq[1] >= 1 && rq[2] >= rq[1] && rq[0] >= 0 && rq[0] + rq[1] <= q.size(0), "request ", b,
                ": bad first token / query length / context length");
    const int64_t blocks = (rq[2] + P.block_size - 1) / P.block_size;
    TORCH_CHECK(blocks <= P.max_blocks, "request ", b, ": block table too short for its context");
    const int kbeg = P.window ? std::max(0, rq[2] - rq[1] - P.window + 1) : 0;
    for (int64_t i = kbeg / P.block_size; i < blocks; ++i) {
      const int32_t id = P.block_tables[b * P.max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "request ", b, ": block id ", id, " out of range");
    }
  }
  auto go = [&](auto q_type) {
    using Q = decltype(q_type);
    if (ct == at::kChar) run<Q, int8_t>(P, B);
    else if (ct == at::kByte) run<Q, uint8_t>(P, B);
    else run<Q, bf16>(P, B);
  };
  if (qt == at::kFloat) go(float{});
  else go(bf16{});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("flash_prefill", &flash_prefill, "attend long queries from a bf16 or 8-bit paged cache in tiled matrix products",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
