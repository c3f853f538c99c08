"""Loader of the CPU small-T matmul kernel (``cpu_matmul.cc``, built by ``pip install -e .``
into ``jaxspec/kernels/_cpu_matmul<EXT_SUFFIX>``) and its XLA FFI targets:

* ``matmul_kn(x, w)``: ``x [T, K] float32 @ w [K, N]`` (float32 or bfloat16) -> ``[T, N]`` float32,
  and ``matmul_kn_many(x, ws)``: several such products sharing x in one call;
* ``matmul_nk(x, e)``: ``x [T, K] float32 @ e [N, K]^T`` -> ``[T, N]`` float32 (a tied
  embedding table as the output head);
* ``matmul_panels(x, ps, ns)``: the products of several weights laid out in panels
  (``pack_panels``, ``cpu_panels.cc``; ``jaxspec.models.layout.Panels``);

and the attention and RoPE targets (``cpu_attention.cc``, called by ``jaxspec.kernels.cpu_attention``).

The library is a plain shared object loaded with ``ctypes`` and registered with
``jax.ffi.register_ffi_target`` (the typed XLA FFI needs no Python binding, so no pybind or
nanobind build dependency). ``enabled()`` loads it once, on first use.

``JAXSPEC_CPU_KERNEL`` switches it (``mode``): unset or ``1`` (the default) on, for float32
and bfloat16 weights; ``0`` off (XLA's dot everywhere, for an A/B). Measured
(``docs/cpu_kernel.md``): SmolLM2-135M's float32 1-token pass is a little faster than with
XLA's dot and a 2- to 5-token verify pass much cheaper; with bfloat16 weights XLA:CPU's dot first
widens W to float32, and the pass takes several times longer than with the kernel. Where it runs, a
verify window's products are bitwise those of 1-token passes. When switched on, it stays off
when the library is missing, fails to load or register, or gives a wrong 3x5x7 product against
numpy (e.g. built against another jaxlib), in which case it warns once (the fix: reinstall with
``pip install -e .``) and callers use XLA's dot.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sysconfig
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

ENV_SWITCH = "JAXSPEC_CPU_KERNEL"
# Caps the kernels' code path for the process (``ISAS``: ``avx2`` on a CPU whose AVX-512 clocks
# down, ``portable``); unset: the widest the CPU has.
ENV_ISA = "JAXSPEC_CPU_ISA"
# Rows (tokens, flattened over the batch for weight products) one kernel call takes, and so up to
# which a product over plain matrices takes the kernel and a token's logits are the same bits in a
# 1-token pass and in a verify window (a batch of 4 rows verifying 9-token windows is 36 rows);
# wider passes over plain matrices take XLA's own ops, which are not row-invariant (over panels,
# the decoder's CPU layout, ``linear`` calls the kernel MAX_ROWS rows at a time up to
# ``linear.CHUNKED_ROWS``). The price at the top of the
# range, measured at SmolLM2's MLP shape (``python -m benchmarks.bench_small_matmul --k 576
# --n 1536 --widths 1,16,32,64``, 2-core AMD EPYC): float32 T=32 0.74 ms vs XLA's 0.88, T=64
# 1.46 vs 1.21; bfloat16 weights T=64 2.11 vs XLA's 1.57.
MAX_ROWS = 64
# The operand dtypes the kernels take (products, attention, RoPE); others take XLA's ops.
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "_cpu_matmul" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
_TARGETS = {"kn": "jaxspec_cpu_matmul_kn", "nk": "jaxspec_cpu_matmul_nk", "panels": "jaxspec_cpu_matmul_panels",
            "attention": "jaxspec_cpu_attention", "rope": "jaxspec_cpu_rope"}
_state: dict = {}
_local = threading.local()


def _load(path: str) -> tuple[bool, str]:
    """Load and register the library at ``path``; ``(True, isa)`` or ``(False, reason)``."""
    if not os.path.exists(path):
        return False, f"the CPU matmul kernel is not built ({path} is missing)"
    try:
        lib = ctypes.CDLL(path)
        symbols = (("kn", lib.JaxspecMatmulKN), ("nk", lib.JaxspecMatmulNK), ("panels", lib.JaxspecMatmulPanels),
                   ("attention", lib.JaxspecAttention), ("rope", lib.JaxspecRope))
        for name, symbol in symbols:
            jax.ffi.register_ffi_target(_TARGETS[name], jax.ffi.pycapsule(symbol), platform="cpu")
        cap = isa_from_env()
        if cap is not None:
            lib.jaxspec_set_isa(ISAS.index(cap))
        isa = ISAS[lib.jaxspec_matmul_isa()]
        _state["lib"] = lib
    except (OSError, AttributeError, RuntimeError, ValueError, TypeError) as exc:
        return False, f"the CPU matmul kernel failed to load ({type(exc).__name__}: {exc})"
    return True, isa


def _self_check() -> str | None:
    """A 3x5x7 product of each target against numpy, on the CPU device; None or what failed."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 5), np.float32), rng.standard_normal((5, 7), np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    try:
        cpu = jax.devices("cpu")[0]
        with jax.ensure_compile_time_eval(), jax.default_device(cpu):
            got_kn = np.asarray(jax.jit(matmul_kn)(jnp.asarray(x), jnp.asarray(w)))
            got_nk = np.asarray(jax.jit(matmul_nk)(jnp.asarray(x), jnp.asarray(np.ascontiguousarray(w.T))))
    except Exception as exc:  # noqa: BLE001 - any failure here means: use XLA's dot
        return f"{type(exc).__name__}: {exc}"
    for name, got in (("kn", got_kn), ("nk", got_nk)):
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            return f"the {name} product differs from numpy's"
    return None


def isa_from_env() -> str | None:
    """The cap ``JAXSPEC_CPU_ISA`` sets (one of ``ISAS``), or None when it is unset or empty.

    Raises:
      ValueError: any other value, naming the variable and the values it takes.
    """
    v = os.environ.get(ENV_ISA, "").strip().lower()
    if v and v not in ISAS:
        raise ValueError(f"{ENV_ISA} must be one of {', '.join(ISAS)} (or unset), got {v!r}")
    return v or None


def mode() -> str:
    """``"on"`` (``JAXSPEC_CPU_KERNEL`` unset or ``1``) or ``"off"`` (``0``).

    Raises:
      ValueError: any other value, naming the variable and the values it takes.
    """
    v = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if v not in ("1", "0"):
        raise ValueError(f"{ENV_SWITCH} must be 1 or 0, got {v!r}")
    return {"1": "on", "0": "off"}[v]


def enabled(path: str | None = None) -> bool:
    """Whether the kernel can run: switch not ``0``, library loaded, self-check passed. Decided
    once per process (``path`` overrides ``LIBRARY_PATH`` for that first decision); warns once
    when the switch allows it but the kernel cannot run."""
    if "on" not in _state:
        isa_from_env()  # a bad value is an error before anything loads
        _state["on"] = False
        if mode() == "off":
            _state["why"] = f"{ENV_SWITCH}=0"
            return False
        ok, info = _load(path or LIBRARY_PATH)
        if ok:
            _state["on"] = True  # the self-check calls matmul_kn, which asks enabled()
            failed = _self_check()
            if failed:
                ok, info = False, f"the CPU matmul kernel failed its self-check ({failed})"
        if not ok:
            _state["on"], _state["why"] = False, info
            warnings.warn(f"{info}; using XLA's dot on CPU. Reinstall with `pip install -e .` to build it.",
                          RuntimeWarning, stacklevel=2)
    return _state["on"]


# What the kernels replace, each a part ``disabled`` can turn off on its own: the weight products
# (``jaxspec.models.linear``), the attention with RoPE (``jaxspec.models.attention``,
# ``jaxspec.models.rope``), and the panel layout ``generate`` gives a params tree of plain
# matrices (``jaxspec.models.layout.for_run``; off: the products run over the matrices as given).
PARTS = ("matmul", "attention", "panels")


@contextlib.contextmanager
def disabled(*parts: str):
    """Within this block, functions traced take XLA's ops for ``parts`` (default: every part of
    ``PARTS``; the models ask ``active(part)`` at trace time): an A/B of both paths in one
    process, as the benchmarks run it. Programs compiled inside keep XLA's ops after the block.

    Raises:
      ValueError: a part not in ``PARTS``.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"parts must be among {PARTS}, got {unknown}")
    before = getattr(_local, "off", frozenset())
    _local.off = before | frozenset(parts or PARTS)
    try:
        yield
    finally:
        _local.off = before


def active(part: str = "matmul") -> bool:
    """Whether ``part`` (of ``PARTS``) traced now takes its kernel: not inside a ``disabled()``
    of it, switched on (``mode``) and ``enabled()``."""
    if part in getattr(_local, "off", frozenset()) or mode() == "off":
        return False
    return enabled()


def active_parts() -> tuple[str, ...]:
    """The parts of ``PARTS`` that take their kernel when traced now (``active``)."""
    return tuple(p for p in PARTS if active(p))


def describe() -> str:
    """Which path weight products take on CPU: ``"jaxspec cpu kernel (avx512)"`` (or
    ``(avx2)``, ``(portable)``), or ``"XLA dot"`` with the reason."""
    if enabled():
        return f"jaxspec cpu kernel ({isa()})"
    return f"XLA dot ({_state['why']})"


# The kernels' code paths, by what the library's run-time choice returns: the widest the CPU has
# (``avx512``: AVX-512F; ``avx2``: AVX2 with FMA), unless ``JAXSPEC_CPU_ISA`` or ``limit_isa``
# caps it (a cap above what the CPU has changes nothing).
ISAS = ("portable", "avx2", "avx512")


def isa() -> str | None:
    """The code path the kernels take now (one of ``ISAS``), or None when the kernel is off."""
    if not enabled():
        return None
    return ISAS[_state["lib"].jaxspec_matmul_isa()]


@contextlib.contextmanager
def limit_isa(name: str):
    """Within this block (or a function decorated with it), the kernels take at most the
    ``name`` code path (of ``ISAS``): decided at each kernel call, so one compiled program runs
    both paths, e.g. an A/B of the AVX-512 and AVX2 products in one process; results must be
    waited for inside it (``block_until_ready``): dispatch is asynchronous. The AVX-512 and AVX2 products are bitwise equal (each output the
    same float32 FMA chain); the portable path is not (its products are unfused). Process-wide:
    not for use while another thread runs kernels.

    Raises:
      ValueError: ``name`` not in ``ISAS``.
      RuntimeError: the kernel is off (``enabled``).
    """
    if name not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {name!r}")
    if not enabled():
        raise RuntimeError(f"the CPU matmul kernel is off: {describe()}")
    before = _state["lib"].jaxspec_set_isa(ISAS.index(name))
    try:
        yield
    finally:
        _state["lib"].jaxspec_set_isa(before)


# What XLA compiles around the kernels must not depend on the row count either:
# - YNNPACK fusions (jaxlib 0.10) run multi-row dots with a kernel whose order of sums depends on
#   the row count (measured: SmolLM2's logits in an 8-token verify window differed from its
#   1-token passes by up to 4e-5 in float32, 0.02 in bfloat16, and were bitwise equal with these
#   fusions off); with the weight products and the attention on the kernels, turning them off
#   costs nothing measurable (docs/cpu_kernel.md).
# - excess precision: by default XLA may skip rounding a bfloat16 intermediate when it fuses
#   elementwise ops (the MLP's activation times up projection, the norms), so whether a value is
#   rounded depends on how the program around it was fused (measured: the tiny test model's
#   bfloat16 logprobs in a verify window 1e-4 off its 1-token passes; bitwise equal with it off).
_ROW_INVARIANT_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_allow_excess_precision": False}


def compiler_options(backend: str, kernel: bool | None = None) -> dict[str, str | bool]:
    """XLA options for a program jaxspec compiles for ``backend`` (``jax.default_backend()``
    names): on CPU with the kernel (``kernel``; default ``active()``), YNNPACK fusions off and
    every bfloat16 intermediate rounded, so that everything a token's row passes through (weight
    products, attention, norms) sums and rounds the same whatever the window length; otherwise
    none. Pass to
    ``jax.jit(..., compiler_options=...)`` or ``Lowered.compile(compiler_options)``."""
    kernel = active() if kernel is None else kernel
    return dict(_ROW_INVARIANT_OPTIONS) if backend == "cpu" and kernel else {}


def target(kind: str) -> str:
    """The registered FFI target name of ``kind`` (``"kn"``, ``"nk"``, ``"attention"``, ``"rope"``)."""
    return _TARGETS[kind]


def _call(kind: str, x: jax.Array, ws) -> list[jax.Array]:
    if not enabled():
        raise RuntimeError(f"the CPU matmul kernel is off: {describe()}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1] if kind == "kn" else w.shape[0]), jnp.float32) for w in ws]
    return jax.ffi.ffi_call(_TARGETS[kind], outs, vmap_method="sequential")(x, *ws)


def matmul_kn(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [T, K] float32 @ w [K, N]`` (float32 or bfloat16) -> float32 ``[T, N]``, on CPU only;
    each output is one sequential float32 FMA chain over k, so row t is bitwise the same
    whatever T. Raises RuntimeError when the kernel is off (``enabled``)."""
    return _call("kn", x, [w])[0]


def matmul_kn_many(x: jax.Array, ws) -> list[jax.Array]:
    """``[x @ w for w in ws]`` in one call (``x [T, K]`` float32, each ``w [K, N_i]`` float32 or
    bfloat16, -> float32 ``[T, N_i]``): the products that share x (a layer's q/k/v, gate/up),
    so the threads split one larger piece of work. Each result is bitwise ``matmul_kn(x, w)``.
    Raises RuntimeError when the kernel is off (``enabled``)."""
    return _call("kn", x, list(ws))


def matmul_nk(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x [T, K] float32 @ e [N, K]^T`` (float32 or bfloat16) -> float32 ``[T, N]``, on CPU
    only; 8 fixed lane sums over k, a fixed reduction tree, then the K mod 8 tail: row t is
    bitwise the same whatever T. Raises RuntimeError when the kernel is off (``enabled``)."""
    return _call("nk", x, [e])[0]


# Output columns per panel of the panel layout (``cpu_panels.cc``).
PANEL = 16


def pack_panels(w: jax.Array) -> jax.Array:
    """``w [K, N]`` -> its panels ``[ceil(N / 16), K, 16]``, same dtype: ``P[p, k, c] = w[k, 16 p + c]``,
    zero past N. The layout ``matmul_panels`` reads: 16 output columns contiguous along k, so a
    register tile keeps its sums in registers for the whole k loop (``docs/cpu_kernel.md``)."""
    k, n = w.shape
    p = -(-n // PANEL)
    w = jnp.pad(w, ((0, 0), (0, p * PANEL - n)))
    return w.reshape(k, p, PANEL).transpose(1, 0, 2)


def unpack_panels(panels: jax.Array, n: int) -> jax.Array:
    """The inverse of ``pack_panels``: ``[P, K, 16]`` -> ``[K, n]``."""
    p, k, _ = panels.shape
    return panels.transpose(1, 0, 2).reshape(k, p * PANEL)[:, :n]


def result_dtype(dtype) -> jnp.dtype:
    """``dtype`` if the kernels write results in it (``DTYPES``: float32, bfloat16).

    Raises:
      ValueError: any other dtype, naming the two.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {dtype}")
    return dtype


def matmul_panels(x: jax.Array, panels, ns, out_dtype=jnp.float32) -> list[jax.Array]:
    """``[x @ unpack_panels(p, n) for p, n in zip(panels, ns)]`` in one call: ``x [T, K]`` float32
    or bfloat16 (T <= ``MAX_ROWS``), each ``p [ceil(n / 16), K, 16]`` float32 or bfloat16
    (``pack_panels``), -> ``[T, n]`` of ``out_dtype`` (float32, or bfloat16: the float32 sums
    rounded once in the kernel, bitwise ``.astype(jnp.bfloat16)`` of the float32 result). Each
    output is one sequential float32 FMA chain over k, so row t is bitwise the same whatever T.

    Raises:
      RuntimeError: the kernel is off (``enabled``).
      ValueError: ``out_dtype`` is neither float32 nor bfloat16.
    """
    if not enabled():
        raise RuntimeError(f"the CPU matmul kernel is off: {describe()}")
    outs = [jax.ShapeDtypeStruct((x.shape[0], n), result_dtype(out_dtype)) for n in ns]
    return jax.ffi.ffi_call(_TARGETS["panels"], outs, vmap_method="sequential")(x, *panels)
