// Small-T matrix products over weights laid out in panels, for XLA:CPU, as an XLA FFI call.
//
//   y_i[T, N_i] = x[T, K] @ W_i[K, N_i], i = 1..M, with each W_i given as its panels
//   P_i[ceil(N_i / 16), K, 16]: P[p, k, c] = W[k, 16 p + c] (zero past N). Several weights that
//   share x (q/k/v, gate/up) go in one call.
//
// x and y are float32 or bfloat16 (x widened once, y rounded once as it is stored); the panels
// float32 or bfloat16 (widened to float32 in registers); the sums float32. T is meant to be small (1..64 rows, cpu_matmul.MAX_ROWS).
//
// Why panels. A panel holds 16 output columns for every k, contiguous along k (one 64-byte line
// of float32, half a line of bfloat16, per k), so a register tile of 16 columns x up to 6 rows
// of x keeps its 12 accumulators in registers for the whole k loop: one weight load feeds up to
// 6 FMAs and each thread streams whole panels, one contiguous region each, which the hardware
// prefetcher follows. (The [K, N] kernel in cpu_matmul.cc applies each 8-row block of W to one
// x row at a time with y in memory: about one load per FMA.) This is the packed-B layout of
// Goto & van de Geijn 2008 ("Anatomy of High-Performance Matrix Multiplication", section 4) and
// of ggml's repacked weights (ggml-cpu/repack.cpp), cut down to T = 1..64 rows; llamafile's
// tinyBLAS (sgemm.cpp) holds the same kind of register tile.
//
// Blocking: a panel is walked in blocks of kKc k's (16 KB of float32 panel, which stays in L1
// while every group of x rows passes over it); the T rows go in groups of at most kRows (the
// group sizes balanced: T = 8 runs as 4 + 4). A group's partial sums go to a small buffer
// between k blocks and come back unchanged. The second group prefetches the next block, a
// first group of 4-6 rows the lines ahead of it (see panels()). A pass
// of 1-3 rows takes two panels at once (tile2_avx2). On a CPU with AVX-512 a panel's 16 columns
// are one register, so a tile holds up to 12 rows and one weight load feeds 12 FMAs
// (tile_avx512): windows of 7-12 rows run as one group, streaming the weights once, where AVX2
// runs two.
//
// Row invariance: every y[t, n] is one sequential float32 chain over k = 0 .. K-1
// (acc = fma(x[t, k], W[k, n], acc) from 0 on the AVX2 and AVX-512 paths, which so give the same
// bits; acc = acc + x * w, unfused, on the portable one), whatever T, the group t falls in, the other weights in the call or the thread.
// So row t of a T-row product is bitwise the 1-row product of x[t].
//
// Threads: XLA's intra-op thread pool (parallel_chunks, cpu_parallel.h), over ranges of panels.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec_cpu::bf16_to_f32;
using jaxspec_cpu::parallel_chunks;
#ifdef JAXSPEC_X86
using jaxspec_cpu::load_w8;
using jaxspec_cpu::load_w16;
#endif

constexpr int64_t kPanel = 16;             // output columns per panel
constexpr int64_t kKc = 256;               // k's per block: 16 KB of a float32 panel, in L1
constexpr int kRows = 6;                   // x rows per register tile (12 accumulators)
constexpr int64_t kMaxT = 64;              // rows a call takes (cpu_matmul.MAX_ROWS)
constexpr int64_t kSerialBelow = 1 << 15;  // K * sum(N) under which one thread does it all
constexpr int64_t kChunkPanels = 8;        // panels per unit of work shared by the threads, at most
constexpr int64_t kAheadLines = 24;        // how far ahead a float32 tile of 4-6 rows prefetches

struct Weight {
  const void* panels;  // [P, K, 16]
  void* y;             // [T, N], float32 or bfloat16 (y_bf16)
  int64_t n, p;
  bool bf16, y_bf16;
};

// acc[r][c] (+)= sum over k in [0, kc) of x[r, k] * w[k, c], for r < rows, c < 16; `part` holds
// the rows' 16 partial sums, 16 floats apart; w points at the block's first k of a panel.
template <bool BF16>
void tile_portable(const float* x, int64_t ldx, const void* w, int64_t kc, float* part, int rows, bool first) {
  for (int r = 0; r < rows; ++r) {
    float acc[kPanel];
    for (int c = 0; c < kPanel; ++c) acc[c] = first ? 0.0f : part[r * kPanel + c];
    for (int64_t k = 0; k < kc; ++k) {
      const float xv = x[r * ldx + k];
      for (int c = 0; c < kPanel; ++c) {
        const int64_t i = k * kPanel + c;
        const float wv = BF16 ? bf16_to_f32(static_cast<const uint16_t*>(w)[i]) : static_cast<const float*>(w)[i];
        acc[c] = acc[c] + xv * wv;
      }
    }
    for (int c = 0; c < kPanel; ++c) part[r * kPanel + c] = acc[c];
  }
}

#ifdef JAXSPEC_X86
// Named accumulators, not arrays: GCC kept an array of __m256 in registers but also stored it to
// the stack every iteration (one store per FMA).
#define JAXSPEC_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

template <int R, bool BF16>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t ldx, const void* w, int64_t kc, float* part,
                                                    bool first, const char* ahead, bool l1) {
  static_assert(R >= 1 && R <= kRows, "rows per tile");
#define JAXSPEC_INIT(r)                                                       \
  __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();        \
  if (R > r && !first) {                                                      \
    a##r##0 = _mm256_loadu_ps(part + r * kPanel);                             \
    a##r##1 = _mm256_loadu_ps(part + r * kPanel + 8);                         \
  }
  JAXSPEC_ROWS(JAXSPEC_INIT)
#undef JAXSPEC_INIT
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = load_w8<BF16>(w, k * kPanel), w1 = load_w8<BF16>(w, k * kPanel + 8);
    if (ahead && (k & 1) == 0) _mm_prefetch(ahead + 32 * k, _MM_HINT_T1);
    if (!BF16 && l1) _mm_prefetch(static_cast<const char*>(w) + (k + kAheadLines) * kPanel * 4, _MM_HINT_T0);
#define JAXSPEC_FMA(r)                                                        \
    if (R > r) {                                                              \
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                 \
      a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);                             \
      a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);                             \
    }
    JAXSPEC_ROWS(JAXSPEC_FMA)
#undef JAXSPEC_FMA
  }
#define JAXSPEC_STORE(r)                                                      \
  if (R > r) {                                                                \
    _mm256_storeu_ps(part + r * kPanel, a##r##0);                             \
    _mm256_storeu_ps(part + r * kPanel + 8, a##r##1);                         \
  }
  JAXSPEC_ROWS(JAXSPEC_STORE)
#undef JAXSPEC_STORE
}
#undef JAXSPEC_ROWS

// Two panels at once for up to 3 rows (12 accumulators): twice the independent chains and two
// streams for a 1- to 3-token pass, which is bound by the weight stream. Each output's chain is
// tile_avx2's.
template <int R, bool BF16>
__attribute__((target("avx2,fma"))) void tile2_avx2(const float* x, int64_t ldx, const void* wa, const void* wb,
                                                     int64_t kc, float* pa, float* pb, bool first) {
  static_assert(R >= 1 && R <= 3, "rows per two-panel tile");
#define JAXSPEC_INIT2(r)                                                              \
  __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = a##r##0, b##r##0 = a##r##0, b##r##1 = a##r##0; \
  if (R > r && !first) {                                                              \
    a##r##0 = _mm256_loadu_ps(pa + r * kPanel);                                       \
    a##r##1 = _mm256_loadu_ps(pa + r * kPanel + 8);                                   \
    b##r##0 = _mm256_loadu_ps(pb + r * kPanel);                                       \
    b##r##1 = _mm256_loadu_ps(pb + r * kPanel + 8);                                   \
  }
  JAXSPEC_INIT2(0) JAXSPEC_INIT2(1) JAXSPEC_INIT2(2)
#undef JAXSPEC_INIT2
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 u0 = load_w8<BF16>(wa, k * kPanel), u1 = load_w8<BF16>(wa, k * kPanel + 8);
    const __m256 v0 = load_w8<BF16>(wb, k * kPanel), v1 = load_w8<BF16>(wb, k * kPanel + 8);
#define JAXSPEC_FMA2(r)                                                               \
    if (R > r) {                                                                      \
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                         \
      a##r##0 = _mm256_fmadd_ps(xb, u0, a##r##0);                                     \
      a##r##1 = _mm256_fmadd_ps(xb, u1, a##r##1);                                     \
      b##r##0 = _mm256_fmadd_ps(xb, v0, b##r##0);                                     \
      b##r##1 = _mm256_fmadd_ps(xb, v1, b##r##1);                                     \
    }
    JAXSPEC_FMA2(0) JAXSPEC_FMA2(1) JAXSPEC_FMA2(2)
#undef JAXSPEC_FMA2
  }
#define JAXSPEC_STORE2(r)                                                             \
  if (R > r) {                                                                        \
    _mm256_storeu_ps(pa + r * kPanel, a##r##0);                                       \
    _mm256_storeu_ps(pa + r * kPanel + 8, a##r##1);                                   \
    _mm256_storeu_ps(pb + r * kPanel, b##r##0);                                       \
    _mm256_storeu_ps(pb + r * kPanel + 8, b##r##1);                                   \
  }
  JAXSPEC_STORE2(0) JAXSPEC_STORE2(1) JAXSPEC_STORE2(2)
#undef JAXSPEC_STORE2
}

// AVX-512: a panel's 16 columns are one register, so a tile holds up to 12 rows (12
// accumulators; one weight load feeds 12 FMAs). Each output's chain
// is tile_avx2's, fma(x[t, k], W[k, n], acc) from 0 over k in order: bitwise the same sums.
#define JAXSPEC_ROWS12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
constexpr int kRows512 = 12;

template <int R, bool BF16>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, int64_t ldx, const void* w, int64_t kc,
                                                     float* part, bool first, const char* ahead, bool l1) {
  static_assert(R >= 1 && R <= kRows512, "rows per tile");
#define JAXSPEC_INIT(r)                                                       \
  __m512 a##r = _mm512_setzero_ps();                                          \
  if (R > r && !first) a##r = _mm512_loadu_ps(part + r * kPanel);
  JAXSPEC_ROWS12(JAXSPEC_INIT)
#undef JAXSPEC_INIT
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w0 = load_w16<BF16>(w, k * kPanel);
    if (ahead && (k & 1) == 0) _mm_prefetch(ahead + 32 * k, _MM_HINT_T1);
    // the line kAheadLines ahead into L1, in bfloat16 too (a line per two k; measured in SmolLM2-135M
    // bfloat16 passes, A/B in one process: T = 9 11.95 ms instead of 13.0, T = 5 10.2 instead of
    // 10.5, T = 1 the same)
    if (l1 && (!BF16 || (k & 1) == 0))
      _mm_prefetch(static_cast<const char*>(w) + k * kPanel * (BF16 ? 2 : 4) + kAheadLines * 64, _MM_HINT_T0);
#define JAXSPEC_FMA(r) \
    if (R > r) a##r = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, a##r);
    JAXSPEC_ROWS12(JAXSPEC_FMA)
#undef JAXSPEC_FMA
  }
#define JAXSPEC_STORE(r) \
  if (R > r) _mm512_storeu_ps(part + r * kPanel, a##r);
  JAXSPEC_ROWS12(JAXSPEC_STORE)
#undef JAXSPEC_STORE
}

#undef JAXSPEC_ROWS12

using Tile2 = void (*)(const float*, int64_t, const void*, const void*, int64_t, float*, float*, bool);
template <bool BF16>
constexpr Tile2 kTiles2[3] = {tile2_avx2<1, BF16>, tile2_avx2<2, BF16>, tile2_avx2<3, BF16>};

using Tile = void (*)(const float*, int64_t, const void*, int64_t, float*, bool, const char*, bool);
template <bool BF16>
constexpr Tile kTiles[kRows] = {tile_avx2<1, BF16>, tile_avx2<2, BF16>, tile_avx2<3, BF16>,
                                tile_avx2<4, BF16>, tile_avx2<5, BF16>, tile_avx2<6, BF16>};
template <bool BF16>
constexpr Tile kTiles512[kRows512] = {
    tile_avx512<1, BF16>, tile_avx512<2, BF16>, tile_avx512<3, BF16>,  tile_avx512<4, BF16>,
    tile_avx512<5, BF16>, tile_avx512<6, BF16>, tile_avx512<7, BF16>,  tile_avx512<8, BF16>,
    tile_avx512<9, BF16>, tile_avx512<10, BF16>, tile_avx512<11, BF16>, tile_avx512<12, BF16>};
#endif

// Panel p's columns of y's t rows from `part` (the rows' 16 sums, 16 floats apart; zeros when
// K = 0, where no tile ran), the last panel's columns past N left out.
void store_panel(const Weight& w, int64_t t, int64_t k, float* part, int64_t p) {
  const int64_t c0 = p * kPanel, cols = std::min(kPanel, w.n - c0), esize = w.y_bf16 ? 2 : 4;
  for (int64_t r = 0; r < t; ++r) {
    if (k == 0) std::fill(part + r * kPanel, part + r * kPanel + kPanel, 0.0f);
    jaxspec_cpu::store_row(part + r * kPanel, static_cast<char*>(w.y) + (r * w.n + c0) * esize, w.y_bf16, cols);
  }
}

// Panels [p0, p1) of one weight: y[:, 16 p0 .. 16 p1) = x @ W[:, those columns]. isa: cpu_isa().
void panels(const float* x, int64_t t, int64_t k, const Weight& w, int64_t p0, int64_t p1, int isa) {
  const int64_t esize = w.bf16 ? 2 : 4;
  const int rows = isa >= 2 ? kRows512 : kRows;
  const int groups = static_cast<int>((t + rows - 1) / rows);
  int starts[kMaxT], sizes[kMaxT];
  for (int g = 0, t0 = 0; g < groups; ++g) {  // balanced groups: T = 8 -> 4 + 4, T = 13 -> 5 + 4 + 4 (AVX2)
    sizes[g] = static_cast<int>(t / groups + (g < t % groups ? 1 : 0));
    starts[g] = t0;
    t0 += sizes[g];
  }
  alignas(64) float part[kMaxT * kPanel];
  int64_t p = p0;
#ifdef JAXSPEC_X86
  if (isa == 1 && t <= 3) {  // pairs of panels (tile2_avx2)
    alignas(32) float part2[3 * kPanel];
    for (; p + 1 < p1; p += 2) {
      const char* pa = static_cast<const char*>(w.panels) + p * k * kPanel * esize;
      const char* pb = pa + k * kPanel * esize;
      for (int64_t k0 = 0; k0 < k; k0 += kKc)
        (w.bf16 ? kTiles2<true> : kTiles2<false>)[t - 1](x + k0, k, pa + k0 * kPanel * esize, pb + k0 * kPanel * esize,
                                                          std::min(kKc, k - k0), part, part2, k0 == 0);
      store_panel(w, t, k, part, p);
      store_panel(w, t, k, part2, p + 1);
    }
  }
#endif
  for (; p < p1; ++p) {
    const char* panel = static_cast<const char*>(w.panels) + p * k * kPanel * esize;
    for (int64_t k0 = 0; k0 < k; k0 += kKc) {
      const int64_t kc = std::min(kKc, k - k0);
      const void* wb = panel + k0 * kPanel * esize;
      for (int g = 0; g < groups; ++g) {
        const float* xg = x + starts[g] * k + k0;
        float* pg = part + starts[g] * kPanel;
#ifdef JAXSPEC_X86
        if (isa >= 1) {
          // Prefetch. The second group reads the block from L1: no demand miss leads the hardware
          // prefetcher on meanwhile, so this group asks for the next block (into L2), one line per
          // two k: 128 lines, all of a bfloat16 block and half of a float32 one (measured: T = 8
          // and 9 about 15% faster in float32; every line of a float32 block, no faster than
          // none). A first group of 4-6 rows, which streams the block from memory, spends 4-6
          // FMA pairs per line and keeps too few loads in flight: in float32 it asks for the line
          // kAheadLines ahead into L1, in bfloat16 (a line per two k), when it is the only group,
          // for the next block into L2 like a second group (measured on [1536, 8960] products,
          // A/B of two builds in one process: T = 4-6 1.15x T = 1 instead of 1.21-1.30x in
          // float32, 1.22-1.31x instead of 1.50-1.61x in bfloat16; the L1 prefetch did less for
          // bfloat16, the L2 one less for float32). An AVX-512 tile takes no pairs of panels, and a
          // first group of any size prefetches so (measured, A/B in one process on the same
          // products: pairs made bfloat16 T = 2-3 cost 1.09-1.19x T = 1 instead of 0.99-1.03x, and
          // did nothing for float32; in SmolLM2-135M passes no faster in either dtype).
          const bool streams = g == 0 && (isa >= 2 || sizes[0] > 3);
          const bool next = g == 1 || (w.bf16 && streams && groups == 1);
          const char* ahead = next ? static_cast<const char*>(wb) + kc * kPanel * esize : nullptr;
          const Tile tile = isa >= 2 ? (w.bf16 ? kTiles512<true> : kTiles512<false>)[sizes[g] - 1]
                                     : (w.bf16 ? kTiles<true> : kTiles<false>)[sizes[g] - 1];
          tile(xg, k, wb, kc, pg, k0 == 0, ahead, streams);
          continue;
        }
#endif
        (w.bf16 ? tile_portable<true> : tile_portable<false>)(xg, k, wb, kc, pg, sizes[g], k0 == 0);
      }
    }
    store_panel(w, t, k, part, p);
  }
}

// x [T, K], then the panels P_1 .. P_M; results y_1 .. y_M [T, N_i]. x float32 or bfloat16
// (widened once here), each y float32 or bfloat16 (the float32 sums rounded once as they are
// stored, as XLA's convert rounds): a bfloat16 model's activations go in and out as they are,
// with no convert ops around the call.
ffi::Error MatmulPanels(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  if (ws.size() != ys.size() || ws.size() == 0)
    return ffi::Error::InvalidArgument("jaxspec cpu panels: one result per weight, at least one weight");
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("jaxspec cpu panels: x must be rank 2");
  if (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("jaxspec cpu panels: x must be float32 or bfloat16");
  const int64_t t = xd[0], k = xd[1];
  if (t > kMaxT) return ffi::Error::InvalidArgument("jaxspec cpu panels: at most 64 rows of x");
  std::vector<Weight> weights(ws.size());
  int64_t total_panels = 0, elems = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    auto wd = w->dimensions();
    auto yd = (*y)->dimensions();
    if (wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel)
      return ffi::Error::InvalidArgument("jaxspec cpu panels: panels must be [P, K, 16] and y rank 2");
    const int64_t n = yd[1];
    if (wd[1] != k || yd[0] != t || wd[0] != (n + kPanel - 1) / kPanel)
      return ffi::Error::InvalidArgument("jaxspec cpu panels: shapes do not chain");
    if (w->element_type() != ffi::F32 && w->element_type() != ffi::BF16)
      return ffi::Error::InvalidArgument("jaxspec cpu panels: weights must be float32 or bfloat16");
    if ((*y)->element_type() != ffi::F32 && (*y)->element_type() != ffi::BF16)
      return ffi::Error::InvalidArgument("jaxspec cpu panels: results must be float32 or bfloat16");
    weights[i] = Weight{w->untyped_data(), (*y)->untyped_data(), n, wd[0], w->element_type() == ffi::BF16,
                        (*y)->element_type() == ffi::BF16};
    total_panels += wd[0];
    elems += k * n;
  }
  if (t == 0) return ffi::Error::Success();
  const int isa = jaxspec_cpu::cpu_isa();
  // Units of work: ranges of at most kChunkPanels panels of one weight, about 8 per thread, the
  // last 2 x threads of them 2 panels (a pair for tile2_avx2) so that the threads finish close
  // together (measured: the caller waited 3-6 us per call for the other thread's last unit).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::clamp<int64_t>(total_panels / (8 * threads), 1, kChunkPanels);
  const int64_t tail = std::min<int64_t>(per, 2), fine_from = total_panels - 2 * threads * tail;
  struct Unit {
    int64_t w, p0, p1;
  };
  std::vector<Unit> units;
  for (int64_t i = 0, before = 0; i < static_cast<int64_t>(weights.size()); before += weights[i].p, ++i)
    for (int64_t p = 0; p < weights[i].p;) {
      const int64_t size = before + p >= fine_from ? tail : std::min(per, std::max<int64_t>(tail, fine_from - before - p));
      units.push_back({i, p, std::min(weights[i].p, p + size)});
      p += size;
    }
  std::vector<float> widened;
  const float* xf = static_cast<const float*>(x.untyped_data());
  if (x.element_type() == ffi::BF16) {
    widened.resize(t * k);
    jaxspec_cpu::widen(static_cast<const uint16_t*>(x.untyped_data()), t * k, widened.data());
    xf = widened.data();
  }
  auto run = [&](int64_t u) { panels(xf, t, k, weights[units[u].w], units[u].p0, units[u].p1, isa); };
  if (elems < kSerialBelow) {
    for (int64_t u = 0; u < static_cast<int64_t>(units.size()); ++u) run(u);
  } else {
    parallel_chunks(pool, static_cast<int64_t>(units.size()), run);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecMatmulPanels, MatmulPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());
