"""``python -m checkpoints_tools train-medusa``: train Medusa-1 heads for a target (Cai et al.
2024, "Medusa", Sec. 2.1, Medusa-1: the target frozen, the heads trained on its final hidden
states), with the data, optimizer, checkpoints and progress of ``train-eagle``
(``checkpoints_tools.train_eagle.run(..., medusa_heads=k)``).

Head i at position t reads the target's final hidden state at t and is trained to predict
the target's own greedy token at ``t + 2 + i`` (the argmax of the target's distribution at
``t + 1 + i``: hard labels from self-distillation; storing the full-vocabulary distribution
per token would take V floats a token), with cross-entropy weighted ``0.8^i`` (Medusa's
lambda_k = 0.8^k). Heads start as the identity (``w = 0``), as in the paper.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from checkpoints_tools.train_eagle import Dataset, _shift
from jaxspec.config import ModelConfig
from jaxspec.drafters import medusa


@dataclasses.dataclass(frozen=True)
class MedusaRecipe:
    """``train``'s view of ``n_heads`` Medusa-1 heads for the target ``config``."""

    config: ModelConfig
    n_heads: int

    def __post_init__(self):
        if not isinstance(self.n_heads, int) or self.n_heads < 1:
            raise ValueError(f"--heads must be an integer >= 1, got {self.n_heads!r}")

    @property
    def n_steps(self) -> int:
        return self.n_heads

    def init(self, key):
        return medusa.init_heads(self.config, self.n_heads, key, scale=0.0)

    def frozen(self, target_params):
        return {k: target_params[k] for k in ("embed", "lm_head") if k in target_params}

    def losses(self, head, frozen, batch):
        """Cross-entropy and top-1 agreement of each head, over answer positions."""
        params = {"heads": head["heads"], "out": frozen}
        ces, accs = [], []
        for i in range(self.n_heads):
            logits = medusa.head_logits(params, self.config, batch["features"], i)
            label = _shift(batch["target_top"], i + 1)
            valid = _shift(batch["loss_mask"], i + 1).astype(jnp.float32)
            n = jnp.maximum(valid.sum(), 1.0)
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), label[..., None], axis=-1)[..., 0]
            ces.append(-jnp.sum(lp * valid) / n)
            accs.append(jnp.sum((jnp.argmax(logits, axis=-1) == label) * valid) / n)
        return jnp.stack(ces), jnp.stack(accs)

    def check(self, data: Dataset) -> None:
        if data.features.shape[-1] != self.config.dim:
            raise ValueError(f"the dataset's features are {data.features.shape[-1]} wide, the target's final hidden "
                             f"state {self.config.dim}: data prepared for another head (EAGLE?)")

    def save(self, dst, head, data, target_params, info):
        from jaxspec.checkpoints.heads import save_medusa_heads

        save_medusa_heads(dst, head, self.config, target_params, training=info, overwrite=True)
