// The Llama family's decoder layers for a step of decode rows (one token each) and prefill
// chunks, all layers in one call: the module path pays Python's dispatch for some 20 small ops a
// layer, which at batch 1 costs as much as the layer's arithmetic, and a chunk's copies besides.
// The same kernels run, in the same order:
//   x, residual = rmsnorm(x + residual); qkv = x Wqkv; rope(q, k); k, v -> cache slots;
//   a = paged attention(q); x = a Wo; x, residual = rmsnorm(x + residual);
//   x = (silu(x Wg) * x Wu) Wd
// Layer 0 takes the embeddings with no residual yet (residual = x, then x = rmsnorm(x)). A
// chunk's rows are attended as the module path attends them on its batch-invariant prefill: each
// row as a decode row at its position, on the one block table of its request.
// cpu_kernels.py / llama_decode.py build the plan: int64 records of pointers and sizes.
#include "common.h"

#include <omp.h>

extern "C" {
void lane_rms_norm_(void*, void*, const void*, int, int64_t, int64_t, float, int);
void lane_rotary_(void*, int, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*, const float*, int64_t,
                  int);
void lane_silu_and_mul(const void*, void*, int, int64_t, int64_t, int);
void lane_paged_decode_attention(const void*, const void*, const void*, int, const int64_t*, const int32_t*, void*,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
void lane_cache_write(const void*, const void*, int64_t, int64_t, void*, void*, const int64_t*, int, int64_t, int64_t,
                      int64_t, int64_t);
void lane_paged_decode_attention_q8(const void*, const void*, const void*, const float*, const float*, const float*, int,
                                    int, const int64_t*, const int32_t*, void*, int64_t, int64_t, int64_t, int64_t,
                                    int64_t, int64_t, float, int);
void lane_cache_write_q8(const void*, const void*, int64_t, int64_t, void*, void*, float*, float*, const int64_t*, int,
                         int, int64_t, int64_t, int64_t, int64_t);
void lane_small_m_linear(const void*, int, const void*, int, const void*, void*, int64_t, int64_t, int64_t, int);
void lane_quant_linear(const void*, int, const void*, int, const float*, void*, int, int64_t, int64_t, int64_t, int);
void lane_quant_x8_linear(const void*, int, const uint8_t*, int, const float*, void*, int, int64_t, int64_t, int64_t,
                          int);
void lane_kquant_linear(const void*, int, const void*, int, const float*, void*, int, int64_t, int64_t, int64_t, int);
bool lane_x8_bf16_amx_silu_mul(const void*, const uint8_t*, int, const float*, void*, int64_t, int64_t, int64_t, int);
}

namespace {

using namespace lane;

// A linear layer's record: format, weight, the weight's dtype or GGUF kind code, bias (the
// weight's dtype for dense, fp32 for blocks; 0: none), N, K. kParts (a fused layer whose parts
// are blocks of different kinds): weight points at its parts' records, code is their count;
// each part computes the next columns of the output.
enum Format : int64_t { kDense = 0, kBlocks = 1, kX8 = 2, kKQuant = 3, kParts = 4 };
struct LinearRec {
  int64_t format, w, code, bias, N, K;
};
// A layer's record: the two norms' weights, the four linears, the K and V caches and, for an
// 8-bit cache, their scales
struct LayerRec {
  int64_t in_norm, post_norm;
  LinearRec qkv, o, gate_up, down;
  int64_t k_cache, v_cache, k_scale, v_scale;
};
// The model's: layers, hidden, heads, kv heads, head dim, intermediate, rotary dim, block
// size, rope cos / sin tables (fp32 [max_pos, rotary dim]), the cache's storage (kModelDtype, or
// C8: kInt8 / kFp8, with the fp8 bytes' float table)
enum CacheKind : int64_t { kModelDtype = 0, kInt8 = 1, kFp8 = 2 };
struct ModelRec {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter, rotary_dim, block_size, cos, sin, cache_kind, fp8_table;
};

template <typename P>
inline P* ptr(int64_t v) {
  return reinterpret_cast<P*>(v);
}

void linear(const LinearRec& l, const void* x, int dtype, void* y, int64_t M, int threads) {
  const void* w = ptr<const void>(l.w);
  const float* bias = ptr<const float>(l.bias);
  const int code = static_cast<int>(l.code);
  switch (l.format) {
    case kDense:
      lane_small_m_linear(x, dtype, w, code, ptr<const void>(l.bias), y, M, l.N, l.K, threads);
      break;
    case kBlocks:
      lane_quant_linear(x, dtype, w, code, bias, y, dtype, M, l.N, l.K, threads);
      break;
    case kX8:
      lane_quant_x8_linear(x, dtype, ptr<const uint8_t>(l.w), code, bias, y, dtype, M, l.N, l.K, threads);
      break;
    case kKQuant:
      lane_kquant_linear(x, dtype, w, code, bias, y, dtype, M, l.N, l.K, threads);
      break;
    default: {  // kParts: a part's rows land in its columns of y (straight there for one row)
      const int64_t es = dtype == kF32 ? 4 : 2;
      const LinearRec* parts = ptr<const LinearRec>(l.w);
      char* out = static_cast<char*>(y);
      char* tmp = M > 1 ? scratch<char, 15>(M * l.N * es) : nullptr;
      for (int64_t p = 0, n0 = 0; p < l.code; n0 += parts[p].N, ++p) {
        linear(parts[p], x, dtype, M > 1 ? tmp : out + n0 * es, M, threads);
        for (int64_t m = 0; m < M && M > 1; ++m)
          std::memcpy(out + (m * l.N + n0) * es, tmp + m * parts[p].N * es, parts[p].N * es);
      }
    }
  }
}

// seconds per piece, summed over layers, when the caller asks (tracing)
enum Piece { kInputNorm, kQkv, kKvWrite, kAttention, kOProj, kFfn, kPieces };
struct Clock {
  double* acc;
  double last;
  explicit Clock(double* a) : acc(a), last(a ? omp_get_wtime() : 0.0) {}
  void mark(Piece p) {
    if (!acc) return;
    const double now = omp_get_wtime();
    acc[p] += now - last;
    last = now;
  }
};

}  // namespace

// x [T, hidden]: layer 0's input (the embeddings), then each layer's output, in place;
// residual [T, hidden] (written by layer 0). positions, slots [T] int64. Rows [0, B) are
// decodes: block_tables [B, MB] int64, context_lens [B] int32 (this token counted). Rows [B, T)
// are prefill chunks: spans [S][4] int64 (first row, rows, tokens already cached, a pointer to
// the request's block ids, int64), in row order. times: null, or kPieces doubles.
extern "C" void lane_llama_decode_layers(const int64_t* model, const int64_t* layers, void* x, void* residual,
                                         int dtype, const int64_t* positions, const int64_t* slots,
                                         const int64_t* block_tables, const int32_t* context_lens, int64_t B,
                                         int64_t MB, const int64_t* spans, int64_t S, int64_t T, float eps,
                                         float scale, double* times, int threads) {
  ModelRec m;
  std::memcpy(&m, model, sizeof(m));
  const int64_t es = dtype == kF32 ? 4 : 2, H = m.heads, KVH = m.kv_heads, D = m.head_dim;
  const int64_t q_size = H * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size;
  char* qkv = scratch<char, 10>(T * qkv_size * es);
  char* q = scratch<char, 11>(T * q_size * es);
  char* attn = scratch<char, 12>(T * q_size * es);
  char* gate_up = scratch<char, 13>(T * 2 * m.inter * es);
  char* act = scratch<char, 14>(T * m.inter * es);
  // each chunk row's context length: its position in the request, plus one
  int32_t* span_lens = scratch<int32_t, 16>(T - B + 1);
  for (int64_t s = 0, r = 0; s < S; ++s)
    for (int64_t i = 0; i < spans[4 * s + 1]; ++i, ++r) span_lens[r] = static_cast<int32_t>(spans[4 * s + 2] + i + 1);
  Clock clock(times);
  for (int64_t i = 0; i < m.layers; ++i) {
    LayerRec l;
    std::memcpy(&l, layers + i * (sizeof(LayerRec) / sizeof(int64_t)), sizeof(l));
    if (i == 0) {
      std::memcpy(residual, x, T * m.hidden * es);
      lane_rms_norm_(x, nullptr, ptr<const void>(l.in_norm), dtype, T, m.hidden, eps, threads);
    } else {
      lane_rms_norm_(x, residual, ptr<const void>(l.in_norm), dtype, T, m.hidden, eps, threads);
    }
    clock.mark(kInputNorm);
    linear(l.qkv, x, dtype, qkv, T, threads);
    lane_rotary_(qkv, dtype, T, qkv_size, H, D, positions, ptr<const float>(m.cos), ptr<const float>(m.sin),
                 m.rotary_dim, threads);
    lane_rotary_(qkv + q_size * es, dtype, T, qkv_size, KVH, D, positions, ptr<const float>(m.cos),
                 ptr<const float>(m.sin), m.rotary_dim, threads);
    clock.mark(kQkv);
    const bool c8 = m.cache_kind != kModelDtype;
    const int fp8 = m.cache_kind == kFp8;
    if (c8)
      lane_cache_write_q8(qkv + q_size * es, qkv + (q_size + kv_size) * es, qkv_size, qkv_size, ptr<void>(l.k_cache),
                          ptr<void>(l.v_cache), ptr<float>(l.k_scale), ptr<float>(l.v_scale), slots, dtype, fp8, T, KVH,
                          D, m.block_size);
    else
      lane_cache_write(qkv + q_size * es, qkv + (q_size + kv_size) * es, qkv_size, qkv_size, ptr<void>(l.k_cache),
                       ptr<void>(l.v_cache), slots, dtype, T, KVH, D, m.block_size);
    clock.mark(kKvWrite);
    for (int64_t t = 0; t < T; ++t) std::memcpy(q + t * q_size * es, qkv + t * qkv_size * es, q_size * es);
    // rows [r0, r0 + n) of q on block tables `tables` (MB columns; 0: one table for all)
    auto attend = [&](int64_t r0, int64_t n, const int64_t* tables, const int32_t* lens, int64_t mb) {
      const char* qr = q + r0 * q_size * es;
      char* out = attn + r0 * q_size * es;
      if (c8)
        lane_paged_decode_attention_q8(qr, ptr<const void>(l.k_cache), ptr<const void>(l.v_cache),
                                       ptr<const float>(l.k_scale), ptr<const float>(l.v_scale),
                                       ptr<const float>(m.fp8_table), fp8, dtype, tables, lens, out, n, H, KVH, D,
                                       m.block_size, mb, scale, threads);
      else
        lane_paged_decode_attention(qr, ptr<const void>(l.k_cache), ptr<const void>(l.v_cache), dtype, tables, lens,
                                    out, n, H, KVH, D, m.block_size, mb, scale, threads);
    };
    if (B > 0) attend(0, B, block_tables, context_lens, MB);
    for (int64_t s = 0, r = 0; s < S; r += spans[4 * s + 1], ++s)
      attend(spans[4 * s], spans[4 * s + 1], ptr<const int64_t>(spans[4 * s + 3]), span_lens + r, 0);
    clock.mark(kAttention);
    linear(l.o, attn, dtype, x, T, threads);
    clock.mark(kOProj);
    lane_rms_norm_(x, residual, ptr<const void>(l.post_norm), dtype, T, m.hidden, eps, threads);
    clock.mark(kInputNorm);
    // bf16 rows on x8 Q4 blocks with AMX: the gate_up tiles apply the SiLU-and-mul as they store
    if (!(l.gate_up.format == kX8 && dtype == kBF16 &&
          lane_x8_bf16_amx_silu_mul(x, ptr<const uint8_t>(l.gate_up.w), static_cast<int>(l.gate_up.code),
                                    ptr<const float>(l.gate_up.bias), act, T, m.inter, l.gate_up.K, threads))) {
      linear(l.gate_up, x, dtype, gate_up, T, threads);
      lane_silu_and_mul(gate_up, act, dtype, T, m.inter, threads);
    }
    linear(l.down, act, dtype, x, T, threads);
    clock.mark(kFfn);
  }
}
