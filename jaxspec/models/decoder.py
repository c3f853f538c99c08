"""The decoder: one decoder-only transformer as pure functions over a params pytree, serving
the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) and Gemma 3 through config switches
(``ModelConfig``: q/k/v bias, q/k norm, RoPE scaling, sliding-window layers with their own RoPE
base, sandwich norms, embedding scale, GeGLU, final-logit soft-capping).

Params layout (Hugging Face conventions: ``y = x @ W`` with ``W[in, out]``; Q/K in the
"rotate_half" RoPE layout)::

    {"embed": [V, D],
     "layers": [{"attn_norm": [D], "wq": [D, H*h], "wk": [D, K*h], "wv": [D, K*h],
                 "wo": [H*h, D], "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F],
                 "w_down": [F, D],
                 # attn_bias:      "bq": [H*h], "bk": [K*h], "bv": [K*h]
                 # qk_norm:        "q_norm": [h], "k_norm": [h]
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

Layers are a Python list, not stacked: docs/design.md measured unrolled layers 1.5x faster than
``lax.scan`` over stacked weights on H200; the price is compile time linear in depth.

Shape letters: the package legend (``jaxspec``): B batch, T new tokens, S cache slots, D model
width, H query heads, K KV heads, h head dim, F MLP width, V vocabulary; in einsum strings the
lower-case g is H / K, the query heads sharing one KV head.

``forward`` is the one interface the engine and every drafter use (prefill, decode, chain and
tree verification, drafting): tokens at any positions, written at any cache offset, with an
optional tree mask, returning logits, the final hidden state and the outputs of requested
layers (what EAGLE-3 and Medusa heads read).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache, write
from jaxspec.config import ModelConfig
from jaxspec.models import layout, rope
from jaxspec.models.attention import attention
from jaxspec.models.linear import linear, linears


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis, in float32:
    ``x / rms(x) * (offset + weight)`` (Gemma stores ``weight - 1``: offset 1)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (offset + weight.astype(jnp.float32))).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeMask:
    """Which cache slots the new tokens see, when they are not a contiguous run (a draft tree).

    Slots below ``start[b]`` (the committed text) are visible to every query; the W slots
    ``start[b] .. start[b] + W - 1`` (the window) are visible to query t where
    ``visible[b, t, w]``; slots past the window are not. The window slots hold tokens at
    ``positions[b, w]`` (for RoPE they were written with, and for sliding windows).

    Attributes:
      start: int32 ``[B]``; visible: bool ``[B, T, W]``; positions: int32 ``[B, W]``.
    """

    start: jax.Array
    visible: jax.Array
    positions: jax.Array


def slots_visible(positions: jax.Array, n_slots: int, mask: TreeMask | None, window: int) -> jax.Array:
    """bool ``[B, T, S]``: which cache slots each query may attend to."""
    slots = jnp.arange(n_slots)[None, None, :]
    if mask is None:  # contiguous: slot s holds position s, causal by position
        key_pos = slots
        visible = slots <= positions[:, :, None]
    else:
        w = mask.visible.shape[-1]
        rel = slots - mask.start[:, None, None]  # [B, 1, S]
        in_window = (rel >= 0) & (rel < w)
        idx = jnp.clip(rel, 0, w - 1)
        seen = jnp.take_along_axis(mask.visible, jnp.broadcast_to(idx, positions.shape + (n_slots,)), axis=2)
        visible = (rel < 0) | (in_window & seen)
        key_pos = jnp.where(in_window, jnp.take_along_axis(mask.positions, idx[:, 0], axis=1)[:, None], slots)
    if window:
        visible &= key_pos > positions[:, :, None] - window
    return visible


def _all_reduce(x: jax.Array, config: ModelConfig) -> jax.Array:
    """Sum of the shards' partial results over ``config.tp_axis``; the identity unsharded."""
    return jax.lax.psum(x, config.tp_axis) if config.tp_axis else x


def embed(params: dict, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Embeddings ``[B, T, D]`` of ``tokens`` int32 ``[B, T]``, times ``config.embed_scale``.

    Under tensor parallelism ``params["embed"]`` is this shard's vocabulary slice
    ``[V / n, D]`` (shard i holds ids ``i * V / n ..``): ids outside it give zeros and the
    sum over shards has exactly one non-zero term (Megatron-LM's parallel embedding). The table
    may be ``layout.Panels`` (a tied head laid out for the CPU kernel): rows read in place.
    """
    table = params["embed"]
    if config.tp_axis:
        v_local = table.shape[0]
        local = tokens - jax.lax.axis_index(config.tp_axis) * v_local
        mine = (local >= 0) & (local < v_local)
        x = jnp.where(mine[..., None], layout.take(table, jnp.clip(local, 0, v_local - 1)), 0)
        x = jax.lax.psum(x, config.tp_axis)
    else:
        x = layout.take(table, tokens)
    if config.embed_scale != 1.0:
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    return x


def self_attention(layer: dict, i: int, y, positions, write_at, k_cache, v_cache, config: ModelConfig, visible):
    """Attention sub-block of layer ``i`` over an already normed input ``y [B, T, Din]``
    (``Din`` is D in a decoder block, 2D in an EAGLE-3 layer, ``jaxspec.models.eagle3``): q/k/v
    projections (+ biases, q/k norms), RoPE at ``positions``, the new keys and values written
    at ``write_at``, attention over the visible slots (``visible``: ``{is_sliding: [B, T, S]}``),
    output projection. Returns ``(out [B, T, D], k_cache, v_cache)``, before any residual add.

    With ``write_at`` None the new keys and values are not written: the tokens attend to the
    cache (``visible[s][0]``, ``[B, T, S]``) and to each other (``visible[s][1]``,
    ``[B, T, T]``), and ``(out, k_new, v_new)`` come back, ``[B, T, K, h]`` each."""
    b, t, _ = y.shape
    hd, eps, off = config.head_dim, config.norm_eps, config.norm_offset
    q, k, v = linears(y, (layer["wq"], layer["wk"], layer["wv"]))
    if config.attn_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(b, t, config.n_heads, hd)
    k = k.reshape(b, t, config.n_kv_heads, hd)
    v = v.reshape(b, t, config.n_kv_heads, hd)
    if config.qk_norm:
        q, k = rms_norm(q, layer["q_norm"], eps, off), rms_norm(k, layer["k_norm"], eps, off)
    freqs = rope.layer_inv_freq(config, i)
    q, k = rope.apply(q, positions, freqs), rope.apply(k, positions, freqs)
    seen = visible[config.is_sliding(i)]
    if write_at is None:  # deferred: attend to the cache as it is and to the new entries apart
        seen, seen_new = seen
        n = seen.shape[-1]
        y = attention(q, k_cache[:, :n], v_cache[:, :n], seen, scale=config.attn_scale, extra=(k, v, seen_new))
        return _all_reduce(linear(y, layer["wo"]), config), k, v
    k_cache = write(k_cache, k, write_at)
    v_cache = write(v_cache, v, write_at)
    n = seen.shape[-1]
    y = linear(attention(q, k_cache[:, :n], v_cache[:, :n], seen, scale=config.attn_scale), layer["wo"])
    return _all_reduce(y, config), k_cache, v_cache


def mlp_residual(layer: dict, x, config: ModelConfig):
    """``x + MLP(norm(x))``: the gated MLP sub-block (SwiGLU or GeGLU) with its residual add."""
    eps, off = config.norm_eps, config.norm_offset
    y = rms_norm(x, layer["mlp_norm"], eps, off)
    act = jax.nn.silu if config.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    gate, up = linears(y, (layer["w_gate"], layer["w_up"]))
    y = _all_reduce(linear(act(gate) * up, layer["w_down"]), config)
    if config.sandwich_norms:
        y = rms_norm(y, layer["post_mlp_norm"], eps, off)
    return x + y


def visibility(positions, n_slots: int, mask, config: ModelConfig, write: bool = True) -> dict:
    """``{is_sliding: bool [B, T, S]}``: the slots each query sees, per kind of layer; with
    ``write`` False (the new tokens kept apart from the cache, ``mask`` required) the pair
    ``([B, T, S], [B, T, T])``: the committed slots below ``mask.start``, and the new tokens."""
    kinds = {config.is_sliding(i) for i in range(config.n_layers)}
    if write:
        return {s: slots_visible(positions, n_slots, mask, config.sliding_window if s else 0) for s in kinds}
    out = {}
    for s in kinds:
        window = config.sliding_window if s else 0
        slots = jnp.arange(n_slots)[None, None, :]
        committed = jnp.broadcast_to(slots < mask.start[:, None, None], positions.shape + (n_slots,))
        new = mask.visible
        if window:
            committed &= slots > positions[:, :, None] - window
            new &= mask.positions[:, None, :] > positions[:, :, None] - window
        out[s] = (committed, new)
    return out


def _block(layer: dict, i: int, x, positions, write_at, k_cache, v_cache, config: ModelConfig, visible):
    eps, off = config.norm_eps, config.norm_offset
    with jax.named_scope("attention"):
        y = rms_norm(x, layer["attn_norm"], eps, off)
        y, k_cache, v_cache = self_attention(layer, i, y, positions, write_at, k_cache, v_cache, config, visible)
        if config.sandwich_norms:
            y = rms_norm(y, layer["post_attn_norm"], eps, off)
        x = x + y
    with jax.named_scope("mlp"):
        x = mlp_residual(layer, x, config)
    return x, k_cache, v_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """What ``forward`` returns.

    Attributes:
      logits: float32 ``[B, T, V]`` (None with ``head=False``).
      hidden: ``[B, T, D]``, the final hidden state (after the final norm).
      captured: tuple of ``[B, T, D]``, the residual stream after each layer in ``capture``
        (layer i's output, Hugging Face's ``hidden_states[i + 1]``), in ``capture``'s order.
      cache: the updated ``KVCache``; with ``write=False`` the new tokens' own keys and values
        instead, ``[B, T, K, h]`` per layer, for the caller to write (``KVCache.write``).
    """

    logits: jax.Array | None
    hidden: jax.Array
    captured: tuple
    cache: KVCache


def forward(
    params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: KVCache, *,
    write_at: jax.Array | None = None, mask: TreeMask | None = None, capture: tuple[int, ...] = (),
    head: bool = True, visible_slots: int | None = None, write: bool = True,
) -> ForwardOutput:
    """Run the decoder over T new tokens, writing their keys and values into the cache: the one
    interface for prefill (T = prompt length), decode (T = 1), chain and tree verification
    (T = N + 1) and drafting.

    Args:
      params: the pytree described in the module docstring; config: its ``ModelConfig``.
      tokens: int32 ``[B, T]``.
      positions: int32 ``[B, T]``, each token's position (RoPE, causality): contiguous
        ``start + t`` for a run of text, ``committed length + depth`` for a tree.
      cache: ``KVCache`` with ``config.n_layers`` layers.
      write_at: int32 ``[B]``: the tokens go to cache slots ``write_at .. write_at + T - 1``;
        default ``positions[:, 0]``. The caller guarantees ``write_at + T <= S``.
      mask: None for a contiguous run (query t sees slots ``<= positions[b, t]``), or a
        ``TreeMask`` (the ancestors of each node).
      capture: layer ids whose outputs to return (``ForwardOutput.captured``), e.g. the low,
        middle and high layers an EAGLE-3 head reads.
      head: compute the logits (False: only hidden states, e.g. prefill, which needs the last
        prompt position's logits only: ``logits_from_hidden``).
      visible_slots: static bound on the slots any query sees (prefill passes the padded prompt
        length: scores ``T x T`` pairs instead of ``T x S``); None reads the whole cache.
      write: False leaves the cache as it is (verification inside a conditional, where an
        updated cache would cost XLA a copy of it per step): the tokens see the committed
        slots below ``mask.start`` and each other through ``mask.visible`` (which must then be
        ``[B, T, T]``), and ``ForwardOutput.cache`` holds their own keys and values.

    Returns:
      ``ForwardOutput``.

    Raises:
      ValueError: a ``capture`` layer id outside ``[0, n_layers)``; ``write=False`` without a
        ``mask`` over the T new tokens.
    """
    bad = [i for i in capture if not 0 <= i < config.n_layers]
    if bad:
        raise ValueError(f"capture layer {bad[0]} outside [0, {config.n_layers}) for {config.name}")
    if not write and (mask is None or mask.visible.shape[-1] != tokens.shape[1]):
        raise ValueError("forward(write=False) needs a TreeMask over the new tokens (visible [B, T, T])")
    write_at = None if not write else positions[:, 0] if write_at is None else write_at
    n_slots = cache.max_len if visible_slots is None else visible_slots
    visible = visibility(positions, n_slots, mask, config, write)
    x = embed(params, config, tokens)
    ks, vs, captured = [], [], {}
    for i, layer in enumerate(params["layers"][: config.n_layers]):
        with jax.named_scope(f"layer_{i}"):
            x, k, v = _block(layer, i, x, positions, write_at, cache.k[i], cache.v[i], config, visible)
        ks.append(k)
        vs.append(v)
        if i in capture:
            captured[i] = x
    hidden = rms_norm(x, params["final_norm"], config.norm_eps, config.norm_offset)
    logits = logits_from_hidden(params, config, hidden) if head else None
    return ForwardOutput(logits, hidden, tuple(captured[i] for i in capture), KVCache(k=tuple(ks), v=tuple(vs)))


def logits_from_hidden(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Output head: float32 logits ``[..., V]`` from final hidden states ``[..., D]``, soft-capped
    (``cap * tanh(logits / cap)``) when ``config.final_softcap`` > 0.

    The products go through ``jaxspec.models.linear`` (on CPU the small-T kernel, whose sums
    do not depend on the number of rows). Under tensor parallelism each shard computes its vocabulary slice and the slices are
    gathered over ``config.tp_axis``, so every shard returns the full ``[..., V]`` (sampling
    and acceptance then run unchanged; why gathering: ``jaxspec.sharding``).
    """
    if config.tie_embeddings:
        out = linear(hidden, params["embed"], transposed=True, out_dtype=jnp.float32)
    else:
        out = linear(hidden, params["lm_head"], out_dtype=jnp.float32)
    if config.final_softcap:
        out = config.final_softcap * jnp.tanh(out / config.final_softcap)
    if config.tp_axis:
        out = jax.lax.all_gather(out, config.tp_axis, axis=out.ndim - 1, tiled=True)
    return out


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
