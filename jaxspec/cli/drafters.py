"""The command line's drafter: checked before the model loads where its settings allow,
built once it has (``jaxspec.drafters.kinds.build``)."""

from __future__ import annotations

from jaxspec.cli.options import _library_error
from jaxspec.drafters import kinds


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
        if d in ("repeat", "grammar"):
            return kinds.build(d, gamma=args.gamma)[0]
        if d == "history":  # siblings (--n) and its own text; --tree-nodes 0: the drafter's default budget
            nodes = args.tree_nodes or max(args.gamma, kinds.default("history", "tree_nodes"))
            return kinds.build("history", gamma=args.gamma, tree_nodes=nodes)[0]
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
    return {"gamma": args.gamma, "tree_nodes": args.tree_nodes, "branching": args.branching,
            "confidence": args.draft_confidence}


def _make_drafter(args, model, load):
    """``(drafter, drafter_params)`` once the model has loaded (``jaxspec.drafters.kinds.build``);
    ``load(name)`` loads a draft model."""
    drafter = _drafter_before_load(args)
    try:
        if args.drafter in ("none", "lookahead", "repeat", "ngram", "grammar", "history"):
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


