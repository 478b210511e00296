// GGUF K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights) kept in their blocks:
// dequantization, and the linear layer for the decode and verify rows (M <= 16).
//
// Layouts (ggml's block_q4_K / q5_K / q6_K):
//   Q4_K 144 B: fp16 d, fp16 dmin, 12 B of 6-bit scales and mins (8 sub-blocks of 32), 128 B nibbles
//   Q5_K 176 B: as Q4_K, with 32 B of fifth bits (qh) before the nibbles
//   Q6_K 210 B: 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales (sub-blocks of 16), fp16 d
// Every kind stores unsigned quants u (Q4_K 0-15, Q5_K 0-31, Q6_K 0-63), so with the input
// row quantized once per call as ggml's Q8_K (int8 q_x, one scale d_x per 256, the sums of
// q_x per 16), a super-block's dot product is integer but for two float factors:
//   Q4_K, Q5_K: w = d sc_j u - dmin m_j:  y += d_x (d sum_j sc_j dot_j(u, q_x) - dmin sum_j m_j bsum_j)
//   Q6_K:       w = d sc_j (u - 32):      y += d_x d (sum_j sc_j dot_j(u, q_x) - 32 sum_j sc_j bsum_j)
// The sums over j run per 16 values (Q4_K / Q5_K's scales counted twice), so the three
// kinds share one dot product: u8 x s8 pairs (maddubs; u <= 63, so no int16 saturation),
// times the sub-block scales as int16 (madd, or VNNI's dpwssd), summed in int32.
// Built with -ffp-contract=off so the dequantizer rounds as gguf's numpy reference; the
// kernels' FMAs are explicit intrinsics.
#include "common.h"

#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace lane;

constexpr int QK = 256;

// A super-block's scales per 16 values (sc), the multipliers of the q_x sums per 16 (mm)
// and the two float factors: dot = da * sum sc_j dot_j(u, q_x) - db * sum mm_j bsum_j.
struct Scales {
  alignas(32) int16_t sc[16];
  alignas(32) int16_t mm[16];
  float da, db;
};

template <int KIND>
inline void scales_of(const uint8_t* blk, Scales& s) {
  if (KIND == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int j = 0; j < 16; ++j) {
      s.sc[j] = sc[j];
      s.mm[j] = static_cast<int16_t>(32 * sc[j]);
    }
    s.da = s.db = half_at(blk + 208);
    return;
  }
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    q4k_scale_min(blk + 4, j, sc, m);  // ggml's get_scale_min_k4
    s.sc[2 * j] = s.sc[2 * j + 1] = static_cast<int16_t>(sc);
    s.mm[2 * j] = s.mm[2 * j + 1] = static_cast<int16_t>(m);
  }
  s.da = half_at(blk);
  s.db = half_at(blk + 2);
}

// stored quant l (0-31) of chunk c (values 32c .. 32c + 31), unsigned
template <int KIND>
inline uint8_t quant(const uint8_t* blk, int c, int l) {
  if (KIND == kQ6_K) {  // each 128 values: 64 B of nibbles (low halves first), 32 B of 2-bit highs
    const int h = c >> 2, k = c & 3;
    const int lo = (blk[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15;
    return static_cast<uint8_t>(lo | (((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4));
  }
  const int lo = (blk[(KIND == kQ4_K ? 16 : 48) + 32 * (c >> 1) + l] >> (4 * (c & 1))) & 15;
  return static_cast<uint8_t>(KIND == kQ4_K ? lo : lo | (((blk[16 + l] >> c) & 1) << 4));
}

template <int KIND>
inline void unpack(const uint8_t* blk, uint8_t* u) {
  for (int c = 0; c < 8; ++c)
    for (int l = 0; l < 32; ++l) u[32 * c + l] = quant<KIND>(blk, c, l);
}

template <int KIND, typename T>
void dequant_blocks(const uint8_t* src, int64_t b0, int64_t b1, T* dst) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = src + b * ggml_block_bytes(KIND);
    uint8_t u[QK];
    Scales s;
    unpack<KIND>(blk, u);
    scales_of<KIND>(blk, s);
    for (int j = 0; j < 16; ++j) {  // float32 as gguf: (d * sc) * q - dmin * m, each product rounded
      const float f = s.da * static_cast<float>(s.sc[j]);
      const float g = KIND == kQ6_K ? 0.f : s.db * static_cast<float>(s.mm[j]);
      const int off = KIND == kQ6_K ? 32 : 0;
      for (int i = 16 * j; i < 16 * j + 16; ++i)
        dst[b * QK + i] = from_f<T>(f * static_cast<float>(static_cast<int>(u[i]) - off) - g);
    }
  }
}

// the generic (and reference) super-block dot: sum sc_j dot_j(u, q_x) and sum mm_j bsum_j
inline void dot_generic(const uint8_t* u, const Scales& s, const int8_t* qx, const int16_t* bs, int32_t& isum,
                        int32_t& corr) {
  isum = corr = 0;
  for (int j = 0; j < 16; ++j) {
    int32_t dj = 0;
    for (int i = 16 * j; i < 16 * j + 16; ++i) dj += static_cast<int32_t>(u[i]) * qx[i];
    isum += s.sc[j] * dj;
    corr += s.mm[j] * bs[j];
  }
}

template <int KIND>
void rows_generic(const uint8_t* wp, const int8_t* qx, const float* dx, const int16_t* bs, float* yf, int64_t M,
                  int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK, row = nb * ggml_block_bytes(KIND);
  std::vector<float> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) acc[m] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + n * row + b * ggml_block_bytes(KIND);
      uint8_t u[QK];
      Scales s;
      unpack<KIND>(blk, u);  // once for every input row
      scales_of<KIND>(blk, s);
      for (int64_t m = 0; m < M; ++m) {
        int32_t isum, corr;
        dot_generic(u, s, qx + m * K + b * QK, bs + (m * nb + b) * 16, isum, corr);
        const float d = dx[m * nb + b];
        acc[m] += KIND == kQ6_K ? s.da * d * static_cast<float>(isum - corr)
                                : s.da * d * static_cast<float>(isum) - s.db * d * static_cast<float>(corr);
      }
    }
    for (int64_t m = 0; m < M; ++m) yf[m * N + n] = acc[m];
  }
}

#if defined(__AVX2__)
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m256i shr16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

// chunk c (values 32c .. 32c + 31) of a super-block as 32 unsigned bytes, in value order
template <int KIND>
inline __m256i chunk(const uint8_t* blk, int c) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if (KIND == kQ6_K) {
    const int h = c >> 2, k = c & 3;
    const __m256i lo = _mm256_and_si256(shr16(load256(blk + 64 * h + 32 * (k & 1)), 4 * (k >> 1)), m4);
    const __m256i hi = _mm256_and_si256(shr16(load256(blk + 128 + 32 * h), 2 * k), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  // 2-bit highs: no carry across bytes
  }
  const __m256i lo = _mm256_and_si256(shr16(load256(blk + (KIND == kQ4_K ? 16 : 48) + 32 * (c >> 1)), 4 * (c & 1)), m4);
  if (KIND == kQ4_K) return lo;
  const __m256i hi = _mm256_and_si256(shr16(load256(blk + 16), c), _mm256_set1_epi8(1));
  return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

// a super-block's scales per 16 (sc) and q_x-sum multipliers (mm) as int16 lanes, built in
// registers (16 scalar stores read back as a vector would stall store forwarding)
template <int KIND>
inline void scales_simd(const uint8_t* blk, __m256i& sc, __m256i& mm, float& da, float& db) {
  if (KIND == kQ6_K) {
    sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    mm = _mm256_slli_epi16(sc, 5);  // 32 sc
    da = db = half_at(blk + 208);
    return;
  }
  uint32_t u[3];  // the 12 bytes of 6-bit fields, unpacked a word at a time as ggml does
  std::memcpy(u, blk + 4, 12);
  const uint64_t s = (u[0] & 0x3f3f3f3fu) |
                     static_cast<uint64_t>((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
  const uint64_t m = (u[1] & 0x3f3f3f3fu) |
                     static_cast<uint64_t>(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)) << 32;
  const __m128i s8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(s)));  // 8 scales
  const __m128i m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(m)));  // 8 mins
  sc = _mm256_set_m128i(_mm_unpackhi_epi16(s8, s8), _mm_unpacklo_epi16(s8, s8));  // each twice: per 16
  mm = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
  da = half_at(blk);
  db = half_at(blk + 2);
}

// the int16 scales of chunk c's maddubs lanes: sc[2c] for lanes 0-7, sc[2c + 1] for 8-15
inline __m256i chunk_scales(__m256i sc, int c) {
  const __m256i pair = _mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(c));
  return _mm256_shuffle_epi8(pair, _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                                   1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// weight rows n0..n1 against R input rows: each chunk of each super-block is unpacked
// once, then dotted with the R rows (int32 accumulators per row, float across blocks)
template <int KIND, int R>
void rows_avx2(const uint8_t* wp, const int8_t* qx, const float* dx, const int16_t* bs, float* yf, int64_t N,
               int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK, row = nb * ggml_block_bytes(KIND);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + n * row + b * ggml_block_bytes(KIND);
      __m256i sc16, mm;
      float da, db;
      scales_simd<KIND>(blk, sc16, mm, da, db);
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w = chunk<KIND>(blk, c);
        // maddubs leaves values 0-15 in int16 lanes 0-7, 16-31 in 8-15: one scale per half
        const __m256i sc = chunk_scales(sc16, c);
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_maddubs_epi16(w, load256(qx + r * K + b * QK + 32 * c));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, sc));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i corr = _mm256_madd_epi16(mm, load256(bs + (r * nb + b) * 16));
        const float d = dx[r * nb + b];
        if (KIND == kQ6_K) {  // one scale for both: subtract in int32, exactly
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], corr)), _mm256_set1_ps(da * d), acc[r]);
        } else {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(da * d), acc[r]);
          acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(db * d), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) yf[r * N + n] = hsum(acc[r]);
  }
}
#endif

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The AVX-512 rows, twice: as built (AVX-512BW: maddubs, madd, add) and, for CPUs with
// VNNI (checked at run time, not a build flag), with dpwssd fusing the madd and add.
namespace {
#define LANE_KQ_NS avx512
#define LANE_KQ_VNNI 0
#include "kquant_avx512.inc"
#undef LANE_KQ_NS
#undef LANE_KQ_VNNI
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif
#define LANE_KQ_NS avx512vnni
#define LANE_KQ_VNNI 1
#include "kquant_avx512.inc"
#undef LANE_KQ_NS
#undef LANE_KQ_VNNI
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace
#endif

namespace {

template <int KIND>
void linear_rows(const uint8_t* wp, const int8_t* qx, const float* dx, const int16_t* bs, float* yf, int64_t M,
                 int64_t N, int64_t K, int64_t n0, int64_t n1) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (use_vnni())
    avx512vnni::tile<KIND>(wp, qx, dx, bs, yf, M, N, K, n0, n1);
  else
    avx512::tile<KIND>(wp, qx, dx, bs, yf, M, N, K, n0, n1);
#elif defined(__AVX2__)
  const int64_t nb = K / QK;
  for (int64_t t0 = n0; t0 < n1; t0 += 16) {  // 16 weight rows stay in L1/L2 for every 4 input rows
    const int64_t t1 = t0 + 16 < n1 ? t0 + 16 : n1;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      rows_avx2<KIND, 4>(wp, qx + m * K, dx + m * nb, bs + m * nb * 16, yf + m * N, N, K, t0, t1);
    for (; m + 2 <= M; m += 2)
      rows_avx2<KIND, 2>(wp, qx + m * K, dx + m * nb, bs + m * nb * 16, yf + m * N, N, K, t0, t1);
    if (m < M) rows_avx2<KIND, 1>(wp, qx + m * K, dx + m * nb, bs + m * nb * 16, yf + m * N, N, K, t0, t1);
  }
#else
  rows_generic<KIND>(wp, qx, dx, bs, yf, M, N, K, n0, n1);
#endif
}

#define LANE_KQ_DISPATCH(kind, ...)      \
  switch (kind) {                        \
    case kQ4_K: {                        \
      constexpr int KIND = kQ4_K;        \
      __VA_ARGS__;                       \
      break;                             \
    }                                    \
    case kQ5_K: {                        \
      constexpr int KIND = kQ5_K;        \
      __VA_ARGS__;                       \
      break;                             \
    }                                    \
    default: {                           \
      constexpr int KIND = kQ6_K;        \
      __VA_ARGS__;                       \
      break;                             \
    }                                    \
  }

}  // namespace

// src: nblocks super-blocks of kind (3 Q4_K, 4 Q5_K, 5 Q6_K) -> dst [nblocks * 256] (dtype)
extern "C" void lane_dequant_kquant(const void* src, int kind, int64_t nblocks, void* dst, int dtype, int threads) {
  LANE_KQ_DISPATCH(kind, LANE_DISPATCH(dtype, T, parallel_for(nblocks, 512, threads, [&](int64_t b0, int64_t b1) {
    dequant_blocks<KIND, T>(static_cast<const uint8_t*>(src), b0, b1, static_cast<T*>(dst));
  })));
}

// x rows as ggml's Q8_K: q [M, K] int8, d [M, K/256] (max|x| / 127), bsum [M, K/16] (sums of q)
extern "C" void lane_quantize_rows_q8k(const void* x, int x_dtype, int8_t* q, float* d, int16_t* bsum, int64_t M,
                                       int64_t K) {
  const int64_t nb = K / QK;
  LANE_DISPATCH(x_dtype, T, {
    const T* xp = static_cast<const T*>(x);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        int8_t* qb = q + m * K + b * QK;
        const float scale = quantize_block_q8(xp + m * K + b * QK, QK, qb);
        for (int j = 0; j < 16; ++j) {
          int s = 0;
          for (int i = 0; i < 16; ++i) s += qb[16 * j + i];
          bsum[(m * nb + b) * 16 + j] = static_cast<int16_t>(s);
        }
        d[m * nb + b] = scale;
      }
  });
}

// For tests: the int32 dot products of each input row with each weight row's sub-blocks
// (Q4_K, Q5_K: 32 values, unsigned quants; Q6_K: 16 values, quants - 32), dots [M, N, K/32
// or K/16], from the weights as the build's kernel unpacks them.
extern "C" void lane_kquant_sub_dots(const int8_t* qx, const void* w, int kind, int32_t* dots, int64_t M, int64_t N,
                                     int64_t K) {
  LANE_KQ_DISPATCH(kind, {
    const int sub = KIND == kQ6_K ? 16 : 32, off = KIND == kQ6_K ? 32 : 0;
    const int64_t nb = K / QK, row = nb * ggml_block_bytes(KIND), ns = K / sub;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = static_cast<const uint8_t*>(w) + n * row + b * ggml_block_bytes(KIND);
        alignas(32) uint8_t u[QK];
#if defined(__AVX2__)
        for (int c = 0; c < 8; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(u + 32 * c), chunk<KIND>(blk, c));
#else
        unpack<KIND>(blk, u);
#endif
        for (int64_t m = 0; m < M; ++m)
          for (int j = 0; j < QK / sub; ++j) {
            int32_t s = 0;
            for (int i = sub * j; i < sub * j + sub; ++i) s += (static_cast<int32_t>(u[i]) - off) * qx[m * K + b * QK + i];
            dots[(m * N + n) * ns + b * (QK / sub) + j] = s;
          }
      }
  });
}

// y [M, N] (y_dtype) = x [M, K] (x_dtype, quantized to Q8_K here) . W^T, W [N, K] in K-quant super-blocks (+ bias fp32)
extern "C" void lane_kquant_linear(const void* x, int x_dtype, const void* w, int kind, const float* bias, void* y,
                                   int y_dtype, int64_t M, int64_t N, int64_t K, int threads) {
  int8_t* qx = scratch<int8_t, 1>(M * K);  // x as Q8_K, once per call, in per-thread buffers
  float* dx = scratch<float, 2>(M * (K / QK));
  int16_t* bsum = scratch<int16_t, 0>(M * (K / 16));
  lane_quantize_rows_q8k(x, x_dtype, qx, dx, bsum, M, K);
  float* yf = scratch<float, 3>(M * N);
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  LANE_KQ_DISPATCH(kind, parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
    linear_rows<KIND>(wp, qx, dx, bsum, yf, M, N, K, n0, n1);
  }));
  LANE_DISPATCH(y_dtype, T, {
    T* yp = static_cast<T*>(y);
    for (int64_t i = 0; i < M * N; ++i) yp[i] = from_f<T>(yf[i] + (bias ? bias[i % N] : 0.f));
  });
}
