// Linear layers on int8 weights with one fp32 scale per output channel (qw [N, K], sw [N]),
// for the decode and verify rows (M <= 16; larger M goes through torch's GEMMs):
//   W8A16: y = (x . qw^T) * sw + b        x widened to fp32 once, weights widened in registers
//   W8A8:  y = sx * sw * (qx . qw^T) + b  x quantized per row (sx = max|x| / 127), int32 dots
// Each weight row streams from memory once and, while in cache, is dotted with every input
// row (tiles of 16 weight rows, several input rows per pass). The W8A8 int32 dots are exact:
//   AVX-512 builds on a CPU with VNNI (checked at run time): vpdpbusd multiplies u8 by s8, so
//     x goes in as x + 128 (x ^ 0x80) and 128 * sum(qw) (wsum, computed at load) comes off;
//   AVX2 (and AVX-512 builds without VNNI): ggml's sign trick, |w| (u8) maddubs x * sign(w)
//     (s8), pairs summed to int16 (|q| <= 127: at most 2 * 127 * 127, no saturation), madd to int32;
//   generic: plain integer loops.
// Input rows are copied once per call into rows padded with zeros to a multiple of 64, so the
// SIMD loops never read past a row; weight row tails are masked (AVX-512) or copied (AVX2).
#include "common.h"

#include <cmath>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace lane;

constexpr int64_t kTile = 16;  // weight rows kept in cache while every input row passes over them
constexpr int64_t kPad = 64;   // input rows are padded to this many values

inline int64_t padded(int64_t K) { return (K + kPad - 1) / kPad * kPad; }

template <int V>
using I = std::integral_constant<int, V>;

// Calls f(R, C, m, c) (R, C as integral constants) for input rows [0, M) in chunks of R = 8
// (when Acc allows), 4, 2, 1 and weight rows [0, nt) in groups of C: about Acc independent
// accumulators, so the FMA / dot-product latency is hidden even for one input row.
template <int Acc, typename F>
void sweep(int64_t M, int64_t nt, const F& f) {
  auto pass = [&](auto R, int64_t m) {
    constexpr int C = Acc / R() > 4 ? 4 : (Acc / R() < 1 ? 1 : Acc / R());
    int64_t c = 0;
    for (; c + C <= nt; c += C) f(R, I<C>{}, m, c);
    for (; c < nt; ++c) f(R, I<1>{}, m, c);
  };
  int64_t m = 0;
  if constexpr (Acc >= 16)
    for (; m + 8 <= M; m += 8) pass(I<8>{}, m);
  for (; m + 4 <= M; m += 4) pass(I<4>{}, m);
  if (m + 2 <= M) {
    pass(I<2>{}, m);
    m += 2;
  }
  if (m < M) pass(I<1>{}, m);
}

// The kernels: R input rows x (stride Kp, zero-padded), C weight rows w (stride K) ->
// out[r * ldo + c]. W8A8: int32 dots; W8A16: fp32 dots (the scale comes after).

template <int R, int C>
void dots_generic(const int8_t* x, int64_t Kp, const int8_t* w, int64_t K, int32_t* out, int64_t ldo) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int8_t* xr = x + r * Kp;
      const int8_t* wr = w + c * K;
      int32_t s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += static_cast<int16_t>(xr[k]) * static_cast<int16_t>(wr[k]);
      out[r * ldo + c] = s;
    }
}

template <int R, int C>
void fdots_generic(const float* x, int64_t Kp, const int8_t* w, int64_t K, float* out, int64_t ldo) {
  float acc[R][C] = {};
  for (int64_t k = 0; k < K; ++k)  // vectorised over k by the compiler (associative math)
    for (int c = 0; c < C; ++c) {
      const float v = static_cast<float>(w[c * K + k]);
      for (int r = 0; r < R; ++r) acc[r][c] += v * x[r * Kp + k];
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = acc[r][c];
}

#if defined(__AVX2__)
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// n (< 32) bytes at p, zero-filled: a weight row's tail, never read past the row
inline __m256i load_tail(const int8_t* p, int64_t n) {
  alignas(32) int8_t t[32] = {};
  std::memcpy(t, p, n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
}

template <int R, int C>
void dots_avx2(const int8_t* x, int64_t Kp, const int8_t* w, int64_t K, int32_t* out, int64_t ldo) {
  __m256i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += 32) {
    __m256i wv[C], aw[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = K - k >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * K + k))
                          : load_tail(w + c * K + k, K - k);
      aw[c] = _mm256_sign_epi8(wv[c], wv[c]);  // |w| as u8
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * Kp + k));
      for (int c = 0; c < C; ++c)  // |w| * (x * sign w): pairs to int16, then to int32
        acc[r][c] = _mm256_add_epi32(
            acc[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(xv, wv[c])), ones));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum_epi32(acc[r][c]);
}

template <int R, int C>
void fdots_avx2(const float* x, int64_t Kp, const int8_t* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) {
      int64_t b8 = 0;  // 8 weights; a row's tail zero-filled, never read past the row
      if (K - k >= 8)
        std::memcpy(&b8, w + c * K + k, 8);  // a constant size: one load, not a memcpy call
      else
        std::memcpy(&b8, w + c * K + k, K - k);
      wv[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(b8)));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * Kp + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = hsum_ps(acc[r][c]);
}
#endif

#if defined(__AVX512F__)
template <int R, int C>
void fdots_avx512(const float* x, int64_t Kp, const int8_t* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __mmask16 tail = K % 16 ? __mmask16((1u << (K % 16)) - 1) : __mmask16(0xffff);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = k + 16 <= K ? __mmask16(0xffff) : tail;
    __m512 wv[C];
    for (int c = 0; c < C; ++c)  // 16 int8 -> 16 fp32; 0 past the row
      wv[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + c * K + k)));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * Kp + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

#define LANE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// x holds x + 128 (x ^ 0x80) as u8: vpdpbusd multiplies u8 by s8; 128 * sum(w) comes off after
template <int R, int C>
LANE_VNNI void dots_vnni(const int8_t* x, int64_t Kp, const int8_t* w, int64_t K, const int32_t* wsum,
                         int32_t* out, int64_t ldo) {
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  const __mmask64 tail = K % 64 ? (__mmask64{1} << (K % 64)) - 1 : ~__mmask64{0};
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 mask = k + 64 <= K ? ~__mmask64{0} : tail;
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_maskz_loadu_epi8(mask, w + c * K + k);  // 0 past the row
    for (int r = 0; r < R; ++r) {
      const __m512i xu = _mm512_loadu_si512(x + r * Kp + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xu, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_epi32(acc[r][c]) - 128 * wsum[c];
}

bool has_vnni() {
  static const bool v = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vnni"));
  return v;
}
#endif

// W8A8: all M input rows against the nt weight rows of a tile -> out[m * ldo + c]
void tile_dots(const int8_t* x, int64_t Kp, const int8_t* w, int64_t K, const int32_t* wsum, bool vnni,
               int32_t* out, int64_t ldo, int64_t M, int64_t nt) {
#if defined(__AVX512F__)
  if (vnni)
    return sweep<16>(M, nt, [&](auto R, auto C, int64_t m, int64_t c) {
      dots_vnni<R(), C()>(x + m * Kp, Kp, w + c * K, K, wsum + c, out + m * ldo + c, ldo);
    });
#endif
  (void)wsum;
  (void)vnni;
#if defined(__AVX2__)
  sweep<8>(M, nt, [&](auto R, auto C, int64_t m, int64_t c) {
    dots_avx2<R(), C()>(x + m * Kp, Kp, w + c * K, K, out + m * ldo + c, ldo);
  });
#else
  sweep<4>(M, nt, [&](auto R, auto C, int64_t m, int64_t c) {
    dots_generic<R(), C()>(x + m * Kp, Kp, w + c * K, K, out + m * ldo + c, ldo);
  });
#endif
}

// W8A16: the same over fp32 input rows
void tile_fdots(const float* x, int64_t Kp, const int8_t* w, int64_t K, float* out, int64_t ldo, int64_t M,
                int64_t nt) {
#if defined(__AVX512F__)
  sweep<16>(M, nt, [&](auto R, auto C, int64_t m, int64_t c) {
    fdots_avx512<R(), C()>(x + m * Kp, Kp, w + c * K, K, out + m * ldo + c, ldo);
  });
#elif defined(__AVX2__)
  sweep<8>(M, nt, [&](auto R, auto C, int64_t m, int64_t c) {
    fdots_avx2<R(), C()>(x + m * Kp, Kp, w + c * K, K, out + m * ldo + c, ldo);
  });
#else
  sweep<4>(M, nt, [&](auto R, auto C, int64_t m, int64_t c) {
    fdots_generic<R(), C()>(x + m * Kp, Kp, w + c * K, K, out + m * ldo + c, ldo);
  });
#endif
}

template <typename T>
void quantize_row(const T* x, int8_t* q, float* s, int64_t K) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)  // vectorises without -ffinite-math-only
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(to_f(x[k]));
    amax = a > amax ? a : amax;
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t k = 0; k < K; ++k) {
    float v = __builtin_rintf(to_f(x[k]) * inv);
    v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
    q[k] = static_cast<int8_t>(static_cast<int32_t>(v));
  }
  *s = amax / 127.f;
}

}  // namespace

// x [M, K] (x_dtype) -> q [M, K] int8, s [M] fp32: s = max|x_row| / 127, q = round(x / s)
// (a zero row: s = 0, q = 0)
extern "C" void lane_quantize_per_token_int8(const void* x, int x_dtype, int8_t* q, float* s, int64_t M,
                                             int64_t K, int threads) {
  LANE_DISPATCH(x_dtype, T, {
    parallel_for(M, K > 0 ? (1 << 15) / K + 1 : M, threads, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) quantize_row(static_cast<const T*>(x) + m * K, q + m * K, s + m, K);
    });
  });
}

// y [M, N] (y_dtype) = sx[m] * sw[n] * dots[m, n] + bias[n] (bias fp32 or null): the W8A8 epilogue,
// also after torch._int_mm for large M
extern "C" void lane_int8_scale(const int32_t* dots, const float* sx, const float* sw, const float* bias, void* y,
                                int y_dtype, int64_t M, int64_t N, int threads) {
  LANE_DISPATCH(y_dtype, T, {
    T* yp = static_cast<T*>(y);
    parallel_for(M, N > 0 ? (1 << 15) / N + 1 : M, threads, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < N; ++n)
          yp[m * N + n] = from_f<T>(sx[m] * sw[n] * static_cast<float>(dots[m * N + n]) + (bias ? bias[n] : 0.f));
    });
  });
}

// W8A8 for small M: qx [M, K] int8 (per-row scales sx), qw [N, K] int8 (sw [N]; wsum [N] = row sums
// of qw, needed by the VNNI path, or null to skip it). Writes the int32 dots [M, N] when dots is not
// null (the tests' hook), and y [M, N] (y_dtype) = sx * sw * dot + bias when y is not null.
extern "C" void lane_int8_w8a8(const int8_t* qx, const float* sx, const int8_t* qw, const float* sw,
                               const int32_t* wsum, const float* bias, int32_t* dots, void* y, int y_dtype,
                               int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
  const bool vnni = wsum && has_vnni();
#else
  const bool vnni = false;
#endif
  // the input rows once, padded: as x + 128 (u8) for VNNI, else as they are (the padding reads as 0)
  const int64_t Kp = padded(K);
  const int8_t flip = vnni ? static_cast<int8_t>(0x80) : 0;
  std::vector<int8_t> xp(M * Kp, flip);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xp[m * Kp + k] = static_cast<int8_t>(qx[m * K + k] ^ flip);
  LANE_DISPATCH(y_dtype, T, {
    parallel_for(N, kTile, threads, [&](int64_t n0, int64_t n1) {
      std::vector<int32_t> out(M * kTile);  // a tile's dots, [M, kTile]
      for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
        const int64_t nt = t0 + kTile < n1 ? kTile : n1 - t0;
        tile_dots(xp.data(), Kp, qw + t0 * K, K, wsum ? wsum + t0 : nullptr, vnni, out.data(), kTile, M, nt);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = 0; c < nt; ++c) {
            const int32_t d = out[m * kTile + c];
            if (dots) dots[m * N + t0 + c] = d;
            if (y)
              static_cast<T*>(y)[m * N + t0 + c] =
                  from_f<T>(sx[m] * sw[t0 + c] * static_cast<float>(d) + (bias ? bias[t0 + c] : 0.f));
          }
      }
    });
  });
}

// W8A16 for small M: y [M, N] (x_dtype) = (x [M, K] . qw^T) * sw + bias (bias fp32 or null)
extern "C" void lane_int8_w8a16(const void* x, int x_dtype, const int8_t* qw, const float* sw, const float* bias,
                                void* y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t Kp = padded(K);
  std::vector<float> xf(M * Kp, 0.f);  // fp32 once per call, rows zero-padded
  LANE_DISPATCH(x_dtype, T, {
    const T* xs = static_cast<const T*>(x);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * Kp + k] = to_f(xs[m * K + k]);
  });
  LANE_DISPATCH(x_dtype, T, {
    parallel_for(N, kTile, threads, [&](int64_t n0, int64_t n1) {
      std::vector<float> out(M * kTile);
      for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
        const int64_t nt = t0 + kTile < n1 ? kTile : n1 - t0;
        tile_fdots(xf.data(), Kp, qw + t0 * K, K, out.data(), kTile, M, nt);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = 0; c < nt; ++c)
            static_cast<T*>(y)[m * N + t0 + c] =
                from_f<T>(out[m * kTile + c] * sw[t0 + c] + (bias ? bias[t0 + c] : 0.f));
      }
    });
  });
}

// rows [n0, n1) of qw [N, K] -> out [n1 - n0, K] (out_dtype) = qw * sw (sw null: the integers as
// they are), for the large-M W8A16 path's torch GEMM
extern "C" void lane_int8_dequant(const int8_t* qw, const float* sw, void* out, int out_dtype, int64_t n0,
                                  int64_t n1, int64_t K, int threads) {
  LANE_DISPATCH(out_dtype, T, {
    T* o = static_cast<T*>(out);
    parallel_for(n1 - n0, (1 << 15) / (K + 1) + 1, threads, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const int8_t* q = qw + (n0 + i) * K;
        const float s = sw ? sw[n0 + i] : 1.f;
        for (int64_t k = 0; k < K; ++k) o[i * K + k] = from_f<T>(static_cast<float>(q[k]) * s);
      }
    });
  });
}
