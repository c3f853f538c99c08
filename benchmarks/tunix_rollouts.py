"""Tunix's rollout engines side by side on Tunix's own Qwen2: its sampler against jaxspec's engine.

The policy is Tunix's ``Qwen2`` module (``tunix.models.qwen2``) holding the packaged
Qwen2.5-Coder-0.5B-Instruct weights (``jaxspec.load``, written in by
``jaxspec.models.tunix.qwen2_module``). Each epoch samples ``--group`` G answers to each of
``--prompts`` arithmetic problems (``examples/grpo_rollouts.py``'s, seeded, as chat turns) at
temperature 1 in calls of ``--rows`` rows, every engine in turn, call by call (interleaved):

- ``tunix``: Tunix's ``VanillaRollout`` (its ``Sampler``, plain decoding);
- ``plain``: ``jaxspec.tunix_rollout.JaxspecRollout`` without a drafter;
- ``history``: ``JaxspecRollout`` with the history drafter (siblings in the call and every
  earlier rollout of the prompt, carried by the engine).

Each engine is called through Tunix's ``BaseRollout.generate``, as a learner calls it, and
timed by wall clock around that call (tokenization and decoding included); a first call of
each engine compiles and is not timed. Per epoch and engine: seconds, generated tokens,
tokens/s, the speedup over ``tunix``, and for jaxspec's engines tau. The weights stay fixed:
the epochs show what the history brings as it fills. Needs the ``tunix`` extra in its own
environment (docs/rollouts.md, "Tunix").

    python -m benchmarks.tunix_rollouts [--prompts 2] [--group 4] [--rows 1] [--epochs 2] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks.bench_env import command, machine_info, result_stem, versions, write_record

ENGINES = ("tunix", "plain", "history")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--rows", type=int, default=1, help="rows per call (a multiple or divisor of --group)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import jaxspec
    from examples.grpo_rollouts import problems
    from tunix.rl.rollout import base_rollout
    from tunix.rl.rollout.vanilla_rollout import VanillaRollout

    from jaxspec.models.tunix import qwen2_module
    from jaxspec.tunix_rollout import JaxspecRollout, TunixTokenizer

    t_start = time.time()
    if args.rows % args.group and args.group % args.rows:
        raise SystemExit("--rows must be a multiple or a divisor of --group")
    model = jaxspec.load(args.model)
    actor = qwen2_module(model)
    tok = TunixTokenizer.of(model)
    c = actor.config
    cache = base_rollout.CacheConfig(cache_size=args.max_prompt_length + args.max_new_tokens, num_layers=c.num_layers,
                                     num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    engines = {"tunix": VanillaRollout(actor, tok, cache),
               "plain": JaxspecRollout(actor, tok, drafter=None, max_position=model.config.max_position),
               "history": JaxspecRollout(actor, tok, max_position=model.config.max_position,
                                         history_capacity=max(16, args.group), disable_by_batch_size=None,
                                         disable_by_acceptance=None)}
    chats = [model.tokenizer.apply_chat_template([{"role": "user", "content": t["question"]}])
             for t in problems(args.prompts, args.seed)]
    rows = [q for q in chats for _ in range(args.group)]
    calls = [rows[i : i + args.rows] for i in range(0, len(rows), args.rows)]
    config = base_rollout.RolloutConfig(max_tokens_to_generate=args.max_new_tokens, temperature=1.0, top_p=1.0,
                                        max_prompt_length=args.max_prompt_length)
    for name, engine in engines.items():  # compile each engine's program on a throwaway call
        engine.generate(calls[0], dataclasses.replace(config, seed=10**6))
    engines["history"].history = None  # the throwaway call's rollouts are not part of the run
    epochs = []
    for epoch in range(args.epochs):
        stats = {e: {"s": 0.0, "tokens": 0, "steps": 0, "emitted": 0, "compiled": 0} for e in engines}
        for k, call in enumerate(calls):
            seed = epoch * len(calls) + k
            for name, engine in engines.items():
                t0 = time.perf_counter()
                out = engine.generate(call, dataclasses.replace(config, seed=seed))
                s = stats[name]
                s["s"] += time.perf_counter() - t0
                s["tokens"] += sum(len(t) for t in out.tokens)
                if name != "tunix":
                    for m in engine.metrics:
                        s["steps"] += int(m.verify_steps.sum())
                        s["emitted"] += int((m.new_tokens - 1).clip(0).sum())
                        s["compiled"] += int(m.compiled)
        for name, s in stats.items():
            s["tokens_per_s"] = s["tokens"] / s["s"]
            s["speedup_over_tunix"] = s["tokens_per_s"] / stats["tunix"]["tokens_per_s"]
            if name != "tunix":
                s["tau"] = s["emitted"] / s["steps"] if s["steps"] else 1.0
        epochs.append(stats)
        print(f"epoch {epoch}: " + "; ".join(
            f"{n} {s['tokens_per_s']:.2f} tok/s ({s['speedup_over_tunix']:.2f}x)" + (f" tau {s['tau']:.2f}" if "tau" in s
                                                                                     else "")
            for n, s in stats.items()), flush=True)
    record = {"benchmark": "tunix_rollouts", "model": args.model, "dtype": "float32", "policy": "tunix.models.qwen2",
              "prompts": args.prompts, "group": args.group, "rows_per_call": args.rows, "epochs": args.epochs,
              "temperature": 1.0, "max_new_tokens": args.max_new_tokens, "engines": list(engines),
              "per_epoch": epochs, "summary": {n: {"speedup_over_tunix_last_epoch": epochs[-1][n]["speedup_over_tunix"],
                                                   "tau_last_epoch": epochs[-1][n].get("tau")} for n in engines},
              "machine": machine_info(), "versions": {**versions(), "google-tunix": _version("google-tunix")},
              "command": command(argv), "elapsed_s": time.time() - t_start}
    write_record(record, args.out or result_stem("tunix_rollouts", f"{args.model}-g{args.group}-rows{args.rows}")
                 + ".json")
    return 0


def _version(dist: str):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
