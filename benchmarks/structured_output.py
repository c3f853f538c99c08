"""Structured output under speculation: JSON extraction with a JSON Schema, constrained plain
decoding against grammar-only speculation (``GrammarDrafter``) and n-gram drafts (with the
forced runs the grammar adds), side by side in one process.

Prompts: ``PROMPTS`` below, short passages written for this benchmark, each with the schema of
what to extract (a person, a product, an event; keys in the schema's order), asked through the
model's chat template. Per prompt the methods run round-robin (each method's first call
compiles and is run again, so no timing includes a compile); a method's speed on a prompt is
its tokens per second over constrained plain decoding's on the same prompt, and the figures
are medians over prompts. Also recorded: the valid rate (texts that parse and validate with
``jsonschema``, of those that finished), tau (tokens per verify step) and whether the tokens
equal constrained plain decoding's (greedy: they must).

Run from the repository root::

    python -m benchmarks.structured_output [--model smollm2-135m] [--dtype float32]
        [--max-new-tokens 96] [--prompts 12] [--methods plain,grammar_g8,ngram_g4,eagle_g3,hf_plain]

Writes ``benchmarks/results/structured_output_<model>_cpu_<date>.json`` (machine, versions,
command, per-prompt rows) and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.bench_env import command, machine_info, median, result_stem, versions, write_record

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "occupation": {"type": "string"}},
          "required": ["name", "age", "city", "occupation"]}
PRODUCT = {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                                            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                                            "in_stock": {"type": "boolean"}},
           "required": ["product", "price", "currency", "in_stock"]}
EVENT = {"type": "object", "properties": {"event": {"type": "string"},
                                          "date": {"type": "string", "pattern": "[0-9]{4}-[0-9]{2}-[0-9]{2}"},
                                          "location": {"type": "string"}, "attendees": {"type": "integer"}},
         "required": ["event", "date", "location", "attendees"]}
PROMPTS = [
    (PERSON, "Maria Lopez is a 34-year-old architect who lives in Barcelona."),
    (PERSON, "At 52, Tom Becker still runs the bakery his father opened in Hamburg."),
    (PERSON, "Our new intern, Priya Nair (21), studies chemistry and lives in Pune."),
    (PERSON, "The pilot, Captain James Okafor, 45, is based in Lagos."),
    (PRODUCT, "The Aeron office chair costs 1395 dollars and is currently in stock."),
    (PRODUCT, "Sold out: the limited edition vinyl, priced at 39.99 euros."),
    (PRODUCT, "A pack of six notebooks is 12.50 GBP; the shop has plenty left."),
    (PRODUCT, "The X200 headphones, 249 USD, are back in stock this week."),
    (EVENT, "PyCon Lithuania takes place in Vilnius on 2025-04-23 with about 600 attendees."),
    (EVENT, "The city marathon on 2024-10-13 in Chicago drew 52000 runners."),
    (EVENT, "Around 120 people came to the book fair in Porto on 2023-06-02."),
    (EVENT, "The robotics workshop in Tokyo on 2025-01-15 is limited to 40 participants."),
]


def instruction(schema: dict, passage: str) -> str:
    keys = ", ".join(schema["properties"])
    return f"Extract the fields {keys} from the text below and answer with one JSON object.\n\nText: {passage}"


def drafter_of(method: str, model=None, model_name: str = "smollm2-135m"):
    """``(drafter, drafter_params)`` of ``plain``, ``grammar_gK`` (GrammarDrafter),
    ``ngram_gK`` (NGramDrafter) or ``eagle_gK`` (the EAGLE-3 head that ships for
    ``model_name``, a chain of K drafted from its masked q; needs the target ``model``)."""
    import jaxspec

    if method == "plain":
        return None, None
    kind, gamma = method.rsplit("_g", 1)
    if kind == "grammar":
        return jaxspec.GrammarDrafter(gamma=int(gamma)), None
    if kind == "ngram":
        return jaxspec.NGramDrafter(gamma=int(gamma)), None
    if kind == "eagle":
        return jaxspec.load_eagle_head(jaxspec.shipped_head(model_name, "eagle3"), model, gamma=int(gamma))
    raise ValueError(f"unknown method {method!r}: plain, grammar_gK, ngram_gK or eagle_gK")


class HFConstrained:
    """transformers' ``generate`` under the same automaton: a logits processor that masks each
    position's scores to the tokens ``jaxspec.grammar``'s tables (outlines-core's index over
    the same vocabulary) allow after the tokens generated so far. It reads the state from the
    ids it is given, so it serves plain decoding and prompt lookup alike (assisted decoding
    calls it for every candidate position)."""

    def __init__(self, model_name: str, tokenizer, vocab_size: int):
        import torch
        from benchmarks.spec_bench import load_hf

        self.torch, self.tok, self.vocab = torch, tokenizer, vocab_size
        self.model = load_hf(model_name)

    def __call__(self, method: str, ids: list[int], fmt: dict, max_new: int, eos: list[int]):
        """``(tokens, seconds)`` of greedy ``method`` (``hf_plain`` or ``hf_prompt_lookup_gK``)."""
        import numpy as np
        import transformers
        from jaxspec import grammar

        torch = self.torch
        tables = grammar.tables([grammar.compile_grammar(None, fmt, self.tok)], eos, self.vocab)
        start = len(ids)

        class Mask(transformers.LogitsProcessor):
            def __call__(self, input_ids, scores):
                for b in range(input_ids.shape[0]):
                    state = tables.run(0, input_ids[b, start:].tolist())
                    allowed = np.zeros(scores.shape[-1], bool) if state < 0 else \
                        tables.next_state[state, tables.token_class][: scores.shape[-1]] >= 0
                    scores[b, torch.from_numpy(~allowed)] = -float("inf")
                return scores

        x = torch.tensor([ids], dtype=torch.long)
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
                  do_sample=False, logits_processor=transformers.LogitsProcessorList([Mask()]))
        if method.startswith("hf_prompt_lookup"):
            kw["prompt_lookup_num_tokens"] = int(method.rsplit("_g", 1)[1]) if "_g" in method else 10
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(x, **kw)
            sec = time.perf_counter() - t0
        return out[0, start:].tolist(), sec


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--methods", default="plain,grammar_g8,ngram_g4",
                   help="plain first; grammar_gK, ngram_gK, eagle_gK (the shipped head); hf_plain, "
                        "hf_prompt_lookup_gK (transformers, same grammar)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (tokens must equal constrained plain's); > 0: sampled, seed 0 (valid rate and tau; "
                        "transformers methods run greedy only)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import jaxspec

    t_start = time.time()
    methods = args.methods.split(",")
    if methods[0] != "plain":
        raise SystemExit("--methods must start with plain (the reference)")
    if args.temperature > 0 and any(m.startswith("hf_") for m in methods):
        raise SystemExit("--temperature > 0 runs jaxspec's methods only (drop the hf_ methods)")
    model = jaxspec.load(args.model, dtype=args.dtype)
    hf = None
    if any(m.startswith("hf_") for m in methods):
        hf = HFConstrained(args.model, model.tokenizer, model.config.vocab_size)
    drafters = {m: drafter_of(m, model, args.model) for m in methods if not m.startswith("hf_")}
    rows = []
    for i, (schema, passage) in enumerate(PROMPTS[: args.prompts]):
        fmt = {"type": "json_schema", "json_schema": {"name": "extract", "schema": schema}}
        row = {"prompt": i, "passage": passage}
        for method in methods:
            if method.startswith("hf_"):
                from jaxspec.request import prompt_ids

                ids = prompt_ids(instruction(schema, passage), model.tokenizer, True)[0]  # as generate's chat=True
                tokens, sec = hf(method, ids, fmt, args.max_new_tokens, list(model.config.eos_ids))
                if not rows:  # the first prompt's first call warms transformers up: run it again
                    tokens, sec = hf(method, ids, fmt, args.max_new_tokens, list(model.config.eos_ids))
                text = model.tokenizer.decode(tokens)
                finished = bool(tokens) and tokens[-1] in model.config.eos_ids
                row[method] = {"tokens": tokens, "text": text, "finish": "stop" if finished else "length",
                               "new_tokens": len(tokens), "run_s": sec, "tok_s": len(tokens) / sec, "tau": None,
                               "valid": valid(text, schema) if finished else None}
                continue

            def run():
                drafter, drafter_params = drafters[method]
                return jaxspec.generate(model, instruction(schema, passage), chat=True, response_format=fmt,
                                        drafter=drafter, drafter_params=drafter_params,
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature)
            out = run()
            if out.metrics.compile_s > 0:  # the first call of a program compiles: time a second one
                out = run()
            m = out.metrics
            row[method] = {"tokens": out.tokens[0], "text": out.texts[0], "finish": out.finish_reasons[0],
                           "new_tokens": int(m.new_tokens[0]), "run_s": m.run_s,
                           "tok_s": float(m.new_tokens[0]) / m.run_s, "tau": float(m.tau),
                           "valid": valid(out.texts[0], schema) if out.finish_reasons[0] == "stop" else None}
        for method in methods:
            r = row[method]
            r["speedup"] = r["tok_s"] / row["plain"]["tok_s"]
            r["same_tokens"] = r["tokens"] == row["plain"]["tokens"]
        rows.append(row)
        print(f"prompt {i}: " + ", ".join(f"{m} {row[m]['speedup']:.2f}x tau {row[m]['tau'] or 0:.2f}" for m in methods)
              + f" | {row['plain']['text']}")
    summary = {}
    for method in methods:
        rs = [r[method] for r in rows]
        finished = [r for r in rs if r["valid"] is not None]
        summary[method] = {
            "speedup_median": median([r["speedup"] for r in rs]),
            "speedup_min": min(r["speedup"] for r in rs),
            "tok_s_median": median([r["tok_s"] for r in rs]),
            "tau_median": median([r["tau"] for r in rs if r["tau"] is not None]),
            "finished": len(finished), "valid": sum(bool(r["valid"]) for r in finished),
            "same_tokens": sum(r["same_tokens"] for r in rs), "prompts": len(rs),
        }
        s = summary[method]
        print(f"{method}: {s['speedup_median']:.2f}x plain (min {s['speedup_min']:.2f}x), "
              f"{s['tok_s_median']:.1f} tok/s, tau {s['tau_median'] or 0:.2f}, valid {s['valid']}/{s['finished']} "
              f"finished of {s['prompts']}, tokens as plain {s['same_tokens']}/{s['prompts']}")
    record = {"benchmark": "structured_output", "model": args.model, "dtype": args.dtype,
              "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "methods": methods, "summary": summary, "rows": rows,
              "machine": machine_info(), "versions": versions(), "command": command(argv),
              "elapsed_s": time.time() - t_start}
    variant = f"{args.model}-{args.dtype}" + (f"-t{args.temperature:g}" if args.temperature else "")
    path = args.out or result_stem("structured_output", variant) + ".json"
    write_record(record, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
