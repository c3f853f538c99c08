// Small-T matrix products for XLA:CPU, as XLA FFI custom calls.
//
//   kn:  y_i[T, N_i] = x[T, K] @ W_i[K, N_i], i = 1..M  (jaxspec's params layout, W row-major
//        [in, out]; several weights that share x, e.g. q/k/v or gate/up, in one call)
//   nk:  y[T, N] = x[T, K] @ E[N, K]^T      (a tied embedding table used as the output head)
//
// x and y are float32; W / E are float32 or bfloat16 (widened to float32 on load); the sums
// are float32. T is meant to be small (1..64 rows, cpu_matmul.MAX_ROWS: decode and verify windows).
//
// Method. The products are memory-bound at these T: the cost is reading the weights once.
// kn: each weight is cut into k pieces, contiguous blocks of W's rows (their number a function
// of the weight's shape only), shared by the threads, so a thread streams one contiguous region
// of memory. A piece walks W in blocks of 8 rows; each block is streamed whole (full rows, or
// panels of kPanelMax columns for wide W so that y's T rows of a panel stay in L2) and applied
// kL1Cols columns at a time: for each x row t the 8 values x[t, k0..k0+7] are broadcast into
// registers and the columns pass by 32 at a time (4 vector accumulators, W as memory operands).
// W leaves memory for t = 0 and is re-read from L1 for t > 0, so it is read from memory once
// whatever T. bfloat16 weights are widened on load (a 16-bit shift). nk: each thread owns a
// range of E rows, in groups of 16 (16 x K values stay in L1/L2 while every block of 3 x rows
// passes over them), with a register block of 3 x rows by 4 E rows (12 AVX2 accumulators), or
// 1 x row by 8 E rows for T = 1, and a software prefetch of the next E rows. The blocking
// follows Goto & van de Geijn 2008, "Anatomy of High-Performance Matrix Multiplication", cut
// down to the GEMV-like case.
//
// Row invariance. kn: every y[t, n] is ((P_1 + P_2) + ...) + P_c, P_j one sequential chain
// over piece j's k (P = fma(x, w, P), starting from 0; partial sums of a k block go to memory
// and come back unchanged), whatever T, t, the other weights in the call or the thread that
// computes a piece; nk keeps 8 lane sums over k = l mod 8, adds them in a fixed tree and then
// the K mod 8 tail in order, whatever the register block. So row t of a T-row product is bitwise the 1-row product of x[t]. The
// file is compiled with -ffp-contract=off so that the portable path's a + b * c is not fused
// in some instantiations and not others.
//
// Threads: XLA's intra-op thread pool (parallel_chunks, cpu_parallel.h).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JAXSPEC_X86 1
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec_cpu::bf16_to_f32;
using jaxspec_cpu::cpu_has_avx2;
using jaxspec_cpu::parallel_chunks;
#ifdef JAXSPEC_X86
using jaxspec_cpu::load_w8;
#endif

constexpr int64_t kPanelMax = 2048;   // columns per panel (kn): y's T rows and 8 W rows stay in L2
constexpr int64_t kL1Cols = 256;      // columns of an 8-row W block applied to all x rows at once
constexpr int64_t kStep = 32;         // kn columns per register step (4 AVX2 vectors; 8 spill: measured no faster)
constexpr int64_t kNkRows = 3;        // x rows per register block (nk)
constexpr int64_t kNkCols = 4;        // E rows (outputs) per register block (nk)
constexpr int64_t kSerialBelow = 1 << 15;  // K * sum(N) under which one thread does it all
constexpr int64_t kPieceElems = 1 << 16;  // kn: weights per k piece, at least
constexpr int64_t kMaxPieces = 8;         // kn: k pieces per weight, at most

struct Problem {
  const float* x;  // [t, k], rows ldx apart
  const void* w;   // kn: [k, n]; nk: [n, k]
  float* y;        // [t, n]
  int64_t t, k, n;
  bool bf16;
  int64_t ldx;
};

// kn: rows [k0, k1) of W (and columns [k0, k1) of x), summed into `out` [t, n]: one k piece.
Problem kn_piece(const Problem& p, int64_t k0, int64_t k1, float* out) {
  Problem q = p;
  q.x = p.x + k0;
  q.w = static_cast<const char*>(p.w) + k0 * p.n * (p.bf16 ? 2 : 4);
  q.k = k1 - k0;
  q.y = out;
  return q;
}

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
      const float* x = p.x + t * p.ldx + k0;
      for (int64_t l = 0; l < lanes; ++l) {
        float acc = k0 == 0 ? 0.0f : y[l];
        for (int64_t j = 0; j < kb; ++j) acc = acc + x[j] * w[j][l];
        y[l] = acc;
      }
    }
  }
}

#ifdef JAXSPEC_X86
// The columns [c0, c1) one 8-column vector at a time (the < kStep columns left at the end of a
// chunk). KB: the rows in this k block (8, or the K mod 8 tail).
template <int KB, bool BF16>
__attribute__((target("avx2,fma"))) void kn_block_avx2_vectors(const Problem& p, int64_t k0, int64_t c0, int64_t c1) {
  const bool first = k0 == 0;
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) {
    __m256 w[KB];
    for (int j = 0; j < KB; ++j) w[j] = load_w8<BF16>(p.w, (k0 + j) * p.n + c);
    for (int64_t t = 0; t < p.t; ++t) {
      float* y = p.y + t * p.n + c;
      const float* x = p.x + t * p.ldx + k0;
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
      const float* x = p.x + t * p.ldx + k0;
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

// The columns [c0, c1) in steps of kStep: per x row t, x[t, k0 .. k0+KB) broadcast once into
// registers, then 4 vector accumulators (4 independent FMA chains) per step, W as memory
// operands. Each output's chain over k is the same as kn_block_avx2_vectors's.
// `cols` (a multiple of kStep) columns of y[t] += x[t, 0 .. KB) @ w[0 .. KB, cols] for every
// x row t: x[t]'s KB values broadcast into registers once, then the columns 32 at a time
// (4 vector accumulators, W as memory operands). w's rows are ldw apart, y's rows ldy apart.
template <int KB, bool BF16>
__attribute__((target("avx2,fma"))) void kn_steps(const float* x, int64_t ldx, int64_t rows, const void* w,
                                                   int64_t ldw, float* y, int64_t ldy, int64_t cols, bool first) {
  for (int64_t t = 0; t < rows; ++t, x += ldx, y += ldy) {
    __m256 xb[KB];
    for (int j = 0; j < KB; ++j) xb[j] = _mm256_broadcast_ss(x + j);
    for (int64_t c = 0; c < cols; c += kStep) {
      __m256 a[4];
      for (int v = 0; v < 4; ++v) a[v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + c + 8 * v);
      for (int j = 0; j < KB; ++j)
        for (int v = 0; v < 4; ++v) a[v] = _mm256_fmadd_ps(xb[j], load_w8<BF16>(w, j * ldw + c + 8 * v), a[v]);
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + c + 8 * v, a[v]);
    }
  }
}

// The block of rows [k0, k0 + KB) of W applied to columns [c0, c1) of every y row. bfloat16
// weights with several x rows are widened once into an L1 buffer (exact), not once per row.
// Each output's chain over k is the same either way.
template <int KB, bool BF16>
__attribute__((target("avx2,fma"))) void kn_block_avx2_steps(const Problem& p, int64_t k0, int64_t c0, int64_t c1) {
  const int64_t cs = c0 + std::min<int64_t>((c1 - c0) / kStep * kStep, kL1Cols);
  const float* x = p.x + k0;
  float* y = p.y + c0;
  if (BF16 && p.t > 1) {
    alignas(32) float wide[KB][kL1Cols];
    for (int j = 0; j < KB; ++j)
      for (int64_t c = c0; c < cs; c += 8) _mm256_store_ps(&wide[j][c - c0], load_w8<true>(p.w, (k0 + j) * p.n + c));
    kn_steps<KB, false>(x, p.ldx, p.t, wide, kL1Cols, y, p.n, cs - c0, k0 == 0);
  } else {
    const void* w = static_cast<const char*>(p.w) + (k0 * p.n + c0) * (BF16 ? 2 : 4);
    kn_steps<KB, BF16>(x, p.ldx, p.t, w, p.n, y, p.n, cs - c0, k0 == 0);
  }
  if (cs < c1) kn_block_avx2_vectors<KB, BF16>(p, k0, cs, c1);
}

template <int KB>
void kn_block_avx2(const Problem& p, int64_t k0, int64_t c0, int64_t c1) {
  if (p.bf16)
    kn_block_avx2_steps<KB, true>(p, k0, c0, c1);
  else
    kn_block_avx2_steps<KB, false>(p, k0, c0, c1);
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
  // Panels of kPanelMax columns (y's T rows of one stay in L2); in a panel, each block of 8 W
  // rows is streamed whole and applied kL1Cols columns at a time (8 x kL1Cols W values stay in
  // L1 while every x row passes over them).
  for (int64_t n0 = c0; n0 < c1; n0 += kPanelMax) {
    const int64_t n1 = std::min(c1, n0 + kPanelMax);
    for (int64_t k0 = 0; k0 < p.k; k0 += 8) {
      const KnBlock block = k0 + 8 <= p.k ? full : tail;
      for (int64_t m0 = n0; m0 < n1; m0 += kL1Cols) block(p, k0, m0, std::min(n1, m0 + kL1Cols));
    }
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
    if ((k & 15) == 0)  // the next NB rows of E, a 64-byte line ahead of use (measured: T = 5 -20%)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(static_cast<const char*>(p.w) + ((n0 + NB + j) * p.k + k) * (BF16 ? 2 : 4), _MM_HINT_T0);
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
      int64_t n = g;
#ifdef JAXSPEC_X86
      if (tb == 1 && avx2)  // one x row: 8 E rows per register block (8 independent chains)
        for (; n + 8 <= g1; n += 8) (p.bf16 ? nk_micro_avx2_t<1, 8, true> : nk_micro_avx2_t<1, 8, false>)(p, t0, n);
#endif
      for (; n < g1; n += kNkCols) table[tb - 1][std::min(kNkCols, g1 - n) - 1](p, t0, n);
    }
  }
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
  *p = Problem{x.typed_data(), w.untyped_data(), y->typed_data(), t, k, n, w.element_type() == ffi::BF16, k};
  return ffi::Error::Success();
}

// How many k pieces W [k, n] is cut into: a function of the shape only (never of T or of the
// thread count), so each output's order of sums is the same in every call. A piece is a
// contiguous block of W's rows, so a thread streams one contiguous region of memory (measured:
// column ranges, i.e. short row segments, read 15-25% slower at SmolLM2's shapes); pieces are
// whole 8-row blocks of at least kPieceElems weights, at most kMaxPieces.
int64_t kn_pieces(int64_t k, int64_t n) {
  return std::clamp<int64_t>(std::min(k * n / kPieceElems, k / 8), 1, kMaxPieces);
}

// The weights W_1 .. W_M (args after x) and results y_1 .. y_M, in order: one call for the
// products that share x (q/k/v, gate/up), so the threads split one larger piece of work.
// y_i = ((P_i1 + P_i2) + ...) + P_ic, P_ij the sequential FMA chain over W_i's j-th k piece.
ffi::Error MatmulKN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  if (ws.size() != ys.size() || ws.size() == 0)
    return ffi::Error::InvalidArgument("jaxspec cpu matmul: one result per weight, at least one weight");
  std::vector<Problem> problems(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    if (ffi::Error e = check_shapes(x, *w, *y, false, &problems[i]); e.failure()) return e;
  }
  const int64_t t = problems[0].t, k = problems[0].k;
  if (k == 0)
    for (const Problem& p : problems) std::fill(p.y, p.y + p.t * p.n, 0.0f);
  if (t == 0 || k == 0) return ffi::Error::Success();
  // Pieces: the first of each weight sums into y, the others into scratch, added in order after.
  int64_t scratch_floats = 0, weights = 0;
  for (const Problem& p : problems) {
    scratch_floats += (kn_pieces(k, p.n) - 1) * t * p.n;
    weights += k * p.n;
  }
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < scratch_floats) scratch.resize(scratch_floats);
  std::vector<Problem> pieces;
  std::vector<float*> owner_y;  // the y each piece belongs to
  float* next = scratch.data();
  for (const Problem& p : problems) {
    const int64_t c = kn_pieces(k, p.n), rows = k / c / 8 * 8;
    for (int64_t j = 0; j < c; ++j) {
      pieces.push_back(kn_piece(p, j * rows, j + 1 == c ? k : (j + 1) * rows, j == 0 ? p.y : next));
      owner_y.push_back(p.y);
      if (j > 0) next += t * p.n;
    }
  }
  const bool avx2 = cpu_has_avx2();
  auto run = [&](int64_t i) { kn_columns(pieces[i], 0, pieces[i].n, avx2); };
  if (weights < kSerialBelow) {
    for (int64_t i = 0; i < static_cast<int64_t>(pieces.size()); ++i) run(i);
  } else {
    parallel_chunks(pool, static_cast<int64_t>(pieces.size()), run);
  }
  for (size_t i = 0; i < pieces.size(); ++i)  // y += P_ij for j = 2 .. c, in order (pieces are in j order)
    if (float* y = owner_y[i]; y != pieces[i].y)
      for (int64_t e = 0; e < t * pieces[i].n; ++e) y[e] = y[e] + pieces[i].y[e];
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
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecMatmulNK, MatmulNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The code path the kernels take now (jaxspec_cpu::cpu_isa): 2 AVX-512, 1 AVX2/FMA, 0 portable.
extern "C" int jaxspec_matmul_isa() { return jaxspec_cpu::cpu_isa(); }

// Caps the code path at `isa` (2, 1 or 0) from the next kernel call on; returns the previous cap.
extern "C" int jaxspec_set_isa(int isa) { return jaxspec_cpu::isa_cap().exchange(isa); }
