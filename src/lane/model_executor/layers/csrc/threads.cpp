// Binds each thread of the OpenMP pool (torch's and the kernels': one libgomp) to one CPU,
// as vLLM's CPU worker does: a thread that stays on its core keeps its cache warm and is
// never queued behind a sibling that migrated onto the same core.
#include <omp.h>
#include <sched.h>

#include <cstdint>

// cpus[i] for thread i of an n-thread team; returns how many threads failed (0: all bound)
extern "C" void lane_bind_threads(const int32_t* cpus, int n, int32_t* failed) {
  int bad = 0;
#pragma omp parallel num_threads(n) reduction(+ : bad)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[omp_get_thread_num()], &set);
    bad += sched_setaffinity(0, sizeof(set), &set) != 0;  // 0: the calling thread
  }
  *failed = bad;
}
