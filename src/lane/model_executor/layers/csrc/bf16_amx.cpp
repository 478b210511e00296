// Linear layers on AMX-BF16 tiles, for every row count, on Sapphire Rapids and later: dense bf16
// weights (`--quantization none` in bf16, bf16 safetensors checkpoints), and GGUF Q4_0 / Q4_1
// weights in the x8 layout with bf16 rows (the default `--quantization auto` in bf16), whose
// blocks are dequantized to bf16 a unit of rows at a time on the way to the same tiles. Batch
// invariance wants one reduction order per output, whatever M is; a tile multiply's sums cannot
// be reproduced by FMAs, so here every M takes the tiles, one row as much as a prefill of 512:
// each output is its own chain of multiplies over K, 32 values at a time in order, whichever
// tile and column its row lands in. Dense weights stay as they are ([N, K], read as A tiles of
// 16 rows x 32 values with the row stride); the input rows are packed once a call into B tiles
// (pairs of values x 16 rows). Unlike the int8 tiles (quant_x8_amx.inc), no scale interrupts a
// sum, so a C tile accumulates over all of K and is stored once: for GGUF blocks from 16-32 rows
// up that beats the int8 tiles, whose per-block scales cost a tile store and its scaling per 32
// values (Sapphire Rapids, SmolLM2: a 512-token prefill 1.8x faster), at the price of one
// dequantization per weight and call, which at one row costs more than the int8 kernel's whole
// product (a 1-row decode step 0.6x).
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cstring>

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

// bf16 rows on x8 Q4_0 / Q4_1 weights: the dequantizing tiles (quant_units) unless
// LANE_CPU_X8_BF16=0 (the int8 kernels then, as on CPUs without AMX) or switched off in this
// process (lane_x8_bf16_amx(0): tests and benchmarks)
std::atomic<int> x8_bf16_enabled{1};
inline bool x8_bf16_usable() {  // (the strips' gather is AVX512-VBMI, which every AMX CPU has)
  static const bool usable = [] {
    __builtin_cpu_init();
    const char* env = std::getenv("LANE_CPU_X8_BF16");
    return __builtin_cpu_supports("avx512vbmi") != 0 && !(env && env[0] == '0');
  }();
  return usable && bf16_amx_usable() && x8_bf16_enabled.load(std::memory_order_relaxed);
}

constexpr int kRows = 16;   // a tile's rows: weight rows (A), input rows (B's columns)
constexpr int kStep = 32;   // values of K a multiply takes (16 pairs)
constexpr int kTileU32 = kRows * kRows;  // a B tile: 16 pairs x 16 input rows, 32 bits each

// x [M, K] -> B tiles: tile t, step s, pair p, input row c at xb[(t * steps + s) * 256 + p * 16 +
// c] (x[m][2q], x[m][2q + 1] as one 32-bit word, q = 16 s + p): each step's 16 rows of 16 words,
// transposed in registers; rows past M are zeros
void pack_rows(const bf16* x, uint32_t* xb, int64_t M, int64_t K, int threads) {
  const int64_t steps = K / kStep, tiles = (M + kRows - 1) / kRows;
  // (one tile's packing is not worth a fork)
  parallel_for(tiles * steps, 4, tiles == 1 ? 1 : threads, [&](int64_t i0, int64_t i1) {
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
// first `rows` m and `cols` n
inline void store_transposed(const float* c, const __m512 bias, bf16* y, int64_t ld, int rows, int cols) {
  __m512 v[16];
  for (int n = 0; n < 16; ++n) v[n] = _mm512_load_ps(c + 16 * n);
  transpose16(v);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int m = 0; m < rows; ++m) _mm256_mask_storeu_epi16(y + m * ld, keep, round_bf16(_mm512_add_ps(v[m], bias)));
}

// A unit's outputs as a linear layer's: columns [0, cols) (y points at the unit's first) of each
// row, + bias (fp32, cols values)
struct StoreRows {
  bf16* y;
  int64_t ld;
  int cols;
  __m512 bv[3];
  StoreRows(bf16* y_, int64_t ld_, const float* bias, int cols_) : y(y_), ld(ld_), cols(cols_) {
    for (int h = 0; h < 3; ++h) {
      const int n = std::clamp(cols - h * kRows, 0, kRows);
      bv[h] = bias && n ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), bias + h * kRows)
                        : _mm512_setzero_ps();
    }
  }
  void operator()(const float* const* c, int64_t m0, int rows) const {
    for (int h = 0; h * kRows < cols; ++h)
      store_transposed(c[h], bv[h], y + m0 * ld + h * kRows, ld, rows, std::min(kRows, cols - h * kRows));
  }
};

// A gate_up unit's outputs (its 16 gate rows, then the 16 matching up rows) as the MLP's
// activations: silu(gate) * up into act's columns [0, 16) (act points at the unit's first), gate
// and up (+ bias) rounded to bf16 first, as the layer's output would be, then the arithmetic of
// the SiLU-and-mul kernel on that output (silu_mul16): the same bits, computed on the sums as they
// lie (elementwise: the layout does not matter) and transposed once, without the layer's output
// going through memory (SmolLM2's gate_up and SiLU x 30 layers, Sapphire Rapids: 2048 rows 130
// -> 109 ms, 512 rows 30 -> 27, 64 rows 5.1-5.3 -> 4.5)
struct SiluRows {
  bf16* act;
  int64_t ld;
  const float *bias_gate, *bias_up;  // the unit's 16 of each (or null)
  void operator()(const float* const* c, int64_t m0, int rows) const {
    __m512 v[16];
    for (int n = 0; n < kRows; ++n) {
      const __m512 bg = _mm512_set1_ps(bias_gate ? bias_gate[n] : 0.f);
      const __m512 bu = _mm512_set1_ps(bias_up ? bias_up[n] : 0.f);
      const __m512 g = bf16_to_f(round_bf16(_mm512_add_ps(_mm512_load_ps(c[0] + kRows * n), bg)));
      const __m512 u = bf16_to_f(round_bf16(_mm512_add_ps(_mm512_load_ps(c[1] + kRows * n), bu)));
      v[n] = silu_mul16(g, u);
    }
    transpose16(v);
    for (int m = 0; m < rows; ++m) _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + (m0 + m) * ld), round_bf16(v[m]));
  }
};

// Weight rows per unit: with one input tile (M <= 16) three weight tiles, whose chains over K
// keep the tile unit busy (a multiply waits on the one before it into the same C tile: two
// chains left it idle half the time at one row); with more, two weight tiles x two input tiles.
// A unit's size never changes an output's chain, only which run beside it.
inline int unit_rows(int64_t M) { return M <= kRows ? 3 * kRows : 2 * kRows; }

// A unit's weight rows as the tiles read them: rows(s0, s1) gives steps [s0, s1) of every row (row
// r's step s at p + r * stride / 2 + (s - s0) * 32) and its row stride in bytes
struct DenseRows {  // the weight itself
  const bf16* w;
  int64_t K;
  const bf16* rows(int64_t s0, int64_t, int64_t* stride) const {
    *stride = K * 2;
    return w + s0 * kStep;
  }
};

// Weight rows [0, cols) of a unit (cols <= unit_rows(M)) against every input row: each output
// one chain of tile multiplies over all of K, in order; emit(c, m0, rows) takes each input tile's
// sums (c[h]: column tile h, [16 weight rows][16 input rows]) for its rows m0.. . The weights are
// asked for kChunk steps at a time, so that a dequantized chunk is read back from L1.
constexpr int64_t kChunk = 8;
template <typename Rows, typename Emit>
void unit_tiles(const Rows& src, const uint32_t* xb, int64_t M, int64_t K, int cols, const Emit& emit) {
  const int64_t steps = K / kStep, tiles = (M + kRows - 1) / kRows;
  const int nt = (cols + kRows - 1) / kRows;
  alignas(64) float c[3][kRows * kRows];  // (one input tile's sums)
  const auto out = [&](const float* c0, const float* c1, const float* c2, int64_t m0) {
    const float* ch[3] = {c0, c1, c2};
    emit(ch, m0, M - m0 < kRows ? static_cast<int>(M - m0) : kRows);
  };
  int64_t stride = 0;
  const bf16* w = nullptr;
  if (tiles == 1) {
    LANE_TILE_ZERO(0);
    LANE_TILE_ZERO(1);
    LANE_TILE_ZERO(2);
    for (int64_t s = 0; s < steps; ++s) {
      if (s % kChunk == 0) w = src.rows(s, std::min(s + kChunk, steps), &stride) - s * kStep;
      const int64_t ws = stride / 2;
      LANE_TILE_LOAD(6, xb + s * kTileU32, 64);
      LANE_TILE_LOAD(4, w + s * kStep, stride);
      LANE_TILE_DPBF16PS(0, 4, 6);
      if (nt > 1) {
        LANE_TILE_LOAD(5, w + kRows * ws + s * kStep, stride);
        LANE_TILE_DPBF16PS(1, 5, 6);
      }
      if (nt > 2) {
        LANE_TILE_LOAD(7, w + 2 * kRows * ws + s * kStep, stride);
        LANE_TILE_DPBF16PS(2, 7, 6);
      }
    }
    LANE_TILE_STORE(0, c[0], 64);
    if (nt > 1) LANE_TILE_STORE(1, c[1], 64);
    if (nt > 2) LANE_TILE_STORE(2, c[2], 64);
    out(c[0], c[1], c[2], 0);
    return;
  }
  // K in chunks, and within a chunk every pass of two input tiles, so that each pass reads the
  // chunk's weights from L1; with more than one pass, the sums wait in cs between chunks (fp32
  // stored and loaded as is: the same chain). Against all of K a pass (the weights then in L2 for
  // every pass): a 64-row FFN 15 % faster, 2048 rows 5 %.
  const bool two = nt > 1;
  const int64_t passes = (tiles + 1) / 2;
  float* cs = align64(scratch<float, 24>(passes * 4 * kRows * kRows + 16));
  for (int64_t s0 = 0; s0 < steps; s0 += kChunk) {
    const int64_t s1 = std::min(s0 + kChunk, steps);
    w = src.rows(s0, s1, &stride) - s0 * kStep;
    const bf16* wb = w + kRows * (stride / 2);
    for (int64_t t = 0; t < tiles; t += 2) {
      const bool t2 = t + 1 < tiles;
      const uint32_t* xa = xb + t * steps * kTileU32;
      const uint32_t* xc = xa + steps * kTileU32;
      float* cp = cs + t / 2 * 4 * kRows * kRows;
      if (s0 == 0) {
        LANE_TILE_ZERO(0);
        LANE_TILE_ZERO(1);
        LANE_TILE_ZERO(2);
        LANE_TILE_ZERO(3);
      } else if (passes > 1) {
        LANE_TILE_LOAD(0, cp, 64);
        LANE_TILE_LOAD(1, cp + 256, 64);
        LANE_TILE_LOAD(2, cp + 512, 64);
        LANE_TILE_LOAD(3, cp + 768, 64);
      }
      for (int64_t s = s0; s < s1; ++s) {
        LANE_TILE_LOAD(4, w + s * kStep, stride);
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
      if (s1 < steps && passes == 1) continue;  // the sums stay in the tiles
      LANE_TILE_STORE(0, cp, 64);
      LANE_TILE_STORE(1, cp + 256, 64);
      LANE_TILE_STORE(2, cp + 512, 64);
      LANE_TILE_STORE(3, cp + 768, 64);
      if (s1 == steps)
        for (int b = 0; b < (t2 ? 2 : 1); ++b)
          out(cp + 2 * b * kRows * kRows, cp + (2 * b + 1) * kRows * kRows, nullptr, (t + b) * kRows);
    }
  }
}

// Q4_0 / Q4_1 weights in the x8 layout (common.h), dequantized a unit of rows at a time into bf16 for
// the same tiles: every weight value bf16(d q + m) (Q4_0: d (q - 8)), the fp32 value rounded
// once, as the dense kernel would see the weight dequantized to bf16. Two rows' blocks make one
// 32-entry table of their values (an FMA over the 16 levels each, one conversion for both),
// looked up by the nibbles (vpermw) with bit 4 choosing the row. The nibbles come from the x8
// group's interleaved chunks: one dword permute puts a row pair's 4-byte pieces side by side in
// each qword, and a multishift per row moves each value's nibble to its word's low bits. About
// 5.5 vector instructions per row and 32 values, most on the one port that permutes (Sapphire
// Rapids: 1.3 ns; 2.5 ns as a per-row table and a byte gather and shift).
__attribute__((target("avx512vbmi,avx512bf16"))) void dequant_strip(const uint8_t* wp, int qtype, int64_t g0,
                                                                     int groups, int64_t nb, int64_t b0, int64_t b1,
                                                                     bf16* dst, int64_t ld) {
  const int64_t gb = kX8Rows * ggml_block_bytes(qtype), qo = x8_quant_offset(qtype);
  // dword 8 c + r of the group's 128 quant bytes is chunk c of row r (its bytes 4c..4c+3: values
  // 4c.. in the low nibbles, 16 + 4c.. in the high). Pair p's qword i: rows 2p and 2p + 1's chunk
  // i % 4. Word k (value k of a row) of qword k / 4: its nibble starts at bit 8 (k % 4) (+ 4 from
  // value 16 on) of its row's dword (+ 32 for the pair's second row). (Built once: a call is one
  // chunk of a unit.)
  struct Indices {
    alignas(64) int32_t pairs[kX8Rows / 2][16];
    alignas(64) uint8_t shifts[2][64];
  };
  static const Indices ix = [] {
    Indices v{};
    for (int p = 0; p < kX8Rows / 2; ++p)
      for (int i = 0; i < 8; ++i) v.pairs[p][2 * i] = 8 * (i % 4) + 2 * p, v.pairs[p][2 * i + 1] = 8 * (i % 4) + 2 * p + 1;
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 32; ++k) v.shifts[h][2 * k] = static_cast<uint8_t>(32 * h + 8 * (k % 4) + (k >= 16 ? 4 : 0));
    return v;
  }();
  const __m512i shift0 = _mm512_load_si512(ix.shifts[0]), shift1 = _mm512_load_si512(ix.shifts[1]);
  const __m512i nibble = _mm512_set1_epi16(0x0f), second = _mm512_set1_epi16(0x10);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 levels = qtype == kQ4_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(8.f)) : iota;
  for (int g = 0; g < groups; ++g)
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* o = wp + ((g0 + g) * nb + b) * gb;
      // the same block of the next chunk, or of the next unit's first: short runs per group, which
      // the hardware prefetchers do not pick up (the weights stream from L3 or DRAM each step)
      const int64_t ahead = b + (b1 - b0) < nb ? (b1 - b0) : (b1 - b0) - nb + groups * nb;
      for (int64_t i = 0; i < gb; i += 64) __builtin_prefetch(o + ahead * gb + i);
      alignas(32) float d[kX8Rows], m[kX8Rows] = {};
      _mm256_store_ps(d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o))));
      if (qtype == kQ4_1) _mm256_store_ps(m, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16))));
      // (d and m reread from memory: the FMAs take them as broadcast operands, not lanes
      // shuffled out of a register on the permute port)
      asm volatile("" ::: "memory");
      const __m512i lo = _mm512_loadu_si512(o + qo), hi = _mm512_loadu_si512(o + qo + 64);
      bf16* row = dst + g * kX8Rows * ld + (b - b0) * kStep;
      for (int p = 0; p < kX8Rows / 2; ++p) {
        const __m512i q = _mm512_permutex2var_epi32(lo, _mm512_load_si512(ix.pairs[p]), hi);
        const __m512 v0 = _mm512_fmadd_ps(levels, _mm512_set1_ps(d[2 * p]), _mm512_set1_ps(m[2 * p]));
        const __m512 v1 = _mm512_fmadd_ps(levels, _mm512_set1_ps(d[2 * p + 1]), _mm512_set1_ps(m[2 * p + 1]));
        const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));  // words 0-15: row 2p
        const __m512i i0 = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift0, q), nibble);
        const __m512i i1 = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(shift1, q), nibble, second, 0xEA);
        _mm512_store_si512(row + 2 * p * ld, _mm512_permutexvar_epi16(i0, table));
        _mm512_store_si512(row + (2 * p + 1) * ld, _mm512_permutexvar_epi16(i1, table));
      }
    }
  // (rows past the weight's, up to the last tile's 16, are zeros)
  for (int r = groups * kX8Rows; r % kRows; ++r) std::memset(dst + r * ld, 0, (b1 - b0) * kStep * 2);
}

// x8 rows g0 * 8 .. (g0 + groups) * 8 dequantized as the tiles ask for them, into the thread's
// strip (rows of the asked steps only: 48 x 8 steps, 24 KiB, for one pass; 48 x K for many)
struct QuantRows {
  const uint8_t* w;
  int qtype;
  int64_t g0, K;
  int groups;
  bf16* strip;
  const bf16* rows(int64_t s0, int64_t s1, int64_t* stride) const {
    *stride = (s1 - s0) * kStep * 2;
    dequant_strip(w, qtype, g0, groups, K / kStep, s0, s1, strip, (s1 - s0) * kStep);
    return strip;
  }
};

// A gate_up layer's unit j: x8 groups 2j, 2j + 1 of the gate rows (rows 16j..) and the same of
// the up rows (I + 16j..), dequantized one above the other into the strip, as QuantRows does
struct GateUpRows {
  const uint8_t* w;
  int qtype;
  int64_t g_gate, g_up, K;
  bf16* strip;
  const bf16* rows(int64_t s0, int64_t s1, int64_t* stride) const {
    const int64_t ld = (s1 - s0) * kStep;
    *stride = ld * 2;
    dequant_strip(w, qtype, g_gate, kRows / kX8Rows, K / kStep, s0, s1, strip, ld);
    dequant_strip(w, qtype, g_up, kRows / kX8Rows, K / kStep, s0, s1, strip + kRows * ld, ld);
    return strip;
  }
};

// x [M, K] (bf16) packed once into B tiles, then the rows in blocks, each block's units(mb)
// units split over the threads: unit(u, xr, m0, mb) runs unit u on rows [m0, m0 + mb), whose
// packed tiles start at xr
template <typename Units, typename Unit>
void tiles_linear(const void* x, int64_t M, int64_t K, int threads, const Units& units, const Unit& unit) {
  const int64_t tiles = (M + kRows - 1) / kRows;
  uint32_t* xb = align64(scratch<uint32_t, 0>(tiles * kRows * K / 2 + 16));
  pack_rows(static_cast<const bf16*>(x), xb, M, K, threads);
  // Input rows in blocks whose packed tiles stay in L2 while every unit's weights go past them:
  // a unit reads all of a block's tiles, so a block bigger than L2 comes back from L3 for every
  // unit (Sapphire Rapids, SmolLM2's FFN: 2048 rows took 1.9x the time per row of 512). Each
  // block re-dequantizes the weights, which costs less. A row's chain over K is the same in
  // any block.
  constexpr int64_t kBlockBytes = 768 << 10;
  const int64_t rb = std::max<int64_t>(1, kBlockBytes / (K * 2 * 2 * kRows)) * 2 * kRows;
  for (int64_t m0 = 0; m0 < M; m0 += rb) {
    const int64_t mb = std::min(rb, M - m0);
    const uint32_t* xr = xb + m0 / kRows * (K / kStep) * kTileU32;
    parallel_for(units(mb), 1, threads, [&](int64_t u0, int64_t u1) {
      tile_configure_full();
      for (int64_t u = u0; u < u1; ++u) unit(u, xr, m0, mb);
      tile_release();
    });
  }
}

// y [M, N] = x [M, K] . W^T + bias (fp32, or null), x and y bf16, W's rows as rows_of(n0, cols)
// gives each unit's (DenseRows, QuantRows): units of unit_rows(rows in the block) weight rows
template <typename RowsOf>
void tiles_linear_rows(const void* x, const RowsOf& rows_of, const float* bias, void* y, int64_t M, int64_t N,
                       int64_t K, int threads) {
  tiles_linear(x, M, K, threads, [&](int64_t mb) { return (N + unit_rows(mb) - 1) / unit_rows(mb); },
               [&](int64_t u, const uint32_t* xr, int64_t m0, int64_t mb) {
                 const int64_t ur = unit_rows(mb), n0 = ur * u;
                 const int cols = static_cast<int>(std::min(ur, N - n0));
                 unit_tiles(rows_of(n0, cols), xr, mb, K, cols,
                            StoreRows(static_cast<bf16*>(y) + m0 * N + n0, N, bias ? bias + n0 : nullptr, cols));
               });
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
  float* bf = nullptr;
  if (bias) {  // (fp32 once a call, as the x8 layers' bias comes)
    bf = scratch<float, 23>(N);
    for (int64_t n = 0; n < N; ++n) bf[n] = to_f(static_cast<const bf16*>(bias)[n]);
  }
  const bf16* wd = static_cast<const bf16*>(w);
  tiles_linear_rows(x, [&](int64_t n0, int) { return DenseRows{wd + n0 * K, K}; }, bf, y, M, N, K, threads);
  return true;
#else
  (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
  return false;
#endif
}

// y [M, N] = x [M, K] . W^T (+ bias [N], fp32), x and y bf16, W Q4_0 / Q4_1 in the x8 layout
// (N a multiple of 8), on AMX-BF16 tiles after dequantizing each unit of rows to bf16: false (nothing
// done) where the CPU, the kind or the switch rules them out, which never depends on M. Every
// output is the dense tiles' chain over K on the dequantized weight, so a row's result is the
// same bits alone or in any batch.
extern "C" bool lane_x8_bf16_amx_linear(const void* x, const uint8_t* w, int qtype, const float* bias, void* y,
                                        int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512F__)
  if ((qtype != kQ4_0 && qtype != kQ4_1) || !x8_bf16_usable()) return false;
  tiles_linear_rows(x, [&](int64_t n0, int cols) {  // (N a multiple of 8: whole x8 groups; the thread's own strip)
    return QuantRows{w, qtype, n0 / kX8Rows, K, cols / kX8Rows, align64(scratch<bf16, 1>(3 * kRows * K + 32))};
  }, bias, y, M, N, K, threads);
  return true;
#else
  (void)x, (void)w, (void)qtype, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
  return false;
#endif
}

// act [M, I] = silu(x Wg^T + bg) * (x Wu^T + bu) for a gate_up layer W = [Wg; Wu] ([2 I, K], x8 Q4_0 /
// Q4_1; bias [2 I] fp32 or null), x and act bf16: the layer and the SiLU-and-mul kernel in one
// pass, each value the same bits as the two in turn (lane_x8_bf16_amx_linear, then
// lane_silu_and_mul). False (nothing done) where that linear would not take the tiles, or I is
// not a multiple of 16: the caller runs the two then.
extern "C" bool lane_x8_bf16_amx_silu_mul(const void* x, const uint8_t* w, int qtype, const float* bias, void* act,
                                          int64_t M, int64_t I, int64_t K, int threads) {
#if defined(__AVX512F__)
  if ((qtype != kQ4_0 && qtype != kQ4_1) || I % kRows != 0 || !x8_bf16_usable()) return false;
  tiles_linear(x, M, K, threads, [&](int64_t) { return I / kRows; },
               [&](int64_t u, const uint32_t* xr, int64_t m0, int64_t mb) {
                 const int64_t j0 = u * kRows;
                 const SiluRows emit{static_cast<bf16*>(act) + m0 * I + j0, I, bias ? bias + j0 : nullptr,
                                     bias ? bias + I + j0 : nullptr};
                 const GateUpRows rows{w, qtype, j0 / kX8Rows, (I + j0) / kX8Rows, K,
                                       align64(scratch<bf16, 1>(3 * kRows * K + 32))};
                 unit_tiles(rows, xr, mb, K, 2 * kRows, emit);
               });
  return true;
#else
  (void)x, (void)w, (void)qtype, (void)bias, (void)act, (void)M, (void)I, (void)K, (void)threads;
  return false;
#endif
}

// lane_x8_bf16_amx_silu_mul for Python (the tests): whether it ran, in done[0]
extern "C" void lane_x8_silu_mul(const void* x, const uint8_t* w, int qtype, const float* bias, void* act, int64_t M,
                                 int64_t I, int64_t K, int threads, int64_t* done) {
  done[0] = lane_x8_bf16_amx_silu_mul(x, w, qtype, bias, act, M, I, K, threads);
}

// Whether bf16 rows on x8 Q4_0 / Q4_1 weights take the dequantizing tiles here (out[0]); with
// on >= 0, set that first (tests and benchmarks: off, the int8 kernels run those rows, with other
// sums, so a switch mid-run breaks batch invariance)
extern "C" void lane_x8_bf16_amx(int on, int64_t* out) {
#if defined(__AVX512F__)
  if (on >= 0) x8_bf16_enabled.store(on, std::memory_order_relaxed);
  out[0] = x8_bf16_usable();
#else
  (void)on;
  out[0] = 0;
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
