"""``jaxspec generate``: run the prompts, print each result (text or ``--json``), and with
``--compare`` plain decoding beside it."""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import warnings
from typing import Any

from jaxspec import compile_cache
from jaxspec.cli.drafters import _drafter_before_load, _make_drafter
from jaxspec.cli.options import (
    _acceptance_gate,
    _batch_policy,
    _library_error,
    _mesh,
    _parse,
    _read_prompts,
    _sampling,
    _synthetic,
    _with_flags,
)


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


@dataclasses.dataclass
class _Session:
    """One ``jaxspec generate`` run: its options checked and turned into values, the model and
    the drafter loaded (``_start``), and the console progress and notes go to (stderr)."""

    args: Any
    console: Any
    prompts: list[str]
    sampling: Any
    batch_policy: Any
    gate: Any
    synthetic: Any
    mesh: Any
    cache_dir: str | None
    model: Any = None
    drafter: Any = None
    drafter_params: Any = None

    def run(self, prompt, d, dp, label: str, i: int):
        """``jaxspec.generate`` of one prompt with drafter ``d`` (None: plain), reporting a compile."""
        import jaxspec

        msg = f"[{i + 1}/{len(self.prompts)}] {label}: compiling (first call per prompt-length bucket) and generating"
        hits = compile_cache.hits()
        with self.console.status(msg):
            spec = d is not None and self.synthetic is not None
            with warnings.catch_warnings():  # the banner already says it, once
                warnings.simplefilter("ignore", jaxspec.synthetic.SyntheticAcceptanceWarning)
                res = jaxspec.generate(self.model, prompt, drafter=d, drafter_params=dp, sampling=self.sampling,
                                       chat=self.args.chat, mesh=self.mesh,
                                       shard_drafter=self.args.shard_drafter and d is not None,
                                       synthetic_acceptance=self.synthetic if spec else None,
                                       allow_synthetic_acceptance=spec, disable_by_batch_size=self.batch_policy,
                                       disable_by_acceptance=self.gate)
        if res.metrics.compile_s > 0:
            line = _compile_line(label, self.args, res, compile_cache.hits() - hits, self.cache_dir)
            self.console.print(line, soft_wrap=True)
        return res


def _start(args) -> _Session:
    """Check every option that can be checked before loading (a bad one exits first), print the
    synthetic-acceptance banner, then load the model and build the drafter."""
    from rich.console import Console

    import jaxspec

    console = Console(stderr=True)
    prompts, sampling = _read_prompts(args), _sampling(args)
    batch_policy = _batch_policy(args)  # a bad value exits before the model loads
    _drafter_before_load(args)  # so do bad drafter settings; sets lookahead's gamma
    gate, synthetic = _acceptance_gate(args), _synthetic(args)
    if synthetic is not None:
        console.print(f"[bold red]{'!' * 20}\n{synthetic.banner()}\n{'!' * 20}[/bold red]", soft_wrap=True)
    mesh = _mesh(args)
    cache_dir = compile_cache.enable() if args.compile_cache else None
    session = _Session(args, console, prompts, sampling, batch_policy, gate, synthetic, mesh, cache_dir)
    try:
        with console.status(f"loading {args.model}"):
            load = functools.partial(jaxspec.load, dtype=args.dtype)
            session.model = jaxspec.load(args.model, dtype=args.dtype, mesh=mesh)
            session.drafter, session.drafter_params = _make_drafter(args, session.model, load)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    return session


_METRICS = ("acceptance_rate", "tau", "gamma", "compile_s", "run_s", "tokens_per_s", "new_tokens", "target_forwards",
            "synthetic", "synthetic_acceptance_rates", "speculation_off", "gate_tau", "rows_gated")


def _record(prompt: str, res, name: str, samples: list[dict]) -> dict:
    """What ``--json`` prints for one prompt (without ``compare``)."""
    summary = res.metrics.summary()
    return {"prompt": prompt, "text": samples[0]["text"], "tokens": samples[0]["tokens"], "samples": samples,
            "drafter": name, "synthetic": res.synthetic,
            "metrics": {**{k: summary[k] for k in _METRICS},
                        "rows": [res.metrics.row(j) for j in range(len(res.tokens))]}}


def _compare(session: _Session, prompt: str, res, i: int, tally: dict) -> dict:
    """``--compare``: plain decoding of the same prompt; the record's ``compare`` entry (the
    speedup and whether the outputs match go into ``tally`` too)."""
    base = session.run(prompt, None, None, "plain", i)
    tally["compile_s"] += base.metrics.compile_s
    speedup = None  # plain against plain where the batch policy turned speculation off
    if res.metrics.speculation is None:
        speedup = res.metrics.tokens_per_s / base.metrics.tokens_per_s
        tally["speedups"].append(speedup)
    identical = base.tokens == res.tokens and base.texts == res.texts
    gap = _max_logprob_gap(base, res) if res.logprobs is not None and identical else None
    tally["same"].append(identical and (gap is None or gap <= LOGPROB_TOLERANCE))
    return {"plain_tokens_per_s": base.metrics.tokens_per_s, "speedup": speedup,
            "identical": identical if session.args.temperature == 0 and not res.synthetic else None,
            "logprobs_max_abs_diff": gap}


def _show(session: _Session, res, samples: list[dict], record: dict) -> None:
    """Print one prompt's result: its JSON record, or its samples' text (stdout) and a line of
    counts (stderr); then whatever the policy or the gate did."""
    console = session.console
    if session.args.json:
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


def _generate(args) -> int:
    """``jaxspec generate``: every prompt in turn, then the summary line; the exit code is 1
    where ``--compare`` found greedy outputs that differ (they must not)."""
    session = _start(args)
    name = args.drafter if session.drafter is not None else "plain"
    tally = {"speedups": [], "same": [], "tps": [], "taus": [], "compile_s": 0.0, "off": 0}
    try:
        for i, prompt in enumerate(session.prompts):
            res = session.run(prompt, session.drafter, session.drafter_params, name, i)
            tally["compile_s"] += res.metrics.compile_s
            tally["tps"].append(res.metrics.tokens_per_s)
            tally["taus"].append(res.metrics.tau)
            tally["off"] += res.metrics.speculation is not None
            samples = _samples(res)
            record = _record(prompt, res, name, samples)
            if args.compare:
                record["compare"] = _compare(session, prompt, res, i, tally)
            _show(session, res, samples, record)
    except ValueError as e:
        raise _library_error(e)
    synthetic = session.synthetic is not None
    line = (f"{name}: {len(session.prompts)} prompt(s), median {statistics.median(tally['tps']):.1f} tok/s, "
            f"median tau {statistics.median(tally['taus']):.2f}, compile {tally['compile_s']:.1f} s")
    if args.compare:
        line += _compare_summary(args, tally["speedups"], tally["same"], tally["off"], synthetic)
        line += f"; matmul: {_matmul_path()}"
    if synthetic:
        line = f"[bold red]SYNTHETIC ACCEPTANCE (not the model's output)[/bold red] {line}"
    session.console.print(line, soft_wrap=True)
    return 0 if (not args.compare or args.temperature != 0 or synthetic or all(tally["same"])) else 1


def _matmul_path() -> str:
    """Which path the weight products took, for ``--compare``'s line: on a CPU backend
    ``jaxspec cpu kernel (avx512)`` (or ``(avx2)``, ``(portable)``) or ``XLA dot (why)``
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


