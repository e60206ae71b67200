// Linear over a 4-bit weight (groups of 32, fp16 scale + min) with int8 activations, for AVX2
// CPUs; JIT-built with linear_bf16.cpp into one extension (cpu_linear.py owns the contract).
//
// Contract: y[m, n] = sum_b (d[n,b] * dx[m,b] * sum_j q[n,b,j] * xq[m,b,j] + mn[n,b] * sx[m,b])
//   (+ bias[n]) where, per 32-weight group b of row n, w = d * q + mn with q in 0..15 (d and mn
//   fp16), and per 32-value block b of token m, x ~= dx * xq with xq = round(x / dx) in
//   -127..127, dx = max|x| / 127, sx = dx * sum_j xq (the activation quantization is done here,
//   in fp32, exactly as `Int4Weight.reference_linear` in cpu_linear.py does it).
//   w    [N, P * 32 + G8 * 4] uint8 with G = K/32 groups, P = ceil(G/2) pairs, G8 = G rounded
//        up to 8: per row, P pairs of groups in 32 bytes (byte j = q[2p][j] | q[2p + 1][j] << 4;
//        a missing odd last group is 0), then G8 fp16 d, then G8 fp16 mn (zero-padded),
//   x    [..., K] bf16 or fp32, K % 32 == 0;  bias [N] fp32/bf16 optional;  y [..., N] x's dtype.
//
// Why: a draft model's step streams all its weights; at 0.625 bytes per weight (vs 1.0 for
// int8 + row scale, 2.0 for bf16) a memory-bound step reads 1.6x less than int8. The dot is
// integer (vpmaddubsw: unsigned q x signed xq, pairs summed in 16 bits; no overflow since
// 2 * 15 * 127 < 2^15), so decoding a group costs ~3 ops for 32 weights instead of ~4 per 8.
// Precision only moves the draft's acceptance rate: the target verifies every token.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "quant.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using u16 = uint16_t;
constexpr int64_t kGroup = 32;      // weights per group
// bytes per row of nb groups: the nibbles in pairs of groups (32 bytes), then the fp16 d and mn
constexpr int64_t row_bytes_of(int64_t nb) { return (nb + 1) / 2 * 32 + (nb + 7) / 8 * 8 * 4; }

// Per-thread buffer for a tile's per-group scales (grows only). Not qd_simd::scratch: the
// calling thread's scratch holds the quantized activations while it runs tiles too.
inline float* tile_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// R rows x T tokens over all nb groups; out[r * T + t] = the finished dot product (no bias).
// Row layout (see the top): pairs of groups, then nb8 fp16 d, then nb8 fp16 mn. The combined
// scales d * dx are computed first (8 groups per instruction), so the group loop is all vector
// work: one load and 3 ops unpack two groups, then per group and token an integer
// multiply-add, a convert and one FMA (measured ~35 % faster than 16-byte groups, which need
// a lane insert per group).
template <int R, int T>
inline void tile(const uint8_t* const* w, int64_t nb, const int8_t* xq, int64_t K,
                 const float* dx, const float* sx, float* out, const char* pf,
                 const char* pf_end) {
  // [r][t][g], each (r, t) row padded to a multiple of 8 groups (the scale loop stores 8 at once)
  const int64_t nb8 = (nb + 7) / 8 * 8;
  float* sc = tile_scratch(static_cast<size_t>(R * T * nb8));
  float accm[R][T];
  for (int r = 0; r < R; ++r) {
    const u16* d = reinterpret_cast<const u16*>(w[r] + (nb + 1) / 2 * 32);
    const u16* mn = d + nb8;
    for (int t = 0; t < T; ++t) {
      float* s = sc + (r * T + t) * nb8;
      const float* dxt = dx + t * nb8;
      const float* sxt = sx + t * nb8;
      __m256 m8 = _mm256_setzero_ps();
      for (int64_t g = 0; g < nb; g += 8) {  // d, mn, dx, sx are zero-padded to nb8
        const __m128i dh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g));
        const __m128i mh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g));
        _mm256_storeu_ps(s + g, _mm256_mul_ps(_mm256_cvtph_ps(dh), _mm256_loadu_ps(dxt + g)));
        m8 = _mm256_fmadd_ps(_mm256_cvtph_ps(mh), _mm256_loadu_ps(sxt + g), m8);
      }
      accm[r][t] = qd_simd::hsum(m8);
    }
  }
  __m256 acc[R][T];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
  for (int64_t g = 0; g < nb; g += 2) {
    // Software prefetch of the weights kPrefetchAhead bytes on: a step of two groups consumes
    // R * 40 bytes, two lines per step keep ahead of that.
    if (pf < pf_end) {
      _mm_prefetch(pf, _MM_HINT_T0);
      _mm_prefetch(pf + 64, _MM_HINT_T0);
      pf += 128;
    }
    const bool two = g + 1 < nb;  // false only for an odd last group
    __m256i x0[T], x1[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const int8_t* xt = xq + t * K + g * kGroup;
      x0[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt));
      x1[t] = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + kGroup))
                  : _mm256_setzero_si256();
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + g * 16));
      const __m256i q0 = _mm256_and_si256(v, low4);
      const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const float* s = sc + r * T * nb8 + g;
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        // the odd last group's partner has q = 0, x = 0 and scale 0 (padded): adds 0
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, x0[t]), ones);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, x1[t]), ones);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(s + t * nb8),
                                    acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(s + t * nb8 + 1),
                                    acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r * T + t] = qd_simd::hsum(acc[r][t]) + accm[r][t];
}

constexpr int kR = 4;  // rows per tile
constexpr int kT = 2;  // tokens per tile (2 x 4 accumulators + 2 x + q + ones: 12 ymm)
// How far ahead of the tile being computed the weights are prefetched: a few tiles, ~2-3x
// DRAM latency at the kernel's pace (measured without it: ~8 GB/s instead of ~20).
constexpr int64_t kPrefetchAhead = 16 << 10;

struct Problem {
  const uint8_t* w;
  const char* w_end;
  const int8_t* xq;
  const float *dx, *sx;
  const void* bias;
  bool bias_bf16;
  void* y;
  bool y_bf16;
  int64_t M, N, K;
};

template <int T>
void rows_tile(const Problem& p, int64_t n0, int64_t m0) {
  const int64_t nb = p.K / kGroup, row_bytes = row_bytes_of(nb);
  const uint8_t* w[kR];
  for (int r = 0; r < kR; ++r)  // rows past N alias the last row: computed, never stored
    w[r] = p.w + std::min(n0 + r, p.N - 1) * row_bytes;
  float out[kR * T];
  // Only the first token chunk of a tile streams the rows from DRAM; it prefetches the
  // bytes kPrefetchAhead past this tile's start, as many as the tile holds.
  const char* pf = reinterpret_cast<const char*>(p.w) + n0 * row_bytes + kPrefetchAhead;
  const char* pf_end = m0 == 0 ? std::min(pf + kR * row_bytes, p.w_end) : pf;
  const int64_t nb8 = (nb + 7) / 8 * 8;
  tile<kR, T>(w, nb, p.xq + m0 * p.K, p.K, p.dx + m0 * nb8, p.sx + m0 * nb8, out, pf, pf_end);
  for (int r = 0; r < kR && n0 + r < p.N; ++r) {
    const int64_t n = n0 + r;
    const float b = !p.bias       ? 0.0f
                    : p.bias_bf16 ? qd_simd::load1(static_cast<const u16*>(p.bias) + n)
                                  : qd_simd::load1(static_cast<const float*>(p.bias) + n);
    for (int t = 0; t < T; ++t) {
      const int64_t i = (m0 + t) * p.N + n;
      if (p.y_bf16)
        qd_simd::store1(static_cast<u16*>(p.y) + i, out[r * T + t] + b);
      else
        qd_simd::store1(static_cast<float*>(p.y) + i, out[r * T + t] + b);
    }
  }
}

void run(const Problem& p) {
  const int64_t tiles = (p.N + kR - 1) / kR;
  const int64_t row_bytes = row_bytes_of(p.K / kGroup);
  // ~64 KiB of weights per task at least: below that fork/join costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{64} << 10) / (kR * row_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      int64_t m0 = 0;
      for (; m0 + kT <= p.M; m0 += kT) rows_tile<kT>(p, i * kR, m0);
      if (m0 < p.M) rows_tile<1>(p, i * kR, m0);
    }
  });
}

}  // namespace

void qd_count_kernel_call();  // linear_bf16.cpp

bool qd_linear_q4_eligible(const at::Tensor& x, const at::Tensor& w, int64_t K,
                           const c10::optional<at::Tensor>& bias) {
  if (!x.defined() || !w.defined() || !x.device().is_cpu() || !w.device().is_cpu()) return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  if (w.scalar_type() != at::kByte || w.dim() != 2 || !w.is_contiguous()) return false;
  if (K <= 0 || K % kGroup != 0 || w.size(1) != row_bytes_of(K / kGroup)) return false;
  if (x.dim() < 1 || x.size(-1) != K) return false;
  if (bias.has_value() && bias->defined() &&
      (!bias->device().is_cpu() || !at::isFloatingType(bias->scalar_type()) || bias->dim() != 1 ||
       bias->size(0) != w.size(0)))
    return false;
  return !(at::GradMode::is_enabled() && x.requires_grad());
}

at::Tensor qd_linear_q4(const at::Tensor& x, const at::Tensor& w, int64_t K,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qd_linear_q4_eligible(x, w, K, bias), "quickdraft linear_q4: inputs not eligible");
  const int64_t N = w.size(0), nb = K / kGroup;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  qd_count_kernel_call();
  if (M == 0 || N == 0) return y.view(out_shape);
  at::Tensor b;
  if (bias.has_value() && bias->defined())
    b = bias->scalar_type() == at::kBFloat16 ? bias->contiguous()
                                             : bias->to(at::kFloat).contiguous();
  // xq [M, K] int8 then dx, sx [M, nb] fp32, in one per-thread scratch (floats).
  const int64_t xq_floats = (M * K + 3) / 4;
  // dx, sx [M, nb8]: zero-padded to whole 8-group chunks, as the weights' d and mn
  const int64_t nb8 = (nb + 7) / 8 * 8;
  float* buf = qd_simd::scratch(static_cast<size_t>(xq_floats + 2 * M * nb8));
  int8_t* xq = reinterpret_cast<int8_t*>(buf);
  float* dx = buf + xq_floats;
  float* sx = dx + M * nb8;
  std::fill(dx, dx + 2 * M * nb8, 0.0f);
  const bool x_bf16 = x2.scalar_type() == at::kBFloat16;
  for (int64_t m = 0; m < M; ++m) {
    if (x_bf16)
      qd_quant::quantize_row(static_cast<const u16*>(x2.data_ptr()) + m * K, K, xq + m * K, dx + m * nb8,
                   sx + m * nb8);
    else
      qd_quant::quantize_row(x2.data_ptr<float>() + m * K, K, xq + m * K, dx + m * nb8, sx + m * nb8);
  }
  Problem p{w.data_ptr<uint8_t>(),
            reinterpret_cast<const char*>(w.data_ptr<uint8_t>() + w.numel()),
            xq,
            dx,
            sx,
            b.defined() ? b.data_ptr() : nullptr,
            b.defined() && b.scalar_type() == at::kBFloat16,
            y.data_ptr(),
            y.scalar_type() == at::kBFloat16,
            M,
            N,
            K};
  run(p);
  return y.view(out_shape);
}
