// The Gated DeltaNet delta rule over one short chunk (a decode step or a verify) and the
// commit of kept updates, for AVX2 + FMA CPUs. Bound in bindings.cpp; the Python-facing contract
// and the torch references are quickdraft/kernels/gdn.py's.
//
//   gdn_delta(y [T, C] fp32, g [T, H], beta [T, H], state [H, dk, dv], k_heads
//             [, pending k [H, m, dk], d [H, m, dv], g [H, m]])
//       -> out [T, H, dv], k [H, T, dk], d [H, T, dv], g [H, T]   (all fp32)
//   With pending updates (the last forward's kept ones, not yet committed into the state)
//   each head's state is first advanced by them in place, as gdn_advance does, then read:
//   the bits of gdn_advance followed by gdn_delta, in one pass over the state from DRAM that
//   also reads token 0's S^T k and S^T q (step_read_rows). qd_gdn_delta_raw (ops.h) is the
//   same on raw rows: hybrid_layer.cpp writes the kept updates straight into the cache.
//   gdn_advance(state [H, dk, dv] fp32, k [H, m, dk], d [H, m, dv], g [H, m])   in place
//   gdn_prefill(y [T, C], g [T, H], beta [T, H], state [H, dk, dv], k_heads) -> out [T, H, dv]
//   A prompt chunk of any length: the state advanced in place token by token (the bits of T
//   decode steps, each committed by gdn_advance), each token's update and the next token's
//   read of the state in one pass (step_read; qd_gdn_delta_raw's commit mode). Before it, a
//   prompt ran gdn_delta per 64 tokens into a scratch state and then gdn_advance over the
//   same updates: the state was stepped twice and read once a token; a qwen35moe pp512 spent
//   ~18 % of its samples there.
//
// Why: a verify's delta rule in torch is ~40 ops (cat, bmm, a triangular solve...) on tensors
// of a few KB, each costing its dispatch, not its arithmetic. All math fp32.
//
// gdn_delta is kernels/gdn.py's delta_rule_updates after prepare_qk, for one chunk of T tokens,
// as the recurrence itself, token by token: with q, k L2-normalised (q also scaled by
// dk^-0.5), e_t = exp(g_t) and S the state before token t (S0, the committed state, for t = 0),
//   a = S^T k_t,  b = S^T q_t                    (read_state: two vectors, one pass; for
//                                                  t > 0 read in the pass that made S)
//   d_t   = beta_t (v_t - e_t a)
//   out_t = e_t b + (q_t . k_t) d_t               (= S_t^T q_t)
//   S_t   = e_t S + k_t d_t^T                     (step_read: step_rows' instructions, into
//                                                  a scratch copy: S0 is never written)
// gdn_advance applies the first m kept (k, d, g) to the committed state with the same
// step_rows. So token t of a verify reads bitwise the state that t decode steps (each
// committing one token) leave, and computes from it with the same code: a verify's rows equal
// decode steps' bit for bit (batch invariance). The cost over the closed chunk form (which read
// the state once for all T tokens) is T - 1 more reads and writes of a per-head scratch copy
// (dk x dv fp32, 64 KiB at 128 x 128) that stays in L2.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// ---- gated delta rule over one short chunk ---------------------------------------------------

// acc[g][j] (+)= sum_{i < rows} coef[g][i] * S[i][j0 + j] for G coefficient vectors, j in
// [0, 8J): one pass over a tile of the state (`init`: start from zero, else accumulate).
template <int G, int J>
void read_block(const float* S, int64_t rows, int64_t dv, int64_t j0, const float* const* coef,
                float* const* acc, bool init) {
  __m256 a[G][J];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j)
      a[g][j] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[g] + j0 + 8 * j);
  for (int64_t i = 0; i < rows; ++i) {
    __m256 s[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) s[j] = _mm256_loadu_ps(S + i * dv + j0 + 8 * j);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const __m256 c = _mm256_broadcast_ss(coef[g] + i);
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) a[g][j] = _mm256_fmadd_ps(c, s[j], a[g][j]);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) _mm256_storeu_ps(acc[g] + j0 + 8 * j, a[g][j]);
}

// out[g] = S^T coef[g] for n <= 10 coefficient vectors. The state is walked in tiles of 16
// whole rows (8 KiB at dv = 128): a column block over all dk rows would stride by a row
// (512 B) and keep only a few L1 sets busy, so every tile row would come from L2 again.
void read_state(const float* S, int64_t dk, int64_t dv, const float* const* coef,
                float* const* out, int n) {
  const int J = n <= 2 && dv % 32 == 0 ? 4 : (n <= 4 && dv % 16 == 0 ? 2 : 1);
  constexpr int64_t kRows = 16;
  for (int64_t i0 = 0; i0 < dk; i0 += kRows) {
    const int64_t rows = std::min(kRows, dk - i0);
    const float* c[10];
    for (int g = 0; g < n; ++g) c[g] = coef[g] + i0;
    const float* tile = S + i0 * dv;
    const bool init = i0 == 0;
    for (int64_t j0 = 0; j0 < dv; j0 += 8 * J) {
      switch (n * 10 + J) {
#define QD_CASE(G, JJ) \
  case G * 10 + JJ:    \
    read_block<G, JJ>(tile, rows, dv, j0, c, out, init); \
    break;
        QD_CASE(1, 4) QD_CASE(2, 4) QD_CASE(1, 2) QD_CASE(2, 2) QD_CASE(3, 2) QD_CASE(4, 2)
        QD_CASE(1, 1) QD_CASE(2, 1) QD_CASE(3, 1) QD_CASE(4, 1) QD_CASE(5, 1) QD_CASE(6, 1)
        QD_CASE(7, 1) QD_CASE(8, 1) QD_CASE(9, 1) QD_CASE(10, 1)
#undef QD_CASE
        default:
          TORCH_CHECK(false, "gdn_delta: bad read block ", n, "x", J);
      }
    }
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = 0.0f;
  for (float l : lanes) s += l;
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// the most kept updates gdn_advance applies in one call (kernels/gdn.py CHUNK_SIZE)
constexpr int64_t kMaxAdvance = 64;

// m token updates S <- e_j S + k_j d_j^T, in order, on rows [0, rows) of S (row i scales by
// e_j and adds k_j[i] d_j), row by row: a row stays in L1 across the m updates, so applying m
// kept updates costs one pass over the state. Every element takes the same instructions (an
// fma of k_j[i] d_j[c] onto e_j S[i][c]) whatever m is and whether src == dst: the commit
// (gdn_advance) and a verify's in-chunk states run this one function.
void step_rows(const float* src, float* dst, int64_t rows, int64_t dv, int m, const float* e,
               const float* const* k, const float* const* d) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < dv; c += 8) {
      __m256 s = _mm256_loadu_ps(src + i * dv + c);
      for (int j = 0; j < m; ++j)
        s = _mm256_fmadd_ps(_mm256_set1_ps(k[j][i]), _mm256_loadu_ps(d[j] + c),
                            _mm256_mul_ps(_mm256_set1_ps(e[j]), s));
      _mm256_storeu_ps(dst + i * dv + c, s);
    }
  }
}

// m token updates of the state, src -> dst (in place when they are one), with step_rows'
// instructions, while reading the new state for the next token: ks = S^T kn, qs = S^T qn
// (read_state's FMA chains: per column, over the rows in order from zero). One pass over the
// state instead of a step and a read; the bits of step_rows then read_state.
template <int J>
void step_read(const float* src, float* dst, int64_t dk, int64_t dv, int m, const float* e,
               const float* const* k, const float* const* d, const float* kn, const float* qn,
               float* ks, float* qs) {
  for (int64_t j0 = 0; j0 < dv; j0 += 8 * J) {
    __m256 ak[J], aq[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) ak[j] = aq[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      const __m256 kni = _mm256_set1_ps(kn[i]), qni = _mm256_set1_ps(qn[i]);
      __m256 s[J];
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) s[j] = _mm256_loadu_ps(src + i * dv + j0 + 8 * j);
      for (int u = 0; u < m; ++u) {
        const __m256 ku = _mm256_set1_ps(k[u][i]), eu = _mm256_set1_ps(e[u]);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j)
          s[j] = _mm256_fmadd_ps(ku, _mm256_loadu_ps(d[u] + j0 + 8 * j), _mm256_mul_ps(eu, s[j]));
      }
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) {
        _mm256_storeu_ps(dst + i * dv + j0 + 8 * j, s[j]);
        ak[j] = _mm256_fmadd_ps(kni, s[j], ak[j]);
        aq[j] = _mm256_fmadd_ps(qni, s[j], aq[j]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      _mm256_storeu_ps(ks + j0 + 8 * j, ak[j]);
      _mm256_storeu_ps(qs + j0 + 8 * j, aq[j]);
    }
  }
}

// step_read row by row (each row's columns in turn, the column sums kept in memory, in L1)
void step_read_rows(const float* src, float* dst, int64_t dk, int64_t dv, int m, const float* e,
                    const float* const* k, const float* const* d, const float* kn,
                    const float* qn, float* ks, float* qs) {
  for (int64_t c = 0; c < dv; c += 8) {
    _mm256_storeu_ps(ks + c, _mm256_setzero_ps());
    _mm256_storeu_ps(qs + c, _mm256_setzero_ps());
  }
  for (int64_t i = 0; i < dk; ++i) {
    const __m256 kni = _mm256_set1_ps(kn[i]), qni = _mm256_set1_ps(qn[i]);
    for (int64_t c = 0; c < dv; c += 8) {
      __m256 sv = _mm256_loadu_ps(src + i * dv + c);
      for (int u = 0; u < m; ++u)
        sv = _mm256_fmadd_ps(_mm256_set1_ps(k[u][i]), _mm256_loadu_ps(d[u] + c),
                             _mm256_mul_ps(_mm256_set1_ps(e[u]), sv));
      _mm256_storeu_ps(dst + i * dv + c, sv);
      _mm256_storeu_ps(ks + c, _mm256_fmadd_ps(kni, sv, _mm256_loadu_ps(ks + c)));
      _mm256_storeu_ps(qs + c, _mm256_fmadd_ps(qni, sv, _mm256_loadu_ps(qs + c)));
    }
  }
}

// step_read's instructions in the order that suits where the state is: a state coming from
// memory row by row, sequentially (`step_read_rows`: a decode step's pending commit streams
// the layer's 2 MiB from DRAM, 84 against 164 us with column blocks of 16, 24 states in
// alternation); one in L2 (a verify's or a prompt's next token) in column blocks of 32 with the
// sums in registers (6.7 against 8.6 ms for 256 prompt tokens of 32 heads of 128 x 128). Every
// order gives the same bits: each element and each column's sum sees the same operations.
void step_read_any(const float* src, float* dst, int64_t dk, int64_t dv, int m, const float* e,
                   const float* const* k, const float* const* d, const float* kn,
                   const float* qn, float* ks, float* qs, bool from_memory) {
  if (from_memory)
    step_read_rows(src, dst, dk, dv, m, e, k, d, kn, qn, ks, qs);
  else if (dv % 32 == 0)
    step_read<4>(src, dst, dk, dv, m, e, k, d, kn, qn, ks, qs);
  else if (dv % 16 == 0)
    step_read<2>(src, dst, dk, dv, m, e, k, d, kn, qn, ks, qs);
  else
    step_read<1>(src, dst, dk, dv, m, e, k, d, kn, qn, ks, qs);
}

// q, k of token t for value head h's key head: L2-normalised, q also scaled by dk^-0.5
inline void normalise_qk(const float* q, const float* k, int64_t dk, float scale, float* qn,
                         float* kn) {
  const float qinv = 1.0f / std::sqrt(dot(q, q, dk) + 1e-6f);
  const float kinv = 1.0f / std::sqrt(dot(k, k, dk) + 1e-6f);
  for (int64_t i = 0; i < dk; ++i) {
    qn[i] = q[i] * qinv * scale;
    kn[i] = k[i] * kinv;
  }
}

}  // namespace

void qd_gdn_delta_raw(const QdDeltaIO& io, int64_t H, int64_t dk, int64_t dv, int64_t Tn,
                      int64_t k_heads) {
  const int64_t C = io.C, kd = k_heads * dk, group = H / k_heads, m = io.m;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const bool pending = m > 0;
  // A one-token step over small heads is ~1 us of work per head: a second thread's fork/join
  // costs more; past ~1 MiB of state (or with a pass to advance it) two threads stream it.
  const int64_t grain = Tn == 1 && !pending && H * dk * dv < (int64_t{1} << 18) ? H : 1;
  at::parallel_for(0, H, grain, [&](int64_t h0, int64_t h1) {
    // this token's and the next one's normalised q and k, the update's d: written to the
    // outputs only after the head's pending updates (which may share their rows) are read
    std::vector<float> qn(2 * dk), kn(2 * dk), ks(dv), qs(dv), dt(dv);
    // the state inside the chunk (a commit steps the state itself)
    std::vector<float> work(Tn > 1 && !io.commit ? dk * dv : 0);
    float e[kMaxAdvance];
    const float* kj_p[kMaxAdvance];
    const float* dj_p[kMaxAdvance];
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t hk = h / group;
      float* S0 = io.state + h * dk * dv;
      auto norm = [&](int64_t t) {
        normalise_qk(io.y + t * C + hk * dk, io.y + t * C + kd + hk * dk, dk, scale,
                     qn.data() + (t % 2) * dk, kn.data() + (t % 2) * dk);
      };
      norm(0);
      if (pending) {  // gdn_advance's step for this head, in place, then token 0's read
        for (int64_t j = 0; j < m; ++j) {
          e[j] = std::exp(io.pg[h * io.pg_hs + j]);
          kj_p[j] = io.pk + h * io.pk_hs + j * dk;
          dj_p[j] = io.pd + h * io.pd_hs + j * dv;
        }
        step_read_any(S0, S0, dk, dv, static_cast<int>(m), e, kj_p, dj_p, kn.data(), qn.data(),
                      ks.data(), qs.data(), true);
      } else {
        const float* coef[2] = {kn.data(), qn.data()};
        float* res[2] = {ks.data(), qs.data()};
        read_state(S0, dk, dv, coef, res, 2);
      }
      const float* S = S0;
      for (int64_t t = 0; t < Tn; ++t) {
        const float* knt = kn.data() + (t % 2) * dk;
        const float* qt = qn.data() + (t % 2) * dk;
        const float gt = io.g[t * H + h];
        const float et = std::exp(gt), bt = io.beta[t * H + h];
        const float kq = dot(qt, knt, dk);
        const float* v = io.y + t * C + 2 * kd + h * dv;
        float* o = io.out + t * io.out_ts + h * dv;
        for (int64_t i = 0; i < dv; ++i) dt[i] = (v[i] - et * ks[i]) * bt;
        for (int64_t i = 0; i < dv; ++i) o[i] = et * qs[i] + kq * dt[i];
        if (io.k) {
          std::memcpy(io.k + h * io.k_hs + t * dk, knt, dk * sizeof(float));
          std::memcpy(io.d + h * io.d_hs + t * dv, dt.data(), dv * sizeof(float));
          io.gout[h * io.gout_hs + t] = gt;
        }
        const float* kj[1] = {knt};
        const float* dj[1] = {dt.data()};
        if (t + 1 < Tn) {  // S_t, the state the next token reads, and its read
          norm(t + 1);
          float* next = io.commit ? S0 : work.data();
          step_read_any(S, next, dk, dv, 1, &et, kj, dj, kn.data() + ((t + 1) % 2) * dk,
                        qn.data() + ((t + 1) % 2) * dk, ks.data(), qs.data(), false);
          S = next;
        } else if (io.commit) {  // the last token's update alone
          step_rows(S0, S0, dk, dv, 1, &et, kj, dj);
        }
      }
    }
  });
}

namespace {

// gdn_delta's and gdn_prefill's inputs: y [T, 2 Hk dk + H dv], g and beta [T, H], state
// [H, dk, dv], all CPU fp32
void check_inputs(const char* fn, const at::Tensor& y, const at::Tensor& g,
                  const at::Tensor& beta, const at::Tensor& state, int64_t k_heads) {
  for (const at::Tensor* t : {&y, &g, &beta, &state})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, fn,
                ": CPU fp32 tensors only");
  TORCH_CHECK(state.dim() == 3 && y.dim() == 2 && g.dim() == 2, fn,
              ": y [T, C], g / beta [T, H], state [H, dk, dv]");
  const int64_t H = state.size(0), dk = state.size(1), dv = state.size(2);
  TORCH_CHECK(k_heads > 0 && H % k_heads == 0 && dk % 8 == 0 && dv % 8 == 0, fn,
              ": heads must group evenly and head dims be multiples of 8");
  TORCH_CHECK(y.size(1) == 2 * k_heads * dk + H * dv, fn, ": y must be [T, 2 Hk dk + H dv]");
  TORCH_CHECK(g.sizes() == beta.sizes() && g.size(0) == y.size(0) && g.size(1) == H, fn,
              ": g and beta must be [T, H]");
}

// The raw call's view of checked, contiguous inputs (the rest of QdDeltaIO left to the caller)
QdDeltaIO io_of(const at::Tensor& y, const at::Tensor& g, const at::Tensor& beta,
                const at::Tensor& state) {
  QdDeltaIO io;
  io.y = y.data_ptr<float>();
  io.C = y.size(1);
  io.g = g.data_ptr<float>();
  io.beta = beta.data_ptr<float>();
  io.state = state.data_ptr<float>();
  return io;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qd_gdn_delta(
    const at::Tensor& y_in, const at::Tensor& g_in, const at::Tensor& beta_in,
    const at::Tensor& state_in, int64_t k_heads, const c10::optional<at::Tensor>& pending_k,
    const c10::optional<at::Tensor>& pending_d, const c10::optional<at::Tensor>& pending_g) {
  check_inputs("gdn_delta", y_in, g_in, beta_in, state_in, k_heads);
  const int64_t H = state_in.size(0), dk = state_in.size(1), dv = state_in.size(2);
  const int64_t Tn = y_in.size(0);
  const at::Tensor y = y_in.contiguous(), g = g_in.contiguous(), beta = beta_in.contiguous();
  const bool pending = pending_g.has_value() && pending_g->size(1) > 0;
  TORCH_CHECK(pending_k.has_value() == pending_g.has_value() &&
                  pending_d.has_value() == pending_g.has_value(),
              "gdn_delta: pending k, d and g come together");
  TORCH_CHECK(!pending || state_in.is_contiguous(),
              "gdn_delta: a state advanced in place must be contiguous");
  const at::Tensor state = state_in.contiguous();
  at::Tensor pk, pd, pg;
  int64_t m = 0;
  if (pending) {
    pk = pending_k->contiguous(), pd = pending_d->contiguous(), pg = pending_g->contiguous();
    m = pg.size(1);
    TORCH_CHECK(m <= kMaxAdvance && pg.size(0) == H && pk.size(0) == H && pk.size(1) == m &&
                    pk.size(2) == dk && pd.size(0) == H && pd.size(1) == m && pd.size(2) == dv,
                "gdn_delta: pending k [H, m, dk], d [H, m, dv], g [H, m], m <= ", kMaxAdvance);
    for (const at::Tensor* t : {&pk, &pd, &pg})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                  "gdn_delta: pending updates must be CPU fp32");
  }
  auto opts = y.options();
  at::Tensor out = at::empty({Tn, H, dv}, opts), k_out = at::empty({H, Tn, dk}, opts);
  at::Tensor d_out = at::empty({H, Tn, dv}, opts), g_out = at::empty({H, Tn}, opts);
  QdDeltaIO io = io_of(y, g, beta, state);
  io.m = m;
  if (pending) {
    io.pk = pk.data_ptr<float>(), io.pk_hs = m * dk;
    io.pd = pd.data_ptr<float>(), io.pd_hs = m * dv;
    io.pg = pg.data_ptr<float>(), io.pg_hs = m;
  }
  io.out = out.data_ptr<float>(), io.out_ts = H * dv;
  io.k = k_out.data_ptr<float>(), io.k_hs = Tn * dk;
  io.d = d_out.data_ptr<float>(), io.d_hs = Tn * dv;
  io.gout = g_out.data_ptr<float>(), io.gout_hs = Tn;
  qd_gdn_delta_raw(io, H, dk, dv, Tn, k_heads);
  return {out, k_out, d_out, g_out};
}

void qd_gdn_advance(at::Tensor state, const at::Tensor& k_in, const at::Tensor& d_in,
                    const at::Tensor& g_in) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&state), &k_in, &d_in, &g_in})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "gdn_advance: CPU fp32 tensors only");
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && k_in.dim() == 3 && d_in.dim() == 3 &&
                  g_in.dim() == 2,
              "gdn_advance: state [H, dk, dv] contiguous, k [H, m, dk], d [H, m, dv], g [H, m]");
  const int64_t H = state.size(0), dk = state.size(1), dv = state.size(2), m = g_in.size(1);
  TORCH_CHECK(dv % 8 == 0 && m <= kMaxAdvance && g_in.size(0) == H && k_in.size(0) == H &&
                  k_in.size(1) == m && k_in.size(2) == dk && d_in.size(0) == H &&
                  d_in.size(1) == m && d_in.size(2) == dv,
              "gdn_advance: shapes must agree, dv % 8 == 0, m <= ", kMaxAdvance);
  if (m == 0) return;
  const at::Tensor k = k_in.contiguous(), d = d_in.contiguous(), g = g_in.contiguous();
  float* sp = state.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    float e[kMaxAdvance];
    const float* kj[kMaxAdvance];
    const float* dj[kMaxAdvance];
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t j = 0; j < m; ++j) {
        e[j] = std::exp(gp[h * m + j]);
        kj[j] = kp + (h * m + j) * dk;
        dj[j] = dp + (h * m + j) * dv;
      }
      float* S = sp + h * dk * dv;
      step_rows(S, S, dk, dv, static_cast<int>(m), e, kj, dj);
    }
  });
}

at::Tensor qd_gdn_prefill(const at::Tensor& y_in, const at::Tensor& g_in, const at::Tensor& beta_in,
                          at::Tensor state, int64_t k_heads) {
  check_inputs("gdn_prefill", y_in, g_in, beta_in, state, k_heads);
  TORCH_CHECK(state.is_contiguous(), "gdn_prefill: the state (advanced in place) contiguous");
  const int64_t H = state.size(0), dk = state.size(1), dv = state.size(2), Tn = y_in.size(0);
  const at::Tensor y = y_in.contiguous(), g = g_in.contiguous(), beta = beta_in.contiguous();
  at::Tensor out = at::empty({Tn, H, dv}, y.options());
  if (Tn == 0) return out;
  QdDeltaIO io = io_of(y, g, beta, state);
  io.commit = true;
  io.out = out.data_ptr<float>(), io.out_ts = H * dv;
  qd_gdn_delta_raw(io, H, dk, dv, Tn, k_heads);
  return out;
}
