// Linear layers on GGUF blocks as they are (Q8_0, Q4_0, Q4_1: 32 weights per block with an
// fp16 scale, and for Q4_1 an fp16 minimum), for the decode and verify rows (M <= 32). Layers
// whose row count is a multiple of 8 are repacked at load and run quant_x8.cpp instead; this
// kernel serves the rest.
// As ggml does, each input row is quantized once per call to 8-bit blocks of 32 (scale
// d_x = max|x| / 127, and s_x = d_x * sum(q_x) for Q4_1's minimum term), so each block's
// dot product is an int32 sum of int8 x int8 products:
//   Q8_0, Q4_0: y += d_w * d_x * sum(q_w * q_x)        (Q4_0: q_w = nibble - 8, signed)
//   Q4_1:       y += d_w * d_x * sum(q_w * q_x) + m_w * s_x
// Each weight block is unpacked to int8 once and dotted with every input row; the
// AVX2 builds (and AVX-512 ones, which run them) use ggml's maddubs / madd dot products;
// the generic build plain C++ integer loops. A 512-bit VNNI variant (two blocks a register,
// vpdpbusd) measured 0.6-0.95x of this code on Sapphire Rapids: the per-block float work and
// the lane reductions exact rounding needs cost more than the dot products saved.
#include "common.h"

#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace lane;

constexpr int kBlock = 32;

// one weight block -> int8 values, scale and minimum
inline void unpack(const uint8_t* blk, int qtype, int8_t* q, float& d, float& m) {
  d = half_at(blk);
  m = 0.f;
  if (qtype == kQ8_0) {
    std::memcpy(q, blk + 2, kBlock);
  } else {
    const uint8_t* p = blk + (qtype == kQ4_0 ? 2 : 4);
    const int off = qtype == kQ4_0 ? 8 : 0;
    if (qtype == kQ4_1) m = half_at(blk + 2);
    for (int i = 0; i < 16; ++i) {
      q[i] = static_cast<int8_t>((p[i] & 0x0f) - off);
      q[i + 16] = static_cast<int8_t>((p[i] >> 4) - off);
    }
  }
}

inline int32_t dot32(const int8_t* a, const int8_t* b) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < kBlock; ++i) s += static_cast<int16_t>(a[i]) * static_cast<int16_t>(b[i]);
  return s;
}

}  // namespace

#if defined(__AVX2__)
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// quantize_block_q8 on one block of 32, in registers: the same max, scale and rounding (x *
// (1 / d) rounded to nearest even), so it writes the same values; returns the block's sum
template <typename T>
inline int32_t quantize_block32(const T* x, int8_t* q, float& d_out) {
  __m256 v[4], a = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    a = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), a);  // a NaN lane keeps a, as fmaxf does
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float amax = _mm_cvtss_f32(m);
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  d_out = d;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

}  // namespace
#endif

void lane::quantize_rows_q8(const void* x, int x_dtype, int8_t* q, float* d, float* s, int32_t* isum, int64_t M,
                            int64_t K, int threads) {
  const int64_t nb = K / kBlock;
  LANE_DISPATCH(x_dtype, T, parallel_for(M, 16, threads, [&](int64_t m0, int64_t m1) {
    const T* xp = static_cast<const T*>(x);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        int8_t* qb = q + m * K + b * kBlock;
#if defined(__AVX2__)
        float scale;
        const int32_t sum = quantize_block32(xp + m * K + b * kBlock, qb, scale);
#else
        const float scale = quantize_block_q8(xp + m * K + b * kBlock, kBlock, qb);
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) sum += qb[i];
#endif
        d[m * nb + b] = scale;
        s[m * nb + b] = scale * static_cast<float>(sum);
        if (isum) isum[m * nb + b] = sum;
      }
  }));
}

// x rows as 8-bit blocks: q [M, K] int8, d [M, K/32], s [M, K/32] (d * sum q)
extern "C" void lane_quantize_rows_q8(const void* x, int x_dtype, int8_t* q, float* d, float* s, int64_t M,
                                      int64_t K) {
  quantize_rows_q8(x, x_dtype, q, d, s, nullptr, M, K);
}

// The int32 dot products of every (row, weight row, block): dots [M, N, K/32] (for tests).
extern "C" void lane_quant_block_dots(const int8_t* qx, const void* w, int qtype, int32_t* dots, int64_t M,
                                      int64_t N, int64_t K) {
  const int64_t nb = K / kBlock, row = nb * ggml_block_bytes(qtype);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      int8_t qw[kBlock];
      float dw, mw;
      unpack(static_cast<const uint8_t*>(w) + n * row + b * ggml_block_bytes(qtype), qtype, qw, dw, mw);
      for (int64_t m = 0; m < M; ++m) dots[(m * N + n) * nb + b] = dot32(qw, qx + m * K + b * kBlock);
    }
}

#if defined(__AVX2__)
namespace {

// 32 unsigned nibbles of a Q4 block, in value order (low nibbles: 0-15, high: 16-31)
inline __m256i nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// sum over 32 lanes of u8 a * s8 b, exact in int32 (the lanes reduced as integers, so the
// block's one float product rounds once)
inline int32_t dot_us(__m256i a, __m256i b) {
  const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// Weight rows [t0, t1) (at most kTile) unpacked once: 32 int8 values per block (Q4_1: the
// unsigned nibbles), its scale and minimum; every pass over the input rows reads them from L1,
// so a second pass costs its dot products only.
constexpr int64_t kTile = 16;
struct Tile {
  std::vector<int8_t> q;
  std::vector<float> d, m;
  explicit Tile(int64_t nb) : q(kTile * nb * kBlock), d(kTile * nb), m(kTile * nb) {}
};

void unpack_tile(const uint8_t* wp, int qtype, int64_t nb, int64_t t0, int64_t t1, Tile& t) {
  const int64_t bb = ggml_block_bytes(qtype), row = nb * bb;
  for (int64_t n = t0; n < t1; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wp + n * row + b * bb;
      const int64_t i = (n - t0) * nb + b;
      t.d[i] = half_at(blk);
      t.m[i] = qtype == kQ4_1 ? half_at(blk + 2) : 0.f;
      const __m256i w = qtype == kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))
                        : qtype == kQ4_0 ? _mm256_sub_epi8(nibbles(blk + 2), _mm256_set1_epi8(8))
                                         : nibbles(blk + 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&t.q[i * kBlock]), w);
    }
}

// One weight block (w: its 32 values as int8, Q4_1's as unsigned nibbles) into R rows' sums
template <int R>
inline void block_dot(__m256i w, float dw, float mw, int qtype, const int8_t* qx, const float* dx,
                      const float* sx, int64_t K, int64_t nb, int64_t b, float* acc) {
  if (qtype != kQ4_1) {  // signed x signed (Q8_0; Q4_0's nibbles - 8): |w| times x with w's sign
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * kBlock));
      acc[r] += dw * dx[r * nb + b] * static_cast<float>(dot_us(aw, _mm256_sign_epi8(x, w)));
    }
  } else {  // Q4_1: unsigned nibbles, and the minimum through s_x = d_x * sum(q_x)
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * kBlock));
      acc[r] += dw * dx[r * nb + b] * static_cast<float>(dot_us(w, x)) + mw * sx[r * nb + b];
    }
  }
}

// Weight rows [t0, t1) against R input rows (R <= 8 accumulators in registers): from the
// unpacked tile (Tiled), or unpacked in registers as they stream (one pass: no round trip)
template <int R, bool Tiled>
void rows_simd(const Tile* t, const uint8_t* wp, int qtype, const int8_t* qx, const float* dx, const float* sx,
               float* yf, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t nb = K / kBlock, bb = ggml_block_bytes(qtype), row = nb * bb;
  for (int64_t n = t0; n < t1; ++n) {
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      if (Tiled) {
        const int64_t i = (n - t0) * nb + b;
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&t->q[i * kBlock]));
        block_dot<R>(w, t->d[i], t->m[i], qtype, qx, dx, sx, K, nb, b, acc);
      } else {
        const uint8_t* blk = wp + n * row + b * bb;
        const __m256i w = qtype == kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))
                          : qtype == kQ4_0 ? _mm256_sub_epi8(nibbles(blk + 2), _mm256_set1_epi8(8))
                                           : nibbles(blk + 4);
        block_dot<R>(w, half_at(blk), qtype == kQ4_1 ? half_at(blk + 2) : 0.f, qtype, qx, dx, sx, K, nb, b, acc);
      }
    }
    for (int r = 0; r < R; ++r) yf[r * N + n] = acc[r];
  }
}

using RowsFn = void (*)(const Tile*, const uint8_t*, int, const int8_t*, const float*, const float*, float*, int64_t,
                       int64_t, int64_t, int64_t);
template <bool Tiled>
constexpr RowsFn kRows[9] = {nullptr, rows_simd<1, Tiled>, rows_simd<2, Tiled>, rows_simd<3, Tiled>,
                             rows_simd<4, Tiled>, rows_simd<5, Tiled>, rows_simd<6, Tiled>, rows_simd<7, Tiled>,
                             rows_simd<8, Tiled>};

}  // namespace
#endif

// y [M, N] (y_dtype) = x [M, K] (x_dtype) . W^T, W [N, K] in GGUF blocks (+ bias fp32); x is
// quantized to 8-bit blocks here, once per call, into per-thread buffers
extern "C" void lane_quant_linear(const void* x, int x_dtype, const void* w, int qtype, const float* bias, void* y,
                                  int y_dtype, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t nb = K / kBlock, bb = ggml_block_bytes(qtype), row = nb * bb;
  int8_t* qx = scratch<int8_t, 0>(M * K);
  float* dx = scratch<float, 0>(2 * M * nb);
  float* sx = dx + M * nb;
  quantize_rows_q8(x, x_dtype, qx, dx, sx, nullptr, M, K);
  float* yf = scratch<float, 1>(M * N);
  const uint8_t* wp = static_cast<const uint8_t*>(w);
  // Rows go in balanced passes of at most 8 (M = 12: 6 + 6) over each tile of unpacked weight
  // rows, so a step's cost grows smoothly with M.
  const int64_t passes = (M + 7) / 8;
  parallel_for(N, 16, threads, [&](int64_t n0, int64_t n1) {
#if defined(__AVX2__)
    if (passes == 1) {  // one pass: unpacking in registers beats a round trip through the tile
      for (int64_t t0 = n0; t0 < n1; t0 += kTile)
        kRows<false>[M](nullptr, wp, qtype, qx, dx, sx, yf, N, K, t0, t0 + kTile < n1 ? t0 + kTile : n1);
      return;
    }
    Tile tile(nb);
    for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
      const int64_t t1 = t0 + kTile < n1 ? t0 + kTile : n1;
      unpack_tile(wp, qtype, nb, t0, t1, tile);
      for (int64_t p = 0, m = 0; p < passes; ++p) {
        const int64_t r = M / passes + (p < M % passes);
        kRows<true>[r](&tile, wp, qtype, qx + m * K, dx + m * nb, sx + m * nb, yf + m * N, N, K, t0, t1);
        m += r;
      }
    }
#else
    std::vector<float> acc(M);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t m = 0; m < M; ++m) acc[m] = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int8_t qw[kBlock];
        float dw, mw;
        unpack(wp + n * row + b * bb, qtype, qw, dw, mw);
        for (int64_t m = 0; m < M; ++m) {
          const int32_t dot = dot32(qw, qx + m * K + b * kBlock);
          acc[m] += dw * dx[m * nb + b] * static_cast<float>(dot) + mw * sx[m * nb + b];
        }
      }
      for (int64_t m = 0; m < M; ++m) yf[m * N + n] = acc[m];
    }
#endif
  });
  LANE_DISPATCH(y_dtype, T, {
    T* yp = static_cast<T*>(y);
    for (int64_t i = 0; i < M * N; ++i) yp[i] = from_f<T>(yf[i] + (bias ? bias[i % N] : 0.f));
  });
}
