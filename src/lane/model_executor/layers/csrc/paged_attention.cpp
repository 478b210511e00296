// Paged decode attention on the CPU: one query token per request, K/V read in
// place from the block-paged cache (no gather copy), fp32 accumulation.
// Work is split over (request, kv head) pairs; each pair serves its GQA group.
#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

extern "C" bool lane_paged_attention_amx(const void*, const void*, const void*, const int64_t*, const int32_t*, void*,
                                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);
extern "C" bool lane_paged_attention_amx_q8(const void*, const void*, const void*, const float*, const float*, int,
                                            const int64_t*, const int32_t*, void*, int64_t, int64_t, int64_t, int64_t,
                                            int64_t, int64_t, float, int);

namespace {

using namespace lane;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = to_f(src[d]);
}

constexpr int64_t kMaxD = 1024;  // MLA decode: latent 512 + rope 64
constexpr int64_t kMaxBS = 256;

// Where the kernel reads a cache row from (``off``: the row's element offset in a cache of
// [blocks, KVH, BS, D]), widened to float: a cache in the query's dtype ...
template <typename T>
struct DenseRows {
  const T* k;
  const T* v;
  static constexpr int64_t kElem = sizeof(T);
  inline void k_row(int64_t off, float* dst, int64_t D) const { load_row(k + off, dst, D); }
  inline void v_row(int64_t off, float* dst, int64_t D) const { load_row(v + off, dst, D); }
  inline const char* k_bytes(int64_t off) const { return reinterpret_cast<const char*>(k + off); }
  inline const char* v_bytes(int64_t off) const { return reinterpret_cast<const char*>(v + off); }
};

// ... or an 8-bit cache (C8, --kv-cache-dtype int8 / fp8_e4m3): one byte per value and one
// float scale per (token, KV head), each row dequantized as the kernel reads it, block by
// block, never into a copy of the context. int8 bytes are signed integers. An fp8 e4m3 byte
// moved into an fp16's top bits (sign to bit 15, exponent and mantissa from bit 7) is the
// same number times 2^-8, subnormals included (both exponents' bias and subnormal step
// differ by 8 binades): F16C converts a row in vectors, the 2^8 going into the scale; without
// F16C a 256-entry table.
template <bool FP8>
struct ByteRows {
  const uint8_t* k;
  const uint8_t* v;
  const float* ks;
  const float* vs;
  const float* lut;  // fp8 byte -> float, where the fp16 route is not built
  static constexpr int64_t kElem = 1;
  inline void row(const uint8_t* src, float s, float* dst, int64_t D) const {
    if constexpr (FP8) {
      int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
      const __m256 s8 = _mm256_set1_ps(s * 256.f);
      for (; d + 16 <= D; d += 16) {  // 16 bytes -> 16 fp16 bit patterns -> 16 floats
        const __m256i h = e4m3_as_f16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s8));
        _mm256_storeu_ps(dst + d + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s8));
      }
#endif
      for (; d < D; ++d) dst[d] = lut[src[d]] * s;  // the table: other CPUs, and a row's tail
    } else {
      const int8_t* x = reinterpret_cast<const int8_t*>(src);
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(x[d]) * s;
    }
  }
  inline void k_row(int64_t off, float* dst, int64_t D) const { row(k + off, ks[off / D], dst, D); }
  inline void v_row(int64_t off, float* dst, int64_t D) const { row(v + off, vs[off / D], dst, D); }
  inline const char* k_bytes(int64_t off) const { return reinterpret_cast<const char*>(k + off); }
  inline const char* v_bytes(int64_t off) const { return reinterpret_cast<const char*>(v + off); }
};

// One pass over the request's blocks with a per-block online softmax: K and V
// are each read once, straight from the cache.
// DC: head_dim as a compile-time constant (0 = runtime D) so the inner loops
// unroll into whole vector registers.
template <typename T, int64_t DC, typename Rows>
void decode_kernel(const T* q, const Rows& cache, const int64_t* tables,
                   const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                   int64_t D_, int64_t BS, int64_t MB, float scale, int threads) {
  const int64_t D = DC ? DC : D_;
  const int64_t G = H / KVH;
  const int64_t tok_stride = D;             // next token of one head in a block
  const int64_t blk_stride = KVH * BS * D;  // next block
  parallel_for(B * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), s(G * BS), m(G), l(G);
    alignas(64) float rows[4][kMaxD];
    for (int64_t k = begin; k < end; ++k) {
      const int64_t pair = zigzag(k, B * KVH), b = pair / KVH, h = pair % KVH;
      const int64_t L = lens[b];
      for (int64_t g = 0; g < G; ++g) {
        load_row(q + (b * H + h * G + g) * D, &qf[g * D], D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
        m[g] = -INFINITY;
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t nblocks = (L + BS - 1) / BS;
      for (int64_t j = 0; j < nblocks; ++j) {
        const int64_t base = tables[b * MB + j] * blk_stride + h * BS * D;
        const int64_t n = std::min(BS, L - j * BS);
        if (j + 1 < nblocks) {  // overlap the next block's DRAM reads with this block's math
          const int64_t next = tables[b * MB + j + 1] * blk_stride + h * BS * D;
          const char* kn = cache.k_bytes(next);
          const char* vn = cache.v_bytes(next);
          const int64_t bytes = BS * D * Rows::kElem;
          for (int64_t off = 0; off < bytes; off += 64) {
            __builtin_prefetch(kn + off);
            __builtin_prefetch(vn + off);
          }
        }
        // scores, four tokens at a time: four independent accumulators per head
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
          for (int u = 0; u < 4; ++u) cache.k_row(base + (t + u) * tok_stride, rows[u], D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = &qf[g * D];
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
            for (int64_t d = 0; d < D; ++d) {
              a0 += qg[d] * rows[0][d];
              a1 += qg[d] * rows[1][d];
              a2 += qg[d] * rows[2][d];
              a3 += qg[d] * rows[3][d];
            }
            float* sg = &s[g * BS + t];
            sg[0] = a0; sg[1] = a1; sg[2] = a2; sg[3] = a3;
          }
        }
        for (; t < n; ++t) {
          cache.k_row(base + t * tok_stride, rows[0], D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = &qf[g * D];
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * rows[0][d];
            s[g * BS + t] = dot;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = &s[g * BS];
          float mb = m[g];
#pragma omp simd reduction(max : mb)  // a float max only vectorises as an OpenMP reduction
          for (int64_t t = 0; t < n; ++t) mb = sg[t] > mb ? sg[t] : mb;
          const float c = m[g] == -INFINITY ? 0.f : fast_exp(m[g] - mb);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) { sg[t] = fast_exp(sg[t] - mb); sum += sg[t]; }
          l[g] = l[g] * c + sum;
          m[g] = mb;
          float* a = &acc[g * D];
          for (int64_t d = 0; d < D; ++d) a[d] *= c;
        }
        // acc += p . v, four tokens per pass over the accumulator
        t = 0;
        for (; t + 4 <= n; t += 4) {
          for (int u = 0; u < 4; ++u) cache.v_row(base + (t + u) * tok_stride, rows[u], D);
          for (int64_t g = 0; g < G; ++g) {
            const float* p = &s[g * BS + t];
            float* a = &acc[g * D];
            for (int64_t d = 0; d < D; ++d)
              a[d] += p[0] * rows[0][d] + p[1] * rows[1][d] + p[2] * rows[2][d] + p[3] * rows[3][d];
          }
        }
        for (; t < n; ++t) {
          cache.v_row(base + t * tok_stride, rows[0], D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * BS + t];
            float* a = &acc[g * D];
            for (int64_t d = 0; d < D; ++d) a[d] += p * rows[0][d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = from_f<T>(acc[g * D + d] * inv);
      }
    }
  });
}


#if defined(__AVX512F__)
#include <immintrin.h>
// AVX-512 path for a bf16 cache and head_dim = 16 * DV: K/V rows widen to fp32
// in registers, dot products and p.v run on whole vectors.
inline __m512 load16(const uint16_t* p) { return bf16_to_f(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const bf16* p) { return load16(reinterpret_cast<const uint16_t*>(p)); }
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// v[0..15] -> one vector whose lane t is the sum of v[t]'s 16 lanes (a fixed tree: pairs within
// 128-bit lanes, then across them): ~3 instructions a vector, where a reduce_add is ~8
inline __m512 transpose_sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i]'s 128-bit lane L holds the lane-L sums of v[4i .. 4i + 3]
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
}

// A block's n K or V values into L2 (prefetcht1), for the three-pass kernels: on Zen 4,
// prefetcht0's 64 lines a block wait on the L1's few miss buffers, and a 64-row step's attention
// ran 1.35x longer
template <typename E>
inline void prefetch_block(const E* p, int64_t n) {
  for (int64_t off = 0; off < n; off += 64 / static_cast<int64_t>(sizeof(E)))
    _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T1);
}

// The longest context of the batch, in whole blocks of 16: the stride of the three-pass kernels'
// per-row scores
inline int64_t padded_context(const int32_t* lens, int64_t B) {
  int64_t L = 0;
  for (int64_t b = 0; b < B; ++b) L = std::max<int64_t>(L, lens[b]);
  return (L + 15) / 16 * 16;
}

// The three-pass kernels walk over items, each a group of R rows
// (R > 1: a chunk's, on one table) and one KV head: its first row, rows, head, the longest
// context of its rows and its table
struct Item {
  int64_t b0, rows, h, len;
  const int64_t* table;
};
inline Item item_at(int64_t k, int64_t groups, int64_t KVH, int64_t R, int64_t B, const int32_t* lens,
                    const int64_t* tables, int64_t MB) {
  const int64_t i = zigzag(k, groups * KVH), b0 = i / KVH * R, rows = std::min(R, B - b0);
  int64_t len = 0;
  for (int64_t r = 0; r < rows; ++r) len = std::max<int64_t>(len, lens[b0 + r]);
  return {b0, rows, i % KVH, len, tables + b0 * MB};
}

// A row's softmax over its scores s (len keys, -inf past them, in blocks of 16), the three-pass
// kernels' middle pass: one maximum, then block j's exp(s - max) (0 past len) handed to
// put(j, e), which stores them as its kernel takes them and returns what the sum adds (the
// same values, or their bf16 rounding). Returns 1 / the sum.
template <typename Put>
inline float softmax_blocks(const float* s, int64_t len, const Put& put) {
  constexpr int64_t BS = 16;
  const int64_t nb = (len + BS - 1) / BS;
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < nb; ++j) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j * BS));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t nr = std::min<int64_t>(BS, len - j * BS);
    const __mmask16 valid = static_cast<__mmask16>((1u << nr) - 1u);
    sum = _mm512_add_ps(sum, put(j, _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j * BS), mx)))));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// AVX-512 path for a bf16 or fp32 cache, head_dim = 16 * DV, block size 16: K/V rows widen to
// fp32 once a block for every head and row; a block's 16 scores per head come out of one
// transposed sum. The softmax takes decode_dpbf16's three passes (there: why): on Zen 4, 64 rows
// x 300 keys, 1.5-1.7x the online form's with the blocks in L3 (one thread), 1.37x over a 2 GiB
// pool (38 -> 27.5 ms for 30 layers).
template <typename T, int DV>
void decode_avx512(const T* q_, const T* kc_, const T* vc_, const int64_t* tables, const int32_t* lens, T* out,
                   int64_t B, int64_t H, int64_t KVH, int64_t MB, float scale, int threads) {
  constexpr int64_t D = DV * 16, BS = 16;
  using E = typename std::conditional<std::is_same<T, float>::value, float, uint16_t>::type;
  const E* qp = reinterpret_cast<const E*>(q_);
  const E* kc = reinterpret_cast<const E*>(kc_);
  const E* vc = reinterpret_cast<const E*>(vc_);
  const int64_t G = H / KVH;
  const int64_t blk_stride = KVH * BS * D;
  // Rows that read one table (MB 0: a prefill chunk's rows, each attended as a decode row at
  // its position) go R at a time, sharing each block's widened K and V rows; a row's
  // arithmetic is the same as alone (lanes past its length are masked out of its softmax and
  // sums), so its output is too.
  const int64_t R = MB == 0 ? 4 : 1, groups = (B + R - 1) / R;
  const int64_t Lpad = padded_context(lens, B);
  constexpr int64_t kAhead = 2;  // K blocks asked for ahead (decode_dpbf16's)
  parallel_for(groups * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    __m512* qv = scratch<__m512, 64>(R * G * DV);
    __m512* acc = scratch<__m512, 65>(R * G * DV);
    float* sc = scratch<float, 64>(R * G * (Lpad + 1));  // scores, then probabilities; then 1 / sums
    float* inv = sc + R * G * Lpad;
    alignas(64) float kf[BS * D];  // the block's K rows widened, then its V rows
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t k = begin; k < end; ++k) {
      const Item it = item_at(k, groups, KVH, R, B, lens, tables, MB);
      const int64_t b0 = it.b0, rows = it.rows, h = it.h, Lmax = it.len;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = b0 + r;
        for (int64_t g = 0; g < G; ++g)
          for (int i = 0; i < DV; ++i) {
            qv[(r * G + g) * DV + i] = _mm512_mul_ps(load16(qp + (b * H + h * G + g) * D + 16 * i), vscale);
            acc[(r * G + g) * DV + i] = _mm512_setzero_ps();
          }
      }
      const int64_t* table = it.table;
      const int64_t nblocks = (Lmax + BS - 1) / BS, head = h * BS * D;
      if (k == begin)
        for (int64_t j = 0; j < std::min(nblocks, kAhead); ++j) prefetch_block(kc + table[j] * blk_stride + head, BS * D);
      // 1. the scores (decode_dpbf16's passes, and why), over the block's K rows widened once
      // for every head and row; keys past a row's length are -inf
      for (int64_t j = 0; j < nblocks; ++j) {
        const int64_t base = table[j] * blk_stride + head, n = std::min(BS, Lmax - j * BS);  // the longest row's
        if (j + kAhead < nblocks) prefetch_block(kc + table[j + kAhead] * blk_stride + head, BS * D);
        prefetch_block(vc + base, BS * D);  // for pass 3
        // rows past n are zeros here, never the cache's contents (which may be anything)
        for (int64_t t = 0; t < BS; ++t)
          for (int i = 0; i < DV; ++i)
            _mm512_store_ps(kf + t * D + 16 * i, t < n ? load16(kc + base + t * D + 16 * i) : _mm512_setzero_ps());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t nr = std::min<int64_t>(BS, lens[b0 + r] - j * BS);  // this row's
          if (nr <= 0) continue;
          const __mmask16 valid = static_cast<__mmask16>((1u << nr) - 1u);
          for (int64_t g = 0; g < G; ++g) {
            const __m512* qg = &qv[(r * G + g) * DV];
            __m512 dots[BS];
            for (int64_t t = 0; t < BS; ++t) {
              __m512 a = _mm512_mul_ps(qg[0], _mm512_load_ps(kf + t * D));
              for (int i = 1; i < DV; ++i) a = _mm512_fmadd_ps(qg[i], _mm512_load_ps(kf + t * D + 16 * i), a);
              dots[t] = a;
            }
            _mm512_storeu_ps(sc + (r * G + g) * Lpad + j * BS, _mm512_mask_mov_ps(ninf, valid, transpose_sum16(dots)));
          }
        }
      }
      // 2. per row and head: the probabilities (in place of the scores) and 1 / their sum
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g) {
          float* s = sc + (r * G + g) * Lpad;
          inv[r * G + g] = softmax_blocks(s, lens[b0 + r], [&](int64_t j, __m512 e) {
            _mm512_storeu_ps(s + j * BS, e);
            return e;
          });
        }
      // 3. acc += p . v, head by head with its accumulators in registers (a count of heads known
      // only at run time kept them in memory, a load and a store at every FMA), over the block's
      // V rows widened once for every head and row; each lane's sum runs over t in order
      for (int64_t j = 0; j < nblocks; ++j) {
        const int64_t base = table[j] * blk_stride + head, n = std::min(BS, Lmax - j * BS);
        for (int64_t t = 0; t < n; ++t)
          for (int i = 0; i < DV; ++i) _mm512_store_ps(kf + t * D + 16 * i, load16(vc + base + t * D + 16 * i));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t nr = std::min<int64_t>(BS, lens[b0 + r] - j * BS);
          for (int64_t g = 0; g < G && nr > 0; ++g) {
            const int64_t rg = r * G + g;
            const float* p = sc + rg * Lpad + j * BS;
            __m512 a[DV];
            for (int i = 0; i < DV; ++i) a[i] = acc[rg * DV + i];
            for (int64_t t = 0; t < nr; ++t) {
              const __m512 pt = _mm512_set1_ps(p[t]);
              for (int i = 0; i < DV; ++i) a[i] = _mm512_fmadd_ps(pt, _mm512_load_ps(kf + t * D + 16 * i), a[i]);
            }
            for (int i = 0; i < DV; ++i) acc[rg * DV + i] = a[i];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t rg = r * G + g;
          alignas(64) float tmp[16];
          for (int i = 0; i < DV; ++i) {
            _mm512_store_ps(tmp, _mm512_mul_ps(acc[rg * DV + i], _mm512_set1_ps(inv[rg])));
            for (int e = 0; e < 16; ++e) out[((b0 + r) * H + h * G + g) * D + 16 * i + e] = from_f<T>(tmp[e]);
          }
        }
    }
  });
}

// acc + the products of a and b's bf16 pairs, lane by lane (AVX512-BF16's vdpbf16ps; the build
// targets plain AVX-512, so it is issued through asm, as round_bf16 is)
inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

std::atomic<int> attention_dpbf16_enabled{1};  // off: benchmarks time the fp32 kernel instead

inline bool attention_dpbf16_usable() {
  return use_avx512bf16() && attention_dpbf16_enabled.load(std::memory_order_relaxed);
}

// 32 fp8 e4m3 bytes as their bf16 values, exactly (3 mantissa bits): sign, then exponent + 120 and
// mantissa from bit 4; exponent 0 (m * 2^-9) from a table. A NaN byte (0x7f, 0xff) reads as 480.
inline __m512i e4m3_bf16(const uint8_t* p) {
  alignas(64) static const uint16_t subnormal[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
  __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  r = _mm512_mask_permutexvar_epi16(r, _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78)), mag,
                                    _mm512_load_si512(subnormal));
  return _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
}

// The caches the AVX512-BF16 kernel reads: a block's n values as bf16 (read in place, or widened
// once into buf for all the rows and heads that read it), and whether each (key, KV head) row has
// a scale (C8's fp8: K's multiplies the key's scores, V's its probabilities)
struct Bf16Rows {
  using Elem = uint16_t;
  static constexpr bool kScaled = false;
  static inline const uint16_t* block(const uint16_t* p, int64_t, uint16_t*) { return p; }
};
struct E4m3Rows {
  using Elem = uint8_t;
  static constexpr bool kScaled = true;
  static inline const uint16_t* block(const uint8_t* p, int64_t n, uint16_t* buf) {
    for (int64_t i = 0; i < n; i += 32) _mm512_store_si512(buf + i, e4m3_bf16(p + i));
    return buf;
  }
};

// Keys 4 * qt .. 4 * qt + 3 of a K block against GC heads' queries, each K row loaded once for
// all of them; per head, the first two levels of transpose_sum16's tree over the four dot products
template <int DV, int GC>
__attribute__((always_inline)) inline void quarter_scores(const __m512i* qv, const uint16_t* kb, int qt, __m512* b) {
  constexpr int64_t D = DV * 16, QV = DV / 2;
  __m512 v[GC][4];
  for (int t = 0; t < 4; ++t) {
    __m512i k[QV];
    for (int i = 0; i < QV; ++i) k[i] = _mm512_loadu_si512(kb + (4 * qt + t) * D + 32 * i);
    for (int g = 0; g < GC; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int i = 0; i < QV; ++i) a = dpbf16(a, qv[g * QV + i], k[i]);
      v[g][t] = a;
    }
  }
  for (int g = 0; g < GC; ++g) {
    const __m512d x = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[g][0], v[g][1]), _mm512_unpackhi_ps(v[g][0], v[g][1])));
    const __m512d y = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[g][2], v[g][3]), _mm512_unpackhi_ps(v[g][2], v[g][3])));
    b[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
}

// transpose_sum16's last levels: lane L of the result sums 128-bit lane L % 4 of x (L < 8) or y
inline __m512 lane_pairs(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
}

// A block's 16 scores for GC heads of one row (head_dim 16 * DV), as transpose_sum16 sums them
// (the same additions in the same order), a quarter of the block at a time so that each K row is
// loaded once for all GC heads; keys past valid are -inf. ks: the keys' scales, or null
template <int DV, int GC>
inline void block_scores(const __m512i* qv, const uint16_t* kb, const float* ks, __mmask16 valid, float* sc,
                         int64_t stride) {
  __m512 b0[GC], b1[GC], half[GC];
  quarter_scores<DV, GC>(qv, kb, 0, b0);
  quarter_scores<DV, GC>(qv, kb, 1, b1);
  for (int g = 0; g < GC; ++g) half[g] = lane_pairs(b0[g], b1[g]);
  quarter_scores<DV, GC>(qv, kb, 2, b0);
  quarter_scores<DV, GC>(qv, kb, 3, b1);
  for (int g = 0; g < GC; ++g) {
    __m512 s = lane_pairs(half[g], lane_pairs(b0[g], b1[g]));
    if (ks) s = _mm512_mul_ps(s, _mm512_loadu_ps(ks));
    _mm512_storeu_ps(sc + g * stride, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s));
  }
}

// The first nr keys of a V block times their probabilities (pp: GC heads' bf16 pairs, stride
// apart), into GC heads' sums: a pair of keys' rows interleaved once for all GC heads; a key at or
// past nr is zeros (its probability is 0, and 0 times what the cache holds there may be a NaN)
template <int DV, int GC>
inline void block_pv(__m512* acc, const uint32_t* pp, int64_t stride, const uint16_t* vb, int64_t nr) {
  constexpr int64_t D = DV * 16, QV = DV / 2;
  __m512 a[GC][DV];
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < DV; ++i) a[g][i] = acc[g * DV + i];
  for (int64_t u = 0; u < (nr + 1) / 2; ++u) {
    __m512i w[DV];
    for (int i = 0; i < QV; ++i) {
      const __m512i x = _mm512_loadu_si512(vb + 2 * u * D + 32 * i);
      const __m512i y = 2 * u + 1 < nr ? _mm512_loadu_si512(vb + (2 * u + 1) * D + 32 * i) : _mm512_setzero_si512();
      w[2 * i] = _mm512_unpacklo_epi16(x, y);
      w[2 * i + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < GC; ++g) {
      const __m512i pu = _mm512_set1_epi32(static_cast<int>(pp[g * stride + u]));
      for (int i = 0; i < DV; ++i) a[g][i] = dpbf16(a[g][i], pu, w[i]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < DV; ++i) acc[g * DV + i] = a[g][i];
}

// f(g, n) over a group's G heads in chunks of up to GC, n the chunk's size as a compile-time
// constant (1, 2, 3 or GC), for the kernels whose rows are loaded once for a chunk of heads
template <int GC, typename F>
inline void head_chunks(int64_t G, const F& f) {
  for (int64_t g = 0; g < G; g += GC) switch (std::min<int64_t>(GC, G - g)) {
      case 1: f(g, std::integral_constant<int, 1>{}); break;
      case 2: f(g, std::integral_constant<int, 2>{}); break;
      case 3: f(g, std::integral_constant<int, 3>{}); break;
      default: f(g, std::integral_constant<int, GC>{});
    }
}

// block_pv's sums back in dim order (unpacklo's lanes 4L + j hold dims 8L + j, unpackhi's
// 8L + 4 + j): a head's dims 32i .. 32i + 31 from its sums lo = acc[2i], hi = acc[2i + 1], times il
inline void dims_in_order(__m512 lo, __m512 hi, __m512 il, __m512& first16, __m512& second16) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  first16 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), il);
  second16 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), il);
}

// The AVX512-BF16 path for a bf16 cache, head_dim = 16 * DV (CPUs with AVX512-BF16 where the AMX
// tiles do not run: Zen 4, Cooper Lake, or LANE_CPU_AMX=0). The fp32 kernel above widens every K
// and V value and spends ~90 instructions per key and KV head (compute-bound at ~11 GB/s a core
// on Zen 4); here K is multiplied in place by vdpbf16ps, two dims a lane, against the query
// rounded to bf16, and V by pairs of keys: two keys' rows interleaved (unpacklo / unpackhi) times
// their two probabilities rounded to bf16, as the AMX tiles take them. A lane of the PV sums then
// holds dim 8L + j (unpacklo) or 8L + 4 + j (unpackhi) of 128-bit lane L, put back in order once
// at the end. Rows that read one table (a chunk's) go R at a time, sharing the walk over its
// blocks; a row's keys and pairs are the same whichever rows it came with, so its output is too.
//
// The softmax takes three passes over a row's keys, not one online pass: every score (K's
// blocks), then one maximum and the probabilities, then V's blocks. The online form's per-block
// chain (a maximum across lanes, a scalar compare, exp, the rescale of the sums) left the core
// waiting on latency; here each pass is a stream of independent work, and the scores (4 bytes a
// key and head, against 256 of K and V) stay in L2. Each K or V row is loaded once for up to GC
// heads of its group (block_scores, block_pv). On Zen 4, with the blocks in L2, a head's block of
// 16 keys took ~360 cycles in the online form and takes ~140.
//
// C8's fp8 cache (E4m3Rows) takes the same passes: each block's bytes widen to their bf16 values
// exactly, once for every row and head that reads them, the key's K scale multiplies its scores
// and its V scale its probability before that is rounded to bf16 (ksc, vsc: [blocks, KVH, 16]
// floats; null for a bf16 cache).
template <int DV, class C>
void decode_dpbf16(const uint16_t* qp, const typename C::Elem* kc, const typename C::Elem* vc, const float* ksc,
                   const float* vsc, const int64_t* tables, const int32_t* lens, bf16* out, int64_t B, int64_t H,
                   int64_t KVH, int64_t MB, float scale, int threads) {
  constexpr int64_t D = DV * 16, BS = 16, QV = DV / 2;  // QV: zmm of a bf16 row (32 dims each)
  constexpr int64_t GC = DV == 4 ? 4 : 2;  // heads a K or V row is loaded for (their sums fit the registers)
  // K blocks asked for ahead in pass 1 (into L2), each V block as its K is scored: a block's
  // arithmetic is now shorter than a read from DRAM, and one block ahead left the core waiting
  // (blocks anywhere in a 2 GiB pool, 64 rows: 1.0x the online kernel with one, 1.25x with two)
  constexpr int64_t kAhead = 2;
  const int64_t G = H / KVH, blk_stride = KVH * BS * D;
  const int64_t R = MB == 0 ? 4 : 1, groups = (B + R - 1) / R;
  const int64_t Lpad = padded_context(lens, B);
  parallel_for(groups * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    __m512i* qv = scratch<__m512i, 60>(R * G * QV);
    __m512* acc = scratch<__m512, 61>(R * G * DV);
    float* sc = scratch<float, 62>(R * G * (Lpad + 1));  // scores, a row's then 1 / its sum
    float* inv = sc + R * G * Lpad;
    uint32_t* pp = scratch<uint32_t, 63>(R * G * Lpad / 2);  // bf16 probabilities, in pairs of keys
    const __m512 vscale = _mm512_set1_ps(scale);
    alignas(64) uint16_t wide[BS * D];  // an 8-bit block widened (E4m3Rows)
    for (int64_t k = begin; k < end; ++k) {
      const Item it = item_at(k, groups, KVH, R, B, lens, tables, MB);
      const int64_t b0 = it.b0, rows = it.rows, h = it.h;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = b0 + r;
        for (int64_t g = 0; g < G; ++g) {
          const uint16_t* qr = qp + (b * H + h * G + g) * D;
          for (int i = 0; i < QV; ++i) {
            const __m512 lo = _mm512_mul_ps(load16(qr + 32 * i), vscale);
            const __m512 hi = _mm512_mul_ps(load16(qr + 32 * i + 16), vscale);
            qv[(r * G + g) * QV + i] =
                _mm512_inserti64x4(_mm512_castsi256_si512(round_bf16(lo)), round_bf16(hi), 1);
          }
          for (int i = 0; i < DV; ++i) acc[(r * G + g) * DV + i] = _mm512_setzero_ps();
        }
      }
      const int64_t* table = it.table;
      const int64_t nblocks = (it.len + BS - 1) / BS, head = h * BS * D;
      auto scales = [&](const float* s, int64_t j) { return s + (table[j] * KVH + h) * BS; };
      // the next item's first kAhead K blocks, asked for while this one's V pass runs
      const Item next = k + 1 < end ? item_at(k + 1, groups, KVH, R, B, lens, tables, MB) : Item{0, 0, 0, 0, table};
      const int64_t next_blocks = std::min((next.len + BS - 1) / BS, kAhead), next_head = next.h * BS * D;
      const int64_t* next_table = next.table;
      if (k == begin)
        for (int64_t j = 0; j < std::min(nblocks, kAhead); ++j) prefetch_block(kc + table[j] * blk_stride + head, BS * D);
      // 1. the scores, a block's 16 keys per head out of one transposed sum; keys past a row's
      // length (whatever the cache holds there) are -inf
      for (int64_t j = 0; j < nblocks; ++j) {
        if (j + kAhead < nblocks) prefetch_block(kc + table[j + kAhead] * blk_stride + head, BS * D);
        prefetch_block(vc + table[j] * blk_stride + head, BS * D);  // for pass 3
        const float* ks = nullptr;
        if constexpr (C::kScaled) {
          if (j + kAhead < nblocks) prefetch_block(scales(ksc, j + kAhead), BS);
          prefetch_block(scales(vsc, j), BS);
          ks = scales(ksc, j);
        }
        const uint16_t* kb = C::block(kc + table[j] * blk_stride + head, BS * D, wide);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t nr = std::min<int64_t>(BS, lens[b0 + r] - j * BS);
          if (nr <= 0) continue;
          const __mmask16 valid = static_cast<__mmask16>((1u << nr) - 1u);
          head_chunks<GC>(G, [&](int64_t g, auto n) {
            block_scores<DV, decltype(n)::value>(&qv[(r * G + g) * QV], kb, ks, valid, sc + (r * G + g) * Lpad + j * BS,
                                                 Lpad);
          });
        }
      }
      // 2. per row and head: the probabilities rounded to bf16 (the weights V is multiplied by)
      // and 1 / their sum
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g) {
          uint32_t* pr = &pp[(r * G + g) * Lpad / 2];
          const int64_t len = lens[b0 + r];
          inv[r * G + g] = softmax_blocks(sc + (r * G + g) * Lpad, len, [&](int64_t j, __m512 e) {
            if constexpr (C::kScaled) {  // (past the row's length a scale may be anything, inf too)
              const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(BS, len - j * BS)) - 1u);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j * BS / 2),
                                  round_bf16(_mm512_maskz_mul_ps(valid, e, _mm512_loadu_ps(scales(vsc, j)))));
              return e;
            } else {
              const __m256i pb = round_bf16(e);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j * BS / 2), pb);
              return bf16_to_f(pb);
            }
          });
        }
      // 3. V, each row's keys in pairs (block_pv)
      for (int64_t j = 0; j < nblocks; ++j) {
        if (j < next_blocks) prefetch_block(kc + next_table[j] * blk_stride + next_head, BS * D);  // the next item's pass 1
        const uint16_t* vb = C::block(vc + table[j] * blk_stride + head, std::min(BS, it.len - j * BS) * D, wide);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t nr = std::min<int64_t>(BS, lens[b0 + r] - j * BS);
          if (nr <= 0) continue;
          head_chunks<GC>(G, [&](int64_t g, auto n) {
            block_pv<DV, decltype(n)::value>(&acc[(r * G + g) * DV], &pp[(r * G + g) * Lpad / 2 + j * BS / 2], Lpad / 2,
                                             vb, nr);
          });
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t rg = r * G + g;
          bf16* o = out + ((b0 + r) * H + h * G + g) * D;
          for (int i = 0; i < QV; ++i) {
            __m512 d0, d1;
            dims_in_order(acc[rg * DV + 2 * i], acc[rg * DV + 2 * i + 1], _mm512_set1_ps(inv[rg]), d0, d1);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * i), round_bf16(d0));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * i + 16), round_bf16(d1));
          }
        }
    }
  });
}

// C8's int8 cache on AVX-512 VNNI, for 16-bit queries (bf16, fp16): the three passes above, with
// every product an integer one. A row's query (times the softmax scale) is rounded to int16 with
// one scale per head (max|q| / 32767: finer than bf16's 8 bits), K's bytes widen to int16
// (vpmovsxbw) and vpdpwssd sums q x k in int32, exactly, two dims a lane; a key's score is that
// sum times the query's scale and its row's. The probabilities times V's row scales are rounded
// to int16 against the row's largest (scale max / 32767), V's bytes widen likewise, pairs of keys
// interleaved as block_pv interleaves them, and the int32 sums of 4 blocks go to float at once,
// times the row's scale. The sums are exact and a row's roundings its own, so a row's
// output does not depend on the rows beside it. Against widening to float (the generic kernel
// here: 45 ms for 64 rows x 300 keys x 30 layers on Zen 4, 1.65x the bf16 cache's), K and V cost
// what bf16's do per value and are half the bytes.
#define LANE_C8_VNNI __attribute__((target("avx512f,avx512vl,avx512vnni,avx512bw,avx512dq")))
#define LANE_C8_INLINE LANE_C8_VNNI __attribute__((always_inline)) inline

// n int8 values (a multiple of 32) widened to int16, once for every row and head that reads them
inline const int16_t* widen_i8(const int8_t* p, int64_t n, int16_t* buf) {
  for (int64_t i = 0; i < n; i += 32)
    _mm512_store_si512(buf + i, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))));
  return buf;
}

LANE_C8_INLINE __m512i lane_pairs_i32(__m512i x, __m512i y) {  // lane_pairs on int32 lanes
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, 0x88), _mm512_shuffle_i32x4(x, y, 0xdd));
}

// quarter_scores over K rows widened to int16 and int16 queries: the same tree, on int32 lanes
template <int DV, int GC>
LANE_C8_INLINE void quarter_dots_i8(const __m512i* qv, const int16_t* kb, int qt, __m512i* b) {
  constexpr int64_t D = DV * 16, QV = DV / 2;
  __m512i v[GC][4];
  for (int t = 0; t < 4; ++t) {
    __m512i k[QV];
    for (int i = 0; i < QV; ++i) k[i] = _mm512_loadu_si512(kb + (4 * qt + t) * D + 32 * i);
    for (int g = 0; g < GC; ++g) {
      __m512i a = _mm512_setzero_si512();
      for (int i = 0; i < QV; ++i) a = _mm512_dpwssd_epi32(a, qv[g * QV + i], k[i]);
      v[g][t] = a;
    }
  }
  for (int g = 0; g < GC; ++g) {
    const __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi32(v[g][0], v[g][1]), _mm512_unpackhi_epi32(v[g][0], v[g][1]));
    const __m512i y = _mm512_add_epi32(_mm512_unpacklo_epi32(v[g][2], v[g][3]), _mm512_unpackhi_epi32(v[g][2], v[g][3]));
    b[g] = _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
  }
}

// block_scores for C8: GC heads' 16 scores of a block, their exact int32 dot products times the
// head's query scale (qs) and each key's row scale (ks); keys past valid are -inf
template <int DV, int GC>
LANE_C8_INLINE void block_scores_i8(const __m512i* qv, const float* qs, const int16_t* kb, __m512 ks, __mmask16 valid,
                                    float* sc, int64_t stride) {
  __m512i b0[GC], b1[GC], half[GC];
  quarter_dots_i8<DV, GC>(qv, kb, 0, b0);
  quarter_dots_i8<DV, GC>(qv, kb, 1, b1);
  for (int g = 0; g < GC; ++g) half[g] = lane_pairs_i32(b0[g], b1[g]);
  quarter_dots_i8<DV, GC>(qv, kb, 2, b0);
  quarter_dots_i8<DV, GC>(qv, kb, 3, b1);
  for (int g = 0; g < GC; ++g) {
    const __m512 dots = _mm512_cvtepi32_ps(lane_pairs_i32(half[g], lane_pairs_i32(b0[g], b1[g])));
    const __m512 s = _mm512_mul_ps(dots, _mm512_mul_ps(_mm512_set1_ps(qs[g]), ks));
    _mm512_storeu_ps(sc + g * stride, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s));
  }
}

// block_pv for C8: the first nr keys (at most 64) of V rows widened to int16 times their int16
// probabilities (pp: pairs of keys, GC heads stride apart), summed in int32, then into GC heads'
// float sums times each head's probability scale (bs[g])
template <int DV, int GC>
LANE_C8_INLINE void block_pv_i8(__m512* acc, const uint32_t* pp, int64_t stride, const float* bs, const int16_t* vb,
                                int64_t nr) {
  constexpr int64_t D = DV * 16, QV = DV / 2;
  __m512i a[GC][DV];
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < DV; ++i) a[g][i] = _mm512_setzero_si512();
  for (int64_t u = 0; u < (nr + 1) / 2; ++u) {
    __m512i w[DV];
    for (int i = 0; i < QV; ++i) {
      const __m512i x = _mm512_loadu_si512(vb + 2 * u * D + 32 * i);
      const __m512i y = 2 * u + 1 < nr ? _mm512_loadu_si512(vb + (2 * u + 1) * D + 32 * i) : _mm512_setzero_si512();
      w[2 * i] = _mm512_unpacklo_epi16(x, y);
      w[2 * i + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < GC; ++g) {
      const __m512i pu = _mm512_set1_epi32(static_cast<int>(pp[g * stride + u]));
      for (int i = 0; i < DV; ++i) a[g][i] = _mm512_dpwssd_epi32(a[g][i], pu, w[i]);
    }
  }
  for (int g = 0; g < GC; ++g) {
    const __m512 s = _mm512_set1_ps(bs[g]);
    for (int i = 0; i < DV; ++i) acc[g * DV + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g][i]), s, acc[g * DV + i]);
  }
}

// 16 floats times inv rounded to int16 (|v| * inv <= 32767), into 16 words at dst
inline void store_i16(__m512 v, float inv, void* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)))));
}

// Items [begin, end) of decode_c8's (row group, KV head) walk; decode_dpbf16's structure
template <typename T, int DV>
LANE_C8_VNNI void c8_items(const T* qp, const int8_t* kc, const int8_t* vc, const float* ksc, const float* vsc,
                           const int64_t* tables, const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                           int64_t MB, float scale, int64_t begin, int64_t end) {
  constexpr int64_t D = DV * 16, BS = 16, QV = DV / 2;
  constexpr int64_t GC = DV == 4 ? 4 : 2, kAhead = 2;
  const int64_t G = H / KVH, blk_stride = KVH * BS * D, R = MB == 0 ? 4 : 1, groups = (B + R - 1) / R;
  const int64_t Lpad = padded_context(lens, B);
  __m512i* qv = scratch<__m512i, 66>(R * G * QV);
  __m512* acc = scratch<__m512, 66>(R * G * DV);
  float* sc = scratch<float, 66>(R * G * (Lpad + 3));  // scores; 1 / sums; query scales; probability scales
  float* inv = sc + R * G * Lpad;
  float* qs = inv + R * G;
  float* bsc = qs + R * G;
  uint32_t* pp = scratch<uint32_t, 66>(R * G * Lpad / 2);  // int16 probabilities, in pairs of keys
  const __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) int16_t wide[4 * BS * D];  // a K block, or a span of V blocks, widened
  for (int64_t k = begin; k < end; ++k) {
    const Item it = item_at(k, groups, KVH, R, B, lens, tables, MB);
    const int64_t b0 = it.b0, rows = it.rows, h = it.h;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = b0 + r;
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = qp + (b * H + h * G + g) * D;
        __m512 x[DV], mx = _mm512_setzero_ps();
        for (int i = 0; i < DV; ++i) {
          x[i] = _mm512_mul_ps(load16(qr + 16 * i), vscale);
          mx = _mm512_max_ps(mx, _mm512_abs_ps(x[i]));
        }
        const float m = _mm512_reduce_max_ps(mx);
        qs[r * G + g] = m / 32767.f;
        const float qi = m > 0.f ? 32767.f / m : 0.f;
        int16_t* q16 = reinterpret_cast<int16_t*>(&qv[(r * G + g) * QV]);
        for (int i = 0; i < DV; ++i) store_i16(x[i], qi, q16 + 16 * i);
        for (int i = 0; i < DV; ++i) acc[(r * G + g) * DV + i] = _mm512_setzero_ps();
      }
    }
    const int64_t* table = it.table;
    const int64_t nblocks = (it.len + BS - 1) / BS, head = h * BS * D;
    auto scales = [&](const float* s, int64_t j) { return s + (table[j] * KVH + h) * BS; };  // block j's rows'
    const Item next = k + 1 < end ? item_at(k + 1, groups, KVH, R, B, lens, tables, MB) : Item{0, 0, 0, 0, table};
    const int64_t next_blocks = std::min((next.len + BS - 1) / BS, kAhead), next_head = next.h * BS * D;
    const int64_t* next_table = next.table;
    if (k == begin)
      for (int64_t j = 0; j < std::min(nblocks, kAhead); ++j) prefetch_block(kc + table[j] * blk_stride + head, BS * D);
    // 1. the scores
    for (int64_t j = 0; j < nblocks; ++j) {
      if (j + kAhead < nblocks) {
        prefetch_block(kc + table[j + kAhead] * blk_stride + head, BS * D);
        prefetch_block(scales(ksc, j + kAhead), BS);
      }
      prefetch_block(vc + table[j] * blk_stride + head, BS * D);  // for pass 3
      prefetch_block(scales(vsc, j), BS);
      const int16_t* kb = widen_i8(kc + table[j] * blk_stride + head, BS * D, wide);
      const __m512 ks = _mm512_loadu_ps(scales(ksc, j));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t nr = std::min<int64_t>(BS, lens[b0 + r] - j * BS);
        if (nr <= 0) continue;
        const __mmask16 valid = static_cast<__mmask16>((1u << nr) - 1u);
        head_chunks<GC>(G, [&](int64_t g, auto n) LANE_C8_VNNI {
          const int64_t rg = r * G + g;
          block_scores_i8<DV, decltype(n)::value>(&qv[rg * QV], qs + rg, kb, ks, valid, sc + rg * Lpad + j * BS, Lpad);
        });
      }
    }
    // 2. per row and head: 1 / the probabilities' sum, and the probabilities times V's row scales
    // rounded to int16 against the row's largest (one scale a row and head: a span's sums go to
    // float once)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t rg = r * G + g;
        float* e8 = sc + rg * Lpad;  // the scores, then the probabilities times V's scales
        const int64_t len = lens[b0 + r];
        __m512 mx = _mm512_setzero_ps();
        inv[rg] = softmax_blocks(e8, len, [&](int64_t j, __m512 e) {
          // (past the row's length the scales may be anything a finished request left, inf too)
          const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(BS, len - j * BS)) - 1u);
          const __m512 ev = _mm512_maskz_mul_ps(valid, e, _mm512_loadu_ps(scales(vsc, j)));
          _mm512_storeu_ps(e8 + j * BS, ev);
          mx = _mm512_max_ps(mx, ev);  // ev >= 0: a scale is |x|max / 127
          return e;
        });
        const float m = _mm512_reduce_max_ps(mx), qi = m > 0.f ? 32767.f / m : 0.f;
        bsc[rg] = m / 32767.f;
        for (int64_t j = 0; j < (len + BS - 1) / BS; ++j) store_i16(_mm512_loadu_ps(e8 + j * BS), qi, &pp[rg * Lpad / 2 + j * BS / 2]);
      }
    // 3. V, kSpan blocks at a time: their rows widened into one run, each row's int32 sums over
    // them exact (64 keys x 32767 x 127 < 2^31), then into its float sums once
    constexpr int64_t kSpan = 4;
    for (int64_t j0 = 0; j0 < nblocks; j0 += kSpan) {
      const int64_t j1 = std::min(nblocks, j0 + kSpan);
      for (int64_t j = j0; j < j1; ++j) {
        if (j < next_blocks) prefetch_block(kc + next_table[j] * blk_stride + next_head, BS * D);
        widen_i8(vc + table[j] * blk_stride + head, std::min(BS, it.len - j * BS) * D, wide + (j - j0) * BS * D);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t nr = std::min<int64_t>(kSpan * BS, lens[b0 + r] - j0 * BS);
        if (nr <= 0) continue;
        head_chunks<GC>(G, [&](int64_t g, auto n) LANE_C8_VNNI {
          const int64_t rg = r * G + g;
          block_pv_i8<DV, decltype(n)::value>(&acc[rg * DV], &pp[rg * Lpad / 2 + j0 * BS / 2], Lpad / 2, bsc + rg, wide,
                                              nr);
        });
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t rg = r * G + g;
        T* o = out + ((b0 + r) * H + h * G + g) * D;
        alignas(64) float tmp[32];
        for (int i = 0; i < QV; ++i) {
          __m512 d0, d1;
          dims_in_order(acc[rg * DV + 2 * i], acc[rg * DV + 2 * i + 1], _mm512_set1_ps(inv[rg]), d0, d1);
          _mm512_store_ps(tmp, d0);
          _mm512_store_ps(tmp + 16, d1);
          for (int e = 0; e < 32; ++e) o[32 * i + e] = from_f<T>(tmp[e]);  // (round_bf16 needs AVX512-BF16)
        }
      }
  }
}

// q [B, H, D] (bf16 or fp16) over an int8 cache, head_dim 16 * DV, block size 16 (c8_items)
template <typename T, int DV>
void decode_c8(const T* qp, const int8_t* kc, const int8_t* vc, const float* ksc, const float* vsc,
               const int64_t* tables, const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t MB,
               float scale, int threads) {
  const int64_t R = MB == 0 ? 4 : 1, groups = (B + R - 1) / R;
  parallel_for(groups * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    c8_items<T, DV>(qp, kc, vc, ksc, vsc, tables, lens, out, B, H, KVH, MB, scale, begin, end);
  });
}
#endif

// The AVX-512 path where it applies (a bf16 or fp32 cache, head_dim 64 or 128, block size 16);
// false otherwise.
template <typename T>
bool try_avx512(const T* q, const T* kc, const T* vc, const int64_t* tables, const int32_t* lens, T* out,
                int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float scale, int threads) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, bf16>::value || std::is_same<T, float>::value) {
    if (BS != 16 || (D != 64 && D != 128)) return false;
    if constexpr (std::is_same<T, bf16>::value) {
      if (attention_dpbf16_usable()) {
        const auto* q16 = reinterpret_cast<const uint16_t*>(q);
        const auto* k16 = reinterpret_cast<const uint16_t*>(kc);
        const auto* v16 = reinterpret_cast<const uint16_t*>(vc);
        if (D == 64) decode_dpbf16<4, Bf16Rows>(q16, k16, v16, nullptr, nullptr, tables, lens, out, B, H, KVH, MB, scale, threads);
        else decode_dpbf16<8, Bf16Rows>(q16, k16, v16, nullptr, nullptr, tables, lens, out, B, H, KVH, MB, scale, threads);
        return true;
      }
    }
    if (D == 64) decode_avx512<T, 4>(q, kc, vc, tables, lens, out, B, H, KVH, MB, scale, threads);
    else decode_avx512<T, 8>(q, kc, vc, tables, lens, out, B, H, KVH, MB, scale, threads);
    return true;
  }
#endif
  return false;
}

template <typename T, typename Rows>
void decode_rows(const T* q, const Rows& rows, const int64_t* tables, const int32_t* lens, T* out, int64_t B,
                 int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float sc, int threads) {
  if (D == 64) decode_kernel<T, 64>(q, rows, tables, lens, out, B, H, KVH, D, BS, MB, sc, threads);
  else if (D == 128) decode_kernel<T, 128>(q, rows, tables, lens, out, B, H, KVH, D, BS, MB, sc, threads);
  else decode_kernel<T, 0>(q, rows, tables, lens, out, B, H, KVH, D, BS, MB, sc, threads);
}

template <typename T, typename Launch>
void split_heads(const Launch& launch, const T* qp, const int64_t* tp, const int32_t* lp, T* op, int64_t B,
                 int64_t H, int64_t KVH, int64_t D, int64_t MB, int threads) {
  // Work is split over (request, KV head). With one KV head (MQA, MLA's latent) and fewer
  // requests than threads, each request's query heads are split too, so every thread gets some.
  const int64_t splits = (KVH == 1 && B < threads) ? std::min<int64_t>(H, threads / B) : 1;
  if (splits > 1) {
    const int64_t hc = (H + splits - 1) / splits;
    parallel_for(B * splits, 1, threads, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / splits, h0 = (u % splits) * hc, n = std::min(hc, H - h0);
        if (n > 0) launch(qp + (b * H + h0) * D, tp + b * MB, lp + b, op + (b * H + h0) * D, 1, n);
      }
    });
  } else {
    launch(qp, tp, lp, op, B, H);
  }
}

template <typename T>
void paged_decode(const T* qp, const T* kc, const T* vc, const int64_t* tp, const int32_t* lp, T* op,
                  int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB, float sc,
                  int threads) {
  // bf16 on AMX-BF16 tiles (paged_attention_amx.cpp) where the model's shape takes them, asked
  // before any split of the heads, so that the choice never depends on the batch
  if constexpr (std::is_same<T, bf16>::value) {
    if (lane_paged_attention_amx(qp, kc, vc, tp, lp, op, B, H, KVH, D, BS, MB, sc, threads)) return;
  }
  // nb requests starting at q_ / tables_ / lens_ / out_, nh query heads each
  auto launch = [&](const T* q_, const int64_t* tables_, const int32_t* lens_, T* out_, int64_t nb,
                    int64_t nh) {
    if (try_avx512(q_, kc, vc, tables_, lens_, out_, nb, nh, KVH, D, BS, MB, sc, threads)) return;
    decode_rows(q_, DenseRows<T>{kc, vc}, tables_, lens_, out_, nb, nh, KVH, D, BS, MB, sc, threads);
  };
  split_heads(launch, qp, tp, lp, op, B, H, KVH, D, MB, threads);
}

// An 8-bit cache: the same kernel, its rows dequantized as they are read.
template <typename T, bool FP8>
void paged_decode_q8(const T* qp, const uint8_t* kc, const uint8_t* vc, const float* ks, const float* vs,
                     const float* lut, const int64_t* tp, const int32_t* lp, T* op, int64_t B, int64_t H,
                     int64_t KVH, int64_t D, int64_t BS, int64_t MB, float sc, int threads) {
  const ByteRows<FP8> rows{kc, vc, ks, vs, lut};
  auto launch = [&](const T* q_, const int64_t* tables_, const int32_t* lens_, T* out_, int64_t nb, int64_t nh) {
#if defined(__AVX512F__)
    // fp8 under bf16 queries: the AVX512-BF16 kernel, each byte widened to bf16 as it is read
    if constexpr (FP8 && std::is_same<T, bf16>::value) {
      if (attention_dpbf16_usable() && BS == 16 && (D == 64 || D == 128)) {
        const auto* q16 = reinterpret_cast<const uint16_t*>(q_);
        if (D == 64) decode_dpbf16<4, E4m3Rows>(q16, kc, vc, ks, vs, tables_, lens_, out_, nb, nh, KVH, MB, sc, threads);
        else decode_dpbf16<8, E4m3Rows>(q16, kc, vc, ks, vs, tables_, lens_, out_, nb, nh, KVH, MB, sc, threads);
        return;
      }
    }
    // int8 under 16-bit queries: the VNNI kernel (float32 rows keep the float kernel's sums)
    if constexpr (!FP8 && !std::is_same<T, float>::value) {
      if (use_vnni() && BS == 16 && (D == 64 || D == 128)) {
        const auto* k8 = reinterpret_cast<const int8_t*>(kc);
        const auto* v8 = reinterpret_cast<const int8_t*>(vc);
        if (D == 64) decode_c8<T, 4>(q_, k8, v8, ks, vs, tables_, lens_, out_, nb, nh, KVH, MB, sc, threads);
        else decode_c8<T, 8>(q_, k8, v8, ks, vs, tables_, lens_, out_, nb, nh, KVH, MB, sc, threads);
        return;
      }
    }
#endif
    decode_rows(q_, rows, tables_, lens_, out_, nb, nh, KVH, D, BS, MB, sc, threads);
  };
  split_heads(launch, qp, tp, lp, op, B, H, KVH, D, MB, threads);
}

// x (|x| <= 448) -> the nearest float8 e4m3fn byte (ties to even), as torch's conversion.
inline uint8_t fp8_e4m3_byte(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  float a = std::fabs(x);
  if (!(a == a)) return 0x7f;  // NaN
  if (a >= 448.f) return sign | 0x7e;  // saturate to the largest finite
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1;    // a = 1.f * 2^exp
  if (exp < -6) exp = -6;  // subnormals: fixed step 2^-9
  const float step = std::ldexp(1.f, exp - 3);
  float q = std::nearbyint(a / step);  // ties to even under the default rounding mode
  if (q >= 16.f) {  // rounding carried into the next binade
    exp += 1;
    q = 8.f;
  }
  if (exp == -6 && q < 8.f) return sign | static_cast<uint8_t>(q);  // subnormal
  return sign | static_cast<uint8_t>(((exp + 7) << 3) | (static_cast<int>(q) - 8));
}

}  // namespace

// Whether bf16 paged attention off the AMX tiles takes the AVX512-BF16 kernel here (out[0]); with
// on >= 0, set that first (on 0: the fp32 kernel; for benchmarks: a process that switches
// mid-run loses batch invariance)
extern "C" void lane_attention_dpbf16(int on, int64_t* out) {
#if defined(__AVX512F__)
  if (on >= 0) attention_dpbf16_enabled.store(on, std::memory_order_relaxed);
  out[0] = attention_dpbf16_usable();
#else
  (void)on;
  out[0] = 0;
#endif
}

// q [B, H, D], caches [NB, KVH, BS, D] (one dtype), block_tables [B, MB] int64,
// context_lens [B] int32 -> out [B, H, D]; head_dim <= 1024, block size <= 256
extern "C" void lane_paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                                            int dtype, const int64_t* block_tables,
                                            const int32_t* context_lens, void* out, int64_t B,
                                            int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MB,
                                            float scale, int threads) {
  LANE_DISPATCH(dtype, T,
                paged_decode<T>(static_cast<const T*>(q), static_cast<const T*>(k_cache),
                                static_cast<const T*>(v_cache), block_tables, context_lens,
                                static_cast<T*>(out), B, H, KVH, D, BS, MB, scale, threads));
}

// The same over an 8-bit cache (uint8 [NB, KVH, BS, D]) with float scales [NB, KVH, BS]:
// fp8 != 0 reads the bytes through lut (256 floats), else as int8. bf16 rows take the AMX tiles
// where the CPU and the shape do (paged_attention_amx.cpp: each block dequantized to bf16 as it is
// packed), as over a bf16 cache.
extern "C" void lane_paged_decode_attention_q8(const void* q, const void* k_cache, const void* v_cache,
                                               const float* k_scale, const float* v_scale, const float* lut, int fp8,
                                               int dtype, const int64_t* block_tables, const int32_t* context_lens,
                                               void* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                               int64_t MB, float scale, int threads) {
  if (dtype == kBF16 && lane_paged_attention_amx_q8(q, k_cache, v_cache, k_scale, v_scale, fp8, block_tables,
                                                     context_lens, out, B, H, KVH, D, BS, MB, scale, threads))
    return;
  const auto* kc = static_cast<const uint8_t*>(k_cache);
  const auto* vc = static_cast<const uint8_t*>(v_cache);
  if (fp8) {
    LANE_DISPATCH(dtype, T,
                  paged_decode_q8<T, true>(static_cast<const T*>(q), kc, vc, k_scale, v_scale, lut, block_tables,
                                           context_lens, static_cast<T*>(out), B, H, KVH, D, BS, MB, scale, threads));
  } else {
    LANE_DISPATCH(dtype, T,
                  paged_decode_q8<T, false>(static_cast<const T*>(q), kc, vc, k_scale, v_scale, lut, block_tables,
                                            context_lens, static_cast<T*>(out), B, H, KVH, D, BS, MB, scale, threads));
  }
}

// Step 24 in 8 bits: T tokens' K and V rows ([T, KVH, D] floats of dtype, row strides in
// elements) quantized per (token, head) into their slots: int8 with scale absmax / 127, or
// (fp8) e4m3 with scale absmax / 448, the bytes from lut's inverse (round to nearest).
extern "C" void lane_cache_write_q8(const void* k, const void* v, int64_t k_stride, int64_t v_stride, void* k_cache,
                                    void* v_cache, float* k_scale, float* v_scale, const int64_t* slots, int dtype,
                                    int fp8, int64_t T, int64_t KVH, int64_t D, int64_t BS) {
  LANE_DISPATCH(dtype, X, {
    std::vector<float> row(D);
    const float top = fp8 ? 448.f : 127.f;
    auto put = [&](const X* src, uint8_t* dst, float* sc) {
      float amax = 0.f;
      int64_t e = 0;
#if defined(__AVX512F__)
      __m512 m = _mm512_setzero_ps();  // 16 at a time (exact conversions; a max is exact in any order)
      for (; e + 16 <= D; e += 16) {
        const __m512 x = load16(src + e);
        _mm512_storeu_ps(row.data() + e, x);
        m = _mm512_max_ps(_mm512_abs_ps(x), m);  // (a NaN value is passed over, as std::max below passes it)
      }
      amax = _mm512_reduce_max_ps(m);
#endif
      for (int64_t d = e; d < D; ++d) {
        row[d] = to_f(src[d]);
        amax = std::max(amax, std::fabs(row[d]));
      }
      const float s = amax > 0.f ? amax / top : 1.f, inv = 1.f / s;
      *sc = s;
      int64_t d = 0;
#if defined(__AVX512F__)
      // int8: 16 at a time, the same product rounded to nearest even (lrint's mode), |q| <= 127.
      // A NaN product is 0, as the scalar cast makes of lrint's; with inv not finite (a row of
      // inf, or one too small to invert) the scalar path takes the row
      for (const __m512 vi = _mm512_set1_ps(inv); !fp8 && std::isfinite(inv) && d + 16 <= D; d += 16) {
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(row.data() + d), vi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(
                             _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p, p, _CMP_ORD_Q), p))));
      }
#endif
      for (; d < D; ++d) dst[d] = fp8 ? fp8_e4m3_byte(row[d] * inv)
                                      : static_cast<uint8_t>(static_cast<int8_t>(std::lrint(row[d] * inv)));
    };
    const X* kp = static_cast<const X*>(k);
    const X* vp = static_cast<const X*>(v);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t blk = slots[t] / BS, off = slots[t] % BS;
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t at = (blk * KVH + h) * BS + off;
        put(kp + t * k_stride + h * D, static_cast<uint8_t*>(k_cache) + at * D, k_scale + at);
        put(vp + t * v_stride + h * D, static_cast<uint8_t*>(v_cache) + at * D, v_scale + at);
      }
    }
  });
}

// Step 24: T tokens' K and V rows ([T, KVH, D], heads contiguous, row strides in elements)
// into their cache slots (slot = block * BS + offset; caches [blocks, KVH, BS, D], of the
// rows' dtype): what torch's index_put does in two calls, without its index arithmetic.
extern "C" void lane_cache_write(const void* k, const void* v, int64_t k_stride, int64_t v_stride, void* k_cache,
                                 void* v_cache, const int64_t* slots, int dtype, int64_t T, int64_t KVH, int64_t D,
                                 int64_t BS) {
  const int64_t es = dtype == kF32 ? 4 : 2, row = D * es;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = slots[t] / BS, off = slots[t] % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = ((blk * KVH + h) * BS + off) * row;
      std::memcpy(static_cast<char*>(k_cache) + dst, static_cast<const char*>(k) + (t * k_stride + h * D) * es, row);
      std::memcpy(static_cast<char*>(v_cache) + dst, static_cast<const char*>(v) + (t * v_stride + h * D) * es, row);
    }
  }
}
