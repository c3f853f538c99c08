"""One table from jaxspec param paths to checkpoint tensor names (Hugging Face and GGUF).

Every reader and writer walks ``tensor_specs(config)``: it lists each tensor of the params
pytree (``jaxspec.models.decoder`` layout) with its shape in our layout, its name in a Hugging
Face ``*.safetensors`` file and in a llama.cpp GGUF file, and whether it is stored transposed
(torch ``Linear`` keeps ``[out, in]``; we keep ``[in, out]``).

Two GGUF quirks live in the readers, not here: llama.cpp permutes the rows of Q/K for its
``llama`` architecture (interleaved RoPE), and stores Gemma's RMSNorm weights as ``1 + w``.
"""

from __future__ import annotations

import dataclasses

from jaxspec.config import ModelConfig
from jaxspec.models import param_shapes

# our per-layer key -> (Hugging Face name inside "model.layers.N.", GGUF name inside "blk.N.")
_LAYER = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "wq": ("self_attn.q_proj.weight", "attn_q.weight"),
    "wk": ("self_attn.k_proj.weight", "attn_k.weight"),
    "wv": ("self_attn.v_proj.weight", "attn_v.weight"),
    "bq": ("self_attn.q_proj.bias", "attn_q.bias"),
    "bk": ("self_attn.k_proj.bias", "attn_k.bias"),
    "bv": ("self_attn.v_proj.bias", "attn_v.bias"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    "wo": ("self_attn.o_proj.weight", "attn_output.weight"),
    "mlp_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "w_gate": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "w_up": ("mlp.up_proj.weight", "ffn_up.weight"),
    "w_down": ("mlp.down_proj.weight", "ffn_down.weight"),
}
# Gemma 2/3 ("sandwich" norms): HF's post_attention_layernorm is the norm *after* attention.
_SANDWICH = {
    "post_attn_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    "mlp_norm": ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
}
_TOP = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint.

    Attributes:
      path: where it lives in the params pytree: ``("embed",)`` or ``("layers", 3, "wq")``.
      hf: Hugging Face safetensors name, e.g. ``model.layers.3.self_attn.q_proj.weight``.
      gguf: GGUF name, e.g. ``blk.3.attn_q.weight``.
      shape: shape in our layout.
      transposed: stored ``[out, in]`` (the reverse of ``shape``) in both file formats.
    """

    path: tuple
    hf: str
    gguf: str
    shape: tuple[int, ...]
    transposed: bool

    @property
    def key(self) -> str:
        """Last path element (``"wq"``, ``"embed"``)."""
        return self.path[-1]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape in the file (torch layout)."""
        return tuple(reversed(self.shape)) if self.transposed else self.shape

    @property
    def is_norm(self) -> bool:
        """An RMSNorm weight (Gemma's GGUF stores these as ``1 + w``)."""
        return self.key.endswith("norm")


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a ``config`` model, in a fixed order (embed, layers, final norm, head)."""
    shapes = param_shapes(config)
    names = {**_LAYER, **_SANDWICH} if config.sandwich_norms else _LAYER
    specs = [TensorSpec(("embed",), *_TOP["embed"], shapes["embed"], False)]
    for i, layer in enumerate(shapes["layers"]):
        for key, shape in layer.items():
            hf, gg = names[key]
            specs.append(TensorSpec(("layers", i, key), f"model.layers.{i}.{hf}", f"blk.{i}.{gg}", shape,
                                    key in _TRANSPOSED))
    specs.append(TensorSpec(("final_norm",), *_TOP["final_norm"], shapes["final_norm"], False))
    if "lm_head" in shapes:
        specs.append(TensorSpec(("lm_head",), *_TOP["lm_head"], shapes["lm_head"], True))
    return specs


def empty_params(config: ModelConfig) -> dict:
    """A params skeleton (``layers`` a list of empty dicts) for ``set_leaf`` to fill."""
    return {"layers": [{} for _ in range(config.n_layers)]}


def set_leaf(params: dict, path: tuple, value) -> None:
    """``params[path] = value`` for a ``TensorSpec.path``."""
    node = params
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def get_leaf(params: dict, path: tuple):
    """``params[path]`` for a ``TensorSpec.path``; KeyError names the path."""
    node = params
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError) as e:
            raise KeyError(f"params has no {'/'.join(map(str, path))}") from e
    return node
