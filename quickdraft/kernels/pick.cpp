// Greedy picks over logit rows: per row the first index of its maximum (torch.argmax's), and on
// request the softmax probability of that index. Bound in bindings.cpp; Python-facing contract
// and torch reference in quickdraft/kernels/pointwise.py (`greedy_pick`).
//
//   greedy_pick(logits [N, V] fp32 / bf16, with_prob) -> ids [N] int64, probs [N] fp32 (empty
//                                                       without with_prob)
//
// Why: every greedy step takes the argmax of its rows (a decode, each verify row, each draft of
// a drafter that runs a model), and a drafter that stops on its chain probability also takes
// that token's softmax. torch's argmax reads a fp32 row at ~2 GB/s (0.46 ms for a 248,320-id
// row) and its logsumexp of a row holding -inf (a draft vocabulary's unscored ids) 1.6 ms; a
// verify of 4 rows plus 3 drafts paid ~7 ms of a 250 ms full-size MoE step. Here: one pass for
// the maximum (NaN checked on the way), one to find its first index, one for sum exp(x - max).
// Each row is computed alone by one thread, the same code wherever it sits (batch-invariant).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "ops.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

using u16 = uint16_t;

using qd_simd::exp8;
using qd_simd::hmax;
using qd_simd::hsum;
using qd_simd::load1;
using qd_simd::load8;

// The row's pick: the first index of its maximum (of its first NaN, as torch.argmax, if it has
// one), and 1 / sum exp(x - max) when `prob` is set (NaN where the maximum is not finite, as
// torch's exp(x[i] - logsumexp(x)) is).
template <class T>
void pick_row(const T* x, int64_t V, bool prob, int64_t* id, float* p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  __m256 m0 = _mm256_set1_ps(ninf), m1 = m0, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m256 a = load8(x + i), b = load8(x + i + 8);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
  float m = hmax(_mm256_max_ps(m0, m1));
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < V; ++i) {
    const float v = load1(x + i);
    has_nan |= std::isnan(v);
    m = v > m ? v : m;
  }
  int64_t at = 0;
  if (has_nan) {
    while (!std::isnan(load1(x + at))) ++at;
    *id = at;
    if (prob) *p = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const __m256 mv = _mm256_set1_ps(m);
  bool found = false;
  for (at = 0; at + 8 <= V && !found; at += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + at), mv, _CMP_EQ_OQ));
    if (hit) {
      at += __builtin_ctz(static_cast<unsigned>(hit));
      found = true;
      break;
    }
  }
  if (!found)  // the tail (m is in the row: no NaN)
    while (at < V - 1 && load1(x + at) != m) ++at;
  *id = at;
  if (!prob) return;
  if (!std::isfinite(m)) {
    *p = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // exp8 clamps below at -87.3, so an id at -inf adds ~1e-38, nothing beside the max's 1
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (i = 0; i + 16 <= V; i += 16) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(load8(x + i), mv)));
    s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(load8(x + i + 8), mv)));
  }
  float sum = hsum(_mm256_add_ps(s0, s1));
  for (; i < V; ++i) sum += std::exp(load1(x + i) - m);
  *p = 1.0f / sum;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> qd_greedy_pick(const at::Tensor& logits, bool with_prob) {
  TORCH_CHECK(logits.device().is_cpu(), "greedy_pick: CPU tensors only");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "greedy_pick: bf16 or fp32 only");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_pick: logits [N, V], V > 0");
  const at::Tensor x = logits.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  at::Tensor ids = at::empty({N}, x.options().dtype(at::kLong));
  at::Tensor probs = at::empty({with_prob ? N : 0}, x.options().dtype(at::kFloat));
  int64_t* ip = ids.data_ptr<int64_t>();
  float* pp = with_prob ? probs.data_ptr<float>() : nullptr;
  const bool fp32 = x.scalar_type() == at::kFloat;
  const void* base = x.data_ptr();
  at::parallel_for(0, N, qd_rows_grain(V), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* p = with_prob ? pp + n : nullptr;  // written only with_prob
      if (fp32)
        pick_row(static_cast<const float*>(base) + n * V, V, with_prob, ip + n, p);
      else
        pick_row(static_cast<const u16*>(base) + n * V, V, with_prob, ip + n, p);
    }
  });
  return {ids, probs};
}
