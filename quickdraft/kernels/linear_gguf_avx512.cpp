// The AVX-512 VNNI tile of the GGUF block kernel (linear_gguf.cpp runs it where the CPU has
// AVX512F/BW/VL and AVX512_VNNI; kernels/linear_gguf.py owns the contract and the reference).
//
// Contract: tile_avx512 computes exactly what linear_gguf.cpp's AVX2 tile computes, bit for
// bit: the same exact integer sums per block, then the same fp32 operations per row. One zmm
// holds a quad's 16 rows x 4 values (rows 0-7 from the low nibbles, 8-15 from the high ones),
// and one vpdpbusd per token adds the 64 products into the rows' int32 sums (AVX2 needs
// vpmaddubsw + vpmaddwd + vpaddd per 8 rows); sub-block scales multiply each 16- or 32-column
// run's sums once. Q8_0's signed weights go in as q + 128 (vpdpbusd takes unsigned weights),
// and 128 * sum(x) comes off with the other offsets; so do the non-linear formats' table values
// (IQ4_NL, IQ4_XS, MXFP4: v(u) + 128 looked up by vpshufb), 128 * sc * sum(x) per sub-block. Q4_K scales its runs in fp32 instead of
// vpmulld (vpdpbusd and vpmulld share port 0 on these cores; converting and an FMA leave it one
// uop sooner): every product and each half block's sum is an integer below 2^24, so exact, and
// the halves' one rounded sum is the int32 sum converted, bit for bit (4-6 % less time per
// 6-16 tokens, bench/kernels.py).
//
// The tile's body is gguf_tile_avx512.h, which linear_gguf_avx512vbmi.cpp builds again with
// AVX512_VBMI. Only these two files are compiled for AVX-512 (the pragma below, after every
// include): they include no torch or standard header with code, so no inline function built for
// AVX-512 can be picked by the linker for another file, and nothing here runs unless the CPU
// has the features.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "gguf_layout.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#define QD_GGUF_VBMI 0

namespace qd_gguf {
namespace {
#include "gguf_tile_avx512.h"
}  // namespace

void tile_avx512(int fmt, int T, const uint8_t* w, int64_t nb, const int8_t* xq, int64_t ldx,
                 const float* dx, int64_t ldd, const int16_t* bs, int64_t ldb, float* acc,
                 bool init, const char* pf) {
  run_tile(fmt, T, w, nb, xq, ldx, dx, ldd, bs, ldb, acc, init, pf);
}

}  // namespace qd_gguf

#pragma GCC pop_options
