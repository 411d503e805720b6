// CPU kernels for verispec.models.fast_llama: one call runs a whole Llama-style forward.
//
// Why a hand-written forward: decoding a small model on a CPU is bound by reading the weights
// (538 MB per step for SmolLM2-135M in float32), and verifying k draft tokens must not read them k
// times. `linear` streams each block of weight rows from memory once and applies it to every input
// row while it sits in L1. Running the layer loop here, not in Python, removes ~10 dispatches per
// layer.
//
// Determinism (the property speculative greedy decoding relies on): every output element of every
// reduction (matmul dot products, attention scores, softmax sums, attention outputs, RMS norms) is
// computed by code whose operation order depends only on that element's own inputs, never on how
// many tokens or rows share the call, nor on how work is split over threads. So a token's logits
// are bitwise the same whether it is fed alone (T=1) or with draft tokens (T=5), in any batch.
//
// Weights are float32, bfloat16 or int8 (symmetric, one float32 scale per weight row). int8 weights
// meet int16 activations: each input row of a matrix product is quantised to int16 with one scale
// (max |x| / 32767, rounded to nearest), the dot products are summed exactly in integers, and the
// sum is multiplied by the row's and the weight row's scales once at the end. Quantising a row
// depends only on that row and an integer sum on no order, so the property above still holds.
// Why: widening int8 weights to float cost 2 instructions per 8 weights and made int8 compute-bound
// beyond one input row; vpmaddwd (AVX2) or vpdpwssd (AVX512-VNNI, when compiled with it) multiplies
// 16 weights by 16 activations in one or two. int4 (a Q4_1 GGUF's own 4-bit blocks, `q4_tile`) meets
// the same int16 rows; w4a8 (the same blocks, `q4a8_tile`) rounds each block of 32 activations to
// 8 bits with its own scale. Both depend only on the row, so the property holds for them too.
//
// The KV cache is float32 or float16 (FastLlama chooses float16 for every format but float32).
// A key or value is rounded once, when written, and widens exactly to float32 whenever it is read,
// so the property above holds for either. At long contexts decoding reads the cache about as much
// as the int8 weights (SmolLM2-135M at 1500 tokens: 69 MB of float32 keys and values, 135 MB of
// weights); on the Xeon float16 took an int8 step at 800 cached tokens from 13.6 to 12.0 ms (one
// token) and 18.6 to 16.4 ms (five; min of 8 interleaved rounds; benchmarks/SESSIONS.md, session 14).
//
// Compiled at first use by torch.utils.cpp_extension.load with -mavx2 -mfma (and -mavx512vnni
// -mavx512vl -mavx512bw where the CPU has them; every build gives bitwise the same integers; and
// -mavx512f on AVX-512 CPUs, for `tile2p_z` and `tile_blocks_z`, whose float32 products are bitwise
// those of the 256-bit tiles; and -mamx-tile -mamx-int8 where the CPU has AMX, for `linear_amx`,
// whose int8 products are bitwise those of the VNNI tiles).

// The headers are the parts of torch this file uses, not <torch/extension.h>: that one (all of
// torch's C++ API) took 52 s of the 85 s build on a 2-core Zen 3 EPYC, these take 21 s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <immintrin.h>
#include <pybind11/stl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/csrc/utils/pybind.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using bf16 = uint16_t;
using i8 = int8_t;
struct f16 {  // IEEE half precision, the int8 and bfloat16 formats' key-value cache
  uint16_t bits;
};

// How `linear` reads paired weights: which tiles serve passes of few input rows, and whether a pass
// of one row prefetches in software. It never changes any output (every tile forms each element in
// the same order), only the speed, and the best choice depends on the CPU. So FastLlama measures it
// once per machine (verispec/models/schedule.py) and gives it to its kernel object
// (`FastLlamaKernel::set_schedule`), which passes it to every `linear` call. The defaults are the
// 2-core AMD EPYC's (Zen 4), where one stream per core with the hardware prefetcher alone reads at
// full bandwidth. On a 2-core Intel Xeon with AVX-512 (session 11, all of SmolLM2's matrices, 2
// threads, min of 8-10 interleaved rounds, ms, defaults -> two-pair tiles from one row and the
// prefetch on one row): int8 1 row 10.7 -> 8.2, 2 rows 8.4 -> 8.5; float32 1 row 29.4 -> 23.8, 2
// rows 28.4 -> 24.8, 9 rows 41.2 -> 35.6; bfloat16 1 row 19.2 -> 14.5, 2 rows 16.1 -> 14.6. On the
// EPYC the same changes cost: two streams at 2 float rows 15.3 -> 17.3 ms, the prefetch on one row
// 10-25% of the bandwidth.
struct Schedule {
  int64_t two_pair_rows_float = 5;  // passes of at least this many rows use tile2p (float32, bf16)
  int64_t two_pair_rows_int8 = 2;   // ... tile_q2p (int8)
  bool prefetch_one_row = false;    // software prefetch in a paired pass of one input row
  int64_t wide_float_rows = 6;      // paired float32 products of at least this many input rows
                                    // use 512-bit tiles (`tile2p_z`) where compiled; 0: never
  int64_t wide_int8_rows = 5;       // ... paired int8 ones (`tile_q2p_z`, where AVX-512 VNNI is)
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// int8 -> f32 is exact (sign-extend to int32, convert); the memory-operand form of vpmovsxbd
// reads exactly the 8 bytes.
inline __m256 load8(const i8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// f16 -> f32 is exact (F16C).
inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float to_f32(float v) { return v; }
inline float to_f32(f16 v) { return _cvtsh_ss(v.bits); }
inline float to_f32(i8 v) { return static_cast<float>(v); }
inline float to_f32(bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Horizontal sum in one fixed lane order, shared by every reduction below.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of each of a[0 .. 8) into out[0 .. 8), bitwise: hsum(v) adds t_l = v_l + v_(l+4), then
// u_0 = t_0 + t_2 and u_1 = t_1 + t_3, then u_0 + u_1, and the three shuffle-and-add rounds below
// pair the same lanes for all eight at once (a quarter of the instructions of eight hsums).
inline void hsum8(const __m256 (&a)[8], float* out) {
  __m256 t[4];  // t[i]: [t of a[2i] | t of a[2i + 1]]
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  __m256 u[2];  // u[i], per 128-bit lane: [u_0, u_1 of a[4i] (+1), u_0, u_1 of a[4i + 2] (+1)]
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // u_0 + u_1 of each (a[0], a[2], a[4], a[6], a[1], ... in its lanes), stored in order
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The end of one output element, shared by the tiles: times the row's scale, plus its bias, stored
// or added to what `out` holds.
inline void finish_dot(float s, const float* scale, const float* bias, int64_t j, float* out,
                       bool accumulate) {
  if (scale != nullptr) s *= scale[j];
  if (bias != nullptr) s += bias[j];
  *out = accumulate ? *out + s : s;
}

// Pair-interleaved weights: rows 2p and 2p + 1 alternate in chunks of kPairChunk weights (one
// load's worth: 8 float32 or bfloat16, 16 int8), [N / 2][K / C][2][C], so that the tile of a pair
// reads one contiguous stream. Row-major tiles of 4 rows read 4 streams at once, and one core then
// streamed 18-23 GB/s where its sum over the same bytes read 27-30 (float32, 1 input row, 2-core
// EPYC); pairs read 27-29 (one thread) and 31-34 GB/s (two, against 28). Only the arrangement of
// the weights changes: every output is the same arithmetic, bitwise.
template <typename WT>
constexpr int64_t kPairChunk = std::is_same_v<WT, i8> ? 16 : 8;

// Weights of type WT per 64-byte cache line: the tiles prefetch once per line of each stream.
template <typename WT>
constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(WT));

// Whether an [n, k] weight of this type can be pair-interleaved: whole pairs and whole chunks (no
// scalar tail). FastLlama applies the same rule when it rearranges the weights.
inline bool paired_ok(at::ScalarType t, int64_t n, int64_t k) {
  return n % 2 == 0 && k % (t == at::kChar ? kPairChunk<i8> : kPairChunk<float>) == 0;
}

// acc + x * w in one fused multiply-add, in inline assembly for the reason `dot_acc` gives: the
// intrinsic would keep accumulators beyond 16 out of ymm16-31 (and fold the input loads into
// memory operands, loading each input vector once per weight row).
inline __m256 fma_reg(__m256 x, __m256 w, __m256 acc) {
  asm("vfmadd231ps %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// y[i, j] (+)= bias[j] + dot(x[i, :K], w[j, :K]) * scale[j] for an MR x NR tile (no scale when
// `scale` is null: float32 and bf16 weights).
// Each element has one accumulator chain over K in steps of 8, then hsum, then the scalar tail,
// then the scale: the same sequence whatever MR and NR are, which makes results independent of M.
// `pf` (0: none) is an element offset from each weight row to prefetch alongside, pointing into a
// later block of the stream. Without it loads and FMAs serialise (measured: M=5 costs memory time +
// compute time); with it the next block's DRAM reads overlap this block's arithmetic. One prefetch
// per 64-byte line, into L2 (T1), not L1: measured on the 2-core EPYC (all SmolLM2 matrices,
// float32, min of 13 interleaved rounds), prefetching into L1 at every 32 bytes cost 25.6 / 29.1 ms
// for 1 / 5 input rows, into L2 once per line 19.0 / 19.6 ms, as fast as torch's own sum over the
// same bytes (19.7 ms): the L1 hint evicted the block being computed on and doubled the prefetches.
//
// Weight element (j, k) of the tile is at w[j * rs + k * kp] for k a multiple of 8: rs = K, kp = 1
// for row-major weights; rs = 8, kp = 2 for pair-interleaved ones (`kPairChunk`), where a tile is one
// pair of rows, a single stream that needs no software prefetch for one or two input rows.
template <int MR, int NR, typename WT>
inline void tile(const float* x, int64_t ldx, const WT* w, int64_t K, int64_t rs, int64_t kp,
                 const float* scale, const float* bias, float* y, int64_t ldy, bool accumulate,
                 int64_t pf) {
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * rs + k * kp);
    if (pf != 0 && (k * kp) % kLine<WT> == 0) {  // one prefetch per line of each stream
#pragma GCC unroll 4
      for (int j = 0; j < (kp == 1 ? NR : 1); ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * rs + k * kp + pf), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 4
      // xv loaded once for its NR products (`fma_reg`). With the intrinsic GCC folded each input
      // load into every multiply-add that used it: a 6 x 2 pass loaded 14 vectors per 12
      // multiply-adds, more than a Zen 3 core's load ports take in the 6 cycles those need.
      // Measured there (session 26, /tmp/s26/mb3.py: SmolLM2's 120 layer matrices, 2 threads, two
      // builds alternating, min / median of 10, ms): 64 rows 117.1 / 121.6 -> 106.7 / 109.6, 128
      // rows 237.9 / 240.0 -> 216.3 / 221.2 (63 GMAC/s), 16 rows 33.8 / 34.4 -> 32.4 / 34.3.
      for (int j = 0; j < NR; ++j)
        acc[i][j] = NR > 1 ? fma_reg(xv, wv[j], acc[i][j]) : _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      // kp == 1 only. An explicit fma: with `s += x * w` the compiler contracted the product into
      // the sum in some instantiations and not others, so a row's outputs for K % 8 != 0 depended on
      // how many rows shared the pass (1 or 3 rows against 2 or 4).
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[i * ldx + kk], to_f32(w[j * K + kk]), s);
      finish_dot(s, scale, bias, j, y + i * ldy + j, accumulate);
    }
  }
}

// The 2 x MR accumulators of a pair tile written as one inline-assembly block per step (a00, a01
// for input row 0, ...): their output operands (VS_ACC_MR), and each input row's address from
// x0 (rows 0-2) and x3 (rows 3-5) with the row stride s in bytes (VS_ROW_i). GCC's allocation of
// such loops moves accumulators between registers or to the stack; in one asm block they stay put.
#define VS_ACC_2 [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11)
#define VS_ACC_3 VS_ACC_2, [a20] "+x"(a20), [a21] "+x"(a21)
#define VS_ACC_4 VS_ACC_3, [a30] "+x"(a30), [a31] "+x"(a31)
#define VS_ACC_5 VS_ACC_4, [a40] "+x"(a40), [a41] "+x"(a41)
#define VS_ACC_6 VS_ACC_5, [a50] "+x"(a50), [a51] "+x"(a51)
#define VS_ROWS_2(ROW) ROW("(%[x0])", "a00", "a01") ROW("(%[x0],%[s],1)", "a10", "a11")
#define VS_ROWS_3(ROW) VS_ROWS_2(ROW) ROW("(%[x0],%[s],2)", "a20", "a21")
#define VS_ROWS_4(ROW) VS_ROWS_3(ROW) ROW("(%[x3])", "a30", "a31")
#define VS_ROWS_5(ROW) VS_ROWS_4(ROW) ROW("(%[x3],%[s],1)", "a40", "a41")
#define VS_ROWS_6(ROW) VS_ROWS_5(ROW) ROW("(%[x3],%[s],2)", "a50", "a51")
#define VS_PAIR_IN [w] "r"(wp), [x0] "r"(x0), [x3] "r"(x3), [s] "r"(stride)

// `tile<6, 2>` over one pair of float32 weight rows (rs = 8, kp = 2), its loop one inline-assembly
// block a step: 12 accumulators, the pair's two vectors (ymm13, ymm14) and one input vector
// (ymm15) in exactly 15 ymm registers. GCC's allocation of the same loop kept one accumulator in a
// register it then needed for a weight, and moved it out and back every step (2 moves per 12
// multiply-adds). Each element's multiply-adds are `tile`'s, in the same order, and its end is
// `tile`'s (hsum, finish_dot), so the outputs are bitwise the same; `pf` as in `tile` (each step
// reads one 64-byte line of the pair). Measured on the 2-core Zen 3 EPYC (session 27,
// /tmp/s27/mb.cpp: one layer's shapes, 128 rows, 30 copies of the weights, 2 threads, min of 7):
// 61.9 -> 67.3 GMAC/s with blocks of 8 weight rows, 64.4 -> 71.4 with blocks of 48
// (`kComputeBlockRows`). SmolLM2-135M's float32 prompts on the kernel, both changes, two builds
// over one copy of the weights alternating (/tmp/s27/ab.py, min / median of 8, ms): 128 tokens
// 227.3 / 230.1 -> 196.9 / 204.5 and, in a second run, 226.3 / 232.4 -> 185.9 / 188.7; 288 tokens
// 518.6 / 527.3 -> 459.6 / 467.8 and 529.3 / 542.0 -> 438.9 / 450.6. Splitting K = 1536 into 3
// chunks, the accumulators kept between them, so that 6 input rows fit in L1: 450 against 439 ms
// at 288 tokens, dropped.
#define VS_F_ROW(addr, a0, a1)                                                              \
  "vmovups " addr ", %%ymm15\n\t"                                                           \
  "vfmadd231ps %%ymm13, %%ymm15, %[" a0 "]\n\tvfmadd231ps %%ymm14, %%ymm15, %[" a1 "]\n\t"
inline void tile_pair6(const float* x, int64_t ldx, const float* w, int64_t K, const float* scale,
                       const float* bias, float* y, int64_t ldy, bool accumulate, int64_t pf) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const int64_t stride = ldx * static_cast<int64_t>(sizeof(float));
  for (int64_t k = 0; k + 8 <= K; k += 8) {
    const float* wp = w + 2 * k;
    const float* x0 = x + k;
    const float* x3 = x + 3 * ldx + k;
    if (pf != 0) _mm_prefetch(reinterpret_cast<const char*>(wp + pf), _MM_HINT_T1);
    asm("vmovups (%[w]), %%ymm13\n\tvmovups 32(%[w]), %%ymm14\n\t" VS_ROWS_6(VS_F_ROW)
        : VS_ACC_6 : VS_PAIR_IN : "memory", "xmm13", "xmm14", "xmm15");
  }
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 2; ++j) finish_dot(hsum(acc[i][j]), scale, bias, j, y + i * ldy + j, accumulate);
}
#undef VS_F_ROW

// f(std::integral_constant<int, R>{}) for R = min(mr, MAX), mr >= 1: a pass's row count as a
// compile-time constant, for tiles templated on it.
template <int MAX, int R = 1, typename F>
inline void with_rows(int64_t mr, const F& f) {
  if constexpr (R < MAX) {
    if (mr > R) return with_rows<MAX, R + 1>(mr, f);
  }
  f(std::integral_constant<int, R>{});
}

// One parallel region per forward. A forward makes about 150 parallel calls (five per layer, more in
// a prompt piece); each at::parallel_for opens an OpenMP region of its own, 0.6-1.2 us here before
// any work, against 0.07 us for handing work to a thread that spins on a flag (session 47). So the
// forward runs inside one region (team_drive): its first thread runs the forward and the others
// wait for team_for's chunks, spinning. team_for splits a range exactly as at::parallel_for does
// (the same chunk to the same thread id), so the work each thread does, and every result, is the
// same; outside a team_drive it is at::parallel_for.
struct TeamState {
  static constexpr int kMost = 64;
  struct alignas(64) Slot {
    std::atomic<uint64_t> v{0};
  };
  // The job's fields share the epoch's line: a waiting thread that sees the epoch change has them
  // too, one line taken from the driver's core instead of two in turn (an empty job of two rows
  // across CCDs 874 -> 614 ns, on one CCD 192 -> 169; medians of 12 and 28 readings, session 50).
  alignas(64) std::atomic<uint64_t> epoch{0};  // the last job posted; the threads' done[t] follow it
  void (*call)(const void*, int64_t, int64_t) = nullptr;
  const void* fn = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  int threads = 1;
  bool exit = false;
  Slot done[kMost];
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
};
inline thread_local TeamState* t_team = nullptr;  // set on the thread driving a team
inline thread_local bool t_team_busy = false;     // that thread is inside a job: nested calls run inline

// Waits until `ready()`: spins, then yields to the scheduler, so that more threads than cores (or a
// busy machine) cost time slices instead of a stall.
template <typename F>
inline void team_wait(const F& ready) {
  for (int64_t i = 0; !ready(); ++i) {
    if (i < (1 << 12)) {
      _mm_pause();
    } else {
      sched_yield();
    }
  }
}

// Threads of the parallel calls: the team's inside a team_drive, else at::get_num_threads().
inline int64_t team_threads() { return t_team ? t_team->threads : at::get_num_threads(); }

// f(b0, b1) in a frame of its own. Inlined into team_for, the first thread's chunk made int8's
// one-row products a third slower in that thread (its chunks' cycles, `rdtsc`) and a fifth in the
// other; out of line, they run as fast as in an OpenMP region (session 48). Likely cause: inlined,
// its loop variables sat on the cache lines of the variables that f captures by reference and the
// other threads read all through their chunks, so each of its writes took those lines from them.
template <typename F>
__attribute__((noinline)) void team_chunk(const F& f, int64_t b0, int64_t b1) {
  f(b0, b1);
}

// f(b0, b1) over [begin, end), split as at::parallel_for splits it.
template <typename F>
inline void team_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  TeamState* s = t_team;
  if (s == nullptr || t_team_busy) return at::parallel_for(begin, end, grain, f);
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (!(n > grain && n > 1 && s->threads > 1)) return f(begin, end);
  int64_t tasks = s->threads;
  if (grain > 0) tasks = std::min(tasks, (n + grain - 1) / grain);
  s->call = [](const void* g, int64_t b0, int64_t b1) { (*static_cast<const F*>(g))(b0, b1); };
  s->fn = &f;
  s->begin = begin;
  s->end = end;
  s->chunk = (n + tasks - 1) / tasks;
  const uint64_t job = s->epoch.load(std::memory_order_relaxed) + 1;
  s->epoch.store(job, std::memory_order_release);
  std::exception_ptr own;
  t_team_busy = true;
  try {
    team_chunk(f, begin, std::min(end, begin + s->chunk));
  } catch (...) {
    own = std::current_exception();
  }
  t_team_busy = false;
  for (int t = 1; t < s->threads; ++t)  // every thread, so none still reads this job's fields
    team_wait([&] { return s->done[t].v.load(std::memory_order_acquire) == job; });
  if (own) std::rethrow_exception(own);
  if (s->error) std::rethrow_exception(s->error);
}

// A team thread other than the first: runs its chunk of each job until the driver exits.
inline void team_serve(TeamState* s, int tid) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t job = 0;
    team_wait([&] { return (job = s->epoch.load(std::memory_order_acquire)) != seen; });
    seen = job;
    if (s->exit) return;
    const int64_t b0 = s->begin + tid * s->chunk;  // past the end for threads beyond the tasks
    if (b0 < s->end) {
      t_team_busy = true;
      try {
        s->call(s->fn, b0, std::min(s->end, b0 + s->chunk));
      } catch (...) {
        if (!s->failed.test_and_set()) s->error = std::current_exception();
      }
      t_team_busy = false;
    }
    s->done[tid].v.store(job, std::memory_order_release);
  }
}

// body() on this thread, its team_for calls split over one OpenMP region's threads. Inline (every
// team_for an at::parallel_for) where this thread already drives a team or is in a parallel region.
template <typename B>
inline void team_drive(const B& body) {
  if (t_team != nullptr || at::in_parallel_region() || at::get_num_threads() <= 1) return body();
  TeamState s;
  std::exception_ptr error;
  // No num_threads clause: as at::parallel_for, which avoids it for a bug of GOMP's thread pool.
#pragma omp parallel
  {
    const int tid = omp_get_thread_num();
    if (tid == 0) {
      s.threads = std::min(omp_get_num_threads(), TeamState::kMost);
      t_team = &s;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      t_team = nullptr;
      s.exit = true;
      s.epoch.fetch_add(1, std::memory_order_release);
    } else if (tid < TeamState::kMost) {
      team_serve(&s, tid);
    }
  }
  if (error) std::rethrow_exception(error);
}

// f(m0, m1) over rows 0 .. M - 1, split between the threads: the work done a row at a time between
// the products (their 8-bit activations, the norms, RoPE, the cache writes and SwiGLU). The
// activations alone took 4% of a 128-token w4a8 piece's time on one core while the other waited
// (perf, session 47), and 5% of a 5-token step's (session 48). Through an OpenMP region of its own
// this pays from 8 rows (9 and 13 tokens 0.7-1.7% faster than from 16; from 4, five tokens no
// faster); handed to team_drive's spinning threads, from 2 (a 5-token w4a8 step at 200 cached tokens 4.44 / 4.88 ->
// 4.25 / 4.57 ms, benchmarks/kernel_ab.py min / median, session 48).
constexpr int64_t kParallelRows = 8;
constexpr int64_t kTeamParallelRows = 2;
template <typename F>
inline void rows_in_parallel(int64_t M, const F& f) {
  if (M < (t_team != nullptr ? kTeamParallelRows : kParallelRows)) return f(0, M);
  team_for(0, M, 1, f);
}

// Calls of at most this many rows (decoding steps, verifications) write what the other thread
// reads next with non-temporal stores (`kStoreStream`, `quantize_blocks8`'s `stream`): the products'
// outputs that go to the norms' rows, and the 8-bit block rows the products read. With the two
// vCPUs on different CCDs, an ordinary store to a line the other CCD has read waits for that copy
// to be invalidated, and asking for the lines ahead (`prefetch_for_write`) did not hide it; a
// streaming store leaves the line in memory, where the reader fetches it as it would have from the
// other CCD. A C++ emulation of a five-token step's layer products and the handoffs between them
// spent 2329 / 2531 us per step in each thread's products with ordinary stores, 2045 / 2242 with
// streaming ones, as little as with outputs no thread reads (on one CCD the same either way);
// whole w4a8 steps (benchmarks/kernel_ab.py --placement, 400 rounds, paired medians): five tokens
// 0.939x across CCDs (355 rounds, 5.31 -> 5.00 ms), one token 0.996x; on one CCD 1.00x (45).
constexpr int64_t kStreamRows = 8;

// In calls of at most this many rows the products of int4, w4a8 and int8 form their own input rows
// on each thread (`OwnRows`): w4a8's qkv and gate/up products normalise and quantise every row
// themselves, so its norms' jobs go and no norm output crosses between the threads (five-token
// steps at 200 cached tokens 1.0% faster with the vCPUs on one CCD, 2.3% across; session 53);
// int4's and int8's four products also quantise their own rows (which int8 did on the first
// thread alone), five-token steps 2.2% / 11% (int4) and 2.8% / 6.5% (int8) faster.
constexpr int64_t kOwnRows = 8;

// Calls of at least this many rows in int4 and w4a8 run their layers by rows (`layers_by_rows`),
// and in int8 of at least kRowSplitRowsInt8: there 32-token calls ran 1.8% slower by rows on one
// CCD and 3.8% faster across CCDs, 96-token calls 0.7% / 6.1% faster (benchmarks/kernel_ab.py
// --dtype int8 --placement, 100 rounds, session 52).
constexpr int64_t kRowSplitRows = 32;
constexpr int64_t kRowSplitRowsInt8 = 64;

// How block tiles store an output: added to what y holds (kStoreAdd), and non-temporally
// (kStoreStream; y 64-byte aligned), or neither: set, through the caches.
constexpr int kStoreAdd = 1, kStoreStream = 2;

// An allocator of 64-byte aligned memory, for buffers written a cache line at a time
// (non-temporal stores need it).
template <typename T>
struct Align64 {
  using value_type = T;
  Align64() = default;
  template <typename U>
  Align64(const Align64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const Align64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Align64<U>&) const { return false; }
};
template <typename T>
using Vec64 = std::vector<T, Align64<T>>;

// In a call of M rows, asks for the lines a thread is about to write, `rows` rows of `row_bytes`
// each `stride` bytes apart from p, all at once (PREFETCHW): a line the other thread last read is
// then taken from it while earlier stores still wait, not a store at a time. Only in calls of at
// most kPrefetchWriteRows rows (decoding steps, verifications) and for at most L1's worth: wider
// calls write more than L1 holds ahead (and the head's logits are fresh memory). On the 2-core
// Zen 4 guest (w4a8 steps at 200 cached tokens, medians of four A/B runs, session 49) 2-5% faster
// at 1 and 5 tokens with both threads on one CCD, no change with them on two.
constexpr int64_t kPrefetchWriteRows = 8;
constexpr int64_t kPrefetchWriteBytes = 32 << 10;
inline void prefetch_for_write(int64_t M, const void* p, int64_t rows, int64_t row_bytes, int64_t stride) {
  if (M > kPrefetchWriteRows || rows * row_bytes > kPrefetchWriteBytes) return;
  for (int64_t r = 0; r < rows; ++r) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(r * stride);
    const uintptr_t end = start + static_cast<uintptr_t>(row_bytes);
    for (uintptr_t a = start & ~uintptr_t{63}; a < end; a += 64)
      asm volatile("prefetchw %0" : : "m"(*reinterpret_cast<const char*>(a)));
  }
}
// The same for rows m0 .. m1 - 1 of a [M, n] array of T, each thread writing its rows whole.
template <typename T>
inline void prefetch_rows_for_write(int64_t M, const T* a, int64_t n, int64_t m0, int64_t m1) {
  const int64_t row = n * static_cast<int64_t>(sizeof(T));
  prefetch_for_write(M, a + m0 * n, m1 - m0, row, row);
}

// 16 int8 weights sign-extended to int16.
inline __m256i load16(const i8* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// acc + pairwise sums of x * w (16 int16 products into 8 int32 lanes).
//
// With AVX512-VNNI the instruction is written as inline assembly: for the intrinsic, GCC 12 keeps the
// accumulator in ymm0-15 and copies every accumulator beyond 16 in and out of ymm16-31 at each use
// (24 register moves per iteration in a 6 x 2 tile); "v" lets it sit in any of the 32 registers.
inline __m256i dot_acc(__m256i acc, __m256i x, __m256i w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
#endif
}

// The 8 int32 lanes of each of a, b, c and d summed exactly: [sum a, sum b, sum c, sum d] as
// doubles. int32 -> double is exact and every partial sum stays far below 2^53, so these integer
// sums are the ones tile_q forms (in any order), and they stay in registers.
inline __m256d hsum4_i32(__m256i a, __m256i b, __m256i c, __m256i d) {
  auto half = [](__m256i v) {
    return _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(v)),
                         _mm256_cvtepi32_pd(_mm256_extracti128_si256(v, 1)));
  };
  const __m256d ab = _mm256_hadd_pd(half(a), half(b));  // [a01 b01 a23 b23]
  const __m256d cd = _mm256_hadd_pd(half(c), half(d));  // [c01 d01 c23 d23]
  return _mm256_add_pd(_mm256_permute2f128_pd(ab, cd, 0x20), _mm256_permute2f128_pd(ab, cd, 0x31));
}

// k per flush of the int32 lanes into double: a lane gains at most 2 * 127 * 32767 per 16 k, so
// 4096 k stay below 2^31.
constexpr int64_t kIntChunk = 4096;

// k per flush where the pair tiles add 4 lanes in int32 before leaving for double (`hsum4_quad`,
// `hsum4_z`): 4 lanes over 1024 k stay below 2^31. The tiles take it where K <= 2048 (SmolLM2's
// 576 and 1536); longer rows keep kIntChunk and `hsum4_i32`, whose rarer flushes cost less there
// (K = 4096, 9 rows: 81.0 us a product in 4096-k chunks, 93.9 in 1024-k ones).
constexpr int64_t kQuadChunk = 1024;

// Whether a pair tile over rows of K columns adds its lanes four at a time (`hsum4_quad`,
// `hsum4_z`, flushing every kQuadChunk columns) or through `hsum4_i32` (every kIntChunk).
inline bool quad_sums(int64_t K) { return K <= 2 * kQuadChunk; }

// Columns between a pair tile's flushes of its int32 lanes into double, by `quad_sums`.
inline int64_t flush_chunk(int64_t K) { return quad_sums(K) ? kQuadChunk : kIntChunk; }

// `hsum4_i32` for lanes of at most 2^31 / 4 in magnitude: each of a, b, c and d's 8 lanes summed
// four at a time in int32, then the two halves in double. The same exact integers, with fewer
// conversions and no horizontal adds.
inline __m256d hsum4_quad(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
  // per 128-bit half: [a, b, c, d], each the sum of 4 lanes (0-3, then 4-7)
  const __m256i q = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
  return _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(q)),
                       _mm256_cvtepi32_pd(_mm256_extracti128_si256(q, 1)));
}

// The MR x NR accumulators of an int8 tile summed exactly into `total` (`hsum4_i32`), four at a
// time, flattened row by row: lane l of total[g] gains the sum of element 4g + l, (i, j) being
// element i * NR + j. These sums left the registers one at a time through the stack, into int64,
// and that end took 37% of the 6 x 2 pair tile's time (K = 576: 36 steps of 16; perf on a 2-core
// Zen 3 EPYC). With this and `tile_q_pair`'s end two rows at a time, SmolLM2-135M in int8, two
// builds over one copy of the weights alternating (session 28, /tmp/s28/ab.py, min / median of 8,
// ms): prompt of 128 tokens 175.1 / 177.3 -> 134.4 / 137.2; greedy step at 200 cached tokens,
// 5 tokens 9.71 / 9.89 -> 8.49 / 8.58, 2 tokens 6.70 / 7.14 -> 5.96 / 6.46, 1 token 6.17 / 6.61 ->
// 5.89 / 6.39. Bitwise the same outputs.
template <int MR, int NR>
inline void add_sums(const __m256i (&acc)[MR][NR], __m256d* total) {
  constexpr int n = MR * NR;
  const __m256i z = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int g = 0; 4 * g < n; ++g) {
    __m256i v[4];
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) v[l] = 4 * g + l < n ? acc[(4 * g + l) / NR][(4 * g + l) % NR] : z;
    total[g] = _mm256_add_pd(total[g], hsum4_i32(v[0], v[1], v[2], v[3]));
  }
}

// The int8 x int16 form of `tile`: x is [MR, K] int16 with one scale per row (xs), w [NR, K] int8
// with one scale per row (scale).
// Strides rs and kp as in `tile` (pair-interleaved int8: rs = 16, kp = 2). `pf` as in `tile`, or
// negative: prefetch -pf ahead with the non-temporal hint (`kQuietPrefetch`).
template <int MR, int NR>
inline void tile_q(const int16_t* x, int64_t ldx, const float* xs, const i8* w, int64_t K,
                   int64_t rs, int64_t kp, const float* scale, const float* bias, float* y,
                   int64_t ldy, bool accumulate, int64_t pf) {
  constexpr int G = (MR * NR + 3) / 4;
  __m256d total[G];
  for (int g = 0; g < G; ++g) total[g] = _mm256_setzero_pd();
  const int64_t kv = K - K % 16;
  for (int64_t c0 = 0; c0 < kv; c0 += kIntChunk) {
    const int64_t c1 = std::min(kv, c0 + kIntChunk);
    __m256i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
    for (int64_t k = c0; k < c1; k += 16) {
      __m256i wv[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) wv[j] = load16(w + j * rs + k * kp);
      if (pf > 0 && (k * kp) % kLine<i8> == 0) {
#pragma GCC unroll 4
        for (int j = 0; j < (kp == 1 ? NR : 1); ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * rs + k * kp + pf), _MM_HINT_T1);
      } else if (pf < 0 && (k * kp) % kLine<i8> == 0) {  // `kQuietPrefetch`
#pragma GCC unroll 4
        for (int j = 0; j < (kp == 1 ? NR : 1); ++j)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * rs + k * kp - pf), _MM_HINT_NTA);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * ldx + k));
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[i][j] = dot_acc(acc[i][j], xv, wv[j]);
      }
    }
    add_sums<MR, NR>(acc, total);
  }
  alignas(32) double sums[4 * G];
  for (int g = 0; g < G; ++g) _mm256_store_pd(sums + 4 * g, total[g]);
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      double t = sums[i * NR + j];  // an exact integer, as every partial sum below
      for (int64_t kk = kv; kk < K; ++kk) t += int32_t(x[i * ldx + kk]) * int32_t(w[j * K + kk]);  // kp == 1
      const float s = static_cast<float>(t * xs[i] * scale[j]);
      finish_dot(s, nullptr, bias, j, y + i * ldy + j, accumulate);  // scaled above, in double
    }
  }
}

#if !defined(__AVX512VL__)
// `tile_q<MR, 2>` over one pair of int8 weight rows (rs = 16, kp = 2) for 2 to 6 input rows, its
// loop one inline-assembly block per step of 16 (`VS_ACC_2`): the MR x 2 accumulators in ymm0-11, the
// pair's 16 codes of each row widened to int16 in ymm12 / ymm13, an input vector in ymm14 and a
// product in ymm15. For the intrinsics GCC kept four of a 5 x 2 tile's accumulators on the stack,
// moved the others between registers, and loaded each input vector twice. The integer sums are
// exact, so the outputs are `tile_q`'s, bitwise. Measured on a 2-core Zen 3 EPYC (session 27,
// SmolLM2-135M in int8, two builds over one copy of the weights alternating, /tmp/s27/ab.py, min /
// median, ms): prompts of 128 tokens 264.4 / 268.2 -> 181.3 / 190.7 and of 64 tokens 132.3 / 134.7
// -> 89.4 / 91.9 (min of 8); greedy steps at 200 cached tokens (min of 8) 5 tokens 14.2 / 14.5 ->
// 10.7 / 11.0, 1 token (one input row: `tile_q`) 6.0 / 6.3 -> 5.9 / 6.1. The float32 head's int8
// screen over 5 tokens took the same time with either (bound by reading its 28 MB).
#define VS_Q_ROW(addr, a0, a1)                                                            \
  "vmovdqu " addr ", %%ymm14\n\t"                                                         \
  "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\tvpaddd %%ymm15, %[" a0 "], %[" a0 "]\n\t"         \
  "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\tvpaddd %%ymm15, %[" a1 "], %[" a1 "]\n\t"
#define VS_Q_STEP(ROWS, ACC)                                                               \
  asm("vpmovsxbw (%[w]), %%ymm12\n\tvpmovsxbw 16(%[w]), %%ymm13\n\t" ROWS(VS_Q_ROW)      \
      : ACC : VS_PAIR_IN : "memory", "xmm12", "xmm13", "xmm14", "xmm15")
template <int MR>
inline void tile_q_pair(const int16_t* x, int64_t ldx, const float* xs, const i8* w, int64_t K,
                        const float* scale, const float* bias, float* y, int64_t ldy, bool accumulate,
                        int64_t pf) {
  static_assert(MR >= 2 && MR <= 6, "2 to 6 input rows");
  __m256d total[(MR + 1) / 2];
  for (int g = 0; g < (MR + 1) / 2; ++g) total[g] = _mm256_setzero_pd();
  const int64_t kv = K - K % 16;
  const int64_t stride = ldx * static_cast<int64_t>(sizeof(int16_t));
  for (int64_t c0 = 0; c0 < kv; c0 += kIntChunk) {
    const int64_t c1 = std::min(kv, c0 + kIntChunk);
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256i a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (int64_t k = c0; k < c1; k += 16) {
      const i8* wp = w + 2 * k;          // the pair's 16 codes of row 0, then of row 1
      const int16_t* x0 = x + k;         // input rows 0-2 at x0, x0 + ldx, x0 + 2 ldx
      const int16_t* x3 = x + 3 * ldx + k;  // rows 3-5 (read only when MR > 3)
      if (pf != 0 && (2 * k) % kLine<i8> == 0)
        _mm_prefetch(reinterpret_cast<const char*>(wp + pf), _MM_HINT_T1);
      if constexpr (MR == 2) VS_Q_STEP(VS_ROWS_2, VS_ACC_2);
      else if constexpr (MR == 3) VS_Q_STEP(VS_ROWS_3, VS_ACC_3);
      else if constexpr (MR == 4) VS_Q_STEP(VS_ROWS_4, VS_ACC_4);
      else if constexpr (MR == 5) VS_Q_STEP(VS_ROWS_5, VS_ACC_5);
      else VS_Q_STEP(VS_ROWS_6, VS_ACC_6);
    }
    const __m256i all[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    __m256i acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = all[i][0], acc[i][1] = all[i][1];
    add_sums<MR, 2>(acc, total);
  }
  // As tile_q's end (K % 16 == 0), two rows at a time: total[g] holds rows 2g and 2g + 1.
  const __m256d sc = _mm256_setr_pd(scale[0], scale[1], scale[0], scale[1]);
  const __m128 b = bias != nullptr ? _mm_setr_ps(bias[0], bias[1], bias[0], bias[1]) : _mm_setzero_ps();
  for (int g = 0; 2 * g < MR; ++g) {
    const int i = 2 * g;
    const bool two = i + 1 < MR;
    const double s0 = xs[i], s1 = two ? xs[i + 1] : 0.0;
    __m128 s = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_mul_pd(total[g], _mm256_setr_pd(s0, s0, s1, s1)), sc));
    if (bias != nullptr) s = _mm_add_ps(s, b);
    float* o0 = y + i * ldy;
    float* o1 = o0 + ldy;
    if (accumulate) s = _mm_add_ps(_mm_setr_ps(o0[0], o0[1], two ? o1[0] : 0.0f, two ? o1[1] : 0.0f), s);
    _mm_storel_pi(reinterpret_cast<__m64*>(o0), s);
    if (two) _mm_storeh_pi(reinterpret_cast<__m64*>(o1), s);
  }
}
#undef VS_Q_ROW
#undef VS_Q_STEP
#endif
#undef VS_ACC_2
#undef VS_ACC_3
#undef VS_ACC_4
#undef VS_ACC_5
#undef VS_ACC_6
#undef VS_ROWS_2
#undef VS_ROWS_3
#undef VS_ROWS_4
#undef VS_ROWS_5
#undef VS_ROWS_6
#undef VS_PAIR_IN

#if defined(__AVX512VL__)
// The 4 outputs of each of MR input rows from their exact integer sums `total` (`hsum4_i32`), as
// the int8 tiles of 4 weight rows end: (t * xs) * scale in double rounded once to float, then the
// bias, stored or added to what `y` holds.
template <int MR>
inline void finish_q4(const __m256d (&total)[MR], const float* xs, const float* scale, const float* bias,
                      float* y, int64_t ldy, bool accumulate) {
  const __m256d sc = _mm256_cvtps_pd(_mm_loadu_ps(scale));
  const __m128 b = bias != nullptr ? _mm_loadu_ps(bias) : _mm_setzero_ps();
  for (int i = 0; i < MR; ++i) {
    __m128 s = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_mul_pd(total[i], _mm256_set1_pd(xs[i])), sc));
    if (bias != nullptr) s = _mm_add_ps(s, b);
    float* out = y + i * ldy;
    _mm_storeu_ps(out, accumulate ? _mm_add_ps(_mm_loadu_ps(out), s) : s);
  }
}

// The pair tiles below also bring the weights 4 KB ahead into L1 wherever they prefetch (`pf`,
// kPrefetchBytes ahead into L2). A 5-token int8 step's products ran at about 10 cycles per step
// of 16 columns, against the 6.5 the same instructions take with their data in L1; the gain
// shows in whole steps, whose weights come from memory (products of one layer's matrix held in L2
// and timed alone ran no faster with it). On the 2-core Xeon
// (SmolLM2-135M int8, greedy step at 200 cached tokens, benchmarks/kernel_ab.py, two builds over
// one copy of the weights, min / median ms): 5 tokens 4.82 / 4.94 -> 4.69 / 4.84 and 4.90 / 5.09
// -> 4.61 / 4.77, 9 tokens 7.83 / 7.97 -> 7.44 / 7.55 (in `tile_q2p_z` alone); then in `tile_q2p`
// too, 1 token 3.13 -> 3.02, 2 3.64 -> 3.40, 3 3.98 -> 3.85, 4 4.60 -> 4.46 (medians). 2 KB ahead
// did as well as 4, 512 bytes no better than none.
constexpr int64_t kNearPrefetch = 4096;

// The pair tiles' prefetch of their two streams at a and b: pf bytes ahead into L2, and
// kNearPrefetch ahead into L1.
inline void prefetch_pairs(const i8* a, const i8* b, int64_t pf) {
  _mm_prefetch(reinterpret_cast<const char*>(a + pf), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(b + pf), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(a + kNearPrefetch), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b + kNearPrefetch), _MM_HINT_T0);
}

// `tile_q` for two pairs of pair-interleaved rows (4 weight rows: w and w + 2K) and MR >= 2 input
// rows: MR x 4 accumulators (up to 24 of AVX-512VL's 32 ymm registers), so each input load feeds 4
// products instead of 2, and the sums leave the registers 4 at a time in double (`hsum4_quad`, or
// `hsum4_i32` for rows longer than 2048).
// Every output is the same: the same exact integer sum, then (t * xs) * scale in double rounded
// once to float, then the bias. Measured against tile_q<MR, 2> (one thread, int8 [1536, 576] from
// L2, GMAC/s): 2 rows 42 -> 65, 3 rows 48 -> 76, 5 rows 52 -> 75, 9 rows 49 -> 84.
template <int MR>
inline void tile_q2p(const int16_t* x, int64_t ldx, const float* xs, const i8* w, int64_t K,
                     const float* scale, const float* bias, float* y, int64_t ldy, bool accumulate,
                     int64_t pf) {
  constexpr int NR = 4;
  const i8* p0 = w;
  const i8* p1 = w + 2 * K;
  __m256d total[MR];
  for (int i = 0; i < MR; ++i) total[i] = _mm256_setzero_pd();
  const bool quad = quad_sums(K);
  const int64_t chunk = flush_chunk(K);
  for (int64_t c0 = 0; c0 < K; c0 += chunk) {  // paired: K % 16 == 0, no tail
    const int64_t c1 = std::min(K, c0 + chunk);
    __m256i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
    for (int64_t k = c0; k < c1; k += 16) {
      __m256i wv[NR];
      wv[0] = load16(p0 + 2 * k);
      wv[1] = load16(p0 + 2 * k + 16);
      wv[2] = load16(p1 + 2 * k);
      wv[3] = load16(p1 + 2 * k + 16);
      if (pf != 0 && (2 * k) % kLine<i8> == 0) prefetch_pairs(p0 + 2 * k, p1 + 2 * k, pf);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * ldx + k));
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[i][j] = dot_acc(acc[i][j], xv, wv[j]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      total[i] = _mm256_add_pd(total[i], quad ? hsum4_quad(acc[i][0], acc[i][1], acc[i][2], acc[i][3])
                                              : hsum4_i32(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
  }
  finish_q4<MR>(total, xs, scale, bias, y, ldy, accumulate);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Most input rows per pass of `tile_q2p_z`: with 10 or more (20 accumulators) the compiler spills
// (10 rows 11.1 ms against two passes of 5, 7.5; 12 rows 12.9 against 8.2).
constexpr int64_t kWideInt8MostRows = 9;

// The exact sums of the 8 int32 lanes of each of four weight rows' chains for one input row, from
// P = [row a's 8 lanes | row b's] and Q = [c | d]: [sum a, sum b, sum c, sum d] as doubles. Lanes
// are added in int32 four at a time (`kQuadChunk` keeps those sums in range), then the two halves
// in double: the same exact integers `hsum4_i32` forms, so the same outputs, in about a third of
// its instructions. Its conversions and horizontal adds, once per input row and 4 weight rows,
// took about 3 cycles per step of a 5-row tile over SmolLM2's 576 columns (36 steps). On the
// 2-core Xeon, one product of [3072, 576] int8 weights from L2 (/tmp/s35/shapes_ab.py, min of 8,
// builds alternating in one process): 5 rows 41.9 -> 34.5 us, 9 rows 70.6 -> 62.4; greedy steps
// with this and `hsum4_quad` in `tile_q2p` (benchmarks/kernel_ab.py, min / median ms): 1 token
// 3.05 / 3.33 -> 3.00 / 3.21, 2 3.47 / 3.75 -> 3.35 / 3.56, 3 3.91 / 4.13 -> 3.78 / 3.97, 5 4.84 /
// 4.98 -> 4.41 / 4.62, 9 7.76 / 7.87 -> 7.08 / 7.21. `hsum4_quad` over P's and Q's 256-bit halves
// (one reduction for both tiles) ran slower: 5 tokens 4.64 -> 4.71, 9 tokens 7.31 -> 7.72 (medians).
inline __m256d hsum4_z(__m512i P, __m512i Q) {
  // Per 128-bit lane: [a0 + a2, c0 + c2, a1 + a3, c1 + c3] (a's lanes 0-3; the next lane holds 4-7,
  // then b's, as for a).
  const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi32(P, Q), _mm512_unpackhi_epi32(P, Q));
  const __m512i t = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_BADC));  // [a0-3, c0-3, ..]
  const __m512i g = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 8, 1, 9, 4, 12, 5, 13, 0, 0, 0, 0, 0, 0, 0, 0), t);  // [a b c d](0-3) [a b c d](4-7)
  const __m256i h = _mm512_castsi512_si256(g);
  return _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(h)),
                       _mm256_cvtepi32_pd(_mm256_extracti128_si256(h, 1)));
}

inline __m512i dot_acc_z(__m512i acc, __m512i x, __m512i w) {  // as dot_acc, 32 products
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// `tile_q2p` in 512-bit registers: the 16 codes of a step for both rows of a pair (their
// pair-interleaved layout puts them side by side) widened into one register, and the input's 16
// values broadcast to both halves, so each instruction multiplies for two weight rows. The integer
// sums are exact, so every output is the same as `tile_q2p`'s (and `tile_q`'s). Used for calls of
// `Schedule::wide_int8_rows` input rows or more (`tile_rows_q_wide`): measured on a 2-core Zen 5
// EPYC (SmolLM2-135M int8 at 200 cached tokens, greedy step, min of 14, ms, in one process,
// `tile_q2p` / this in every paired pass of 2 or more rows), 2 rows 4.56 / 4.71, 4 4.49 / 4.73, 5
// 4.97 / 4.63 and 5.85 / 5.20 (two runs): below 5 rows the step waited on memory, and the wider
// tile cost a few percent (the `one-stream` schedule keeps 5). On the 2-core Xeon, with both
// tiles' cheaper sums (`hsum4_quad`, `hsum4_z`), this tile won from 2 rows (benchmarks/kernel_ab.py,
// medians, ms, from 5 rows / from 3: 3 tokens 4.12 / 3.77, 4 tokens 4.58 / 4.16; from 3 / from 2: 2
// tokens 3.57 / 3.43; from 2 / from 1: 1 token 3.26 / 3.25), so `two-stream` takes it from 2.
template <int MR>
inline void tile_q2p_z(const int16_t* x, int64_t ldx, const float* xs, const i8* w, int64_t K,
                       const float* scale, const float* bias, float* y, int64_t ldy, bool accumulate,
                       int64_t pf) {
  const i8* p0 = w;
  const i8* p1 = w + 2 * K;
  __m256d total[MR];
  for (int i = 0; i < MR; ++i) total[i] = _mm256_setzero_pd();
  const bool quad = quad_sums(K);
  const int64_t chunk = flush_chunk(K);
  for (int64_t c0 = 0; c0 < K; c0 += chunk) {  // paired: K % 16 == 0, no tail
    const int64_t c1 = std::min(K, c0 + chunk);
    __m512i acc[MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int64_t k = c0; k < c1; k += 16) {
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 2 * k)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 2 * k)));
      if (pf != 0 && (2 * k) % kLine<i8> == 0) prefetch_pairs(p0 + 2 * k, p1 + 2 * k, pf);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * ldx + k)));
        acc[i][0] = dot_acc_z(acc[i][0], xv, w0);
        acc[i][1] = dot_acc_z(acc[i][1], xv, w1);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      total[i] = _mm256_add_pd(
          total[i], quad ? hsum4_z(acc[i][0], acc[i][1])
                         : hsum4_i32(_mm512_castsi512_si256(acc[i][0]), _mm512_extracti64x4_epi64(acc[i][0], 1),
                                     _mm512_castsi512_si256(acc[i][1]), _mm512_extracti64x4_epi64(acc[i][1], 1)));
  }
  finish_q4<MR>(total, xs, scale, bias, y, ldy, accumulate);
}
#endif

template <int MR>
inline void tile_rows_q(const int16_t* x, int64_t ldx, const float* xs, const i8* w, int64_t K,
                        int64_t nr, const float* scale, const float* bias, float* y, int64_t ldy,
                        bool acc, int64_t pf, bool paired, int64_t two_pair_from) {
  int64_t j = 0;
  if (paired) {  // pair p starts where row 2p would (p * 2K)
#if defined(__AVX512VL__)
    if (MR >= two_pair_from) {  // else single-pair tiles: one stream from memory
      for (; j + 4 <= nr; j += 4)
        tile_q2p<MR>(x, ldx, xs, w + j * K, K, scale + j, bias ? bias + j : nullptr, y + j, ldy,
                     acc, pf);
    }
#endif
    for (; j + 2 <= nr; j += 2) {
#if !defined(__AVX512VL__)
      if constexpr (MR >= 2) {
        tile_q_pair<MR>(x, ldx, xs, w + j * K, K, scale + j, bias ? bias + j : nullptr, y + j, ldy, acc, pf);
        continue;
      }
#endif
      tile_q<MR, 2>(x, ldx, xs, w + j * K, K, kPairChunk<i8>, 2, scale + j,
                    bias ? bias + j : nullptr, y + j, ldy, acc, pf);
    }
    return;
  }
  constexpr int NR = MR >= 3 ? 2 : 4;
  for (; j + NR <= nr; j += NR)
    tile_q<MR, NR>(x, ldx, xs, w + j * K, K, K, 1, scale + j, bias ? bias + j : nullptr, y + j, ldy,
                   acc, pf);
  for (; j < nr; ++j)
    tile_q<MR, 1>(x, ldx, xs, w + j * K, K, K, 1, scale + j, bias ? bias + j : nullptr, y + j, ldy,
                  acc, pf);
}

inline void tile_any_q(int64_t mr, const int16_t* x, int64_t ldx, const float* xs, const i8* w,
                       int64_t K, int64_t nr, const float* scale, const float* bias, float* y,
                       int64_t ldy, bool acc, int64_t pf, bool paired, int64_t two_pair_from) {
  const int64_t f = two_pair_from;
  switch (mr) {
    case 1: return tile_rows_q<1>(x, ldx, xs, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 2: return tile_rows_q<2>(x, ldx, xs, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 3: return tile_rows_q<3>(x, ldx, xs, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 4: return tile_rows_q<4>(x, ldx, xs, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 5: return tile_rows_q<5>(x, ldx, xs, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    default: return tile_rows_q<6>(x, ldx, xs, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Paired int8 weights with tile_q2p_z, up to kWideInt8MostRows input rows per pass, for calls of at
// least `Schedule::wide_int8_rows` rows: a verification of 9 tokens reads each block of weights once. Measured
// as `tile_q2p_z`'s figures, ms, 256-bit tiles in passes of up to 6 / these: 8 rows 7.67 / 5.76, 9
// 8.22 / 6.66, 12 10.60 / 8.20, 16 13.75 / 10.32.
template <int MR>
inline void tile_rows_q_wide(const int16_t* x, int64_t ldx, const float* xs, const i8* w, int64_t K,
                             int64_t nr, const float* scale, const float* bias, float* y, int64_t ldy,
                             bool acc, int64_t pf) {
  int64_t j = 0;
  for (; j + 4 <= nr; j += 4)
    tile_q2p_z<MR>(x, ldx, xs, w + j * K, K, scale + j, bias ? bias + j : nullptr, y + j, ldy, acc, pf);
  for (int64_t m = 0; j < nr && m < MR; m += 6)  // a last pair: pair tiles, 6 rows at a time
    tile_any_q(std::min<int64_t>(6, MR - m), x + m * ldx, ldx, xs + m, w + j * K, K, nr - j, scale + j,
               bias ? bias + j : nullptr, y + m * ldy + j, ldy, acc, pf, true, 1);
}

#endif

// A row's int16 scale from its largest magnitude `amax` and whether it holds a NaN: xs = amax / 32767
// and the factor 32767 / amax its values are multiplied by; a row that is zero, or holds a NaN or an
// inf, keeps nothing meaningful and gets xs = 0, factor 0 (the caller zeroes it).
inline float row_scale(float amax, bool nan, float* xs) {
  if (nan || !(amax > 0.0f) || !std::isfinite(amax)) {
    *xs = 0.0f;
    return 0.0f;
  }
  *xs = amax / 32767.0f;
  return 32767.0f / amax;
}

// Each row of x [M, K] (stride ldx) as int16 q [M, K] and scale xs [M]: x ~= q * xs, with
// xs = max |x| / 32767 and q rounded to nearest (ties to even); an all-zero row gets xs = 0.
inline void quantize_rows_i16(const float* x, int64_t M, int64_t ldx, int64_t K, int16_t* q,
                              float* xs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * ldx;
    int16_t* o = q + m * K;
    __m256 vmax = _mm256_setzero_ps();
    __m256 vnan = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_loadu_ps(r + k);
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, abs_mask));
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.0f;
    for (int i = 0; i < 8; ++i) amax = std::max(amax, lanes[i]);
    bool nan = _mm256_movemask_ps(vnan) != 0;
    for (; k < K; ++k) {
      amax = std::max(amax, std::fabs(r[k]));
      nan = nan || std::isnan(r[k]);
    }
    const float inv = row_scale(amax, nan, xs + m);
    if (inv == 0.0f) {
      std::memset(o, 0, K * sizeof(int16_t));
      continue;
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 8 <= K; k += 8) {
      // cvtps rounds to nearest even; packs saturates to +-32767 at most here (|r * inv| <= 32767).
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), vinv));
      const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), p);
    }
    for (; k < K; ++k) {
      const float v = std::nearbyint(r[k] * inv);
      o[k] = static_cast<int16_t>(std::min(32767.0f, std::max(-32767.0f, v)));
    }
  }
}

// int8 products on AMX tiles (Intel's tile matrix unit; built with -mamx-tile -mamx-int8 where the
// CPU has them, used where FastLlama asks for it with `set_amx`; CPUs with AVX-512 VNNI and no AMX
// read the same layout with `linear_vnni_tiles`, below). The int16 activations of
// `quantize_rows_i16` split exactly into bytes, q = 256 * hi + lo with hi = q >> 8 in -128 .. 127
// and lo = q & 255 in 0 .. 255, so a dot product with int8 weights is 256 * (hi . w) + (lo . w):
// one signed x signed tile product (TDPBSSD) and one unsigned x signed (TDPBUSD) per 64 columns
// of up to 16 input rows and 16 weight rows, each summed exactly in int32 (|lo . w| <= 255 * 127 *
// K < 2^31 for K <= 65536). These are the very integers `tile_q` sums, scaled by the same double
// products once at the end, so every output is bitwise the VNNI tiles'. One tile product
// multiplies a 64 x 16 block of weights by up to 16 input rows at once.
//
// The weights are held once more, as tiles: [N / 16][K / 64][16][16][4] (`amx_pack`), each tile 1 KB
// read as one stream: row g holds columns 4g .. 4g + 3 of each of the 16 weight rows (the layout
// a tile product's second operand takes). The activations' hi and lo bytes are row-major [M, K].
constexpr int64_t kAmxRows = 16;  // weight rows per tile, input rows per tile product at most
constexpr int64_t kAmxCols = 64;  // columns per tile
constexpr int64_t kAmxTile = kAmxRows * kAmxCols;
// Bytes ahead the first pass over a pair of weight tiles prefetches in each tile's stream, into L2
// (as `linear`'s kPrefetchBytes). SmolLM2-135M in int8 on the Xeon, one kernel switching settings
// round by round, greedy step at 200 cached tokens, 1 / 5 tokens, min / median, ms: (/tmp/s34/sweep.py,
// 30 steps each) 2 KB into L1 4.76 / 5.39, 6.11 / 6.59; 16 KB into L2 4.08 / 4.45, 5.46 / 5.88; 24 KB
// into L2 4.01 / 4.57, 5.34 / 5.87; none 5.29 / 5.69, 6.59 / 6.95; (/tmp/s34/sweep2.py, 40 each)
// 24 KB into L2 3.77 / 4.41, 5.26 / 5.67; into L1 4.08 / 4.63, 5.40 / 6.00; 32 KB alike 24.
constexpr int64_t kAmxPrefetch = 24 * 1024;

// Whether this build has the AMX tiles and the kernel (Linux) lets this process use them.
bool amx_ready() {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, ...)
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Whether `linear_amx` can take w [N, K].
inline bool amx_shape_ok(int64_t n, int64_t k) {
  return n % kAmxRows == 0 && k % kAmxCols == 0 && k <= 65536;
}

// int8 w [N, K], row-major or pair-interleaved (`paired`), -> its tiles [N / 16][K / 64][16][16][4],
// written into `out` (N * K bytes).
void amx_pack(const i8* w, int64_t N, int64_t K, bool paired, i8* o) {
  TORCH_CHECK(amx_shape_ok(N, K), "AMX tiles need N % 16 == 0 and K % 64 == 0, K <= 65536");
  constexpr int64_t C = kPairChunk<i8>;
  const int64_t S = K / kAmxCols;
  team_for(0, N / kAmxRows, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < kAmxRows; ++r) {
        const int64_t n = t * kAmxRows + r;
        for (int64_t k = 0; k < K; ++k) {
          const i8 v = paired ? w[(n / 2) * 2 * K + (k / C) * 2 * C + (n % 2) * C + k % C] : w[n * K + k];
          o[(t * S + k / kAmxCols) * kAmxTile + (k % kAmxCols) / 4 * 64 + r * 4 + k % 4] = v;
        }
      }
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums of input rows with weight tile a (hi, lo), then b (hi, lo), [mc][16] int32; 4, 5:
// the input rows' hi and lo bytes [mc][64]; 6, 7: weight tiles a and b.
inline void amx_configure(int64_t mc) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t < 6 ? mc : kAmxRows);
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif

#if defined(__AVX512F__)
// Each row of x [M, K] (stride ldx) quantised as `quantize_rows_i16` does (the same scale xs [M] and
// the same q, element by element), stored as q's high bytes hi (q >> 8) and low bytes lo (q & 255),
// [M, K] each; K a multiple of 16. One pass less than quantising, then splitting. With
// `offset_hi`, hi holds (q >> 8) + 128 as an unsigned byte instead (`linear_vnni_tiles`).
// With `block_sums` [M, K / 32] (K a multiple of 32), each 32 columns' sum of q, exact in float32
// (|sum| <= 32 * 32767 < 2^24), as the 4-bit blocks' products take it.
inline void quantize_rows_bytes(const float* x, int64_t M, int64_t ldx, int64_t K, i8* hi, uint8_t* lo,
                                float* xs, bool offset_hi = false, float* block_sums = nullptr) {
  const __m512i flip = _mm512_set1_epi32(offset_hi ? 0x80 : 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * ldx;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_loadu_ps(r + k);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float amax = _mm512_reduce_max_ps(vmax);  // max of non-negative values: exact in any order
    const float inv = row_scale(amax, nan != 0, xs + m);
    if (inv == 0.0f) {
      std::memset(hi + m * K, 0, K);
      std::memset(lo + m * K, 0, K);
      if (block_sums != nullptr) std::fill_n(block_sums + m * (K / 32), K / 32, 0.0f);
      continue;
    }
    const __m512 vinv = _mm512_set1_ps(inv);
    __m512i block = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k), vinv));  // |q| <= 32767
      const __m512i h = _mm512_xor_si512(_mm512_srai_epi32(q, 8), flip);  // the low byte: hi, or hi + 128
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + m * K + k), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + m * K + k), _mm512_cvtepi32_epi8(q));
      if (block_sums != nullptr) {
        block = _mm512_add_epi32(block, q);
        if (k % 32 == 16) {
          block_sums[m * (K / 32) + k / 32] = static_cast<float>(_mm512_reduce_add_epi32(block));
          block = _mm512_setzero_si512();
        }
      }
    }
  }
}

// 8 outputs of `tile_q`'s end from their exact sums 256 * h + l (int32 each; exact in double):
// float(t * xs * scale[j]) in double, then the bias, stored or added (`finish_dot`, 8 at once).
inline void finish_amx8(__m256i h, __m256i l, double xs, const float* scale, const float* bias,
                        float* out, bool accumulate) {
  __m512d t = _mm512_fmadd_pd(_mm512_cvtepi32_pd(h), _mm512_set1_pd(256.0), _mm512_cvtepi32_pd(l));
  t = _mm512_mul_pd(_mm512_mul_pd(t, _mm512_set1_pd(xs)), _mm512_cvtps_pd(_mm256_loadu_ps(scale)));
  __m256 s = _mm512_cvtpd_ps(t);
  if (bias != nullptr) s = _mm256_add_ps(s, _mm256_loadu_ps(bias));
  if (accumulate) s = _mm256_add_ps(_mm256_loadu_ps(out), s);
  _mm256_storeu_ps(out, s);
}

// x [M, K] quantised into this thread's buffers by `quantize_rows_bytes`, for the tile products:
// the pointers stay valid for all threads until this thread's next call.
struct ByteRows {
  const float* xs;        // [M]
  const i8* hi;           // [M, K]
  const uint8_t* lo;      // [M, K]
  const float* sums;      // [M, K / 32] with `block_sums`, else null
};
// Buffers for ByteRows of M rows of K: byte_rows and own_byte_rows each keep one per thread.
struct ByteRowBuffers {
  std::vector<float> xs, sums;
  std::vector<i8> hi;
  std::vector<uint8_t> lo;
  struct Out {  // where to write them (sums null without block sums)
    float* xs;
    i8* hi;
    uint8_t* lo;
    float* sums;
  };
  Out size(int64_t M, int64_t K, bool block_sums) {
    xs.resize(M);
    hi.resize(M * K);
    lo.resize(M * K);
    sums.resize(block_sums ? M * (K / 32) : 0);
    return {xs.data(), hi.data(), lo.data(), block_sums ? sums.data() : nullptr};
  }
};

inline ByteRows byte_rows(const float* x, int64_t M, int64_t ldx, int64_t K, bool offset_hi,
                          bool block_sums = false) {
  thread_local ByteRowBuffers buf;
  // This thread's buffers, by pointer: in the workers, the names would be their own thread_locals.
  const ByteRowBuffers::Out o = buf.size(M, K, block_sums);
  rows_in_parallel(M, [=](int64_t m0, int64_t m1) {
    quantize_rows_bytes(x + m0 * ldx, m1 - m0, ldx, K, o.hi + m0 * K, o.lo + m0 * K, o.xs + m0, offset_hi,
                        o.sums ? o.sums + m0 * (K / 32) : nullptr);
  });
  return {o.xs, o.hi, o.lo, o.sums};
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
// y[M, N] (+)= (x[M, K] @ w[N, K]^T) * scale[N] + bias with w as tiles (`amx_pack`): `tile_q`'s
// outputs, bitwise (see above). Threads split pairs of weight tiles; each pair meets every input
// row (in passes of up to 16) while it sits in L1 / L2, and the first pass prefetches ahead.
void linear_amx(const float* x, int64_t M, int64_t ldx, const i8* wt, int64_t N, int64_t K,
                const float* scale, const float* bias, float* y, int64_t ldy, bool accumulate) {
  const ByteRows rows_q = byte_rows(x, M, ldx, K, false);
  const int64_t passes = (M + kAmxRows - 1) / kAmxRows;
  const int64_t mc = (M + passes - 1) / passes;  // input rows per pass (the last may have fewer)
  const int64_t S = K / kAmxCols, tiles = N / kAmxRows;
  const float* qs = rows_q.xs;
  const i8* hp = rows_q.hi;
  const uint8_t* lp = rows_q.lo;
  team_for(0, (tiles + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    int64_t rows = mc;
    amx_configure(rows);
    alignas(64) int32_t c[4][kAmxRows][kAmxRows];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = 2 * p;
      const bool two = t + 1 < tiles;
      const i8* a = wt + t * S * kAmxTile;
      const i8* b = a + S * kAmxTile;
      for (int64_t m0 = 0; m0 < M; m0 += mc) {
        if (std::min(mc, M - m0) != rows) {
          rows = std::min(mc, M - m0);
          amx_configure(rows);
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < S; ++s) {
          if (m0 == 0) {
            for (int64_t line = 0; line < kAmxTile; line += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(a + s * kAmxTile + line) + kAmxPrefetch, _MM_HINT_T1);
              if (two)
                _mm_prefetch(reinterpret_cast<const char*>(b + s * kAmxTile + line) + kAmxPrefetch, _MM_HINT_T1);
            }
          }
          _tile_loadd(4, hp + m0 * K + s * kAmxCols, K);
          _tile_loadd(5, lp + m0 * K + s * kAmxCols, K);
          _tile_loadd(6, a + s * kAmxTile, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbusd(1, 5, 6);
          if (two) {
            _tile_loadd(7, b + s * kAmxTile, 64);
            _tile_dpbssd(2, 4, 7);
            _tile_dpbusd(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (two) {
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
        }
        for (int64_t u = 0; u < (two ? 2 : 1); ++u) {
          const int64_t j = (t + u) * kAmxRows;
          for (int64_t i = 0; i < rows; ++i) {
            const __m512i h = _mm512_load_si512(c[2 * u][i]);
            const __m512i l = _mm512_load_si512(c[2 * u + 1][i]);
            float* out = y + (m0 + i) * ldy + j;
            const double xsi = qs[m0 + i];
            const float* bj = bias ? bias + j : nullptr;
            finish_amx8(_mm512_castsi512_si256(h), _mm512_castsi512_si256(l), xsi, scale + j, bj, out,
                        accumulate);
            finish_amx8(_mm512_extracti64x4_epi64(h, 1), _mm512_extracti64x4_epi64(l, 1), xsi, scale + j + 8,
                        bj ? bj + 8 : nullptr, out + 8, accumulate);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// Whether this build has the bfloat16 attention (`FastLlamaKernel::attention_bf16`): AVX-512 BF16.
bool bf16_attention_ready() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Nanoseconds for a cache line to go from one thread to another and back: the median of 5 trials
// of up to 2048 round trips (each stopped after about 2 ms) between the first two threads of an OpenMP
// region. It tells how far apart the cores are: about 60 ns where they share an L3, over 300 where
// they sit on different CCDs of an AMD EPYC, where every product, norm and cache write of a
// multi-token step pays for the data its threads pass each other (benchmarks/README.md). -1 with
// fewer than two threads.
double core_roundtrip_ns() {
  if (at::get_num_threads() < 2 || at::in_parallel_region()) return -1.0;
  constexpr int64_t kTrips = 2048;
  constexpr double kMostSeconds = 2e-3;
  std::vector<double> trials;
  for (int trial = 0; trial < 5; ++trial) {
    alignas(64) std::atomic<int64_t> flag{0};
    int64_t trips = 0;
    double seconds = 0.0;
    bool pair = true;
#pragma omp parallel
    {
      const int tid = omp_get_thread_num();
      if (tid == 0 && omp_get_num_threads() < 2) pair = false;
#pragma omp barrier
      if (pair && tid == 0) {  // sends 2i + 1, waits for 2i + 2; -1 ends the trial
        const auto start = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < kTrips; ++i) {
          flag.store(2 * i + 1, std::memory_order_release);
          team_wait([&] { return flag.load(std::memory_order_acquire) == 2 * i + 2; });
          trips = i + 1;
          if (trips % 64 != 0 && trips != kTrips) continue;  // the clock every 64 trips
          seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (seconds > kMostSeconds) break;
        }
        flag.store(-1, std::memory_order_release);
      } else if (pair && tid == 1) {
        for (int64_t seen = 0;;) {
          int64_t f = 0;
          team_wait([&] { return (f = flag.load(std::memory_order_acquire)) == -1 || (f > seen && f % 2 == 1); });
          if (f == -1) break;
          seen = f;
          flag.store(f + 1, std::memory_order_release);
        }
      }
    }
    if (!pair) return -1.0;
    trials.push_back(seconds / static_cast<double>(trips) * 1e9);
  }
  std::sort(trials.begin(), trials.end());
  return trials[trials.size() / 2];
}

// Whether this build multiplies int8 weights held as tiles (`amx_pack`'s layout) with AVX-512 VNNI
// (`linear_vnni_tiles`): CPUs without AMX but with VNNI (AMD's Zen 4 and Zen 5, Intel's Ice Lake).
bool vnni_tiles_ready() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// Each weight row's sum over K of the tiles `amx_pack` wrote (N * K bytes): sum[N], exact in int32.
void tile_row_sums(const i8* tiles, int64_t N, int64_t K, int32_t* sum) {
  for (int64_t n = 0; n < N; ++n) sum[n] = 0;
  for (int64_t t = 0; t < N / kAmxRows; ++t)
    for (int64_t q = 0; q < K / 4; ++q)
      for (int64_t r = 0; r < kAmxRows; ++r)
        for (int64_t b = 0; b < 4; ++b) sum[t * kAmxRows + r] += tiles[(t * K / 4 + q) * 64 + r * 4 + b];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The tiles' layout read without AMX: a tile of 16 weight rows is [K / 4][16][4] bytes, so its 64
// bytes at each step of 4 columns are the 16 rows' 4 weights, one 32-bit lane per row, which is
// what `vpdpbusd` multiplies by 4 unsigned bytes broadcast from an input row, adding the 4 products
// into each lane. The activations split as for AMX, q = 256 * hi + lo, with hi offset to an unsigned
// byte (hi + 128, `quantize_rows_bytes`); each lane then holds H = sum (hi + 128) w and L = sum lo w,
// and hi . w = H - 128 * sum w, with each weight row's sum computed once (`tile_row_sums`). Every
// one is an exact integer in int32 for K <= 65536 (|H| <= 255 * 128 * K < 2^31), so the outputs are
// `finish_amx8`'s of the same integers as the AMX and VNNI pair tiles: bitwise theirs.

// acc + the 4-byte dot products of u (unsigned) and w (signed) in each 32-bit lane. In inline assembly,
// as `dot_acc_z`: with the intrinsic GCC moved the accumulators through memory on every step.
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(w));
  return acc;
}

// dpbusd with w the 4 signed bytes at p broadcast to every lane, as the instruction's memory operand.
inline __m512i dpbusd_from(__m512i acc, __m512i u, const uint8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// MR input rows against NT tiles (16 NT weight rows), over all of K, in 2 MR NT accumulators; per
// step of 4 columns, NT loads of weights, 2 MR broadcasts and 2 MR NT `vpdpbusd`. There is no
// widening and no horizontal sum, which a pair tile (`tile_q2p_z`) pays per 16 columns and per row.
// `pf`: prefetch the tiles that far ahead (the first pass over them).
template <int MR, int NT>
inline void vnni_tile(const uint8_t* hi, const uint8_t* lo, int64_t K, const i8* w, int64_t stride,
                      const int32_t* wsum, const float* xs, const float* scale, const float* bias, float* y,
                      int64_t ldy, bool accumulate, int64_t pf) {
  __m512i h[MR][NT], l[MR][NT];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) h[i][u] = l[i][u] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 4) {
    __m512i wv[NT];
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) {
      const i8* at = w + u * stride + 16 * k;
      if (pf != 0 && k % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(at + pf), _MM_HINT_T1);
      wv[u] = _mm512_loadu_si512(at);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      int32_t hv, lv;
      std::memcpy(&hv, hi + i * K + k, 4);
      std::memcpy(&lv, lo + i * K + k, 4);
      const __m512i hb = _mm512_set1_epi32(hv), lb = _mm512_set1_epi32(lv);
#pragma GCC unroll 4
      for (int u = 0; u < NT; ++u) {
        h[i][u] = dpbusd(h[i][u], hb, wv[u]);
        l[i][u] = dpbusd(l[i][u], lb, wv[u]);
      }
    }
  }
#pragma GCC unroll 4
  for (int u = 0; u < NT; ++u) {
    const int64_t j = kAmxRows * u;
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum + j), 7);  // 128 * sum w
    const float* bj = bias ? bias + j : nullptr;
    for (int i = 0; i < MR; ++i) {
      const __m512i d = _mm512_sub_epi32(h[i][u], offset);  // hi . w
      float* out = y + i * ldy + j;
      finish_amx8(_mm512_castsi512_si256(d), _mm512_castsi512_si256(l[i][u]), xs[i], scale + j, bj, out,
                  accumulate);
      finish_amx8(_mm512_extracti64x4_epi64(d, 1), _mm512_extracti64x4_epi64(l[i][u], 1), xs[i], scale + j + 8,
                  bj ? bj + 8 : nullptr, out + 8, accumulate);
    }
  }
}

constexpr int kVnniRows = 4;   // input rows per `vnni_tile` pass
constexpr int kVnniTiles = 3;  // tiles per `vnni_tile` (24 accumulators)

// y[M, N] (+)= (x[M, K] @ w[N, K]^T) * scale[N] + bias with w as tiles (`amx_pack`) and its rows'
// sums (`tile_row_sums`), on AVX-512 VNNI: `tile_q`'s outputs, bitwise (see above). Threads split
// groups of kVnniTiles tiles (48 weight rows); each group meets every input row, kVnniRows at a
// time, while it sits in L1 / L2, and the first pass prefetches ahead (as `linear_amx`).
void linear_vnni_tiles(const float* x, int64_t M, int64_t ldx, const i8* wt, const int32_t* wsum, int64_t N,
                       int64_t K, const float* scale, const float* bias, float* y, int64_t ldy, bool accumulate) {
  const ByteRows rows_q = byte_rows(x, M, ldx, K, true);
  const float* qs = rows_q.xs;
  const uint8_t* hp = reinterpret_cast<const uint8_t*>(rows_q.hi);  // hi + 128
  const uint8_t* lp = rows_q.lo;
  const int64_t tiles = N / kAmxRows, stride = kAmxRows * K;
  team_for(0, (tiles + kVnniTiles - 1) / kVnniTiles, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t = g * kVnniTiles, nt = std::min<int64_t>(kVnniTiles, tiles - t), j = t * kAmxRows;
      for (int64_t m = 0; m < M; m += kVnniRows) {
        const int64_t mr = std::min<int64_t>(kVnniRows, M - m);
        const int64_t pf = m == 0 ? kAmxPrefetch : 0;
        with_rows<kVnniRows>(mr, [&](auto R) {
          with_rows<kVnniTiles>(nt, [&](auto T) {  // the last group may hold fewer tiles
            vnni_tile<decltype(R)::value, decltype(T)::value>(hp + m * K, lp + m * K, K, wt + t * stride, stride,
                                                              wsum + j, qs + m, scale + j, bias ? bias + j : nullptr,
                                                              y + m * ldy + j, ldy, accumulate, pf);
          });
        });
      }
    }
  });
}
#endif

// exp of 8 floats: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), a degree-7 polynomial
// for exp(r) (Cephes' expf coefficients), times 2^n. Inputs are clamped to [-87.3, 88] (2^-126 and
// 2^127 stay normal); relative error about 2 ulp. Every element goes through this same code, so a
// score's weight depends only on the score.
constexpr float kExp8Least = -87.33654f;  // exp8's least input: exp of it is 2^-126
constexpr float kExpLog2e = 1.44269504088896341f, kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(kExp8Least));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), r);
  __m256 q = _mm256_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kExpPoly[i]));
  q = _mm256_fmadd_ps(q, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(q, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp8's operations and constants on 16 lanes: every lane bitwise exp8's, in half the instructions
// per element (the AVX2 build's logits against the AVX-512 build's, tests/test_blocks.py, check it).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(kExp8Least));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
  __m512 q = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kExpPoly[i]));
  q = _mm512_fmadd_ps(q, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(q, _mm512_castsi512_ps(e));
}

// The upper 8 lanes of v.
inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#endif

// out[i] = exp8(x[i] - shift) for i < n < 8, through one padded vector: each the same arithmetic
// as in a whole group of 8.
inline void exp8_tail(const float* x, int64_t n, float shift, float* out) {
  alignas(32) float t[8];
  for (int i = 0; i < 8; ++i) t[i] = i < n ? x[i] - shift : -100.0f;
  _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
  std::memcpy(out, t, n * sizeof(float));
}

// The largest of v's 8 lanes.
inline float hmax(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float mx = lanes[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
  return mx;
}

// s0 += e's lanes 0-3 and s1 += lanes 4-7, widened to double (exact).
inline void add_wide(__m256 e, __m256d& s0, __m256d& s1) {
  s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
  s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

// The sum of v's 4 lanes in a fixed order.
inline double hsum_pd(__m256d v) {
  alignas(32) double d[4];
  _mm256_store_pd(d, v);
  return (d[0] + d[1]) + (d[2] + d[3]);
}

// p[0..n) *= scale, then p[j] = exp(p[j] - max p); returns sum p[j] (8 lanes over j, then the lanes
// in order). Fixed order for a given n, so a query's weights do not depend on other queries. With
// AVX-512 the exponentials go 16 at a time (`exp16`), bitwise the same: a prompt piece of 128
// tokens at 600 cached tokens spent about a tenth of its attention in this loop's 8-lane form
// (perf, session 47).
inline float softmax_numerators(float* p, int64_t n, float scale) {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p + j), vs);
    _mm256_storeu_ps(p + j, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  float mx = hmax(vmax);
  for (; j < n; ++j) {
    p[j] *= scale;
    mx = std::max(mx, p[j]);
  }
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  j = 0;
#if defined(__AVX512F__)
  // 16 at a time through exp16; its two halves join the 8 lanes' sums in the order above.
  for (const __m512 vm16 = _mm512_set1_ps(mx); j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), vm16));
    _mm512_storeu_ps(p + j, e);
    vsum = _mm256_add_ps(_mm256_add_ps(vsum, _mm512_castps512_ps256(e)), high8(e));
  }
#endif
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
    _mm256_storeu_ps(p + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) sum += lanes[i];
  if (j < n) {  // the tail through the same exp8, padded
    exp8_tail(p + j, n - j, mx, p + j);
    for (; j < n; ++j) sum += p[j];
  }
  return sum;
}

#if defined(__AVX512VL__)
// `tile` for two pairs of pair-interleaved float32 or bfloat16 rows (4 weight rows: w and w + 2K)
// and MR >= 2 input rows: MR x 4 accumulators in AVX-512VL's 32 registers, each input vector loaded
// once for 4 products. Every output is the same chain as in `tile` (fma over k in steps of 8, hsum,
// scale, bias), so the results are bitwise the same. One thread, float32 weights from L2, GMAC/s,
// old -> new: 2 rows 26 -> 34, 5 rows 35 -> 48-50, 9 rows 31-36 -> 42-51 (used for 5 or more:
// below).
template <int MR, typename WT>
inline void tile2p(const float* x, int64_t ldx, const WT* w, int64_t K, const float* scale,
                   const float* bias, float* y, int64_t ldy, bool accumulate, int64_t pf) {
  constexpr int64_t C = kPairChunk<WT>;
  const WT* p0 = w;
  const WT* p1 = w + 2 * K;
  __m256 acc[MR][4];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {  // paired: K % 8 == 0, no tail
    __m256 wv[4];
    wv[0] = load8(p0 + 2 * k);
    wv[1] = load8(p0 + 2 * k + C);
    wv[2] = load8(p1 + 2 * k);
    wv[3] = load8(p1 + 2 * k + C);
    if (pf != 0 && (2 * k) % kLine<WT> == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(p0 + 2 * k + pf), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p1 + 2 * k + pf), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[i][j] = fma_reg(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) finish_dot(hsum(acc[i][j]), scale, bias, j, y + i * ldy + j, accumulate);
}
#endif

#if defined(__AVX512F__)
// Eight horizontal sums of four registers held in pairs, z[i] = [a's 8 lanes | b's], into
// out[0 .. 8) in order (z[0]'s halves, then z[1]'s, ...), each bitwise hsum(half): hsum adds
// t_l = v_l + v_(l+4), then u_0 = t_0 + t_2 and u_1 = t_1 + t_3, then u_0 + u_1, and the rounds
// below add the same lanes in the same order for eight halves at once.
inline void hsum8_pairs(const __m512* z, float* out) {
  // w0 = [t of z0.a | t of z0.b | t of z2.a | t of z2.b] and w1 the same of z1 and z3
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[2], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[0], z[2], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[1], z[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(z[1], z[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // per 128-bit lane q: [u_0, u_1 of w0's half q, u_0, u_1 of w1's half q]
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(3, 2, 3, 2)));
  // lanes 4q and 4q + 2: the sums of w0's and w1's half q
  const __m512 r = _mm512_add_ps(u, _mm512_movehdup_ps(u));
  const __m512i order = _mm512_setr_epi32(0, 4, 2, 6, 8, 12, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r)));
}

// The outputs of a tile of MR input rows against NP pairs of weight rows whose accumulators are
// held in pairs (acc[i][p] = [row 2p's 8 lanes | row 2p + 1's], `tile2p_z`, `tile_blocks_z`):
// each sum is hsum's, eight at a time (`hsum8_pairs`), then finish_dot's, so every output is
// bitwise what hsum and finish_dot give one at a time.
template <int MR, int NP>
inline void finish_pairs(const __m512 (&acc)[MR][NP], const float* scale, const float* bias, float* y,
                         int64_t ldy, bool accumulate) {
  constexpr int R = MR * NP;                // registers, in row order
  constexpr int G = (R + 3) / 4;            // groups of four
  alignas(64) float sums[G * 8];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m512 z[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const int r = 4 * g + q;
      z[q] = r < R ? acc[r / NP][r % NP] : _mm512_setzero_ps();
    }
    hsum8_pairs(z, sums + 8 * g);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NP; ++j) finish_dot(sums[i * 2 * NP + j], scale, bias, j, y + i * ldy + j, accumulate);
}

// tile2p for float32 weights in 512-bit registers. A pair's chunk of 8 weights of both rows,
// [row 2p: k .. k+7 | row 2p+1: k .. k+7], is one load, and meets the input's 8 values repeated
// in both halves: one fma does the work of two of tile2p's, and lane l of each half forms exactly
// the chain that lane l of tile2p's register for that row forms. Each half then goes through the
// same hsum, so the outputs are bitwise the same as tile2p's (and tile's). NP pairs of weight rows
// (tile2p's two, or a block's four: `tile_rows_wide`) meet each input vector.
template <int MR, int NP = 2>
inline void tile2p_z(const float* x, int64_t ldx, const float* w, int64_t K, const float* scale,
                     const float* bias, float* y, int64_t ldy, bool accumulate, int64_t pf) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {  // paired: K % 8 == 0, no tail
    __m512 wv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_ps(w + 2 * p * K + 2 * k);
    if (pf != 0 && (2 * k) % kLine<float> == 0) {
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p * K + 2 * k + pf), _MM_HINT_T1);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_castpd_ps(
          _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + i * ldx + k))));
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xv, wv[p], acc[i][p]);
    }
  }
  finish_pairs<MR, NP>(acc, scale, bias, y, ldy, accumulate);
}
#endif

// Rows m0 .. m0+MR of the input against weight rows n0 .. n0+nr (a block of `for_each_pass`: 8
// rows, or kComputeBlockRows; nr even where the weights are paired).
template <int MR, typename WT>
inline void tile_rows(const float* x, int64_t ldx, const WT* w, int64_t K, int64_t nr,
                      const float* scale, const float* bias, float* y, int64_t ldy, bool acc,
                      int64_t pf, bool paired, int64_t two_pair_from) {
  int64_t j = 0;
  if (paired) {  // pair p starts where row 2p would (p * 2K)
#if defined(__AVX512VL__)
    // From `two_pair_from` rows (EPYC: five). There, all of the model's matrices, 2 threads, min /
    // median of 8 alternating rounds, ms: float32 5 rows 19.0 / 20.6 -> 15.9 / 19.5, 9 rows 24.8 /
    // 26.9 -> 21.1 / 25.5; 2 rows 15.3 / 19.9 -> 17.3 / 21.1 and 3-4 rows within 1-6% either way
    // (reading the weights from memory, two streams at once cost what the arithmetic saved).
    // bfloat16: 5 rows 16.5 / 16.8 -> 14.3 / 14.6, 9 rows 25.8 / 26.5 -> 23.3 / 24.5.
    if (MR >= two_pair_from) {
      for (; j + 4 <= nr; j += 4)
        tile2p<MR, WT>(x, ldx, w + j * K, K, scale ? scale + j : nullptr, bias ? bias + j : nullptr,
                   y + j, ldy, acc, pf);
    }
#endif
    for (; j + 2 <= nr; j += 2) {
      if constexpr (MR == 6 && std::is_same_v<WT, float>) {
        tile_pair6(x, ldx, w + j * K, K, scale ? scale + j : nullptr, bias ? bias + j : nullptr,
                   y + j, ldy, acc, pf);
        continue;
      }
      tile<MR, 2>(x, ldx, w + j * K, K, kPairChunk<WT>, 2, scale ? scale + j : nullptr,
                  bias ? bias + j : nullptr, y + j, ldy, acc, pf);
    }
    return;
  }
  // MR x 2 (MR >= 3) or MR x 4 tiles: 6-12 accumulators + weight and input vectors fit in the
  // 16 ymm registers, and there are always >= 4 independent FMA chains.
  constexpr int NR = MR >= 3 ? 2 : 4;
  for (; j + NR <= nr; j += NR)
    tile<MR, NR>(x, ldx, w + j * K, K, K, 1, scale ? scale + j : nullptr, bias ? bias + j : nullptr,
                 y + j, ldy, acc, pf);
  for (; j < nr; ++j)
    tile<MR, 1>(x, ldx, w + j * K, K, K, 1, scale ? scale + j : nullptr, bias ? bias + j : nullptr,
                y + j, ldy, acc, pf);
}

template <typename WT>
inline void tile_any(int64_t mr, const float* x, int64_t ldx, const WT* w, int64_t K, int64_t nr,
                     const float* scale, const float* bias, float* y, int64_t ldy, bool acc,
                     int64_t pf, bool paired, int64_t two_pair_from) {
  const int64_t f = two_pair_from;
  switch (mr) {
    case 1: return tile_rows<1>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 2: return tile_rows<2>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 3: return tile_rows<3>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 4: return tile_rows<4>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    case 5: return tile_rows<5>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
    default: return tile_rows<6>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf, paired, f);
  }
}

#if defined(__AVX512F__)
// Paired float32 weights with tile2p_z, which keeps up to 12 input rows in registers (24
// accumulators), so a verification of 9 tokens reads each block of weights once, not twice.
// Measured on the 2-core Xeon (session 12; all of SmolLM2's matrices, 2 threads, min of 8
// interleaved rounds, ms, 256-bit -> 512-bit tiles): 9 rows 37.6 -> 29.5, 12 rows 50.6 -> 34.4;
// one thread from L2: 5 rows 36 -> 28 us, 9 rows 66-74 -> 44-47. A whole forward of 9 tokens at
// 200 cached: 33.5-39.3 -> 30.8-34.8 (1.46-1.63 -> 1.30-1.48 of one token). Five rows from memory
// gained nothing (bound by reading the weights), hence `Schedule::wide_float_rows` = 6.
//
// Calls of more than kComputeFrom rows (prompts, in pieces of 128) are bound by the arithmetic,
// not by reading the weights, whose block is in L1 after the first pass: they go in passes of up
// to kComputeRows rows against all four pairs of a block (NP = 4: 24 accumulators, 4 weight loads
// and 6 input loads per 24 multiply-adds, against 2 and 12 with NP = 2). Measured on the 2-core
// Zen 5 EPYC (session 25, /tmp/s25/mb.py: SmolLM2's 120 layer matrices, 64 rows, 2 threads, min of
// 9 interleaved rounds): 41.6 -> 38.0 ms, 164 -> 179 GMAC/s, 76% of the two cores' multiply-add
// peak; a 128-token prompt piece 98 -> 89 ms. Steps of 9 or 12 rows split this way got slower (9
// tokens 11.8 -> 15.5 ms: the first pass waits on memory), and 16 rows were 3-8% slower too (in
// passes of 6, 5 and 5 rather than two of 8), hence only above kComputeFrom rows (a step feeds a
// row at most 16 tokens, `FastLlama.kernel_max_tokens`).
constexpr int64_t kWideMostRows = 12;
constexpr int64_t kComputeRows = 6;

template <int MR, int NP>
inline void tile_rows_wide(const float* x, int64_t ldx, const float* w, int64_t K, int64_t nr,
                           const float* scale, const float* bias, float* y, int64_t ldy, bool acc,
                           int64_t pf) {
  int64_t j = 0;
  for (; j + 2 * NP <= nr; j += 2 * NP)
    tile2p_z<MR, NP>(x, ldx, w + j * K, K, scale ? scale + j : nullptr, bias ? bias + j : nullptr,
                     y + j, ldy, acc, pf);
  for (; j + 4 <= nr; j += 4)
    tile2p_z<MR, 2>(x, ldx, w + j * K, K, scale ? scale + j : nullptr, bias ? bias + j : nullptr,
                    y + j, ldy, acc, pf);
  for (int64_t m = 0; j < nr && m < MR; m += 6)  // a last pair: pair tiles, 6 rows at a time
    tile_any(std::min<int64_t>(6, MR - m), x + m * ldx, ldx, w + j * K, K, nr - j,
             scale ? scale + j : nullptr, bias ? bias + j : nullptr, y + m * ldy + j, ldy, acc, pf,
             true, 1);
}

// `compute`: a pass of a call of more than kComputeFrom rows (at most kComputeRows), tiled for the
// arithmetic (above).
inline void tile_any_wide(int64_t mr, const float* x, int64_t ldx, const float* w, int64_t K,
                          int64_t nr, const float* scale, const float* bias, float* y,
                          int64_t ldy, bool acc, int64_t pf, bool compute) {
  if (compute) {
    with_rows<kComputeRows>(mr, [&](auto R) {
      tile_rows_wide<decltype(R)::value, 4>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf);
    });
    return;
  }
  with_rows<kWideMostRows>(mr, [&](auto R) {
    tile_rows_wide<decltype(R)::value, 2>(x, ldx, w, K, nr, scale, bias, y, ldy, acc, pf);
  });
}
#endif

// Calls of more than this many rows are prompts, in pieces (`FastLlama.kernel_prefill_piece`),
// bound by the arithmetic rather than by reading the weights: the 512-bit float32 tiles take them
// in passes of kComputeRows rows, the 256-bit ones in blocks of kComputeBlockRows weight rows.
constexpr int64_t kComputeFrom = 16;
constexpr int64_t kComputeBlockRows = 48;

// Prefetch distance in bytes (about 1-2 blocks of rows ahead). Measured on the 2-core EPYC, all
// SmolLM2 matrices, 1 / 5 input rows, min of 13 interleaved rounds: float32 37 KB 19.1 / 19.0 ms,
// 74 KB 19.0 / 19.6; bfloat16 18 KB 11.5 / 19.1, 74 KB 13.0 / 20.6; int8 9 KB 9.0 / 14.9, 18 KB
// 7.7 / 15.2, 37 KB 9.4 / 15.4 (the session-2 distance, 2 blocks of 4 rows, and L1 hints: float32
// 25.6 / 29.1, bfloat16 18.6 / 20.6, int8 10.4 / 14.3).
constexpr int64_t kPrefetchBytes = 24 * 1024;

// A quiet pass (one input row, paired int8 weights, no software prefetch by the schedule) on AVX2
// still prefetches, 1 KB ahead with the non-temporal hint, which on AMD's Zen brings the line close
// to the core while keeping it out of the caches that the step's small data (activations, the
// key-value rows, the Python interpreter between calls) lives in. `tile_q` takes it as a negative
// `pf`. Measured on a 2-core Zen 3 EPYC (session 30, SmolLM2-135M, greedy steps at 200 cached
// tokens with the caller's argmax and truncate, two builds over one copy of the weights alternating,
// min / median, ms per step): int8, 1 token, 8.53 / 10.16 -> 7.71 / 8.97 (30 rounds) and 7.80 /
// 8.20 -> 6.41 / 7.37 (16); float32 (its head's int8 screen is such a pass) 8.74 / 10.08 -> 8.37 /
// 9.69. 512 bytes or 2 KB ahead, or the T1 or T0 hints at 1 KB, gained less; the same hint on the
// float32 4-bit blocks' own prefetch gained nothing. Builds with AVX-512 keep no such prefetch (not
// measured there).
constexpr int64_t kQuietPrefetch = 1024;

// The schedule shared by every weight type: threads split the weight rows into blocks of 8; each
// block meets the input rows in passes of up to `most` rows (6; 12 for the 512-bit float32 tiles),
// split evenly (with 6: 9 = 5 + 4, not 6 + 3: fewer passes means fewer weight loads per multiply;
// the split never changes any element's arithmetic), and only the first pass prefetches, later
// ones find the block in L1/L2. `pass(m, mr, n0, nr, first)` computes input rows m .. m+mr against
// weight rows n0 .. n0+nr. `NB` (a multiple of 8) replaces the 8 rows of a block; threads take at
// least 128 rows each. `first_in_chunk()` runs on each thread before its blocks (`OwnRows`).
template <typename Pass, typename First>
void for_each_pass_after(int64_t M, int64_t N, const First& first_in_chunk, const Pass& pass, int64_t most = 6,
                         int64_t NB = 8) {
  const int64_t nblocks = (N + NB - 1) / NB;
  team_for(0, nblocks, std::max<int64_t>(1, 128 / NB), [&](int64_t b0, int64_t b1) {
    first_in_chunk();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB;
      const int64_t nr = std::min(NB, N - n0);
      for (int64_t m = 0; m < M;) {
        const int64_t rest = M - m;
        const int64_t mr = rest <= most ? rest : rest <= 2 * most ? (rest + 1) / 2 : most;
        pass(m, mr, n0, nr, m == 0);
        m += mr;
      }
    }
  });
}

template <typename Pass>
void for_each_pass(int64_t M, int64_t N, const Pass& pass, int64_t most = 6, int64_t NB = 8) {
  for_each_pass_after(M, N, [] {}, pass, most, NB);
}

// A product's input rows formed by each of its threads for itself, from x (`own_rows8`,
// `own_byte_rows`, `i16_rows`): no job before the product, and no input row read from the other
// thread. With `w` (else null), x is a norm's input: rmsnorm_row with weight w [K] and epsilon
// eps first.
struct OwnRows {
  const float* w = nullptr;
  float eps = 0.0f;
};
// Declared here for `linear`'s own rows (defined with the norms below).
inline const float* own_normed(const float* x, int64_t M, int64_t ldx, int64_t K, const OwnRows& own, int64_t* ld);

// int16 rows (`quantize_rows_i16`): q [M, K] and scales qs [M].
struct I16Rows {
  const int16_t* q;
  const float* qs;
};
inline thread_local I16Rows t_own_i16{};  // the rows this thread formed for itself (`OwnRows`)

// The rows of x [M, K] (`own_normed` first where `own` has a norm) quantised into this thread's
// buffers, all on this thread: valid for every thread until this thread's next call.
inline I16Rows i16_rows(const float* x, int64_t M, int64_t ldx, int64_t K, const OwnRows& own) {
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> qs;
  int64_t ld = 0;
  const float* xn = own_normed(x, M, ldx, K, own, &ld);
  q.resize(M * K);
  qs.resize(M);
  quantize_rows_i16(xn, M, ld, K, q.data(), qs.data());
  return {q.data(), qs.data()};
}

// y[M, N] (+)= (x[M, K] @ w[N, K]^T) * scale[N] + bias. Threads split the weight rows, so each thread
// streams its half of the weights once; within a block of 8 weight rows every input row is applied
// while the block is in L1 (`for_each_pass`).
//
// `paired`: w is pair-interleaved (`paired_ok`). Its first pass prefetches with 2 or more input
// rows, whose arithmetic would otherwise wait on the loads (int8, 2 rows: +0.8-1.5 ms per forward
// without it); with one only where `sched.prefetch_one_row` says so (on the EPYC the hardware
// prefetcher keeps up with the single stream alone, and a software prefetch cost 10-25% of the
// bandwidth; on the Xeon it saved 19% with int8 weights).
//
// `own` (int8 only): each thread forms the int16 rows itself (`i16_rows`), none quantised first.
template <typename WT>
void linear(const float* x, int64_t M, int64_t ldx, const WT* w, int64_t N, int64_t K,
            const float* scale, const float* bias, float* y, int64_t ldy, bool accumulate,
            bool paired, const Schedule& sched, const OwnRows* own = nullptr) {
  const bool quiet = paired && M == 1 && !sched.prefetch_one_row;
  int64_t pf = quiet ? 0 : kPrefetchBytes / static_cast<int64_t>(sizeof(WT));
#if !defined(__AVX512VL__)
  if (std::is_same_v<WT, i8> && quiet) pf = -kQuietPrefetch;  // one-row int8 tiles: `tile_q`
#endif
  if constexpr (std::is_same_v<WT, i8>) {
    const I16Rows shared = own == nullptr ? i16_rows(x, M, ldx, K, OwnRows{}) : I16Rows{};
    const auto first_in_chunk = [&] {
      if (own != nullptr) t_own_i16 = i16_rows(x, M, ldx, K, *own);
    };
    // The rows this thread reads: its own (`t_own_i16`) with `own`, else the shared ones.
    const auto rows = [&] { return own != nullptr ? t_own_i16 : shared; };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (paired && M >= sched.wide_int8_rows) {
      for_each_pass_after(M, N, first_in_chunk, [&](int64_t m, int64_t mr, int64_t n0, int64_t nr, bool first) {
        const I16Rows r = rows();
        with_rows<kWideInt8MostRows>(mr, [&](auto R) {
          tile_rows_q_wide<decltype(R)::value>(r.q + m * K, K, r.qs + m, w + n0 * K, K, nr, scale + n0,
                                               bias ? bias + n0 : nullptr, y + m * ldy + n0, ldy, accumulate,
                                               first ? pf : 0);
        });
      }, kWideInt8MostRows);
      return;
    }
#endif
    for_each_pass_after(M, N, first_in_chunk, [&](int64_t m, int64_t mr, int64_t n0, int64_t nr, bool first) {
      const I16Rows r = rows();
      tile_any_q(mr, r.q + m * K, K, r.qs + m, w + n0 * K, K, nr, scale + n0, bias ? bias + n0 : nullptr,
                 y + m * ldy + n0, ldy, accumulate, first ? pf : 0, paired,
                 sched.two_pair_rows_int8);
    });
  } else {
    TORCH_CHECK(own == nullptr, "a product's own input rows need int8 or block weights");
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<WT, float>) {
      const int64_t wide = std::max(sched.wide_float_rows, sched.two_pair_rows_float);
      if (paired && sched.wide_float_rows > 0 && M >= wide) {
        const bool compute = M > kComputeFrom;
        for_each_pass(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t nr, bool first) {
          tile_any_wide(mr, x + m * ldx, ldx, w + n0 * K, K, nr, scale ? scale + n0 : nullptr,
                        bias ? bias + n0 : nullptr, y + m * ldy + n0, ldy, accumulate,
                        first ? pf : 0, compute);
        }, compute ? kComputeRows : kWideMostRows);
        return;
      }
    }
#endif
    // Paired float32 calls of more than kComputeFrom rows (prompts, in pieces) are bound by the
    // arithmetic: their passes meet blocks of kComputeBlockRows weight rows, which stay in L2 while
    // every pass's 6 input rows stay in L1 (blocks of 8 rows and 6 input rows filled L1, 32 KB on
    // Zen 3, with K = 576). Measured with `tile_pair6` (its comment): 67.3 -> 71.4 GMAC/s.
    const bool compute = std::is_same_v<WT, float> && paired && M > kComputeFrom;
    for_each_pass(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t nr, bool first) {
      tile_any(mr, x + m * ldx, ldx, w + n0 * K, K, nr, scale ? scale + n0 : nullptr,
               bias ? bias + n0 : nullptr, y + m * ldy + n0, ldy, accumulate, first ? pf : 0,
               paired, sched.two_pair_rows_float);
    }, 6, compute ? kComputeBlockRows : 8);
  }
}

// Float32 weights held as exact blocks of 32 (GGUF's layouts, which a GGUF model's matrices keep
// once transformers dequantises them to float32), read instead of the float32 rows:
//
// - 4-bit (Q4_1): w = d * q + m with q in 0 .. 15 and d, m float16 values widened to float32.
//   A block's 16 bytes of codes hold q[i] in the low nibble of byte i and q[i + 16] in its high
//   nibble; its scales are (d, m) as float32. d * q is exact in float32 (11 + 4 significant
//   bits), so fma(d, q, m) is the one rounding of d * q + m that the dequantisation did: the very
//   float32 weight. 6 bits read per weight instead of 32 (the layer matrices of SmolLM2's GGUF).
// - 8-bit (Q8_0): w = d * q with q in -128 .. 127 and d a float16 value widened to float32, exact
//   in float32 (11 + 8 bits): 32 bytes of codes and d as float32, 9 bits per weight (SmolLM2's
//   embedding, which is its output head).
//
// Both are laid out in groups of 8 rows (`Grouped`). Holding Q4_1's (d, m) as the float16 values
// they are (5 bits a weight instead of 6), widened once per block and tile, was slower on a 2-core
// Zen 3 EPYC (session 27, greedy step at 200 cached tokens, min of 20 alternating, ms: 1 token
// 6.67 -> 6.93, 5 tokens 14.37 -> 16.24): there the step is bound by widening the blocks, not by
// reading them.
// Each output runs `tile`'s chain (8 lanes over K in steps of 8, hsum, no tail, finish_dot), so it
// is bitwise the float32 path's. FastLlama checks every block at load (`_q4_blocks`,
// `_q8_blocks`) and the tests compare outputs bitwise.

// Where row row0 + j's codes (CB bytes) and scales (SB bytes) of block b lie in blocks laid out as
// FastLlama's `_group_blocks` does: rows in groups of 8 (the last may hold fewer), and for each
// group and block of 32 columns, the group's codes, then its scales. A pass over a group of 8
// weight rows (`for_each_pass`) so reads one stream from memory, not 16.
template <int64_t CB, int64_t SB>
struct Grouped {
  static constexpr int64_t kCodeBytes = CB, kScaleBytes = SB;
  const uint8_t* p;  // the matrix's first byte
  int64_t nb;        // blocks per row
  int64_t N;         // rows
  int64_t row0;      // the first row of this view
  // Block 0 of this view's first row: its codes and scales, and the bytes from one block to the
  // next. Row row0 + j of the same group (j < 8 - row0 % 8) has its codes j * CB bytes on and its
  // scales j * SB bytes on.
  struct Walk {
    const uint8_t* codes;
    const uint8_t* scales;
    int64_t step;
  };
  inline Walk walk() const {
    const int64_t g = row0 >> 3, rows = std::min<int64_t>(8, N - 8 * g);
    const uint8_t* base = p + g * 8 * nb * (CB + SB);
    return {base + (row0 & 7) * CB, base + rows * CB + (row0 & 7) * SB, rows * (CB + SB)};
  }
  // Row row0 + j's codes of block b, and (in *scales) its scales.
  inline const uint8_t* codes(int64_t j, int64_t b, const float** scales) const {
    const Walk at = Grouped{p, nb, N, row0 + j}.walk();
    *scales = reinterpret_cast<const float*>(at.scales + b * at.step);
    return at.codes + b * at.step;
  }
};

struct Q4Blocks : Grouped<16, 8> {  // the 4-bit blocks of a matrix
#if defined(__AVX512F__)
  // Block b of rows j and j + 1 (j even) widened to w[0 .. 4), for `tile_blocks_z`: the low half
  // of w[c] holds row j's weights 8c .. 8c+7, the high half row j + 1's. Each row's 16 possible
  // weights fma(d, i, m) fill one register, and a two-table lookup (bit 4 of an index picks row
  // j + 1's table) widens both rows' codes at once: the same values as `chunk`. The two rows lie
  // side by side (`Grouped`): codes at qa and qa + 16, scales at da and da + 2.
  inline void widen2(int64_t j, int64_t b, __m512* w) const {
    const float* da;
    const uint8_t* qa = codes(j, b, &da);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ta = _mm512_fmadd_ps(_mm512_set1_ps(da[0]), iota, _mm512_set1_ps(da[1]));
    const __m512 tb = _mm512_fmadd_ps(_mm512_set1_ps(da[2]), iota, _mm512_set1_ps(da[3]));
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa));
    const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + 16));
    const __m512i i0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(va, vb));  // bytes 0-7 of each row
    const __m512i i1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(va, vb));  // bytes 8-15
    const __m512i high = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
    const __m512i low4 = _mm512_set1_epi32(15);
    // (i & 15) | high in one instruction (truth table 0xEA: A & B | C).
    w[0] = _mm512_permutex2var_ps(ta, _mm512_ternarylogic_epi32(i0, low4, high, 0xEA), tb);
    w[1] = _mm512_permutex2var_ps(ta, _mm512_ternarylogic_epi32(i1, low4, high, 0xEA), tb);
    w[2] = _mm512_permutex2var_ps(ta, _mm512_or_si512(_mm512_srli_epi32(i0, 4), high), tb);
    w[3] = _mm512_permutex2var_ps(ta, _mm512_or_si512(_mm512_srli_epi32(i1, 4), high), tb);
  }
#endif
  // Weights 8c .. 8c+7 (c = 0 .. 3) of the block whose codes are at q and scales at s, widened to
  // float32 for `tile_blocks`: fma(d, q, m) of the low nibbles of bytes 0-7 (c = 0), 8-15 (1),
  // then of their high nibbles (2, 3).
  static inline __m256 chunk(const uint8_t* q, const float* s, int c) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (c & 1))));
    const __m256i i = c < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
    return _mm256_fmadd_ps(_mm256_broadcast_ss(s), _mm256_cvtepi32_ps(i), _mm256_broadcast_ss(s + 1));
  }
  Q4Blocks rows(int64_t n0) const { return {{p, nb, N, row0 + n0}}; }
};

struct Q8Blocks : Grouped<32, 4> {  // the 8-bit blocks of a matrix
#if defined(__AVX512F__)
  inline void widen2(int64_t j, int64_t b, __m512* w) const {  // as Q4Blocks::widen2
    const float* d;
    const int8_t* qa = reinterpret_cast<const int8_t*>(codes(j, b, &d));
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(d[0]), 0xFF00, _mm512_set1_ps(d[1]));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qa + 8 * c)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qa + 32 + 8 * c)));
      w[c] = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)));
    }
  }
#endif
  static inline __m256 chunk(const uint8_t* q, const float* s, int c) {  // weights 8c .. 8c+7: d * q
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c));
    return _mm256_mul_ps(_mm256_broadcast_ss(s), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
  }
  Q8Blocks rows(int64_t n0) const { return {{p, nb, N, row0 + n0}}; }
};

// MR input rows against NR weight rows of blocks B (all in one group of 8), for CPUs without
// AVX-512 (16 ymm registers). The blocks are widened 8 weights at a time (`chunk`), so that the
// MR x NR accumulators fit beside one or a few weight registers; every output is one chain of
// multiply-adds over K in steps of 8, as in `tile`, in the same order whatever MR and NR are.
// - Up to 3 input rows: a weight row's block at a time, each of its chunks applied to all MR rows
//   with the inputs as memory operands (NR = 8 for one row, 4 for two or three: at least 8
//   chains, where 2 weight rows left one row's step waiting on the multiply-add's latency).
// - 4 or more: one chunk of all NR (2) weight rows at a time, each input vector loaded once for NR
//   products; as memory operands its loads outnumbered what the load ports take.
// - `pf` (bytes, 0: none): prefetch the whole group's block that far ahead. `linear_blocks` asks it
//   of a group's first tile (kBlockPrefetchBytes) in every pass, not only the first as `linear`
//   does: a later pass's prefetches run ahead into the next groups (8 tokens, two passes of 4,
//   22.7 ms with them, 24.7 without; min of 20, same build otherwise).
// Measured on a 2-core Zen 3 EPYC (AVX2 only, session 26), SmolLM2-135M's greedy step at 200 cached
// tokens, two builds over the same weights in one process (/tmp/s26/ab.py), min / median of 25-30,
// ms. Against the tile before (a whole block of 2 weight rows widened, then all MR rows): 1 token
// 12.06 / 15.39 -> 9.51 / 11.77, 2 tokens 13.83 / 17.15 -> 10.84 / 14.90, 5 tokens 23.51 / 29.61 ->
// 21.04 / 24.71. Then the prefetch: 1 token 8.07 / 9.43 -> 7.22 / 8.26, 2 tokens 9.94 / 11.70 ->
// 8.50 / 10.33, 5 tokens 16.42 / 20.76 -> 15.64 / 20.49 (1536 bytes ahead gained nothing at one
// token; 8192 as much as 4096). This machine's memory is shared with other tenants and its
// figures drift by up to 50% within minutes, so only builds alternated within one run are compared.
constexpr int64_t kBlockPrefetchBytes = 4096;

template <int MR, int NR, typename B>
inline void tile_blocks(const float* x, int64_t ldx, const B& blocks, const float* bias, float* y,
                        int64_t ldy, bool accumulate, int64_t pf) {
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  auto at = blocks.walk();
  for (int64_t b = 0; b < blocks.nb; ++b, at.codes += at.step, at.scales += at.step) {
    const auto scales = [&](int j) { return reinterpret_cast<const float*>(at.scales + j * B::kScaleBytes); };
    const auto input = [&](int i, int c) { return x + i * ldx + b * 32 + 8 * c; };
    if (pf != 0)
      for (int64_t o = 0; o < at.step; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(at.codes + pf + o), _MM_HINT_T0);
    if constexpr (MR <= 3) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256 w = B::chunk(at.codes + j * B::kCodeBytes, scales(j), c);
#pragma GCC unroll 3
          for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(input(i, c)), w, acc[i][j]);
        }
    } else {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256 w[NR];
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) w[j] = B::chunk(at.codes + j * B::kCodeBytes, scales(j), c);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256 xv = _mm256_loadu_ps(input(i, c));
#pragma GCC unroll 8
          for (int j = 0; j < NR; ++j) acc[i][j] = fma_reg(xv, w[j], acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) finish_dot(hsum(acc[i][j]), nullptr, bias, j, y + i * ldy + j, accumulate);
}

// Weight rows per `tile_blocks` call for MR input rows (above).
constexpr int blocks_rows(int MR) { return MR == 1 ? 8 : MR <= 3 ? 4 : 2; }

#if defined(__AVX512F__)
// Each row of x [M, K] with every run of 8 values written twice, [x 8c .. 8c+7 | x 8c .. 8c+7], so
// that `tile_blocks_z` loads each input vector whole (64-byte aligned) where it broadcast 8 values
// into both halves of a register before every use. Built on this thread, for it alone; valid until
// its next call.
inline const float* doubled_rows(const float* x, int64_t M, int64_t ldx, int64_t K) {
  thread_local Vec64<float> buf;
  buf.resize(M * 2 * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 8)
      _mm512_store_ps(buf.data() + m * 2 * K + 2 * k,
                      _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + m * ldx + k)))));
  return buf.data();
}

// MR input rows against NP pairs of weight rows in 512-bit registers (each pair as `widen2` lays it
// out, the accumulator's halves the two rows' 8-lane chains), the input rows doubled (`doubled_rows`,
// ldx = 2K), a pair at a time: its four widened registers meet every row's vectors, loaded as the
// multiply-adds' operands, before the next pair is widened (each accumulator's chain in the same
// order). Against widening all NP pairs first and broadcasting each input vector (session 54,
// 2-core Zen 4 EPYC, float32 greedy steps at 200 cached tokens, `benchmarks/kernel_ab.py`, paired
// medians, three runs): 20 rounds, 1 / 5 tokens 0.969x / 0.993x; 50 rounds all across CCDs, 1 / 2
// / 5 / 8 tokens 0.977x / 0.952x / 0.942x / 1.007x; 80 rounds, 43 on one CCD and 37 across, 1 token
// 0.980x / 0.976x, 5 tokens 1.003x / 0.974x. Logits bitwise the same (`benchmarks/bitwise_ab.py`).
// Before that: half the multiply-add instructions of `tile_blocks` and half its widening, and with
// NP pairs, NP independent chains per input row.
// Measured on a 2-core Zen 5 EPYC (native 512-bit multiply-adds), SmolLM2-135M at 200 cached
// tokens, greedy step, min of 14, ms, in one process: this build against one without AVX-512
// (`tile_blocks`, same layout), 1 token 3.42 / 4.91, 2 4.11 / 6.60, 5 7.78 / 12.73, 8 12.33 / 19.18;
// with half the pairs (2 for one or two rows, 1 for 3-8) 1 token 3.66 -> 4.08, 3 5.92 -> 7.40. In
// separate runs, before the 8-row groups (`Grouped`) and after: 1 token 4.14 -> 3.2-3.5.
// `pf` (bytes, 0: none): prefetch the group's block that far ahead, as `tile_blocks` does; a
// group's first tile asks it (`blocks_z_rows`). On the 2-core Xeon (session 33; AVX-512 and AMX,
// two 512-bit multiply-add ports; greedy step at 200 cached tokens, two builds over one copy of
// the weights alternating in one process, benchmarks/kernel_ab.py, 8 rounds of 5, min / median,
// ms): 1 token 8.12 / 8.91 -> 6.65 / 7.05, 5 tokens 13.08 / 13.49 -> 9.29 / 9.78, 9 tokens 19.28 /
// 19.93 -> 17.30 / 18.42 (with the five- and six-row tiles below). Without it, a fifth of the
// 5-row tile's samples sat on the first load of each block's scales. 2048 or 8192 bytes ahead did
// no better.
template <int MR, int NP, typename B>
inline void tile_blocks_z(const float* x, int64_t ldx, const B& blocks, const float* bias, float* y,
                          int64_t ldy, bool accumulate, int64_t pf) {
  __m512 acc[MR][NP];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_ps();
  const auto at = blocks.walk();
  for (int64_t b = 0; b < blocks.nb; ++b) {
    if (pf != 0)
      for (int64_t o = 0; o < at.step; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(at.codes + b * at.step + pf + o), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {  // a pair at a time: its 4 widened registers meet every row
      __m512 w[4];
      blocks.widen2(2 * p, b, w);
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i) {
        const float* xi = x + i * ldx + b * 64;  // doubled: 64 floats a block
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[i][p] = _mm512_fmadd_ps(_mm512_load_ps(xi + 16 * c), w[c], acc[i][p]);
      }
    }
  }
  finish_pairs<MR, NP>(acc, nullptr, bias, y, ldy, accumulate);
}

// Pairs per `tile_blocks_z` call for MR input rows: enough independent chains for one or two rows,
// and at most 16 accumulators (32 registers in all). Up to 4 rows, all four pairs of a group, so
// an input vector meets 4 registers of weights. On the 2-core Zen 5 EPYC (session 25, greedy step
// at 200 cached tokens, min of 15, ms, two builds of the kernel over the same weights in one
// process, /tmp/s25/ab2.py), with `finish_pairs` beside it: 2 tokens 3.82 -> 3.42, 3 tokens 4.55
// -> 4.09, 4 tokens 5.46 -> 4.99, 5 tokens 6.86 -> 6.51; 1 and 8 tokens unchanged. (Two models
// loaded side by side differed by up to 30% at 5-8 tokens with the same build: compare builds
// over one copy of the weights.) Five and six rows too (20-24 accumulators; GCC then keeps some of
// the widened weights on the stack): on the 2-core Xeon (session 33, without the prefetch below,
// greedy step at 200 cached tokens, median of 15, ms) 5 tokens 12.5 -> 11.5, 6 tokens 13.5 -> 12.6.
constexpr int blocks_z_pairs(int MR) { return MR <= 6 ? 4 : MR <= 8 ? 2 : 1; }

// Weight rows n0 .. n0+nr (nr even) of blocks against MR input rows.
template <int MR, typename B>
inline void blocks_z_rows(const float* x, int64_t ldx, const B& blocks, int64_t nr, const float* bias,
                          float* y, int64_t ldy, bool accumulate) {
  constexpr int NP = blocks_z_pairs(MR);
  int64_t j = 0;
  for (; j + 2 * NP <= nr; j += 2 * NP)
    tile_blocks_z<MR, NP>(x, ldx, blocks.rows(j), bias ? bias + j : nullptr, y + j, ldy, accumulate,
                          j == 0 ? kBlockPrefetchBytes : 0);
  for (; j < nr; j += 2)
    tile_blocks_z<MR, 1>(x, ldx, blocks.rows(j), bias ? bias + j : nullptr, y + j, ldy, accumulate,
                         j == 0 ? kBlockPrefetchBytes : 0);
}

// Most input rows per pass of the block tiles: each pass widens the blocks again. (How many rows a
// call may have and still read the blocks at all is the caller's `set_block_rows`, measured per
// machine: verispec/models/schedule.py, `apply_blocks`.)
constexpr int64_t kBlockMostRows = 12;
#else
constexpr int64_t kBlockMostRows = 6;
#endif

// `linear` for float32 weights held as blocks (above): y[M, N] (+)= x[M, K] @ w^T + bias, bitwise
// what `linear` gives for the float32 matrix (N even). `for_each_pass` splits the weight rows and
// the input rows as for `linear`; each block of 8 weight rows goes through its tiles a pair at a time.
// With AVX-512 each thread first doubles the call's input rows for its tiles (`doubled_rows`).
template <typename B>
void linear_blocks(const float* x, int64_t M, int64_t ldx, const B& blocks, int64_t N, const float* bias,
                   float* y, int64_t ldy, bool accumulate) {
#if defined(__AVX512F__)
  const int64_t K = blocks.nb * 32;
  thread_local const float* xd = nullptr;  // this thread's doubled rows, formed before its blocks
  for_each_pass_after(M, N, [&] { xd = doubled_rows(x, M, ldx, K); }, [&](int64_t m, int64_t mr, int64_t n0,
                                                                          int64_t nr, bool) {
    with_rows<kBlockMostRows>(mr, [&](auto R) {
      constexpr int MR = decltype(R)::value;
      blocks_z_rows<MR>(xd + m * 2 * K, 2 * K, blocks.rows(n0), nr, bias ? bias + n0 : nullptr, y + m * ldy + n0,
                        ldy, accumulate);
    });
  }, kBlockMostRows);
#else
  for_each_pass(M, N, [&](int64_t m, int64_t mr, int64_t n0, int64_t nr, bool) {
    with_rows<kBlockMostRows>(mr, [&](auto R) {
      constexpr int MR = decltype(R)::value;
      constexpr int NR = blocks_rows(MR);
      for (int64_t j = n0; j < n0 + nr;) {
        const float* bj = bias ? bias + j : nullptr;
        const int64_t pf = j == n0 ? kBlockPrefetchBytes : 0;  // for the whole group, every pass
        if (j + NR <= n0 + nr) {
          tile_blocks<MR, NR>(x + m * ldx, ldx, blocks.rows(j), bj, y + m * ldy + j, ldy, accumulate, pf);
          j += NR;
        } else {  // a group of fewer than 8 rows
          tile_blocks<MR, 2>(x + m * ldx, ldx, blocks.rows(j), bj, y + m * ldy + j, ldy, accumulate, pf);
          j += 2;
        }
      }
    });
  }, kBlockMostRows);
#endif
}

// Sum of squares in fixed order: 8 lanes over the row, hsum, scalar tail.
inline float sumsq(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; k < n; ++k) s = std::fma(x[k], x[k], s);  // explicit, as in `tile`'s tail
  return s;
}

// One row x [H] into y [H], in the order of HF's LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).
inline void rmsnorm_row(const float* x, int64_t H, const float* w, float eps, float* y) {
  const float r = 1.0f / std::sqrt(sumsq(x, H) / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) y[k] = w[k] * (x[k] * r);
}

// rmsnorm_row over the M rows of x [M, H] (row stride ldx) into y [M, H], on this thread.
inline void rmsnorm_rows(const float* x, int64_t M, int64_t ldx, int64_t H, const float* w, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) rmsnorm_row(x + m * ldx, H, w, eps, y + m * H);
}

// rmsnorm_rows over the rows of x [M, H] into y [M, H], split between the threads. Then, on the
// thread that wrote them, after(m0, m1) for each of its runs of rows (`quantize_ahead`).
template <typename After>
void rmsnorm_then(const float* x, int64_t M, int64_t H, const float* w, float eps, float* y, const After& after) {
  rows_in_parallel(M, [&](int64_t m0, int64_t m1) {
    prefetch_rows_for_write(M, y, H, m0, m1);
    rmsnorm_rows(x + m0 * H, m1 - m0, H, H, w, eps, y + m0 * H);
    after(m0, m1);
  });
}

// The rows of x [M, K] (row stride ldx), normalised first where `own` has a norm, in this thread's
// own buffer [M, K] (or x itself without a norm): its row stride in *ld.
inline const float* own_normed(const float* x, int64_t M, int64_t ldx, int64_t K, const OwnRows& own, int64_t* ld) {
  thread_local Vec64<float> xn;
  *ld = ldx;
  if (own.w == nullptr) return x;
  xn.resize(M * K);
  rmsnorm_rows(x, M, ldx, K, own.w, own.eps, xn.data());
  *ld = K;
  return xn.data();
}

void rmsnorm(const float* x, int64_t M, int64_t H, const float* w, float eps, float* y) {
  rmsnorm_then(x, M, H, w, eps, y, [](int64_t, int64_t) {});
}

// HF's rotate_half convention: out = x * cos + cat(-x2, x1) * sin, with cos/sin rows of width D.
inline void rope(float* v, const float* cos, const float* sin, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t d = 0; d < h; ++d) {
    const float x1 = v[d], x2 = v[d + h];
    v[d] = x1 * cos[d] + (-x2) * sin[d];
    v[d + h] = x2 * cos[d + h] + x1 * sin[d + h];
  }
}

// The attention code below reads keys and values of type KT from the cache: float32, or float16
// (`f16`) for the int8 and bfloat16 formats. Every key and value widens exactly to float32 before
// any arithmetic, so each path computes the same thing for either type.
template <typename KT>
inline float dot(const float* a, const KT* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), load8(b + k), acc);
  float s = hsum(acc);
  for (; k < n; ++k) s = std::fma(a[k], to_f32(b[k]), s);
  return s;
}

// Four keys at once for throughput; each score is the same op sequence as dot().
template <typename KT>
inline void dot4(const float* q, const KT* k, int64_t D, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, load8(k + d), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k + D + d), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k + 2 * D + d), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k + 3 * D + d), a3);
  }
  float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
  for (; d < D; ++d)
    for (int i = 0; i < 4; ++i) s[i] = std::fma(q[d], to_f32(k[i * D + d]), s[i]);
  for (int i = 0; i < 4; ++i) out[i] = s[i];
}

// Eight keys at once, each score again dot()'s op sequence (`hsum8`).
template <typename KT>
inline void dot8(const float* q, const KT* k, int64_t D, float* out) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(k + i * D + d), a[i]);
  }
  hsum8(a, out);
  for (; d < D; ++d)
    for (int i = 0; i < 8; ++i) out[i] = std::fma(q[d], to_f32(k[i * D + d]), out[i]);
}

// Scores of keys j0 .. j1 - 1 (rows of k, D values each) into p[j0 .. j1), each dot(q, key).
template <typename KT>
inline void scores(const float* q, const KT* k, int64_t j0, int64_t j1, int64_t D, float* p) {
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) dot8(q, k + j * D, D, p + j);
  for (; j + 4 <= j1; j += 4) dot4(q, k + j * D, D, p + j);
  for (; j < j1; ++j) p[j] = dot(q, k + j * D, D);
}

// out[0 .. D) continues, for each element, its fma chain over the value rows j0 .. j1 - 1 in order:
// out[d] = fma(p[j], v[j * D + d], out[d]). The key loop is outside, so a value row is read once,
// front to back, and 8 columns' chains are independent (a column block at a time made each fma
// wait for the previous one and swept the values D / 8 times); the arithmetic is the same.
template <int NB, typename KT>
inline void weighted_block(const float* p, const KT* v, int64_t j0, int64_t j1, int64_t D,
                           float* out) {
  __m256 a[NB];
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) a[b] = _mm256_loadu_ps(out + 8 * b);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const KT* row = v + j * D;
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) a[b] = _mm256_fmadd_ps(pj, load8(row + 8 * b), a[b]);
  }
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) _mm256_storeu_ps(out + 8 * b, a[b]);
}

template <typename KT>
inline void weighted_rows(const float* p, const KT* v, int64_t j0, int64_t j1, int64_t D,
                          float* out) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) weighted_block<8>(p, v + d, j0, j1, D, out + d);
  for (; d + 8 <= D; d += 8) weighted_block<1>(p, v + d, j0, j1, D, out + d);
  for (; d < D; ++d)
    for (int64_t j = j0; j < j1; ++j) out[d] = std::fma(p[j], to_f32(v[j * D + d]), out[d]);
}

constexpr int64_t kQ4Tile = 16;                         // weight rows per tile
constexpr int64_t kTileHalves = 2 * kQ4Tile;            // bytes of 16 float16 or int16 values, one per row
// One tile's block in `q4_pack`'s layout: codes, then d and m (float16); in `q8_pack`'s: codes, then
// d (float16) and the code sums (int16). The *At constants are where each part starts.
constexpr int64_t kQ4CodeBytes = 256, kQ4DAt = kQ4CodeBytes, kQ4MAt = kQ4DAt + kTileHalves;
constexpr int64_t kQ4BlockBytes = kQ4MAt + kTileHalves;
constexpr int64_t kQ8CodeBytes = 512, kQ8DAt = kQ8CodeBytes, kQ8SumAt = kQ8DAt + kTileHalves;
constexpr int64_t kQ8BlockBytes = kQ8SumAt + kTileHalves;
constexpr int kQ4Group = 4;                             // tiles per thread work item
constexpr int kQ4A8TileRows = 2;  // w4a8 passes of at least this many rows go a tile at a time

// 8-bit block rows (`quantize_blocks8`): x [M, K] as codes and each block's scale and sum.
struct BlockRows8 {
  const uint8_t* a;  // [M, K]
  const float* da;   // [M, K / 32]
  const float* sa;   // [M, K / 32]
};

// A product's 8-bit block rows written ahead by the job that computes its input: the norms, SwiGLU
// and the attention quantise each row or query output as they finish it (`quantize_ahead`,
// `FastLlamaKernel::run`), so the product takes them as they are instead of quantising its input in
// a job of its own (the threads' handoff, and each row read back by the other thread). `offset` as
// in `quantize_blocks8`, set by the product's weight format; `stream`: the codes go out with
// non-temporal stores (`quantize_ahead`, `quantize_span`; calls of at most kStreamRows rows), fenced
// by the job that writes them. The codes are those `block_rows8` forms from the same floats, so every
// output is the same, bitwise.
struct Blocks8 {
  Vec64<uint8_t> a;           // [M, K] (aligned for `quantize_blocks8`'s streaming stores)
  std::vector<float> da, sa;  // [M, K / 32]
  int64_t K = 0;
  bool offset = false;
  bool stream = false;
  void resize(int64_t M, int64_t k, bool off, bool streamed = false) {
    K = k;
    offset = off;
    stream = streamed;
    a.resize(M * K);
    da.resize(M * (K / 32));
    sa.resize(M * (K / 32));
  }
  // The rows from r0 on.
  BlockRows8 rows(int64_t r0 = 0) const { return {a.data() + r0 * K, da.data() + r0 * (K / 32), sa.data() + r0 * (K / 32)}; }
};

// What each thread of a product does with its columns c0 .. c1 - 1 once they are final in every
// row, as the last step of its chunk (`FastLlamaKernel::run`: RoPE and the cache writes of the heads
// it computed), so that work needs no job of its own and its data never crosses to the other thread.
// With `halves` the product's threads split its two halves of columns alike (a thread's groups
// of kQ4Group tiles are the same ones in each half: gate and up columns together), and fn gets
// columns c0 .. c1 - 1 of each half; the halves must hold whole groups.
struct ColumnsDone {
  void (*fn)(const void* ctx, int64_t c0, int64_t c1);
  const void* ctx;
  bool halves = false;
};

// A ColumnsDone calling f(c0, c1), which must outlive the product.
template <typename F>
inline ColumnsDone columns_done(const F& f, bool halves = false) {
  return {[](const void* c, int64_t c0, int64_t c1) { (*static_cast<const F*>(c))(c0, c1); }, &f, halves};
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Exact 4-bit blocks against int16 activations, in integers (a prototype of an int4 weight format;
// session 41). A Q4_1 block of 32 weights is d * q + m, q in 0..15 (`_q4_blocks`). With each input
// row quantised as for int8 weights (x ~= xs * a, a int16 = 256 hi + lo, hi signed, lo unsigned;
// `quantize_rows_bytes`), a block's contribution is d * (sum q a) + m * (sum a): sum q a = 256 H + L
// with H = sum q hi and L = sum q lo, both exact in int32, and `vpdpbusd` forms either directly,
// the codes being valid both as unsigned bytes (H: codes x signed hi) and as signed ones (L:
// unsigned lo x codes). |sum q a| <= 15 * 32767 * 32 < 2^24 and |sum a| <= 32767 * 32, so both
// convert to float32 exactly; each output then runs one fma chain over its row's blocks in order
// (d * S, then m * A, per block) and is scaled by xs once: the same operations for a row whoever
// shares the call, so the outputs do not depend on how many rows a call holds.
//
// Layout (`q4_pack`): weight rows in tiles of 16, tiles in groups of kQ4Group (the last may hold
// fewer); per tile and block, 256 bytes of codes then d[16] and m[16] as float16, as GGUF stores
// them (widened exactly when read): 320 bytes, 5 bits a weight. With float32 scales (384 bytes,
// sessions 41-42) a greedy step read 17% more, and cost more (SmolLM2-135M at 200 cached tokens,
// one model per build alternating, benchmarks/kernel_ab.py --own-weights, min ms, float32 /
// float16 scales: w4a8 1 token 3.96 / 3.39, 5 tokens 5.00 / 4.51; int4 3.85 / 3.23, 5.64 / 5.35;
// the head's `q8_pack` blocks went from 640 to 576 bytes the same way). Every output is bitwise the
// same. A group holds its tiles' first blocks, then their second, and so on, so that a pass over it reads
// one stream from memory. Codes vector j (0..3) holds, per row r, the 4 bytes GGUF packs for the
// block's columns 4j .. 4j + 3 (low nibbles) and 16 + 4j .. 16 + 4j + 3 (high nibbles), so one `and`
// gives the 16 rows' 4 codes of one column quad in each 32-bit lane, and a shift and an `and` the
// other quad.
constexpr int kQ4Rows = 5;                              // input rows per pass at most
// The first pass asks for bytes this far ahead, into L2 (`_MM_HINT_T1`): into L1 instead, int4
// greedy steps cost 7-20% more (SmolLM2-135M at 200 cached tokens, benchmarks/kernel_ab.py, min
// ms T0 / T1: 1 token 3.94 / 3.52, 2 tokens 5.44 / 4.64, 3 6.82 / 5.41, 5 8.01 / 7.62).
constexpr int64_t kQ4Prefetch = 16 * 1024;
// Passes of one input row (decoding steps: bound by reading the weights) also ask for bytes
// kQ4FarPrefetch ahead into L3 (`_MM_HINT_T2`), so each core keeps more lines in flight from
// memory. On the 2-core Zen 4 guest with its vCPUs on two CCDs, one-token steps read the layer
// weights at about 34 GB/s where the memory gives 55-65 (from the caches the same products run at
// 77-100 GB/s); w4a8 one-token steps at 200 cached tokens (benchmarks/kernel_ab.py --placement,
// 500 rounds, paired medians, session 50): 0.957x across CCDs (3.39 -> 3.30 ms), 0.972x on one CCD
// (38 rounds; 0.995x in 272 of an earlier run). Asking for it in the layers' passes of more rows
// too cost 1-2% at five tokens on one CCD (their 5-row passes are bound by the multiplies); 80 KB
// ahead, 8-9% everywhere. The head's 8-bit blocks (`q8_pack`), read at the memory's rate even in
// passes of five rows, ask for it in every pass (`far_prefetch`): five-token steps 0.962x on one
// CCD (4.50 -> 4.33 ms, 89 rounds) and 0.978x across (111), session 51.
constexpr int64_t kQ4FarPrefetch = 3 * kQ4Prefetch;

// Whether a pass of MR rows over blocks of BlockBytes also asks for bytes kQ4FarPrefetch ahead.
template <int MR, int64_t BlockBytes>
constexpr bool far_prefetch() {
  return MR == 1 || BlockBytes == kQ8BlockBytes;
}

// Tiles for MR input rows at a time: registers 3 MR NT (sums) + 2 NT (codes) + 4 (broadcasts) <= 32.
constexpr int q4_tiles_for(int mr) { return mr == 1 ? 4 : mr <= 3 ? 2 : 1; }

// The loop both block formats share: MR input rows against NT tiles (tile u's block b at w + b *
// bstride + u * BlockBytes), `block(blk, b, f, h, l)` adding block b into the float32 sums f[MR][NT]
// by way of the two integer sums h and l (zeroed for each block), then each output scaled by its
// row's xs with the bias in one fma (or, with xs null, the bias added), stored as `store` says
// (kStoreAdd, kStoreStream).
template <int MR, int NT, int64_t BlockBytes, typename Block>
inline void block_tiles(int64_t B, const uint8_t* w, int64_t bstride, const float* xs, const float* bias, float* y,
                        int64_t ldy, int store, bool prefetch, const Block& block) {
  __m512 f[MR][NT];
#pragma GCC unroll 5
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) f[i][u] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = w + b * bstride;
    if (prefetch)
      for (int64_t o = 0; o < NT * BlockBytes; o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + kQ4Prefetch + o), _MM_HINT_T1);
        if constexpr (far_prefetch<MR, BlockBytes>())
          _mm_prefetch(reinterpret_cast<const char*>(blk + kQ4FarPrefetch + o), _MM_HINT_T2);
      }
    __m512i h[MR][NT], l[MR][NT];
#pragma GCC unroll 5
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int u = 0; u < NT; ++u) h[i][u] = l[i][u] = _mm512_setzero_si512();
    block(blk, b, f, h, l);
  }
#pragma GCC unroll 5
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) {
      const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias + kQ4Tile * u) : _mm512_setzero_ps();
      __m512 o = xs != nullptr ? _mm512_fmadd_ps(f[i][u], _mm512_set1_ps(xs[i]), bv) : _mm512_add_ps(f[i][u], bv);
      float* out = y + i * ldy + kQ4Tile * u;
      if (store & kStoreAdd) o = _mm512_add_ps(_mm512_loadu_ps(out), o);
      if (store & kStoreStream) _mm512_stream_ps(out, o);
      else _mm512_storeu_ps(out, o);
    }
}

// 16 float16 scales at p (a tile's d or m), widened to float32: exact.
inline __m512 load_half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 int16 at p (a tile's code sums), widened to int32.
inline __m512i load_int16x16(const uint8_t* p) {
  return _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Codes vector j (0..3) of NT tiles' 4-bit blocks at blk (tile u's at blk + u * kQ4BlockBytes),
// unpacked: c0[u] holds each row's codes of columns 4j .. 4j + 3 (the low nibbles), c1[u] those of
// 16 + 4j .. 16 + 4j + 3 (the high nibbles), a row to a 32-bit lane.
template <int NT>
inline void q4_codes(const uint8_t* blk, int j, __m512i (&c0)[NT], __m512i (&c1)[NT]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int u = 0; u < NT; ++u) {
    const __m512i v = _mm512_loadu_si512(blk + u * kQ4BlockBytes + 64 * j);
    c0[u] = _mm512_and_si512(v, low4);
    c1[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
}

// MR input rows against NT tiles of 4-bit blocks.
template <int MR, int NT>
inline void q4_tile(const i8* hi, const uint8_t* lo, const float* asum, int64_t K, const uint8_t* w,
                    int64_t bstride, const float* xs, const float* bias, float* y, int64_t ldy,
                    int store, bool prefetch) {
  const int64_t B = K / 32;
  block_tiles<MR, NT, kQ4BlockBytes>(B, w, bstride, xs, bias, y, ldy, store, prefetch,
                                     [&](const uint8_t* blk, int64_t b, __m512 (&f)[MR][NT], __m512i (&h)[MR][NT],
                                         __m512i (&l)[MR][NT]) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i c0[NT], c1[NT];
      q4_codes<NT>(blk, j, c0, c1);
#pragma GCC unroll 5
      for (int i = 0; i < MR; ++i) {
        const int64_t at = i * K + 32 * b + 4 * j;
        int32_t h0, l0, h1, l1;
        std::memcpy(&h0, hi + at, 4);
        std::memcpy(&l0, lo + at, 4);
        std::memcpy(&h1, hi + at + 16, 4);
        std::memcpy(&l1, lo + at + 16, 4);
        const __m512i hb0 = _mm512_set1_epi32(h0), lb0 = _mm512_set1_epi32(l0);
        const __m512i hb1 = _mm512_set1_epi32(h1), lb1 = _mm512_set1_epi32(l1);
#pragma GCC unroll 4
        for (int u = 0; u < NT; ++u) {
          h[i][u] = dpbusd(h[i][u], c0[u], hb0);  // codes (unsigned) x hi (signed)
          l[i][u] = dpbusd(l[i][u], lb0, c0[u]);  // lo (unsigned) x codes (signed)
          h[i][u] = dpbusd(h[i][u], c1[u], hb1);
          l[i][u] = dpbusd(l[i][u], lb1, c1[u]);
        }
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) {
      const uint8_t* tile = blk + u * kQ4BlockBytes;
      const __m512 d = load_half16(tile + kQ4DAt), m = load_half16(tile + kQ4MAt);
#pragma GCC unroll 5
      for (int i = 0; i < MR; ++i) {
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(h[i][u], 8), l[i][u]);
        f[i][u] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), f[i][u]);
        f[i][u] = _mm512_fmadd_ps(m, _mm512_set1_ps(asum[i * B + b]), f[i][u]);
      }
    }
  });
}

// Exact 8-bit blocks (GGUF's Q8_0: d * q, q in -127..127; int4's embedding and head) the same way:
// the codes are signed, so hi goes in offset by 128 (unsigned, `quantize_rows_bytes`) and each
// block's sum of codes, stored with it, takes the offset back out. `sum q a` is an exact int32 (at
// most 127 * 32767 * 32 < 2^31) but may exceed 2^24: its conversion to float32 rounds, the same
// way for every row. Layout (`q8_pack`): as `q4_pack`'s, with 512 bytes of codes (vector j: 16
// rows' codes of columns 4j .. 4j + 3), d[16] float16 and the code sums[16] int16 per tile and
// block.
template <int MR, int NT>
inline void q8_tile(const uint8_t* hi, const uint8_t* lo, int64_t K, const uint8_t* w, int64_t bstride,
                    const float* xs, const float* bias, float* y, int64_t ldy, int store, bool prefetch) {
  block_tiles<MR, NT, kQ8BlockBytes>(K / 32, w, bstride, xs, bias, y, ldy, store, prefetch,
                                     [&](const uint8_t* blk, int64_t b, __m512 (&f)[MR][NT], __m512i (&h)[MR][NT],
                                         __m512i (&l)[MR][NT]) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i c[NT];
#pragma GCC unroll 4
      for (int u = 0; u < NT; ++u) c[u] = _mm512_loadu_si512(blk + u * kQ8BlockBytes + 64 * j);
#pragma GCC unroll 5
      for (int i = 0; i < MR; ++i) {
        int32_t hv, lv;
        std::memcpy(&hv, hi + i * K + 32 * b + 4 * j, 4);
        std::memcpy(&lv, lo + i * K + 32 * b + 4 * j, 4);
        const __m512i hb = _mm512_set1_epi32(hv), lb = _mm512_set1_epi32(lv);
#pragma GCC unroll 4
        for (int u = 0; u < NT; ++u) {
          h[i][u] = dpbusd(h[i][u], hb, c[u]);  // (hi + 128) x codes
          l[i][u] = dpbusd(l[i][u], lb, c[u]);  // lo x codes
        }
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) {
      const uint8_t* tile = blk + u * kQ8BlockBytes;
      const __m512 d = load_half16(tile + kQ8DAt);
      const __m512i offset = _mm512_slli_epi32(load_int16x16(tile + kQ8SumAt), 7);  // 128 * sum q
#pragma GCC unroll 5
      for (int i = 0; i < MR; ++i) {
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(h[i][u], offset), 8), l[i][u]);
        f[i][u] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), f[i][u]);
      }
    }
  });
}

// 8-bit activations per block of 32 columns (the w4a8 format, session 42): each block of a row is
// x ~= da * a, a int8 in -127..127 rounded to nearest (ties to even), da = max |x| / 127 over the
// block (0 for a block of zeros, or one holding a NaN or an inf: its codes are 0), and sa = da *
// sum a, the block's sum as the codes give it. With `offset`, a is stored plus 128 as an unsigned
// byte (against signed weight codes, `q8a8_tile`). a [M, K] bytes, da and sa [M, K / 32]. With
// `stream`, the codes go out with non-temporal stores (a 16-byte aligned; the caller fences).
inline void quantize_blocks8(const float* x, int64_t M, int64_t ldx, int64_t K, uint8_t* a, float* da, float* sa,
                             bool offset, bool stream = false) {
  const __m512i flip = _mm512_set1_epi32(offset ? 0x80 : 0);
  const int64_t B = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* r = x + m * ldx + 32 * b;
      const __m512 v0 = _mm512_loadu_ps(r), v1 = _mm512_loadu_ps(r + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const bool bad = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
      uint8_t* out = a + m * K + 32 * b;
      if (bad || !(amax > 0.0f) || !std::isfinite(amax)) {
        std::memset(out, offset ? 0x80 : 0, 32);
        da[m * B + b] = sa[m * B + b] = 0.0f;
        continue;
      }
      const __m512 inv = _mm512_set1_ps(127.0f / amax);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // |q| <= 127
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      const __m128i c0 = _mm512_cvtepi32_epi8(_mm512_xor_si512(q0, flip));
      const __m128i c1 = _mm512_cvtepi32_epi8(_mm512_xor_si512(q1, flip));
      if (stream) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(out), c0);
        _mm_stream_si128(reinterpret_cast<__m128i*>(out + 16), c1);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), c0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), c1);
      }
      const float d = amax / 127.0f;
      da[m * B + b] = d;
      sa[m * B + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
}

// Rows m0 .. m1 - 1 of x [.., b.K] (row stride ldx) into the same rows of b, asking first for the
// lines it will write (`prefetch_rows_for_write`: in calls of at most 8 rows of M); b's streamed
// codes (`Blocks8::stream`) are not asked for, and are fenced before the handoff.
inline void quantize_ahead(Blocks8& b, const float* x, int64_t ldx, int64_t M, int64_t m0, int64_t m1) {
  const int64_t K = b.K, B = K / 32;
  if (!b.stream) prefetch_rows_for_write(M, b.a.data(), K, m0, m1);
  prefetch_rows_for_write(M, b.da.data(), B, m0, m1);
  prefetch_rows_for_write(M, b.sa.data(), B, m0, m1);
  quantize_blocks8(x + m0 * ldx, m1 - m0, ldx, K, b.a.data() + m0 * K, b.da.data() + m0 * B, b.sa.data() + m0 * B,
                   b.offset, b.stream);
  if (b.stream) _mm_sfence();
}

// n values x (n % 32 == 0) into b at flat column `at` of its [M, K] rows (at % 32 == 0): one
// attention query's output, whose D columns lie whole in one row. b's streamed codes
// (`Blocks8::stream`) are left for the caller to fence (`_mm_sfence`) before the product reads them.
inline void quantize_span(Blocks8& b, const float* x, int64_t at, int64_t n) {
  quantize_blocks8(x, 1, n, n, b.a.data() + at, b.da.data() + at / 32, b.sa.data() + at / 32, b.offset, b.stream);
}

// x [M, K] quantised into this thread's buffers by `quantize_blocks8`.
inline BlockRows8 block_rows8(const float* x, int64_t M, int64_t ldx, int64_t K, bool offset) {
  thread_local Blocks8 rows;
  rows.resize(M, K, offset);
  Blocks8* b = &rows;  // this thread's buffers, by pointer (see byte_rows)
  rows_in_parallel(M, [=](int64_t m0, int64_t m1) { quantize_ahead(*b, x, ldx, M, m0, m1); });
  return rows.rows();
}

// The rows of x [M, K] (`own_normed`) quantised to 8-bit blocks in this thread's own buffers, all
// on this thread (`OwnRows`): the same codes the norm's job and `quantize_ahead` would form.
inline BlockRows8 own_rows8(const float* x, int64_t M, int64_t ldx, int64_t K, const OwnRows& own, bool offset) {
  thread_local Blocks8 rows;
  int64_t ld = 0;
  const float* xn = own_normed(x, M, ldx, K, own, &ld);
  rows.resize(M, K, offset);
  quantize_ahead(rows, xn, ld, M, 0, M);
  return rows.rows();
}

// The same as `byte_rows` forms (int4's int16 rows), all on this thread (`OwnRows`).
inline ByteRows own_byte_rows(const float* x, int64_t M, int64_t ldx, int64_t K, const OwnRows& own, bool offset_hi,
                              bool block_sums) {
  thread_local ByteRowBuffers buf;
  int64_t ld = 0;
  const float* xn = own_normed(x, M, ldx, K, own, &ld);
  const ByteRowBuffers::Out o = buf.size(M, K, block_sums);
  quantize_rows_bytes(xn, M, ld, K, o.hi, o.lo, o.xs, offset_hi, o.sums);
  return {o.xs, o.hi, o.lo, o.sums};
}

// Block b of one tile (its 4-bit blocks at `tile`) into the float sums f[i][u] of MR rows, from the
// rows' integer sums s[i]: (d * da) * S, then m * sa (`q4a8_tile`).
template <int MR, int NT>
inline void q4a8_add_block(const uint8_t* tile, const float* da, const float* sa, int64_t B, int64_t b,
                           const __m512i (&s)[MR], __m512 (&f)[MR][NT], int u) {
  const __m512 d = load_half16(tile + kQ4DAt), m = load_half16(tile + kQ4MAt);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(da[i * B + b]));
    f[i][u] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s[i]), f[i][u]);
    f[i][u] = _mm512_fmadd_ps(m, _mm512_set1_ps(sa[i * B + b]), f[i][u]);
  }
}

// MR input rows of 8-bit blocks (`quantize_blocks8`) against NT tiles of 4-bit blocks (`q4_pack`): a
// block's sum S = sum q a is exact in int32 (|S| <= 15 * 127 * 32) and in float32; each output runs
// one fma chain over its row's blocks, (d * da) * S, then m * sa, per block. One `vpdpbusd` per 4
// weights and row, half of `q4_tile`'s.
// Passes of kQ4A8TileRows rows or more take a block's tiles one at a time: each tile's codes meet
// every row's 4 activation bytes as the instruction's broadcast memory operand (`dpbusd_from`), and
// its MR integer sums go into the float sums before the next tile's start, so the MR x NT float
// sums stay in registers (before, MR x NT integer sums beside them left some in memory). The same
// integers and the same chains: logits bitwise the same (`benchmarks/bitwise_ab.py`, w4a8). Session
// 54, 2-core Zen 4 EPYC, w4a8 greedy steps at 200 cached tokens (`benchmarks/kernel_ab.py
// --placement`, paired medians) against all tiles at once: 30 rounds, 2 / 5 / 8 tokens 0.969x /
// 0.966x / 0.961x; 80 rounds 0.980x / 0.969x / 0.973x (5 tokens 0.973x on one CCD, 0.964x across);
// 60 rounds in a slow phase, 5 tokens 0.999x and a 128-token prompt piece 0.997x; one token (one
// row, unchanged) 0.99-1.00x. From 5 rows only: 5 tokens 0.953x, 2 and 8 tokens gained less.
template <int MR, int NT>
inline void q4a8_tile(const uint8_t* a, const float* da, const float* sa, int64_t K, const uint8_t* w,
                      int64_t bstride, const float* bias, float* y, int64_t ldy, int store, bool prefetch) {
  const int64_t B = K / 32;
  block_tiles<MR, NT, kQ4BlockBytes>(B, w, bstride, nullptr, bias, y, ldy, store, prefetch,
                                     [&](const uint8_t* blk, int64_t b, __m512 (&f)[MR][NT], __m512i (&h)[MR][NT],
                                         __m512i (&)[MR][NT]) {
    if constexpr (MR >= kQ4A8TileRows) {
#pragma GCC unroll 4
      for (int u = 0; u < NT; ++u) {
        const uint8_t* tile = blk + u * kQ4BlockBytes;
        __m512i s[MR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) s[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          __m512i c0[1], c1[1];
          q4_codes<1>(tile, j, c0, c1);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const uint8_t* at = a + i * K + 32 * b + 4 * j;
            s[i] = dpbusd_from(s[i], c0[0], at);
            s[i] = dpbusd_from(s[i], c1[0], at + 16);
          }
        }
        q4a8_add_block<MR>(tile, da, sa, B, b, s, f, u);
      }
      return;
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i c0[NT], c1[NT];
      q4_codes<NT>(blk, j, c0, c1);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int64_t at = i * K + 32 * b + 4 * j;
        int32_t a0, a1;
        std::memcpy(&a0, a + at, 4);
        std::memcpy(&a1, a + at + 16, 4);
        const __m512i ab0 = _mm512_set1_epi32(a0), ab1 = _mm512_set1_epi32(a1);
#pragma GCC unroll 4
        for (int u = 0; u < NT; ++u) {
          h[i][u] = dpbusd(h[i][u], c0[u], ab0);  // codes (unsigned) x a (signed)
          h[i][u] = dpbusd(h[i][u], c1[u], ab1);
        }
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) {
      __m512i s[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) s[i] = h[i][u];
      q4a8_add_block<MR>(blk + u * kQ4BlockBytes, da, sa, B, b, s, f, u);
    }
  });
}

// The same with 8-bit weight blocks (`q8_pack`, signed codes): a goes in offset by 128 (`offset`)
// and each block's code sum takes it out, S = sum (a + 128) q - 128 sum q, exact (|S| <= 127 * 127
// * 32); each output's chain adds (d * da) * S per block.
template <int MR, int NT>
inline void q8a8_tile(const uint8_t* a, const float* da, int64_t K, const uint8_t* w, int64_t bstride,
                      const float* bias, float* y, int64_t ldy, int store, bool prefetch) {
  const int64_t B = K / 32;
  block_tiles<MR, NT, kQ8BlockBytes>(B, w, bstride, nullptr, bias, y, ldy, store, prefetch,
                                     [&](const uint8_t* blk, int64_t b, __m512 (&f)[MR][NT], __m512i (&h)[MR][NT],
                                         __m512i (&)[MR][NT]) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i c[NT];
#pragma GCC unroll 4
      for (int u = 0; u < NT; ++u) c[u] = _mm512_loadu_si512(blk + u * kQ8BlockBytes + 64 * j);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t av;
        std::memcpy(&av, a + i * K + 32 * b + 4 * j, 4);
        const __m512i ab = _mm512_set1_epi32(av);
#pragma GCC unroll 4
        for (int u = 0; u < NT; ++u) h[i][u] = dpbusd(h[i][u], ab, c[u]);  // (a + 128) x codes
      }
    }
#pragma GCC unroll 4
    for (int u = 0; u < NT; ++u) {
      const uint8_t* tile = blk + u * kQ8BlockBytes;
      const __m512 d = load_half16(tile + kQ8DAt);
      const __m512i offset = _mm512_slli_epi32(load_int16x16(tile + kQ8SumAt), 7);  // 128 * sum q
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(da[i * B + b]));
        f[i][u] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_sub_epi32(h[i][u], offset)), f[i][u]);
      }
    }
  });
}

// 8-bit activations: passes of up to 4 input rows against a whole group of 4 tiles at once (16
// integer sums in registers; GCC keeps some of the float sums in memory, read and written once
// per block). Against 8 rows by 1 tile (6 by 2 for 2-6 rows), the 120 layer products of
// SmolLM2-135M, min ms (/tmp/s42/variants.py, three builds alternating): 2 rows 3.31 -> 3.04, 3
// rows 3.20 -> 2.82, 5 rows 3.40 -> 3.35, 9 rows 6.60 (4.70 at 6 by 2) -> 4.67, 128 rows 60.1 (50.8)
// -> 50.3; w4a8 greedy steps at 200 cached tokens (benchmarks/kernel_ab.py, against 6 by 2): 3
// tokens 5.03 -> 4.57, 5 tokens 6.00 -> 5.60 ms.
// Calls of at most kQ4A8Rows rows (decoding steps; a verification of k = 4 drafts) take one pass
// of all their rows, wider ones passes of kQ4A8WideRows. Five rows in one pass, not 4 + 1, made the
// 120 layer products at 5 rows 5% cheaper (SmolLM2-135M, two builds alternating, 12 rounds, min ms:
// 3.32 -> 3.17, and 3.44 -> 3.27 in a second run), a 5-token w4a8 step at most 3.5% (within the
// noise: benchmarks/kernel_ab.py min / median ms, 16 rounds 4.55 / 4.92 -> 4.39 / 4.72, 14 rounds
// 4.31 / 4.66 -> 4.30 / 4.53); passes of 5 throughout made 128 rows 4% dearer (49.65 -> 51.69), so
// prompts keep passes of 4 (128 rows 49.75 -> 49.67 with this rule).
constexpr int kQ4A8Rows = 5;
constexpr int kQ4A8WideRows = 4;
constexpr int kQ4A8Tiles = kQ4Group;

// y[M, N] (+)= x[M, K] @ W^T + bias, W [N, K] as exact 4-bit blocks in `q4_pack`'s layout (N % 16 == 0,
// K % 32 == 0). Threads split groups of kQ4Group tiles; each group meets every input row, up to
// kQ4Rows at a time, while it sits in L1 / L2; the first pass asks for the next blocks ahead.
// With Q8: W as exact 8-bit blocks in `q8_pack`'s layout (`q8_tile`), the same way. With A8: the
// activations as 8-bit blocks (`quantize_blocks8`; `q4a8_tile`, `q8a8_tile`), up to kQ4A8Rows at a time
// (kQ4A8WideRows in wider calls).
// With `pre` (A8 only): the activations already quantised (`Blocks8`, offset as Q8 needs), x unread.
// With `done`: each thread's columns (whole groups of kQ4Group tiles) handed to it at the end; with
// done->halves, the threads split pairs of groups, group p of each half (the same columns of both).
// With `stream` (the caller's choice: `FastLlamaKernel::streams`), and y's rows 64-byte aligned: y
// written with non-temporal stores (for outputs the other thread reads next).
// With `own` (instead of `pre`): each thread first forms all of the input rows itself (`OwnRows`).
template <bool Q8 = false, bool A8 = false>
void linear_q4_tiles(const float* x, int64_t M, int64_t ldx, const uint8_t* wt, int64_t N, int64_t K,
                     const float* bias, float* y, int64_t ldy, bool accumulate, const Blocks8* pre,
                     const ColumnsDone* done, bool stream, int64_t pre_row, const OwnRows* own) {
  stream = stream && reinterpret_cast<uintptr_t>(y) % 64 == 0 && ldy % kQ4Tile == 0;
  const int store = (accumulate ? kStoreAdd : 0) | (stream ? kStoreStream : 0);
  ByteRows rows_pre_q{};
  BlockRows8 rows_pre{};
  if (own == nullptr) {
    if constexpr (A8)
      rows_pre = pre ? pre->rows(pre_row) : block_rows8(x, M, ldx, K, Q8);
    else
      rows_pre_q = byte_rows(x, M, ldx, K, Q8, !Q8);  // 4-bit blocks need each block's sum of a
  }
  constexpr int64_t kBlockBytes = Q8 ? kQ8BlockBytes : kQ4BlockBytes;
  constexpr int kRows = A8 ? kQ4A8Rows : kQ4Rows;
  const int64_t B = K / 32, tiles = N / kQ4Tile;
  const int64_t groups = (tiles + kQ4Group - 1) / kQ4Group;
  const bool halves = done != nullptr && done->halves;
  TORCH_CHECK(!halves || N % (2 * kQ4Group * kQ4Tile) == 0, "halves of whole groups");
  team_for(0, halves ? groups / 2 : groups, 1, [&](int64_t i0, int64_t i1) {
    constexpr int64_t F = sizeof(float), GC = kQ4Group * kQ4Tile;
    const int64_t c0 = i0 * GC, c1 = std::min(N, i1 * GC);  // its columns (of each half, with halves)
    BlockRows8 rows8 = rows_pre;
    ByteRows rows_q = rows_pre_q;
    if (own != nullptr) {
      if constexpr (A8)
        rows8 = own_rows8(x, M, ldx, K, *own, Q8);
      else
        rows_q = own_byte_rows(x, M, ldx, K, *own, Q8, !Q8);
    }
    const float* as = rows_q.sums;
    if (!stream) {
      if (halves) prefetch_for_write(M, y + N / 2 + c0, M, (c1 - c0) * F, ldy * F);
      prefetch_for_write(M, y + c0, M, (c1 - c0) * F, ldy * F);
    }
    const int64_t n = halves ? 2 : 1;  // groups per item: with halves, p then groups / 2 + p
    for (int64_t v = i0 * n; v < i1 * n; ++v) {
      const int64_t g = halves ? v % 2 * (groups / 2) + v / 2 : v;
      const int64_t t0 = g * kQ4Group, t1 = std::min<int64_t>(tiles, t0 + kQ4Group);
      const int64_t bstride = (t1 - t0) * kBlockBytes;  // between a tile's blocks
      const uint8_t* gw = wt + t0 * B * kBlockBytes;
      // Two rows go one at a time, each pass over the group's tiles from L1 / L2: their own pass
      // of 2 rows by 2 tiles was slower (int4 greedy steps at 200 cached tokens, SmolLM2-135M, two
      // builds alternating, min ms: 2 tokens 5.65 -> 4.85, 1 token 3.76 -> 3.69; one row at a
      // time for 3 tokens no faster, for 4 and 5 slower).
      const int64_t step = A8 ? (M <= kQ4A8Rows ? kQ4A8Rows : kQ4A8WideRows) : M <= 2 ? 1 : kRows;
      for (int64_t m = 0; m < M; m += step) {
        const int64_t mr = std::min<int64_t>(step, M - m);
        with_rows<kRows>(mr, [&](auto R) {
          constexpr int MR = decltype(R)::value;
          constexpr int NT = A8 ? kQ4A8Tiles : q4_tiles_for(MR);
          for (int64_t t = t0; t < t1; t += NT) {
            with_rows<NT>(std::min<int64_t>(NT, t1 - t), [&](auto T) {
              constexpr int TN = decltype(T)::value;
              const int64_t j = t * kQ4Tile;
              const uint8_t* tw = gw + (t - t0) * kBlockBytes;
              const float* bj = bias ? bias + j : nullptr;
              float* yj = y + m * ldy + j;
              if constexpr (A8 && Q8)
                q8a8_tile<MR, TN>(rows8.a + m * K, rows8.da + m * B, K, tw, bstride, bj, yj, ldy, store, m == 0);
              else if constexpr (A8)
                q4a8_tile<MR, TN>(rows8.a + m * K, rows8.da + m * B, rows8.sa + m * B, K, tw, bstride, bj, yj, ldy,
                                  store, m == 0);
              else if constexpr (Q8)
                q8_tile<MR, TN>(reinterpret_cast<const uint8_t*>(rows_q.hi) + m * K, rows_q.lo + m * K, K, tw,
                                bstride, rows_q.xs + m, bj, yj, ldy, store, m == 0);
              else
                q4_tile<MR, TN>(rows_q.hi + m * K, rows_q.lo + m * K, as + m * B, K, tw, bstride, rows_q.xs + m, bj,
                                yj, ldy, store, m == 0);
            });
          }
        });
      }
    }
    if (stream) _mm_sfence();  // the streamed lines reach memory before the team's handoff
    if (done) done->fn(done->ctx, c0, c1);
  });
}

// linear_q4_tiles for W's block format (`q8`: `q8_pack`'s, else `q4_pack`'s) and the activations'
// (`a8`: 8-bit blocks, else int16 rows), chosen at run time.
// `pre` (a8 only), `done` and `stream` as in linear_q4_tiles.
inline void linear_block_tiles(bool q8, bool a8, const float* x, int64_t M, int64_t ldx, const uint8_t* wt, int64_t N,
                               int64_t K, const float* bias, float* y, int64_t ldy, bool accumulate,
                               const Blocks8* pre = nullptr, const ColumnsDone* done = nullptr,
                               bool stream = false, int64_t pre_row = 0, const OwnRows* own = nullptr) {
  auto* f = q8 ? (a8 ? &linear_q4_tiles<true, true> : &linear_q4_tiles<true, false>)
               : (a8 ? &linear_q4_tiles<false, true> : &linear_q4_tiles<false, false>);
  f(x, M, ldx, wt, N, K, bias, y, ldy, accumulate, a8 ? pre : nullptr, done, stream, pre_row, own);
}
#else
inline void quantize_ahead(Blocks8&, const float*, int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "8-bit block activations need AVX-512 VNNI");  // never asked for: see `ahead`
}
inline void quantize_span(Blocks8&, const float*, int64_t, int64_t) {
  TORCH_CHECK(false, "8-bit block activations need AVX-512 VNNI");
}
#endif

// The head dimension whose queries of one key-value head the attention takes several at a time
// (AVX-512 below, AVX2 after it); other head dimensions go one query at a time.
constexpr int64_t kGroupedHeadDim = 64;

// A bfloat16 cache (int4 and w4a8 with VERISPEC_KV_CACHE=bfloat16: `FastLlamaKernel::attention_bf16`)
// holds one head's S positions (S a multiple of 32) of head dimension kGroupedHeadDim in the layouts
// `vdpbf16ps` reads whole:
//   keys [S / 16][D / 2][16][2]: per block of 16 keys and per pair of values (2p, 2p + 1), the
//     16 keys' pairs side by side, so that one register holds one pair of 16 keys;
//   values [S / 2][D][2]: per pair of positions (2i, 2i + 1), each value's two side by side, so that
//     one register holds 16 values of two positions.
// (Only builds with AVX-512 BF16 hold one; the others compile the code that writes it, never run.)
inline int64_t bf16_key_at(int64_t j, int64_t d) {
  return (j / 16) * 16 * kGroupedHeadDim + (d / 2) * 32 + (j % 16) * 2 + (d % 2);
}
inline int64_t bf16_value_at(int64_t j, int64_t d) { return (j / 2) * 2 * kGroupedHeadDim + d * 2 + (j % 2); }

#if defined(__AVX512BF16__) && defined(__AVX512F__)

// The 32 values at x as 16 pairs of bfloat16 (rounded to nearest even by `vcvtne2ps2bf16`).
inline __m512i bf16_pairs(const float* x) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
}

// Scores of QN queries (qp[x]: its 32 pairs of bfloat16) against the 16 keys of block `blk`:
// out[x][0 .. 16). Lane i of each sum is key i's chain of 32 `vdpbf16ps` steps, pair by pair in
// order, however many queries share the block.
template <int QN>
inline void bf16_block_scores(const uint32_t* const* qp, const bf16* blk, float* const* out) {
  __m512 a[QN];
#pragma GCC unroll 16
  for (int x = 0; x < QN; ++x) a[x] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int p = 0; p < kGroupedHeadDim / 2; ++p) {
    const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(blk + 32 * p));
#pragma GCC unroll 16
    for (int x = 0; x < QN; ++x) {
      const __m512bh q = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qp[x][p])));
      a[x] = _mm512_dpbf16_ps(a[x], k, q);
    }
  }
#pragma GCC unroll 16
  for (int x = 0; x < QN; ++x) _mm512_storeu_ps(out[x], a[x]);
}

// Weighted sums of QN queries over the value pairs i0 .. i1 - 1 (pp[x][i]: query x's weights of
// positions 2i and 2i + 1 as a pair of bfloat16): out[x][0 .. 64) continues, each element one
// chain of `vdpbf16ps` steps over the pairs in order, however many queries share the pairs.
template <int QN>
inline void bf16_weighted(const uint32_t* const* pp, const bf16* v, int64_t i0, int64_t i1,
                          float* const* out) {
  __m512 a[QN][4];
#pragma GCC unroll 6
  for (int x = 0; x < QN; ++x)
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) a[x][r] = _mm512_loadu_ps(out[x] + 16 * r);
  for (int64_t i = i0; i < i1; ++i) {
    const bf16* pair = v + i * 2 * kGroupedHeadDim;
    __m512bh r[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) r[k] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pair + 32 * k));
#pragma GCC unroll 6
    for (int x = 0; x < QN; ++x) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pp[x][i])));
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) a[x][k] = _mm512_dpbf16_ps(a[x][k], r[k], w);
    }
  }
#pragma GCC unroll 6
  for (int x = 0; x < QN; ++x)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out[x] + 16 * k, a[x][k]);
}
#endif

#if defined(__AVX512F__)
// Attention of several queries at once in 512-bit registers, for head dimension kGroupedHeadDim,
// every output bitwise the same as the 256-bit code's above, only faster where queries share a
// key-value head (GQA, and the tokens of a verification). On the Xeon, one thread, 1504 keys in
// L2, ms per 30 layers (benchmarks/SESSIONS.md, session 14): five queries' scores 0.65 -> 0.52-0.57,
// their weighted sums 0.64 -> 0.32.

// 16 keys' or values' elements, widened to float32.
inline __m512 load16z(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16z(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// [row a: 8 values | row b: 8 values] in one register, widened to float32.
template <typename KT>
inline __m512 load8_pair(const KT* a, const KT* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(load8(a))),
                                             _mm256_castps_pd(load8(b)), 1));
}

// Scores of QN queries against 8 keys: out[x][0 .. 8). Two keys share a register and each query's 8
// values are repeated in both halves, so lane l of each half forms dot's chain for its key; the
// four registers of key pairs (`key(i, d)`: keys 2i and 2i + 1 at values d .. d + 7) are loaded
// once for all QN queries.
template <int QN, typename KeyPairs>
inline void dot8_queries_of(const float* const* q, const KeyPairs& key, float* const* out) {
  constexpr int64_t D = kGroupedHeadDim;
  __m512 a[QN][4];
#pragma GCC unroll 6
  for (int x = 0; x < QN; ++x)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) a[x][i] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t d = 0; d < D; d += 8) {
    __m512 kk[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) kk[i] = key(i, d);
#pragma GCC unroll 6
    for (int x = 0; x < QN; ++x) {
      const __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(load8(q[x] + d))));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[x][i] = _mm512_fmadd_ps(qv, kk[i], a[x][i]);
    }
  }
#pragma GCC unroll 6
  for (int x = 0; x < QN; ++x) hsum8_pairs(a[x], out[x]);
}

// dot8_queries_of keys j .. j + 7 of the cache (rows of k, 64 values each).
// Keys 2i and 2i + 1 of k (rows of 64 values) at values d .. d + 7, in one register.
template <typename KT>
inline __m512 key_pair(const KT* k, int i, int64_t d) {
  return load8_pair(k + 2 * i * kGroupedHeadDim + d, k + (2 * i + 1) * kGroupedHeadDim + d);
}

template <int QN, typename KT>
inline void dot8_queries(const float* const* q, const KT* k, float* const* out) {
  dot8_queries_of<QN>(q, [k](int i, int64_t d) { return key_pair(k, i, d); }, out);
}

// weighted_rows for QN queries over the same value rows j0 .. j1 - 1: each row is loaded once
// for all of them. Each output element is the same fma chain over the rows in order.
template <int QN, typename KT>
inline void weighted_queries(const float* const* p, const KT* v, int64_t j0, int64_t j1,
                             float* const* out) {
  constexpr int64_t D = kGroupedHeadDim;
  __m512 a[QN][4];
#pragma GCC unroll 6
  for (int x = 0; x < QN; ++x)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) a[x][i] = _mm512_loadu_ps(out[x] + 16 * i);
  for (int64_t j = j0; j < j1; ++j) {
    const KT* row = v + j * D;
    __m512 r[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) r[i] = load16z(row + 16 * i);
#pragma GCC unroll 6
    for (int x = 0; x < QN; ++x) {
      const __m512 pj = _mm512_set1_ps(p[x][j]);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[x][i] = _mm512_fmadd_ps(pj, r[i], a[x][i]);
    }
  }
#pragma GCC unroll 6
  for (int x = 0; x < QN; ++x)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out[x] + 16 * i, a[x][i]);
}
#endif

#if !defined(__AVX512F__)
// Attention of three queries at once in 256-bit registers, for head dimension kGroupedHeadDim,
// every output bitwise the same as one query at a time, only faster where queries share a
// key-value head (GQA: SmolLM2's 3 query heads per KV head; the tokens of a verification or a
// prompt): each key or value is loaded, and widened from float16, once for the three. One at a
// time, widening the float16 cache took most of the attention's time on a 2-core Zen 3 EPYC
// (session 28, perf): attention was 20% of an int8 prompt of 704 tokens there, 15% with these.
// SmolLM2-135M, two builds over one copy of the weights alternating (/tmp/s28/ab.py, min / median
// of 10, ms, a noisy machine): int8 prompt of 704 tokens 993.8 / 1118.6 -> 960.3 / 994.4, greedy
// step at 200 cached tokens 6.50 / 7.38 -> 6.30 / 7.15; float32 (its cache float32, nothing to
// widen; min / median of 8) 704 tokens 1274 / 1360 -> 1271 / 1339, one token 7.04 / 8.14 -> 6.87
// / 7.10. `plan_attention` keeps each token's G queries in one item, so they meet as threes.

// Scores of 3 queries against keys j .. j + 3 (rows of k, 64 values each): out[x][0 .. 4). Each
// score is dot()'s chain (one 8-lane multiply-add per 8 values, in order), then hsum's sum.
template <typename KT>
inline void dot4_queries3(const float* const* q, const KT* k, float* const* out) {
  constexpr int64_t D = kGroupedHeadDim;
  __m256 a0[4], a1[4], a2[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) a0[i] = a1[i] = a2[i] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 q0 = _mm256_loadu_ps(q[0] + d), q1 = _mm256_loadu_ps(q[1] + d);
    const __m256 q2 = _mm256_loadu_ps(q[2] + d);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256 kk = load8(k + i * D + d);
      a0[i] = _mm256_fmadd_ps(q0, kk, a0[i]);
      a1[i] = _mm256_fmadd_ps(q1, kk, a1[i]);
      a2[i] = _mm256_fmadd_ps(q2, kk, a2[i]);
    }
  }
  const __m256 z = _mm256_setzero_ps();
  const __m256 first[8] = {a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]};
  const __m256 last[8] = {a2[0], a2[1], a2[2], a2[3], z, z, z, z};
  alignas(32) float s[16];
  hsum8(first, s);
  hsum8(last, s + 8);
#pragma GCC unroll 3
  for (int x = 0; x < 3; ++x)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) out[x][i] = s[4 * x + i];
}

// weighted_rows for 3 queries over the same value rows j0 .. j1 - 1, head dimension 64 in two
// halves of 32 (12 accumulators): each row's values are loaded once for the three. Each output
// element is the same fma chain over the rows in order.
template <typename KT>
inline void weighted_queries3(const float* const* p, const KT* v, int64_t j0, int64_t j1,
                              float* const* out) {
  constexpr int64_t D = kGroupedHeadDim;
#pragma GCC unroll 1
  for (int64_t h = 0; h < D; h += 32) {
    __m256 a0[4], a1[4], a2[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      a0[c] = _mm256_loadu_ps(out[0] + h + 8 * c);
      a1[c] = _mm256_loadu_ps(out[1] + h + 8 * c);
      a2[c] = _mm256_loadu_ps(out[2] + h + 8 * c);
    }
    for (int64_t j = j0; j < j1; ++j) {
      const KT* row = v + j * D + h;
      const __m256 p0 = _mm256_set1_ps(p[0][j]), p1 = _mm256_set1_ps(p[1][j]), p2 = _mm256_set1_ps(p[2][j]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256 r = load8(row + 8 * c);
        a0[c] = _mm256_fmadd_ps(p0, r, a0[c]);
        a1[c] = _mm256_fmadd_ps(p1, r, a1[c]);
        a2[c] = _mm256_fmadd_ps(p2, r, a2[c]);
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      _mm256_storeu_ps(out[0] + h + 8 * c, a0[c]);
      _mm256_storeu_ps(out[1] + h + 8 * c, a1[c]);
      _mm256_storeu_ps(out[2] + h + 8 * c, a2[c]);
    }
  }
}
#endif

// One block of keys j0 .. j0 + JB - 1 for an item's n queries (query(a): its float32 vector;
// end(a, j0): where its keys in the block end): scores into p[a * S + j]. With head_dim 64 on
// AVX-512, groups of 6 (while 6 are left), then of 3 (2 where 2 or 4 are left) share their key
// loads over the keys all of them attend to, in whole 8s; each query's other keys, and every query
// elsewhere, go through `scores`. Every score is dot()'s, however the queries are grouped.
// Groups of 6 (a verification's items of two tokens) convert each float16 key once for six
// queries instead of twice for three: on the 2-core Zen 4, one thread, 704 keys in L2
// (/tmp/s52/mb/attn.cpp), 4.43 -> 3.79 TSC cycles per query and key (the multiply-adds alone
// 2.86; hsum8_pairs about 0.8 of the rest). Whole w4a8 steps (benchmarks/kernel_ab.py
// --placement, paired medians, session 52): five tokens at 700 cached tokens 0.976x and 0.973x
// (60 and 100 rounds, both placements alike), at 200 within the noise (0.99-1.005x); one token,
// whose items hold three queries, unchanged.
template <typename KT, typename Query, typename End>
inline void block_scores(int64_t n, int64_t j0, const KT* K, int64_t D, int64_t S, const Query& query,
                         const End& end, float* p) {
  int64_t a = 0;
#if defined(__AVX512F__)
  while (D == kGroupedHeadDim && a < n) {
    const int64_t take = n - a >= 6 ? 6 : (n - a) % 3 == 1 && n - a > 1 ? 2 : std::min<int64_t>(3, n - a);
    int64_t common = j0;
    if (take > 1) {
      int64_t e = end(a, j0);
      for (int64_t x = 1; x < take; ++x) e = std::min(e, end(a + x, j0));
      common = e > j0 ? j0 + (e - j0) / 8 * 8 : j0;
    }
    const float* q[6];
    float* o[6];
    for (int64_t x = 0; x < take; ++x) q[x] = query(a + x);
    for (int64_t j = j0; j < common; j += 8) {
      for (int64_t x = 0; x < take; ++x) o[x] = p + (a + x) * S + j;
      if (take == 6) dot8_queries<6>(q, K + j * D, o);
      else if (take == 3) dot8_queries<3>(q, K + j * D, o);
      else dot8_queries<2>(q, K + j * D, o);
    }
    for (int64_t x = 0; x < take; ++x)
      if (end(a + x, j0) > common) scores(q[x], K, common, end(a + x, j0), D, p + (a + x) * S);
    a += take;
  }
#else
  for (; D == kGroupedHeadDim && a + 3 <= n; a += 3) {  // threes over the keys all three attend to, in 4s
    const int64_t e = std::min({end(a, j0), end(a + 1, j0), end(a + 2, j0)});
    const int64_t common = e > j0 ? j0 + (e - j0) / 4 * 4 : j0;
    const float* q[3] = {query(a), query(a + 1), query(a + 2)};
    float* o[3];
    for (int64_t j = j0; j < common; j += 4) {
      for (int64_t x = 0; x < 3; ++x) o[x] = p + (a + x) * S + j;
      dot4_queries3(q, K + j * D, o);
    }
    for (int64_t x = 0; x < 3; ++x)
      if (end(a + x, j0) > common) scores(q[x], K, common, end(a + x, j0), D, p + (a + x) * S);
  }
#endif
  for (; a < n; ++a)
    if (end(a, j0) > j0) scores(query(a), K, j0, end(a, j0), D, p + a * S);
}

#if defined(__AVX512F__)
// block_weighted's grouped part, for head dimension kGroupedHeadDim: the queries in groups of up to
// G, each group sharing the value rows all of them attend to, read from `rows` (whose row 0 is the
// block's row `first`: the cache itself with first 0, or the block widened, first j0); each query's
// other rows from the cache. Each output element is the same fma chain however they are grouped.
template <int G, typename KT, typename RT, typename End, typename Out>
inline void weighted_groups(int64_t n, int64_t j0, const KT* V, const RT* rows, int64_t first, int64_t S,
                            const float* p, const End& end, const Out& out) {
  for (int64_t a = 0; a < n;) {
    const int64_t take = std::min<int64_t>(G, n - a);
    int64_t common = end(a, j0);
    for (int64_t x = 1; x < take; ++x) common = std::min(common, end(a + x, j0));
    common = std::max(common, j0);
    const float* pp[G];
    float* o[G];
    for (int64_t x = 0; x < take; ++x) {
      pp[x] = p + (a + x) * S + first;
      o[x] = out(a + x);
    }
    with_rows<G>(take, [&](auto QN) { weighted_queries<QN>(pp, rows, j0 - first, common - first, o); });
    for (int64_t x = 0; x < take; ++x)
      if (end(a + x, j0) > common) weighted_rows(p + (a + x) * S, V, common, end(a + x, j0), kGroupedHeadDim, o[x]);
    a += take;
  }
}
#endif

// The weighted sums of the same block: out(a) (+)= p[a * S + j] * V[j] over the block's keys of
// query a, in order. With head_dim 64 on AVX-512, up to 4 queries share each value row over the
// rows all of them attend to; each output element is the same fma chain however they are grouped.
template <typename KT, typename End, typename Out>
inline void block_weighted(int64_t n, int64_t j0, const KT* V, int64_t D, int64_t S, const float* p,
                           const End& end, const Out& out) {
  int64_t a = 0;
#if defined(__AVX512F__)
  if (D == kGroupedHeadDim) return weighted_groups<4>(n, j0, V, V, 0, S, p, end, out);
#else
  for (; D == kGroupedHeadDim && a + 3 <= n; a += 3) {  // threes over the rows all three attend to
    const int64_t common = std::max(j0, std::min({end(a, j0), end(a + 1, j0), end(a + 2, j0)}));
    const float* pp[3] = {p + a * S, p + (a + 1) * S, p + (a + 2) * S};
    float* o[3] = {out(a), out(a + 1), out(a + 2)};
    weighted_queries3(pp, V, j0, common, o);
    for (int64_t x = 0; x < 3; ++x)
      if (end(a + x, j0) > common) weighted_rows(pp[x], V, common, end(a + x, j0), D, o[x]);
  }
#endif
  for (; a < n; ++a)
    if (end(a, j0) > j0) weighted_rows(p + a * S, V, j0, end(a, j0), D, out(a));
}

#if defined(__AVX512F__)
// Wide items (prompt pieces, wide verifications): an item's queries go through each block of keys
// in groups of up to kWideQueries, and the block's keys and values are widened to float32 once for
// all of them (`widen_key_pairs`, `widen_rows`) instead of once per group. The registers each
// score and each output element accumulate in are those of `dot8_queries` and `weighted_queries`,
// with the same operations in the same order, so every result is bitwise the same. Only items of
// prompt pieces and wide batches are that wide: below about 30 queries widening a block cost more
// than it saved (ms in attention at 300 cached tokens, without / with: 16 tokens 2.97 / 3.09, 32
// tokens 5.99 / 5.74; a 5-token step's items, of 6 queries, were slower too).
// SmolLM2-135M int8 on the 2-core Zen 4 EPYC, two builds alternating (/tmp/s41/attab.py, min /
// median of 10, ms in attention per 128-token piece): 25.7 / 28.9 -> 22.9 / 24.4 at 300 cached
// tokens, 47.3 / 54.4 -> 41.6 / 45.2 at 640; a 769-token prompt 726 / 764 -> 707 / 723.
constexpr int kWideQueries = 6;           // queries per group: 24 accumulators
constexpr int64_t kWideItemQueries = 32;  // items of at least this many queries take this path

// Keys k[0 .. 8 * groups) (rows of 64 values), widened into dst in the order `dot8_queries` loads
// them: per 8 keys and per 8 values d, four registers [key 2i: values d .. d + 7 | key 2i + 1: the
// same], 512 floats per 8 keys.
template <typename KT>
inline void widen_key_pairs(const KT* k, int64_t groups, float* dst) {
  constexpr int64_t D = kGroupedHeadDim;
  for (int64_t g = 0; g < groups; ++g, k += 8 * D)
    for (int64_t d = 0; d < D; d += 8)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i, dst += 16)
        _mm512_storeu_ps(dst, key_pair(k, i, d));
}

// Rows v[0 .. rows) of 64 values widened to float32 into dst, in the same order.
template <typename KT>
inline void widen_rows(const KT* v, int64_t rows, float* dst) {
  for (int64_t o = 0; o < rows * kGroupedHeadDim; o += 16) _mm512_storeu_ps(dst + o, load16z(v + o));
}

// dot8_queries_of 8 keys widened by widen_key_pairs (kp: their 512 floats).
template <int QN>
inline void dot8_queries_wide(const float* const* q, const float* kp, float* const* out) {
  dot8_queries_of<QN>(q, [kp](int i, int64_t d) { return _mm512_loadu_ps(kp + 8 * d + 16 * i); }, out);
}

// block_scores for a wide item, the block's keys j0 .. j0 + 8 * groups - 1 widened in kp: groups of
// queries share each widened key over the keys all of them attend to, in whole 8s; each query's
// other keys go through `scores`, from the cache. Every score is dot()'s.
template <typename KT, typename Query, typename End>
inline void block_scores_wide(int64_t n, int64_t j0, const KT* K, const float* kp, int64_t S,
                              const Query& query, const End& end, float* p) {
  constexpr int64_t D = kGroupedHeadDim;
  for (int64_t a = 0; a < n;) {
    const int64_t take = std::min<int64_t>(kWideQueries, n - a);
    int64_t e = end(a, j0);
    for (int64_t x = 1; x < take; ++x) e = std::min(e, end(a + x, j0));
    const int64_t common = e > j0 ? j0 + (e - j0) / 8 * 8 : j0;
    const float* q[kWideQueries];
    float* o[kWideQueries];
    for (int64_t x = 0; x < take; ++x) q[x] = query(a + x);
    for (int64_t j = j0; j < common; j += 8) {
      for (int64_t x = 0; x < take; ++x) o[x] = p + (a + x) * S + j;
      with_rows<kWideQueries>(take, [&](auto QN) { dot8_queries_wide<QN>(q, kp + (j - j0) * D, o); });
    }
    for (int64_t x = 0; x < take; ++x)
      if (end(a + x, j0) > common) scores(q[x], K, common, end(a + x, j0), D, p + (a + x) * S);
    a += take;
  }
}

#endif

// A weight matrix [N, K] and, for int8, its per-row scales [N] (undefined otherwise).
struct Mat {
  at::Tensor w, scale;
  bool paired = false;  // pair-interleaved (kPairChunk)
  at::Tensor q4;  // float32 weights also held as exact 4-bit blocks (`linear_blocks`), or undefined
  at::Tensor q8;  // ... as exact 8-bit blocks, or undefined
  at::Tensor tiles;  // int8 weights also as tiles (`amx_pack`), or undefined
  at::Tensor wsum;   // with tiles on VNNI: each weight row's sum (`tile_row_sums`), int32 [N]
  at::Tensor q4i;    // int4 weights: exact 4-bit blocks in `q4_pack`'s layout (no `w`), or undefined
  at::Tensor q8i;    // int4's embedding / head: also as exact 8-bit blocks in `q8_pack`'s layout, or undefined
  int64_t n = 0;     // rows: w's, or q8i's where the matrix is held as blocks only (`set_head_blocks`)
  const float* sc() const { return scale.defined() ? scale.data_ptr<float>() : nullptr; }
};

struct Layer {
  at::Tensor in_norm;
  Mat wqkv;
  at::Tensor bqkv;
  Mat wo;
  at::Tensor bo, post_norm;
  Mat wgu, wdown;
};

// f32 -> bf16, rounded to nearest even as torch rounds (NaN -> 0x7FC0): 8 at once and one.
inline void store8(bf16* p, __m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // 32-bit lanes (each < 2^16) to 16 bits: packus works per 128-bit half, then the halves' low
  // quadwords are brought together.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// f32 -> f16, rounded to nearest even as torch's float16 conversion (`_cvtss_sh` one at a time).
inline void store8(f16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store1(f16* p, float v) { p->bits = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }
inline void store1(bf16* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  *p = std::isnan(v) ? bf16{0x7FC0} : static_cast<bf16>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
inline void store1(float* p, float v) { *p = v; }

#if defined(__AVX512F__)
// a[k] = silu(g[k] * sg[k]) * (u[k] * su[k]) for k < n (n a multiple of 16; no scales: 1):
// swiglu_rows's float32 arithmetic, 16 at a time, for its rows and for the gate/up product's
// threads (`FastLlamaKernel::run`).
inline void swiglu16(const float* g, const float* u, const float* sg, const float* su, float* a, int64_t n) {
  for (int64_t k = 0; k < n; k += 16) {
    __m512 gv = _mm512_loadu_ps(g + k), uv = _mm512_loadu_ps(u + k);
    if (sg) {
      gv = _mm512_mul_ps(gv, _mm512_loadu_ps(sg + k));
      uv = _mm512_mul_ps(uv, _mm512_loadu_ps(su + k));
    }
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(a + k, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), uv));
  }
}
#endif

// out[m, k] = silu(g) * u with g = gu[m, k] * scale[k], u = gu[m, I + k] * scale[I + k] (no scale:
// 1), computed in float32 (exp8 on whole groups of 8 columns, std::exp on the last I % 8) and
// stored in T, rows split over the threads (one row each at least: a decoding step has a few).
// gu: [M, 2I] (gate, then up) in T. Both the kernel's own forward and the torch path's long
// prompts use it. Then, on the thread that wrote them, after(m0, m1) for each of its runs of rows
// (`quantize_ahead`).
template <typename T, typename After>
void swiglu_rows_then(const T* gu, const float* scale, int64_t M, int64_t I, T* out, const After& after) {
  const int64_t I8 = I - I % 8;
  rows_in_parallel(M, [&](int64_t m0, int64_t m1) {
    prefetch_rows_for_write(M, out, I, m0, m1);
    for (int64_t m = m0; m < m1; ++m) {
      const T* g = gu + m * 2 * I;
      T* a = out + m * I;
      int64_t k = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {  // 16 at a time, each element the same operations
        k = I8 / 16 * 16;
        swiglu16(g, g + I, scale, scale ? scale + I : nullptr, a, k);
      }
#endif
      for (; k < I8; k += 8) {
        __m256 gv = load8(g + k), uv = load8(g + I + k);
        if (scale) {
          gv = _mm256_mul_ps(gv, _mm256_loadu_ps(scale + k));
          uv = _mm256_mul_ps(uv, _mm256_loadu_ps(scale + I + k));
        }
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        store8(a + k, _mm256_mul_ps(s, uv));
      }
      for (int64_t k = I8; k < I; ++k) {
        const float gk = to_f32(g[k]) * (scale ? scale[k] : 1.0f);
        const float uk = to_f32(g[I + k]) * (scale ? scale[I + k] : 1.0f);
        store1(a + k, gk / (1.0f + std::exp(-gk)) * uk);
      }
    }
    after(m0, m1);
  });
}

template <typename T>
void swiglu_rows(const T* gu, const float* scale, int64_t M, int64_t I, T* out) {
  swiglu_rows_then(gu, scale, M, I, out, [](int64_t, int64_t) {});
}

// The torch path's RMSNorm for long prompts: rmsnorm()'s float32 arithmetic (HF's order) per row in
// one pass instead of eager torch's six. x [M, H] float32, w [H] float32 -> [M, H] in OT: bfloat16
// for bfloat16 products (rounded as torch rounds, in place of the narrowing copy too), float32 for
// float32 products.
template <typename OT>
at::Tensor rmsnorm_rows_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be contiguous float32 [M, H]");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H,
              "weight must be contiguous float32 with ", H, " elements");
  auto out = at::empty({M, H}, x.options().dtype(std::is_same_v<OT, bf16> ? at::kBFloat16 : at::kFloat));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  OT* op = reinterpret_cast<OT*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  const int64_t H8 = H - H % 8;
  team_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = xp + m * H;
      OT* om = op + m * H;
      const float r = 1.0f / std::sqrt(sumsq(xm, H) / static_cast<float>(H) + e);
      const __m256 rv = _mm256_set1_ps(r);
      for (int64_t k = 0; k < H8; k += 8)
        store8(om + k, _mm256_mul_ps(_mm256_loadu_ps(wp + k), _mm256_mul_ps(_mm256_loadu_ps(xm + k), rv)));
      for (int64_t k = H8; k < H; ++k) store1(om + k, wp[k] * (xm[k] * r));
    }
  });
  return out;
}

// Rotary embeddings in place on the torch path's fused projections: qkv [M, C] float32 holds each
// row's heads of D values (queries, then keys, then values); the first `heads` of them are rotated
// as rope() rotates them, at position pos[m] of the tables cos / sin [P, D] float32. One pass
// instead of eager torch's five per tensor (multiply, halves, negate, concatenate, add).
void rope_rows_op(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                  int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat,
              "qkv must be contiguous float32 [M, C]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be contiguous float32 [P, D]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.numel() == qkv.size(0),
              "pos must be contiguous int64 [M]");
  const int64_t M = qkv.size(0), C = qkv.size(1), P = cos.size(0), D = cos.size(1);
  TORCH_CHECK(D % 2 == 0 && heads >= 0 && heads * D <= C, "heads * D must fit in a row");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) TORCH_CHECK(pp[m] >= 0 && pp[m] < P, "position out of the tables");
  float* q = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  team_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t h = 0; h < heads; ++h) rope(q + m * C + h * D, cp + pp[m] * D, sp + pp[m] * D, D);
  });
}

// x [M, K] @ w [N, K]^T -> [M, N] in x's type (w's too), the rows of x split evenly over the
// threads (blocks of at least 64 rows), each block one at::mm_out on its own thread: oneDNN ran
// long bfloat16 products of few columns on one thread (ROWS_SPLIT_FROM in fast_llama.py).
at::Tensor linear_rows_op(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.scalar_type() == w.scalar_type(),
              "x [M, K] and w [N, K] of one type");
  const int64_t M = x.size(0);
  auto out = at::empty({M, w.size(0)}, x.options());
  const at::Tensor wt = w.t();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(team_threads(), M / 64));
  team_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t m0 = M * p / parts, m1 = M * (p + 1) / parts;
      at::Tensor block = out.narrow(0, m0, m1 - m0);
      at::mm_out(block, x.narrow(0, m0, m1 - m0), wt);
    }
  });
  return out;
}

// That t holds a [n, k] matrix as `q4_pack` (or with Q8, `q8_pack`) lays it out.
void check_q4_packed(const at::Tensor& t, int64_t n, int64_t k, bool q8 = false) {
  TORCH_CHECK(k % 32 == 0 && n % kQ4Tile == 0, "int4 matrices need columns in 32s (K) and rows in 16s (N)");
  const int64_t bytes = q8 ? kQ8BlockBytes : kQ4BlockBytes;
  TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() == n / kQ4Tile * (k / 32) * bytes,
              "an int4 matrix must be ", q8 ? "q8_pack" : "q4_pack", "'s output for [", n, ", ", k, "]");
}

// x stored at p as float16, which must hold it exactly (GGUF's block scales are float16).
inline void store_half_exact(uint8_t* p, float x) {
  const uint16_t h = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  const float back = _cvtsh_ss(h);
  TORCH_CHECK(std::memcmp(&back, &x, 4) == 0, "a block scale ", x, " is not a float16 value");
  std::memcpy(p, &h, 2);
}

// The order both block layouts keep: tiles in groups of kQ4Group, and in each group the tiles' first
// blocks, then their second, and so on; `fill(at, t, b)` writes tile t's block b, `bytes` long, at at.
template <typename Fill>
void each_tile_block(int64_t tiles, int64_t B, int64_t bytes, uint8_t* at, const Fill& fill) {
  for (int64_t t0 = 0; t0 < tiles; t0 += kQ4Group)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = t0; t < std::min<int64_t>(tiles, t0 + kQ4Group); ++t, at += bytes) fill(at, t, b);
}

// `q8_pack`: exact 8-bit blocks (q [N, K / 32, 32] int8, d [N, K / 32] float32) in `q8_tile`'s
// layout, [N / 16 * K / 32 * 576] uint8.
at::Tensor q8_pack_op(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 32 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "q must be contiguous int8 [N, K / 32, 32]");
  const int64_t N = q.size(0), B = q.size(1);
  TORCH_CHECK(N % kQ4Tile == 0, "N must be a multiple of ", kQ4Tile);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 && d.size(0) == N && d.size(1) == B,
              "d must be contiguous float32 [N, K / 32]");
  auto out = at::empty({N / kQ4Tile * B * kQ8BlockBytes}, q.options().dtype(at::kByte));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  each_tile_block(N / kQ4Tile, B, kQ8BlockBytes, out.data_ptr<uint8_t>(), [&](uint8_t* o, int64_t t, int64_t b) {
    for (int64_t r = 0; r < kQ4Tile; ++r) {
      const int8_t* codes = qp + ((t * kQ4Tile + r) * B + b) * 32;
      for (int64_t j = 0; j < 8; ++j) std::memcpy(o + 64 * j + 4 * r, codes + 4 * j, 4);
      store_half_exact(o + kQ8DAt + 2 * r, dp[(t * kQ4Tile + r) * B + b]);
      int16_t sum = 0;  // |sum| <= 32 * 128
      for (int64_t k = 0; k < 32; ++k) sum = static_cast<int16_t>(sum + codes[k]);
      std::memcpy(o + kQ8SumAt + 2 * r, &sum, 2);
    }
  });
  return out;
}

// Row r [K] of a matrix in `q8_pack`'s layout, widened: d * q, exact in float32.
void q8_row(const uint8_t* packed, int64_t N, int64_t K, int64_t r, float* out) {
  const int64_t B = K / 32, tiles = N / kQ4Tile, t = r / kQ4Tile, t0 = t / kQ4Group * kQ4Group;
  const int64_t G = std::min<int64_t>(kQ4Group, tiles - t0), rr = r % kQ4Tile;
  const uint8_t* group = packed + t0 * B * kQ8BlockBytes;
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = group + (b * G + (t - t0)) * kQ8BlockBytes;
    uint16_t h;
    std::memcpy(&h, blk + kQ8DAt + 2 * rr, 2);
    const float d = _cvtsh_ss(h);
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t i = 0; i < 4; ++i) out[32 * b + 4 * j + i] = d * static_cast<float>(static_cast<int8_t>(blk[64 * j + 4 * rr + i]));
  }
}

// `q4_pack`: exact 4-bit blocks (q [N, K / 32, 16] uint8 as GGUF packs them, dm [N, K / 32, 2]
// float32: d, m) in `linear_q4_tiles`' layout, [N / 16 * K / 32 * 320] uint8.
at::Tensor q4_pack_op(const at::Tensor& q, const at::Tensor& dm) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 16 && q.scalar_type() == at::kByte && q.is_contiguous(),
              "q must be contiguous uint8 [N, K / 32, 16]");
  const int64_t N = q.size(0), B = q.size(1);
  TORCH_CHECK(N % kQ4Tile == 0, "N must be a multiple of ", kQ4Tile);
  TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.is_contiguous() && dm.dim() == 3 && dm.size(0) == N &&
                  dm.size(1) == B && dm.size(2) == 2,
              "dm must be contiguous float32 [N, K / 32, 2]");
  auto out = at::empty({N / kQ4Tile * B * kQ4BlockBytes}, q.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* dp = dm.data_ptr<float>();
  each_tile_block(N / kQ4Tile, B, kQ4BlockBytes, out.data_ptr<uint8_t>(), [&](uint8_t* o, int64_t t, int64_t b) {
    for (int64_t r = 0; r < kQ4Tile; ++r) {
      const int64_t n = t * kQ4Tile + r;
      for (int64_t j = 0; j < 4; ++j) std::memcpy(o + 64 * j + 4 * r, qp + (n * B + b) * 16 + 4 * j, 4);
      store_half_exact(o + kQ4DAt + 2 * r, dp[(n * B + b) * 2]);
      store_half_exact(o + kQ4MAt + 2 * r, dp[(n * B + b) * 2 + 1]);
    }
  });
  return out;
}

// y [M, N] = x [M, K] @ W^T (+ bias), W in `q4_pack`'s layout: `linear_q4_tiles`, for tests and
// measurements (AVX-512 VNNI CPUs only).
at::Tensor q4_linear_op(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const std::optional<at::Tensor>& bias, bool q8, bool a8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_q4_packed(packed, N, K, q8);
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias [N]");
  auto y = at::empty({M, N}, x.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  linear_block_tiles(q8, a8, x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), N, K,
                     bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N, false);
#else
  TORCH_CHECK(false, "q4_linear needs AVX-512 VNNI");
#endif
  return y;
}

// The MLP's activation for the torch path's long prompts: [M, 2I] products (bfloat16 or float32,
// int8 weights' scales not yet applied) -> [M, I] in the same dtype, in one pass instead of
// eager torch's five (widen, scale, silu, multiply, narrow); see swiglu_rows.
at::Tensor swiglu_op(const at::Tensor& gu, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gu must be contiguous [M, 2I]");
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 || gu.scalar_type() == at::kFloat,
              "gu must be bfloat16 or float32");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  if (scale)
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == 2 * I,
                "scale must be contiguous float32 with ", 2 * I, " elements");
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  auto out = at::empty({M, I}, gu.options());
  if (gu.scalar_type() == at::kBFloat16)
    swiglu_rows(reinterpret_cast<const bf16*>(gu.data_ptr()), s, M, I,
                reinterpret_cast<bf16*>(out.data_ptr()));
  else
    swiglu_rows(gu.data_ptr<float>(), s, M, I, out.data_ptr<float>());
  return out;
}

// Pair-interleaved w [N, K] (`kPairChunk`) -> row-major out [N, K] in OT: each chunk of C weights
// copied (OT = WT) or widened exactly (int8 -> bfloat16: load8's float holds it, and store8's
// rounding leaves a value of 8 significant bits unchanged). Pairs split over the threads.
template <int64_t Bytes>
inline void stream_chunk(void* dst, const void* src) {
  static_assert(Bytes == 16 || Bytes == 32, "chunks of 16 or 32 bytes");
  if constexpr (Bytes == 32)
    _mm256_stream_si256(static_cast<__m256i*>(dst), _mm256_loadu_si256(static_cast<const __m256i*>(src)));
  else
    _mm_stream_si128(static_cast<__m128i*>(dst), _mm_loadu_si128(static_cast<const __m128i*>(src)));
}

template <typename WT, typename OT>
void rows_from_pairs(const WT* w, int64_t N, int64_t K, OT* out, bool stream) {
  constexpr int64_t C = kPairChunk<WT>;
  constexpr int64_t B = C * static_cast<int64_t>(sizeof(WT));
  stream = stream && reinterpret_cast<uintptr_t>(out) % B == 0 && (K * sizeof(OT)) % B == 0;
  team_for(0, N / 2, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const WT* src = w + p * 2 * K;  // [K / C][2][C]
      OT* even = out + 2 * p * K;
      OT* odd = even + K;
      for (int64_t k = 0; k < K; k += C, src += 2 * C) {
        if constexpr (std::is_same_v<WT, OT>) {
          if (stream) {
            stream_chunk<B>(even + k, src);
            stream_chunk<B>(odd + k, src + C);
          } else {
            std::memcpy(even + k, src, C * sizeof(WT));
            std::memcpy(odd + k, src + C, C * sizeof(WT));
          }
        } else {
          for (int64_t c = 0; c < C; c += 8) {
            store8(even + k + c, load8(src + c));
            store8(odd + k + c, load8(src + C + c));
          }
        }
      }
    }
    if (stream) _mm_sfence();
  });
}

// The torch path's row-major copy of a paired matrix for its long-prompt products, in one pass:
// w [N, K] pair-interleaved float32, bfloat16 or int8 -> [N, K] in w's own dtype, or in bfloat16
// with `to_bf16` (int8 weights meeting bfloat16 products), written into `into` when given (the
// caller's buffer, kept between calls: at least N * K elements of the output's dtype). Eager
// torch's strided copy moved 8-weight chunks in short inner loops (SmolLM2-135M's layers on the
// Xeon: float32 75 ms where a plain clone takes 48, int8 31 ms against 8.5) and widened int8 in a
// second pass (23 ms).
at::Tensor rows_from_pairs_op(const at::Tensor& w, bool to_bf16, const std::optional<at::Tensor>& into,
                              bool stream) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be contiguous [N, K]");
  const at::ScalarType t = w.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kChar, "w must be float32, bfloat16 or int8");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(paired_ok(t, N, K), "w [", N, ", ", K, "] cannot be pair-interleaved");
  const at::ScalarType o = to_bf16 ? at::kBFloat16 : t;
  TORCH_CHECK(t != at::kFloat || !to_bf16, "float32 weights are not rounded to bfloat16 here");
  at::Tensor out;
  if (into) {
    TORCH_CHECK(into->is_contiguous() && into->scalar_type() == o && into->numel() >= N * K,
                "into must be contiguous, of the output's dtype, with at least N * K elements");
    out = into->view(-1).narrow(0, 0, N * K).view({N, K});
  } else {
    out = at::empty({N, K}, w.options().dtype(o));
  }
  const void* src = w.data_ptr();
  void* dst = out.data_ptr();
  if (t == at::kFloat)
    rows_from_pairs(static_cast<const float*>(src), N, K, static_cast<float*>(dst), stream);
  else if (t == at::kBFloat16)
    rows_from_pairs(static_cast<const bf16*>(src), N, K, static_cast<bf16*>(dst), stream);
  else if (o == at::kChar)
    rows_from_pairs(static_cast<const i8*>(src), N, K, static_cast<i8*>(dst), stream);
  else
    rows_from_pairs(static_cast<const i8*>(src), N, K, static_cast<bf16*>(dst), false);
  return out;
}

// The sum of e[j] >= floor over e[0 .. V), in double, 8 lanes then in a fixed order.
inline double mass_from(const float* e, int64_t V, float floor) {
  const __m256 vf = _mm256_set1_ps(floor);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(e + j);
    add_wide(_mm256_and_ps(v, _mm256_cmp_ps(v, vf, _CMP_GE_OQ)), s0, s1);
  }
  double sum = hsum_pd(_mm256_add_pd(s0, s1));
  for (; j < V; ++j)
    if (e[j] >= floor) sum += e[j];
  return sum;
}

// The last token top-p keeps, for e [V] (exp(s - max) of the tokens top-k kept, 0 for the others;
// the most probable is 1): ranked by e (equal ones by index), a token stays while the mass ranked
// before it is below `target` (top_p times the sum of e). Returns its (e, index): a token stays
// iff its e is above that e, or equal with an index not above that index. Tokens are binned by
// their float's exponent and top 4 mantissa bits (16 bins an octave, `hist`), bins above the one
// where the mass crosses the target stay whole, and only that bin's tokens are sorted. Only
// tokens within a factor `floor` of the most probable are binned, the widest floor whose mass
// reaches the target (a pass each): real distributions' nuclei end within 2^-8.
std::pair<float, int64_t> nucleus_cut(const float* e, int64_t V, double target, std::vector<double>& hist) {
  constexpr int kBins = 1 << 12;  // bits >> 19 of a float in (0, 1]: at most 0x3F800000 >> 19
  float floor = std::numeric_limits<float>::denorm_min();  // every token top-k kept, at the last
  for (const float f : {0x1p-8f, 0x1p-16f, 0x1p-32f})
    if (mass_from(e, V, f) >= target) {
      floor = f;
      break;
    }
  auto bin = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return static_cast<int>(u >> 19);
  };
  auto each = [&](const auto& f) {  // f(j) for each e[j] >= floor
    const __m256 vf = _mm256_set1_ps(floor);
    int64_t j = 0;
    for (; j + 8 <= V; j += 8)
      for (int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + j), vf, _CMP_GE_OQ)); m != 0; m &= m - 1)
        f(j + __builtin_ctz(m));
    for (; j < V; ++j)
      if (e[j] >= floor) f(j);
  };
  hist.assign(kBins, 0.0);
  each([&](int64_t j) { hist[bin(e[j])] += e[j]; });
  // Whole bins from the top while their mass stays below the target, then token by token in
  // order (a bin sorted at a time) until the mass before the next reaches it.
  double before = 0.0;
  float cut_e = 2.0f;  // above every e until a token is taken one by one
  int64_t cut_j = 0;
  bool one_by_one = false;
  std::vector<std::pair<float, int64_t>> ranked;
  for (int b = kBins - 1; b >= 0 && before < target; --b) {
    if (hist[b] == 0.0) continue;
    if (!one_by_one && before + hist[b] < target) {
      before += hist[b];
      continue;
    }
    one_by_one = true;
    ranked.clear();
    each([&](int64_t j) {
      if (bin(e[j]) == b) ranked.emplace_back(e[j], j);
    });
    std::sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
    for (const auto& [v, j] : ranked) {
      if (before >= target) break;
      cut_e = v;
      cut_j = j;
      before += v;
    }
  }
  if (!one_by_one)  // every bin stayed whole (the target within rounding of their mass): all of them
    each([&](int64_t j) {
      if (e[j] < cut_e || (e[j] == cut_e && j > cut_j)) {
        cut_e = e[j];
        cut_j = j;
      }
    });
  return {cut_e, cut_j};
}

// Zeroes what top-p drops from e [V] (every token below (cut_e, cut_j) in `nucleus_cut`'s ranking)
// and returns the sum of what stays, 8 lanes in double in a fixed order as `mass_from` sums (one
// running double sum took about 50 us of a 49152-token row: each add waited on the one before).
inline double cut_nucleus(float* e, int64_t V, float cut_e, int64_t cut_j) {
  const __m256 vc = _mm256_set1_ps(cut_e);
  const __m256i after = _mm256_set1_epi32(static_cast<int32_t>(cut_j + 1));  // V < 2^31 (checked)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(e + j);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(j)), lane);
    const __m256 up_to_cut = _mm256_castsi256_ps(_mm256_cmpgt_epi32(after, idx));  // j <= cut_j
    const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(v, vc, _CMP_GT_OQ),
                                     _mm256_and_ps(_mm256_cmp_ps(v, vc, _CMP_EQ_OQ), up_to_cut));
    const __m256 kept = _mm256_and_ps(v, keep);
    _mm256_storeu_ps(e + j, kept);
    add_wide(kept, s0, s1);
  }
  double sum = hsum_pd(_mm256_add_pd(s0, s1));
  for (; j < V; ++j) {
    if (e[j] < cut_e || (e[j] == cut_e && j > cut_j)) e[j] = 0.0f;
    sum += e[j];
  }
  return sum;
}

// `verispec.rejection.inverse_cdf` for float32 rows: token r is the first j whose running sum of
// probs[r, 0 .. j] (in double) exceeds u[r] times the row's sum, so a token of probability 0 is
// never drawn. The sums run over blocks of 8 tokens (each block summed in a fixed order, the blocks
// in order), then token by token inside the block where the running sum passes the target,
// instead of a float64 cumsum of the whole row and a search (V = 49152: 0.09 -> 0.02 ms a row).
at::Tensor draw_rows_op(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.is_contiguous() && probs.scalar_type() == at::kFloat,
              "probs must be contiguous float32 [R, V]");
  const int64_t R = probs.size(0), V = probs.size(1);
  TORCH_CHECK(V > 0, "probs must have a token");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == R,
              "u must be contiguous float64 [R]");
  auto out = at::empty({R}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t blocks = (V + 7) / 8;
  std::vector<double> sums(blocks);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = p + r * V;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      double s = 0.0;
      if (8 * b + 8 <= V) {
        __m256d h0 = _mm256_setzero_pd(), h1 = _mm256_setzero_pd();
        add_wide(_mm256_loadu_ps(row + 8 * b), h0, h1);
        s = hsum_pd(_mm256_add_pd(h0, h1));
      } else {
        for (int64_t j = 8 * b; j < V; ++j) s += row[j];
      }
      sums[b] = s;
      total += s;
    }
    const double target = uu[r] * total;
    double run = 0.0;
    int64_t pick = -1;
    for (int64_t b = 0; b < blocks && pick < 0; ++b) {
      if (run + sums[b] <= target && b + 1 < blocks) {
        run += sums[b];
        continue;
      }
      for (int64_t j = 8 * b; j < std::min(V, 8 * b + 8); ++j) {  // the block's tokens one by one
        run += row[j];
        if (run > target && row[j] > 0.0f) {
          pick = j;
          break;
        }
      }
    }
    if (pick < 0)  // none passed the target (rounding): the last token that can be drawn
      for (pick = V - 1; pick > 0 && !(row[pick] > 0.0f); --pick) {
      }
    o[r] = pick;
  }
  return out;
}

// `verispec.sampling.logits_to_probs` for float32 rows, in one pass over each row instead of the
// dozen full-vocabulary tensor operations torch takes (temperature, top-k, a softmax to rank by,
// top-k again for the ranking, the mask, a second softmax): those took 0.26 ms for one row with
// top-p and 1.7 ms for five (`benchmarks/sampling_cost.py`, V = 49152), as much as a third of a
// verification step. Row r of logits [R, V]: s = logits / temperature (float32, as torch divides);
// with 0 < top_k < V, tokens whose s is below the top_k-th largest are dropped; with top_p < 1,
// the kept tokens ranked by probability (equal ones by index) stay while the mass ranked before
// them is below top_p (so the first always stays); out [R, V] is the softmax over what stays, 0
// elsewhere. Each row depends only on its own logits and settings.
void sampling_row(const float* logits, int64_t V, double temperature, int64_t top_k, double top_p, float* out,
                  std::vector<float>& heap, std::vector<double>& hist) {
  const float t = std::max(static_cast<float>(temperature), 1e-6f);
  const __m256 vt = _mm256_set1_ps(t);
  const int64_t V8 = V - V % 8;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < V8; j += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(logits + j), vt);
    _mm256_storeu_ps(out + j, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  float mx = hmax(vmax);
  for (int64_t j = V8; j < V; ++j) {
    out[j] = logits[j] / t;
    mx = std::max(mx, out[j]);
  }
  float lo = -std::numeric_limits<float>::infinity();  // tokens below lo are dropped
  if (top_k > 0 && top_k < V) {  // lo = the top_k-th largest s, by a min-heap of the top_k largest
    const auto greater = std::greater<float>();
    heap.assign(out, out + top_k);
    std::make_heap(heap.begin(), heap.end(), greater);
    auto offer = [&](float v) {
      if (v > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), greater);
        heap.back() = v;
        std::push_heap(heap.begin(), heap.end(), greater);
      }
    };
    int64_t j = top_k;
    for (; j % 8 != 0 && j < V; ++j) offer(out[j]);
    for (; j + 8 <= V; j += 8) {  // most blocks hold nothing above the heap's least
      int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(out + j), _mm256_set1_ps(heap.front()), _CMP_GT_OQ));
      for (; mask != 0; mask &= mask - 1) offer(out[j + __builtin_ctz(mask)]);
    }
    for (; j < V; ++j) offer(out[j]);
    lo = heap.front();
  }
  // exp(s - max) where s >= lo, else 0; their sum in double, lane by lane in a fixed order. Below
  // exp8's least input (2^-126) a probability is too small to draw and stays 0 too.
  const float keep_from = std::max(lo, mx + kExp8Least);
  const __m256 vm = _mm256_set1_ps(mx), vlo = _mm256_set1_ps(keep_from);
  __m256d sum0 = _mm256_setzero_pd(), sum1 = _mm256_setzero_pd();
  for (int64_t j = 0; j < V8; j += 8) {
    const __m256 v = _mm256_loadu_ps(out + j);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(v, vm)), _mm256_cmp_ps(v, vlo, _CMP_GE_OQ));
    _mm256_storeu_ps(out + j, e);
    add_wide(e, sum0, sum1);
  }
  double z = hsum_pd(_mm256_add_pd(sum0, sum1));
  if (V8 < V) {
    alignas(32) float e[8];
    exp8_tail(out + V8, V - V8, mx, e);
    for (int64_t j = V8; j < V; ++j) {
      out[j] = out[j] >= keep_from ? e[j - V8] : 0.0f;  // out[j] still holds s here
      z += out[j];
    }
  }
  if (top_p < 1.0) {
    const auto [cut_e, cut_j] = nucleus_cut(out, V, top_p * z, hist);
    z = cut_nucleus(out, V, cut_e, cut_j);
  }
  const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / z));
  for (int64_t j = 0; j < V8; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), inv));
  for (int64_t j = V8; j < V; ++j) out[j] *= static_cast<float>(1.0 / z);
}

// sampling_row for each row of logits [R, V] (float32), with temperature [R] (float64), top_k [R]
// (int64, 0: off) and top_p [R] (float64, 1: off): the probabilities [R, V], float32.
at::Tensor sampling_probs_op(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                             const at::Tensor& top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be contiguous float32 [R, V]");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "the vocabulary must hold 1 .. 2^31 - 1 tokens");
  TORCH_CHECK(temperature.scalar_type() == at::kDouble && temperature.is_contiguous() && temperature.numel() == R,
              "temperature must be contiguous float64 [R]");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == R,
              "top_k must be contiguous int64 [R]");
  TORCH_CHECK(top_p.scalar_type() == at::kDouble && top_p.is_contiguous() && top_p.numel() == R,
              "top_p must be contiguous float64 [R]");
  auto out = at::empty({R, V}, logits.options());
  const float* x = logits.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const double* t = temperature.data_ptr<double>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const double* p = top_p.data_ptr<double>();
  team_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> heap;
    std::vector<double> hist;
    for (int64_t r = r0; r < r1; ++r) sampling_row(x + r * V, V, t[r], k[r], p[r], o + r * V, heap, hist);
  });
  return out;
}

}  // namespace

// Holds references to the weights and caches owned by the Python FastLlama and runs its forward.
class FastLlamaKernel {
 public:
  FastLlamaKernel(int64_t hidden, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                  int64_t intermediate, double eps)
      : H_(hidden), Hq_(n_heads), Hkv_(n_kv_heads), D_(head_dim), I_(intermediate),
        eps_(static_cast<float>(eps)) {
    TORCH_CHECK(n_heads % n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  }

  // Whether the layers added from now on, and the embedding and head set after, hold their matrices
  // pair-interleaved (`kPairChunk`) wherever `paired_ok` allows: FastLlama rearranges them so
  // before handing them over.
  void set_paired(bool on) { paired_ = on; }

  // Whether int8 products run on AMX tiles (`linear_amx`) where the matrices have them (`pack_tiles`).
  // Raises where the build or the OS has no AMX (`amx_ready`).
  void set_amx(bool on) {
    TORCH_CHECK(!on || amx_ready(), "this build or machine has no AMX int8 tiles");
    amx_ = on;
  }
  bool amx() const { return amx_; }

  // Whether int8 products run on the tiles with AVX-512 VNNI (`linear_vnni_tiles`) where the
  // matrices have them (`pack_tiles`), on CPUs without AMX. Raises where the build has no VNNI.
  void set_vnni_tiles(bool on) {
    TORCH_CHECK(!on || vnni_tiles_ready(), "this build has no AVX-512 VNNI");
    vnni_tiles_ = on;
  }
  bool vnni_tiles() const { return vnni_tiles_; }

  // Products of at least `rows` input rows read the tiles (with `set_amx` on), narrower ones the
  // pair-interleaved matrices through the VNNI tiles. On the 2-core Xeon (SmolLM2-135M int8, greedy
  // step at 200 cached tokens, min of 50, ms, all calls on one path, /tmp/s34/sweep6.py): AMX /
  // VNNI 1 token 4.76 / 4.15, 5 tokens 5.58 / 5.61, 9 tokens 6.60 / 8.49. Steps switching between
  // the paths ran slower than either, so FastLlama keeps decoding on the VNNI tiles and gives the
  // tiles calls wider than any decoding step (`schedule.AMX_ROWS`, where the figures are).
  void set_amx_rows(int64_t rows) {
    TORCH_CHECK(rows >= 1, "rows must be >= 1");
    amx_rows_ = rows;
  }
  int64_t amx_rows() const { return amx_rows_; }

  // Every layer's matrices and (with `head`) the head: what `pack_tiles` may give tiles.
  std::vector<Mat*> product_mats(bool head = true) {
    std::vector<Mat*> out;
    for (Layer& L : layers_)
      for (Mat* m : {&L.wqkv, &L.wo, &L.wgu, &L.wdown}) out.push_back(m);
    if (head && head_.w.defined()) out.push_back(&head_);
    return out;
  }

  // The int8 matrices of `product_mats` that the tiles can take (`amx_shape_ok`).
  std::vector<Mat*> tile_mats(bool head) {
    std::vector<Mat*> fit;
    for (Mat* m : product_mats(head))
      if (m->w.scalar_type() == at::kChar && amx_shape_ok(m->w.size(0), m->w.size(1))) fit.push_back(m);
    return fit;
  }

  // A matrix's bytes in `pack_tiles`'s buffer: its own, rounded up to a cache line.
  static int64_t tile_slot(const Mat& m) { return (m.w.numel() + 63) / 64 * 64; }

  // Bytes `pack_tiles` needs.
  int64_t tile_bytes_needed(bool head) {
    int64_t n = 0;
    for (Mat* m : tile_mats(head)) n += tile_slot(*m);
    return n;
  }

  // Packs the int8 matrices (`tile_mats`; call after the layers and the head are set) as tiles
  // (`amx_pack`) into `buffer` (contiguous, at least `tile_bytes_needed` bytes; FastLlama gives
  // memory on 2 MB pages, where streaming it misses the TLB less), or into memory of its own
  // without one. The weights are then held twice: these and the pair-interleaved ones the other
  // paths read. `head`: the head too (AMX; its prompts' last rows are too few for the VNNI tiles).
  // Without AMX, each tiled matrix also gets its rows' sums (`tile_row_sums`) for the VNNI tiles.
  void pack_tiles(std::optional<at::Tensor> buffer, bool head) {
    TORCH_CHECK(amx_ready() || vnni_tiles_ready(), "this build has neither AMX int8 tiles nor AVX-512 VNNI");
    const int64_t need = tile_bytes_needed(head);
    at::Tensor buf = buffer ? *buffer : at::empty({need}, at::TensorOptions().dtype(at::kByte));
    TORCH_CHECK(buf.is_contiguous() && buf.nbytes() >= static_cast<size_t>(need), "the buffer must be contiguous, of at least ",
                need, " bytes");
    buf = buf.view(at::kByte).view(-1);
    int64_t at = 0;
    for (Mat* m : tile_mats(head)) {
      const int64_t N = m->w.size(0), K = m->w.size(1);
      m->tiles = buf.narrow(0, at, N * K);
      amx_pack(wptr<i8>(m->w), N, K, m->paired, reinterpret_cast<i8*>(m->tiles.data_ptr()));
      if (!amx_ready()) {  // the VNNI tiles' (`linear_vnni_tiles`); AMX needs no sums
        m->wsum = at::empty({N}, at::TensorOptions().dtype(at::kInt));
        tile_row_sums(wptr<i8>(m->tiles), N, K, m->wsum.data_ptr<int32_t>());
      }
      at += tile_slot(*m);
    }
  }

  // Bytes of the tiles this object holds (`pack_tiles`, with their rows' sums), beyond the weights
  // it was handed.
  int64_t tile_bytes() {
    int64_t n = 0;
    for (Mat* m : product_mats()) {
      if (m->tiles.defined()) n += m->tiles.nbytes();
      if (m->wsum.defined()) n += m->wsum.nbytes();
    }
    return n;
  }

  // This object's `Schedule` (see there), passed to every `linear` call it makes.
  void set_schedule(int64_t two_pair_rows_float, int64_t two_pair_rows_int8,
                    bool prefetch_one_row, int64_t wide_int8_rows) {
    TORCH_CHECK(two_pair_rows_float >= 1 && two_pair_rows_int8 >= 1 && wide_int8_rows >= 1,
                "row counts must be >= 1");
    schedule_ = Schedule{two_pair_rows_float, two_pair_rows_int8, prefetch_one_row,
                         schedule_.wide_float_rows, wide_int8_rows};
  }

  // From how many input rows paired float32 products use 512-bit tiles (0: never). The outputs
  // are bitwise the same either way (tests compare them).
  void set_wide_float_rows(int64_t rows) {
    TORCH_CHECK(rows >= 0, "rows must be >= 0");
    schedule_.wide_float_rows = rows;
  }

  pybind11::tuple get_schedule() const {
    return pybind11::make_tuple(schedule_.two_pair_rows_float, schedule_.two_pair_rows_int8,
                                schedule_.prefetch_one_row, schedule_.wide_int8_rows);
  }

  // The s* arguments are the per-row scales of int8 weights (None for float32 and bf16).
  void add_layer(at::Tensor in_norm, at::Tensor wqkv, std::optional<at::Tensor> bqkv, at::Tensor wo,
                 std::optional<at::Tensor> bo, at::Tensor post_norm, at::Tensor wgu,
                 at::Tensor wdown, std::optional<at::Tensor> sqkv, std::optional<at::Tensor> so,
                 std::optional<at::Tensor> sgu, std::optional<at::Tensor> sdown) {
    const int64_t qkv = (Hq_ + 2 * Hkv_) * D_;
    Layer L;
    L.wqkv = mat(wqkv, sqkv, qkv, H_);
    L.wo = mat(wo, so, H_, Hq_ * D_);
    L.wgu = mat(wgu, sgu, 2 * I_, H_);
    L.wdown = mat(wdown, sdown, H_, I_);
    push_layer(std::move(L), in_norm, bqkv, bo, post_norm);
  }

  // A layer's norms and biases checked and set, then the layer appended.
  void push_layer(Layer L, const at::Tensor& in_norm, const std::optional<at::Tensor>& bqkv,
                  const std::optional<at::Tensor>& bo, const at::Tensor& post_norm) {
    check_f32(in_norm, H_);
    check_f32(post_norm, H_);
    if (bqkv) check_f32(*bqkv, (Hq_ + 2 * Hkv_) * D_);
    if (bo) check_f32(*bo, H_);
    L.in_norm = in_norm;
    L.post_norm = post_norm;
    L.bqkv = bqkv.value_or(at::Tensor());
    L.bo = bo.value_or(at::Tensor());
    layers_.push_back(std::move(L));
  }

  // A layer of int4 or w4a8 weights: its matrices only as exact 4-bit blocks in `q4_pack`'s layout
  // (uint8), multiplied in integers by `linear_q4_tiles` in every call. The embedding and head
  // are their exact 8-bit blocks alone (`set_head_blocks`) or int8 rows (`set_head`, with the
  // blocks of either from `set_q8i`), so the kernel's weight type is int8.
  void add_layer_q4(at::Tensor in_norm, at::Tensor wqkv, std::optional<at::Tensor> bqkv, at::Tensor wo,
                    std::optional<at::Tensor> bo, at::Tensor post_norm, at::Tensor wgu, at::Tensor wdown) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    auto q4 = [](const at::Tensor& t, int64_t n, int64_t k) {
      check_q4_packed(t, n, k);
      Mat m;
      m.q4i = t;
      return m;
    };
    Layer L;
    L.wqkv = q4(wqkv, (Hq_ + 2 * Hkv_) * D_, H_);
    L.wo = q4(wo, H_, Hq_ * D_);
    L.wgu = q4(wgu, 2 * I_, H_);
    L.wdown = q4(wdown, H_, I_);
    push_layer(std::move(L), in_norm, bqkv, bo, post_norm);
#else
    TORCH_CHECK(false, "int4 weights need a CPU with AVX-512 VNNI");
#endif
  }

  // Whether the block matrices (`add_layer_q4`, `set_q8i`) take their activations as 8-bit blocks
  // (`quantize_blocks8`: the w4a8 format) instead of int16 rows (int4).
  void set_act8(bool on) { act8_ = on; }

  // Whether each forward runs in one parallel region (`team_drive`, the default) instead of one
  // OpenMP region per parallel call. Every logit is the same either way; for tests and A/B runs.
  void set_team(bool on) { team_ = on; }

  // Whether the jobs between w4a8's products are folded into the jobs before them (`ahead`: the
  // 8-bit blocks quantised by their producers, the heads written and SwiGLU computed by the qkv
  // and gate/up products' threads). Every logit is the same either way; for tests and A/B runs.
  void set_fuse(bool on) { fuse_ = on; }
  void set_rows(bool on) { rows_ = on; }
  int64_t rows_calls() const { return rows_calls_; }

  // Whether steps of at most kStreamRows tokens write what the other thread reads next (the wo and
  // down products' outputs, the 8-bit blocks the norms, the attention and SwiGLU quantise ahead)
  // with non-temporal stores. Every logit is the same either way; for tests and A/B runs.
  void set_stream(bool on) { stream_ = on; }

  // Whether a call of M rows streams what crosses to the other thread (`set_stream`, kStreamRows).
  bool streams(int64_t M) const { return stream_ && M <= kStreamRows; }

  // Whether the products of a call of M rows form their own input rows on each thread where they
  // can (`set_own_rows`, kOwnRows, `OwnRows`, `takes_own_rows`; which products: `run`). Every logit
  // is the same either way.
  void set_own_rows(bool on) { own_rows_ = on; }
  bool own_rows(int64_t M) const { return own_rows_ && M <= kOwnRows; }

  // Whether product<WT>(W, ..) reads W's blocks (`linear_block_tiles`: int4, w4a8): it then hands
  // its threads' columns on (`ColumnsDone`).
  template <typename WT>
  bool block_product(const Mat& W) const {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<WT, i8>) return W.q4i.defined() || W.q8i.defined();
#endif
    (void)W;
    return false;
  }

  // Whether product<WT>(W, ..) over M rows takes `OwnRows`: block products, and int8's row products.
  template <typename WT>
  bool takes_own_rows(const Mat& W, int64_t M) const {
    if constexpr (std::is_same_v<WT, i8>) return block_product<WT>(W) || !reads_tiles(W, M);
    (void)W, (void)M;
    return false;
  }

  // The int8 head and embedding of int4 and w4a8 (`set_head`, which must come first) also as exact
  // 8-bit blocks in `q8_pack`'s layout (either may be None): head products then multiply them in
  // integers (`q8_tile`, `q8a8_tile`), and embedding rows are read from them exactly. A tied head
  // is the embedding: its blocks serve both.
  void set_q8i(std::optional<at::Tensor> head, std::optional<at::Tensor> embed) {
    TORCH_CHECK(wtype_ == at::kChar && head_.w.defined(), "an int8 head must be set first");
    const bool tied = embed_.w.defined() && embed_.w.data_ptr() == head_.w.data_ptr();
    if (head) {
      check_q4_packed(*head, head_.n, H_, true);
      head_.q8i = *head;
      if (tied) embed_.q8i = *head;
    }
    if (embed && !tied) {
      TORCH_CHECK(embed_.w.defined(), "no embedding to set");
      check_q4_packed(*embed, embed_.n, H_, true);
      embed_.q8i = *embed;
    }
  }

  // In place of `set_head` and `set_q8i`, for int4 and w4a8 whose head and embedding are both made
  // of exact 8-bit blocks: the kernel holds them only as those blocks (`q8_pack`'s layout), with no
  // int8 rows beside them (28 MB for SmolLM2-135M's tied pair, which nothing read). `embed` None:
  // the head is tied to the embedding and its blocks serve both.
  void set_head_blocks(std::optional<at::Tensor> embed, at::Tensor final_norm, at::Tensor head) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    TORCH_CHECK(wtype_ == at::ScalarType::Undefined || wtype_ == at::kChar, "blocks-only heads are for int4 layers");
    TORCH_CHECK(!head_.w.defined() && !embed_.w.defined(), "the head is already set");
    check_f32(final_norm, H_);
    // A matrix of n rows in q8_pack's layout has n / 16 * H / 32 blocks of kQ8BlockBytes.
    auto rows = [&](const at::Tensor& t) {
      const int64_t n = t.numel() / std::max<int64_t>(1, H_ / 32 * kQ8BlockBytes) * kQ4Tile;
      check_q4_packed(t, n, H_, true);
      TORCH_CHECK(n > 0, "an empty head");
      return n;
    };
    wtype_ = at::kChar;
    head_ = Mat();
    head_.q8i = head;
    head_.n = rows(head);
    embed_ = Mat();
    embed_.q8i = embed ? *embed : head;
    embed_.n = rows(embed_.q8i);
    final_norm_ = final_norm;
#else
    TORCH_CHECK(false, "int4 weights need a CPU with AVX-512 VNNI");
#endif
  }

  // Layer `l`'s matrix `which` (0 wqkv, 1 wo, 2 wgu, 3 wdown), float32, also as exact 4-bit blocks
  // (`linear_blocks`): contiguous uint8, N * K / 32 blocks of 16 bytes of codes and (d, m) as
  // float32, in groups of 8 rows (`Grouped`, FastLlama's `_group_blocks`). The caller has checked
  // that they dequantise to the matrix bitwise (FastLlama's `_q4_blocks`); calls of up to
  // `set_block_rows`' tokens then read them instead of the float32 matrix.
  void set_q4(int64_t l, int64_t which, at::Tensor blocks) {
    TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()) && which >= 0 && which < 4,
                "no such layer matrix");
    TORCH_CHECK(wtype_ == at::kFloat, "4-bit blocks stand for float32 weights only");
    Layer& L = layers_[l];
    Mat& W = which == 0 ? L.wqkv : which == 1 ? L.wo : which == 2 ? L.wgu : L.wdown;
    W.q4 = checked_blocks(blocks, W.w.size(0), W.w.size(1), 16 + 8);
  }

  // The float32 head also as exact 8-bit blocks (`linear_blocks`): contiguous uint8, V * H / 32
  // blocks of 32 int8 codes and d as float32, grouped as `set_q4`'s, checked by the caller
  // (FastLlama's `_q8_blocks`). Calls wanting the whole head's logits for up to `set_block_rows`'
  // rows then read them instead of the float32 head.
  void set_head_q8(at::Tensor blocks) {
    TORCH_CHECK(head_.w.defined() && head_.w.scalar_type() == at::kFloat, "a float32 head must be set first");
    head_.q8 = checked_blocks(blocks, head_.n, H_, 32 + 4);
  }

  static at::Tensor checked_blocks(const at::Tensor& blocks, int64_t N, int64_t K, int64_t bytes) {
    TORCH_CHECK(K % 32 == 0 && N % 2 == 0, "blocks need K % 32 == 0 and N even");
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.numel() == N * K / 32 * bytes,
                "blocks must be contiguous uint8 of ", N * K / 32 * bytes, " bytes");
    return blocks;
  }

  // Calls of up to `layers` tokens read a layer matrix's 4-bit blocks, and whole-head logits of up
  // to `head` rows the head's 8-bit blocks, where they have them (0: never).
  void set_block_rows(int64_t layers, int64_t head) {
    TORCH_CHECK(layers >= 0 && head >= 0, "rows must be >= 0");
    q4_rows_ = layers;
    head_q8_rows_ = head;
  }

  // The embedding has the weights' type; an int8 one is dequantised row by row (`embed_scale`).
  // None: a model fed with input vectors only (`forward_hidden`, e.g. an EAGLE draft head).
  void set_head(std::optional<at::Tensor> embed, at::Tensor final_norm, at::Tensor head,
                std::optional<at::Tensor> embed_scale, std::optional<at::Tensor> head_scale) {
    // A tied embedding is the head's storage: the same rule pairs both or neither.
    if (embed) embed_ = mat(*embed, embed_scale, embed->size(0), H_);
    check_f32(final_norm, H_);
    head_ = mat(head, head_scale, head.size(0), H_);
    final_norm_ = final_norm;
  }

  // A screen for greedy calls of a float32 head (FastLlama's `head_screen`): int8 codes c [V, H]
  // (pair-interleaved where `paired_ok` allows and pairing is on) with per-row scales s [V], and
  // per-row bound coefficients, rounded up: wnorm[j] >= ||s_j c_j||_2 and
  // resid[j] >= ||E_j - s_j c_j||_2 + kScreenGamma * ||E_j||_2, E the float32 head. Calls whose
  // `argmax_only` is set read it instead of the whole head (see `screened_head`).
  void set_head_screen(at::Tensor codes, at::Tensor scale, at::Tensor wnorm, at::Tensor resid) {
    TORCH_CHECK(head_.w.defined() && head_.w.scalar_type() == at::kFloat, "a float32 head must be set first");
    const int64_t V = head_.n;
    TORCH_CHECK(codes.scalar_type() == at::kChar, "screen codes must be int8");
    check_weight(codes, V, H_);
    check_f32(scale, V);
    check_f32(wnorm, V);
    check_f32(resid, V);
    screen_ = {codes, scale, paired_ && paired_ok(at::kChar, V, H_)};
    screen_wnorm_ = wnorm;
    screen_resid_ = resid;
  }

  // Screened calls so far, and of those the rows that fell back to the whole head.
  pybind11::tuple screen_counts() const { return pybind11::make_tuple(screened_rows_, screen_fallbacks_); }

  void set_rope(at::Tensor cos, at::Tensor sin) {
    check_f32(cos, cos.numel());
    check_f32(sin, cos.numel());
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D_ && sin.sizes() == cos.sizes(), "bad rope table");
    cos_ = cos;
    sin_ = sin;
  }

  void set_cache(std::vector<at::Tensor> k, std::vector<at::Tensor> v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one cache per layer");
    for (size_t l = 0; l < k.size(); ++l) {
      for (const auto* t : {&k[l], &v[l]}) {
        TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf ||
                     t->scalar_type() == at::kBFloat16) &&
                        t->scalar_type() == k[0].scalar_type() && t->is_contiguous() &&
                        t->dim() == 4 && t->size(1) == Hkv_ && t->size(3) == D_ &&
                        t->sizes() == k[0].sizes(),
                    "cache must be contiguous float32, float16 or bfloat16 [B, H_kv, S, D], one dtype");
      }
    }
    kv_bf16_ = !k.empty() && k[0].scalar_type() == at::kBFloat16;
    TORCH_CHECK(!kv_bf16_ || (bf16_attention_ready() && D_ == kGroupedHeadDim && k[0].size(2) % 32 == 0),
                "a bfloat16 cache needs a build with AVX-512 BF16, head dimension 64 and S a multiple of 32");
    kv_half_ = !k.empty() && k[0].scalar_type() == at::kHalf;
    kc_ = std::move(k);
    vc_ = std::move(v);
  }

  // ids, slots, pos: [M] int64 (token, its batch row, its cache position). logit_rows: [R] int64
  // indices into the M tokens whose logits are wanted. Returns [R, V] float32.
  //
  // ctx (optional, [M] int64): token m sees cache positions 0 .. ctx[m] - 1 and itself, and ctx[m]
  // is its RoPE position; without it ctx = pos (causal attention over 0 .. pos). This verifies a
  // tree of draft tokens in one call: an alternative to the draft token at some position is written
  // after the chain and attends to the chain's tokens before that position only. A token's scores,
  // softmax and value sum run the same operations in the same order as for the same token placed at
  // position ctx[m] of a chain, so its logits are bitwise the same.
  //
  // argmax_only: the caller reads only where each row's largest logit lies. With a screen set
  // (`set_head_screen`), each row then holds the head's own float32 logits, bitwise, for the rows
  // of the vocabulary the screen could not rule out and -inf for the others; its largest value and
  // the first place it occurs are those of the full row.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& slots, const at::Tensor& pos,
                     const at::Tensor& logit_rows, std::optional<at::Tensor> ctx, bool argmax_only) {
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 1);
    TORCH_CHECK(embed_.n > 0, "this kernel has no embedding: use forward_hidden");
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t m = 0; m < ids.numel(); ++m)
      TORCH_CHECK(id[m] >= 0 && id[m] < embed_.n, "token id out of range");
    return dispatch(ids.numel(), id, nullptr, slots, pos, logit_rows, ctx, argmax_only);
  }

  // Greedy decoding's call: `forward` over token ids[m] at (slots[m], pos[m]) with the head's
  // screen where it has one, then the index of each token's largest logit: the first among equals,
  // a NaN counting as largest (numpy's argmax, which the screen's logits decide exactly). Plain
  // lists in and out: after a forward has streamed the weights through every cache level, each
  // small torch or numpy operation around the call costs 10-100 us (the Python side of a one-token
  // step took about 0.5 ms of an 8-10 ms int8 step with tensors in and the logits out).
  std::vector<int64_t> forward_argmax(std::vector<int64_t> ids, std::vector<int64_t> slots,
                                      std::vector<int64_t> pos) {
    const int64_t M = static_cast<int64_t>(ids.size());
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == M && static_cast<int64_t>(pos.size()) == M,
                "ids, slots and pos differ in length");
    if (M == 0) return {};
    const auto opts = at::TensorOptions().dtype(at::kLong);
    const at::Tensor logits = forward(at::from_blob(ids.data(), {M}, opts), at::from_blob(slots.data(), {M}, opts),
                                      at::from_blob(pos.data(), {M}, opts), at::arange(M, opts), std::nullopt, true);
    const int64_t V = logits.size(1);
    const float* all = logits.data_ptr<float>();
    std::vector<int64_t> best(M, 0);
    for (int64_t m = 0; m < M; ++m) best[m] = first_argmax(all + m * V, V);
    return best;
  }

  // The index of the largest of row[0 .. n): the first among equals, the first NaN where there is
  // one. Vectorised: one pass for the maximum (and any NaN), one for its first index; a branch per
  // element took about 40 us per row of SmolLM2's 49152 logits, 0.2 ms of a 5-token int8 step.
  static int64_t first_argmax(const float* row, int64_t n) {
    const int64_t n8 = n - n % 8;
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 nan = _mm256_setzero_ps();
    for (int64_t j = 0; j < n8; j += 8) {
      const __m256 v = _mm256_loadu_ps(row + j);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      top = _mm256_max_ps(top, v);
    }
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    float most = hmax(top);
    for (int64_t j = n8; j < n; ++j) {
      any_nan = any_nan || std::isnan(row[j]);
      most = std::max(most, row[j]);
    }
    // The first NaN, or the first element equal to the maximum.
    const __m256 vmost = _mm256_set1_ps(most);
    for (int64_t j = 0; j < n8; j += 8) {
      const __m256 v = _mm256_loadu_ps(row + j);
      const int mask = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, vmost, _CMP_EQ_OQ));
      if (mask != 0) return j + __builtin_ctz(mask);
    }
    for (int64_t j = n8; j < n; ++j)
      if (any_nan ? std::isnan(row[j]) : row[j] == most) return j;
    return 0;  // not reached: some element equals the maximum of them all
  }

  // Like forward, with the first layer's inputs given: x [M, hidden] float32 (row m at slots[m],
  // pos[m]) instead of token ids.
  at::Tensor forward_hidden(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& pos,
                            const at::Tensor& logit_rows) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == H_,
                "x must be contiguous float32 [M, hidden]");
    return dispatch(x.size(0), nullptr, x.data_ptr<float>(), slots, pos, logit_rows, std::nullopt, false);
  }

  // Row `slot` of every layer's caches: the keys and values at positions src[i] move to dst[i], in
  // order (src, dst: [n] int64). After a tree forward, an accepted alternative moves into place.
  void move_positions(int64_t slot, const at::Tensor& src, const at::Tensor& dst) {
    TORCH_CHECK(!kc_.empty(), "no cache set");
    for (const auto* t : {&src, &dst})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1);
    TORCH_CHECK(src.numel() == dst.numel(), "src and dst differ in length");
    const int64_t B = kc_[0].size(0), S = kc_[0].size(2), D = D_;
    TORCH_CHECK(slot >= 0 && slot < B, "row out of range");
    const int64_t* s = src.data_ptr<int64_t>();
    const int64_t* d = dst.data_ptr<int64_t>();
    for (int64_t i = 0; i < src.numel(); ++i)
      TORCH_CHECK(s[i] >= 0 && s[i] < S && d[i] >= 0 && d[i] < S, "position out of range");
    if (kv_bf16_) {  // element by element through the layouts
      for (size_t l = 0; l < kc_.size(); ++l)
        for (int64_t g = 0; g < Hkv_; ++g) {
          bf16* kh = static_cast<bf16*>(kc_[l].data_ptr()) + (slot * Hkv_ + g) * S * D;
          bf16* vh = static_cast<bf16*>(vc_[l].data_ptr()) + (slot * Hkv_ + g) * S * D;
          for (int64_t i = 0; i < src.numel(); ++i)
            if (s[i] != d[i])
              for (int64_t e = 0; e < D; ++e) {
                kh[bf16_key_at(d[i], e)] = kh[bf16_key_at(s[i], e)];
                vh[bf16_value_at(d[i], e)] = vh[bf16_value_at(s[i], e)];
              }
        }
      return;
    }
    const int64_t row = D * kc_[0].element_size();  // bytes of one position of one head
    for (size_t l = 0; l < kc_.size(); ++l) {
      for (char* base : {static_cast<char*>(kc_[l].data_ptr()), static_cast<char*>(vc_[l].data_ptr())}) {
        for (int64_t g = 0; g < Hkv_; ++g) {
          char* head = base + (slot * Hkv_ + g) * S * row;
          for (int64_t i = 0; i < src.numel(); ++i)
            if (s[i] != d[i]) std::memcpy(head + d[i] * row, head + s[i] * row, row);
        }
      }
    }
  }

  // When on, each forward keeps the final residual stream (before the final norm) of all its
  // tokens, [M, hidden] float32, for drafters that read the target's hidden states (EAGLE).
  void set_keep_hidden(bool on) {
    keep_hidden_ = on;
    if (!on) hidden_ = at::Tensor();
  }
  at::Tensor last_hidden() const { return hidden_; }

  // Exposed for tests and benchmarks: y = (x @ w^T) * scale (+ bias), x [M, K] float32; `scale`
  // [N] for int8 weights only.
  // `paired`: w is pair-interleaved (`paired_ok` must hold), as FastLlama arranges its matrices.
  // `amx`: int8 w is packed as AMX tiles for this call and multiplied there (`linear_amx`).
  // `vnni_tiles`: likewise, multiplied with AVX-512 VNNI (`linear_vnni_tiles`).
  at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, std::optional<at::Tensor> bias,
                       std::optional<at::Tensor> scale, bool paired, bool amx, bool vnni_tiles) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2);
    check_weight(w, w.size(0), x.size(1));
    TORCH_CHECK(!paired || paired_ok(w.scalar_type(), w.size(0), w.size(1)),
                "these weights cannot be pair-interleaved");
    check_scale(w, scale);
    TORCH_CHECK(!(amx || vnni_tiles) || w.scalar_type() == at::kChar, "tiles take int8 weights");
    if (bias) check_f32(*bias, w.size(0));
    auto y = at::empty({x.size(0), w.size(0)}, x.options());
    const float* b = bias ? bias->data_ptr<float>() : nullptr;
    const float* s = scale ? scale->data_ptr<float>() : nullptr;
    const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
    switch (w.scalar_type()) {
      case at::kBFloat16:
        linear(x.data_ptr<float>(), M, K, wptr<bf16>(w), N, K, s, b, y.data_ptr<float>(), N, false,
               paired, schedule_);
        break;
      case at::kChar:
        if (amx || vnni_tiles) {
          if (amx) {
            TORCH_CHECK(amx_ready(), "this build or machine has no AMX int8 tiles");
          } else {
            TORCH_CHECK(vnni_tiles_ready(), "this build has no AVX-512 VNNI");
          }
          const at::Tensor tiles = at::empty({N, K}, w.options());
          amx_pack(wptr<i8>(w), N, K, paired, reinterpret_cast<i8*>(tiles.data_ptr()));
          const i8* t = wptr<i8>(tiles);
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
          if (amx) linear_amx(x.data_ptr<float>(), M, K, t, N, K, s, b, y.data_ptr<float>(), N, false);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
          if (!amx) {
            const at::Tensor sums = at::empty({N}, at::TensorOptions().dtype(at::kInt));
            tile_row_sums(t, N, K, sums.data_ptr<int32_t>());
            linear_vnni_tiles(x.data_ptr<float>(), M, K, t, sums.data_ptr<int32_t>(), N, K, s, b,
                              y.data_ptr<float>(), N, false);
          }
#endif
          (void)t;
          break;
        }
        linear(x.data_ptr<float>(), M, K, wptr<i8>(w), N, K, s, b, y.data_ptr<float>(), N, false,
               paired, schedule_);
        break;
      default:
        linear(x.data_ptr<float>(), M, K, wptr<float>(w), N, K, s, b, y.data_ptr<float>(), N, false,
               paired, schedule_);
    }
    return y;
  }

 private:
  // Checks shared by forward and forward_hidden; exactly one of `id` and `x_in` is set.
  at::Tensor dispatch(int64_t M, const int64_t* id, const float* x_in, const at::Tensor& slots,
                      const at::Tensor& pos, const at::Tensor& logit_rows,
                      const std::optional<at::Tensor>& ctx, bool argmax_only) {
    for (const auto* t : {&slots, &pos, &logit_rows})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1);
    TORCH_CHECK(!kc_.empty() && cos_.defined() && head_.n > 0, "kernel not fully set up");
    TORCH_CHECK(slots.numel() == M && pos.numel() == M);
    const int64_t B = kc_[0].size(0), S = kc_[0].size(2);
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t* ps = pos.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(sl[m] >= 0 && sl[m] < B, "row out of range");
      TORCH_CHECK(ps[m] >= 0 && ps[m] < S && ps[m] < cos_.size(0), "position out of range");
    }
    ctx_ = ps;
    if (ctx) {
      TORCH_CHECK(ctx->scalar_type() == at::kLong && ctx->is_contiguous() && ctx->numel() == M,
                  "ctx must be contiguous int64 [M]");
      ctx_ = ctx->data_ptr<int64_t>();
      for (int64_t m = 0; m < M; ++m)
        TORCH_CHECK(ctx_[m] >= 0 && ctx_[m] <= ps[m], "ctx must lie in [0, pos]");
    }
    at::Tensor out;
    auto body = [&] {
      switch (wtype_) {
        case at::kBFloat16: out = run<bf16>(M, id, x_in, sl, ps, logit_rows, false); break;
        case at::kChar: out = run<i8>(M, id, x_in, sl, ps, logit_rows, false); break;
        default: out = run<float>(M, id, x_in, sl, ps, logit_rows, argmax_only && screen_.w.defined());
      }
    };
    if (team_) {
      team_drive(body);
    } else {
      body();
    }
    return out;
  }

  template <typename WT>
  static const WT* wptr(const at::Tensor& t) {
    return reinterpret_cast<const WT*>(t.data_ptr());
  }

  static void check_f32(const at::Tensor& t, int64_t n) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
                "expected contiguous float32 with ", n, " elements");
  }

  static void check_weight(const at::Tensor& w, int64_t n, int64_t k) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) == n && w.size(1) == k && w.is_contiguous(),
                "weight must be contiguous [", n, ", ", k, "]");
    const auto t = w.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kChar,
                "weights must be float32, bfloat16 or int8");
  }

  // int8 weights need float32 scales, one per row; the float types take none.
  static void check_scale(const at::Tensor& w, const std::optional<at::Tensor>& scale) {
    if (w.scalar_type() == at::kChar) {
      TORCH_CHECK(scale.has_value(), "int8 weights need per-row scales");
      check_f32(*scale, w.size(0));
    } else {
      TORCH_CHECK(!scale.has_value(), "only int8 weights take scales");
    }
  }

  // A checked weight of [n, k]; every weight of one model must share one type (run<WT> reads all
  // of them as WT). Pair-interleaved when set_paired is on and `paired_ok` allows.
  Mat mat(const at::Tensor& w, const std::optional<at::Tensor>& scale, int64_t n, int64_t k) {
    check_weight(w, n, k);
    check_scale(w, scale);
    if (wtype_ == at::ScalarType::Undefined) wtype_ = w.scalar_type();
    TORCH_CHECK(w.scalar_type() == wtype_, "all weights must have one type");
    Mat m;
    m.w = w;
    m.scale = scale.value_or(at::Tensor());
    m.paired = paired_ && paired_ok(w.scalar_type(), n, k);
    m.n = n;
    return m;
  }

  static const float* opt(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

  // y[M, N] (+)= x[M, K] @ W^T + bias: from W's exact blocks (`linear_blocks`, bitwise the same)
  // where it has them, for calls of up to q4_rows_ tokens (a layer's 4-bit blocks, `set_q4`) or
  // head_q8_rows_ rows (the head's 8-bit blocks, `set_head_q8`), else `linear`.
  // `pre`: x already quantised into 8-bit blocks (`ahead`), where W takes them, from its row
  // `pre_row` on (`layers_by_rows`: a thread's rows of the call); `done` then handed
  // each thread's columns at the end of its chunk (`linear_q4_tiles`). `stream`: y goes to the other
  // thread next, so block tiles write it with non-temporal stores where they can (`linear_q4_tiles`).
  // `own` (instead of `pre`, where the product takes it: `takes_own_rows`): each of the product's
  // threads forms every input row itself (`OwnRows`: quantised, normalised first where it has a
  // norm); `done` as with `pre` (block products only).
  template <typename WT>
  void product(const Mat& W, const float* x, int64_t M, int64_t K, int64_t N, const float* bias, float* y,
               bool accumulate, const Blocks8* pre = nullptr, const ColumnsDone* done = nullptr,
               bool stream = false, int64_t pre_row = 0, const OwnRows* own = nullptr) {
    if constexpr (std::is_same_v<WT, i8>) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (block_product<WT>(W)) {
        const bool q8 = !W.q4i.defined();
        linear_block_tiles(q8, act8_, x, M, K, (q8 ? W.q8i : W.q4i).data_ptr<uint8_t>(), N, K, bias, y, N, accumulate,
                           pre, pre || own ? done : nullptr, stream, pre_row, own);
        return;
      }
#endif
      if (reads_tiles(W, M)) {
        TORCH_CHECK(own == nullptr, "a product's own input rows need int8 rows or block weights");
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
        if (amx_) {
          linear_amx(x, M, K, wptr<i8>(W.tiles), N, K, W.sc(), bias, y, N, accumulate);
          return;
        }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        linear_vnni_tiles(x, M, K, wptr<i8>(W.tiles), W.wsum.data_ptr<int32_t>(), N, K, W.sc(), bias, y, N,
                          accumulate);
        return;
#endif
      }
      linear(x, M, K, wptr<WT>(W.w), N, K, W.sc(), bias, y, N, accumulate, W.paired, schedule_, own);
      return;
    }
    TORCH_CHECK(own == nullptr, "a product's own input rows need int8 rows or block weights");
    if constexpr (std::is_same_v<WT, float>) {
      if (W.q4.defined() && M <= q4_rows_) {
        const Q4Blocks blocks{{W.q4.data_ptr<uint8_t>(), K / 32, N, 0}};
        linear_blocks(x, M, K, blocks, N, bias, y, N, accumulate);
        return;
      }
      if (W.q8.defined() && M <= head_q8_rows_) {
        const Q8Blocks blocks{{W.q8.data_ptr<uint8_t>(), K / 32, N, 0}};
        linear_blocks(x, M, K, blocks, N, bias, y, N, accumulate);
        return;
      }
    }
    linear(x, M, K, wptr<WT>(W.w), N, K, W.sc(), bias, y, N, accumulate, W.paired, schedule_);
  }

  // Whether product<i8>(W, ..) over M rows reads W's tiles (int8 prompts: AMX, else VNNI).
  bool reads_tiles(const Mat& W, int64_t M) const {
    if (!W.tiles.defined() || M < amx_rows_) return false;
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
    if (amx_) return true;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return vnni_tiles_ && W.wsum.defined();
#else
    return false;
#endif
  }

  // Where product<WT>(W, ..) over M rows of K columns takes 8-bit block activations, `buf` sized for
  // them and the offset W's blocks need, for the job before the product to fill (`quantize_ahead`);
  // else (or with `set_fuse(false)`) null, and the product quantises the float rows itself.
  template <typename WT>
  Blocks8* ahead(const Mat& W, int64_t M, int64_t K, Blocks8& buf) const {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<WT, i8>) {
      if (fuse_ && act8_ && (W.q4i.defined() || W.q8i.defined()) && K % 32 == 0) {
        buf.resize(M, K, !W.q4i.defined(), streams(M));
        return &buf;
      }
    }
#endif
    (void)W, (void)M, (void)K, (void)buf;
    return nullptr;
  }

  // Whether a call of M rows runs its layers by rows (`layers_by_rows`): int4 and w4a8 calls of at
  // least kRowSplitRows tokens (prompt pieces), int8 ones of at least kRowSplitRowsInt8, in a team
  // of two threads. (Each thread reads every weight: with more threads, unmeasured, the columns split stays.)
  template <typename WT>
  bool rows_split(int64_t M) {
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<WT, i8>) {
#else
    if constexpr (true) {  // `layers_by_rows` computes SwiGLU 16 columns at a time (`swiglu16`)
#endif
      (void)M;
      return false;
    } else {
      if (!rows_ || M < kRowSplitRows || t_team == nullptr || team_threads() != 2) return false;
      if (H_ % 32 != 0 || I_ % 32 != 0 || (Hq_ * D_) % 32 != 0 || D_ % 32 != 0) return false;
      for (const Layer& L : layers_)
        if (!L.wqkv.q4i.defined() || !L.wo.q4i.defined() || !L.wgu.q4i.defined() || !L.wdown.q4i.defined())
          return M >= kRowSplitRowsInt8;  // int8's rows of weights
      return true;
    }
  }

  // The layers of an int8, int4 or w4a8 call of M rows (`rows_split`), each thread taking its own rows
  // through everything but the attention: per layer one job over the attention's items, then one
  // in which each thread runs the wo product, the post-norm, the gate/up product, SwiGLU and the
  // down product of its rows over all columns, and the next layer's input norm and qkv product
  // (with RoPE and the cache writes) of the same rows. Each thread reads every weight, but no
  // activation crosses to the other thread but the keys, values and queries the attention reads
  // and its outputs. Every product's output row is the same arithmetic whichever rows share its
  // call, every norm, RoPE and SwiGLU row its own, so every result is the same, bitwise, as with
  // the products split by columns. Across CCDs a 128-token w4a8 piece at 300 cached tokens took
  // 109 ms split by columns, 87 on one CCD; by rows (benchmarks/kernel_ab.py --placement, 150
  // rounds, paired medians, session 52): 32 / 64 / 128 tokens 0.968x / 0.934x / 0.917x across
  // CCDs, 0.971x / 0.975x / 0.977x on one.
  void layers_by_rows(int64_t M, const int64_t* sl, const int64_t* ps, const float* cos, const float* sin) {
    using WT = i8;
    const int64_t H = H_, QKV = (Hq_ + 2 * Hkv_) * D_, HQD = Hq_ * D_, I = I_;
    float* x = x_.data();
    float* xn = xn_.data();
    float* qkv = qkv_.data();
    // w4a8's 8-bit block activations, quantised ahead (each thread its rows); int4's and int8's
    // products quantise their rows themselves.
    Blocks8* qx = ahead<WT>(layers_[0].wqkv, M, H, xq_);
    Blocks8* qa = ahead<WT>(layers_[0].wo, M, HQD, attq_);
    Blocks8* qd = ahead<WT>(layers_[0].wdown, M, I, actq_);
    TORCH_CHECK(!qx == !qa && !qx == !qd, "8-bit block activations for all products or none");
    auto quantise = [&](Blocks8* q, const float* v, int64_t K, int64_t m0, int64_t m1) {
      if (q) quantize_ahead(*q, v, K, M, m0, m1);
    };
    auto norm = [&](const at::Tensor& w, int64_t m0, int64_t m1) {  // on this thread: it is inside a job
      rmsnorm_rows(x + m0 * H, m1 - m0, H, H, w.data_ptr<float>(), eps_, xn + m0 * H);
      quantise(qx, xn, H, m0, m1);
    };
    ++rows_calls_;
    // Layer l's input norm and qkv product (RoPE, the cache) for rows m0 .. m1 - 1.
    auto head_part = [&](size_t l, int64_t m0, int64_t m1) {
      const Layer& L = layers_[l];
      norm(L.in_norm, m0, m1);
      product<WT>(L.wqkv, xn + m0 * H, m1 - m0, H, QKV, opt(L.bqkv), qkv + m0 * QKV, false, qx, nullptr, false, m0);
      write_heads(l, m0, m1, 0, Hq_ + 2 * Hkv_, sl, ps, cos, sin);
    };
    // Layer l's wo product, post-norm, gate/up product, SwiGLU and down product for those rows.
    auto tail_part = [&](size_t l, int64_t m0, int64_t m1) {
      const Layer& L = layers_[l];
      product<WT>(L.wo, att_.data() + m0 * HQD, m1 - m0, HQD, H, opt(L.bo), x + m0 * H, true, qa, nullptr, false, m0);
      norm(L.post_norm, m0, m1);
      float* gu = gu_.data();
      float* act = act_.data();
      product<WT>(L.wgu, xn + m0 * H, m1 - m0, H, 2 * I, nullptr, gu + m0 * 2 * I, false, qx, nullptr, false, m0);
#if defined(__AVX512F__)
      for (int64_t m = m0; m < m1; ++m)
        swiglu16(gu + m * 2 * I, gu + m * 2 * I + I, nullptr, nullptr, act + m * I, I);
#endif
      quantise(qd, act, I, m0, m1);
      product<WT>(L.wdown, act + m0 * I, m1 - m0, I, H, nullptr, x + m0 * H, true, qd, nullptr, false, m0);
    };
    // f(m0, m1) on each thread over its own rows.
    const int64_t T = team_threads(), per = (M + T - 1) / T;
    auto by_thread = [&](const auto& f) {
      team_for(0, T, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) f(std::min(M, t * per), std::min(M, (t + 1) * per));
      });
    };
    const size_t layers = layers_.size();
    by_thread([&](int64_t m0, int64_t m1) { head_part(0, m0, m1); });
    for (size_t l = 0; l < layers; ++l) {
      attention(l, M, ps, qa);  // its items split between the threads as in `run`
      by_thread([&](int64_t m0, int64_t m1) {
        tail_part(l, m0, m1);
        if (l + 1 < layers) head_part(l + 1, m0, m1);
      });
    }
  }

  // The whole head's logits out [R, V] for final-normed rows x [R, H].
  template <typename WT>
  void head_logits(const float* x, int64_t R, float* out) {
    product<WT>(head_, x, R, H_, head_.n, nullptr, out, false);
  }

  template <typename WT>
  at::Tensor run(int64_t M, const int64_t* id, const float* x_in, const int64_t* sl, const int64_t* ps,
                 const at::Tensor& logit_rows, bool screened) {
    const int64_t H = H_, D = D_, QKV = (Hq_ + 2 * Hkv_) * D_, HQD = Hq_ * D_, I = I_;
    x_.resize(M * H);
    xn_.resize(M * H);
    qkv_.resize(M * QKV);
    att_.resize(M * HQD);
    gu_.resize(M * 2 * I);
    act_.resize(M * I);
    float* x = x_.data();
    float* xn = xn_.data();
    float* qkv = qkv_.data();

    if (x_in != nullptr) {
      std::memcpy(x, x_in, M * H * sizeof(float));
    } else {
      const WT* emb = embed_.w.defined() ? wptr<WT>(embed_.w) : nullptr;  // null: blocks only
      const float* emb_scale = embed_.sc();
      for (int64_t m = 0; m < M; ++m) {
        if (embed_.q8i.defined()) {  // int4, w4a8: the exact row
          q8_row(embed_.q8i.data_ptr<uint8_t>(), embed_.n, H, id[m], x + m * H);
          continue;
        }
        const float s = emb_scale ? emb_scale[id[m]] : 1.0f;  // x * 1.0f is exact for the float types
        if (embed_.paired) {  // row id is half of pair id / 2, chunk by chunk
          constexpr int64_t C = kPairChunk<WT>;
          const WT* row = emb + (id[m] / 2) * 2 * H + (id[m] % 2) * C;
          for (int64_t k = 0; k < H; ++k) x[m * H + k] = to_f32(row[(k / C) * 2 * C + k % C]) * s;
        } else {
          for (int64_t k = 0; k < H; ++k) x[m * H + k] = to_f32(emb[id[m] * H + k]) * s;
        }
      }
    }

    const float* cos = cos_.data_ptr<float>();
    const float* sin = sin_.data_ptr<float>();
    plan_attention(M, sl);
    // Each product's 8-bit block activations, where it takes them, are quantised by the job that
    // writes its input, row by row or query by query as each is finished (`ahead`).
    auto norm = [&](const at::Tensor& w, Blocks8* q) {
      rmsnorm_then(x, M, H, w.data_ptr<float>(), eps_, xn, [&](int64_t m0, int64_t m1) {
        if (q) quantize_ahead(*q, xn, H, M, m0, m1);
      });
    };
    // Where the qkv product takes 8-bit blocks, its threads split it by groups of kQ4Group tiles;
    // with heads of that many columns each thread then writes the heads it computed (`write_heads`:
    // RoPE, the cache) as its chunk's last step, instead of write_kv's job over rows afterwards.
    // Where the gate/up product takes 8-bit blocks, its threads can take the same groups of gate and
    // up columns (ColumnsDone::halves) and each then computes SwiGLU over those columns of every row,
    // and the down product's 8-bit blocks of them, as its chunk's last step: no SwiGLU job, and no
    // gate or up row read by the other thread. Each element's arithmetic is swiglu_rows's (swiglu16).
    const bool heads_whole = D == kQ4Group * kQ4Tile, swiglu_whole = I % (kQ4Group * kQ4Tile) == 0;
    const bool stream = streams(M);  // the wo and down products' outputs go to the norms' rows
    const bool by_rows = rows_split<WT>(M);
    if (by_rows) layers_by_rows(M, sl, ps, cos, sin);
    // A product's input after a norm: the norm's job writes xn (and 8-bit blocks into q, `ahead`);
    // or, where the product can (`takes_own_rows`: int4, w4a8, int8) in a call of up to kOwnRows
    // tokens (`own_rows`), its threads each form every input row from x themselves (`OwnRows`),
    // and no job runs before it. The int4 and int8 products after the attention and SwiGLU form
    // their own rows alike. Only block products hand their columns on (`columns`: the heads,
    // SwiGLU), and only where their input is quantised ahead or their own.
    struct Normed {
      const float* x;
      Blocks8* pre;
      OwnRows rows;  // with a norm where the product's threads normalise x themselves
      bool columns;
      const OwnRows* own() const { return rows.w != nullptr ? &rows : nullptr; }
    };
    const bool own_calls = own_rows(M);
    const auto normed = [&](const Mat& W, Blocks8* q, const at::Tensor& w) {
      if (own_calls && takes_own_rows<WT>(W, M))
        return Normed{x, nullptr, {w.data_ptr<float>(), eps_}, block_product<WT>(W)};
      norm(w, q);
      return Normed{xn, q, {}, q != nullptr};
    };
    // y [M, N] = W's product over a norm's output `in` (+ bias), `done` handed each thread's columns.
    const auto product_normed = [&](const Mat& W, const Normed& in, int64_t N, const float* bias, float* y,
                                    const ColumnsDone* done) {
      product<WT>(W, in.x, M, H, N, bias, y, false, in.pre, done, false, 0, in.own());
    };
    // x [M, H] += W's product over a [M, K] (+ bias), its 8-bit blocks in `pre` where quantised
    // ahead; else, where the product can, each thread quantises its own rows of a in short calls.
    const OwnRows unnormed{};
    const auto residual_product = [&](const Mat& W, const float* a, int64_t K, const float* bias, Blocks8* pre) {
      const OwnRows* own = own_calls && pre == nullptr && takes_own_rows<WT>(W, M) ? &unnormed : nullptr;
      product<WT>(W, a, M, K, H, bias, x, true, pre, nullptr, stream, 0, own);
    };
    for (size_t l = 0; !by_rows && l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      Blocks8* q = ahead<WT>(L.wqkv, M, H, xq_);
      Normed in = normed(L.wqkv, q, L.in_norm);
      const auto heads = [&](int64_t c0, int64_t c1) { write_heads(l, 0, M, c0 / D, c1 / D, sl, ps, cos, sin); };
      const ColumnsDone heads_done = columns_done(heads);
      const ColumnsDone* heads_at = in.columns && heads_whole ? &heads_done : nullptr;
      product_normed(L.wqkv, in, QKV, opt(L.bqkv), qkv, heads_at);
      if (!heads_at) write_kv(l, M, sl, ps, cos, sin);
      Blocks8* qa = D % 32 == 0 ? ahead<WT>(L.wo, M, HQD, attq_) : nullptr;
      attention(l, M, ps, qa);
      residual_product(L.wo, att_.data(), HQD, opt(L.bo), qa);
      q = ahead<WT>(L.wgu, M, H, xq_);
      in = normed(L.wgu, q, L.post_norm);
      Blocks8* qd = ahead<WT>(L.wdown, M, I, actq_);
      const auto swiglu_by_columns = [&](int64_t c0, int64_t c1) { swiglu_columns(M, c0, c1, qd); };
      const ColumnsDone swiglu_done = columns_done(swiglu_by_columns, true);
      if (in.columns && swiglu_whole) {
        product_normed(L.wgu, in, 2 * I, nullptr, gu_.data(), &swiglu_done);
      } else {
        product_normed(L.wgu, in, 2 * I, nullptr, gu_.data(), nullptr);
        swiglu(M, I, qd);
      }
      residual_product(L.wdown, act_.data(), I, nullptr, qd);
    }

    if (keep_hidden_) {
      hidden_ = at::empty({M, H}, at::kFloat);
      std::memcpy(hidden_.data_ptr<float>(), x, M * H * sizeof(float));
    }

    const int64_t R = logit_rows.numel();
    const int64_t* lr = logit_rows.data_ptr<int64_t>();
    std::vector<float> sel(R * H);
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(lr[r] >= 0 && lr[r] < M, "logit row out of range");
      rmsnorm(x + lr[r] * H, 1, H, final_norm_.data_ptr<float>(), eps_, sel.data() + r * H);
    }
    const int64_t V = head_.n;
    auto logits = at::empty({R, V}, at::kFloat);
    if constexpr (std::is_same_v<WT, float>) {
      if (screened && R > 0) {
        screened_head(sel.data(), R, logits.data_ptr<float>());
        return logits;
      }
    }
    if (R > 0) head_logits<WT>(sel.data(), R, logits.data_ptr<float>());
    return logits;
  }

  // The greedy screen of the float32 head E [V, H] for rows h = sel [R, H] (final-normed), into
  // out [R, V]. The screen's logits a_j come from `linear` on its int8 codes: h quantised to int16
  // as q * xs, the integer sum exact, then t * xs * s_j in double rounded once to float. So with
  // e = h - xs q (|e_k| <= 0.502 xs + |h_k| 2^-22 by `quantize_rows_i16`'s rounding) and
  // r_j = E_j - s_j c_j:
  //   |h . E_j - a_j| <= |a_j| 2^-22 + ||e|| ||s_j c_j|| + ||h|| ||r_j||,
  // and the head's float32 logit l_j (K fused multiply-adds per lane chain, then a sum of 8) lies
  // within gamma ||h|| ||E_j|| of h . E_j. With m_j the sum of those margins (wnorm and resid hold
  // the per-row norms, gamma folded into resid), every j with a_j + m_j < max_i (a_i - m_i) has
  // l_j below some other logit and can be neither the largest nor the first among equals. The
  // others' logits are computed by the same `tile` code as the whole head's, whose every output
  // is the same arithmetic whatever rows share a call and however they are laid out (bitwise, as
  // the tests check). Rows whose candidates exceed kScreenMost, or whose h is not finite, take
  // the whole head.
  void screened_head(const float* sel, int64_t R, float* out) {
    const int64_t V = head_.n, H = H_;
    screen_logits_.resize(R * V);
    linear(sel, R, H, wptr<i8>(screen_.w), V, H, screen_.sc(), nullptr, screen_logits_.data(), V,
           false, screen_.paired, schedule_);
    const float* wn = screen_wnorm_.data_ptr<float>();
    const float* rn = screen_resid_.data_ptr<float>();
    const float* head = head_.w.data_ptr<float>();
    constexpr int64_t C = kPairChunk<float>;
    for (int64_t r = 0; r < R; ++r) {
      const float* h = sel + r * H;
      float* o = out + r * V;
      const float* a = screen_logits_.data() + r * V;
      double ss = 0.0, amax = 0.0;
      for (int64_t k = 0; k < H; ++k) {
        ss += static_cast<double>(h[k]) * h[k];
        amax = std::max(amax, std::fabs(static_cast<double>(h[k])));
      }
      const double hn = std::sqrt(ss) * (1.0 + 1e-9);
      const double en = 0.51 * (amax / 32767.0) * std::sqrt(static_cast<double>(H)) + hn * 1e-6;
      ++screened_rows_;
      bool whole = !std::isfinite(hn);
      int64_t n = 0;
      if (!whole) {
        // In float, 8 lanes at a time: every coefficient is inflated by 2^-18 and the |a_j| term
        // is 2^-19 instead of 2^-22, far more than the at most four roundings (2^-24 each) of
        // m_j, a_j - m_j and a_j + m_j, and lo is lowered by 2^-20 |lo|: so upper_j >= a_j + m_j
        // and lo <= max_i (a_i - m_i), each with the margins of the real-number argument above.
        const float ef = static_cast<float>(en * (1.0 + 0x1p-18));
        const float hf = static_cast<float>(hn * (1.0 + 0x1p-18));
        screen_upper_.resize(V);
        float* up = screen_upper_.data();
        const __m256 c0 = _mm256_set1_ps(0x1p-19f), ve = _mm256_set1_ps(ef), vh = _mm256_set1_ps(hf);
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 vlo = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        int64_t j = 0;
        for (; j + 8 <= V; j += 8) {
          const __m256 va = _mm256_loadu_ps(a + j);
          const __m256 m = _mm256_add_ps(
              _mm256_add_ps(_mm256_mul_ps(_mm256_and_ps(va, abs_mask), c0),
                            _mm256_mul_ps(ve, _mm256_loadu_ps(wn + j))),
              _mm256_mul_ps(vh, _mm256_loadu_ps(rn + j)));
          vlo = _mm256_max_ps(_mm256_sub_ps(va, m), vlo);
          _mm256_storeu_ps(up + j, _mm256_add_ps(va, m));
        }
        float lo = hmax(vlo);
        for (; j < V; ++j) {
          const float m = std::fabs(a[j]) * 0x1p-19f + ef * wn[j] + hf * rn[j];
          lo = std::max(lo, a[j] - m);
          up[j] = a[j] + m;
        }
        lo -= std::fabs(lo) * 0x1p-20f;
        cand_.clear();
        for (j = 0; j < V; ++j) {
          if (up[j] >= lo) {
            if (static_cast<int64_t>(cand_.size()) == kScreenMost) {
              whole = true;
              break;
            }
            cand_.push_back(j);
          }
        }
        whole = whole || !std::isfinite(lo);
        n = static_cast<int64_t>(cand_.size());
        whole = whole || !std::isfinite(lo);
      }
      if (whole) {
        ++screen_fallbacks_;
        head_logits<float>(h, 1, o);
        continue;
      }
      cand_rows_.resize(n * H);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = cand_[i];
        float* dst = cand_rows_.data() + i * H;
        if (head_.paired) {  // row j of the pairs, chunk by chunk (as the embedding reads it)
          const float* row = head + (j / 2) * 2 * H + (j % 2) * C;
          for (int64_t k = 0; k < H; k += C) std::memcpy(dst + k, row + 2 * k, C * sizeof(float));
        } else {
          std::memcpy(dst, head + j * H, H * sizeof(float));
        }
      }
      cand_vals_.resize(n);
      linear(h, 1, H, cand_rows_.data(), n, H, nullptr, nullptr, cand_vals_.data(), n, false, false,
             schedule_);
      std::fill_n(o, V, -std::numeric_limits<float>::infinity());
      for (int64_t i = 0; i < n; ++i) o[cand_[i]] = cand_vals_[i];
    }
  }

  // RoPE on q and k in place, then k and v into the caches at (slot, head, pos).
  void write_kv(size_t l, int64_t M, const int64_t* sl, const int64_t* ps, const float* cos,
                const float* sin) {
    const int64_t QKV = (Hq_ + 2 * Hkv_) * D_;
    rows_in_parallel(M, [&](int64_t m0, int64_t m1) {  // each token its own row and cache positions
      prefetch_rows_for_write(M, qkv_.data(), QKV, m0, m1);
      write_heads(l, m0, m1, 0, Hq_ + 2 * Hkv_, sl, ps, cos, sin);
    });
  }

  // write_kv's work for rows m0 .. m1 - 1 and heads h0 .. h1 - 1 of qkv_ (q heads, then k, then v):
  // RoPE on the q and k heads, the k and v heads into the caches. Each head's arithmetic is its own,
  // so any split of rows and heads gives the same bits.
  void write_heads(size_t l, int64_t m0, int64_t m1, int64_t h0, int64_t h1, const int64_t* sl, const int64_t* ps,
                   const float* cos, const float* sin) {
    const int64_t D = D_, QKV = (Hq_ + 2 * Hkv_) * D_;
    for (int64_t m = m0; m < m1; ++m) {
      float* row = qkv_.data() + m * QKV;
      const float* c = cos + ctx_[m] * D;  // the RoPE position (ctx = pos but in trees)
      const float* s = sin + ctx_[m] * D;
      for (int64_t h = h0; h < std::min(h1, Hq_ + Hkv_); ++h) rope(row + h * D, c, s, D);
      for (int64_t h = std::max(h0, Hq_); h < h1; ++h) {
        const bool value = h >= Hq_ + Hkv_;
        store_kv(l, sl[m], value ? h - Hq_ - Hkv_ : h - Hq_, ps[m], row + h * D, value);
      }
    }
  }

  // Key (or with `value`, value) x, D floats, of KV head g into layer l's cache at (slot, g, pos),
  // rounded to the cache's type as torch rounds it (nearest even) and, for bfloat16, into its layouts.
  void store_kv(size_t l, int64_t slot, int64_t g, int64_t pos, const float* x, bool value) {
    const int64_t D = D_, S = kc_[l].size(2), head = (slot * Hkv_ + g) * S * D;
    const at::Tensor& cache = value ? vc_[l] : kc_[l];
    if (kv_bf16_) {
      bf16* ch = static_cast<bf16*>(cache.data_ptr()) + head;
      alignas(32) bf16 r[kGroupedHeadDim];
      for (int64_t d = 0; d < D; d += 8) store8(r + d, _mm256_loadu_ps(x + d));
      if (value) {
        for (int64_t d = 0; d < D; ++d) ch[bf16_value_at(pos, d)] = r[d];
      } else {
        for (int64_t d = 0; d < D; d += 2)  // the key's pairs, each one 32-bit word of its block
          std::memcpy(ch + bf16_key_at(pos, d), r + d, 2 * sizeof(bf16));
      }
      return;
    }
    const int64_t off = head + pos * D;
    if (kv_half_) {
      f16* c = static_cast<f16*>(cache.data_ptr()) + off;
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) store8(c + d, _mm256_loadu_ps(x + d));  // the same rounding, 8 at a
                    // time (1 / 5 tokens: 42 -> 29, 89 -> 61 us per step on the Xeon, as `prefetch_rows`)
      for (; d < D; ++d) store1(c + d, x[d]);
      return;
    }
    std::memcpy(cache.data_ptr<float>() + off, x, D * sizeof(float));
  }

  // Which queries (token m, head h) are scored together: those of one batch row and one KV head
  // read the same keys and values, so an item holds several of them and goes through the keys a
  // block at a time while the block is in L1. Each key and value is then read once per item, not
  // once per query (a 5-token step over 1000 cached tokens read each row's 1.5 MB of keys and
  // values 15 times per layer). Items hold at most `cap` queries so that every thread gets work,
  // but never fewer than one token's queries of a KV head (its G query heads), and at most
  // kMaxItemQueries so their score buffers (n queries by the item's keys) stay in L2 in long
  // prefills (32 before session 41; 96 lets a prompt piece's wide items widen each block of keys
  // once for more queries). Grouping never changes a query's arithmetic. One token's KV heads were split 1 + 2 over the threads before, each read by
  // both cores; whole, with the 512-bit groups, one token at 1500 cached tokens took 2-3% less on
  // the Xeon (8 alternating rounds, min: int8 9.97 -> 9.70 ms, float32 26.06 -> 25.29; five tokens
  // unchanged, their items already whole groups; benchmarks/SESSIONS.md, session 14).
  struct AttnItem {
    int64_t slot, g, begin, end;  // queries_[begin .. end)
  };
  static constexpr int64_t kMaxItemQueries = 96;

  // The most cached positions any of an item's queries attends to before itself.
  int64_t item_context(const AttnItem& it) const {
    int64_t c = 0;
    for (int64_t a = it.begin; a < it.end; ++a) c = std::max(c, ctx_[queries_[a] / Hq_]);
    return c;
  }

  void plan_attention(int64_t M, const int64_t* sl) {
    const int64_t G = Hq_ / Hkv_, threads = std::max<int64_t>(1, team_threads());
    const int64_t per_thread = (M * Hq_ + 4 * threads - 1) / (4 * threads);
    const int64_t cap = std::min(kMaxItemQueries, std::max<int64_t>(G, per_thread));
    items_.clear();
    queries_.clear();
    std::vector<int64_t> rows;  // the call's batch rows, in order of their first token
    for (int64_t m = 0; m < M; ++m)
      if (std::find(rows.begin(), rows.end(), sl[m]) == rows.end()) rows.push_back(sl[m]);
    for (const int64_t slot : rows) {
      for (int64_t g = 0; g < Hkv_; ++g) {
        const int64_t first = static_cast<int64_t>(queries_.size());
        for (int64_t m = 0; m < M; ++m)
          if (sl[m] == slot)
            for (int64_t h = g * G; h < (g + 1) * G; ++h) queries_.push_back(m * Hq_ + h);
        const int64_t n = static_cast<int64_t>(queries_.size()) - first, pieces = (n + cap - 1) / cap;
        const int64_t t = n / G;  // whole tokens per item, so a token's G queries stay together
        for (int64_t i = 0; i < pieces; ++i)
          items_.push_back({slot, g, first + G * (t * i / pieces), first + G * (t * (i + 1) / pieces)});
      }
    }
  }

  // act_[m, k] = silu(gate) * up from gu_ [M, 2I] (gate, then up), by swiglu_rows: each element's
  // arithmetic depends only on its column, so tokens stay independent. (Its exp8: the scalar expf
  // took 0.6-1 ms of a 5-token int8 forward (perf: 4-6% of its samples); on the Xeon, 6 interleaved
  // rounds at 200 cached tokens, ms: int8 1 / 5 / 9 tokens 11.2 / 15.9 / 25.4 -> 11.0 / 14.8 / 24.0,
  // float32 24.9 / 26.1 / 29.9 -> 24.0 / 26.6 / 28.6.)
  // swiglu's work on columns c0 .. c1 - 1 (multiples of 16) of every row, with q those columns'
  // 8-bit blocks too (c0 and c1 multiples of 32).
  void swiglu_columns(int64_t M, int64_t c0, int64_t c1, Blocks8* q) {
#if defined(__AVX512F__)
    const int64_t I = I_;
    for (int64_t m = 0; m < M; ++m) {
      const float* g = gu_.data() + m * 2 * I;
      float* a = act_.data() + m * I;
      swiglu16(g + c0, g + I + c0, nullptr, nullptr, a + c0, c1 - c0);
      if (q) quantize_span(*q, a + c0, m * I + c0, c1 - c0);
    }
    if (q && q->stream) _mm_sfence();
#else
    (void)M, (void)c0, (void)c1, (void)q;
    TORCH_CHECK(false, "8-bit block activations need AVX-512");
#endif
  }

  // With q, each thread then quantises its rows into q (`ahead`).
  void swiglu(int64_t M, int64_t I, Blocks8* q) {
    swiglu_rows_then<float>(gu_.data(), nullptr, M, I, act_.data(), [&](int64_t m0, int64_t m1) {
      if (q) quantize_ahead(*q, act_.data(), I, M, m0, m1);
    });
  }

  // Each of an item's n queries' outputs into q's 8-bit blocks (none without q), where the wo
  // product takes them (`ahead`): on the thread that computed them, as soon as they are final.
  void quantize_outputs(Blocks8* q, const int64_t* qs, int64_t n) {
    if (!q) return;
    for (int64_t a = 0; a < n; ++a) quantize_span(*q, att_.data() + qs[a] * D_, qs[a] * D_, D_);
    if (q->stream) _mm_sfence();
  }

  // Causal attention of each token over its own row's cache positions 0 .. ctx - 1, then itself
  // (at pos; ctx = pos but in trees); no other key (other drafts, stale rejected tokens) is ever
  // read. Per query: scores (dot), softmax_numerators, normalise, then each output element one fma
  // chain over the keys in order and the token's own value last: the same operations whichever
  // queries share its item (plan_attention) and however the keys are blocked.
  // With q, each query's output also goes into q's 8-bit blocks (`quantize_outputs`).
  void attention(size_t l, int64_t M, const int64_t* ps, Blocks8* q) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (kv_bf16_) return attention_bf16(l, ps, q);
#endif
    if (kv_half_) attention_t<f16>(l, M, ps, q);
    else attention_t<float>(l, M, ps, q);
  }

  // Asks for bytes from .. to of an item's keys (into L1) and values (into L2): `attention_t` asks
  // for the next block of each while it scores a block. A decoding step has just streamed the
  // weights through every cache level, and the attention's loads otherwise waited on each line
  // (perf put most of its samples on the value loads). The arithmetic is unchanged. On the 2-core
  // Xeon (SmolLM2-135M int8, greedy step at 200 cached tokens, builds over one copy of the weights
  // alternating, 10 rounds of 20 steps, us per step spent in attention, /tmp/s35/phases2.py): 1
  // token 300 -> 251, 5 tokens 635 -> 633. Asking for an item's whole keys and values at its start
  // gained as much for one token, but its prefetches then waited on each other (19% of the
  // attention's samples in a 5-token step).
  static void prefetch_rows(const void* keys, const void* values, int64_t from, int64_t to) {
    const char* k = static_cast<const char*>(keys);
    const char* v = static_cast<const char*>(values);
    for (int64_t o = from; o < to; o += 64) {
      _mm_prefetch(k + o, _MM_HINT_T0);
      _mm_prefetch(v + o, _MM_HINT_T1);
    }
  }

#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // Attention over a bfloat16 cache (int4, w4a8; opt-in), in `vdpbf16ps` steps: each query rounded
  // to bfloat16 pairs, each score a chain over the 32 pairs of its key (`bf16_block_scores`, 16 keys
  // a register, no widening and no horizontal sums), the softmax in float32 as `attention_t`'s, the
  // weights rounded to bfloat16 pairs of positions, then each output element a chain over the pairs
  // of positions 0 .. ctx - 1 in order (the pair holding position ctx, where ctx is odd, weighted 0
  // there) and last the token's own value (its pair weighted 0 at the other position). A query's
  // operations depend only on its own vector, the cached keys and values and its ctx and position,
  // not on which queries share its item. Half the multiply instructions of the float32 chains, which
  // bound a verification's attention: SmolLM2-135M w4a8 on the 2-core Zen 4, a float16 cache against
  // this one (step_phases.py, us per step in attention at 200 cached tokens): 1 token 332 -> 236, 5
  // tokens 718 -> 453; whole steps at 800 cached tokens (min ms) 4.16 -> 3.78 and 6.32 -> 5.14.
  void attention_bf16(size_t l, const int64_t* ps, Blocks8* q) {
    constexpr int64_t D = kGroupedHeadDim, QS = 8, QW = 6;  // queries per pass: scores, weighted sums
    const int64_t QKV = (Hq_ + 2 * Hkv_) * D, S = kc_[l].size(2);
    const bf16* kc = static_cast<const bf16*>(kc_[l].data_ptr());
    const bf16* vc = static_cast<const bf16*>(vc_[l].data_ptr());
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    team_for(0, static_cast<int64_t>(items_.size()), 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> pbuf;
      thread_local std::vector<uint32_t> qbuf, wbuf, obuf;  // queries, weights, own weights: bfloat16 pairs
      for (int64_t i = i0; i < i1; ++i) {
        const AttnItem& it = items_[i];
        const int64_t n = it.end - it.begin, cmax = item_context(it);
        const int64_t* qs = queries_.data() + it.begin;
        const bf16* K = kc + (it.slot * Hkv_ + it.g) * S * D;
        const bf16* V = vc + (it.slot * Hkv_ + it.g) * S * D;
        const int64_t P = (cmax + 16) / 16 * 16 + 32;  // scores of keys 0 .. cmax, padded for the pairs
        pbuf.resize(n * P);
        qbuf.resize(n * D / 2);
        wbuf.resize(n * P / 2);
        obuf.resize(n);
        auto ctx = [&](int64_t a) { return ctx_[qs[a] / Hq_]; };
        for (int64_t a = 0; a < n; ++a) {
          const float* q = qkv_.data() + (qs[a] / Hq_) * QKV + (qs[a] % Hq_) * D;
          for (int64_t h = 0; h < D; h += 32)
            _mm512_storeu_si512(qbuf.data() + a * D / 2 + h / 2, bf16_pairs(q + h));
        }
        // Scores: QS queries at a time over the blocks of 16 keys any of them attends to.
        for (int64_t a = 0; a < n; a += QS) {
          const int64_t take = std::min<int64_t>(QS, n - a);
          int64_t c = 0;
          for (int64_t x = 0; x < take; ++x) c = std::max(c, ctx(a + x));
          const uint32_t* qp[QS];
          float* o[QS];
          for (int64_t x = 0; x < take; ++x) qp[x] = qbuf.data() + (a + x) * D / 2;
          for (int64_t j = 0; j < c; j += 16) {
            const bf16* blk = K + j * D;
            for (int64_t b = 0; b < 16 * D && j + 16 < c; b += 32)  // the next block, as this one is scored
              _mm_prefetch(reinterpret_cast<const char*>(blk + 16 * D + b), _MM_HINT_T0);
            for (int64_t x = 0; x < take; ++x) o[x] = pbuf.data() + (a + x) * P + j;
            with_rows<QS>(take, [&](auto QN) { bf16_block_scores<QN>(qp, blk, o); });
          }
        }
        for (int64_t a = 0; a < n; ++a) {
          const int64_t m = qs[a] / Hq_, c = ctx(a), own = ps[m];
          float* p = pbuf.data() + a * P;
          alignas(64) float lanes[16];
          const uint32_t* qp[1] = {qbuf.data() + a * D / 2};
          float* o[1] = {lanes};
          bf16_block_scores<1>(qp, K + own / 16 * 16 * D, o);  // the token's own key: its lane's chain
          p[c] = lanes[own % 16];
          const float inv = 1.0f / softmax_numerators(p, c + 1, scale);
          for (int64_t j = 0; j < c; ++j) p[j] *= inv;
          const float w_own = p[c] * inv;
          std::fill_n(p + c, 32, 0.0f);
          uint32_t* w = wbuf.data() + a * P / 2;
          for (int64_t j = 0; j < c + 1; j += 32) _mm512_storeu_si512(w + j / 2, bf16_pairs(p + j));
          alignas(64) float pair[32] = {};
          pair[own % 2] = w_own;
          alignas(64) uint32_t own_pair[16];
          _mm512_store_si512(own_pair, bf16_pairs(pair));
          obuf[a] = own_pair[0];
          std::fill_n(att_.data() + qs[a] * D, D, 0.0f);
        }
        // Weighted sums: QW queries at a time over the pairs all of them attend to whole, each
        // query's last pairs alone, then its own value.
        for (int64_t a = 0; a < n; a += QW) {
          const int64_t take = std::min<int64_t>(QW, n - a);
          int64_t common = ctx(a);
          for (int64_t x = 1; x < take; ++x) common = std::min(common, ctx(a + x));
          common /= 2;  // pairs every query of the pass weighs whole
          const uint32_t* pp[QW];
          float* o[QW];
          for (int64_t x = 0; x < take; ++x) {
            pp[x] = wbuf.data() + (a + x) * P / 2;
            o[x] = att_.data() + qs[a + x] * D;
          }
          with_rows<QW>(take, [&](auto QN) { bf16_weighted<QN>(pp, V, 0, common, o); });
          for (int64_t x = 0; x < take; ++x) {
            const int64_t c = ctx(a + x), own = ps[qs[a + x] / Hq_];
            bf16_weighted<1>(pp + x, V, common, (c + 1) / 2, o + x);
            const uint32_t* op[1] = {obuf.data() + a + x};
            bf16_weighted<1>(op, V + own / 2 * 2 * D, 0, 1, o + x);
          }
        }
        quantize_outputs(q, qs, n);
      }
    });
  }
#endif

  template <typename KT>
  void attention_t(size_t l, int64_t M, const int64_t* ps, Blocks8* q) {
    constexpr int64_t JB = 64;  // keys per block: 16 KB of float32 keys or values at D = 64
    const int64_t D = D_, QKV = (Hq_ + 2 * Hkv_) * D_, S = kc_[l].size(2);
    const KT* kc = static_cast<const KT*>(kc_[l].data_ptr());
    const KT* vc = static_cast<const KT*>(vc_[l].data_ptr());
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    team_for(0, static_cast<int64_t>(items_.size()), 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> pbuf;
      thread_local std::vector<float> wbuf(JB * kGroupedHeadDim);  // a block's widened keys or values
      for (int64_t i = i0; i < i1; ++i) {
        const AttnItem& it = items_[i];
        const int64_t n = it.end - it.begin, cmax = item_context(it);
        const int64_t* qs = queries_.data() + it.begin;
        const KT* K = kc + (it.slot * Hkv_ + it.g) * S * D;
        const KT* V = vc + (it.slot * Hkv_ + it.g) * S * D;
        const int64_t P = (cmax + 16) / 16 * 16;  // each query's scores: keys 0 .. cmax - 1, then its own
        pbuf.resize(n * P);
        const int64_t block_bytes = JB * D * static_cast<int64_t>(sizeof(KT));
        const int64_t all_bytes = cmax * D * static_cast<int64_t>(sizeof(KT));
        prefetch_rows(K, V, 0, std::min(block_bytes, all_bytes));
        auto query = [&](int64_t a) { return qkv_.data() + (qs[a] / Hq_) * QKV + (qs[a] % Hq_) * D; };
        auto end = [&](int64_t a, int64_t j0) { return std::min(j0 + JB, ctx_[qs[a] / Hq_]); };
        auto out = [&](int64_t a) { return att_.data() + qs[a] * D; };
#if defined(__AVX512F__)
        const bool wide = D == kGroupedHeadDim && n >= kWideItemQueries;
#else
        const bool wide = false;
#endif
        for (int64_t j0 = 0; j0 < cmax; j0 += JB) {
          const int64_t next = (j0 + JB) * D * static_cast<int64_t>(sizeof(KT));
          prefetch_rows(K, V, next, std::min(next + block_bytes, all_bytes));
#if defined(__AVX512F__)
          if (wide) {
            widen_key_pairs(K + j0 * D, (std::min(j0 + JB, cmax) - j0) / 8, wbuf.data());
            block_scores_wide(n, j0, K, wbuf.data(), P, query, end, pbuf.data());
            continue;
          }
#endif
          block_scores(n, j0, K, D, P, query, end, pbuf.data());
        }
        for (int64_t a = 0; a < n; ++a) {
          const int64_t m = qs[a] / Hq_, c = ctx_[m];
          float* p = pbuf.data() + a * P;
          p[c] = dot(query(a), K + ps[m] * D, D);  // key c is the token's own (K + c * D in a chain)
          const float inv = 1.0f / softmax_numerators(p, c + 1, scale);
          for (int64_t j = 0; j <= c; ++j) p[j] *= inv;
          std::fill_n(out(a), D, 0.0f);
        }
        for (int64_t j0 = 0; j0 < cmax; j0 += JB) {
#if defined(__AVX512F__)
          if (wide) {
            const float* vs = wbuf.data();
            if constexpr (std::is_same_v<KT, float>) vs = V + j0 * D;
            else widen_rows(V + j0 * D, std::min(j0 + JB, cmax) - j0, wbuf.data());
            weighted_groups<kWideQueries>(n, j0, V, vs, j0, P, pbuf.data(), end, out);
            continue;
          }
#endif
          block_weighted(n, j0, V, D, P, pbuf.data(), end, out);
        }
        for (int64_t a = 0; a < n; ++a) {  // the token's own value last: one more row of the chain
          const int64_t m = qs[a] / Hq_;
          weighted_rows(pbuf.data() + a * P + ctx_[m], V + ps[m] * D, 0, 1, D, out(a));
        }
        quantize_outputs(q, qs, n);
      }
    });
  }

  int64_t H_, Hq_, Hkv_, D_, I_;
  float eps_;
  const int64_t* ctx_ = nullptr;  // per token of the running call: keys before it, RoPE position
  bool keep_hidden_ = false;
  bool paired_ = false;
  bool amx_ = false;
  bool vnni_tiles_ = false;
  int64_t amx_rows_ = 1;  // calls of at least this many rows read the tiles (AMX or VNNI)
  bool kv_half_ = false;  // the caches hold float16, not float32
  bool kv_bf16_ = false;  // the caches hold bfloat16 in `attention_bf16`'s layouts (`bf16_key_at`)
  int64_t q4_rows_ = kBlockMostRows;  // calls of up to this many tokens read 4-bit blocks (`set_q4`)
  bool act8_ = false;                 // block matrices (`add_layer_q4`, `set_q8i`) take 8-bit activations
  bool team_ = true;                  // forwards run in one parallel region (`set_team`)
  bool fuse_ = true;                  // w4a8's row jobs folded into the jobs before them (`set_fuse`)
  bool stream_ = true;                // non-temporal stores for what crosses to the other thread (`set_stream`)
  bool rows_ = true;                  // int8, int4, w4a8 prompt pieces run their layers by rows (`set_rows`)
  bool own_rows_ = true;              // short calls' block products form their own rows (`set_own_rows`)
  int64_t rows_calls_ = 0;            // calls that did (`rows_calls`, for the tests)
  Blocks8 xq_, attq_, actq_;          // the products' 8-bit block inputs, quantised ahead (`ahead`)
  int64_t head_q8_rows_ = kBlockMostRows;  // whole-head logits of up to this many rows read 8-bit blocks
  Schedule schedule_;
  at::Tensor hidden_;
  std::vector<Layer> layers_;
  at::ScalarType wtype_ = at::ScalarType::Undefined;
  Mat embed_, head_;
  at::Tensor final_norm_, cos_, sin_;
  // The greedy head screen (`set_head_screen`), its buffers and counts.
  static constexpr int64_t kScreenMost = 4096;
  Mat screen_;
  at::Tensor screen_wnorm_, screen_resid_;
  std::vector<float> screen_logits_, screen_upper_, cand_rows_, cand_vals_;
  std::vector<int64_t> cand_;
  int64_t screened_rows_ = 0, screen_fallbacks_ = 0;
  std::vector<at::Tensor> kc_, vc_;
  Vec64<float> x_, xn_, qkv_, att_, gu_, act_;  // aligned for streaming stores
  std::vector<AttnItem> items_;
  std::vector<int64_t> queries_;  // m * Hq + h, grouped by item
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<FastLlamaKernel>(m, "FastLlamaKernel", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &FastLlamaKernel::add_layer)
      .def("add_layer_q4", &FastLlamaKernel::add_layer_q4)
      .def("set_q8i", &FastLlamaKernel::set_q8i, pybind11::arg("head"), pybind11::arg("embed") = std::nullopt)
      .def("set_head_blocks", &FastLlamaKernel::set_head_blocks, pybind11::arg("embed"), pybind11::arg("final_norm"),
           pybind11::arg("head"))
      .def("set_act8", &FastLlamaKernel::set_act8)
      .def("set_team", &FastLlamaKernel::set_team)
      .def("set_fuse", &FastLlamaKernel::set_fuse)
      .def("set_rows", &FastLlamaKernel::set_rows)
      .def("set_own_rows", &FastLlamaKernel::set_own_rows)
      .def("rows_calls", &FastLlamaKernel::rows_calls)
      .def("set_stream", &FastLlamaKernel::set_stream)
      .def("set_head", &FastLlamaKernel::set_head)
      .def("set_paired", &FastLlamaKernel::set_paired)
      .def("set_amx", &FastLlamaKernel::set_amx)
      .def("amx", &FastLlamaKernel::amx)
      .def("set_amx_rows", &FastLlamaKernel::set_amx_rows)
      .def("amx_rows", &FastLlamaKernel::amx_rows)
      .def("tile_bytes", &FastLlamaKernel::tile_bytes)
      .def("set_vnni_tiles", &FastLlamaKernel::set_vnni_tiles)
      .def("vnni_tiles", &FastLlamaKernel::vnni_tiles)
      .def("tile_bytes_needed", &FastLlamaKernel::tile_bytes_needed, pybind11::arg("head") = true)
      .def("pack_tiles", &FastLlamaKernel::pack_tiles, pybind11::arg("buffer") = std::nullopt,
           pybind11::arg("head") = true)
      .def("set_schedule", &FastLlamaKernel::set_schedule, pybind11::arg("two_pair_rows_float"),
           pybind11::arg("two_pair_rows_int8"), pybind11::arg("prefetch_one_row"),
           pybind11::arg("wide_int8_rows"))
      .def("get_schedule", &FastLlamaKernel::get_schedule)
      .def("set_wide_float_rows", &FastLlamaKernel::set_wide_float_rows)
      .def("set_q4", &FastLlamaKernel::set_q4, pybind11::arg("layer"), pybind11::arg("which"),
           pybind11::arg("blocks"))
      .def("set_block_rows", &FastLlamaKernel::set_block_rows, pybind11::arg("layers"), pybind11::arg("head"))
      .def("set_head_q8", &FastLlamaKernel::set_head_q8, pybind11::arg("blocks"))
      .def("set_rope", &FastLlamaKernel::set_rope)
      .def("set_cache", &FastLlamaKernel::set_cache)
      .def("move_positions", &FastLlamaKernel::move_positions)
      .def("forward", &FastLlamaKernel::forward, pybind11::arg("ids"), pybind11::arg("slots"),
           pybind11::arg("pos"), pybind11::arg("logit_rows"), pybind11::arg("ctx") = std::nullopt,
           pybind11::arg("argmax_only") = false, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_argmax", &FastLlamaKernel::forward_argmax, pybind11::arg("ids"), pybind11::arg("slots"),
           pybind11::arg("pos"), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_head_screen", &FastLlamaKernel::set_head_screen, pybind11::arg("codes"),
           pybind11::arg("scale"), pybind11::arg("wnorm"), pybind11::arg("resid"))
      .def("screen_counts", &FastLlamaKernel::screen_counts)
      .def("forward_hidden", &FastLlamaKernel::forward_hidden,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_keep_hidden", &FastLlamaKernel::set_keep_hidden)
      .def("last_hidden", &FastLlamaKernel::last_hidden)
      .def("linear", &FastLlamaKernel::linear_op, pybind11::arg("x"), pybind11::arg("w"),
           pybind11::arg("bias"), pybind11::arg("scale"), pybind11::arg("paired") = false,
           pybind11::arg("amx") = false, pybind11::arg("vnni_tiles") = false);
  m.def("amx_ready", &amx_ready);
  m.def("vnni_tiles_ready", &vnni_tiles_ready);
  m.def("bf16_attention_ready", &bf16_attention_ready);
  m.def("core_roundtrip_ns", &core_roundtrip_ns);
  m.def("linear_rows", &linear_rows_op, pybind11::arg("x"), pybind11::arg("w"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q4_pack", &q4_pack_op, pybind11::arg("q"), pybind11::arg("dm"));
  m.def("q4_linear", &q4_linear_op, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"),
        pybind11::arg("bias") = std::nullopt, pybind11::arg("q8") = false, pybind11::arg("a8") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_pack", &q8_pack_op, pybind11::arg("q"), pybind11::arg("d"));
  m.def("swiglu", &swiglu_op, pybind11::arg("gu"), pybind11::arg("scale") = std::nullopt,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rmsnorm_f32", &rmsnorm_rows_op<float>, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rmsnorm_bf16", &rmsnorm_rows_op<bf16>, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_rows", &rope_rows_op, pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("pos"), pybind11::arg("heads"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sampling_probs", &sampling_probs_op, pybind11::arg("logits"), pybind11::arg("temperature"),
        pybind11::arg("top_k"), pybind11::arg("top_p"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("draw_rows", &draw_rows_op, pybind11::arg("probs"), pybind11::arg("u"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rows_from_pairs", &rows_from_pairs_op, pybind11::arg("w"), pybind11::arg("to_bf16") = false,
        pybind11::arg("into") = std::nullopt, pybind11::arg("stream") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
