// AMX tiles, shared by the int8 x8 kernels (quant_x8_amx.inc) and the bf16 dense kernel
// (bf16_amx.cpp). GCC 12's AMX intrinsics cannot be trusted: _tile_loadconfig tells the
// compiler it reads only 8 bytes of the 64-byte config (so stores to the rest are dead, and a
// config built on the stack is dropped: llama.cpp's SIGILL), and _tile_loadd does not say it
// reads memory at all. The asm below names the whole config as an operand and clobbers memory.
#pragma once
#if defined(__AVX512F__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace lane {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Load cfg into this thread's tile unit (tile configs are per thread)
inline void tile_configure(const TileConfig& cfg) { asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory"); }
// Every tile 16 rows of 64 bytes, the largest (the bf16 tiles: dense layers, attention); the
// config is thread_local, not on the stack, so the compiler cannot drop it
inline void tile_configure_full() {
  static thread_local TileConfig cfg;
  cfg = TileConfig{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  tile_configure(cfg);
}
// The tile state off again: context switches save 8 KiB less
inline void tile_release() { asm volatile("tilerelease" ::); }

#define LANE_TILE_LOAD(t, p, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(static_cast<int64_t>(stride)) : "memory")
#define LANE_TILE_STORE(t, p, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p), "r"(static_cast<int64_t>(stride)) : "memory")
#define LANE_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::)
// dst += A . B, AT&T order: B, A, dst (int8: signed x signed / unsigned x signed; bf16 pairs)
#define LANE_TILE_DPBSSD(c, a, b) asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define LANE_TILE_DPBUSD(c, a, b) asm volatile("tdpbusd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define LANE_TILE_DPBF16PS(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// The CPU has AMX-TILE and the feature (CPUID 7.0 EDX: 22 AMX-BF16, 25 AMX-INT8), the kernel
// gave this process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA,
// asked once; refused on kernels before 5.16), and LANE_CPU_AMX is not 0.
inline bool amx_state_granted() {
  static const bool granted = [] {
    const char* env = std::getenv("LANE_CPU_AMX");
    if (env && env[0] == '0') return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return granted;
}
inline bool cpu_has_amx(int edx_bit) {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> edx_bit) & 1) && amx_state_granted();
}

// v[n] lane m -> v[m] lane n: a 16 x 16 fp32 transpose in registers (the tiles' sums come out
// with weight rows along the tile's rows; outputs go by input row)
inline void transpose16(__m512* v) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i)
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) {  // u[4i + e], 128-bit lane L: rows 4i..4i + 3 at column 4L + e
    const __m512d* d = reinterpret_cast<const __m512d*>(t + 4 * i);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(d[0], d[2]));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(d[0], d[2]));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(d[1], d[3]));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(d[1], d[3]));
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x44), b = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xee);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x44), d = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xee);
    v[e] = _mm512_shuffle_f32x4(a, c, 0x88), v[4 + e] = _mm512_shuffle_f32x4(a, c, 0xdd);
    v[8 + e] = _mm512_shuffle_f32x4(b, d, 0x88), v[12 + e] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
}

}  // namespace lane
#endif
