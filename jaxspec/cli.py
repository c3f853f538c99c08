"""Command line: ``jaxspec generate [PROMPT] [options]``.

Prompts run one at a time (batch 1, the setting speculative decoding is for, as in
Spec-Bench). Progress goes to stderr, results to stdout: the text, or with ``--json`` one JSON
object per prompt (``text`` and ``tokens`` of the first sample, ``samples`` with each sample's
text, tokens, finish and stop reason and logprobs, ``metrics``). ``--compare`` also runs plain
decoding of the same engine and settings on the same prompts and prints the speedup and
whether outputs match (tokens and text, and with ``--logprobs`` logprobs; under greedy decoding
they must); where the batch policy turned speculation off it says so instead of a speedup.

An option that the chosen ``--drafter`` does not read (``DRAFTER_OPTIONS``) is an error, as is
every bad drafter setting that can be told without the model's weights: all before the model
loads. Errors from jaxspec name the flags, not its parameters (``PARAM_FLAGS``).

``--synthetic-acceptance RATE[,RATE...]`` (or ``--synthetic-tau TAU``) accepts drafts at random
with the given conditional rates (``jaxspec.synthetic``), to measure speed at a chosen tau
apart from the drafter's quality. It is NOT lossless: it refuses to run without
``--allow-synthetic-acceptance``, prints a banner, and marks every result (``"synthetic": true``).

Compiled programs are kept in jax's persistent compilation cache (``jaxspec.compile_cache``:
``$JAXSPEC_CACHE/xla`` or ``~/.cache/jaxspec/xla``), so a second run skips the compile; switch
it off with ``--no-compile-cache`` or ``JAXSPEC_COMPILE_CACHE=0``. Each compile is reported on
stderr with its time and whether it came from that cache.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
import warnings

from jaxspec import compile_cache
from jaxspec.drafters import kinds

DRAFTERS = (*kinds.KINDS, "none")  # the drafter registry's kinds (jaxspec.drafters.kinds), and plain decoding


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspec", description="JAX-native speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, speculatively by default")
    g.add_argument("prompt", nargs="?", help="prompt text (or use --prompts-file)")
    g.add_argument("--model", default="smollm2-135m", help="model name or .gguf path (default: smollm2-135m)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter dtype (default: float32 on CPU, bfloat16 on accelerators)")
    g.add_argument("--drafter", choices=DRAFTERS, default="ngram",
                   help="drafting method (default: ngram; repeat: gamma copies of the last token, zero cost, for "
                        "--synthetic-acceptance)")
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
    s.add_argument("--n", type=int, default=1, help="samples per prompt (default: 1)")
    s.add_argument("--seed", type=int, default=0, help="random seed; sample r uses seed + r (default: 0)")
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
    return parser


def _read_prompts(args) -> list[str]:
    if args.prompts_file and args.prompt:
        raise SystemExit("error: give a PROMPT or --prompts-file, not both")
    if args.prompts_file:
        prompts = []
        try:
            with open(args.prompts_file) as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as e:  # its line and column are the line's, not the file's
                            raise SystemExit(f"error: {args.prompts_file}:{n}: invalid JSON: {e.msg} "
                                             f"(column {e.colno})")
                        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                            raise SystemExit(f"error: {args.prompts_file}:{n}: expected {{\"prompt\": \"...\"}}")
                        if not row["prompt"]:
                            raise SystemExit(f"error: {args.prompts_file}:{n}: the prompt is empty")
                        prompts.append(row["prompt"])
        except OSError as e:
            raise SystemExit(f"error: cannot read --prompts-file {args.prompts_file}: {e.strerror}")
        except UnicodeDecodeError as e:
            raise SystemExit(f"error: --prompts-file {args.prompts_file} is not UTF-8 text: {e}")
        if not prompts:
            raise SystemExit(f"error: --prompts-file {args.prompts_file} has no prompts")
        return prompts
    if not args.prompt:
        raise SystemExit("error: the prompt is empty: give a PROMPT or --prompts-file")
    return [args.prompt]


# The options only some drafters read (dest -> the --drafter values that read them). Their parser default is None,
# so an option given explicitly is told from one left out even when its value equals the default (OPTION_DEFAULTS,
# filled in once the check has passed); one given to a drafter that does not read it is an error, never ignored.
# --gamma: a chain's length or a tree's depth; medusa's depth is the number of --medusa-topk entries (both given:
# they must agree); lookahead's is --ngram - 1.
_CHAIN_OR_TREE = ("early-exit", "model", "eagle")
DRAFTER_OPTIONS: dict[str, tuple[str, ...]] = {
    "draft_model": ("model",), "shard_drafter": ("model",), "eagle_head": ("eagle",),
    "medusa_heads": ("medusa",), "medusa_topk": ("medusa",),
    "gamma": ("ngram", *_CHAIN_OR_TREE, "medusa", "repeat"),
    "tree_nodes": ("ngram", *_CHAIN_OR_TREE), "branching": _CHAIN_OR_TREE, "draft_confidence": _CHAIN_OR_TREE,
    "early_exit_layers": ("early-exit",),
    **dict.fromkeys(("ngram_max", "ngram_min", "ngram_branch_min", "short_gamma", "long_match"), ("ngram",)),
    **dict.fromkeys(("window", "ngram", "guesses", "pool_size"), ("lookahead",)),
    **dict.fromkeys(("disable_by_batch_size", "disable_by_acceptance"), tuple(d for d in DRAFTERS if d != "none")),
}
# (drafter, dest or None for any) -> why that drafter has no use for the option, added to the error
_LOOKAHEAD_BUDGET = "its node budget is (--window + --guesses) x (--ngram - 1)"
WHY_NOT = {("lookahead", "gamma"): f"its depth is --ngram - 1 and {_LOOKAHEAD_BUDGET}",
           ("lookahead", "tree_nodes"): _LOOKAHEAD_BUDGET,
           ("medusa", "tree_nodes"): "its tree is --medusa-topk, children per node at each depth",
           ("repeat", "tree_nodes"): "it drafts a chain", ("none", None): "plain decoding drafts nothing"}
# A drafter option's default is the registry's (jaxspec.drafters.kinds: written once, beside its drafter).
OPTION_DEFAULTS = {"tree_nodes": kinds.default("model", "tree_nodes"), "branching": kinds.default("model", "branching"),
                   "ngram_max": kinds.default("ngram", "max_n"), "ngram_min": kinds.default("ngram", "min_n"),
                   "short_gamma": kinds.default("ngram", "short_gamma"),
                   "long_match": kinds.default("ngram", "long_match"), "shard_drafter": False, "logprobs_mode": "raw", "disable_by_batch_size": "auto",
                   "disable_by_acceptance": "auto"}
# options read only alongside another: dest -> (whether that other is there, what it is)
NEEDS = {"branching": (lambda a: a.tree_nodes > 0, "a tree (--tree-nodes N > 0): a chain has no branching"),
         "long_match": (lambda a: a.short_gamma > 0, "adaptive depth (--short-gamma G > 0)"),
         "ngram_branch_min": (lambda a: a.tree_nodes > a.gamma, "a tree of several branches (--tree-nodes > --gamma)"),
         "logprobs_mode": (lambda a: a.logprobs is not None, "--logprobs N")}

# jaxspec's parameter names -> the flags that set them: an error from the library names what the user typed
PARAM_FLAGS = {"gamma": "--gamma", "tree_nodes": "--tree-nodes", "branching": "--branching",
               "confidence": "--draft-confidence", "n_layers": "--early-exit-layers", "min_n": "--ngram-min",
               "max_n": "--ngram-max", "branch_min_n": "--ngram-branch-min", "branches": "--tree-nodes / --gamma",
               "short_gamma": "--short-gamma", "long_match": "--long-match", "topk": "--medusa-topk",
               "window": "--window", "ngram": "--ngram", "guesses": "--guesses", "pool_size": "--pool-size",
               "max_new_tokens": "--max-new-tokens", "stop_token_ids": "--stop-token-id",
               "disable_by_batch_size": "--disable-by-batch-size", "disable_by_acceptance": "--disable-by-acceptance"}
# a quoted string (a path) or a repr such as NGramDrafter(gamma=4, ...), kept as they are, or a parameter name (and
# "=None"; "draft confidence", "lookahead window": words, not the parameters)
_PARAM = re.compile(r"(?<!\w)'[^']*'|[A-Z]\w*\([^()]*\)|(?<![\w-])(?<!draft )(?<!lookahead )("
                    + "|".join(sorted(PARAM_FLAGS, key=len, reverse=True)) + r")(=None)?(?![\w-])")


def _with_flags(message: str) -> str:
    """``message`` (jaxspec's) with each parameter named by its flag, ``name=None`` as ``--flag none``."""
    return _PARAM.sub(lambda m: m[0] if m[1] is None else PARAM_FLAGS[m[1]] + (" none" if m[2] else ""), message)


def _library_error(e: Exception) -> SystemExit:
    return SystemExit(f"error: {_with_flags(str(e))}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _or(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _check_options(args) -> None:
    """Refuse an option the chosen drafter does not read, or one read only alongside an option
    that is not there; then fill in the defaults and the drafter's gamma (None for none and
    lookahead, whose depth ``_drafter_before_load`` sets)."""
    d = args.drafter
    given = {k for k in (*DRAFTER_OPTIONS, *NEEDS) if getattr(args, k) is not None}
    unused = [k for k in DRAFTER_OPTIONS if k in given and d not in DRAFTER_OPTIONS[k]]
    if unused:
        why = [w for w in dict.fromkeys(WHY_NOT.get((d, k)) or WHY_NOT.get((d, None)) for k in unused) if w]
        why = f" ({'; '.join(why)})" if why else ""
        if len(unused) == 1:
            (k,) = unused
            users = _or(DRAFTER_OPTIONS[k])
            raise SystemExit(f"error: {_flag(k)} applies to --drafter {users}, not --drafter {d}{why}")
        users = "; ".join(f"{_flag(k)}: --drafter {_or(DRAFTER_OPTIONS[k])}" for k in unused)
        raise SystemExit(f"error: {', '.join(map(_flag, unused))} do not apply to --drafter {d}{why} ({users})")
    for k, v in OPTION_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if d == "medusa":
        _medusa_depth(args, given)
    elif d not in ("none", "lookahead"):
        args.gamma = kinds.default(d, "gamma") if args.gamma is None else args.gamma
    for k, (present, what) in NEEDS.items():
        if k in given and not present(args):
            raise SystemExit(f"error: {_flag(k)} applies only with {what}")


def _medusa_depth(args, given) -> None:
    """``--medusa-topk`` as a tuple, or a chain of ``--gamma`` (default: the registry's ``topk``'s
    depth, 4); ``--gamma`` then is its depth. Giving both with another depth is an error."""
    if args.gamma is not None:
        from jaxspec.drafters.base import check_gamma

        try:
            check_gamma(args.gamma)
        except ValueError as e:
            raise _library_error(e)
    if "medusa_topk" not in given:
        chain = kinds.default("medusa", "topk")
        args.medusa_topk = chain if args.gamma is None else (1,) * args.gamma
    else:
        try:
            args.medusa_topk = tuple(int(k) for k in args.medusa_topk.split(","))
        except ValueError:
            raise SystemExit(f"error: --medusa-topk must be integers separated by commas, got {args.medusa_topk!r}")
        if args.gamma is not None and args.gamma != len(args.medusa_topk):
            raise SystemExit(f"error: --gamma {args.gamma} and --medusa-topk {','.join(map(str, args.medusa_topk))} "
                             f"disagree: medusa drafts as deep as --medusa-topk has entries "
                             f"({len(args.medusa_topk)}); give one of the two")
    args.gamma = len(args.medusa_topk)


def _head_manifest(args) -> dict | None:
    """The head manifest of ``--drafter eagle`` / ``medusa`` (the shipped head's without
    ``--eagle-head`` / ``--medusa-heads``), or None for the other drafters; exits if there is none."""
    if args.drafter not in ("eagle", "medusa"):
        return None
    from jaxspec.checkpoints.heads import read_head_manifest, shipped_head

    flag, kind = ("--eagle-head", "eagle3") if args.drafter == "eagle" else ("--medusa-heads", "medusa1")
    path = args.eagle_head if args.drafter == "eagle" else args.medusa_heads
    if not path:  # the head that ships for a packaged model
        try:
            path = shipped_head(args.model, kind)
        except FileNotFoundError as e:
            raise SystemExit(f"error: --drafter {args.drafter} needs {flag} PATH: {e}")
        if args.drafter == "eagle":
            args.eagle_head = path
        else:
            args.medusa_heads = path
    try:
        return read_head_manifest(path, kind)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {flag}: {e}")


def _drafter_before_load(args):
    """Check every drafter setting that does not need the model's weights (called before the
    model loads, and again to build the drafter), and build the drafters that need none of them:
    ngram, repeat and lookahead (their drafter is returned; else None). An EAGLE or Medusa head's
    manifest gives its drafter's config, so those are checked in full too; the limits that need
    the target's or the draft model's config (vocabulary, layers, context) are checked once loaded."""
    import jaxspec
    from jaxspec.drafters import base, dynamic_tree

    d = args.drafter
    manifest = _head_manifest(args)
    try:
        if d in ("none", "lookahead"):
            drafter = None
            if d == "lookahead":
                drafter, _ = kinds.build("lookahead", window=args.window, ngram=args.ngram, guesses=args.guesses,
                                         pool_size=args.pool_size)
            args.gamma = None if drafter is None else drafter.gamma
            return drafter
        if d == "medusa":
            if len(args.medusa_topk) > manifest["n_heads"]:
                raise SystemExit(f"error: --drafter medusa drafts {len(args.medusa_topk)} deep (--gamma / "
                                 f"--medusa-topk) but {args.medusa_heads!r} holds {manifest['n_heads']} Medusa heads")
            jaxspec.MedusaDrafter(manifest["target"], topk=args.medusa_topk)
            return None
        base.check_gamma(args.gamma)
        base.check_int("tree_nodes", args.tree_nodes, 0)
        if d == "repeat":
            return kinds.build("repeat", gamma=args.gamma)[0]
        if d == "ngram":
            if args.tree_nodes % args.gamma:
                raise SystemExit(f"error: --tree-nodes for ngram must be a multiple of --gamma ({args.gamma}): each "
                                 f"branch drafts gamma tokens; got {args.tree_nodes}")
            return kinds.build("ngram", gamma=args.gamma, max_n=args.ngram_max, min_n=args.ngram_min,
                               branches=max(1, args.tree_nodes // args.gamma), short_gamma=args.short_gamma,
                               long_match=args.long_match, branch_min_n=args.ngram_branch_min)[0]
        base.check_int("branching", args.branching, 1)
        dynamic_tree.check_tree(args.gamma, args.tree_nodes, args.branching)
        if args.draft_confidence is not None:
            base.check_confidence(args.draft_confidence, args.tree_nodes)
        if d == "eagle":
            jaxspec.EagleDrafter(manifest["config"], **{k: v for k, v in _tree(args).items() if v is not None})
        if d == "early-exit" and args.early_exit_layers is not None:
            base.check_int("n_layers", args.early_exit_layers, 1)
        if d == "model" and not args.draft_model:
            raise SystemExit("error: --drafter model needs --draft-model NAME_OR_PATH")
        return None
    except ValueError as e:
        raise _library_error(e)


def _tree(args) -> dict:
    """The chain/tree options of a model, early-exit or EAGLE drafter (``--draft-confidence``
    left out: None, the registry's default)."""
    return dict(gamma=args.gamma, tree_nodes=args.tree_nodes, branching=args.branching,
                confidence=args.draft_confidence)


def _make_drafter(args, model, load):
    """``(drafter, drafter_params)`` once the model has loaded (``jaxspec.drafters.kinds.build``);
    ``load(name)`` loads a draft model."""
    drafter = _drafter_before_load(args)
    try:
        if args.drafter in ("none", "lookahead", "repeat", "ngram"):
            return drafter, None
        if args.drafter == "early-exit":
            return kinds.build("early-exit", model, n_layers=args.early_exit_layers, **_tree(args))
        if args.drafter == "eagle":
            return kinds.build("eagle", model, head=args.eagle_head, **_tree(args))
        if args.drafter == "medusa":
            return kinds.build("medusa", model, heads=args.medusa_heads, topk=args.medusa_topk)
    except ValueError as e:
        raise _library_error(e)
    draft = load(args.draft_model)
    try:
        return kinds.build("model", model, draft=draft, **_tree(args))  # a Model: generate checks the pairing
    except ValueError as e:
        raise _library_error(e)


def _mesh(args):
    """The ``--mesh`` as a ``jax.sharding.Mesh``, or None."""
    if args.mesh is None:
        if args.shard_drafter:
            raise SystemExit("error: --shard-drafter needs --mesh")
        return None
    from jaxspec import sharding

    try:
        return sharding.make_mesh(*sharding.parse_mesh(args.mesh))
    except ValueError as e:
        raise SystemExit(f"error: --mesh: {e}")


def _synthetic(args):
    """The ``jaxspec.SyntheticAcceptance`` that ``--synthetic-acceptance``/``--synthetic-tau``
    ask for, or None; refused without ``--allow-synthetic-acceptance`` (before any loading)."""
    import jaxspec

    if args.synthetic_acceptance is None and args.synthetic_tau is None:
        if args.allow_synthetic_acceptance:
            raise SystemExit("error: --allow-synthetic-acceptance applies only with --synthetic-acceptance or "
                             "--synthetic-tau")
        return None
    flag = "--synthetic-acceptance" if args.synthetic_tau is None else "--synthetic-tau"
    if args.synthetic_acceptance is not None and args.synthetic_tau is not None:
        raise SystemExit("error: give --synthetic-acceptance or --synthetic-tau, not both")
    if not args.allow_synthetic_acceptance:
        raise SystemExit(f"error: {flag} is NOT lossless (drafts are accepted at random, the output is not the "
                         f"model's): add --allow-synthetic-acceptance to run it, for benchmarks only")
    if args.drafter == "none":
        raise SystemExit(f"error: {flag} needs a drafter to supply drafts (e.g. --drafter repeat), not --drafter none")
    gamma = args.gamma
    try:
        if args.synthetic_tau is not None:
            return jaxspec.SyntheticAcceptance.from_tau(args.synthetic_tau, gamma)
        try:
            rates = [float(x) for x in args.synthetic_acceptance.split(",")]
        except ValueError:
            raise ValueError(f"expected RATE[,RATE...] (numbers in [0, 1]), got {args.synthetic_acceptance!r}")
        if len(rates) == 1:
            rates = rates * gamma
        if len(rates) != gamma:
            raise ValueError(f"{len(rates)} rates given but the drafter's gamma is {gamma}: give one rate, or one "
                             "per position")
        return jaxspec.SyntheticAcceptance(tuple(rates))
    except ValueError as e:
        raise SystemExit(f"error: {flag}: {e}")


def _sampling(args):
    import jaxspec

    try:
        sampling = jaxspec.SamplingConfig(
            max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, seed=args.seed,
            n=args.n, stop=args.stop, stop_token_ids=args.stop_token_id, logprobs=args.logprobs,
            logprobs_mode=args.logprobs_mode,
        )
    except ValueError as e:
        name = str(e).split(" ")[0]
        raise SystemExit(f"error: {PARAM_FLAGS.get(name, _flag(name))}: {e}")
    if any(t < 0 for t in args.stop_token_id):  # the vocabulary's end is checked once the model has loaded
        raise SystemExit(f"error: --stop-token-id must be token ids >= 0, got {min(args.stop_token_id)}")
    return sampling


def _samples(res) -> list[dict]:
    """Per sample of a one-prompt result: what ``--json`` prints."""
    out = []
    for j, tokens in enumerate(res.tokens):
        sample = {"text": res.texts[j], "tokens": tokens, "finish_reason": res.finish_reasons[j],
                  "stop_reason": res.stop_reasons[j]}
        if res.logprobs is not None:
            sample["logprobs"] = res.logprobs[j]
            sample["top_logprobs"] = [[[i, lp] for i, lp in alts] for alts in res.top_logprobs[j]]
        out.append(sample)
    return out


def _max_logprob_gap(a, b) -> float:
    """Largest |difference| between two results' logprobs (chosen and alternatives)."""
    gap = 0.0
    for la, lb, ta, tb in zip(a.logprobs, b.logprobs, a.top_logprobs, b.top_logprobs):
        gap = max([gap] + [abs(x - y) for x, y in zip(la, lb)])
        for alts_a, alts_b in zip(ta, tb):
            gap = max([gap] + [abs(x[1] - y[1]) for x, y in zip(alts_a, alts_b)])
    return gap


LOGPROB_TOLERANCE = 1e-4  # float32; 1-token and window forwards agree to a few ulps on CPU


def _batch_policy(args):
    """``--disable-by-batch-size`` as ``generate`` takes it: "auto", None or an int."""
    from jaxspec import policy

    v = args.disable_by_batch_size
    try:
        value = {"auto": "auto", "none": None}[v] if v in ("auto", "none") else int(v)
        policy.limit(value, None)
    except ValueError:
        raise SystemExit(f"error: --disable-by-batch-size must be auto, none or an integer >= 1, got {v!r}")
    return value


def _acceptance_gate(args):
    """``--disable-by-acceptance`` as ``generate`` takes it: "auto", None or a number in
    ``(1, gamma + 1]`` (``jaxspec.policy.gate``'s range; the drafter's gamma is set by then)."""
    v = args.disable_by_acceptance
    if v in ("auto", "none"):
        return {"auto": "auto", "none": None}[v]
    try:
        tau = float(v)
    except ValueError:
        tau = None
    if tau is None or not 1 < tau <= args.gamma + 1:
        raise SystemExit(f"error: --disable-by-acceptance must be auto, none or a mean accepted length (tau) in "
                         f"(1, {args.gamma + 1}] (a verify step emits 1 to gamma + 1 tokens, gamma {args.gamma} here), "
                         f"got {v!r}")
    return tau


def _generate(args) -> int:
    from rich.console import Console

    import jaxspec

    console = Console(stderr=True)
    prompts = _read_prompts(args)
    sampling = _sampling(args)
    batch_policy = _batch_policy(args)  # a bad value exits before the model loads
    _drafter_before_load(args)  # so do bad drafter settings; sets lookahead's gamma
    gate = _acceptance_gate(args)
    synthetic = _synthetic(args)
    if synthetic is not None:
        console.print(f"[bold red]{'!' * 20}\n{synthetic.banner()}\n{'!' * 20}[/bold red]", soft_wrap=True)
    mesh = _mesh(args)
    cache_dir = compile_cache.enable() if args.compile_cache else None
    try:
        with console.status(f"loading {args.model}"):
            load = functools.partial(jaxspec.load, dtype=args.dtype)
            model = jaxspec.load(args.model, dtype=args.dtype, mesh=mesh)
            drafter, drafter_params = _make_drafter(args, model, load)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")

    def run(prompt, d, dp, label, i):
        msg = f"[{i + 1}/{len(prompts)}] {label}: compiling (first call per prompt-length bucket) and generating"
        hits = compile_cache.hits()
        with console.status(msg):
            spec = d is not None and synthetic is not None
            with warnings.catch_warnings():  # the banner above already says it, once
                warnings.simplefilter("ignore", jaxspec.synthetic.SyntheticAcceptanceWarning)
                res = jaxspec.generate(model, prompt, drafter=d, drafter_params=dp, sampling=sampling, chat=args.chat,
                                       mesh=mesh, shard_drafter=args.shard_drafter and d is not None,
                                       synthetic_acceptance=synthetic if spec else None,
                                       allow_synthetic_acceptance=spec,
                                       disable_by_batch_size=batch_policy, disable_by_acceptance=gate)
        if res.metrics.compile_s > 0:
            console.print(_compile_line(label, args, res, compile_cache.hits() - hits, cache_dir), soft_wrap=True)
        return res

    name = args.drafter if drafter is not None else "plain"
    speedups, same, spec_tps, taus, compile_s, off = [], [], [], [], 0.0, 0
    try:
        for i, prompt in enumerate(prompts):
            res = run(prompt, drafter, drafter_params, name, i)
            compile_s += res.metrics.compile_s
            spec_tps.append(res.metrics.tokens_per_s)
            taus.append(res.metrics.tau)
            off += res.metrics.speculation is not None
            samples = _samples(res)
            summary = res.metrics.summary()
            record = {"prompt": prompt, "text": samples[0]["text"], "tokens": samples[0]["tokens"],
                      "samples": samples, "drafter": name, "synthetic": res.synthetic,
                      "metrics": {**{k: summary[k] for k in ("acceptance_rate", "tau", "gamma", "compile_s", "run_s",
                                                            "tokens_per_s", "new_tokens", "target_forwards",
                                                            "synthetic", "synthetic_acceptance_rates",
                                                            "speculation_off", "gate_tau", "rows_gated")},
                                  "rows": [res.metrics.row(j) for j in range(len(res.tokens))]}}
            if args.compare:
                base = run(prompt, None, None, "plain", i)
                compile_s += base.metrics.compile_s
                speedup = None  # plain against plain where the batch policy turned speculation off
                if res.metrics.speculation is None:
                    speedup = res.metrics.tokens_per_s / base.metrics.tokens_per_s
                    speedups.append(speedup)
                identical = base.tokens == res.tokens and base.texts == res.texts
                gap = _max_logprob_gap(base, res) if res.logprobs is not None and identical else None
                same.append(identical and (gap is None or gap <= LOGPROB_TOLERANCE))
                record["compare"] = {"plain_tokens_per_s": base.metrics.tokens_per_s, "speedup": speedup,
                                     "identical": identical if args.temperature == 0 and not res.synthetic else None,
                                     "logprobs_max_abs_diff": gap}
            if args.json:
                print(json.dumps(record), flush=True)
            else:
                for j, sample in enumerate(samples):
                    if len(samples) > 1:
                        console.print(f"[dim]--- sample {j + 1}/{len(samples)}[/dim]")
                    print(sample["text"], flush=True)
                console.print(f"[dim]{int(res.metrics.new_tokens.sum())} tokens, {res.metrics.tokens_per_s:.1f} tok/s, "
                              f"tau {res.metrics.tau:.2f}[/dim]")
            if res.metrics.speculation:
                console.print(f"[yellow]{_with_flags(res.metrics.speculation)}[/yellow]", soft_wrap=True)
            if res.metrics.gated.any():
                console.print(f"[yellow]acceptance gate: {int(res.metrics.gated.sum())} of {len(res.tokens)} row(s) "
                              f"fell below tau {res.metrics.gate_tau:g} and decoded plainly from then on "
                              f"(--disable-by-acceptance none: always speculate)[/yellow]", soft_wrap=True)
    except ValueError as e:
        raise _library_error(e)

    line = (f"{name}: {len(prompts)} prompt(s), median {statistics.median(spec_tps):.1f} tok/s, "
            f"median tau {statistics.median(taus):.2f}, compile {compile_s:.1f} s")
    if args.compare:
        line += _compare_summary(args, speedups, same, off, synthetic is not None) + f"; matmul: {_matmul_path()}"
    if synthetic is not None:
        line = f"[bold red]SYNTHETIC ACCEPTANCE (not the model's output)[/bold red] {line}"
    console.print(line, soft_wrap=True)
    return 0 if (not args.compare or args.temperature != 0 or synthetic is not None or all(same)) else 1


def _matmul_path() -> str:
    """Which path the weight products took, for ``--compare``'s line: on a CPU backend
    ``jaxspec cpu kernel (avx2)`` (or ``(portable)``) or ``XLA dot (why)``
    (``jaxspec.kernels.cpu_matmul``, switch ``JAXSPEC_CPU_KERNEL=0``); elsewhere ``XLA dot``."""
    import jax

    from jaxspec.kernels import cpu_matmul

    return cpu_matmul.describe() if jax.default_backend() == "cpu" else "XLA dot"


def _compare_summary(args, speedups: list[float], same: list[bool], off: int, synthetic: bool) -> str:
    """What ``--compare`` found, after the summary line: the median speedup over the prompts
    that speculated (``off`` of them the batch policy decoded plainly: no speedup to measure
    there) and whether outputs match, naming what was compared."""
    n = len(same)
    if not off:
        line = f", median speedup {statistics.median(speedups):.2f}x vs plain"
    elif speedups:
        line = (f", median speedup {statistics.median(speedups):.2f}x vs plain over the {len(speedups)} prompt(s) "
                f"that speculated (the batch policy turned speculation off for {off}/{n}: no speedup there)")
    else:
        line = (f", no speedup to report: the batch policy turned speculation off ({off}/{n} prompt(s) decoded "
                f"plainly, as the baseline did)")
    if synthetic:
        return line + ", outputs differ by design: SYNTHETIC acceptance is not lossless"
    if args.temperature != 0:
        return line + ", outputs differ by design when sampling (same distribution)"
    what = "tokens, text" + (f", logprobs within {LOGPROB_TOLERANCE}" if args.logprobs is not None else "")
    return line + f", outputs identical: {sum(same)}/{n} ({what})"


def _compile_line(label: str, args, res, hits: int, cache_dir: str | None) -> str:
    """What one compile was: the program (drafter, gamma, models; plain where the batch policy
    turned speculation off), its time and its source."""
    source = ("no persistent cache" if cache_dir is None
              else f"loaded from the cache {cache_dir}" if hits else f"stored in {cache_dir}")
    if res.metrics.speculation is not None:
        label, what = "plain", f"{args.model}; speculation off by the batch policy, not --drafter {label}"
    else:
        what = args.model + (f" + draft {args.draft_model}" if label == "model" else "")
        what += f", gamma {res.metrics.gamma}" if label != "plain" else ""
    return f"compiled the {label} program ({what}) in {res.metrics.compile_s:.1f} s: {source}"


def main(argv=None) -> int:
    """Entry point of the ``jaxspec`` command; returns the process exit code."""
    args = _parse(argv)
    if args.command == "generate":
        return _generate(args)
    return 2


def _parse(argv=None):
    """The parsed command line, drafter options checked (``_check_options``) and defaults filled in."""
    args = _parser().parse_args(argv)
    if args.command == "generate":
        _check_options(args)
    return args


if __name__ == "__main__":
    sys.exit(main())
