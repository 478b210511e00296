// Paged attention over a bf16 cache on AMX-BF16 tiles (Sapphire Rapids and later): decode rows
// and a prefill chunk's rows (each attended as a decode row at its position: the batch-invariant
// prefill), so a row's output is the same bits whichever way it came.
//
// A tile's 16 rows ("lanes") are query rows of one KV head: the G heads of one request (decode),
// or of 16 / G consecutive positions (a chunk). The context goes by in steps of 32 keys, two
// cache blocks, counted from position 0 for every lane: S = Q K^T (two C tiles), a per-lane
// online softmax over the step's keys, O += P V (P rounded to bf16). K and V enter as B tiles,
// packed from the cache: K's blocks transposed (dim pairs x keys), V's key pairs interleaved value
// by value. A chunk packs each step once, for all its rows; a decode row packs its own.
//
// Why a row is the same in both: every lane's arithmetic is its own (a tile's C[m][n] is row m
// of A against column n of B), runs in one function (attend_step) over the same steps, and keys
// a lane must not see are masked out of its softmax (P exactly 0; V past the context packed as 0,
// never the cache's leftovers, since 0 * NaN is NaN); a lane with no key in a step skips it.
// This file is built without reassociation or contraction (cpu_kernels._SOURCE_CFLAGS), so the
// compiler cannot order a lane's sums differently in the two callers.
#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "amx.h"

namespace {

using namespace lane;

#if defined(__AVX512F__)
std::atomic<int> attention_amx_enabled{1};  // off: benchmarks time the AVX-512 kernel instead

inline bool attention_amx_usable() {
  static const bool usable = use_avx512bf16() && cpu_has_amx(22);
  return usable && attention_amx_enabled.load(std::memory_order_relaxed);
}

constexpr int64_t kLanes = 16;  // query rows a tile holds
constexpr int64_t kKeys = 32;   // keys a step takes: two 16-token blocks
constexpr int64_t kBS = 16;
constexpr int64_t kTile = 256;  // 32-bit words in a tile: 16 rows of 64 bytes

// A step's tiles: K ([2 blocks][D / 32 chunks], each 16 dim pairs x 16 keys), then V ([D / 16],
// each 16 key pairs x 16 dims)
template <int64_t D>
constexpr int64_t step_words() { return (2 * (D / 32) + D / 16) * kTile; }

// Keys 32 j .. 32 j + 31 of KV head h (block table `table`, context L) -> dst; keys at or past L
// are zeros
template <int64_t D>
void pack_step(const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t L, int64_t j, int64_t h,
               int64_t KVH, uint32_t* dst) {
  const uint16_t* kb[2] = {nullptr, nullptr};
  const uint16_t* vb[2] = {nullptr, nullptr};
  int64_t n[2];
  for (int b = 0; b < 2; ++b) {
    n[b] = std::clamp<int64_t>(L - kKeys * j - kBS * b, 0, kBS);
    if (n[b] > 0) {
      const int64_t base = (table[2 * j + b] * KVH + h) * kBS * D;
      kb[b] = kc + base, vb[b] = vc + base;
    }
  }
  for (int b = 0; b < 2; ++b)
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512 v[16];
      for (int t = 0; t < 16; ++t)
        v[t] = t < n[b] ? _mm512_castsi512_ps(_mm512_loadu_si512(kb[b] + t * D + 32 * c)) : _mm512_setzero_ps();
      transpose16(v);  // row p: dims 32 c + 2p, 2p + 1 of each key
      uint32_t* o = dst + (b * (D / 32) + c) * kTile;
      for (int p = 0; p < 16; ++p) _mm512_store_si512(o + 16 * p, _mm512_castps_si512(v[p]));
    }
  uint32_t* vt = dst + 2 * (D / 32) * kTile;
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t k2 = 0; k2 < 16; ++k2) {  // keys 2 k2, 2 k2 + 1: block k2 / 8, rows t, t + 1
    const int b = static_cast<int>(k2 / 8), t = static_cast<int>(2 * (k2 % 8));
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i x = t < n[b] ? _mm512_loadu_si512(vb[b] + t * D + 32 * c) : _mm512_setzero_si512();
      const __m512i y = t + 1 < n[b] ? _mm512_loadu_si512(vb[b] + (t + 1) * D + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vt + (2 * c) * kTile + 16 * k2, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_store_si512(vt + (2 * c + 1) * kTile + 16 * k2, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// One tile's rows: their context lengths, where their queries are and where their outputs go,
// their softmax state and accumulators, and their queries as A tiles ([D / 32][lane][32])
template <int64_t D>
struct Lanes {
  int64_t n = 0;
  int64_t len[kLanes];
  const uint16_t* q[kLanes];
  uint16_t* out[kLanes];
  alignas(64) float m[kLanes], l[kLanes];
  alignas(64) float acc[kLanes * D];
  alignas(64) uint16_t qa[D / 32 * kLanes * 32];

  void start() {
    std::fill(qa, qa + D / 32 * kLanes * 32, uint16_t{0});
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < D / 32; ++c) std::memcpy(qa + (c * kLanes + r) * 32, q[r] + 32 * c, 64);
    }
    std::fill(m, m + kLanes, -INFINITY);
    std::fill(l, l + kLanes, 0.f);
    std::fill(acc, acc + kLanes * D, 0.f);
  }
  int64_t steps() const { return (*std::max_element(len, len + n) + kKeys - 1) / kKeys; }
  void finish() {
    for (int64_t r = 0; r < n; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + d),
                            round_bf16(_mm512_mul_ps(_mm512_load_ps(acc + r * D + d), inv)));
    }
  }
};

inline __mmask16 first(int64_t k) { return k >= 16 ? __mmask16(0xffff) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1u); }

// Step j of every lane, on its packed tiles (tiles configured by tile_configure_full)
template <int64_t D>
__attribute__((noinline)) void attend_step(Lanes<D>& ln, const uint32_t* tiles, int64_t j, float scale) {
  alignas(64) float s[kLanes * kKeys];
  alignas(64) float o[kLanes * D];
  alignas(64) uint16_t pa[kLanes * kKeys];
  LANE_TILE_ZERO(0);
  LANE_TILE_ZERO(1);
  for (int64_t c = 0; c < D / 32; ++c) {
    LANE_TILE_LOAD(2, ln.qa + c * kLanes * 32, 64);
    LANE_TILE_LOAD(3, tiles + c * kTile, 64);
    LANE_TILE_DPBF16PS(0, 2, 3);
    LANE_TILE_LOAD(4, tiles + (D / 32 + c) * kTile, 64);
    LANE_TILE_DPBF16PS(1, 2, 4);
  }
  LANE_TILE_STORE(0, s, kKeys * 4);
  LANE_TILE_STORE(1, s + 16, kKeys * 4);
  const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  // scores scaled, keys a lane must not see at -inf (a lane with none of this step's keys is
  // inactive: its state stays as it was, its P row zeros); every lane's max in one tree
  __mmask16 active = 0, m0[kLanes], m1[kLanes];
  __m512 x[2 * kLanes], t[kLanes];
  for (int64_t r = ln.n; r < kLanes; ++r) t[r] = ninf, m0[r] = m1[r] = 0;  // no row: no key
  for (int64_t r = 0; r < ln.n; ++r) {
    const int64_t k = ln.len[r] - kKeys * j;  // keys of this step the lane sees
    if (k > 0) active |= static_cast<__mmask16>(1u << r);
    m0[r] = first(k), m1[r] = first(k - 16);
    x[2 * r] = _mm512_mask_mov_ps(ninf, m0[r], _mm512_mul_ps(_mm512_load_ps(s + r * kKeys), vs));
    x[2 * r + 1] = _mm512_mask_mov_ps(ninf, m1[r], _mm512_mul_ps(_mm512_load_ps(s + r * kKeys + 16), vs));
    t[r] = _mm512_max_ps(x[2 * r], x[2 * r + 1]);
  }
  const __m512 m_old = _mm512_load_ps(ln.m), m_new = _mm512_max_ps(m_old, transpose_max16(t));
  alignas(64) float mb[kLanes];
  _mm512_store_ps(mb, m_new);
  std::memset(pa + ln.n * kKeys, 0, (kLanes - ln.n) * kKeys * 2);
  for (int64_t r = ln.n; r < kLanes; ++r) t[r] = _mm512_setzero_ps();
  for (int64_t r = 0; r < ln.n; ++r) {  // P, its row sums (in one tree below) and its bf16 A tile
    const __m512 vmb = _mm512_set1_ps(mb[r]);
    const __m512 p0 = _mm512_maskz_mov_ps(m0[r], exp512(_mm512_sub_ps(x[2 * r], vmb)));
    const __m512 p1 = _mm512_maskz_mov_ps(m1[r], exp512(_mm512_sub_ps(x[2 * r + 1], vmb)));
    t[r] = _mm512_add_ps(p0, p1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pa + r * kKeys), round_bf16(p0));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pa + r * kKeys + 16), round_bf16(p1));
  }
  const __m512 sum = transpose_sum16(t);
  // every lane's rescaling at once: corr = exp(m - new m), 0 before the lane's first key
  const __m512 corr = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_OQ) & active,
                                          exp512(_mm512_sub_ps(m_old, m_new)));
  _mm512_store_ps(ln.l, _mm512_mask_add_ps(_mm512_load_ps(ln.l), active,
                                           _mm512_mul_ps(_mm512_load_ps(ln.l), corr), sum));
  _mm512_store_ps(ln.m, _mm512_mask_mov_ps(m_old, active, m_new));
  alignas(64) float cs[kLanes];
  _mm512_store_ps(cs, corr);
  LANE_TILE_LOAD(5, pa, 64);
  const uint32_t* vt = tiles + 2 * (D / 32) * kTile;
  for (int64_t c = 0; c < D / 16; ++c) {
    LANE_TILE_ZERO(7);
    LANE_TILE_LOAD(6, vt + c * kTile, 64);
    LANE_TILE_DPBF16PS(7, 5, 6);
    LANE_TILE_STORE(7, o + 16 * c, D * 4);
  }
  for (int64_t r = 0; r < ln.n; ++r) {
    if (!((active >> r) & 1)) continue;
    const __m512 cv = _mm512_set1_ps(cs[r]);
    float* a = ln.acc + r * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_store_ps(a + d, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(a + d), cv), _mm512_load_ps(o + r * D + d)));
  }
}

template <int64_t D>
void attend(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* tables, const int32_t* lens,
            uint16_t* out, int64_t B, int64_t H, int64_t KVH, int64_t MB, float scale, int threads) {
  const int64_t G = H / KVH;
  if (MB > 0) {  // decode rows: one request's G heads a tile, each step packed where it is used
    parallel_for(B * KVH, 1, threads, [&](int64_t begin, int64_t end) {
      tile_configure_full();
      Lanes<D> ln;
      alignas(64) uint32_t tiles[step_words<D>()];
      for (int64_t k = begin; k < end; ++k) {
        const int64_t b = k / KVH, h = k % KVH;
        ln.n = G;
        for (int64_t g = 0; g < G; ++g) {
          ln.len[g] = lens[b];
          ln.q[g] = q + (b * H + h * G + g) * D;
          ln.out[g] = out + (b * H + h * G + g) * D;
        }
        ln.start();
        for (int64_t j = 0, n = ln.steps(); j < n; ++j) {
          pack_step<D>(kc, vc, tables + b * MB, lens[b], j, h, KVH, tiles);
          attend_step<D>(ln, tiles, j, scale);
        }
        ln.finish();
      }
      tile_release();
    });
    return;
  }
  // rows of one table (MB 0): each step packed once for every tile, then 16 / G rows a tile
  const int64_t L = *std::max_element(lens, lens + B), steps = (L + kKeys - 1) / kKeys;
  uint32_t* packed = align64(scratch<uint32_t, 1>(KVH * steps * step_words<D>() + 16));
  parallel_for(KVH * steps, 4, threads, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      pack_step<D>(kc, vc, tables, L, u % steps, u / steps, KVH, packed + u * step_words<D>());
  });
  const int64_t R = kLanes / G, groups = (B + R - 1) / R;
  parallel_for(groups * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    tile_configure_full();
    Lanes<D> ln;
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = zigzag(k, groups * KVH), b0 = item / KVH * R, h = item % KVH;
      ln.n = std::min(R, B - b0) * G;
      for (int64_t r = 0; r < ln.n; ++r) {
        const int64_t b = b0 + r / G, head = h * G + r % G;
        ln.len[r] = lens[b];
        ln.q[r] = q + (b * H + head) * D;
        ln.out[r] = out + (b * H + head) * D;
      }
      ln.start();
      for (int64_t j = 0, n = ln.steps(); j < n; ++j)
        attend_step<D>(ln, packed + (h * steps + j) * step_words<D>(), j, scale);
      ln.finish();
    }
    tile_release();
  });
}
#endif

}  // namespace

// q [B, H, D] bf16, caches [NB, KVH, 16, D] bf16, block_tables [B, MB] int64 (MB 0: one table for
// every row, a prefill chunk's rows), context_lens [B] int32 -> out [B, H, D]: false (nothing done)
// where the CPU or the shape does not take the tiles (head_dim 64 or 128, 16-token blocks, at most
// 16 query heads per KV head), which depends on the model, never on the batch
extern "C" bool lane_paged_attention_amx(const void* q, const void* k_cache, const void* v_cache,
                                         const int64_t* block_tables, const int32_t* context_lens, void* out, int64_t B,
                                         int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale,
                                         int threads) {
#if defined(__AVX512F__)
  if (BS != kBS || (D != 64 && D != 128) || H % KVH != 0 || H / KVH > kLanes || !attention_amx_usable())
    return false;
  if (B <= 0) return true;
  const auto* qp = static_cast<const uint16_t*>(q);
  const auto* kc = static_cast<const uint16_t*>(k_cache);
  const auto* vc = static_cast<const uint16_t*>(v_cache);
  auto* op = static_cast<uint16_t*>(out);
  if (D == 64) attend<64>(qp, kc, vc, block_tables, context_lens, op, B, H, KVH, MB, scale, threads);
  else attend<128>(qp, kc, vc, block_tables, context_lens, op, B, H, KVH, MB, scale, threads);
  return true;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)context_lens, (void)out, (void)B, (void)H;
  (void)KVH, (void)D, (void)BS, (void)MB, (void)scale, (void)threads;
  return false;
#endif
}

// Whether bf16 paged attention takes the tiles here (out[0]); with on >= 0, set that first (on 0:
// never; for benchmarks: the tiles' sums differ from the AVX-512 kernel's, so a process that
// switches mid-run loses batch invariance)
extern "C" void lane_attention_amx(int on, int64_t* out) {
#if defined(__AVX512F__)
  if (on >= 0) attention_amx_enabled.store(on, std::memory_order_relaxed);
  out[0] = attention_amx_usable();
#else
  (void)on;
  out[0] = 0;
#endif
}
