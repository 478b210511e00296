// Linear layers on Q4_0 / Q4_1 / Q8_0 weights repacked at load, 8 rows interleaved
// (common.h's "x8" layout), for the decode and verify rows (M <= 64). The GGUF layout's
// kernel (quant_linear.cpp) does a block's float work (fp16 conversions, a scale product, an
// FMA into one row's sum, a horizontal add per row) for every row; here one register holds 8
// rows, so that work is done once per 8 rows, and one broadcast of the activations feeds 8
// rows' products (as llama.cpp's Q4_0_8x8 GEMV does):
//   dot_r = sum_i w_r,i q_x,i (u8 x s8: maddubs + madd, or VNNI's dpbusd. Q4 takes the unsigned
//           nibbles; Q8_0 |w| times q_x with w's sign (maddubs), or q_x + 128 times w less
//           128 sum w (dpbusd))
//   Q4_1: y_r += d_r d_x dot_r + m_r s_x     Q4_0: y_r += d_r d_x (dot_r - 8 sum q_x)
//   Q8_0: y_r += d_r d_x dot_r
// Every block's integer dot product is exact (the offsets are taken in int32). With AVX-512
// VNNI two blocks share a 512-bit register (pair_row), which halves each row's instructions.
// The K-quants run there too (only there: lane_x8_supports). Q4_K and Q5_K: each sub-block of
// 32 as a Q4_1 block whose scale d * sc and minimum -dmin * mn (exact in fp32) are made from the
// super-block's fields (Q5_K: with each value's top bit). Q6_K: each 32 values as a Q4 block of
// 6-bit values whose two halves (its sub-blocks of 16) are summed apart, less 32 times the
// activations' half sums, each times its own d * sc.
#include "common.h"

#include <atomic>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "amx.h"

namespace {

using namespace lane;

constexpr int kBlock = 32;

// Decode streams the weights from DRAM once a step, and at 2+ rows a block's arithmetic is long
// enough that the out-of-order window no longer keeps enough of the stream in flight: asking
// for the bytes 4 KiB ahead made M = 1..4 steps 1.3x faster on Sapphire Rapids (the kernels'
// own reads follow in order, so the hardware prefetcher alone lags).
constexpr int64_t kPrefetchAhead = 4096;
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + kPrefetchAhead + i);
}

inline int64_t group_block_bytes(int qtype) { return kX8Rows * ggml_block_bytes(qtype); }

constexpr int64_t kRowBlock = 128;  // input rows whose 8-bit blocks stay in L2 (prefill: lane_quant_x8_linear)

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
// 8 outputs rounded to y's dtype as from_f rounds them, in registers: 8 scalar conversions a
// row and group were a third of a row's work on 576-wide layers
inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
inline void store8(f16* y, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// AVX512-BF16's conversion where the CPU has it (common.h): one instruction for the ten below.
// The pair kernel and the tiles both store through it, so a row's output stays the same
// whichever computed it. On Sapphire Rapids: decode steps of 1 and 32 rows 5-8 % faster, a
// 256-token prefill 5 %.
inline void store8(bf16* y, __m256 v) {  // nearest even; a NaN keeps its top bits, made quiet
#if defined(__AVX512F__)
  if (use_avx512bf16()) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), round_bf16(v));
    return;
  }
#endif
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_castsi256_si128(p));
}

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

// AVX-512 VNNI: two blocks in one 512-bit register, so each row's dot products, conversion
// and FMAs are half as many instructions as one block in 256 bits (zmm dpbusd issues as often
// as ymm here). Lane 2r holds row r's block b, lane 2r + 1 its block b + 1: a 64-bit broadcast
// of the activations' paired chunks (pair_rows) feeds all 16 lanes, and the two halves of a
// row's sum meet once, at the end. An odd last block pairs with zeros.
#define LANE_X8_VNNI __attribute__((target("avx512f,avx512vl,avx512vnni,avx512bw,avx512dq")))
// the pieces of the pair kernel's loop, inlined or refused at compile time: a call per row
// passes the unpacked weights through the stack (2.5x slower)
#define LANE_X8_VNNI_INLINE LANE_X8_VNNI __attribute__((always_inline)) inline

// Activations for the pair kernel, per input row and block pair p (blocks 2p, 2p + 1):
// xp 64 bytes (chunk c of both blocks: 4 + 4 bytes, c = 0..7; Q8_0's offset by +128 to u8),
// dp / sp / ip two floats or ints each (d_x, s_x and Q4_0's 8 * sum q_x of the two blocks).
struct Pairs {
  uint8_t* xp;
  float *dp, *sp;
  int32_t* ip;
  int64_t np;
};

// (Q6_K: ip holds four ints a pair: 32 * the sums of q_x over the first halves of its two
// blocks, then over the second halves)
inline int64_t ip_width(int qtype) { return qtype == kQ6_K ? 4 : 2; }

inline Pairs pair_rows(int qtype, const int8_t* qx, const float* dx, const float* sx, const int32_t* isum, int64_t M,
                       int64_t K) {
  const int64_t nb = K / kBlock, np = (nb + 1) / 2, iw = ip_width(qtype);
  Pairs p{scratch<uint8_t, 1>(M * np * 64), scratch<float, 5>(4 * M * np), nullptr, scratch<int32_t, 1>(iw * M * np),
          np};
  p.sp = p.dp + 2 * M * np;
  const uint32_t flip = qtype == kQ8_0 ? 0x80808080u : 0u;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < np; ++j) {
      const int64_t o = m * np + j;
      for (int h = 0; h < 2; ++h) {
        const int64_t b = 2 * j + h;
        const bool real = b < nb;
        for (int c = 0; c < 8; ++c) {  // 4 bytes at a time: byte stores would stall the kernel's loads
          uint32_t v = 0;
          if (real) std::memcpy(&v, qx + m * K + b * kBlock + 4 * c, 4);
          v = real ? v ^ flip : 0u;
          std::memcpy(p.xp + o * 64 + 8 * c + 4 * h, &v, 4);
        }
        p.dp[2 * o + h] = real ? dx[m * nb + b] : 0.f;
        p.sp[2 * o + h] = real ? sx[m * nb + b] : 0.f;
        if (qtype == kQ6_K) {
          int32_t first = 0;
          for (int i = 0; i < 16 && real; ++i) first += qx[m * K + b * kBlock + i];
          p.ip[4 * o + h] = real ? 32 * first : 0;
          p.ip[4 * o + 2 + h] = real ? 32 * (isum[m * nb + b] - first) : 0;
        } else {
          p.ip[2 * o + h] = real ? 8 * isum[m * nb + b] : 0;
        }
      }
    }
  return p;
}

// Two blocks of 8 weight rows, lanes interleaved: w[c] (Q4: lo[0..3], hi[0..3]; Q8_0: the 8
// signed chunks), scales d, Q4_1's minimums m, Q8_0's 128 * sum(w) per lane (the offset)
template <int Q>
struct PairW {
  __m512i w[8], off;
  __m512 d, m;
};

LANE_X8_VNNI_INLINE __m512i interleave(const uint8_t* a, const uint8_t* b) {  // lanes a0 b0 a1 b1 ...
  const __m512i idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i hi = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)) : _mm256_setzero_si256();
  return _mm512_permutex2var_epi32(_mm512_castsi256_si512(lo), idx, _mm512_castsi256_si512(hi));
}

LANE_X8_VNNI_INLINE __m512 halves(const uint8_t* a, const uint8_t* b) {  // 8 fp16 of each, interleaved
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i y = b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)) : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_unpackhi_epi16(x, y), _mm_unpacklo_epi16(x, y)));
}

template <int Q>
LANE_X8_VNNI_INLINE PairW<Q> pair_load(const uint8_t* o0, const uint8_t* o1) {  // o1 null: no second block
  PairW<Q> p;
  const int64_t qo = x8_quant_offset(Q);
  p.d = halves(o0, o1);
  if (Q == kQ4_1) p.m = halves(o0 + 16, o1 ? o1 + 16 : nullptr);
  if (Q == kQ8_0) {
    __m512i s = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      p.w[c] = interleave(o0 + qo + 32 * c, o1 ? o1 + qo + 32 * c : nullptr);
      s = _mm512_dpbusd_epi32(s, _mm512_set1_epi8(1), p.w[c]);
    }
    p.off = _mm512_slli_epi32(s, 7);
  } else {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = interleave(o0 + qo + 32 * c, o1 ? o1 + qo + 32 * c : nullptr);
      p.w[c] = _mm512_and_si512(raw, mask);
      p.w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
    }
  }
  return p;
}

// The 8 rows' fp16 fields at p as floats, each twice: lanes 2r and 2r + 1 row r's
LANE_X8_VNNI_INLINE __m512 row_halves(const uint8_t* p) {
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm512_permutexvar_ps(
      dup, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}

// Q4_K: sub-blocks 2p and 2p + 1 of a group's super-block s (common.h's layout), lane 2r + h
// row r's sub-block 2p + h
LANE_X8_VNNI_INLINE PairW<kQ4_K> q4k_pair_load(const uint8_t* s, int p) {
  PairW<kQ4_K> w;
  const uint8_t* q = s + 128 + 256 * p;
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = interleave(q + 32 * c, q + 128 + 32 * c);
    w.w[c] = _mm512_and_si512(raw, mask);
    w.w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
  }
  const __m512 d = row_halves(s), dmin = row_halves(s + 16);
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32 + 16 * p)));
  const __m128i hb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 96 + 8 * p));
  const __m512i hi = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(hb, hb)),
                                       _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4));
  const __m512i m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
  const __m512i sc = _mm512_or_si512(_mm512_and_si512(lo, m15), _mm512_slli_epi32(_mm512_and_si512(hi, m3), 4));
  const __m512i mn = _mm512_or_si512(_mm512_srli_epi32(lo, 4),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, 2), m3), 4));
  w.d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
  w.m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
  return w;
}

// Q5_K: as Q4_K, with each value's top bit (common.h's layout)
LANE_X8_VNNI_INLINE PairW<kQ5_K> q5k_pair_load(const uint8_t* s, int p) {
  const PairW<kQ4_K> q4 = q4k_pair_load(s, p);
  PairW<kQ5_K> w;
  w.d = q4.d, w.m = q4.m;
  const __m512i top = interleave(s + 1152 + 64 * p, s + 1152 + 64 * p + 32), one = _mm512_set1_epi8(1);
  for (int c = 0; c < 4; ++c) {
    w.w[c] = _mm512_or_si512(q4.w[c], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, c), one), 4));
    w.w[4 + c] =
        _mm512_or_si512(q4.w[4 + c], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 4 + c), one), 4));
  }
  return w;
}

// Q6_K: blocks 2p and 2p + 1 of a group's super-block s (common.h's layout): w[c] the 6-bit
// values 4c.. (first halves), w[4 + c] 16 + 4c.. (second halves); d and m the halves' d * sc
LANE_X8_VNNI_INLINE PairW<kQ6_K> q6k_pair_load(const uint8_t* s, int p) {
  PairW<kQ6_K> w;
  const uint8_t* lo = s + 144 + 256 * p;
  const uint8_t* hi = s + 1168 + 128 * p;
  const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = interleave(lo + 32 * c, lo + 128 + 32 * c);
    __m512i top = interleave(hi + 32 * (c & 1), hi + 64 + 32 * (c & 1));
    if (c >= 2) top = _mm512_srli_epi16(top, 4);
    w.w[c] = _mm512_or_si512(_mm512_and_si512(raw, m4), _mm512_slli_epi16(_mm512_and_si512(top, m2), 4));
    w.w[4 + c] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), m4),
                                 _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 2), m2), 4));
  }
  const __m512 d = row_halves(s);
  const uint8_t* sc = s + 16 + 32 * p;
  w.d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
  w.m = _mm512_mul_ps(
      d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)))));
  return w;
}

// Pair j (blocks 2j, 2j + 1) of a group's nb blocks at gp, unpacked: the K-quants' pairs are
// quarters of a super-block, the 32-blocks' whole blocks (an odd last one pairs with zeros)
template <int Q>
LANE_X8_VNNI_INLINE PairW<Q> pair_at(const uint8_t* gp, int64_t j, int64_t nb) {
  const int64_t gb = group_block_bytes(Q);
  if constexpr (Q == kQ4_K) return q4k_pair_load(gp + (j >> 2) * gb, static_cast<int>(j & 3));
  else if constexpr (Q == kQ5_K) return q5k_pair_load(gp + (j >> 2) * gb, static_cast<int>(j & 3));
  else if constexpr (Q == kQ6_K) return q6k_pair_load(gp + (j >> 2) * gb, static_cast<int>(j & 3));
  else return pair_load<Q>(gp + 2 * j * gb, 2 * j + 1 < nb ? gp + (2 * j + 1) * gb : nullptr);
}

LANE_X8_VNNI_INLINE __m512i bcast8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}
LANE_X8_VNNI_INLINE __m512 bcast2f(const float* p) {
  double v;
  std::memcpy(&v, p, 8);
  return _mm512_castpd_ps(_mm512_set1_pd(v));
}

// One row's two blocks: each lane's int32 dot product (exact)
template <int Q>
LANE_X8_VNNI_INLINE __m512i pair_int_dots(const PairW<Q>& w, const uint8_t* xp, const int32_t* ip) {
  __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();  // two chains: dpbusd's latency
  if (Q == kQ8_0) {  // (q_x + 128) * w, less 128 * sum(w)
    for (int c = 0; c < 8; c += 2) {
      s = _mm512_dpbusd_epi32(s, bcast8(xp + 8 * c), w.w[c]);
      t = _mm512_dpbusd_epi32(t, bcast8(xp + 8 * c + 8), w.w[c + 1]);
    }
    s = _mm512_sub_epi32(s, w.off);
  } else {  // unsigned nibbles * q_x: chunk c's low nibbles are values 4c.., its high ones 16 + 4c..
    for (int c = 0; c < 4; ++c) {
      s = _mm512_dpbusd_epi32(s, w.w[c], bcast8(xp + 8 * c));
      t = _mm512_dpbusd_epi32(t, w.w[4 + c], bcast8(xp + 32 + 8 * c));
    }
    if (Q == kQ4_0) s = _mm512_sub_epi32(s, bcast8(reinterpret_cast<const uint8_t*>(ip)));
  }
  return _mm512_add_epi32(s, t);
}

// ... scaled into acc
template <int Q>
LANE_X8_VNNI_INLINE __m512 pair_row(const PairW<Q>& w, const uint8_t* xp, const float* dp, const float* sp,
                                    const int32_t* ip, __m512 acc) {
  if (Q == kQ6_K) {  // the halves apart: each (u - 32) * q_x summed exactly, then its own scale
    __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      s = _mm512_dpbusd_epi32(s, w.w[c], bcast8(xp + 8 * c));
      t = _mm512_dpbusd_epi32(t, w.w[4 + c], bcast8(xp + 32 + 8 * c));
    }
    s = _mm512_sub_epi32(s, bcast8(reinterpret_cast<const uint8_t*>(ip)));
    t = _mm512_sub_epi32(t, bcast8(reinterpret_cast<const uint8_t*>(ip + 2)));
    const __m512 dx = bcast2f(dp);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(w.d, dx), _mm512_cvtepi32_ps(s), acc);
    return _mm512_fmadd_ps(_mm512_mul_ps(w.m, dx), _mm512_cvtepi32_ps(t), acc);
  }
  acc = _mm512_fmadd_ps(_mm512_mul_ps(w.d, bcast2f(dp)), _mm512_cvtepi32_ps(pair_int_dots<Q>(w, xp, ip)), acc);
  if (Q == kQ4_1 || Q == kQ4_K || Q == kQ5_K) acc = _mm512_fmadd_ps(w.m, bcast2f(sp), acc);
  return acc;
}

// The int32 dot products of one row's two blocks (for lane_quant_x8_block_dots)
template <int Q>
LANE_X8_VNNI void pair_dots(const uint8_t* o0, const uint8_t* o1, const uint8_t* xp, const int32_t* ip,
                            int32_t* out) {
  _mm512_storeu_si512(out, pair_int_dots<Q>(pair_load<Q>(o0, o1), xp, ip));
}

// Input rows a pass takes: their 16 accumulators and the pair's 10 weight registers fit the 32
// zmm registers, and a second pass repeats the weights' unpacking, a fifth of a pass's work
constexpr int64_t kPairRows = 16;

// How a pass gets a group's unpacked weights: unpacks them (and keeps them in the tile where
// one is given: the first of several passes), or reads the tile (the later ones). Separate
// code, so the registers of the one never pass through the stack for the other.
enum TileMode { kUnpack, kRead };

// One group of 8 weight rows against R input rows
template <int Q, int R, int Mode, typename T>
LANE_X8_VNNI inline void pair_group_rows(const uint8_t* gp, int64_t nb, const Pairs& x, int64_t m0,
                                         const float* bias, T* y, int64_t N, int64_t n0, PairW<Q>* tile) {
  const int64_t gb = group_block_bytes(Q);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < x.np; ++j) {
    // a pair's bytes (a K-quant's: a quarter of its super-block's), ahead: every pass, so that
    // the stream does not pause while a later pass runs
    if constexpr (Q == kQ4_K || Q == kQ5_K || Q == kQ6_K) prefetch_ahead(gp + j * (gb / 4), gb / 4);
    else prefetch_ahead(gp + 2 * j * gb, 2 * gb);
    // (no lambda here: it would not carry the target attribute, and pair_row would not inline)
    PairW<Q> unpacked;
    const PairW<Q>* w = &unpacked;
    if constexpr (Mode == kRead) {
      w = &tile[j];
    } else {
      unpacked = pair_at<Q>(gp, j, nb);
      if (tile) tile[j] = unpacked;
    }
    for (int r = 0; r < R; ++r) {
      const int64_t o = (m0 + r) * x.np + j;
      acc[r] = pair_row<Q>(*w, x.xp + 64 * o, x.dp + 2 * o, x.sp + 2 * o, x.ip + ip_width(Q) * o, acc[r]);
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  for (int r = 0; r < R; ++r) {
    const __m512 v = _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], 0xb1));  // lane 2i: row i's two halves
    __m256 out8 = _mm512_castps512_ps256(_mm512_permutexvar_ps(even, v));
    if (bias) out8 = _mm256_add_ps(out8, _mm256_loadu_ps(bias + n0));
    store8(y + (m0 + r) * N + n0, out8);
  }
}

template <int Q, typename T>
LANE_X8_VNNI void pair_groups(const uint8_t* wp, const Pairs& x, const float* bias, T* y, int64_t M, int64_t N,
                              int64_t K, int64_t g0, int64_t g1) {
  // rows in balanced passes of at most kPairRows (M = 20: 10 + 10); a group's weights are
  // unpacked once, so a second pass costs its rows and some loads from L1, not a second
  // unpacking (the cause of a 1.3x step from M = 8 to 9 when passes took 8 rows)
  const int64_t nb = K / x8_values(Q), passes = (M + kPairRows - 1) / kPairRows;
  PairW<Q>* tile = passes > 1 ? scratch<PairW<Q>, 0>(x.np) : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = wp + g * nb * group_block_bytes(Q);
    for (int64_t p = 0, m = 0; p < passes; ++p) {
      const int64_t r = M / passes + (p < M % passes);
      switch (r) {
#define LANE_X8_CASE(R) \
  case R:                                                                                          \
    if (p == 0) pair_group_rows<Q, R, kUnpack, T>(gp, nb, x, m, bias, y, N, g * kX8Rows, tile);     \
    else pair_group_rows<Q, R, kRead, T>(gp, nb, x, m, bias, y, N, g * kX8Rows, tile);               \
    break;
        LANE_X8_CASE(1) LANE_X8_CASE(2) LANE_X8_CASE(3) LANE_X8_CASE(4)
        LANE_X8_CASE(5) LANE_X8_CASE(6) LANE_X8_CASE(7) LANE_X8_CASE(8)
        LANE_X8_CASE(9) LANE_X8_CASE(10) LANE_X8_CASE(11) LANE_X8_CASE(12)
        LANE_X8_CASE(13) LANE_X8_CASE(14) LANE_X8_CASE(15) LANE_X8_CASE(16)
#undef LANE_X8_CASE
      }
      m += r;
    }
  }
}

template <typename T>
LANE_X8_VNNI void groups_vnni(const uint8_t* wp, int qtype, const Pairs& x, const float* bias, T* y, int64_t M,
                              int64_t N, int64_t K, int64_t g0, int64_t g1) {
  switch (qtype) {
    case kQ4_0: pair_groups<kQ4_0, T>(wp, x, bias, y, M, N, K, g0, g1); break;
    case kQ4_1: pair_groups<kQ4_1, T>(wp, x, bias, y, M, N, K, g0, g1); break;
    case kQ4_K: pair_groups<kQ4_K, T>(wp, x, bias, y, M, N, K, g0, g1); break;
    case kQ5_K: pair_groups<kQ5_K, T>(wp, x, bias, y, M, N, K, g0, g1); break;
    case kQ6_K: pair_groups<kQ6_K, T>(wp, x, bias, y, M, N, K, g0, g1); break;
    default: pair_groups<kQ8_0, T>(wp, x, bias, y, M, N, K, g0, g1);
  }
}

// One group of 8 weight rows against R input rows: y[r * N + n0 .. n0 + 8). The kind (Q) is a
// template argument, so the inner loops carry no branch on it.
// A block of 8 weight rows unpacked: the quants as F keeps them, the scales and minimums
template <class F>
struct BlockW {
  typename F::W w;
  __m256 d, m;
};

// (the tile as in pair_group_rows)
template <int Q, int R, class F, typename T>
__attribute__((always_inline)) inline void group_rows(const uint8_t* gp, int64_t nb, const int8_t* qx,
                                                      const float* dx, const float* sx, const int32_t* isum,
                                                      int64_t K, const float* bias, T* y, int64_t N, int64_t n0,
                                                      BlockW<F>* tile, bool fill) {
  const int64_t gb = group_block_bytes(Q), qo = x8_quant_offset(Q);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    BlockW<F> u;
    const uint8_t* o = gp + b * gb;
    prefetch_ahead(o, gb);
    if (fill) {
      u.w = F::load(o + qo);
      u.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
      if (Q == kQ4_1) u.m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
      if (tile) tile[b] = u;
    } else {
      u = tile[b];
    }
    const typename F::W& w = u.w;
    const __m256 d = u.d;
    for (int r = 0; r < R; ++r) {
      __m256i i = F::dots(w, qx + r * K + b * kBlock);
      if (Q == kQ4_0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(8 * isum[r * nb + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), _mm256_cvtepi32_ps(i), acc[r]);
    }
    if (Q == kQ4_1)
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(u.m, _mm256_set1_ps(sx[r * nb + b]), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    if (bias) acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(bias + n0));
    store8(y + r * N + n0, acc[r]);
  }
}

template <int Q, class F, typename T>
__attribute__((always_inline)) inline void groups(const uint8_t* wp, const int8_t* qx, const float* dx,
                                                  const float* sx, const int32_t* isum, const float* bias, T* y,
                                                  int64_t M, int64_t N, int64_t K, int64_t g0, int64_t g1) {
  const int64_t nb = K / kBlock, passes = (M + 7) / 8;  // balanced passes of at most 8 rows
  BlockW<F>* tile = passes > 1 ? scratch<BlockW<F>, 0>(nb) : nullptr;
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
  case R: group_rows<Q, R, F, T>(gp, nb, q, d, s, is, K, bias, yr, N, n0, tile, p == 0); break;
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

#undef LANE_X8_GROUPS

#if defined(__AVX512F__)
#include "quant_x8_amx.inc"
#endif

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

// Whether the x8 layout and kernel serve qtype here (out[0] 1 or 0): Q4_0 / Q4_1 / Q8_0 on every
// CPU, the K-quants where the VNNI pair kernel runs (elsewhere kquant.cpp's kernel keeps them,
// for every M)
extern "C" void lane_x8_supports(int qtype, int32_t* out) {
  out[0] = qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || (qtype >= kQ4_K && qtype <= kQ6_K && use_vnni());
}

// GGUF rows [N, K / x8_values blocks] of a kind lane_x8_supports -> the x8 layout (N a multiple
// of 8), same size
extern "C" void lane_repack_x8(const uint8_t* src, int qtype, uint8_t* dst, int64_t N, int64_t K) {
  const int64_t nb = K / x8_values(qtype), bb = ggml_block_bytes(qtype), gb = group_block_bytes(qtype);
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
  std::vector<int32_t> isum(M * nb);
  for (int64_t i = 0; i < M * nb; ++i)
    for (int j = 0; j < kBlock; ++j) isum[i] += qx[i * kBlock + j];
#if defined(__AVX2__)
  if (use_vnni()) {
    std::vector<float> unused(M * nb);
    const Pairs p = pair_rows(qtype, qx, unused.data(), unused.data(), isum.data(), M, K);
    for (int64_t g = 0; g < N / kX8Rows; ++g)
      for (int64_t j = 0; j < p.np; ++j)
        for (int64_t m = 0; m < M; ++m) {
          const uint8_t* o0 = w + (g * nb + 2 * j) * gb;
          const uint8_t* o1 = 2 * j + 1 < nb ? o0 + gb : nullptr;
          const int64_t o = m * p.np + j;
          int32_t d[2 * kX8Rows];
          if (qtype == kQ8_0) pair_dots<kQ8_0>(o0, o1, p.xp + 64 * o, p.ip + 2 * o, d);
          else if (qtype == kQ4_0) pair_dots<kQ4_0>(o0, o1, p.xp + 64 * o, p.ip + 2 * o, d);
          else pair_dots<kQ4_1>(o0, o1, p.xp + 64 * o, p.ip + 2 * o, d);
          for (int r = 0; r < kX8Rows; ++r)
            for (int h = 0; h < 2 && 2 * j + h < nb; ++h) dots[(m * N + g * kX8Rows + r) * nb + 2 * j + h] = d[2 * r + h];
        }
    return;
  }
#endif
  for (int64_t g = 0; g < N / kX8Rows; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* o = w + (g * nb + b) * gb + qo;
        const int8_t* xq = qx + m * K + b * kBlock;
        alignas(32) int32_t d[kX8Rows];
#if defined(__AVX2__)
        const __m256i v = qtype == kQ8_0 ? Q8::dots(Q8::load(o), xq) : Q4::dots(Q4::load(o), xq);
        _mm256_store_si256(reinterpret_cast<__m256i*>(d), v);
#else
        dots_scalar(o, qtype, xq, d);
#endif
        for (int r = 0; r < kX8Rows; ++r)
          dots[(m * N + g * kX8Rows + r) * nb + b] = d[r] - (qtype == kQ4_0 ? 8 * isum[m * nb + b] : 0);
      }
}

// Whether the x8 kernels take AMX tiles here (out[0]), and from how many rows (out[1]); with
// on >= 0, set that first (on 0: never; min_rows > 0: the new threshold). For the tests and
// benchmarks, which run the same rows through both kernels.
extern "C" void lane_x8_amx(int on, int64_t min_rows, int64_t* out) {
#if defined(__AVX512F__)
  if (on >= 0) amx_enabled.store(on, std::memory_order_relaxed);
  if (min_rows > 0) amx_min_rows = min_rows;
  out[0] = amx_usable(), out[1] = amx_min_rows;
#else
  (void)on, (void)min_rows;
  out[0] = 0, out[1] = 0;
#endif
}

extern "C" bool lane_x8_bf16_amx_linear(const void*, const uint8_t*, int, const float*, void*, int64_t, int64_t,
                                        int64_t, int);

// y [M, N] (y_dtype) = x [M, K] (x_dtype) . W^T, W in the x8 layout (+ bias fp32), on the integer
// kernels: x is quantized to 8-bit blocks once per call
extern "C" void lane_quant_x8_linear_int8(const void* x, int x_dtype, const uint8_t* w, int qtype, const float* bias,
                                          void* y, int y_dtype, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t nb = K / kBlock;
  int8_t* qx = scratch<int8_t, 2>(M * K);
  float* dx = scratch<float, 4>(2 * M * nb);
  float* sx = dx + M * nb;
  int32_t* isum = scratch<int32_t, 0>(M * nb);
  quantize_rows_q8(x, x_dtype, qx, dx, sx, isum, M, K, threads);
#if defined(__AVX512F__)
  // AMX tiles from amx_min_rows rows (bit for bit the pair kernel's rows, so the switch keeps
  // batch invariance): threads take units of 16 columns
  const bool amx = M >= amx_min_rows && qtype != kQ6_K && amx_usable();
  const AmxActs acts = amx ? amx_acts(qx, dx, sx, isum, M, K, threads) : AmxActs{};
#else
  constexpr bool amx = false;
#endif
#if defined(__AVX2__)
  const Pairs pairs = use_vnni() && !amx ? pair_rows(qtype, qx, dx, sx, isum, M, K) : Pairs{};
#endif
  // the pair kernels write fp32 (one instantiation per kind and row count, not three: the
  // build's longest unit), rounded to y's dtype per thread while its columns are in cache; the
  // tiles write y's dtype
  float* yf = y_dtype == kF32 || amx ? static_cast<float*>(y) : scratch<float, 8>(M * N);
  const int64_t groups = N / kX8Rows;
  parallel_for(amx ? (groups + 1) / 2 : groups, amx ? 2 : 4, threads, [&](int64_t g0, int64_t g1) {
#if defined(__AVX512F__)
    if (amx) return amx_units_of(qtype, w, acts, bias, y, y_dtype, M, N, K, g0, g1);  // (units of 2 groups)
#endif
    // rows in blocks of kRowBlock, each against all the thread's weight groups: a block's
    // activations stay in L2 while the weights stream past (a prefill's whole M would be
    // re-read from L3 for every group). A row's arithmetic does not depend on its block.
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t Mb = M - mb < kRowBlock ? M - mb : kRowBlock;
      float* yb = yf + mb * N;
#if defined(__AVX2__)
      if (use_vnni()) {
        const int64_t iw = ip_width(qtype);
        const Pairs sub{pairs.xp + 64 * mb * pairs.np, pairs.dp + 2 * mb * pairs.np, pairs.sp + 2 * mb * pairs.np,
                        pairs.ip + iw * mb * pairs.np, pairs.np};
        groups_vnni<float>(w, qtype, sub, bias, yb, Mb, N, K, g0, g1);
      } else {
        groups_avx2<float>(w, qtype, qx + mb * K, dx + mb * nb, sx + mb * nb, isum + mb * nb, bias, yb, Mb, N, K,
                           g0, g1);
      }
#else
      groups_scalar<float>(w, qtype, qx + mb * K, dx + mb * nb, sx + mb * nb, isum + mb * nb, bias, yb, Mb, N, K,
                           g0, g1);
#endif
    }
    if (y_dtype != kF32)
      LANE_DISPATCH(y_dtype, T, {
        T* yp = static_cast<T*>(y);
        for (int64_t m = 0; m < M; ++m) {
          int64_t n = g0 * kX8Rows;
#if defined(__AVX2__)
          for (; n + 8 <= g1 * kX8Rows; n += 8) store8(yp + m * N + n, _mm256_loadu_ps(yf + m * N + n));
#endif
          for (; n < g1 * kX8Rows; ++n) yp[m * N + n] = from_f<T>(yf[m * N + n]);
        }
      });
  });
}

// As lane_quant_x8_linear_int8, but bf16 rows on Q4_0 / Q4_1 where the CPU has AMX-BF16 take
// bf16_amx.cpp's dequantizing tiles instead, for every M (a layer that mostly sees one or two
// rows, an MoE expert's, keeps the integer kernels: the caller's choice, per layer)
extern "C" void lane_quant_x8_linear(const void* x, int x_dtype, const uint8_t* w, int qtype, const float* bias,
                                     void* y, int y_dtype, int64_t M, int64_t N, int64_t K, int threads) {
  if (x_dtype == kBF16 && y_dtype == kBF16 && lane_x8_bf16_amx_linear(x, w, qtype, bias, y, M, N, K, threads)) return;
  lane_quant_x8_linear_int8(x, x_dtype, w, qtype, bias, y, y_dtype, M, N, K, threads);
}
