"""The model: a params pytree plus a frozen ``ModelConfig``. ``decoder`` is the one decoder
(Llama, Mistral, Qwen2/3, SmolLM2 and Gemma 3 through config switches), ``rope`` its position
encoding. Everything outside this package reaches the decoder through the names below, and
``forward`` is the one interface for prefill, decode, verification and drafting.

The engine reads its target through the ``TargetModel`` protocol (``target``): jaxspec's
decoder (``Decoder``), or a model of your own (``MaskedTarget``; a flax.nnx module through
``jaxspec.models.nnx.NnxTarget``)."""

from jaxspec.models.decoder import (
    ForwardOutput, TreeMask, forward, init_params, logits_from_hidden, param_shapes,
)
from jaxspec.models.target import Decoder, MaskedTarget, TargetModel, as_target

__all__ = ["Decoder", "ForwardOutput", "MaskedTarget", "TargetModel", "TreeMask", "as_target", "forward",
           "init_params", "logits_from_hidden", "param_shapes"]
