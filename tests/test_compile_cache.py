"""The persistent compilation cache (``jaxspec.compile_cache``): a second process loads the
first one's compiled program instead of compiling it, and the off switches write nothing."""

import json
import os
import subprocess
import sys

import pytest

from jaxspec import cli, compile_cache

# A fresh process: enable the cache (every program stored: min compile time 0), compile one
# small program, report the cache directory and how many programs came from the cache.
SCRIPT = """
import json, jax, jax.numpy as jnp
from jaxspec import compile_cache
d = compile_cache.enable(min_compile_time_s=0)
jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((16, 8))).block_until_ready()
print(json.dumps({"dir": d, "hits": compile_cache.hits()}))
"""


def run_fresh(tmp_path, script=SCRIPT, **env) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inherited = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # not conftest's cache
    env = {**inherited, "JAXSPEC_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]), **env}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_plain_import_exposes_it(tmp_path):
    """``import jaxspec`` alone gives ``jaxspec.compile_cache.enable()`` (as docs/getting_started.md writes it),
    and importing configures nothing: no cache directory set or created."""
    script = ("import json, jax, jaxspec\n"
              "print(json.dumps({'dir': jax.config.jax_compilation_cache_dir,"
              " 'enable': jaxspec.compile_cache.enable.__name__}))")
    assert run_fresh(tmp_path, script) == {"dir": None, "enable": "enable"}
    assert not (tmp_path / "xla").exists()


def files(path) -> list[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def test_second_process_loads_from_the_cache(tmp_path):
    first = run_fresh(tmp_path)
    assert first == {"dir": str(tmp_path / "xla"), "hits": 0}
    written = files(tmp_path / "xla")
    assert written, "the first process stored nothing"
    second = run_fresh(tmp_path)
    assert second["hits"] >= 1  # jax's cache_hits event: loaded, not compiled
    assert sorted(files(tmp_path / "xla")) == sorted(written)  # nothing new to store


@pytest.mark.parametrize("value", ["0", "off"])
def test_env_off_switch_writes_nothing(tmp_path, value):
    assert run_fresh(tmp_path, JAXSPEC_COMPILE_CACHE=value) == {"dir": None, "hits": 0}
    assert not (tmp_path / "xla").exists()


@pytest.mark.parametrize("flag, calls", [([], 1), (["--no-compile-cache"], 0)])
def test_cli_flag(monkeypatch, flag, calls):
    """The CLI enables the cache before loading (default on) and not at all with the flag off;
    an unknown model stops it right after that point, before anything is compiled."""
    seen = []
    monkeypatch.setattr(compile_cache, "enable", lambda *a, **k: seen.append(1))
    with pytest.raises(SystemExit, match="unknown model"):
        cli.main(["generate", "hi", "--model", "no-such-model", *flag])
    assert len(seen) == calls
