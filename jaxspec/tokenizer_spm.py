"""SentencePiece-style BPE backend from a GGUF vocabulary (``tokenizer.ggml.model = "llama"``:
Llama 2, Gemma).

llama.cpp keeps SentencePiece's pieces (a space spelled ``"▁"``, bytes as ``<0xAB>`` tokens) and
their scores but no merges. Encoding with BPE needs merges, so they are rebuilt from the
vocabulary: every token that splits into two vocabulary tokens gives a merge; a merge ranks
by the score of the token it produces (higher first). Gemma's scores are all 0, and its files
list tokens in merge order, so for Gemma the rank is the token's position in the file (the
fix transformers' GGUF loader also applies; ``transformers.integrations.gguf``).
Gemma files also spell tokens made only of spaces with real spaces; they are respelled with
``"▁"`` so that the normalized text can reach them.

Pipeline (that of Hugging Face's ``GemmaTokenizer``): normalizer ``" " -> "▁"``, BPE with byte
fallback over the whole normalized text, decoder ``"▁" -> " "`` + byte fallback + fuse.
"""

from __future__ import annotations

from typing import Sequence

SPACE = "\u2581"


def respell(tokens: Sequence[str]) -> list[str]:
    """Tokens made only of spaces (two or more) spelled with ``"▁"`` instead."""
    return [SPACE * len(t) if t and not t.strip(" ") and len(t) > 1 else t for t in tokens]


def implied_merges(tokens: Sequence[str], scores: Sequence[float] | None, by_position: bool) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary, best first.

    Args:
      tokens: the vocabulary (index = id).
      scores: SentencePiece scores per id (higher merges first), ignored when ``by_position``.
      by_position: rank merges by the produced token's id (lower first) instead of its score.

    Returns:
      ``[(left, right), ...]``; ties broken by the ids of left then right.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, tok in enumerate(tokens):
        rank = i if by_position else -float(scores[i])
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((rank, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_backend(tokens: Sequence[str], scores: Sequence[float] | None, unk_id: int, by_position: bool):
    """A ``tokenizers.Tokenizer`` that encodes like SentencePiece BPE with byte fallback.

    Args:
      tokens: vocabulary, already ``respell``-ed.
      scores: per-id scores (``tokenizer.ggml.scores``) or None.
      unk_id: id of the unknown token.
      by_position: see ``implied_merges``.
    """
    from tokenizers import decoders, normalizers
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers.models import BPE

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    model = BPE(vocab=vocab, merges=implied_merges(tokens, scores, by_position), unk_token=tokens[unk_id],
                fuse_unk=True, byte_fallback=True, dropout=None)
    tk = _HFTokenizer(model)
    tk.normalizer = normalizers.Replace(" ", SPACE)
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk
