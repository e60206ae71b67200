// The extension's functions that one of its files calls in another: bindings.cpp binds them
// to Python, dense_layer.cpp chains them into a decoder layer, every GEMM counts its calls.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

// Rows a task takes when a per-row op (a norm, the activations' int8 quantization) splits a
// prompt's rows between the threads: ~32K values a task, so that a decode step's or a verify's
// few rows stay on the calling thread (a fork/join would cost more than they do). Each row is
// computed alone, by the same code, wherever the split falls.
inline int64_t qd_rows_grain(int64_t row_len) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(row_len, 1));
}

// linear_bf16.cpp
bool qd_linear_eligible(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias, int64_t max_m);
at::Tensor qd_linear(const at::Tensor& x, const at::Tensor& w,
                     const c10::optional<at::Tensor>& bias, int64_t max_m);
void qd_count_kernel_call();
int64_t qd_kernel_calls();
// norm_rope.cpp
at::Tensor qd_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset);
std::tuple<at::Tensor, at::Tensor> qd_add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                   const at::Tensor& w, double eps,
                                                   double offset);
at::Tensor qd_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// gdn_ops.cpp
at::Tensor qd_silu_mul(const at::Tensor& gate_up);
at::Tensor qd_gelu_mul(const at::Tensor& gate_up);  // Gemma's GeGLU
at::Tensor qd_sigmoid(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> qd_gdn_gates(const at::Tensor& a, const at::Tensor& b,
                                                const at::Tensor& a_log, const at::Tensor& dt_bias);
at::Tensor qd_gated_rms_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& z,
                             double eps);
at::Tensor qd_causal_conv_silu(const at::Tensor& x, const at::Tensor& window,
                               const at::Tensor& weight);
// pick.cpp
std::tuple<at::Tensor, at::Tensor> qd_greedy_pick(const at::Tensor& logits, bool with_prob);
// gdn_delta.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qd_gdn_delta(
    const at::Tensor& y, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
    int64_t k_heads, const c10::optional<at::Tensor>& pending_k,
    const c10::optional<at::Tensor>& pending_d, const c10::optional<at::Tensor>& pending_g);
void qd_gdn_advance(at::Tensor state, const at::Tensor& k, const at::Tensor& d,
                    const at::Tensor& g);
// gdn_delta on raw rows (hybrid_layer.cpp writes a decode step's updates straight into its
// checkpoint slots): y [T, C], g and beta [T, H], state [H, dk, dv] contiguous (advanced in
// place by the m pending updates first); per head h: pending k at pk + h pk_hs (+ j dk), d at
// pd + h pd_hs (+ j dv), g at pg + h pg_hs (+ j); out row t of head h at out + t out_ts + h dv,
// the kept updates at k + h k_hs + t dk, d + h d_hs + t dv, gout + h gout_hs + t (none where
// k is null). The outputs may share rows with the pending updates (a head's are read before its
// outputs are written). `commit` (gdn_prefill): the state itself advanced through every token,
// the last one's update included, instead of a scratch copy for the tokens after the first.
struct QdDeltaIO {
  const float* y = nullptr;
  int64_t C = 0;
  const float* g = nullptr;
  const float* beta = nullptr;
  float* state = nullptr;
  int64_t m = 0;
  const float *pk = nullptr, *pd = nullptr, *pg = nullptr;
  int64_t pk_hs = 0, pd_hs = 0, pg_hs = 0;
  float* out = nullptr;
  int64_t out_ts = 0;
  float *k = nullptr, *d = nullptr, *gout = nullptr;
  int64_t k_hs = 0, d_hs = 0, gout_hs = 0;
  bool commit = false;
};
void qd_gdn_delta_raw(const QdDeltaIO& io, int64_t H, int64_t dk, int64_t dv, int64_t T,
                      int64_t k_heads);
at::Tensor qd_gdn_prefill(const at::Tensor& y, const at::Tensor& g, const at::Tensor& beta,
                          at::Tensor state, int64_t k_heads);
// linear_q4.cpp
bool qd_linear_q4_eligible(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const c10::optional<at::Tensor>& bias);
at::Tensor qd_linear_q4(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const c10::optional<at::Tensor>& bias);
// linear_gguf.cpp
bool qd_linear_gguf_eligible(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                             const std::vector<int64_t>& fmts, const std::vector<int64_t>& ns,
                             const c10::optional<at::Tensor>& bias);
at::Tensor qd_linear_gguf(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                          const std::vector<int64_t>& fmts, const std::vector<int64_t>& ns,
                          const c10::optional<at::Tensor>& bias);
int64_t qd_gguf_isa(int64_t level);
// gguf_rows.cpp
std::vector<int64_t> qd_gguf_rows_formats();
at::Tensor qd_gguf_rows(const at::Tensor& raw, const at::Tensor& ids, int64_t type, int64_t dim);
// panel_driver.h's, for every panel kernel; bytes_32 the 32-value GGUF formats' in one-row passes (-1: bytes)
int64_t qd_set_prefetch_bytes(int64_t bytes, int64_t bytes_32);
// linear_panel.cpp
bool qd_linear_panel_eligible(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const c10::optional<at::Tensor>& bias);
at::Tensor qd_linear_panel(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const c10::optional<at::Tensor>& bias);
int64_t qd_panel_isa(int64_t level);
// linear_i8.cpp
bool qd_linear_i8_eligible(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias);
at::Tensor qd_linear_i8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias);
// attention.cpp
bool qd_attend_eligible(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        int64_t start, int64_t shared = 0);
int64_t qd_attend_isa(int64_t level);
at::Tensor qd_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                     double scale, int64_t window = 0,
                     const c10::optional<at::Tensor>& sinks = c10::nullopt,
                     const c10::optional<at::Tensor>& ends = c10::nullopt);
at::Tensor qd_attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& k_pages,
                           const c10::optional<at::Tensor>& v_pages, int64_t block, int64_t layer,
                           int64_t start, double scale, int64_t window = 0,
                           const c10::optional<at::Tensor>& sinks = c10::nullopt,
                           const c10::optional<at::Tensor>& ends = c10::nullopt);
// dense_layer.cpp
void qd_register_dense_layer(py::module_& m);
// moe_gguf.cpp
class QdMoEGGUF;
// a copy of a Python-side MoEGGUF (call with the GIL held), for a C++ layer to keep
std::shared_ptr<const QdMoEGGUF> qd_moe_gguf_of(const py::handle& experts);
at::Tensor qd_moe_gguf_forward(const QdMoEGGUF& experts, const at::Tensor& x,
                               const at::Tensor& top_idx, const at::Tensor& top_weight);
class QdMoEBlock;
std::shared_ptr<const QdMoEBlock> qd_moe_block_of(const py::handle& block);  // as above
at::Tensor qd_moe_block_forward(const QdMoEBlock& block, const at::Tensor& x);
void qd_register_moe_gguf(py::module_& m);
// gemma4_layer.cpp
void qd_register_gemma4_layer(py::module_& m);
// hybrid_layer.cpp
void qd_register_hybrid_layers(py::module_& m);
