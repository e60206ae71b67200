// One Gemma 4 decoder layer (models/families/gemma4.py `DecoderLayer`) for the rows of one or several
// sequences packed in one step, as a sequence of this extension's kernels and ATen ops called
// from C++ (kernels/gemma4_layer.py owns the contract and when it runs).
//
// Contract: Gemma4Layer(...).forward(h, ple, cos, sin, k_groups, v_groups, starts, counts,
// ends) returns exactly what `DecoderLayer.forward` returns for the same inputs when every op
// there takes its kernel: the same kernels and ATen ops in the same order on the same
// operands, so the output is bitwise equal (tests/test_gemma4_gguf.py checks it).
// k_groups[i] / v_groups[i] are sequence i's KV tensors [layers, kv_heads, capacity, head_dim]
// of the group holding this layer's KV (its source's, for a layer that reads another's); its
// rows start at token 0. `ends` (int64 [N] or None): every row's key end for a local layer
// (an image row sees its whole image; kernels/attention.py `attend`).
//
// Why: a Gemma 4 layer is ~40 Python-level ops (11 norms, the router's softmax / top-k /
// renormalisation, the per-sequence attention loop) around 5 GEMMs and one grouped-experts
// call; at decode they cost ~0.5 ms a layer, a fifth of a 26B-A4B-width token.
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "bf16.h"
#include "layer_parts.h"
#include "ops.h"

using qd_layer::NamedOperands;
using qd_layer::Operand;
using qd_layer::operand_of;


class QdGemma4Layer {
 public:
  // slot: this layer's KV slot in its group (own: written here; else its source layer's);
  // norms: input, q, k (own only), unit (v's weightless norm), post_attention,
  // pre_feedforward, post_feedforward, layer_scalar; MoE: post_feedforward_1 / _2,
  // pre_feedforward_2, router_unit, router_scale, per_expert_scale; per-layer input:
  // post_per_layer_input. ops: qkv, o, gate_up, down; MoE: router; per-layer input:
  // ple_gate, ple_projection. experts: the layer's MoEGGUF (None: no MoE).
  QdGemma4Layer(int64_t slot, bool own, bool shares_v, int64_t heads, int64_t kv_heads,
                int64_t head_dim, int64_t window, double eps,
                std::unordered_map<std::string, at::Tensor> norms,
                const NamedOperands& ops,
                const py::object& experts, int64_t top_k, double router_root)
      : slot_(slot),
        own_(own),
        shares_v_(shares_v),
        heads_(heads),
        kv_heads_(kv_heads),
        d_(head_dim),
        window_(window),
        top_k_(top_k),
        eps_(eps),
        root_(router_root),
        norms_(std::move(norms)),
        qkv_(operand_of(ops, "qkv")),
        o_(operand_of(ops, "o")),
        gate_up_(operand_of(ops, "gate_up")),
        down_(operand_of(ops, "down")),
        moe_(!experts.is_none()),
        ple_(ops.count("ple_gate") > 0) {
    if (moe_) {
      experts_ = qd_moe_gguf_of(experts);
      router_ = operand_of(ops, "router");
    }
    if (ple_) {
      ple_gate_ = operand_of(ops, "ple_gate");
      ple_projection_ = operand_of(ops, "ple_projection");
    }
    std::vector<const char*> need = {"input",           "q",           "unit",
                                     "post_attention",  "pre_feedforward",
                                     "post_feedforward", "layer_scalar"};
    if (own_) need.push_back("k");
    if (moe_)
      for (const char* n : {"post_feedforward_1", "post_feedforward_2", "pre_feedforward_2",
                            "router_unit", "router_scale", "per_expert_scale"})
        need.push_back(n);
    if (ple_) need.push_back("post_per_layer_input");
    for (const char* n : need)
      TORCH_CHECK(norms_.count(n) && norms_.at(n).defined(), "quickdraft Gemma4Layer: no ", n);
  }

  at::Tensor forward(const at::Tensor& h, const c10::optional<at::Tensor>& ple,
                     const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_groups,
                     const std::vector<at::Tensor>& v_groups, const std::vector<int64_t>& starts,
                     const std::vector<int64_t>& counts,
                     const c10::optional<at::Tensor>& ends) const {
    const at::Tensor attn = attention(norm(h, "input"), cos, sin, k_groups, v_groups, starts,
                                      counts, ends);
    at::Tensor residual, x;
    std::tie(residual, x) = qd_add_rms_norm(h, norm(attn, "post_attention"),
                                            norms_.at("pre_feedforward"), eps_, 0.0);
    at::Tensor out = down_(qd_gelu_mul(gate_up_(x)));
    if (moe_) {
      at::Tensor weight, idx;
      std::tie(weight, idx) = route(residual);
      const at::Tensor routed = qd_moe_gguf_forward(*experts_, norm(residual, "pre_feedforward_2"),
                                                    idx, weight.to(x.scalar_type()));
      out = norm(out, "post_feedforward_1") + norm(routed, "post_feedforward_2");
    }
    at::Tensor y = residual + norm(out, "post_feedforward");
    if (ple_) {
      TORCH_CHECK(ple.has_value() && ple->defined() && ple->size(0) == y.size(0),
                  "quickdraft Gemma4Layer: this layer takes a per-layer input row per row");
      const at::Tensor gate = gelu_rows(ple_gate_(y)) * *ple;
      y = y + norm(ple_projection_(gate), "post_per_layer_input");
    }
    return y * norms_.at("layer_scalar");
  }

 private:
  at::Tensor norm(const at::Tensor& x, const char* name) const {
    return qd_rms_norm(x, norms_.at(name), eps_, 0.0);
  }

  // gelu(x, tanh) one row at a time (kernels/pointwise.py gelu_tanh_rows)
  static at::Tensor gelu_rows(const at::Tensor& x) {
    at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    for (int64_t r = 0; r < x.size(0); ++r) out[r].copy_(at::gelu(x[r], "tanh"));
    return out;
  }

  // models/families/gemma4.py Router.forward: (top weights fp32 [N, k], top ids [N, k])
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x) const {
    const at::Tensor xs = norm(x, "router_unit") * norms_.at("router_scale") * root_;
    const at::Tensor probs = at::softmax(router_(xs).to(at::kFloat), -1);
    const int64_t k = top_k_;
    at::Tensor weight, idx;
    std::tie(weight, idx) = at::topk(probs, k, -1);
    // w / (w_0 + w_1 + ... in slot order) * float(per_expert_scale[id]) per row, in place, in
    // one loop: the Python router's fp32 adds, division and product, each IEEE op rounding
    // as its tensor op does
    weight = weight.contiguous();
    idx = idx.contiguous();
    // the scales read in place (bf16 widened exactly, as the tensor op's cast): no cast a call
    const at::Tensor& pes = norms_.at("per_expert_scale");
    const at::Tensor scale =
        pes.scalar_type() == at::kBFloat16 || pes.scalar_type() == at::kFloat
            ? pes.contiguous()
            : pes.to(at::kFloat).contiguous();
    const bool bf16 = scale.scalar_type() == at::kBFloat16;
    const void* sc = scale.data_ptr();
    auto scale_of = [&](int64_t e) {
      return bf16 ? qd_bf16::bf16_to_f32(static_cast<const uint16_t*>(sc)[e])
                  : static_cast<const float*>(sc)[e];
    };
    const int64_t* id = idx.data_ptr<int64_t>();
    float* w = weight.data_ptr<float>();
    for (int64_t r = 0; r < weight.size(0); ++r) {
      float* row = w + r * k;
      volatile float total = row[0];  // volatile: no reassociation of the sum
      for (int64_t j = 1; j < k; ++j) total = total + row[j];
      const float t = total;
      for (int64_t j = 0; j < k; ++j) {
        const float q = row[j] / t;  // rounded, then the product rounded, as the tensor ops
        row[j] = q * scale_of(id[r * k + j]);
      }
    }
    return {weight, idx};
  }

  // models/families/gemma4.py Attention.forward after its input norm: [N, hidden]
  at::Tensor attention(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& k_groups,
                       const std::vector<at::Tensor>& v_groups,
                       const std::vector<int64_t>& starts,
                       const std::vector<int64_t>& counts,
                       const c10::optional<at::Tensor>& ends) const {
    const size_t m = counts.size();
    TORCH_CHECK(k_groups.size() == m && v_groups.size() == m && starts.size() == m,
                "quickdraft Gemma4Layer: one KV group and start per sequence");
    const int64_t n = x.size(0), h = heads_, hkv = kv_heads_, d = d_;
    const at::Tensor qkv = qkv_(x);
    const at::Tensor q =
        qd_rope(qd_rms_norm(qkv.narrow(1, 0, h * d).view({n, h, d}), norms_.at("q"), eps_, 0.0),
                cos, sin);
    at::Tensor k, v;
    if (own_) {
      const at::Tensor k_raw = qkv.narrow(1, h * d, hkv * d).view({n, hkv, d});
      const at::Tensor v_raw =
          shares_v_ ? k_raw : qkv.narrow(1, (h + hkv) * d, hkv * d).view({n, hkv, d});
      k = qd_rope(qd_rms_norm(k_raw, norms_.at("k"), eps_, 0.0), cos, sin);
      v = qd_rms_norm(v_raw, norms_.at("unit"), eps_, 0.0);
    }
    std::vector<at::Tensor> outs;
    outs.reserve(m);
    int64_t row = 0;
    for (size_t i = 0; i < m; ++i) {
      const int64_t c = counts[i], start = starts[i];
      TORCH_CHECK(c >= 0 && row + c <= n,
                  "quickdraft Gemma4Layer: counts must be >= 0 and sum to the rows");
      if (c == 0) continue;
      const at::Tensor kc = k_groups[i].select(0, slot_), vc = v_groups[i].select(0, slot_);
      TORCH_CHECK(start >= 0 && start + c <= kc.size(1),
                  "quickdraft Gemma4Layer: reserve() before the forward");
      if (own_) {
        kc.narrow(1, start, c).copy_(k.narrow(0, row, c).transpose(0, 1));
        vc.narrow(1, start, c).copy_(v.narrow(0, row, c).transpose(0, 1));
      }
      const at::Tensor qs = q.narrow(0, row, c), keys = kc.narrow(1, 0, start + c),
                       values = vc.narrow(1, 0, start + c);
      TORCH_CHECK(qd_attend_eligible(qs, keys, values, start),
                  "quickdraft Gemma4Layer: the attention kernel refuses these rows");
      // a local layer's image rows see their whole image (`ends`, models/families/gemma4.py)
      const bool two_way = window_ > 0 && ends.has_value() && ends->defined();
      outs.push_back(qd_attend(qs, keys, values, start, 1.0, window_, c10::nullopt,
                               two_way ? c10::optional<at::Tensor>(ends->narrow(0, row, c))
                                       : c10::nullopt));
      row += c;
    }
    TORCH_CHECK(row == n, "quickdraft Gemma4Layer: counts must sum to the rows");
    return o_(outs.size() == 1 ? outs[0] : at::cat(outs));
  }

  int64_t slot_;
  bool own_, shares_v_;
  int64_t heads_, kv_heads_, d_, window_, top_k_;
  double eps_, root_;
  std::unordered_map<std::string, at::Tensor> norms_;
  Operand qkv_, o_, gate_up_, down_;
  bool moe_, ple_;
  std::shared_ptr<const QdMoEGGUF> experts_;
  Operand router_, ple_gate_, ple_projection_;
};

void qd_register_gemma4_layer(py::module_& m) {
  py::class_<QdGemma4Layer>(m, "Gemma4Layer")
      .def(py::init<int64_t, bool, bool, int64_t, int64_t, int64_t, int64_t, double,
                    std::unordered_map<std::string, at::Tensor>,
                    const NamedOperands&, const py::object&,
                    int64_t, double>(),
           py::arg("slot"), py::arg("own"), py::arg("shares_v"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("window"), py::arg("eps"),
           py::arg("norms"), py::arg("ops"), py::arg("experts"), py::arg("top_k"), py::arg("router_root"))
      .def("forward", &QdGemma4Layer::forward, py::arg("h"), py::arg("ple"), py::arg("cos"),
           py::arg("sin"), py::arg("k_groups"), py::arg("v_groups"), py::arg("starts"),
           py::arg("counts"), py::arg("ends") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
