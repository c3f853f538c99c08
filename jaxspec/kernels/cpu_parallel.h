// What jaxspec's CPU kernels (cpu_matmul.cc, cpu_panels.cc, cpu_attention.cc) share: work
// sharing over XLA's intra-op thread pool, the run-time choice of the AVX2/FMA code paths, and
// the widening of bfloat16 weights.
//
// parallel_chunks: `chunks` independent pieces of work, claimed from a counter by the calling
// thread and by up to num_threads - 1 pool tasks; returns when all are done. The caller works
// too and claims chunks until none are left, so the call finishes even when no pool thread ever
// runs a task; it then waits for chunks other threads claimed, spinning (yielding the core) for
// at most kSpinMicros before it sleeps: a kernel call takes tens of microseconds, and waking a
// sleeping thread costs about as much (measured: 11 us per call with a sleeping wait, 3 us
// spinning, on a 64 x 64 product).
#ifndef JAXSPEC_KERNELS_CPU_PARALLEL_H_
#define JAXSPEC_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JAXSPEC_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxspec_cpu {

namespace ffi = xla::ffi;

constexpr int64_t kSpinMicros = 100;

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

template <class Fn>
void parallel_chunks(ffi::ThreadPool& pool, int64_t chunks, const Fn& fn) {
  // pool.num_threads() - 1 helpers keep one worker per pool thread (measured: num_threads
  // helpers, i.e. one more runnable thread than cores, made a SmolLM2-sized pass 40% slower).
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, chunks - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < chunks; ++i) fn(i);
    return;
  }
  auto shared = std::make_shared<Shared>();
  // A task only touches fn after claiming a chunk, and the caller waits for every claimed
  // chunk, so fn (on the caller's stack) outlives every use; late tasks find nothing to claim.
  auto work = [shared, chunks, &fn]() {
    int64_t mine = 0;
    for (int64_t i; (i = shared->next.fetch_add(1)) < chunks; ++mine) fn(i);
    if (mine && shared->done.fetch_add(mine) + mine == chunks) {
      std::lock_guard<std::mutex> lock(shared->mu);  // the caller checks `done` under mu before it sleeps
      shared->cv.notify_all();
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  for (int spins = 0; shared->done.load() != chunks; ++spins) {
    if ((spins & 7) == 7 && std::chrono::steady_clock::now() > until) {
      std::unique_lock<std::mutex> lock(shared->mu);
      shared->cv.wait(lock, [&] { return shared->done.load() == chunks; });
      return;
    }
    std::this_thread::yield();  // a pool thread sharing this core gets to finish its chunk
  }
}

// The widest code path the kernels take: 2 AVX-512 (F), 1 AVX2/FMA, 0 portable. The CPU's, at
// most the cap that jaxspec_set_isa sets (cpu_matmul.limit_isa: side-by-side runs of two paths
// in one process, and the tests that compare them bit for bit). The AVX-512 products are
// bitwise the AVX2 ones (each output the same float32 FMA chain, only more columns per
// instruction); the portable path is unfused.
inline std::atomic<int>& isa_cap() {
  static std::atomic<int> cap{2};
  return cap;
}

inline int cpu_isa() {
#ifdef JAXSPEC_X86
  static const int has = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 0
                         : __builtin_cpu_supports("avx512f")                                 ? 2
                                                                                              : 1;
  return std::min(has, isa_cap().load(std::memory_order_relaxed));
#else
  return 0;
#endif
}

inline bool cpu_has_avx2() { return cpu_isa() >= 1; }

// bfloat16 -> float32: exact (the 16 bits are float32's top half).
inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bfloat16, rounded to nearest even; a NaN becomes a quiet NaN of its sign: what
// XLA's convert does, so a kernel that rounds its own output gives the bits it gave before.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// n values from `src` to `dst`, float32 (copied) or bfloat16 (rounded, f32_to_bf16).
inline void store_row(const float* src, void* dst, bool bf16, int64_t n) {
  if (!bf16) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
}

#ifdef JAXSPEC_X86
// Eight weights from w + i (float32, or bfloat16 widened on load: a 16-bit shift) as floats.
template <bool BF16>
__attribute__((target("avx2,fma"))) inline __m256 load_w8(const void* w, int64_t i) {
  if (BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(w) + i);
}

// Sixteen weights from w + i as floats (AVX-512), as load_w8.
template <bool BF16>
__attribute__((target("avx512f"))) inline __m512 load_w16(const void* w, int64_t i) {
  if (BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps(static_cast<const float*>(w) + i);
}
#endif

#ifdef JAXSPEC_X86
__attribute__((target("avx2,fma"))) inline void widen_avx2(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_w8<true>(src, i));
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
#endif

// n bfloat16 values widened to float32 (exact), 8 at a time where AVX2 is there.
inline void widen(const uint16_t* src, int64_t n, float* dst) {
#ifdef JAXSPEC_X86
  if (cpu_has_avx2()) {
    widen_avx2(src, n, dst);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

}  // namespace jaxspec_cpu

#endif  // JAXSPEC_KERNELS_CPU_PARALLEL_H_
