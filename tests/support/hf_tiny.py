"""Tiny random checkpoints written by transformers itself, one per family, for loader tests.

Each model is built by transformers from its own config class, its weights redrawn from
N(0, 0.3^2) (norm weights too, so Gemma's ``1 + w`` and every norm is exercised; the default
0.02 init gives near-uniform logits that would hide errors), saved with
``save_pretrained(safe_serialization=True)``, and run by transformers (eager attention,
float32) on ``TOKENS`` to give reference logits. The sequence (20 tokens) is longer than the
sliding windows (5 and 6) so the window masks matter.
"""

from __future__ import annotations

import numpy as np

TOKENS = [3, 17, 42, 5, 9, 60, 1, 33, 28, 11, 47, 2, 19, 55, 7, 38, 24, 61, 13, 50]
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = ["llama", "llama3_scaled", "mistral", "qwen2", "qwen3", "gemma3"]


def hf_config(family: str):
    """The transformers config of one tiny family."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama3_scaled":  # Llama 3.1 RoPE scaling, small original context so every band is hit
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=6)
    if family == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON)
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **COMMON, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=12, final_logit_softcapping=20.0,
            attn_logit_softcapping=3.0,  # transformers' Gemma 3 ignores it; so must we
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}})
    if family == "gemma3_multimodal":  # Gemma3ForConditionalGeneration: a SigLIP tower + the text model
        # final soft-capping off: transformers' Gemma3ForConditionalGeneration does not apply it
        # (only Gemma3ForCausalLM does); real Gemma 3 configs have none.
        text = {**hf_config("gemma3").to_dict(), "final_logit_softcapping": None}
        return tf.Gemma3Config(text_config=text, mm_tokens_per_image=4, vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    raise ValueError(family)


def write_tiny(family: str, path: str, seed: int = 0, max_shard_size: str | None = None) -> np.ndarray:
    """Save a tiny random ``family`` model to ``path``; return transformers' float32 logits
    ``[len(TOKENS), 64]`` on ``TOKENS``. ``max_shard_size`` (e.g. ``"20KB"``) writes shards
    plus ``model.safetensors.index.json``."""
    import torch
    import transformers as tf

    cfg = hf_config(family)
    cfg._attn_implementation = "eager"
    if family == "gemma3_multimodal":
        cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kw)
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float().numpy()
