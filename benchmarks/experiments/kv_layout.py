"""A KV-cache layout experiment (not the engine): attention + cache write only, SmolLM2
shapes (30 layers, 9 q / 3 kv heads, h 64, f32), batch 1, T new tokens per step, S slots, N steps inside one lax.fori_loop (the loop-carried cache as in
the engine's while loop). Layout A: K, V [B,S,K,h] (jaxspec today). Layout B: K [B,K,h,S],
V [B,K,S,h] (the layouts XLA:CPU's dots read without a transpose). ms per step, median of
4 timed loops; the count of copy and transpose ops in the optimized HLO. The loop carries the
caches through lax.fori_loop, which adds copies of its own (120 in both layouts): a lead for
the engine's layout, not a measurement of it.

    python -m benchmarks.experiments.kv_layout [S] [T]       # default 1024 1
"""
import re, sys, time, statistics
import jax, jax.numpy as jnp, numpy as np

L, H, K, h = 30, 9, 3, 64
S, T = 1024, 1  # slots, new tokens per step: the command line sets them
N = 32
g = H // K

def step_a(caches, i, q, knew, vnew):
    out = 0.0
    new = []
    for l in range(L):
        kc, vc = caches[l]
        start = S // 2 + i * T
        qq = q.reshape(1, T, K, g, h)
        s_c = jnp.einsum("btkgh,bskh->bkgts", qq, kc)
        s_n = jnp.einsum("btkgh,bskh->bkgts", qq, knew)
        w = jax.nn.softmax(jnp.concatenate([s_c, s_n], -1), -1)
        o = jnp.einsum("bkgts,bskh->btkgh", w[..., :S], vc) + jnp.einsum("bkgts,bskh->btkgh", w[..., S:], vnew)
        out = out + o.sum()
        kc = jax.lax.dynamic_update_slice_in_dim(kc, knew, start, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, vnew, start, axis=1)
        new.append((kc, vc))
    return new, out

def step_b(caches, i, q, knew, vnew):
    out = 0.0
    new = []
    kn = knew.transpose(0, 2, 3, 1)  # [B,K,h,T]
    vn = vnew.transpose(0, 2, 1, 3)  # [B,K,T,h]
    for l in range(L):
        kc, vc = caches[l]  # [B,K,h,S], [B,K,S,h]
        start = S // 2 + i * T
        qq = q.reshape(1, T, K, g, h).transpose(0, 2, 1, 3, 4).reshape(1, K, T * g, h)  # fold T x g
        s_c = jnp.einsum("bkqh,bkhs->bkqs", qq, kc)
        s_n = jnp.einsum("bkqh,bkhs->bkqs", qq, kn)
        w = jax.nn.softmax(jnp.concatenate([s_c, s_n], -1), -1)
        o = jnp.einsum("bkqs,bksh->bkqh", w[..., :S], vc) + jnp.einsum("bkqs,bksh->bkqh", w[..., S:], vn)
        out = out + o.sum()
        kc = jax.lax.dynamic_update_slice_in_dim(kc, kn, start, axis=3)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, vn, start, axis=2)
        new.append((kc, vc))
    return new, out

def run(step, shapes):
    key = jax.random.key(0)
    caches = [(jnp.zeros(shapes[0], jnp.float32), jnp.zeros(shapes[1], jnp.float32)) for _ in range(L)]
    q = jax.random.normal(key, (1, T, H * h))
    knew = jax.random.normal(key, (1, T, K, h)); vnew = knew * 0.5

    def loop(caches):
        def body(i, c):
            caches, acc = c
            caches, o = step(caches, i, q, knew, vnew)
            return caches, acc + o
        return jax.lax.fori_loop(0, N, body, (caches, 0.0))

    f = jax.jit(loop, donate_argnums=(0,))
    txt = f.lower(caches).compile().as_text()
    shp = "f32[%s]" % ",".join(map(str, shapes[0]))
    copies = len(re.findall(r"= f32\[[0-9,]+\]\{[0-9,]+\} copy\(", txt))
    transposes = len(re.findall(r"transpose\(", txt))
    times = []
    for _ in range(5):
        t0 = time.perf_counter(); caches, acc = f(caches); jax.block_until_ready(acc); times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / N * 1e3, copies, transposes

if __name__ == "__main__":
    S = int(sys.argv[1]) if len(sys.argv) > 1 else S
    T = int(sys.argv[2]) if len(sys.argv) > 2 else T
    a = run(step_a, ((1, S, K, h), (1, S, K, h)))
    b = run(step_b, ((1, K, h, S), (1, K, S, h)))
    print(f"S={S} T={T}: layout A [B,S,K,h]: {a[0]:.2f} ms/step (copy ops {a[1]}, transposes {a[2]}); "
          f"layout B K[B,K,h,S] V[B,K,S,h]: {b[0]:.2f} ms/step (copy ops {b[1]}, transposes {b[2]})")
