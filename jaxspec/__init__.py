"""jaxspec: JAX-native speculative decoding.

    import jaxspec
    model = jaxspec.load("smollm2-135m")
    out = jaxspec.generate(model, "Hello", drafter=jaxspec.NGramDrafter(gamma=4))
    print(out.text, out.metrics.tau)

Shape letters, the same in every module's names, docstrings and einsum strings:
B batch, T new tokens, S cache slots, P padded prompt length, N draft-tree nodes,
W = N + 1 verify-window entries (root + nodes), D model width, H query heads, K KV heads,
h head dim, F MLP width, V vocabulary, E stop ids; stop strings (``jaxspec.stopping``): Z strings,
Y bytes of the longest, M bytes of the longest token, L = Y + M bytes of tail per row;
structured output (``jaxspec.grammar``): G automaton states, C token classes.
"""

from jaxspec import compile_cache  # jaxspec.compile_cache.enable(); imports only os, configures nothing
from jaxspec.api import Model, default_dtype, generate, load
from jaxspec.checkpoints.heads import load_eagle_head, load_medusa_heads, shipped_head
from jaxspec.checkpoints.pairing import check_pair
from jaxspec.config import ModelConfig, SamplingConfig
from jaxspec.drafters import (EagleDrafter, EarlyExitDrafter, GrammarDrafter, HistoryDrafter, HybridDrafter,
                              LookaheadDrafter, MedusaDrafter, ModelDrafter, NGramDrafter, RepeatDrafter)
from jaxspec.metrics import Metrics
from jaxspec.result import GenerationResult
from jaxspec.rollouts import RolloutHistory
from jaxspec.sharding import make_mesh, shard_params
from jaxspec.synthetic import SyntheticAcceptance

__all__ = [
    "EagleDrafter",
    "EarlyExitDrafter",
    "GenerationResult",
    "GrammarDrafter",
    "HistoryDrafter",
    "HybridDrafter",
    "LookaheadDrafter",
    "MedusaDrafter",
    "Metrics",
    "Model",
    "check_pair",
    "ModelConfig",
    "ModelDrafter",
    "NGramDrafter",
    "RepeatDrafter",
    "RolloutHistory",
    "SamplingConfig",
    "SyntheticAcceptance",
    "default_dtype",
    "generate",
    "load",
    "load_eagle_head",
    "load_medusa_heads",
    "make_mesh",
    "shard_params",
    "shipped_head",
]
__version__ = "0.1.0"
