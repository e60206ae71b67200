// The routed experts of one MoE layer in one call, over a GGUF file's own block formats
// (kernels/moe_gguf.py owns the contract and the reference; the GEMM is linear_gguf.cpp's).
//
// Contract: MoEGGUF(...).forward(x [N, H], top_idx [N, k], top_weight [N, k]) returns
//   out[r] = sum over slots j in order of  w[r, j] * down_e(act(gate_up_e(x[r])))
// with e = top_idx[r, j]: each GEMM output (plus expert e's bias where given, gpt-oss) rounded
// to x's dtype as `project` rounds it, act silu_mul or gpt-oss's clamped swiglu (the same ATen
// ops as models/families/gpt_oss.py), the products and the sum in fp32 (in slot order), rounded once. That is what the per-expert loop
// of kernels/moe_gguf.py computes, bit for bit, and a row's result depends on that row alone.
//
// Why: the per-expert loop is ~8 torch calls and two fork/joins per chosen expert, 8 experts a
// layer, 40-48 layers: at decode those calls cost as much as streaming the experts' weights.
// Here a layer is one call with two parallel regions (gate/up, then down; a MoEBlock's shared
// expert runs in the same two). Rows are grouped by
// expert, so each chosen expert's panels are streamed once per forward whatever the number of
// rows (a verify, a prompt chunk), and x is quantized to int8 once for all its experts. The
// threads split the (expert, panel) work into contiguous ranges of equal estimated cost.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "gguf_gemm.h"
#include "ops.h"
#include "simd.h"

namespace {

using namespace qd_gguf;  // NOLINT: the layout's names

// One projection of every expert: per expert its row parts (one format and row count per
// part, the same for every expert), over K input columns.
struct Proj {
  std::vector<std::vector<at::Tensor>> packed;  // [E][parts]
  std::vector<int64_t> fmts, ns;                // per part
  int64_t K = 0, N = 0;                         // in and out features
  std::vector<int64_t> panels;                  // per part: ceil(n / 16)
  std::vector<int64_t> col;                     // per part: its first output column
};

Proj make_proj(std::vector<std::vector<at::Tensor>> packed, std::vector<int64_t> fmts,
               std::vector<int64_t> ns, int64_t K, const char* what) {
  Proj p{std::move(packed), std::move(fmts), std::move(ns), K, 0, {}, {}};
  TORCH_CHECK(!p.packed.empty() && !p.fmts.empty() && p.fmts.size() == p.ns.size(),
              "quickdraft MoEGGUF: ", what, ": experts and one format and row count per part");
  for (size_t i = 0; i < p.fmts.size(); ++i) {
    const int64_t f = p.fmts[i];
    TORCH_CHECK(f >= 0 && f < kNumFmt && p.ns[i] > 0, "quickdraft MoEGGUF: ", what, ": part ", i,
                " has format ", f, " and ", p.ns[i], " rows");
    TORCH_CHECK(K % block_size(static_cast<int>(f)) == 0, "quickdraft MoEGGUF: ", what, ": ", K,
                " columns are not whole blocks of format ", f);
    p.panels.push_back((p.ns[i] + kPanel - 1) / kPanel);
    p.col.push_back(p.N);
    p.N += p.ns[i];
  }
  for (size_t e = 0; e < p.packed.size(); ++e) {
    TORCH_CHECK(p.packed[e].size() == p.fmts.size(), "quickdraft MoEGGUF: ", what, ": expert ",
                e, " has ", p.packed[e].size(), " parts, not ", p.fmts.size());
    for (size_t i = 0; i < p.fmts.size(); ++i) {
      const at::Tensor& t = p.packed[e][i];
      const int f = static_cast<int>(p.fmts[i]);
      TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kByte &&
                      t.dim() == 3 && t.is_contiguous() && t.size(0) == p.panels[i] &&
                      t.size(1) * block_size(f) == K && t.size(2) == block_bytes(f),
                  "quickdraft MoEGGUF: ", what, ": expert ", e, " part ", i,
                  " is not a packed [", p.panels[i], ", ", K / block_size(f), ", ",
                  block_bytes(f), "] uint8 tensor");
    }
  }
  return p;
}

// The rows of `src` (Acts of some rows, row length K, block `block`) listed in `rows`, copied
// into `dst` in that order (a prompt's assignments split between the threads: a copy costs
// a byte what a norm costs a value's few ops, so eight times the norms' rows a task).
void gather(const Acts& src, const std::vector<int64_t>& rows, int64_t K, int block,
            const Acts& dst) {
  const int64_t A = static_cast<int64_t>(rows.size());
  at::parallel_for(0, A, 8 * qd_rows_grain(K), [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t r = rows[a];
      std::memcpy(dst.xq + a * K, src.xq + r * K, K);
      std::memcpy(dst.dx + a * (K / block), src.dx + r * (K / block), K / block * sizeof(float));
      std::memcpy(dst.bs16 + a * (K / 16), src.bs16 + r * (K / 16), K / 16 * sizeof(int16_t));
      std::memcpy(dst.bs32 + a * (K / 32), src.bs32 + r * (K / 32), K / 32 * sizeof(int16_t));
    }
  });
}

Acts offset(const Acts& a, int64_t rows, int64_t K, int block) {
  return Acts{a.xq + rows * K, a.dx + rows * (K / block), a.bs16 + rows * (K / 16),
              a.bs32 + rows * (K / 32)};
}

// The weighted sum over slots, fp32, in slot order; no fused multiply-add, so each product
// and each sum is rounded as torch's `out += w * y` rounds them (the reference's bits).
template <class T>
__attribute__((optimize("fp-contract=off"))) void weighted_sum(
    const T* y, const int64_t* slot_row, const float* w, int64_t k, int64_t H, float* acc,
    T* out) {
  for (int64_t c = 0; c < H; ++c) acc[c] = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    const T* yr = y + slot_row[j] * H;
    const float wj = w[j];
    for (int64_t c = 0; c < H; ++c) {
      const float prod = wj * qd_simd::load1(yr + c);
      acc[c] = acc[c] + prod;
    }
  }
  for (int64_t c = 0; c < H; ++c) qd_simd::store1(out + c, acc[c]);
}

// One GEMM's share of a grouped parallel region: the row parts `packed` (one format and row
// count each, `panels` per part) times M rows of `acts` (by block size: [0] for 32, [1] for
// 256, already at the segment's first row) into y, plus a bias row where `base` has one
// (`base`: y and the bias at the segment's first row; part i's columns from col[i]).
struct Seg {
  const std::vector<at::Tensor>* packed;
  const std::vector<int64_t>* fmts;
  const std::vector<int64_t>* ns;
  const std::vector<int64_t>* panels;
  const std::vector<int64_t>* col;
  int64_t K, M;
  Acts acts[2];
  qd_panel::Epilogue base;  // y and bias at the segment's first row, column 0
  size_t y_elem, bias_elem;
};

// Every segment's panels in one parallel region, cut into one contiguous range of (segment,
// panel) units per thread of about equal cost (a panel's bytes times 2 plus its rows).
void run_segs(const std::vector<Seg>& segs) {
  std::vector<int64_t> first(segs.size() + 1, 0);
  for (size_t s = 0; s < segs.size(); ++s) {
    int64_t u = 0;
    for (int64_t q : *segs[s].panels) u += q;
    first[s + 1] = first[s] + u;
  }
  const int64_t U = first.back();
  if (U == 0) return;
  std::vector<double> cost(U + 1, 0.0);  // prefix sums
  for (size_t s = 0, u = 0; s < segs.size(); ++s) {
    const Seg& g = segs[s];
    for (size_t i = 0; i < g.fmts->size(); ++i) {
      const int f = static_cast<int>((*g.fmts)[i]);
      const double bytes = static_cast<double>(g.K / block_size(f) * block_bytes(f));
      for (int64_t q = 0; q < (*g.panels)[i]; ++q, ++u)
        cost[u + 1] = cost[u] + bytes * (2.0 + static_cast<double>(g.M));
    }
  }
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(cost[U] / (64 << 10))));
  std::vector<int64_t> cut(threads + 1, U);
  cut[0] = 0;
  for (int64_t t = 1; t < threads; ++t)
    cut[t] = std::lower_bound(cost.begin(), cost.end(), cost[U] * t / threads) - cost.begin();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      size_t s = std::upper_bound(first.begin(), first.end(), cut[t]) - first.begin() - 1;
      for (int64_t u = cut[t]; u < cut[t + 1];) {
        while (u >= first[s + 1]) ++s;
        const Seg& g = segs[s];
        // this segment's part holding unit u, and the run of its panels within the range
        int64_t q = u - first[s];
        size_t part = 0;
        while (q >= (*g.panels)[part]) q -= (*g.panels)[part++];
        const int64_t len = std::min(cut[t + 1] - u, (*g.panels)[part] - q);
        const int f = static_cast<int>((*g.fmts)[part]);
        const int64_t c = (*g.col)[part];
        qd_panel::Epilogue ep = g.base;
        ep.y = static_cast<char*>(ep.y) + c * static_cast<int64_t>(g.y_elem);
        if (ep.bias)
          ep.bias = static_cast<const char*>(ep.bias) + c * static_cast<int64_t>(g.bias_elem);
        part_panels(g.acts[block_size(f) == 256], g.M, g.K, f,
                    static_cast<const uint8_t*>((*g.packed)[part].data_ptr()), (*g.ns)[part],
                    ep, q, q + len);
        u += len;
      }
    }
  });
}

// Per part: ceil(n / 16) panels, and its first output column.
void part_layout(const std::vector<int64_t>& ns, std::vector<int64_t>& panels,
                 std::vector<int64_t>& col) {
  panels.clear();
  col.clear();
  int64_t c = 0;
  for (int64_t n : ns) {
    panels.push_back((n + kPanel - 1) / kPanel);
    col.push_back(c);
    c += n;
  }
}

}  // namespace

// A shared expert run inside the routed experts' two parallel regions (QdMoEBlock): gate_up
// and down as row parts over every row, silu(gate) * up between them, as linear_gguf and
// silu_mul compute them.
struct QdSharedExpert {
  std::vector<at::Tensor> gu, down;
  std::vector<int64_t> gu_fmts, gu_ns, down_fmts, down_ns;
  std::vector<int64_t> gu_panels, gu_col, down_panels, down_col;
  int64_t H = 0, I2 = 0;  // in features, gate_up's rows
};

// gpt-oss's activation of gate_up [A, 2I] (gate columns, then up): (u + 1) * g * sigmoid(alpha g)
// with g = min(gate, limit), u = clamp(up, -limit, limit), op for op as models/families/gpt_oss.py.
at::Tensor swiglu_oai(const at::Tensor& h, double alpha, double limit) {
  const int64_t I = h.size(1) / 2;
  const at::Tensor gate = h.narrow(1, 0, I).clamp_max(limit);
  const at::Tensor up = h.narrow(1, I, I).clamp(-limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

class QdMoEGGUF {
 public:
  QdMoEGGUF(std::vector<std::vector<at::Tensor>> gate_up, std::vector<int64_t> gate_up_fmts,
            std::vector<int64_t> gate_up_ns, std::vector<std::vector<at::Tensor>> down,
            std::vector<int64_t> down_fmts, std::vector<int64_t> down_ns, int64_t hidden,
            const c10::optional<at::Tensor>& gate_up_bias,
            const c10::optional<at::Tensor>& down_bias, int64_t act, double alpha, double limit)
      : gu_(make_proj(std::move(gate_up), std::move(gate_up_fmts), std::move(gate_up_ns), hidden,
                      "gate_up")),
        down_(make_proj(std::move(down), std::move(down_fmts), std::move(down_ns), gu_.N / 2,
                        "down")),
        gu_bias_(qd_panel::bias_operand(gate_up_bias)),
        down_bias_(qd_panel::bias_operand(down_bias)),
        act_(act),
        alpha_(alpha),
        limit_(limit) {
    TORCH_CHECK(act >= 0 && act <= 2,
                "quickdraft MoEGGUF: act 0 (silu_mul), 1 (swiglu_oai) or 2 (gelu_mul)");
    const int64_t E = static_cast<int64_t>(gu_.packed.size());
    TORCH_CHECK(!gu_bias_.defined() || (gu_bias_.dim() == 2 && gu_bias_.size(0) == E &&
                                        gu_bias_.size(1) == gu_.N),
                "quickdraft MoEGGUF: gate_up_bias must be [", E, ", ", gu_.N, "]");
    TORCH_CHECK(!down_bias_.defined() || (down_bias_.dim() == 2 && down_bias_.size(0) == E &&
                                          down_bias_.size(1) == hidden),
                "quickdraft MoEGGUF: down_bias must be [", E, ", ", hidden, "]");
    TORCH_CHECK(gu_.N % 2 == 0, "quickdraft MoEGGUF: gate_up has an odd row count ", gu_.N);
    TORCH_CHECK(gu_.packed.size() == down_.packed.size(), "quickdraft MoEGGUF: ",
                gu_.packed.size(), " gate_up experts but ", down_.packed.size(), " down");
    TORCH_CHECK(down_.N == hidden, "quickdraft MoEGGUF: down has ", down_.N, " rows, not ",
                hidden);
  }

  int64_t experts() const { return static_cast<int64_t>(gu_.packed.size()); }

  // sh: a shared expert to run in the same two parallel regions, its output [N, H] (x's
  // dtype) in *shared_out
  at::Tensor forward(const at::Tensor& x, const at::Tensor& top_idx,
                     const at::Tensor& top_weight, const QdSharedExpert* sh = nullptr,
                     at::Tensor* shared_out = nullptr) const {
    const int64_t H = gu_.K, I = gu_.N / 2, E = experts();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H && x.device().is_cpu() &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                "quickdraft MoEGGUF: x must be [N, ", H, "] bf16 or fp32 on the CPU");
    const int64_t N = x.size(0);
    TORCH_CHECK(top_idx.dim() == 2 && top_idx.size(0) == N &&
                    top_idx.scalar_type() == at::kLong && top_weight.sizes() == top_idx.sizes(),
                "quickdraft MoEGGUF: top_idx int64 and top_weight of one shape [N, k]");
    const int64_t k = top_idx.size(1), A = N * k;
    TORCH_CHECK(!sh || (sh->H == H && shared_out),
                "quickdraft MoEGGUF: a shared expert of the experts' width, and its output");
    at::Tensor out = at::empty({N, H}, x.options());
    qd_count_kernel_call();
    if (A == 0 && !sh) return out.zero_();
    const at::Tensor xc = x.contiguous();
    const at::Tensor idx = top_idx.contiguous();
    const at::Tensor w = top_weight.to(at::kFloat).contiguous();

    // Assignments (row, slot) in expert order, by row within an expert: `rows` [A] their rows,
    // `where` [N * k] the assignment of each (row, slot).
    const int64_t* ip = idx.data_ptr<int64_t>();
    std::vector<int64_t> count(E + 1, 0);
    for (int64_t i = 0; i < A; ++i) {
      TORCH_CHECK(ip[i] >= 0 && ip[i] < E, "quickdraft MoEGGUF: expert id ", ip[i],
                  " out of range [0, ", E, ")");
      ++count[ip[i] + 1];
    }
    std::vector<int64_t> start(E + 1, 0), used;
    for (int64_t e = 0; e < E; ++e) {
      start[e + 1] = start[e] + count[e + 1];
      if (count[e + 1] > 0) used.push_back(e);
    }
    std::vector<int64_t> rows(A), where(A), fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < A; ++i) {
      const int64_t a = fill[ip[i]]++;
      rows[a] = i / k;
      where[i] = a;
    }

    // gate/up: x quantized once per block size, its rows gathered in assignment order (the
    // shared expert reads x's own rows); one row (a decode step) is every expert's, read in
    // place
    const bool one_row = N == 1;
    int blocks[2] = {0, 0}, own_blocks[2] = {0, 0}, shared_down[2] = {0, 0};
    for (int64_t f : gu_.fmts) {
      const int b = block_size(static_cast<int>(f));
      blocks[b == 256] = own_blocks[b == 256] = b;
    }
    if (sh) {
      for (int64_t f : sh->gu_fmts) {
        const int b = block_size(static_cast<int>(f));
        own_blocks[b == 256] = b;
      }
      for (int64_t f : sh->down_fmts) {
        const int b = block_size(static_cast<int>(f));
        shared_down[b == 256] = b;
      }
    }
    int64_t floats = 0;
    for (int which = 0; which < 2; ++which) {
      if (own_blocks[which]) floats += acts_floats(N, H, own_blocks[which]);
      if (blocks[which]) floats += acts_floats(A, H, blocks[which]);
      if (shared_down[which]) floats += acts_floats(N, sh->I2 / 2, shared_down[which]);
    }
    const int down_block = block_size(static_cast<int>(down_.fmts[0]));
    for (int64_t f : down_.fmts)
      TORCH_CHECK(block_size(static_cast<int>(f)) == down_block,
                  "quickdraft MoEGGUF: down's parts need one block size");
    floats += acts_floats(A, I, down_block);
    float* buf = qd_simd::scratch(static_cast<size_t>(floats));
    Acts own[2] = {}, gathered[2] = {};
    for (int which = 0; which < 2; ++which) {
      if (!own_blocks[which]) continue;
      own[which] = quantize(xc, own_blocks[which], buf);
      buf += acts_floats(N, H, own_blocks[which]);
      if (!blocks[which]) continue;
      if (one_row) {
        gathered[which] = own[which];
        continue;
      }
      gathered[which] = acts_at(buf, A, H, blocks[which]);
      buf += acts_floats(A, H, blocks[which]);
      gather(own[which], rows, H, blocks[which], gathered[which]);
    }
    at::Tensor h = at::empty({A, 2 * I}, x.options());  // [A, 2I] gate | up per assignment
    at::Tensor hs = sh ? at::empty({N, sh->I2}, x.options()) : at::Tensor();
    std::vector<Seg> segs;
    for (int64_t e : used)
      segs.push_back(expert_seg(gu_, e, start, gathered, h, gu_bias_, one_row));
    if (sh)
      segs.push_back(shared_seg(sh->gu, sh->gu_fmts, sh->gu_ns, sh->gu_panels, sh->gu_col, H, N,
                                own, hs));
    run_segs(segs);

    // down: silu(gate) * up (the kernel's own op), gpt-oss's or Gemma's, quantized per assignment
    const at::Tensor act = act_ == 0   ? qd_silu_mul(h)
                           : act_ == 1 ? swiglu_oai(h, alpha_, limit_).contiguous()
                                       : qd_gelu_mul(h);
    Acts down_acts[2] = {};
    down_acts[down_block == 256] = quantize(act, down_block, buf);
    buf += acts_floats(A, I, down_block);
    at::Tensor y = at::empty({A, H}, x.options());  // [A, H]
    at::Tensor sy;
    Acts sacts[2] = {};
    if (sh) {
      const at::Tensor sact = qd_silu_mul(hs);
      for (int which = 0; which < 2; ++which) {
        if (!shared_down[which]) continue;
        sacts[which] = quantize(sact, shared_down[which], buf);
        buf += acts_floats(N, sh->I2 / 2, shared_down[which]);
      }
      sy = at::empty({N, H}, x.options());
    }
    segs.clear();
    for (int64_t e : used)
      segs.push_back(expert_seg(down_, e, start, down_acts, y, down_bias_));
    if (sh)
      segs.push_back(shared_seg(sh->down, sh->down_fmts, sh->down_ns, sh->down_panels,
                                sh->down_col, sh->I2 / 2, N, sacts, sy));
    run_segs(segs);
    if (sh) *shared_out = sy;

    // the weighted sums, each row over its slots in order
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, N, std::max<int64_t>(1, 8192 / H), [&](int64_t r0, int64_t r1) {
      std::vector<float> acc(H);
      for (int64_t r = r0; r < r1; ++r) {
        if (x.scalar_type() == at::kBFloat16)
          weighted_sum(static_cast<const uint16_t*>(y.data_ptr()), where.data() + r * k,
                       wp + r * k, k, H, acc.data(), static_cast<uint16_t*>(out.data_ptr()) + r * H);
        else
          weighted_sum(y.data_ptr<float>(), where.data() + r * k, wp + r * k, k, H, acc.data(),
                       out.data_ptr<float>() + r * H);
      }
    });
    return out;
  }

 private:
  Proj gu_, down_;
  at::Tensor gu_bias_, down_bias_;  // [E, 2I], [E, H] (gpt-oss), or undefined
  int64_t act_;
  double alpha_, limit_;

  // expert e's rows [start[e], start[e + 1]) of `acts` (at row 0; `row0`: its row 0 for every
  // expert, one row's) times its parts of `p`, into the same rows of y, plus its row of `bias`
  // [E, p.N] where defined
  static Seg expert_seg(const Proj& p, int64_t e, const std::vector<int64_t>& start,
                        const Acts* acts, at::Tensor& y, const at::Tensor& bias,
                        bool row0 = false) {
    const int64_t a0 = start[e], M = start[e + 1] - start[e];
    Seg g{&p.packed[e], &p.fmts, &p.ns, &p.panels, &p.col, p.K, M, {}, {}, 0, 0};
    for (int which = 0; which < 2; ++which)
      if (acts[which].xq)
        g.acts[which] = offset(acts[which], row0 ? 0 : a0, p.K, which ? 256 : 32);
    g.base = qd_panel::epilogue(nullptr, bias, y);
    g.y_elem = y.element_size();
    g.base.y = static_cast<char*>(g.base.y) + a0 * y.size(1) * static_cast<int64_t>(g.y_elem);
    if (bias.defined()) {
      g.bias_elem = bias.element_size();
      g.base.bias = static_cast<const char*>(g.base.bias) +
                    e * p.N * static_cast<int64_t>(g.bias_elem);
    }
    return g;
  }

  static Seg shared_seg(const std::vector<at::Tensor>& packed, const std::vector<int64_t>& fmts,
                        const std::vector<int64_t>& ns, const std::vector<int64_t>& panels,
                        const std::vector<int64_t>& col, int64_t K, int64_t M, const Acts* acts,
                        at::Tensor& y) {
    Seg g{&packed, &fmts, &ns, &panels, &col, K, M, {acts[0], acts[1]}, {}, 0, 0};
    g.base = qd_panel::epilogue(nullptr, at::Tensor(), y);
    g.y_elem = y.element_size();
    return g;
  }
};

// A whole MoE block over GGUF experts (RoutedMoE, or SparseMoE with its gated shared expert),
// as the Python blocks in models/families/moe.py compute it with every op on its kernel: router logits
// (the bf16 linear kernel), softmax in fp32, top k, renormalized in slot order, the grouped
// experts, and sigmoid(shared_gate(x)) * shared(x) added in x's dtype. `topk_first` is
// gpt-oss's routing (models/families/gpt_oss.py GptOssMoE): logits with the router's bias, their top k,
// a softmax in fp32 over those k, kept in fp32 for the experts' sum. Same ops, same order, same bits; one call per layer instead
// of ~15 torch ops from Python.
class QdMoEBlock {
 public:
  QdMoEBlock(QdMoEGGUF experts, at::Tensor router, int64_t top_k, bool norm_topk, int64_t max_m,
             std::vector<at::Tensor> shared_gate_up, std::vector<int64_t> shared_gate_up_fmts,
             std::vector<int64_t> shared_gate_up_ns, std::vector<at::Tensor> shared_down,
             std::vector<int64_t> shared_down_fmts, std::vector<int64_t> shared_down_ns,
             c10::optional<at::Tensor> shared_gate, int64_t shared_gate_panel_n,
             c10::optional<at::Tensor> router_bias, bool topk_first)
      : experts_(std::move(experts)),
        router_(std::move(router)),
        router_bias_(std::move(router_bias)),
        topk_first_(topk_first),
        top_k_(top_k),
        norm_topk_(norm_topk),
        max_m_(max_m),
        shared_gate_(std::move(shared_gate)),
        shared_gate_panel_n_(shared_gate_panel_n) {
    TORCH_CHECK(router_.dim() == 2 && router_.size(0) == experts_.experts(),
                "quickdraft MoEBlock: the router needs one row per expert");
    TORCH_CHECK(top_k_ >= 1 && top_k_ <= experts_.experts(), "quickdraft MoEBlock: top_k ",
                top_k_, " of ", experts_.experts(), " experts");
    TORCH_CHECK(shared_gate_up.empty() == shared_down.empty() &&
                    shared_gate_up.empty() == !shared_gate_.has_value(),
                "quickdraft MoEBlock: a shared expert needs gate_up, down and its gate");
    if (shared_gate_up.empty()) return;
    TORCH_CHECK(shared_gate_up.size() == shared_gate_up_fmts.size() &&
                    shared_gate_up.size() == shared_gate_up_ns.size() &&
                    shared_down.size() == shared_down_fmts.size() &&
                    shared_down.size() == shared_down_ns.size(),
                "quickdraft MoEBlock: the shared expert's parts, formats and row counts");
    QdSharedExpert& sh = shared_;
    sh.gu = std::move(shared_gate_up), sh.down = std::move(shared_down);
    sh.gu_fmts = std::move(shared_gate_up_fmts), sh.gu_ns = std::move(shared_gate_up_ns);
    sh.down_fmts = std::move(shared_down_fmts), sh.down_ns = std::move(shared_down_ns);
    part_layout(sh.gu_ns, sh.gu_panels, sh.gu_col);
    part_layout(sh.down_ns, sh.down_panels, sh.down_col);
    sh.H = sh.gu[0].size(1) * block_size(static_cast<int>(sh.gu_fmts[0]));
    sh.I2 = 0;
    for (int64_t n : sh.gu_ns) sh.I2 += n;
    int64_t down_n = 0;
    for (int64_t n : sh.down_ns) down_n += n;
    TORCH_CHECK(sh.I2 % 2 == 0 && down_n == sh.H &&
                    sh.down[0].size(1) * block_size(static_cast<int>(sh.down_fmts[0])) ==
                        sh.I2 / 2,
                "quickdraft MoEBlock: the shared expert's gate_up [2I, H] and down [H, I]");
  }

  at::Tensor forward(const at::Tensor& x) const {
    const at::Tensor logits = qd_linear(x, router_, router_bias_, max_m_);  // [N, E]
    at::Tensor weight, idx;  // [N, k]
    if (topk_first_) {
      at::Tensor top;
      std::tie(top, idx) = at::topk(logits, top_k_, -1);
      weight = at::softmax(top.to(at::kFloat), -1);
    } else {
      std::tie(weight, idx) = at::topk(at::softmax(logits.to(at::kFloat), -1), top_k_, -1);
    }
    if (norm_topk_) renormalize(weight);
    // gpt-oss's block hands the experts its fp32 weights; the Qwen blocks round them to x's
    // dtype, which the experts' fp32 sum reads back: rounded in place, the same values
    if (!topk_first_ && x.scalar_type() == at::kBFloat16) round_to_bf16(weight);
    if (shared_.gu.empty()) return experts_.forward(x, idx, weight);
    // the shared expert's gate_up and down in the routed experts' two parallel regions (the
    // bits of linear_gguf and silu_mul on it)
    at::Tensor shared;
    const at::Tensor xc = x.contiguous();
    at::Tensor out = experts_.forward(xc, idx, weight, &shared_, &shared);
    // the gate [1, H]: a plain tensor (the bf16 linear kernel) or packed in a panel
    const at::Tensor gate = qd_sigmoid(
        shared_gate_panel_n_ < 0
            ? qd_linear(xc, *shared_gate_, c10::nullopt, max_m_)
            : qd_linear_panel(xc, *shared_gate_, shared_gate_panel_n_, c10::nullopt));
    return add_gated(out, gate, shared);
  }

 private:
  // w[r, j] / (w[r, 0] + w[r, 1] + ... in slot order), in place: models/families/moe.py's route does
  // the same fp32 adds and division as tensor ops (one op per slot); each IEEE operation
  // rounds alike, so the bits are the same
  static void renormalize(at::Tensor& weight) {
    weight = weight.contiguous();
    float* w = weight.data_ptr<float>();
    const int64_t N = weight.size(0), k = weight.size(1);
    for (int64_t r = 0; r < N; ++r) {
      float* row = w + r * k;
      volatile float total = row[0];  // volatile: no reassociation of the sum
      for (int64_t j = 1; j < k; ++j) total = total + row[j];
      const float t = total;
      for (int64_t j = 0; j < k; ++j) row[j] = row[j] / t;
    }
  }

  // each fp32 weight rounded to bf16 (nearest even, as torch's cast) and widened back, in place
  static void round_to_bf16(at::Tensor& weight) {
    weight = weight.contiguous();
    float* w = weight.data_ptr<float>();
    for (int64_t i = 0; i < weight.numel(); ++i)
      w[i] = qd_bf16::bf16_to_f32(qd_bf16::f32_to_bf16(w[i]));
  }

  // out + gate * shared, as those two torch ops round in x's dtype (bf16: the product
  // rounded to bf16, then the sum), in place of out; a prompt's rows split between the threads
  static at::Tensor add_gated(at::Tensor out, const at::Tensor& gate, const at::Tensor& shared) {
    const bool plain = out.is_contiguous() && shared.is_contiguous() && gate.is_contiguous() &&
                       gate.dim() == 2 && gate.size(1) == 1 && gate.size(0) == out.size(0) &&
                       shared.sizes() == out.sizes() &&
                       gate.scalar_type() == out.scalar_type() &&
                       shared.scalar_type() == out.scalar_type() &&
                       (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat);
    if (!plain) return out + gate * shared;
    const int64_t N = out.size(0), H = out.size(1);
    at::parallel_for(0, N, qd_rows_grain(H), [&](int64_t r0, int64_t r1) {
      if (out.scalar_type() == at::kFloat)
        add_gated_rows(out.data_ptr<float>(), gate.data_ptr<float>(), shared.data_ptr<float>(),
                       r0, r1, H);
      else
        add_gated_rows(static_cast<uint16_t*>(out.data_ptr()),
                       static_cast<const uint16_t*>(gate.data_ptr()),
                       static_cast<const uint16_t*>(shared.data_ptr()), r0, r1, H);
    });
    return out;
  }

  // rows [r0, r1) of add_gated, fp32 (no fused multiply-add: the product rounds, then the sum)
  __attribute__((optimize("fp-contract=off"))) static void add_gated_rows(
      float* o, const float* g, const float* sv, int64_t r0, int64_t r1, int64_t H) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < H; ++c) {
        const float prod = g[r] * sv[r * H + c];
        o[r * H + c] = o[r * H + c] + prod;
      }
  }

  // rows [r0, r1) of add_gated, bf16
  __attribute__((optimize("fp-contract=off"))) static void add_gated_rows(
      uint16_t* o, const uint16_t* g, const uint16_t* sv, int64_t r0, int64_t r1, int64_t H) {
    using qd_bf16::bf16_to_f32;
    using qd_bf16::f32_to_bf16;
    for (int64_t r = r0; r < r1; ++r) {
      const float gr = bf16_to_f32(g[r]);
      const __m256 gv = _mm256_set1_ps(gr);
      uint16_t* orow = o + r * H;
      const uint16_t* srow = sv + r * H;
      int64_t c = 0;
      for (; c + 8 <= H; c += 8) {  // the product rounded to bf16 (store8), then the sum
        alignas(16) uint16_t prod[8];
        qd_simd::store8(prod, _mm256_mul_ps(gv, qd_simd::load8(srow + c)));
        qd_simd::store8(orow + c, _mm256_add_ps(qd_simd::load8(orow + c), qd_simd::load8(prod)));
      }
      for (; c < H; ++c) {
        const float prod = bf16_to_f32(f32_to_bf16(gr * bf16_to_f32(srow[c])));
        orow[c] = f32_to_bf16(bf16_to_f32(orow[c]) + prod);
      }
    }
  }

  QdMoEGGUF experts_;
  at::Tensor router_;
  c10::optional<at::Tensor> router_bias_;
  bool topk_first_;
  int64_t top_k_;
  bool norm_topk_;
  int64_t max_m_;
  c10::optional<at::Tensor> shared_gate_;
  int64_t shared_gate_panel_n_;  // -1: shared_gate_ is a plain tensor; else its panels' rows
  QdSharedExpert shared_;  // its parts empty when the block has none
};

std::shared_ptr<const QdMoEGGUF> qd_moe_gguf_of(const py::handle& experts) {
  return std::make_shared<const QdMoEGGUF>(experts.cast<const QdMoEGGUF&>());
}

at::Tensor qd_moe_gguf_forward(const QdMoEGGUF& experts, const at::Tensor& x,
                               const at::Tensor& top_idx, const at::Tensor& top_weight) {
  return experts.forward(x, top_idx, top_weight);
}

std::shared_ptr<const QdMoEBlock> qd_moe_block_of(const py::handle& block) {
  return std::make_shared<const QdMoEBlock>(block.cast<const QdMoEBlock&>());
}

at::Tensor qd_moe_block_forward(const QdMoEBlock& block, const at::Tensor& x) {
  return block.forward(x);
}

void qd_register_moe_gguf(py::module_& m) {
  py::class_<QdMoEGGUF>(m, "MoEGGUF")
      .def(py::init<std::vector<std::vector<at::Tensor>>, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<std::vector<at::Tensor>>,
                    std::vector<int64_t>, std::vector<int64_t>, int64_t,
                    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, int64_t,
                    double, double>(),
           py::arg("gate_up"), py::arg("gate_up_fmts"), py::arg("gate_up_ns"), py::arg("down"),
           py::arg("down_fmts"), py::arg("down_ns"), py::arg("hidden"),
           py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none(),
           py::arg("act") = 0, py::arg("alpha") = 1.702, py::arg("limit") = 7.0)
      .def("experts", &QdMoEGGUF::experts)
      .def(
          "forward",
          [](const QdMoEGGUF& self, const at::Tensor& x, const at::Tensor& top_idx,
             const at::Tensor& top_weight) { return self.forward(x, top_idx, top_weight); },
          py::arg("x"), py::arg("top_idx"), py::arg("top_weight"),
          py::call_guard<py::gil_scoped_release>());
  py::class_<QdMoEBlock>(m, "MoEBlock")
      .def(py::init<QdMoEGGUF, at::Tensor, int64_t, bool, int64_t, std::vector<at::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<at::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, c10::optional<at::Tensor>,
                    int64_t, c10::optional<at::Tensor>, bool>(),
           py::arg("experts"), py::arg("router"), py::arg("top_k"), py::arg("norm_topk"),
           py::arg("max_m"), py::arg("shared_gate_up"), py::arg("shared_gate_up_fmts"),
           py::arg("shared_gate_up_ns"), py::arg("shared_down"), py::arg("shared_down_fmts"),
           py::arg("shared_down_ns"), py::arg("shared_gate"), py::arg("shared_gate_panel_n"),
           py::arg("router_bias") = py::none(), py::arg("topk_first") = false)
      .def("forward", &QdMoEBlock::forward, py::arg("x"),
           py::call_guard<py::gil_scoped_release>());
}
