"""GRPO on arithmetic word problems, with rollouts sampled by jaxspec, plain and speculative.

Every step samples ``--group`` G answers to each problem at temperature 1 with the current
policy, twice on the same weights: plain decoding, and speculative decoding with the
rollout-history drafter (``jaxspec.HistoryDrafter``: the row's own text, its G - 1 siblings
and the earlier rollouts of its problem, kept in a ``jaxspec.RolloutHistory``). Both are
scored (1 when the last number of the answer is the exact result, else 0), and one of them,
alternating (even steps plain, odd steps speculative), feeds an on-policy GRPO update:

    advantage A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)   (Shao et al. 2024, Sec. 4.1)
    loss = - sum over the batch's answer tokens of A_i * log p(token) / their count

with one Adam step per batch of rollouts (on-policy, so the probability ratio is 1 and neither
clipping nor a KL term applies). The trained weights are the last ``--train-layers`` decoder
blocks and the final norm; the rest stay frozen (the forward runs through all of them, the
backward only through those), so the policy's weights change every step while a step fits a
CPU. Speculative sampling keeps each rollout an exact sample of the policy, so the two reward
columns estimate the same quantity at every step.

The last line printed is one JSON object:

    {"steps", "recompiles": calls after each method's first that compiled (0 expected),
     "tau_last_epoch": tokens per verify step of the last step's speculative rollouts,
     "passes_ratio_last_epoch": makespan in target passes (each call's slowest row's, summed
        over the step's calls), speculative over plain, last step,
     "speedup_last_epoch": plain rollout seconds / speculative rollout seconds, last step,
     "rollout_s_plain", "rollout_s_spec": rollout seconds over all steps (compiles excluded),
     "reward_plain", "reward_spec": mean reward per step,
     "reward_agreement_z": the paired z of the per-step reward difference (``agreement_z``),
     "update_norm": the global norm of each step's weight update (0 when every group's
        rewards are equal: GRPO's advantages are then 0)}

Every problem is sampled every step, so a step is an epoch over the problems. Run:

    python examples/grpo_rollouts.py [--model qwen2.5-coder-0.5b] [--problems 4] [--group 8]
        [--steps 10] [--max-new-tokens 128] [--prompts FILE.jsonl] [--rows N]

``--rows N`` samples N rows per ``generate`` call (default: every row in one call). Each call's
rollouts join the history at once, so with ``--rows 1`` a problem's later samples draft from
its earlier ones within the step, as siblings would. On a CPU the drafter pays at 1-2 rows per
call, and the batch policy decodes larger calls plainly (the per-step lines say so).

``--prompts`` reads JSONL lines ``{"question": str, "answer": int}``; without it the problems
are generated, seeded by ``--seed``. ``--model random-tiny`` is a tiny random decoder over
SmolLM2's tokenizer, for a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxspec
from jaxspec import models
from jaxspec.cache import KVCache


def problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` arithmetic word problems ``{"question", "answer"}`` with exact integer answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        boxes, per_box, sold = rng.randint(3, 30), rng.randint(2, 12), rng.randint(1, 20)
        sold = min(sold, boxes * per_box)
        out.append({"question": f"A shop has {boxes} boxes with {per_box} apples in each box. It sells {sold} "
                                f"apples. How many apples are left? Think step by step, then give the answer.",
                    "answer": boxes * per_box - sold})
    return out


def reward(text: str, answer: int) -> float:
    """1.0 when the last integer in ``text`` equals ``answer``, else 0.0."""
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(numbers) and int(numbers[-1]) == answer)


def _random_tiny() -> jaxspec.Model:
    """A tiny random decoder over SmolLM2's tokenizer (smoke tests)."""
    smol = jaxspec.load("smollm2-135m")
    cfg = dataclasses.replace(smol.config, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                              name="random-tiny")
    return jaxspec.Model(models.init_params(cfg, jax.random.key(0), scale=1.0), cfg, smol.tokenizer)


def split(params: dict, n_train: int) -> tuple[dict, dict]:
    """``(trained, frozen)`` halves of a decoder params tree: the last ``n_train`` blocks and the
    final norm, and everything else."""
    layers = params["layers"]
    cut = len(layers) - n_train
    trained = {"layers": list(layers[cut:]), "final_norm": params["final_norm"]}
    frozen = {k: v for k, v in params.items() if k not in ("layers", "final_norm")}
    frozen["layers"] = list(layers[:cut])
    return trained, frozen


def join(trained: dict, frozen: dict) -> dict:
    """The params tree from ``split``'s halves."""
    out = dict(frozen)
    out["layers"] = list(frozen["layers"]) + list(trained["layers"])
    out["final_norm"] = trained["final_norm"]
    return out


def grpo_loss(trained, frozen, cfg, tokens, mask, advantages, n_answer_tokens):
    """GRPO's on-policy loss (module docstring) over some rows: ``tokens [R, T]`` (prompt +
    answer, padded), ``mask [R, T - 1]`` (1 where the next token is an answer token),
    ``advantages [R]``; divided by the whole batch's ``n_answer_tokens``, so the rows' losses add up."""
    params = join(trained, frozen)
    r, t = tokens.shape
    out = models.forward(params, cfg, tokens[:, :-1], jnp.broadcast_to(jnp.arange(t - 1), (r, t - 1)),
                         KVCache.zeros(cfg, r, t - 1, jnp.float32))
    logp = jnp.take_along_axis(jax.nn.log_softmax(out.logits), tokens[:, 1:, None], -1)[..., 0]
    return -jnp.sum(advantages[:, None] * logp * mask) / n_answer_tokens


def grads_of(grad_fn, trained, frozen, cfg, tokens, mask, adv, micro: int):
    """``(loss, grads)`` of the whole batch, ``micro`` rows at a time (the logits of a
    150k-token vocabulary over every row at once would not fit memory)."""
    total = jnp.maximum(jnp.sum(mask), 1.0)
    loss, grads = 0.0, None
    for s in range(0, tokens.shape[0], micro):
        part = slice(s, s + micro)
        l, g = grad_fn(trained, frozen, cfg, tokens[part], mask[part], adv[part], total)
        loss += l
        grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
    return loss, grads


def batch_of(prompt_ids: list[list[int]], answers: list[list[int]]):
    """``(tokens [R, T], mask [R, T - 1])``: each row its prompt then its answer, right-padded to
    a multiple of 64 tokens (so the gradient's program is reused from step to step)."""
    width = -(-max(len(p) + len(a) for p, a in zip(prompt_ids, answers)) // 64) * 64
    tokens = np.zeros((len(answers), width), np.int32)
    mask = np.zeros((len(answers), width - 1), np.float32)
    for i, (p, a) in enumerate(zip(prompt_ids, answers)):
        tokens[i, : len(p) + len(a)] = p + a
        mask[i, len(p) - 1 : len(p) + len(a) - 1] = 1.0
    return jnp.asarray(tokens), jnp.asarray(mask)


def advantages_of(rewards: np.ndarray, group: int) -> np.ndarray:
    """Group-relative advantages of ``rewards [P * G]`` (prompt-major)."""
    r = rewards.reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1)


def agreement_z(log: dict) -> float | None:
    """The paired test of the two reward columns: z = mean(d) / (sd(d) / sqrt(steps)), d the
    per-step difference speculative - plain (same weights at each step, so under exact
    sampling E[d] = 0); compared with Student's t on steps - 1 degrees of freedom, |z| < 2.26
    agrees at the 5% level over 10 steps. None with fewer than 2 steps or no spread."""
    d = np.array([s["reward"] - p["reward"] for s, p in zip(log["spec"], log["plain"])])
    if len(d) < 2 or d.std(ddof=1) == 0:
        return None
    return float(d.mean() / (d.std(ddof=1) / np.sqrt(len(d))))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompts", default=None, help="JSONL of {\"question\", \"answer\"} (default: generated)")
    p.add_argument("--problems", type=int, default=4, help="generated problems (without --prompts)")
    p.add_argument("--group", type=int, default=8, help="samples per problem (G)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--train-layers", type=int, default=2, help="decoder blocks trained, the last ones")
    p.add_argument("--rows", type=int, default=0,
                   help="rows per generate call (default 0: all problems x group in one call); on a CPU the "
                        "history drafter pays at 1-2 rows, and the batch policy decodes larger calls plainly")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per gradient computation")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model = _random_tiny() if args.model == "random-tiny" else jaxspec.load(args.model)
    if args.prompts:
        with open(args.prompts) as f:
            tasks = [json.loads(line) for line in f if line.strip()]
    else:
        tasks = problems(args.problems, args.seed)
    questions = [t["question"] for t in tasks]
    answers = [int(t["answer"]) for t in tasks]
    prompt_ids = jaxspec.request.prompt_ids(questions, model.tokenizer, chat=True)
    cfg, tok, g = model.config, model.tokenizer, args.group
    trained, frozen = split(model.params, args.train_layers)
    opt = optax.adam(args.lr)
    opt_state = opt.init(trained)
    history = jaxspec.RolloutHistory(vocab_size=cfg.vocab_size, capacity=max(16, g),
                                     max_tokens=args.max_new_tokens + jaxspec.rollouts.PROMPT_TAIL)
    drafter = jaxspec.HistoryDrafter()
    grad_fn = jax.jit(jax.value_and_grad(grpo_loss), static_argnames="cfg")
    log = {"plain": [], "spec": []}
    recompiles, update_norms = 0, []
    rows = [q for q in questions for _ in range(g)]  # prompt-major: row i samples question i // g
    per_call = args.rows or len(rows)
    calls = [rows[i : i + per_call] for i in range(0, len(rows), per_call)]
    for step in range(args.steps):
        params = join(trained, frozen)
        kw = dict(config=cfg, tokenizer=tok, chat=True, temperature=1.0, max_new_tokens=args.max_new_tokens)
        runs = {}
        for name in ("plain", "spec"):
            tokens, texts, stats = [], [], {"run_s": 0.0, "wall_s": 0.0, "makespan": 0, "steps": 0, "emitted": 0}
            for c, call in enumerate(calls):
                extra = dict(drafter=drafter, drafter_params=history) if name == "spec" else {}
                t0 = time.perf_counter()
                res = jaxspec.generate(params, call, seed=((step * len(calls) + c) * 2 + (name == "spec")) * 1000
                                       + args.seed, **kw, **extra)
                stats["wall_s"] += time.perf_counter() - t0
                m = res.metrics
                recompiles += bool(step and m.compiled)
                stats["run_s"] += m.run_s
                stats["makespan"] += int(m.target_forwards.max())  # a call waits for its slowest row
                stats["steps"] += int(m.verify_steps.sum())
                stats["emitted"] += int((m.new_tokens - 1).clip(0).sum())
                stats["speculation_off"] = m.speculation
                tokens += res.tokens
                texts += res.texts
                if name == "spec":
                    history = res.history
            rewards = np.array([reward(text, answers[i // g]) for i, text in enumerate(texts)])
            tau = stats.pop("emitted") / max(stats.pop("steps"), 1)
            log[name].append({"reward": float(rewards.mean()), "tau": tau, **stats})
            runs[name] = (tokens, rewards)
        tokens, rewards = runs["plain" if step % 2 == 0 else "spec"]
        tokens, mask = batch_of([prompt_ids[i // g] for i in range(len(tokens))], tokens)
        adv = jnp.asarray(advantages_of(rewards, g), jnp.float32)
        loss, grads = grads_of(grad_fn, trained, frozen, cfg, tokens, mask, adv, args.micro_batch)
        updates, opt_state = opt.update(grads, opt_state, trained)
        trained = optax.apply_updates(trained, updates)
        update_norms.append(float(optax.tree.norm(updates)))
        print(json.dumps({"step": step, "loss": float(loss), **{f"{k}_{n}": v for n in log for k, v in log[n][-1].items()}}),
              flush=True)
    last_p, last_s = log["plain"][-1], log["spec"][-1]
    summary = {
        "steps": args.steps,
        "recompiles": recompiles,
        "tau_last_epoch": last_s["tau"],
        "passes_ratio_last_epoch": last_s["makespan"] / last_p["makespan"],
        "speedup_last_epoch": last_p["run_s"] / last_s["run_s"],
        "rollout_s_plain": sum(x["run_s"] for x in log["plain"]),
        "rollout_s_spec": sum(x["run_s"] for x in log["spec"]),
        "reward_plain": [x["reward"] for x in log["plain"]],
        "reward_spec": [x["reward"] for x in log["spec"]],
        "update_norm": update_norms,
        "reward_agreement_z": agreement_z(log),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
