// Fused per-token ops of a decoder layer for the CPU: RMSNorm (optionally after a residual
// add) and rotate-half RoPE. Bound in bindings.cpp; Python-facing contract and references in
// quickdraft/kernels/pointwise.py.
//
// Why: at decode time a layer's tensors are a few KB, so each torch op costs its dispatch
// overhead, not its arithmetic: F.rms_norm on a bf16 row is ~8 ops (~30 us here), apply_rope
// ~6 ops per tensor (~24 us). One pass each in C++ costs ~1-2 us. All math is fp32 with one
// rounding to the output dtype at the end (as accurate as the torch reference, or more). A
// prompt's rows are split between the threads (qd_rows_grain): each row computed alone.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using u16 = uint16_t;

using qd_bf16::bf16_to_f32;
using qd_bf16::f32_to_bf16;

// Row access in either dtype: load to fp32, store from fp32.
template <class T>
struct Row;
template <>
struct Row<float> {
  static float get(const float* p, int64_t i) { return p[i]; }
  static void put(float* p, int64_t i, float v) { p[i] = v; }
};
template <>
struct Row<u16> {
  static float get(const u16* p, int64_t i) { return bf16_to_f32(p[i]); }
  static void put(u16* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
};

// Sum of squares in fp32 with 8-lane accumulators (the scalar loop would not vectorise without
// -ffast-math, which we do not want elsewhere).
inline float sum_squares(const float* v, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  acc0 = _mm256_add_ps(acc0, acc1);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc0);
  float s = 0.0f;
  for (float l : lanes) s += l;
  for (; i < n; ++i) s += v[i] * v[i];
  return s;
}

// rows [m0, m1) of x [M, H] (+ delta) -> sum (if delta) and
// y = sum * rsqrt(mean(sum^2) + eps) * (w + offset)
template <class T, class WT>
void norm_rows(const T* x, const T* delta, const WT* w, T* sum_out, T* y, int64_t m0,
               int64_t m1, int64_t H, float eps, float offset) {
  std::vector<float> buf(H);
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * H;
    for (int64_t i = 0; i < H; ++i) buf[i] = Row<T>::get(xr, i);
    if (delta != nullptr) {
      const T* dr = delta + m * H;
      T* sr = sum_out + m * H;
      for (int64_t i = 0; i < H; ++i) {
        // the residual stream is kept in the model dtype: round the sum as `x + delta` would
        Row<T>::put(sr, i, buf[i] + Row<T>::get(dr, i));
        buf[i] = Row<T>::get(sr, i);
      }
    }
    const float inv = 1.0f / std::sqrt(sum_squares(buf.data(), H) / static_cast<float>(H) + eps);
    T* yr = y + m * H;
    for (int64_t i = 0; i < H; ++i)
      Row<T>::put(yr, i, buf[i] * inv * (Row<WT>::get(w, i) + offset));
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "rms_norm: x must be bf16 or fp32");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: weight dtype must match x");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: weight [H] for x [..., H]");
}

template <class F>
void dispatch_dtype(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat)
    f(float{});
  else
    f(u16{});
}

}  // namespace

// y = x * rsqrt(mean(x^2, -1) + eps) * (weight + offset); offset 1 is the zero-centred
// (1 + w) convention of Qwen3-Next / Qwen3.5.
at::Tensor qd_rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps,
                       double offset) {
  check_norm_args(x_in, w_in);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t H = x.size(-1), M = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor y = at::empty_like(x);
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, M, qd_rows_grain(H), [&](int64_t m0, int64_t m1) {
      norm_rows<T, T>(static_cast<const T*>(x.data_ptr()), nullptr,
                      static_cast<const T*>(w.data_ptr()), nullptr,
                      static_cast<T*>(y.data_ptr()), m0, m1, H, static_cast<float>(eps),
                      static_cast<float>(offset));
    });
  });
  return y;
}

// (s, y): s = x + delta (the new residual stream, in x's dtype) and y = rms_norm(s).
std::tuple<at::Tensor, at::Tensor> qd_add_rms_norm(const at::Tensor& x_in,
                                                   const at::Tensor& delta_in,
                                                   const at::Tensor& w_in, double eps,
                                                   double offset) {
  check_norm_args(x_in, w_in);
  TORCH_CHECK(delta_in.sizes() == x_in.sizes() && delta_in.scalar_type() == x_in.scalar_type(),
              "add_rms_norm: delta must match x in shape and dtype");
  const at::Tensor x = x_in.contiguous(), d = delta_in.contiguous(), w = w_in.contiguous();
  const int64_t H = x.size(-1), M = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor s = at::empty_like(x), y = at::empty_like(x);
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, M, qd_rows_grain(H), [&](int64_t m0, int64_t m1) {
      norm_rows<T, T>(static_cast<const T*>(x.data_ptr()), static_cast<const T*>(d.data_ptr()),
                      static_cast<const T*>(w.data_ptr()), static_cast<T*>(s.data_ptr()),
                      static_cast<T*>(y.data_ptr()), m0, m1, H, static_cast<float>(eps),
                      static_cast<float>(offset));
    });
  });
  return {s, y};
}

// Rotate-half RoPE on the first `rot` dims of each head (the rest copied through):
//   out[j] = x[j] cos[j] - x[j + rot/2] sin[j],  out[j + rot/2] = x[j + rot/2] cos[j + rot/2]
//   + x[j] sin[j + rot/2]  for j < rot/2.
// x [N, heads, d] with any strides whose last dim is contiguous (e.g. a view into the fused
// qkv output); cos, sin [N, rot] fp32. Returns a contiguous [N, heads, d] tensor.
at::Tensor qd_rope(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "rope: x must be a CPU [N, heads, d] tensor with a contiguous last dim");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "rope: x must be bf16 or fp32");
  const at::Tensor cs = cos_in.to(at::kFloat).contiguous(), sn = sin_in.to(at::kFloat).contiguous();
  const int64_t N = x.size(0), heads = x.size(1), d = x.size(2), rot = cs.size(-1);
  TORCH_CHECK(cs.dim() == 2 && cs.size(0) == N && sn.sizes() == cs.sizes() && rot <= d &&
                  rot % 2 == 0,
              "rope: cos/sin must be [N, rot] with an even rot <= head_dim");
  at::Tensor out = at::empty({N, heads, d}, x.options());
  const int64_t half = rot / 2, sn0 = x.stride(0), sh = x.stride(1);
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    const float* c = cs.data_ptr<float>();
    const float* s = sn.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      const float* cn = c + n * rot;
      const float* snr = s + n * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = xp + n * sn0 + h * sh;
        T* orow = op + (n * heads + h) * d;
        for (int64_t j = 0; j < half; ++j) {
          const float a = Row<T>::get(xr, j), b = Row<T>::get(xr, j + half);
          Row<T>::put(orow, j, a * cn[j] - b * snr[j]);
          Row<T>::put(orow, j + half, b * cn[j + half] + a * snr[j + half]);
        }
        for (int64_t j = rot; j < d; ++j) orow[j] = xr[j];
      }
    }
  });
  return out;
}
