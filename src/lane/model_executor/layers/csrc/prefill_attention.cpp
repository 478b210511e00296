// Paged prefill attention on the CPU: one request's chunk of n queries at positions
// num_computed .. num_computed + n - 1 attends causally to everything before it (the
// cached context and the chunk itself, whose K/V the layer has already written), read
// in place from the block-paged cache: no gather copy, no GQA expansion.
//
// Flash style: a tile of rows (TQ query positions x the G query heads of one KV head)
// walks the context in steps of C tokens. Each step's K is widened to fp32 and
// transposed ([D, C]) so a score row is C lanes wide; V is widened ([C, DP]). Both are
// read once per tile and serve all its rows. Online softmax, fp32 accumulation. Steps
// past the tile's last position are never visited; rows whose position is before a
// step take no part in it. Work is split over (KV head, tile) pairs.
#include "common.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace lane;

// A GCC/clang vector of the ISA's width: plain C++ arithmetic on it compiles to whole
// registers on every path (4 floats generic, 8 AVX2, 16 AVX-512), no intrinsics.
#if defined(__AVX512F__)
constexpr int64_t VW = 16, NT = 8;  // NT tokens x 2 vectors of rows: 16 of the 32 registers
#elif defined(__AVX2__)
constexpr int64_t VW = 8, NT = 4;   // 8 accumulators of the 16 registers
#else
constexpr int64_t VW = 4, NT = 4;
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

#define LANE_INLINE inline __attribute__((always_inline))
LANE_INLINE vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
LANE_INLINE void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

constexpr int64_t RV = 2 * VW;  // rows per score micro-kernel (two vectors)
constexpr int64_t C = 32;       // tokens per step (a multiple of NT)
constexpr int64_t NR = 4;       // rows per p.v micro-kernel
constexpr int64_t kRows = 128;   // rows per tile (rounded to whole query positions)

// The rows of a tile lie in the vector lanes: Q is kept transposed ([D, R]), scores are
// [C, R], and the softmax (max, exp, sums) runs lane-parallel over rows, so K rows are only
// widened, never transposed.
template <typename T>
void prefill(const T* q, const T* kc, const T* vc, const int64_t* block_ids, int64_t num_computed,
             T* out, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, int threads) {
  const int64_t G = H / KVH;
  const int64_t TQ = std::max<int64_t>(1, kRows / G);  // query positions per tile
  const int64_t R = (TQ * G + RV - 1) / RV * RV;       // rows, padded to whole micro-kernels
  const int64_t DP = (D + VW - 1) / VW * VW;            // head_dim padded to whole vectors
  const int64_t tiles = (n + TQ - 1) / TQ;
  parallel_for(tiles * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> Qt(D * R), K(C * D), V(C * DP), S(C * R), acc(R * DP), m(R), mn(R), corr(R), l(R);
    std::vector<int32_t> pos(R);
    for (int64_t u = begin; u < end; ++u) {
      // tiles zig-zag (first, last, second, second last, ...) so that every thread's
      // contiguous range holds as much causal work as the others'
      const int64_t k = u / KVH, h = u % KVH;
      const int64_t tile = k % 2 == 0 ? k / 2 : tiles - 1 - k / 2;
      const int64_t i0 = tile * TQ, nq = std::min(TQ, n - i0);
      const int64_t rows = nq * G;  // row r: query i0 + r / G, head h * G + r % G
      std::fill(Qt.begin(), Qt.end(), 0.f);
      for (int64_t r = 0; r < R; ++r) {
        pos[r] = r < rows ? static_cast<int32_t>(num_computed + i0 + r / G) : -1;  // padding: attends to nothing
        if (r < rows) {
          const T* src = q + ((i0 + r / G) * H + h * G + r % G) * D;
          for (int64_t d = 0; d < D; ++d) Qt[d * R + r] = to_f(src[d]) * scale;
        }
      }
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t last = num_computed + i0 + nq - 1;  // the tile's last position
      for (int64_t js = 0; js <= last; js += C) {
        const int64_t nt = std::min(C, last + 1 - js), ntp = (nt + NT - 1) / NT * NT;
        // widen this step's K and V rows; rows past nt are zero (the cache there may hold anything)
        for (int64_t t = 0; t < C; ++t) {
          float* kd = &K[t * D];
          float* vd = &V[t * DP];
          if (t < nt) {
            const int64_t p = js + t;
            const int64_t off = ((block_ids[p / BS] * KVH + h) * BS + p % BS) * D;
            for (int64_t d = 0; d < D; ++d) kd[d] = to_f(kc[off + d]);
            for (int64_t d = 0; d < D; ++d) vd[d] = to_f(vc[off + d]);
            for (int64_t d = D; d < DP; ++d) vd[d] = 0.f;
          } else {
            std::fill(kd, kd + D, 0.f);
            std::fill(vd, vd + DP, 0.f);
          }
        }
        // overlap the next step's DRAM reads with this step's math
        for (int64_t p = js + C; p < std::min(js + 2 * C, last + 1); ++p) {
          const int64_t off = ((block_ids[p / BS] * KVH + h) * BS + p % BS) * D;
          for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kc + off) + b);
            __builtin_prefetch(reinterpret_cast<const char*>(vc + off) + b);
          }
        }
        // rows before the first that reaches js take no part (rows go by position)
        const int64_t first = std::max<int64_t>(0, js - num_computed - i0) * G;
        const int64_t r0 = first / RV * RV;
        // scores [t, r]: NT tokens x 2 vectors of rows; each K value broadcast once per NT x RV
        for (int64_t r = r0; r < R; r += RV) {
          for (int64_t t = 0; t < ntp; t += NT) {
            vf s[NT][2] = {};
            for (int64_t d = 0; d < D; ++d) {
              const vf q0 = vload(&Qt[d * R + r]), q1 = vload(&Qt[d * R + r + VW]);
              for (int64_t j = 0; j < NT; ++j) {
                const float kv = K[(t + j) * D + d];
                s[j][0] += kv * q0;
                s[j][1] += kv * q1;
              }
            }
            for (int64_t j = 0; j < NT; ++j) {
              vstore(&S[(t + j) * R + r], s[j][0]);
              vstore(&S[(t + j) * R + r + VW], s[j][1]);
            }
          }
        }
        // online softmax, lane-parallel over rows: token js + t counts for row r iff it is
        // not after the row's position
        for (int64_t r = r0; r < R; ++r) mn[r] = m[r];
        for (int64_t t = 0; t < nt; ++t) {
          const float* st = &S[t * R];
          const int32_t p = static_cast<int32_t>(js + t);
          for (int64_t r = r0; r < R; ++r) mn[r] = pos[r] >= p && st[r] > mn[r] ? st[r] : mn[r];
        }
        for (int64_t r = r0; r < R; ++r) {
          corr[r] = m[r] == -INFINITY ? 0.f : fast_exp(m[r] - mn[r]);
          m[r] = mn[r];
          l[r] *= corr[r];
        }
        for (int64_t t = 0; t < nt; ++t) {  // S becomes P
          float* st = &S[t * R];
          const int32_t p = static_cast<int32_t>(js + t);
          for (int64_t r = r0; r < R; ++r) {
            st[r] = pos[r] >= p ? fast_exp(st[r] - mn[r]) : 0.f;
            l[r] += st[r];
          }
        }
        // acc = acc * corr + P . V: NR rows x two vectors of head_dim; each V vector loaded once for NR rows
        for (int64_t r = r0; r < R; r += NR) {
          int64_t d = 0;
          for (; d + 2 * VW <= DP; d += 2 * VW) {
            vf a[NR][2];
            for (int64_t i = 0; i < NR; ++i) {
              a[i][0] = vload(&acc[(r + i) * DP + d]) * corr[r + i];
              a[i][1] = vload(&acc[(r + i) * DP + d + VW]) * corr[r + i];
            }
            for (int64_t t = 0; t < nt; ++t) {
              const vf v0 = vload(&V[t * DP + d]), v1 = vload(&V[t * DP + d + VW]);
              for (int64_t i = 0; i < NR; ++i) {
                const float pv = S[t * R + r + i];
                a[i][0] += pv * v0;
                a[i][1] += pv * v1;
              }
            }
            for (int64_t i = 0; i < NR; ++i) {
              vstore(&acc[(r + i) * DP + d], a[i][0]);
              vstore(&acc[(r + i) * DP + d + VW], a[i][1]);
            }
          }
          if (d < DP) {  // one vector left (head_dim an odd number of vectors, as 80 on AVX-512)
            vf a[NR];
            for (int64_t i = 0; i < NR; ++i) a[i] = vload(&acc[(r + i) * DP + d]) * corr[r + i];
            for (int64_t t = 0; t < nt; ++t) {
              const vf v0 = vload(&V[t * DP + d]);
              for (int64_t i = 0; i < NR; ++i) a[i] += S[t * R + r + i] * v0;
            }
            for (int64_t i = 0; i < NR; ++i) vstore(&acc[(r + i) * DP + d], a[i]);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / l[r];
        T* dst = out + ((i0 + r / G) * H + h * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(acc[r * DP + d] * inv);
      }
    }
  });
}

}  // namespace

// q [n, H, D] (the chunk's queries, at positions num_computed ..), caches [NB, KVH, BS, D]
// (one dtype), block_ids [>= ceil((num_computed + n) / BS)] int64 -> out [n, H, D]
extern "C" void lane_paged_prefill_attention(const void* q, const void* k_cache, const void* v_cache,
                                             int dtype, const int64_t* block_ids, int64_t num_computed,
                                             void* out, int64_t n, int64_t H, int64_t KVH, int64_t D,
                                             int64_t BS, float scale, int threads) {
  LANE_DISPATCH(dtype, T,
                prefill<T>(static_cast<const T*>(q), static_cast<const T*>(k_cache),
                           static_cast<const T*>(v_cache), block_ids, num_computed,
                           static_cast<T*>(out), n, H, KVH, D, BS, scale, threads));
}
