// Small-M linear over an int8 weight (one fp32 scale per row) with int8 activations, for AVX2
// CPUs (kernels/linear_int.py owns the contract and the reference).
//
// Contract: y[m, n] = scale[n] * sum_b dx[m, b] * sum_{k in block b} xq[m, k] * q[n, k]
//   (+ bias[n]), where per 32-value block b of token m x ~= dx * xq (quant.h: xq = round(x / dx)
//   in -127..127, dx = max|x| / 127; x is zero-padded to K32 = K rounded up to 32), and
//   packed  [P, K32 / 4, 64] int8, P = ceil(N / 16): packed[p, c, 4j + i] = q[16p + j, 4c + i]
//           (rows past N and columns past K are zero),
//   scale   [N] fp32;  x [..., K] bf16 or fp32;  bias [N] fp32/bf16 optional;  y [..., N] x's dtype.
// `Int8Weight.reference_linear` computes the same function in plain torch.
//
// Why: a draft model's step streams all its weights. Converting int8 weights to fp32 costs
// about 4 ops per 8 weights, which made both the nn.Linear-layout int8 kernel and an fp32
// panel version compute-bound at 20-25 GB/s here. With the activations in int8 too, the dot is
// integer: per 4 columns (c) of a 16-row panel, two 32-byte loads hold the weights, and per
// token one sign, one vpmaddubsw (|x| unsigned x sign-adjusted w, pairs summed in 16 bits: no
// overflow since 2 * 127 * 127 < 2^15) and one vpmaddwd give each row's 4-column dot in its own
// 32-bit lane (no lane sums). Per 32-value block the int32 sums are converted and scaled by dx
// into fp32 accumulators. As in linear_panel.cpp each thread reads one sequential stream of
// panels and up to kTmax tokens share each pass over it.
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

using qd_panel::kPanel;  // tokens per pass kTmax = 4: 2 * 4 int32 sums + 2 w + ones + x, |x|
constexpr int64_t kGroupBytes = kGroup * kPanel;  // one 32-column block of a panel: 512 bytes

inline __m256i broadcast4(const int8_t* p) {  // 4 bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// T tokens x 16 rows over blocks [0, nb) of one panel slice `w` (nb * 512 bytes): acc [T][16]
// fp32 (zeroed first when init) += dx[t][b] * (integer dot of block b). xq / ax: the tokens'
// int8 values and their absolute values, row stride ldx; dx row stride ldd. Prefetches the
// 8 lines of each block at `pf` + its offset (null: none).
template <int T>
inline void tile(const int8_t* w, int64_t nb, const int8_t* xq, const int8_t* ax, int64_t ldx,
                 const float* dx, int64_t ldd, float* acc, bool init, const char* pf) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (init) std::fill(acc, acc + T * kPanel, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = w + b * kGroupBytes;
    if (pf) {
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) _mm_prefetch(pf + b * kGroupBytes + l * 64, _MM_HINT_T0);
    }
    __m256i s[T][2];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) s[t][0] = s[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < kGroup / 4; ++c) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64 + 32));
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int64_t o = t * ldx + b * kGroup + c * 4;
        const __m256i xb = broadcast4(xq + o), ab = broadcast4(ax + o);
        // |x| * (w * sign(x)) = x * w; pairs summed to 16 bits, then the 4-column dot per row
        s[t][0] = _mm256_add_epi32(
            s[t][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(w0, xb)), ones));
        s[t][1] = _mm256_add_epi32(
            s[t][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(w1, xb)), ones));
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const __m256 d = _mm256_broadcast_ss(dx + t * ldd + b);
      float* a = acc + t * kPanel;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][0]), d, _mm256_loadu_ps(a)));
      _mm256_storeu_ps(a + 8,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][1]), d, _mm256_loadu_ps(a + 8)));
    }
  }
}

void tile_dispatch(int T, const int8_t* w, int64_t nb, const int8_t* xq, const int8_t* ax,
                   int64_t ldx, const float* dx, int64_t ldd, float* acc, bool init,
                   const char* pf) {
  switch (T) {
    case 1: return tile<1>(w, nb, xq, ax, ldx, dx, ldd, acc, init, pf);
    case 2: return tile<2>(w, nb, xq, ax, ldx, dx, ldd, acc, init, pf);
    case 3: return tile<3>(w, nb, xq, ax, ldx, dx, ldd, acc, init, pf);
    case 4: return tile<4>(w, nb, xq, ax, ldx, dx, ldd, acc, init, pf);
  }
  TORCH_CHECK(false, "quickdraft linear_i8: bad token chunk ", T);
}

}  // namespace

bool qd_linear_i8_eligible(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias) {
  if (!x.defined() || !packed.defined() || !scale.defined()) return false;
  if (!x.device().is_cpu() || !packed.device().is_cpu() || !scale.device().is_cpu()) return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  if (packed.scalar_type() != at::kChar || packed.dim() != 3 || !packed.is_contiguous() ||
      packed.size(2) != 4 * kPanel)
    return false;
  if (scale.scalar_type() != at::kFloat || scale.dim() != 1 || !scale.is_contiguous()) return false;
  const int64_t N = scale.size(0), K32 = packed.size(1) * 4;
  if (N == 0 || packed.size(0) != (N + kPanel - 1) / kPanel || K32 % kGroup != 0) return false;
  if (x.dim() < 1 || x.size(-1) == 0 || (x.size(-1) + kGroup - 1) / kGroup * kGroup != K32)
    return false;
  if (bias.has_value() && bias->defined() &&
      (!bias->device().is_cpu() || !at::isFloatingType(bias->scalar_type()) || bias->dim() != 1 ||
       bias->size(0) != N))
    return false;
  return !(at::GradMode::is_enabled() && x.requires_grad());
}

at::Tensor qd_linear_i8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qd_linear_i8_eligible(x, packed, scale, bias),
              "quickdraft linear_i8: inputs not eligible");
  const int64_t N = scale.size(0), K = x.size(-1), K32 = packed.size(1) * 4;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  qd_count_kernel_call();
  if (M == 0) return y.view(out_shape);
  if (K != K32) x2 = at::constant_pad_nd(x2, {0, K32 - K});  // zero columns, as the weights
  x2 = x2.contiguous();
  const at::Tensor b = qd_panel::bias_operand(bias);
  // xq, ax [M, K32] int8 then dx [M, nb] fp32, in one per-thread scratch (floats)
  const int64_t nb = K32 / kGroup, x_floats = (M * K32 + 3) / 4;
  float* buf = qd_simd::scratch(static_cast<size_t>(2 * x_floats + M * nb));
  int8_t* xq = reinterpret_cast<int8_t*>(buf);
  int8_t* ax = reinterpret_cast<int8_t*>(buf + x_floats);
  float* dx = buf + 2 * x_floats;
  for (int64_t m = 0; m < M; ++m) {
    if (x2.scalar_type() == at::kBFloat16)
      qd_quant::quantize_row(static_cast<const u16*>(x2.data_ptr()) + m * K32, K32, xq + m * K32,
                             dx + m * nb, nullptr);
    else
      qd_quant::quantize_row(x2.data_ptr<float>() + m * K32, K32, xq + m * K32, dx + m * nb,
                             nullptr);
  }
  for (int64_t i = 0; i < M * K32; i += 32) {  // K32 % 32 == 0
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ax + i), _mm256_abs_epi8(v));
  }
  const qd_panel::Epilogue e = qd_panel::epilogue(scale.data_ptr<float>(), b, y);
  qd_panel::run(reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()), M, N, nb,
                kGroupBytes, e,
                [&](int T, const uint8_t* w, int64_t g0, int64_t glen, int64_t m0, float* acc,
                    bool init, const char* pf) {
                  const int64_t k0 = g0 * kGroup;
                  tile_dispatch(T, reinterpret_cast<const int8_t*>(w), glen, xq + m0 * K32 + k0,
                                ax + m0 * K32 + k0, K32, dx + m0 * nb + g0, nb, acc, init, pf);
                });
  return y.view(out_shape);
}
