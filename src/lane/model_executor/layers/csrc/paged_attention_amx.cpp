// Paged attention over a bf16 cache on AMX-BF16 tiles (Sapphire Rapids and later): decode rows
// and a prefill chunk's rows (each attended as a decode row at its position: the batch-invariant
// prefill), so a row's output is the same bits whichever way it came.
//
// A tile's 16 "lanes" are query rows of one KV head: the G heads of one request (decode), or of
// 16 / G consecutive positions (a chunk). The context goes by in steps of 32 keys, two cache
// blocks, counted from position 0 for every lane: S^T = K Q^T (two C tiles, keys x lanes), a
// per-lane online softmax over the step's keys, O += P V (P rounded to bf16). The queries are the
// B tile (dim pairs x lanes, built once a row); a K block is an A tile as it lies in the cache
// (16 keys x 32 dims), so K is never transposed; the softmax takes each lane's 32 scores back as
// two vectors. V enters as B tiles, its key pairs interleaved value by value. A chunk packs each
// step's K and V once, for all its rows; a decode row reads K from the cache and packs its V,
// a request's KV heads going through the context together when there are requests to spare.
// (Against K transposed into B tiles: decode attention over a cache in DRAM 10-20 % faster,
// chunks the same.)
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
constexpr int64_t kFewLanes = 4;  // tiles with at most this many lanes take the softmax lane by lane

// v's 16 lanes summed: lanes k + k + 8, then + 4, + 2, + 1 (the order attend_step's vector path
// folds a lane's keys in; written out, not left to a reduce intrinsic's choice)
inline float fold16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// A decode row's next V blocks (step j + 1's), asked for a few lines at a time while step j
// computes (attend_step calls ask between its parts). Over a cache in DRAM the step waits on
// misses: asked for all at once they fill the core's line fill buffers and stall it, and asked
// for only while V is packed (as K still is), the memory idles while the tiles work
// (decode_attention.py's 64 rows at 300 keys, blocks in order / anywhere: 23.5 / 29.7 -> 22.3 /
// 26.0 ms; in-engine, a 64-row step's attention 24.7-26.9 -> 22.5-23.6 ms).
template <int64_t D, int64_t Elem = 2>
struct NextV {
  static constexpr int64_t kLines = kBS * D * Elem / 64;  // a block's
  const char* block[2] = {nullptr, nullptr};
  int64_t line = 2 * kLines;  // none to ask for
  void ask(int64_t lines) {
    for (const int64_t end = std::min(2 * kLines, line + lines); line < end; ++line)
      if (block[line / kLines]) _mm_prefetch(block[line / kLines] + line % kLines * 64, _MM_HINT_T1);
  }
};

// The cache the tiles read, by key row (a slot times the KV heads plus the head) and 32-value
// chunk c of it: bf16 values as they lie (a K block is an A tile in place), or 8 bits (C8,
// --kv-cache-dtype int8 / fp8_e4m3) with a float scale per row, each chunk dequantized to fp32
// as paged_attention.cpp's ByteRows does (int8: the integer times the scale; an e4m3 byte: its
// fp16 bit pattern times the scale and 2^8) and rounded to bf16 for the tiles. A K block of
// those is always copied (dequantized) into tiles first.
template <int64_t D>
struct Bf16Cache {
  static constexpr int64_t kElem = 2;
  static constexpr bool kInPlace = true;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* k_row(int64_t row) const { return k + row * D; }
  const char* k_bytes(int64_t row) const { return reinterpret_cast<const char*>(k + row * D); }
  const char* v_bytes(int64_t row) const { return reinterpret_cast<const char*>(v + row * D); }
  const char* k_scales(int64_t) const { return nullptr; }
  const char* v_scales(int64_t) const { return nullptr; }
  __m512i k32(int64_t row, int64_t c) const { return _mm512_loadu_si512(k + row * D + 32 * c); }
  __m512i v32(int64_t row, int64_t c) const { return _mm512_loadu_si512(v + row * D + 32 * c); }
};

template <int64_t D, bool FP8>
struct ByteCache {
  static constexpr int64_t kElem = 1;
  static constexpr bool kInPlace = false;
  const uint8_t* k;
  const uint8_t* v;
  const float* ks;
  const float* vs;
  const uint16_t* k_row(int64_t) const { return nullptr; }
  const char* k_bytes(int64_t row) const { return reinterpret_cast<const char*>(k + row * D); }
  const char* v_bytes(int64_t row) const { return reinterpret_cast<const char*>(v + row * D); }
  const char* k_scales(int64_t row) const { return reinterpret_cast<const char*>(ks + row); }
  const char* v_scales(int64_t row) const { return reinterpret_cast<const char*>(vs + row); }
  static __m512 sixteen(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (FP8) return _mm512_cvtph_ps(e4m3_as_f16(b));
    else return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static __m512i chunk(const uint8_t* p, float scale) {
    const __m512 s = _mm512_set1_ps(FP8 ? scale * 256.f : scale);
    return _mm512_inserti64x4(_mm512_castsi256_si512(round_bf16(_mm512_mul_ps(sixteen(p), s))),
                              round_bf16(_mm512_mul_ps(sixteen(p + 16), s)), 1);
  }
  __m512i k32(int64_t row, int64_t c) const { return chunk(k + row * D + 32 * c, ks[row]); }
  __m512i v32(int64_t row, int64_t c) const { return chunk(v + row * D + 32 * c, vs[row]); }
};

// Step j's keys of KV head h (block table `table`, context L): its two K blocks as A tiles in kb
// (nullptr past L): the cache's own rows (row stride D), or with kdst, copied there as tiles of
// 64-byte rows ([block][D / 32][key][32 dims]); and its V as B tiles in dst, keys at or past L
// zeros: [D / 16] tiles, each 16 key pairs x 16 dims, keys 2i, 2i + 1 interleaved value by value
// (one unpack of two rows: a tile's 16 columns are the dims 32c + {0-3, 8-11, 16-19, 24-27} or
// {4-7, ...}, which Lanes::finish puts back in order; a column's sums do not depend on where it
// is). Either way of K gives the tiles the same values; the copy only makes a chunk's loads
// dense. With prefetch, step j + 1's blocks are asked for a sixteenth at a time along the
// packing: all at once, the misses queue up behind each other, and a decode row over a cache in
// DRAM waits on them (decode_attention.py's 64 rows: 14 against ~11 GB/s). With vnext, only K's
// are: V's first lines (their pages walked early), the rest left to vnext.ask.
template <int64_t D, typename Cache>
void step_blocks(const Cache& cache, const int64_t* table, int64_t L, int64_t j, int64_t h, int64_t KVH,
                 const uint16_t** kb, uint32_t* dst, uint32_t* kdst = nullptr, bool prefetch = false,
                 NextV<D, Cache::kElem>* vnext = nullptr) {
  int64_t rows[2] = {0, 0};                                    // each block's first key row
  const char* next[4] = {nullptr, nullptr, nullptr, nullptr};  // step j + 1's K and V blocks
  int64_t n[2];
  for (int b = 0; b < 2; ++b) {
    n[b] = std::clamp<int64_t>(L - kKeys * j - kBS * b, 0, kBS);
    kb[b] = nullptr;
    if (n[b] > 0) rows[b] = (table[2 * j + b] * KVH + h) * kBS, kb[b] = cache.k_row(rows[b]);
    if (prefetch && L > kKeys * (j + 1) + kBS * b) {
      const int64_t row = (table[2 * (j + 1) + b] * KVH + h) * kBS;
      next[2 * b] = cache.k_bytes(row), next[2 * b + 1] = cache.v_bytes(row);
      for (const char* sc : {cache.k_scales(row), cache.v_scales(row)})  // a block's 16 scales: one line
        if (sc) _mm_prefetch(sc, _MM_HINT_T1);
    }
  }
  if (vnext) *vnext = NextV<D, Cache::kElem>{{next[1], next[3]}, 0};
  for (int b = 0; (kdst || !Cache::kInPlace) && b < 2; ++b) {  // K as A tiles of 64-byte rows ([D / 32][key][32 dims])
    if (n[b] == 0) continue;
    for (int64_t c = 0; c < D / 32; ++c)
      for (int t = 0; t < 16; ++t) _mm512_store_si512(kdst + (b * (D / 32) + c) * kTile + 16 * t, cache.k32(rows[b] + t, c));
    kb[b] = reinterpret_cast<const uint16_t*>(kdst + b * (D / 32) * kTile);
  }
  for (int64_t k2 = 0; k2 < 16; ++k2) {  // keys 2 k2, 2 k2 + 1: block k2 / 8, rows t, t + 1
    const int b = static_cast<int>(k2 / 8), t = static_cast<int>(2 * (k2 % 8));
    for (int q = 1; vnext && k2 == 0 && q < 4; q += 2)
      if (next[q]) _mm_prefetch(next[q], _MM_HINT_T1);
    for (int q = 0; q < 4; q += vnext ? 2 : 1)  // a sixteenth of the next step's blocks (K's only, with vnext)
      for (int64_t i = 0; next[q] && i < D * Cache::kElem; i += 64)
        _mm_prefetch(next[q] + k2 * D * Cache::kElem + i, _MM_HINT_T1);
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i x = t < n[b] ? cache.v32(rows[b] + t, c) : _mm512_setzero_si512();
      const __m512i y = t + 1 < n[b] ? cache.v32(rows[b] + t + 1, c) : _mm512_setzero_si512();
      _mm512_store_si512(dst + (2 * c) * kTile + 16 * k2, _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(dst + (2 * c + 1) * kTile + 16 * k2, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// One tile's rows: their context lengths (lanes past n: 0, no key), where their queries are and
// where their outputs go, their softmax state and accumulators, and their queries as B tiles
// ([D / 32], each 16 dim pairs x 16 lanes), so that a cache block is an A tile as it lies and S
// comes out keys x lanes
template <int64_t D>
struct Lanes {
  int64_t n = 0;
  alignas(64) int32_t lens[kLanes];
  const uint16_t* q[kLanes];
  uint16_t* out[kLanes];
  alignas(64) float m[kLanes], l[kLanes];
  alignas(64) float acc[kLanes * D];
  alignas(64) uint32_t qb[D / 32 * kTile];
  alignas(64) uint32_t pa[kTile];  // P as an A tile: lane r's 32 keys in row r (bf16)

  void start() {
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512 v[kLanes];
      for (int64_t r = 0; r < kLanes; ++r)
        v[r] = r < n ? _mm512_castsi512_ps(_mm512_loadu_si512(q[r] + 32 * c)) : _mm512_setzero_ps();
      transpose16(v);  // row p: dims 32 c + 2p, 2p + 1 of every lane
      for (int p = 0; p < 16; ++p) _mm512_store_si512(qb + c * kTile + 16 * p, _mm512_castps_si512(v[p]));
    }
    std::fill(lens + n, lens + kLanes, 0);
    std::fill(m, m + kLanes, -INFINITY);
    std::fill(l, l + kLanes, 0.f);
    std::fill(acc, acc + kLanes * D, 0.f);
    std::fill(pa, pa + kTile, 0u);  // rows of lanes past n stay 0
  }
  int64_t steps() const { return (*std::max_element(lens, lens + n) + kKeys - 1) / kKeys; }
  void finish() {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t r = 0; r < n; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      for (int64_t d = 0; d < D; d += 32) {  // the V tiles' columns back in dim order
        const __m512 a = _mm512_load_ps(acc + r * D + d), b = _mm512_load_ps(acc + r * D + d + 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + d),
                            round_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(a, first, b), inv)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + d + 16),
                            round_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(a, second, b), inv)));
      }
    }
  }
};

// Step j of every lane: K blocks kb (nullptr: none; a block's 32 dims c at kb + c kstep, rows
// kstride bytes apart), V tiles vt (tiles configured by tile_configure_full). S^T = K Q^T comes
// out keys x lanes; the softmax goes key by key over all 16 lanes, or, for a tile of a few lanes
// (a decode row's G heads), lane by lane, which pays for G lanes' exps rather than 16 (64 decode
// rows over a cache in L3: 0.68 -> 0.62 ms a layer): the same arithmetic in the same order
// either way, so a lane's output does not depend on which way its tile took
template <int64_t D, typename Next>
__attribute__((noinline)) void attend_step(Lanes<D>& ln, const uint16_t* const* kb, int64_t kstep, int64_t kstride,
                                           const uint32_t* vt, int64_t j, float scale, Next& vnext) {
  alignas(64) float s[kKeys * kLanes];
  alignas(64) float o[kLanes * D];
  LANE_TILE_ZERO(0);
  LANE_TILE_ZERO(1);
  for (int64_t c = 0; c < D / 32; ++c) {
    LANE_TILE_LOAD(3, ln.qb + c * kTile, 64);
    if (kb[0]) {
      LANE_TILE_LOAD(2, kb[0] + kstep * c, kstride);
      LANE_TILE_DPBF16PS(0, 2, 3);
    }
    if (kb[1]) {
      LANE_TILE_LOAD(4, kb[1] + kstep * c, kstride);
      LANE_TILE_DPBF16PS(1, 4, 3);
    }
  }
  LANE_TILE_STORE(0, s, 64);
  LANE_TILE_STORE(1, s + kBS * kLanes, 64);
  constexpr int64_t kShare = Next::kLines / 4;  // of the next V's lines, asked for at each part
  vnext.ask(2 * kShare);
  const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  const __m512 m_old = _mm512_load_ps(ln.m);
  const int32_t k0 = static_cast<int32_t>(kKeys * j);
  __mmask16 active = 0;  // lanes with a key in this step (one without keeps its state as it was)
  __m512 m_new, sums;    // per lane: the running max with this step's scores, this step's P summed
  if (ln.n <= kFewLanes) {
    // a few lanes (a decode row's G heads): each lane's 32 scores as two vectors (a gather from
    // the keys x lanes sums), its max and its P's sum folded in the order the vector path folds
    // a lane's 32 keys, so that either way gives the same bits
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx = _mm512_mullo_epi32(iota, _mm512_set1_epi32(kLanes));
    alignas(64) float mr[kLanes], sr[kLanes];
    for (int64_t r = 0; r < ln.n; ++r) {
      const int32_t left = ln.lens[r] - k0;
      vnext.ask(kShare);
      if (left <= 0) continue;
      active |= static_cast<__mmask16>(1u << r);
      const __mmask16 sa = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(left), iota);
      const __mmask16 sb = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(left - kBS), iota);
      const __m512 xa = _mm512_mask_mov_ps(ninf, sa, _mm512_mul_ps(_mm512_i32gather_ps(idx, s + r, 4), vs));
      const __m512 xb = _mm512_mask_mov_ps(ninf, sb, _mm512_mul_ps(_mm512_i32gather_ps(idx, s + kBS * kLanes + r, 4), vs));
      mr[r] = std::max(ln.m[r], _mm512_reduce_max_ps(_mm512_max_ps(xa, xb)));
      const __m512 mv = _mm512_set1_ps(mr[r]);
      const __m512 pa = _mm512_maskz_mov_ps(sa, exp512(_mm512_sub_ps(xa, mv)));
      const __m512 pb = _mm512_maskz_mov_ps(sb, exp512(_mm512_sub_ps(xb, mv)));
      sr[r] = fold16(_mm512_add_ps(pa, pb));  // key k + key k + 16, then the fold
      _mm256_store_si256(reinterpret_cast<__m256i*>(ln.pa + 16 * r), round_bf16(pa));  // row r: its 32 keys
      _mm256_store_si256(reinterpret_cast<__m256i*>(ln.pa + 16 * r + 8), round_bf16(pb));
    }
    m_new = _mm512_mask_load_ps(m_old, active, mr);
    sums = _mm512_maskz_load_ps(active, sr);
  } else {
    // many lanes (a chunk's rows): a key's lanes in one vector, so that a lane's max and sum are
    // plain vector folds over the keys (k + 16, + 8, + 4, + 2, + 1: fold16's order); P goes
    // back to lanes x keys by one transpose
    const __m512i lens = _mm512_load_si512(ln.lens);
    __mmask16 seen[kKeys];
    __m512 x[kKeys];
    __m512 mx = ninf;
    for (int k = 0; k < kKeys; ++k) {
      seen[k] = _mm512_cmpgt_epi32_mask(lens, _mm512_set1_epi32(k0 + k));
      x[k] = _mm512_mask_mov_ps(ninf, seen[k], _mm512_mul_ps(_mm512_load_ps(s + k * kLanes), vs));
      mx = _mm512_max_ps(mx, x[k]);
    }
    active = seen[0];
    m_new = _mm512_mask_mov_ps(m_old, active, _mm512_max_ps(m_old, mx));
    __m512i w[kLanes];
    for (int k = 0; k < kKeys; ++k) x[k] = _mm512_maskz_mov_ps(seen[k], exp512(_mm512_sub_ps(x[k], m_new)));
    for (int k = 0; k < kKeys; k += 2)  // lanes x key pairs, as bf16 pairs
      w[k / 2] = _mm512_or_si512(_mm512_cvtepu16_epi32(round_bf16(x[k])),
                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(round_bf16(x[k + 1])), 16));
    for (int span = kKeys / 2; span >= 1; span /= 2)
      for (int k = 0; k < span; ++k) x[k] = _mm512_add_ps(x[k], x[k + span]);
    sums = x[0];
    __m512* wp = reinterpret_cast<__m512*>(w);
    transpose16(wp);  // row r: lane r's 32 keys
    for (int r = 0; r < kLanes; ++r) _mm512_store_si512(ln.pa + 16 * r, _mm512_castps_si512(wp[r]));
  }
  if (!active) return;
  // every lane's rescaling at once: corr = exp(m - new m), 0 before the lane's first key
  const __m512 corr = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_OQ) & active,
                                          exp512(_mm512_sub_ps(m_old, m_new)));
  _mm512_store_ps(ln.l, _mm512_mask_add_ps(_mm512_load_ps(ln.l), active,
                                           _mm512_mul_ps(_mm512_load_ps(ln.l), corr), sums));
  _mm512_store_ps(ln.m, m_new);
  alignas(64) float cs[kLanes];
  _mm512_store_ps(cs, corr);
  LANE_TILE_LOAD(5, ln.pa, 64);
  for (int64_t c = 0; c < D / 16; ++c) {
    LANE_TILE_ZERO(7);
    vnext.ask(kShare);
    LANE_TILE_LOAD(6, vt + c * kTile, 64);
    LANE_TILE_DPBF16PS(7, 5, 6);
    LANE_TILE_STORE(7, o + 16 * c, D * 4);
  }
  vnext.ask(2 * Next::kLines);  // the rest
  for (int64_t r = 0; r < ln.n; ++r) {
    if (!((active >> r) & 1)) continue;
    const __m512 cv = _mm512_set1_ps(cs[r]);
    float* a = ln.acc + r * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_store_ps(a + d, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(a + d), cv), _mm512_load_ps(o + r * D + d)));
  }
}

template <int64_t D, typename Cache>
void attend(const uint16_t* q, const Cache& cache, const int64_t* tables, const int32_t* lens, uint16_t* out,
            int64_t B, int64_t H, int64_t KVH, int64_t MB, float scale, int threads) {
  const int64_t G = H / KVH;
  if (MB > 0) {  // decode rows: one request's G heads a tile, each step's V packed where it is used
    // With requests to spare, an item is a request's KV heads (up to kHeads of them) stepping
    // through the context together: a step reads each block's heads as one contiguous run,
    // which the prefetchers follow. Few requests split by head, to keep both threads busy
    constexpr int64_t kHeads = 4;
    const int64_t HC = B >= 4 * threads ? std::min(KVH, kHeads) : 1, chunks = (KVH + HC - 1) / HC;
    parallel_for(B * chunks, 1, threads, [&](int64_t begin, int64_t end) {
      tile_configure_full();
      Lanes<D> ln[kHeads];
      alignas(64) uint32_t vt[D / 16 * kTile];
      alignas(64) uint32_t kt[Cache::kInPlace ? 1 : 2 * (D / 32) * kTile];  // K blocks dequantized (C8)
      // K's 32-dim chunks and rows: the cache's own rows, or the copy's tiles
      constexpr int64_t kKStep = Cache::kInPlace ? 32 : 2 * kTile, kKStride = Cache::kInPlace ? D * 2 : 64;
      const uint16_t* kb[2];
      for (int64_t k = begin; k < end; ++k) {
        // (zigzag: a batch runs oldest first, its contexts longest first; halves would give one
        // thread the long ones)
        const int64_t item = zigzag(k, B * chunks), b = item / chunks, h0 = item % chunks * HC;
        const int64_t nh = std::min(HC, KVH - h0);
        for (int64_t i = 0; i < nh; ++i) {
          ln[i].n = G;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = (h0 + i) * G + g;
            ln[i].lens[g] = lens[b];
            ln[i].q[g] = q + (b * H + head) * D;
            ln[i].out[g] = out + (b * H + head) * D;
          }
          ln[i].start();
        }
        const int64_t n = ln[0].steps();
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t i = 0; i < nh; ++i) {
            NextV<D, Cache::kElem> vnext;
            step_blocks<D>(cache, tables + b * MB, lens[b], j, h0 + i, KVH, kb, vt, Cache::kInPlace ? nullptr : kt,
                           true, &vnext);
            attend_step<D>(ln[i], kb, kKStep, kKStride, vt, j, scale, vnext);
          }
        }
        for (int64_t i = 0; i < nh; ++i) ln[i].finish();
      }
      tile_release();
    });
    return;
  }
  // rows of one table (MB 0): each step's V packed once for every tile, then 16 / G rows a tile
  const int64_t L = *std::max_element(lens, lens + B), steps = (L + kKeys - 1) / kKeys;
  constexpr int64_t kwords = 2 * (D / 32) * kTile, words = kwords + D / 16 * kTile;
  uint32_t* packed = align64(scratch<uint32_t, 1>(KVH * steps * words + 16));
  const uint16_t** blocks = scratch<const uint16_t*, 2>(KVH * steps * 2);
  parallel_for(KVH * steps, 4, threads, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      step_blocks<D>(cache, tables, L, u % steps, u / steps, KVH, blocks + 2 * u, packed + u * words + kwords,
                     packed + u * words);
  });
  const int64_t R = kLanes / G, groups = (B + R - 1) / R;
  parallel_for(groups * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    tile_configure_full();
    Lanes<D> ln;
    NextV<D, Cache::kElem> none;  // (a chunk's blocks were packed up front)
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = zigzag(k, groups * KVH), b0 = item / KVH * R, h = item % KVH;
      ln.n = std::min(R, B - b0) * G;
      for (int64_t r = 0; r < ln.n; ++r) {
        const int64_t b = b0 + r / G, head = h * G + r % G;
        ln.lens[r] = lens[b];
        ln.q[r] = q + (b * H + head) * D;
        ln.out[r] = out + (b * H + head) * D;
      }
      ln.start();
      for (int64_t j = 0, n = ln.steps(); j < n; ++j) {
        const int64_t u = h * steps + j;
        attend_step<D>(ln, blocks + 2 * u, 2 * kTile, 64, packed + u * words + kwords, j, scale, none);
      }
      ln.finish();
    }
    tile_release();
  });
}

// Whether the tiles take this shape here: head_dim 64 or 128, 16-token blocks, at most 16 query
// heads per KV head, and the CPU's AMX-BF16 (the model's and the machine's, never the batch's)
inline bool tiles_take(int64_t H, int64_t KVH, int64_t D, int64_t BS) {
  return BS == kBS && (D == 64 || D == 128) && H % KVH == 0 && H / KVH <= kLanes && attention_amx_usable();
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
  if (!tiles_take(H, KVH, D, BS)) return false;
  if (B <= 0) return true;
  const auto* qp = static_cast<const uint16_t*>(q);
  const auto* kc = static_cast<const uint16_t*>(k_cache);
  const auto* vc = static_cast<const uint16_t*>(v_cache);
  auto* op = static_cast<uint16_t*>(out);
  if (D == 64) attend<64>(qp, Bf16Cache<64>{kc, vc}, block_tables, context_lens, op, B, H, KVH, MB, scale, threads);
  else attend<128>(qp, Bf16Cache<128>{kc, vc}, block_tables, context_lens, op, B, H, KVH, MB, scale, threads);
  return true;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)context_lens, (void)out, (void)B, (void)H;
  (void)KVH, (void)D, (void)BS, (void)MB, (void)scale, (void)threads;
  return false;
#endif
}

// The same over an 8-bit cache (C8: uint8 [NB, KVH, 16, D], int8 or fp8 e4m3 bytes, with float
// scales [NB, KVH, 16]): the blocks dequantized to bf16 as they are packed into tiles, so a step
// reads half the bytes of a bf16 cache. Same conditions, and q bf16.
extern "C" bool lane_paged_attention_amx_q8(const void* q, const void* k_cache, const void* v_cache,
                                            const float* k_scale, const float* v_scale, int fp8,
                                            const int64_t* block_tables, const int32_t* context_lens, void* out,
                                            int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB,
                                            float scale, int threads) {
#if defined(__AVX512F__)
  if (!tiles_take(H, KVH, D, BS)) return false;
  if (B <= 0) return true;
  const auto* qp = static_cast<const uint16_t*>(q);
  const auto* kc = static_cast<const uint8_t*>(k_cache);
  const auto* vc = static_cast<const uint8_t*>(v_cache);
  auto* op = static_cast<uint16_t*>(out);
  const int64_t* t = block_tables;
  const int32_t* l = context_lens;
  if (D == 64 && fp8) attend<64>(qp, ByteCache<64, true>{kc, vc, k_scale, v_scale}, t, l, op, B, H, KVH, MB, scale, threads);
  else if (D == 64) attend<64>(qp, ByteCache<64, false>{kc, vc, k_scale, v_scale}, t, l, op, B, H, KVH, MB, scale, threads);
  else if (fp8) attend<128>(qp, ByteCache<128, true>{kc, vc, k_scale, v_scale}, t, l, op, B, H, KVH, MB, scale, threads);
  else attend<128>(qp, ByteCache<128, false>{kc, vc, k_scale, v_scale}, t, l, op, B, H, KVH, MB, scale, threads);
  return true;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)k_scale, (void)v_scale, (void)fp8, (void)block_tables;
  (void)context_lens, (void)out, (void)B, (void)H, (void)KVH, (void)D, (void)BS, (void)MB, (void)scale, (void)threads;
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
