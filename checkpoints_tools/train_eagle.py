"""``python -m checkpoints_tools train-eagle``: train an EAGLE-3 head for a target (Li et al.
2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test", Sec. 3), with optax and orbax.

1. Data (``checkpoints_tools.drafter_data``): prompts answered by the target itself with
   ``jaxspec.generate`` (self-distillation); the draft vocabulary (d2t) is the most frequent
   answer tokens; one teacher-forced target pass per batch of sequences
   (``jaxspec.models.forward(..., capture=)``) gives the three captured layers and the
   target's next-token distribution, restricted to the draft vocabulary, of which the
   ``soft_topk`` most probable tokens are kept, renormalised (sparse distillation: the rest
   of the mass is a long tail the head need not learn, and the dense distribution would
   take Vd floats a token). Kept in memory and in ``OUT/data.npz``: per token ``3D``
   float32 features + ``soft_topk`` (index, probability) pairs (SmolLM2, K 32: 7.2 KB a
   token; dense Vd 8192 would be 39 KB).
2. Training-time test (Sec. 3.2): ``unroll`` steps; step 0 reads the target's fused features,
   step i > 0 the head's own hidden states of step i - 1, each step one position further
   ahead, attending to the target-feature entries of the text so far and to its own earlier
   steps at the same position (exactly what drafting sees, through the same
   ``eagle3.forward`` with a tree mask). Loss: sum over steps of 0.8^i x the soft
   cross-entropy between the target's (top-K, restricted) distribution and the head's, over
   answer tokens.
3. optax AdamW, linear warmup + cosine decay, global-norm gradient clipping; orbax
   checkpoints of (head, optimizer state) every ``save_every`` steps in ``OUT/checkpoints``,
   any of which ``resume`` continues from bit for bit (batches are a function of the seed
   and the step); a tqdm bar with the loss and the held-out acceptance (the head's top-1
   equals the target's top-1, step 0: the chance a greedy draft is accepted); the head in
   ``OUT/head`` (``jaxspec.checkpoints.heads``) with the target's config and weight
   fingerprint.

The loop (``train``) takes a recipe for the head it trains: ``EagleRecipe`` here,
``checkpoints_tools.train_medusa.MedusaRecipe`` for Medusa-1 heads, which share the data,
optimizer, checkpoints and progress. With several devices, batches are split over all of
them (data parallelism, ``Placement``), the head replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.drafters.medusa import output_rows
from jaxspec.models import eagle3
from jaxspec.models.eagle3 import EagleConfig

DATA_SETTINGS = ("draft_vocab", "soft_topk")  # the TrainConfig fields that OUT/data.npz depends on
BATCH_FIELDS = ("tokens", "features", "soft_ids", "soft_p", "target_top", "loss_mask")  # a training batch's rows
LM_HEAD_INITS = ("random", "target", "frozen")  # TrainConfig.lm_head
SEQ_BUCKET = 64  # sequences are padded, and batches cut, to a multiple of this many tokens


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training settings (every one checked by ``check``).

    Attributes:
      draft_vocab: Vd, tokens the head drafts (<= the target's vocabulary; Medusa: 0 drafts
        from the whole vocabulary through the target's own output head).
      steps: optimizer steps; batch: sequences per step.
      lr: peak learning rate; warmup: linear warmup steps (< steps); then cosine decay to
        ``lr * final_lr_frac``.
      weight_decay: AdamW's; clip: global gradient-norm clip.
      unroll: training-time-test steps (>= 1); decay: weight ratio of successive steps (0.8).
      seed: head init and batch order; holdout: fraction of sequences held out (>= 1 kept).
      save_every, eval_every: checkpoint and held-out evaluation intervals (steps).
      ffn_dim: the head layer's MLP width (0: the target's).
      soft_topk: K, how many of the target's most probable draft-vocabulary tokens (and their
        renormalised probabilities) the soft labels keep per position (0: all Vd).
      group_by_length: draw each batch's rows from one length bucket (``row_lengths``), as
        Hugging Face's ``group_by_length`` does, so that a batch is cut to that bucket instead
        of the longest row of a random draw (``batch_indices``); False: uniform draws.
      lm_head: how the EAGLE head's output layer starts (``LM_HEAD_INITS``): "random"; "target":
        the target's output-head columns of the draft vocabulary and its final norm, then
        trained; "frozen": those, never updated (SpecForge's shared-head variant keeps the
        target's head frozen). Medusa heads always use the target's head.
    """

    draft_vocab: int = 8192
    steps: int = 1000
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 50
    final_lr_frac: float = 0.1
    weight_decay: float = 0.0
    clip: float = 0.5
    unroll: int = 4
    decay: float = 0.8
    seed: int = 0
    holdout: float = 0.1
    save_every: int = 100
    eval_every: int = 50
    ffn_dim: int = 0
    soft_topk: int = 32
    group_by_length: bool = True
    lm_head: str = "random"

    def check(self, vocab_size: int, medusa: bool = False) -> None:
        """Raise ``ValueError`` naming the setting and its limit (``medusa``: Medusa heads,
        which also take ``draft_vocab`` 0)."""
        def need(ok, what):
            if not ok:
                raise ValueError(what)

        need(isinstance(self.draft_vocab, int) and (2 <= self.draft_vocab <= vocab_size
                                                    or (medusa and self.draft_vocab == 0)),
             f"--draft-vocab must be in [2, {vocab_size}] (the target's vocabulary)"
             f"{' or 0 (all of it)' if medusa else ''}, got {self.draft_vocab}")
        need(self.soft_topk >= 0, f"--soft-topk must be >= 0 (0: the whole draft vocabulary), got {self.soft_topk}")
        for name in ("steps", "batch", "unroll", "save_every", "eval_every"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        need(0 <= self.warmup < self.steps, f"--warmup must be in [0, steps={self.steps}), got {self.warmup}")
        need(self.lr > 0 and self.clip > 0, f"--lr and --clip must be > 0, got {self.lr}, {self.clip}")
        need(0 < self.decay <= 1, f"--decay must be in (0, 1], got {self.decay}")
        need(0 <= self.holdout < 1, f"--holdout must be in [0, 1), got {self.holdout}")
        need(self.lm_head in LM_HEAD_INITS,
             f"--lm-head must be one of {', '.join(LM_HEAD_INITS)}, got {self.lm_head!r}")


# ---------------------------------------------------------------------------- data


@dataclasses.dataclass
class Dataset:
    """Teacher-forced training data (numpy), Q sequences of T tokens (padded).

    Attributes:
      tokens: int32 ``[Q, T]``; features: float32 ``[Q, T, 3D]`` (the captured layers, or
        the final hidden state for Medusa);
      soft_ids: int32 ``[Q, T, K]`` (draft-vocabulary indices) and soft_p: float32
        ``[Q, T, K]``: the K most probable tokens of the target's next-token distribution at
        each position, restricted to the draft vocabulary, with their probabilities
        renormalised over the K (K = 0 for Medusa's hard labels);
      target_top: int32 ``[Q, T]``, its argmax over the full vocabulary; loss_mask: bool
        ``[Q, T]``, position t's next token is an answer token; d2t: int32 ``[Vd]``.
    """

    tokens: np.ndarray
    features: np.ndarray
    soft_ids: np.ndarray
    soft_p: np.ndarray
    target_top: np.ndarray
    loss_mask: np.ndarray
    d2t: np.ndarray

    def rows(self, idx) -> "Dataset":
        return Dataset(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self) if f.name != "d2t"),
                       d2t=self.d2t)

    def save(self, path: str) -> None:
        np.savez(path, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def load(cls, path: str) -> "Dataset":
        with np.load(path) as z:
            return cls(**{f.name: z[f.name] for f in dataclasses.fields(cls)})


@functools.partial(jax.jit, static_argnames=("config", "capture", "k"))
def _teacher_forced(params, tokens, d2t, *, config, capture, k):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = KVCache.zeros(config, b, t, params["embed"].dtype)
    out = models.forward(params, config, tokens, positions, cache, capture=capture or ())
    top_p, top_ids = jax.lax.top_k(jax.nn.softmax(jnp.take(out.logits, d2t, axis=-1), axis=-1), k)
    top_p = top_p / jnp.maximum(jnp.sum(top_p, axis=-1, keepdims=True), 1e-30)
    feats = jnp.concatenate(out.captured, axis=-1) if capture else out.hidden
    return feats.astype(jnp.float32), top_ids.astype(jnp.int32), top_p, jnp.argmax(out.logits, axis=-1).astype(jnp.int32)


def build_dataset(params, config, sequences: list[tuple[list[int], int]], d2t: np.ndarray, capture, batch: int = 8,
                  progress=None, soft_topk: int = 32) -> Dataset:
    """Teacher-forced target pass over ``sequences`` (``(ids, prompt length)``), ``batch`` at a
    time. ``capture``: the layers whose outputs are the features (EAGLE), or None for the final
    hidden state (Medusa); ``d2t`` of length 0 stores no distributions (hard labels only);
    ``soft_topk``: tokens kept of each distribution (0 or more than Vd: all Vd)."""
    t = int(_bucket(max(len(ids) for ids, _ in sequences)))
    q = len(sequences)
    tokens = np.zeros((q, t), np.int32)
    mask = np.zeros((q, t), bool)
    for i, (ids, n_prompt) in enumerate(sequences):
        tokens[i, : len(ids)] = ids
        mask[i, max(n_prompt - 1, 0) : len(ids) - 1] = True  # position p predicts token p + 1
    k = len(d2t) if soft_topk <= 0 else min(soft_topk, len(d2t))
    d2t_dev = jnp.asarray(d2t, jnp.int32)
    out = None
    lengths = np.array([len(ids) for ids, _ in sequences])
    order = np.argsort(lengths, kind="stable")  # batches of similar lengths, each cut to its bucket
    for i in range(0, q, batch):
        rows = order[i : i + batch]
        chunk = tokens[rows, : int(_bucket(lengths[rows].max()))]
        res = _teacher_forced(params, jnp.asarray(np.pad(chunk, ((0, batch - len(rows)), (0, 0)))), d2t_dev,
                              config=config, capture=None if capture is None else tuple(capture), k=k)
        res = [np.asarray(x)[: len(rows)] for x in res]
        if out is None:  # positions past a row's bucket stay 0: they carry no loss and precede none
            out = [np.zeros((q, t) + x.shape[2:], x.dtype) for x in res]
        for full, x in zip(out, res):
            full[rows, : x.shape[1]] = x
        if progress is not None:
            progress(len(rows))
    feats, ids, probs, top = out
    return Dataset(tokens, feats, ids, probs, top, mask, d2t)


def _loss_bounds(loss_mask: np.ndarray):
    """(first, last loss position, has any) of each row of ``loss_mask [Q, T]``."""
    m = np.asarray(loss_mask, bool)
    return m.argmax(axis=1), m.shape[1] - 1 - m[:, ::-1].argmax(axis=1), m.any(axis=1)


def _bucket(n):
    """``n`` tokens (an integer or an integer array) rounded up to a multiple of ``SEQ_BUCKET``."""
    return -(-n // SEQ_BUCKET) * SEQ_BUCKET


def row_lengths(loss_mask: np.ndarray) -> np.ndarray:
    """Columns of each row that its losses read, rounded up to a multiple of ``SEQ_BUCKET``
    (at most T): through the token its last loss position predicts. A batch cut to the
    largest of its rows' lengths gives the losses of the whole T columns (the attention is
    causal: later columns reach no loss; tested)."""
    _, last, any_ = _loss_bounds(loss_mask)
    return np.minimum(_bucket(np.where(any_, last, 0) + 2), np.shape(loss_mask)[1])


# ---------------------------------------------------------------------------- the training-time test


def _shift(x, n: int):
    """``x [B, T, ...]`` moved n positions left along T, zero-padded at the end."""
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def _window(x, lo, size: int):
    """``x [B, T, ...]`` at positions ``lo[b] .. lo[b] + size - 1`` of each row (clipped to [0, T - 1])."""
    idx = jnp.clip(lo[:, None] + jnp.arange(size), 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def answer_span(loss_mask: np.ndarray) -> int:
    """The widest run of positions, first to last loss position of a row, over the rows of
    ``loss_mask [Q, T]``: the window of each row that the losses read."""
    first, last, any_ = _loss_bounds(loss_mask)
    return int(np.max(np.where(any_, last - first + 1, 0)))


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
        labels = {n: _window(x, lo, span) for n, x in labels.items()}
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
        out = eagle3.forward(head, config, embed, _shift(tokens, i + 1), h, positions, cache,
                             write_at=jnp.full((b,), i * t, jnp.int32), mask=mask)
        cache, h = out.cache, out.hidden
        if span:
            logits = eagle3.head_logits(head, config, _window(h, lo - (i + 1), span))
            lab = dict(labels, loss_mask=labels["loss_mask"] & (label_at >= i + 1))
        else:
            logits, lab = out.logits, {n: _shift(x, i + 1) for n, x in labels.items()}
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


def _loss(head, frozen, batch, recipe, decay):
    ce, acc = recipe.losses(head, frozen, batch)
    return jnp.sum(ce * decay ** jnp.arange(recipe.n_steps)), (ce, acc)


def optimizer(cfg: TrainConfig, frozen_keys: tuple[str, ...] = ()):
    """AdamW with linear warmup + cosine decay, after global-norm gradient clipping; the
    head's entries named in ``frozen_keys`` (a recipe's) get zero updates and no state."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps, cfg.lr * cfg.final_lr_frac)
    opt = optax.chain(optax.clip_by_global_norm(cfg.clip),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    if not frozen_keys:
        return opt

    def labels(head):
        return {k: jax.tree_util.tree_map(lambda _: "frozen" if k in frozen_keys else "train", v)
                for k, v in head.items()}

    return optax.multi_transform({"train": opt, "frozen": optax.set_to_zero()}, labels)


@functools.partial(jax.jit, static_argnames=("recipe", "cfg"), donate_argnums=(0, 1))
def _train_step(head, opt_state, frozen, batch, *, recipe, cfg):
    import optax

    (loss, (ce, acc)), grads = jax.value_and_grad(_loss, has_aux=True)(head, frozen, batch, recipe, cfg.decay)
    updates, opt_state = optimizer(cfg, recipe.frozen_keys).update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, loss, ce, acc


@functools.partial(jax.jit, static_argnames=("recipe", "decay"))
def _eval_step(head, frozen, batch, *, recipe, decay):
    loss, (ce, acc) = _loss(head, frozen, batch, recipe, decay)
    return loss, ce, acc


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where training arrays live: one device (``mesh`` None), or data parallel over a 1-D
    ``("data",)`` mesh of every device: batch rows split over it, head and optimizer state
    replicated; the compiled step then averages gradients across devices (GSPMD)."""

    mesh: Any = None

    @classmethod
    def auto(cls, batch: int, data_parallel: bool | None, log=print) -> "Placement":
        """Data parallel when asked (or, with ``None``, when more than one device is present
        and they divide ``batch``).

        Raises:
          ValueError: ``data_parallel=True`` with a batch the device count does not divide.
        """
        n = jax.device_count()
        if data_parallel is False or n == 1:
            return cls()
        if batch % n:
            if data_parallel:
                raise ValueError(f"--batch ({batch}) must be a multiple of the {n} devices for data parallelism")
            log(f"{n} devices do not divide --batch {batch}: training on one device")
            return cls()
        from jaxspec.sharding import auto_axes

        return cls(auto_axes(jax.make_mesh((n,), ("data",))))

    def rows(self, tree):
        if self.mesh is None:
            return jax.tree_util.tree_map(jnp.asarray, tree)
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec("data")))

    def replicate(self, tree):
        if self.mesh is None:
            return tree
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))


def _device_batch(data: Dataset, idx, place: Placement = Placement()) -> dict:
    """Rows ``idx`` of ``data`` on the device(s), cut to the largest of their ``row_lengths``."""
    part = data.rows(idx)
    cols = int(row_lengths(part.loss_mask).max())
    batch = place.rows({n: getattr(part, n)[:, :cols] for n in BATCH_FIELDS})
    return {**batch, "d2t": place.replicate(jnp.asarray(data.d2t))}


def evaluate(head, frozen, data: Dataset, recipe, cfg: TrainConfig, place: Placement = Placement()) -> dict:
    """Held-out loss and per-step top-1 agreement (token-weighted over ``cfg.batch``-row chunks
    of rows sorted by ``row_lengths``)."""
    k = recipe.n_steps
    totals, weight = np.zeros(1 + 2 * k), 0.0
    order = np.argsort(row_lengths(data.loss_mask), kind="stable")
    for i in range(0, len(order), cfg.batch):
        idx = order[i : i + cfg.batch]
        idx = np.pad(idx, (0, cfg.batch - len(idx)), mode="edge")  # one compiled shape per length
        loss, ce, acc = _eval_step(head, frozen, _device_batch(data, idx, place), recipe=recipe, decay=cfg.decay)
        w = float(data.loss_mask[idx].sum())
        totals += w * np.concatenate([[float(loss)], np.asarray(ce), np.asarray(acc)])
        weight += w
    totals /= max(weight, 1.0)
    return {"loss": float(totals[0]), "ce": totals[1 : 1 + k].tolist(), "acceptance": totals[1 + k :].tolist()}


def batch_indices(cfg: TrainConfig, step: int, lengths: np.ndarray) -> np.ndarray:
    """Rows of training step ``step`` among rows of ``lengths`` (``row_lengths``): a function
    of (seed, step) only, so a resumed run draws the batches a straight run draws. With
    ``cfg.group_by_length``, a length bucket drawn with probability proportional to its rows,
    then ``cfg.batch`` rows of it (every row as likely as under uniform draws); otherwise (or
    with one bucket) ``cfg.batch`` rows of all."""
    lengths = np.asarray(lengths)
    rows = np.arange(len(lengths))
    if cfg.group_by_length:
        sizes = {int(n): int(c) for n, c in zip(*np.unique(lengths, return_counts=True))}
        if len(sizes) > 1:
            pick = np.random.default_rng([cfg.seed, step, 1]).choice(list(sizes), p=np.array(list(sizes.values()))
                                                                     / len(lengths))
            rows = np.flatnonzero(lengths == pick)
    return rows[np.random.default_rng([cfg.seed, step]).choice(len(rows), cfg.batch, replace=len(rows) < cfg.batch)]


def split_indices(q: int, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) row indices of ``q`` sequences, each sorted: a permutation seeded by
    ``cfg.seed``; ``holdout`` of the rows (at least 1 when > 0)."""
    perm = np.random.default_rng([cfg.seed, 1 << 20]).permutation(q)
    n_hold = 0 if cfg.holdout == 0 else min(max(1, round(q * cfg.holdout)), q - 1)
    return np.sort(perm[n_hold:]), np.sort(perm[:n_hold])


def split(data: Dataset, cfg: TrainConfig) -> tuple[Dataset, Dataset]:
    """(train, held-out) rows of ``data`` (``split_indices``)."""
    train, held_out = split_indices(len(data.tokens), cfg)
    return data.rows(train), data.rows(held_out)


# ---------------------------------------------------------------------------- checkpoints


def _manager(out_dir: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(os.path.join(out_dir, "checkpoints")),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True))


def saved_steps(out_dir: str) -> list[int]:
    """Steps with a checkpoint in ``OUT/checkpoints``."""
    if not os.path.isdir(os.path.join(out_dir, "checkpoints")):
        return []
    with _manager(out_dir) as m:
        return sorted(m.all_steps())


def save_state(out_dir: str, step: int, state: dict) -> None:
    """orbax checkpoint of ``state`` (head + optimizer state) at ``step``."""
    import orbax.checkpoint as ocp

    with _manager(out_dir) as m:
        m.save(step, args=ocp.args.StandardSave(state))
        m.wait_until_finished()


def restore_state(out_dir: str, step: int, like: dict) -> dict:
    """The state saved at ``step``, restored into the structure and dtypes of ``like``.

    Raises:
      ValueError: no checkpoint at that step (the saved ones listed).
    """
    import orbax.checkpoint as ocp

    steps = saved_steps(out_dir)
    if step not in steps:
        raise ValueError(f"no checkpoint of step {step} in {os.path.join(out_dir, 'checkpoints')!r}; saved steps: "
                         f"{steps or 'none'}")
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
    with _manager(out_dir) as m:
        state = m.restore(step, args=ocp.args.StandardRestore(abstract))
    # as host values, placed like fresh arrays (and weak types as in ``like``): the compiled
    # training step is reused instead of recompiled for committed inputs
    return jax.tree_util.tree_map(lambda x, ref: jnp.asarray(np.asarray(x), dtype=ref.dtype), state, like)


# ---------------------------------------------------------------------------- the run


def train(target_params, target_config, data: Dataset, cfg: TrainConfig, out_dir: str, *,
          resume_from: int | None = None, progress: bool = True, write_head: bool = True, recipe=None,
          data_parallel: bool | None = None, log=print) -> dict:
    """Train a head on ``data`` and write it to ``OUT/head``.

    Args:
      target_params, target_config: the target (what the head reads of it is used frozen; its
        config and fingerprint go into the head file).
      data: ``build_dataset``'s (EAGLE: the same d2t as ``cfg.draft_vocab``).
      out_dir: checkpoints in ``OUT/checkpoints``, the head in ``OUT/head``.
      resume_from: a saved step to continue from (None: start from the seed's initial head).
      recipe: the head to train; default an EAGLE-3 head (``EagleRecipe``) of ``cfg``.
      data_parallel: split batches over every device (``Placement.auto``; None: when more than
        one device is present and they divide the batch).

    Returns:
      ``{"head", "config", "initial", "final", "losses"}``: held-out evaluations before
      and after (``evaluate``), and the training loss of every step run.
    """
    from tqdm import tqdm

    cfg.check(target_config.vocab_size, medusa=recipe is not None and recipe.kind == "medusa")
    if recipe is None:
        recipe = EagleRecipe(EagleConfig(target_config, cfg.draft_vocab, ffn_dim=cfg.ffn_dim), cfg.unroll,
                             span=answer_span(data.loss_mask), lm_head=cfg.lm_head)
    recipe.check(data)
    train_set, held = split(data, cfg)
    held = held if len(held.tokens) else train_set
    place = Placement.auto(cfg.batch, data_parallel, log)
    frozen = place.replicate(recipe.frozen(target_params))
    fresh = lambda: recipe.init(jax.random.key(cfg.seed), target_params, data.d2t)  # noqa: E731
    head = fresh()
    opt_state = optimizer(cfg, recipe.frozen_keys).init(head)
    start = 0
    if resume_from is not None:
        state = restore_state(out_dir, resume_from, {"head": head, "opt_state": opt_state})
        head, opt_state, start = state["head"], state["opt_state"], resume_from
    initial = evaluate(place.replicate(fresh()), frozen, held, recipe, cfg, place)
    head, opt_state = place.replicate(head), place.replicate(opt_state)
    losses, last_eval = [], initial
    lengths = row_lengths(train_set.loss_mask)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, desc="train")
    for step in bar:
        batch = _device_batch(train_set, batch_indices(cfg, step, lengths), place)
        head, opt_state, loss, ce, acc = _train_step(head, opt_state, frozen, batch, recipe=recipe, cfg=cfg)
        losses.append(float(loss))
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            last_eval = evaluate(head, frozen, held, recipe, cfg, place)
        if done % cfg.save_every == 0 or done == cfg.steps:
            save_state(out_dir, done, {"head": head, "opt_state": opt_state})
        bar.set_postfix(loss=f"{losses[-1]:.3f}", held_out_acc=f"{last_eval['acceptance'][0]:.3f}")
    final = evaluate(head, frozen, held, recipe, cfg, place)
    result = {"head": head, "config": recipe.config, "initial": initial, "final": final, "losses": losses}
    if write_head:
        info = {"settings": dataclasses.asdict(cfg), "sequences": int(len(data.tokens)),
                "held_out_sequences": int(len(held.tokens)), "initial": initial, "final": final}
        recipe.save(os.path.join(out_dir, "head"), head, data, target_params, info)
    return result


def run(model, prompt_ids: list[list[int]], cfg: TrainConfig, out_dir: str, *, max_new_tokens: int = 128,
        gen_batch: int = 8, resume: bool | int = False, progress: bool = True, medusa_heads: int = 0,
        sequences: list[tuple[list[int], int]] | None = None, answers_only: bool = False, log=print) -> dict:
    """The whole pipeline: self-distill, choose the draft vocabulary, teacher-forced
    features, train. The answers are kept in ``OUT/sequences.json`` (``sequences=`` reuses
    another run's: ``drafter_data.load_sequences``), prepared data in ``OUT/data.npz``, reused
    when resuming and by a fresh run whose data settings (target, answers, ``DATA_SETTINGS``)
    are those of ``OUT/train.json``: changing the steps or the learning rate does not redo the
    target's features.
    ``medusa_heads`` > 0 trains that many Medusa-1 heads instead of an EAGLE-3 head
    (``checkpoints_tools.train_medusa``; ``cfg.draft_vocab`` 0: over the whole vocabulary).

    Args:
      model: the target ``jaxspec.Model`` (or an object with ``params`` and ``config``).
      prompt_ids: token ids of each prompt to answer (``drafter_data.encode``); may be empty
        when ``sequences`` are given.
      sequences: ``(prompt + answer ids, prompt length)`` per prompt, answered already: trained
        on before the answers to ``prompt_ids``.
      resume: False (start; ``OUT`` must hold no checkpoint), True (the latest saved step)
        or a step number.
      answers_only: stop once ``OUT/sequences.json`` is written (answer on one machine, train
        on another); returns ``{"sequences": path, "n": count}``.

    Raises:
      ValueError: a setting out of range (named, with its limit), no prompt, a resume with
        no checkpoint or with other settings than ``OUT/train.json`` records; all before any
        compile.
    """
    from jaxspec.checkpoints.heads import fingerprint

    from checkpoints_tools import drafter_data

    config, params = model.config, model.params
    cfg.check(config.vocab_size, medusa=medusa_heads > 0)
    answered = list(sequences or [])
    if not prompt_ids and not answered:
        raise ValueError("the training data is empty: no prompt and no answered sequence")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    os.makedirs(out_dir, exist_ok=True)
    if medusa_heads < 0:
        raise ValueError(f"--heads must be >= 1, got {medusa_heads}")
    record = {"settings": dataclasses.asdict(cfg), "max_new_tokens": max_new_tokens,
              "n_prompts": len(prompt_ids) + len(answered),
              "target": config.to_dict(), "target_fingerprint": fingerprint(params), "medusa_heads": medusa_heads}
    meta, data_file = os.path.join(out_dir, "train.json"), os.path.join(out_dir, "data.npz")
    steps = saved_steps(out_dir)
    resume_step = None
    if resume is not False:
        if not steps:
            raise ValueError(f"--resume: no checkpoint in {os.path.join(out_dir, 'checkpoints')!r}")
        resume_step = steps[-1] if resume is True else int(resume)
        with open(meta) as f:
            saved = json.load(f)
        saved["settings"].setdefault("lm_head", "random")  # runs from before --lm-head
        keep = lambda r: {**r, "settings": {k: v for k, v in r["settings"].items() if k != "steps"}}  # noqa: E731
        if keep(saved) != keep(record):
            raise ValueError(f"--resume: the settings, prompts or target differ from those in {meta!r}")
    elif steps:
        raise ValueError(f"{out_dir!r} already holds checkpoints (steps {steps}): pass --resume, or another --out")
    # A fresh run in a directory whose data.npz was prepared for the same data (target, answers,
    # draft vocabulary, soft labels) reuses it, whatever the optimizer settings.
    data_key = lambda r: ({k: r["settings"][k] for k in DATA_SETTINGS},  # noqa: E731
                          {k: v for k, v in r.items() if k != "settings"})
    same_data = os.path.isfile(meta) and os.path.isfile(data_file)
    if same_data:
        with open(meta) as f:
            same_data = data_key(json.load(f)) == data_key(record)
    with open(meta, "w") as f:
        json.dump(record, f, indent=1)
    if not answers_only and (resume_step is not None or same_data) and os.path.isfile(data_file):
        data = Dataset.load(data_file)
    else:
        from tqdm import tqdm

        sequences = answered
        if prompt_ids:
            log(f"self-distillation: {len(prompt_ids)} prompts x {max_new_tokens} new tokens")
            with tqdm(total=len(prompt_ids), disable=not progress, desc="answers") as bar:
                sequences = answered + drafter_data.self_distill(model, prompt_ids, max_new_tokens=max_new_tokens,
                                                                 batch=gen_batch, progress=bar.update)
        drafter_data.save_sequences(os.path.join(out_dir, "sequences.json"), sequences, params, max_new_tokens)
        if answers_only:
            return {"sequences": os.path.join(out_dir, "sequences.json"), "n": len(sequences)}
        d2t = np.zeros((0,), np.int32)
        if cfg.draft_vocab:
            d2t = drafter_data.draft_vocabulary(sequences, cfg.draft_vocab, config.vocab_size)
            log(f"draft vocabulary: {cfg.draft_vocab} tokens cover {drafter_data.coverage(sequences, d2t):.1%} of "
                f"the answer tokens")
        capture = None if medusa_heads else EagleConfig(config, cfg.draft_vocab).capture
        with tqdm(total=len(sequences), disable=not progress, desc="target features") as bar:
            data = build_dataset(params, config, sequences, d2t, capture, batch=gen_batch, progress=bar.update,
                                 soft_topk=1 if medusa_heads else cfg.soft_topk)  # Medusa: hard labels
        data.save(data_file)
    recipe = None
    if medusa_heads:
        from checkpoints_tools.train_medusa import MedusaRecipe

        recipe = MedusaRecipe(config, medusa_heads, cfg.draft_vocab, span=answer_span(data.loss_mask))
    return train(params, config, data, cfg, out_dir, resume_from=resume_step, progress=progress, recipe=recipe,
                 log=log)
