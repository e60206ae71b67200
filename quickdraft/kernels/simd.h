// 8-lane fp32 helpers shared by the CPU kernels (linear_bf16.cpp, gdn_ops.cpp, attention.cpp):
// loads and stores of either element type (fp32, or bf16 held as uint16_t, rounded as
// c10::BFloat16), a vectorised exp, lane sum and max, and a per-thread scratch buffer.
#pragma once

#include <immintrin.h>

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "bf16.h"

namespace qd_simd {

using u16 = uint16_t;

// 8 values of either dtype -> fp32, and back.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const u16* p) { return qd_bf16::bf16x8_to_f32(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(u16* p, __m256 v) {  // f32_to_bf16 on 8 lanes
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // 8 x u32 (< 2^16) -> 8 x u16: pack within 128-bit lanes, then gather the two halves
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline float load1(const float* p) { return *p; }
inline float load1(const u16* p) { return qd_bf16::bf16_to_f32(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(u16* p, float v) { *p = qd_bf16::f32_to_bf16(v); }

// exp for 8 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 Taylor/minimax
// polynomial (relative error ~1e-7, as Cephes expf); inputs clamped to the fp32 range, so
// large negative x gives ~0 (silu(-inf) = -0 * 0... handled by the caller's x * sigmoid form).
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2 in two steps (Cody-Waite) for accuracy
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Per-thread, 64-byte aligned fp32 scratch that only grows: a fresh large malloc per call would
// be an mmap plus page faults on every forward. One buffer per thread and slot for all kernels,
// so a caller must be done with a slot before it calls another kernel that uses it: slot 0 for
// a kernel's inputs (activations, attention rows), slot 1 for the GEMM drivers' accumulators,
// which run while their caller's slot 0 holds the activations.
template <int Slot = 0>
inline float* scratch(size_t floats) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buf;
  thread_local size_t cap = 0;
  if (floats > cap) {
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    buf.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buf, "quickdraft kernels: out of memory for scratch");
    cap = bytes / sizeof(float);
  }
  return buf.get();
}

}  // namespace qd_simd
