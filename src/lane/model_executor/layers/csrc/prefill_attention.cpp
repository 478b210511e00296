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
constexpr int64_t VW = 16;
#elif defined(__AVX2__)
constexpr int64_t VW = 8;
#else
constexpr int64_t VW = 4;
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

#define LANE_INLINE inline __attribute__((always_inline))
LANE_INLINE vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
LANE_INLINE void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

constexpr int64_t C = 2 * VW;  // tokens per step: two vectors per score row
constexpr int64_t NR = 4;      // rows per micro-kernel: 4 x 2 accumulators fit every ISA's registers
constexpr int64_t kRows = 48;  // rows per tile (rounded to whole query positions)

template <typename T>
void prefill(const T* q, const T* kc, const T* vc, const int64_t* block_ids, int64_t num_computed,
             T* out, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, int threads) {
  const int64_t G = H / KVH;
  const int64_t TQ = std::max<int64_t>(1, kRows / G);       // query positions per tile
  const int64_t R = (TQ * G + NR - 1) / NR * NR;            // rows, padded to whole micro-kernels
  const int64_t DP = (D + VW - 1) / VW * VW;                 // head_dim padded to whole vectors
  const int64_t tiles = (n + TQ - 1) / TQ;
  parallel_for(tiles * KVH, 1, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(R * D), Kt(D * C), V(C * DP), S(R * C), P(R * C), acc(R * DP), m(R), l(R);
    std::vector<int64_t> pos(R);
    for (int64_t u = begin; u < end; ++u) {
      // tiles zig-zag (first, last, second, second last, ...) so that every thread's
      // contiguous range holds as much causal work as the others'
      const int64_t k = u / KVH, h = u % KVH;
      const int64_t tile = k % 2 == 0 ? k / 2 : tiles - 1 - k / 2;
      const int64_t i0 = tile * TQ, nq = std::min(TQ, n - i0);
      const int64_t rows = nq * G;  // row r: query i0 + r / G, head h * G + r % G
      std::fill(Q.begin(), Q.end(), 0.f);
      for (int64_t r = 0; r < R; ++r) {
        pos[r] = r < rows ? num_computed + i0 + r / G : -1;  // padding rows attend to nothing
        m[r] = -INFINITY;
        l[r] = 0.f;
        if (r < rows) {
          const T* src = q + ((i0 + r / G) * H + h * G + r % G) * D;
          for (int64_t d = 0; d < D; ++d) Q[r * D + d] = to_f(src[d]) * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t last = num_computed + i0 + nq - 1;  // the tile's last position
      for (int64_t js = 0; js <= last; js += C) {
        const int64_t nt = std::min(C, last + 1 - js);
        // widen this step's K (transposed) and V; columns / rows past nt are zero
        std::fill(Kt.begin(), Kt.end(), 0.f);
        std::fill(V.begin(), V.end(), 0.f);
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t p = js + t;
          const int64_t off = ((block_ids[p / BS] * KVH + h) * BS + p % BS) * D;
          for (int64_t d = 0; d < D; ++d) Kt[d * C + t] = to_f(kc[off + d]);
          for (int64_t d = 0; d < D; ++d) V[t * DP + d] = to_f(vc[off + d]);
        }
        // rows before the first that reaches js take no part (rows go by position)
        const int64_t first = std::max<int64_t>(0, js - num_computed - i0) * G;
        const int64_t r0 = first / NR * NR;
        // scores: NR rows x C tokens, each K column pair loaded once for NR rows
        for (int64_t r = r0; r < R; r += NR) {
          vf s[NR][2] = {};
          for (int64_t d = 0; d < D; ++d) {
            const vf k0 = vload(&Kt[d * C]), k1 = vload(&Kt[d * C + VW]);
            for (int64_t i = 0; i < NR; ++i) {
              const float qv = Q[(r + i) * D + d];
              s[i][0] += qv * k0;
              s[i][1] += qv * k1;
            }
          }
          for (int64_t i = 0; i < NR; ++i) {
            vstore(&S[(r + i) * C], s[i][0]);
            vstore(&S[(r + i) * C + VW], s[i][1]);
          }
        }
        // online softmax per row over its causal part of the step
        for (int64_t r = r0; r < R; ++r) {
          const int64_t cnt = std::min(nt, pos[r] - js + 1);
          float* pr = &P[r * C];
          if (cnt <= 0) {
            std::fill(pr, pr + C, 0.f);
            continue;
          }
          const float* sr = &S[r * C];
          float mb = m[r];
#pragma omp simd reduction(max : mb)
          for (int64_t c = 0; c < cnt; ++c) mb = sr[c] > mb ? sr[c] : mb;
          const float corr = m[r] == -INFINITY ? 0.f : fast_exp(m[r] - mb);
          float sum = 0.f;
          for (int64_t c = 0; c < C; ++c) {
            pr[c] = c < cnt ? fast_exp(sr[c] - mb) : 0.f;
            sum += pr[c];
          }
          m[r] = mb;
          l[r] = l[r] * corr + sum;
          float* a = &acc[r * DP];
          for (int64_t d = 0; d < DP; ++d) a[d] *= corr;
        }
        // acc += P . V: NR rows x two vectors of head_dim, each V vector loaded once for NR rows
        for (int64_t r = r0; r < R; r += NR) {
          int64_t d = 0;
          for (; d + 2 * VW <= DP; d += 2 * VW) {
            vf a[NR][2];
            for (int64_t i = 0; i < NR; ++i) {
              a[i][0] = vload(&acc[(r + i) * DP + d]);
              a[i][1] = vload(&acc[(r + i) * DP + d + VW]);
            }
            for (int64_t t = 0; t < nt; ++t) {
              const vf v0 = vload(&V[t * DP + d]), v1 = vload(&V[t * DP + d + VW]);
              for (int64_t i = 0; i < NR; ++i) {
                const float p = P[(r + i) * C + t];
                a[i][0] += p * v0;
                a[i][1] += p * v1;
              }
            }
            for (int64_t i = 0; i < NR; ++i) {
              vstore(&acc[(r + i) * DP + d], a[i][0]);
              vstore(&acc[(r + i) * DP + d + VW], a[i][1]);
            }
          }
          if (d < DP) {  // one vector left (head_dim an odd number of vectors, as 80 on AVX-512)
            vf a[NR];
            for (int64_t i = 0; i < NR; ++i) a[i] = vload(&acc[(r + i) * DP + d]);
            for (int64_t t = 0; t < nt; ++t) {
              const vf v0 = vload(&V[t * DP + d]);
              for (int64_t i = 0; i < NR; ++i) a[i] += P[(r + i) * C + t] * v0;
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
