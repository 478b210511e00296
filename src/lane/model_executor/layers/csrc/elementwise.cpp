// Fused element-wise ops for the CPU bf16 path: each reads and writes its data
// once, where torch runs four to six passes (casts, mean, rsqrt, cat, mul, add).
// Math is fp32; results round to the tensor dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

template <typename T>
inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
void add_rms_norm_rows(T* x, T* res, const T* w, int64_t rows, int64_t D, float eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * D;
      T* rr = res ? res + r * D : nullptr;
      float ss = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        float v = ld(xr, d);
        if (add) {  // residual = x + residual, rounded as torch rounds it
          const T s = static_cast<T>(v + ld(rr, d));
          rr[d] = s;
          v = static_cast<float>(s);
        }
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      const T* src = add ? rr : xr;
      for (int64_t d = 0; d < D; ++d) {
        // HF: weight * (x * rsqrt(var + eps)).to(dtype)
        const T n = static_cast<T>(ld(src, d) * inv);
        xr[d] = static_cast<T>(static_cast<float>(n) * ld(w, d));
      }
    }
  });
}

template <typename T>
void rope_rows(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, int64_t rd,
               const int64_t* pos, const float* cos, const float* sin) {
  const int64_t half = rd / 2;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cos + pos[r] * rd;
      const float* s = sin + pos[r] * rd;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + r * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = ld(v, i), x2 = ld(v, i + half);
          v[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          v[i + half] = static_cast<T>(x2 * c[i + half] + x1 * s[i + half]);
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      for (int64_t i = 0; i < I; ++i) {
        const float a = ld(g, i);
        o[i] = static_cast<T>(a / (1.f + std::exp(-a)) * ld(u, i));
      }
    }
  });
}

}  // namespace

// x [rows, D]: in place x = rmsnorm(x + residual) * w (residual updated), or rmsnorm(x) * w
void rms_norm_(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm_: contiguous x and weight of one dtype");
  const bool add = residual.has_value() && residual->defined();
  if (add) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual shape");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), add ? residual->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), rows, D, static_cast<float>(eps), add);
  });
}

// x [T, heads, D] with contiguous heads (rows may be strided): rotate-half rope in place
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: x [T, H, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "fp32 cache");
  auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t rd = cos.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.stride(0), x.size(1), x.size(2), rd,
                        pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_and_mul: x [T, 2I]");
  const int64_t I = x.size(1) / 2;
  auto out = torch::empty({x.size(0), I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), I);
  });
  return out;
}

// comb [T, n, n] float32, in place: columns, then (iters - 1) x (rows, columns), each
// dividing by (sum + eps) -- DeepSeek V4's mHC mixing matrix, in the reference's order
void sinkhorn_(torch::Tensor comb, int64_t iters, double eps_) {
  TORCH_CHECK(comb.dim() == 3 && comb.size(1) == comb.size(2) && comb.is_contiguous() &&
              comb.scalar_type() == at::kFloat, "sinkhorn_: contiguous float32 [T, n, n]");
  const int64_t T = comb.size(0), n = comb.size(1);
  const float eps = static_cast<float>(eps_);
  float* base = comb.data_ptr<float>();
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
  auto rows = [&](float* c) { normalise(c, n, 1); };
  auto cols = [&](float* c) { normalise(c, 1, n); };
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* c = base + t * n * n;
      cols(c);
      for (int64_t k = 1; k < iters; ++k) {
        rows(c);
        cols(c);
      }
    }
  });
}
