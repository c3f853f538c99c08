"""Magpie prompts: user queries sampled from the aligned target itself, given nothing but its
chat template's user-turn header (Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing", Sec. 2.1, step 1).

Why: a draft head is served on what users ask the target, and the templated instructions of
``instruct_prompts`` are a few dozen sentence shapes: a head trained on their answers reached
tau 1.99 on held-out templated prompts but 1.44 on Spec-Bench's (docs/training.md, "What limits a
head's acceptance"). An instruction-tuned model, left to continue ``<|im_start|>user\\n``, writes the
kind of request its own fine-tuning data held (SmolLM2-135M-Instruct's included Magpie-Ultra),
so its queries cover the distribution the target was aligned on, in every shape and length,
with no dataset download and no benchmark text. The answers are then the target's own
(``drafter_data.self_distill``), as for every other prompt source.

Measured (2026-12-03, README): at equal size and steps (1000 answers, 500 steps) a head on
Magpie answers agreed with the target a little more on held-out Magpie prompts than one on the
templated instructions did on theirs, but carried no better to Spec-Bench (tau 1.30 / 1.31 vs
1.32 / 1.35 at gamma 2 / 4): the hypothesis above did not hold for SmolLM2-135M.
"""

from __future__ import annotations

from checkpoints_tools.drafter_data import Prompt

MARKER = "MAGPIEQUERYMARKER"


def query_prefix(tokenizer) -> str:
    """The chat template rendered up to where a user's first message would start (the system
    turn the template adds by default included).

    Raises:
      ValueError: the tokenizer has no chat template, or one that does not place the user's text
        verbatim.
    """
    full = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], add_generation_prompt=False)
    if MARKER not in full:
        raise ValueError(f"--magpie: the chat template of {tokenizer.name} does not place the user's message "
                         f"verbatim, so it has no user-turn header to continue")
    return full[: full.index(MARKER)]


def magpie_prompts(model, n: int, *, seed: int = 0, batch: int = 32, max_tokens: int = 96,
                   temperature: float = 1.0, min_words: int = 3, progress=None) -> list[Prompt]:
    """``n`` distinct user queries written by ``model`` (a ``jaxspec.load`` result with a chat
    tokenizer) after its user-turn header, sampled at ``temperature`` (Magpie uses 1.0) with
    plain decoding, ``batch`` rows a call. ``generate`` seeds row r with ``seed + r``, so call i
    passes ``seed * 2**20 + i * batch``: every sample draws from its own key (for up to 2**20
    samples per seed) and the same arguments give the same queries.

    A query is kept when the model ended its turn within ``max_tokens`` tokens (finish reason
    ``"stop"``; a cut-off query is dropped, not truncated), it has at least ``min_words``
    words, and it is new. Returns ``Prompt``s named ``magpie:<seed>:<k>``, in sampling order.

    Raises:
      ValueError: ``n``, ``batch`` or ``max_tokens`` < 1, no chat template, or fewer than ``n``
        usable queries after ``4 * n`` samples (the count reached is named).
    """
    import jaxspec

    for name, v in (("--magpie", n), ("batch", batch), ("max_tokens", max_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if model.tokenizer is None:
        raise ValueError(f"--magpie needs the target's tokenizer; {model.config.name} has none")
    tok = model.tokenizer
    prefix = tok.encode(query_prefix(tok), add_bos=False)
    out, seen, drawn = [], set(), 0
    while len(out) < n:
        if drawn >= 4 * n:
            raise ValueError(f"--magpie {n}: only {len(out)} usable queries after {drawn} samples (each must end "
                             f"within {max_tokens} tokens and have >= {min_words} words)")
        res = jaxspec.generate(model, [prefix] * batch, max_new_tokens=max_tokens, temperature=temperature,
                               seed=seed * 2**20 + drawn)
        for text, reason in zip(res.texts, res.finish_reasons):
            text = text.strip()
            if reason == "stop" and len(text.split()) >= min_words and text not in seen and len(out) < n:
                seen.add(text)
                out.append(Prompt(f"magpie:{seed}:{len(out)}", messages=({"role": "user", "content": text},)))
        drawn += batch
        if progress is not None:
            progress(len(out))
    return out
