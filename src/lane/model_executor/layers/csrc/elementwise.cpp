// Fused element-wise ops for the CPU bf16 path: each reads and writes its data
// once, where torch runs four to six passes (casts, mean, rsqrt, cat, mul, add).
// Math is fp32; results round to the tensor dtype.
#include "common.h"

#include <cmath>

namespace {

using namespace lane;

template <typename T>
void add_rms_norm_rows(T* x, T* res, const T* w, int64_t rows, int64_t D, float eps, int threads) {
  parallel_for(rows, 16, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * D;
      T* rr = res ? res + r * D : nullptr;
      float ss = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        float v = to_f(xr[d]);
        if (rr) {  // residual = x + residual, rounded as torch rounds it
          const T s = from_f<T>(v + to_f(rr[d]));
          rr[d] = s;
          v = to_f(s);
        }
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      const T* src = rr ? rr : xr;
      for (int64_t d = 0; d < D; ++d) {
        // HF: weight * (x * rsqrt(var + eps)).to(dtype)
        const T n = from_f<T>(to_f(src[d]) * inv);
        xr[d] = from_f<T>(to_f(n) * to_f(w[d]));
      }
    }
  });
}

template <typename T>
void rope_rows(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, int64_t rd,
               const int64_t* pos, const float* cos, const float* sin, int threads) {
  const int64_t half = rd / 2;
  parallel_for(rows, 16, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cos + pos[r] * rd;
      const float* s = sin + pos[r] * rd;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + r * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
          v[i] = from_f<T>(x1 * c[i] - x2 * s[i]);
          v[i + half] = from_f<T>(x2 * c[i + half] + x1 * s[i + half]);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I, int threads) {
  parallel_for(rows, 16, threads, [&](int64_t r0, int64_t r1) {
    silu_mul_block(x + r0 * 2 * I, 2 * I, x + r0 * 2 * I + I, 2 * I, out + r0 * I, I, r1 - r0, I);
  });
}

}  // namespace

namespace {
// the SiLU-and-mul as a plain loop, which the compiler vectorises (silu_mul_block's every type,
// and bf16 on a CPU without AVX512-BF16)
template <typename T>
void silu_mul_loop(const T* g, int64_t ldg, const T* u, int64_t ldu, T* o, int64_t ldo, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const float a = to_f(g[r * ldg + i]);
      o[r * ldo + i] = from_f<T>(a / (1.f + fast_exp(-a)) * to_f(u[r * ldu + i]));
    }
}
}  // namespace

template <typename T>
void lane::silu_mul_block(const T* g, int64_t ldg, const T* u, int64_t ldu, T* o, int64_t ldo, int64_t rows,
                          int64_t n) {
  silu_mul_loop(g, ldg, u, ldu, o, ldo, rows, n);
}
#if defined(__AVX512F__)
// bf16 in explicit vectors (silu_mul16), 16 values at a time, the tail masked, rounded by
// AVX512-BF16's instruction; without it the loop (the fused gate_up tiles, the other caller, run
// only on AMX CPUs, which have it)
template <>
void lane::silu_mul_block<lane::bf16>(const bf16* g, int64_t ldg, const bf16* u, int64_t ldu, bf16* o, int64_t ldo,
                                      int64_t rows, int64_t n) {
  if (!use_avx512bf16()) return silu_mul_loop(g, ldg, u, ldu, o, ldo, rows, n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = n - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 v = silu_mul16(bf16_to_f(_mm256_maskz_loadu_epi16(k, g + r * ldg + i)),
                                  bf16_to_f(_mm256_maskz_loadu_epi16(k, u + r * ldu + i)));
      _mm256_mask_storeu_epi16(o + r * ldo + i, k, round_bf16(v));
    }
}
#endif
template void lane::silu_mul_block<float>(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                                          int64_t);
#if !defined(__AVX512F__)
template void lane::silu_mul_block<lane::bf16>(const lane::bf16*, int64_t, const lane::bf16*, int64_t, lane::bf16*,
                                               int64_t, int64_t, int64_t);
#endif
template void lane::silu_mul_block<lane::f16>(const lane::f16*, int64_t, const lane::f16*, int64_t, lane::f16*,
                                              int64_t, int64_t, int64_t);

// x [rows, D], in place: x = rmsnorm(x + residual) * w (residual updated) or rmsnorm(x) * w
extern "C" void lane_rms_norm_(void* x, void* residual, const void* weight, int dtype, int64_t rows,
                               int64_t D, float eps, int threads) {
  LANE_DISPATCH(dtype, T,
                add_rms_norm_rows<T>(static_cast<T*>(x), static_cast<T*>(residual),
                                     static_cast<const T*>(weight), rows, D, eps, threads));
}

// x [T, heads, D] with contiguous heads, rows row_stride apart: rotate-half rope on the
// first rd channels of each head, in place; cos / sin [max_pos, rd] fp32
extern "C" void lane_rotary_(void* x, int dtype, int64_t rows, int64_t row_stride, int64_t heads,
                             int64_t D, const int64_t* positions, const float* cos, const float* sin,
                             int64_t rd, int threads) {
  LANE_DISPATCH(dtype, T,
                rope_rows<T>(static_cast<T*>(x), rows, row_stride, heads, D, rd, positions, cos, sin,
                             threads));
}

// x [rows, 2I] = [gate | up] -> out [rows, I] = silu(gate) * up
extern "C" void lane_silu_and_mul(const void* x, void* out, int dtype, int64_t rows, int64_t I,
                                  int threads) {
  LANE_DISPATCH(dtype, T,
                silu_mul_rows<T>(static_cast<const T*>(x), static_cast<T*>(out), rows, I, threads));
}

// comb [T, n, n] float32, in place: columns, then (iters - 1) x (rows, columns), each
// dividing by (sum + eps) -- DeepSeek V4's mHC mixing matrix, in the reference's order
extern "C" void lane_sinkhorn_(float* base, int64_t T, int64_t n, int64_t iters, float eps,
                               int threads) {
  // divide each line a of the matrix by (its sum + eps); element b of line a sits at
  // a * line + b * step: rows are (line n, step 1), columns (line 1, step n)
  auto normalise = [&](float* c, int64_t line, int64_t step) {
    for (int64_t a = 0; a < n; ++a) {
      float s = 0.f;
      for (int64_t b = 0; b < n; ++b) s += c[a * line + b * step];
      const float d = s + eps;
      for (int64_t b = 0; b < n; ++b) c[a * line + b * step] /= d;
    }
  };
  parallel_for(T, 64, threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* c = base + t * n * n;
      normalise(c, 1, n);
      for (int64_t k = 1; k < iters; ++k) {
        normalise(c, n, 1);
        normalise(c, 1, n);
      }
    }
  });
}

namespace {

// torch.argmax's answer for one row: the first NaN if there is one, else the first maximum
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  float best = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < V; ++i) {
    const float v = to_f(x[i]);
    nan |= v != v;
    best = v > best ? v : best;
  }
  for (int64_t i = 0; i < V; ++i) {
    const float v = to_f(x[i]);
    if (nan ? v != v : v == best) return i;
  }
  return 0;
}

}  // namespace

// Greedy sampling: out[r] = argmax of row r of x [rows, V] (torch's is ~1.5 ns an element, a
// millisecond a step at batch 16 over a 49k vocabulary)
extern "C" void lane_argmax_rows(const void* x, int dtype, int64_t* out, int64_t rows, int64_t V, int threads) {
  LANE_DISPATCH(dtype, T, parallel_for(rows, 2, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(static_cast<const T*>(x) + r * V, V);
  }));
}
