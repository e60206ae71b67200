// 475 lines on purpose: one kernel (activation packing, register tiles, format dispatch, driver)
// read top to bottom; its tile shapes and the driver that picks them belong together.
// Small-M linear over a bf16 weight in nn.Linear layout for AVX2 + FMA CPUs; the Python-facing
// contract and the reference are quickdraft/kernels/linear_bf16.py's.
//
// Contract: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for
//   x     [..., K] bf16 or fp32 (any strides; flattened to M = numel / K rows),
//   w     [N, K]   bf16 or fp16 (a GGUF file's F16 tensors, exact), contiguous (nn.Linear
//                  layout, not repacked),
//   bias  [N]      any floating dtype, optional (fp32 / bf16 read as is, others cast to fp32),
//   y     [..., N] in x's dtype; fp32 accumulation, one round-to-nearest-even at the end.
// `qd_linear` runs the kernel when `eligible` holds (CPU, K % 8 == 0, M <= max_m, no autograd,
// ...) and otherwise calls at::linear, i.e. exactly what F.linear would do. bf16 models on the
// CPU run packed weights (linear_panel.cpp); this layout serves routed MoE experts and
// unpacked weights. int8 weights have their own kernel (linear_i8.cpp).
//
// Why: decode is bound by streaming the weights, and a speculative-decoding verify pass has
// M = 2..17 rows. Torch's bf16 CPU matmul without AVX-512 costs ~M times the M=1 time; here
// each weight byte is read from DRAM once per call whatever M is, and the M tokens are served
// from registers and L1, so the cost grows only with the FMA work.
//
// Design:
// * bf16 -> fp32 is a 16-bit shift: 16 bf16 loaded as 8 u32 lanes hold (w[2j] | w[2j+1] << 16)
//   in lane j, so `lane << 16` is fp32(w[2j]) and `lane & 0xffff0000` is fp32(w[2j+1]): one
//   integer op per 8 weights, no shuffles.
// * Hence x is converted once per call into an fp32 scratch in that same order ("even 8, odd 8"
//   per 16-block; a trailing 8-block, when K % 16 == 8, stays in natural order). The weight
//   format is a template policy (Bf16W) of the kernel.
// * Register tile: R weight rows x T tokens of 8-lane fp32 accumulators (R*T + R + 1 <= 16 ymm).
//   Token chunks run inside a row block (~48-64 KiB of weights), so the block comes from DRAM
//   once and is re-read from L1/L2 by the later chunks; lane sums happen once per output.
// * Threads (torch's intra-op pool, via at::parallel_for) each take a contiguous range of row
//   blocks. Each thread software-prefetches its NEXT row block, spread evenly over the current
//   block's tiles: DRAM then streams at a steady rate while the FMAs run, instead of idling
//   during the cache-resident chunks and stalling at every block start.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16.h"
#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

namespace {

using u16 = uint16_t;

using qd_bf16::bf16_even;
using qd_bf16::bf16_odd;
using qd_bf16::bf16x8_to_f32;  // 8 bf16 in natural order -> 8 fp32
using qd_bf16::f32_to_bf16;
using qd_simd::scratch;

// out[i] = sum of the 8 lanes of vector i, for n vectors stored contiguously (8 at a time through
// an hadd tree: ~12 instructions per 8 sums instead of ~5 per sum).
inline void hsum_many(const float* a, int n, float* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const float* v = a + i * 8;
    __m256 h01 = _mm256_hadd_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8));
    __m256 h23 = _mm256_hadd_ps(_mm256_load_ps(v + 16), _mm256_load_ps(v + 24));
    __m256 h45 = _mm256_hadd_ps(_mm256_load_ps(v + 32), _mm256_load_ps(v + 40));
    __m256 h67 = _mm256_hadd_ps(_mm256_load_ps(v + 48), _mm256_load_ps(v + 56));
    __m256 q0 = _mm256_hadd_ps(h01, h23);  // per 128-bit half: partial sums of vectors 0..3
    __m256 q1 = _mm256_hadd_ps(h45, h67);  // ... and of 4..7
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20),
                             _mm256_permute2f128_ps(q0, q1, 0x31));
    _mm256_storeu_ps(out + i, s);
  }
  for (; i < n; ++i) {  // the same additions as the tree above, so a sum's bits do not depend
    const __m256 v = _mm256_load_ps(a + i * 8);  // on how many sums there are (batch invariance)
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 q = _mm256_hadd_ps(h, h);
    out[i] = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
  }
}

// Weight formats: how a 16-weight block of one row becomes two fp32 vectors. The activations are
// packed (pack_x) in the matching order, so the FMAs pair the right x with each weight.
struct Bf16W {
  using elem = u16;
  static __m256 lo(const elem* p) {
    return bf16_even(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m256 hi(const elem* p) {
    return bf16_odd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m256 tail8(const elem* p) { return bf16x8_to_f32(p); }
};

// fp16 weights (F16C): the even and odd halves of a 16-block gathered by one byte shuffle per
// 128-bit lane and a 64-bit permute, then widened exactly.
struct F16W {
  using elem = u16;
  static __m256i split(const elem* p) {  // [evens 0-7 | odds 0-7] as 16 halves
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), order);
    return _mm256_permute4x64_epi64(v, 0xD8);
  }
  static __m256 lo(const elem* p) { return _mm256_cvtph_ps(_mm256_castsi256_si128(split(p))); }
  static __m256 hi(const elem* p) { return _mm256_cvtph_ps(_mm256_extracti128_si256(split(p), 1)); }
  static __m256 tail8(const elem* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

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
      if (K16 < K) _mm256_storeu_ps(dst + K16, bf16x8_to_f32(src + K16));
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
        e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xd8));
        o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xd8));
        _mm256_storeu_ps(dst + k, e);
        _mm256_storeu_ps(dst + k + 8, o);
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
template <class W, int R, int T>
inline void tile(const typename W::elem* const* wr, const float* xs, int64_t ldx, int64_t K,
                 bool init, float* acc_mem, const char*& pf, const char* pf_end) {
  using elem = typename W::elem;
  // One accumulator per (row, token) whatever T: every output is one FMA chain over k in
  // order, so a row's bits do not depend on M (batch invariance; T == 1 once kept separate
  // even/odd chains, which made a decode row differ from the same row in a verify).
  __m256 acc[R][T];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      acc[r][t] = init ? _mm256_setzero_ps() : _mm256_load_ps(acc_mem + (r * T + t) * 8);
    }
  const elem* w[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) w[r] = wr[r];
  const int64_t K16 = K / 16 * 16;
#pragma GCC unroll 2
  for (int64_t k = 0; k < K16; k += 16) {
    if (pf < pf_end) {
      // A step consumes R * 16 * sizeof(elem) bytes of weights; with a single token chunk the
      // prefetch must keep that pace (2 lines at R = 4 in bf16), with several chunks a
      // fraction of it suffices.
      _mm_prefetch(pf, _MM_HINT_T0);
      if constexpr (R * sizeof(elem) >= 8) _mm_prefetch(pf + 64, _MM_HINT_T0);
      pf += R * sizeof(elem) >= 8 ? 128 : 64;
    }
    __m256 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) wv[r] = W::lo(w[r] + k);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      __m256 xv = _mm256_load_ps(xs + t * ldx + k);
      QD_IN_REG(xv);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const elem* p = w[r] + k;
      QD_LAUNDER(p);
      wv[r] = W::hi(p);
    }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      __m256 xv = _mm256_load_ps(xs + t * ldx + k + 8);
      QD_IN_REG(xv);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  if (K16 < K) {
    __m256 w8[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) w8[r] = W::tail8(w[r] + K16);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      __m256 xv = _mm256_load_ps(xs + t * ldx + K16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(w8[r], xv, acc[r][t]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      _mm256_store_ps(acc_mem + (r * T + t) * 8, acc[r][t]);
    }
}

template <class W, int R, int TMAX>
void tile_dispatch(int T, const typename W::elem* const* wr, const float* xs, int64_t ldx,
                   int64_t K, bool init, float* acc, const char*& pf, const char* pf_end) {
  static_assert(TMAX >= 1 && TMAX <= 4, "extend the switch");
  switch (T) {
    case 1:
      return tile<W, R, 1>(wr, xs, ldx, K, init, acc, pf, pf_end);
    case 2:
      if constexpr (TMAX >= 2) return tile<W, R, 2>(wr, xs, ldx, K, init, acc, pf, pf_end);
      break;
    case 3:
      if constexpr (TMAX >= 3) return tile<W, R, 3>(wr, xs, ldx, K, init, acc, pf, pf_end);
      break;
    case 4:
      if constexpr (TMAX >= 4) return tile<W, R, 4>(wr, xs, ldx, K, init, acc, pf, pf_end);
      break;
  }
  TORCH_CHECK(false, "quickdraft linear_bf16: bad token chunk ", T);
}

struct Problem {
  const void* w;      // [N, K] in the weight format's element type
  const float* xs;    // [M, ldx], packed (see top)
  const void* bias;   // [N] or nullptr: fp32, or bf16 when bias_bf16
  bool bias_bf16;
  void* y;            // [M, N], fp32 or bf16
  bool y_bf16;
  int64_t M, N, K, ldx;
  int64_t rb;        // rows per block (multiple of R)
  int64_t kb;        // k per block (multiple of 16; K = no k-blocking)
  bool prefetch;     // software-prefetch the next row block
};

template <class W, int R, int TMAX>
void run(const Problem& p) {
  using elem = typename W::elem;
  const elem* const wbase = static_cast<const elem*>(p.w);
  // Balanced token chunks (M=8 -> 3+3+2 rather than 3+3+1+1).
  const int64_t nch = (p.M + TMAX - 1) / TMAX;
  const int64_t RB = p.rb, KB = p.kb;
  const int64_t nblocks = (p.N + RB - 1) / RB;
  const int64_t nk = (p.K + KB - 1) / KB;
  const int64_t block_bytes = RB * p.K * static_cast<int64_t>(sizeof(elem));
  const int64_t tiles_per_block = nk * nch * ((RB + R - 1) / R);
  const int64_t pf_lines =
      p.prefetch ? ((block_bytes + 63) / 64 + tiles_per_block - 1) / tiles_per_block : 0;
  const char* const w_end = reinterpret_cast<const char*>(wbase + p.N * p.K);
  // At least ~128 KiB of weights per thread: below that the fork/join costs more than the
  // second core saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{128} << 10) / block_bytes);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    // acc[g][m][r][8]: lane partial sums for every (row, token) of one row block.
    // a decode step's or a verify's accumulators in a per-thread buffer, a prompt's per call
    // (as x above: a long prompt does not pin them for the life of the process)
    const int64_t acc_floats = RB * p.M * 32;
    std::unique_ptr<float, decltype(&std::free)> acc_buf(nullptr, &std::free);
    float* acc;
    if (acc_floats * 4 <= (int64_t{4} << 20)) {
      acc = qd_simd::scratch<1>(static_cast<size_t>(acc_floats));
    } else {
      acc_buf.reset(static_cast<float*>(std::aligned_alloc(64, (acc_floats * 4 + 63) / 64 * 64)));
      acc = acc_buf.get();
      TORCH_CHECK(acc, "quickdraft linear_bf16: out of memory");
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * RB;
      const int64_t rows = std::min(RB, p.N - n0);
      const int64_t G = (rows + R - 1) / R;
      // This thread's next block only: the other thread streams its own range.
      const char* pf = reinterpret_cast<const char*>(wbase + (n0 + RB) * p.K);
      const char* const pf_end = b + 1 < b1 ? std::min(w_end, pf + block_bytes) : pf;
      for (int64_t k0 = 0; k0 < p.K; k0 += KB) {
        const int64_t klen = std::min(KB, p.K - k0);
        int64_t m0 = 0;
        for (int64_t c = 0; c < nch; ++c) {
          const int T = static_cast<int>(p.M / nch + (c < p.M % nch ? 1 : 0));
          for (int64_t g = 0; g < G; ++g) {
            // Rows past N alias the last valid row: computed and discarded, one code path.
            const elem* wr[R];
            for (int r = 0; r < R; ++r)
              wr[r] = wbase + (n0 + std::min<int64_t>(g * R + r, rows - 1)) * p.K + k0;
            tile_dispatch<W, R, TMAX>(T, wr, p.xs + m0 * p.ldx + k0, p.ldx, klen, k0 == 0,
                                   acc + (g * p.M + m0) * R * 8, pf,
                                   std::min(pf_end, pf + pf_lines * 64));
          }
          m0 += T;
        }
      }
      // Epilogue: lane sums, bias, store in y's dtype.
      int64_t m0 = 0;
      for (int64_t c = 0; c < nch; ++c) {
        const int T = static_cast<int>(p.M / nch + (c < p.M % nch ? 1 : 0));
        for (int64_t g = 0; g < G; ++g) {
          float sums[R * TMAX];
          hsum_many(acc + (g * p.M + m0) * R * 8, R * T, sums);
          for (int t = 0; t < T; ++t)
            for (int r = 0; r < R && g * R + r < rows; ++r) {
              const int64_t n = n0 + g * R + r;
              const float dot = sums[r * T + t];
              const float b = !p.bias       ? 0.0f
                              : p.bias_bf16 ? qd_bf16::bf16_to_f32(static_cast<const u16*>(p.bias)[n])
                                            : static_cast<const float*>(p.bias)[n];
              const float v = dot + b;
              const int64_t i = (m0 + t) * p.N + n;
              if (p.y_bf16)
                static_cast<u16*>(p.y)[i] = f32_to_bf16(v);
              else
                static_cast<float*>(p.y)[i] = v;
            }
        }
        m0 += T;
      }
    }
  });
}

// Kernel configuration; 0 in a field means "the measured default for this M and K" (the
// fields were benchmark knobs; only the defaults run).
struct Knobs {
  int64_t r = 0, tmax = 0;   // tile: rows x tokens (instances: 4x1, 4x2, 2x4, 3x3)
  int64_t block_bytes = 0;   // target weight bytes per row block
  int64_t kb = 0;            // k per block
  int64_t prefetch = -1;     // -1 default (on), 0 off, 1 on
};

// Defaults measured with bench/kernels.py on a 2-core Zen 3 (AVX2): ~94% of FMA peak for 3x3
// in cache; 3x4 / 4x3 / 2x6 spill (17+ ymm) and run at half speed; M=1 and M=2 are bound by
// DRAM, so wide row tiles; 48-64 KiB blocks make the next-block prefetch distance right (far
// more overflows L2, far less does not cover DRAM latency); k-blocking pays only when the
// token chunk's x slice (T * K * 4 bytes) would no longer fit L1.
Knobs resolve(Knobs k, int64_t M, int64_t K) {
  if (k.r == 0 || k.tmax == 0) {
    if (M == 1) k.r = 4, k.tmax = 1;
    else if (M == 2) k.r = 4, k.tmax = 2;
    else if (M == 4) k.r = 2, k.tmax = 4;
    else k.r = 3, k.tmax = 3;
  }
  if (k.block_bytes == 0) k.block_bytes = M == 1 ? (48 << 10) : (64 << 10);
  if (k.kb == 0) k.kb = (M > 1 && K > 4096) ? 1024 : K;
  if (k.prefetch < 0) k.prefetch = 1;
  return k;
}

std::atomic<int64_t> g_kernel_calls{0};

template <class W>
void run_format(const Problem& p, int64_t R, int64_t tmax) {
  if (R == 4 && tmax == 1) run<W, 4, 1>(p);
  else if (R == 4 && tmax == 2) run<W, 4, 2>(p);
  else if (R == 2 && tmax == 4) run<W, 2, 4>(p);
  else if (R == 3 && tmax == 3) run<W, 3, 3>(p);
  else TORCH_CHECK(false, "quickdraft linear: no tile instance ", R, "x", tmax);
}

at::Tensor run_kernel(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias, Knobs knobs) {
  const int64_t N = w.size(0), K = w.size(1);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  g_kernel_calls.fetch_add(1, std::memory_order_relaxed);
  if (M == 0 || N == 0) return y.view(out_shape);

  at::Tensor b;
  // fp32 and bf16 biases are read as they are (a cast per call costs a torch op per layer)
  if (bias.has_value() && bias->defined())
    b = bias->scalar_type() == at::kBFloat16 ? bias->contiguous()
                                             : bias->to(at::kFloat).contiguous();
  const int64_t ldx = (K + 15) / 16 * 16;  // every token row 64-byte aligned
  // Decode-sized x reuses a per-thread buffer; prefill-sized x gets a per-call one, so a long
  // prompt does not pin its scratch for the life of the process.
  at::Tensor xs_owner;
  float* xs;
  if (M * ldx * 4 <= (int64_t{4} << 20)) {
    xs = scratch(static_cast<size_t>(M * ldx));
  } else {
    xs_owner = at::empty({M * ldx}, x.options().dtype(at::kFloat));
    xs = xs_owner.data_ptr<float>();
  }
  pack_x(x2.data_ptr(), x2.scalar_type() == at::kBFloat16, M, K, xs, ldx);
  constexpr int64_t elem_bytes = 2;

  // Tokens go in balanced groups of at most kGroupM, each streaming the weight once: the
  // chunk loop re-reads the group's x for every row block, which must stay cache-resident
  // (measured: without groups, M=1024 x K=8960 ran at half the speed per token of M=64).
  constexpr int64_t kGroupM = 64;
  const int64_t ngroups = (M + kGroupM - 1) / kGroupM;
  char* const y_base = static_cast<char*>(y.data_ptr());
  int64_t g0 = 0;
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    const int64_t gm = M / ngroups + (gi < M % ngroups ? 1 : 0);
    const Knobs k = resolve(knobs, gm, K);
    const int64_t R = k.r;
    Problem p{w.data_ptr(),
              xs + g0 * ldx,
              b.defined() ? b.data_ptr() : nullptr,
              b.defined() && b.scalar_type() == at::kBFloat16,
              y_base + g0 * N * static_cast<int64_t>(y.element_size()),
              y.scalar_type() == at::kBFloat16,
              gm,
              N,
              K,
              ldx,
              std::max<int64_t>(R, k.block_bytes / (elem_bytes * K) / R * R),
              k.kb >= K ? K : std::max<int64_t>(16, k.kb / 16 * 16),
              k.prefetch != 0};
    if (w.scalar_type() == at::kHalf)
      run_format<F16W>(p, R, k.tmax);
    else
      run_format<Bf16W>(p, R, k.tmax);
    g0 += gm;
  }
  return y.view(out_shape);
}

bool eligible(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
              int64_t max_m) {
  if (!x.defined() || !w.defined() || x.layout() != at::kStrided || w.layout() != at::kStrided)
    return false;
  if (!x.device().is_cpu() || !w.device().is_cpu()) return false;
  if ((w.scalar_type() != at::kBFloat16 && w.scalar_type() != at::kHalf) || w.dim() != 2 ||
      !w.is_contiguous())
    return false;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat) return false;
  const int64_t K = w.size(1);
  if (x.dim() < 1 || K == 0 || K % 8 != 0 || x.size(-1) != K) return false;
  if (x.numel() / K > max_m) return false;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias && (bias->layout() != at::kStrided || !bias->device().is_cpu() ||
                   !at::isFloatingType(bias->scalar_type()) || bias->dim() != 1 ||
                   bias->size(0) != w.size(0)))
    return false;
  // No backward here: anything that needs a gradient goes to at::linear.
  if (at::GradMode::is_enabled() &&
      (x.requires_grad() || w.requires_grad() || (has_bias && bias->requires_grad())))
    return false;
  return true;
}

// at::linear, except that a weight/bias of another floating dtype than x is first cast to x's
// dtype: the kernel accepts fp32 x with a bf16 weight, so every fallback must too.
at::Tensor fallback(const at::Tensor& x, const at::Tensor& w,
                    const c10::optional<at::Tensor>& bias) {
  if (!x.defined() || !w.defined() || !at::isFloatingType(x.scalar_type()))
    return at::linear(x, w, bias);
  const auto dt = x.scalar_type();
  const bool cast_w = at::isFloatingType(w.scalar_type()) && w.scalar_type() != dt;
  const at::Tensor w2 = cast_w ? w.to(dt) : w;
  c10::optional<at::Tensor> b2 = bias;
  if (bias.has_value() && bias->defined() && at::isFloatingType(bias->scalar_type()) &&
      bias->scalar_type() != dt)
    b2 = bias->to(dt);
  return at::linear(x, w2, b2);
}

}  // namespace

bool qd_linear_eligible(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias, int64_t max_m) {
  return eligible(x, w, bias, max_m);
}

at::Tensor qd_linear(const at::Tensor& x, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias, int64_t max_m) {
  if (!eligible(x, w, bias, max_m)) return fallback(x, w, bias);
  return run_kernel(x, w, bias, Knobs{});
}

// Counts a call of any weight-GEMM kernel (linear_i8.cpp's, linear_q4.cpp's...): tests check
// the fast path ran.
void qd_count_kernel_call() { g_kernel_calls.fetch_add(1, std::memory_order_relaxed); }
int64_t qd_kernel_calls() { return g_kernel_calls.load(); }
