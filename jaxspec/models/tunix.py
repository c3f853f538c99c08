"""Tunix's flax.nnx decoders (``google-tunix`` on PyPI: ``tunix.models.qwen2``, ``qwen3``) as a
target model (``jaxspec.models.target``).

    from tunix.models.qwen2 import model as qwen2
    from jaxspec.models.tunix import TunixTarget

    module = qwen2.Qwen2(qwen2.ModelConfig.qwen2p5_0p5b(), rngs=nnx.Rngs(0))
    target, params = TunixTarget.split(module, name="qwen2.5-0.5b", max_position=32768, eos_ids=(151643,))
    out = jaxspec.generate(params, prompt_ids, config=target, drafter=jaxspec.HistoryDrafter())

Tunix's decoders take ``(input_tokens, positions, cache, attention_mask, output_hidden_states)``
with an explicit ``[B, L, cache_length]`` mask, which is all a draft tree's verify needs. Their
cache writes a whole batch at one index (``end_index``, the first row's), so the target runs
row by row (``MaskedTarget.row_offsets`` False), as the gemma library's does; the cache pytree
jaxspec carries is Tunix's without ``end_index`` (``layer_i``: ``k``, ``v`` ``[B, S, K, h]``).
The final hidden states are the ones the module sows with ``output_hidden_states=True``; its
logits of every position are unused, and ``jit`` drops them.

``split`` separates the module into its graph (part of the compiled program's key) and its
``nnx.State`` (the params pytree): a training loop's new weights of the same shapes reuse the
compiled program. ``jaxspec.tunix_rollout`` uses this target as Tunix's rollout engine.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxspec.models import layout
from jaxspec.models.target import _MaskedForward


@dataclasses.dataclass(frozen=True)
class TunixTarget(_MaskedForward):
    """A Tunix decoder (a flax.nnx module) as a ``TargetModel``.

    Attributes:
      graphdef: the module's ``nnx.GraphDef`` (``split``); params are its ``nnx.State``. Tunix's
        configs are mutable dataclasses, so the graph is unhashable: the target compares and
        hashes by ``graph_id`` (the graph's identity) instead; a rollout keeps one target, so
        its calls share one compiled program.
      name, vocab_size, max_position, bos_id, eos_ids (keywords): as in ``jaxspec.models.TargetModel``.
    """

    graphdef: Any = dataclasses.field(compare=False)
    graph_id: int = dataclasses.field(default=0, kw_only=True)
    row_offsets: bool = dataclasses.field(default=False, kw_only=True)  # one cache write index per batch

    @classmethod
    def split(cls, module: nnx.Module, *, name: str, max_position: int, bos_id: int = -1,
              eos_ids: tuple[int, ...] = ()) -> tuple[TunixTarget, nnx.State]:
        """``(TunixTarget, params)`` of ``module``; the vocabulary size is its config's.

        Raises:
          ValueError: a module whose ``__call__`` cannot return its final hidden states (no
            ``output_hidden_states`` argument: Tunix's qwen2 and qwen3 have it), or with
            sliding-window layers (Tunix's gemma3: its band assumes a prefill from slot 0).
        """
        if "output_hidden_states" not in inspect.signature(type(module).__call__).parameters:
            raise ValueError(f"{type(module).__name__}.__call__ has no output_hidden_states argument: TunixTarget "
                             "reads the final hidden states the module sows (Tunix's Qwen2, Qwen3)")
        if getattr(module.config, "sliding_window_size", None) is not None:
            raise ValueError(f"{type(module).__name__} has sliding-window layers, whose band Tunix builds from the "
                             "query's index in the call (right for a prefill from slot 0, not for a verify window "
                             "later in the text): TunixTarget runs Tunix's Qwen2 and Qwen3")
        graphdef, params = nnx.split(module)
        return cls(graphdef, graph_id=id(graphdef), name=name, vocab_size=int(module.config.vocab_size),
                   max_position=int(max_position), bos_id=int(bos_id), eos_ids=tuple(int(e) for e in eos_ids)), params

    def apply(self, params, tokens, positions, cache, write_at, mask):
        module = nnx.merge(self.graphdef, params)
        full = {name: {**layer, "end_index": write_at} for name, layer in cache.items()}
        _, new_cache = module(tokens, positions, full, mask, output_hidden_states=True)
        sown = nnx.pop(module, nnx.Intermediate)
        hidden = _leaf(sown["all_hidden_states"])
        return hidden, {name: _without_index(layer) for name, layer in new_cache.items()}

    def head(self, params, hidden):
        module = nnx.merge(self.graphdef, params)
        x = hidden.reshape(-1, 1, hidden.shape[-1])  # Tunix's heads take [B, T, D]; the engine's hidden is [..., D]
        if getattr(module.config, "use_tied_embedding", True) or not hasattr(module, "lm_head"):
            logits = module.embedder.decode(x)
        else:
            logits = module.lm_head(x)
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])

    def make_cache(self, params, batch: int, max_len: int):
        module = nnx.merge(self.graphdef, params)
        dtype = module.embedder.input_embedding.value.dtype
        if hasattr(module, "init_cache"):
            cache = module.init_cache(batch, max_len, dtype)
        else:  # Tunix's sampler builds the same dict for models without init_cache (qwen2)
            c = module.config
            shape = (batch, max_len, c.num_kv_heads, c.head_dim)
            cache = {f"layer_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                     for i in range(c.num_layers)}
        return {name: _without_index(layer) for name, layer in cache.items()}


def load_qwen2(module: nnx.Module, params: dict, config) -> None:
    """Write jaxspec's Qwen2 weights (``jaxspec.load(...).params``, Hugging Face conventions,
    matrices ``[in, out]``) into a Tunix ``Qwen2`` module of the same sizes, in place.

    With ``jaxspec.load`` and this, Tunix's learners train the models jaxspec packages (no hub
    download). Tunix's Qwen2 splits the attention matrices by head (``q_proj.w`` ``[D, H, h]``,
    ``o_proj.w`` ``[H, h, D]``) and stores RMSNorm scales and RoPE as Hugging Face does, so it
    is reshapes. A model with a separate output head needs ``use_tied_embedding=False`` in
    Tunix's config.

    Raises:
      ValueError: ``config`` (a jaxspec ``ModelConfig``) is not a Qwen2 model, the sizes, RoPE
        theta or norm epsilon differ, or the output heads are tied in one and not in the other.
    """
    c = module.config
    if config.family != "qwen2":
        raise ValueError(f"load_qwen2 needs a qwen2 model, got family {config.family!r}")
    mine = (config.n_layers, config.vocab_size, config.dim, config.ffn_dim, config.n_heads, config.n_kv_heads,
            config.head_dim, float(config.rope_theta), float(config.norm_eps))
    theirs = (c.num_layers, c.vocab_size, c.embed_dim, c.hidden_dim, c.num_heads, c.num_kv_heads, c.head_dim,
              float(c.rope_theta), float(c.norm_eps))
    if mine != theirs:
        raise ValueError(f"the models differ (layers, vocab, dim, ffn, heads, kv heads, head dim, RoPE theta, norm "
                         f"eps): jaxspec {mine}, Tunix {theirs}")
    if bool(config.tie_embeddings) != bool(c.use_tied_embedding):
        raise ValueError(f"jaxspec's model has tie_embeddings={config.tie_embeddings}, Tunix's config "
                         f"use_tied_embedding={c.use_tied_embedding}: build the module with "
                         f"dataclasses.replace(cfg, use_tied_embedding={bool(config.tie_embeddings)}), or use qwen2_module")
    h, kv, hd, d = c.num_heads, c.num_kv_heads, c.head_dim, c.embed_dim
    params = layout.as_arrays(params)  # jaxspec's CPU panels back to [in, out] matrices
    pure = {"embedder": {"input_embedding": params["embed"]}, "final_norm": {"w": params["final_norm"]}, "layers": {}}
    if not c.use_tied_embedding:
        pure["lm_head"] = {"w": params["lm_head"]}
    for i, layer in enumerate(params["layers"]):
        pure["layers"][i] = {
            "input_layernorm": {"w": layer["attn_norm"]},
            "post_attention_layernorm": {"w": layer["mlp_norm"]},
            "attn": {"q_proj": {"w": layer["wq"].reshape(d, h, hd)}, "k_proj": {"w": layer["wk"].reshape(d, kv, hd)},
                     "v_proj": {"w": layer["wv"].reshape(d, kv, hd)}, "o_proj": {"w": layer["wo"].reshape(h, hd, d)},
                     "q_bias": layer["bq"], "k_bias": layer["bk"], "v_bias": layer["bv"]},
            "mlp": {"gate_proj": {"kernel": layer["w_gate"]}, "up_proj": {"kernel": layer["w_up"]},
                    "down_proj": {"kernel": layer["w_down"]}},
        }
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(module, state)


def qwen2_module(model) -> nnx.Module:
    """Tunix's ``Qwen2`` holding a ``jaxspec.load``ed Qwen2's weights (``model``: a ``jaxspec.Model``,
    e.g. ``jaxspec.load("qwen2.5-coder-0.5b")``, whose output head is untied).

    The module's config is Tunix's of the same sizes (``tunix.models.qwen2.model.ModelConfig``),
    with the output head tied or not as the checkpoint's; it is built with ``nnx.eval_shape``
    (no random weights drawn first) and filled by ``load_qwen2``.

    Raises:
      ValueError: as ``load_qwen2``.
    """
    from tunix.models.qwen2 import model as qwen2

    c = model.config
    cfg = qwen2.ModelConfig(num_layers=c.n_layers, vocab_size=c.vocab_size, embed_dim=c.dim, hidden_dim=c.ffn_dim,
                            num_heads=c.n_heads, head_dim=c.head_dim, num_kv_heads=c.n_kv_heads,
                            rope_theta=int(c.rope_theta), norm_eps=c.norm_eps, use_tied_embedding=bool(c.tie_embeddings))
    module = nnx.eval_shape(lambda: qwen2.Qwen2(cfg, rngs=nnx.Rngs(0)))
    load_qwen2(module, model.params, c)
    return module


def _leaf(sown):
    """The array ``sow`` stored (a one-element tuple inside a Variable)."""
    value = sown.value if hasattr(sown, "value") else sown
    return value[-1] if isinstance(value, tuple) else value


def _without_index(layer: dict) -> dict:
    return {k: v for k, v in layer.items() if k != "end_index"}
