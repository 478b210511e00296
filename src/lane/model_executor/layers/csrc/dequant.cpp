// GGUF block dequantisation (Q4_0, Q4_1, Q8_0) straight into the model dtype: one pass
// over the weights where torch needs six. Built with -ffp-contract=off: d * q + m
// rounds twice, as gguf's numpy reference (and so transformers) computes it.
#include "common.h"

namespace {

using namespace lane;

template <typename T>
void dequant_blocks(const uint8_t* src, int qtype, int64_t b0, int64_t b1, T* dst) {
  const int64_t size = ggml_block_bytes(qtype);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = src + b * size;
    T* out = dst + b * 32;
    const float d = half_at(blk);
    if (qtype == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < 32; ++i) out[i] = from_f<T>(d * static_cast<float>(q[i]));
    } else if (qtype == kQ4_0) {  // low nibbles are values 0-15, high nibbles 16-31
      const uint8_t* q = blk + 2;
      for (int i = 0; i < 16; ++i) {
        out[i] = from_f<T>(d * static_cast<float>((q[i] & 0x0f) - 8));
        out[i + 16] = from_f<T>(d * static_cast<float>((q[i] >> 4) - 8));
      }
    } else {
      const float m = half_at(blk + 2);
      const uint8_t* q = blk + 4;
      for (int i = 0; i < 16; ++i) {
        out[i] = from_f<T>(d * static_cast<float>(q[i] & 0x0f) + m);
        out[i + 16] = from_f<T>(d * static_cast<float>(q[i] >> 4) + m);
      }
    }
  }
}

}  // namespace

// src: nblocks GGUF blocks of qtype (0 Q4_0, 1 Q4_1, 2 Q8_0) -> dst [nblocks * 32] (dtype)
extern "C" void lane_dequant_ggml(const void* src, int qtype, int64_t nblocks, void* dst, int dtype,
                                  int threads) {
  LANE_DISPATCH(dtype, T, parallel_for(nblocks, 4096, threads, [&](int64_t b0, int64_t b1) {
    dequant_blocks<T>(static_cast<const uint8_t*>(src), qtype, b0, b1, static_cast<T*>(dst));
  }));
}

extern "C" void lane_dequant_kquant(const void* src, int kind, int64_t nblocks, void* dst, int dtype, int threads);

namespace {

// row n of x8-layout weights [N, K] -> dst [K]: each block as its GGUF self, dequantized so
template <typename T>
void dequant_x8_row(const uint8_t* src, int qtype, int64_t n, int64_t K, T* dst) {
  const int64_t vals = x8_values(qtype), nb = K / vals, gb = kX8Rows * ggml_block_bytes(qtype), g = n / kX8Rows;
  uint8_t blk[210];
  for (int64_t b = 0; b < nb; ++b) {
    x8_block(const_cast<uint8_t*>(src) + (g * nb + b) * gb, qtype, static_cast<int>(n % kX8Rows), blk, false);
    if (qtype >= kQ4_K)
      lane_dequant_kquant(blk, qtype, 1, dst + b * vals, dtype_code<T>(), 1);
    else
      dequant_blocks<T>(blk, qtype, 0, 1, dst + b * vals);
  }
}

}  // namespace

// src: weights [N, K] in the x8 layout (common.h) -> dst [N, K] (dtype), rounded as above
extern "C" void lane_dequant_ggml_x8(const void* src, int qtype, int64_t N, int64_t K, void* dst, int dtype,
                                     int threads) {
  LANE_DISPATCH(dtype, T, parallel_for(N, 64, threads, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      dequant_x8_row<T>(static_cast<const uint8_t*>(src), qtype, n, K, static_cast<T*>(dst) + n * K);
  }));
}

// rows ids [n] of x8-layout weights [N, K] -> dst [n, K] (an embedding's lookup)
extern "C" void lane_dequant_x8_rows(const void* src, int qtype, const int64_t* ids, int64_t n, int64_t K, void* dst,
                                     int dtype) {
  LANE_DISPATCH(dtype, T, for (int64_t i = 0; i < n; ++i) dequant_x8_row<T>(
      static_cast<const uint8_t*>(src), qtype, ids[i], K, static_cast<T*>(dst) + i * K));
}
