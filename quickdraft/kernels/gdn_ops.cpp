// Fused CPU ops of the hybrid (Gated DeltaNet) layers and the gated MLPs (SwiGLU, Gemma's GeGLU),
// for decode steps and short verifies. Bound in bindings.cpp; Python-facing contract and torch references in
// quickdraft/kernels/pointwise.py and quickdraft/kernels/gdn.py.
//
//   silu_mul(gate_up [N, 2I])                   -> silu(gate_up[:, :I]) * gate_up[:, I:]  [N, I]
//   gelu_mul(gate_up [N, 2I])                   -> gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]
//   gated_rms_norm(x [N, H, D] fp32, w [D], z [N, H, D], eps)
//                                               -> rms_norm(x) * w * silu(z)  [N, H, D], z dtype
//   causal_conv_silu(x [T, C], window [K-1, C], weight [C, K]) -> silu(causal conv)  [T, C] fp32
//   gdn_gates(a [N, H], b [N, H], A_log [H], dt_bias [H]) -> g, beta [N, H] fp32
//   sigmoid(x) -> sigmoid(x) in x's dtype (any shape)
//
// Why: in a decode step or a k+1-row verify these tensors are a few KB, so each torch op costs
// its dispatch and threading overhead, not its arithmetic (a strided bf16 silu ~40 us). One
// pass each here; a prompt's rows are split between the threads (the conv by channels, the
// others by rows: qd_rows_grain), each row computed alone. The delta rule itself is gdn_delta.cpp.
// All math is fp32, rounded once to the output dtype.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16.h"
#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using u16 = uint16_t;

using qd_bf16::bf16_to_f32;
using qd_bf16::f32_to_bf16;
using qd_simd::exp8;
using qd_simd::load1;
using qd_simd::load8;
using qd_simd::store1;
using qd_simd::store8;

// silu(x) = x / (1 + exp(-x)); NaN propagates through the division.
inline __m256 silu8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
inline float silu1(float x) { return x / (1.0f + std::exp(-x)); }

template <class F>
void dispatch_dtype(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat)
    f(float{});
  else
    f(u16{});
}

void check_float_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, what,
              ": bf16 or fp32 only");
}

// ---- silu(gate) * up ------------------------------------------------------------------------

template <class T>
void silu_mul_rows(const T* in, int64_t ld, T* out, int64_t N, int64_t I) {
  for (int64_t n = 0; n < N; ++n) {
    const T* g = in + n * ld;
    const T* u = g + I;
    T* o = out + n * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) store8(o + i, _mm256_mul_ps(silu8(load8(g + i)), load8(u + i)));
    for (; i < I; ++i) store1(o + i, silu1(load1(g + i)) * load1(u + i));
  }
}

// ---- gelu_tanh(gate) * up (Gemma's GeGLU) -----------------------------------------------------

// gelu_tanh(x) = 0.5 x (1 + tanh(z)) = x / (1 + exp(-2z)), z = sqrt(2 / pi) (x + 0.044715 x^3)
inline __m256 gelu8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 k = _mm256_set1_ps(-2.0f * 0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
  const __m256 t = _mm256_mul_ps(_mm256_mul_ps(k, x), _mm256_fmadd_ps(c, _mm256_mul_ps(x, x), one));
  return _mm256_div_ps(x, _mm256_add_ps(one, exp8(t)));
}

// Every element through the same 8-lane code (a row's tail padded into a vector), so a row's
// bits depend on that row only; one rounding of gelu(g) * u.
template <class T>
void gelu_mul_rows(const T* in, int64_t ld, T* out, int64_t N, int64_t I) {
  for (int64_t n = 0; n < N; ++n) {
    const T* g = in + n * ld;
    const T* u = g + I;
    T* o = out + n * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) store8(o + i, _mm256_mul_ps(gelu8(load8(g + i)), load8(u + i)));
    if (i < I) {
      alignas(32) float gb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ub[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t j = i; j < I; ++j) {
        gb[j - i] = load1(g + j);
        ub[j - i] = load1(u + j);
      }
      _mm256_store_ps(gb, _mm256_mul_ps(gelu8(_mm256_load_ps(gb)), _mm256_load_ps(ub)));
      for (int64_t j = i; j < I; ++j) store1(o + j, gb[j - i]);
    }
  }
}

// ---- sigmoid, elementwise ---------------------------------------------------------------------

// Every element through the same 8-lane code (the tail padded into a vector), so an element's
// bits do not depend on where it falls in the tensor: torch's sigmoid takes its vector path or
// its scalar tail by position, and so gave a gate row other bits alone than inside a verify.
template <class T>
void sigmoid_all(const T* x, T* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  auto sig = [&](__m256 v) {
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, sig(load8(x + i)));
  if (i < n) {
    alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = i; j < n; ++j) buf[j - i] = load1(x + j);
    _mm256_store_ps(buf, sig(_mm256_load_ps(buf)));
    for (int64_t j = i; j < n; ++j) store1(out + j, buf[j - i]);
  }
}

// ---- gated RMSNorm: rms_norm(x) * w * silu(z) -------------------------------------------------

template <class T, class WT>
void gated_norm_rows(const float* x, const WT* w, const T* z, int64_t zs0, int64_t zs1, T* out,
                     int64_t n0, int64_t n1, int64_t H, int64_t D, float eps) {
  std::vector<float> wf(D);
  for (int64_t i = 0; i < D; ++i) wf[i] = load1(w + i);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const float* xr = x + (n * H + h) * D;
      const T* zr = z + n * zs0 + h * zs1;
      T* o = out + (n * H + h) * D;
      float ss = 0.0f;
      int64_t i = 0;
      __m256 acc = _mm256_setzero_ps();
      for (; i + 8 <= D; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      for (float l : lanes) ss += l;
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      const __m256 vinv = _mm256_set1_ps(inv);
      i = 0;
      for (; i + 8 <= D; i += 8) {
        __m256 normed = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv),
                                      _mm256_loadu_ps(wf.data() + i));
        store8(o + i, _mm256_mul_ps(normed, silu8(load8(zr + i))));
      }
      for (; i < D; ++i) store1(o + i, xr[i] * inv * wf[i] * silu1(load1(zr + i)));
    }
}

// ---- causal depthwise conv + silu -----------------------------------------------------------

// channels [c0, c1) of every row (c0 a multiple of 8; c1 = C or a multiple of 8)
template <class T, class WT>
void conv_rows(const T* x, int64_t ldx, const T* win, const WT* w, float* out, int64_t Tn,
               int64_t C, int64_t K, int64_t c0, int64_t c1) {
  // row r of [window ; x]: r < K-1 from the window, else x row r-(K-1)
  auto row = [&](int64_t r) -> const T* { return r < K - 1 ? win + r * C : x + (r - K + 1) * ldx; };
  std::vector<float> wt(K * 8);
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    if (K == 4) {  // the 8 channels' 4 taps are 32 consecutive values: a 4x8 transpose
      const __m256 v0 = load8(w + c * 4), v1 = load8(w + c * 4 + 8);  // channels 0-1, 2-3
      const __m256 v2 = load8(w + c * 4 + 16), v3 = load8(w + c * 4 + 24);  // 4-5, 6-7
      // per 128-bit lane (channel 2j | 2j+1): unpack pairs, then gather each tap
      const __m256 a = _mm256_unpacklo_ps(v0, v1), b = _mm256_unpackhi_ps(v0, v1);
      const __m256 e = _mm256_unpacklo_ps(v2, v3), f = _mm256_unpackhi_ps(v2, v3);
      // lanes now hold channels [0 2 4 6 | 1 3 5 7]; restore the natural order
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      const __m256 taps[4] = {_mm256_shuffle_ps(a, e, 0x44), _mm256_shuffle_ps(a, e, 0xEE),
                              _mm256_shuffle_ps(b, f, 0x44), _mm256_shuffle_ps(b, f, 0xEE)};
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(wt.data() + i * 8, _mm256_permutevar8x32_ps(taps[i], order));
    } else {
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < 8; ++j) wt[i * 8 + j] = load1(w + (c + j) * K + i);
    }
    for (int64_t t = 0; t < Tn; ++t) {
      __m256 acc = _mm256_mul_ps(load8(row(t) + c), _mm256_loadu_ps(wt.data()));
      for (int64_t i = 1; i < K; ++i)
        acc = _mm256_fmadd_ps(load8(row(t + i) + c), _mm256_loadu_ps(wt.data() + i * 8), acc);
      _mm256_storeu_ps(out + t * C + c, silu8(acc));
    }
  }
  for (; c < c1; ++c)
    for (int64_t t = 0; t < Tn; ++t) {
      float acc = 0.0f;
      for (int64_t i = 0; i < K; ++i) acc += load1(row(t + i) + c) * load1(w + c * K + i);
      out[t * C + c] = silu1(acc);
    }
}

}  // namespace

at::Tensor qd_sigmoid(const at::Tensor& x_in) {
  check_float_cpu(x_in, "sigmoid");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    sigmoid_all(static_cast<const T*>(x.data_ptr()), static_cast<T*>(out.data_ptr()), x.numel());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> qd_gdn_gates(const at::Tensor& a_in, const at::Tensor& b_in,
                                                const at::Tensor& a_log, const at::Tensor& dt_bias) {
  check_float_cpu(a_in, "gdn_gates");
  TORCH_CHECK(a_in.dim() == 2 && b_in.sizes() == a_in.sizes() &&
                  b_in.scalar_type() == a_in.scalar_type() && a_log.dim() == 1 &&
                  a_log.size(0) == a_in.size(1) && dt_bias.sizes() == a_log.sizes() &&
                  a_log.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat,
              "gdn_gates: a, b [N, H] of one dtype, A_log and dt_bias [H] fp32");
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const at::Tensor al = a_log.contiguous(), dt = dt_bias.contiguous();
  const int64_t N = a.size(0), H = a.size(1);
  auto opts = a.options().dtype(at::kFloat);
  at::Tensor g = at::empty({N, H}, opts), beta = at::empty({N, H}, opts);
  float* gp = g.data_ptr<float>();
  float* bp = beta.data_ptr<float>();
  const float* alp = al.data_ptr<float>();
  const float* dtp = dt.data_ptr<float>();
  // Scalar libm math per element, the same for every element wherever it is: g = -exp(A_log)
  // softplus(a + dt_bias) (torch's softplus: x past 20 is itself), beta = sigmoid(b).
  dispatch_dtype(a, [&](auto tag) {
    using T = decltype(tag);
    const T* ap = static_cast<const T*>(a.data_ptr());
    const T* bq = static_cast<const T*>(b.data_ptr());
    for (int64_t i = 0; i < N * H; ++i) {
      const int64_t h = i % H;
      const float x = load1(ap + i) + dtp[h];
      const float sp = x > 20.0f ? x : std::log1p(std::exp(x));
      gp[i] = -std::exp(alp[h]) * sp;
      bp[i] = 1.0f / (1.0f + std::exp(-load1(bq + i)));
    }
  });
  return {g, beta};
}

namespace {

// act(gate) * up of gate_up [N, 2I] by `rows` (silu_mul_rows / gelu_mul_rows), the rows split
// between threads once there are enough of them (a prompt chunk); each row is computed alike
// wherever it runs
template <class Rows>
at::Tensor glu(const at::Tensor& gate_up, const char* what, const Rows& rows) {
  check_float_cpu(gate_up, what);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1, what,
              ": gate_up must be [N, 2I] with a contiguous last dim");
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({N, I}, gate_up.options());
  dispatch_dtype(gate_up, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(gate_up.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, N, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(I, 1)),
                     [&](int64_t r0, int64_t r1) {
                       rows(in + r0 * ld, ld, o + r0 * I, r1 - r0, I);
                     });
  });
  return out;
}

}  // namespace

at::Tensor qd_silu_mul(const at::Tensor& gate_up) {
  return glu(gate_up, "silu_mul", [](const auto* in, int64_t ld, auto* o, int64_t n, int64_t I) {
    silu_mul_rows(in, ld, o, n, I);
  });
}

at::Tensor qd_gelu_mul(const at::Tensor& gate_up) {
  return glu(gate_up, "gelu_mul", [](const auto* in, int64_t ld, auto* o, int64_t n, int64_t I) {
    gelu_mul_rows(in, ld, o, n, I);
  });
}

at::Tensor qd_gated_rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& z,
                             double eps) {
  check_float_cpu(z, "gated_rms_norm");
  check_float_cpu(w_in, "gated_rms_norm");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 3,
              "gated_rms_norm: x must be a CPU fp32 [N, H, D] tensor");
  TORCH_CHECK(z.dim() == 3 && z.sizes() == x_in.sizes() && z.stride(2) == 1,
              "gated_rms_norm: z must match x with a contiguous last dim");
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == x_in.size(2), "gated_rms_norm: w must be [D]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  at::Tensor out = at::empty({N, H, D}, z.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch_dtype(z, [&](auto tag) {
    using T = decltype(tag);
    dispatch_dtype(w, [&](auto wtag) {
      using WT = decltype(wtag);
      at::parallel_for(0, N, qd_rows_grain(H * D), [&](int64_t n0, int64_t n1) {
        gated_norm_rows<T, WT>(x.data_ptr<float>(), static_cast<const WT*>(w.data_ptr()),
                               static_cast<const T*>(z.data_ptr()), z.stride(0), z.stride(1),
                               static_cast<T*>(out.data_ptr()), n0, n1, H, D,
                               static_cast<float>(eps));
      });
    });
  });
  return out;
}

at::Tensor qd_causal_conv_silu(const at::Tensor& x, const at::Tensor& window_in,
                               const at::Tensor& weight_in) {
  check_float_cpu(x, "causal_conv_silu");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "causal_conv_silu: x must be [T, C] with a contiguous last dim");
  TORCH_CHECK(window_in.scalar_type() == x.scalar_type() && window_in.dim() == 2 &&
                  window_in.size(1) == x.size(1) && window_in.device().is_cpu(),
              "causal_conv_silu: window must be [K-1, C] in x's dtype");
  check_float_cpu(weight_in, "causal_conv_silu");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.size(0) == x.size(1) &&
                  weight_in.size(1) == window_in.size(0) + 1,
              "causal_conv_silu: weight must be [C, K] with K - 1 window rows");
  const at::Tensor win = window_in.contiguous(), w = weight_in.contiguous();
  const int64_t Tn = x.size(0), C = x.size(1), K = w.size(1);
  at::Tensor out = at::empty({Tn, C}, x.options().dtype(at::kFloat));
  dispatch_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    dispatch_dtype(w, [&](auto wtag) {
      using WT = decltype(wtag);
      // a prompt chunk's channels split over the threads in blocks of 8 (a decode step's
      // few microseconds stay on one: a fork/join would cost more)
      const int64_t blocks = (C + 7) / 8;
      const int64_t grain =
          std::max<int64_t>(1, (int64_t{1} << 15) / (8 * std::max<int64_t>(Tn, 1)));
      at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        conv_rows<T, WT>(static_cast<const T*>(x.data_ptr()), x.stride(0),
                         static_cast<const T*>(win.data_ptr()), static_cast<const WT*>(w.data_ptr()),
                         out.data_ptr<float>(), Tn, C, K, b0 * 8, std::min(C, b1 * 8));
      });
    });
  });
  return out;
}
