"""Is plain decoding of the gemma library's Gemma 3 270M faster inside jaxspec's loop than in the
library's own ``gm.text.Sampler``, on the same weights and prompts? (``QUESTION``)

Both decode greedily the same token ids (the library's sampler is handed jaxspec's tokenizer of
the packaged GGUF through a small adapter: no tokenizer download), ``--max-new-tokens`` each;
jaxspec runs the library's ``Transformer`` as its target (``jaxspec.models.gemma_library``),
plainly and with an n-gram drafter. Each is run once to compile, then ``--repeats`` times
interleaved (sampler, jaxspec plain, jaxspec n-gram); the JSON has every time and the medians'
ratios, the tokens' agreement, machine, versions and command.

    python -m benchmarks.experiments.gemma_sampler --out benchmarks/results/gemma_sampler_gemma3-270m_cpu_<date>.json

Needs the ``gemma`` extra (docs/own_model.md, "The gemma library").
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.models.gemma_library import GemmaTarget, params_from_jaxspec

QUESTION = ("Is plain decoding of the gemma library's Gemma 3 270M faster inside jaxspec's loop than in the library's "
            "own gm.text.Sampler, on the same weights and prompts?")
PROMPTS = [  # an editing prompt (n-gram drafts pay) and an open one
    "Fix the spelling mistakes and return the full corrected text: The comittee will meet on Friday to discuss "
    "the new budjet. Every departmnet must send its report before Thursday.",
    "The three most important inventions of the twentieth century are",
]


class LibraryTokenizer:
    """jaxspec's tokenizer in the interface ``gm.text.Sampler`` reads (encode / decode, the
    Gemma 3 special and forbidden ids)."""

    VERSION = None  # the sampler then skips its check of model and tokenizer versions

    def __init__(self, tokenizer, gm):
        self.tokenizer = tokenizer
        self.special_tokens = gm.text.Gemma3Tokenizer.special_tokens
        self.FORBIDDEN_TOKENS = gm.text.Gemma3Tokenizer.FORBIDDEN_TOKENS

    def encode(self, text, add_bos=False):
        return ([self.special_tokens.BOS] if add_bos else []) + self.tokenizer.encode(text, add_bos=False)

    def decode(self, ids):
        return self.tokenizer.decode(list(np.asarray(ids).reshape(-1)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from gemma import gm

    own = jaxspec.load("gemma3-270m", dtype="float32")
    library = gm.nn.Gemma3_270M(dtype=jnp.float32)
    params = params_from_jaxspec(own.params, own.config)
    model = jaxspec.Model(params, GemmaTarget.of(library, own.config), own.tokenizer)
    tok = LibraryTokenizer(own.tokenizer, gm)
    sampler = gm.text.Sampler(model=library, params=params, tokenizer=tok, cache_length=512, max_out_length=128)
    ids = [tok.encode(p, add_bos=True) for p in PROMPTS]
    n = args.max_new_tokens
    end = (tok.special_tokens.EOS, tok.special_tokens.END_OF_TURN)  # where the sampler stops; jaxspec too

    def run_sampler():
        t0 = time.perf_counter()
        out = sampler.sample(PROMPTS, max_new_tokens=n, return_state=True)
        rows = np.asarray(jax.device_get(out.state.predicted_tokens))[:, :n].tolist()
        return time.perf_counter() - t0, [_cut(row, end) for row in rows]

    def run_jaxspec(drafter):
        out = jaxspec.generate(model, ids, max_new_tokens=n, drafter=drafter, stop_token_ids=list(end),
                               disable_by_batch_size=None, disable_by_acceptance=None)  # every row speculates
        return out.metrics.run_s, out.tokens, out.metrics

    times = {"sampler": [], "jaxspec_plain": [], "jaxspec_ngram": []}
    for r in range(args.repeats + 1):  # the first round compiles
        s = run_sampler()
        p = run_jaxspec(None)
        g = run_jaxspec(jaxspec.NGramDrafter(gamma=4))
        if r:
            times["sampler"].append(s[0])
            times["jaxspec_plain"].append(p[0])
            times["jaxspec_ngram"].append(g[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    counts = {"sampler": sum(map(len, s[1])), "jaxspec_plain": sum(map(len, p[1])),
              "jaxspec_ngram": sum(map(len, g[1]))}
    result = {
        "question": QUESTION,
        "tokens_per_s": {k: round(counts[k] / v, 2) for k, v in med.items()},
        "new_tokens": counts,
        "jaxspec_plain_over_sampler": round(counts["jaxspec_plain"] / med["jaxspec_plain"]
                                            / (counts["sampler"] / med["sampler"]), 3),  # tok/s ratio
        "jaxspec_ngram_over_sampler": round(counts["jaxspec_ngram"] / med["jaxspec_ngram"]
                                            / (counts["sampler"] / med["sampler"]), 3),
        "tau_ngram": round(float(g[2].tau), 3),
        "tokens_equal_sampler_jaxspec": s[1] == p[1],
        "tokens_equal_plain_ngram": p[1] == g[1],
        "times_s": times,
        "prompts": len(PROMPTS), "max_new_tokens": n, "dtype": "float32",
        "machine": platform.machine(), "processor": platform.processor(), "backend": jax.default_backend(),
        "versions": {"jax": jax.__version__, "jaxspec": jaxspec.__version__, "gemma": _version("gemma"),
                     "kauldron": _version("kauldron")},
        "command": "python -m benchmarks.experiments.gemma_sampler " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _cut(row: list[int], end) -> list[int]:
    """``row`` up to and with its first id in ``end``."""
    stops = [i for i, t in enumerate(row) if t in end]
    return row[: stops[0] + 1] if stops else row


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
