"""The command line's options checked and turned into what ``jaxspec`` takes: which drafter
reads which option (``DRAFTER_OPTIONS``; defaults from the drafter registry), errors that name
flags rather than parameters (``PARAM_FLAGS``), and each option's value (prompts, sampling,
mesh, synthetic acceptance, batch policy, acceptance gate)."""

from __future__ import annotations

import json
import re

from jaxspec.cli.parser import DRAFTERS, _parser
from jaxspec.drafters import kinds


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
    "gamma": ("ngram", *_CHAIN_OR_TREE, "medusa", "repeat", "grammar", "history"),
    "tree_nodes": ("ngram", *_CHAIN_OR_TREE, "history"), "branching": _CHAIN_OR_TREE, "draft_confidence": _CHAIN_OR_TREE,
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
           ("repeat", "tree_nodes"): "it drafts a chain", ("grammar", "tree_nodes"): "it drafts a chain", ("none", None): "plain decoding drafts nothing"}
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
               "disable_by_batch_size": "--disable-by-batch-size", "disable_by_acceptance": "--disable-by-acceptance",
               "regex": "--regex", "response_format": "--json-schema"}
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


def _response_format(args) -> dict | None:
    """``--json-schema PATH`` as ``generate``'s ``response_format`` (None without it)."""
    if args.json_schema is None:
        return None
    try:
        with open(args.json_schema) as f:
            schema = json.load(f)
    except OSError as e:
        raise SystemExit(f"error: cannot read --json-schema {args.json_schema}: {e.strerror}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: --json-schema {args.json_schema} is not a JSON file: {e}")
    return {"type": "json_schema", "json_schema": {"name": args.json_schema, "schema": schema}}


def _sampling(args):
    import jaxspec

    try:
        sampling = jaxspec.SamplingConfig(
            max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, seed=args.seed,
            n=args.n, stop=args.stop, stop_token_ids=args.stop_token_id, logprobs=args.logprobs,
            logprobs_mode=args.logprobs_mode, regex=args.regex, response_format=_response_format(args),
        )
    except ValueError as e:
        name = str(e).split(" ")[0]
        raise SystemExit(f"error: {PARAM_FLAGS.get(name, _flag(name))}: {e}")
    if any(t < 0 for t in args.stop_token_id):  # the vocabulary's end is checked once the model has loaded
        raise SystemExit(f"error: --stop-token-id must be token ids >= 0, got {min(args.stop_token_id)}")
    return sampling



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


def _parse(argv=None):
    """The parsed command line, drafter options checked (``_check_options``) and defaults filled in."""
    args = _parser().parse_args(argv)
    if args.command == "generate":
        _check_options(args)
    return args

