"""Structured output: a regex or a JSON Schema as a token-level automaton that lives on the
device, inside the one compiled program.

On the host, once per (pattern, tokenizer) and cached: the pattern (a JSON Schema is first
turned into a regex) is compiled by outlines-core into its ``Index``, a deterministic
automaton over the tokenizer's vocabulary: every state's allowed tokens and the state each
leads to (Willard and Louf 2023, "Efficient Guided Generation for Large Language Models",
Sec. 3-4: regex -> DFA -> a map from each DFA state to the tokens whose bytes it can read).
Why outlines-core: its index is the whole automaton, computed ahead of time, which is what
static device tables need; xgrammar and llguidance run a pushdown automaton or an Earley
parser on the host per token (vLLM's and SGLang's structured output), which a ``while_loop``
on the device cannot call.

On the device (``GrammarTables``), every row carries a state (``LoopState.grammar_state``):

- tokens whose transitions agree in every state share a class (a small JSON schema over
  SmolLM2's 49152 tokens has 31 states and 63 classes), so the automaton is
  ``next_state [G, C]`` plus ``token_class [V]``: the state after a token of class c from
  state s, -1 where the token is not allowed;
- state 0 is free: every token allowed, staying in state 0, the state of a row without a
  grammar, so rows with and without one (or with different ones) share a batch;
- at an accepting state the request's stop ids (EOS unless ignored, ``stop_token_ids``) are
  allowed and keep the state; nowhere else are they allowed unless their text is;
- a state that allows no token ends the row (``live``): after the text of an accepting state
  that allows nothing more, or at a dead end;
- ``G`` and ``C`` are padded to powers of two (at least ``MIN_STATES``, ``MIN_CLASSES``), so
  another schema within the bucket reuses the compiled program.

The engine masks the target's logits to the allowed tokens of each window entry's state
(the state after the path to it: ``window_states``) before every sampling setting, and
advances each row's state along the tokens it keeps. The acceptance rule is unchanged: the
target's processed distribution is the constrained one, so greedy output is constrained
plain decoding's, and sampled output follows the constrained distribution exactly, whatever
the drafter proposes (speculative sampling is exact for any proposal distribution).

Shape letters (the package legend): B batch, W window entries, V vocabulary, G automaton
states, C token classes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_STATES = 2048  # automaton states of one call, all its grammars together (the free state not counted)
MIN_STATES = 16  # the state bucket's least size
MIN_CLASSES = 64  # the token-class bucket's least size
MIN_SLOTS = 16  # the least number of forced-text spellings a row remembers (a bucket)
# JSON from a schema is compact, as ``json.dumps(separators=(",", ":"))`` writes it: no
# whitespace between JSON's tokens (outlines-core's default allows one space, ``[ ]?``), so
# every key and punctuation run is forced text, which the engine drafts for free.
WHITESPACE = ""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarTables:
    """The call's automata on the device.

    Attributes:
      token_class: int32 ``[V]``, each token's class.
      next_state: int32 ``[G, C]``, the state after a token of class c in state s; -1: not allowed.
      live: bool ``[G]``, states that allow some token.
      forced: int32 ``[G]``, the token each state forces (``Automaton.forced``), -1 where none.
      spelled: int32 ``[G]``, the slot of a row's ``spelling`` memory that a forcing state
        reads and writes (one per distinct forced token), -1 where none; ``[F]`` slots.
      slots: int32 ``[F]``, each slot's forced token (-1: padding); its length is F.
      initial: int32 ``[B]``, each row's first state (0: no grammar).
    """

    token_class: jax.Array
    next_state: jax.Array
    live: jax.Array
    forced: jax.Array
    spelled: jax.Array
    slots: jax.Array
    initial: jax.Array


def no_spelling(tables: GrammarTables, batch: int) -> jax.Array:
    """int32 ``[B, F]`` of -1: no row has written any forced text yet."""
    return jnp.full((batch, tables.slots.shape[0]), -1, jnp.int32)


def remember(tables: GrammarTables, spelling: jax.Array, state: jax.Array, token: jax.Array, keep: jax.Array):
    """``spelling`` int32 ``[B, F]`` after each row wrote ``token`` int32 ``[B]`` in ``state``
    int32 ``[B]`` (where ``keep`` bool ``[B]``): at a forcing state the slot of its forced text
    now holds the token the target chose to spell it with."""
    slot = jnp.where((state >= 0) & keep, tables.spelled[jnp.maximum(state, 0)], -1)
    rows = jnp.arange(spelling.shape[0])
    return spelling.at[rows, jnp.where(slot >= 0, slot, spelling.shape[1])].set(token, mode="drop")


def allowed(tables: GrammarTables, state: jax.Array) -> jax.Array:
    """bool ``[..., V]``: the tokens allowed in ``state`` int32 ``[...]`` (none in state -1)."""
    row = tables.next_state[jnp.maximum(state, 0)]  # [..., C]
    return (row[..., tables.token_class] >= 0) & (state >= 0)[..., None]


def advance(tables: GrammarTables, state: jax.Array, token: jax.Array) -> jax.Array:
    """int32 ``[...]``: the state after ``token`` in ``state`` (both int32 ``[...]``); -1 once
    a token was not allowed."""
    nxt = tables.next_state[jnp.maximum(state, 0), tables.token_class[jnp.maximum(token, 0)]]
    return jnp.where(state >= 0, nxt, -1)


def is_live(tables: GrammarTables, state: jax.Array) -> jax.Array:
    """bool ``[...]``: ``state`` allows some token (state -1 does not)."""
    return (state >= 0) & tables.live[jnp.maximum(state, 0)]


def constrain(tables: GrammarTables, state: jax.Array, proposal, spelling: jax.Array | None = None):
    """A proposal without q (``jaxspec.tree.Proposal``, deterministic drafts) under the
    grammar, node by node, with the state after the node's parent: a valid node whose token
    the state allows is kept (the drafter's spelling of forced text too: an n-gram drafter
    that saw the model write ``":`` then ``"`` proposes that, where the forced token is
    ``":"``); otherwise, where the state forces a token (``GrammarTables.forced``), the node
    proposes it, valid even where the drafter proposed nothing (grammar-forced drafts,
    SGLang's jump-forward decoding inside the verify window); else the node is invalid (the
    target would reject its token). ``state`` int32 ``[B]``: each row's state after its
    committed text.

    Which token spells forced text: the one this row's target chose the last time it wrote
    the same forced text (``spelling`` int32 ``[B, F]``, kept by the engine with
    ``remember``: a model that writes ``":`` then ``"`` where the tokenizer's encoding is
    ``":"`` gets its own spelling drafted at the next key), else the tokenizer's encoding.

    Lossless: a deterministic proposal is accepted with probability p(token), so replacing
    or dropping drafts changes only which are proposed. (A proposal with q must be drawn
    from the masked q instead: ``jaxspec.drafters.model.draw_chain``.)
    """
    b, n = proposal.tokens.shape
    rows = jnp.arange(b)
    states = jnp.full((b, n + 1), -1, jnp.int32).at[:, 0].set(state)  # window order: the root, then the nodes
    tokens, valid = [], []
    for i in range(n):  # parents come before their children
        parent = states[rows, jnp.clip(proposal.parents[:, i] + 1, 0, i)]
        forced = jnp.where(parent >= 0, tables.forced[jnp.maximum(parent, 0)], -1)
        if spelling is not None:
            slot = jnp.where(parent >= 0, tables.spelled[jnp.maximum(parent, 0)], -1)
            learned = jnp.where(slot >= 0, spelling[rows, jnp.maximum(slot, 0)], -1)
            learned_ok = (learned >= 0) & (advance(tables, parent, learned) >= 0)
            forced = jnp.where((forced >= 0) & learned_ok, learned, forced)
        own = proposal.valid[:, i] & (advance(tables, parent, proposal.tokens[:, i]) >= 0)
        token = jnp.where(own | (forced < 0), proposal.tokens[:, i], forced)
        after = advance(tables, parent, token)
        ok = (own | (forced >= 0)) & (after >= 0)
        states = states.at[:, i + 1].set(jnp.where(ok, after, -1))
        tokens.append(token)
        valid.append(ok)
    return dataclasses.replace(proposal, tokens=jnp.stack(tokens, axis=1).astype(jnp.int32),
                               valid=jnp.stack(valid, axis=1))


def window_states(tables: GrammarTables, state: jax.Array, tree) -> jax.Array:
    """int32 ``[B, W]``: the state after the path to each entry of a verify window
    (``jaxspec.tree.Tree``), the root's being ``state`` int32 ``[B]`` (the row's state after
    its committed text); -1 under a node whose token its parent's state does not allow."""
    rows = jnp.arange(state.shape[0])
    states = jnp.full(tree.tokens.shape, -1, jnp.int32).at[:, 0].set(state)
    for i in range(1, tree.width):  # parents come before their children
        parent = states[rows, jnp.clip(tree.parent[:, i], 0, i - 1)]
        states = states.at[:, i].set(advance(tables, parent, tree.tokens[:, i]))
    return states


def chain_states(tables: GrammarTables, state: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32 ``[B, T + 1]``: ``state`` int32 ``[B]``, then the state after each of ``tokens``
    int32 ``[B, T]`` in turn (a chain: what a step emits)."""
    states = [state]
    for j in range(tokens.shape[1]):
        states.append(advance(tables, states[-1], tokens[:, j]))
    return jnp.stack(states, axis=1)


# ------------------------------------------------------------------------------ the host side


@dataclasses.dataclass(frozen=True)
class Automaton:
    """One pattern's automaton over one vocabulary, compressed (host, numpy).

    Attributes:
      source: what it was compiled from, for messages (``"regex '...'"``, ``"json_schema"``).
      token_class: int32 ``[V]``; next_state: int32 ``[n, C]`` (states 0..n-1, 0 the initial
        one; -1: not allowed); final: bool ``[n]``, the accepting states.
      forced: int32 ``[n]``, where the text from a state on is forced (every token the state
        allows is a prefix of one of them, and the state does not accept), the first token
        of the forced text as the tokenizer encodes it (if allowed; else the longest allowed
        token); -1 elsewhere (``forced_tokens``).
    """

    source: str
    token_class: np.ndarray
    next_state: np.ndarray
    final: np.ndarray
    forced: np.ndarray

    @property
    def n_states(self) -> int:
        return self.next_state.shape[0]


def _import_outlines():
    try:
        import outlines_core
    except ImportError as e:  # pragma: no cover - the models extra installs it
        raise ImportError("structured output (regex=, response_format=) needs outlines-core: "
                          "pip install 'jaxspec[models]' (or outlines-core==0.2.14)") from e
    return outlines_core


_VOCABULARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> outlines Vocabulary
_AUTOMATA: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {pattern: Automaton}


def _vocabulary(tokenizer):
    """outlines-core's ``Vocabulary`` of ``tokenizer``: each token's decoded bytes (special
    tokens, which decode to nothing, are left out), and as its end-of-sequence id one past the
    vocabulary (dropped again: which ids end a row is the request's, ``compile_tables``)."""
    if tokenizer not in _VOCABULARIES:
        oc = _import_outlines()
        ids: dict[bytes, list[int]] = {}
        for i, b in enumerate(tokenizer.token_bytes()):
            if b:
                ids.setdefault(b, []).append(i)
        _VOCABULARIES[tokenizer] = oc.Vocabulary(tokenizer.vocab_size, ids)
    return _VOCABULARIES[tokenizer]


def schema_regex(schema: Any) -> str:
    """The regex of a JSON Schema (a dict or its JSON text), by outlines-core
    (``build_regex_from_schema``), with ``WHITESPACE`` between JSON's tokens.

    Raises:
      ValueError: a schema that is not JSON, or that outlines-core does not support (its
        message names the unsupported part).
    """
    oc = _import_outlines()
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"response_format: the JSON schema is not JSON-serialisable: {e}") from e
    try:
        return oc.json_schema.build_regex_from_schema(text, WHITESPACE)
    except Exception as e:  # outlines-core raises ValueError/TypeError with what it does not support
        raise ValueError(f"response_format: the JSON schema cannot be compiled: {e}") from e


def compile_pattern(pattern: str, tokenizer, source: str | None = None) -> Automaton:
    """The ``Automaton`` of regex ``pattern`` over ``tokenizer``'s vocabulary (cached per
    tokenizer and pattern).

    Raises:
      ValueError: a pattern outlines-core cannot compile, more than ``MAX_STATES`` states,
        or one whose first state allows no token of this vocabulary.
    """
    cache = _AUTOMATA.setdefault(tokenizer, {})
    if pattern in cache:
        return cache[pattern]
    source = source or f"regex {pattern!r:.80}"
    vocab = _vocabulary(tokenizer)
    oc = _import_outlines()
    try:
        # End-anchored: outlines-core's index comes from regex-automata's leftmost-first DFA,
        # whose match states do not continue into a repetition through a state that is not a
        # match (unanchored, 'a(x1)*' allowed only "a": outlines-core 0.2.10-0.2.14); anchored
        # at the end, every continuation of the pattern is in the index.
        index = oc.Index(f"(?:{pattern})$", vocab)
    except Exception as e:
        if "incompatible" in str(e):  # outlines-core found a character no token can spell
            raise ValueError(f"{source} admits no token sequence of the vocabulary of {tokenizer.name}: {e}") from e
        try:  # outlines-core's parse errors do not say where: Python's do, for the syntax the two share
            re.compile(pattern)
        except re.error as syntax:
            raise ValueError(f"{source} is not a valid regular expression: {syntax}") from e
        raise ValueError(f"{source} cannot be compiled over the vocabulary of {tokenizer.name} (outlines-core "
                         f"supports no lookaround or backreference): {e}") from e
    transitions = index.get_transitions()  # {state: {token: next state}}
    first = index.get_initial_state()
    order = [first] + sorted(set(transitions) - {first})
    if len(order) > MAX_STATES:
        raise ValueError(f"{source} compiles to {len(order)} automaton states, over the limit of {MAX_STATES} "
                         f"(jaxspec.grammar.MAX_STATES): simplify the pattern or schema")
    number = {s: i for i, s in enumerate(order)}
    v = tokenizer.vocab_size
    edges = []  # per state: (token ids, next states), the end-of-sequence id dropped
    for s in order:
        d = transitions.get(s, {})
        tok = np.fromiter(d.keys(), np.int64, len(d))
        nxt = np.fromiter((number[t] for t in d.values()), np.int64, len(d))
        keep = tok < v
        edges.append((tok[keep], nxt[keep]))
    # Classes: tokens with equal columns (next state, or -1, in every state). A 64-bit hash of
    # each column, built state by state (memory O(V)), then checked exactly.
    h = np.zeros(v, np.uint64)
    with np.errstate(over="ignore"):
        for tok, nxt in edges:
            col = np.zeros(v, np.uint64)
            col[tok] = nxt.astype(np.uint64) + np.uint64(1)
            h = h * np.uint64(0x100000001B3) + col
    _, first_of, token_class = np.unique(h, return_index=True, return_inverse=True)
    table = np.full((len(order), len(first_of)), -1, np.int32)
    for i, (tok, nxt) in enumerate(edges):
        table[i, token_class[tok]] = nxt
        col = np.full(v, -1, np.int64)
        col[tok] = nxt
        if not np.array_equal(table[i][token_class], col):  # a hash collision: never seen
            raise RuntimeError(f"{source}: token classes collided; please report this pattern")
    final = np.zeros(len(order), bool)
    final[[number[s] for s in index.get_final_states() if s in number]] = True
    if not np.any(table[0] >= 0) and not final[0]:
        raise ValueError(f"{source} admits no token of the vocabulary of {tokenizer.name}")
    token_class = token_class.astype(np.int32).ravel()
    automaton = Automaton(source, token_class, table, final, forced_tokens(table, token_class, final, tokenizer))
    cache[pattern] = automaton
    return automaton


MAX_FORCED_CHOICES = 32  # a state allowing more tokens than this is never forced (a prefix chain is shorter)
MAX_FORCED_BYTES = 64  # the forced text tokenized to pick a state's forced token


def forced_tokens(table: np.ndarray, token_class: np.ndarray, final: np.ndarray, tokenizer) -> np.ndarray:
    """int32 ``[n]``: each state's forced token (``Automaton.forced``), -1 where the text is
    not forced. A state forces text when every token it allows is a prefix of the longest
    one (so every continuation starts with that token's bytes); following longest tokens
    gives the forced text (up to ``MAX_FORCED_BYTES``), which the tokenizer encodes: its
    first token, the one the model most likely writes, is proposed where the state allows
    it."""
    n = table.shape[0]
    sizes = np.bincount(token_class, minlength=table.shape[1])
    data = tokenizer.token_bytes()
    longest = np.full(n, -1, np.int32)
    for s in range(n):
        classes = np.nonzero(table[s] >= 0)[0]
        if final[s] or not 0 < sizes[classes].sum() <= MAX_FORCED_CHOICES:
            continue
        ids = np.nonzero(np.isin(token_class, classes))[0]
        top = max(ids, key=lambda t: len(data[t]))
        if all(data[top].startswith(data[t]) for t in ids):
            longest[s] = top
    forced = longest.copy()
    for s in np.nonzero(longest >= 0)[0]:
        text, state = b"", s
        while state >= 0 and longest[state] >= 0 and len(text) < MAX_FORCED_BYTES:
            text += data[longest[state]]
            state = table[state, token_class[longest[state]]]
        try:
            ids = tokenizer.encode(text.decode("utf-8"), add_bos=False)
        except UnicodeDecodeError:  # the forced bytes end inside a character: keep the longest token
            continue
        if ids and table[s, token_class[ids[0]]] >= 0:
            forced[s] = ids[0]
    return forced


def compile_grammar(regex: str | None, response_format: dict | None, tokenizer) -> Automaton | None:
    """The ``Automaton`` of one prompt's ``regex`` or ``response_format`` (vLLM's and the
    OpenAI API's names), or None when it has neither (or ``{"type": "text"}``).

    ``response_format``: ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
    {...}}}`` (OpenAI; a ``json_schema`` without a ``"schema"`` key is taken as the schema
    itself), ``{"type": "json_object"}`` (any JSON object) or ``{"type": "text"}``.

    Raises:
      ValueError: both given, a ``response_format`` of another shape, a schema or regex that
        cannot be compiled (``compile_pattern``, ``schema_regex``), no tokenizer.
    """
    if regex is not None and response_format is not None:
        raise ValueError("regex and response_format together: give one of them")
    if regex is None and response_format is None:
        return None
    if tokenizer is None:
        raise ValueError("regex= and response_format= need a tokenizer (the model has none): pass tokenizer=")
    if regex is not None:
        return compile_pattern(regex, tokenizer)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return compile_pattern(schema_regex({"type": "object"}), tokenizer, "response_format json_object")
    if kind != "json_schema" or not isinstance(response_format.get("json_schema"), dict):
        raise ValueError(f"response_format must be {{'type': 'json_schema', 'json_schema': {{...}}}}, "
                         f"{{'type': 'json_object'}} or {{'type': 'text'}}, got {response_format!r:.120}")
    spec = response_format["json_schema"]
    schema = spec["schema"] if "schema" in spec else spec
    return compile_pattern(schema_regex(schema), tokenizer, "response_format json_schema")


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class HostTables:
    """``GrammarTables`` in numpy, as ``tables`` builds them (``device`` places them)."""

    token_class: np.ndarray
    next_state: np.ndarray
    live: np.ndarray
    forced: np.ndarray
    spelled: np.ndarray
    slots: np.ndarray
    final: np.ndarray  # bool [G]: accepting states (the free state counts as accepting)
    initial: np.ndarray  # int32 [B]

    def device(self) -> GrammarTables:
        return GrammarTables(*(jnp.asarray(x) for x in (self.token_class, self.next_state, self.live, self.forced,
                                                         self.spelled, self.slots, self.initial)))

    def run(self, row: int, tokens: Sequence[int]) -> int:
        """The state of row ``row`` after ``tokens`` (-1 once one was not allowed)."""
        s = int(self.initial[row])
        for t in tokens:
            if s < 0:
                break
            s = int(self.next_state[s, self.token_class[t]])
        return s


def tables(automata: Sequence[Automaton | None], stop_ids: Sequence[int], vocab_size: int) -> HostTables:
    """One table for a call's rows, ``automata[b]`` row b's (None: no grammar), with the
    request's ``stop_ids`` allowed at accepting states.

    Raises:
      ValueError: more than ``MAX_STATES`` states in all.
    """
    distinct: list[Automaton] = []
    for a in automata:
        if a is not None and all(a is not d for d in distinct):
            distinct.append(a)
    total = sum(a.n_states for a in distinct)
    if total > MAX_STATES:
        raise ValueError(f"the call's grammars have {total} automaton states together, over the limit of "
                         f"{MAX_STATES} (jaxspec.grammar.MAX_STATES)")
    stops = np.array(sorted({int(i) for i in stop_ids}), np.int64)
    # Each grammar's columns, the stop ids' made their own (allowed, keeping the state, at
    # accepting states) ...
    columns, keys = [], []
    for a in distinct:
        nxt, cls = a.next_state, a.token_class.astype(np.int64).copy()
        if cls.size > vocab_size:
            raise ValueError(f"{a.source}: the tokenizer has {cls.size} tokens, the model {vocab_size}")
        if cls.size < vocab_size:  # ids past the tokenizer's (a padded embedding): never allowed
            nxt = np.concatenate([nxt, np.full((nxt.shape[0], 1), -1, np.int32)], axis=1)
            cls = np.concatenate([cls, np.full(vocab_size - cls.size, nxt.shape[1] - 1)])
        if stops.size:
            extra = nxt[:, cls[stops]].copy()  # [n, E]
            at_final = a.final[:, None] & (extra < 0)
            extra = np.where(at_final, np.arange(a.n_states)[:, None], extra)
            cls[stops] = nxt.shape[1] + np.arange(stops.size)
            nxt = np.concatenate([nxt, extra], axis=1)
        columns.append(nxt)
        keys.append(cls)
    # ... then a class of the call per combination of the grammars' classes.
    if keys:
        combo, token_class = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
        token_class = token_class.ravel()
    else:
        combo, token_class = np.zeros((1, 0), np.int64), np.zeros(vocab_size, np.int64)
    n_classes = combo.shape[0]
    s_bucket, c_bucket = _bucket(total + 1, MIN_STATES), _bucket(n_classes, MIN_CLASSES)
    next_state = np.full((s_bucket, c_bucket), -1, np.int32)
    next_state[0, :n_classes] = 0  # the free state
    final = np.zeros(s_bucket, bool)
    final[0] = True
    forced = np.full(s_bucket, -1, np.int32)
    offset, start = 1, {}
    for k, (a, nxt) in enumerate(zip(distinct, columns)):
        block = nxt[:, combo[:, k]]  # [n, classes of the call]
        next_state[offset:offset + a.n_states, :n_classes] = np.where(block >= 0, block + offset, -1)
        final[offset:offset + a.n_states] = a.final
        # an accepting state that allows no text forces the (first) stop id: the text is complete
        done = a.final & ~np.any(a.next_state >= 0, axis=1)
        forced[offset:offset + a.n_states] = np.where(done & (stops.size > 0), stops[0] if stops.size else -1,
                                                      a.forced)
        start[id(a)] = offset
        offset += a.n_states
    initial = np.array([0 if a is None else start[id(a)] for a in automata], np.int32)
    live = np.any(next_state >= 0, axis=1)
    distinct_forced = np.unique(forced[forced >= 0])
    slots = np.full(_bucket(distinct_forced.size, MIN_SLOTS), -1, np.int32)
    slots[: distinct_forced.size] = distinct_forced
    spelled = np.where(forced >= 0, np.searchsorted(distinct_forced, forced), -1).astype(np.int32)
    return HostTables(token_class.astype(np.int32), next_state, live, forced, spelled, slots, final, initial)
