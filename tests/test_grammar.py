"""Structured output (``jaxspec.grammar``): regex and JSON Schema automata on the device.

The tiny target (vocabulary 64) with a byte-level tokenizer of JSON's characters, letters,
digits and a few merges (``TOKENS``): every constrained output is checked against the
pattern (``re.fullmatch``) or the schema (``jsonschema``), greedy constrained speculative
decoding equals greedy constrained plain decoding token for token with every drafter, and
sampled rows never leave the grammar. The exact-distribution test with a grammar is in
tests/test_distribution.py.
"""

from __future__ import annotations

import json
import re

import jax
import jsonschema
import numpy as np
import pytest

import jaxspec
import jaxspec.api
from jaxspec import grammar
from jaxspec.tokenizer import Tokenizer
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

# 64 tokens in GPT-2's byte alphabet (Ġ = space): JSON punctuation, digits, letters and
# merges that a schema's keys and punctuation use; id 63 is an end-of-sequence token.
TOKENS = (list('{}[]":,') + ["Ġ"] + list("0123456789") + list("abcdefghijklmnopqrstuvwxyz")
          + ['{"', '":', '",', '"}', "name", "age", "ab", "an", "na", "er", "on", "no", "at", "ta", "es", "se", "ed",
             "de", "or", "<eos>"])
EOS = 63
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
REGEX = r"[a-z]{2,6}( [0-9]{1,3}){2}"
DRAFTERS = ["ngram", "early_exit", "model_small", "model_self", "grammar", "self_tree"]


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(TOKENS, merges=[], name="tiny-json", eos_ids=[EOS])
    assert t.vocab_size == 64
    return t


def _gen(tiny, tok, kind="plain", gamma=4, prompts=None, **kw):
    kw.setdefault("stop_token_ids", [EOS])  # the tiny config has no EOS of its own
    if kind in ("grammar", "self_tree"):  # forced runs alone; a top-k tree of the target itself
        drafter, params = ((jaxspec.GrammarDrafter(gamma=2 * gamma), None) if kind == "grammar" else
                           (jaxspec.ModelDrafter(tiny.cfg, gamma=3, tree_nodes=6, branching=2), tiny.params))
        return jaxspec.generate(tiny.params, prompts or tiny.prompts, config=tiny.cfg, tokenizer=tok, drafter=drafter,
                                drafter_params=params, ignore_eos=False, **kw)
    return tiny.generate(prompts or tiny.prompts, kind, gamma, tokenizer=tok, ignore_eos=False, **kw)


def _check_json(result):
    """Every row that finished ("stop") parses and validates; others are a prefix cut by length."""
    for text, reason in zip(result.texts, result.finish_reasons):
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert reason == "length", reason


# ---------------------------------------------------------------------------- host tables


def test_automaton_tables_follow_the_regex(tok):
    """The compressed tables accept exactly the token sequences whose text matches: a few
    classes stand for the 64 tokens, the stop id is allowed only where the text is complete,
    and a free row (no grammar) allows everything."""
    a = grammar.compile_grammar(REGEX, None, tok)
    assert a.next_state.shape[1] < 64
    t = grammar.tables([a, None], [EOS], 64)
    assert t.next_state.shape[0] >= grammar.MIN_STATES and t.next_state.shape[1] >= grammar.MIN_CLASSES
    # (text, a prefix of some match, a whole match)
    for text, live, whole in (("abc 1 22", True, True), ("ab 123 4", True, True), ("abc 1", True, False),
                              ("a 1 2", False, False), ("abc 1234 5", False, False), ("abcdefg 1 2", False, False)):
        s = t.run(0, tok.encode(text))
        assert (s >= 0) == live, text
        assert (live and t.next_state[s, t.token_class[EOS]] >= 0) == whole == bool(re.fullmatch(REGEX, text)), text
    assert t.run(1, tok.encode("anything {at} all")) == 0


def test_repetition_after_an_accepting_state_continues(tok):
    """A pattern that may end and may also go on (``[a-c]+(,[0-9])*``): after "ab" both EOS and
    the repetition are allowed, and "ab,1,2" is accepted (outlines-core alone, unanchored,
    lost the repetition after an accepting state)."""
    t = grammar.tables([grammar.compile_grammar("[a-c]+(,[0-9])*", None, tok)], [EOS], 64)
    s = t.run(0, tok.encode("ab"))
    assert t.final[s] and t.next_state[s, t.token_class[tok.encode(",")[0]]] >= 0
    assert t.final[t.run(0, tok.encode("ab,1,2"))]
    assert t.run(0, tok.encode("ab,,")) == -1


def test_json_schema_automaton_accepts_a_valid_object(tok):
    a = grammar.compile_grammar(None, FORMAT, tok)
    t = grammar.tables([a], [EOS], 64)
    good = tok.encode('{"name":"ab","age":42}')
    assert t.final[t.run(0, good)]
    assert t.run(0, tok.encode('{"age":42}')) == -1  # keys in the schema's order, name required


def test_forced_tokens_are_the_text_the_grammar_forces(tok):
    """A state forces a token where every token it allows is a prefix of the longest one: the
    literal runs of the pattern, none where the text is free or may end."""
    a = grammar.compile_grammar("ab(cd|ce)[0-9]+", None, tok)
    t = grammar.tables([a], [EOS], 64)
    run, forced = [], []
    for ch in "abce1":
        s = t.run(0, run)
        forced.append(TOKENS[t.forced[s]] if t.forced[s] >= 0 else None)
        run += tok.encode(ch)
    # "ab" is one token of the vocabulary but the tokenizer (no merges) spells it a, b
    assert forced == ["a", "b", "c", None, None], forced
    done = grammar.tables([grammar.compile_grammar("(yes|no)", None, tok)], [EOS], 64)
    assert done.forced[done.run(0, tok.encode("yes"))] == EOS  # complete, nothing more: EOS is forced


def test_constrain_fills_forced_drafts_and_drops_forbidden_ones(tok):
    """``grammar.constrain`` on a chain: a forbidden draft and its descendants go; an empty
    node after a forcing state gets the forced token."""
    import jax.numpy as jnp
    from jaxspec.tree import Proposal

    t = grammar.tables([grammar.compile_grammar("abc[0-9]x", None, tok)], [EOS], 64).device()
    ids = {c: tok.encode(c)[0] for c in "abcx7z"}
    chain = jnp.asarray([[ids["a"], ids["z"], 0, 0, 0], [ids["a"], 0, 0, ids["7"], ids["x"]]], jnp.int32)
    valid = jnp.asarray([[True, True, True, True, True], [True, False, False, True, True]])
    out = grammar.constrain(t, jnp.zeros(2, jnp.int32) + t.initial[0], Proposal.chain(chain, valid=valid))
    # row 0: "a" then "z" is forbidden where "b" is forced: the forced "b" replaces it, then "c"
    np.testing.assert_array_equal(np.asarray(out.tokens[0, :3]), [ids["a"], ids["b"], ids["c"]])
    assert np.asarray(out.valid[0]).tolist() == [True, True, True, False, False]  # "0" after "c" is not a digit
    # row 1: forced "b", "c" fill the empty nodes; "7" and "x" were proposed and are allowed
    assert np.asarray(out.valid[1]).tolist() == [True] * 5
    assert tok.decode(np.asarray(out.tokens[1]).tolist()) == "abc7x"


# ---------------------------------------------------------------------------- greedy: spec == plain


@pytest.mark.parametrize("kind", core(DRAFTERS, ["ngram", "model_self", "self_tree"]))
def test_json_greedy_spec_equals_plain(tiny, tok, kind):
    """Greedy constrained speculative decoding is constrained plain decoding, token for token;
    the finished rows validate against the schema and the grammar changed the output."""
    plain = _gen(tiny, tok, response_format=FORMAT, max_new_tokens=40)
    _check_json(plain)
    assert "stop" in plain.finish_reasons
    assert plain.tokens != _gen(tiny, tok, max_new_tokens=40).tokens
    spec = _gen(tiny, tok, kind, response_format=FORMAT, max_new_tokens=40)
    assert spec.tokens == plain.tokens
    assert spec.finish_reasons == plain.finish_reasons
    if kind in ("model_self", "grammar", "self_tree"):  # drafts drawn / ranked under the grammar are accepted
        assert spec.metrics.tau > 1.3, spec.metrics.tau


@pytest.mark.parametrize("kind", core(["plain", "ngram", "model_small"], ["ngram"]))
def test_regex_greedy_and_rows_without_grammar(tiny, tok, kind):
    """Per-prompt grammars in one batch: a regex row matches it, a free row (None) is the
    unconstrained output exactly, and speculative equals plain."""
    prompts = tiny.prompts
    free = _gen(tiny, tok, "plain", prompts=prompts, max_new_tokens=20)
    out = _gen(tiny, tok, kind, prompts=prompts, regex=[REGEX, None, REGEX], max_new_tokens=20)
    ref = _gen(tiny, tok, "plain", prompts=prompts, regex=[REGEX, None, REGEX], max_new_tokens=20)
    assert out.tokens == ref.tokens
    assert out.tokens[1] == free.tokens[1]
    for i in (0, 2):
        text = out.texts[i]
        if out.finish_reasons[i] == "stop":
            assert re.fullmatch(REGEX, text), text
        assert re.fullmatch(r"[a-z]{0,6}( [0-9]{0,3}){0,2}", text), text


def test_text_that_allows_nothing_more_stops_without_eos(tiny, tok):
    """A pattern that, once matched, allows no further token ends the row there ("stop")
    even with no stop id: the grammar is complete."""
    out = _gen(tiny, tok, "ngram", regex="(yes|no)", stop_token_ids=[], max_new_tokens=10)
    assert out.finish_reasons == ["stop"] * 3
    assert all(t in ("yes", "no") for t in out.texts), out.texts


def test_stop_strings_and_penalties_compose(tiny, tok):
    """A stop string inside the constrained text cuts it as without a grammar (stop reason the
    string, the text before it), under penalties, and speculative equals plain."""
    kw = dict(response_format=FORMAT, max_new_tokens=40, stop=['","age'], repetition_penalty=1.2)
    plain = _gen(tiny, tok, **kw)
    spec = _gen(tiny, tok, "ngram", **kw)
    assert spec.tokens == plain.tokens and spec.texts == plain.texts
    assert plain.stop_reasons[0] == '","age'
    assert plain.texts[0].startswith('{"name":"') and '"age' not in plain.texts[0]


# ---------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("kind", core(["plain", "model_small", "ngram"], ["model_small"]))
def test_sampled_rows_stay_in_the_grammar(tiny, tok, kind):
    """Sampled at temperature 1.5 with top-p and penalties, 4 samples per prompt: no row ever
    takes a token its automaton does not allow, and finished rows validate."""
    out = _gen(tiny, tok, kind, response_format=FORMAT, max_new_tokens=40, temperature=1.5, top_p=0.95,
               presence_penalty=0.5, n=4, seed=7)
    req_tables = grammar.tables([grammar.compile_grammar(None, FORMAT, tok)], [EOS], 64)
    for tokens in out.tokens:
        assert req_tables.run(0, tokens) >= 0, tokens
    _check_json(out)


def test_min_new_tokens_yields_to_the_grammar(tiny, tok):
    """Where the grammar allows only the stop id, ``min_new_tokens`` does not suppress it."""
    out = _gen(tiny, tok, "ngram", regex="(yes|no)", min_new_tokens=8, max_new_tokens=10)
    assert all(t in ("yes", "no") for t in out.texts), out.texts
    assert out.stop_reasons == [EOS] * 3, (out.tokens, out.stop_reasons)  # ended by EOS, before min_new_tokens
    assert all(len(t) <= 4 for t in out.tokens)


# ---------------------------------------------------------------------------- compiles and errors


def test_another_schema_in_the_bucket_does_not_recompile(tiny, tok):
    """A different schema (and a different regex) whose tables fit the same buckets reuses
    the compiled program."""
    other = {"type": "object", "properties": {"age": {"type": "integer"}, "ok": {"type": "boolean"}},
             "required": ["age", "ok"]}
    _gen(tiny, tok, "ngram", response_format=FORMAT, max_new_tokens=16)
    n = len(jaxspec.api._COMPILED)
    out = _gen(tiny, tok, "ngram", response_format={"type": "json_schema", "json_schema": other}, max_new_tokens=16)
    assert len(jaxspec.api._COMPILED) == n
    assert out.metrics.compile_s == 0.0
    for text, reason in zip(out.texts, out.finish_reasons):
        if reason == "stop":
            jsonschema.validate(json.loads(text), other)


@pytest.mark.parametrize("kw,match", [
    (dict(regex="a+", response_format=FORMAT), "regex and response_format together"),
    (dict(regex="("), "not a valid regular expression: missing \\), unterminated subpattern"),
    (dict(regex="a(?=b)"), "cannot be compiled .* no lookaround"),
    (dict(regex=""), "regex must be"),
    (dict(response_format={"type": "json_schema", "json_schema": {"type": "wat"}}), "cannot be compiled"),
    (dict(response_format={"type": "yaml"}), "response_format must be"),
    (dict(response_format="json"), "response_format must be"),
    (dict(regex="[A-Z]+"), "admits no token"),
    (dict(regex=["a+", "b+"]), "one per prompt"),
])
def test_bad_grammar_is_refused_before_compiling(tiny, tok, kw, match):
    n = len(jaxspec.api._COMPILED)
    with pytest.raises(ValueError, match=match):
        _gen(tiny, tok, "ngram", max_new_tokens=8, **kw)
    assert len(jaxspec.api._COMPILED) == n


def test_grammar_needs_a_tokenizer_and_a_state_limit(tiny, tok, monkeypatch):
    with pytest.raises(ValueError, match="GrammarDrafter drafts the tokens a grammar forces"):
        jaxspec.generate(tiny.params, tiny.prompts, config=tiny.cfg, tokenizer=tok, drafter=jaxspec.GrammarDrafter())
    with pytest.raises(ValueError, match="need a tokenizer"):
        jaxspec.generate(tiny.params, tiny.prompts, config=tiny.cfg, regex="a+", max_new_tokens=4)
    monkeypatch.setattr(grammar, "MAX_STATES", 4)
    with pytest.raises(ValueError, match="over the limit of 4"):
        _gen(tiny, tok, regex="abcdefgh", max_new_tokens=4)


def test_finish_reasons_read_the_automaton():
    """``result._finish``: a row whose automaton allows nothing more is "stop" where it accepts
    and "dead_end" where it does not; a stop reason wins; otherwise "length"."""
    import dataclasses

    from jaxspec import result

    # states: 0 free, 1 start, 2 accepting and closed, 3 dead end (allows nothing, not accepting)
    nxt = np.full((4, 2), -1, np.int32)
    nxt[0] = 0
    nxt[1] = [2, 3]
    t = grammar.HostTables(token_class=np.array([0, 1], np.int32), next_state=nxt, live=np.any(nxt >= 0, axis=1),
                           forced=np.full(4, -1, np.int32), spelled=np.full(4, -1, np.int32),
                           slots=np.full(16, -1, np.int32), final=np.array([True, False, True, False]),
                           initial=np.array([1, 1, 0], np.int32))
    req = dataclasses.make_dataclass("Req", ["grammar"])(t)
    assert result._finish(req, 0, [0], None) == "stop"
    assert result._finish(req, 1, [1], None) == "dead_end"
    assert result._finish(req, 1, [1], 7) == "stop"
    assert result._finish(req, 2, [1, 0], None) == "length"  # a free row
