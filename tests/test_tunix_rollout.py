"""jaxspec as Tunix's rollout engine (jaxspec.tunix_rollout) and Tunix's decoders as targets
(jaxspec.models.tunix), on a tiny random Tunix Qwen2.

Tunix is an optional extra with its own pins (google-tunix 0.1.7 holds safetensors below 0.8,
which takes transformers back to 5.12): it runs in its own environment, which .ci/run builds
(docs/rollouts.md, "Tunix"). Without it these tests skip.
"""

import dataclasses
import functools
import types

import numpy as np
import pytest

tunix = pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.qwen2 import model as qwen2  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.models.tunix import TunixTarget, load_qwen2, qwen2_module  # noqa: E402
from jaxspec.tunix_rollout import JaxspecRollout, TunixTokenizer  # noqa: E402

VOCAB = 264  # bytes + 3 + 5 spare


class ByteTokenizer:
    """Bytes shifted by 3 (0 pad, 1 BOS, 2 EOS): a tokenizer with Tunix's five methods."""

    def encode(self, text, **kw):
        return [b + 3 for b in text.encode()]

    def decode(self, ids, **kw):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    def bos_id(self):
        return 1

    def eos_id(self):
        return 2

    def pad_id(self):
        return 0


def tiny_qwen3(scale: float = 4.0) -> nnx.Module:
    """Tunix's Qwen3 (q/k norms) with 2 layers, scaled as ``tiny_qwen2``."""
    from tunix.models.qwen3 import model as qwen3

    cfg = qwen3.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                            num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=True)
    graphdef, state = nnx.split(qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * scale, state))


def tiny_qwen2(scale: float = 4.0) -> nnx.Module:
    """Tunix's Qwen2 with 2 layers; weights scaled up so greedy text varies (at Tunix's init
    scale a 64-wide model repeats one token)."""
    cfg = qwen2.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
                            num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=True)
    graphdef, state = nnx.split(qwen2.Qwen2(cfg, rngs=nnx.Rngs(0)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * scale, state))


def reference_greedy(module, prompt, n):
    """The module's own greedy tokens, each step the whole text again without a cache."""
    seq = list(prompt)
    for _ in range(n):
        t = len(seq)
        logits, _ = module(jnp.asarray([seq]), jnp.arange(t)[None], None, jnp.tril(jnp.ones((1, t, t), bool)))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tunix_target_decodes_as_the_module_and_speculation_keeps_it(family):
    module = {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3}[family]()
    target, params = TunixTarget.split(module, name="tiny-qwen2", max_position=256)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(3, VOCAB, n)] for n in (12, 7)]
    plain = jaxspec.generate(params, prompts, config=target, max_new_tokens=16)
    for p, out in zip(prompts, plain.tokens):
        assert out == reference_greedy(module, p, 16)
    assert len({t for row in plain.tokens for t in row}) > 4  # the text varies: a cache slip would show
    for drafter in (jaxspec.HistoryDrafter(), jaxspec.NGramDrafter(gamma=3)):
        spec = jaxspec.generate(params, prompts, config=target, max_new_tokens=16, drafter=drafter,
                                disable_by_batch_size=None)
        assert spec.tokens == plain.tokens, drafter.kind
        assert spec.metrics.speculation is None


def test_tunix_target_refuses_what_it_cannot_run():
    class Plain(nnx.Module):
        def __call__(self, tokens, positions, cache, mask):
            return tokens, cache

    with pytest.raises(ValueError, match="output_hidden_states"):
        TunixTarget.split(Plain(), name="plain", max_position=8)
    from tunix.models.gemma3 import model as gemma3

    module = nnx.eval_shape(lambda: gemma3.Gemma3(gemma3.ModelConfig.gemma3_270m(), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="sliding-window"):
        TunixTarget.split(module, name="gemma3", max_position=8)


def test_load_qwen2_gives_tunix_qwen2_jaxspecs_logits():
    """A tiny random jaxspec Qwen2 (norms and biases random too, so every mapping shows)
    written into Tunix's Qwen2 by ``load_qwen2``: Tunix's module gives jaxspec's decoder's
    logits (which tests/test_families.py checks against transformers'). ATOL 1e-4: float32
    on both sides in different summation orders, as there."""
    from jaxspec.cache import KVCache
    from jaxspec.config import ModelConfig
    from jaxspec.models.decoder import init_params

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                      rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, max_position=256, bos_id=1,
                      eos_ids=(2,), name="tiny-qwen2", family="qwen2", attn_bias=True)
    params = init_params(cfg, jax.random.key(0), scale=1.5)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    rand = lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape)  # noqa: E731
    params["layers"] = [{k: rand(v) if k in ("attn_norm", "mlp_norm", "bq", "bk", "bv") else v for k, v in layer.items()}
                        for layer in params["layers"]]
    params["final_norm"] = rand(params["final_norm"])
    tokens = [3, 17, 42, 5, 9, 60, 1, 33, 28, 11, 47, 2, 19, 55, 7, 38]
    t = len(tokens)
    ref = jaxspec.models.forward(params, cfg, jnp.asarray([tokens]), jnp.arange(t)[None],
                                 KVCache.zeros(cfg, 1, 32, jnp.float32)).logits[0]
    tcfg = qwen2.ModelConfig(num_layers=3, vocab_size=64, embed_dim=32, hidden_dim=48, num_heads=4, head_dim=8,
                             num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=True)
    module = qwen2.Qwen2(tcfg, rngs=nnx.Rngs(1))
    load_qwen2(module, params, cfg)
    logits, _ = module(jnp.asarray([tokens]), jnp.arange(t)[None], None, jnp.tril(jnp.ones((1, t, t), bool)))
    assert float(jnp.abs(ref).max()) > 1.0  # logits that differ across tokens, not a flat row
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="use_tied_embedding"):
        load_qwen2(qwen2.Qwen2(dataclasses.replace(tcfg, use_tied_embedding=False), rngs=nnx.Rngs(1)), params, cfg)
    built = qwen2_module(types.SimpleNamespace(config=cfg, params=params))  # the config derived, tied as cfg
    logits2, _ = built(jnp.asarray([tokens]), jnp.arange(t)[None], None, jnp.tril(jnp.ones((1, t, t), bool)))
    np.testing.assert_array_equal(np.asarray(logits2), np.asarray(logits))
    with pytest.raises(ValueError, match="RoPE theta"):
        load_qwen2(qwen2.Qwen2(dataclasses.replace(tcfg, rope_theta=500), rngs=nnx.Rngs(1)), params, cfg)


def test_tunix_tokenizer_of_a_jaxspec_model():
    class Tok:  # jaxspec's Tokenizer's encode/decode signature
        add_bos = False

        def encode(self, text, add_bos=None):
            return ([9] if add_bos else []) + [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    cfg = types.SimpleNamespace(eos_ids=(7, 8), bos_id=9)
    tok = TunixTokenizer.of(types.SimpleNamespace(tokenizer=Tok(), config=cfg))
    assert (tok.encode("ab"), tok.decode([104, 105]), tok.bos_id(), tok.eos_id(), tok.pad_id()) == \
        ([97, 98], "hi", None, 7, 9)
    Tok.add_bos = True  # a model whose prompts start with BOS: Tunix's sampler and the engine prepend it
    assert TunixTokenizer.of(types.SimpleNamespace(tokenizer=Tok(), config=cfg)).bos_id() == 9


def rollout_config(**kw):
    return base_rollout.RolloutConfig(**{"max_tokens_to_generate": 12, "temperature": 1.0, "top_p": 1.0,
                                         "max_prompt_length": 8, **kw})


def test_rollout_engine_samples_keeps_history_and_takes_new_weights():
    engine = JaxspecRollout(tiny_qwen2(), ByteTokenizer(), max_position=64, disable_by_batch_size=None)
    rc = rollout_config(return_logprobs=True)
    prompts = ["1+2=", "1+2=", "3*4=", "3*4="]
    out = engine.generate(prompts, rc)
    assert engine.compiled and engine.metrics[0].history_misses == 4  # nothing earlier yet
    assert out.left_padded_prompt_tokens.shape == (4, 8)
    assert out.left_padded_prompt_tokens[0].tolist() == [0, 0, 0, 1, 52, 46, 53, 64]  # pad, BOS, "1+2="
    assert out.logits is None and len(out.tokens) == 4
    for row, text in zip(out.tokens, out.text):
        assert row.dtype == np.int32 and 2 not in row.tolist() and text == ByteTokenizer().decode(row.tolist())
    # the engine's logprobs (of the distribution sampled from: T=1, no top-k/p, so the model's)
    # are the ones Tunix computes from the same weights; float32 sums in another order: 1e-4
    completion = np.stack([np.pad(r, (0, 12 - len(r))) for r in out.tokens])
    logps = engine.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(completion))
    for k, row in enumerate(out.tokens):
        np.testing.assert_allclose(np.asarray(logps[k, : len(row)]), out.logprobs[k], atol=1e-4)

    engine.generate(prompts, rc)
    assert not engine.compiled and engine.metrics[0].history_misses == 0
    assert len(engine.history.rollouts(out.left_padded_prompt_tokens[0][3:].tolist())) == 4

    greedy = rollout_config(temperature=0.0)
    before = engine.generate(prompts[:1], greedy).tokens[0].tolist()
    state = nnx.state(engine.model(), nnx.Param)
    engine.update_params(jax.tree.map(lambda x: x * 1.5, state), (nnx.Param,))
    after = engine.generate(prompts[:1], greedy)
    assert not engine.compiled
    assert after.tokens[0].tolist() != before
    assert after.tokens[0].tolist() == reference_greedy(engine.model(), [1, 52, 46, 53, 64], 12)[: len(after.tokens[0])]


def test_rollout_engine_in_calls_of_one_row_drafts_from_the_earlier_ones():
    engine = JaxspecRollout(tiny_qwen2(), ByteTokenizer(), max_position=64, rows_per_call=1)
    out = engine.generate(["1+2=", "1+2=", "3*4=", "3*4="], rollout_config())
    assert len(out.tokens) == 4 and out.left_padded_prompt_tokens.shape == (4, 8)
    assert [m.history_misses for m in engine.metrics] == [1, 0, 1, 0]  # a sibling's rollout is there
    assert engine.calls == 4 and [m.compiled for m in engine.metrics] == [True, False, False, False]


def test_rollout_engine_with_history_and_a_draft_model():
    """A HybridDrafter (the history where it matches, a draft model's chain elsewhere): the
    history fills, and greedy output is the module's own."""
    from jaxspec import models

    draft_cfg = jaxspec.ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                    ffn_dim=64, max_position=64, name="tiny-draft")
    hybrid = jaxspec.HybridDrafter(jaxspec.HistoryDrafter(), jaxspec.ModelDrafter(draft_cfg, gamma=3))
    engine = JaxspecRollout(tiny_qwen2(), ByteTokenizer(), max_position=64, drafter=hybrid, rows_per_call=1,
                            draft_params=models.init_params(draft_cfg, jax.random.key(1)))
    out = engine.generate(["1+2=", "1+2="], rollout_config())
    assert [m.history_misses for m in engine.metrics] == [1, 0] and len(engine.history) == 2
    greedy = engine.generate(["1+2="], rollout_config(temperature=0.0)).tokens[0].tolist()
    assert len(out.tokens) == 2 and greedy == reference_greedy(engine.model(), [1, 52, 46, 53, 64], 12)[: len(greedy)]


def test_rollout_engine_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="rows_per_call"):
        JaxspecRollout(tiny_qwen2(), ByteTokenizer(), rows_per_call=0)
    engine = JaxspecRollout(tiny_qwen2(), ByteTokenizer(), max_position=64)
    with pytest.raises(ValueError, match="max_prompt_length=8"):
        engine.generate(["a prompt longer than eight bytes"], rollout_config())
    with pytest.raises(ValueError, match="does not have"):
        engine.update_params({"no_such_weight": jnp.zeros(3)})


def test_tunix_grpo_learner_trains_with_jaxspec_rollouts():
    actor = tiny_qwen2(scale=0.25)  # samples vary (at Tunix's init scale it puts p ~ 1 on one token)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    roles = rl_cluster_lib.Role
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine=functools.partial(JaxspecRollout, max_position=64, disable_by_batch_size=None),
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.adam(1e-2), eval_every_n_steps=100,
                                                        max_steps=2),
        rollout_config=rollout_config())
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=None, tokenizer=ByteTokenizer(), cluster_config=config)
    engine = cluster.rollout
    assert isinstance(engine, JaxspecRollout)
    first = jax.tree.map(lambda x: np.array(x, copy=True), engine.params)

    def reward(prompts, completions, **kw):  # varies across a group (the lengths do not: no EOS in 12
        return [float(sum(c.encode()) % 5) for c in completions]  # tokens), so the advantages are not all 0

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward,
                                       algo_config=grpo_learner.GRPOConfig(num_generations=4, beta=0.0))
    learner.train([{"prompts": np.array(["1+2=", "3*4="])} for _ in range(2)])
    assert engine.calls == 2 and not engine.compiled  # step 2 reused step 1's program
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), engine.params, first)
    assert max(jax.tree.leaves(moved)) > 0  # the learner's update reached the rollout engine
