"""Frozen, hashable configuration dataclasses.

Configs are static: they are passed to ``jax.jit`` as static arguments and decide shapes.
Per-request values that may change between calls without recompiling (temperature, seeds,
``max_new_tokens``) are arrays, not fields here; see ``jaxspec.engine.generate``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def default_dtype():
    """Parameter dtype default: float32 on CPU (XLA:CPU runs bfloat16 3.6x slower, DESIGN.md),
    bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2).

    Attributes:
      vocab_size: V, number of token ids.
      dim: D, residual stream width.
      n_layers: number of decoder blocks.
      n_heads: H, query heads.
      n_kv_heads: KV heads (grouped-query attention, Ainslie et al. 2023); divides ``n_heads``.
      head_dim: per-head width; ``n_heads * head_dim`` is the attention width.
      ffn_dim: F, hidden width of the SwiGLU MLP (Shazeer 2020).
      rope_theta: RoPE base (Su et al. 2021), e.g. 1e4 (Llama 2) or 1e5 (SmolLM2).
      norm_eps: RMSNorm epsilon (Zhang & Sennrich 2019).
      tie_embeddings: output head is the transposed embedding table (no ``lm_head`` param).
      max_position: longest context the checkpoint was trained for (tokens).
      bos_id: beginning-of-sequence id, or -1 when the model has none.
      eos_ids: ids that end generation.
      name: human-readable name, used in messages.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position: int = 8192
    bos_id: int = -1
    eos_ids: tuple[int, ...] = ()
    name: str = "llama"

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))

    def truncated(self, n_layers: int) -> "ModelConfig":
        """The same model with only its first ``n_layers`` blocks (early-exit drafting)."""
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"n_layers must be in [1, {self.n_layers}], got {n_layers}")
        return dataclasses.replace(self, n_layers=n_layers, name=f"{self.name}[:{n_layers}]")
