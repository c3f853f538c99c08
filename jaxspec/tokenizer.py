"""Byte-level BPE tokenizer and chat template built from GGUF metadata.

A GGUF file carries no ``tokenizer.json``; it stores the vocabulary (``tokenizer.ggml.tokens``),
the merges, the token types (1 normal, 3 control, 4 user-defined, ...), the BOS/EOS ids and
the Jinja chat template under llama.cpp's key names. :class:`Tokenizer` rebuilds a Hugging
Face ``tokenizers`` BPE tokenizer from them, with GPT-2 byte-level pre-tokenization and
decoding, and renders chat templates in a sandboxed Jinja environment like transformers does.

Pre-tokenization follows ``tokenizer.ggml.pre`` the way llama.cpp does. In particular
``"smollm"`` (SmolLM/SmolLM2, also StarCoder-style vocabularies) splits every digit into its own
token before the GPT-2 regex, as the original SmolLM2 ``tokenizer.json`` does
(``Digits(individual_digits=True)``). Note: transformers (<= 5.x) does not know the ``smollm``
pre-tokenizer and, loading the same GGUF, keeps runs of digits together ("2024" -> one or two
ids instead of four); everything else is identical.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Iterable, Sequence

from jaxspec.chat_templates import compile_template

__all__ = ["Tokenizer"]

# llama_token_type values stored in tokenizer.ggml.token_type
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# tokenizer.ggml.pre values whose llama.cpp pre-tokenizer is "each digit alone, then GPT-2 regex".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
# Plain GPT-2 regex.
_GPT2_PRE = {"gpt2", "gpt-2", "default", "", None}
# Same regexes as transformers' GGUF tokenizer mapping / llama.cpp.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _make_pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in _GPT2_PRE:
        warnings.warn(
            f"unknown GGUF pre-tokenizer {pre!r}; using the plain GPT-2 byte-level split, which may "
            f"tokenize digits/whitespace differently from llama.cpp",
            stacklevel=3,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


class Tokenizer:
    """GPT-2 style byte-level BPE tokenizer with special tokens and a Jinja chat template.

    Build it with :meth:`from_gguf` (reads the file's metadata) or :meth:`from_metadata` (the
    dict returned by ``jaxspec.checkpoints.gguf_reader.read_gguf``). Control tokens (GGUF token type 3,
    e.g. ``<|im_start|>``) are registered as special tokens and user-defined tokens (type 4) as
    added tokens, so their text in a string is encoded as a single id.

    Args:
      tokens: the vocabulary, ``tokens[i]`` is the (byte-level spelled) string of id ``i``.
      merges: BPE merges, each ``"left right"``, highest priority first.
      token_type: optional llama.cpp token type per id (same length as ``tokens``).
      bos_id: beginning-of-sequence id or -1.
      eos_ids: ids that end generation.
      chat_template: Jinja source, or None when the model has none.
      pre: llama.cpp pre-tokenizer name (``tokenizer.ggml.pre``), e.g. ``"smollm"``, ``"gpt2"``,
        ``"llama-bpe"``, ``"qwen2"``.
      add_bos: default for :meth:`encode`'s ``add_bos`` (``tokenizer.ggml.add_bos_token``).
      name: used in error messages.
      model: ``"gpt2"`` (byte-level BPE with ``merges``) or ``"llama"`` (SentencePiece BPE with
        byte fallback, merges rebuilt from the vocabulary: ``jaxspec.tokenizer_spm``).
      scores: SentencePiece scores per id (``"llama"`` only).
      unk_id: unknown-token id (``"llama"`` only).

    Raises:
      ValueError: empty vocabulary, ``token_type`` length mismatch, ids out of range.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_type: Sequence[int] | None = None,
        bos_id: int = -1,
        eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        pre: str | None = "gpt2",
        add_bos: bool = False,
        name: str = "tokenizer",
        model: str = "gpt2",
        scores: Sequence[float] | None = None,
        unk_id: int = 0,
    ):
        from tokenizers import AddedToken

        tokens = list(tokens)
        if not tokens:
            raise ValueError(f"{name}: empty vocabulary")
        if token_type is not None and len(token_type) != len(tokens):
            raise ValueError(f"{name}: token_type has {len(token_type)} entries, vocabulary has {len(tokens)}")
        self.name = name
        self._tokens = tokens
        self._vocab_size = len(tokens)
        self.bos_id = int(bos_id)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        for what, ids in (("bos_id", [self.bos_id] if self.bos_id >= 0 else []), ("eos_ids", self.eos_ids)):
            for i in ids:
                if not 0 <= i < self._vocab_size:
                    raise ValueError(f"{name}: {what} {i} outside the vocabulary [0, {self._vocab_size})")
        self.chat_template = chat_template
        self.pre = pre
        self.add_bos = bool(add_bos)

        self.model = model
        if model == "llama":
            from jaxspec.tokenizer_spm import respell, sentencepiece_backend

            tokens = self._tokens = respell(tokens)
            # Gemma's scores are all equal (0): its merge order is the token order.
            by_position = scores is None or len(set(scores[max(unk_id, 0) + 1:])) <= 1 or "gemma" in name.lower()
            tk = sentencepiece_backend(tokens, scores, unk_id, by_position)
        elif model == "gpt2":
            tk = self._byte_level_backend(tokens, merges, pre, name)
        else:
            raise ValueError(f"{name}: tokenizer model {model!r} is not supported ('gpt2' or 'llama')")

        special_ids: set[int] = set()
        if token_type is not None:
            control = [(i, t) for i, (t, ty) in enumerate(zip(tokens, token_type)) if ty == TOKEN_TYPE_CONTROL]
            user = [(i, t) for i, (t, ty) in enumerate(zip(tokens, token_type)) if ty == TOKEN_TYPE_USER_DEFINED]
            if control:
                tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for _, t in control])
                special_ids.update(i for i, _ in control)
            if user:
                tk.add_tokens([AddedToken(t, normalized=False, special=False) for _, t in user])
        for i in (self.bos_id, *self.eos_ids):
            if i >= 0 and i not in special_ids:
                tk.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)])
                special_ids.add(i)
        if tk.get_vocab_size(with_added_tokens=True) != self._vocab_size:
            raise ValueError(
                f"{name}: tokenizer has {tk.get_vocab_size(with_added_tokens=True)} ids after adding special "
                f"tokens, vocabulary has {self._vocab_size} (duplicate or mis-spelled tokens)"
            )
        self.special_ids = frozenset(special_ids)
        self.backend = tk
        self._template = None

    @staticmethod
    def _byte_level_backend(tokens, merges, pre, name):
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders
        from tokenizers.models import BPE

        # Every byte-level token is spelled in GPT-2's byte alphabet; respell the rare one that is
        # not (stored as raw UTF-8 text), like transformers does.
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab.setdefault(key, i)
        merge_pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{name}: malformed BPE merge {m!r} (expected 'left right')")
            merge_pairs.append((parts[0], parts[1]))
        bpe = BPE(vocab=vocab, merges=merge_pairs, dropout=None, continuing_subword_prefix="",
                  end_of_word_suffix="", fuse_unk=False)
        tk = _HFTokenizer(bpe)
        tk.pre_tokenizer = _make_pre_tokenizer(pre)
        tk.decoder = decoders.ByteLevel()
        return tk

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_metadata(cls, meta: dict[str, Any], source: str = "<metadata>", pre: str | None = None) -> "Tokenizer":
        """Build from a GGUF key/value dict (``read_gguf(...)[2]`` or ``read_gguf_metadata``).

        Args:
          meta: GGUF metadata with ``tokenizer.ggml.*`` keys.
          source: file name used in error messages.
          pre: override ``tokenizer.ggml.pre``; ``pre="gpt2"`` reproduces transformers'
            GGUF tokenizer exactly for SmolLM2 (which ignores ``"smollm"``'s digit split).

        Returns:
          Tokenizer.

        Raises:
          ValueError: the tokenizer model is neither ``"gpt2"`` (byte-level BPE) nor ``"llama"``
            (SentencePiece BPE), or tokens / merges are missing; the message names ``source``.
        """
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(
                f"{source}: tokenizer.ggml.model is {model!r}; jaxspec.tokenizer supports 'gpt2' "
                f"(byte-level BPE) and 'llama' (SentencePiece BPE)"
            )
        for key in ("tokenizer.ggml.tokens",) + (("tokenizer.ggml.merges",) if model == "gpt2" else ()):
            if not meta.get(key):
                raise ValueError(f"{source}: GGUF metadata has no {key!r}")
        eos_ids = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if key in meta and int(meta[key]) not in eos_ids:
                eos_ids.append(int(meta[key]))
        return cls(
            tokens=meta["tokenizer.ggml.tokens"],
            merges=meta.get("tokenizer.ggml.merges", []),
            token_type=meta.get("tokenizer.ggml.token_type"),
            bos_id=int(meta.get("tokenizer.ggml.bos_token_id", -1)),
            eos_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            pre=meta.get("tokenizer.ggml.pre", "gpt2") if pre is None else pre,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            name=str(meta.get("general.name", source)),
            model=model,
            scores=meta.get("tokenizer.ggml.scores"),
            unk_id=int(meta.get("tokenizer.ggml.unknown_token_id", 0)),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, pre: str | None = None) -> "Tokenizer":
        """Read a GGUF file's metadata (no tensors) and build its tokenizer.

        Args:
          path: ``.gguf`` file.
          pre: override the file's pre-tokenizer name (see :meth:`from_metadata`).

        Raises:
          FileNotFoundError: ``path`` does not exist (message names it).
          ValueError: not a valid GGUF, or its tokenizer is not byte-level BPE (message names it).
        """
        from jaxspec.checkpoints.gguf_reader import read_gguf_metadata

        path = os.fspath(path)
        return cls.from_metadata(read_gguf_metadata(path), source=repr(path), pre=pre)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """A Hugging Face tokenizer directory: ``tokenizer.json`` (the ``tokenizers`` pipeline, used
        as is), ``tokenizer_config.json`` (BOS/EOS tokens, ``add_bos_token``, ``chat_template``) and
        optionally ``chat_template.jinja`` (transformers 5 writes the template there). Without
        ``add_bos_token``, ``add_bos`` is what the pipeline's post-processor does (transformers'
        ``encode`` default: ``add_special_tokens=True``).

        Raises:
          FileNotFoundError: no ``tokenizer.json`` in ``path``.
          ValueError: ``tokenizer.json`` is not readable by ``tokenizers`` (message names it).
        """
        from tokenizers import Tokenizer as _HFTokenizer

        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path!r} has no tokenizer.json")
        try:
            backend = _HFTokenizer.from_file(file)
        except Exception as e:
            raise ValueError(f"{file!r}: not a readable tokenizers file: {e}") from e
        cfg = {}
        if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            with open(os.path.join(path, "tokenizer_config.json")) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if os.path.isfile(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                template = f.read()

        def token_id(key):
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return -1 if tok is None else (backend.token_to_id(tok) if backend.token_to_id(tok) is not None else -1)

        self = cls.__new__(cls)
        size = backend.get_vocab_size(with_added_tokens=True)
        vocab = backend.get_vocab(with_added_tokens=True)
        self._tokens = [""] * size
        for tok, i in vocab.items():
            if i < size:
                self._tokens[i] = tok
        self.name, self._vocab_size, self.model, self.pre = path, size, "hf", None
        self.bos_id = token_id("bos_token")
        self.eos_ids = tuple(i for i in (token_id("eos_token"),) if i >= 0)
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # the post-processor's choice (a Llama-style TemplateProcessing adds BOS)
            add_bos = self.bos_id >= 0 and backend.encode("a", add_special_tokens=True).ids[:1] == [self.bos_id]
        self.chat_template, self.add_bos, self._template = template, bool(add_bos), None
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.backend = backend
        return self

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """Number of ids (V), special tokens included."""
        return self._vocab_size

    def id_to_token(self, i: int) -> str:
        """Byte-level spelling of id ``i`` (e.g. ``'Ġthe'``). Raises IndexError when out of range."""
        if not 0 <= int(i) < self._vocab_size:
            raise IndexError(f"token id {i} outside the vocabulary [0, {self._vocab_size})")
        return self._tokens[int(i)]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (byte-level spelling), or None."""
        return self.backend.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes in decoded text (``b""`` for special tokens): ``decode(ids)`` is the
        UTF-8 decoding of their concatenation. Used to match stop strings on device."""
        if getattr(self, "_token_bytes", None) is None:
            byte_of = {c: b for b, c in _bytes_to_unicode().items()}
            added = self.backend.get_added_tokens_decoder()
            out = []
            for i, tok in enumerate(self._tokens):
                if i in self.special_ids:
                    out.append(b"")
                elif self.model == "llama":  # SentencePiece: "▁" is a space, <0xXX> one byte
                    is_byte = len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">") and i not in added
                    out.append(bytes([int(tok[3:5], 16)]) if is_byte else tok.replace("\u2581", " ").encode("utf-8"))
                elif i in added or not set(tok) <= byte_of.keys():
                    out.append(tok.encode("utf-8"))
                else:
                    out.append(bytes(byte_of[c] for c in tok))
            self._token_bytes = out
        return self._token_bytes

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> token ids.

        Special-token text (``"<|im_start|>"``) becomes its single id.

        Args:
          text: the string to encode.
          add_bos: prepend ``bos_id``. ``None`` (default): as the model's tokenizer says
            (``self.add_bos``: the GGUF's ``tokenizer.ggml.add_bos_token``, an HF directory's
            ``add_bos_token`` or its post-processor), as llama.cpp and transformers' ``encode``
            do, and not when the text already starts with the BOS token (a chat template's
            ``{{ bos_token }}``). Pass ``False`` for text a chat template rendered, ``True`` to
            prepend it whatever the text holds.

        Returns:
          list of int ids in ``[0, vocab_size)``.

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: ``add_bos`` requested but the model has no BOS id.
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos and self.bos_id >= 0 and ids[:1] != [self.bos_id]
        if add_bos:
            if self.bos_id < 0:
                raise ValueError(f"{self.name}: add_bos=True but the tokenizer has no BOS id")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Token ids -> text.

        Args:
          ids: 1-D sequence of ints (list, numpy or jax array).
          skip_special_tokens: drop control/special tokens (``<|im_end|>``...) from the text.

        Returns:
          str. Byte sequences that are not valid UTF-8 (a multi-byte character cut between ids)
          decode to U+FFFD.

        Raises:
          ValueError: an id outside ``[0, vocab_size)`` or ``ids`` not 1-D.
        """
        try:
            import numpy as np

            arr = np.asarray(ids)
        except Exception as e:  # pragma: no cover
            raise ValueError(f"Tokenizer.decode: cannot read ids: {e}") from e
        if arr.ndim != 1:
            if arr.ndim == 0:
                arr = arr.reshape(1)
            else:
                raise ValueError(f"Tokenizer.decode: ids must be 1-D, got shape {arr.shape}")
        if arr.size and (arr.dtype.kind not in "iu"):
            raise ValueError(f"Tokenizer.decode: ids must be integers, got dtype {arr.dtype}")
        out = [int(i) for i in arr.tolist()]
        bad = [i for i in out if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"Tokenizer.decode: id {bad[0]} outside the vocabulary [0, {self._vocab_size})")
        return self.backend.decode(out, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation with the model's Jinja chat template (sandboxed, like transformers).

        Args:
          messages: list of dicts with at least ``"role"`` and ``"content"`` (str).
          add_generation_prompt: append the assistant turn header (e.g. ``<|im_start|>assistant\\n``).
          **kwargs: extra template variables (``tools``, ``documents``, ...).

        Returns:
          The prompt string; encode it with :meth:`encode` (the template already contains any
          BOS/marker tokens, so do not add BOS again).

        Raises:
          ValueError: the tokenizer has no chat template, or a message is malformed, or the
            template raised (``raise_exception``) / failed to render.
        """
        import jinja2

        if not self.chat_template:
            raise ValueError(f"{self.name}: this tokenizer has no chat template (tokenizer.chat_template)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("apply_chat_template: messages must be a non-empty list of dicts")
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"apply_chat_template: messages[{k}] must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        special = {}
        if self.bos_id >= 0:
            special["bos_token"] = self._tokens[self.bos_id]
        if self.eos_ids:
            special["eos_token"] = self._tokens[self.eos_ids[0]]
        variables = {**special, **kwargs}
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"{self.name}: chat template failed: {e}") from e

    def __repr__(self) -> str:
        return (f"Tokenizer(name={self.name!r}, vocab_size={self._vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, pre={self.pre!r})")
