"""The one place that decides how a weight product runs: ``linear(x, w)`` is ``x @ w``, on
CPU through jaxspec's small-T kernel (``jaxspec.kernels.cpu_matmul``, ``docs/cpu_kernel.md``)
when it applies, elsewhere (TPU, GPU) XLA's dot unchanged.

Why: on XLA:CPU a 1-row product goes to a GEMV and a 2+-row one to a different GEMM fusion that
reads weights about half as fast and rounds differently, so a T-token verify pass cost about
twice a 1-token pass and its logits were not bitwise those of 1-token passes. The kernel reads
the weights once for any T <= ``MAX_ROWS`` and sums every output in the same order whatever T.

The kernel path is taken when the kernel is active (``cpu_matmul.active``: switch
``JAXSPEC_CPU_KERNEL`` unset or ``1``, not ``0``; library built and self-checked; not inside
``cpu_matmul.disabled()``), the flattened rows
(product of x's leading dims) are 1..``MAX_ROWS``, x is float32 or bfloat16, and w is a 2-D
float32 or bfloat16 matrix; otherwise XLA's dot. On that path x is widened to float32, the
sums are float32, and the result is rounded once to the output dtype (float32 for float32
activations; bfloat16 for a bfloat16 model's bfloat16 activations), the same for a 1-token and
a T-token pass. Gradients: a ``jax.custom_vjp`` whose backward pass is plain dots.

A weight may also come as ``layout.Panels`` (the same matrix laid out in panels of 16 output
columns, ``jaxspec.models.layout``): on the kernel path it takes the panel kernel
(``cpu_matmul.matmul_panels``), which keeps a register tile of outputs for every row of a verify
window, and a prefill of up to ``CHUNKED_ROWS`` rows too, ``MAX_ROWS`` rows per call; elsewhere
XLA's dot over the panels. Its gradient comes back as panels too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxspec.kernels import cpu_matmul
from jaxspec.models.layout import PANEL, Panels

MAX_ROWS = cpu_matmul.MAX_ROWS
# Rows up to which a product over ``layout.Panels`` takes the panel kernel, MAX_ROWS rows per
# call (a prefill): XLA's dot cannot read panels in place, so its path first copies every weight
# back to a [K, N] matrix, about 165 ms per SmolLM2-135M pass whatever the prompt's length, then
# computes faster per row. Measured (whole prefills of SmolLM2-135M, 2-core AMD EPYC with
# AVX-512): 100 tokens 99 ms vs 197 (float32), 131 vs 243 (bfloat16); 400 tokens 359 vs 414 and
# 400 vs 466; 1000 tokens 1009 vs 948 and 1086 vs 1018: the two cross near 690 rows.
CHUNKED_ROWS = 640


def _xla(x, w, transposed, out_dtype):
    spec = "...k,nk->...n" if transposed else "...k,kn->...n"
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _products(x, ws, transposed, out_dtype):
    """``[x @ w for w in ws]`` (one weight when ``transposed``): the kernel on CPU, XLA elsewhere."""

    def cpu(x, *ws):
        x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        ys = [cpu_matmul.matmul_nk(x2, ws[0])] if transposed else cpu_matmul.matmul_kn_many(x2, ws)
        return tuple(y.reshape(*x.shape[:-1], y.shape[-1]).astype(out_dtype) for y in ys)

    def default(x, *ws):
        return tuple(_xla(x, w, transposed, out_dtype) for w in ws)

    return jax.lax.platform_dependent(x, *ws, cpu=cpu, default=default)


def _products_fwd(x, ws, transposed, out_dtype):
    return _products(x, ws, transposed, out_dtype), (x, ws)


def _products_bwd(transposed, out_dtype, res, gs):
    x, ws = res
    dx, dws = jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), []
    for w, g in zip(ws, gs):
        g = g.astype(jnp.promote_types(x.dtype, w.dtype))
        if transposed:  # y = x @ w.T, w [N, K]
            dx = dx + jnp.einsum("...n,nk->...k", g, w.astype(g.dtype))
            dws.append(jnp.einsum("...n,...k->nk", g, x.astype(g.dtype)).astype(w.dtype))
        else:  # y = x @ w, w [K, N]
            dx = dx + jnp.einsum("...n,kn->...k", g, w.astype(g.dtype))
            dws.append(jnp.einsum("...k,...n->kn", x.astype(g.dtype), g).astype(w.dtype))
    return dx.astype(x.dtype), tuple(dws)


_products.defvjp(_products_fwd, _products_bwd)


def _xla_panels(x, data, n, out_dtype):
    """``x @ w`` for ``w`` given as its panels ``data [P, K, 16]``, with XLA's dot."""
    y = jnp.einsum("...k,pkc->...pc", x, data, preferred_element_type=out_dtype)
    return y.reshape(*y.shape[:-2], -1)[..., :n].astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _panel_products(x, datas, ns, out_dtype):
    """``[x @ w for w in ws]``, each ``w`` given as its panels (``datas``) and width (``ns``):
    the panel kernel on CPU, XLA's dot elsewhere."""

    def cpu(x, *datas):
        # x and y as they are where the kernel takes them (float32, bfloat16): no convert ops
        x2 = x.reshape(-1, x.shape[-1])
        kernel_dtype = out_dtype if out_dtype in cpu_matmul.DTYPES else jnp.dtype(jnp.float32)
        # more rows than a call takes (a prefill): one call per MAX_ROWS rows, each streaming the
        # weights again (CHUNKED_ROWS says why not XLA's dot over the panels)
        parts = [cpu_matmul.matmul_panels(x2[i : i + MAX_ROWS], datas, ns, kernel_dtype)
                 for i in range(0, x2.shape[0], MAX_ROWS)]
        ys = [p[0] if len(parts) == 1 else jnp.concatenate(p) for p in zip(*parts)]
        return tuple(y.reshape(*x.shape[:-1], n).astype(out_dtype) for y, n in zip(ys, ns))

    def default(x, *datas):
        return tuple(_xla_panels(x, d, n, out_dtype) for d, n in zip(datas, ns))

    return jax.lax.platform_dependent(x, *datas, cpu=cpu, default=default)


def _panel_products_fwd(x, datas, ns, out_dtype):
    return _panel_products(x, datas, ns, out_dtype), (x, datas)


def _panel_products_bwd(ns, out_dtype, res, gs):
    x, datas = res
    dx, dds = jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), []
    for d, n, g in zip(datas, ns, gs):
        g = g.astype(jnp.promote_types(x.dtype, d.dtype))
        pad = [(0, 0)] * (g.ndim - 1) + [(0, d.shape[0] * PANEL - n)]
        gp = jnp.pad(g, pad).reshape(*g.shape[:-1], d.shape[0], PANEL)
        dx = dx + jnp.einsum("...pc,pkc->...k", gp, d.astype(g.dtype))
        dds.append(jnp.einsum("...k,...pc->pkc", x.astype(g.dtype), gp).astype(d.dtype))
    return dx.astype(x.dtype), tuple(dds)


_panel_products.defvjp(_panel_products_fwd, _panel_products_bwd)


def _check_chain(x, w, transposed):
    """Panels must agree with ``transposed`` (a table stored transposed is read as one) and
    chain with x (plain arrays: ``jnp.einsum`` checks)."""
    if transposed != w.transposed:
        raise ValueError(f"linear(transposed={transposed}) got Panels of a {'[N, K]' if w.transposed else '[K, N]'} "
                         f"matrix (Panels.transposed={w.transposed})")
    if x.shape[-1] != w.data.shape[-2]:
        raise ValueError(f"linear: x's last axis is {x.shape[-1]} but the weight is {w.shape}"
                         f" ({'N, K' if w.transposed else 'K, N'})")


def kernel_applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``linear(x, w)`` may take the CPU kernel (on a CPU device): enabled, 2-D w,
    float32/bfloat16 operands, 1..``MAX_ROWS`` flattened rows, or up to ``CHUNKED_ROWS`` when w
    is ``layout.Panels`` (taken ``MAX_ROWS`` rows per call)."""
    rows = math.prod(x.shape[:-1])
    most = CHUNKED_ROWS if isinstance(w, Panels) else MAX_ROWS
    return (w.ndim == 2 and x.ndim >= 1 and 1 <= rows <= most and jnp.dtype(x.dtype) in cpu_matmul.DTYPES
            and jnp.dtype(w.dtype) in cpu_matmul.DTYPES and cpu_matmul.active())


def linear(x: jax.Array, w: jax.Array, *, transposed: bool = False, out_dtype=None) -> jax.Array:
    """``x @ w``: ``x [..., K]`` by ``w [K, N]`` (jaxspec's ``[in, out]`` params layout), or with
    ``transposed`` by ``w [N, K]`` (``x @ w.T``: a tied embedding table as the output head).

    Args:
      x: ``[..., K]`` activations, any float dtype.
      w: ``[K, N]`` (or ``[N, K]`` with ``transposed``) weights, as an array or as
        ``layout.Panels`` (with ``transposed``, Panels stored transposed: a tied embedding table).
      transposed: contract w's minor axis instead of its major one.
      out_dtype: the result dtype (default: ``jnp.result_type(x, w)``), also the dot's
        accumulation type on the XLA path (``preferred_element_type``).

    Returns:
      ``[..., N]`` of ``out_dtype``. On CPU with the kernel (see the module docstring) the sums
      are float32 in a fixed order per output, so each row is bitwise the same whatever the
      number of rows; elsewhere exactly ``jnp.einsum(..., preferred_element_type=out_dtype)``.

    Raises:
      TypeError / ValueError: the shapes do not chain (from ``jnp.einsum`` for arrays);
        ``Panels`` whose ``transposed`` is not ``transposed``.
    """
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x.dtype, w.dtype))
    if isinstance(w, Panels):
        _check_chain(x, w, transposed)
        if kernel_applies(x, w):
            return _panel_products(x, (w.data,), (w.n,), out_dtype)[0]
        return _xla_panels(x, w.data, w.n, out_dtype)
    k_axis = 1 if transposed else 0
    if w.ndim != 2 or x.shape[-1] != w.shape[k_axis] or not kernel_applies(x, w):
        return _xla(x, w, transposed, out_dtype)
    return _products(x, (w,), transposed, out_dtype)[0]


def linears(x: jax.Array, ws, *, out_dtype=None) -> tuple[jax.Array, ...]:
    """``tuple(linear(x, w) for w in ws)``, computed together: the products that share their
    input (a layer's q/k/v projections, the MLP's gate and up) go to the CPU kernel as one call,
    so its threads split one larger piece of work (fewer, larger parallel regions per pass).
    Each result is bitwise what ``linear(x, w, out_dtype=...)`` gives.

    Args:
      x: ``[..., K]`` activations.
      ws: a sequence of ``[K, N_i]`` weights (arrays or ``layout.Panels``).
      out_dtype: as in ``linear`` (default: ``jnp.result_type(x, w)`` per weight).

    Returns:
      A tuple of ``[..., N_i]`` arrays, one per weight.

    Raises:
      TypeError / ValueError: from ``jnp.einsum`` when the shapes do not chain.
    """
    ws = tuple(ws)
    dtypes = [jnp.dtype(out_dtype or jnp.result_type(x.dtype, w.dtype)) for w in ws]
    panels = [isinstance(w, Panels) for w in ws]
    together = (len(set(dtypes)) == 1 and len(set(panels)) == 1
                and all(w.ndim == 2 and x.shape[-1] == w.shape[0] for w in ws)
                and all(kernel_applies(x, w) for w in ws))
    if not together:
        return tuple(linear(x, w, out_dtype=d) for w, d in zip(ws, dtypes))
    if panels[0]:
        return _panel_products(x, tuple(w.data for w in ws), tuple(w.n for w in ws), dtypes[0])
    return _products(x, ws, False, dtypes[0])
