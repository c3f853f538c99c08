"""Logical axes of every parameter of ``jaxspec.models.decoder``, declared once.

Each params leaf names what each of its dimensions is (``wq [D, H*hd]`` is
``("embed", "q_heads")``), the way jax-llm-examples' ``ArrayInfo`` does; ``jaxspec.sharding``
maps these logical names to mesh axes with one rules table and derives every
PartitionSpec from them (loading placement, orbax restore onto a mesh, ``generate(mesh=)``).
Models know nothing of meshes: this file only says what the dimensions mean.

Logical names (and the count that splitting one must divide, ``sizes``): ``vocab`` (V),
``embed`` (D, the residual width), ``q_heads`` (H query heads of ``head_dim`` columns each),
``kv_heads`` (K), ``ffw`` (F, MLP width); ``None`` marks a dimension that is never split
(norm weights, ``head_dim``).

A leaf missing from the table is an error naming it (``leaf_axes``), never a silent
replication: add a new parameter here when adding it to ``param_shapes``.
"""

from __future__ import annotations

from jaxspec.config import ModelConfig

# Per-layer leaf -> logical axes of its dimensions (the layout of jaxspec.models.decoder).
LAYER_AXES = {
    "attn_norm": (None,),
    "wq": ("embed", "q_heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "bq": ("q_heads",),  # attn_bias
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "q_norm": (None,),  # qk_norm: over head_dim, shared by all heads
    "k_norm": (None,),
    "wo": ("q_heads", "embed"),
    "post_attn_norm": (None,),  # sandwich_norms
    "mlp_norm": (None,),
    "w_gate": ("embed", "ffw"),
    "w_up": ("embed", "ffw"),
    "w_down": ("ffw", "embed"),
    "post_mlp_norm": (None,),  # sandwich_norms
}
# Top-level leaf -> logical axes.
TOP_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": (None,),
    "lm_head": ("embed", "vocab"),  # absent with tied embeddings
}


def sizes(config: ModelConfig) -> dict[str, int]:
    """How many units each logical axis has (heads, not columns): a mesh axis can split a
    logical axis only when it divides this count."""
    return {"vocab": config.vocab_size, "embed": config.dim, "q_heads": config.n_heads,
            "kv_heads": config.n_kv_heads, "ffw": config.ffn_dim}


def leaf_axes(path: tuple, ndim: int | None = None) -> tuple:
    """Logical axes of the params leaf at ``path`` (``("layers", 3, "wq")`` or ``("embed",)``).

    Raises:
      ValueError: the leaf is not in the table (names it), or ``ndim`` is given and differs
        from the number of declared axes.
    """
    table = LAYER_AXES if len(path) == 3 and path[0] == "layers" else TOP_AXES if len(path) == 1 else {}
    name = "/".join(map(str, path))
    if path[-1] not in table:
        raise ValueError(f"param {name!r} has no logical axes: declare them in jaxspec.models.axes "
                         f"(LAYER_AXES or TOP_AXES) so it can be sharded")
    axes = table[path[-1]]
    if ndim is not None and ndim != len(axes):
        raise ValueError(f"param {name!r} has {ndim} dimensions, jaxspec.models.axes declares {len(axes)}: {axes}")
    return axes


def leaves_along(logical: str) -> frozenset:
    """Per-layer leaf names with a dimension along ``logical`` (``"kv_heads"``: wk, wv, bk, bv)."""
    return frozenset(k for k, axes in LAYER_AXES.items() if logical in axes)
