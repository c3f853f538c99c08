// Small-T matrix products for XLA:CPU, as XLA FFI custom calls.
//
//   kn:  y[T, N] = x[T, K] @ W[K, N]        (jaxspec's params layout, W row-major [in, out])
//   nk:  y[T, N] = x[T, K] @ E[N, K]^T      (a tied embedding table used as the output head)
//
// x and y are float32; W / E are float32 or bfloat16 (widened to float32 on load); the sums
// are float32. T is meant to be small (1..16 rows: decode and speculative verify windows).
//
// Method. The products are memory-bound at these T: the cost is reading the weights once.
// kn: each thread owns a range of output columns (two ranges per pool thread); it walks W in
// blocks of 8 rows k0 .. k0+7, and for each 8-column vector loads the 8 W vectors once (8
// long contiguous row streams that the hardware prefetcher follows: the row-segment walk of
// XLA:CPU's tiled GEMV) and applies them to every x row, so W leaves memory once whatever T;
// y's T rows of the range stay in cache between row blocks. bfloat16 weights are widened on
// load (a 16-bit shift). nk: each thread owns a range of E rows, in groups of 16 (16 x K
// values stay in L1/L2 while every block of 3 x rows passes over them), with a register block
// of 3 x rows by 4 E rows (12 AVX2 accumulators). The blocking follows Goto & van de Geijn
// 2008, "Anatomy of High-Performance Matrix Multiplication", cut down to the GEMV-like case.
//
// Row invariance. Every y[t, n] is one sequential chain over k = 0 .. K-1 (kn: y = fma(x, w,
// y), starting from 0; partial sums of a k block go to y and come back unchanged), whatever T,
// t, the column range or the thread that computes it; nk keeps 8 lane sums over k = l mod 8, adds
// them in a fixed tree and then the K mod 8 tail in order. So row t of a T-row product is
// bitwise the 1-row product of x[t]. The file is compiled with -ffp-contract=off so that the
// portable path's a + b * c is not fused in some instantiations and not others.
//
// Threads: XLA's intra-op thread pool, handed to the handler by the FFI (ffi::ThreadPool);
// the calling thread works too, and claims chunks until none are left, so the call finishes
// even when no pool thread ever runs a task.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JAXSPEC_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanelMax = 8192;   // columns per panel (kn): y's T rows of it stay in L2
constexpr int64_t kNkRows = 3;        // x rows per register block (nk)
constexpr int64_t kNkCols = 4;        // E rows (outputs) per register block (nk)
constexpr int64_t kSerialBelow = 1 << 15;  // K * N under which one thread does it all

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Problem {
  const float* x;
  const void* w;
  float* y;
  int64_t t, k, n;
  bool bf16;
};

// ---------------------------------------------------------------------------------------------
// kn: for each block of 8 rows of W (k0 .. k0+7) and each 8-column vector c of the thread's
// columns, the 8 W vectors are loaded once (8 contiguous row streams, which the hardware
// prefetcher follows) and every x row t does y[t, c] = fma(x[t, k0+7], W[k0+7, c], ... fma(
// x[t, k0], W[k0, c], y[t, c])). y's T rows of the column range stay in L1 between k blocks.

template <int KB>
void kn_block_portable(const Problem& p, int64_t k0, int64_t c0, int64_t c1) {
  const int64_t kb = KB > 0 ? KB : std::min<int64_t>(8, p.k - k0);
  for (int64_t c = c0; c < c1; c += 8) {
    const int64_t lanes = std::min<int64_t>(8, c1 - c);
    float w[8][8];
    for (int64_t j = 0; j < kb; ++j)
      for (int64_t l = 0; l < lanes; ++l) {
        const int64_t i = (k0 + j) * p.n + c + l;
        w[j][l] = p.bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p.w)[i]) : static_cast<const float*>(p.w)[i];
      }
    for (int64_t t = 0; t < p.t; ++t) {
      float* y = p.y + t * p.n + c;
      const float* x = p.x + t * p.k + k0;
      for (int64_t l = 0; l < lanes; ++l) {
        float acc = k0 == 0 ? 0.0f : y[l];
        for (int64_t j = 0; j < kb; ++j) acc = acc + x[j] * w[j][l];
        y[l] = acc;
      }
    }
  }
}

#ifdef JAXSPEC_X86
template <bool BF16>
__attribute__((target("avx2,fma"))) inline __m256 load_w8(const void* w, int64_t i) {
  if (BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(w) + i);
}

// KB: the rows in this k block (8, or the K mod 8 tail).
template <int KB, bool BF16>
__attribute__((target("avx2,fma"))) void kn_block_avx2_t(const Problem& p, int64_t k0, int64_t c0, int64_t c1) {
  const bool first = k0 == 0;
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    __m256 w[KB];
    for (int j = 0; j < KB; ++j) w[j] = load_w8<BF16>(p.w, (k0 + j) * p.n + c);
    for (int64_t t = 0; t < p.t; ++t) {
      float* y = p.y + t * p.n + c;
      const float* x = p.x + t * p.k + k0;
      __m256 acc = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y);
      for (int j = 0; j < KB; ++j) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(x + j), w[j], acc);
      _mm256_storeu_ps(y, acc);
    }
  }
  if (c < c1) {  // the last < 8 columns: the same chain per element, through a small buffer
    const int64_t lanes = c1 - c;
    __m256 w[KB];
    for (int j = 0; j < KB; ++j) {
      alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t l = 0; l < lanes; ++l) {
        const int64_t i = (k0 + j) * p.n + c + l;
        tmp[l] = BF16 ? bf16_to_f32(static_cast<const uint16_t*>(p.w)[i]) : static_cast<const float*>(p.w)[i];
      }
      w[j] = _mm256_load_ps(tmp);
    }
    for (int64_t t = 0; t < p.t; ++t) {
      float* y = p.y + t * p.n + c;
      const float* x = p.x + t * p.k + k0;
      alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (!first)
        for (int64_t l = 0; l < lanes; ++l) tmp[l] = y[l];
      __m256 acc = _mm256_load_ps(tmp);
      for (int j = 0; j < KB; ++j) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(x + j), w[j], acc);
      _mm256_store_ps(tmp, acc);
      for (int64_t l = 0; l < lanes; ++l) y[l] = tmp[l];
    }
  }
}

template <int KB>
void kn_block_avx2(const Problem& p, int64_t k0, int64_t c0, int64_t c1) {
  if (p.bf16)
    kn_block_avx2_t<KB, true>(p, k0, c0, c1);
  else
    kn_block_avx2_t<KB, false>(p, k0, c0, c1);
}
#endif

using KnBlock = void (*)(const Problem&, int64_t, int64_t, int64_t);

// Columns [c0, c1) of y = x @ W, in panels of at most kPanelMax columns.
void kn_columns(const Problem& p, int64_t c0, int64_t c1, bool avx2) {
  KnBlock full = kn_block_portable<8>, tail = kn_block_portable<0>;
#ifdef JAXSPEC_X86
  static constexpr KnBlock kTails[8] = {nullptr,          kn_block_avx2<1>, kn_block_avx2<2>, kn_block_avx2<3>,
                                        kn_block_avx2<4>, kn_block_avx2<5>, kn_block_avx2<6>, kn_block_avx2<7>};
  if (avx2) {
    full = kn_block_avx2<8>;
    tail = kTails[p.k % 8];
  }
#endif
  for (int64_t n0 = c0; n0 < c1; n0 += kPanelMax) {
    const int64_t n1 = std::min(c1, n0 + kPanelMax);
    int64_t k0 = 0;
    for (; k0 + 8 <= p.k; k0 += 8) full(p, k0, n0, n1);
    if (k0 < p.k) tail(p, k0, n0, n1);
  }
}

// ---------------------------------------------------------------------------------------------
// nk micro-kernels: y[t, n] = sum_k x[t, k] E[n, k], rows x[t0 .. t0+TB) by outputs
// [n0, n0 + NB); 8 lane sums (lane l: k = l mod 8), a fixed reduction tree, then the tail.

inline float reduce8(const float* s) {
  // ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)): the order of the AVX2 path's tree.
  const float a0 = s[0] + s[4], a1 = s[1] + s[5], a2 = s[2] + s[6], a3 = s[3] + s[7];
  return (a0 + a2) + (a1 + a3);
}

template <int TB, int NB>
void nk_micro_portable(const Problem& p, int64_t t0, int64_t n0) {
  const int64_t k8 = p.k / 8 * 8;
  float acc[TB][NB][8] = {};
  for (int64_t k = 0; k < k8; k += 8)
    for (int j = 0; j < NB; ++j) {
      float w[8];
      for (int l = 0; l < 8; ++l) {
        const int64_t i = (n0 + j) * p.k + k + l;
        w[l] = p.bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p.w)[i]) : static_cast<const float*>(p.w)[i];
      }
      for (int t = 0; t < TB; ++t)
        for (int l = 0; l < 8; ++l) acc[t][j][l] = acc[t][j][l] + p.x[(t0 + t) * p.k + k + l] * w[l];
    }
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < NB; ++j) {
      float r = reduce8(acc[t][j]);
      for (int64_t k = k8; k < p.k; ++k) {
        const int64_t i = (n0 + j) * p.k + k;
        const float w = p.bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p.w)[i]) : static_cast<const float*>(p.w)[i];
        r = r + p.x[(t0 + t) * p.k + k] * w;
      }
      p.y[(t0 + t) * p.n + n0 + j] = r;
    }
}

#ifdef JAXSPEC_X86
template <int TB, int NB, bool BF16>
__attribute__((target("avx2,fma"))) void nk_micro_avx2_t(const Problem& p, int64_t t0, int64_t n0) {
  const int64_t k8 = p.k / 8 * 8;
  __m256 acc[TB][NB];
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < NB; ++j) acc[t][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_w8<BF16>(p.w, (n0 + j) * p.k + k);
    for (int t = 0; t < TB; ++t) {
      const __m256 xv = _mm256_loadu_ps(p.x + (t0 + t) * p.k + k);
      for (int j = 0; j < NB; ++j) acc[t][j] = _mm256_fmadd_ps(xv, wv[j], acc[t][j]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < NB; ++j) {
      // lanes (l, l + 4) first, then (l, l + 2), then (0, 1): reduce8's tree.
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[t][j]), _mm256_extractf128_ps(acc[t][j], 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
      float r = _mm_cvtss_f32(s);
      for (int64_t k = k8; k < p.k; ++k) {
        const int64_t i = (n0 + j) * p.k + k;
        const float w = BF16 ? bf16_to_f32(static_cast<const uint16_t*>(p.w)[i]) : static_cast<const float*>(p.w)[i];
        r = r + p.x[(t0 + t) * p.k + k] * w;
      }
      p.y[(t0 + t) * p.n + n0 + j] = r;
    }
}

template <int TB, int NB>
void nk_micro_avx2(const Problem& p, int64_t t0, int64_t n0) {
  if (p.bf16)
    nk_micro_avx2_t<TB, NB, true>(p, t0, n0);
  else
    nk_micro_avx2_t<TB, NB, false>(p, t0, n0);
}
#endif

using NkMicro = void (*)(const Problem&, int64_t, int64_t);

template <template <int, int> class Sel>
struct NkTable {
  NkMicro f[kNkRows][kNkCols] = {
      {Sel<1, 1>::f, Sel<1, 2>::f, Sel<1, 3>::f, Sel<1, 4>::f},
      {Sel<2, 1>::f, Sel<2, 2>::f, Sel<2, 3>::f, Sel<2, 4>::f},
      {Sel<3, 1>::f, Sel<3, 2>::f, Sel<3, 3>::f, Sel<3, 4>::f},
  };
};
template <int TB, int NB>
struct PortableNk {
  static constexpr NkMicro f = nk_micro_portable<TB, NB>;
};
#ifdef JAXSPEC_X86
template <int TB, int NB>
struct Avx2Nk {
  static constexpr NkMicro f = nk_micro_avx2<TB, NB>;
};
#endif

// Outputs [r0, r1) of y = x @ E^T, in groups of 16 E rows (16 x K floats stay in L1/L2 while
// every row block of x passes over them).
void nk_outputs(const Problem& p, int64_t r0, int64_t r1, bool avx2) {
  static const NkTable<PortableNk> portable;
#ifdef JAXSPEC_X86
  static const NkTable<Avx2Nk> vectorized;
  const NkMicro(*table)[kNkCols] = avx2 ? vectorized.f : portable.f;
#else
  const NkMicro(*table)[kNkCols] = portable.f;
#endif
  constexpr int64_t kGroup = 16;
  for (int64_t g = r0; g < r1; g += kGroup) {
    const int64_t g1 = std::min(g + kGroup, r1);
    for (int64_t t0 = 0; t0 < p.t; t0 += kNkRows) {
      const int64_t tb = std::min(kNkRows, p.t - t0);
      for (int64_t n = g; n < g1; n += kNkCols) table[tb - 1][std::min(kNkCols, g1 - n) - 1](p, t0, n);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Work sharing over XLA's intra-op pool: `chunks` independent pieces, claimed from a counter by
// the caller and by up to num_threads pool tasks; returns when all are done.

struct Shared {
  std::atomic<int64_t> next{0};
  int64_t done = 0;
  std::mutex mu;
  std::condition_variable cv;
};

template <class Fn>
void parallel_chunks(ffi::ThreadPool& pool, int64_t chunks, const Fn& fn) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
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
    if (mine) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->done += mine;
      if (shared->done == chunks) shared->cv.notify_all();
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done == chunks; });
}

bool cpu_has_avx2() {
#ifdef JAXSPEC_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

ffi::Error check_shapes(const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& w, ffi::Result<ffi::Buffer<ffi::F32>>& y,
                        bool transposed, Problem* p) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("jaxspec cpu matmul: x, w and y must be rank 2");
  const int64_t t = xd[0], k = xd[1];
  const int64_t wk = transposed ? wd[1] : wd[0], n = transposed ? wd[0] : wd[1];
  if (wk != k || yd[0] != t || yd[1] != n)
    return ffi::Error::InvalidArgument("jaxspec cpu matmul: shapes do not chain");
  if (w.element_type() != ffi::F32 && w.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("jaxspec cpu matmul: weights must be float32 or bfloat16");
  *p = Problem{x.typed_data(), w.untyped_data(), y->typed_data(), t, k, n, w.element_type() == ffi::BF16};
  return ffi::Error::Success();
}

ffi::Error MatmulKN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                    ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p;
  if (ffi::Error e = check_shapes(x, w, y, false, &p); e.failure()) return e;
  if (p.t == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::fill(p.y, p.y + p.t * p.n, 0.0f);
    return ffi::Error::Success();
  }
  const bool avx2 = cpu_has_avx2();
  if (p.k * p.n < kSerialBelow) {
    kn_columns(p, 0, p.n, avx2);
    return ffi::Error::Success();
  }
  // Two chunks per thread, each a multiple of 8 columns: long contiguous row segments of W
  // (measured: 2 chunks per thread beat 1, 4 and 8 at K 1536, N 8960).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t panel = (p.n + 2 * threads - 1) / (2 * threads);
  panel = std::clamp<int64_t>((panel + 7) / 8 * 8, 32, kPanelMax);
  const int64_t chunks = (p.n + panel - 1) / panel;
  parallel_chunks(pool, chunks, [&](int64_t i) {
    kn_columns(p, i * panel, std::min(p.n, (i + 1) * panel), avx2);
  });
  return ffi::Error::Success();
}

ffi::Error MatmulNK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                    ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p;
  if (ffi::Error e = check_shapes(x, w, y, true, &p); e.failure()) return e;
  if (p.t == 0 || p.n == 0) return ffi::Error::Success();
  const bool avx2 = cpu_has_avx2();
  if (p.k * p.n < kSerialBelow) {
    nk_outputs(p, 0, p.n, avx2);
    return ffi::Error::Success();
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t rows = std::clamp<int64_t>((p.n + 8 * threads - 1) / (8 * threads), 16, 1024) / 16 * 16;
  const int64_t chunks = (p.n + rows - 1) / rows;
  parallel_chunks(pool, chunks, [&](int64_t i) { nk_outputs(p, i * rows, std::min(p.n, (i + 1) * rows), avx2); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecMatmulKN, MatmulKN,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecMatmulNK, MatmulNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 1 when the AVX2/FMA path runs on this CPU, 0 for the portable path (for the CLI's report).
extern "C" int jaxspec_matmul_isa() { return cpu_has_avx2() ? 1 : 0; }
