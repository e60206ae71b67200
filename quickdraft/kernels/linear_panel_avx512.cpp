// The AVX512_BF16 tiles of the bf16 panel kernel (linear_panel.cpp runs them where the CPU has
// AVX512F/BW and AVX512_BF16 and the activations are bf16; kernels/linear_bf16.py owns the
// contract and the reference).
//
// Contract: every output is the same fp32 chain over k in order as linear_panel.cpp's AVX2
// tile computes, bit for bit: acc = round(acc + x[k] * w[k]) for k = 0, 1, ... Here one
// vdpbf16ps adds two k to 16 rows: per 32-bit lane it adds the odd bf16 product, then the even
// one, each rounded to nearest even, and a product of two bf16 values is exact in fp32, so
// lane (k + 1, k) gives the FMA chain's two steps in order. A zmm load takes k and k + 1 of a
// panel (64 bytes: 16 rows each, in the panel's j / 8 + j order), one vpermw puts row j's
// (k + 1, k) pair in lane j, and each token broadcasts its (x[k + 1], x[k]) pair (`xp`, made
// once per call): 32 multiply-adds per instruction where the AVX2 tile takes 8, and no
// conversions. The instruction flushes denormal inputs and results to zero, which the AVX2
// FMAs do not: results can differ where a product or a partial sum is below 2^-126, never
// between calls on one host (every M runs these tiles, so batch invariance holds).
//
// Only this file is compiled for AVX-512 (the pragma below, after every include), as
// linear_gguf_avx512.cpp: nothing here runs unless the CPU has the features.
#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")

namespace qd_panel_bf16 {
namespace {

using u16 = uint16_t;
using u32 = uint32_t;

// vpermw indices: lane j of the result = (row j at k + 1, row j at k); the panel stores row j
// of one k at u16 2j (j < 8) or 2(j - 8) + 1 (j >= 8), k + 1's 16 u16 after k's.
inline __m512i pair_index() {
  alignas(64) u16 idx[32];
  for (int j = 0; j < 16; ++j) {
    const u16 r = static_cast<u16>(j < 8 ? 2 * j : 2 * (j - 8) + 1);
    idx[2 * j] = static_cast<u16>(16 + r);  // low half: k + 1 (added second)
    idx[2 * j + 1] = r;                     // high half: k (added first)
  }
  return _mm512_load_si512(idx);
}

// k and k + 1 of a panel as (k + 1, k) pairs per row; past K (`single`): (0, k)
inline __m512bh pairs(const u16* wk, __m512i idx, bool single) {
  const __m512i raw = single ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                   reinterpret_cast<const __m256i*>(wk)))
                             : _mm512_loadu_si512(wk);
  __m512i w = _mm512_permutexvar_epi16(idx, raw);
  if (single) w = _mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return (__m512bh)w;
}

template <int T>
inline void tile(const u16* w, int64_t klen, const u32* xp, int64_t ldxp, float* acc, bool init,
                 const char* pf) {
  const __m512i idx = pair_index();
  __m512 a[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) a[t] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + t * 16);
  for (int64_t k = 0; k < klen; k += 2) {
    if (pf) _mm_prefetch(pf + k * 32, _MM_HINT_T0);
    const __m512bh wp = pairs(w + k * 16, idx, k + 1 == klen);
    const u32* xk = xp + k / 2;
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xk[t * ldxp]));
      a[t] = _mm512_dpbf16_ps(a[t], wp, (__m512bh)xb);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc + t * 16, a[t]);
}

}  // namespace

// One token over two panels at once (w0, w1: [K, 16] u16 each) into acc0, acc1 [16]: the chain
// of tile<1>, two in flight (a decode step needs them to cover the instruction's latency).
void tile1_pair(const u16* w0, const u16* w1, int64_t K, const u32* xp, float* acc0,
                float* acc1, const char* pf0, const char* pf1) {
  const __m512i idx = pair_index();
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    _mm_prefetch(pf0 + k * 32, _MM_HINT_T0);
    _mm_prefetch(pf1 + k * 32, _MM_HINT_T0);
    const bool single = k + 1 == K;
    const __m512i xb = _mm512_set1_epi32(static_cast<int>(xp[k / 2]));
    const __m512bh x = (__m512bh)xb;
    a = _mm512_dpbf16_ps(a, pairs(w0 + k * 16, idx, single), x);
    b = _mm512_dpbf16_ps(b, pairs(w1 + k * 16, idx, single), x);
  }
  _mm512_storeu_ps(acc0, a);
  _mm512_storeu_ps(acc1, b);
}

// T tokens (1..16) x 16 rows over k in [0, klen) of one panel slice (klen even but at the end
// of K), x pairs from xp [T][ldxp] (u32: (x[k + 1], x[k]) of the slice's first k at xp[0]).
bool tile_dispatch(int T, const u16* w, int64_t klen, const u32* xp, int64_t ldxp, float* acc,
                   bool init, const char* pf) {
  switch (T) {
    case 1: tile<1>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 2: tile<2>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 3: tile<3>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 4: tile<4>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 5: tile<5>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 6: tile<6>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 7: tile<7>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 8: tile<8>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 9: tile<9>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 10: tile<10>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 11: tile<11>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 12: tile<12>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 13: tile<13>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 14: tile<14>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 15: tile<15>(w, klen, xp, ldxp, acc, init, pf); return true;
    case 16: tile<16>(w, klen, xp, ldxp, acc, init, pf); return true;
  }
  return false;
}

}  // namespace qd_panel_bf16

#pragma GCC pop_options
