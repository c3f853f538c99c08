"""The ``jaxspec`` command's argparse parser (``_parser``), option group by option group; the
reference page (docs/cli.md) is generated from it."""

from __future__ import annotations

import argparse

from jaxspec.drafters import kinds

DRAFTERS = (*kinds.KINDS, "none")  # the drafter registry's kinds (jaxspec.drafters.kinds), and plain decoding


def _parser() -> argparse.ArgumentParser:
    """The ``jaxspec`` parser: ``generate`` and its options, group by group (the order of
    ``--help``). A drafter option's parser default is None, so that an option given is told
    from one left out (``jaxspec.cli.options.DRAFTER_OPTIONS``)."""
    parser = argparse.ArgumentParser(prog="jaxspec", description="JAX-native speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, speculatively by default")
    for add in (_drafter_arguments, _mesh_arguments, _sampling_arguments, _run_arguments):
        add(g)
    return parser


def _drafter_arguments(g) -> None:
    """The prompt, the model and the drafter with its options (lookahead's in a group)."""
    g.add_argument("prompt", nargs="?", help="prompt text (or use --prompts-file)")
    g.add_argument("--model", default="smollm2-135m", help="model name or .gguf path (default: smollm2-135m)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter dtype (default: float32 on CPU, bfloat16 on accelerators)")
    g.add_argument("--drafter", choices=DRAFTERS, default="ngram",
                   help="drafting method (default: ngram; repeat: gamma copies of the last token, zero cost, for "
                        "--synthetic-acceptance; grammar: the tokens --regex / --json-schema force)")
    g.add_argument("--draft-model", help="draft model name or .gguf path, for --drafter model")
    g.add_argument("--eagle-head", metavar="PATH",
                   help="EAGLE-3 head directory for --drafter eagle (python -m checkpoints_tools train-eagle; "
                        "default: the head that ships for --model, if one does)")
    g.add_argument("--medusa-heads", metavar="PATH",
                   help="Medusa heads directory for --drafter medusa (python -m checkpoints_tools train-medusa; "
                        "default: the heads that ship for --model, if they do)")
    g.add_argument("--medusa-topk", default=None, metavar="K1,K2,..",
                   help="--drafter medusa: children per node at each depth, e.g. 3,2,2 (default: a chain of --gamma)")
    g.add_argument("--gamma", type=int, default=None,
                   help="draft tokens per verify step: a chain's length, a tree's depth (default: 4; medusa: the "
                        "number of --medusa-topk entries, which --gamma must equal if both are given)")
    g.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                   help="draft a tree of N nodes instead of a chain (0 = chain, default); ngram: N = branches x "
                        "gamma (N must be a multiple of gamma), model/early-exit/eagle: EAGLE-2 top-k tree of depth "
                        "gamma")
    g.add_argument("--branching", type=int, default=None, metavar="K",
                   help="model/early-exit/eagle trees: children per expanded node (default: 4)")
    g.add_argument("--draft-confidence", type=float, default=None, metavar="C",
                   help="model/early-exit/eagle chains: stop a chain where the drafter's cumulative probability of "
                        "it falls below C, in [0, 1) (0: always --gamma drafts; default: 0.3 for --drafter model "
                        "chains, 0 otherwise); lossless")
    g.add_argument("--early-exit-layers", type=int, default=None,
                   help="target layers the early-exit drafter keeps (default: a quarter of them)")
    g.add_argument("--ngram-max", type=int, default=None, help="longest n-gram matched (default: 3)")
    g.add_argument("--ngram-min", type=int, default=None, help="shortest n-gram matched (default: 2)")
    g.add_argument("--ngram-branch-min", type=int, default=None, metavar="N",
                   help="ngram tree: the shortest n-gram with which a match other than the best drafts a branch "
                        "(default: --ngram-max)")
    g.add_argument("--short-gamma", type=int, default=None, metavar="G",
                   help="ngram, adaptive depth: draft G tokens from a match that extends over fewer than "
                        "--long-match tokens, --gamma from a longer one (copying; a tree then drafts that match alone); "
                        "0 = off (default)")
    g.add_argument("--long-match", type=int, default=None, metavar="L",
                   help="ngram with --short-gamma: the match extent (tokens) that counts as copying (default: 16)")
    la = g.add_argument_group("lookahead decoding (--drafter lookahead; Fu et al. 2024): a step verifies "
                              "1 + (window + guesses) x (ngram - 1) tokens")
    la.add_argument("--window", type=int, metavar="W", help="Jacobi window columns (default: 5)")
    la.add_argument("--ngram", type=int, metavar="N",
                    help="n-gram size: N - 1 Jacobi levels, candidates of N - 1 tokens (default: 4)")
    la.add_argument("--guesses", type=int, metavar="G", help="candidates verified per step (default: 5)")
    la.add_argument("--pool-size", type=int, metavar="Q", help="n-gram pool slots, LRU (default: 4096)")


def _mesh_arguments(g) -> None:
    """The device mesh, and synthetic acceptance (benchmarks only)."""
    g.add_argument("--mesh", metavar="DATAxMODEL", default=None,
                   help="run on a device mesh, e.g. 1x8: batch rows over DATA devices, the target tensor-parallel "
                        "over MODEL devices (DATA*MODEL = all devices; multi-host: python -m jaxspec.launch)")
    g.add_argument("--shard-drafter", action="store_true", default=None,
                   help="with --mesh and --drafter model: split the draft model over MODEL too (default: replicated)")
    y = g.add_argument_group("synthetic acceptance (benchmarks only: NOT lossless, the output is not the model's)")
    y.add_argument("--synthetic-acceptance", metavar="RATE[,RATE...]", default=None,
                   help="accept draft i with conditional probability RATE_i (one RATE: every position; else one per "
                        "position, --gamma of them) instead of verifying it; needs --allow-synthetic-acceptance")
    y.add_argument("--synthetic-tau", type=float, metavar="TAU", default=None,
                   help="as --synthetic-acceptance, with one constant rate giving a mean accepted length of TAU "
                        "in [1, gamma + 1]")
    y.add_argument("--allow-synthetic-acceptance", action="store_true",
                   help="required for --synthetic-acceptance / --synthetic-tau")


def _sampling_arguments(g) -> None:
    """``jaxspec.SamplingConfig``'s settings."""
    s = g.add_argument_group("sampling (jaxspec.SamplingConfig; speculative output stays exact under each)")
    s.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per sample (default: 128)")
    s.add_argument("--min-new-tokens", type=int, default=0, help="EOS and stops suppressed before this many (default: 0)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most probable tokens; 0 = off (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (default: 0)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL repetition penalty > 0; 1 = off")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty in [-2, 2]")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty in [-2, 2]")
    s.add_argument("--stop", action="append", default=[], metavar="STRING", help="stop string (repeatable)")
    s.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="token id that ends a sample, besides EOS (repeatable)")
    s.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each token's log-probability and the N most probable alternatives (in --json)")
    s.add_argument("--logprobs-mode", choices=("raw", "processed"), default=None,
                   help="logprobs of the model's raw distribution (default) or of the processed one sampled from")
    s.add_argument("--regex", default=None, metavar="PATTERN",
                   help="structured output: the text matches this regular expression (docs/structured_output.md)")
    s.add_argument("--json-schema", default=None, metavar="PATH",
                   help="structured output: the text is compact JSON valid under the JSON Schema in this file")
    s.add_argument("--n", type=int, default=1, help="samples per prompt (default: 1)")
    s.add_argument("--seed", type=int, default=0, help="random seed; sample r uses seed + r (default: 0)")


def _run_arguments(g) -> None:
    """The policy, the prompts' source and form, the output, ``--compare``, the compile cache."""
    g.add_argument("--disable-by-batch-size", default=None, metavar="auto|none|K",
                   help="batch-aware policy (jaxspec.policy): decode plainly when a call has more than K rows; auto "
                        "(default): the size measured for the drafter on this backend; none: always speculate")
    g.add_argument("--disable-by-acceptance", default=None, metavar="auto|none|TAU",
                   help="acceptance gate (jaxspec.policy): a row whose mean accepted length over its last verify "
                        "steps falls below TAU decodes plainly from then on; auto (default): the break-even tau "
                        "measured for the drafter on this backend; none: never")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap prompts in the model's chat template (default: on)")
    g.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and report the speedup")
    g.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="keep compiled programs in $JAXSPEC_CACHE/xla (default ~/.cache/jaxspec/xla) for later runs "
                        "(default: on; JAXSPEC_COMPILE_CACHE=0 also turns it off)")

