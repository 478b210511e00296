// Dense linear layers: y = x W^T (+ b), for any number of rows. torch's GEMM for a few rows
// reads weights at a fraction of DRAM bandwidth on a CPU, and its GEMMs change their
// reduction order with M (MKL steps at 3 -> 4 rows, oneDNN picks kernels by shape), so a
// row's result would depend on the rows beside it. Here every output element is one dot
// product computed the same way whatever M is: one vector accumulator over K in whole
// vectors, a fixed horizontal sum, then K's tail in order. The arithmetic is fp32; bf16 /
// fp16 weights are widened exactly (in registers for a chunk of rows, or once into a
// buffer when many chunks reuse them: the same values either way).
//   The loop: groups of 4 weight rows (split over threads) against chunks of C input rows,
// in blocks of kMBlock rows so a block of x stays in L2 while the thread's weights stream
// past it. Weight rows past the last whole group (N % 4) take a scalar loop, one input row
// at a time (its order depends on n only).
#include "common.h"

#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace lane;

constexpr int64_t kMBlock = 64;

// a * b + c in one rounding where the ISA has FMA (explicitly: the compiler would contract
// a * b + c as it likes per instantiation), else two (nothing to contract)
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// one weight row against one input row, in order (no vector registers)
template <typename W>
float dot_scalar(const W* w, const float* x, int64_t K) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc = madd(to_f(w[k]), x[k], acc);
  return acc;
}

#if defined(__AVX2__)
#if defined(__AVX512F__)
struct VecF {
  using V = __m512;
  static constexpr int kW = 16, kC = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const bf16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static V load(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) {  // a fixed tree: halves, then the 8-lane sum
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#else
struct VecF {
  using V = __m256;
  static constexpr int kW = 8, kC = 2;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const bf16* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static V load(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

// 4 weight rows (row i at w + i * ws) against C input rows: y[c * N + n + i]. Each vector of x
// feeds 4 rows' FMAs; the next rows are prefetched (decode streams weights from DRAM).
template <int C, typename W>
void rows4(const W* w, int64_t ws, const float* x, float* y, int64_t N, int64_t K, int64_t n) {
  using V = VecF::V;
  constexpr int kW = VecF::kW;
  const int64_t kv = K / kW * kW;
  V acc[4][C];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = VecF::zero();
  for (int64_t k = 0; k < kv; k += kW) {
    V wv[4];
    for (int i = 0; i < 4; ++i) {
      __builtin_prefetch(w + i * ws + 4 * ws + k);
      wv[i] = VecF::load(w + i * ws + k);
    }
    for (int c = 0; c < C; ++c) {
      const V xv = VecF::load(x + c * K + k);
      for (int i = 0; i < 4; ++i) acc[i][c] = VecF::fma(wv[i], xv, acc[i][c]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < C; ++c) {
      float t = VecF::sum(acc[i][c]);
      for (int64_t k = kv; k < K; ++k) t = madd(to_f(w[i * ws + k]), x[c * K + k], t);
      y[c * N + n + i] = t;
    }
}

template <typename W>
void rows4_chunk(const W* w, int64_t ws, const float* x, float* y, int64_t c, int64_t N, int64_t K, int64_t n) {
  // (a chunk has at most kC rows: the clamps keep rows4<3>, <4> out of AVX2 builds)
  constexpr int C = VecF::kC;
  if (c == 4) rows4<4 < C ? 4 : C>(w, ws, x, y, N, K, n);
  else if (c == 3) rows4<3 < C ? 3 : C>(w, ws, x, y, N, K, n);
  else if (c == 2) rows4<2>(w, ws, x, y, N, K, n);
  else rows4<1>(w, ws, x, y, N, K, n);
}

// rows m0..m1 of y, weight groups [g0, g1): each group of 4 against the rows in chunks of kC
template <typename W>
void groups(const W* w, const float* x, float* y, int64_t m0, int64_t m1, int64_t N, int64_t K, int64_t g0,
            int64_t g1, float* wide) {
  constexpr int64_t C = VecF::kC;
  const int64_t M = m1 - m0;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = 4 * g;
    const W* wg = w + n * K;
    if (M > C && !std::is_same<W, float>::value) {  // widen once for every chunk
      for (int i = 0; i < 4; ++i)
        for (int64_t k = 0; k < K; ++k) wide[i * K + k] = to_f(wg[i * K + k]);
    }
    for (int64_t m = m0; m < m1; m += C) {
      const int64_t c = m1 - m < C ? m1 - m : C;
      if (M > C && !std::is_same<W, float>::value)
        rows4_chunk<float>(wide, K, x + m * K, y + m * N, c, N, K, n);
      else
        rows4_chunk<W>(wg, K, x + m * K, y + m * N, c, N, K, n);
    }
  }
}
#endif

template <typename W>
void linear_rows(const W* w, const float* x, float* y, int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX2__)
  const int64_t ng = N / 4;
  parallel_for(ng, 4, threads, [&](int64_t g0, int64_t g1) {
    float* wide = scratch<float, 22>(4 * K);
    for (int64_t m0 = 0; m0 < M; m0 += kMBlock)
      groups<W>(w, x, y, m0, m0 + kMBlock < M ? m0 + kMBlock : M, N, K, g0, g1, wide);
  });
  const int64_t n_tail = 4 * ng;
#else
  const int64_t n_tail = 0;
#endif
  if (n_tail < N)
    parallel_for(N - n_tail, 16, threads, [&](int64_t a, int64_t b) {
      for (int64_t n = n_tail + a; n < n_tail + b; ++n)
        for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_scalar(w + n * K, x + m * K, K);
    });
}

template <typename T>
void widen(const void* src, float* dst, int64_t n) {
  const T* s = static_cast<const T*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(s[i]);
}

template <typename T>
void narrow(const float* src, void* dst, int64_t n) {
  T* d = static_cast<T*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = from_f<T>(src[i]);
}

}  // namespace

extern "C" bool lane_bf16_amx_linear(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int);

// x [M, K] (x_dtype), w [N, K] (w_dtype), bias [N] (w_dtype) or null -> y [M, N] (x_dtype). All
// bf16 on a CPU with AMX-BF16: its tiles, for every M (bf16_amx.cpp).
extern "C" void lane_small_m_linear(const void* x, int x_dtype, const void* w, int w_dtype,
                                    const void* bias, void* y, int64_t M, int64_t N, int64_t K,
                                    int threads) {
  if (x_dtype == kBF16 && w_dtype == kBF16 && lane_bf16_amx_linear(x, w, bias, y, M, N, K, threads)) return;
  float* xf = scratch<float, 20>(M * K);
  float* yf = scratch<float, 21>(M * N);
  LANE_DISPATCH(x_dtype, T, widen<T>(x, xf, M * K));
  LANE_DISPATCH(w_dtype, W, linear_rows<W>(static_cast<const W*>(w), xf, yf, M, N, K, threads));
  if (bias) {
    std::vector<float> bf(N);
    LANE_DISPATCH(w_dtype, T, widen<T>(bias, bf.data(), N));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yf[m * N + n] += bf[n];
  }
  LANE_DISPATCH(x_dtype, T, narrow<T>(yf, y, M * N));
}
