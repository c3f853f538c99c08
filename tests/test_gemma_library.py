"""The gemma library's Gemma 3 270M as the target (``jaxspec.models.gemma_library``).

The end-to-end test runs ``examples/gemma_library.py`` on 4 prompts x 64 tokens: greedy
speculation (n-gram) gives plain decoding's tokens, and plain decoding of the library's model
in jaxspec's loop gives jaxspec's own decoder's tokens on the same (packaged, converted)
weights. It needs the ``gemma`` extra (pip install -e '.[gemma]': the library and the versions
that run together, jax 0.9.2 among them, docs/own_model.md), so it is ``slow`` and skipped where
the library does not import; the protocol itself is CI's through tests/test_own_model.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jaxspec
from jaxspec.checkpoints import loading
from jaxspec.models.gemma_library import params_from_jaxspec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_params_from_jaxspec_refuses_other_families():
    config = jaxspec.ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8,
                                 name="a-llama")
    with pytest.raises(ValueError, match=r"maps a Gemma 3 .* got a-llama \(family llama\)"):
        params_from_jaxspec({}, config)


@pytest.mark.slow  # ~10 min on 2 cores: Gemma 3 270M compiled five times (vocabulary 262,144)
def test_example_gemma_library():
    try:
        from gemma import gm  # noqa: F401
    except Exception as e:  # the extra not installed, or its versions not the ones that run together
        pytest.skip(f"the gemma library does not import here ({type(e).__name__}: {e})")
    try:
        loading.resolve("gemma3-270m")
    except FileNotFoundError as e:  # the packaged model's wheels not installed
        pytest.skip(str(e))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gemma_library.py"), "--prompts", "4",
                          "--max-new-tokens", "64"], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["identical"] and result["tokens_equal_jaxspec_decoder"], result
    assert result["tau"] > 1.0, result  # the editing prompts repeat their text: drafts were accepted
    assert all(other["identical"] and other["tau"] > 1.0 for other in result["other_drafters"].values()), result
