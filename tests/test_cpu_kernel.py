"""The CPU kernels (``jaxspec.kernels``): the small-T matmul behind ``models.linear`` (products
against float64 and ``jnp.dot``, bitwise row invariance for every T in 1..16, gradients) and the
attention behind ``models.attention`` (against XLA's, row invariance, keys in the cache or kept
apart, gradients); a token's logits in a T-token window, written, kept apart or on a tree path,
bitwise equal to its 1-token pass (tiny model and SmolLM2, float32 and bfloat16); and the
fallbacks (switch off, missing library)."""

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
from jaxspec.models import attention as attention_mod
from jaxspec.models import layout
from jaxspec.models import linear as linear_mod
from jaxspec.models import rope as rope_mod

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


def _product(kind, w):
    """``(f, operand)``: the jitted kernel of ``kind`` and ``w [K, N]`` in the layout it reads."""
    n = w.shape[1]
    if kind == "kn":
        return jax.jit(cpu_matmul.matmul_kn), w
    if kind == "nk":
        return jax.jit(cpu_matmul.matmul_nk), w.T.copy()
    return jax.jit(lambda x, p: cpu_matmul.matmul_panels(x, [p], [n])[0]), cpu_matmul.pack_panels(w)


KINDS = ["kn", "nk", "panels"]


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_product_within_rounding_bound(k, n, wdtype, kind):
    """Each output of a K-term float32 sum (products exact in float64: bfloat16 weights widen
    exactly, float32 x float32 fits a float64 product's 48 bits) is within K * u * sum_k |x w|
    of the exact value (u = 2^-24; recursive summation's bound, Higham 2002, Sec. 3.1); jnp.dot
    obeys the same bound, so the two differ by at most twice it."""
    x, w = _operands(k, n, 16, wdtype)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    exact, mag = x.astype(np.float64) @ w64, np.abs(x.astype(np.float64)) @ np.abs(w64)
    f, operand = _product(kind, w)
    got = np.asarray(f(jnp.asarray(x), operand))
    assert got.dtype == np.float32 and got.shape == (16, n)
    bound = k * U * mag
    assert (np.abs(got - exact) <= bound).all()
    ref = np.asarray(jnp.dot(jnp.asarray(x), w.astype(jnp.float32), precision="highest"))
    assert (np.abs(got - ref) <= 2 * bound).all()
    assert np.abs(got - exact).max() > 0 or k < 16  # a float32 sum, not a float64 one


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_rows_bitwise_invariant(k, n, wdtype, kind):
    """Row t of a T-row product is bitwise the 1-row product of x[t], for every T in 1..16 and
    at the top of the range (the panel kernel takes rows in register tiles of up to 6: T = 64
    runs as 10 tiles)."""
    x, w = _operands(k, n, cpu_matmul.MAX_ROWS, wdtype, seed=1)
    f, w = _product(kind, w)
    ones = np.stack([np.asarray(f(jnp.asarray(x[t : t + 1]), w))[0] for t in range(cpu_matmul.MAX_ROWS)])
    for t in [*range(1, 17), 31, cpu_matmul.MAX_ROWS]:
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:t]), w)), ones[:t], err_msg=f"T={t}")


def _vector_paths():
    """The vector code paths this CPU runs (``avx2``, and ``avx512`` where it has AVX-512F)."""
    have = cpu_matmul.ISAS.index(cpu_matmul.isa())
    return [cpu_matmul.ISAS[i] for i in range(1, have + 1)]


@pytest.mark.parametrize("wdtype", DTYPES)
def test_vector_paths_bitwise_equal_and_row_invariant(wdtype):
    """The AVX-512 panel tiles (one register per panel, up to 12 rows a tile) and the AVX2 ones
    (two registers, up to 6 rows, pairs of panels for 1-3 rows) give the same bits: each output is
    the same float32 FMA chain over k. Checked, with each path's row invariance, for every T in
    1..16, 31 and 64, on a threaded shape; one compiled program runs both (``limit_isa`` acts at
    each call). Skipped on a CPU without AVX-512."""
    paths = _vector_paths()
    if len(paths) < 2:
        pytest.skip(f"this CPU runs only the {cpu_matmul.isa()} path")
    x, w = _operands(600, 300, cpu_matmul.MAX_ROWS, wdtype, seed=2)
    f, w = _product("panels", w)
    got = {}
    for path in paths:
        with cpu_matmul.limit_isa(path):
            assert cpu_matmul.isa() == path and cpu_matmul.describe() == f"jaxspec cpu kernel ({path})"
            ones = np.stack([np.asarray(f(jnp.asarray(x[t : t + 1]), w))[0] for t in range(cpu_matmul.MAX_ROWS)])
            got[path] = [np.asarray(f(jnp.asarray(x[:t]), w)) for t in [*range(1, 17), 31, cpu_matmul.MAX_ROWS]]
            for y in got[path]:
                np.testing.assert_array_equal(y, ones[: len(y)], err_msg=f"{path}, T={len(y)}")
    for a, b in zip(got["avx512"], got["avx2"]):
        np.testing.assert_array_equal(a, b, err_msg=f"avx512 vs avx2, T={len(a)}")
    assert cpu_matmul.isa() == paths[-1]  # the cap restored
    with pytest.raises(ValueError, match="isa must be one of"):
        with cpu_matmul.limit_isa("sse"):
            pass


def test_panels_layout_round_trip_and_errors():
    """pack/unpack are inverses (odd N: the last panel zero-padded); the kernel refuses panels
    that do not chain with x or y, naming the call."""
    w = jnp.asarray(np.random.default_rng(5).standard_normal((13, 37), np.float32))
    p = layout.pack(w)
    assert p.data.shape == (3, 13, 16) and p.shape == (13, 37) and p.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p.unpack()), np.asarray(w))
    assert not np.asarray(p.data[2, :, 5:]).any()
    with pytest.raises(Exception, match="jaxspec cpu panels: shapes do not chain"):
        jax.jit(lambda x: cpu_matmul.matmul_panels(x, [p.data], [50])[0])(jnp.ones((2, 13)))
    with pytest.raises(ValueError, match="pack takes a 2-D matrix"):
        layout.pack(jnp.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="x's last axis is 12"):
        linear_mod.linear(jnp.ones((2, 12)), p)


def test_transposed_panels_are_the_table():
    """A tied embedding table [V, D] laid out transposed (the head [D, V] in panels) is the
    table to every reader: shape, unpack, np.asarray, lookups (take, both axes), flat elements;
    linear(transposed=True) over it is the head's product, bitwise the row-invariant kernel's for
    1 and 9 rows; linear without transposed refuses it, naming the flag."""
    e = jnp.asarray(np.random.default_rng(6).standard_normal((37, 13), np.float32))  # [V, D]
    t = layout.pack(e, transposed=True)
    assert t.shape == (37, 13) and t.data.shape == (3, 13, 16) and t.transposed
    np.testing.assert_array_equal(np.asarray(t), np.asarray(e))
    ids = jnp.asarray([[0, 36, 17], [12, 5, 3]])
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.take)(t, ids)), np.asarray(e)[np.asarray(ids)])
    np.testing.assert_array_equal(np.asarray(layout.take(t, ids[1], axis=1)), np.asarray(e)[:, np.asarray(ids[1])])
    flat = jnp.asarray([0, 12, 13, 200, 37 * 13 - 1])
    np.testing.assert_array_equal(np.asarray(t.take_flat(flat)), np.asarray(e).ravel()[np.asarray(flat)])
    p = layout.pack(e.T)  # the same head, not transposed: columns are the table's rows
    np.testing.assert_array_equal(np.asarray(layout.take(p, ids[0], axis=1)), np.asarray(e)[np.asarray(ids[0])].T)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((9, 13), np.float32))
    head = jax.jit(functools.partial(linear_mod.linear, transposed=True))
    y9, y1 = np.asarray(head(x, t)), np.asarray(head(x[4:5], t))
    np.testing.assert_array_equal(y9, np.asarray(jax.jit(linear_mod.linear)(x, p)))
    np.testing.assert_array_equal(y9[4:5], y1)
    np.testing.assert_allclose(y9, np.asarray(x) @ np.asarray(e).T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Panels.transposed=True"):
        linear_mod.linear(x, t)


def test_linear_dispatch_and_shapes():
    """linear flattens leading dims, handles [N, K] weights, takes XLA's dot past MAX_ROWS
    (same values within rounding), and rounds bfloat16 activations' results to bfloat16."""
    x, w = _operands(13, 37, 2 * (linear_mod.MAX_ROWS // 2 + 1), jnp.float32, seed=2)
    x3 = jnp.asarray(x).reshape(2, linear_mod.MAX_ROWS // 2 + 1, 13)
    assert not linear_mod.kernel_applies(x3, w) and linear_mod.kernel_applies(x3[:, :8], w)
    big = np.asarray(linear_mod.linear(x3, w))  # MAX_ROWS + 2 rows: XLA
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


def test_linear_takes_panels():
    """A matrix as layout.Panels goes through linear/linears like the array: the panel kernel
    up to MAX_ROWS rows (each product bitwise matmul_panels alone, for every T, also inside
    linears), then MAX_ROWS rows per call up to CHUNKED_ROWS (a prefill: each row bitwise its
    1-row product), XLA's dot past that (within rounding of x @ w); a mix of panels and arrays; and
    gradients equal those of x @ w, the weight's gradient coming back as Panels."""
    x, _ = _operands(600, 8, 2 * (linear_mod.MAX_ROWS // 2 + 1), jnp.float32, seed=6)
    ws = [jnp.asarray(np.random.default_rng(i).standard_normal((600, n), np.float32)) for i, n in enumerate((300, 37))]
    ps = [layout.pack(w) for w in ws]
    one = jax.jit(linear_mod.linear)
    for t in (1, 5, 16):
        xt = jnp.asarray(x[:t])
        alone = [np.asarray(cpu_matmul.matmul_panels(xt, [p.data], [p.n])[0]) for p in ps]
        for got, want in zip(jax.jit(linear_mod.linears)(xt, ps), alone):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"T={t}")
        np.testing.assert_array_equal(np.asarray(one(xt, ps[1])), alone[1])
        mixed = jax.jit(linear_mod.linears)(xt, (ps[0], ws[1]))
        np.testing.assert_array_equal(np.asarray(mixed[0]), alone[0])
        np.testing.assert_array_equal(np.asarray(mixed[1]), np.asarray(one(xt, ws[1])))
    x3 = jnp.asarray(x).reshape(2, -1, 600)  # MAX_ROWS + 2 rows: the kernel, in two calls
    assert linear_mod.kernel_applies(x3, ps[0]) and not linear_mod.kernel_applies(x3, ws[0])
    rows = np.stack([np.asarray(cpu_matmul.matmul_panels(jnp.asarray(x[t : t + 1]), [ps[0].data], [300])[0])[0]
                     for t in range(len(x))])
    np.testing.assert_array_equal(np.asarray(one(x3, ps[0])).reshape(len(x), 300), rows)
    big = jnp.zeros((linear_mod.CHUNKED_ROWS + 1, 600)).at[: len(x)].set(x)  # past CHUNKED_ROWS: XLA
    assert not linear_mod.kernel_applies(big, ps[0])
    np.testing.assert_allclose(np.asarray(one(big, ps[0]))[: len(x)], np.asarray(x @ ws[0]), rtol=1e-4, atol=1e-4)
    yb = one(x3[:, :4].astype(jnp.bfloat16), layout.pack(ws[0].astype(jnp.bfloat16)))
    assert yb.dtype == jnp.bfloat16 and yb.shape == (2, 4, 300)

    def loss(x, w, f):
        return jnp.sum(jnp.tanh(f(x, w)))

    xt = jnp.asarray(x[:4]) * 0.05
    gx, gp = jax.jit(jax.grad(functools.partial(loss, f=linear_mod.linear), argnums=(0, 1)))(xt, ps[1])
    hx, hw = jax.grad(functools.partial(loss, f=lambda x, w: x @ w), argnums=(0, 1))(xt, ws[1])
    assert isinstance(gp, layout.Panels) and np.abs(np.asarray(hw)).max() > 0
    # dx sums 37 products per element, in an order XLA:CPU chooses per program and per CPU
    # (an AMD EPYC host moved one element by 1.3e-6): float32's bound for such a sum is
    # 37 x eps x (the sum of |terms|)
    terms = np.abs(1 - np.tanh(np.asarray(xt @ ws[1])) ** 2) @ np.abs(np.asarray(ws[1])).T
    assert np.all(np.abs(np.asarray(gx) - np.asarray(hx)) <= 37 * np.finfo(np.float32).eps * terms)
    np.testing.assert_allclose(np.asarray(gp.unpack()), np.asarray(hw), rtol=1e-5, atol=1e-6)
    assert not np.asarray(gp.data[-1, :, 37 % 16:]).any()  # no gradient into the padding


def test_params_laid_out_once_and_back(tiny, tmp_path):
    """generate lays a bare params tree out in panels once (the same copy on the next call) and
    gives the tokens of the tree laid out by hand; as_arrays undoes it bitwise; an orbax save of
    the laid-out tree restores as the plain one; load on CPU returns panels."""
    from jaxspec.checkpoints import orbax_io

    params = tiny.params
    laid = layout.for_run(params, tiny.cfg)
    assert layout.has_panels(laid) and not layout.has_panels(params)
    assert layout.for_run(params, tiny.cfg) is laid and layout.for_run(laid, tiny.cfg) is laid
    assert isinstance(laid["layers"][0]["w_down"], layout.Panels) and laid["final_norm"] is params["final_norm"]
    head = laid["lm_head" if "lm_head" in params else "embed"]
    assert isinstance(head, layout.Panels) and head.transposed == ("lm_head" not in params)
    for got, want in zip(jax.tree.leaves(layout.as_arrays(laid)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ngram = jaxspec.NGramDrafter(gamma=3)
    a = jaxspec.generate(params, tiny.prompts, config=tiny.cfg, max_new_tokens=12, drafter=ngram, logprobs=0)
    b = jaxspec.generate(layout.for_kernel(params), tiny.prompts, config=tiny.cfg, max_new_tokens=12, logprobs=0)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    orbax_io.save(str(tmp_path / "ckpt"), laid, tiny.cfg)
    restored, _, _ = orbax_io.restore(str(tmp_path / "ckpt"))
    assert not layout.has_panels(restored)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert layout.wanted(tiny.cfg) and not layout.wanted(tiny.cfg, mesh=object())
    with cpu_matmul.disabled("matmul"):
        assert layout.for_run(params, tiny.cfg) is params  # XLA's dot: plain arrays


def _attention_operands(dtype, seed=0, b=2, t=5, heads=6, kv=2, h=24, s=19, n=5):
    """Random q [b, t, heads, h], cache k/v [b, s, kv, h], new k/v [b, n, kv, h] and masks (odd
    head dim: the AVX2 path's 8-lane sums plus a tail; every query sees slot 0)."""
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), np.float32).astype(dtype)

    seen = jnp.asarray(rng.random((b, t, s)) < 0.6).at[:, :, 0].set(True)
    return arr(b, t, heads, h), arr(b, s, kv, h), arr(b, s, kv, h), seen, (arr(b, n, kv, h), arr(b, n, kv, h),
                                                                          jnp.asarray(rng.random((b, t, n)) < 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("apart", [False, True])
def test_attention_kernel_matches_xla(dtype, apart):
    """The kernel against XLA's attention: float32 sums of <= 24 terms of size <= |q||k| (
    scores) and of softmax weights times values: within 1e-5 absolute in float32; in bfloat16
    both round the output once to 8 bits (one bfloat16 ulp, 2**-8 relative), after XLA also
    rounded its weights to bfloat16: 2 ulps of the largest output."""
    q, k, v, seen, extra = _attention_operands(dtype)
    extra = extra if apart else None
    got = jax.jit(lambda *a: attention_mod.attention(*a, extra=extra))(q, k, v, seen)
    want = attention_mod._xla(q, k, v, seen, extra, 0.0)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if dtype == jnp.float32 else 2 * 2.0**-8 * float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernel_row_and_placement_invariant(dtype):
    """Bitwise: query t of a T-query call equals the same query alone, and a query sees the
    same result whether the newest keys sit in the cache or are kept apart (the 1-token pass
    vs the verify window)."""
    q, k, v, seen, (kn, vn, sn) = _attention_operands(dtype)
    f = jax.jit(lambda q, s1, s2: attention_mod.attention(q, k, v, s1, extra=(kn, vn, s2)))
    full = f(q, seen, sn)
    for t in range(q.shape[1]):
        np.testing.assert_array_equal(np.asarray(full[:, t : t + 1], np.float32),
                                      np.asarray(f(q[:, t : t + 1], seen[:, t : t + 1], sn[:, t : t + 1]), np.float32))
    s, n = k.shape[1], kn.shape[1]
    k2, v2 = k.at[:, s - n :].set(kn), v.at[:, s - n :].set(vn)  # the new keys written over the last slots
    older = jnp.zeros((2, 1, s), bool).at[:, :, : s - n].set(True)
    apart = jax.jit(lambda: attention_mod.attention(q[:, :1], k, v, older, extra=(kn, vn, jnp.ones((2, 1, n), bool))))()
    written = jax.jit(lambda: attention_mod.attention(q[:, :1], k2, v2, jnp.ones((2, 1, s), bool)))()
    np.testing.assert_array_equal(np.asarray(apart, np.float32), np.asarray(written, np.float32))


def test_kernels_write_bfloat16_as_xla_rounds():
    """The kernels' bfloat16 results (a bfloat16 model's activations, with no convert op after
    the call) are bitwise XLA's convert of their float32 results: ties to even, overflow to
    inf, NaN stays NaN, signed zeros and subnormals kept; a bfloat16 x in is the float32 x."""
    from jaxspec.kernels import cpu_attention

    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7FC00000, 0x7F800001,
                     0x80000000, 0x00000001, 0x00408000, 0xC0490FDB, 0x3EAAAAAB, 0x7F800000, 0x47800080,
                     0x3F7FFFFF, 0xBF808001], np.uint32)
    x = jnp.asarray(bits.view(np.float32).reshape(16, 1))
    ones = cpu_matmul.pack_panels(jnp.ones((1, 16), jnp.float32))  # y[t, n] = x[t] * 1, exactly x[t]
    f = jax.jit(lambda x, dt: cpu_matmul.matmul_panels(x, [ones], [16], dt)[0], static_argnums=1)
    got, want = np.asarray(f(x, jnp.bfloat16)), np.asarray(f(x, jnp.float32).astype(jnp.bfloat16))
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    xw, w = _operands(37, 21, 5, jnp.bfloat16, seed=3)
    p = cpu_matmul.pack_panels(w)
    xb = jnp.asarray(xw).astype(jnp.bfloat16)
    g = jax.jit(lambda x: cpu_matmul.matmul_panels(x, [p], [21])[0])
    np.testing.assert_array_equal(np.asarray(g(xb)), np.asarray(g(xb.astype(jnp.float32))))
    q, k, v, seen, (kn, vn, sn) = _attention_operands(jnp.bfloat16)
    att = jax.jit(lambda dt: cpu_attention.attention(q, k, v, seen, kn, vn, sn, 0.3, out_dtype=dt), static_argnums=0)
    np.testing.assert_array_equal(np.asarray(att(jnp.bfloat16)).view(np.uint16),
                                  np.asarray(att(jnp.float32).astype(jnp.bfloat16)).view(np.uint16))
    freqs = rope_mod.inv_freq(q.shape[-1], 10000.0)
    pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32) + 7, q.shape[:2])
    rp = jax.jit(lambda dt: cpu_attention.rope(q, pos, freqs, out_dtype=dt), static_argnums=0)
    np.testing.assert_array_equal(np.asarray(rp(jnp.bfloat16)).view(np.uint16),
                                  np.asarray(rp(jnp.float32).astype(jnp.bfloat16)).view(np.uint16))
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        cpu_matmul.matmul_panels(x, [ones], [16], jnp.float16)


def test_attention_and_rope_gradients_are_xla_s():
    """Gradients through the kernels are XLA's (``jax.custom_vjp``): equal to those of the XLA
    functions, bit for bit (the backward passes are the same XLA code)."""
    q, k, v, seen, extra = _attention_operands(jnp.float32)
    g = jax.grad(lambda q, k: attention_mod.attention(q, k, v, seen, extra=extra).sum(), argnums=(0, 1))(q, k)
    want = jax.grad(lambda q, k: attention_mod._xla(q, k, v, seen, extra, 0.0).sum(), argnums=(0, 1))(q, k)
    for a, b in zip(g, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pos = jnp.asarray([[3, 4, 5, 6, 7], [0, 1, 2, 9, 11]], jnp.int32)
    freqs = rope_mod.inv_freq(24, 10000.0)
    g = jax.grad(lambda q: (rope_mod.apply(q, pos, freqs) ** 2).sum())(q)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.grad(lambda q: (rope_mod._xla(q, pos, freqs) ** 2).sum())(q)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kernel_matches_xla_and_is_row_invariant(dtype):
    """RoPE on CPU: within 4 float32 ulps of the largest value of XLA's (float32 sin/cos of the
    same float32 angles, each within an ulp or two; in bfloat16 both round once: 1 ulp), and
    a row alone bitwise equal to the same row among others."""
    q = _attention_operands(dtype)[0]
    pos = jnp.asarray([[3, 4, 5, 6, 7], [0, 1, 2, 9, 511]], jnp.int32)
    freqs = rope_mod.inv_freq(24, 10000.0)
    got = jax.jit(rope_mod.apply)(q, pos, freqs)
    want = np.asarray(rope_mod._xla(q, pos, freqs), np.float32)
    scale = float(np.max(np.abs(want)))
    tol = 4 * 2.0**-23 * scale if dtype == jnp.float32 else 2.0**-7 * scale
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=tol)
    for t in range(q.shape[1]):
        np.testing.assert_array_equal(np.asarray(jax.jit(rope_mod.apply)(q[:, t : t + 1], pos[:, t : t + 1], freqs)),
                                      np.asarray(got[:, t : t + 1]))


TINY = jaxspec.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                           max_position=512, name="tiny-kernel")


# A draft tree over 6 window slots: parent of each node (-1: the root, the first new token).
# Nodes 0, 2, 3, 5 are a path (depths 0..3) carrying the sequence's tokens; 1 and 4 are
# siblings with other tokens, visible to no node of the path.
TREE_PARENT = [-1, 0, 0, 2, 3, 3]
TREE_PATH = [0, 2, 3, 5]


def _tree():
    n = len(TREE_PARENT)
    seen, depth = np.eye(n, dtype=bool), np.zeros(n, np.int32)
    for i, p in enumerate(TREE_PARENT):
        if p >= 0:
            seen[i] |= seen[p]
            depth[i] = depth[p] + 1
    return seen, depth


def _check_windows(fwd, seq, start, n, cache, label, written=(2, 5, 8), apart=(2, 5, 8)):
    """Score positions ``start .. start + n - 1`` of ``seq`` [1, L] one token at a time through
    ``cache`` (holding positions below ``start``), then check that the same positions inside
    windows over the same cache give the same logits bit for bit: T-token windows written into
    the cache (``written``: prefill chunks, drafters), kept apart from it (``apart``: the
    engine's verify, ``forward(write=False)``), and the path of a draft tree among siblings
    (``TREE_PARENT``), both ways. ``fwd(tokens, positions, cache, mask, write)``."""
    def run(t, cache, mask=None, write=True, tokens=None):
        pos = start + np.arange(t, dtype=np.int32)[None] if mask is None else mask.positions
        tokens = seq[:, start : start + t] if tokens is None else tokens
        out = fwd(jnp.asarray(tokens), jnp.asarray(pos), cache, mask, write)
        return np.asarray(out.logits[0], np.float32), out.cache

    ones, c = [], cache
    for j in range(n):
        pos = jnp.asarray([[start + j]], jnp.int32)
        out = fwd(jnp.asarray(seq[:, start + j : start + j + 1]), pos, c, None, True)
        ones.append(np.asarray(out.logits[0, 0], np.float32))
        c = out.cache
    ones = np.stack(ones)
    begin = jnp.asarray([start], jnp.int32)
    for t in written:
        np.testing.assert_array_equal(run(t, cache)[0], ones[:t], err_msg=f"{label}: written, T={t}")
    for t in apart:
        causal = models.TreeMask(begin, jnp.asarray(np.tri(t, dtype=bool)[None]),
                                 jnp.asarray(start + np.arange(t, dtype=np.int32)[None]))
        np.testing.assert_array_equal(run(t, cache, causal, write=False)[0], ones[:t], err_msg=f"{label}: apart, T={t}")
    seen, depth = _tree()
    tokens = (seq[0, start + depth] + 1 + np.arange(len(depth))) % 64  # siblings: other tokens
    tokens[TREE_PATH] = seq[0, start + depth[TREE_PATH]]
    tree = models.TreeMask(begin, jnp.asarray(seen[None]), jnp.asarray(start + depth[None]))
    for write in (False, True):
        got = run(len(depth), cache, tree, write=write, tokens=tokens[None])[0][TREE_PATH]
        np.testing.assert_array_equal(got, ones[: len(TREE_PATH)], err_msg=f"{label}: tree path, write={write}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_logits_bitwise_equal_one_token_passes(dtype):
    """The logits of tokens 8..15 scored by 1-token passes through the KV cache equal, bit for
    bit, the same positions inside T-token windows over the same cache (T = 2, 5, 8), written
    into the cache or kept apart from it as the engine's verify keeps them, and along the path
    of a draft tree (``_check_windows``)."""
    params = models.init_params(TINY, jax.random.key(0), dtype=dtype, scale=1.0)
    seq = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 16)).astype(np.int32)
    fwd = jax.jit(lambda t, p, c, m, w: models.forward(params, TINY, t, p, c, mask=m, write=w), static_argnums=4)
    prompt = fwd(jnp.asarray(seq[:, :8]), jnp.arange(8, dtype=jnp.int32)[None], KVCache.zeros(TINY, 1, 32, dtype),
                 None, True)
    _check_windows(fwd, seq, 8, 8, prompt.cache, str(jnp.dtype(dtype)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_window_logits_bitwise_equal_one_token_passes(dtype):
    """The real SmolLM2-135M, compiled as jaxspec compiles its programs (``compiler_options``):
    logits of positions 16..31 scored one token at a time equal, bit for bit, the same positions
    inside a 16-token window written into the cache, a 5-token window kept apart from it (the
    engine's verify) and the path of a draft tree, in float32 and in bfloat16 (weights,
    activations and cache)."""
    base = smollm2()
    model = base if dtype == "float32" else jaxspec.load("smollm2-135m", dtype=dtype)
    cfg = model.config
    # XLA's defaults for the two compile-speed flags conftest.py sets for the suite (with both,
    # XLA:CPU's unoptimized reductions are not row-invariant): what a user's program compiles to
    options = {**cpu_matmul.compiler_options(jax.default_backend()), "xla_backend_optimization_level": 3,
               "xla_cpu_use_fusion_emitters": True}
    fwd = jax.jit(lambda p, t, pos, c, m, w: models.forward(p, cfg, t, pos, c, mask=m, write=w), static_argnums=5,
                  compiler_options=options)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 32)).astype(np.int32)
    cache = KVCache.zeros(cfg, 1, 64, model.params["embed"].dtype)
    prompt = fwd(model.params, jnp.asarray(seq[:, :16]), jnp.arange(16, dtype=jnp.int32)[None], cache, None, True)
    _check_windows(functools.partial(fwd, model.params), seq, 16, 16, prompt.cache, dtype, written=(16,), apart=(5,))


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


def test_isa_cap_from_the_environment():
    """JAXSPEC_CPU_ISA caps the kernels' code path for the process (portable: every CPU has it;
    a product still matches numpy); another value is refused before anything loads, naming the
    variable and its values."""
    code = ("import numpy as np, jax.numpy as jnp; from jaxspec.kernels import cpu_matmul as c; "
            "x, w = np.ones((3, 5), np.float32), np.arange(35, dtype=np.float32).reshape(5, 7); "
            "assert np.allclose(np.asarray(c.matmul_panels(jnp.asarray(x), [c.pack_panels(jnp.asarray(w))], [7])[0]), x @ w); "
            "print(c.describe())")
    env = dict(os.environ, JAXSPEC_CPU_KERNEL="1", JAXSPEC_CPU_ISA="portable", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "jaxspec cpu kernel (portable)"
    env["JAXSPEC_CPU_ISA"] = "sse"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "JAXSPEC_CPU_ISA must be one of portable, avx2, avx512 (or unset), got 'sse'" in out.stderr


def test_default_is_on_for_both_dtypes(monkeypatch):
    """Unset: the kernel takes float32 and bfloat16 weights (measured: SmolLM2's float32 1-token
    pass a little faster, its 2-5-token verify passes much cheaper, bfloat16 several times
    faster than with XLA's dot); ``0`` switches it off; another value is refused naming the
    variable and its values."""
    monkeypatch.delenv(cpu_matmul.ENV_SWITCH)
    assert cpu_matmul.mode() == "on" and cpu_matmul.active()
    assert cpu_matmul.describe() in [f"jaxspec cpu kernel ({path})" for path in cpu_matmul.ISAS]
    x, w = _operands(13, 37, 3, jnp.float32)
    assert linear_mod.kernel_applies(jnp.asarray(x), w) and linear_mod.kernel_applies(jnp.asarray(x), w.astype(jnp.bfloat16))
    monkeypatch.setenv(cpu_matmul.ENV_SWITCH, "0")
    assert cpu_matmul.mode() == "off" and not cpu_matmul.active()
    assert not linear_mod.kernel_applies(jnp.asarray(x), w)
    monkeypatch.setenv(cpu_matmul.ENV_SWITCH, "auto")
    with pytest.raises(ValueError, match="JAXSPEC_CPU_KERNEL must be 1 or 0, got 'auto'"):
        cpu_matmul.mode()


def test_disabled_turns_off_one_part_and_keys_the_program(tiny):
    """``cpu_matmul.disabled(part)``: inside, that part takes XLA's ops and the other keeps its
    kernel; ``generate`` compiles another program for it (``Program.kernels``), which gives the
    same greedy tokens; an unknown part is refused naming the parts."""
    q, k, v, seen, _ = _attention_operands(jnp.float32)
    x, w = _operands(13, 37, 3, jnp.float32)
    assert cpu_matmul.active_parts() == cpu_matmul.PARTS and attention_mod.kernel_applies(q, k, v, None)
    with cpu_matmul.disabled("attention"):
        assert cpu_matmul.active_parts() == ("matmul", "panels")
        assert not attention_mod.kernel_applies(q, k, v, None) and linear_mod.kernel_applies(jnp.asarray(x), w)
        off = tiny.generate(tiny.prompts[:1], "ngram", gamma=4, max_new_tokens=8)
    with cpu_matmul.disabled():
        assert cpu_matmul.active_parts() == ()
    assert cpu_matmul.active_parts() == cpu_matmul.PARTS
    on = tiny.generate(tiny.prompts[:1], "ngram", gamma=4, max_new_tokens=8)
    assert on.metrics.compile_s > 0 and off.tokens == on.tokens
    with pytest.raises(ValueError, match=r"parts must be among \('matmul', 'attention', 'panels'\), got \['rope'\]"):
        with cpu_matmul.disabled("rope"):
            pass
