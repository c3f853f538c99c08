"""Model families. A model is a params pytree plus a frozen ``ModelConfig``; ``llama`` is the one
decoder (Llama, Mistral, Qwen2/3, SmolLM2 and Gemma 3 through config switches), ``rope`` its
position encoding."""

from jaxspec.models.llama import forward, forward_hidden, init_params, logits_from_hidden

__all__ = ["forward", "forward_hidden", "init_params", "logits_from_hidden"]
