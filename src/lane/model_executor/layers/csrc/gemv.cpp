// Small-M linear layers (decode): y = x W^T (+ b). torch's GEMM for a few rows reads
// weights at a fraction of DRAM bandwidth on a CPU, and MKL's sgemm steps 1.4x from 3 rows to
// 4; here each weight row is streamed once per call and dotted with the input rows in fp32:
// fp32 weights (AVX2 / AVX-512) 4 rows at a time against 2-4 input rows in vector registers,
// bf16 / fp16 ones up to eight input rows at a time (16 weight rows stay in cache for the next
// eight). x, b and y any of the three dtypes.
#include "common.h"

#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace lane;

template <typename W, int MC>
void rows(const W* w, const float* x, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * K;
    float acc[MC];
    for (int m = 0; m < MC; ++m) acc[m] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float v = to_f(wr[k]);
      for (int m = 0; m < MC; ++m) acc[m] += v * x[m * K + k];
    }
    for (int m = 0; m < MC; ++m) y[m * N + n] = acc[m];
  }
}

// rows n0..n1 of y for all M inputs, in chunks of 8 / 4 / 2 / 1 rows of x
template <typename W>
void tile(const W* w, const float* x, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
          int64_t n1) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows<W, 8>(w, x + m * K, y + m * N, N, K, n0, n1);
  if (m + 4 <= M) { rows<W, 4>(w, x + m * K, y + m * N, N, K, n0, n1); m += 4; }
  if (m + 2 <= M) { rows<W, 2>(w, x + m * K, y + m * N, N, K, n0, n1); m += 2; }
  if (m < M) rows<W, 1>(w, x + m * K, y + m * N, N, K, n0, n1);
}

#if defined(__AVX2__)
// fp32 weights: 4 weight rows at a time against C input rows, k in whole vectors, so each
// vector of x feeds 4 rows' FMAs (the plain loop above loads one x vector per FMA); the next
// 4 rows are prefetched as these stream. C: 4 rows of x in zmm (16 sums), 2 in ymm (8 sums).
#if defined(__AVX512F__)
struct VecF {
  using V = __m512;
  static constexpr int kW = 16, kC = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#else
struct VecF {
  using V = __m256;
  static constexpr int kW = 8, kC = 2;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

template <int C>
void rows4_f32(const float* w, const float* x, float* y, int64_t N, int64_t K, int64_t n) {
  using V = VecF::V;
  constexpr int kW = VecF::kW;
  const int64_t kv = K / kW * kW;
  const float* wr[4];
  for (int i = 0; i < 4; ++i) wr[i] = w + (n + i) * K;
  V acc[4][C];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = VecF::zero();
  for (int64_t k = 0; k < kv; k += kW) {
    V wv[4];
    for (int i = 0; i < 4; ++i) {
      __builtin_prefetch(wr[i] + 4 * K + k);
      wv[i] = VecF::load(wr[i] + k);
    }
    for (int c = 0; c < C; ++c) {
      const V xv = VecF::load(x + c * K + k);
      for (int i = 0; i < 4; ++i) acc[i][c] = VecF::fma(wv[i], xv, acc[i][c]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < C; ++c) {
      float t = VecF::sum(acc[i][c]);
      for (int64_t k = kv; k < K; ++k) t += wr[i][k] * x[c * K + k];
      y[c * N + n + i] = t;
    }
}

// rows n0..n1 of y (fp32 weights) for all M inputs: blocks of 4 weight rows, each against every
// chunk of C input rows while its 4 rows sit in L1; a last 1-3 rows take the plain loop
void tile_f32(const float* w, const float* x, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int C = VecF::kC;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const int64_t chunks = (M + C - 1) / C;  // balanced: M = 5 runs 3 + 2, not 4 + 1
    for (int64_t m = 0, j = 0; j < chunks; ++j) {
      const int64_t c = M / chunks + (j < M % chunks);
      // (a chunk has at most C rows: the clamps only keep rows4_f32<3>, <4> out of AVX2 builds)
      if (c == 4) rows4_f32<4 < C ? 4 : C>(w, x + m * K, y + m * N, N, K, n);
      else if (c == 3) rows4_f32<3 < C ? 3 : C>(w, x + m * K, y + m * N, N, K, n);
      else if (c == 2) rows4_f32<2>(w, x + m * K, y + m * N, N, K, n);
      else rows4_f32<1>(w, x + m * K, y + m * N, N, K, n);
      m += c;
    }
  }
  if (n < n1) tile<float>(w, x, y, M, N, K, n, n1);
}
#endif

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

// x [M, K] (x_dtype), w [N, K] (w_dtype), bias [N] (w_dtype) or null -> y [M, N] (x_dtype)
extern "C" void lane_small_m_linear(const void* x, int x_dtype, const void* w, int w_dtype,
                                    const void* bias, void* y, int64_t M, int64_t N, int64_t K,
                                    int threads) {
  std::vector<float> xf(M * K), yf(M * N), bf(bias ? N : 0);
  LANE_DISPATCH(x_dtype, T, widen<T>(x, xf.data(), M * K));
  if (bias) LANE_DISPATCH(w_dtype, T, widen<T>(bias, bf.data(), N));
#if defined(__AVX2__)
  if (w_dtype == kF32) {
    parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
      tile_f32(static_cast<const float*>(w), xf.data(), yf.data(), M, N, K, n0, n1);
    });
  } else
#endif
  LANE_DISPATCH(w_dtype, W, {
    const W* wp = static_cast<const W*>(w);
    parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
      for (int64_t t0 = n0; t0 < n1; t0 += 16)  // 16 weight rows stay in cache for every x chunk
        tile<W>(wp, xf.data(), yf.data(), M, N, K, t0, t0 + 16 < n1 ? t0 + 16 : n1);
    });
  });
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) yf[m * N + n] += bf[n];
  LANE_DISPATCH(x_dtype, T, narrow<T>(yf.data(), y, M * N));
}
