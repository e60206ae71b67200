// What the C++ decoder layers (dense_layer.cpp, gemma4_layer.cpp, hybrid_layer.cpp) share: a
// projection's operand, one of this extension's GEMMs over a packed, quantized or GGUF weight
// (kernels/dense_layer.py `layer_operand` builds the arguments and decides eligibility), and
// a sequence's KV write and attention as KVCache.write and attention.py `attend` do them.
#pragma once

#include <torch/extension.h>

#include <limits>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ops.h"

namespace qd_layer {

// A projection's operand: kind 1 = PanelWeight (packed, N), 2 = Int8Weight (packed, scale),
// 3 = Int4Weight (packed, N), 4 = GGUFWeight (one packed tensor, format and N per part), 5 = a
// plain weight [N, K] in nn.Linear layout for the rows kernel (a GGUF file's F16 tensor, fp16);
// bias optional. Kinds 1-3 and 5 have one part.
struct Operand {
  int64_t kind;
  std::vector<at::Tensor> packed;
  at::Tensor scale;
  std::vector<int64_t> ns, fmts;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case 1: return qd_linear_panel(x, packed[0], ns[0], bias);
      case 2: return qd_linear_i8(x, packed[0], scale, bias);
      case 3: return qd_linear_q4(x, packed[0], ns[0], bias);
      case 4: return qd_linear_gguf(x, packed, fmts, ns, bias);
      case 5: return qd_linear(x, packed[0], bias, std::numeric_limits<int64_t>::max());
    }
    TORCH_CHECK(false, "quickdraft layer operand: unknown operand kind ", kind);
  }
};

inline Operand make_operand(int64_t kind, std::vector<at::Tensor> packed, at::Tensor scale,
                            std::vector<int64_t> ns, std::vector<int64_t> fmts,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind >= 1 && kind <= 5, "quickdraft layer operand: operand kind 1-5, got ", kind);
  TORCH_CHECK(!packed.empty() && packed.size() == ns.size() && (kind == 4 || packed.size() == 1) &&
                  (kind != 4 || fmts.size() == packed.size()),
              "quickdraft layer operand: one part per operand (kind 4: a format and N per part)");
  return Operand{kind, std::move(packed), std::move(scale), std::move(ns), std::move(fmts), bias};
}

// An operand as Python passes it (kind, packed per part, scale, out features per part, format
// per part: dense_layer.py's tuple), by name
using OperandArgs = std::tuple<int64_t, std::vector<at::Tensor>, at::Tensor,
                               std::vector<int64_t>, std::vector<int64_t>>;
using NamedOperands = std::unordered_map<std::string, OperandArgs>;

inline Operand operand_of(const NamedOperands& ops, const char* name,
                          const c10::optional<at::Tensor>& bias = c10::nullopt) {
  const auto it = ops.find(name);
  TORCH_CHECK(it != ops.end(), "quickdraft layer: no operand ", name);
  const auto& [kind, packed, scale, ns, fmts] = it->second;
  return make_operand(kind, packed, scale, ns, fmts, bias);
}

// One sequence's new rows q [n, H, d], k, v [n, Hkv, d] of `layer`: the keys / values written at
// token `start` of its KVCache (k_cache, v_cache [layers, Hkv, capacity, d], the rows after
// its shared prefix blocks, k_pages / v_pages: none, or an empty tensor), then attended
// (attention.cpp `attend_paged`, the kernel's bits with or without blocks).
inline at::Tensor write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   int64_t layer, int64_t start,
                                   const c10::optional<at::Tensor>& k_pages,
                                   const c10::optional<at::Tensor>& v_pages, int64_t block,
                                   double scale, int64_t window = 0,
                                   const c10::optional<at::Tensor>& sinks = c10::nullopt) {
  const int64_t n = q.size(0);
  const bool paged = k_pages.has_value() && k_pages->defined() && k_pages->numel() > 0;
  const int64_t shared = paged ? k_pages->size(0) * block : 0;
  const int64_t own = start - shared;  // the first new row's index in the own rows
  const at::Tensor kc = k_cache.select(0, layer), vc = v_cache.select(0, layer);
  TORCH_CHECK(own >= 0 && own + n <= kc.size(1), "quickdraft layer: reserve() before the forward");
  kc.narrow(1, own, n).copy_(k.transpose(0, 1));
  vc.narrow(1, own, n).copy_(v.transpose(0, 1));
  return qd_attend_paged(q, kc.narrow(1, 0, own + n), vc.narrow(1, 0, own + n), k_pages,
                         v_pages, block, layer, start, scale, window, sinks);
}

}  // namespace qd_layer
