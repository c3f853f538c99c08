"""Loader of the CPU small-T matmul kernel (``cpu_matmul.cc``, built by ``pip install -e .``
into ``jaxspec/kernels/_cpu_matmul<EXT_SUFFIX>``) and its two XLA FFI targets:

* ``matmul_kn(x, w)``: ``x [T, K] float32 @ w [K, N]`` (float32 or bfloat16) -> ``[T, N]`` float32,
  and ``matmul_kn_many(x, ws)``: several such products sharing x in one call;
* ``matmul_nk(x, e)``: ``x [T, K] float32 @ e [N, K]^T`` -> ``[T, N]`` float32 (a tied
  embedding table as the output head).

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
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "_cpu_matmul" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
_TARGETS = {"kn": "jaxspec_cpu_matmul_kn", "nk": "jaxspec_cpu_matmul_nk"}
_state: dict = {}
_local = threading.local()


def _load(path: str) -> tuple[bool, str]:
    """Load and register the library at ``path``; ``(True, isa)`` or ``(False, reason)``."""
    if not os.path.exists(path):
        return False, f"the CPU matmul kernel is not built ({path} is missing)"
    try:
        lib = ctypes.CDLL(path)
        for name, symbol in (("kn", lib.JaxspecMatmulKN), ("nk", lib.JaxspecMatmulNK)):
            jax.ffi.register_ffi_target(_TARGETS[name], jax.ffi.pycapsule(symbol), platform="cpu")
        isa = "avx2" if lib.jaxspec_matmul_isa() else "portable"
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
        _state["on"], _state["isa"] = False, None
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
        else:
            _state["isa"] = info
    return _state["on"]


@contextlib.contextmanager
def disabled():
    """Within this block, functions traced take XLA's dot (``jaxspec.models.linear`` asks
    ``active()`` at trace time): an A/B of both paths in one process, as the benchmarks run it.
    Programs compiled inside keep XLA's dot after the block."""
    before = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = before


def active() -> bool:
    """Whether a product traced now takes the kernel: not inside ``disabled()``, switched on
    (``mode``) and ``enabled()``."""
    if getattr(_local, "off", False) or mode() == "off":
        return False
    return enabled()


def describe() -> str:
    """Which path weight products take on CPU: ``"jaxspec cpu kernel (avx2)"`` (or
    ``(portable)``), or ``"XLA dot"`` with the reason."""
    if enabled():
        return f"jaxspec cpu kernel ({_state['isa']})"
    return f"XLA dot ({_state['why']})"


# XLA:CPU's YNNPACK fusions (jaxlib 0.10) run the attention's multi-row dots with a kernel whose
# order of sums depends on the row count (measured: SmolLM2's logits in an 8-token verify window
# differed from its 1-token passes by up to 4e-5 in float32, 0.02 in bfloat16, and were bitwise
# equal with these fusions off); with the weight products on the kernel, turning them off
# costs nothing measurable (docs/cpu_kernel.md) and leaves XLA's own dot emitter, which is
# row-invariant at these shapes.
_ROW_INVARIANT_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options(backend: str, kernel: bool | None = None) -> dict[str, str]:
    """XLA options for a program jaxspec compiles for ``backend`` (``jax.default_backend()``
    names): on CPU with the kernel (``kernel``; default ``active()``), YNNPACK fusions off, so
    that everything a token's row passes through (weight products, attention, norms) sums in
    the same order whatever the window length; otherwise none. Pass to
    ``jax.jit(..., compiler_options=...)`` or ``Lowered.compile(compiler_options)``."""
    kernel = active() if kernel is None else kernel
    return dict(_ROW_INVARIANT_OPTIONS) if backend == "cpu" and kernel else {}


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
