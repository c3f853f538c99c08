"""Decoder-only transformer as pure functions over a params pytree: the Llama family (Llama 2/3,
Mistral, Qwen2, Qwen3, SmolLM2) and Gemma 3, one forward with config switches
(``ModelConfig``: q/k/v bias, q/k norm, RoPE scaling, sliding-window layers with their own RoPE
base, sandwich norms, embedding scale, GeGLU, final-logit soft-capping).

Params layout (Hugging Face conventions: ``y = x @ W`` with ``W[in, out]``; Q/K in the
"rotate_half" RoPE layout)::

    {"embed": [V, D],
     "layers": [{"attn_norm": [D], "wq": [D, H*hd], "wk": [D, KV*hd], "wv": [D, KV*hd],
                 "wo": [H*hd, D], "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F],
                 "w_down": [F, D],
                 # attn_bias:      "bq": [H*hd], "bk": [KV*hd], "bv": [KV*hd]
                 # qk_norm:        "q_norm": [hd], "k_norm": [hd]
                 # sandwich_norms: "post_attn_norm": [D], "post_mlp_norm": [D]
                 }, ...],          # one dict per layer, unrolled
     "final_norm": [D],
     "lm_head": [D, V]}                            # absent when embeddings are tied

Sliding-window layers (Mistral, Gemma 3 local layers) keep the full static-shape cache and
mask keys older than the window by position, so a T-token verify sees exactly what T
one-token steps would, and speculation stays lossless (a ring buffer would save memory but
make rejected drafts overwrite live keys).

Tensor parallelism (``config.tp_axis`` set, inside ``jax.shard_map``; ``jaxspec.sharding``
prepares the params): each shard holds its heads' columns of wq/wk/wv, the matching rows of
wo, a slice of the MLP width and a slice of the vocabulary of embed/lm_head, and the model
sums partial results over the axis after wo and w_down (Megatron-LM, Shoeybi et al. 2019,
Sec. 3), looks embeddings up in the local vocabulary slice and sums, and gathers the local
logits into the full vocabulary.

Layers are a Python list, not stacked: DESIGN.md measured unrolled layers 1.5x faster than
``lax.scan`` over stacked weights on H200; the price is compile time linear in depth.

Shape letters: B batch, T new tokens, S cache slots, D model width, H query heads, K KV heads,
G = H / K query heads per KV head, h head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache, write
from jaxspec.config import ModelConfig
from jaxspec.models import rope


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis, in float32:
    ``x / rms(x) * (offset + weight)`` (Gemma stores ``weight - 1``: offset 1)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *, scale: float = 0.0, window: int = 0,
) -> jax.Array:
    """Grouped-query attention of new queries over the whole cache, causal by position.

    Args:
      q: ``[B, T, H, h]``; k, v: ``[B, S, K, h]`` (cache, new tokens already written).
      positions: int32 ``[B, T]``; query ``t`` sees cache slots ``s <= positions[b, t]``, so
        stale slots past a sequence's length are never read.
      scale: score scale; 0 means ``h ** -0.5``.
      window: > 0: query ``t`` also needs ``positions[b, t] - s < window`` (sliding window,
        the same rule as transformers' ``sliding_window_overlay``).

    Returns:
      ``[B, T, H * h]``.
    """
    b, t, n_heads, h = q.shape
    n_kv = k.shape[2]
    q = q.reshape(b, t, n_kv, n_heads // n_kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * scale if scale else scores / np.sqrt(h)
    slots = jnp.arange(k.shape[1])[None, None, :]
    visible = slots <= positions[:, :, None]  # [B, T, S]
    if window:
        visible &= slots > positions[:, :, None] - window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v)
    return out.reshape(b, t, n_heads * h)


def _all_reduce(x: jax.Array, config: ModelConfig) -> jax.Array:
    """Sum of the shards' partial results over ``config.tp_axis``; the identity unsharded."""
    return jax.lax.psum(x, config.tp_axis) if config.tp_axis else x


def embed(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Embeddings ``[B, T, D]`` of ``tokens`` int32 ``[B, T]``, times ``config.embed_scale``.

    Under tensor parallelism ``params["embed"]`` is this shard's vocabulary slice
    ``[V / n, D]`` (shard i holds ids ``i * V / n ..``): ids outside it give zeros and the
    sum over shards has exactly one non-zero term (Megatron-LM's parallel embedding).
    """
    table = params["embed"]
    if config.tp_axis:
        v_local = table.shape[0]
        local = tokens - jax.lax.axis_index(config.tp_axis) * v_local
        mine = (local >= 0) & (local < v_local)
        x = jnp.where(mine[..., None], jnp.take(table, jnp.clip(local, 0, v_local - 1), axis=0), 0)
        x = jax.lax.psum(x, config.tp_axis)
    else:
        x = jnp.take(table, tokens, axis=0)
    if config.embed_scale != 1.0:
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    return x


def _block(layer: dict, i: int, x, positions, k_cache, v_cache, config: ModelConfig, visible_slots: int | None):
    b, t, _ = x.shape
    hd, eps, off = config.head_dim, config.norm_eps, config.norm_offset
    with jax.named_scope("attention"):
        y = rms_norm(x, layer["attn_norm"], eps, off)
        q, k, v = y @ layer["wq"], y @ layer["wk"], y @ layer["wv"]
        if config.attn_bias:
            q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
        q = q.reshape(b, t, config.n_heads, hd)
        k = k.reshape(b, t, config.n_kv_heads, hd)
        v = v.reshape(b, t, config.n_kv_heads, hd)
        if config.qk_norm:
            q, k = rms_norm(q, layer["q_norm"], eps, off), rms_norm(k, layer["k_norm"], eps, off)
        freqs = rope.layer_inv_freq(config, i)
        q, k = rope.apply(q, positions, freqs), rope.apply(k, positions, freqs)
        k_cache = write(k_cache, k, positions[:, 0])
        v_cache = write(v_cache, v, positions[:, 0])
        k_seen, v_seen = k_cache[:, :visible_slots], v_cache[:, :visible_slots]
        window = config.sliding_window if config.is_sliding(i) else 0
        y = attention(q, k_seen, v_seen, positions, scale=config.attn_scale, window=window) @ layer["wo"]
        y = _all_reduce(y, config)
        if config.sandwich_norms:
            y = rms_norm(y, layer["post_attn_norm"], eps, off)
        x = x + y
    with jax.named_scope("mlp"):
        y = rms_norm(x, layer["mlp_norm"], eps, off)
        act = jax.nn.silu if config.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
        y = _all_reduce((act(y @ layer["w_gate"]) * (y @ layer["w_up"])) @ layer["w_down"], config)
        if config.sandwich_norms:
            y = rms_norm(y, layer["post_mlp_norm"], eps, off)
        x = x + y
    return x, k_cache, v_cache


def forward_hidden(
    params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: KVCache,
    visible_slots: int | None = None,
):
    """Run the decoder over new tokens, writing their keys and values into the cache.

    Serves prefill (T = prompt length), decode (T = 1) and verify (T = gamma + 1) alike.

    Args:
      params: the pytree described in the module docstring.
      config: its ``ModelConfig``.
      tokens: int32 ``[B, T]``.
      positions: int32 ``[B, T]``, contiguous per row (``positions[b, t] = start[b] + t``);
        the tokens are written to cache slots ``start[b] .. start[b] + T - 1``.
      cache: ``KVCache`` with ``config.n_layers`` layers and ``S >= max(positions) + 1``.
      visible_slots: static bound ``> max(positions)``: attention reads only cache slots below
        it. Prefill passes the prompt length (keys past it are all masked anyway), which saves
        scoring ``T x S`` instead of ``T x T`` pairs; None reads the whole cache.

    Returns:
      ``(hidden [B, T, D] after the final norm, updated cache)``.
    """
    x = embed(params, config, tokens)
    ks, vs = [], []
    for i, layer in enumerate(params["layers"][: config.n_layers]):
        with jax.named_scope(f"layer_{i}"):
            x, k, v = _block(layer, i, x, positions, cache.k[i], cache.v[i], config, visible_slots)
        ks.append(k)
        vs.append(v)
    x = rms_norm(x, params["final_norm"], config.norm_eps, config.norm_offset)
    return x, KVCache(k=tuple(ks), v=tuple(vs))


def logits_from_hidden(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Output head: float32 logits ``[..., V]`` from final hidden states ``[..., D]``, soft-capped
    (``cap * tanh(logits / cap)``) when ``config.final_softcap`` > 0.

    Under tensor parallelism each shard computes its vocabulary slice and the slices are
    gathered over ``config.tp_axis``, so every shard returns the full ``[..., V]`` (sampling
    and acceptance then run unchanged; why gathering: ``jaxspec.sharding``).
    """
    if config.tie_embeddings:
        out = jnp.einsum("...d,vd->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("...d,dv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
    if config.final_softcap:
        out = config.final_softcap * jnp.tanh(out / config.final_softcap)
    if config.tp_axis:
        out = jax.lax.all_gather(out, config.tp_axis, axis=out.ndim - 1, tiled=True)
    return out


def forward(params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: KVCache):
    """``forward_hidden`` plus the head: ``(logits f32[B, T, V], hidden [B, T, D], cache)``."""
    hidden, cache = forward_hidden(params, config, tokens, positions, cache)
    return logits_from_hidden(params, config, hidden), hidden, cache


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.5) -> dict:
    """Random params for tests and benchmarks: normal weights scaled by ``scale / sqrt(fan_in)``.

    A larger ``scale`` gives peakier next-token distributions (tiny test models use 0.5-2).
    """
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    shapes = {
        "wq": (d, config.n_heads * hd), "wk": (d, config.n_kv_heads * hd), "wv": (d, config.n_kv_heads * hd),
        "wo": (config.n_heads * hd, d), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    keys = iter(jax.random.split(key, 2 + config.n_layers * len(shapes)))
    extra_keys = iter(jax.random.split(jax.random.fold_in(key, 1), 3 * config.n_layers))

    def dense(shape, fan_in, keys=keys):
        return (jax.random.normal(next(keys), shape) * scale / np.sqrt(fan_in)).astype(dtype)

    def norm(shape):  # the identity map, whatever the stored offset
        return jnp.full(shape, 1.0 - config.norm_offset, dtype)

    layers = []
    for i in range(config.n_layers):
        layer = {name: dense(shape, shape[0]) for name, shape in shapes.items()}
        for name, shape in param_shapes(config)["layers"][i].items():
            if name not in layer:  # norms: the identity; q/k/v biases: random like a weight row
                layer[name] = norm(shape) if "norm" in name else dense(shape, d, extra_keys)
        layers.append(layer)
    params = {"embed": jax.random.normal(next(keys), (config.vocab_size, d)).astype(dtype), "layers": layers,
              "final_norm": norm((d,))}
    if not config.tie_embeddings:
        params["lm_head"] = dense((d, config.vocab_size), d)
    return params


def param_shapes(config: ModelConfig) -> dict:
    """The params pytree of ``config`` with shape tuples as leaves (the layout above)."""
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    q_out, kv_out = config.n_heads * hd, config.n_kv_heads * hd
    layer = {"attn_norm": (d,), "wq": (d, q_out), "wk": (d, kv_out), "wv": (d, kv_out), "wo": (q_out, d),
             "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    if config.attn_bias:
        layer.update(bq=(q_out,), bk=(kv_out,), bv=(kv_out,))
    if config.qk_norm:
        layer.update(q_norm=(hd,), k_norm=(hd,))
    if config.sandwich_norms:
        layer.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    shapes = {"embed": (config.vocab_size, d), "layers": [dict(layer) for _ in range(config.n_layers)],
              "final_norm": (d,)}
    if not config.tie_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes
