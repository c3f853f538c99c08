"""Drafting with a smaller model: a separate draft model, or the target's own first layers,
as a chain of sampled drafts or a top-k tree.

- ``ModelDrafter``: a separate draft model sharing the target's vocabulary (Leviathan et al.
  2023; Chen et al. 2023).
- ``EarlyExitDrafter``: self-speculation with the target's first ``n_layers`` blocks followed
  by its final norm and output head, no training needed (the "early-exit" drafting of
  Elhoushi et al. 2024, "LayerSkip", Sec. 4; Zhang et al. 2024, "Draft & Verify").

Chain mode (``tree_nodes=0``): ``gamma`` drafts drawn one after another from the drafter's
processed distribution q, which acceptance uses (lossless at any temperature). With a
``confidence`` threshold the chain stops where the drafter's cumulative probability of it
falls below the threshold (``draw_chain``), so that an unlikely draft costs no verify width.

Tree mode (``tree_nodes=N``): EAGLE-2's dynamic tree of depth ``gamma``
(``jaxspec.drafters.dynamic_tree``), ranked by the draft model's raw distribution; the
selection is deterministic, so acceptance treats nodes as one-hot proposals
(``jaxspec.acceptance``): lossless at any temperature.

The drafter keeps its own static KV cache. Every ``propose`` starts by reading the two newest
tokens (positions ``seq_len - 2`` and ``seq_len - 1``): the root and the deepest accepted
node, the only accepted node a proposal may not have fed to the drafter (a leaf). Nodes it
fed sit in scratch slots after the root (chain: node i at slot root + i + 1, i.e. in place);
``commit`` moves the accepted path's entries into contiguous slots with the same
``KVCache.keep_path`` the target's cache uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import grammar, models
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.drafters import dynamic_tree
from jaxspec.drafters.base import (
    chain_capabilities,
    check_confidence,
    check_gamma,
    check_int,
)
from jaxspec.drafters.dynamic_tree import check_tree
from jaxspec.models.target import require_decoder
from jaxspec.sampling import fold_rows, processed_probs, sample
from jaxspec.tree import Proposal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Text:
    """What a chain's next draft is processed with: the ``History`` and the grammar state
    (None without a grammar) after the drafts so far."""

    history: Any
    grammar_state: Any


def draw_chain(step, carry: Any, logits: jax.Array, context, gamma: int,
               confidence: float = 0.0) -> tuple[Any, Proposal]:
    """A chain of ``gamma`` drafts, each drawn from the drafter's processed distribution q
    (the target's processing: ``processed_probs`` with the history plus the drafts so far,
    masked to what the row's grammar allows after them, ``jaxspec.grammar``), which the
    proposal carries, so acceptance is lossless at any temperature.

    With ``confidence`` > 0, draft i is valid only while the drafter's probability of drafts
    0 .. i - 1 times the largest probability of draft i's distribution (each under the RAW
    distribution ``softmax(logits)``, the same at every temperature) is at least
    ``confidence``: the chain stops where the drafter expects a rejection, and the engine
    verifies only as many nodes as the longest chain of the batch keeps (a one-token step
    when none); the drafter itself stops at the first draft that no row can keep, so a draft
    model's forwards past it are skipped (Hugging Face's assistant stops the same way).
    Whether draft i is proposed depends on the drafts before it and on the SHAPE
    of its distribution, never on the token drawn at i (that would bias the draws the
    acceptance rule takes as samples of q; keeping draft i by its own probability fails the
    exact-distribution test: TV 0.10, p = 0) nor on the target, so acceptance stays exact.
    Greedy, the two agree (the draft is the most probable token). Stopping a chain on a
    predicted rejection: SpecDec++ (Huang et al. 2024, Sec. 3); Hugging Face's
    ``assistant_confidence_threshold``; EAGLE-2 (Li et al. 2024, Sec. 4) grows its trees by
    the same cumulative draft probability.

    Args:
      step: ``step(carry, token [B], i) -> (carry, logits [B, V])``: feed draft ``i - 1``
        (``token``) and score draft ``i`` (i = 1 .. gamma - 1).
      carry: the drafter's state threaded through ``step`` (a ``lax.while_loop`` carry).
      logits: float32 ``[B, V]`` scoring draft 0; context: the ``Context``.
      confidence: the threshold in ``[0, 1)``; 0 keeps every draft (static).

    Returns:
      ``(carry, Proposal.chain of [B, gamma] with q [B, gamma, V])``; its valid nodes are a
      prefix of the chain.
    """
    keys, g = context.keys, context.grammar

    def draft(logits, history, i):
        state = history.grammar_state
        q = processed_probs(logits, context.sampling, history.history,
                            allowed=None if g is None else grammar.allowed(g, state))
        d = sample(fold_rows(keys, i), q)
        sure = jnp.ones((d.shape[0], 2), jnp.float32)  # [raw prob of d, largest raw prob]
        if confidence:
            raw = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
            sure = jnp.stack([jnp.take_along_axis(raw, d[:, None], axis=1)[:, 0], jnp.max(raw, axis=-1)], axis=1)
        after = _Text(history.history.add(d[:, None], jnp.ones_like(d[:, None], bool)),
                      None if g is None else grammar.advance(g, state, d))
        return d, q, sure, after

    d0, q0, sure0, history = draft(logits, _Text(context.history, context.grammar_state), 0)
    # One loop for every threshold: draft i needs before_i = prod_{j < i} p(d_j) >= confidence
    # (its largest probability is <= 1), so once no row whose chain is still valid has that,
    # drafts i .. gamma - 1 are invalid in every row and are never computed (a separate draft
    # model saves its forwards). With confidence 0 every draft is kept and the loop runs
    # gamma - 1 steps. Unfed nodes keep token 0 and q 0; they are invalid, never candidates nor fed.
    b = d0.shape[0]

    def go_on(s):
        i, _, _, _, _, _, valid, before = s
        return (i < gamma) & jnp.any(valid[:, i - 1] & (before >= confidence))

    def body(s):
        i, carry, token, history, drafts, qs, valid, before = s
        carry, logits = step(carry, token, i)
        d, q, sure, history = draft(logits, history, i)
        ok = valid[:, i - 1] & (before * sure[:, 1] >= confidence)
        return (i + 1, carry, d, history, drafts.at[:, i].set(d), qs.at[:, i].set(q), valid.at[:, i].set(ok),
                before * sure[:, 0])

    init = (jnp.int32(1), carry, d0, history, jnp.zeros((b, gamma), jnp.int32).at[:, 0].set(d0),
            jnp.zeros((b, gamma) + q0.shape[1:], q0.dtype).at[:, 0].set(q0),
            jnp.zeros((b, gamma), bool).at[:, 0].set(sure0[:, 1] >= confidence), sure0[:, 0])
    _, carry, _, _, drafts, q, valid, _ = jax.lax.while_loop(go_on, body, init)
    return carry, Proposal.chain(drafts, valid=valid, q=q)


# A draft model's chain stops below this cumulative draft probability unless told otherwise
# (Hugging Face's assisted generation defaults to 0.4). Measured on Qwen2.5-Coder-1.5B with its
# 0.5B draft, gamma 4, batch 1, greedy: 0.86x -> 0.92x our plain on 16 mixed Spec-Bench questions
# (C 0.5 the same; benchmarks/results/batch_sweep_qwen2.5-coder-1.5b-confidence_cpu_2026-12-03.json) and
# 1.24x -> 1.24x on the coding and HumanEval prompts (C 0.5: 1.22x;
# spec_bench_qwen2.5-coder-1.5b-code-confidence_cpu_2026-12-03.json): it saves draft forwards and
# verify width where a draft would be rejected and costs nothing where drafts are accepted.
DEFAULT_CONFIDENCE = 0.3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """A model drafter's state.

    Attributes:
      cache: the draft model's ``KVCache`` (S + scratch slots).
      node_slots: int32 ``[B, N]``, slot of each node of the last proposal relative to its
        root (-1: not fed to the drafter).
    """

    cache: KVCache
    node_slots: jax.Array


class _DraftModel:
    """The drafting shared by ``ModelDrafter`` and ``EarlyExitDrafter`` (a draft model's
    forwards over its own cache); the two dataclasses hold the fields."""

    def _check(self):
        check_gamma(self.gamma)
        check_int("branching", self.branching, 1, self.config.vocab_size)
        check_tree(self.gamma, self.tree_nodes, self.branching)
        check_confidence(self.confidence, self.tree_nodes)

    @property
    def capabilities(self):
        return chain_capabilities(self.gamma, self.confidence, shares_target_weights=self.shares_target_weights)

    @property
    def n_nodes(self) -> int:
        """N: ``gamma`` for a chain, ``tree_nodes`` for a tree."""
        return self.tree_nodes or self.gamma

    @property
    def scratch(self) -> int:
        """Slots after the root a proposal writes into the drafter's cache."""
        return self.gamma if not self.tree_nodes else dynamic_tree.scratch_slots(self.gamma, self.branching)

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        return drafter_params

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        from jaxspec.checkpoints.pairing import check_configs

        check_configs(target_config, self.config)  # vocabulary size, BOS, EOS
        if drafter_params is None:
            raise ValueError("ModelDrafter needs drafter_params (the draft model's weights)")

    def init(self, params, prefill, max_len):
        prompt = prefill.prompt
        cache = KVCache.zeros(self.config, prompt.shape[0], max_len + self.scratch, params["embed"].dtype)
        positions = jnp.broadcast_to(jnp.arange(prompt.shape[1], dtype=jnp.int32), prompt.shape)
        out = models.forward(params, self.config, prompt, positions, cache, head=False, visible_slots=prompt.shape[1])
        return DraftState(out.cache, jnp.zeros((prompt.shape[0], self.n_nodes), jnp.int32))

    def read(self, params, cache: KVCache, context, newest: int = 2, before=0) -> tuple[jax.Array, KVCache]:
        """``(logits [B, V], cache)`` once the draft model has read the ``newest`` tokens that end
        ``before`` (int, or int32 scalar) tokens before the root, positions ``end - newest ..
        end - 1`` with ``end = seq_len - before``, into ``cache`` in place; the logits are
        those after position ``end - 1``. Where ``end < newest`` the window starts at 0
        instead (a forward writes contiguous slots), reading past ``end - 1`` into slots no
        query before them sees. ``propose`` reads the 2 newest (module docstring); a drafter
        that did not draft every step reads everything since its last read in such windows
        (``jaxspec.drafters.hybrid``)."""
        end = context.seq_lens - before
        start = jnp.maximum(end - newest, 0)
        positions = start[:, None] + jnp.arange(newest, dtype=jnp.int32)[None]
        out = models.forward(params, self.config, jnp.take_along_axis(context.tokens, positions, axis=1), positions,
                             cache, head=False)
        last = jnp.clip(end - 1 - start, 0, newest - 1)
        hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)  # the output head on one row
        return models.logits_from_hidden(params, self.config, hidden)[:, 0], out.cache

    def draft(self, params, cache: KVCache, logits: jax.Array, context) -> tuple[DraftState, Proposal]:
        """``(state, proposal)``: the chain or tree drafted after the root, whose ``logits``
        ``[B, V]`` ``read`` gave."""
        if self.tree_nodes:
            return self._tree(params, cache, logits, context)
        return self._chain(params, cache, logits, context)

    def propose(self, params, state: DraftState, context):
        logits, cache = self.read(params, state.cache, context)
        return self.draft(params, cache, logits, context)

    def _chain(self, params, cache, logits, context):
        cfg = self.config

        def step(cache, token, i):
            pos = (context.seq_lens - 1 + i)[:, None]
            out = models.forward(params, cfg, token[:, None], pos, cache)
            return out.cache, out.logits[:, 0]

        cache, proposal = draw_chain(step, cache, logits, context, self.gamma, self.confidence)
        b = proposal.tokens.shape[0]
        fed = jnp.where(jnp.arange(self.gamma) < self.gamma - 1, jnp.arange(1, self.gamma + 1), -1)
        return DraftState(cache, jnp.broadcast_to(fed, (b, self.gamma)).astype(jnp.int32)), proposal

    def _tree(self, params, cache, logits, context):
        cfg, k = self.config, self.branching

        def expand(cache, tokens, feats, positions, write_at, mask, allowed):
            out = models.forward(params, cfg, tokens, positions, cache, write_at=write_at, mask=mask)
            child_lp, child_tok = dynamic_tree.best_children(out.logits, k, allowed)
            return out.cache, child_lp, child_tok, None

        g, state = context.grammar, context.grammar_state
        root_lp, root_tok = dynamic_tree.best_children(logits, k, None if g is None else grammar.allowed(g, state))
        cache, proposal, slots = dynamic_tree.grow(expand, cache, root_lp, root_tok, None, context.seq_lens - 1,
                                                   depth=self.gamma, branching=k, n_nodes=self.tree_nodes,
                                                   grammar=g, state=state)
        return DraftState(cache, slots), proposal

    def commit(self, params, state: DraftState, committed):
        node = jnp.maximum(committed.path - 1, 0)
        slot = jnp.where(committed.path > 0, jnp.take_along_axis(state.node_slots, node, axis=1), 0)
        cache = state.cache.keep_path(committed.start, jnp.maximum(slot, 0), span=max(self.scratch, slot.shape[1]))
        return DraftState(cache, state.node_slots)


@dataclasses.dataclass(frozen=True)
class ModelDrafter(_DraftModel):
    """Draft with a small Llama-family model: a chain of ``gamma`` sampled tokens, or a top-k
    tree of ``tree_nodes`` nodes and depth ``gamma``.

    Attributes:
      config: the draft model's ``ModelConfig``; ``vocab_size`` must equal the target's.
      gamma: chain length, or the tree's depth (>= 1).
      tree_nodes: 0 for a chain; else N, the tree's node budget, in
        ``[1, branching + (gamma - 1) * branching ** 2]`` (the candidates it grows).
      branching: children per expanded node and expanded nodes per depth (tree mode), >= 1.
      confidence: chain mode: stop the chain where the draft model's cumulative probability
        of it falls below this, in ``[0, 1)`` (``draw_chain``; 0: always ``gamma`` drafts).
        ``None`` (default): ``DEFAULT_CONFIDENCE`` for a chain, 0 for a tree (a tree is grown
        by draft confidence already).

    Raises:
      ValueError: ``gamma``, ``tree_nodes``, ``branching`` or ``confidence`` out of range (at construction);
        vocabulary sizes, BOS or EOS ids differ, or no draft params (at ``validate``, before
        any compile). ``jaxspec.check_pair`` also compares the tokenizers' strings.
    """

    config: ModelConfig
    gamma: int = 4
    tree_nodes: int = 0
    branching: int = 4
    confidence: float | None = None
    kind = "model"  # class attributes, not fields: the registry's name (jaxspec.drafters.kinds)
    shares_target_weights = False  # early exit's is True

    def __post_init__(self):
        if self.confidence is None:  # a frozen dataclass resolves its default this way
            object.__setattr__(self, "confidence", 0.0 if self.tree_nodes else DEFAULT_CONFIDENCE)
        self._check()

    def localized(self, model_shards: int) -> ModelDrafter:
        """This drafter as one of ``model_shards`` shards runs it, its weights split over the
        mesh's ``model`` axis (``jaxspec.sharding.plan``): the per-shard config.

        Raises:
          ValueError: ``model_shards`` does not divide the draft model's heads, MLP width or
            vocabulary.
        """
        from jaxspec import sharding

        sharding.check_model_axis(self.config, model_shards, "drafter")
        return dataclasses.replace(self, config=sharding.local_config(self.config, model_shards))


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(_DraftModel):
    """Self-speculation: the target's first ``n_layers`` blocks, final norm and head.

    Attributes:
      target_config: the target's ``ModelConfig`` (``config``, the drafter's model, is its first
        ``n_layers`` blocks: ``target_config.truncated(n_layers)``).
      n_layers: blocks to keep, ``1 <= n_layers < target_config.n_layers``; the registry's
        default (``jaxspec.drafters.kinds``) is a quarter of them, at least 1.
      gamma, tree_nodes, branching, confidence: as ``ModelDrafter``'s (chain by default),
        except that ``confidence`` defaults to 0 (every chain ``gamma`` drafts).

    The drafter's params are a view of the target's (no copy): ``select_params`` slices them.

    Raises:
      ValueError: ``n_layers``, ``gamma``, ``tree_nodes``, ``branching`` or ``confidence`` out of range (at
        construction); a target whose config is not the one this drafter was built for (at
        ``validate``).
    """

    # Fields in the order of the constructor users call, EarlyExitDrafter(target_config,
    # n_layers, gamma, ...); ``config`` is derived, not given (``field(init=False)``).
    target_config: ModelConfig
    n_layers: int = 1
    gamma: int = 4
    tree_nodes: int = 0
    branching: int = 4
    confidence: float = 0.0
    config: ModelConfig = dataclasses.field(init=False, default=None, repr=False, compare=False)
    kind = "early-exit"
    # its params are the target's, so it runs on the target's shards under a mesh (``jaxspec.sharding``)
    shares_target_weights = True

    def __post_init__(self):
        require_decoder(self.target_config, "EarlyExitDrafter", "the target's first layers and output head")
        if not isinstance(self.n_layers, int) or not 1 <= self.n_layers < self.target_config.n_layers:
            raise ValueError(
                f"n_layers for early exit must be in [1, {self.target_config.n_layers - 1}] "
                f"(the target has {self.target_config.n_layers} layers), got {self.n_layers}"
            )
        object.__setattr__(self, "config", self.target_config.truncated(self.n_layers))  # derived once
        self._check()

    def localized(self, model_shards: int) -> EarlyExitDrafter:
        """This drafter as one of ``model_shards`` shards of the target runs it: the first
        ``n_layers`` blocks of the target's per-shard config.

        Raises:
          ValueError: ``model_shards`` does not divide the target's heads, MLP width or vocabulary.
        """
        from jaxspec import sharding

        return dataclasses.replace(self, target_config=sharding.local_config(self.target_config, model_shards))

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        return {**target_params, "layers": list(target_params["layers"][: self.n_layers])}

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        require_decoder(target_config, "EarlyExitDrafter", "the target's first layers and output head")
        if target_config.truncated(self.n_layers) != self.config:
            raise ValueError(f"EarlyExitDrafter was built for {self.config.name}, not the target {target_config.name}")
