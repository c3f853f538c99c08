"""``verify``: jaxspec's logits against Hugging Face transformers' on fixed prompts.

The reference is transformers reading the same source: an HF directory
(``AutoModelForCausalLM.from_pretrained``), a GGUF file (``gguf_file=``; transformers
dequantizes and un-permutes with its own code), or, for an orbax checkpoint, the source it was
converted from (recorded in its ``jaxspec.json``). Both run in float32 on the same token ids.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from jaxspec.checkpoints import orbax_io
from jaxspec.checkpoints.loading import checkpoint_kind, resolve

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model draft tokens.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Paris is the capital of France, and Berlin is the capital of",
]


def reference_source(path: str) -> tuple[str, str]:
    """``(kind, path)`` transformers should read for ``path`` (an orbax dir maps to its source)."""
    kind = checkpoint_kind(path)
    if kind != "orbax":
        return kind, path
    src = orbax_io.read_manifest(path).get("source")
    if not src or not os.path.exists(src):
        raise ValueError(f"{path!r}: its source checkpoint ({src!r}) is not available, and transformers cannot read "
                         f"orbax; verify the source, or convert again from an existing file")
    return checkpoint_kind(src), src


def transformers_logits(kind: str, path: str, ids: list[list[int]]) -> list[np.ndarray]:
    """float32 logits ``[T, V]`` per prompt from transformers (needs torch + transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind == "gguf":
        with tempfile.TemporaryDirectory() as d:  # from_pretrained wants the file inside a directory
            os.symlink(os.path.abspath(path), os.path.join(d, os.path.basename(path)))
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=os.path.basename(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([row])).logits[0].float().numpy() for row in ids]


def jaxspec_logits(model, ids: list[list[int]]) -> list[np.ndarray]:
    """float32 logits ``[T, V]`` per prompt from jaxspec (one full forward each)."""
    import jax.numpy as jnp

    from jaxspec.cache import KVCache
    from jaxspec import models

    out = []
    for row in ids:
        t = len(row)
        cache = KVCache.zeros(model.config, 1, t, jnp.float32)
        logits = models.forward(model.params, model.config, jnp.asarray([row], jnp.int32),
                                jnp.arange(t, dtype=jnp.int32)[None], cache).logits
        out.append(np.asarray(logits[0]))
    return out


def prompt_ids(model, n_random: int = 24) -> list[list[int]]:
    """Token ids of ``PROMPTS`` (BOS first when the model has one), or fixed random ids (seed 0)
    when the checkpoint has no tokenizer."""
    if model.tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, model.config.vocab_size, n_random).tolist() for _ in PROMPTS]
    bos = [model.config.bos_id] if model.config.bos_id >= 0 else []
    return [bos + model.tokenizer.encode(p, add_bos=False) for p in PROMPTS]


def verify(name_or_path: str) -> dict:
    """Compare logits; returns ``max_abs``, ``max_rel`` (max |diff| / max |reference logit|),
    ``argmax_agreement`` (fraction of positions), ``n_tokens``, and the reference path."""
    import jax.numpy as jnp

    import jaxspec

    path = resolve(name_or_path)
    model = jaxspec.load(path, dtype=jnp.float32)
    ids = prompt_ids(model)
    ref_kind, ref_path = reference_source(path)
    ours, ref = jaxspec_logits(model, ids), transformers_logits(ref_kind, ref_path, ids)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours, ref))
    scale = max(float(np.abs(b).max()) for b in ref)
    agree = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(ours, ref)])
    return {"max_abs": diff, "max_rel": diff / scale, "argmax_agreement": float(agree.mean()),
            "n_tokens": int(agree.size), "reference": f"transformers ({ref_kind}: {ref_path})"}
