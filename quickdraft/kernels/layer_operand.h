// A decoder layer's projection operand as the C++ layers (dense_layer.cpp, gemma4_layer.cpp) hold
// it: one of this extension's GEMMs over a packed, quantized or GGUF weight
// (kernels/dense_layer.py `layer_operand` builds the arguments and decides eligibility).
#pragma once

#include <torch/extension.h>

#include <limits>
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

}  // namespace qd_layer
