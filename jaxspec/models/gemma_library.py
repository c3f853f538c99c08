"""The gemma library's Gemma 3 (``gemma`` on PyPI, Google DeepMind: ``gm.nn.Gemma3_270M`` and
friends, flax linen) as a target model (``jaxspec.models.target``).

    from gemma import gm
    from jaxspec.models.gemma_library import GemmaTarget, params_from_jaxspec

    own = jaxspec.load("gemma3-270m", dtype="float32")      # the packaged GGUF
    target = GemmaTarget.of(gm.nn.Gemma3_270M(dtype=jnp.float32), own.config)
    params = params_from_jaxspec(own.params, own.config)    # the gemma library's params tree
    out = jaxspec.generate(jaxspec.Model(params, target, own.tokenizer), "Hi", drafter=jaxspec.NGramDrafter())

The library's ``Transformer.__call__(tokens, positions=, cache=, attention_mask=)`` takes an
explicit ``[B, L, cache_length]`` mask, which is all a draft tree's verify needs. Its cache
writes a whole batch at one index (``end_index``, the first row's), so the target runs row by
row (``MaskedTarget.row_offsets`` False); the cache pytree jaxspec carries is the library's
without ``end_index`` (leaves ``k``, ``v`` ``[B, S, K, h]`` and ``positions`` ``[B, S]``, the
position written in each slot, which the library's sliding-window layers read).

Weights: ``params_from_jaxspec`` maps jaxspec's layout (Hugging Face conventions, what
``jaxspec.load`` reads from a GGUF or safetensors) onto the library's einsum weights; both store
RMSNorm scales as ``weight - 1`` and use split-half RoPE, so it is reshapes and transposes.

Install: the gemma library imports kauldron, whose requirements include tensorflow;
docs/own_model.md ("The gemma library") gives the versions that run together and what they cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.models.linear import linear
from jaxspec.models.target import _MaskedForward


@dataclasses.dataclass(frozen=True)
class GemmaTarget(_MaskedForward):
    """A gemma library ``Transformer`` (a flax linen module) as a ``TargetModel``.

    Attributes:
      model: the module, e.g. ``gm.nn.Gemma3_270M(dtype=jnp.float32)``; params are its
        ``"params"`` collection (``params_from_jaxspec``, or the library's own checkpoint).
      name, vocab_size, max_position, bos_id, eos_ids (keywords): as in ``jaxspec.models.TargetModel``
        (``of`` takes them from a jaxspec ``ModelConfig`` of the same model).
    """

    model: Any
    row_offsets: bool = dataclasses.field(default=False, kw_only=True)  # one cache write index per batch

    @classmethod
    def of(cls, model, config: ModelConfig) -> GemmaTarget:
        """The target for ``model`` with ``config``'s facts (name, vocabulary, context, ids)."""
        return cls(model, name=f"{config.name} (gemma library)", vocab_size=config.vocab_size,
                   max_position=config.max_position, bos_id=config.bos_id, eos_ids=tuple(config.eos_ids))

    def apply(self, params, tokens, positions, cache, write_at, mask):
        full = {name: {**layer, "end_index": write_at} for name, layer in cache.items()}
        out = self.model.apply({"params": params}, tokens, positions=positions, cache=full, attention_mask=mask,
                               return_hidden_states=True)  # its logits are unused: jit drops them
        return out.hidden_states, {name: _without_index(layer) for name, layer in out.cache.items()}

    def head(self, params, hidden):
        # the tied embedding through jaxspec's linear, not the library's einsum: on CPU XLA's dot
        # of a few rows against the [262144, 640] table ran 8x slower per step (batch 2, 1.6 vs
        # 13.4 tok/s), and the kernel's sums do not depend on the rows (docs/cpu_kernel.md)
        logits = linear(hidden, params["embedder"]["input_embedding"], transposed=True, out_dtype=jnp.float32)
        cap = self.model.config.final_logit_softcap
        return cap * jnp.tanh(logits / cap) if cap else logits

    def make_cache(self, params, batch: int, max_len: int):
        dtype = params["embedder"]["input_embedding"].dtype
        cache = self.model.init_cache(batch_size=batch, dtype=dtype, cache_length=max_len)
        return {name: _without_index(layer) for name, layer in cache.items()}


def _without_index(layer: dict) -> dict:
    return {k: v for k, v in layer.items() if k != "end_index"}


def params_from_jaxspec(params: dict, config: ModelConfig) -> dict:
    """The gemma library's ``"params"`` tree of a Gemma 3 in jaxspec's layout
    (``jaxspec.models.decoder``; matrices as arrays or ``layout.Panels``), same dtype.

    Raises:
      ValueError: ``config`` is not a Gemma 3 (``family`` gemma3, tied embeddings).
    """
    if config.family != "gemma3" or not config.tie_embeddings:
        raise ValueError(f"params_from_jaxspec maps a Gemma 3 (family gemma3, tied embeddings), got {config.name} "
                         f"(family {config.family})")
    from jaxspec.models import layout

    params = layout.as_arrays(params)  # a CPU load's matrices in panels: the library takes plain arrays
    d, n, k, h = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
    out = {"embedder": {"input_embedding": params["embed"]}, "final_norm": {"scale": params["final_norm"]}}
    for i, layer in enumerate(params["layers"]):
        heads = lambda w, count: w.reshape(d, count, h).transpose(1, 0, 2)  # noqa: E731  [D, N*h] -> [N, D, h]
        out[f"layer_{i}"] = {
            "attn": {
                "q_einsum": {"w": heads(layer["wq"], n)},
                "kv_einsum": {"w": jnp.stack([heads(layer["wk"], k), heads(layer["wv"], k)])},
                "attn_vec_einsum": {"w": layer["wo"].reshape(n, h, d)},
                "_query_norm": {"scale": layer["q_norm"]},
                "_key_norm": {"scale": layer["k_norm"]},
            },
            "mlp": {"gating_einsum": jnp.stack([layer["w_gate"].T, layer["w_up"].T]), "linear": layer["w_down"]},
            "pre_attention_norm": {"scale": layer["attn_norm"]},
            "post_attention_norm": {"scale": layer["post_attn_norm"]},
            "pre_ffw_norm": {"scale": layer["mlp_norm"]},
            "post_ffw_norm": {"scale": layer["post_mlp_norm"]},
        }
    return out
