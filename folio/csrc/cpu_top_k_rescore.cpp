// rescore_top_k: per row of bf16 (or float32) logits [M, V] computed from a 4-bit copy of an lm_head, the k
// largest replaced in place by their exact values x[m] . table[token] from the table of the same dtype, or from a
// bf16 table under float32 logits (a float32 model keeps a bf16 checkpoint's table in bf16; its rows are widened
// exactly as they are read, so the values equal a float32 copy's bit for bit) (folio.models.rescored_head).
//
// Selection without sorting the row: the first k logits seed a heap whose root is the lowest ranked (lower
// value, or equal value and higher index); the rest of the row is scanned 16 at a time against the root's
// value, and only a strictly larger logit replaces the root, so among equal values the lower index stays, as a
// stable descending sort ranks them. A NaN ranks as minus infinity. Past the first few hundred logits hardly
// any passes the threshold, so the scan costs about a read of the row (V = 151936: ~10 us). The k exact dot
// products read k rows of the table, which lie anywhere in it: each row is prefetched a few rows ahead of its
// product. Sums in float32 (vdpbf16ps where the CPU has AVX512-BF16, else 16 scalar partial sums; float32 rows by
// FMAs in 16 lanes), rounded to bf16 to nearest even, as a bf16 GEMM rounds its float32 sums.
#include "parallel.h"
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FOLIO_AVX512 1
#else
#define FOLIO_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FOLIO_AVX2 1
#else
#define FOLIO_AVX2 0
#endif

namespace {

constexpr int64_t PREFETCH_ROWS = 4;  // table rows prefetched ahead of the current product

struct Candidate {
  float value;
  int64_t index;
};

// a ranks above b: a larger value, or the same value at a lower index
inline bool above(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

template <class T>
inline float logit(const T* row, int64_t i) {
  const float v = static_cast<float>(row[i]);
  return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
}

// heap (by `above`, so its front is the lowest ranked) becomes the k highest-ranked logits of row[0, V)
template <class T>
void select(const T* row, int64_t V, int64_t k, std::vector<Candidate>& heap) {
  heap.resize(k);
  for (int64_t i = 0; i < k; ++i) heap[i] = {logit(row, i), i};
  std::make_heap(heap.begin(), heap.end(), above);
  auto offer = [&](int64_t i) {
    const float v = static_cast<float>(row[i]);  // a NaN fails the comparison: it ranks below everything kept
    if (v > heap.front().value) {
      std::pop_heap(heap.begin(), heap.end(), above);
      heap.back() = {v, i};
      std::push_heap(heap.begin(), heap.end(), above);
    }
  };
  int64_t i = k;
  if constexpr (std::is_same_v<T, float>) {
#if FOLIO_AVX2
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      int pass = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(heap.front().value), _CMP_GT_OQ));
      for (; pass; pass &= pass - 1) offer(i + __builtin_ctz(pass));
    }
#endif
  } else {
#if FOLIO_AVX512
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
    for (; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i))), 16));
      __mmask16 pass = _mm512_cmp_ps_mask(v, _mm512_set1_ps(heap.front().value), _CMP_GT_OQ);
      for (; pass; pass &= pass - 1) offer(i + __builtin_ctz(pass));
    }
#endif
  }
  for (; i < V; ++i) offer(i);
}

#if FOLIO_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // 8 bf16 widened exactly: their bits in the top half of a float32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

// a float32 x times a float32 (or bf16, widened) row: 16 lanes of FMAs (two AVX2 vectors), added up at the end;
// the same operations whichever the row's dtype, so a bf16 row gives its float32 copy's sum bit for bit
template <class W>
float dot(const W* a, const float* b, int64_t H) {
  int64_t h = 0;
  float sum = 0;
#if FOLIO_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; h + 16 <= H; h += 16) {
    acc0 = _mm256_fmadd_ps(load8(a + h), _mm256_loadu_ps(b + h), acc0);
    acc1 = _mm256_fmadd_ps(load8(a + h + 8), _mm256_loadu_ps(b + h + 8), acc1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(acc0, acc1));
  for (float v : lanes) sum += v;
#endif
  for (; h < H; ++h) sum = std::fma(static_cast<float>(a[h]), b[h], sum);
  return sum;
}

float dot(const c10::BFloat16* a, const c10::BFloat16* b, int64_t H) {
#if FOLIO_AVX512 && defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  int64_t h = 0;
  for (; h + 32 <= H; h += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + h), (__m512bh)_mm512_loadu_si512(b + h));
  if (h < H) {
    const __mmask32 tail = (__mmask32)((1ull << (H - h)) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, a + h),
                           (__m512bh)_mm512_maskz_loadu_epi16(tail, b + h));
  }
  return _mm512_reduce_add_ps(acc);
#else
  float part[16] = {};
  for (int64_t h = 0; h < H; ++h) part[h % 16] += static_cast<float>(a[h]) * static_cast<float>(b[h]);
  float sum = 0;
  for (float p : part) sum += p;
  return sum;
#endif
}

template <class T>
void prefetch_row(const T* row, int64_t H) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < H * (int64_t)sizeof(T); byte += 64) __builtin_prefetch(p + byte);
}

// T: the logits' and x's dtype; W: the table's (T, or bf16 under float32)
template <class T, class W>
void rescore(at::Tensor& logits, const at::Tensor& x, const at::Tensor& table, int64_t k) {
  const int64_t M = logits.size(0), V = logits.size(1), H = x.size(1);
  T* out = logits.data_ptr<T>();
  const T* xs = x.data_ptr<T>();
  const W* rows = table.data_ptr<W>();
  std::vector<int64_t> top(M * k);  // each row's selected tokens
  folio::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> heap;
    for (int64_t m = begin; m < end; ++m) {
      select(out + m * V, V, k, heap);
      for (int64_t j = 0; j < k; ++j) top[m * k + j] = heap[j].index;
    }
  });
  // the products of all rows' tokens shared out over the threads (one row's k are worth two threads)
  folio::parallel_for(0, M * k, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < std::min(begin + PREFETCH_ROWS, end); ++j) prefetch_row(rows + top[j] * H, H);
    for (int64_t j = begin; j < end; ++j) {
      if (j + PREFETCH_ROWS < end) prefetch_row(rows + top[j + PREFETCH_ROWS] * H, H);
      const int64_t m = j / k;
      out[m * V + top[j]] = T(dot(rows + top[j] * H, xs + m * H, H));
    }
  });
}

void rescore_top_k(at::Tensor logits, const at::Tensor& x, const at::Tensor& table, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && x.dim() == 2 && table.dim() == 2, "rescore_top_k: 2-D tensors");
  const auto dt = logits.scalar_type();
  const auto table_dt = table.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && x.scalar_type() == dt &&
                  (table_dt == dt || table_dt == at::kBFloat16),
              "rescore_top_k: bf16 or float32 tensors, all of one dtype (or a bf16 table under float32)");
  TORCH_CHECK(logits.is_contiguous() && x.is_contiguous() && table.is_contiguous(),
              "rescore_top_k: contiguous tensors");
  TORCH_CHECK(x.size(0) == logits.size(0) && table.size(0) == logits.size(1) && table.size(1) == x.size(1),
              "rescore_top_k: shapes do not match");
  TORCH_CHECK(k > 0, "rescore_top_k: k must be positive");
  k = std::min(k, logits.size(1));
  if (dt == at::kBFloat16) rescore<c10::BFloat16, c10::BFloat16>(logits, x, table, k);
  else if (table_dt == at::kBFloat16) rescore<float, c10::BFloat16>(logits, x, table, k);
  else rescore<float, float>(logits, x, table, k);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  folio::bind_decode_threads(m);
  m.def("rescore_top_k", &rescore_top_k,
        "per row of bf16 or float32 logits, the k largest replaced in place by x . table[token] (sums in float32; "
        "a bf16 table under float32 logits widened)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
