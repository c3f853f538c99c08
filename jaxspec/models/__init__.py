"""The model: a params pytree plus a frozen ``ModelConfig``. ``decoder`` is the one decoder
(Llama, Mistral, Qwen2/3, SmolLM2 and Gemma 3 through config switches), ``rope`` its position
encoding. Everything outside this package reaches the decoder through the names below, and
``forward`` is the one interface for prefill, decode, verification and drafting."""

from jaxspec.models.decoder import (
    ForwardOutput, TreeMask, forward, init_params, logits_from_hidden, param_shapes,
)

__all__ = ["ForwardOutput", "TreeMask", "forward", "init_params", "logits_from_hidden", "param_shapes"]
