// The AVX-512 tiles of the attention kernel (attention.cpp runs them where the CPU has
// AVX512F/BW/VL and AVX512_BF16; kernels/attention.py owns the contract and the reference).
//
// Scores: a tile of 4 query rows x 4 keys holds 16 accumulators over the head dimension (bf16:
// vdpbf16ps, 32 exact bf16 products per instruction, the raw query times the key, scaled once
// after; fp32: FMA of the pre-scaled query), and one transposed reduction turns the 16 into the
// 16 scores. The reduction adds lane i and i + 8, then i and i + 4, i and i + 2, i and i + 1 of
// every accumulator, whichever accumulators share the tile, so a score depends only on its own
// row and key. A tile's missing rows (a task's last ones) take zero accumulators, its missing
// keys (the last ones) repeat the last key; neither is stored.
// Values: a tile of NR <= 4 rows x 64 (or 32) dims, one FMA per row, key and 16 dims, keys in
// order; a key past a row's limit has p = 0 and adds exactly nothing. So every row of a verify
// equals the same row of a decode step bit for bit, as on the AVX2 path (not the same bits as
// the AVX2 path: the sums run in another order).
//
// Only this file is compiled for AVX-512 (the pragma below, after every include): it includes
// no torch or standard header with code, so no inline function built for AVX-512 can be picked
// by the linker for another file, and nothing here runs unless the CPU has the features.
#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")

namespace qd_attn512 {
namespace {

using u16 = uint16_t;

#define QD_INLINE inline __attribute__((always_inline))
#define QD_LAMBDA __attribute__((always_inline))

// Lane sums of 16 accumulators a[4 * r + j] (row r, key j) -> lane 4 * r + j.
QD_INLINE __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)  // lanes 0-7: a[2m][i] + a[2m][i + 8]; 8-15 the same of a[2m+1]
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // chunk q: a[4m + q]'s lanes i + (i + 4)
    c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m) {  // per chunk: lanes 0 + 2 and 1 + 3 of two accumulators
    const __m512d x = _mm512_castps_pd(c[2 * m]), y = _mm512_castps_pd(c[2 * m + 1]);
    d[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // chunk q, lane m: the sum of a[4m + q], i.e. key q of row m; transpose to lane 4m + q
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, e);
}

// Chunk r of `t` holds row r's scores of 4 keys: store rows [0, nr), keys [0, nk).
QD_INLINE void store_tile(__m512 t, int nr, int nk, float* sc, int64_t ldsc) {
  const __mmask8 keep = static_cast<__mmask8>((1u << nk) - 1);
  _mm_mask_storeu_ps(sc, keep, _mm512_extractf32x4_ps(t, 0));
  if (nr > 1) _mm_mask_storeu_ps(sc + ldsc, keep, _mm512_extractf32x4_ps(t, 1));
  if (nr > 2) _mm_mask_storeu_ps(sc + 2 * ldsc, keep, _mm512_extractf32x4_ps(t, 2));
  if (nr > 3) _mm_mask_storeu_ps(sc + 3 * ldsc, keep, _mm512_extractf32x4_ps(t, 3));
}

template <int NR>
QD_INLINE void score_tile_bf16(const u16* const* q, int64_t d, const u16* const* k, float scale,
                               int nk, float* sc, int64_t ldsc) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 32) {
    __m512bh kv[4];
    for (int c = 0; c < 4; ++c)
      kv[c] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(k[c] + j));
    for (int r = 0; r < NR; ++r) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(q[r] + j));
      for (int c = 0; c < 4; ++c) acc[4 * r + c] = _mm512_dpbf16_ps(acc[4 * r + c], x, kv[c]);
    }
  }
  store_tile(_mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)), NR, nk, sc, ldsc);
}

template <int NR>
QD_INLINE void score_tile_f32(const float* qp, int64_t d, const float* const* k, int nk, float* sc,
                              int64_t ldsc) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += 16) {
    __m512 kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = _mm512_loadu_ps(k[c] + j);
    for (int r = 0; r < NR; ++r) {
      const __m512 x = _mm512_load_ps(qp + r * d + j);
      for (int c = 0; c < 4; ++c) acc[4 * r + c] = _mm512_fmadd_ps(x, kv[c], acc[4 * r + c]);
    }
  }
  store_tile(reduce16(acc), NR, nk, sc, ldsc);
}

// Rows are fetched this many keys ahead (a row pointer per key: the rows of a task may lie in
// separate blocks, where the hardware prefetcher loses the stream at every block edge).
constexpr int64_t kAhead = 16;

QD_INLINE void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// Keys [s, s + 4) of the task's key rows; past nkeys, the last key again (a tile's missing
// keys are computed and not stored).
template <class T>
inline void key_rows(const T* const* k, int64_t s, int64_t nkeys, const T** out) {
  for (int c = 0; c < 4; ++c) out[c] = k[s + c < nkeys ? s + c : nkeys - 1];
}

// One key's W dims of v as fp32: bf16 as (even dims 16 | odd dims 16) per 32 dims, fp32 as is.
template <int V>
QD_INLINE void load_values(const u16* row, __m512* x) {
  const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int h = 0; h < V / 2; ++h) {
    const __m512i raw = _mm512_loadu_si512(static_cast<const void*>(row + 32 * h));
    x[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    x[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, hi16));
  }
}
template <int V>
QD_INLINE void load_values(const float* row, __m512* x) {
  for (int i = 0; i < V; ++i) x[i] = _mm512_loadu_ps(row + 16 * i);
}

// A row's W sums in natural order (bf16's even | odd order interleaved back).
template <int V>
QD_INLINE void store_values(const u16*, const __m512* acc, float* out) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int h = 0; h < V / 2; ++h) {
    _mm512_storeu_ps(out + 32 * h, _mm512_permutex2var_ps(acc[2 * h], lo, acc[2 * h + 1]));
    _mm512_storeu_ps(out + 32 * h + 16, _mm512_permutex2var_ps(acc[2 * h], hi, acc[2 * h + 1]));
  }
}
template <int V>
QD_INLINE void store_values(const float*, const __m512* acc, float* out) {
  for (int i = 0; i < V; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

// o[r][c .. c + W) = sum_s p[r][s] v_s for NR rows, W = 64 or 32 dims, natural order.
template <int NR, int W, class T>
void values_tile(const float* p, int64_t ldp, const T* const* v, int64_t nkeys, int64_t c,
                 float* o, int64_t d) {
  constexpr int V = W / 16;  // zmm per row
  __m512 acc[NR][V];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < V; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nkeys; ++s) {
    if (s + kAhead < nkeys) prefetch_row(v[s + kAhead] + c, W * static_cast<int64_t>(sizeof(T)));
    __m512 x[V];
    load_values<V>(v[s] + c, x);
    for (int r = 0; r < NR; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * ldp + s]);
      for (int i = 0; i < V; ++i) acc[r][i] = _mm512_fmadd_ps(x[i], w, acc[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r) store_values<V>(v[0], acc[r], o + r * d + c);
}

template <int NR, class T>
void values_rows(const float* p, int64_t ldp, const T* const* v, int64_t nkeys, int64_t d,
                 float* o) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) values_tile<NR, 64>(p, ldp, v, nkeys, c, o, d);
  if (c < d) values_tile<NR, 32>(p, ldp, v, nkeys, c, o, d);
}

template <class T>
void values_all(const float* p, int64_t ldp, int nr, const int64_t* nkeys, const T* const* v,
                int64_t d, float* o) {
  int r = 0;
  for (; r + 4 <= nr; r += 4) {
    int64_t n = nkeys[r];
    for (int i = 1; i < 4; ++i) n = n > nkeys[r + i] ? n : nkeys[r + i];
    values_rows<4>(p + r * ldp, ldp, v, n, d, o + r * d);
  }
  for (; r < nr; ++r) values_rows<1>(p + r * ldp, ldp, v, nkeys[r], d, o + r * d);
}

template <int N>
struct Rows {
  static constexpr int value = N;
};

// Every 4-key tile over rows [0, nr): `tile(Rows<NR>, r, keys, nk, out)` for its rows r..r+NR.
template <class T, class Tile>
QD_INLINE void scores_all(int nr, int64_t d, const T* const* k, int64_t nkeys, float* sc,
                          int64_t ldsc, Tile tile) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t s = 0; s < nkeys; s += 4) {
    if (s + kAhead + 4 <= nkeys)  // key rows need not be adjacent: fetch them ahead
      for (int c = 0; c < 4; ++c) prefetch_row(k[s + kAhead + c], row_bytes);
    const T* kr[4];
    key_rows(k, s, nkeys, kr);
    const int nk = nkeys - s < 4 ? static_cast<int>(nkeys - s) : 4;
    int r = 0;
    for (; r + 4 <= nr; r += 4) tile(Rows<4>{}, r, kr, nk, sc + r * ldsc + s);
    switch (nr - r) {
      case 3: tile(Rows<3>{}, r, kr, nk, sc + r * ldsc + s); break;
      case 2: tile(Rows<2>{}, r, kr, nk, sc + r * ldsc + s); break;
      case 1: tile(Rows<1>{}, r, kr, nk, sc + r * ldsc + s); break;
      default: break;
    }
  }
}

}  // namespace

// The two halves of a task of attention.cpp's on AVX-512 (its contract; this file's header).
// k[s], v[s]: key s's row of the task's kv head (attention.cpp's key rows: a cache row or a
// shared block's).
// scores: sc[r * ldsc + s] = scale * q_r . k_s for r < nr, s < nkeys (q rows raw bf16).
void scores_bf16(const u16* const* q, int nr, int64_t d, const u16* const* k, int64_t nkeys,
                 float scale, float* sc, int64_t ldsc) {
  auto tile = [&](auto rows, int r, const u16** kr, int nk, float* out) QD_LAMBDA {
    score_tile_bf16<decltype(rows)::value>(q + r, d, kr, scale, nk, out, ldsc);
  };
  scores_all(nr, d, k, nkeys, sc, ldsc, tile);
}

// the same with fp32 keys and rows of qp [nr][d] already scaled
void scores_f32(const float* qp, int nr, int64_t d, const float* const* k, int64_t nkeys,
                float* sc, int64_t ldsc) {
  auto tile = [&](auto rows, int r, const float** kr, int nk, float* out) QD_LAMBDA {
    score_tile_f32<decltype(rows)::value>(qp + r * d, d, kr, nk, out, ldsc);
  };
  scores_all(nr, d, k, nkeys, sc, ldsc, tile);
}

// values: o[r][0, d) = sum over s < nkeys[r] of p[r][s] v_s, natural order (d % 32 == 0).
void values_bf16(const float* p, int64_t ldp, int nr, const int64_t* nkeys, const u16* const* v,
                 int64_t d, float* o) {
  values_all(p, ldp, nr, nkeys, v, d, o);
}

void values_f32(const float* p, int64_t ldp, int nr, const int64_t* nkeys, const float* const* v,
                int64_t d, float* o) {
  values_all(p, ldp, nr, nkeys, v, d, o);
}

}  // namespace qd_attn512

#undef QD_INLINE
#undef QD_LAMBDA

#pragma GCC pop_options
