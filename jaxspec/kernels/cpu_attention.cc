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
//   out      [B, T, H, h]   float32
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
// Threads: one task per (batch row, KV head, query row); the H / K query heads that share a KV
// head read each key and value row once (parallel_chunks, cpu_parallel.h). Compiled with
// -ffp-contract=off (see cpu_matmul.cc).

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
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t h) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= h; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  // fixed tree: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs, then the last pair
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  float r = _mm_cvtss_f32(s);
  for (; d < h; ++d) r = std::fma(a[d], b[d], r);
  return r;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float p, const float* v, float* out, int64_t h) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= h; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(out + d)));
  for (; d < h; ++d) out[d] = std::fma(p, v[d], out[d]);
}
#endif

struct Problem {
  const void *q, *kc, *vc, *kn, *vn;
  const bool *seen_c, *seen_n;
  float* out;
  bool q_bf16, c_bf16, n_bf16;
  int64_t b, t, n_heads, n_kv, h, s, n;
  float scale;
};

// Query row t of batch row b, the query heads of KV head kv.
void attend(const Problem& p, int64_t b, int64_t kv, int64_t t, bool avx2) {
  const int64_t g = p.n_heads / p.n_kv, h = p.h;
#ifdef JAXSPEC_X86
  auto dot = avx2 ? dot_avx2 : dot_portable;
  auto axpy = avx2 ? axpy_avx2 : axpy_portable;
#else
  auto dot = dot_portable;
  auto axpy = axpy_portable;
#endif
  thread_local std::vector<float> qs, scores, tmp, denom;
  qs.resize(g * h);
  tmp.resize(h);
  // the visible keys, in order: (part, index)
  thread_local std::vector<int64_t> keys;
  keys.clear();
  const bool* sc = p.seen_c + (b * p.t + t) * p.s;
  for (int64_t j = 0; j < p.s; ++j)
    if (sc[j]) keys.push_back(j);
  const bool* sn = p.seen_n + (b * p.t + t) * p.n;
  for (int64_t j = 0; j < p.n; ++j)
    if (sn[j]) keys.push_back(p.s + j);
  const int64_t m = static_cast<int64_t>(keys.size());
  float* out = p.out + ((b * p.t + t) * p.n_heads + kv * g) * h;
  if (m == 0) {  // nothing visible: zeros (XLA's softmax over an all-masked row gives NaN; never asked for)
    std::fill(out, out + g * h, 0.0f);
    return;
  }
  for (int64_t i = 0; i < g; ++i) {
    const float* qi = row(p.q, p.q_bf16, (b * p.t + t) * p.n_heads + kv * g + i, h, tmp.data());
    std::memcpy(qs.data() + i * h, qi, h * sizeof(float));
  }
  auto key_row = [&](int64_t key, bool values, float* buf) {
    if (key < p.s)
      return row(values ? p.vc : p.kc, p.c_bf16, (b * p.s + key) * p.n_kv + kv, h, buf);
    return row(values ? p.vn : p.kn, p.n_bf16, (b * p.n + key - p.s) * p.n_kv + kv, h, buf);
  };
  scores.resize(g * m);
  for (int64_t j = 0; j < m; ++j) {
    const float* k = key_row(keys[j], false, tmp.data());
    for (int64_t i = 0; i < g; ++i) scores[i * m + j] = dot(qs.data() + i * h, k, h) * p.scale;
  }
  denom.resize(g);
  for (int64_t i = 0; i < g; ++i) {
    float* si = scores.data() + i * m;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < m; ++j) mx = std::max(mx, si[j]);
    float l = 0.0f;
    for (int64_t j = 0; j < m; ++j) {
      si[j] = std::exp(si[j] - mx);
      l = l + si[j];
    }
    denom[i] = l;
    std::fill(out + i * h, out + (i + 1) * h, 0.0f);
  }
  for (int64_t j = 0; j < m; ++j) {
    const float* v = key_row(keys[j], true, tmp.data());
    for (int64_t i = 0; i < g; ++i) axpy(scores[i * m + j], v, out + i * h, h);
  }
  for (int64_t i = 0; i < g; ++i)
    for (int64_t d = 0; d < h; ++d) out[i * h + d] = out[i * h + d] / denom[i];
}

bool is_f32_or_bf16(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::F32 || x.element_type() == ffi::BF16;
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
                     ffi::Buffer<ffi::PRED> seen_c, ffi::AnyBuffer kn, ffi::AnyBuffer vn,
                     ffi::Buffer<ffi::PRED> seen_n, float scale, ffi::Result<ffi::Buffer<ffi::F32>> out) {
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
  Problem p{q.untyped_data(),  kc.untyped_data(), vc.untyped_data(), kn.untyped_data(), vn.untyped_data(),
            seen_c.typed_data(), seen_n.typed_data(), out->typed_data(),
            q.element_type() == ffi::BF16, kc.element_type() == ffi::BF16, kn.element_type() == ffi::BF16,
            b, t, n_heads, n_kv, h, s, n, scale};
  const bool avx2 = cpu_has_avx2();
  const int64_t tasks = b * n_kv * t;
  parallel_chunks(pool, tasks, [&](int64_t i) { attend(p, i / (n_kv * t), i / t % n_kv, i % t, avx2); });
  return ffi::Error::Success();
}

// RoPE, "rotate_half" layout: out[.., i] = x[i] * cos(a_i) - x[i + h/2] * sin(a_i) and
// out[.., i + h/2] = x[i + h/2] * cos(a_i) + x[i] * sin(a_i), a_i = position * inv_freq[i], all
// float32, each product rounded before the sum (no FMA contraction: -ffp-contract=off). In
// XLA, these few multiply-adds are fused with whatever consumes them (the cache write in a
// 1-token pass, the attention in a verify window) and the fusions contract them differently;
// here they are the same code in every program.
ffi::Error Rope(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions();
  if (xd.size() != 4 || !is_f32_or_bf16(x))
    return ffi::Error::InvalidArgument("jaxspec cpu rope: x must be float32 or bfloat16 [B, T, N, h]");
  const int64_t b = xd[0], t = xd[1], n = xd[2], h = xd[3], half = h / 2;
  auto pd = positions.dimensions();
  if (h % 2 != 0 || h > kMaxHeadDim || pd.size() != 2 || pd[0] != b || pd[1] != t ||
      inv_freq.dimensions().size() != 1 || inv_freq.dimensions()[0] != half)
    return ffi::Error::InvalidArgument("jaxspec cpu rope: shapes do not match");
  const bool bf16 = x.element_type() == ffi::BF16;
  const int32_t* pos = positions.typed_data();
  const float* freq = inv_freq.typed_data();
  float cs[kMaxHeadDim], sn[kMaxHeadDim], tmp[kMaxHeadDim];
  for (int64_t bt = 0; bt < b * t; ++bt) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(pos[bt]) * freq[i];
      cs[i] = std::cos(a);
      sn[i] = std::sin(a);
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* xi = row(x.untyped_data(), bf16, bt * n + j, h, tmp);
      float* o = out->typed_data() + (bt * n + j) * h;
      for (int64_t i = 0; i < half; ++i) {
        const float c1 = xi[i] * cs[i], s2 = xi[i + half] * sn[i];
        const float c2 = xi[i + half] * cs[i], s1 = xi[i] * sn[i];
        o[i] = c1 - s2;
        o[i + half] = c2 + s1;
      }
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
                                  .Ret<ffi::Buffer<ffi::F32>>());

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
                                  .Ret<ffi::Buffer<ffi::F32>>());
