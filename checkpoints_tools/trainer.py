"""The training loop every draft head shares (``python -m checkpoints_tools train-eagle`` and
``train-medusa``), with optax and orbax.

``run`` is the whole pipeline: self-distillation (``checkpoints_tools.drafter_data``: prompts
answered by the target itself with ``jaxspec.generate``), the draft vocabulary (d2t: the most
frequent answer tokens), the teacher-forced features (``checkpoints_tools.head_dataset``), then
``train``: optax AdamW, linear warmup + cosine decay, global-norm gradient clipping; orbax
checkpoints of (head, optimizer state) every ``save_every`` steps in ``OUT/checkpoints``, any of
which ``resume`` continues from bit for bit (batches are a function of the seed and the step);
a tqdm bar with the loss and the held-out acceptance (the head's top-1 equals the target's
top-1, first step: the chance a greedy draft is accepted); the head in ``OUT/head``
(``jaxspec.checkpoints.heads``) with the target's config and weight fingerprint.

``train`` takes a recipe for the head it trains, which gives its initial parameters, its
losses and how it is saved: ``checkpoints_tools.train_eagle.EagleRecipe`` (EAGLE-3) or
``checkpoints_tools.train_medusa.MedusaRecipe`` (Medusa-1). With several devices, batches are
split over all of them (data parallelism, ``Placement``), the head replicated.
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

from checkpoints_tools.head_dataset import (BATCH_FIELDS, Dataset, answer_span, batch_indices, build_dataset,
                                            row_lengths, split)
from checkpoints_tools.train_eagle import EagleRecipe
from checkpoints_tools.train_medusa import MedusaRecipe
from jaxspec.models.eagle3 import EagleConfig

DATA_SETTINGS = ("draft_vocab", "soft_topk")  # the TrainConfig fields that OUT/data.npz depends on
LM_HEAD_INITS = ("random", "target", "frozen")  # TrainConfig.lm_head


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


# ---------------------------------------------------------------------------- the optimizer and the steps


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

    def fresh():
        return recipe.init(jax.random.key(cfg.seed), target_params, data.d2t)

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

        def keep(r):
            return {**r, "settings": {k: v for k, v in r["settings"].items() if k != "steps"}}

        if keep(saved) != keep(record):
            raise ValueError(f"--resume: the settings, prompts or target differ from those in {meta!r}")
    elif steps:
        raise ValueError(f"{out_dir!r} already holds checkpoints (steps {steps}): pass --resume, or another --out")
    # A fresh run in a directory whose data.npz was prepared for the same data (target, answers,
    # draft vocabulary, soft labels) reuses it, whatever the optimizer settings.

    def data_key(r):
        return ({k: r["settings"][k] for k in DATA_SETTINGS},
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
        recipe = MedusaRecipe(config, medusa_heads, cfg.draft_vocab, span=answer_span(data.loss_mask))
    return train(params, config, data, cfg, out_dir, resume_from=resume_step, progress=progress, recipe=recipe,
                 log=log)
