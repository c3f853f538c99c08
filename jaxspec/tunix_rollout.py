"""jaxspec as a rollout engine for Tunix's RL learners (GRPO, PPO, DAPO): speculative rollouts
drafted from each prompt's sibling samples and earlier rollouts.

Tunix (``google-tunix`` on PyPI, JAX) chooses its rollout engine by ``ClusterConfig.rollout_engine``:
``"vanilla"`` (its own sampler), ``"vllm"``, ``"sglang_jax"``, or a subclass of
``tunix.rl.rollout.base_rollout.BaseRollout``. ``JaxspecRollout`` is such a subclass:

    import functools
    from tunix.rl import rl_cluster
    from jaxspec.tunix_rollout import JaxspecRollout

    cluster_config = rl_cluster.ClusterConfig(
        ...,
        rollout_engine=functools.partial(JaxspecRollout, max_position=32768),
        rollout_config=base_rollout.RolloutConfig(temperature=1.0, max_tokens_to_generate=256, ...))

The learner's actor (a Tunix ``nnx`` decoder: Qwen2, Qwen3) runs through
``jaxspec.models.tunix.TunixTarget``; each ``generate`` runs ``jaxspec.generate`` (one call, or
calls of ``rows_per_call`` rows) with the history drafter (``jaxspec.HistoryDrafter``: the row's own text, the other samples of its
prompt in the call, and the earlier rollouts of that prompt kept in a ``jaxspec.RolloutHistory``
that the engine carries from call to call). Sampling is exact: the rollouts follow the
actor's distribution as Tunix's own sampler's do (``jaxspec.acceptance``), so the learner's
curve does not depend on the engine. Every call reads the actor's weights as they are now: a
learner on the same device updates the actor in place and the engine shares it (``model()``
is the actor, so the learner skips its weight sync); ``update_params`` writes weights into it
otherwise. New weights have the same shapes and dtypes, so the compiled program is reused
(``compiled`` says whether the last ``generate`` compiled).

Choices, where Tunix's samplers differ:
- a prompt longer than ``RolloutConfig.max_prompt_length`` is refused (``ValueError``), not cut;
- ``logits`` of the output are not returned (None: Tunix's learners read tokens and text);
- sampled token ids exclude the EOS id that ended them, as Tunix's sampler returns them;
- the seed of jaxspec call k is ``RolloutConfig.seed`` (0 when None) plus k, so each step
  samples afresh (Tunix's sampler reuses the seed, 0 when None, at every call).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from tunix.rl import common as tunix_common
from tunix.rl import utils as tunix_utils
from tunix.rl.rollout import base_rollout

from jaxspec import api
from jaxspec.drafters.history import HistoryDrafter
from jaxspec.models.tunix import TunixTarget
from jaxspec.rollouts import PROMPT_TAIL, RolloutHistory


class TunixTokenizer:
    """A jaxspec ``Tokenizer`` with the five methods Tunix asks of a custom tokenizer
    (``encode``, ``decode``, ``bos_id``, ``eos_id``, ``pad_id``: Tunix's ``TokenizerAdapter``).

    ``TunixTokenizer.of(model)`` takes them from a ``jaxspec.Model``: ``encode`` adds no BOS and
    ``bos_id`` is None where the model's prompts start without one (Qwen's chat turns);
    ``eos_id`` is the model's first EOS id (Qwen's ``<|im_end|>``), ``pad_id`` its BOS id
    (only Tunix's left padding of prompts reads it).
    """

    def __init__(self, tokenizer, *, eos_id: int, pad_id: int, bos_id: int | None = None):
        self.tokenizer, self._eos, self._pad, self._bos = tokenizer, int(eos_id), int(pad_id), bos_id

    @classmethod
    def of(cls, model) -> TunixTokenizer:
        """The adapter of a ``jaxspec.Model``'s tokenizer and ids."""
        c, tok = model.config, model.tokenizer
        adds_bos = bool(getattr(tok, "add_bos", False))
        return cls(tok, eos_id=c.eos_ids[0], pad_id=c.bos_id, bos_id=c.bos_id if adds_bos else None)

    def encode(self, text: str, **kw) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False)

    def decode(self, ids, **kw) -> str:
        return self.tokenizer.decode(list(ids))

    def bos_id(self):
        return self._bos

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return self._pad


class JaxspecRollout(base_rollout.BaseRollout):
    """A Tunix rollout engine that generates with jaxspec (``jaxspec.generate``).

    Args:
      rollout_actor: the Tunix decoder (``nnx.Module``) whose rollouts are sampled.
      tokenizer: Tunix's ``TokenizerAdapter`` (what ``RLCluster`` passes), or a tokenizer it wraps
        (a Hugging Face or SentencePiece one, or ``TunixTokenizer.of(jaxspec_model)``).
      mesh: a one-device mesh or None (a model split over several devices runs on jaxspec's
        own decoder only: ``jaxspec.generate(mesh=)``).
      rollout_config: unused at construction (each ``generate`` takes its own).
      drafter: a ``jaxspec`` drafter, default ``HistoryDrafter()``; None: plain decoding. A
        ``HybridDrafter`` whose first part is a ``HistoryDrafter`` drafts from the history
        where it matches and with its draft model elsewhere (``draft_params``).
      draft_params: the draft model's params (a ``jaxspec.Model`` or its params) of a
        drafter that has one (``ModelDrafter``, or a ``HybridDrafter``'s fallback); None else.
      history_capacity: earlier rollouts kept per prompt (``RolloutHistory.capacity``).
      rows_per_call: None (default): each ``generate`` is one ``jaxspec.generate`` call; k: calls of
        k rows in turn, each drafting also from the earlier calls' rollouts (the history). On a
        CPU the history drafter pays at 1-2 rows per call, and the batch policy decodes larger
        calls plainly (docs/batch_policy.md); a learner sends a prompt's G samples at once.
      max_position: the actor's context, in tokens (default 32768).
      settings: further ``jaxspec.generate`` keywords (``disable_by_batch_size``, ...).

    Raises:
      ValueError: a mesh of several devices; rows_per_call below 1.
    """

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh: Any = None, rollout_config: Any = None, *,
                 drafter: Any = "history", draft_params: Any = None, history_capacity: int = 16,
                 max_position: int = 32768, rows_per_call: int | None = None, **settings):
        if rows_per_call is not None and rows_per_call < 1:
            raise ValueError(f"rows_per_call must be None or >= 1, got {rows_per_call}")
        if mesh is not None and mesh.devices.size > 1:
            raise ValueError(f"JaxspecRollout runs the actor on one device, got a mesh of {mesh.devices.size}")
        if not hasattr(tokenizer, "pad_id"):
            from tunix.generate import tokenizer_adapter
            tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
        self.tokenizer = tokenizer
        bos = tokenizer.bos_id()
        self.device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
        self.actor = rollout_actor
        self.target, _ = TunixTarget.split(
            rollout_actor, name=type(rollout_actor).__name__, max_position=max_position,
            bos_id=-1 if bos is None else bos, eos_ids=(tokenizer.eos_id(),))
        self.drafter = HistoryDrafter() if drafter == "history" else drafter
        self.draft_params = draft_params
        self.history_capacity = history_capacity
        self.history: RolloutHistory | None = None
        self.settings = settings
        self.rows_per_call = rows_per_call
        self.metrics = []  # the last generate's jaxspec.metrics.Metrics, one per jaxspec call
        self.calls = 0

    @property
    def compiled(self) -> bool:
        """Whether the last ``generate`` compiled a program (a training loop can assert it never does)."""
        return any(m.compiled for m in self.metrics)

    def _prompt_ids(self, prompt: str, limit: int) -> list[int]:
        """Tunix's sampler's tokenization: BOS (where the tokenizer has one) then the text's ids."""
        if isinstance(prompt, np.ndarray):  # Tunix's learners pass numpy strings
            prompt = prompt.item() if prompt.ndim == 0 else prompt
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a str, got {type(prompt).__name__} {prompt!r:.80}")
        ids = self.tokenizer.encode(prompt)
        bos = self.tokenizer.bos_id()
        if bos is not None and bos >= 0 and bos != self.tokenizer.pad_id() and (not ids or ids[0] != bos):
            ids = [bos] + list(ids)
        if len(ids) > limit:
            raise ValueError(f"a prompt of {len(ids)} tokens is longer than RolloutConfig.max_prompt_length={limit} "
                             f"(jaxspec does not cut prompts): raise max_prompt_length")
        return [int(t) for t in ids]

    def _drafter_params(self, uses_history: bool):
        """What ``jaxspec.generate`` takes as ``drafter_params``: the history, the draft model's
        params, or a hybrid's pair of them."""
        history = self.history if uses_history else None
        if getattr(self.drafter, "kind", None) == "hybrid":
            return (history, self.draft_params)
        return history if uses_history else self.draft_params

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        """``jaxspec.generate`` over ``prompts`` (each repeated prompt a sibling sample): one call,
        or calls of ``rows_per_call`` rows in turn.

        Returns Tunix's ``RolloutOutput``: text, tokens (int32 arrays without the final EOS),
        the prompts left-padded to ``max_prompt_length`` with the pad id, logprobs where
        ``return_logprobs`` (of the distribution sampled from), logits None.
        """
        rc = rollout_config
        ids = [self._prompt_ids(p, rc.max_prompt_length) for p in prompts]
        eos = tuple(int(e) for e in (rc.eos_tokens or [self.tokenizer.eos_id()]))
        seed = 0 if rc.seed is None else int(np.asarray(rc.seed).reshape(-1)[0])
        uses_history = api._history_drafter(self.drafter) is not None
        if uses_history and self.history is None:
            self.history = RolloutHistory(vocab_size=self.target.vocab_size, capacity=self.history_capacity,
                                          max_tokens=rc.max_tokens_to_generate + PROMPT_TAIL)
        per_call = self.rows_per_call or len(ids)
        params = self.params  # placed once per generate: every call of it samples the same weights
        self.metrics, tokens, logprobs = [], [], []
        for start in range(0, len(ids), per_call):
            res = api.generate(
                params, ids[start : start + per_call], config=self.target, drafter=self.drafter,
                drafter_params=self._drafter_params(uses_history),
                max_len=rc.max_prompt_length + rc.max_tokens_to_generate, max_new_tokens=rc.max_tokens_to_generate,
                temperature=float(rc.temperature), top_p=1.0 if rc.top_p is None else float(rc.top_p),
                top_k=0 if rc.top_k is None or rc.top_k < 0 else int(rc.top_k), stop_token_ids=eos,
                seed=(seed + self.calls) % (1 << 32), logprobs=0 if rc.return_logprobs else None,
                logprobs_mode="processed", **self.settings)
            self.calls += 1
            self.metrics.append(res.metrics)
            if res.history is not None:
                self.history = res.history
            for k, row in enumerate(res.tokens):
                n = len(row) - (1 if row and row[-1] in eos else 0)
                tokens.append(np.asarray(row[:n], np.int32))
                if res.logprobs is not None:
                    logprobs.append(res.logprobs[k][:n])
        pad = self.tokenizer.pad_id()
        left = np.full((len(ids), rc.max_prompt_length), pad, np.int32)
        for k, row in enumerate(ids):
            left[k, rc.max_prompt_length - len(row):] = row
        return base_rollout.RolloutOutput(
            text=[self.tokenizer.decode(t.tolist()) for t in tokens], logits=None, tokens=tokens,
            left_padded_prompt_tokens=left, logprobs=logprobs if rc.return_logprobs else None)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """The actor's log-probabilities of ``completion_tokens`` after ``prompt_tokens`` (Tunix's own)."""
        return tunix_common.compute_per_token_logps(
            self.target.graphdef, self.params, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            pad_id=self.pad_id(), eos_id=self.eos_id(), stop_gradient=True, return_logits=False)

    def update_params(self, params: Any, filter_types: tuple | None = None) -> None:
        """Take the learner's new weights (all of the actor's, or those of ``filter_types``: the
        learner passes only them), each cast to the dtype it had, written into the actor (whose
        weights every call reads); same shapes reuse the compiled program. A learner that
        updates the actor in place (one device, colocated) shares its weights with the engine
        (``model()`` is the actor) and does not call this.

        Raises:
          ValueError: a weight the actor does not have.
        """
        new, _ = tunix_utils.to_flat_dict(params)
        current = nnx.state(self.actor)
        old, treedef = tunix_utils.to_flat_dict(current)
        unknown = sorted(set(new) - set(old))
        if unknown:
            raise ValueError(f"update_params: {len(unknown)} weights the actor does not have, e.g. {unknown[0]}")
        merged = [new[k].astype(v.dtype) if k in new else v for k, v in old.items()]
        state = jax.tree.map(lambda x: x, current)  # a new State of the same structure
        nnx.replace_by_pure_dict(state, jax.tree.unflatten(treedef, merged))
        nnx.update(self.actor, state)

    @property
    def params(self) -> nnx.State:
        """The actor's weights now (the learner updates them in place), on the rollout's
        device, without the learner's mesh axes (a learner's sharded arrays may carry them in
        their types, which a one-device program cannot index)."""
        return jax.device_put(nnx.state(self.actor), jax.sharding.SingleDeviceSharding(self.device))

    def pad_id(self) -> int:
        return self.tokenizer.pad_id()

    def eos_id(self) -> int:
        return self.tokenizer.eos_id()

    def model(self) -> nnx.Module:
        """The actor itself: the learner sees that the engine shares its weights and skips the sync."""
        return self.actor


__all__ = ["JaxspecRollout", "TunixTarget", "TunixTokenizer"]
