// One decoder layer of the Llama family (Llama / Qwen2 / Qwen3 with a dense MLP; Qwen3-MoE and
// gpt-oss with their MoE block as one MoEBlock call) for the decode, verify and prompt rows of one
// sequence (`forward`) or of several packed in one step (`forward_many`), as a sequence of this
// extension's kernels called from C++ (kernels/dense_layer.py owns the contract and when it
// runs).
//
// Contract: DenseLayer(...).forward(h, residual, cos, sin, k_cache, v_cache, start) returns
// exactly what `DecoderLayer.forward_residual` returns for the same inputs when every op there
// takes its kernel: the same kernels run in the same order on the same operands, so the
// outputs are bitwise equal (tests/test_models.py checks it). The caller guarantees that path:
// the new rows of KV-cache sequences, a head size the attention kernel takes, projection operands in
// panels or int8 / int4 / GGUF blocks (kind 1 / 2 / 3 / 4 below), norm weights in h's dtype, and
// for a MoE layer a block the Python layer runs as the same one call (kernels/moe_gguf.py).
//
// Why: a 0.5B draft step ran ~5.5 ms of Python and torch dispatch around ~13 ms of GEMMs
// (24 layers x ~13 ops, ~230 us per layer); a C++ layer makes that one call per layer. A batched
// step paid that again per sequence (a cache write and an attention call per sequence per layer).
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "layer_parts.h"
#include "ops.h"

using qd_layer::make_operand;
using qd_layer::Operand;

class QdDenseLayer {
 public:
  // ops: qkv, o[, gate_up, down] each (kind, packed, scale or empty, n), the last two absent
  // for a MoE layer (moe: its MoEBlock; None: a dense MLP); q_norm / k_norm undefined when the
  // model has none (Qwen3 has them); o_bias, window (0: none) and sinks (fp32 [heads]):
  // gpt-oss's.
  QdDenseLayer(int64_t layer, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
               double scale, at::Tensor input_norm, at::Tensor post_norm,
               c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
               std::vector<int64_t> kinds, std::vector<std::vector<at::Tensor>> packed,
               std::vector<at::Tensor> scales, std::vector<std::vector<int64_t>> ns,
               std::vector<std::vector<int64_t>> fmts, c10::optional<at::Tensor> qkv_bias,
               c10::optional<at::Tensor> o_bias, int64_t window, c10::optional<at::Tensor> sinks,
               const py::object& moe)
      : layer_(layer),
        heads_(heads),
        kv_heads_(kv_heads),
        d_(head_dim),
        eps_(eps),
        scale_(scale),
        input_norm_(std::move(input_norm)),
        post_norm_(std::move(post_norm)),
        q_norm_(std::move(q_norm)),
        k_norm_(std::move(k_norm)),
        window_(window),
        sinks_(std::move(sinks)) {
    if (!moe.is_none()) moe_ = qd_moe_block_of(moe);
    const size_t n = moe_ ? 2 : 4;
    TORCH_CHECK(kinds.size() == n && packed.size() == n && scales.size() == n && ns.size() == n &&
                    fmts.size() == n,
                "quickdraft DenseLayer: 4 operands (qkv, o, gate_up, down); 2 with a MoE block");
    for (size_t i = 0; i < n; ++i)
      ops_[i] = make_operand(kinds[i], packed[i], scales[i], ns[i], fmts[i],
                             i == 0   ? qkv_bias
                             : i == 1 ? o_bias
                                      : c10::optional<at::Tensor>());
  }

  // h [n, hidden]: the previous layer's MLP output (the embedding for layer 0); residual: the
  // residual stream before adding h (None for layer 0); cos, sin [n, head_dim] fp32; k_cache,
  // v_cache [layers, kv_heads, capacity, head_dim]: the sequence's own rows, from key `shared`
  // on (k_pages, v_pages: the shared blocks of the keys before it, attention.cpp's
  // `attend_paged`; none: shared = 0); start: the sequence's committed length.
  // Writes the rows' keys/values at [start, start + n) and returns (mlp output, residual).
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& h,
                                             const c10::optional<at::Tensor>& residual,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             int64_t start, const c10::optional<at::Tensor>& k_pages,
                                             const c10::optional<at::Tensor>& v_pages,
                                             int64_t block) const {
    at::Tensor res, q, k, v;
    std::tie(res, q, k, v) = rotated_qkv(h, residual, cos, sin);
    const at::Tensor attn = attend_one(q, k, v, k_cache, v_cache, start, k_pages, v_pages, block);
    return mlp(res, attn);
  }

  // The rows of several sequences packed in order (a continuous-batching step): counts[i] rows
  // of sequence i, with its own caches, committed length, shared blocks (an empty k_pages /
  // v_pages tensor: none) and block size. The same kernels in the same order as the Python
  // layer's loop over the sequences, so the same bits.
  std::tuple<at::Tensor, at::Tensor> forward_many(
      const at::Tensor& h, const c10::optional<at::Tensor>& residual, const at::Tensor& cos,
      const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
      const std::vector<at::Tensor>& v_caches, const std::vector<int64_t>& starts,
      const std::vector<int64_t>& counts, const std::vector<at::Tensor>& k_pages,
      const std::vector<at::Tensor>& v_pages, const std::vector<int64_t>& blocks) const {
    const size_t m = counts.size();
    TORCH_CHECK(k_caches.size() == m && v_caches.size() == m && starts.size() == m &&
                    k_pages.size() == m && v_pages.size() == m && blocks.size() == m,
                "quickdraft DenseLayer.forward_many: one cache, start, page table and block per "
                "sequence");
    at::Tensor res, q, k, v;
    std::tie(res, q, k, v) = rotated_qkv(h, residual, cos, sin);
    std::vector<at::Tensor> outs;
    outs.reserve(m);
    int64_t row = 0;
    for (size_t i = 0; i < m; ++i) {
      const int64_t n = counts[i];
      TORCH_CHECK(n >= 0 && row + n <= q.size(0),
                  "quickdraft DenseLayer.forward_many: counts must be >= 0 and sum to the rows");
      if (n == 0) continue;  // a sequence with no new rows: nothing to write or attend
      outs.push_back(attend_one(q.narrow(0, row, n), k.narrow(0, row, n), v.narrow(0, row, n),
                                k_caches[i], v_caches[i], starts[i], k_pages[i], v_pages[i],
                                blocks[i]));
      row += n;
    }
    TORCH_CHECK(row == q.size(0),
                "quickdraft DenseLayer.forward_many: counts must sum to the rows");
    return mlp(res, outs.size() == 1 ? outs[0] : at::cat(outs));
  }

 private:
  // (residual, q [n, H, d], k, v [n, Hkv, d]): the input norm, the qkv projection, the q / k
  // norms (Qwen3) and rope
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rotated_qkv(
      const at::Tensor& h, const c10::optional<at::Tensor>& residual, const at::Tensor& cos,
      const at::Tensor& sin) const {
    at::Tensor res, x;
    if (residual.has_value() && residual->defined()) {
      std::tie(res, x) = qd_add_rms_norm(*residual, h, input_norm_, eps_, 0.0);
    } else {
      res = h;
      x = qd_rms_norm(h, input_norm_, eps_, 0.0);
    }
    const int64_t n = x.size(0), qw = heads_ * d_, kw = kv_heads_ * d_;
    const at::Tensor qkv = ops_[0](x);
    at::Tensor q = qkv.narrow(1, 0, qw).view({n, heads_, d_});
    at::Tensor k = qkv.narrow(1, qw, kw).view({n, kv_heads_, d_});
    const at::Tensor v = qkv.narrow(1, qw + kw, kw).view({n, kv_heads_, d_});
    if (q_norm_.has_value() && k_norm_.has_value()) {
      q = qd_rms_norm(q, *q_norm_, eps_, 0.0);
      k = qd_rms_norm(k, *k_norm_, eps_, 0.0);
    }
    return {res, qd_rope(q, cos, sin), qd_rope(k, cos, sin), v};
  }

  // One sequence's rows: their keys / values written at [start, start + n), then attended.
  at::Tensor attend_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t start,
                        const c10::optional<at::Tensor>& k_pages,
                        const c10::optional<at::Tensor>& v_pages, int64_t block) const {
    return qd_layer::write_and_attend(q, k, v, k_cache, v_cache, layer_, start, k_pages, v_pages,
                                      block, scale_, window_, sinks_);
  }

  // (mlp output, residual) after the attention: o projection, post norm, MLP or MoE block
  std::tuple<at::Tensor, at::Tensor> mlp(const at::Tensor& res, const at::Tensor& attn) const {
    at::Tensor r, x;
    std::tie(r, x) = qd_add_rms_norm(res, ops_[1](attn), post_norm_, eps_, 0.0);
    if (moe_) return {qd_moe_block_forward(*moe_, x), r};
    return {ops_[3](qd_silu_mul(ops_[2](x))), r};
  }

  int64_t layer_, heads_, kv_heads_, d_;
  double eps_, scale_;
  at::Tensor input_norm_, post_norm_;
  c10::optional<at::Tensor> q_norm_, k_norm_;
  int64_t window_;
  c10::optional<at::Tensor> sinks_;
  std::shared_ptr<const QdMoEBlock> moe_;  // null: a dense MLP (ops_[2], ops_[3])
  Operand ops_[4];
};

void qd_register_dense_layer(py::module_& m) {
  py::class_<QdDenseLayer>(m, "DenseLayer")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, std::vector<int64_t>,
                    std::vector<std::vector<at::Tensor>>, std::vector<at::Tensor>,
                    std::vector<std::vector<int64_t>>, std::vector<std::vector<int64_t>>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t,
                    c10::optional<at::Tensor>, const py::object&>(),
           py::arg("layer"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("eps"), py::arg("scale"), py::arg("input_norm"), py::arg("post_norm"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("kinds"), py::arg("packed"),
           py::arg("scales"), py::arg("ns"), py::arg("fmts"), py::arg("qkv_bias"),
           py::arg("o_bias") = py::none(), py::arg("window") = 0, py::arg("sinks") = py::none(),
           py::arg("moe") = py::none())
      .def("forward", &QdDenseLayer::forward, py::arg("h"), py::arg("residual"), py::arg("cos"),
           py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"),
           py::arg("k_pages") = py::none(), py::arg("v_pages") = py::none(),
           py::arg("block") = 1, py::call_guard<py::gil_scoped_release>())
      .def("forward_many", &QdDenseLayer::forward_many, py::arg("h"), py::arg("residual"),
           py::arg("cos"), py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"),
           py::arg("starts"), py::arg("counts"), py::arg("k_pages"), py::arg("v_pages"),
           py::arg("blocks"), py::call_guard<py::gil_scoped_release>());
}
