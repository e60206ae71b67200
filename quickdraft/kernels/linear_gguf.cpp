// Small-M linear over a GGUF file's own quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), repacked exactly into 16-row panels, with int8 activations, for AVX2 CPUs.
// kernels/linear_gguf.py owns the contract, the layout and the reference; in short, per block
// b (32 or 256 values) of row n and token t:
//   y[t, n] += d dx[t,b] * sum_s sc[s] dot_s(u, xq[t])  -  dm dx[t,b] * sum_s m[s] bsum[t,s]
// with the integer sums exact and the block terms added in fp32 in block order, so a row's
// result does not depend on the other rows (decode and verify give the same bits).
//
// Why: decode streams every weight once per token; the GGUF's 4.5-6.6 bits per weight are
// 0.28-0.41x the bytes of bf16. Per 4-column quad the weights are unpacked once (low nibbles,
// plus the fifth / sixth bits from their own planes) and reused by every token: per token and
// 8 rows one vpmaddubsw (u unsigned < 64 x int8 activations, pairs < 2^15) and one vpmaddwd
// whose second operand is the row's sub-block scale (K-quants) or 1, so the scales cost no
// extra multiply; the mins and Q4_0/Q5_0/Q6_K's offsets go through per-sub-block activation
// sums, once per block. Q8_0 (signed) uses |q| x sign(x, q), as llama.cpp's AVX2 path does; the
// non-linear formats (IQ4_NL, IQ4_XS, MXFP4) look their 4-bit indices up in a 16-byte table
// (vpshufb); IQ4's values go the same signed way, MXFP4's (|v| <= 12) are looked up as v + 12,
// unsigned, and take 12 sum(x) off once a block, as Q4_0 its 8: no sign op per token.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16.h"
#include "gguf_gemm.h"
#include "gguf_layout.h"
#include "ops.h"
#include "panel_driver.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using namespace qd_gguf;  // NOLINT: the layout's names
using u16 = uint16_t;

inline __m256i bcast32(const void* p) {  // 4 bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 rows' sub-block scales (kShift 0) or mins (4) as int32: int8 each, or Q2_K's nibbles.
template <int F, int kShift>
inline __m256i scales8(const int8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (Traits<F>::kPackedM)
    return _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(v), kShift), _mm256_set1_epi32(15));
  else
    return _mm256_cvtepi8_epi32(v);
}

// int32 lanes lo[j], hi[j] -> lane j = (lo[j], hi[j]) as two int16: the vpmaddwd operand that
// multiplies a row's pair of 16-bit sums by its own scale(s).
inline __m256i pair32(__m256i lo, __m256i hi) {
  return _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
}

inline __m256 load_f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Always inlined, as the AVX-512 tile's copy (gguf_tile_avx512.h): left to GCC's heuristics,
// the Q6_K tile's loop over 4 tokens was kept out of line.
template <int N, class Fn, int... I>
__attribute__((always_inline)) inline void static_for_impl(Fn&& fn,
                                                           std::integer_sequence<int, I...>) {
  (fn(std::integral_constant<int, I>{}), ...);
}
template <int N, class Fn>
__attribute__((always_inline)) inline void static_for(Fn&& fn) {
  static_for_impl<N>(fn, std::make_integer_sequence<int, N>{});
}

// 8 rows' d (or dm) of a panel block as fp32: fp16, or MXFP4's E8M0 bytes as 2^(e - 128) (bits
// (e - 1) << 23 for e >= 2, the subnormals 0x00200000 << e below, as ggml_e8m0_to_fp32_half).
template <int F>
inline __m256 load_d8(const uint8_t* p) {
  if constexpr (Traits<F>::kE8) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  } else {
    return load_f16x8(p);
  }
}

// The unsigned values (or table indices) of quad C of group g, rows 0-7 (u[0]) and 8-15 (u[1]).
template <int F, int C>
inline void unpack_quad(const uint8_t* wb, int g, __m256i u[2]) {
  using Tr = Traits<F>;
  if constexpr (Tr::kBits <= 3) {  // bits 2k, 2k + 1 of vector C / 2, k = 2 (C % 2) + h
    const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 128 + (C / 2) * 32));
    static_for<2>([&](auto h) {
      constexpr int k = 2 * (C % 2) + decltype(h)::value;
      u[h] = _mm256_and_si256(_mm256_srli_epi16(lb, 2 * k), _mm256_set1_epi8(3));
    });
    if constexpr (Tr::kBits == 3) {  // bit 2 (C % 4) + h of the 1-bit plane's vector C / 4
      const __m256i hb = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wb + Tr::kLow + g * 64 + (C / 4) * 32));
      static_for<2>([&](auto h) {
        // bit k of every byte straight to its bit 2 (one shift, then a mask and an or)
        constexpr int k = 2 * (C % 4) + decltype(h)::value;
        __m256i at2;
        if constexpr (k <= 2)
          at2 = _mm256_slli_epi16(hb, 2 - k);
        else
          at2 = _mm256_srli_epi16(hb, k - 2);
        u[h] = _mm256_or_si256(u[h], _mm256_and_si256(at2, _mm256_set1_epi8(4)));
      });
    }
    return;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 256 + C * 32));
  u[0] = _mm256_and_si256(v, low4);
  u[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  if constexpr (Tr::kBits == 5) {  // bit 2 (C % 4) + h of vector C / 4 -> bit 4
    const __m256i hb = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(wb + Tr::kLow + g * 64 + (C / 4) * 32));
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    static_for<2>([&](auto h) {
      constexpr int k = 2 * (C % 4) + decltype(h)::value;
      __m256i t;
      if constexpr (k < 4)
        t = _mm256_slli_epi16(hb, 4 - k);
      else if constexpr (k == 4)
        t = hb;
      else
        t = _mm256_srli_epi16(hb, k - 4);
      u[h] = _mm256_or_si256(u[h], _mm256_and_si256(t, bit4));
    });
  } else if constexpr (Tr::kBits == 6) {  // bits 2k, 2k + 1 of vector C / 2 -> bits 4, 5
    const __m256i hb = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(wb + Tr::kLow + g * 128 + (C / 2) * 32));
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    static_for<2>([&](auto h) {
      constexpr int k = 2 * (C % 2) + decltype(h)::value;
      __m256i t;
      if constexpr (k < 2)
        t = _mm256_slli_epi16(hb, 4 - 2 * k);
      else if constexpr (k == 2)
        t = hb;
      else
        t = _mm256_srli_epi16(hb, 2);
      u[h] = _mm256_or_si256(u[h], _mm256_and_si256(t, bits45));
    });
  }
}

// T tokens x 16 rows over blocks [0, nb) of one panel slice `w` (nb * kBytes): acc [T][16]
// fp32 (zeroed first when init) += the block terms. xq: int8 activations (row stride ldx, from
// this slice's first column); dx: block scales (row stride ldd); bs: int16 sums per sub-block
// (row stride ldb). Prefetches each block at `pf` + its offset (null: none).
template <int F, int T>
void tile(const uint8_t* w, int64_t nb, const int8_t* xq, int64_t ldx, const float* dx,
          int64_t ldd, const int16_t* bs, int64_t ldb, float* acc, bool init, const char* pf) {
  using Tr = Traits<F>;
  constexpr int kSubs = Tr::kBlock / Tr::kSub;  // sub-blocks per block
  // MXFP4's values looked up as v + 12 in [0, 24] (unsigned), 12 sum(x) taken off per block
  constexpr int kLift = F == kMXFP4 ? 12 : 0;
  // quads whose vpmaddubsw pairs add up in 16 bits before one vpmaddwd: a pair is at most
  // 2 * max|u| * 127, so 8 / 4 / 2 of them fit in int16 for 4 / 5 / 6 bits, 4 for MXFP4's
  // lifted u <= 24, one for IQ4's |v| <= 127; 2-3 bits: 4, a 16-value sub-block's quads
  constexpr int kRun = F == kIQ4_NL || F == kIQ4_XS ? 1
                       : kLift > 0                  ? 4
                       : Tr::kBits == 4             ? 8
                       : Tr::kBits == 6             ? 2
                                                    : 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i tbl = _mm256_setzero_si256();
  if constexpr (Tr::kTable) {
    alignas(16) int8_t values[16];  // v(u) (+ kLift)
    for (int i = 0; i < 16; ++i) values[i] = static_cast<int8_t>(table_values<F>()[i] + kLift);
    tbl = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(values)));
  }
  if (init) std::fill(acc, acc + T * kPanel, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * Tr::kBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(wb + Tr::kScOff);  // [subs][16]
    __m256i s[T][2], p16[T][2];
    static_for<T>([&](auto t) { s[t][0] = s[t][1] = _mm256_setzero_si256(); });
    for (int g = 0; g < Tr::kGroups; ++g) {
      const int8_t* xg = xq + b * Tr::kBlock + g * 32;
      if (pf) prefetch_group<F>(pf + b * Tr::kBytes, g);
      // vpmaddwd multipliers: the rows' sub-block scales (quads 0-3 and 4-7), or 1
      __m256i mul[2][2];
      if constexpr (Tr::kK) {
        const int s0 = g * 32 / Tr::kSub, s1 = (g * 32 + 16) / Tr::kSub;
        static_for<2>([&](auto h) {
          const __m256i a = scales8<F, 0>(sc + s0 * kPanel + 8 * h);
          const __m256i b = scales8<F, 0>(sc + s1 * kPanel + 8 * h);
          mul[0][h] = pair32(a, a);
          mul[1][h] = pair32(b, b);
        });
      } else {
        mul[0][0] = mul[0][1] = mul[1][0] = mul[1][1] = ones;
      }
      static_for<8>([&](auto c) {
        constexpr int C = decltype(c)::value;
        if constexpr (Tr::kBits == 8) {
          const uint8_t* q = wb + g * 512 + C * 64;
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
          const __m256i a0 = _mm256_sign_epi8(v0, v0), a1 = _mm256_sign_epi8(v1, v1);
          static_for<T>([&](auto t) {
            const __m256i xb = bcast32(xg + t * ldx + C * 4);
            const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, v0));
            const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, v1));
            s[t][0] = _mm256_add_epi32(s[t][0], _mm256_madd_epi16(p0, ones));
            s[t][1] = _mm256_add_epi32(s[t][1], _mm256_madd_epi16(p1, ones));
          });
        } else {
          __m256i u[2], v[2];
          unpack_quad<F, C>(wb, g, u);
          constexpr bool kSigned = Tr::kTable && kLift == 0;
          if constexpr (kSigned)  // signed values: |v| x sign(x, v), as Q8_0
            static_for<2>([&](auto h) {
              v[h] = _mm256_shuffle_epi8(tbl, u[h]);
              u[h] = _mm256_sign_epi8(v[h], v[h]);
            });
          else if constexpr (Tr::kTable)  // lifted: v + kLift, unsigned
            static_for<2>([&](auto h) { u[h] = _mm256_shuffle_epi8(tbl, u[h]); });
          static_for<T>([&](auto t) {
            const __m256i xb = bcast32(xg + t * ldx + C * 4);
            static_for<2>([&](auto h) {
              const __m256i p =
                  _mm256_maddubs_epi16(u[h], kSigned ? _mm256_sign_epi8(xb, v[h]) : xb);
              p16[t][h] = C % kRun == 0 ? p : _mm256_add_epi16(p16[t][h], p);
              if constexpr (C % kRun == kRun - 1)  // flush the run: times the scale, to 32 bits
                s[t][h] = _mm256_add_epi32(s[t][h], _mm256_madd_epi16(p16[t][h], mul[C / 4][h]));
            });
          });
        }
      });
    }
    // mins / offsets, then the block's fp32 terms
    __m256 d[2], dm[2];
    static_for<2>([&](auto h) {
      d[h] = load_d8<F>(wb + Tr::kDOff + 8 * Tr::kDBytes * h);
      dm[h] = Tr::kHasDm ? load_d8<F>(wb + Tr::kDOff + Tr::kDBytes * (kPanel + 8 * h)) : d[h];
    });
    static_for<T>([&](auto t) {
      const float dxt = dx[t * ldd + b];
      const int16_t* bst = bs + t * ldb + b * kSubs;
      __m256i msum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      if constexpr (Tr::kK && !Tr::kTable) {  // sum_s m[s] bsum[s] per row, m in pairs of subs
        const int8_t* mm = Tr::kHasM ? reinterpret_cast<const int8_t*>(wb + Tr::kMOff) : sc;
        constexpr int kMShift = Tr::kPackedM ? 4 : 0;  // Q2_K: the min is the high nibble
        static_for<kSubs / 2>([&](auto i) {
          const __m256i xb = bcast32(bst + 2 * i);
          static_for<2>([&](auto h) {
            const __m256i mv = pair32(scales8<F, kMShift>(mm + 2 * i * kPanel + 8 * h),
                                      scales8<F, kMShift>(mm + (2 * i + 1) * kPanel + 8 * h));
            msum[h] = _mm256_add_epi32(msum[h], _mm256_madd_epi16(mv, xb));
          });
        });
        if constexpr (Tr::kMScShift > 0)  // m = 32 sc (Q6_K), 4 sc (Q3_K)
          static_for<2>([&](auto h) { msum[h] = _mm256_slli_epi32(msum[h], Tr::kMScShift); });
      } else if constexpr (Tr::kMConst != 0 || kLift != 0) {
        constexpr int m = kLift != 0 ? kLift : Tr::kMConst;
        msum[0] = msum[1] = _mm256_set1_epi32(m * static_cast<int32_t>(bst[0]));
      }
      float* a = acc + t * kPanel;
      const __m256 dxv = _mm256_set1_ps(dxt);
      static_for<2>([&](auto h) {
        __m256 av = _mm256_loadu_ps(a + 8 * h);
        if constexpr (Tr::kHasDm) {
          av = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][h]), _mm256_mul_ps(d[h], dxv), av);
          av = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[h]), _mm256_mul_ps(dm[h], dxv), av);
        } else {  // dm = d: subtract in integers, scale once
          const __m256i tot = _mm256_sub_epi32(s[t][h], msum[h]);
          av = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(d[h], dxv), av);
        }
        _mm256_storeu_ps(a + 8 * h, av);
      });
    });
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*, int64_t,
                        const int16_t*, int64_t, float*, bool, const char*);

template <int F>
TileFn pick_tile(int T) {
  switch (T) {
    case 1: return &tile<F, 1>;
    case 2: return &tile<F, 2>;
    case 3: return &tile<F, 3>;
    case 4: return &tile<F, 4>;
  }
  TORCH_CHECK(false, "quickdraft linear_gguf: bad token chunk ", T);
}

TileFn tile_for(int f, int T) {
  switch (f) {
    case kQ4_0: return pick_tile<kQ4_0>(T);
    case kQ4_1: return pick_tile<kQ4_1>(T);
    case kQ5_0: return pick_tile<kQ5_0>(T);
    case kQ5_1: return pick_tile<kQ5_1>(T);
    case kQ8_0: return pick_tile<kQ8_0>(T);
    case kQ4_K: return pick_tile<kQ4_K>(T);
    case kQ5_K: return pick_tile<kQ5_K>(T);
    case kQ6_K: return pick_tile<kQ6_K>(T);
    case kQ2_K: return pick_tile<kQ2_K>(T);
    case kQ3_K: return pick_tile<kQ3_K>(T);
    case kIQ4_NL: return pick_tile<kIQ4_NL>(T);
    case kIQ4_XS: return pick_tile<kIQ4_XS>(T);
    case kMXFP4: return pick_tile<kMXFP4>(T);
  }
  TORCH_CHECK(false, "quickdraft linear_gguf: unknown format ", f);
}

// One token's K values -> xq (int8, per `block` values dx = max|x| / 127, xq = round(x / dx)
// half to even, as quantize_blocks in linear_gguf.py), dx [K / block] and the int16 sums of xq
// per 16 values bs16 [K / 16].
template <class Tx>
void quantize_row(const Tx* x, int64_t K, int block, int8_t* xq, float* dx, int16_t* bs16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b0 = 0; b0 < K; b0 += block) {
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8)
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, qd_simd::load8(x + b0 + i)));
    const float d = qd_simd::hmax(amax) / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    dx[b0 / block] = d;
    for (int i = 0; i < block; i += 32) {
      __m256i qi[4];
      for (int j = 0; j < 4; ++j)  // round to nearest even (MXCSR default), as torch.round
        qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(qd_simd::load8(x + b0 + i + 8 * j), _mm256_set1_ps(id)));
      for (int half = 0; half < 2; ++half) {
        __m256i s = _mm256_add_epi32(qi[2 * half], qi[2 * half + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        bs16[(b0 + i) / 16 + half] = static_cast<int16_t>(_mm_cvtsi128_si32(s4));
      }
      const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
      const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
      __m256i p8 = _mm256_packs_epi16(p16a, p16b);
      p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b0 + i), p8);
    }
  }
}

bool cpu_has_avx512_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

bool cpu_has_avx512_vbmi() {
  static const bool ok = cpu_has_avx512_vnni() && __builtin_cpu_supports("avx512vbmi");
  return ok;
}

// the tile in use: -1 the best this CPU runs, 0 AVX2, 1 AVX-512 VNNI, 2 that with AVX512_VBMI
int g_isa = -1;

int isa_level() {
  if (g_isa >= 0) return g_isa;
  return cpu_has_avx512_vbmi() ? 2 : cpu_has_avx512_vnni() ? 1 : 0;
}

}  // namespace

namespace qd_gguf {

int64_t acts_floats(int64_t M, int64_t K, int block) {
  return (M * K + 3) / 4 + M * K / block + (M * K / 16 * 2 + 3) / 4 + (M * K / 32 * 2 + 3) / 4;
}

Acts acts_at(float* buf, int64_t M, int64_t K, int block) {
  Acts a;
  a.xq = reinterpret_cast<int8_t*>(buf);
  a.dx = buf + (M * K + 3) / 4;
  a.bs16 = reinterpret_cast<int16_t*>(a.dx + M * K / block);
  a.bs32 = reinterpret_cast<int16_t*>(reinterpret_cast<float*>(a.bs16) + (M * K / 16 * 2 + 3) / 4);
  return a;
}

Acts quantize(const at::Tensor& x2, int block, float* buf) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const Acts a = acts_at(buf, M, K, block);
  // each row on its own, a prompt's rows split between the threads (qd_rows_grain)
  at::parallel_for(0, M, qd_rows_grain(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (x2.scalar_type() == at::kBFloat16)
        quantize_row(static_cast<const u16*>(x2.data_ptr()) + m * K, K, block, a.xq + m * K,
                     a.dx + m * K / block, a.bs16 + m * K / 16);
      else
        quantize_row(x2.data_ptr<float>() + m * K, K, block, a.xq + m * K,
                     a.dx + m * K / block, a.bs16 + m * K / 16);
      for (int64_t i = m * K / 32; i < (m + 1) * K / 32; ++i)
        a.bs32[i] = static_cast<int16_t>(a.bs16[2 * i] + a.bs16[2 * i + 1]);
    }
  });
  return a;
}

// The prefetch distance of the formats of 32-value blocks (Q4_0 ... Q8_0, IQ4_NL, MXFP4) in a
// one-row pass (a decode step's GEMV, an expert's single row); more rows and the 256-value
// formats use qd_panel::prefetch_bytes. build.py sets both at load.
int64_t prefetch_bytes_32 = 4096;

void part_panels(const Acts& a, int64_t M, int64_t K, int f, const uint8_t* packed, int64_t n,
                 const qd_panel::Epilogue& e, int64_t p0, int64_t p1) {
  const int block = block_size(f);
  const int sub = sub_size(f);
  const int16_t* bs = sub == 16 ? a.bs16 : a.bs32;
  const int64_t ldb = K / sub;
  const int64_t subs = block / sub;
  const int64_t G = K / block;  // blocks per row
  const int64_t bytes = block_bytes(f);
  const int isa = isa_level();
  const bool wide = isa > 0;
  qd_panel::run_range(
      packed, M, n, G, bytes, e,
      [&](int T, const uint8_t* w, int64_t g0, int64_t glen, int64_t m0, float* acc, bool init,
          const char* pf) {
        const int8_t* xq = a.xq + m0 * K + g0 * block;
        const float* dx = a.dx + m0 * G + g0;
        const int16_t* bsm = bs + m0 * ldb + g0 * subs;
        if (isa == 2)
          tile_avx512vbmi(f, T, w, glen, xq, K, dx, G, bsm, ldb, acc, init, pf);
        else if (isa == 1)
          tile_avx512(f, T, w, glen, xq, K, dx, G, bsm, ldb, acc, init, pf);
        else
          tile_for(f, T)(w, glen, xq, K, dx, G, bsm, ldb, acc, init, pf);
      },
      p0, p1, std::max<int64_t>(1, 8192 / bytes), wide ? kTmaxAvx512 : qd_panel::kTmax,
      block == 32 && M == 1 ? prefetch_bytes_32 : qd_panel::prefetch_bytes);
}

}  // namespace qd_gguf

int64_t qd_gguf_isa(int64_t level) {
  TORCH_CHECK(level >= -1 && level <= 2,
              "quickdraft gguf_isa: -1 (best), 0 (AVX2), 1 (AVX-512), 2 (AVX-512 + VBMI)");
  TORCH_CHECK(level < 1 || cpu_has_avx512_vnni(),
              "quickdraft gguf_isa: this CPU lacks AVX512F/BW/VL + AVX512_VNNI");
  TORCH_CHECK(level != 2 || cpu_has_avx512_vbmi(), "quickdraft gguf_isa: this CPU lacks AVX512_VBMI");
  g_isa = static_cast<int>(level);
  return isa_level();
}

int64_t qd_set_prefetch_bytes(int64_t bytes, int64_t bytes_32) {
  if (bytes_32 == -1) bytes_32 = bytes;
  for (int64_t b : {bytes, bytes_32})
    TORCH_CHECK(b >= 0 && b <= (int64_t{1} << 16) && b % 64 == 0,
                "quickdraft set_prefetch_bytes: a multiple of 64 in [0, 65536], got ", b);
  qd_panel::prefetch_bytes = bytes;
  qd_gguf::prefetch_bytes_32 = bytes_32;
  return qd_panel::prefetch_bytes;
}

bool qd_linear_gguf_eligible(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                             const std::vector<int64_t>& fmts, const std::vector<int64_t>& ns,
                             const c10::optional<at::Tensor>& bias) {
  if (!x.defined() || !x.device().is_cpu() || x.dim() < 1) return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  if (packed.empty() || packed.size() != fmts.size() || packed.size() != ns.size()) return false;
  const int64_t K = x.size(-1);
  int64_t total = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    const at::Tensor& p = packed[i];
    if (fmts[i] < 0 || fmts[i] >= kNumFmt || ns[i] <= 0) return false;
    const int f = static_cast<int>(fmts[i]);
    if (!p.defined() || !p.device().is_cpu() || p.scalar_type() != at::kByte || p.dim() != 3 ||
        !p.is_contiguous() || p.size(2) != block_bytes(f))
      return false;
    if (p.size(0) != (ns[i] + kPanel - 1) / kPanel || p.size(1) * block_size(f) != K ||
        p.size(1) == 0)
      return false;
    total += ns[i];
  }
  if (bias.has_value() && bias->defined() &&
      (!bias->device().is_cpu() || !at::isFloatingType(bias->scalar_type()) || bias->dim() != 1 ||
       bias->size(0) != total || !bias->is_contiguous()))
    return false;
  return !(at::GradMode::is_enabled() && x.requires_grad());
}

at::Tensor qd_linear_gguf(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                          const std::vector<int64_t>& fmts, const std::vector<int64_t>& ns,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qd_linear_gguf_eligible(x, packed, fmts, ns, bias),
              "quickdraft linear_gguf: inputs not eligible");
  const int64_t K = x.size(-1);
  int64_t N = 0;
  for (int64_t n : ns) N += n;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  qd_count_kernel_call();
  if (M == 0) return y.view(out_shape);
  const at::Tensor b = qd_panel::bias_operand(bias);
  // per block size 32, 256: made on first use, in the per-thread scratch (a fresh allocation
  // per call would cost a prefill chunk an mmap and its page faults)
  const int64_t per = std::max(acts_floats(M, K, 32), acts_floats(M, K, 256));
  float* scratch = qd_simd::scratch(static_cast<size_t>(2 * per));
  Acts acts[2];
  bool made[2] = {false, false};
  // every part's panels in one parallel region: the parts (q/k/v, gate/up, a Gated DeltaNet's
  // four in-projections) are cut into one contiguous range of panels per thread by bytes, so
  // a fused operand costs one fork/join, not one per part (small parts had one each)
  std::vector<int64_t> first(packed.size() + 1, 0), col(packed.size(), 0);
  std::vector<double> bytes_before(packed.size() + 1, 0.0);
  for (size_t i = 0; i < packed.size(); ++i) {
    const int f = static_cast<int>(fmts[i]);
    const int block = block_size(f), which = block == 256;
    if (!made[which]) acts[which] = quantize(x2, block, scratch + which * per), made[which] = true;
    const int64_t P = (ns[i] + kPanel - 1) / kPanel;
    first[i + 1] = first[i] + P;
    bytes_before[i + 1] = bytes_before[i] + static_cast<double>(P * (K / block) * block_bytes(f));
    if (i + 1 < packed.size()) col[i + 1] = col[i] + ns[i];
  }
  const double total = bytes_before.back();
  // ~128 KiB of weights per thread at least: below that the fork/join costs more than it saves
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(total / (128 << 10))));
  const int64_t units = first.back();
  // the panel at which thread t starts: equal shares of the bytes
  auto cut = [&](int64_t t) -> int64_t {
    if (t >= threads) return units;
    const double target = total * static_cast<double>(t) / static_cast<double>(threads);
    size_t i = 0;
    while (i + 1 < packed.size() && bytes_before[i + 1] <= target) ++i;
    const double per_panel = (bytes_before[i + 1] - bytes_before[i]) /
                             static_cast<double>(first[i + 1] - first[i]);
    const int64_t p = static_cast<int64_t>((target - bytes_before[i]) / per_panel);
    return std::min(first[i] + p, first[i + 1]);
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t u0 = cut(t), u1 = cut(t + 1);
      for (size_t i = 0; i < packed.size(); ++i) {
        const int64_t p0 = std::max(u0, first[i]) - first[i];
        const int64_t p1 = std::min(u1, first[i + 1]) - first[i];
        if (p0 >= p1) continue;
        const int f = static_cast<int>(fmts[i]);
        qd_panel::Epilogue e = qd_panel::epilogue(nullptr, b, y);
        e.y = static_cast<char*>(e.y) + col[i] * y.element_size();
        if (e.bias) e.bias = static_cast<const char*>(e.bias) + col[i] * b.element_size();
        part_panels(acts[block_size(f) == 256], M, K, f,
                    static_cast<const uint8_t*>(packed[i].data_ptr()), ns[i], e, p0, p1);
      }
    }
  });
  return y.view(out_shape);
}
