// The AVX-512 tile of the GGUF block kernel built with AVX512_VBMI as well (gguf_tile_avx512.h:
// the table formats' lookups by vpermb); linear_gguf.cpp runs it where the CPU has VBMI beside
// linear_gguf_avx512.cpp's features, with the same contract and the same bits. Only this file
// is compiled for VBMI, after every include, for the reasons linear_gguf_avx512.cpp gives.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "gguf_layout.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")

#define QD_GGUF_VBMI 1

namespace qd_gguf {
namespace {
#include "gguf_tile_avx512.h"
}  // namespace

void tile_avx512vbmi(int fmt, int T, const uint8_t* w, int64_t nb, const int8_t* xq,
                     int64_t ldx, const float* dx, int64_t ldd, const int16_t* bs, int64_t ldb,
                     float* acc, bool init, const char* pf) {
  run_tile(fmt, T, w, nb, xq, ldx, dx, ldd, bs, ldb, acc, init, pf);
}

}  // namespace qd_gguf

#pragma GCC pop_options
