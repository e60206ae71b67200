// Small-M linear over a bf16 weight on AVX2 + FMA CPUs (JIT-built by quickdraft/kernels/cpu_linear.py).
//
// Contract: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for
//   x    [M, K] bf16 or fp32, contiguous (the Python side flattens leading dims),
//   w    [N, K] bf16, contiguous (the nn.Linear layout, never repacked),
//   bias [N]    any floating dtype, optional,
//   y    [M, N] in x's dtype; fp32 accumulation, one bf16 rounding (nearest-even) at the end.
// Requires K % 8 == 0; the caller checks shapes/dtypes and falls back to F.linear otherwise.
//
// Why: decode is bound by streaming the weights, and a speculative-decoding verify pass has
// M = 2..17 rows. Torch's bf16 GEMM on AVX2 has no small-M fast path (its cost grows ~linearly
// with M), so here each weight byte is read from DRAM once per call whatever M is, and the M
// tokens are served from registers/L1.
//
// Layout tricks:
// * bf16 -> fp32 is a 16-bit shift: for 16 bf16 loaded as 8 u32 lanes, lane j holds
//   (w[2j] | w[2j+1] << 16), so `lane << 16` is fp32(w[2j]) and `lane & 0xffff0000` is
//   fp32(w[2j+1]). Two cheap integer ops per 16 weights and no shuffles.
// * x is therefore converted once per call into an fp32 scratch in the same "even 8, odd 8"
//   order per 16-block (a trailing 8-block, when K % 16 == 8, stays in natural order).
// * Register tile: R weight rows x T tokens of fp32 accumulators; token chunks loop inside a
//   row group so the group's weights (R x K x 2 bytes) come from DRAM once and are re-read
//   from L1/L2 by later chunks.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace {

using u16 = uint16_t;

inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }

inline __m256 bf16_odd(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 8 bf16 in natural order -> 8 fp32.
inline __m256 bf16_8(const u16* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// fp32 -> bf16 bits, round to nearest even (what torch's .to(bfloat16) does); NaN stays NaN.
inline u16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<u16>(u >> 16);
}

// Per-thread scratch that only grows: a fresh large malloc per call would be an mmap plus page
// faults on every forward.
float* scratch(size_t floats) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buf;
  thread_local size_t cap = 0;
  if (floats > cap) {
    size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    buf.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buf, "quickdraft linear_bf16: out of memory for scratch");
    cap = bytes / sizeof(float);
  }
  return buf.get();
}

// x [M, K] -> xs [M, ldx] fp32 in the packed order described at the top.
void pack_x(const void* x, bool x_bf16, int64_t M, int64_t K, float* xs, int64_t ldx) {
  const int64_t K16 = K / 16 * 16;
  if (x_bf16) {
    const u16* xp = static_cast<const u16*>(x);
    for (int64_t m = 0; m < M; ++m) {
      const u16* src = xp + m * K;
      float* dst = xs + m * ldx;
      for (int64_t k = 0; k < K16; k += 16) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
        _mm256_storeu_ps(dst + k, bf16_even(v));
        _mm256_storeu_ps(dst + k + 8, bf16_odd(v));
      }
      if (K16 < K) _mm256_storeu_ps(dst + K16, bf16_8(src + K16));
    }
  } else {
    const float* xp = static_cast<const float*>(x);
    for (int64_t m = 0; m < M; ++m) {
      const float* src = xp + m * K;
      float* dst = xs + m * ldx;
      for (int64_t k = 0; k < K16; k += 16) {
        __m256 a = _mm256_loadu_ps(src + k), b = _mm256_loadu_ps(src + k + 8);
        // per 128-bit lane: (a0 a2 b0 b2 | a4 a6 b4 b6); the 64-bit permute puts a's pairs first.
        __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
        __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
        _mm256_storeu_ps(dst + k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xd8)));
        _mm256_storeu_ps(dst + k + 8,
                         _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xd8)));
      }
      if (K16 < K) std::memcpy(dst + K16, src + K16, 8 * sizeof(float));
    }
  }
}

// Pins a value in a register: stops GCC from folding the x load into each of the R FMAs that use
// it (R loads instead of one; the L1 load ports then become the bottleneck).
#define QD_IN_REG(v) asm("" : "+x"(v))
// Hides a pointer's value from the optimiser so a second load through it is not merged with the
// first (re-loading 32 bytes from L1 is cheaper than keeping R more registers live).
#define QD_LAUNDER(p) asm("" : "+r"(p))

// One R x T tile over k in [0, K) of pre-offset rows/tokens, accumulating into acc_mem
// (R*T vectors of 8 lanes, [r][t] order; zeroed first when init). Lane sums are left to the
// epilogue so K can be split into blocks at no precision cost.
// Registers: R*T accumulators + R weights + 1 x (+ the odd mask) must fit AVX2's 16 ymm; GCC
// spills badly beyond that (measured: 3x4 and 4x3 run at half the speed of 3x3).
template <int R, int T>
inline void tile(const u16* const* wr, const float* xs, int64_t ldx, int64_t K, bool init,
                 float* acc_mem) {
  // T == 1 keeps separate even/odd accumulators: with one token there are otherwise only R
  // independent FMA chains, too few to hide the 4-cycle FMA latency.
  constexpr int A = (T == 1) ? 2 : 1;
  __m256 acc[R][T][A];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      acc[r][t][0] = init ? _mm256_setzero_ps() : _mm256_load_ps(acc_mem + (r * T + t) * 8);
      if constexpr (A == 2) acc[r][t][A - 1] = _mm256_setzero_ps();
    }
  const u16* w[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) w[r] = wr[r];
  const int64_t K16 = K / 16 * 16;
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      wv[r] = bf16_even(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k)));
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      __m256 xv = _mm256_load_ps(xs + t * ldx + k);
      QD_IN_REG(xv);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][t][0] = _mm256_fmadd_ps(wv[r], xv, acc[r][t][0]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const u16* p = w[r] + k;
      QD_LAUNDER(p);
      wv[r] = bf16_odd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      __m256 xv = _mm256_load_ps(xs + t * ldx + k + 8);
      QD_IN_REG(xv);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r][t][A - 1] = _mm256_fmadd_ps(wv[r], xv, acc[r][t][A - 1]);
    }
  }
  if (K16 < K) {
    __m256 w8[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) w8[r] = bf16_8(w[r] + K16);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      __m256 xv = _mm256_load_ps(xs + t * ldx + K16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][t][0] = _mm256_fmadd_ps(w8[r], xv, acc[r][t][0]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      __m256 s = acc[r][t][0];
      if constexpr (A == 2) s = _mm256_add_ps(s, acc[r][t][1]);
      _mm256_store_ps(acc_mem + (r * T + t) * 8, s);
    }
}

template <int R, int TMAX>
void tile_dispatch(int T, const u16* const* wr, const float* xs, int64_t ldx, int64_t K,
                   bool init, float* acc) {
  static_assert(TMAX <= 8, "extend the switch");
  switch (T) {
    case 1: return tile<R, 1>(wr, xs, ldx, K, init, acc);
    case 2: if constexpr (TMAX >= 2) return tile<R, 2>(wr, xs, ldx, K, init, acc); break;
    case 3: if constexpr (TMAX >= 3) return tile<R, 3>(wr, xs, ldx, K, init, acc); break;
    case 4: if constexpr (TMAX >= 4) return tile<R, 4>(wr, xs, ldx, K, init, acc); break;
    case 5: if constexpr (TMAX >= 5) return tile<R, 5>(wr, xs, ldx, K, init, acc); break;
    case 6: if constexpr (TMAX >= 6) return tile<R, 6>(wr, xs, ldx, K, init, acc); break;
    case 7: if constexpr (TMAX >= 7) return tile<R, 7>(wr, xs, ldx, K, init, acc); break;
    case 8: if constexpr (TMAX >= 8) return tile<R, 8>(wr, xs, ldx, K, init, acc); break;
  }
  TORCH_CHECK(false, "quickdraft linear_bf16: bad token chunk ", T);
}

struct Problem {
  const u16* w;
  const float* xs;
  const float* bias;  // fp32 [N] or nullptr
  void* y;
  bool y_bf16;
  int64_t M, N, K, ldx;
  int64_t rb, kb, pf;  // rows per block, k per block, prefetch distance (elements)
};

template <int R, int TMAX>
void run(const Problem& p) {
  // Balanced token chunks (e.g. M=9, TMAX=5 -> 5+4), so no chunk degenerates to 1 token.
  const int64_t nch = (p.M + TMAX - 1) / TMAX;
  const int64_t RB = std::max<int64_t>(R, p.rb / R * R);
  const int64_t KB = p.kb > 0 ? std::max<int64_t>(16, p.kb / 16 * 16) : p.K;
  const int64_t nblocks = (p.N + RB - 1) / RB;
  const int64_t nk = (p.K + KB - 1) / KB;
  // Software prefetch of the NEXT row block, spread evenly over this block's tiles: keeps DRAM
  // busy at a steady rate while the FMAs run (hardware prefetchers alone leave the weight
  // stream idle during the cache-resident token chunks, then stall on the next block).
  const int64_t block_lines = (RB * p.K * 2 + 63) / 64;
  const int64_t tiles_per_block = nk * nch * ((RB + R - 1) / R);
  const int64_t pf_lines = p.pf ? (block_lines + tiles_per_block - 1) / tiles_per_block : 0;
  const char* const w_end = reinterpret_cast<const char*>(p.w + p.N * p.K);
  const int pf_hint = static_cast<int>(p.pf);
  // Each thread should get at least ~128 KiB of weights: below that the OpenMP fork/join costs
  // more than the second core saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{128} << 10) / (2 * RB * p.K));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    // acc[g][m][r][8]: lane partial sums for every (row, token) of one row block.
    float* acc = static_cast<float*>(
        std::aligned_alloc(64, (RB * p.M * 8 * sizeof(float) + 63) / 64 * 64));
    TORCH_CHECK(acc, "quickdraft linear_bf16: out of memory");
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RB;
      const int64_t rows = std::min(RB, p.N - n0);
      const int64_t G = (rows + R - 1) / R;
      const char* pf_ptr = reinterpret_cast<const char*>(p.w + (n0 + RB) * p.K);
      const char* const pf_end =
          b + 1 < b1 ? std::min(w_end, pf_ptr + RB * p.K * 2) : pf_ptr;  // own range only
      for (int64_t k0 = 0; k0 < p.K; k0 += KB) {
        const int64_t klen = std::min(KB, p.K - k0);
        int64_t m0 = 0;
        for (int64_t c = 0; c < nch; ++c) {
          const int T = static_cast<int>(p.M / nch + (c < p.M % nch ? 1 : 0));
          for (int64_t g = 0; g < G; ++g) {
            for (int64_t i = 0; i < pf_lines && pf_ptr < pf_end; ++i, pf_ptr += 64) {
              if (pf_hint == 2)
                _mm_prefetch(pf_ptr, _MM_HINT_T1);
              else if (pf_hint == 3)
                _mm_prefetch(pf_ptr, _MM_HINT_NTA);
              else
                _mm_prefetch(pf_ptr, _MM_HINT_T0);
            }
            // Rows past N alias the last valid row: computed and discarded, one code path.
            const u16* wr[R];
            for (int r = 0; r < R; ++r)
              wr[r] = p.w + (n0 + std::min<int64_t>(g * R + r, rows - 1)) * p.K + k0;
            tile_dispatch<R, TMAX>(T, wr, p.xs + m0 * p.ldx + k0, p.ldx, klen, k0 == 0,
                                   acc + (g * p.M + m0) * R * 8);
          }
          m0 += T;
        }
      }
      // Epilogue: lane sums, bias, store in y's dtype.
      int64_t m0 = 0;
      for (int64_t c = 0; c < nch; ++c) {
        const int T = static_cast<int>(p.M / nch + (c < p.M % nch ? 1 : 0));
        for (int64_t g = 0; g < G; ++g) {
          const float* a = acc + (g * p.M + m0) * R * 8;
          for (int t = 0; t < T; ++t)
            for (int r = 0; r < R && g * R + r < rows; ++r) {
              const int64_t n = n0 + g * R + r;
              const float v =
                  hsum(_mm256_load_ps(a + (r * T + t) * 8)) + (p.bias ? p.bias[n] : 0.0f);
              const int64_t i = (m0 + t) * p.N + n;
              if (p.y_bf16)
                static_cast<u16*>(p.y)[i] = to_bf16(v);
              else
                static_cast<float*>(p.y)[i] = v;
            }
        }
        m0 += T;
      }
    }
    std::free(acc);
  });
}

// Tuning knobs exposed for bench/kernels.py; linear_bf16 uses the measured defaults.
at::Tensor linear_bf16_tuned(const at::Tensor& x, const at::Tensor& w,
                             const c10::optional<at::Tensor>& bias, std::vector<int64_t> knobs) {
  TORCH_CHECK(knobs.size() == 8, "knobs: r1, rb1, kb1, r, tmax, rb, kb, pf");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "quickdraft linear_bf16: CPU only");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "quickdraft linear_bf16: weight must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "quickdraft linear_bf16: x must be bf16 or fp32");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "quickdraft linear_bf16: x [..., K] vs w [N, K]");
  TORCH_CHECK(K % 8 == 0 && K > 0, "quickdraft linear_bf16: K must be a positive multiple of 8");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(out_shape);

  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quickdraft linear_bf16: bias must have N elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t ldx = (K + 15) / 16 * 16;  // keeps every token row 64-byte aligned
  float* xs = scratch(static_cast<size_t>(M * ldx));
  pack_x(x2.data_ptr(), x2.scalar_type() == at::kBFloat16, M, K, xs, ldx);

  const bool one = M == 1;
  int64_t R = one ? knobs[0] : knobs[3], TM = one ? 1 : knobs[4];
  if (R == 0) {
    // Measured best tiles per M (hot-cache GFMA/s, 3x3 ~ 94% of FMA peak).
    R = M == 1 ? 4 : M == 2 ? 4 : (M == 4 || M == 5) ? 2 : 3;
    TM = M == 1 ? 1 : M == 2 ? 2 : (M == 4 || M == 5) ? 5 : 3;
  }
  Problem p{reinterpret_cast<const u16*>(w.data_ptr<at::BFloat16>()),
            xs,
            b.defined() ? b.data_ptr<float>() : nullptr,
            y.data_ptr(),
            y.scalar_type() == at::kBFloat16,
            M,
            N,
            K,
            ldx,
            one ? knobs[1] : knobs[5],
            one ? knobs[2] : knobs[6],
            knobs[7]};
#define QD_CASE(RR, TT) \
  if (R == RR && TM == TT) return run<RR, TT>(p), y.view(out_shape);
  QD_CASE(2, 1) QD_CASE(4, 1) QD_CASE(6, 1) QD_CASE(8, 1)
  QD_CASE(2, 4) QD_CASE(2, 5) QD_CASE(3, 3) QD_CASE(4, 2)
#undef QD_CASE
  TORCH_CHECK(false, "quickdraft linear_bf16: no instance for R=", R, " TMAX=", TM);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias) {
  return linear_bf16_tuned(x, w, bias, {4, 16, 0, 0, 0, 16, 512, 0});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "y = x @ w.T (+ bias) for bf16 w [N, K], small M",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("linear_bf16_tuned", &linear_bf16_tuned, "linear_bf16 with explicit tuning knobs",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("knobs"));
}
