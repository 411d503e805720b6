// The arithmetic rate of each of the first two CPUs, alone and both at once, in rounds: 512-bit
// float32 multiply-adds (`vfmadd`) and 8-bit dot products (`vpdpbusd`), each as 12 independent
// chains (no memory traffic), so a round reads what the core itself gives. On a VM the rate moves
// with the host's other work on the same cores (benchmarks/README.md, "The host's share of the
// cores moves"); the float32 rate bounds what a float32 verification step can cost.
//
//     g++ -O2 -march=native -pthread -o /tmp/core_rate benchmarks/core_rate.cpp
//     flock /tmp/verispec-cpu.lock /tmp/core_rate [ROUNDS] [PAUSE_MS]
//
// Each line: ns per iteration of 12 instructions on CPU 0 alone, CPU 1 alone, then both at once
// (0 and 1); the last lines give the best rate seen as G multiply-adds a second per core.
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
namespace {

constexpr long kIters = 2000000;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

// ns per iteration of 12 float32 multiply-adds (16 lanes each).
double fma_ns() {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * i);
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-7f);
  const double t = now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);  // in registers, unrolled
  }
  const double s = now() - t;
  alignas(64) float keep[16];
  for (int i = 1; i < 12; ++i) a[0] = _mm512_add_ps(a[0], a[i]);
  _mm512_store_ps(keep, a[0]);
  if (keep[0] == 42.0f) std::printf(" ");  // keeps the chains
  return s / kIters * 1e9;
}

// ns per iteration of 12 `vpdpbusd` (64 8-bit products each).
double vnni_ns() {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5);
  const double t = now();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
  }
  const double s = now() - t;
  alignas(64) int keep[16];
  for (int i = 1; i < 12; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
  _mm512_store_si512(keep, a[0]);
  if (keep[0] == 42) std::printf(" ");
  return s / kIters * 1e9;
}

// {cpu 0 alone, cpu 1 alone, cpu 0 beside 1, cpu 1 beside 0}
template <typename F>
void rates(F f, double* out) {
  pin(0);
  out[0] = f();
  std::thread([&] { pin(1); out[1] = f(); }).join();
  std::thread other([&] { pin(1); out[3] = f(); });
  out[2] = f();
  other.join();
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  const int pause_ms = argc > 2 ? std::atoi(argv[2]) : 500;
  double best_fma = 1e9, best_vnni = 1e9;
  for (int r = 0; r < rounds; ++r) {
    double a[4], v[4];
    rates(fma_ns, a);
    rates(vnni_ns, v);
    for (double x : a) best_fma = std::min(best_fma, x);
    for (double x : v) best_vnni = std::min(best_vnni, x);
    std::printf("fma %.2f %.2f both %.2f %.2f | vpdpbusd %.2f %.2f both %.2f %.2f (ns per 12)\n", a[0], a[1], a[2],
                a[3], v[0], v[1], v[2], v[3]);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
  }
  std::printf("best float32 multiply-adds: %.1f G a second per core\n", 12 * 16 / best_fma);
  std::printf("best vpdpbusd: %.2f G instructions (%.1f G 8-bit products) a second per core\n", 12 / best_vnni,
              12 * 64 / best_vnni);
}
#else
int main() {
  std::printf("core_rate needs AVX-512 with VNNI (build with -march=native on such a CPU)\n");
  return 1;
}
#endif
