// The paged attention kernel's path for CPUs with AVX2 and FMA but no AVX-512 (cpu_paged_attention.cpp includes
// it after the definitions it uses: Params, Item, key_rows, window_first, the scratch, the prefetcher).
//
// One item (see cpu_paged_attention.cpp) at a time, keys in tiles of KEYS = 32 with an online softmax, as the
// AVX-512 path does, in 8-lane float32 vectors:
//   - scores: RB rows x KB keys of q . k accumulate in registers, lane c of each the sum of every 8th product,
//     then one horizontal add tree gives the KB scores of a row. float32 rows are read in place from the cache;
//     bf16 and 8-bit rows are first widened into a tile buffer (8-bit: their codes, exactly), once per kv head
//     and tile, for all the rows (query heads and tokens) that share the kv head;
//   - the softmax update of each row over its tile: one running max and one rescaling per 32 keys;
//   - P.V: RC rows x CW vectors of the accumulator in registers, each key's V vectors loaded once for RC rows.
// What this replaced was the portable loop (a horizontal sum per key and row, each accumulator updated through
// memory per key): at a decode of 14 heads over 2 kv heads, head_dim 64, it took 0.47 us a key and layer.
//
// An 8-bit cache's key scale multiplies the key's scores and its value scale the probabilities (as the portable
// loop does): with rows whose scales are powers of two, an 8-bit cache then attends bit for bit as a bf16 cache of
// the same values, since every cache type's values reach the same float32 arithmetic in the same order.
// Included inside that file's anonymous namespace, after <immintrin.h>.
#pragma once

namespace avx2 {

constexpr int LANES = 8;
constexpr int KEYS = 32;  // keys per softmax tile
constexpr int SUBS = KEYS / LANES;  // score vectors per row and tile
constexpr int RB = 3, KB = 4;  // score accumulators in registers: rows x keys
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// 8 values of a cache row as float32: an 8-bit row's codes (times nothing: its scale is applied outside).
inline __m256 widen(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen(const uint8_t* p) {  // fp8 e4m3 bits: the value table
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(FP8_E4M3_VALUES.data(), idx, 4);
}

// 2^x for x <= 0, as exp2_approx (exp2_approx.h) computes it, 8 lanes at a time.
inline __m256 exp2_8(__m256 x) {
  const __m256i xb = _mm256_min_epu32(_mm256_castps_si256(x), _mm256_set1_epi32((int)0xC2FC0000u));  // >= -126
  x = _mm256_castsi256_ps(xb);
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 t = _mm256_add_ps(x, magic);
  const __m256 f = _mm256_sub_ps(x, _mm256_sub_ps(t, magic));
  __m256 p = _mm256_set1_ps(0.0013276268728077412f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00967547856271267f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05550713464617729f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022120237350464f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931469440460205f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000001192092896f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000)), _mm256_set1_epi32(127)),
      23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// The sums of 4 vectors' lanes: lane j of the result is the sum of a[j]'s 8 lanes.
inline __m128 hsum4(const __m256 (&a)[KB]) {
  static_assert(KB == 4, "one add tree for 4 keys");
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// T: the dtype of q and out; C: the cache's (T, or int8 / uint8 for 8-bit caches); head_dim D = 8 NV.
template <typename T, typename C, int NV>
void attend_item(const Params& P, const Item& it, float* partial, const Item* ahead) {
  constexpr int D = NV * LANES;
  constexpr bool Q8 = Cache<C>::QUANTIZED;
  constexpr bool IN_PLACE = std::is_same<C, float>::value;  // float32 rows are read from the cache as they are
  constexpr int RW = D + Cache<C>::SCALE_BYTES;  // elements of a cache row
  static_assert(NV % 2 == 0, "head_dim a multiple of 16");
  constexpr int CW = NV % 4 == 0 ? 4 : 2;  // P.V: accumulator vectors of a row in registers
  constexpr int RC = 12 / CW;  // and rows

  const int G = P.G;
  const ItemRows rows(P, it);
  const int RH = rows.RH, NH = rows.NH, R = rows.R, off = rows.off, kend = rows.kend;

  float* mem = thread_scratch().get((size_t)R * (2 * D + KEYS + LANES + 2) + (IN_PLACE ? 0 : 2 * KEYS * D));
  float* qf = mem;  // q times the softmax scale (base 2)
  float* acc = qf + (size_t)R * D;
  float* S = acc + (size_t)R * D;  // a tile's scores, then probabilities, KEYS per row
  float* lv = S + (size_t)R * KEYS;  // per-lane partial sums of the probabilities, LANES per row
  float* m = lv + (size_t)R * LANES;
  float* corr = m + R;
  float* kbuf = corr + R;  // a tile's K and V rows widened (not IN_PLACE)
  float* vbuf = kbuf + KEYS * D;

  for (int r = 0; r < R; ++r) {
    const T* src = rows.q<T>(P, it, r);
    for (int c = 0; c < D; ++c) qf[(size_t)r * D + c] = to_f(src[c]) * P.scale_log2;
    std::fill(acc + (size_t)r * D, acc + (size_t)(r + 1) * D, 0.f);
    std::fill(lv + (size_t)r * LANES, lv + (size_t)(r + 1) * LANES, 0.f);
    m[r] = NEG_INF;
  }

  const C* kc = static_cast<const C*>(P.k_cache);
  const C* vc = static_cast<const C*>(P.v_cache);
  const int32_t* bt = P.block_tables + it.b * P.max_blocks;
  const int64_t row_stride = (int64_t)P.Hkv * RW;
  // prefetch steps per tile: one per vector of d in the scores' blocks, one per key in P.V
  const int steps = NH * (((RH + RB - 1) / RB) * (KEYS / KB) * NV + ((RH + RC - 1) / RC) * (NV / CW) * KEYS);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int t0 = it.k0; t0 < kend; t0 += KEYS) {
    const int nt = std::min(KEYS, kend - t0);
    int64_t tok[KEYS];  // start of each key's row [Hkv, D] in the cache
    key_rows(P, bt, t0, nt, row_stride, tok);
    // the next tile's rows into L2 (in the last tile, the first ones of the item this thread runs next: a block
    // may be anywhere in the cache, where the hardware prefetchers cannot guess it), a line of K and one of V at a
    // time spread over this tile's inner loops: issued a key's whole rows at a time, they stalled the core on its
    // outstanding misses (a 32-request decode over 1024 keys, 3 kv heads: 8.8 GB/s of KV read, 15.6 spread)
    LinePrefetcher<KEYS> pf;
    if (t0 + KEYS < kend) aim<C>(pf, P, it, t0 + KEYS, steps);
    else if (ahead) aim<C>(pf, P, *ahead, ahead->k0, steps);
    for (int hh = 0; hh < NH; ++hh) {
      const int64_t hoff = (int64_t)(it.h0 + hh) * RW;
      const float* kr[KEYS + KB];  // each key's K and V rows as floats; keys past nt point at key 0 (never used)
      const float* vr[KEYS];
      alignas(32) float ks[KEYS], vs[KEYS];  // 8-bit: each key's scales
      for (int j = 0; j < nt; ++j) {
        const C* kp = kc + tok[j] + hoff;
        const C* vp = vc + tok[j] + hoff;
        if constexpr (IN_PLACE) {
          kr[j] = kp;
          vr[j] = vp;
        } else {
          for (int c = 0; c < NV; ++c) _mm256_storeu_ps(kbuf + j * D + LANES * c, widen(kp + LANES * c));
          for (int c = 0; c < NV; ++c) _mm256_storeu_ps(vbuf + j * D + LANES * c, widen(vp + LANES * c));
          kr[j] = kbuf + j * D;
          vr[j] = vbuf + j * D;
        }
        if constexpr (Q8) {
          ks[j] = Cache<C>::scale(kp, D);
          vs[j] = Cache<C>::scale(vp, D);
        }
      }
      for (int j = nt; j < KEYS + KB; ++j) kr[j] = kr[0];
      if constexpr (Q8) {
        for (int j = nt; j < KEYS; ++j) ks[j] = vs[j] = 0.f;
      }
      const int rbeg = hh * RH, rend = rbeg + RH;

      // scores q . k (base 2; an 8-bit key's still without its scale) into S
      for (int r0 = rbeg; r0 < rend; r0 += RB) {
        const int rb = std::min(RB, rend - r0);
        for (int j0 = 0; j0 < nt; j0 += KB) {
          __m256 a[RB][KB];
          for (int i = 0; i < RB; ++i)
            for (int j = 0; j < KB; ++j) a[i][j] = _mm256_setzero_ps();
          for (int c = 0; c < NV; ++c) {
            pf.step_lines();
            __m256 qv[RB];
            for (int i = 0; i < RB; ++i)
              if (i < rb) qv[i] = _mm256_loadu_ps(qf + (size_t)(r0 + i) * D + LANES * c);
            for (int j = 0; j < KB; ++j) {
              const __m256 kv = _mm256_loadu_ps(kr[j0 + j] + LANES * c);
              for (int i = 0; i < RB; ++i)
                if (i < rb) a[i][j] = _mm256_fmadd_ps(qv[i], kv, a[i][j]);
            }
          }
          for (int i = 0; i < RB; ++i)
            if (i < rb) _mm_storeu_ps(S + (size_t)(r0 + i) * KEYS + j0, hsum4(a[i]));
        }
      }

      // each row's online-softmax update over the tile: S becomes its probabilities (8-bit: times each value's
      // scale), corr the factor its accumulator is rescaled by
      for (int r = rbeg; r < rend; ++r) {
        float* s = S + (size_t)r * KEYS;
        const int pos = off + it.q0 + (r - rbeg) / G;
        const int lim = std::min(nt, pos + 1 - t0);  // keys [first, lim) of the tile are row r's to see
        const int first = window_first(P.window, pos, t0);
        if (lim <= first) {  // none (a prefill row's keys end before the tile, or its window starts after it)
          std::fill(s, s + KEYS, 0.f);
          corr[r] = 1.f;
          continue;
        }
        __m256 x[SUBS];  // the scores (times an 8-bit key's scale), soft-capped, unseen keys -inf
        for (int u = 0; u < SUBS; ++u) {
          x[u] = _mm256_loadu_ps(s + LANES * u);
          if constexpr (Q8) x[u] = _mm256_mul_ps(x[u], _mm256_load_ps(ks + LANES * u));
        }
        if (P.softcap2 > 0.f) {
          for (int u = 0; u < SUBS; ++u) _mm256_storeu_ps(s + LANES * u, x[u]);
          for (int j = 0; j < nt; ++j) s[j] = P.softcap2 * std::tanh(s[j] * P.inv_softcap2);
          for (int u = 0; u < SUBS; ++u) x[u] = _mm256_loadu_ps(s + LANES * u);
        }
        const __m256i lo = _mm256_set1_epi32(first - 1), hi = _mm256_set1_epi32(lim);
        __m256 seen[SUBS];
        __m256 mx = _mm256_set1_ps(NEG_INF);
        for (int u = 0; u < SUBS; ++u) {
          const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(LANES * u));
          seen[u] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(j, lo), _mm256_cmpgt_epi32(hi, j)));
          x[u] = _mm256_blendv_ps(_mm256_set1_ps(NEG_INF), x[u], seen[u]);
          mx = _mm256_max_ps(mx, x[u]);
        }
        const float mo = m[r];
        const float mn = std::max(mo, hmax(mx));  // finite: the row sees a key of the tile
        corr[r] = mn == mo ? 1.f : (mo == NEG_INF ? 0.f : std::exp2(mo - mn));
        m[r] = mn;
        const __m256 mv = _mm256_set1_ps(mn);
        __m256 psum = _mm256_setzero_ps();
        for (int u = 0; u < SUBS; ++u) {
          const __m256 p = _mm256_and_ps(exp2_8(_mm256_sub_ps(x[u], mv)), seen[u]);
          psum = _mm256_add_ps(psum, p);
          _mm256_storeu_ps(s + LANES * u, Q8 ? _mm256_mul_ps(p, _mm256_load_ps(vs + LANES * u)) : p);
        }
        float* lr = lv + (size_t)r * LANES;
        _mm256_storeu_ps(lr, _mm256_fmadd_ps(_mm256_loadu_ps(lr), _mm256_set1_ps(corr[r]), psum));
      }

      // acc_r = acc_r * corr_r + sum_j p_rj v_j, RC rows x CW vectors at a time in registers
      for (int r0 = rbeg; r0 < rend; r0 += RC) {
        const int rc = std::min(RC, rend - r0);
        for (int c0 = 0; c0 < NV; c0 += CW) {
          __m256 av[RC][CW];
          for (int i = 0; i < RC; ++i) {
            if (i < rc) {
              const __m256 cr = _mm256_set1_ps(corr[r0 + i]);
              for (int c = 0; c < CW; ++c)
                av[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)(r0 + i) * D + LANES * (c0 + c)), cr);
            }
          }
          for (int j = 0; j < nt; ++j) {
            pf.step_lines();
            __m256 vv[CW];
            for (int c = 0; c < CW; ++c) vv[c] = _mm256_loadu_ps(vr[j] + LANES * (c0 + c));
            for (int i = 0; i < RC; ++i) {
              if (i < rc) {
                const __m256 pj = _mm256_broadcast_ss(S + (size_t)(r0 + i) * KEYS + j);
                for (int c = 0; c < CW; ++c) av[i][c] = _mm256_fmadd_ps(pj, vv[c], av[i][c]);
              }
            }
          }
          for (int i = 0; i < RC; ++i)
            if (i < rc)
              for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + (size_t)(r0 + i) * D + LANES * (c0 + c), av[i][c]);
        }
      }
    }
    pf.lines_per_step = KEYS * pf.lines;  // what a short tile's fewer steps left
    pf.step_lines();
  }

  for (int r = 0; r < R; ++r) {
    const float* a = acc + (size_t)r * D;
    const float l = hsum(_mm256_loadu_ps(lv + (size_t)r * LANES));
    if (partial) {
      store_partial(partial, r, D, m[r], l, a);
    } else {
      T* dst = rows.out<T>(P, it, r);
      const float sum = with_sink(P, rows.head(P, it, r), m[r], l);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int c = 0; c < D; ++c) dst[c] = static_cast<T>(a[c] * inv);
    }
  }
}

}  // namespace avx2
