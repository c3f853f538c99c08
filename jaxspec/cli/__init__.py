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

The package, by job: ``parser`` (the argparse parser), ``options`` (which drafter reads which
option, errors in flags, each option's value), ``drafters`` (the drafter, through
``jaxspec.drafters.kinds``), ``run`` (``jaxspec generate`` itself). The names below are the
package's: ``main`` (the command's entry point), ``_parser`` (which docs/cli.md renders), and
those the tests reach.
"""

# Re-exported as jaxspec.cli.NAME (for the tests, and sphinx-argparse's :func: _parser).
from jaxspec.cli.drafters import _drafter_before_load as _drafter_before_load
from jaxspec.cli.drafters import _make_drafter as _make_drafter
from jaxspec.cli.options import DRAFTER_OPTIONS, OPTION_DEFAULTS, PARAM_FLAGS
from jaxspec.cli.options import _check_options as _check_options
from jaxspec.cli.options import _mesh as _mesh
from jaxspec.cli.options import _parse as _parse
from jaxspec.cli.options import _synthetic as _synthetic
from jaxspec.cli.options import _with_flags as _with_flags
from jaxspec.cli.parser import DRAFTERS
from jaxspec.cli.parser import _parser as _parser
from jaxspec.cli.run import LOGPROB_TOLERANCE, main
from jaxspec.cli.run import _compare_summary as _compare_summary
from jaxspec.cli.run import _compile_line as _compile_line
from jaxspec.cli.run import _matmul_path as _matmul_path

__all__ = ["DRAFTERS", "DRAFTER_OPTIONS", "LOGPROB_TOLERANCE", "OPTION_DEFAULTS", "PARAM_FLAGS", "main"]
