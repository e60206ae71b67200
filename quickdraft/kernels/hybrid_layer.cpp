// The decoder layers of a hybrid model (models/families/qwen3_next.py `HybridDecoderLayer`, Qwen3.5 /
// Qwen3.5-MoE layout), each as a sequence of this extension's kernels called from C++ for the
// decode and verify rows of one or several sequences (kernels/hybrid_layer.py owns the contracts
// and when they run): GDNLayer for the Gated DeltaNet layers, AttentionLayer for the gated
// full-attention ones.
//
// Contract: GDNLayer(...).forward(x, counts, convs, ssms, committed, pending, cp_inputs, cp_k,
// cp_d, cp_g) returns exactly what the Python layer returns for the same inputs on a forward
// that keeps every token's checkpoint (a decode step or a verify: HybridCache
// `keeps_checkpoints`), and leaves each cache as the Python layer leaves it: the conv window
// advanced by the pending inputs, the SSM state by the pending updates (in the delta rule's pass
// over it), this forward's inputs and updates in the checkpoint slots. The caller then sets
// the cache's pending count of this layer to 0, as `gdn_state_deferred` does.
// AttentionLayer(...).forward(x, cos, sin, k_caches, v_caches, starts, counts, k_pages,
// v_pages, blocks) returns what the Python layer returns, the new rows' keys and values written
// as KVCache.write writes them (after any shared prefix blocks, which it reads in place). Same
// kernels, same order, same bits (tests/test_gguf_qwen.py checks both).
//
// Why: a Gated DeltaNet layer is ~20 Python-level calls (the in-projection's split, gates,
// conv, delta rule, checkpoint copies, gated norm, the head gather, the norms, the MoE block)
// around 2 GEMMs and one MoE call, an attention layer ~15: ~0.2 ms a layer, 40 layers a token
// at Qwen3.6-35B-A3B's depth.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "layer_parts.h"
#include "ops.h"

using qd_layer::NamedOperands;
using qd_layer::Operand;
using qd_layer::operand_of;

namespace {

// The layer's MLP: its MoE block's one call, or a gated MLP (gate_up, down)
struct Mlp {
  std::shared_ptr<const QdMoEBlock> moe;
  Operand gate_up, down;

  Mlp(const NamedOperands& ops, const py::object& block) {
    if (!block.is_none()) {
      moe = qd_moe_block_of(block);
    } else {
      gate_up = operand_of(ops, "gate_up");
      down = operand_of(ops, "down");
    }
  }

  at::Tensor operator()(const at::Tensor& x) const {
    return moe ? qd_moe_block_forward(*moe, x) : down(qd_silu_mul(gate_up(x)));
  }
};

// HybridCache.gdn_state_deferred's conv window: the last `taps` rows of [window ; ins[:p]]
// (conv_window), in place; window [taps, C] contiguous, ins [slots, C], one dtype
void advance_window(const at::Tensor& window, const at::Tensor& ins, int64_t p) {
  if (p == 0) return;
  const int64_t taps = window.size(0);
  const size_t row = static_cast<size_t>(window.size(1) * window.element_size());
  const size_t in_row = static_cast<size_t>(ins.stride(0) * ins.element_size());
  char* w = static_cast<char*>(window.data_ptr());
  const char* in = static_cast<const char*>(ins.data_ptr());
  if (p < taps) std::memmove(w, w + p * row, (taps - p) * row);
  const int64_t from = std::max<int64_t>(0, p - taps), kept = p - from;
  for (int64_t r = 0; r < kept; ++r)
    std::memcpy(w + (taps - kept + r) * row, in + (from + r) * in_row, row);
}

// rows [0, src.size(0)) of dst = src, rows of one dtype and length (contiguous within a row)
void copy_rows(const at::Tensor& dst, const at::Tensor& src) {
  const size_t row = static_cast<size_t>(src.size(1) * src.element_size());
  for (int64_t r = 0; r < src.size(0); ++r)
    std::memcpy(static_cast<char*>(dst.data_ptr()) + r * dst.stride(0) * dst.element_size(),
                static_cast<const char*>(src.data_ptr()) + r * src.stride(0) * src.element_size(),
                row);
}

}  // namespace

class QdGDNLayer {
 public:
  // slot: the layer's index among the GDN layers (its cache slot); shape: k_heads, v_heads,
  // key_dim (dk), value_dim (dv); tensors: input_norm, post_norm (1 + w norms), conv_weight
  // [C, K], a_log and dt_bias (fp32), norm (the gated norm's weight [dv]), out_heads (the value
  // heads' order `out` expects, optional); ops: inp, out, and gate_up / down unless moe (the
  // layer's MoEBlock) is given.
  QdGDNLayer(int64_t slot, int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, double eps,
             std::unordered_map<std::string, at::Tensor> tensors,
             const NamedOperands& ops, const py::object& moe)
      : slot_(slot),
        k_heads_(k_heads),
        v_heads_(v_heads),
        dk_(dk),
        dv_(dv),
        eps_(eps),
        t_(std::move(tensors)),
        inp_(operand_of(ops, "inp")),
        out_(operand_of(ops, "out")),
        mlp_(ops, moe) {
    for (const char* n : {"input_norm", "post_norm", "conv_weight", "a_log", "dt_bias", "norm"})
      TORCH_CHECK(t_.count(n) && t_.at(n).defined(), "quickdraft GDNLayer: no ", n);
    out_heads_ = t_.count("out_heads") ? c10::optional<at::Tensor>(t_.at("out_heads"))
                                       : c10::nullopt;
  }

  int64_t slot() const { return slot_; }

  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                     const std::vector<at::Tensor>& convs, const std::vector<at::Tensor>& ssms,
                     const std::vector<int64_t>& committed, const std::vector<int64_t>& pending,
                     const std::vector<at::Tensor>& cp_inputs, const std::vector<at::Tensor>& cp_k,
                     const std::vector<at::Tensor>& cp_d,
                     const std::vector<at::Tensor>& cp_g) const {
    const size_t m = counts.size();
    TORCH_CHECK(convs.size() == m && ssms.size() == m && committed.size() == m &&
                    pending.size() == m && cp_inputs.size() == m && cp_k.size() == m &&
                    cp_d.size() == m && cp_g.size() == m,
                "quickdraft GDNLayer: one cache's tensors per sequence");
    const at::Tensor h = qd_rms_norm(x, t_.at("input_norm"), eps_, 1.0);
    const at::Tensor mixed = mixer(h, counts, convs, ssms, committed, pending, cp_inputs, cp_k,
                                   cp_d, cp_g);
    at::Tensor res, y;
    std::tie(res, y) = qd_add_rms_norm(x, mixed, t_.at("post_norm"), eps_, 1.0);
    return res + mlp_(y);
  }

 private:
  // models/families/qwen3_next.py GatedDeltaNet.forward on the keeps-checkpoints path
  at::Tensor mixer(const at::Tensor& h, const std::vector<int64_t>& counts,
                   const std::vector<at::Tensor>& convs, const std::vector<at::Tensor>& ssms,
                   const std::vector<int64_t>& committed, const std::vector<int64_t>& pending,
                   const std::vector<at::Tensor>& cp_inputs, const std::vector<at::Tensor>& cp_k,
                   const std::vector<at::Tensor>& cp_d, const std::vector<at::Tensor>& cp_g) const {
    const int64_t n = h.size(0), hv = v_heads_;
    const int64_t c = 2 * k_heads_ * dk_ + hv * dv_, vd = hv * dv_;
    const at::Tensor proj = inp_(h);
    const at::Tensor mixed = proj.narrow(1, 0, c);
    const at::Tensor z = proj.narrow(1, c, vd).reshape({n, hv, dv_});
    const at::Tensor b = proj.narrow(1, c + vd, hv), a = proj.narrow(1, c + vd + hv, hv);
    at::Tensor g, beta;
    std::tie(g, beta) = qd_gdn_gates(a, b, t_.at("a_log"), t_.at("dt_bias"));
    const at::Tensor& conv_w = t_.at("conv_weight");
    at::Tensor core = at::empty({n, hv, dv_}, h.options().dtype(at::kFloat));
    const at::Tensor gc = g.contiguous(), bc = beta.contiguous();
    int64_t row = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      const int64_t t = counts[i];
      TORCH_CHECK(t >= 0 && row + t <= n,
                  "quickdraft GDNLayer: counts must be >= 0 and sum to the rows");
      // HybridCache.gdn_state_deferred; the state and the checkpoint slots by their strides
      // (a select is a torch op each, and they are read only by pointer here)
      const at::Tensor window = convs[i].select(0, slot_).select(0, committed[i]);
      const at::Tensor ins = cp_inputs[i].select(0, slot_);
      const at::Tensor &ssm = ssms[i], &ck = cp_k[i], &cd = cp_d[i], &cg = cp_g[i];
      TORCH_CHECK(t <= ins.size(0), "quickdraft GDNLayer: reserve() before the forward");
      TORCH_CHECK(ssm.dim() == 5 && ck.dim() == 4 && cd.dim() == 4 && cg.dim() == 3 &&
                      slot_ < ssm.size(0) && committed[i] >= 0 && committed[i] < ssm.size(1) &&
                      slot_ < ck.size(0) && slot_ < cd.size(0) && slot_ < cg.size(0),
                  "quickdraft GDNLayer: the HybridCache's slots");
      TORCH_CHECK(ssm.stride(4) == 1 && ssm.stride(3) == dv_ && ssm.stride(2) == dk_ * dv_ &&
                      window.is_contiguous() && ins.stride(1) == 1 &&
                      ins.scalar_type() == window.scalar_type() &&
                      mixed.scalar_type() == window.scalar_type() &&
                      ck.stride(3) == 1 && ck.stride(2) == dk_ && cd.stride(3) == 1 &&
                      cd.stride(2) == dv_ && cg.stride(2) == 1 &&
                      ssm.scalar_type() == at::kFloat && ck.scalar_type() == at::kFloat &&
                      cd.scalar_type() == at::kFloat && cg.scalar_type() == at::kFloat,
                  "quickdraft GDNLayer: the HybridCache's layout");
      float* const state =
          ssm.data_ptr<float>() + slot_ * ssm.stride(0) + committed[i] * ssm.stride(1);
      float* const kp = ck.data_ptr<float>() + slot_ * ck.stride(0);
      float* const dp = cd.data_ptr<float>() + slot_ * cd.stride(0);
      float* const gp = cg.data_ptr<float>() + slot_ * cg.stride(0);
      const int64_t p = pending[i];
      advance_window(window, ins, p);
      const at::Tensor seg = mixed.narrow(0, row, t);
      const at::Tensor y = qd_causal_conv_silu(seg, window, conv_w);
      // the delta rule, its kept updates written straight into the checkpoint slots
      // (HybridCache.keep_checkpoints) over the pending ones it consumes first
      QdDeltaIO io;
      io.y = y.data_ptr<float>();
      io.C = y.size(1);
      io.g = gc.data_ptr<float>() + row * hv;
      io.beta = bc.data_ptr<float>() + row * hv;
      io.state = state;
      io.m = p;
      io.pk = io.k = kp, io.pk_hs = io.k_hs = ck.stride(1);
      io.pd = io.d = dp, io.pd_hs = io.d_hs = cd.stride(1);
      io.pg = io.gout = gp, io.pg_hs = io.gout_hs = cg.stride(1);
      io.out = core.data_ptr<float>() + row * hv * dv_, io.out_ts = hv * dv_;
      TORCH_CHECK(y.is_contiguous() && p <= ck.size(2) && t <= ck.size(2),
                  "quickdraft GDNLayer: the checkpoint slots");
      if (t > 0) {
        qd_gdn_delta_raw(io, hv, dk_, dv_, t, k_heads_);
      } else if (p > 0) {  // no rows: the pending updates still go into the state
        const at::Tensor ks = ck.select(0, slot_), ds = cd.select(0, slot_),
                         gs = cg.select(0, slot_);
        qd_gdn_advance(ssm.select(0, slot_).select(0, committed[i]), ks.narrow(1, 0, p),
                       ds.narrow(1, 0, p), gs.narrow(1, 0, p));
      }
      copy_rows(ins, seg);  // HybridCache.keep_checkpoints' inputs
      row += t;
    }
    TORCH_CHECK(row == n, "quickdraft GDNLayer: counts must sum to the rows");
    at::Tensor out = qd_gated_rms_norm(core, t_.at("norm"), z, eps_);
    if (out_heads_.has_value()) out = out.index_select(1, *out_heads_);
    return out_(out.reshape({n, -1}));
  }

  int64_t slot_, k_heads_, v_heads_, dk_, dv_;
  double eps_;
  std::unordered_map<std::string, at::Tensor> t_;
  Operand inp_, out_;
  Mlp mlp_;
  c10::optional<at::Tensor> out_heads_;
};

class QdHybridAttentionLayer {
 public:
  // layer: its KV slot (among the attention layers); tensors: input_norm, post_norm, q_norm,
  // k_norm (1 + w norms); ops: qkv (q and its gate interleaved per head, then k, v), o, and
  // gate_up / down unless moe (the layer's MoEBlock) is given; qkv_bias optional.
  QdHybridAttentionLayer(int64_t layer, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         double eps, double scale,
                         std::unordered_map<std::string, at::Tensor> tensors,
                         const NamedOperands& ops,
                         c10::optional<at::Tensor> qkv_bias, const py::object& moe)
      : layer_(layer),
        heads_(heads),
        kv_heads_(kv_heads),
        d_(head_dim),
        eps_(eps),
        scale_(scale),
        t_(std::move(tensors)),
        qkv_(operand_of(ops, "qkv", qkv_bias)),
        o_(operand_of(ops, "o")),
        mlp_(ops, moe) {
    for (const char* n : {"input_norm", "post_norm", "q_norm", "k_norm"})
      TORCH_CHECK(t_.count(n) && t_.at(n).defined(), "quickdraft AttentionLayer: no ", n);
  }

  // x [N, hidden]; cos, sin [N, rotary_dim] fp32; per sequence its KVCache's k, v, committed
  // length, new rows, shared blocks' page tables (an empty tensor: none) and block size
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const std::vector<int64_t>& starts,
                     const std::vector<int64_t>& counts, const std::vector<at::Tensor>& k_pages,
                     const std::vector<at::Tensor>& v_pages,
                     const std::vector<int64_t>& blocks) const {
    const size_t m = counts.size();
    TORCH_CHECK(k_caches.size() == m && v_caches.size() == m && starts.size() == m &&
                    k_pages.size() == m && v_pages.size() == m && blocks.size() == m,
                "quickdraft AttentionLayer: one cache, start, page table and block per sequence");
    const at::Tensor h = qd_rms_norm(x, t_.at("input_norm"), eps_, 1.0);
    // models/families/qwen3_next.py GatedAttention.forward
    const int64_t n = h.size(0), hh = heads_, hk = kv_heads_, d = d_;
    const at::Tensor qkv = qkv_(h);
    const at::Tensor q_gate = qkv.narrow(1, 0, 2 * hh * d).view({n, hh, 2 * d});
    const at::Tensor gate = q_gate.narrow(2, d, d).reshape({n, hh * d});
    const at::Tensor q = qd_rope(qd_rms_norm(q_gate.narrow(2, 0, d), t_.at("q_norm"), eps_, 1.0),
                                 cos, sin);
    const at::Tensor k = qd_rope(
        qd_rms_norm(qkv.narrow(1, 2 * hh * d, hk * d).view({n, hk, d}), t_.at("k_norm"), eps_,
                    1.0),
        cos, sin);
    const at::Tensor v = qkv.narrow(1, (2 * hh + hk) * d, hk * d).view({n, hk, d});
    std::vector<at::Tensor> outs;
    outs.reserve(m);
    int64_t row = 0;
    for (size_t i = 0; i < m; ++i) {
      const int64_t c = counts[i];
      TORCH_CHECK(c >= 0 && row + c <= n,
                  "quickdraft AttentionLayer: counts must be >= 0 and sum to the rows");
      if (c == 0) continue;
      outs.push_back(qd_layer::write_and_attend(
          q.narrow(0, row, c), k.narrow(0, row, c), v.narrow(0, row, c), k_caches[i],
          v_caches[i], layer_, starts[i], k_pages[i], v_pages[i], blocks[i], scale_));
      row += c;
    }
    TORCH_CHECK(row == n, "quickdraft AttentionLayer: counts must sum to the rows");
    const at::Tensor attn = outs.size() == 1 ? outs[0] : at::cat(outs);
    const at::Tensor mixed = o_(attn * qd_sigmoid(gate));
    at::Tensor res, y;
    std::tie(res, y) = qd_add_rms_norm(x, mixed, t_.at("post_norm"), eps_, 1.0);
    return res + mlp_(y);
  }

 private:
  int64_t layer_, heads_, kv_heads_, d_;
  double eps_, scale_;
  std::unordered_map<std::string, at::Tensor> t_;
  Operand qkv_, o_;
  Mlp mlp_;
};

void qd_register_hybrid_layers(py::module_& m) {
  py::class_<QdGDNLayer>(m, "GDNLayer")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double,
                    std::unordered_map<std::string, at::Tensor>,
                    const NamedOperands&, const py::object&>(),
           py::arg("slot"), py::arg("k_heads"), py::arg("v_heads"), py::arg("key_dim"),
           py::arg("value_dim"), py::arg("eps"), py::arg("tensors"), py::arg("ops"),
           py::arg("moe"))
      .def_property_readonly("slot", &QdGDNLayer::slot)
      .def("forward", &QdGDNLayer::forward, py::arg("x"), py::arg("counts"), py::arg("convs"),
           py::arg("ssms"), py::arg("committed"), py::arg("pending"), py::arg("cp_inputs"),
           py::arg("cp_k"), py::arg("cp_d"), py::arg("cp_g"),
           py::call_guard<py::gil_scoped_release>());
  py::class_<QdHybridAttentionLayer>(m, "HybridAttentionLayer")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double,
                    std::unordered_map<std::string, at::Tensor>,
                    const NamedOperands&,
                    c10::optional<at::Tensor>, const py::object&>(),
           py::arg("layer"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("eps"), py::arg("scale"), py::arg("tensors"), py::arg("ops"),
           py::arg("qkv_bias"), py::arg("moe"))
      .def("forward", &QdHybridAttentionLayer::forward, py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"), py::arg("starts"),
           py::arg("counts"), py::arg("k_pages"), py::arg("v_pages"), py::arg("blocks"),
           py::call_guard<py::gil_scoped_release>());
}
