"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2) as pure functions over a params pytree.

Params layout (Hugging Face conventions: ``y = x @ W`` with ``W[in, out]``; Q/K in the
"rotate_half" RoPE layout)::

    {"embed": [V, D],
     "layers": [{"attn_norm": [D], "wq": [D, H*hd], "wk": [D, KV*hd], "wv": [D, KV*hd],
                 "wo": [H*hd, D], "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F],
                 "w_down": [F, D]}, ...],          # one dict per layer, unrolled
     "final_norm": [D],
     "lm_head": [D, V]}                            # absent when embeddings are tied

Layers are a Python list, not stacked: DESIGN.md measured unrolled layers 1.5x faster than
``lax.scan`` over stacked weights on H200; the price is compile time linear in depth.

Shape letters: B batch, T new tokens, S cache slots, D model width, H query heads, K KV heads,
G = H / K query heads per KV head, h head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache, write
from jaxspec.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019), statistics in float32: ``x / rms(x) * weight``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), "rotate_half" layout.

    Args:
      x: ``[B, T, N, h]`` queries or keys.
      positions: int32 ``[B, T]`` absolute positions.
      theta: RoPE base.
    """
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float32) / h))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, h/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
    """Grouped-query attention of new queries over the whole cache, causal by position.

    Args:
      q: ``[B, T, H, h]``; k, v: ``[B, S, K, h]`` (cache, new tokens already written).
      positions: int32 ``[B, T]``; query ``t`` sees cache slots ``s <= positions[b, t]``, so
        stale slots past a sequence's length are never read.

    Returns:
      ``[B, T, H * h]``.
    """
    b, t, n_heads, h = q.shape
    n_kv = k.shape[2]
    q = q.reshape(b, t, n_kv, n_heads // n_kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) / np.sqrt(h)
    visible = jnp.arange(k.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", weights, v)
    return out.reshape(b, t, n_heads * h)


def _block(layer: dict, x, positions, k_cache, v_cache, config: ModelConfig, visible_slots: int | None):
    b, t, _ = x.shape
    hd = config.head_dim
    with jax.named_scope("attention"):
        y = rms_norm(x, layer["attn_norm"], config.norm_eps)
        q = (y @ layer["wq"]).reshape(b, t, config.n_heads, hd)
        k = (y @ layer["wk"]).reshape(b, t, config.n_kv_heads, hd)
        v = (y @ layer["wv"]).reshape(b, t, config.n_kv_heads, hd)
        q = rope(q, positions, config.rope_theta)
        k = rope(k, positions, config.rope_theta)
        k_cache = write(k_cache, k, positions[:, 0])
        v_cache = write(v_cache, v, positions[:, 0])
        k_seen, v_seen = k_cache[:, :visible_slots], v_cache[:, :visible_slots]
        x = x + attention(q, k_seen, v_seen, positions) @ layer["wo"]
    with jax.named_scope("mlp"):
        y = rms_norm(x, layer["mlp_norm"], config.norm_eps)
        x = x + (jax.nn.silu(y @ layer["w_gate"]) * (y @ layer["w_up"])) @ layer["w_down"]
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
    x = jnp.take(params["embed"], tokens, axis=0)
    ks, vs = [], []
    for i, layer in enumerate(params["layers"][: config.n_layers]):
        with jax.named_scope(f"layer_{i}"):
            x, k, v = _block(layer, x, positions, cache.k[i], cache.v[i], config, visible_slots)
        ks.append(k)
        vs.append(v)
    x = rms_norm(x, params["final_norm"], config.norm_eps)
    return x, KVCache(k=tuple(ks), v=tuple(vs))


def logits_from_hidden(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Output head: float32 logits ``[..., V]`` from final hidden states ``[..., D]``."""
    if config.tie_embeddings:
        out = jnp.einsum("...d,vd->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("...d,dv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
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

    def dense(shape, fan_in):
        return (jax.random.normal(next(keys), shape) * scale / np.sqrt(fan_in)).astype(dtype)

    layers = []
    for _ in range(config.n_layers):
        layer = {name: dense(shape, shape[0]) for name, shape in shapes.items()}
        layer["attn_norm"] = jnp.ones((d,), dtype)
        layer["mlp_norm"] = jnp.ones((d,), dtype)
        layers.append(layer)
    params = {"embed": jax.random.normal(next(keys), (config.vocab_size, d)).astype(dtype), "layers": layers,
              "final_norm": jnp.ones((d,), dtype)}
    if not config.tie_embeddings:
        params["lm_head"] = dense((d, config.vocab_size), d)
    return params
