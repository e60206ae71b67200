// Small-M linear over a bf16 weight repacked into 16-row panels, for AVX2 + FMA CPUs
// (kernels/linear_bf16.py owns the Python-facing contract).
//
// Contract: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for
//   x       [..., K] bf16 or fp32 (flattened to M = numel / K rows),
//   packed  [P, K, 16] bf16, P = ceil(N / 16): packed[p, k, 2j] = w[16p + j, k] and
//           packed[p, k, 2j + 1] = w[16p + 8 + j, k] (rows past N are zero),
//   bias    [N] fp32 or bf16, optional;   y [..., N] in x's dtype.
// fp32 accumulation, one round-to-nearest-even at the end (as linear_bf16.cpp).
//
// Why: linear_bf16.cpp reads an nn.Linear-layout weight as R interleaved row streams and takes
// dot products along k, which costs lane sums and, at M = 4..6 tokens, re-reads and re-converts
// every weight once per token chunk; measured, its verify-sized calls (M = 5) cost 1.3-1.7x a
// decode step (M = 1). Here each thread reads ONE sequential stream (its panels, back to back)
// and takes outer products: per k, one 32-byte load holds 16 rows, two integer ops make them
// two fp32 vectors (lane << 16 = rows 0-7, lane & 0xffff0000 = rows 8-15), and each token
// broadcasts x[m, k] into 2 FMAs. So up to kTmax = 6 tokens share one pass over the weights with
// 2 conversions per 2 * T FMAs, the accumulators are the outputs (no lane sums), and software
// prefetch a fixed distance ahead on the stream keeps DRAM busy while the FMAs run.
// Batch invariance: every output is one FMA chain over k in order for any token count, so a
// verify row equals the decode step's bit for bit (a summation order that followed the token
// count flipped greedy near-ties under speculation in bf16). One token runs two panels at once
// to keep four chains in flight (docs/speculation.md, "Batch invariance"; docs/benchmarks.md
// has the cost).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16.h"
#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>


namespace qd_panel_bf16 {  // linear_panel_avx512.cpp
void tile1_pair(const uint16_t* w0, const uint16_t* w1, int64_t K, const uint32_t* xp,
                float* acc0, float* acc1, const char* pf0, const char* pf1);
bool tile_dispatch(int T, const uint16_t* w, int64_t klen, const uint32_t* xp, int64_t ldxp,
                   float* acc, bool init, const char* pf);
}  // namespace qd_panel_bf16

namespace {

using u16 = uint16_t;
using u32 = uint32_t;

constexpr int kPanel = 16;   // weight rows per panel
constexpr int kTmax = 6;     // tokens per pass: 2 * kTmax accumulators + 2 weights + 1 x <= 16 ymm
constexpr int kTmaxBf16 = 16;  // the AVX512_BF16 tiles': one zmm accumulator per token
constexpr int64_t kKBlock = 512;  // k per block when tokens need several passes (16 KiB of panel)
constexpr int64_t kPrefetchBytes = 4096;  // distance ahead on the weight stream (4-16 KiB: same)

// One k of a panel: its 16 weights (32 bytes at wk) become two fp32 vectors, and each of T
// tokens adds x[t][k] times them into its two accumulators.
template <int T>
__attribute__((always_inline)) inline void step(const u16* wk, const float* xk, int64_t ldx,
                                                __m256 (&a)[T][2], __m256i hi16) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
  const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(u, hi16));
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    const __m256 xb = _mm256_broadcast_ss(xk + t * ldx);
    a[t][0] = _mm256_fmadd_ps(w0, xb, a[t][0]);
    a[t][1] = _mm256_fmadd_ps(w1, xb, a[t][1]);
  }
}

// T tokens x 16 rows over k in [0, klen) of one panel slice `w` ([klen, 16] u16): acc [T][16]
// (zeroed first when init). Each output is ONE fp32 FMA chain over k in order, whatever T is,
// so a row's result does not depend on how many rows share the call (batch invariance: a
// verify row equals the decode step's bit for bit). A loop step takes 2 k (64 bytes) and
// prefetches one line at `pf` (kPrefetchBytes ahead on the stream; null: none).
template <int T>
inline void tile(const u16* w, int64_t klen, const float* xs, int64_t ldx, float* acc, bool init,
                 const char* pf) {
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 a[T][2];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
      a[t][h] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + t * 16 + h * 8);
  int64_t k = 0;
  for (; k + 2 <= klen; k += 2) {
    if (pf) _mm_prefetch(pf + k * 32, _MM_HINT_T0);
    step<T>(w + k * 16, xs + k, ldx, a, hi16);
    step<T>(w + (k + 1) * 16, xs + k + 1, ldx, a, hi16);
  }
  for (; k < klen; ++k) step<T>(w + k * 16, xs + k, ldx, a, hi16);
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + t * 16 + h * 8, a[t][h]);
}

// One token over two panels at once (w0, w1; [K, 16] u16 each), into acc0 and acc1 [16]: the
// same chain per output as tile<1>, but four independent chains instead of two, which a decode
// step (M = 1) needs to cover the FMA latency.
inline void tile1_pair(const u16* w0, const u16* w1, int64_t K, const float* xs, float* acc0,
                       float* acc1, const char* pf0, const char* pf1) {
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 a[1][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}};
  __m256 b[1][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}};
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    _mm_prefetch(pf0 + k * 32, _MM_HINT_T0);
    _mm_prefetch(pf1 + k * 32, _MM_HINT_T0);
    step<1>(w0 + k * 16, xs + k, 0, a, hi16);
    step<1>(w1 + k * 16, xs + k, 0, b, hi16);
    step<1>(w0 + (k + 1) * 16, xs + k + 1, 0, a, hi16);
    step<1>(w1 + (k + 1) * 16, xs + k + 1, 0, b, hi16);
  }
  for (; k < K; ++k) {
    step<1>(w0 + k * 16, xs + k, 0, a, hi16);
    step<1>(w1 + k * 16, xs + k, 0, b, hi16);
  }
  _mm256_storeu_ps(acc0, a[0][0]);
  _mm256_storeu_ps(acc0 + 8, a[0][1]);
  _mm256_storeu_ps(acc1, b[0][0]);
  _mm256_storeu_ps(acc1 + 8, b[0][1]);
}

void tile_dispatch(int T, const u16* w, int64_t klen, const float* xs, int64_t ldx, float* acc,
                   bool init, const char* pf) {
  switch (T) {
    case 1: return tile<1>(w, klen, xs, ldx, acc, init, pf);
    case 2: return tile<2>(w, klen, xs, ldx, acc, init, pf);
    case 3: return tile<3>(w, klen, xs, ldx, acc, init, pf);
    case 4: return tile<4>(w, klen, xs, ldx, acc, init, pf);
    case 5: return tile<5>(w, klen, xs, ldx, acc, init, pf);
    case 6: return tile<6>(w, klen, xs, ldx, acc, init, pf);
  }
  TORCH_CHECK(false, "quickdraft linear_panel: bad token chunk ", T);
}

bool cpu_has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

int g_isa = -1;  // the tiles in use: -1 the best this CPU runs, 0 AVX2, 1 AVX512_BF16

bool use_bf16_tiles() { return g_isa < 0 ? cpu_has_avx512_bf16() : g_isa == 1; }

// One group of M <= kGroupM tokens: y [M, N] (row stride N) from xs [M, ldx] fp32, or (`xp`
// not null: the AVX512_BF16 tiles) from xp [M, ldxp] u32 pairs (x[2i + 1], x[2i]).
void run_group(const u16* packed, int64_t P, int64_t N, int64_t K, const float* xs, int64_t ldx,
               const u32* xp, int64_t ldxp, int64_t M, const void* bias, bool bias_bf16, void* y,
               bool y_bf16) {
  const bool wide = xp != nullptr;
  const int64_t tmax = wide ? kTmaxBf16 : kTmax;
  const int64_t nch = (M + tmax - 1) / tmax;  // balanced token chunks
  const int64_t KB = nch == 1 ? K : kKBlock;
  const int64_t panel_bytes = K * kPanel * 2;
  // ~128 KiB of weights per thread at least: below that the fork/join costs more than it saves
  const int64_t grain = std::max<int64_t>(1, (int64_t{128} << 10) / panel_bytes);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    const int64_t acc_floats = std::max<int64_t>(M, 2) * kPanel;  // M = 1: two panels at once
    float* const acc = qd_simd::scratch<1>(static_cast<size_t>(acc_floats));
    // y rows of panel p from acc [M][16] (lane order: acc[m][0..7] = rows 0-7, [8..15] = 8-15)
    auto write = [&](int64_t p, const float* pacc) {
      const int64_t rows = std::min<int64_t>(kPanel, N - p * kPanel);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t n = p * kPanel + j;
          float v = pacc[m * kPanel + j];
          if (bias)
            v += bias_bf16 ? qd_bf16::bf16_to_f32(static_cast<const u16*>(bias)[n])
                           : static_cast<const float*>(bias)[n];
          if (y_bf16)
            static_cast<u16*>(y)[m * N + n] = qd_bf16::f32_to_bf16(v);
          else
            static_cast<float*>(y)[m * N + n] = v;
        }
      }
    };
    int64_t p = p0;
    if (M == 1) {
      for (; p + 2 <= p1; p += 2) {
        const u16* w0 = packed + p * K * kPanel;
        const u16* w1 = w0 + K * kPanel;
        // prefetch kPrefetchBytes ahead on each of the two streams
        const char* pf0 = reinterpret_cast<const char*>(w0) + kPrefetchBytes;
        const char* pf1 = reinterpret_cast<const char*>(w1) + kPrefetchBytes;
        if (wide)
          qd_panel_bf16::tile1_pair(w0, w1, K, xp, acc, acc + kPanel, pf0, pf1);
        else
          tile1_pair(w0, w1, K, xs, acc, acc + kPanel, pf0, pf1);
        write(p, acc);
        write(p + 1, acc + kPanel);
      }
    }
    for (; p < p1; ++p) {
      const u16* wp = packed + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t klen = std::min(KB, K - k0);
        int64_t m0 = 0;
        for (int64_t c = 0; c < nch; ++c) {
          const int T = static_cast<int>(M / nch + (c < M % nch ? 1 : 0));
          // The first pass over a block streams it from DRAM: prefetch ahead on the stream
          // (into the next panel at the end of this one; past the thread's range is harmless).
          const char* pf =
              c == 0 ? reinterpret_cast<const char*>(wp + k0 * kPanel) + kPrefetchBytes : nullptr;
          if (wide) {
            const bool ok = qd_panel_bf16::tile_dispatch(T, wp + k0 * kPanel, klen,
                                                         xp + m0 * ldxp + k0 / 2, ldxp,
                                                         acc + m0 * kPanel, k0 == 0, pf);
            TORCH_CHECK(ok, "quickdraft linear_panel: bad token chunk ", T);
          } else {
            tile_dispatch(T, wp + k0 * kPanel, klen, xs + m0 * ldx + k0, ldx, acc + m0 * kPanel,
                          k0 == 0, pf);
          }
          m0 += T;
        }
      }
      write(p, acc);
    }
  });
}

}  // namespace

bool qd_linear_panel_eligible(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const c10::optional<at::Tensor>& bias) {
  if (!x.defined() || !packed.defined()) return false;
  if (!x.device().is_cpu() || !packed.device().is_cpu()) return false;
  if (packed.scalar_type() != at::kBFloat16 || packed.dim() != 3 || !packed.is_contiguous() ||
      packed.size(2) != kPanel || N <= (packed.size(0) - 1) * kPanel ||
      N > packed.size(0) * kPanel)
    return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  const int64_t K = packed.size(1);
  if (x.dim() < 1 || K == 0 || x.size(-1) != K) return false;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias && (!bias->device().is_cpu() || !at::isFloatingType(bias->scalar_type()) ||
                   bias->dim() != 1 || bias->size(0) != N))
    return false;
  return !(at::GradMode::is_enabled() && x.requires_grad());
}

at::Tensor qd_linear_panel(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qd_linear_panel_eligible(x, packed, N, bias),
              "quickdraft linear_panel: inputs not eligible");
  const int64_t P = packed.size(0), K = packed.size(1);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  qd_count_kernel_call();
  if (M == 0) return y.view(out_shape);
  at::Tensor b;
  if (bias.has_value() && bias->defined())
    b = bias->scalar_type() == at::kBFloat16 ? bias->contiguous()
                                             : bias->to(at::kFloat).contiguous();
  // bf16 x on an AVX512_BF16 CPU: x as (x[2i + 1], x[2i]) u32 pairs for its tiles; else x as
  // fp32 rows (the broadcasts read single floats). Made once per call.
  const bool wide = x2.scalar_type() == at::kBFloat16 && use_bf16_tiles();
  const int64_t ldxp = (K + 1) / 2;
  at::Tensor xs, pairs;
  if (wide) {
    pairs = at::empty({M, ldxp}, x.options().dtype(at::kInt));
    const auto* src = reinterpret_cast<const u16*>(x2.data_ptr<at::BFloat16>());
    auto* dst = reinterpret_cast<u32*>(pairs.data_ptr<int32_t>());
    for (int64_t m = 0; m < M; ++m) {
      const u16* row = src + m * K;
      u32* out = dst + m * ldxp;
      for (int64_t i = 0; i < K / 2; ++i) {  // (x[2i], x[2i + 1]) -> (x[2i + 1], x[2i])
        u32 v;
        std::memcpy(&v, row + 2 * i, sizeof v);
        out[i] = (v >> 16) | (v << 16);
      }
      if (K % 2) out[K / 2] = static_cast<u32>(row[K - 1]) << 16;  // (0, x[K - 1])
    }
  } else {
    xs = x2.scalar_type() == at::kFloat ? x2 : x2.to(at::kFloat);
  }
  const float* xp = wide ? nullptr : xs.data_ptr<float>();
  const u32* pp = wide ? reinterpret_cast<const u32*>(pairs.data_ptr<int32_t>()) : nullptr;
  const auto* wp = reinterpret_cast<const u16*>(packed.data_ptr<at::BFloat16>());
  // Tokens in groups of at most 64 (as linear_bf16.cpp): a group's x stays cache-resident
  // while its panels stream past.
  constexpr int64_t kGroupM = 64;
  const int64_t ngroups = (M + kGroupM - 1) / kGroupM;
  char* const y_base = static_cast<char*>(y.data_ptr());
  int64_t g0 = 0;
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    const int64_t gm = M / ngroups + (gi < M % ngroups ? 1 : 0);
    run_group(wp, P, N, K, wide ? nullptr : xp + g0 * K, K, wide ? pp + g0 * ldxp : nullptr,
              ldxp, gm, b.defined() ? b.data_ptr() : nullptr,
              b.defined() && b.scalar_type() == at::kBFloat16,
              y_base + g0 * N * static_cast<int64_t>(y.element_size()),
              y.scalar_type() == at::kBFloat16);
    g0 += gm;
  }
  return y.view(out_shape);
}

int64_t qd_panel_isa(int64_t level) {
  TORCH_CHECK(level >= -1 && level <= 1,
              "quickdraft panel_isa: -1 (best), 0 (AVX2), 1 (AVX512_BF16)");
  TORCH_CHECK(level != 1 || cpu_has_avx512_bf16(),
              "quickdraft panel_isa: this CPU lacks AVX512F/BW + AVX512_BF16");
  g_isa = static_cast<int>(level);
  return use_bf16_tiles() ? 1 : 0;
}
