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
//   m = max_j s_j,  p_j = exp(s_j - m),  l = sum_j p_j (sequential),
//   out = (sum_j p_j v_j) / l   (per dimension, one sequential chain over j).
// So a token's attention output in a T-token verify window is bitwise the one it gets in its
// own 1-token pass, which the weight products (cpu_matmul.cc) already guarantee for the rest.
// Masked keys are skipped, not weighted by exp(-inf) = 0 (the same sums either way, fewer
// reads: only the slots a query sees are read, not the whole static-shape cache).
//
// Threads: one task per (batch row, KV head, chunk of up to kChunkQueries of its T * H / K
// queries); a task reads each key and value row its queries see once (widened once when
// bfloat16) and applies it to all of them, the dots of 4 queries interleaved; every query's
// own sequence of operations is the one above, whatever its chunk (parallel_chunks,
// cpu_parallel.h). Compiled with -ffp-contract=off (see cpu_matmul.cc).

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

constexpr int64_t kMaxHeadDim = 512;
// Queries (query rows x the heads of one KV head) per task: they share every key and value
// read, and a window's queries still spread over the threads.
constexpr int64_t kChunkQueries = 8;

// Row `i` (h values) of a float32 or bfloat16 buffer, widened into `tmp` when bfloat16.
inline const float* row(const void* base, bool bf16, int64_t i, int64_t h, float* tmp) {
  if (!bf16) return static_cast<const float*>(base) + i * h;
  const uint16_t* src = static_cast<const uint16_t*>(base) + i * h;
  for (int64_t d = 0; d < h; ++d) {
    uint32_t u = static_cast<uint32_t>(src[d]) << 16;
    std::memcpy(tmp + d, &u, sizeof(float));
  }
  return tmp;
}

float dot_portable(const float* a, const float* b, int64_t h) {
  float acc = 0.0f;
  for (int64_t d = 0; d < h; ++d) acc = acc + a[d] * b[d];
  return acc;
}

void axpy_portable(float p, const float* v, float* out, int64_t h) {
  for (int64_t d = 0; d < h; ++d) out[d] = out[d] + p * v[d];
}

#ifdef JAXSPEC_X86
// The fixed tree of a dot's 8 lane sums, (l0+l4, l1+l5, l2+l6, l3+l7), then pairs, then the
// last pair, followed by the h mod 8 tail from d on.
__attribute__((target("avx2,fma"))) inline float finish_dot(__m256 acc, const float* a, const float* b, int64_t d,
                                                            int64_t h) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  float r = _mm_cvtss_f32(s);
  for (; d < h; ++d) r = std::fma(a[d], b[d], r);
  return r;
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t h) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= h; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return finish_dot(acc, a, b, d, h);
}

// NQ queries (rows of qs, h apart) dotted with one key: each exactly dot_avx2's sequence, the
// NQ chains interleaved so that they overlap.
template <int NQ>
__attribute__((target("avx2,fma"))) void dots_avx2(const float* qs, const float* k, int64_t h, float* out) {
  __m256 acc[NQ];
  for (int i = 0; i < NQ; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= h; d += 8) {
    const __m256 kd = _mm256_loadu_ps(k + d);
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + i * h + d), kd, acc[i]);
  }
  for (int i = 0; i < NQ; ++i) out[i] = finish_dot(acc[i], qs + i * h, k, d, h);
}

#endif

// `nq` queries (rows of qs) dotted with key k, into out[0..nq).
void dots(const float* qs, int64_t nq, const float* k, int64_t h, float* out, bool avx2) {
#ifdef JAXSPEC_X86
  if (avx2) {
    int64_t i = 0;
    for (; i + 4 <= nq; i += 4) dots_avx2<4>(qs + i * h, k, h, out + i);
    switch (nq - i) {
      case 3: dots_avx2<3>(qs + i * h, k, h, out + i); break;
      case 2: dots_avx2<2>(qs + i * h, k, h, out + i); break;
      case 1: dots_avx2<1>(qs + i * h, k, h, out + i); break;
    }
    return;
  }
#endif
  for (int64_t i = 0; i < nq; ++i) out[i] = dot_portable(qs + i * h, k, h);
}

struct Problem {
  const void *q, *kc, *vc, *kn, *vn;
  const bool *seen_c, *seen_n;
  void* out;
  bool q_bf16, c_bf16, n_bf16, out_bf16;
  int64_t b, t, n_heads, n_kv, h, s, n;
  float scale;
};

// out = (sum over the keys j a query sees, in order, of p[j] * v_j) / denom, each element one
// sequential chain of FMAs from 0 (one axpy per key), then one division.
void weighted_values_portable(const float* p, const uint8_t* seen, const float* const* v, int64_t m, int64_t h,
                              float denom, float* out) {
  std::fill(out, out + h, 0.0f);
  for (int64_t j = 0; j < m; ++j)
    if (seen[j]) axpy_portable(p[j], v[j], out, h);
  for (int64_t d = 0; d < h; ++d) out[d] = out[d] / denom;
}

#ifdef JAXSPEC_X86
// weighted_values_portable's sums with 64 outputs at a time in registers: the same FMA per
// element and key, in the same order.
__attribute__((target("avx2,fma"))) void weighted_values_avx2(const float* p, const uint8_t* seen,
                                                              const float* const* v, int64_t m, int64_t h,
                                                              float denom, float* out) {
  int64_t d0 = 0;
  for (; d0 + 64 <= h; d0 += 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t j = 0; j < m; ++j) {
      if (!seen[j]) continue;
      const __m256 pv = _mm256_set1_ps(p[j]);
      const float* vj = v[j] + d0;
      a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj), a0);
      a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8), a1);
      a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 16), a2);
      a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 24), a3);
      a4 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 32), a4);
      a5 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 40), a5);
      a6 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 48), a6);
      a7 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 56), a7);
    }
    const __m256 dv = _mm256_set1_ps(denom);
    _mm256_storeu_ps(out + d0, _mm256_div_ps(a0, dv));
    _mm256_storeu_ps(out + d0 + 8, _mm256_div_ps(a1, dv));
    _mm256_storeu_ps(out + d0 + 16, _mm256_div_ps(a2, dv));
    _mm256_storeu_ps(out + d0 + 24, _mm256_div_ps(a3, dv));
    _mm256_storeu_ps(out + d0 + 32, _mm256_div_ps(a4, dv));
    _mm256_storeu_ps(out + d0 + 40, _mm256_div_ps(a5, dv));
    _mm256_storeu_ps(out + d0 + 48, _mm256_div_ps(a6, dv));
    _mm256_storeu_ps(out + d0 + 56, _mm256_div_ps(a7, dv));
  }
  for (; d0 + 8 <= h; d0 += 8) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; ++j)
      if (seen[j]) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + d0), a);
    _mm256_storeu_ps(out + d0, _mm256_div_ps(a, _mm256_set1_ps(denom)));
  }
  for (; d0 < h; ++d0) {
    float a = 0.0f;
    for (int64_t j = 0; j < m; ++j)
      if (seen[j]) a = std::fma(p[j], v[j][d0], a);
    out[d0] = a / denom;
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
  thread_local std::vector<float> scores_buf, widened_buf, dot_buf, results_buf;
  thread_local std::vector<int64_t> keys_buf;
  thread_local std::vector<uint8_t> vis_buf;
  thread_local std::vector<const float*> krow_buf, vrow_buf;
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
  // which of them each query row sees: [rows, m]
  vis_buf.resize(rows * m);
  uint8_t* vis_rows = vis_buf.data();
  for (int64_t r = 0; r < rows; ++r) {
    const bool* sc = seen_c + r * p.s;
    const bool* sn = seen_n + r * p.n - p.s;
    uint8_t* vr = vis_rows + r * m;
    for (int64_t j = 0; j < m; ++j) vr[j] = keys[j] < p.s ? sc[keys[j]] : sn[keys[j]];
  }
  // the key and value rows, as float32 (bfloat16 widened once here)
  krow_buf.resize(m);
  vrow_buf.resize(m);
  const float** krow = krow_buf.data();
  const float** vrow = vrow_buf.data();
  const bool any_bf16 = p.c_bf16 || p.n_bf16 || p.q_bf16;
  widened_buf.resize(any_bf16 ? (2 * m + nq) * h : nq * h);
  float* widened = widened_buf.data();
  for (int64_t j = 0; j < m; ++j) {
    const int64_t key = keys[j];
    const bool cache = key < p.s, bf16 = cache ? p.c_bf16 : p.n_bf16;
    const int64_t i = cache ? (b * p.s + key) * p.n_kv + kv : (b * p.n + key - p.s) * p.n_kv + kv;
    krow[j] = row(cache ? p.kc : p.kn, bf16, i, h, bf16 ? widened + j * h : nullptr);
    vrow[j] = row(cache ? p.vc : p.vn, bf16, i, h, bf16 ? widened + (m + j) * h : nullptr);
  }
  float* qs = widened + (any_bf16 ? 2 * m * h : 0);
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
  // scores [nq, m]: every query with every key of the union (a key a query does not see is
  // dotted too, and never used)
  scores_buf.resize(nq * m);
  dot_buf.resize(nq);
  float* scores = scores_buf.data();
  float* dot_out = dot_buf.data();
  for (int64_t j = 0; j < m; ++j) {
    dots(qs, nq, krow[j], h, dot_out, avx2);
    for (int64_t qi = 0; qi < nq; ++qi) scores[qi * m + j] = dot_out[qi] * p.scale;
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    float* si = scores + qi * m;
    const uint8_t* vi = vis_rows + ((q0 + qi) / g - r0) * m;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < m; ++j)
      if (vi[j]) mx = std::max(mx, si[j]);
    float l = 0.0f;
    for (int64_t j = 0; j < m; ++j)
      if (vi[j]) {
        si[j] = std::exp(si[j] - mx);
        l = l + si[j];
      }
    if (l == 0.0f) {  // the query sees nothing: zeros (XLA's softmax over an all-masked row gives NaN; never asked for)
      std::fill(outs[qi], outs[qi] + h, 0.0f);
      continue;
    }
#ifdef JAXSPEC_X86
    if (avx2) {
      weighted_values_avx2(si, vi, vrow, m, h, l, outs[qi]);
      continue;
    }
#endif
    weighted_values_portable(si, vi, vrow, m, h, l, outs[qi]);
  }
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
