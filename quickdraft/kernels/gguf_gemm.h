// The GGUF GEMM's pieces that another kernel drives itself (linear_gguf.cpp defines them; the
// grouped MoE kernel, moe_gguf.cpp, runs one expert's panels with them): the int8 activations
// of a block size, and one weight part's panels over rows of those activations.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "gguf_layout.h"
#include "panel_driver.h"

namespace qd_gguf {

// The activations of M rows [M, K] for one block size: xq [M, K] int8, dx [M, K / block] (the
// per-block scales), the int16 sums of xq per 16 and per 32 values [M, K / 16], [M, K / 32].
struct Acts {
  int8_t* xq;
  float* dx;
  int16_t* bs16;
  int16_t* bs32;
};

// Floats of scratch one block size's Acts of M rows take (each array rounded up to whole floats).
int64_t acts_floats(int64_t M, int64_t K, int block);

// The Acts of M rows of length K for `block`, laid out in `buf` (acts_floats(M, K, block)
// floats), not yet filled.
Acts acts_at(float* buf, int64_t M, int64_t K, int block);

// The Acts of x2 [M, K] (bf16 or fp32, contiguous) for `block` (32 or 256), as views into `buf`
// (acts_floats(M, K, block) floats). Each row is quantized on its own.
Acts quantize(const at::Tensor& x2, int block, float* buf);

// Rows [0, M) of `a` (row length K) times the 16-row panels [p0, p1) of one part in format `f`
// (`packed` [ceil(n / 16), K / block, block_bytes(f)]), written through `e`, on the calling
// thread: what linear_gguf runs per thread, with the same bits for a row whatever M is.
void part_panels(const Acts& a, int64_t M, int64_t K, int f, const uint8_t* packed, int64_t n,
                 const qd_panel::Epilogue& e, int64_t p0, int64_t p1);

}  // namespace qd_gguf
