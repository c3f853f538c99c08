"""``python -m checkpoints_tools train-eagle``: the EAGLE-3 head's training objective (Li et al.
2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test", Sec. 3), run by ``checkpoints_tools.trainer``.

Training-time test (Sec. 3.2): ``unroll`` steps; step 0 reads the target's fused features
(three captured layers, ``checkpoints_tools.head_dataset``), step i > 0 the head's own hidden
states of step i - 1, each step one position further ahead, attending to the target-feature
entries of the text so far and to its own earlier steps at the same position (exactly what
drafting sees, through the same ``eagle3.forward`` with a tree mask). Loss: sum over steps of
0.8^i x the soft cross-entropy between the target's (top-K, restricted to the draft vocabulary)
distribution and the head's, over answer tokens (``unrolled_losses``). ``EagleRecipe`` is what
the trainer needs to know about the head: its initial parameters, losses and how it is saved.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from checkpoints_tools.head_dataset import Dataset, shift_left, take_window
from jaxspec import models
from jaxspec.drafters.medusa import output_rows
from jaxspec.models import eagle3
from jaxspec.models.eagle3 import EagleConfig


def unrolled_losses(head, embed, batch: dict, config: EagleConfig, unroll: int, span: int = 0):
    """Soft cross-entropy and top-1 agreement per training-time-test step.

    Step i at base position t feeds token ``x[t + 1 + i]`` with the fused target feature of t
    (i = 0) or the head's hidden state of step i - 1 at t, at position ``t + i``; it sees the
    step-0 entries of positions <= t and its own steps 1..i at t (the draft chain a proposal
    builds from t), and predicts ``x[t + 2 + i]`` against the target's distribution at
    ``t + 1 + i``.

    ``span`` > 0 (``answer_span`` of the data: every row's loss positions lie within ``span``
    of its first one) computes the output head only there: the same losses, at a fraction of
    the cost (the head's logits over the draft vocabulary are about half of a step; prompts
    and padding carry no loss). 0: at every position.

    Returns:
      ``(ce float32 [unroll], acc float32 [unroll])``, each averaged over the masked positions.
    """
    tokens, feats = batch["tokens"], batch["features"]
    b, t = tokens.shape
    span = min(span, t)  # a batch cut to fewer columns than the widest answer window
    labels = {n: batch[n] for n in ("soft_ids", "soft_p", "target_top", "loss_mask")}
    if span:  # label j of each row sits at lo + j; the hidden state of step i that predicts it, i + 1 before
        lo = jnp.argmax(batch["loss_mask"], axis=1)
        labels = {n: take_window(x, lo, span) for n, x in labels.items()}
        label_at = lo[:, None] + jnp.arange(span)
        labels["loss_mask"] = labels["loss_mask"] & (label_at < t)
    k = unroll
    h = feats @ head["fc"]
    cache = eagle3.empty_cache(config, b, k * t, h.dtype)
    base = jnp.arange(t)
    slot_step, slot_col = jnp.arange(k * t) // t, jnp.arange(k * t) % t
    win_positions = jnp.broadcast_to(slot_col + slot_step, (b, k * t))
    ces, accs = [], []
    for i in range(k):
        seen = (((slot_step == 0) & (slot_col[None] <= base[:, None]))
                | ((slot_step >= 1) & (slot_step <= i) & (slot_col[None] == base[:, None])))
        mask = models.TreeMask(jnp.zeros((b,), jnp.int32), jnp.broadcast_to(seen, (b, t, k * t)), win_positions)
        positions = jnp.broadcast_to(base + i, (b, t))
        out = eagle3.forward(head, config, embed, shift_left(tokens, i + 1), h, positions, cache,
                             write_at=jnp.full((b,), i * t, jnp.int32), mask=mask)
        cache, h = out.cache, out.hidden
        if span:
            logits = eagle3.head_logits(head, config, take_window(h, lo - (i + 1), span))
            lab = dict(labels, loss_mask=labels["loss_mask"] & (label_at >= i + 1))
        else:
            logits, lab = out.logits, {n: shift_left(x, i + 1) for n, x in labels.items()}
        valid = lab["loss_mask"].astype(jnp.float32)
        n = jnp.maximum(valid.sum(), 1.0)
        logq = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), lab["soft_ids"], axis=-1)
        ce = -jnp.sum(lab["soft_p"] * logq, axis=-1)
        ces.append(jnp.sum(ce * valid) / n)
        hit = batch["d2t"][jnp.argmax(logits, axis=-1)] == lab["target_top"]
        accs.append(jnp.sum(hit * valid) / n)
    return jnp.stack(ces), jnp.stack(accs)


@dataclasses.dataclass(frozen=True)
class EagleRecipe:
    """What ``train`` needs to know about the head it trains (hashable: a static jit argument;
    ``checkpoints_tools.train_medusa.MedusaRecipe`` is the other one).

    ``losses(head, frozen, batch) -> (ce [n_steps], acc [n_steps])``; ``frozen`` is what the
    head reads from the target (here its embedding)."""

    config: EagleConfig
    unroll: int
    span: int = 0  # unrolled_losses' span: the output head only over each row's answer window
    lm_head: str = "random"  # TrainConfig.lm_head
    kind = "eagle"

    @property
    def n_steps(self) -> int:
        return self.unroll

    def init(self, key, target_params, d2t):
        """A fresh head (``eagle3.init_params``); with ``lm_head`` "target" or "frozen" its
        ``lm_head`` is the target's output head restricted to ``d2t`` (``[D, Vd]``) and its
        ``norm`` the target's final norm (offset folded in: the head's norms have none)."""
        head = eagle3.init_params(self.config, key, dtype=jnp.float32)
        if self.lm_head == "random":
            return head
        t = self.config.target
        return {**head, "lm_head": output_rows(target_params, t, jnp.asarray(d2t)).T.astype(jnp.float32),
                "norm": jnp.asarray(target_params["final_norm"], jnp.float32) + t.norm_offset}

    @property
    def frozen_keys(self) -> tuple[str, ...]:
        """The head's entries that training leaves as initialised."""
        return ("lm_head",) if self.lm_head == "frozen" else ()

    def frozen(self, target_params):
        return target_params["embed"]

    def losses(self, head, frozen, batch):
        return unrolled_losses(head, frozen, batch, self.config, self.unroll, self.span)

    def check(self, data: "Dataset") -> None:
        if data.d2t.shape != (self.config.draft_vocab,):
            raise ValueError(f"the dataset's draft vocabulary has {data.d2t.shape[0]} tokens, --draft-vocab is "
                             f"{self.config.draft_vocab}")

    def save(self, dst, head, data, target_params, info):
        from jaxspec.checkpoints.heads import save_head

        save_head(dst, head, data.d2t, self.config, target_params, training=info, overwrite=True)
