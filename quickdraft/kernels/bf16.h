// bf16 <-> fp32 conversions shared by the CPU kernels (linear_bf16.cpp, norm_rope.cpp,
// gdn_ops.cpp). fp32 -> bf16 rounds exactly as c10::BFloat16: to nearest even, NaN -> 0x7fc0.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace qd_bf16 {

using u16 = uint16_t;

inline float bf16_to_f32(u16 h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline u16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<u16>(u >> 16);
}

// 16 bf16 loaded as 8 u32 lanes hold (w[2j] | w[2j+1] << 16) in lane j: `lane << 16` is
// fp32(w[2j]) and `lane & 0xffff0000` is fp32(w[2j+1]), one integer op per 8 values.
inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }

inline __m256 bf16_odd(__m256i v) {
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  return _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
}

// 8 bf16 in natural order -> 8 fp32.
inline __m256 bf16x8_to_f32(const u16* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

}  // namespace qd_bf16
