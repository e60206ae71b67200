// Small-M linear over a 4-bit weight (groups of 32, fp16 scale + min) in 16-row panels, with
// int8 activations, for AVX2 CPUs (kernels/linear_int.py owns the contract and the reference).
//
// Contract: y[m, n] = sum_b (d[n,b] * dx[m,b] * sum_j q[n,b,j] * xq[m,b,j] + mn[n,b] * sx[m,b])
//   (+ bias[n]) where, per 32-weight group b of row n, w = d * q + mn with q in 0..15 (d and mn
//   fp16), and per 32-value block b of token m, x ~= dx * xq (quant.h: xq = round(x / dx) in
//   -127..127, dx = max|x| / 127, sx = dx * sum_j xq), and
//   packed [P, G, 320] uint8, P = ceil(N / 16), G = K / 32: per panel p and group g, 8 quads of
//          32 bytes (quad c, byte 4j + i = q[16p + j][32g + 4c + i] | q[16p + 8 + j][...] << 4,
//          j < 8, i < 4), then the 16 rows' fp16 d, then their fp16 mn (rows past N: all 0),
//   x [..., K] bf16 or fp32;  bias [N] fp32/bf16 optional;  y [..., N] x's dtype.
// `Int4Weight.reference_linear` computes the same function in plain torch.
//
// Why: a draft model's step streams all its weights; at 0.625 bytes per weight (int8 + row
// scale: 1.0, bf16: 2.0) it reads 1.6x less than int8. The layout is linear_i8.cpp's (one
// sequential stream per thread, each row's 4-column dot in its own 32-bit lane, so no lane
// sums), with the weights unsigned: per quad one load and 3 ops unpack rows 0-7 and 8-15, and
// per token one vpmaddubsw (unsigned q x signed xq, pairs in 16 bits: 2 * 15 * 127 < 2^15) and
// one vpmaddwd per 8 rows. The row-major layout this replaces needed an fp32 convert and FMA
// per group, row and token plus a lane sum per row, and was compute-bound at ~18 GB/s.
// Precision only moves a draft's acceptance rate: the target verifies every token.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16.h"
#include "ops.h"
#include "panel_driver.h"
#include "quant.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>


namespace {

using u16 = uint16_t;
using qd_quant::kGroup;

using qd_panel::kPanel;  // tokens per pass kTmax = 4: 2 * 4 int32 sums + lo, hi, x, masks
constexpr int64_t kGroupBytes = kGroup * kPanel / 2 + 4 * kPanel;  // nibbles, d, mn: 320

inline __m256i broadcast4(const int8_t* p) {  // 4 bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// T tokens x 16 rows over groups [0, nb) of one panel slice `w` (nb * 320 bytes): acc [T][16]
// fp32 (zeroed first when init) += d * dx[t][b] * (integer dot of group b) + mn * sx[t][b].
// xq row stride ldx; dx, sx row stride ldd. Prefetches each group's 5 lines at `pf` + its
// offset (null: none).
template <int T>
inline void tile(const uint8_t* w, int64_t nb, const int8_t* xq, int64_t ldx, const float* dx,
                 const float* sx, int64_t ldd, float* acc, bool init, const char* pf) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
  if (init) std::fill(acc, acc + T * kPanel, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kGroupBytes;
    if (pf) {
#pragma GCC unroll 5
      for (int l = 0; l < 5; ++l) _mm_prefetch(pf + b * kGroupBytes + l * 64, _MM_HINT_T0);
    }
    __m256i s[T][2];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) s[t][0] = s[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < kGroup / 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 32));
      const __m256i lo = _mm256_and_si256(v, low4);                        // rows 0-7
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  // rows 8-15
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const __m256i xb = broadcast4(xq + t * ldx + b * kGroup + c * 4);
        s[t][0] = _mm256_add_epi32(s[t][0], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones));
        s[t][1] = _mm256_add_epi32(s[t][1], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), ones));
      }
    }
    const u16* sc = reinterpret_cast<const u16*>(wb + kGroup * kPanel / 2);
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 24)));
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const __m256 dxt = _mm256_broadcast_ss(dx + t * ldd + b);
      const __m256 sxt = _mm256_broadcast_ss(sx + t * ldd + b);
      float* a = acc + t * kPanel;
      __m256 a0 = _mm256_fmadd_ps(m0, sxt, _mm256_loadu_ps(a));
      __m256 a1 = _mm256_fmadd_ps(m1, sxt, _mm256_loadu_ps(a + 8));
      a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][0]), _mm256_mul_ps(d0, dxt), a0);
      a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][1]), _mm256_mul_ps(d1, dxt), a1);
      _mm256_storeu_ps(a, a0);
      _mm256_storeu_ps(a + 8, a1);
    }
  }
}

void tile_dispatch(int T, const uint8_t* w, int64_t nb, const int8_t* xq, int64_t ldx,
                   const float* dx, const float* sx, int64_t ldd, float* acc, bool init,
                   const char* pf) {
  switch (T) {
    case 1: return tile<1>(w, nb, xq, ldx, dx, sx, ldd, acc, init, pf);
    case 2: return tile<2>(w, nb, xq, ldx, dx, sx, ldd, acc, init, pf);
    case 3: return tile<3>(w, nb, xq, ldx, dx, sx, ldd, acc, init, pf);
    case 4: return tile<4>(w, nb, xq, ldx, dx, sx, ldd, acc, init, pf);
  }
  TORCH_CHECK(false, "quickdraft linear_q4: bad token chunk ", T);
}

}  // namespace

bool qd_linear_q4_eligible(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const c10::optional<at::Tensor>& bias) {
  if (!x.defined() || !packed.defined() || !x.device().is_cpu() || !packed.device().is_cpu())
    return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  if (packed.scalar_type() != at::kByte || packed.dim() != 3 || !packed.is_contiguous() ||
      packed.size(2) != kGroupBytes)
    return false;
  if (N <= 0 || packed.size(0) != (N + kPanel - 1) / kPanel || packed.size(1) == 0) return false;
  if (x.dim() < 1 || x.size(-1) != packed.size(1) * kGroup) return false;
  if (bias.has_value() && bias->defined() &&
      (!bias->device().is_cpu() || !at::isFloatingType(bias->scalar_type()) || bias->dim() != 1 ||
       bias->size(0) != N))
    return false;
  return !(at::GradMode::is_enabled() && x.requires_grad());
}

at::Tensor qd_linear_q4(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qd_linear_q4_eligible(x, packed, N, bias),
              "quickdraft linear_q4: inputs not eligible");
  const int64_t G = packed.size(1), K = G * kGroup;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  qd_count_kernel_call();
  if (M == 0) return y.view(out_shape);
  const at::Tensor b = qd_panel::bias_operand(bias);
  // xq [M, K] int8 then dx, sx [M, G] fp32, in one per-thread scratch (floats)
  const int64_t xq_floats = (M * K + 3) / 4;
  float* buf = qd_simd::scratch(static_cast<size_t>(xq_floats + 2 * M * G));
  int8_t* xq = reinterpret_cast<int8_t*>(buf);
  float* dx = buf + xq_floats;
  float* sx = dx + M * G;
  for (int64_t m = 0; m < M; ++m) {
    if (x2.scalar_type() == at::kBFloat16)
      qd_quant::quantize_row(static_cast<const u16*>(x2.data_ptr()) + m * K, K, xq + m * K,
                             dx + m * G, sx + m * G);
    else
      qd_quant::quantize_row(x2.data_ptr<float>() + m * K, K, xq + m * K, dx + m * G, sx + m * G);
  }
  const qd_panel::Epilogue e = qd_panel::epilogue(nullptr, b, y);
  qd_panel::run(packed.data_ptr<uint8_t>(), M, N, G, kGroupBytes, e,
                [&](int T, const uint8_t* w, int64_t g0, int64_t glen, int64_t m0, float* acc,
                    bool init, const char* pf) {
                  tile_dispatch(T, w, glen, xq + m0 * K + g0 * kGroup, K, dx + m0 * G + g0,
                                sx + m0 * G + g0, G, acc, init, pf);
                });
  return y.view(out_shape);
}
