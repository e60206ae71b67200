// Rows of a GGUF table in its own block format, dequantized to fp32 (models/layers.py
// `GGUFEmbedding`: a token's embedding, Gemma's per-layer inputs). The reference is the gguf
// package's `dequantize`: the same fp32 products and differences in the same order (no fused
// multiply-add), so the same bits. Formats: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (what llama.cpp's
// quantizer gives token_embd in its Q4_0 .. Q8_0 mixes); `gguf_rows_formats()` lists them by
// ggml type, and the others stay on the reference.
//
// Why: the reference costs ~0.4 ms a row (dozens of numpy calls), ~4 % of a cut MoE model's
// decode step and more of a small dense model's; here a row is a few microseconds.
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// ggml type ids
constexpr int64_t kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // exact: every f16 is an fp32
}

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (gguf's Q4_K.get_scale_min)
void scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 0x3F;
    *m = s[j + 4] & 0x3F;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// One block into out (32 or 256 values); fp-contract off: d * q - dm rounds twice, as numpy
__attribute__((optimize("fp-contract=off"))) void block(int64_t type, const uint8_t* b,
                                                         float* out) {
  switch (type) {
    case kQ4_0: {
      const float d = f16(b);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * static_cast<float>((b[2 + i] & 0x0F) - 8);
        out[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
      }
      return;
    }
    case kQ8_0: {
      const float d = f16(b);
      for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;  // Q5_K only
      const uint8_t* qs = type == kQ4_K ? b + 16 : b + 48;
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min(scales, j, &sc, &m);
        const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(m);
        const uint8_t* q = qs + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int i = 0; i < 32; ++i) {
          int v = (q[i] >> shift) & 0x0F;
          if (type == kQ5_K) v |= ((qh[i] >> j) & 1) << 4;
          out[j * 32 + i] = dj * static_cast<float>(v) - mj;
        }
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int c = 0; c < 8; ++c) {  // 32 values: ql's half c / 4, nibble (c % 4) / 2
        const int h = c / 4;
        const uint8_t* l = ql + h * 64 + (c % 2) * 32;
        const int lshift = ((c % 4) / 2) * 4, hshift = (c % 4) * 2;
        for (int i = 0; i < 32; ++i) {
          const int e = c * 32 + i;
          const int q = (((l[i] >> lshift) & 0x0F) | (((qh[h * 32 + i] >> hshift) & 3) << 4)) - 32;
          out[e] = (d * static_cast<float>(scales[e / 16])) * static_cast<float>(q);
        }
      }
      return;
    }
  }
}

int64_t block_values(int64_t type) { return type == kQ4_0 || type == kQ8_0 ? 32 : 256; }

int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
  }
  return 0;
}

}  // namespace

std::vector<int64_t> qd_gguf_rows_formats() { return {kQ4_0, kQ8_0, kQ4_K, kQ5_K, kQ6_K}; }

// raw [V, row bytes] uint8 (the file's rows), ids [n] int64 -> [n, dim] fp32
at::Tensor qd_gguf_rows(const at::Tensor& raw, const at::Tensor& ids, int64_t type, int64_t dim) {
  const int64_t bb = block_bytes(type), bv = block_values(type);
  TORCH_CHECK(bb > 0, "quickdraft gguf_rows: ggml type ", type, " is not one of gguf_rows_formats()");
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 &&
                  raw.stride(1) == 1,
              "quickdraft gguf_rows: raw must be a CPU uint8 [rows, bytes] table, rows contiguous");
  TORCH_CHECK(dim > 0 && dim % bv == 0 && raw.size(1) == dim / bv * bb,
              "quickdraft gguf_rows: ", raw.size(1), " bytes a row is not ", dim,
              " values of ggml type ", type);
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  TORCH_CHECK(idx.dim() == 1, "quickdraft gguf_rows: ids must be 1-D");
  const int64_t n = idx.size(0), rows = raw.size(0);
  at::Tensor out = at::empty({n, dim}, raw.options().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  const uint8_t* base = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t id = ip[r];
    TORCH_CHECK(id >= 0 && id < rows, "quickdraft gguf_rows: id ", id, " outside [0, ", rows, ")");
    const uint8_t* row = base + id * raw.stride(0);
    for (int64_t b = 0; b < dim / bv; ++b) block(type, row + b * bb, op + r * dim + b * bv);
  }
  return out;
}
