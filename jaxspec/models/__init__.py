"""Model families. A model is a params pytree plus a frozen ``ModelConfig``; see ``llama``."""

from jaxspec.models.llama import forward, forward_hidden, init_params, logits_from_hidden

__all__ = ["forward", "forward_hidden", "init_params", "logits_from_hidden"]
