"""The teacher-forced dataset a draft head trains on (EAGLE-3 and Medusa-1 alike), and how its
rows are batched and split.

``build_dataset`` runs the target once over each answered sequence (``jaxspec.models.forward``
with ``capture=``, rows sorted by length and each batch cut to a multiple of ``SEQ_BUCKET``
tokens) and keeps, per token, the captured layers (or the final hidden state) and the target's
next-token distribution restricted to the draft vocabulary, of which the ``soft_topk`` most
probable tokens are kept, renormalised (sparse distillation: the rest of the mass is a long tail
the head need not learn, and the dense distribution would take Vd floats a token; SmolLM2, K 32:
7.2 KB a token, dense Vd 8192 would be 39 KB). ``batch_indices`` draws a step's rows (a
function of the seed and the step, so a resumed run draws what a straight run draws) and
``split_indices`` holds rows out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.cache import KVCache

if TYPE_CHECKING:
    from checkpoints_tools.trainer import TrainConfig

BATCH_FIELDS = ("tokens", "features", "soft_ids", "soft_p", "target_top", "loss_mask")  # a training batch's rows
SEQ_BUCKET = 64  # sequences are padded, and batches cut, to a multiple of this many tokens


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


def answer_span(loss_mask: np.ndarray) -> int:
    """The widest run of positions, first to last loss position of a row, over the rows of
    ``loss_mask [Q, T]``: the window of each row that the losses read."""
    first, last, any_ = _loss_bounds(loss_mask)
    return int(np.max(np.where(any_, last - first + 1, 0)))


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


# ---------------------------------------------------------------------------- windows of a batch


def shift_left(x, n: int):
    """``x [B, T, ...]`` moved n positions left along T, zero-padded at the end."""
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def take_window(x, lo, size: int):
    """``x [B, T, ...]`` at positions ``lo[b] .. lo[b] + size - 1`` of each row (clipped to [0, T - 1])."""
    idx = jnp.clip(lo[:, None] + jnp.arange(size), 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

