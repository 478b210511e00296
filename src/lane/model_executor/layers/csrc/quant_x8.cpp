// Linear layers on Q4_0 / Q4_1 / Q8_0 weights repacked at load, 8 rows interleaved
// (common.h's "x8" layout), for the decode and verify rows (M <= 16). The GGUF layout's
// kernel (quant_linear.cpp) does a block's float work (fp16 conversions, a scale product, an
// FMA into one row's sum, a horizontal add per row) for every row; here one register holds 8
// rows, so that work is done once per 8 rows, and one 32-bit broadcast of 4 activations feeds
// 8 rows' products (as llama.cpp's Q4_0_8x8 GEMV does):
//   dot_r = sum_i w_r,i q_x,i (maddubs + madd, or VNNI's dpbusd; u8 x s8, so Q4 takes the
//           unsigned nibbles and Q8_0 |w| times q_x with w's sign)
//   Q4_1: y_r += d_r d_x dot_r + m_r s_x     Q4_0: y_r += d_r d_x (dot_r - 8 sum q_x)
//   Q8_0: y_r += d_r d_x dot_r
// Q4_0's offset is taken in int32, so every block's integer dot product is exact.
#include "common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace lane;

constexpr int kBlock = 32;

inline int64_t group_block_bytes(int qtype) { return kX8Rows * ggml_block_bytes(qtype); }

// generic: 8 rows' int32 dot products of one block with x's block (Q4: unsigned nibbles)
inline void dots_scalar(const uint8_t* q, int qtype, const int8_t* xq, int32_t* out) {
  for (int r = 0; r < kX8Rows; ++r) {
    int32_t s = 0;
    for (int c = 0; c < x8_chunks(qtype); ++c)
      for (int j = 0; j < 4; ++j) {
        const uint8_t v = q[32 * c + 4 * r + j];
        if (qtype == kQ8_0)
          s += static_cast<int8_t>(v) * xq[4 * c + j];
        else
          s += (v & 0x0f) * xq[4 * c + j] + (v >> 4) * xq[16 + 4 * c + j];
      }
    out[r] = s;
  }
}

#if defined(__AVX2__)
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Q4: one block of 8 rows as chunk c's low nibbles (values 4c..4c+3 of every row, 4 bytes a
// row) and high nibbles (values 16 + 4c..). maddubs pairs u (<= 15) with q_x (|q_x| <= 127):
// an int16 lane holds at most 2 * 15 * 127, and 8 of them summed stay under 2^15.
struct Q4 {
  struct W {
    __m256i lo[4], hi[4];
  };
  static inline W load(const uint8_t* q) {
    W w;
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      w.lo[c] = _mm256_and_si256(raw, mask);
      w.hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    }
    return w;
  }
  static inline __m256i dots(const W& w, const int8_t* xq) {  // lane r: row r's dot product
    __m256i s = _mm256_maddubs_epi16(w.lo[0], bcast4(xq));
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w.hi[0], bcast4(xq + 16)));
    for (int c = 1; c < 4; ++c) {
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w.lo[c], bcast4(xq + 4 * c)));
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w.hi[c], bcast4(xq + 16 + 4 * c)));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
  }
};

// Q8_0: 8 chunks of signed quants; |w| (u8) times q_x with w's sign (ggml's trick). One
// maddubs lane holds up to 2 * 127 * 127, so each goes to int32 (madd) before the sum.
struct Q8 {
  struct W {
    __m256i q[8];
  };
  static inline W load(const uint8_t* q) {
    W w;
    for (int c = 0; c < 8; ++c) w.q[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
    return w;
  }
  static inline __m256i dots(const W& w, const int8_t* xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w.q[c], w.q[c]), _mm256_sign_epi8(bcast4(xq + 4 * c), w.q[c]));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
  }
};

#define LANE_X8_VNNI __attribute__((target("avx512f,avx512vl,avx512vnni")))
struct Q4Vnni : Q4 {
  LANE_X8_VNNI static inline __m256i dots(const W& w, const int8_t* xq) {
    __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();  // two chains: dpbusd's latency
    for (int c = 0; c < 4; ++c) {
      s = _mm256_dpbusd_epi32(s, w.lo[c], bcast4(xq + 4 * c));
      t = _mm256_dpbusd_epi32(t, w.hi[c], bcast4(xq + 16 + 4 * c));
    }
    return _mm256_add_epi32(s, t);
  }
};
struct Q8Vnni : Q8 {
  LANE_X8_VNNI static inline __m256i dots(const W& w, const int8_t* xq) {
    __m256i s = _mm256_setzero_si256(), t = _mm256_setzero_si256();
    for (int c = 0; c < 8; c += 2) {
      s = _mm256_dpbusd_epi32(s, _mm256_abs_epi8(w.q[c]), _mm256_sign_epi8(bcast4(xq + 4 * c), w.q[c]));
      t = _mm256_dpbusd_epi32(t, _mm256_abs_epi8(w.q[c + 1]), _mm256_sign_epi8(bcast4(xq + 4 * c + 4), w.q[c + 1]));
    }
    return _mm256_add_epi32(s, t);
  }
};

// One group of 8 weight rows against R input rows: y[r * N + n0 .. n0 + 8). The kind (Q) is a
// template argument, so the inner loops carry no branch on it.
template <int Q, int R, class F, typename T>
__attribute__((always_inline)) inline void group_rows(const uint8_t* gp, int64_t nb, const int8_t* qx,
                                                      const float* dx, const float* sx, const int32_t* isum,
                                                      int64_t K, const float* bias, T* y, int64_t N, int64_t n0) {
  const int64_t gb = group_block_bytes(Q), qo = x8_quant_offset(Q);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = gp + b * gb;
    const typename F::W w = F::load(o + qo);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
    for (int r = 0; r < R; ++r) {
      __m256i i = F::dots(w, qx + r * K + b * kBlock);
      if (Q == kQ4_0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(8 * isum[r * nb + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), _mm256_cvtepi32_ps(i), acc[r]);
    }
    if (Q == kQ4_1) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (bias) acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(bias + n0));
    alignas(32) float out[kX8Rows];
    _mm256_store_ps(out, acc[r]);
    for (int i = 0; i < kX8Rows; ++i) y[r * N + n0 + i] = from_f<T>(out[i]);
  }
}

template <int Q, class F, typename T>
__attribute__((always_inline)) inline void groups(const uint8_t* wp, const int8_t* qx, const float* dx,
                                                  const float* sx, const int32_t* isum, const float* bias, T* y,
                                                  int64_t M, int64_t N, int64_t K, int64_t g0, int64_t g1) {
  const int64_t nb = K / kBlock, passes = (M + 7) / 8;  // balanced passes of at most 8 rows
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = wp + g * nb * group_block_bytes(Q);
    for (int64_t p = 0, m = 0; p < passes; ++p) {
      const int64_t r = M / passes + (p < M % passes);
      const int8_t* q = qx + m * K;
      const float *d = dx + m * nb, *s = sx + m * nb;
      const int32_t* is = isum + m * nb;
      T* yr = y + m * N;
      const int64_t n0 = g * kX8Rows;
      switch (r) {
#define LANE_X8_CASE(R) \
  case R: group_rows<Q, R, F, T>(gp, nb, q, d, s, is, K, bias, yr, N, n0); break;
        LANE_X8_CASE(1) LANE_X8_CASE(2) LANE_X8_CASE(3) LANE_X8_CASE(4)
        LANE_X8_CASE(5) LANE_X8_CASE(6) LANE_X8_CASE(7) LANE_X8_CASE(8)
#undef LANE_X8_CASE
      }
      m += r;
    }
  }
}

#define LANE_X8_GROUPS(F4, F8)                                                                               \
  switch (qtype) {                                                                                          \
    case kQ4_0: groups<kQ4_0, F4, T>(wp, qx, dx, sx, isum, bias, y, M, N, K, g0, g1); break;                \
    case kQ4_1: groups<kQ4_1, F4, T>(wp, qx, dx, sx, isum, bias, y, M, N, K, g0, g1); break;                \
    default: groups<kQ8_0, F8, T>(wp, qx, dx, sx, isum, bias, y, M, N, K, g0, g1);                          \
  }

template <typename T>
void groups_avx2(const uint8_t* wp, int qtype, const int8_t* qx, const float* dx, const float* sx,
                 const int32_t* isum, const float* bias, T* y, int64_t M, int64_t N, int64_t K, int64_t g0,
                 int64_t g1) {
  LANE_X8_GROUPS(Q4, Q8)
}

template <typename T>
LANE_X8_VNNI void groups_vnni(const uint8_t* wp, int qtype, const int8_t* qx, const float* dx, const float* sx,
                              const int32_t* isum, const float* bias, T* y, int64_t M, int64_t N, int64_t K,
                              int64_t g0, int64_t g1) {
  LANE_X8_GROUPS(Q4Vnni, Q8Vnni)
}
#undef LANE_X8_GROUPS

#endif

template <typename T>
void groups_scalar(const uint8_t* wp, int qtype, const int8_t* qx, const float* dx, const float* sx,
                   const int32_t* isum, const float* bias, T* y, int64_t M, int64_t N, int64_t K, int64_t g0,
                   int64_t g1) {
  const int64_t nb = K / kBlock, gb = group_block_bytes(qtype), qo = x8_quant_offset(qtype);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m = 0; m < M; ++m) {
      float acc[kX8Rows] = {};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* o = wp + (g * nb + b) * gb;
        int32_t dots[kX8Rows];
        dots_scalar(o + qo, qtype, qx + m * K + b * kBlock, dots);
        for (int r = 0; r < kX8Rows; ++r) {
          const float dd = half_at(o + 2 * r) * dx[m * nb + b];
          if (qtype == kQ4_1)
            acc[r] += dd * static_cast<float>(dots[r]) + half_at(o + 16 + 2 * r) * sx[m * nb + b];
          else
            acc[r] += dd * static_cast<float>(dots[r] - (qtype == kQ4_0 ? 8 * isum[m * nb + b] : 0));
        }
      }
      for (int r = 0; r < kX8Rows; ++r) {
        const int64_t n = g * kX8Rows + r;
        y[m * N + n] = from_f<T>(acc[r] + (bias ? bias[n] : 0.f));
      }
    }
}

}  // namespace

// GGUF Q4_0 / Q4_1 / Q8_0 rows [N, K / 32 blocks] -> the x8 layout (N a multiple of 8), same size
extern "C" void lane_repack_x8(const uint8_t* src, int qtype, uint8_t* dst, int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, bb = ggml_block_bytes(qtype), gb = group_block_bytes(qtype);
  for (int64_t g = 0; g < N / kX8Rows; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int r = 0; r < kX8Rows; ++r)
        x8_block(dst + (g * nb + b) * gb, qtype, r,
                 const_cast<uint8_t*>(src + ((g * kX8Rows + r) * nb + b) * bb), true);
}

// For tests: the int32 dot products of every input row (qx, 8-bit blocks) with every weight
// row's blocks, as the kernel computes them (Q4_0: nibbles - 8): dots [M, N, K/32]
extern "C" void lane_quant_x8_block_dots(const int8_t* qx, const uint8_t* w, int qtype, int32_t* dots, int64_t M,
                                         int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, gb = group_block_bytes(qtype), qo = x8_quant_offset(qtype);
  for (int64_t g = 0; g < N / kX8Rows; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* o = w + (g * nb + b) * gb + qo;
        const int8_t* xq = qx + m * K + b * kBlock;
        alignas(32) int32_t d[kX8Rows];
#if defined(__AVX2__)
        __m256i v;
        if (qtype == kQ8_0)
          v = use_vnni() ? Q8Vnni::dots(Q8::load(o), xq) : Q8::dots(Q8::load(o), xq);
        else
          v = use_vnni() ? Q4Vnni::dots(Q4::load(o), xq) : Q4::dots(Q4::load(o), xq);
        _mm256_store_si256(reinterpret_cast<__m256i*>(d), v);
#else
        dots_scalar(o, qtype, xq, d);
#endif
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) sum += xq[i];
        for (int r = 0; r < kX8Rows; ++r)
          dots[(m * N + g * kX8Rows + r) * nb + b] = d[r] - (qtype == kQ4_0 ? 8 * sum : 0);
      }
}

// y [M, N] (y_dtype) = x [M, K] (x_dtype) . W^T, W in the x8 layout (+ bias fp32); x is
// quantized to 8-bit blocks once per call
extern "C" void lane_quant_x8_linear(const void* x, int x_dtype, const uint8_t* w, int qtype, const float* bias,
                                     void* y, int y_dtype, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t nb = K / kBlock;
  int8_t* qx = scratch<int8_t, 2>(M * K);
  float* dx = scratch<float, 4>(2 * M * nb);
  float* sx = dx + M * nb;
  int32_t* isum = scratch<int32_t, 0>(M * nb);
  quantize_rows_q8(x, x_dtype, qx, dx, sx, isum, M, K);
  LANE_DISPATCH(y_dtype, T, parallel_for(N / kX8Rows, 4, threads, [&](int64_t g0, int64_t g1) {
    T* yp = static_cast<T*>(y);
#if defined(__AVX2__)
    if (use_vnni())
      groups_vnni<T>(w, qtype, qx, dx, sx, isum, bias, yp, M, N, K, g0, g1);
    else
      groups_avx2<T>(w, qtype, qx, dx, sx, isum, bias, yp, M, N, K, g0, g1);
#else
    groups_scalar<T>(w, qtype, qx, dx, sx, isum, bias, yp, M, N, K, g0, g1);
#endif
  }));
}
