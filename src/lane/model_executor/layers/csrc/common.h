// Shared by the CPU kernels. They include no torch header (those take a minute to
// compile); Python hands them raw pointers, sizes and a dtype code through ctypes.
// The ISA is the compiler's: each build targets one of generic / avx2 / avx512.
#pragma once
#include <omp.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

// GGUF blocks, as cpu_kernels.GGML_KINDS codes them. Blocks of 32 values (Q4_0, Q4_1, Q8_0):
// an fp16 scale first (Q4_1: then an fp16 minimum), then the quants. The K-quants' super-blocks
// of 256 (kquant.cpp): Q4_K is d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of quants.
enum Ggml : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };

inline int64_t ggml_block_bytes(int qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    default: return 210;
  }
}

// Q4_K's sub-block j (0..7) scale and minimum (6 bits each) from its 12 packed bytes, and back
inline void q4k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63, mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
inline void q4k_pack_scales(const int* sc, const int* mn, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
}

template <typename T>
constexpr int dtype_code() {
  return std::is_same<T, float>::value ? kF32 : (std::is_same<T, bf16>::value ? kBF16 : kF16);
}

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
//
// Q4_K (on CPUs whose x8 kernel runs it: lane_x8_supports), per group and super-block, 1152
// bytes (8 x 144), so that each sub-block of 32 runs as a Q4_1 block would, its scale
// d * sc and minimum -dmin * mn made in registers once for all input rows:
//   [0, 16) the 8 rows' d, [16, 32) their dmin (fp16);
//   [32, 96) per sub-block pair p (sub-blocks 2p, 2p + 1), lane k = 2r + h (row r, sub-block
//     2p + h): byte 32 + 16p + k = (sc & 15) | (mn & 15) << 4;
//   [96, 128) the scales' top bits, (sc >> 4) | (mn >> 4) << 2: a nibble of byte 96 + 8p + k % 8,
//     the high one for k >= 8;
//   [128, 1152) sub-block j's quants at 128 + 128j as a Q4 block of 8 rows (chunks above).
//
// Q5_K, 1408 bytes (8 x 176): Q4_K's 1152 of its d, dmin, scales and low 4 bits, then each
// sub-block j's top bits at 1152 + 32j: byte 4r + t holds, at bit c (c = 0..3), that of value
// 4c + t, and at bit 4 + c that of 16 + 4c + t.
//
// Q6_K (likewise), 1680 bytes (8 x 210), each 32 values a block whose halves (the sub-blocks
// of 16) have their own int8 scale, the stored values u = q + 32 (0..63):
//   [0, 16) the 8 rows' d (fp16);
//   [16, 144) per block pair p (blocks 2p, 2p + 1), lane k = 2r + h (row r, block 2p + h): byte
//     16 + 32p + k the scale of the block's first half, 16 + 32p + 16 + k of its second;
//   [144, 1168) block j's low 4 bits at 144 + 128j as a Q4 block of 8 rows;
//   [1168, 1680) block j's top 2 bits at 1168 + 64j: byte 32e + 4r + t holds, for chunks c = e
//     and e + 2 (2 bits each, from bit 4 * (c >> 1)), those of values 4c + t and 16 + 4c + t.
constexpr int kX8Rows = 8;
inline int64_t x8_quant_offset(int qtype) { return qtype == kQ4_1 ? 32 : 16; }
inline int x8_chunks(int qtype) { return qtype == kQ8_0 ? 8 : 4; }
inline int64_t x8_values(int qtype) { return qtype >= kQ4_K ? 256 : 32; }  // a block's values

// n bytes between a packed group block and a row's plain GGUF block, the way to_packed says
inline void x8_move(uint8_t* packed, uint8_t* plain, int n, bool to_packed) {
  if (to_packed) std::memcpy(packed, plain, n); else std::memcpy(plain, packed, n);
}

inline void x8_block_q4k(uint8_t* gb, int r, uint8_t* blk, bool to_packed);

// Q5_K as Q4_K (a 144-byte block of its d, dmin, scales and low 4 bits) and its top bits apart
inline void x8_block_q5k(uint8_t* gb, int r, uint8_t* blk, bool to_packed) {
  uint8_t q4[144];  // d, dmin, scales | qs: Q5_K's first 16 and last 128 bytes
  if (to_packed) std::memcpy(q4, blk, 16), std::memcpy(q4 + 16, blk + 48, 128);
  x8_block_q4k(gb, r, q4, to_packed);
  if (!to_packed) std::memcpy(blk, q4, 16), std::memcpy(blk + 48, q4 + 16, 128);
  uint8_t* qh = blk + 16;  // bit j of qh[l]: value 32j + l's top bit
  if (!to_packed) std::memset(qh, 0, 32);
  for (int j = 0; j < 8; ++j)
    for (int m = 0; m < 16; ++m) {
      uint8_t& packed = gb[1152 + 32 * j + 4 * r + m % 4];
      for (int top = 0; top < 2; ++top) {
        const int l = m + 16 * top, bit = 4 * top + m / 4;
        if (to_packed)
          packed = static_cast<uint8_t>((packed & ~(1 << bit)) | (((qh[l] >> j) & 1) << bit));
        else
          qh[l] = static_cast<uint8_t>(qh[l] | (((packed >> bit) & 1) << j));
      }
    }
}

// Q6_K's stored value v (0..255) of a GGUF super-block: 4 low bits in ql, 2 top bits in qh
inline int q6k_get(const uint8_t* blk, int v) {
  const int half = v / 128, w = v % 128, k = w / 32, l = w % 32;
  const int lo = (blk[64 * half + l + 32 * (k & 1)] >> (4 * (k >> 1))) & 15;
  return lo | (((blk[128 + 32 * half + l] >> (2 * k)) & 3) << 4);
}
inline void q6k_set(uint8_t* blk, int v, int u) {
  const int half = v / 128, w = v % 128, k = w / 32, l = w % 32;
  uint8_t& lo = blk[64 * half + l + 32 * (k & 1)];
  uint8_t& hi = blk[128 + 32 * half + l];
  const int ls = 4 * (k >> 1), hs = 2 * k;
  lo = static_cast<uint8_t>((lo & ~(15 << ls)) | ((u & 15) << ls));
  hi = static_cast<uint8_t>((hi & ~(3 << hs)) | (((u >> 4) & 3) << hs));
}

inline void x8_block_q6k(uint8_t* gb, int r, uint8_t* blk, bool to_packed) {
  x8_move(gb + 2 * r, blk + 208, 2, to_packed);
  for (int s = 0; s < 16; ++s) {  // sub-block s of 16: block j = s / 2, its half s % 2
    const int j = s / 2;
    x8_move(gb + 16 + 32 * (j / 2) + 16 * (s % 2) + 2 * r + j % 2, blk + 192 + s, 1, to_packed);
  }
  for (int v = 0; v < 256; ++v) {
    const int j = v / 32, i = v % 32, m = i % 16, c = m / 4, t = m % 4, top = i / 16;
    uint8_t& lo = gb[144 + 128 * j + 32 * c + 4 * r + t];
    uint8_t& hi = gb[1168 + 64 * j + 32 * (c & 1) + 4 * r + t];
    const int ls = 4 * top, hs = 4 * (c >> 1) + 2 * top;
    if (to_packed) {
      const int u = q6k_get(blk, v);
      lo = static_cast<uint8_t>((lo & ~(15 << ls)) | ((u & 15) << ls));
      hi = static_cast<uint8_t>((hi & ~(3 << hs)) | (((u >> 4) & 3) << hs));
    } else {
      q6k_set(blk, v, ((lo >> ls) & 15) | (((hi >> hs) & 3) << 4));
    }
  }
}

inline void x8_block_q4k(uint8_t* gb, int r, uint8_t* blk, bool to_packed) {
  x8_move(gb + 2 * r, blk, 2, to_packed);
  x8_move(gb + 16 + 2 * r, blk + 2, 2, to_packed);
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    const int p = j / 2, k = 2 * r + j % 2, shift = 4 * (k >> 3);
    uint8_t& lo = gb[32 + 16 * p + k];
    uint8_t& hi = gb[96 + 8 * p + (k & 7)];
    if (to_packed) {
      q4k_scale_min(blk + 4, j, sc[j], mn[j]);
      lo = static_cast<uint8_t>((sc[j] & 15) | ((mn[j] & 15) << 4));
      hi = static_cast<uint8_t>((hi & ~(15 << shift)) | (((sc[j] >> 4) | ((mn[j] >> 4) << 2)) << shift));
    } else {
      const int h = (hi >> shift) & 15;
      sc[j] = (lo & 15) | ((h & 3) << 4), mn[j] = (lo >> 4) | ((h >> 2) << 4);
    }
  }
  if (!to_packed) q4k_pack_scales(sc, mn, blk + 4);
  // GGUF: byte l of 32-byte run i holds value l of sub-block 2i (low nibble), of 2i + 1 (high);
  // x8: sub-block j's byte m holds its values m and 16 + m, as Q4_1's
  for (int j = 0; j < 8; ++j)
    for (int m = 0; m < 16; ++m) {
      uint8_t& packed = gb[128 + 128 * j + 32 * (m / 4) + 4 * r + m % 4];
      uint8_t* run = blk + 16 + 32 * (j / 2);
      const int sh = 4 * (j % 2);
      if (to_packed) {
        packed = static_cast<uint8_t>(((run[m] >> sh) & 15) | (((run[16 + m] >> sh) & 15) << 4));
      } else {
        run[m] = static_cast<uint8_t>((run[m] & ~(15 << sh)) | ((packed & 15) << sh));
        run[16 + m] = static_cast<uint8_t>((run[16 + m] & ~(15 << sh)) | ((packed >> 4) << sh));
      }
    }
}

// one row's GGUF block out of a group's packed block (gb), or into it (to_packed)
inline void x8_block(uint8_t* gb, int qtype, int r, uint8_t* blk, bool to_packed) {
  if (qtype == kQ4_K) return x8_block_q4k(gb, r, blk, to_packed);
  if (qtype == kQ5_K) return x8_block_q5k(gb, r, blk, to_packed);
  if (qtype == kQ6_K) return x8_block_q6k(gb, r, blk, to_packed);
  const int64_t qo = x8_quant_offset(qtype), bq = qtype == kQ4_1 ? 4 : 2;
  x8_move(gb + 2 * r, blk, 2, to_packed);
  if (qtype == kQ4_1) x8_move(gb + 16 + 2 * r, blk + 2, 2, to_packed);
  for (int c = 0; c < x8_chunks(qtype); ++c) x8_move(gb + qo + 32 * c + 4 * r, blk + bq + 4 * c, 4, to_packed);
}

// Input rows as 8-bit blocks of 32 for the integer kernels (quant_linear.cpp): q [M, K], d
// [M, K/32] (max|x| / 127), s = d * sum(q) and (isum non-null) the sums themselves; rows split
// over `threads`
void quantize_rows_q8(const void* x, int x_dtype, int8_t* q, float* d, float* s, int32_t* isum, int64_t M,
                      int64_t K, int threads = 1);

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

// Whether the CPU has AVX512-BF16's float -> bf16 conversion (vcvtneps2bf16: nearest even, a NaN
// quieted as from_f quiets it; only inputs below 2^-126, which it flushes to zero, round
// otherwise). The build targets plain AVX-512, so round_bf16 below issues it through asm.
inline bool use_avx512bf16() {
#if defined(__AVX512F__)
  static const bool v = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return v;
#else
  return false;
#endif
}

#if defined(__AVX2__)
// C8's fp8 e4m3 bytes, 16 of them, as fp16 bit patterns of the same numbers times 2^-8 (sign to
// bit 15, exponent and mantissa from bit 7: the two formats' biases and subnormal steps differ by
// 8 binades, so subnormals come out right too); the converter multiplies 2^8 into its scale
inline __m256i e4m3_as_f16(__m128i bytes) {
  const __m256i b = _mm256_cvtepu8_epi16(bytes);
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
}
#endif

#if defined(__AVX512F__)
// v rounded to bf16 by vcvtneps2bf16 (only where use_avx512bf16())
inline __m128i round_bf16(__m256 v) {
  __m128i r;
  asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(v));
  return r;
}
inline __m256i round_bf16(__m512 v) {
  __m256i r;
  asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(v));
  return r;
}

// fast_exp on 16 lanes (the same polynomial, as FMAs)
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 bf16 values (words) -> fp32
inline __m512 bf16_to_f(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// silu(g) * u on 16 lanes, before rounding: one definition for the SiLU-and-mul kernel
// (silu_mul_block) and the gate_up tiles that apply it as they store (bf16_amx.cpp). a / (1 + e)
// is a times the reciprocal refined once (rcp14's 14 bits -> ~23), cheaper than a division
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  // (fast_exp's range: exp512 clamps only below)
  const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(-87.f)),
                                 _mm512_set1_ps(88.f));
  const __m512 d = _mm512_add_ps(one, exp512(x)), q = _mm512_rcp14_ps(d);
  const __m512 inv = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, q, one), q, q);
  return _mm512_mul_ps(_mm512_mul_ps(g, inv), u);
}
#endif

// p rounded up to a 64-byte boundary (tile rows across two cache lines load or store at half
// speed); the buffer must have 63 bytes to spare
template <typename T>
inline T* align64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
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

// o[r][i] = silu(g[r][i]) * u[r][i] for `rows` rows of n values (row strides ldg, ldu, ldo), in
// fp32 and rounded to T (float, f16, bf16): defined once (elementwise.cpp), for the SiLU-and-mul
// kernel and the gate_up tiles that apply it as they store (bf16_amx.cpp), so a value comes out
// the same bits either way
template <typename T>
void silu_mul_block(const T* g, int64_t ldg, const T* u, int64_t ldu, T* o, int64_t ldo, int64_t rows, int64_t n);
#if defined(__AVX512F__)
template <>
void silu_mul_block<bf16>(const bf16* g, int64_t ldg, const bf16* u, int64_t ldu, bf16* o, int64_t ldo, int64_t rows,
                          int64_t n);  // (explicit vectors)
#endif

// Item k of n in an order whose every contiguous range mixes both ends (0, n - 1, 1, n - 2, ...):
// split into parallel_for's contiguous ranges, work that grows with the index (a prefill's
// causal rows) comes out even, where halves would give one thread three times the other's
inline int64_t zigzag(int64_t k, int64_t n) { return k % 2 == 0 ? k / 2 : n - 1 - k / 2; }

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
