// Activation quantization shared by the integer-dot kernels (linear_q4.cpp, linear_i8.cpp):
// per block of 32 values, int8 with one fp32 scale.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd.h"

namespace qd_quant {

constexpr int64_t kGroup = 32;  // activation values per quantization block

// One token's K values (K % 32 == 0) -> xq (int8, natural order), dx and, unless sx is null,
// sx = dx * sum(xq) per 32-block: dx = max|x| / 127, xq = round(x / dx), as the Python
// references (Int4Weight / Int8Weight.reference_linear) compute it.
template <class T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* dx, float* sx) {
  for (int64_t b = 0; b < K / kGroup; ++b) {
    const T* p = x + b * kGroup;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      v[i] = qd_simd::load8(p + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float d = qd_simd::hmax(amax) / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)  // round to nearest even (MXCSR default), as torch.round
      qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    // 4 x 8 int32 -> 32 int8: the packs interleave 128-bit lanes, the permute restores order
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
    const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kGroup), p8);
    dx[b] = d;
    if (sx) sx[b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

}  // namespace qd_quant
