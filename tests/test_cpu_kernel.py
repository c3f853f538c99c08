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
from conftest import smollm2

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
    """The kernel on (``JAXSPEC_CPU_KERNEL=1``, the default, also where the environment says
    ``0``), then the process's decision restored. Skipped where the library was not built."""
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


@pytest.mark.parametrize("wdtype", DTYPES)
def test_linears_bitwise_equal_separate_products(wdtype):
    """linears (one kernel call for several weights sharing x, split over threads together)
    gives each product bitwise as linear does alone, for every T; its gradients are those of
    the separate dots. Shapes: a threaded call (K 600, columns 300 + 37 + 256) with odd N."""
    x, _ = _operands(600, 8, 16, jnp.float32, seed=4)
    ws = [jnp.asarray(np.random.default_rng(i).standard_normal((600, n), np.float32)).astype(wdtype)
          for i, n in enumerate((300, 37, 256))]
    assert linear_mod.kernel_applies(jnp.asarray(x), ws[0])
    many, one = jax.jit(linear_mod.linears), jax.jit(linear_mod.linear)
    for t in (1, 5, 16):
        xt = jnp.asarray(x[:t])
        for got, w in zip(many(xt, ws), ws):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(one(xt, w)), err_msg=f"T={t}")

    def loss(x, ws, f):
        return sum(jnp.sum(jnp.tanh(y)) for y in f(x, ws))

    xt = jnp.asarray(x[:4])
    got = jax.grad(functools.partial(loss, f=linear_mod.linears), argnums=(0, 1))(xt, ws)
    want = jax.grad(functools.partial(loss, f=lambda x, ws: [linear_mod.linear(x, w) for w in ws]), argnums=(0, 1))(xt, ws)
    for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.abs(np.asarray(h, np.float32)).max() > 0
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(h, np.float32), rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_window_logits_bitwise_equal_one_token_passes(dtype):
    """The real SmolLM2-135M, compiled as jaxspec compiles its programs (``compiler_options``):
    logits of positions 16..31 scored one token at a time equal, bit for bit, the same positions
    inside a T-token verify window (T = 2, 5, 8, 16) over the same cache, in float32 and in
    bfloat16 (weights, activations and cache)."""
    base = smollm2()
    model = base if dtype == "float32" else jaxspec.load("smollm2-135m", dtype=dtype)
    cfg = model.config
    # XLA's defaults for the two compile-speed flags conftest.py sets for the suite (with both,
    # XLA:CPU's unoptimized reductions are not row-invariant): what a user's program compiles to
    options = {**cpu_matmul.compiler_options(jax.default_backend()), "xla_backend_optimization_level": 3,
               "xla_cpu_use_fusion_emitters": True}
    fwd = jax.jit(lambda p, *a: models.forward(p, cfg, *a), compiler_options=options)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 32)).astype(np.int32)

    def run(start, t, cache):
        pos = jnp.asarray(start + np.arange(t, dtype=np.int32)[None])
        return fwd(model.params, jnp.asarray(seq[:, start : start + t]), pos, cache)

    cache = run(0, 16, KVCache.zeros(cfg, 1, 64, model.params["embed"].dtype)).cache
    ones, c = [], cache
    for j in range(16, 32):
        out = run(j, 1, c)
        ones.append(np.asarray(out.logits[0, 0], np.float32))
        c = out.cache
    for t in (2, 5, 8, 16):
        np.testing.assert_array_equal(np.asarray(run(16, t, cache).logits[0], np.float32), np.stack(ones[:t]),
                                      err_msg=f"{dtype} T={t}")


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


def test_default_is_on_for_both_dtypes(monkeypatch):
    """Unset: the kernel takes float32 and bfloat16 weights (measured: SmolLM2's float32 1-token
    pass a little faster, its 2-5-token verify passes much cheaper, bfloat16 several times
    faster than with XLA's dot); ``0`` switches it off; another value is refused naming the
    variable and its values."""
    monkeypatch.delenv(cpu_matmul.ENV_SWITCH)
    assert cpu_matmul.mode() == "on" and cpu_matmul.active()
    assert cpu_matmul.describe() in ("jaxspec cpu kernel (avx2)", "jaxspec cpu kernel (portable)")
    x, w = _operands(13, 37, 3, jnp.float32)
    assert linear_mod.kernel_applies(jnp.asarray(x), w) and linear_mod.kernel_applies(jnp.asarray(x), w.astype(jnp.bfloat16))
    monkeypatch.setenv(cpu_matmul.ENV_SWITCH, "0")
    assert cpu_matmul.mode() == "off" and not cpu_matmul.active()
    assert not linear_mod.kernel_applies(jnp.asarray(x), w)
    monkeypatch.setenv(cpu_matmul.ENV_SWITCH, "auto")
    with pytest.raises(ValueError, match="JAXSPEC_CPU_KERNEL must be 1 or 0, got 'auto'"):
        cpu_matmul.mode()
