// The one Python module of the CPU extension (built by quickdraft/kernels/build.py): every op
// the Python side calls, each defined in the source of its family and declared in ops.h. The
// GIL is released around every kernel: they touch no Python objects, and other Python threads
// (an HTTP server loop) keep running during a forward.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  qd_register_dense_layer(m);
  qd_register_moe_gguf(m);
  qd_register_gemma4_layer(m);
  qd_register_hybrid_layers(m);
  // The GIL is released: the kernel touches no Python objects, and other Python threads
  // (an HTTP server loop) keep running during a forward.
  m.def("linear", &qd_linear, "x @ w.T (+ bias): the kernel when eligible, else at::linear",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("max_m"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eligible", &qd_linear_eligible, "whether `linear` would run the kernel for these inputs",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("max_m"));
  m.def("linear_i8", &qd_linear_i8,
        "scale * (int8(x) . w) (+ bias), int8 weight in 16-row panels, int8 activations",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eligible_i8", &qd_linear_i8_eligible, "whether `linear_i8` accepts these inputs",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("bias"));
  m.def("linear_q4", &qd_linear_q4,
        "x @ dequantized(w).T (+ bias), 4-bit weight in 16-row panels, int8 activations",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eligible_q4", &qd_linear_q4_eligible, "whether `linear_q4` accepts these inputs",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"));
  m.def("linear_gguf", &qd_linear_gguf,
        "x @ w.T (+ bias), w in GGUF block formats repacked in 16-row panels, int8 activations",
        py::arg("x"), py::arg("packed"), py::arg("fmts"), py::arg("ns"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eligible_gguf", &qd_linear_gguf_eligible, "whether `linear_gguf` accepts these inputs",
        py::arg("x"), py::arg("packed"), py::arg("fmts"), py::arg("ns"), py::arg("bias"));
  m.def("gguf_rows", &qd_gguf_rows,
        "rows `ids` of a GGUF table raw [V, row bytes] of ggml type `type`, dequantized to fp32",
        py::arg("raw"), py::arg("ids"), py::arg("type"), py::arg("dim"));
  m.def("gguf_rows_formats", &qd_gguf_rows_formats, "the ggml types gguf_rows dequantizes");
  m.def("set_prefetch_bytes", &qd_set_prefetch_bytes,
        "how far ahead the panel kernels (int8, int4, GGUF) prefetch their weight stream, in "
        "bytes (0: no software prefetch), bytes_32 for the GGUF formats of 32-value blocks in a "
        "one-row pass (-1: the same); returns bytes",
        py::arg("bytes"), py::arg("bytes_32") = -1);
  m.def("gguf_isa", &qd_gguf_isa,
        "the GGUF kernel's tile: -1 the best this CPU runs, 0 AVX2, 1 AVX-512 VNNI, 2 that with "
        "AVX512_VBMI; returns the one in use",
        py::arg("level"));
  m.def("panel_isa", &qd_panel_isa,
        "the bf16 panel kernel's tiles: -1 the best this CPU runs, 0 AVX2, 1 AVX512_BF16 (bf16 "
        "activations); returns the one in use",
        py::arg("level"));
  m.def("linear_panel", &qd_linear_panel, "x @ w.T (+ bias), w packed in 16-row panels",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("eligible_panel", &qd_linear_panel_eligible, "whether `linear_panel` accepts these",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"));
  m.def("rms_norm", &qd_rms_norm, "x * rsqrt(mean(x^2) + eps) * (w + offset)", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("offset"),
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &qd_add_rms_norm, "(x + delta, rms_norm(x + delta))", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("offset"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rope", &qd_rope, "rotate-half RoPE on the first cos.size(-1) dims of each head",
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &qd_silu_mul, "silu(gate_up[:, :I]) * gate_up[:, I:]", py::arg("gate_up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gelu_mul", &qd_gelu_mul, "gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]",
        py::arg("gate_up"), py::call_guard<py::gil_scoped_release>());
  m.def("sigmoid", &qd_sigmoid, "elementwise sigmoid, the same bits wherever an element is",
        py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("greedy_pick", &qd_greedy_pick,
        "per row the first index of its maximum and, with_prob, that index's softmax probability",
        py::arg("logits"), py::arg("with_prob"), py::call_guard<py::gil_scoped_release>());
  m.def("gdn_gates", &qd_gdn_gates, "Gated DeltaNet log decay g and beta, fp32",
        py::arg("a"), py::arg("b"), py::arg("a_log"), py::arg("dt_bias"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gated_rms_norm", &qd_gated_rms_norm, "rms_norm(x) * w * silu(z)", py::arg("x"),
        py::arg("weight"), py::arg("z"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("causal_conv_silu", &qd_causal_conv_silu, "silu(causal depthwise conv1d) in fp32",
        py::arg("x"), py::arg("window"), py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gdn_delta", &qd_gdn_delta,
        "gated delta rule over one short chunk: out, k, d, g (pending updates: the state is "
        "advanced by them in place first)",
        py::arg("y"), py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("k_heads"),
        py::arg("pending_k") = py::none(), py::arg("pending_d") = py::none(),
        py::arg("pending_g") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("gdn_advance", &qd_gdn_advance, "apply kept delta-rule updates to a state, in place",
        py::arg("state"), py::arg("k"), py::arg("d"), py::arg("g"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gdn_prefill", &qd_gdn_prefill,
        "gated delta rule over a prompt chunk of any length: out; the state advanced in place",
        py::arg("y"), py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("k_heads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("attend", &qd_attend, "causal GQA of n new queries over a KV cache (decode / verify)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("start"), py::arg("scale"),
        py::arg("window") = 0, py::arg("sinks") = py::none(), py::arg("ends") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("attend_paged", &qd_attend_paged,
        "`attend` over a sequence whose first keys lie in shared blocks (k_pages, v_pages: int64 "
        "[pages, 3]: a block's address, layer and head strides; read at `layer`) and the rest in "
        "k, v",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_pages"), py::arg("v_pages"),
        py::arg("block"), py::arg("layer"), py::arg("start"), py::arg("scale"),
        py::arg("window") = 0, py::arg("sinks") = py::none(), py::arg("ends") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("attend_isa", &qd_attend_isa,
        "the attention kernel's tiles: -1 the best this CPU runs, 0 AVX2, 1 AVX-512 (+ BF16); "
        "returns the one in use",
        py::arg("level"));
  m.def("attend_eligible", &qd_attend_eligible, "whether `attend` accepts these inputs",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("start"), py::arg("shared") = 0);
  m.def("kernel_calls", &qd_kernel_calls,
        "how many calls ran the kernel (tests check the fast path was taken)");
}
