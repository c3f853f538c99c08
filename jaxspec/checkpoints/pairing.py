"""Draft/target pairing: a separate draft model must share the target's vocabulary and special
tokens, or its drafts would be ids of different strings (still lossless, since the target
verifies every token, but accepted almost never, and silently so).

Compared: vocabulary sizes, BOS id, EOS ids, and, when both sides carry a tokenizer, the
string of every id. Each mismatch is a ``ValueError`` naming both models and both values.
"""

from __future__ import annotations

from jaxspec.config import ModelConfig


def check_configs(target: ModelConfig, draft: ModelConfig) -> None:
    """Vocabulary size, BOS and EOS ids of two configs.

    Raises:
      ValueError: sizes differ (message gives both sizes and names), or BOS / EOS ids differ
        where both models define them.
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft.vocab_size} tokens, {draft.name}) differs from the target's "
            f"({target.vocab_size} tokens, {target.name}); a draft model must share the target's tokenizer"
        )
    if draft.bos_id >= 0 and target.bos_id >= 0 and draft.bos_id != target.bos_id:
        raise ValueError(f"draft model BOS id ({draft.bos_id}, {draft.name}) differs from the target's "
                         f"({target.bos_id}, {target.name}): the tokenizers differ")
    if draft.eos_ids and target.eos_ids and not set(draft.eos_ids) & set(target.eos_ids):
        raise ValueError(f"draft model EOS ids ({list(draft.eos_ids)}, {draft.name}) share none with the target's "
                         f"({list(target.eos_ids)}, {target.name}): the tokenizers differ")


def check_pair(target, draft) -> None:
    """Check that ``draft`` can draft for ``target``.

    Args:
      target, draft: ``jaxspec.Model`` (config + tokenizer) or bare ``ModelConfig``.

    Raises:
      ValueError: see ``check_configs``; or both have tokenizers and some id spells a
        different string (the message gives the first such id and both strings).
    """
    t_cfg, d_cfg = getattr(target, "config", target), getattr(draft, "config", draft)
    check_configs(t_cfg, d_cfg)
    t_tok, d_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if t_tok is None or d_tok is None:
        return
    for i in range(t_cfg.vocab_size):
        a, b = t_tok.id_to_token(i), d_tok.id_to_token(i)
        if a != b:
            raise ValueError(f"draft model token {i} is {b!r} ({d_cfg.name}) but the target's is {a!r} "
                             f"({t_cfg.name}): same vocabulary size ({t_cfg.vocab_size}), different tokenizers")
