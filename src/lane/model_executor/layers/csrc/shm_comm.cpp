// Collectives between the ranks of one machine through one shared-memory segment (vLLM's CPU
// backend has the same idea): each rank copies its input into its own slot, publishes a
// sequence number, waits until every rank has published it, then reads the others' slots.
//
// Segment: a header (magic, world, each rank's pid, each rank's published sequence number on
// its own cache line), then two sets of slots (one per rank each), used by odd and even
// sequence numbers in turn. One barrier per collective is enough: a rank writes slot set
// s % 2 for collective s only after collective s - 1's barrier, which every rank reached after
// it had finished reading collective s - 2's slots (the same set).
//
// A wait spins briefly, then yields, then sleeps in short naps: with more ranks than cores
// (dp 2 x tp 2 on 2 cores) a spinning waiter would hold the core its peer needs. It gives up
// when a peer's process is gone (status 2) or after the timeout (status 1); status[1] names
// the rank waited for.
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kPidsAt = 64;      // int64 pid per rank
constexpr int64_t kFlagsAt = 4096;   // one cache line per rank
enum ShmDtype : int { kSF32 = 0, kSBF16 = 1, kSF16 = 2, kSI32 = 3, kSI64 = 4 };

inline std::atomic<int64_t>* flag(char* base, int r) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + kFlagsAt + r * kLine);
}
inline int64_t data_at(int world) { return (kFlagsAt + world * kLine + 4095) / 4096 * 4096; }
inline char* slot(char* base, int world, int64_t slot_bytes, int64_t seq, int r) {
  return base + data_at(world) + ((seq & 1) * world + r) * slot_bytes;
}

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Into this rank's slot. Large copies stream past the cache (non-temporal stores): a peer
// then reads them from the shared cache or memory, not line by line out of this core's
// private cache, which costs ~20x more for a megabyte on a VM whose cores sit apart.
void publish_copy(char* dst, const void* src_, int64_t n) {
  const char* src = static_cast<const char*>(src_);
#if defined(__x86_64__)
  if (n >= (256 << 10) && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 64 <= n; i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#elif defined(__AVX__)
    for (; i + 32 <= n; i += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
#else
    for (; i + 16 <= n; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
#endif
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();  // the streamed stores are visible before the flag that publishes them
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// A peer is gone when its pid is, or is a zombie its parent has not reaped yet.
bool gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64], buf[512];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces
  return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

// Publish seq for this rank, then wait for every rank to publish it. 0: done.
int barrier(char* base, int world, int rank, int64_t seq, double timeout_s, int32_t* status) {
  flag(base, rank)->store(seq, std::memory_order_release);
  const auto* pids = reinterpret_cast<const int64_t*>(base + kPidsAt);
  double deadline = -1.0;
  for (int q = 0; q < world; ++q) {
    int64_t spins = 0;
    while (flag(base, q)->load(std::memory_order_acquire) < seq) {
      ++spins;
      if (spins < 2048) {
        cpu_relax();
        continue;
      }
      if (spins < 4096) {
        sched_yield();
        continue;
      }
      const timespec nap{0, 20000};  // 20 us
      nanosleep(&nap, nullptr);
      if ((spins & 63) == 0) {
        const double t = now_s();
        if (deadline < 0) deadline = t + timeout_s;
        if (gone(pids[q])) {
          status[0] = 2, status[1] = q;
          return 2;
        }
        if (t > deadline) {
          status[0] = 1, status[1] = q;
          return 1;
        }
      }
    }
  }
  return 0;
}

// Rank q's published elements; this rank's own are read from its input, still in its cache
// (the same values as its slot, which was streamed past the cache).
template <typename T>
inline const T* source(char* base, int world, int64_t slot_bytes, int64_t seq, int q, int rank, const void* own) {
  return reinterpret_cast<const T*>(q == rank ? own : slot(base, world, slot_bytes, seq, q));
}

template <typename T, typename Acc>
void sum_slots(char* base, int world, int64_t slot_bytes, int64_t seq, int rank, const void* own, int64_t lo,
               int64_t hi, T* out) {
  constexpr int64_t kTile = 1024;  // accumulate a tile in registers/L1, one rounding at the end
  Acc acc[kTile];
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t n = (hi - t0 < kTile) ? hi - t0 : kTile;
    const T* first = source<T>(base, world, slot_bytes, seq, 0, rank, own) + t0;
    for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<Acc>(lane::to_f(first[i]));
    for (int q = 1; q < world; ++q) {
      const T* s = source<T>(base, world, slot_bytes, seq, q, rank, own) + t0;
      for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<Acc>(lane::to_f(s[i]));
    }
    for (int64_t i = 0; i < n; ++i) out[t0 - lo + i] = lane::from_f<T>(acc[i]);
  }
}

template <typename T>
void sum_ints(char* base, int world, int64_t slot_bytes, int64_t seq, int rank, const void* own, int64_t lo,
              int64_t hi, T* out) {
  for (int64_t i = lo; i < hi; ++i) {
    T acc = 0;
    for (int q = 0; q < world; ++q) acc += source<T>(base, world, slot_bytes, seq, q, rank, own)[i];
    out[i - lo] = acc;
  }
}

// Elements [lo, hi) summed over ranks, in rank order, into out (which may be own: a tile is
// read whole before it is written).
void sum_range(char* base, int world, int64_t slot_bytes, int64_t seq, int rank, const void* own, int64_t lo,
               int64_t hi, void* out, int dtype) {
  switch (dtype) {
    case kSF32:
      sum_slots<float, float>(base, world, slot_bytes, seq, rank, own, lo, hi, static_cast<float*>(out));
      break;
    case kSBF16:
      sum_slots<lane::bf16, float>(base, world, slot_bytes, seq, rank, own, lo, hi, static_cast<lane::bf16*>(out));
      break;
    case kSF16:
      sum_slots<lane::f16, float>(base, world, slot_bytes, seq, rank, own, lo, hi, static_cast<lane::f16*>(out));
      break;
    case kSI32: sum_ints<int32_t>(base, world, slot_bytes, seq, rank, own, lo, hi, static_cast<int32_t*>(out)); break;
    case kSI64: sum_ints<int64_t>(base, world, slot_bytes, seq, rank, own, lo, hi, static_cast<int64_t*>(out)); break;
  }
}

}  // namespace

extern "C" {

// Write this rank's pid into the header (before the first collective).
void lane_shm_attach(void* base, int rank, int64_t pid) {
  reinterpret_cast<int64_t*>(static_cast<char*>(base) + kPidsAt)[rank] = pid;
}

// The offset of the first slot and the segment size for world ranks and slot_bytes a slot.
void lane_shm_layout(int world, int64_t slot_bytes, int64_t* out) {
  out[0] = data_at(world);
  out[1] = data_at(world) + 2 * world * slot_bytes;
}

void lane_shm_barrier(void* base, int world, int rank, int64_t seq, double timeout_s, int32_t* status) {
  barrier(static_cast<char*>(base), world, rank, seq, timeout_s, status);
}

// out[0:n] = the sum over ranks of in[0:n] (n elements of dtype; n * size <= slot_bytes).
// in == out is allowed. Every rank adds in rank order: the same result on every rank.
void lane_shm_all_reduce(void* base_, int world, int rank, int64_t slot_bytes, int64_t seq, const void* in,
                         void* out, int64_t n, int dtype, int64_t elem_size, double timeout_s, int32_t* status) {
  char* base = static_cast<char*>(base_);
  publish_copy(slot(base, world, slot_bytes, seq, rank), in, n * elem_size);
  if (barrier(base, world, rank, seq, timeout_s, status)) return;
  sum_range(base, world, slot_bytes, seq, rank, in, 0, n, out, dtype);
}

// in holds n elements; out[0:hi-lo] = the sum over ranks of elements [lo, hi) (this rank's part).
void lane_shm_reduce_scatter(void* base_, int world, int rank, int64_t slot_bytes, int64_t seq, const void* in,
                             int64_t n, int64_t lo, int64_t hi, void* out, int dtype, int64_t elem_size,
                             double timeout_s, int32_t* status) {
  char* base = static_cast<char*>(base_);
  publish_copy(slot(base, world, slot_bytes, seq, rank), in, n * elem_size);
  if (barrier(base, world, rank, seq, timeout_s, status)) return;
  if (hi > lo) sum_range(base, world, slot_bytes, seq, rank, in, lo, hi, out, dtype);
}

// Rank q's nbytes land at out + q * out_stride (nbytes <= slot_bytes).
void lane_shm_all_gather(void* base_, int world, int rank, int64_t slot_bytes, int64_t seq, const void* in,
                         int64_t nbytes, void* out, int64_t out_stride, double timeout_s, int32_t* status) {
  char* base = static_cast<char*>(base_);
  publish_copy(slot(base, world, slot_bytes, seq, rank), in, nbytes);
  if (barrier(base, world, rank, seq, timeout_s, status)) return;
  for (int q = 0; q < world; ++q)
    std::memcpy(static_cast<char*>(out) + q * out_stride, q == rank ? in : slot(base, world, slot_bytes, seq, q),
                nbytes);
}

// Each rank posts its whole send buffer (in_bytes <= slot_bytes); this rank's piece from rank q
// is src_len[q] bytes at src_off[q] of q's buffer, and the pieces land in out in rank order.
void lane_shm_all_to_all(void* base_, int world, int rank, int64_t slot_bytes, int64_t seq, const void* in,
                         int64_t in_bytes, const int64_t* src_off, const int64_t* src_len, void* out,
                         double timeout_s, int32_t* status) {
  char* base = static_cast<char*>(base_);
  publish_copy(slot(base, world, slot_bytes, seq, rank), in, in_bytes);
  if (barrier(base, world, rank, seq, timeout_s, status)) return;
  char* dst = static_cast<char*>(out);
  for (int q = 0; q < world; ++q) {
    const char* src = q == rank ? static_cast<const char*>(in) : slot(base, world, slot_bytes, seq, q);
    std::memcpy(dst, src + src_off[q], src_len[q]);
    dst += src_len[q];
  }
}

}  // extern "C"
