"""A persistent XLA compilation cache, so a second process reuses the first one's programs.

Compiling the generation program is the slowest part of a short run on CPU (seconds to tens
of seconds per program); jax can store compiled executables on disk and load them in a later
process (the "persistent compilation cache", jax's ``jax_compilation_cache_dir`` option). The
CLI turns it on by default; library code calls :func:`enable` itself.

Directory: ``$JAXSPEC_CACHE/xla``, else ``~/.cache/jaxspec/xla`` (beside the assembled
GGUFs of ``jaxspec.checkpoints.packaged``). Off switch: ``JAXSPEC_COMPILE_CACHE=0`` (also
``off``, ``false``, ``no``) in the environment, or ``jaxspec generate --no-compile-cache``.

As jax warns, the cache is trusted: anyone who can write to the directory can make the process
run code, so it is created private (mode 0700); do not point it at a shared, writable folder.
"""

from __future__ import annotations

import os

__all__ = ["DISABLE_ENV", "MIN_COMPILE_TIME_S", "MIN_ENTRY_SIZE_BYTES", "default_dir", "enable", "hits"]

DISABLE_ENV = "JAXSPEC_COMPILE_CACHE"
# jax's own defaults (jax 0.10: jax_persistent_cache_min_compile_time_secs = 1.0,
# jax_persistent_cache_min_entry_size_bytes = 0). Programs that compile in under a second
# (the small helper jits around generate) are not worth a file; every generation program is.
MIN_COMPILE_TIME_S = 1.0
MIN_ENTRY_SIZE_BYTES = 0
HIT_EVENT = "/jax/compilation_cache/cache_hits"

_hits = 0
_listening = False


def default_dir() -> str:
    """``$JAXSPEC_CACHE/xla`` or ``~/.cache/jaxspec/xla``."""
    from jaxspec.checkpoints.packaged import cache_dir

    return os.path.join(cache_dir(), "xla")


def disabled_by_env() -> bool:
    """True when ``$JAXSPEC_COMPILE_CACHE`` is ``0``, ``off``, ``false`` or ``no``."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "off", "false", "no")


def _count(event: str, **_) -> None:
    global _hits
    if event == HIT_EVENT:
        _hits += 1


def hits() -> int:
    """Programs this process loaded from the persistent cache instead of compiling (counted
    from jax's ``/jax/compilation_cache/cache_hits`` monitoring event since :func:`enable`)."""
    return _hits


def enable(path: str | None = None, *, min_compile_time_s: float = MIN_COMPILE_TIME_S,
           min_entry_size_bytes: int = MIN_ENTRY_SIZE_BYTES) -> str | None:
    """Turn on jax's persistent compilation cache for this process.

    Call it before the first compile: jax opens the directory once per process.

    Args:
      path: cache directory (created, mode 0700); default :func:`default_dir`.
      min_compile_time_s: programs that compiled faster than this (seconds) are not stored.
      min_entry_size_bytes: programs whose serialized executable is smaller are not stored.

    Returns:
      The directory in use, or None when ``$JAXSPEC_COMPILE_CACHE`` switches the cache off
      (then nothing is configured and nothing is written).
    """
    global _listening
    if disabled_by_env():
        return None
    import jax

    path = os.path.abspath(path or default_dir())
    os.makedirs(path, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    if not _listening:
        jax.monitoring.register_event_listener(_count)
        _listening = True
    return path
