// The packed layout of GGUF block formats shared by the kernels (linear_gguf.cpp for AVX2,
// linear_gguf_avx512.cpp for AVX-512 VNNI): format ids, and per format the block geometry and
// the byte offsets within one 16-row panel block (kernels/linear_gguf.py documents the layout).
// Constants only: the AVX-512 source includes this under its own target options.
#pragma once

#include <cstdint>

namespace qd_gguf {

constexpr int kPanel = 16;  // weight rows per panel

// Formats by the id linear_gguf.py's FORMATS gives them.
enum Fmt {
  kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kQ2_K, kQ3_K, kIQ4_NL, kIQ4_XS, kMXFP4,
  kNumFmt
};

template <int F>
struct Traits {
  // super-blocks of 256 with sub-block scales
  static constexpr bool kK = F == kQ4_K || F == kQ5_K || F == kQ6_K || F == kQ2_K || F == kQ3_K ||
                             F == kIQ4_XS;
  static constexpr int kBlock = kK ? 256 : 32;
  static constexpr int kGroups = kBlock / 32;
  static constexpr int kBits = F == kQ2_K                                               ? 2
                               : F == kQ3_K                                             ? 3
                               : F == kQ5_0 || F == kQ5_1 || F == kQ5_K                 ? 5
                               : F == kQ6_K                                             ? 6
                               : F == kQ8_0                                             ? 8
                                                                                        : 4;
  static constexpr int kSub = F == kQ6_K || F == kQ2_K || F == kQ3_K ? 16 : 32;
  static constexpr bool kHasM = F == kQ4_K || F == kQ5_K || F == kQ2_K;
  // Q2_K: each sub-block's 4-bit scale and min share a byte (scale low, min high), as in the file
  static constexpr bool kPackedM = F == kQ2_K;
  static constexpr bool kHasDm = F == kQ4_1 || F == kQ5_1 || F == kQ4_K || F == kQ5_K || F == kQ2_K;
  static constexpr int kMConst = F == kQ4_0 ? 8 : F == kQ5_0 ? 16 : F == kQ4_1 || F == kQ5_1 ? 1 : 0;
  static constexpr int kMScShift = F == kQ6_K ? 5 : F == kQ3_K ? 2 : -1;  // m = sc << shift
  static constexpr bool kTable = F == kIQ4_NL || F == kIQ4_XS || F == kMXFP4;  // u indexes v
  static constexpr bool kE8 = F == kMXFP4;  // d is an E8M0 byte
  // byte offsets within one panel block: the low parts (nibbles, a 2-bit plane or bytes), the
  // high plane at kLow, then scales, mins, d, dm
  static constexpr int64_t kLow = kBits == 8 ? kPanel * kBlock : kBits >= 4 ? kPanel * kBlock / 2
                                                                             : kPanel * kBlock / 4;
  static constexpr int64_t kQuant = kPanel * kBlock * kBits / 8;
  static constexpr int64_t kScOff = kQuant;
  static constexpr int64_t kMOff = kPackedM ? kScOff : kScOff + (kK ? kPanel * kBlock / kSub : 0);
  static constexpr int64_t kDOff = kMOff + (kHasM ? kPanel * kBlock / kSub : 0);
  static constexpr int kDBytes = kE8 ? 1 : 2;
  static constexpr int64_t kBytes = kDOff + kDBytes * kPanel * (kHasDm ? 2 : 1);
};

// The non-linear formats' values v(u) (IQ4_NL / IQ4_XS; MXFP4: e2m1 doubled).
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <int F>
static constexpr const int8_t* table_values() {  // static: no ODR sharing
  return F == kMXFP4 ? kMXFP4Values : kIQ4Values;
}

constexpr int64_t block_bytes(int f) {
  switch (f) {
    case kQ4_0: return Traits<kQ4_0>::kBytes;
    case kQ4_1: return Traits<kQ4_1>::kBytes;
    case kQ5_0: return Traits<kQ5_0>::kBytes;
    case kQ5_1: return Traits<kQ5_1>::kBytes;
    case kQ8_0: return Traits<kQ8_0>::kBytes;
    case kQ4_K: return Traits<kQ4_K>::kBytes;
    case kQ5_K: return Traits<kQ5_K>::kBytes;
    case kQ6_K: return Traits<kQ6_K>::kBytes;
    case kQ2_K: return Traits<kQ2_K>::kBytes;
    case kQ3_K: return Traits<kQ3_K>::kBytes;
    case kIQ4_NL: return Traits<kIQ4_NL>::kBytes;
    case kIQ4_XS: return Traits<kIQ4_XS>::kBytes;
    case kMXFP4: return Traits<kMXFP4>::kBytes;
  }
  return 0;
}

constexpr int block_size(int f) {
  return f == kQ4_K || f == kQ5_K || f == kQ6_K || f == kQ2_K || f == kQ3_K || f == kIQ4_XS ? 256
                                                                                              : 32;
}

constexpr int sub_size(int f) { return f == kQ6_K || f == kQ2_K || f == kQ3_K ? 16 : 32; }

// The share of a panel block's cache lines that group g prefetches (at `pf`, the block's
// address panel_driver.h's prefetch_bytes ahead on the stream): spread over the groups, a
// block's lines go out a few at a time. Issued all at once per block they were slower:
// Qwen2.5-Coder-1.5B's Q6_K lm_head streamed at 18 GB/s that way and at 35 GB/s spread (this
// AVX-512 EPYC, 2 threads).
template <int F>
static inline void prefetch_group(const char* pf, int g) {  // static: no ODR sharing
  constexpr int64_t lines = (Traits<F>::kBytes + 63) / 64;
  for (int64_t l = g * lines / Traits<F>::kGroups; l < (g + 1) * lines / Traits<F>::kGroups; ++l)
    __builtin_prefetch(pf + l * 64, 0, 3);
}

constexpr int kTmaxAvx512 = 8;  // tokens per pass on AVX-512: 2 x 8 accumulators of 32 zmm

// One panel block of T <= kTmaxAvx512 tokens for format `fmt` on AVX-512 (linear_gguf_avx512.cpp): the same
// contract and the same results, bit for bit, as the AVX2 tile in linear_gguf.cpp.
void tile_avx512(int fmt, int T, const uint8_t* w, int64_t nb, const int8_t* xq, int64_t ldx,
                 const float* dx, int64_t ldd, const int16_t* bs, int64_t ldb, float* acc,
                 bool init, const char* pf);
// The same tile built with AVX512_VBMI too (linear_gguf_avx512vbmi.cpp): the same bits.
void tile_avx512vbmi(int fmt, int T, const uint8_t* w, int64_t nb, const int8_t* xq,
                     int64_t ldx, const float* dx, int64_t ldd, const int16_t* bs, int64_t ldb,
                     float* acc, bool init, const char* pf);

}  // namespace qd_gguf
