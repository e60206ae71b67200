// The parallel driver shared by the integer panel kernels (linear_i8.cpp, linear_q4.cpp): the
// loop over 16-row weight panels, weight blocks and token chunks, and the epilogue that writes
// y. Each kernel supplies only its tile (T tokens x 16 rows over a run of 32-weight groups).
//
// Schedule: threads (torch's intra-op pool) take contiguous ranges of panels, so each thread
// reads one sequential weight stream. Tokens go in balanced chunks of at most kTmax; with one
// chunk a panel is read in one pass, with several it is read in blocks of kBlockGroups groups
// (~5-8 KiB) that the later chunks re-read from L1. The first chunk over a block prefetches
// `prefetch_bytes` ahead on the stream (0: none; build.py sets it per CPU at load). A row's
// sums run over the groups in order whatever M is and however the panels are split, so its
// result does not depend on the other rows.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"
#include "simd.h"

namespace qd_panel {

constexpr int kPanel = 16;                // weight rows per panel
constexpr int kTmax = 4;                  // tokens per tile pass
constexpr int64_t kBlockGroups = 16;      // groups per block when tokens need several passes
// Distance ahead on the weight stream; 0: no software prefetch. build.py sets it once at load
// (`set_prefetch_bytes`), before any kernel runs. Too far ahead costs more than none: on a
// 2-core Xeon (AMX) VM, 4 KiB streamed a 4-bit panel at 18-23 GB/s and 1.5 KiB at 25-28.
inline int64_t prefetch_bytes = 4096;

// Where the results go: y[m * ldy + n] = acc * row_scale[n] (when given) + bias[n] (when
// given).
struct Epilogue {
  const float* row_scale;  // [N] or null
  const void* bias;        // [N] fp32 or bf16, or null
  bool bias_bf16;
  void* y;  // [M, ldy] fp32 or bf16
  bool y_bf16;
  int64_t ldy;
};

// The bias as a kernel reads it: bf16 and fp32 as they are, other dtypes cast to fp32 (a cast
// per call would cost a torch op per layer); undefined when there is none.
inline at::Tensor bias_operand(const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  return bias->scalar_type() == at::kBFloat16 ? bias->contiguous()
                                              : bias->to(at::kFloat).contiguous();
}

inline Epilogue epilogue(const float* row_scale, const at::Tensor& bias, at::Tensor& y) {
  return Epilogue{row_scale, bias.defined() ? bias.data_ptr() : nullptr,
                  bias.defined() && bias.scalar_type() == at::kBFloat16, y.data_ptr(),
                  y.scalar_type() == at::kBFloat16, y.size(-1)};
}

// y[m, n0 + j] for a whole panel's 16 rows, 8 lanes at a time: what run_range's scalar loop
// writes, the same bits (a scale or a bias, not both: one rounding each, no contraction).
template <class Y>
inline void write_rows(const Epilogue& e, const float* acc, int64_t M, int64_t n0, Y* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < kPanel; h += 8) {
      __m256 v = _mm256_loadu_ps(acc + m * kPanel + h);
      if (e.row_scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(e.row_scale + n0 + h));
      if (e.bias)
        v = _mm256_add_ps(v, e.bias_bf16
                                 ? qd_simd::load8(static_cast<const uint16_t*>(e.bias) + n0 + h)
                                 : qd_simd::load8(static_cast<const float*>(e.bias) + n0 + h));
      qd_simd::store8(y + m * e.ldy + n0 + h, v);
    }
}

inline void write_panel(const Epilogue& e, const float* acc, int64_t M, int64_t n0) {
  if (e.y_bf16)
    write_rows(e, acc, M, n0, static_cast<uint16_t*>(e.y));
  else
    write_rows(e, acc, M, n0, static_cast<float*>(e.y));
}

// Panels [p0, p1) of `run` below on the calling thread: what each of its threads does with its
// range. The grouped MoE kernel (moe_gguf.cpp) calls it for a range of one expert's panels.
// `distance`: how far ahead the first pass prefetches (the GGUF kernel passes its own per
// format, linear_gguf.cpp).
template <class Tile>
void run_range(const uint8_t* packed, int64_t M, int64_t N, int64_t G, int64_t group_bytes,
               const Epilogue& e, const Tile& tile, int64_t p0, int64_t p1,
               int64_t block_groups = kBlockGroups, int64_t tmax = kTmax,
               int64_t distance = prefetch_bytes) {
  const int64_t nch = (M + tmax - 1) / tmax;  // balanced token chunks
  const int64_t GB = nch == 1 ? G : block_groups;
  const int64_t panel_bytes = G * group_bytes;
  float* const acc = qd_simd::scratch<1>(static_cast<size_t>(M * kPanel));
  for (int64_t pi = p0; pi < p1; ++pi) {
    const uint8_t* wp = packed + pi * panel_bytes;
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      const int64_t glen = std::min(GB, G - g0);
      const uint8_t* wg = wp + g0 * group_bytes;
      int64_t m0 = 0;
      for (int64_t c = 0; c < nch; ++c) {
        const int T = static_cast<int>(M / nch + (c < M % nch ? 1 : 0));
        // the first pass over a block streams it from DRAM: prefetch ahead on the stream
        const char* pf = c == 0 && distance > 0 ? reinterpret_cast<const char*>(wg) + distance
                                                : nullptr;
        tile(T, wg, g0, glen, m0, acc + m0 * kPanel, g0 == 0, pf);
        m0 += T;
      }
    }
    const int64_t rows = std::min<int64_t>(kPanel, N - pi * kPanel);
    if (rows == kPanel && !(e.row_scale && e.bias)) {
      write_panel(e, acc, M, pi * kPanel);
      continue;
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t n = pi * kPanel + j;
        float v = acc[m * kPanel + j];
        if (e.row_scale) v *= e.row_scale[n];
        if (e.bias)
          v += e.bias_bf16 ? qd_bf16::bf16_to_f32(static_cast<const uint16_t*>(e.bias)[n])
                           : static_cast<const float*>(e.bias)[n];
        if (e.y_bf16)
          static_cast<uint16_t*>(e.y)[m * e.ldy + n] = qd_bf16::f32_to_bf16(v);
        else
          static_cast<float*>(e.y)[m * e.ldy + n] = v;
      }
  }
}

// Runs `tile(T, w, g0, glen, m0, acc, init, pf)` over every panel of `packed` ([P, G,
// group_bytes] bytes, P = ceil(N / 16)): T tokens from token m0, the panel's groups [g0, g0 +
// glen) at w, accumulating into acc [T][16] fp32 (zeroed first when init), prefetching at pf
// (null: none). Then writes y through `e`. With several token chunks, groups go in blocks of
// `block_groups`, and chunks hold at most `tmax` tokens.
template <class Tile>
void run(const uint8_t* packed, int64_t M, int64_t N, int64_t G, int64_t group_bytes,
         const Epilogue& e, const Tile& tile, int64_t block_groups = kBlockGroups,
         int64_t tmax = kTmax) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  // ~128 KiB of weights per thread at least: below that the fork/join costs more than it saves
  const int64_t grain = std::max<int64_t>(1, (int64_t{128} << 10) / (G * group_bytes));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    run_range(packed, M, N, G, group_bytes, e, tile, p0, p1, block_groups, tmax);
  });
}

}  // namespace qd_panel
