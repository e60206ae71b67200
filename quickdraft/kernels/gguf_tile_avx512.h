// The body of the AVX-512 VNNI tile (linear_gguf_avx512.cpp's contract), included by
// linear_gguf_avx512.cpp and linear_gguf_avx512vbmi.cpp inside `namespace qd_gguf { namespace {`
// after each one's target pragma, so that each file builds its own copy for its own features.
// QD_GGUF_VBMI 1 (AVX512_VBMI): the table formats look their values up by vpermb, which reads an
// index's low six bits, so a nibble needs no mask (the table repeats every 16 bytes); the
// results are the same bits.
// No include guard and no includes: it is only ever included as above.

// Its own copy of linear_gguf.cpp's static_for: defined under the pragma, so that GCC inlines
// the AVX-512 lambdas into it (a function built for less may not inline them: each would
// become a call per quad and token). Always inlined: left to its heuristics, GCC kept the
// token loop out of line, its accumulators in memory, in a build without -fPIC (the Q4_K tile
// at 8 tokens read 55 G MACs a second that way, 165-171 inlined).
template <class Fn, int... I>
__attribute__((always_inline)) inline void static_for_impl(Fn&& fn,
                                                           std::integer_sequence<int, I...>) {
  (fn(std::integral_constant<int, I>{}), ...);
}
template <int N, class Fn>
__attribute__((always_inline)) inline void static_for(Fn&& fn) {
  static_for_impl(fn, std::make_integer_sequence<int, N>{});
}

inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 rows' sub-block scales (kShift 0) or mins (4) as int32: int8 each, or Q2_K's nibbles.
template <int F, int kShift>
inline __m512i scales16(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (Traits<F>::kPackedM)
    return _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(v), kShift), _mm512_set1_epi32(15));
  else
    return _mm512_cvtepi8_epi32(v);
}

inline __m512i halves(int lo, int hi) {  // 16-bit lanes: lo in the low 256 bits, hi above
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(lo)),
                            _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
}

// 16 rows' d (or dm) of a panel block as fp32 (fp16 in the panel).
inline __m512 load_d16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// MXFP4: 16 rows' E8M0 bytes e as the fp32 exponents e - 128 of d = 2^(e - 128), from which
// the tile makes d exactly by one vscalefps a block (2^-128 and 2^-127 are subnormal but exact).
inline __m512 e8_exponents16(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128)));
}

// Quad C of group g as 64 unsigned bytes: lane j (4 bytes) = row j's 4 values (the table
// formats: v(u) + 128).
template <int F, int C>
inline __m512i unpack_quad(const uint8_t* wb, int g, __m512i tbl) {
  using Tr = Traits<F>;
  if constexpr (Tr::kBits == 8) {  // signed q -> q + 128
    const __m512i v = _mm512_loadu_si512(wb + g * 512 + C * 64);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (Tr::kBits <= 3) {  // bits 2k, 2k + 1 of vector C / 2, k = 2 (C % 2) + h
    const __m512i lb = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 128 + (C / 2) * 32)));
    constexpr int k0 = 2 * (C % 2), k1 = k0 + 1;
    const __m512i lo = _mm512_srlv_epi16(lb, halves(2 * k0, 2 * k1));  // bits 0-1 wanted
    if constexpr (Tr::kBits == 3) {  // bit 2 (C % 4) + h of the 1-bit plane's vector C / 4
      const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wb + Tr::kLow + g * 64 + (C / 4) * 32)));
      // bit j of every byte straight to its bit 2 (one shift of the 16-bit lanes moves both
      // bytes' bit j alike), then (lo & 3) | (hi & 4) by one ternlog
      constexpr int j0 = 2 * (C % 4), j1 = j0 + 1;
      __m512i hi;
      if constexpr (j1 <= 2)
        hi = _mm512_sllv_epi16(hb, halves(2 - j0, 2 - j1));
      else
        hi = _mm512_srlv_epi16(hb, halves(j0 - 2, j1 - 2));
      hi = _mm512_and_si512(hi, _mm512_set1_epi8(4));
      return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(3), 0xEC);  // (a & c) | b
    }
    return _mm512_and_si512(lo, _mm512_set1_epi8(3));
  } else {
    const __m512i v = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 256 + C * 32)));
    // Q4_K: rows 8-15 as 16 u (their nibbles in place, one op instead of a shift and an and;
    // the tile takes the 16 off exactly, below)
    if constexpr (F == kQ4_K) return _mm512_and_si512(v, halves(0x0f0f, 0xf0f0));
#if QD_GGUF_VBMI
    if constexpr (Tr::kTable)  // bits 4-5 of an index pick a copy of the same 16 values
      return _mm512_permutexvar_epi8(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), tbl);
#endif
    __m512i u = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4),
                                 _mm512_set1_epi8(0x0f));
    if constexpr (Tr::kTable) return _mm512_shuffle_epi8(tbl, u);
    if constexpr (Tr::kBits == 5) {  // bit 2 (C % 4) + h of vector C / 4 -> bit 4, per half h
      const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wb + Tr::kLow + g * 64 + (C / 4) * 32)));
      constexpr int k0 = 2 * (C % 4), k1 = k0 + 1;
      __m512i t;
      if constexpr (k1 <= 4)
        t = _mm512_sllv_epi16(hb, halves(4 - k0, 4 - k1));
      else
        t = _mm512_srlv_epi16(hb, halves(k0 > 4 ? k0 - 4 : 0, k1 - 4));
      u = _mm512_or_si512(u, _mm512_and_si512(t, _mm512_set1_epi8(0x10)));
    } else if constexpr (Tr::kBits == 6) {  // bits 2k, 2k + 1 of vector C / 2 -> bits 4, 5
      const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wb + Tr::kLow + g * 128 + (C / 2) * 32)));
      constexpr int k0 = 2 * (C % 2), k1 = k0 + 1;
      __m512i t;
      if constexpr (k1 <= 2)
        t = _mm512_sllv_epi16(hb, halves(4 - 2 * k0, 4 - 2 * k1));
      else
        t = _mm512_srlv_epi16(hb, halves(0, 2));
      u = _mm512_or_si512(u, _mm512_and_si512(t, _mm512_set1_epi8(0x30)));
    }
    return u;
  }
}

template <int F, int T>
void tile(const uint8_t* w, int64_t nb, const int8_t* xq, int64_t ldx, const float* dx,
          int64_t ldd, const int16_t* bs, int64_t ldb, float* acc, bool init, const char* pf) {
  using Tr = Traits<F>;
  constexpr int kSubs = Tr::kBlock / Tr::kSub;
  constexpr int kRun = Tr::kSub / 4;  // quads per sub-block
  // the 32-value formats' offset per x: Q8_0's q + 128 (and the tables' v + 128) bring
  // 128 sum(x) to take off, Q4_0 / Q5_0 their 8 / 16, Q4_1 / Q5_1 (dm) 1
  constexpr int kOffset = F == kQ8_0 || Tr::kTable ? 128 : Tr::kMConst;
  __m512i tbl = _mm512_setzero_si512();
  if constexpr (Tr::kTable) {  // v(u) + 128 as bytes, in every 128-bit lane
    alignas(16) uint8_t lifted[16];
    for (int i = 0; i < 16; ++i) lifted[i] = static_cast<uint8_t>(table_values<F>()[i] + 128);
    tbl = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(lifted)));
  }
  // Q4_K's rows 8-15 (unpack_quad)
  const __m512 sixteenth = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(1.0f), _mm512_set1_ps(0.0625f));
  // the tokens' 16 row sums stay in registers across the blocks (stored once, at the end)
  __m512 accv[T];
  static_for<T>([&](auto t) {
    accv[t] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + t * kPanel);
  });
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * Tr::kBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(wb + Tr::kScOff);  // [subs][16]
    __m512i s[T], run[T];
    // Q4_K: the scaled runs summed in fp32, sub-blocks 0-3 in `half`, 4-7 in `part` (below)
    __m512 half[T], part[T];
    static_for<T>([&](auto t) {
      // the formats that subtract their offsets in integers (no dm) start each token's sum at
      // its minus: one op a token and block instead of a sub (the same exact int32 sum)
      if constexpr (!Tr::kK && !Tr::kHasDm)
        s[t] = _mm512_set1_epi32(-kOffset * static_cast<int32_t>(bs[t * ldb + b * kSubs]));
      else
        s[t] = _mm512_setzero_si512();
      half[t] = part[t] = _mm512_setzero_ps();
    });
    for (int g = 0; g < Tr::kGroups; ++g) {
      const int8_t* xg = xq + b * Tr::kBlock + g * 32;
      if (pf) prefetch_group<F>(pf + b * Tr::kBytes, g);
      __m512i scale[2];
      __m512 fscale = _mm512_setzero_ps();
      if constexpr (Tr::kK) {
        const int s0 = g * 32 / Tr::kSub, s1 = (g * 32 + 16) / Tr::kSub;
        scale[0] = scales16<F, 0>(sc + s0 * kPanel);
        scale[1] = scales16<F, 0>(sc + s1 * kPanel);
        if constexpr (F == kQ4_K) fscale = _mm512_cvtepi32_ps(scale[0]);
      }
      if constexpr (F == kQ4_K)
        if (g == Tr::kGroups / 2)
          static_for<T>([&](auto t) {
            half[t] = part[t];
            part[t] = _mm512_setzero_ps();
          });
      static_for<8>([&](auto c) {
        constexpr int C = decltype(c)::value;
        const __m512i u = unpack_quad<F, C>(wb, g, tbl);
        static_for<T>([&](auto t) {
          const __m512i xb = bcast32(xg + t * ldx + C * 4);
          if constexpr (F == kQ4_K) {
            // The AVX2 tile's int32 sum, exactly, with one p0 uop less per token and run
            // (vpmulld is two): |run| <= 32 * 15 * 128 and sc <= 63, so run * sc and any
            // sum of four such products are integers below 2^24, exact in fp32; rows 8-15
            // (16 u, unpack_quad) carry 16 times such integers, exact too.
            run[t] = _mm512_dpbusd_epi32(C == 0 ? _mm512_setzero_si512() : run[t], u, xb);
            if constexpr (C == 7) part[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(run[t]), fscale, part[t]);
          } else if constexpr (Tr::kK) {
            run[t] = _mm512_dpbusd_epi32(C % kRun == 0 ? _mm512_setzero_si512() : run[t], u, xb);
            if constexpr (C % kRun == kRun - 1)
              s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(run[t], scale[C / 4]));
          } else {
            s[t] = _mm512_dpbusd_epi32(s[t], u, xb);
          }
        });
      });
    }
    // d; MXFP4's 2^(e - 128) made exactly by one vscalefps a block, not one a token (it runs at
    // half vmulps's rate here, Zen 4), and d * dx rounds once, as scaling dx by 2^(e - 128) does
    const __m512 d = Tr::kE8 ? _mm512_scalef_ps(_mm512_set1_ps(1.0f), e8_exponents16(wb + Tr::kDOff))
                             : load_d16(wb + Tr::kDOff);
    const __m512 dm = Tr::kHasDm ? load_d16(wb + Tr::kDOff + Tr::kDBytes * kPanel) : d;
    // mins / offsets: sum_s m[s] bsum[t, s] per row, each pair of sub-blocks' m unpacked once
    // for all tokens (exact int32 sums: the order does not change the bits)
    __m512i msums[T];
    static_for<T>([&](auto t) { msums[t] = _mm512_setzero_si512(); });
    if constexpr (Tr::kK) {
      const int8_t* mm = Tr::kHasM ? reinterpret_cast<const int8_t*>(wb + Tr::kMOff) : sc;
      constexpr int kMShift = Tr::kPackedM ? 4 : 0;  // Q2_K: the min is the high nibble
      static_for<kSubs / 2>([&](auto i) {
        const __m512i lo = scales16<F, kMShift>(mm + 2 * i * kPanel);
        const __m512i hi = scales16<F, kMShift>(mm + (2 * i + 1) * kPanel);
        const __m512i mv = _mm512_mask_blend_epi16(0xAAAAAAAAu, lo, _mm512_slli_epi32(hi, 16));
        static_for<T>([&](auto t) {
          msums[t] = _mm512_dpwssd_epi32(msums[t], mv, bcast32(bs + t * ldb + b * kSubs + 2 * i));
        });
      });
    }
    static_for<T>([&](auto t) {
      const int16_t* bst = bs + t * ldb + b * kSubs;
      __m512i msum = msums[t];
      if constexpr (Tr::kK) {
        if constexpr (Tr::kMScShift > 0)  // m = 32 sc (Q6_K), 4 sc (Q3_K)
          msum = _mm512_slli_epi32(msum, Tr::kMScShift);
        if constexpr (Tr::kTable) msum = _mm512_slli_epi32(msum, 7);  // IQ4_XS: 128 sc
      } else if constexpr (Tr::kHasDm) {
        msum = _mm512_set1_epi32(kOffset * static_cast<int32_t>(bst[0]));
      }
      const __m512 dxv = _mm512_set1_ps(dx[t * ldd + b]);
      __m512& av = accv[t];
      if constexpr (Tr::kHasDm) {
        // Q4_K: the two exact halves' sum rounds once, as converting their int32 sum does;
        // rows 8-15 summed 16 u, so that sum is 16 times theirs, rounded the same, and
        // scaling it by 1/16 is exact
        const __m512 sum = F == kQ4_K ? _mm512_mul_ps(_mm512_add_ps(half[t], part[t]), sixteenth)
                                      : _mm512_cvtepi32_ps(s[t]);
        av = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, dxv), av);
        av = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dm, dxv), av);
      } else {
        // s - m sum(x), or for the formats that started s at -kOffset sum(x), s itself
        const __m512i tot = Tr::kK ? _mm512_sub_epi32(s[t], msum) : s[t];
        av = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(d, dxv), av);
      }
    });
  }
  static_for<T>([&](auto t) { _mm512_storeu_ps(acc + t * kPanel, accv[t]); });
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const float*, int64_t,
                        const int16_t*, int64_t, float*, bool, const char*);

template <int F>
TileFn pick(int T) {
  switch (T) {
    case 1: return &tile<F, 1>;
    case 2: return &tile<F, 2>;
    case 3: return &tile<F, 3>;
    case 4: return &tile<F, 4>;
    case 5: return &tile<F, 5>;
    case 6: return &tile<F, 6>;
    case 7: return &tile<F, 7>;
    default: return &tile<F, 8>;
  }
}

// The tile for format `fmt` and T tokens (tile_avx512's arguments).
inline void run_tile(int fmt, int T, const uint8_t* w, int64_t nb, const int8_t* xq, int64_t ldx,
                     const float* dx, int64_t ldd, const int16_t* bs, int64_t ldb, float* acc,
                     bool init, const char* pf) {
  TileFn fn = nullptr;
  switch (fmt) {
    case kQ4_0: fn = pick<kQ4_0>(T); break;
    case kQ4_1: fn = pick<kQ4_1>(T); break;
    case kQ5_0: fn = pick<kQ5_0>(T); break;
    case kQ5_1: fn = pick<kQ5_1>(T); break;
    case kQ8_0: fn = pick<kQ8_0>(T); break;
    case kQ4_K: fn = pick<kQ4_K>(T); break;
    case kQ5_K: fn = pick<kQ5_K>(T); break;
    case kQ6_K: fn = pick<kQ6_K>(T); break;
    case kQ2_K: fn = pick<kQ2_K>(T); break;
    case kQ3_K: fn = pick<kQ3_K>(T); break;
    case kIQ4_NL: fn = pick<kIQ4_NL>(T); break;
    case kIQ4_XS: fn = pick<kIQ4_XS>(T); break;
    case kMXFP4: fn = pick<kMXFP4>(T); break;
    default: return;
  }
  fn(w, nb, xq, ldx, dx, ldd, bs, ldb, acc, init, pf);
}
