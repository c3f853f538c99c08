"""The CPU small-T matmul kernel (``jaxspec.kernels.cpu_matmul``) and ``models.linear``:
products against float64 and ``jnp.dot``, bitwise row invariance for every T in 1..16, a
token's logits in a T-token window bitwise equal to its 1-token pass (tiny model, float32 and
bfloat16), gradients through ``linear``, and the fallbacks (switch off, missing library)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.kernels import cpu_matmul
from jaxspec.models import linear as linear_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U = 2.0**-24  # float32 unit roundoff
# K=13, N=37: odd sizes (K mod 8 = 5, N mod 8 = 5, one thread); K=600, N=300: the threaded path.
SHAPES = [(13, 37), (600, 300)]
DTYPES = [jnp.float32, jnp.bfloat16]



@pytest.fixture(autouse=True, scope="module")
def kernel_on():
    """The kernel is opt-in (``JAXSPEC_CPU_KERNEL=1``): this module switches it on, then restores
    the process's decision. Skipped where the library was not built."""
    mp = pytest.MonkeyPatch()
    mp.setenv(cpu_matmul.ENV_SWITCH, "1")
    mp.setattr(cpu_matmul, "_state", {})
    if not os.path.exists(cpu_matmul.LIBRARY_PATH):
        mp.undo()
        pytest.skip(f"the kernel is not built ({cpu_matmul.LIBRARY_PATH}); pip install -e . builds it")
    assert cpu_matmul.enabled(), cpu_matmul.describe()
    yield
    mp.undo()


def _operands(k, n, t, wdtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k), np.float32)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32)).astype(wdtype)
    return x, w


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("kind", ["kn", "nk"])
def test_product_within_rounding_bound(k, n, wdtype, kind):
    """Each output of a K-term float32 sum (products exact in float64: bfloat16 weights widen
    exactly, float32 x float32 fits a float64 product's 48 bits) is within K * u * sum_k |x w|
    of the exact value (u = 2^-24; recursive summation's bound, Higham 2002, Sec. 3.1); jnp.dot
    obeys the same bound, so the two differ by at most twice it."""
    x, w = _operands(k, n, 16, wdtype)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    exact, mag = x.astype(np.float64) @ w64, np.abs(x.astype(np.float64)) @ np.abs(w64)
    if kind == "kn":
        got = np.asarray(jax.jit(cpu_matmul.matmul_kn)(jnp.asarray(x), w))
    else:
        got = np.asarray(jax.jit(cpu_matmul.matmul_nk)(jnp.asarray(x), w.T.copy()))
    assert got.dtype == np.float32 and got.shape == (16, n)
    bound = k * U * mag
    assert (np.abs(got - exact) <= bound).all()
    ref = np.asarray(jnp.dot(jnp.asarray(x), w.astype(jnp.float32), precision="highest"))
    assert (np.abs(got - ref) <= 2 * bound).all()
    assert np.abs(got - exact).max() > 0 or k < 16  # a float32 sum, not a float64 one


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("kind", ["kn", "nk"])
def test_rows_bitwise_invariant(k, n, wdtype, kind):
    """Row t of a T-row product is bitwise the 1-row product of x[t], for every T in 1..16."""
    x, w = _operands(k, n, 16, wdtype, seed=1)
    f = jax.jit(cpu_matmul.matmul_kn if kind == "kn" else cpu_matmul.matmul_nk)
    w = w if kind == "kn" else w.T.copy()
    ones = np.stack([np.asarray(f(jnp.asarray(x[t : t + 1]), w))[0] for t in range(16)])
    for t in range(1, 17):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:t]), w)), ones[:t], err_msg=f"T={t}")


def test_linear_dispatch_and_shapes():
    """linear flattens leading dims, handles [N, K] weights, takes XLA's dot past MAX_ROWS
    (same values within rounding), and rounds bfloat16 activations' results to bfloat16."""
    x, w = _operands(13, 37, 2 * 3 * 5, jnp.float32, seed=2)
    x3 = jnp.asarray(x).reshape(2, 15, 13)
    assert not linear_mod.kernel_applies(x3, w) and linear_mod.kernel_applies(x3[:, :8], w)
    big = np.asarray(linear_mod.linear(x3, w))  # 30 rows: XLA
    small = np.asarray(jax.jit(linear_mod.linear)(x3[:, :8], w))  # 16 rows: kernel
    np.testing.assert_allclose(small, big[:, :8], rtol=1e-5, atol=1e-5)
    tr = np.asarray(jax.jit(functools.partial(linear_mod.linear, transposed=True))(x3[:, :8], w.T))
    np.testing.assert_array_equal(tr.shape, small.shape)
    np.testing.assert_allclose(tr, small, rtol=1e-5, atol=1e-5)
    yb = jax.jit(linear_mod.linear)(x3[:, :8].astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16 and yb.shape == (2, 8, 37)


def test_linear_gradients_match_plain_dots():
    """A custom_vjp with plain dots backward: grads of linear equal those of x @ w."""
    x, w = _operands(13, 37, 4, jnp.float32, seed=3)
    x = jnp.asarray(x)
    for transposed in (False, True):
        wt = w.T if transposed else w

        def loss(x, w, f):
            return jnp.sum(jnp.tanh(f(x, w)))

        got = jax.jit(jax.grad(functools.partial(loss, f=functools.partial(linear_mod.linear, transposed=transposed)),
                               argnums=(0, 1)))(x, wt)
        plain = (lambda x, w: x @ w.T) if transposed else (lambda x, w: x @ w)
        want = jax.grad(functools.partial(loss, f=plain), argnums=(0, 1))(x, wt)
        for g, h in zip(got, want):
            assert np.abs(np.asarray(h)).max() > 0
            np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-6)


TINY = jaxspec.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                           max_position=512, name="tiny-kernel")


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_logits_bitwise_equal_one_token_passes(dtype):
    """The logits of tokens 8..15 scored by 1-token passes through the KV cache equal, bit for
    bit, the same positions inside a T-token verify window (T = 2, 5, 8) over the same cache."""
    params = models.init_params(TINY, jax.random.key(0), dtype=dtype, scale=1.0)
    seq = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 16)).astype(np.int32)
    fwd = jax.jit(functools.partial(models.forward, params, TINY))

    def run(start, t, cache):
        pos = jnp.asarray(start + np.arange(t, dtype=np.int32)[None])
        return fwd(jnp.asarray(seq[:, start : start + t]), pos, cache)

    cache = run(0, 8, KVCache.zeros(TINY, 1, 32, dtype)).cache
    ones, c = [], cache
    for j in range(8, 16):
        out = run(j, 1, c)
        ones.append(np.asarray(out.logits[0, 0]))
        c = out.cache
    for t in (2, 5, 8):
        np.testing.assert_array_equal(np.asarray(run(8, t, cache).logits[0]), np.stack(ones[:t]), err_msg=f"T={t}")


def test_missing_library_warns_once_and_falls_back(monkeypatch):
    """Switched on but not built: one RuntimeWarning naming the fix, enabled() False, linear =
    XLA's dot."""
    monkeypatch.setattr(cpu_matmul, "_state", {})
    with pytest.warns(RuntimeWarning, match="pip install -e"):
        assert not cpu_matmul.enabled(path=os.path.join(ROOT, "no-such-dir", "_cpu_matmul.so"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_matmul.enabled() and cpu_matmul.describe().startswith("XLA dot")
        x, w = _operands(13, 37, 3, jnp.float32)
        np.testing.assert_allclose(np.asarray(jax.jit(linear_mod.linear)(jnp.asarray(x), w)),
                                   x @ np.asarray(w), rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="off"):
            cpu_matmul.matmul_kn(jnp.asarray(x), w)


def test_switch_off_in_a_fresh_process():
    """JAXSPEC_CPU_KERNEL=0: the kernel is never loaded, no warning, XLA's dot reported."""
    code = ("import warnings; warnings.simplefilter('error'); from jaxspec.kernels import cpu_matmul as c; "
            "print(c.enabled(), c.describe())")
    env = dict(os.environ, JAXSPEC_CPU_KERNEL="0", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False XLA dot (JAXSPEC_CPU_KERNEL=0)"


def test_default_runs_bfloat16_weights_only(monkeypatch):
    """Unset (``auto``): bfloat16 weights take the kernel, float32 weights XLA's dot (measured:
    the kernel made SmolLM2's bfloat16 pass 4.4x faster and its float32 1-token pass slower);
    ``1`` takes it for both; another value is refused naming the variable."""
    monkeypatch.delenv(cpu_matmul.ENV_SWITCH)
    assert cpu_matmul.mode() == "auto"
    assert cpu_matmul.active(jnp.bfloat16) and not cpu_matmul.active(jnp.float32)
    assert cpu_matmul.describe().endswith("for bfloat16 weights, XLA dot for float32")
    monkeypatch.setenv(cpu_matmul.ENV_SWITCH, "1")
    assert cpu_matmul.active(jnp.bfloat16) and cpu_matmul.active(jnp.float32)
    monkeypatch.setenv(cpu_matmul.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="JAXSPEC_CPU_KERNEL must be auto, 1 or 0, got 'yes'"):
        cpu_matmul.mode()
