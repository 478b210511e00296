// Small-M linear layers (decode): y = x W^T (+ b). torch's GEMM for a few rows reads
// weights at a fraction of DRAM bandwidth on a CPU; here each weight row is streamed
// once per call and dotted with up to eight input rows at a time in fp32 (16 rows stay
// in cache for the next eight). Weights fp32 / bf16 / fp16; x, b and y any of the three.
#include "common.h"

#include <vector>

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
