"""Drafting with an EAGLE-3 head (Li et al. 2025, "EAGLE-3", Sec. 3): a one-layer head over
the target's own features (``jaxspec.models.eagle3``), as a chain of sampled drafts or
EAGLE-2's dynamic tree (``jaxspec.drafters.dynamic_tree``).

How the head is fed. Entry t of the head pairs a feature of position t with the token at
t + 1 and predicts the token at t + 2. Where the target has read position t, the feature is
the target's (the three captured layers, fused); while drafting past the committed text it
is the head's own hidden state from the previous draft step (EAGLE's feature feedback).
The token at t + 1 of the last committed feature is known only once verification has emitted
it, so ``commit`` (and ``init`` for the prompt's last position) stores the fused features
of the accepted path as PENDING entries, and ``propose`` first reads them in one head
forward (W = N + 1 entries at positions ``start ..``, the valid ones being those up to
``seq_len - 2``), then drafts from the last one. Those entries overwrite the previous
proposal's scratch slots, so the head's cache always holds target features along the
committed text and never a rejected draft (no ``keep_path`` needed).

Chain mode: q is the head's distribution over the draft vocabulary, scattered into the
target's vocabulary (0 outside it) and processed like the target's p (``draw_chain``):
lossless at any temperature; tokens outside the draft vocabulary are never drafted, which
costs acceptance, never exactness; with ``confidence`` the chain stops where the head's
cumulative probability of it falls below the threshold (``draw_chain``). Tree mode:
deterministic top-k (one-hot acceptance).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import grammar
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.drafters import dynamic_tree
from jaxspec.drafters.base import Unsplit, chain_capabilities, check_confidence, check_gamma, check_int
from jaxspec.drafters.model import draw_chain
from jaxspec.models import eagle3
from jaxspec.models.eagle3 import EagleConfig
from jaxspec.models.target import require_decoder


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleState:
    """An EAGLE drafter's state.

    Attributes:
      cache: the head's one-layer ``KVCache`` (S + W + scratch slots).
      pending: ``[B, W, D]`` fused target features of the entries not yet read (the accepted
        path of the last verify; after the prompt, its last position alone).
      start: int32 ``[B]``, the position of ``pending[:, 0]``.
    """

    cache: KVCache
    pending: jax.Array
    start: jax.Array


@dataclasses.dataclass(frozen=True)
class EagleDrafter(Unsplit):
    """Draft with a trained EAGLE-3 head: a chain of ``gamma`` sampled tokens, or a dynamic
    top-k tree of ``tree_nodes`` nodes and depth ``gamma``.

    Attributes:
      config: the head's ``EagleConfig`` (its target, draft vocabulary, captured layers).
      gamma, tree_nodes, branching, confidence: as ``ModelDrafter``'s; ``branching <= draft_vocab``;
        ``confidence`` defaults to 0 here (a head's forward is cheap, and a threshold never beat
        plain gamma 2 with SmolLM2's head: docs/drafters/eagle3.md, "Confidence").

    ``drafter_params``: the head (``jaxspec.load_eagle_head`` returns it with its drafter):
    ``{"head": params, "d2t": int32 [Vd]}``; ``select_params`` adds the target's embedding.

    Raises:
      ValueError: ``gamma``, ``tree_nodes``, ``branching`` or ``confidence`` out of range (at
        construction); a target whose config differs from the head's, or head params of the wrong shapes (at
        ``validate``, before any compile).
    """

    config: EagleConfig
    gamma: int = 4
    tree_nodes: int = 0
    branching: int = 4
    confidence: float = 0.0
    kind = "eagle"  # class attribute, not a field

    def __post_init__(self):
        check_gamma(self.gamma)
        check_int("branching", self.branching, 1, self.config.draft_vocab, " (at most the draft vocabulary)")
        dynamic_tree.check_tree(self.gamma, self.tree_nodes, self.branching)
        check_confidence(self.confidence, self.tree_nodes)

    @property
    def capabilities(self):
        return chain_capabilities(self.gamma, self.confidence, capture=self.config.capture)

    @property
    def n_nodes(self) -> int:
        """N: ``gamma`` for a chain, ``tree_nodes`` for a tree."""
        return self.tree_nodes or self.gamma

    @property
    def scratch(self) -> int:
        """Slots past the committed text a proposal writes (pending entries, then drafts)."""
        grown = self.gamma if not self.tree_nodes else dynamic_tree.scratch_slots(self.gamma, self.branching)
        return self.n_nodes + 1 + grown

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        return {**drafter_params, "embed": target_params["embed"]}

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        from jaxspec.checkpoints.heads import check_head_target

        require_decoder(target_config, "EagleDrafter", "the target's layer outputs and embedding table")
        check_head_target(self.config.target, target_config, "the EagleDrafter's config")
        if not isinstance(drafter_params, dict) or set(drafter_params) != {"head", "d2t"}:
            raise ValueError("EagleDrafter needs drafter_params = {'head': ..., 'd2t': ...}, as "
                             "jaxspec.load_eagle_head returns them")
        expected = eagle3.param_shapes(self.config)
        got = jax.tree_util.tree_map(lambda x: tuple(x.shape), drafter_params["head"])
        if got != expected:
            raise ValueError(f"EAGLE head params do not match its config {self.config.layer.name}: shapes {got}, "
                             f"expected {expected}")
        if tuple(drafter_params["d2t"].shape) != (self.config.draft_vocab,):
            raise ValueError(f"d2t has shape {tuple(drafter_params['d2t'].shape)}, expected "
                             f"({self.config.draft_vocab},)")

    def init(self, params, prefill, max_len):
        cfg = self.config
        prompt = prefill.prompt
        b, p = prompt.shape
        feats = eagle3.fuse(params["head"], prefill.captured)  # [B, P, D]
        cache = eagle3.empty_cache(cfg, b, max_len + self.scratch, feats.dtype)
        # Entries (feature t, token t + 1) for every prompt position but the last, whose next
        # token is not known yet; entries past a row's prompt are stale until overwritten.
        nxt = jnp.concatenate([prompt[:, 1:], prompt[:, -1:]], axis=1)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        out = eagle3.forward(params["head"], cfg, params["embed"], nxt, feats, positions, cache)
        last = prefill.prompt_lens - 1
        pending = jnp.zeros((b, self.n_nodes + 1, feats.shape[-1]), feats.dtype)
        pending = pending.at[:, 0].set(jnp.take_along_axis(feats, last[:, None, None], axis=1)[:, 0])
        return EagleState(out.cache, pending, last)

    def _read_pending(self, params, state: EagleState, context):
        """Head forward over the pending entries; returns the last valid entry's logits
        ``[B, Vd]`` and hidden state ``[B, D]`` (it scores the first draft) and the cache."""
        w = state.pending.shape[1]
        positions = state.start[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
        s = context.tokens.shape[1]
        tokens = jnp.take_along_axis(context.tokens, jnp.minimum(positions + 1, s - 1), axis=1)
        out = eagle3.forward(params["head"], self.config, params["embed"], tokens, state.pending, positions,
                             state.cache)
        last = jnp.clip(context.seq_lens - 2 - state.start, 0, w - 1)[:, None, None]
        logits, hidden = (jnp.take_along_axis(x, last, axis=1)[:, 0] for x in (out.logits, out.hidden))
        return logits, hidden, out.cache

    def propose(self, params, state: EagleState, context):
        logits, hidden, cache = self._read_pending(params, state, context)
        root = context.seq_lens - 2  # position of the entry that scores the first draft
        cfg, head, embed, d2t = self.config, params["head"], params["embed"], params["d2t"]
        vocab = cfg.target.vocab_size
        if not self.tree_nodes:
            def step(carry, token, i):
                cache, feat = carry
                pos = (root + i)[:, None]
                out = eagle3.forward(head, cfg, embed, token[:, None], feat[:, None], pos, cache)
                return (out.cache, out.hidden[:, 0]), eagle3.target_logits(out.logits[:, 0], d2t, vocab)

            (cache, _), proposal = draw_chain(step, (cache, hidden), eagle3.target_logits(logits, d2t, vocab),
                                              context, self.gamma, self.confidence)
            return dataclasses.replace(state, cache=cache), proposal
        k = self.branching

        def expand(cache, tokens, feats, positions, write_at, mask, allowed):
            out = eagle3.forward(head, cfg, embed, tokens, feats, positions, cache, write_at=write_at, mask=mask)
            child_lp, child_tok = dynamic_tree.best_children(out.logits, k, allowed, d2t)
            return out.cache, child_lp, child_tok, out.hidden

        g, gstate = context.grammar, context.grammar_state
        root_lp, root_tok = dynamic_tree.best_children(logits, k, None if g is None else grammar.allowed(g, gstate), d2t)
        feats = jnp.broadcast_to(hidden[:, None], (hidden.shape[0], k, hidden.shape[-1]))
        cache, proposal, _ = dynamic_tree.grow(expand, cache, root_lp, root_tok, feats, root, depth=self.gamma,
                                               branching=k, n_nodes=self.tree_nodes, grammar=g, state=gstate)
        return dataclasses.replace(state, cache=cache), proposal

    def commit(self, params, state: EagleState, committed):
        pending = eagle3.fuse(params["head"], committed.captured).astype(state.pending.dtype)
        return EagleState(state.cache, pending, committed.start)
