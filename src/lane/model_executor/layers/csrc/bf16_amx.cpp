// Dense bf16 linear layers on AMX-BF16 tiles, for every row count (`--quantization none` in
// bf16, and bf16 safetensors checkpoints, on Sapphire Rapids and later). Batch invariance wants
// one reduction order per output, whatever M is; a tile multiply's sums cannot be reproduced
// by FMAs, so here every M takes the tiles, one row as much as a prefill of 512: each output is
// its own chain of multiplies over K, 32 values at a time in order, whichever tile and column
// its row lands in. The weights stay as they are ([N, K], read as A tiles of 16 rows x 32
// values with the row stride); the input rows are packed once a call into B tiles (pairs of
// values x 16 rows). Unlike the int8 tiles (quant_x8_amx.inc), no scale interrupts a sum, so a
// C tile accumulates over all of K and is stored once.
#include "common.h"

#include <atomic>

#include "amx.h"

namespace {

using namespace lane;

#if defined(__AVX512F__)
// off in this process (lane_bf16_amx(0)): benchmarks time the FMA kernel on the same rows
std::atomic<int> bf16_amx_enabled{1};

inline bool bf16_amx_usable() {
  // (AMX-BF16 CPUs have AVX512-BF16, the output's rounding, too)
  static const bool usable = use_avx512bf16() && cpu_has_amx(22);
  return usable && bf16_amx_enabled.load(std::memory_order_relaxed);
}

constexpr int kRows = 16;   // a tile's rows: weight rows (A), input rows (B's columns)
constexpr int kStep = 32;   // values of K a multiply takes (16 pairs)
constexpr int kTileU32 = kRows * kRows;  // a B tile: 16 pairs x 16 input rows, 32 bits each

// x [M, K] -> B tiles: tile t, step s, pair p, input row c at xb[(t * steps + s) * 256 + p * 16 +
// c] (x[m][2q], x[m][2q + 1] as one 32-bit word, q = 16 s + p): each step's 16 rows of 16 words,
// transposed in registers; rows past M are zeros
void pack_rows(const bf16* x, uint32_t* xb, int64_t M, int64_t K, int threads) {
  const int64_t steps = K / kStep, tiles = (M + kRows - 1) / kRows;
  parallel_for(tiles * steps, 4, threads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / steps, s = i % steps;
      __m512 v[16];
      for (int c = 0; c < kRows; ++c) {
        const int64_t m = t * kRows + c;
        v[c] = m < M ? _mm512_castsi512_ps(_mm512_loadu_si512(x + m * K + s * kStep)) : _mm512_setzero_ps();
      }
      transpose16(v);
      for (int p = 0; p < kRows; ++p) _mm512_store_si512(xb + i * kTileU32 + p * kRows, _mm512_castps_si512(v[p]));
    }
  });
}

// 16 x 16 sums c[n][m] (weight row n, input row m) + bias[n] -> y[m * ld + n] in bf16 for the
// first `rows` m
inline void store_transposed(const float* c, const __m512 bias, bf16* y, int64_t ld, int rows) {
  __m512 v[16];
  for (int n = 0; n < 16; ++n) v[n] = _mm512_load_ps(c + 16 * n);
  transpose16(v);
  for (int m = 0; m < rows; ++m) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ld), round_bf16(_mm512_add_ps(v[m], bias)));
  }
}

// Units [u0, u1) of 32 weight rows (two A tiles) against the input rows two tiles at a time
// (two B tiles): four C tiles, each summed over all of K
void units(const bf16* w, const uint32_t* xb, const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K,
           int64_t u0, int64_t u1) {
  tile_configure_full();
  const int64_t steps = K / kStep, tiles = (M + kRows - 1) / kRows, stride = K * 2;
  alignas(64) float c[4][kRows * kRows];
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t n0 = 2 * kRows * u;
    const bool two = n0 + kRows < N;  // N is a multiple of 16
    const bf16* wa = w + n0 * K;
    const bf16* wb = wa + kRows * K;
    __m512 bv[2];
    for (int h = 0; h < 2; ++h) {
      alignas(64) float b[kRows] = {};
      if (bias && (h == 0 || two))
        for (int i = 0; i < kRows; ++i) b[i] = to_f(bias[n0 + h * kRows + i]);
      bv[h] = _mm512_load_ps(b);
    }
    for (int64_t t = 0; t < tiles; t += 2) {
      const bool t2 = t + 1 < tiles;
      const uint32_t* xa = xb + t * steps * kTileU32;
      const uint32_t* xc = xa + steps * kTileU32;
      LANE_TILE_ZERO(0);
      LANE_TILE_ZERO(1);
      LANE_TILE_ZERO(2);
      LANE_TILE_ZERO(3);
      for (int64_t s = 0; s < steps; ++s) {
        LANE_TILE_LOAD(4, wa + s * kStep, stride);
        LANE_TILE_LOAD(6, xa + s * kTileU32, 64);
        LANE_TILE_DPBF16PS(0, 4, 6);
        if (two) {
          LANE_TILE_LOAD(5, wb + s * kStep, stride);
          LANE_TILE_DPBF16PS(1, 5, 6);
        }
        if (t2) {
          LANE_TILE_LOAD(7, xc + s * kTileU32, 64);
          LANE_TILE_DPBF16PS(2, 4, 7);
          if (two) LANE_TILE_DPBF16PS(3, 5, 7);
        }
      }
      LANE_TILE_STORE(0, c[0], 64);
      if (two) LANE_TILE_STORE(1, c[1], 64);
      if (t2) LANE_TILE_STORE(2, c[2], 64);
      if (two && t2) LANE_TILE_STORE(3, c[3], 64);
      for (int b = 0; b < (t2 ? 2 : 1); ++b) {
        const int64_t m0 = (t + b) * kRows;
        const int rows = M - m0 < kRows ? static_cast<int>(M - m0) : kRows;
        for (int h = 0; h < (two ? 2 : 1); ++h)
          store_transposed(c[2 * b + h], bv[h], y + m0 * N + n0 + h * kRows, N, rows);
      }
    }
  }
  tile_release();
}
#endif

}  // namespace

// y [M, N] = x [M, K] . w [N, K]^T (+ bias [N]), all bf16, on AMX-BF16 tiles: false (nothing
// done) where the CPU or the shape does not take them (K a multiple of 32, N of 16), which
// depends on the layer, never on M
extern "C" bool lane_bf16_amx_linear(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N,
                                     int64_t K, int threads) {
#if defined(__AVX512F__)
  if (K % kStep != 0 || N % kRows != 0 || !bf16_amx_usable()) return false;
  const int64_t tiles = (M + kRows - 1) / kRows;
  uint32_t* xb = align64(scratch<uint32_t, 0>(tiles * kRows * K / 2 + 16));
  pack_rows(static_cast<const bf16*>(x), xb, M, K, threads);
  const int64_t n_units = (N + 2 * kRows - 1) / (2 * kRows);
  parallel_for(n_units, 1, threads, [&](int64_t u0, int64_t u1) {
    units(static_cast<const bf16*>(w), xb, static_cast<const bf16*>(bias), static_cast<bf16*>(y), M, N, K, u0, u1);
  });
  return true;
#else
  (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
  return false;
#endif
}

// Whether dense bf16 layers take the tiles here (out[0]); with on >= 0, set that first (on 0:
// never; for benchmarks: the tiles' sums differ from the FMA kernel's, so a process that
// switches mid-run loses batch invariance)
extern "C" void lane_bf16_amx(int on, int64_t* out) {
#if defined(__AVX512F__)
  if (on >= 0) bf16_amx_enabled.store(on, std::memory_order_relaxed);
  out[0] = bf16_amx_usable();
#else
  (void)on;
  out[0] = 0;
#endif
}
