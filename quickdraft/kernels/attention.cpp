// (over 400 lines: one kernel, its AVX2 tile, the paged key rows and the entry points)
// Causal grouped-query attention of a few new queries over a KV cache (a decode step or a
// speculative verify), for AVX2 + FMA CPUs (bound in bindings.cpp); the Python-facing contract
// and the torch reference are kernels/attention.py's (`attend`, `reference_attend`).
//
//   attend(q [n, H, d], k [Hkv, S, d], v [Hkv, S, d], start, scale, window) -> [n, H * d]
//   query i (at position p = start + i) of head h attends to keys lo .. p of kv head
//   h / (H / Hkv), lo = 0 (window 0) or max(0, p - window + 1) (a sliding-window layer),
//   softmax(scale * q.k) weighted sum of v; q, k, v all bf16 or all fp32, any strides with a
//   contiguous last dim; output in q's dtype. fp32 math, one rounding. With `sinks` (fp32 [H],
//   gpt-oss's learned per-head logits) each head's softmax also counts one key of score
//   sinks[h] and value 0: the denominator gains exp(sinks[h] - max). With `ends` (int64 [n],
//   start + i + 1 <= ends[i] <= start + n) query i sees keys lo .. ends[i] - 1: past its own
//   position to the end of a block it attends to both ways (Gemma 4's image rows); the
//   window's lo stays p's.
//
// Why: torch's SDPA costs ~0.25 ms per layer for one query row here (dispatch, threading and
// its flash-kernel setup for a few KFLOP), and with the causal mask a verify needs, ~0.55 ms
// for five: ~7 ms of a 1.5B decode step and ~15 ms of its verify. The arithmetic is a few
// MFLOP per layer.
//
// Design: one task per (kv head, block of <= 8 of the query rows sharing it), in parallel.
// A task scores its rows against every key it may see (dot products over d in registers, 4
// rows x 2 keys per tile, k read straight from the cache: bf16 decodes as in linear_bf16.cpp,
// the query packed in the matching even/odd order), takes a two-pass softmax per row, and sums
// p * v (2 rows x 32 dims per tile). Each row's arithmetic depends only on its own limit, not
// on n or its tile neighbours (keys past a row's limit get p = 0 and add exactly nothing), so a
// row of a verify equals the same row of a decode step bit for bit. A sliding window's keys
// below a row's lo get p = 0 the same way; a task starts at its lowest lo rounded down to a
// multiple of 8, so a key keeps its softmax lane (s % 8) whatever rows share the task.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace qd_attn512 {  // attention_avx512.cpp
void scores_bf16(const uint16_t* const* q, int nr, int64_t d, const uint16_t* const* k,
                 int64_t nkeys, float scale, float* sc, int64_t ldsc);
void scores_f32(const float* qp, int nr, int64_t d, const float* const* k, int64_t nkeys,
                float* sc, int64_t ldsc);
void values_bf16(const float* p, int64_t ldp, int nr, const int64_t* nkeys,
                 const uint16_t* const* v, int64_t d, float* o);
void values_f32(const float* p, int64_t ldp, int nr, const int64_t* nkeys, const float* const* v,
                int64_t d, float* o);
}  // namespace qd_attn512

namespace {

using u16 = uint16_t;
using qd_simd::exp8;
using qd_simd::hmax;
using qd_simd::hsum;
using qd_simd::scratch;
using qd_simd::store8;

// How 16 consecutive elements of a k or v row become two fp32 vectors: bf16 as lo = even
// elements, hi = odd ones (qd_bf16::bf16_even / bf16_odd); the query and the output use the
// same order.
template <class T>
struct Row16;

template <>
struct Row16<u16> {
  static constexpr bool kEvenOdd = true;
  static __m256 lo(const u16* p) {
    return qd_bf16::bf16_even(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m256 hi(const u16* p) {
    return qd_bf16::bf16_odd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

template <>
struct Row16<float> {
  static constexpr bool kEvenOdd = false;
  static __m256 lo(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 hi(const float* p) { return _mm256_loadu_ps(p + 8); }
};

constexpr int kRowsPerTask = 8;

// Rows are fetched this many keys ahead (a row pointer per key: the rows of a task may lie in
// separate blocks, where the hardware prefetcher loses the stream at every block edge).
constexpr int64_t kAhead = 16;

inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// sc[r][s] = q_r . k_s for NR rows (packed, [NR][d]) and keys s in [0, nkeys); k[s]: key s's row.
template <class T, int NR>
void score_rows(const float* qp, int64_t d, const T* const* k, int64_t nkeys, float* sc,
                int64_t ldsc) {
  using R = Row16<T>;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  int64_t s = 0;
  for (; s + 2 <= nkeys; s += 2) {
    if (s + kAhead + 2 <= nkeys) {
      prefetch_row(k[s + kAhead], row_bytes);
      prefetch_row(k[s + kAhead + 1], row_bytes);
    }
    const T* k0 = k[s];
    const T* k1 = k[s + 1];
    __m256 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
      const __m256 a0 = R::lo(k0 + j), a1 = R::lo(k1 + j);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m256 x = _mm256_load_ps(qp + r * d + j);
        acc[r][0] = _mm256_fmadd_ps(a0, x, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a1, x, acc[r][1]);
      }
      const __m256 b0 = R::hi(k0 + j), b1 = R::hi(k1 + j);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m256 x = _mm256_load_ps(qp + r * d + j + 8);
        acc[r][0] = _mm256_fmadd_ps(b0, x, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(b1, x, acc[r][1]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      sc[r * ldsc + s] = hsum(acc[r][0]);
      sc[r * ldsc + s + 1] = hsum(acc[r][1]);
    }
  }
  if (s < nkeys) {  // the same per-(row, key) sequence of FMAs as above
    const T* k0 = k[s];
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
      const __m256 a0 = R::lo(k0 + j);
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_fmadd_ps(a0, _mm256_load_ps(qp + r * d + j), acc[r]);
      const __m256 b0 = R::hi(k0 + j);
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_fmadd_ps(b0, _mm256_load_ps(qp + r * d + j + 8), acc[r]);
    }
    for (int r = 0; r < NR; ++r) sc[r * ldsc + s] = hsum(acc[r]);
  }
}

// In place: row sc[lo, limit) -> exp(sc - max), zero on [first, lo) and [limit, width);
// returns the sum, and the max in *row_max. `first` (a multiple of 8, <= lo) is where the
// task's scores start.
float softmax_numerators(float* sc, int64_t first, int64_t lo, int64_t limit, int64_t width,
                         float* row_max) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t padded = (limit + 7) / 8 * 8;  // sc has room up to a multiple of 8
  for (int64_t s = first; s < lo; ++s) sc[s] = ninf;
  for (int64_t s = limit; s < padded; ++s) sc[s] = ninf;
  __m256 m = _mm256_set1_ps(ninf);
  for (int64_t s = first; s < padded; s += 8) m = _mm256_max_ps(m, _mm256_load_ps(sc + s));
  *row_max = hmax(m);
  const __m256 mx = _mm256_set1_ps(*row_max);
  __m256 sum = _mm256_setzero_ps();
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t s = first; s < padded; s += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(sc + s), mx));
    if (s + 8 > limit) {  // lanes past the limit: exactly 0
      const __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(limit - s)), _CMP_LT_OQ);
      e = _mm256_and_ps(e, keep);
    }
    if (s < lo) {  // lanes below the window: exactly 0
      const __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(lo - s)), _CMP_GE_OQ);
      e = _mm256_and_ps(e, keep);
    }
    _mm256_store_ps(sc + s, e);
    sum = _mm256_add_ps(sum, e);
  }
  for (int64_t s = padded; s < width; ++s) sc[s] = 0.0f;
  return hsum(sum);
}

// o[r][0, d) = sum_s p[r][s] v_s over s in [0, nkeys) for NR <= 2 rows, in Row16<T>'s order.
template <class T, int NR>
void weighted_values(const float* p, int64_t ldp, const T* const* v, int64_t nkeys, int64_t d,
                     float* o) {
  using R = Row16<T>;
  for (int64_t c = 0; c < d; c += 32) {
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nkeys; ++s) {
      if (s + kAhead < nkeys) prefetch_row(v[s + kAhead] + c, 32 * static_cast<int64_t>(sizeof(T)));
      const T* row = v[s] + c;
      const __m256 v0 = R::lo(row), v1 = R::hi(row), v2 = R::lo(row + 16), v3 = R::hi(row + 16);
#pragma GCC unroll 2
      for (int r = 0; r < NR; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * ldp + s);
        acc[r][0] = _mm256_fmadd_ps(v0, w, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(v1, w, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(v2, w, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(v3, w, acc[r][3]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) _mm256_store_ps(o + r * d + c + 8 * j, acc[r][j]);
  }
}

bool cpu_has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

int g_isa = -1;  // the tiles in use: -1 the best this CPU runs, 0 AVX2, 1 AVX-512 (+ BF16)

bool use_avx512() { return g_isa < 0 ? cpu_has_avx512_bf16() : g_isa == 1; }

// The AVX-512 halves of a task (attention_avx512.cpp), by element type.
void scores512(const u16* const* qrow, const float*, int nr, int64_t d, const u16* const* k,
               int64_t nkeys, float scale, float* sc, int64_t ldsc) {
  qd_attn512::scores_bf16(qrow, nr, d, k, nkeys, scale, sc, ldsc);
}
void scores512(const float* const*, const float* qp, int nr, int64_t d, const float* const* k,
               int64_t nkeys, float, float* sc, int64_t ldsc) {
  qd_attn512::scores_f32(qp, nr, d, k, nkeys, sc, ldsc);
}
void values512(const float* p, int64_t ldp, int nr, const int64_t* nkeys, const u16* const* v,
               int64_t d, float* o) {
  qd_attn512::values_bf16(p, ldp, nr, nkeys, v, d, o);
}
void values512(const float* p, int64_t ldp, int nr, const int64_t* nkeys, const float* const* v,
               int64_t d, float* o) {
  qd_attn512::values_f32(p, ldp, nr, nkeys, v, d, o);
}

// Where a sequence's keys and values live: its first `shared` keys in blocks of `block` tokens
// that the prefix cache shares, the rest in its own rows (k, v [kv heads, S, d], any strides
// with a contiguous last dim). Page i of pk / pv is (address, layer stride, head stride) in
// elements: block i's row t of kv head h at `layer` is at address + layer * ls + h * hs + t * d
// (a block may be a token range of a larger tensor). No blocks: every key is its own.
struct Pages {
  const int64_t* pk = nullptr;
  const int64_t* pv = nullptr;
  int64_t shared = 0, block = 1, layer = 0;
};

// Row pointers of keys [first, keys) of kv head h (key s at rows[s - first]).
template <class T>
void key_pointers(const T* own, int64_t s0, int64_t s1, const int64_t* pages, const Pages& pg,
                  int64_t h, int64_t d, int64_t first, int64_t keys, const T** rows) {
  const int64_t end = std::min(keys, pg.shared);
  for (int64_t i = first / pg.block * pg.block; i < end; i += pg.block) {  // block by block
    const int64_t* page = pages + 3 * (i / pg.block);
    const T* rows_i = reinterpret_cast<const T*>(page[0]) + pg.layer * page[1] + h * page[2];
    for (int64_t t = std::max<int64_t>(first - i, 0); t < std::min(pg.block, end - i); ++t)
      rows[i + t - first] = rows_i + t * d;
  }
  const T* base = own + h * s0;
  for (int64_t s = std::max(first, pg.shared); s < keys; ++s)
    rows[s - first] = base + (s - pg.shared) * s1;
}

template <class T>
void attend_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Pages& pg,
                 int64_t start, float scale, int64_t window, const float* sinks,
                 const int64_t* ends, at::Tensor& out) {
  using R = Row16<T>;
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t Hkv = k.size(0), group = H / Hkv;
  const int64_t rows = group * n;  // query rows per kv head: row = g * n + i
  const int64_t blocks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const T* qb = static_cast<const T*>(q.data_ptr());
  const T* kb = static_cast<const T*>(k.data_ptr());
  const T* vb = static_cast<const T*>(v.data_ptr());
  T* ob = static_cast<T*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t max_keys = start + n;
  const int64_t ldsc = (max_keys + 7) / 8 * 8;
  const bool wide = use_avx512();
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t t0, int64_t t1) {
    // the floats, then the key and value row pointers (2 floats each, 8-byte aligned)
    float* const qp = scratch(static_cast<size_t>(kRowsPerTask * (2 * d + ldsc) + 4 * ldsc));
    float* const o = qp + kRowsPerTask * d;
    float* const sc = o + kRowsPerTask * d;
    const T** const krows = reinterpret_cast<const T**>(sc + kRowsPerTask * ldsc);
    const T** const vrows = krows + ldsc;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / blocks, r0 = (t % blocks) * kRowsPerTask;
      const int nr = static_cast<int>(std::min<int64_t>(kRowsPerTask, rows - r0));
      int64_t limit[kRowsPerTask], lo[kRowsPerTask], head_of[kRowsPerTask];
      const T* qrow[kRowsPerTask];
      T* orow[kRowsPerTask];
      int64_t keys = 0;            // the task's longest limit
      int64_t first = max_keys;    // the task's lowest window start
      for (int r = 0; r < nr; ++r) {
        const int64_t g = (r0 + r) / n, i = (r0 + r) % n, head = h * group + g;
        head_of[r] = head;
        lo[r] = window > 0 ? std::max<int64_t>(0, start + i + 1 - window) : 0;
        limit[r] = ends ? ends[i] : start + i + 1;
        keys = std::max(keys, limit[r]);
        first = std::min(first, lo[r]);
        qrow[r] = qb + i * qs0 + head * qs1;
        orow[r] = ob + i * (H * d) + head * d;
      }
      // q * scale in fp32, per 16 elements in Row16<T>'s order (AVX-512 bf16 reads q as is)
      const bool even_odd = R::kEvenOdd && !wide;
      if (!(wide && R::kEvenOdd))
        for (int r = 0; r < nr; ++r)
          for (int64_t j = 0; j < d; j += 16)
            for (int e = 0; e < 16; ++e) {
              const int src = even_odd ? (e < 8 ? 2 * e : 2 * (e - 8) + 1) : e;
              qp[r * d + j + e] = qd_simd::load1(qrow[r] + j + src) * scale;
            }
      first = first / 8 * 8;  // keys below it are outside every row's window
      key_pointers(kb, ks0, ks1, pg.pk, pg, h, d, first, keys, krows);
      key_pointers(vb, vs0, vs1, pg.pv, pg, h, d, first, keys, vrows);
      float* const sf = sc + first;
      const int64_t span = keys - first;
      int r = 0;
      if (wide) {
        scores512(qrow, qp, nr, d, krows, span, scale, sf, ldsc);
      } else {
        for (; r + 4 <= nr; r += 4) score_rows<T, 4>(qp + r * d, d, krows, span, sf + r * ldsc, ldsc);
        for (; r < nr; ++r) score_rows<T, 1>(qp + r * d, d, krows, span, sf + r * ldsc, ldsc);
      }
      float inv[kRowsPerTask];
      for (r = 0; r < nr; ++r) {
        float mx;
        float sum = softmax_numerators(sc + r * ldsc, first, lo[r], limit[r], ldsc, &mx);
        if (sinks) sum += std::exp(sinks[head_of[r]] - mx);  // a key of value 0
        inv[r] = 1.0f / sum;
      }
      if (wide) {
        int64_t nkeys[kRowsPerTask];
        for (r = 0; r < nr; ++r) nkeys[r] = limit[r] - first;
        values512(sf, ldsc, nr, nkeys, vrows, d, o);
      } else {
        for (r = 0; r + 2 <= nr; r += 2)
          weighted_values<T, 2>(sf + r * ldsc, ldsc, vrows, std::max(limit[r], limit[r + 1]) - first,
                                d, o + r * d);
        if (r < nr)
          weighted_values<T, 1>(sf + r * ldsc, ldsc, vrows, limit[r] - first, d, o + r * d);
      }
      for (r = 0; r < nr; ++r) {
        const float* src = o + r * d;
        const __m256 scl = _mm256_set1_ps(inv[r]);
        for (int64_t j = 0; j < d; j += 16) {
          __m256 a = _mm256_mul_ps(_mm256_load_ps(src + j), scl);
          __m256 b = _mm256_mul_ps(_mm256_load_ps(src + j + 8), scl);
          if (even_odd) {  // (even 8 | odd 8) -> natural order
            const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
            a = _mm256_permute2f128_ps(lo, hi, 0x20);
            b = _mm256_permute2f128_ps(lo, hi, 0x31);
          }
          store8(orow[r] + j, a);
          store8(orow[r] + j + 8, b);
        }
      }
    }
  });
}

}  // namespace

bool qd_attend_eligible(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        int64_t start, int64_t shared) {
  if (!q.defined() || !k.defined() || !v.defined()) return false;
  if (!q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu()) return false;
  const auto dt = q.scalar_type();
  if ((dt != at::kBFloat16 && dt != at::kFloat) || k.scalar_type() != dt || v.scalar_type() != dt)
    return false;
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3) return false;
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), Hkv = k.size(0);
  if (n < 1 || d % 32 != 0 || Hkv < 1 || H % Hkv != 0) return false;
  if (shared < 0 || shared > start) return false;
  if (k.size(2) != d || v.sizes() != k.sizes() || start < 0 || k.size(1) != start + n - shared)
    return false;
  if (q.stride(2) != 1 || k.stride(2) != 1 || v.stride(2) != 1) return false;
  return !(at::GradMode::is_enabled() &&
           (q.requires_grad() || k.requires_grad() || v.requires_grad()));
}

int64_t qd_attend_isa(int64_t level) {
  TORCH_CHECK(level >= -1 && level <= 1, "quickdraft attend_isa: -1 (best), 0 (AVX2), 1 (AVX-512)");
  TORCH_CHECK(level != 1 || cpu_has_avx512_bf16(),
              "quickdraft attend_isa: this CPU lacks AVX512F/BW/VL + AVX512_BF16");
  g_isa = static_cast<int>(level);
  return use_avx512() ? 1 : 0;
}

at::Tensor qd_attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& k_pages,
                           const c10::optional<at::Tensor>& v_pages, int64_t block, int64_t layer,
                           int64_t start, double scale, int64_t window,
                           const c10::optional<at::Tensor>& sinks,
                           const c10::optional<at::Tensor>& ends) {
  TORCH_CHECK(window >= 0, "quickdraft attend: window must be >= 0 (0: none)");
  const bool has_sinks = sinks.has_value() && sinks->defined();
  TORCH_CHECK(!has_sinks || (sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                             sinks->dim() == 1 && sinks->size(0) == q.size(1) &&
                             sinks->is_contiguous()),
              "quickdraft attend: sinks: contiguous fp32 [H] on the CPU");
  const float* sink_ptr = has_sinks ? sinks->data_ptr<float>() : nullptr;
  Pages pg;
  const bool paged = k_pages.has_value() && k_pages->defined() && k_pages->numel() > 0;
  if (paged) {
    TORCH_CHECK(v_pages.has_value() && v_pages->defined() && v_pages->sizes() == k_pages->sizes() &&
                    k_pages->scalar_type() == at::kLong && v_pages->scalar_type() == at::kLong &&
                    k_pages->dim() == 2 && k_pages->size(1) == 3 && k_pages->is_contiguous() &&
                    v_pages->is_contiguous(),
                "quickdraft attend: k_pages, v_pages: int64 [pages, 3] (address, layer stride, "
                "head stride) alike");
    TORCH_CHECK(block >= 1 && layer >= 0, "quickdraft attend: block >= 1, layer >= 0");
    pg.pk = k_pages->data_ptr<int64_t>();
    pg.pv = v_pages->data_ptr<int64_t>();
    pg.shared = k_pages->size(0) * block;
    pg.block = block;
    pg.layer = layer;
  }
  TORCH_CHECK(qd_attend_eligible(q, k, v, start, pg.shared),
              "quickdraft attend: q [n, H, d], k and v [Hkv, start + n - shared, d] of one float "
              "dtype (bf16/fp32) on the CPU, d % 32 == 0, H % Hkv == 0, contiguous last dims");
  const bool has_ends = ends.has_value() && ends->defined();
  const int64_t n = q.size(0);
  const int64_t* end_ptr = nullptr;
  if (has_ends) {
    TORCH_CHECK(ends->device().is_cpu() && ends->scalar_type() == at::kLong && ends->dim() == 1 &&
                    ends->size(0) == n && ends->is_contiguous(),
                "quickdraft attend: ends: contiguous int64 [n] on the CPU");
    end_ptr = ends->data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(end_ptr[i] >= start + i + 1 && end_ptr[i] <= start + n,
                  "quickdraft attend: ends[i] must lie in [start + i + 1, start + n]");
  }
  at::Tensor out = at::empty({n, q.size(1) * q.size(2)}, q.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat)
    attend_impl<float>(q, k, v, pg, start, sc, window, sink_ptr, end_ptr, out);
  else
    attend_impl<u16>(q, k, v, pg, start, sc, window, sink_ptr, end_ptr, out);
  return out;
}

at::Tensor qd_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                     double scale, int64_t window, const c10::optional<at::Tensor>& sinks,
                     const c10::optional<at::Tensor>& ends) {
  return qd_attend_paged(q, k, v, c10::nullopt, c10::nullopt, 1, 0, start, scale, window, sinks,
                         ends);
}
