"""``python -m checkpoints_tools train-medusa``: train Medusa-1 heads for a target (Cai et al.
2024, "Medusa", Sec. 2.1, Medusa-1: the target frozen, the heads trained on its final hidden
states), with the data, optimizer, checkpoints and progress of ``train-eagle``
(``checkpoints_tools.trainer.run(..., medusa_heads=k)``).

Head i at position t reads the target's final hidden state at t and is trained to predict
the target's own greedy token at ``t + 2 + i`` (the argmax of the target's distribution at
``t + 1 + i``: hard labels from self-distillation; storing the full-vocabulary distribution
per token would take V floats a token), with cross-entropy weighted ``0.8^i`` (Medusa's
lambda_k = 0.8^k). Heads start as the identity (``w = 0``), as in the paper. With
``--draft-vocab Vd`` the heads score only the Vd most frequent answer tokens (the target's
output-head rows of those tokens, still frozen; ``MedusaRecipe``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from checkpoints_tools.head_dataset import Dataset, shift_left, take_window
from jaxspec.config import ModelConfig
from jaxspec.drafters import medusa


@dataclasses.dataclass(frozen=True)
class MedusaRecipe:
    """``train``'s view of ``n_heads`` Medusa-1 heads for the target ``config``.

    Attributes:
      draft_vocab: 0: the heads score the target's whole vocabulary through its frozen output
        head; Vd > 0: only the rows of the data's draft vocabulary (``Dataset.d2t``), ``V / Vd``
        times less work per position (``medusa.output_rows``).
      span: positions of each row the losses read, from ``n_heads`` before the first answer
        position on (0: all T). The heads read one position each, with no context, so the
        prompt positions (whose next tokens are not the answer's) only cost time; ``run``
        sets it from the data's longest answer.
    """

    config: ModelConfig
    n_heads: int
    draft_vocab: int = 0
    span: int = 0
    kind = "medusa"
    frozen_keys = ()  # the target's output head, shared, is not among the heads' params

    def __post_init__(self):
        if not isinstance(self.n_heads, int) or self.n_heads < 1:
            raise ValueError(f"--heads must be an integer >= 1, got {self.n_heads!r}")

    @property
    def n_steps(self) -> int:
        return self.n_heads

    def init(self, key, target_params=None, d2t=None):
        return medusa.init_heads(self.config, self.n_heads, key, scale=0.0)

    def frozen(self, target_params):
        return {k: target_params[k] for k in ("embed", "lm_head") if k in target_params}

    def losses(self, head, frozen, batch):
        """Cross-entropy (over answer tokens in the draft vocabulary) and top-1 agreement
        with the target's greedy token (over all answer tokens) of each head."""
        feats, top, mask = batch["features"], batch["target_top"], batch["loss_mask"]
        t = mask.shape[1]
        span = min(self.span, t)  # a batch cut to fewer columns than the widest answer window
        if span:
            lo = jnp.maximum(jnp.argmax(mask, axis=1) - self.n_heads, 0)
            size = span + self.n_heads  # labels run n_heads past the features
            feats = take_window(feats, lo, span)
            top = take_window(top, lo, size)
            mask = take_window(mask, lo, size) & (lo[:, None] + jnp.arange(size) < t)
        params = {"heads": head["heads"], "out": frozen}
        if self.draft_vocab:
            d2t = batch["d2t"]
            params = {"heads": head["heads"], "rows": medusa.output_rows(frozen, self.config, d2t)}
            t2d = jnp.full((self.config.vocab_size,), -1, jnp.int32).at[d2t].set(jnp.arange(d2t.shape[0]))
        ces, accs = [], []
        for i in range(self.n_heads):
            logits = medusa.head_logits(params, self.config, feats, i)
            target = shift_left(top, i + 1)[:, : feats.shape[1]]  # the target's token, a target id
            valid = shift_left(mask, i + 1)[:, : feats.shape[1]].astype(jnp.float32)
            drafted = jnp.argmax(logits, axis=-1)
            label, in_vocab = target, valid
            if self.draft_vocab:  # labels as draft indices (-1: not draftable), drafts as target ids
                label, drafted = t2d[target], batch["d2t"][drafted]
                in_vocab = valid * (label >= 0)
            hit = drafted == target
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), jnp.maximum(label, 0)[..., None],
                                     axis=-1)[..., 0]
            ces.append(-jnp.sum(lp * in_vocab) / jnp.maximum(in_vocab.sum(), 1.0))
            accs.append(jnp.sum(hit * valid) / jnp.maximum(valid.sum(), 1.0))
        return jnp.stack(ces), jnp.stack(accs)

    def check(self, data: Dataset) -> None:
        if data.features.shape[-1] != self.config.dim:
            raise ValueError(f"the dataset's features are {data.features.shape[-1]} wide, the target's final hidden "
                             f"state {self.config.dim}: data prepared for another head (EAGLE?)")
        if self.draft_vocab != len(data.d2t):
            raise ValueError(f"the dataset's draft vocabulary has {len(data.d2t)} tokens, the heads {self.draft_vocab}: "
                             f"data prepared with another --draft-vocab")

    def save(self, dst, head, data, target_params, info):
        from jaxspec.checkpoints.heads import save_medusa_heads

        save_medusa_heads(dst, head, self.config, target_params, d2t=data.d2t if self.draft_vocab else None,
                          training=info, overwrite=True)
