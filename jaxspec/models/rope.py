"""Rotary position embedding (Su et al. 2021): inverse frequencies, with long-context scaling.

Frequencies are computed once on the host in float32 numpy (they depend only on the static
config), the same way transformers computes them (``ROPE_INIT_FUNCTIONS``), so positions in
the compiled program cost one multiply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig, RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """float32 ``[head_dim / 2]`` inverse frequencies ``theta ** (-2i / head_dim)``, scaled.

    ``linear``: divided by ``factor`` (position interpolation, Chen et al. 2023).
    ``llama3``: Meta's Llama 3.1 band rule (``transformers`` ``_compute_llama3_parameters``):
    long wavelengths divided by ``factor``, short ones kept, a linear blend between.
    """
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if scaling is None:
        return freqs.astype(np.float32)
    if scaling.kind == "linear":
        return (freqs / scaling.factor).astype(np.float32)
    old = scaling.original_max_position
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * np.pi / freqs
    scaled = np.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def layer_inv_freq(config: ModelConfig, layer: int) -> np.ndarray:
    """Inverse frequencies of block ``layer``: sliding layers with their own base
    (``rope_local_theta``, Gemma 3) are unscaled; every other layer uses ``rope_theta`` and
    ``rope_scaling``."""
    if config.is_sliding(layer) and config.rope_local_theta:
        return inv_freq(config.head_dim, config.rope_local_theta)
    return inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


def apply(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """Rotate ``x`` by its positions, "rotate_half" layout (dim ``i`` pairs with ``i + h/2``).

    Args:
      x: ``[B, T, N, h]`` queries or keys.
      positions: int32 ``[B, T]`` absolute positions.
      freqs: float32 ``[h/2]`` from ``inv_freq``.

    Returns:
      ``[B, T, N, h]`` in ``x.dtype`` (computed in float32).
    """
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, h/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
