// Shared by the CPU kernels. They include no torch header (those take a minute to
// compile); Python hands them raw pointers, sizes and a dtype code through ctypes.
// The ISA is the compiler's: each build targets one of generic / avx2 / avx512.
#pragma once
#include <omp.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace lane {

// dtype codes, as cpu_kernels.py passes them
enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

enum class bf16 : uint16_t {};  // a scalar type (not a struct): loops over it vectorise
#if defined(__FLT16_MAX__)  // GCC >= 12, clang >= 15: converts with F16C where the ISA has it
using f16 = _Float16;
#else
struct f16 {
  uint16_t x;
};
#endif

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) {  // bf16 -> fp32 is a 16-bit shift
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
#if defined(__FLT16_MAX__)
inline float to_f(f16 v) { return static_cast<float>(v); }
#else
inline float to_f(f16 v) {  // IEEE half -> float, subnormals included
  const uint32_t s = (v.x & 0x8000u) << 16, e = (v.x >> 10) & 0x1fu, m = v.x & 0x3ffu;
  float f;
  if (e == 0) {
    f = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24
    return s ? -f : f;
  }
  const uint32_t u = s | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
#endif

template <typename T>
inline T from_f(float f);
template <>
inline float from_f<float>(float f) { return f; }
template <>
inline bf16 from_f<bf16>(float f) {  // round to nearest even, as torch rounds
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}
#if defined(__FLT16_MAX__)
template <>
inline f16 from_f<f16>(float f) { return static_cast<f16>(f); }
#else
template <>
inline f16 from_f<f16>(float f) {  // float -> IEEE half, round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t s = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{static_cast<uint16_t>(s | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return f16{static_cast<uint16_t>(s | 0x7c00u)};  // overflow -> inf
  if (a < 0x38800000u) {  // subnormal half: scale so the integer rounding is the half's
    float r;
    std::memcpy(&r, &a, sizeof(r));
    return f16{static_cast<uint16_t>(s | static_cast<uint16_t>(__builtin_rintf(r * 16777216.f)))};
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return f16{static_cast<uint16_t>(s | (r >> 13))};
}
#endif

// exp as plain arithmetic, so loops of it vectorise (libm's expf does not):
// 2^n * p(r), r in [-ln2/2, ln2/2], degree-6 polynomial (rel. err ~2e-7); x clamped to [-87, 88]
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_rintf(x * 1.44269504f);  // rint, not round: only rint vectorises
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// GGUF blocks of 32 values (Q4_0, Q4_1, Q8_0, as cpu_kernels.py codes them): an fp16
// scale first (Q4_1: then an fp16 minimum), then the quants
enum Ggml : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

inline int64_t ggml_block_bytes(int qtype) { return qtype == kQ4_0 ? 18 : (qtype == kQ4_1 ? 20 : 34); }

inline float half_at(const uint8_t* p) {  // an fp16 field of a block
  f16 h;
  std::memcpy(&h, p, sizeof(h));
  return to_f(h);
}

// n activations to int8 as ggml quantizes them for its integer dot products (Q8_0's and
// Q8_K's blocks): returns d = max|x| / 127 and writes q = rint(x / d), as x * (1 / d)
template <typename T>
inline float quantize_block_q8(const T* x, int n, int8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = __builtin_fmaxf(amax, __builtin_fabsf(to_f(x[i])));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < n; ++i) q[i] = static_cast<int8_t>(__builtin_rintf(to_f(x[i]) * inv));
  return d;
}

// Q4_0 / Q4_1 / Q8_0 weights repacked at load, 8 rows interleaved ("x8", quant_x8.cpp): for
// each group of 8 rows and each block, the 8 fp16 scales, (Q4_1) the 8 fp16 minimums, then
// chunks of 32 bytes, chunk c holding bytes 4c..4c+3 of every row's quants (4 chunks for Q4,
// whose byte i holds value i in its low nibble and value i + 16 in its high one; 8 for Q8_0).
// The same bytes as the GGUF rows.
constexpr int kX8Rows = 8;
inline int64_t x8_quant_offset(int qtype) { return qtype == kQ4_1 ? 32 : 16; }
inline int x8_chunks(int qtype) { return qtype == kQ8_0 ? 8 : 4; }

// one row's GGUF block out of a group's packed block (gb), or into it (to_packed)
inline void x8_block(uint8_t* gb, int qtype, int r, uint8_t* blk, bool to_packed) {
  const int64_t qo = x8_quant_offset(qtype), bq = qtype == kQ4_1 ? 4 : 2;
  auto move = [&](uint8_t* packed, uint8_t* plain, int n) {
    if (to_packed) std::memcpy(packed, plain, n); else std::memcpy(plain, packed, n);
  };
  move(gb + 2 * r, blk, 2);
  if (qtype == kQ4_1) move(gb + 16 + 2 * r, blk + 2, 2);
  for (int c = 0; c < x8_chunks(qtype); ++c) move(gb + qo + 32 * c + 4 * r, blk + bq + 4 * c, 4);
}

// Input rows as 8-bit blocks of 32 for the integer kernels (quant_linear.cpp): q [M, K], d
// [M, K/32] (max|x| / 127), s = d * sum(q) and (isum non-null) the sums themselves
void quantize_rows_q8(const void* x, int x_dtype, int8_t* q, float* d, float* s, int32_t* isum, int64_t M,
                      int64_t K);

// Whether the kernels with a VNNI variant (K-quants, the x8 32-blocks) take it: an AVX-512 build
// on a CPU that has it, unless LANE_CPU_VNNI=0 (so one VNNI machine tests the plain paths too).
// Asked on first use, __builtin_cpu_init first: a static initializer may run before libgcc's.
inline bool use_vnni() {
#if defined(__AVX512F__)
  static const bool v = [] {
    __builtin_cpu_init();
    const char* env = std::getenv("LANE_CPU_VNNI");
    return __builtin_cpu_supports("avx512vnni") && !(env && env[0] == '0');
  }();
  return v;
#else
  return false;
#endif
}

// A per-thread buffer that grows as needed and is reused call to call (no allocation per call).
// Each caller names its own (T, Tag): a kernel that calls another (decode_layers.cpp) must not
// share a buffer the callee overwrites.
template <typename T, int Tag>
inline T* scratch(int64_t n) {
  static thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Split [0, n) into one contiguous range per thread, as at::parallel_for does; inline
// when there is one thread or too little work.
template <typename F>
void parallel_for(int64_t n, int64_t grain, int threads, const F& f) {
  if (n <= 0) return;
  int64_t chunks = grain > 0 ? (n + grain - 1) / grain : n;
  if (chunks > threads) chunks = threads;
  if (chunks <= 1 || omp_in_parallel()) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + chunks - 1) / chunks;
#pragma omp parallel num_threads(static_cast<int>(chunks))
  {
    const int64_t b = omp_get_thread_num() * per;
    const int64_t e = b + per < n ? b + per : n;
    if (b < e) f(b, e);
  }
}

}  // namespace lane

// Calls body with T bound to the C++ type of dtype code `code`.
#define LANE_DISPATCH(code, T, ...)         \
  switch (code) {                           \
    case lane::kBF16: {                     \
      using T = lane::bf16;                 \
      __VA_ARGS__;                          \
      break;                                \
    }                                       \
    case lane::kF16: {                      \
      using T = lane::f16;                  \
      __VA_ARGS__;                          \
      break;                                \
    }                                       \
    default: {                              \
      using T = float;                      \
      __VA_ARGS__;                          \
      break;                                \
    }                                       \
  }
