"""Drafting with Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
Framework with Multiple Decoding Heads", Sec. 2.1): head i reads the target's final hidden
state at the last committed entry and predicts the token ``i + 2`` places after it (the
target's own head predicts the next one: the bonus token, already emitted).

Head i is one residual SiLU block, ``h + SiLU(h @ w_i + b_i)``, followed by the target's own
output head, shared and frozen (Medusa initialises each head's output layer from it; sharing
it keeps a head at D^2 + D parameters). With a draft vocabulary ``d2t`` (int32 ``[Vd]``
target ids) the head keeps only those rows of the target's output head: ``V / Vd`` times less
work per head, and tokens outside it are never drafted (acceptance, never exactness: EAGLE-3's
reduced vocabulary, Li et al. 2025, Sec. 3). The heads see no draft token, so a proposal is a
STATIC tree (Sec. 2.1.2, "tree attention"): ``topk = (k_1, .., k_gamma)`` gives every node at
depth d the ``k_{d+1}`` best tokens of head d as children, the Cartesian product of the
heads' top-k. The selection is deterministic: acceptance treats nodes as one-hot proposals,
lossless at any temperature. The state is the one hidden state the heads read; no cache.

Params: ``{"heads": [{"w": [D, D], "b": [D]}, ...]}`` (``n_heads`` of them), optionally
``"d2t"``; ``select_params`` adds the target's output head (``"out"``), or its ``d2t`` rows
(``"rows"`` ``[Vd, D]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Capabilities, Unsplit, check_int
from jaxspec.models import layout
from jaxspec.models.linear import linear
from jaxspec.models.target import require_decoder
from jaxspec.tree import Proposal


def init_heads(config: ModelConfig, n_heads: int, key: jax.Array, dtype=jnp.float32, scale: float = 1.0) -> dict:
    """Random Medusa heads for a target of ``config``: ``w`` normal with std ``scale / sqrt(D)``,
    ``b`` zero (Medusa initialises ``w`` to zero, which makes every head the identity)."""
    d = config.dim
    keys = jax.random.split(key, n_heads)
    return {"heads": [{"w": (jax.random.normal(k, (d, d)) * scale / np.sqrt(d)).astype(dtype),
                       "b": jnp.zeros((d,), dtype)} for k in keys]}


def output_rows(target_params: dict, config: ModelConfig, d2t: jax.Array) -> jax.Array:
    """The target output head's rows of the draft vocabulary ``d2t`` (int32 ``[Vd]``):
    ``[Vd, D]`` in the head's dtype (the tied embedding's rows, or ``lm_head``'s columns)."""
    if config.tie_embeddings:
        return layout.take(target_params["embed"], d2t, axis=0)
    return layout.take(target_params["lm_head"], d2t, axis=1).T


def head_logits(params: dict, config: ModelConfig, hidden: jax.Array, i: int) -> jax.Array:
    """Head ``i``'s float32 logits from target final hidden states ``[..., D]``: ``[..., V]``
    over the target's vocabulary, or ``[..., Vd]`` over the draft vocabulary when ``params``
    holds ``"rows"`` (``output_rows``), soft-capped like the target's."""
    head = params["heads"][i]
    h = hidden + jax.nn.silu(linear(hidden, head["w"]) + head["b"])
    if "rows" not in params:
        return models.logits_from_hidden(params["out"], config, h)
    out = linear(h, params["rows"], transposed=True, out_dtype=jnp.float32)
    return config.final_softcap * jnp.tanh(out / config.final_softcap) if config.final_softcap else out


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Unsplit):
    """Draft a static tree from Medusa heads.

    Attributes:
      config: the target's ``ModelConfig``.
      topk: children per node at each depth (``gamma = len(topk)``, at most the number of
        heads); ``(1, 1, 1)`` is a chain of the heads' argmaxes. N = sum over depths of the
        product of ``topk`` up to that depth.

    Raises:
      ValueError: ``topk`` empty or with an entry outside ``[1, 16]`` (at construction); fewer
        heads than depths or heads of the wrong width (at ``validate``).
    """

    config: ModelConfig
    topk: tuple[int, ...] = (1, 1, 1, 1)
    capabilities = Capabilities()  # class attributes, not fields
    kind = "medusa"

    def __post_init__(self):
        object.__setattr__(self, "topk", tuple(self.topk))
        if not self.topk:
            raise ValueError("topk must list at least one depth, e.g. (1, 1, 1) for a chain of 3")
        for k in self.topk:
            check_int("topk entries", k, 1, 16)

    @property
    def gamma(self) -> int:
        return len(self.topk)

    @property
    def n_nodes(self) -> int:
        return int(sum(np.cumprod(self.topk)))

    def _topology(self):
        """Static ``(parents [N], depth [N], rank [N])``: node order is by depth, each node's
        children contiguous; ``rank`` is which of its depth's top-k tokens a node holds."""
        parents, depth, rank = [], [], []
        level = [-1]
        for d, k in enumerate(self.topk):
            nxt = []
            for p in level:
                for r in range(k):
                    nxt.append(len(parents))
                    parents.append(p)
                    depth.append(d)
                    rank.append(r)
            level = nxt
        return np.array(parents, np.int32), np.array(depth), np.array(rank)

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        if "d2t" in drafter_params:
            d2t = jnp.asarray(drafter_params["d2t"], jnp.int32)
            return {"heads": drafter_params["heads"], "d2t": d2t,
                    "rows": output_rows(target_params, self.config, d2t)}
        out = {k: target_params[k] for k in ("embed", "lm_head") if k in target_params}
        return {"heads": drafter_params["heads"], "out": out}

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        require_decoder(target_config, "MedusaDrafter", "the target's final hidden state and output head")
        if target_config != self.config:
            raise ValueError(f"MedusaDrafter was built for {self.config.name}, not the target {target_config.name}")
        heads = (drafter_params or {}).get("heads") if isinstance(drafter_params, dict) else None
        if not heads or len(heads) < self.gamma:
            raise ValueError(f"MedusaDrafter with topk {self.topk} needs >= {self.gamma} heads in "
                             f"drafter_params['heads'], got {0 if not heads else len(heads)}")
        d = target_config.dim
        for i, h in enumerate(heads):
            if tuple(h["w"].shape) != (d, d) or tuple(h["b"].shape) != (d,):
                raise ValueError(f"Medusa head {i} has w {tuple(h['w'].shape)}, b {tuple(h['b'].shape)}; the target "
                                 f"needs ({d}, {d}) and ({d},)")
        if "d2t" in drafter_params:
            d2t = np.asarray(drafter_params["d2t"])
            v = target_config.vocab_size
            if d2t.ndim != 1 or not 1 <= d2t.size <= v or d2t.min() < 0 or d2t.max() >= v:
                raise ValueError(f"drafter_params['d2t'] must be int [Vd] target ids in [0, {v}) with "
                                 f"1 <= Vd <= {v}, got shape {d2t.shape}")

    def init(self, params, prefill, max_len):
        last = (prefill.prompt_lens - 1)[:, None, None]
        return jnp.take_along_axis(prefill.hidden, last, axis=1)[:, 0]

    def propose(self, params, state, context):
        parents, depth, rank = self._topology()
        b = state.shape[0]
        best = [jax.lax.top_k(head_logits(params, self.config, state, d), k)[1] for d, k in enumerate(self.topk)]
        if "d2t" in params:  # draft-vocabulary indices -> target ids
            best = [params["d2t"][ids] for ids in best]
        tokens = jnp.stack([best[d][:, r] for d, r in zip(depth, rank)], axis=1).astype(jnp.int32)
        n = self.n_nodes
        return state, Proposal(tokens, jnp.broadcast_to(jnp.asarray(parents), (b, n)), jnp.ones((b, n), bool), None)

    def commit(self, params, state, committed):
        last = committed.n_accepted[:, None, None]
        return jnp.take_along_axis(committed.hidden, last, axis=1)[:, 0].astype(state.dtype)
