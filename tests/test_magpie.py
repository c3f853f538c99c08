"""Magpie prompts (checkpoints_tools/magpie.py) on the real SmolLM2-135M-Instruct: the
target writes user queries after its chat template's user-turn header; they are seeded,
distinct, whole (a query the model did not end is dropped) and usable as chat prompts."""

import pytest

from checkpoints_tools.magpie import magpie_prompts, query_prefix
from conftest import smollm2


def test_prefix_is_the_template_up_to_the_user_message():
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert query_prefix(smollm2().tokenizer) == system + "<|im_start|>user\n"


@pytest.mark.slow  # ~4 min on 2 cores
def test_queries_are_seeded_distinct_whole_chat_prompts():
    model = smollm2()
    a = magpie_prompts(model, 3, seed=0, batch=4, max_tokens=48)
    assert a == magpie_prompts(model, 3, seed=0, batch=4, max_tokens=48)
    b = magpie_prompts(model, 3, seed=1, batch=4, max_tokens=48)
    texts = [p.messages[0]["content"] for p in a]
    assert len(set(texts)) == 3 and not set(texts) & {p.messages[0]["content"] for p in b}
    assert [p.source for p in a] == ["magpie:0:0", "magpie:0:1", "magpie:0:2"]
    assert all(p.messages[0]["role"] == "user" and not p.text and len(t.split()) >= 3 for p, t in zip(a, texts))
    # whole: each query re-encoded ends the model's user turn within 48 tokens, markers stripped
    tok = model.tokenizer
    assert all("<|im_end|>" not in t and "<|im_start|>" not in t and len(tok.encode(t, add_bos=False)) <= 48
               for t in texts)


def test_cut_off_queries_are_dropped_not_truncated():
    """With room for 1 token no query ends its turn, so none is kept and the call says how
    many samples it drew."""
    with pytest.raises(ValueError, match=r"--magpie 1: only 0 usable queries after 4 samples \(each must end within "
                                         r"1 tokens"):
        magpie_prompts(smollm2(), 1, batch=4, max_tokens=1)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"--magpie must be an integer >= 1, got 0"):
        magpie_prompts(smollm2(), 0)

    class NoUserSlot:
        name = "fixed-template"

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "<s>always the same</s>"

    with pytest.raises(ValueError, match=r"the chat template of fixed-template does not place the user's message"):
        query_prefix(NoUserSlot())
