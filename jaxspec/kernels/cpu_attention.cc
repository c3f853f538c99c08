// Attention of a few new tokens over a KV cache and over their own keys and values kept apart,
// for XLA:CPU, as an XLA FFI custom call.
//
//   q        [B, T, H, h]   the new tokens' queries (RoPE applied), float32 or bfloat16
//   k_c, v_c [B, S, K, h]   the cache, float32 or bfloat16
//   seen_c   [B, T, S]      bool: which cache slots query t sees
//   k_n, v_n [B, N, K, h]   the new tokens' own keys and values, not written into the cache
//                           (N may be 0: everything is in the cache)
//   seen_n   [B, T, N]      bool: which of those query t sees
//   scale    attribute      the score scale
//   out      [B, T, H, h]   float32 or bfloat16 (the float32 result rounded once, as XLA's
//                           convert rounds)
//
// Grouped-query attention: query head i reads KV head i / (H / K).
//
// Row invariance. The point of this kernel is that a query's output depends only on the keys
// and values it sees and on their order, never on T, on where its window starts, or on whether
// a key sits in the cache or in the new part. Each query takes its visible keys in the order
// cache slots ascending, then new entries ascending (the order of their positions: a 1-token
// pass finds its own key, and the keys accepted before it, in the cache; a verify window finds
// them among the new entries, after the committed slots), and for that list computes
//   s_j = dot(q, k_j) * scale   (8 lane sums over h = l mod 8 (AVX2) added in a fixed tree, then
//                                the h mod 8 tail; or one sequential chain on the portable path)
//   m = max_j s_j,  p_j = exp(s_j - m)  (exp8 below on the AVX2 path, std::exp on the portable
//                                        one),  l = sum_j p_j (sequential),
//   out = (sum_j p_j v_j) / l   (per dimension, one sequential chain over j).
// So a token's attention output in a T-token verify window is bitwise the one it gets in its
// own 1-token pass, which the weight products (cpu_matmul.cc) already guarantee for the rest.
// Masked keys are skipped, not weighted by exp(-inf) = 0 (the same sums either way, fewer
// reads: only the slots a query sees are read, not the whole static-shape cache).
//
// Threads: one task per (batch row, KV head, chunk of up to kChunkQueries of its T * H / K
// queries); a task reads each key and value row its queries see once (bfloat16 widened in
// registers as it is read) and applies it to all of them. On the AVX2 path the chunk's queries sit in the
// lanes of one vector: a key's dots with all of them come out as one vector (the lane trees of 8
// dots added at once), and the max, exp and l run 8 queries wide; every query's own sequence of
// operations is the one above, whatever its chunk (parallel_chunks, cpu_parallel.h). Compiled
// with -ffp-contract=off (see cpu_matmul.cc).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec_cpu::cpu_has_avx2;
using jaxspec_cpu::parallel_chunks;
#ifdef JAXSPEC_X86
using jaxspec_cpu::load_w8;
#endif

constexpr int64_t kMaxHeadDim = 512;
// Queries (query rows x the heads of one KV head) per task: they share every key and value
// read, and a window's queries still spread over the threads.
constexpr int64_t kChunkQueries = 8;

// Row `i` (h values) of a float32 or bfloat16 buffer, widened into `tmp` when bfloat16 (exact).
inline const float* row(const void* base, bool bf16, int64_t i, int64_t h, float* tmp) {
  if (!bf16) return static_cast<const float*>(base) + i * h;
  jaxspec_cpu::widen(static_cast<const uint16_t*>(base) + i * h, h, tmp);
  return tmp;
}

struct Problem {
  const void *q, *kc, *vc, *kn, *vn;
  const bool *seen_c, *seen_n;
  void* out;
  bool q_bf16, c_bf16, n_bf16, out_bf16;
  int64_t b, t, n_heads, n_kv, h, s, n;
  float scale;
};

// What one task has gathered for its nq (<= kChunkQueries) queries before any arithmetic: the
// m keys any of them sees (cache slots ascending, then new entries ascending), which of them
// each query sees, the queries as float32 rows, and where each result goes.
struct Chunk {
  int64_t nq, m, h;
  const void* const* krow;  // [m] key rows: float32 (widened if need be), or bfloat16 as
  const void* const* vrow;  // stored when kv_bf16 (AVX2 path only); [m] value rows, alike
  bool kv_bf16;
  const uint8_t* vis;   // [m, kChunkQueries]: vis[j * kChunkQueries + i], query i sees key j
  const uint8_t* all;   // [m]: every query of the chunk sees key j
  const float* qs;      // [nq, h]
  float* const* outs;   // [nq] float32 results
  float scale;
};

// The portable path, one query at a time: scores s_j = dot(q, k_j) * scale (one sequential
// chain), m = max, p_j = exp(s_j - m), l = sum_j p_j and out = (sum_j p_j v_j) / l, each sum
// one sequential chain over the visible keys in order.
void attend_portable(const Chunk& c, float* scores) {
  const int64_t m = c.m, h = c.h;
  for (int64_t i = 0; i < c.nq; ++i) {
    const float* q = c.qs + i * h;
    float* out = c.outs[i];
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < m; ++j) {
      if (!c.vis[j * kChunkQueries + i]) continue;
      float acc = 0.0f;
      for (int64_t d = 0; d < h; ++d) acc = acc + q[d] * static_cast<const float*>(c.krow[j])[d];
      scores[j] = acc * c.scale;
      mx = std::max(mx, scores[j]);
    }
    float l = 0.0f;
    std::fill(out, out + h, 0.0f);
    for (int64_t j = 0; j < m; ++j) {
      if (!c.vis[j * kChunkQueries + i]) continue;
      const float pj = std::exp(scores[j] - mx);
      l = l + pj;
      for (int64_t d = 0; d < h; ++d) out[d] = out[d] + pj * static_cast<const float*>(c.vrow[j])[d];
    }
    if (l == 0.0f) {  // the query sees nothing: zeros (XLA's softmax over an all-masked row gives NaN; never asked for)
      std::fill(out, out + h, 0.0f);
      continue;
    }
    for (int64_t d = 0; d < h; ++d) out[d] = out[d] / l;
  }
}

#ifdef JAXSPEC_X86
// Element e of a float32 or (BF16) bfloat16 row, as float32.
template <bool BF16>
inline float element(const void* row, int64_t e) {
  return BF16 ? jaxspec_cpu::bf16_to_f32(static_cast<const uint16_t*>(row)[e]) : static_cast<const float*>(row)[e];
}

// Eight dots at once: acc[i] holds dot i's 8 lane sums l0..l7; lane i of the result is
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), the fixed tree every dot of this path takes
// (the h mod 8 tail is added after it, in order).
__attribute__((target("avx2,fma"))) inline __m256 lane_trees8(const __m256* acc) {
  __m256 b[4];
  for (int i = 0; i < 4; ++i)  // [l_x + l_{x+4} of dot i | of dot i + 4], x = 0..3
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(acc[i], acc[i + 4], 0x20),
                         _mm256_permute2f128_ps(acc[i], acc[i + 4], 0x31));
  // [s0 + s2, s1 + s3] of dots (0, 1 | 4, 5) and (2, 3 | 6, 7)
  const __m256 c01 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 c23 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Key k dotted with the NQ queries qs (rows h apart), times scale, into lanes 0..NQ-1 of out.
template <int NQ, bool BF16>
__attribute__((target("avx2,fma"))) inline void key_scores(const float* qs, const void* k, int64_t h, float scale,
                                                           float* out) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= h; d += 8) {
    const __m256 kd = load_w8<BF16>(k, d);
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + i * h + d), kd, acc[i]);
  }
  const __m256 sums = lane_trees8(acc);
  if (d == h) {
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    return;
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, sums);
  for (int i = 0; i < NQ; ++i) {
    for (int64_t e = d; e < h; ++e) r[i] = std::fma(qs[i * h + e], element<BF16>(k, e), r[i]);
    out[i] = r[i] * scale;
  }
}

// Lanes of an 8-byte visibility row as a mask (all ones where the byte is nonzero).
__attribute__((target("avx2,fma"))) inline __m256 lane_mask(const uint8_t* vis) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vis)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setzero_si256()));
}

// exp of 8 floats: Cody-Waite reduction x = n ln2 + r (n = round(x log2 e), ln2 in two parts),
// a degree-5 polynomial on r (Cephes' expf coefficients), times 2^n built in the exponent field.
// Within 1 ulp of std::exp on [-87.3, 88.37] (checked at 475,000 points), 0 below -87.34 (where
// exp is under 2^-126), NaN kept; inputs above 88.37 are clamped there (the kernel's are <= 0: a
// score minus the query's max). One fixed sequence of operations per element, so a result
// depends on its input only.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.3762626f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));  // a NaN x passes (max/min return their second operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The AVX2 path: the portable path's softmax with the chunk's queries in the lanes of one
// vector. scores [m, 8]: row j the scaled dots of key j with every query (the key read once),
// each dot 8 lane sums in a fixed tree (lane_trees8) and the tail; per query the max and
// exp(s_j - max) over the keys it sees, l one sequential sum in key order; the weighted values
// 8 outputs x NQ queries at a time in registers, each element one sequential FMA chain over the
// keys the query sees, in order; out = that / l. A key a query does not see is dotted but never
// used.
template <int NQ, bool BF16>
__attribute__((target("avx2,fma"))) void attend_avx2(const Chunk& c, float* scores) {
  constexpr int64_t W = kChunkQueries;
  const int64_t m = c.m, h = c.h;
  for (int64_t j = 0; j < m; ++j) key_scores<NQ, BF16>(c.qs, c.krow[j], h, c.scale, scores + j * W);
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < m; ++j)  // max(s, mx) is mx when s is NaN, as std::max(mx, s)
    mx = _mm256_max_ps(_mm256_blendv_ps(mx, _mm256_loadu_ps(scores + j * W), lane_mask(c.vis + j * W)), mx);
  __m256 l = _mm256_setzero_ps();
  for (int64_t j = 0; j < m; ++j) {
    float* sj = scores + j * W;
    const __m256 pj = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj), mx));
    _mm256_storeu_ps(sj, pj);
    l = _mm256_blendv_ps(l, _mm256_add_ps(l, pj), lane_mask(c.vis + j * W));
  }
  alignas(32) float ls[8];
  _mm256_store_ps(ls, l);
  int64_t d0 = 0;
  for (; d0 + 8 <= h; d0 += 8) {
    __m256 acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; ++j) {
      const __m256 v = load_w8<BF16>(c.vrow[j], d0);
      const float* pj = scores + j * W;
      const uint8_t* vj = c.vis + j * W;
      if (c.all[j]) {  // keys every query sees take no per-query test
        for (int i = 0; i < NQ; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(pj[i]), v, acc[i]);
      } else {
        for (int i = 0; i < NQ; ++i)
          if (vj[i]) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(pj[i]), v, acc[i]);
      }
    }
    for (int i = 0; i < NQ; ++i) _mm256_storeu_ps(c.outs[i] + d0, _mm256_div_ps(acc[i], _mm256_set1_ps(ls[i])));
  }
  for (int i = 0; i < NQ; ++i) {
    for (int64_t d = d0; d < h; ++d) {
      float a = 0.0f;
      for (int64_t j = 0; j < m; ++j)
        if (c.vis[j * W + i]) a = std::fma(scores[j * W + i], element<BF16>(c.vrow[j], d), a);
      c.outs[i][d] = a / ls[i];
    }
    if (ls[i] == 0.0f) std::fill(c.outs[i], c.outs[i] + h, 0.0f);  // sees nothing: as the portable path
  }
}
#endif

// Queries q0 .. q0 + nq - 1 of batch row b and KV head kv, query qi being head kv * g + qi % g
// of query row qi / g (g = H / K). Every key any of them sees is read once (widened once when
// bfloat16) and dotted with all of them; each query's own sums run over the keys it sees, in
// order, exactly as if it were alone.
void attend(const Problem& p, int64_t b, int64_t kv, int64_t q0, int64_t nq, bool avx2) {
  const int64_t g = p.n_heads / p.n_kv, h = p.h, r0 = q0 / g, rows = (q0 + nq - 1) / g + 1 - r0;
  // thread_local buffers, reached once (each thread_local access may cost a call)
  thread_local std::vector<float> scores_buf, widened_buf, results_buf;
  thread_local std::vector<int64_t> keys_buf;
  thread_local std::vector<uint8_t> vis_buf, all_buf;
  thread_local std::vector<const void*> krow_buf, vrow_buf;
  // the keys any of the rows sees, in order: cache slots ascending, then new entries ascending
  // (local pointers throughout: a store through a byte pointer may alias anything, and the
  // compiler would reload every vector's data pointer after each one)
  const bool* seen_c = p.seen_c + (b * p.t + r0) * p.s;
  const bool* seen_n = p.seen_n + (b * p.t + r0) * p.n;
  keys_buf.resize(p.s + p.n);
  int64_t* keys = keys_buf.data();
  int64_t m = 0;
  for (int64_t j = 0; j < p.s; ++j) {
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) any |= seen_c[r * p.s + j];
    keys[m] = j;
    m += any;
  }
  for (int64_t j = 0; j < p.n; ++j) {
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) any |= seen_n[r * p.n + j];
    keys[m] = p.s + j;
    m += any;
  }
  // which of them each query sees: [m, kChunkQueries], lanes past nq unset
  vis_buf.assign(m * kChunkQueries, 0);
  uint8_t* vis = vis_buf.data();
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t r = (q0 + qi) / g - r0;
    const bool* sc = seen_c + r * p.s;
    const bool* sn = seen_n + r * p.n - p.s;
    for (int64_t j = 0; j < m; ++j) vis[j * kChunkQueries + qi] = keys[j] < p.s ? sc[keys[j]] : sn[keys[j]];
  }
  all_buf.resize(m);
  uint8_t* all = all_buf.data();
  for (int64_t j = 0; j < m; ++j) {
    bool every = true;
    for (int64_t qi = 0; qi < nq; ++qi) every &= vis[j * kChunkQueries + qi] != 0;
    all[j] = every;
  }
  // the key and value rows
  krow_buf.resize(m);
  vrow_buf.resize(m);
  const void** krow = krow_buf.data();
  const void** vrow = vrow_buf.data();
  // bfloat16 keys and values (cache and new part alike) are read as stored and widened in
  // registers on the AVX2 path; otherwise any bfloat16 rows are widened here, once
  const bool kv_bf16 = avx2 && p.c_bf16 && (p.n_bf16 || p.n == 0);
  const bool widen_kv = !kv_bf16 && (p.c_bf16 || p.n_bf16);  // rows widened into `widened`
  widened_buf.resize((widen_kv ? 2 * m + nq : nq) * h);
  float* widened = widened_buf.data();
  for (int64_t j = 0; j < m; ++j) {
    const int64_t key = keys[j];
    const bool cache = key < p.s, bf16 = cache ? p.c_bf16 : p.n_bf16;
    const int64_t i = cache ? (b * p.s + key) * p.n_kv + kv : (b * p.n + key - p.s) * p.n_kv + kv;
    const void *kb = cache ? p.kc : p.kn, *vb = cache ? p.vc : p.vn;
    if (kv_bf16) {
      krow[j] = static_cast<const uint16_t*>(kb) + i * h;
      vrow[j] = static_cast<const uint16_t*>(vb) + i * h;
      continue;
    }
    krow[j] = row(kb, bf16, i, h, bf16 ? widened + j * h : nullptr);
    vrow[j] = row(vb, bf16, i, h, bf16 ? widened + (m + j) * h : nullptr);
  }
  float* qs = widened + (widen_kv ? 2 * m * h : 0);
  // each query's float32 result: its row of out, or (bfloat16 out) of `results`, rounded at the end
  results_buf.resize(p.out_bf16 ? nq * h : 0);
  float* outs[kChunkQueries];
  int64_t at[kChunkQueries];
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t r = (q0 + qi) / g, i = (q0 + qi) % g;
    at[qi] = (b * p.t + r) * p.n_heads + kv * g + i;
    const float* src = row(p.q, p.q_bf16, at[qi], h, qs + qi * h);
    if (src != qs + qi * h) std::memcpy(qs + qi * h, src, h * sizeof(float));
    outs[qi] = p.out_bf16 ? results_buf.data() + qi * h : static_cast<float*>(p.out) + at[qi] * h;
  }
  const Chunk chunk{nq, m, h, krow, vrow, kv_bf16, vis, all, qs, outs, p.scale};
  scores_buf.resize(m * kChunkQueries);
  float* scores = scores_buf.data();
#ifdef JAXSPEC_X86
  if (avx2) {
    using Path = void (*)(const Chunk&, float*);
    static constexpr Path kF32[8] = {attend_avx2<1, false>, attend_avx2<2, false>, attend_avx2<3, false>,
                                     attend_avx2<4, false>, attend_avx2<5, false>, attend_avx2<6, false>,
                                     attend_avx2<7, false>, attend_avx2<8, false>};
    static constexpr Path kBF16[8] = {attend_avx2<1, true>, attend_avx2<2, true>, attend_avx2<3, true>,
                                      attend_avx2<4, true>, attend_avx2<5, true>, attend_avx2<6, true>,
                                      attend_avx2<7, true>, attend_avx2<8, true>};
    (kv_bf16 ? kBF16 : kF32)[nq - 1](chunk, scores);
  } else
#endif
    attend_portable(chunk, scores);
  if (p.out_bf16)
    for (int64_t qi = 0; qi < nq; ++qi)
      jaxspec_cpu::store_row(outs[qi], static_cast<uint16_t*>(p.out) + at[qi] * h, true, h);
}

bool is_f32_or_bf16(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::F32 || x.element_type() == ffi::BF16;
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
                     ffi::Buffer<ffi::PRED> seen_c, ffi::AnyBuffer kn, ffi::AnyBuffer vn,
                     ffi::Buffer<ffi::PRED> seen_n, float scale, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), cd = kc.dimensions(), nd = kn.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || nd.size() != 4)
    return ffi::Error::InvalidArgument("jaxspec cpu attention: q, k and v must be rank 4");
  const int64_t b = qd[0], t = qd[1], n_heads = qd[2], h = qd[3], s = cd[1], n_kv = cd[2], n = nd[1];
  if (cd[0] != b || cd[3] != h || nd[0] != b || nd[2] != n_kv || nd[3] != h || n_kv == 0 || n_heads % n_kv != 0 ||
      h > kMaxHeadDim)
    return ffi::Error::InvalidArgument("jaxspec cpu attention: shapes do not match");
  if (vc.dimensions().size() != 4 || vc.dimensions()[1] != s || vn.dimensions().size() != 4 ||
      vn.dimensions()[1] != n || seen_c.dimensions().size() != 3 || seen_c.dimensions()[2] != s ||
      seen_n.dimensions().size() != 3 || seen_n.dimensions()[2] != n || seen_c.dimensions()[1] != t ||
      seen_n.dimensions()[1] != t)
    return ffi::Error::InvalidArgument("jaxspec cpu attention: k/v/mask shapes do not match");
  if (!is_f32_or_bf16(q) || !is_f32_or_bf16(kc) || !is_f32_or_bf16(kn) || kc.element_type() != vc.element_type() ||
      kn.element_type() != vn.element_type())
    return ffi::Error::InvalidArgument("jaxspec cpu attention: float32 or bfloat16 operands, k and v alike");
  if (out->element_type() != ffi::F32 && out->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("jaxspec cpu attention: out must be float32 or bfloat16");
  Problem p{q.untyped_data(),  kc.untyped_data(), vc.untyped_data(), kn.untyped_data(), vn.untyped_data(),
            seen_c.typed_data(), seen_n.typed_data(), out->untyped_data(),
            q.element_type() == ffi::BF16, kc.element_type() == ffi::BF16, kn.element_type() == ffi::BF16,
            out->element_type() == ffi::BF16,
            b, t, n_heads, n_kv, h, s, n, scale};
  const bool avx2 = cpu_has_avx2();
  // tasks: (batch row, KV head, a chunk of its T * g queries), chunks of at most kChunkQueries
  const int64_t per_kv = t * (n_heads / n_kv), chunks = (per_kv + kChunkQueries - 1) / kChunkQueries;
  const int64_t size = (per_kv + chunks - 1) / chunks;
  parallel_chunks(pool, b * n_kv * chunks, [&](int64_t i) {
    const int64_t c = i % chunks, q0 = c * size;
    if (q0 >= per_kv) return;
    attend(p, i / (n_kv * chunks), i / chunks % n_kv, q0, std::min(size, per_kv - q0), avx2);
  });
  return ffi::Error::Success();
}

// RoPE, "rotate_half" layout: out[.., i] = x[i] * cos(a_i) - x[i + h/2] * sin(a_i) and
// out[.., i + h/2] = x[i + h/2] * cos(a_i) + x[i] * sin(a_i), a_i = position * inv_freq[i], all
// float32, each product rounded before the sum (no FMA contraction: -ffp-contract=off). In
// XLA, these few multiply-adds are fused with whatever consumes them (the cache write in a
// 1-token pass, the attention in a verify window) and the fusions contract them differently;
// here they are the same code in every program.
ffi::Error Rope(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions();
  if (xd.size() != 4 || !is_f32_or_bf16(x))
    return ffi::Error::InvalidArgument("jaxspec cpu rope: x must be float32 or bfloat16 [B, T, N, h]");
  const int64_t b = xd[0], t = xd[1], n = xd[2], h = xd[3], half = h / 2;
  auto pd = positions.dimensions();
  if (h % 2 != 0 || h > kMaxHeadDim || pd.size() != 2 || pd[0] != b || pd[1] != t ||
      inv_freq.dimensions().size() != 1 || inv_freq.dimensions()[0] != half)
    return ffi::Error::InvalidArgument("jaxspec cpu rope: shapes do not match");
  if (out->element_type() != ffi::F32 && out->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("jaxspec cpu rope: out must be float32 or bfloat16");
  const bool bf16 = x.element_type() == ffi::BF16, out_bf16 = out->element_type() == ffi::BF16;
  const int32_t* pos = positions.typed_data();
  const float* freq = inv_freq.typed_data();
  float cs[kMaxHeadDim], sn[kMaxHeadDim], tmp[kMaxHeadDim], res[kMaxHeadDim];
  for (int64_t bt = 0; bt < b * t; ++bt) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(pos[bt]) * freq[i];
      cs[i] = std::cos(a);
      sn[i] = std::sin(a);
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* xi = row(x.untyped_data(), bf16, bt * n + j, h, tmp);
      float* o = out_bf16 ? res : static_cast<float*>(out->untyped_data()) + (bt * n + j) * h;
      for (int64_t i = 0; i < half; ++i) {
        const float c1 = xi[i] * cs[i], s2 = xi[i + half] * sn[i];
        const float c2 = xi[i + half] * cs[i], s1 = xi[i] * sn[i];
        o[i] = c1 - s2;
        o[i + half] = c2 + s1;
      }
      if (out_bf16) jaxspec_cpu::store_row(res, static_cast<uint16_t*>(out->untyped_data()) + (bt * n + j) * h, true, h);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecRope, Rope,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());
