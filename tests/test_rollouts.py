"""Rollouts for RL post-training: the policy's weights change every step, the program stays.

A training loop samples with ``generate``, takes a gradient step and samples again with the
new params. Params are an input of the compiled program, never a static, so new values of the
same shapes and dtypes reuse it (``Metrics.compiled`` says when a call compiled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxspec
from jaxspec import models
from jaxspec.cache import KVCache

PROMPT = [5, 6, 7, 8, 5, 6]
GROUP = 4  # samples per prompt
NEW = 12


def _nll(params, cfg, tokens):
    """Mean next-token negative log-likelihood of ``tokens [B, T]`` (teacher forcing)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t - 1), (b, t - 1))
    out = models.forward(params, cfg, tokens[:, :-1], positions, KVCache.zeros(cfg, b, t - 1, jnp.float32))
    logp = jax.nn.log_softmax(out.logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def test_ten_optax_updates_compile_once(tiny):
    """Ten rollouts, each after an Adam step on the last rollout's likelihood: the first call
    may compile, the nine others must not (``_COMPILED`` does not grow; the step's greedy
    speculative and plain calls neither); the weights do move
    (the greedy rollout changes), and speculative greedy output stays the new target's own."""
    params, opt = tiny.params, optax.adam(3e-2)
    opt_state = opt.init(params)
    drafter = jaxspec.NGramDrafter(gamma=3, max_n=3, min_n=1)
    compiled, greedy = [], []
    for step in range(10):
        kw = dict(config=tiny.cfg, max_new_tokens=NEW, ignore_eos=True)
        res = jaxspec.generate(params, [PROMPT], drafter=drafter, n=GROUP, temperature=1.0, seed=step, **kw)
        spec = jaxspec.generate(params, [PROMPT], drafter=drafter, **kw)
        plain = jaxspec.generate(params, [PROMPT], **kw)
        compiled.append((any(r.metrics.compiled for r in (res, spec, plain)), len(jaxspec.api._COMPILED)))
        spec, plain = spec.tokens, plain.tokens
        assert spec == plain, step  # exactness holds for whatever weights the call is given
        greedy.append(plain[0])
        batch = jnp.asarray([PROMPT + t for t in res.tokens])
        grads = jax.grad(_nll)(params, tiny.cfg, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert not any(c for c, _ in compiled[1:]), compiled
    assert len({n for _, n in compiled}) == 1, compiled  # the program count never moved after step 0
    assert len({tuple(g) for g in greedy}) > 1  # the updates changed what the policy generates


def test_new_dtype_compiles_and_says_so(tiny):
    """Params of another dtype are another program: the call compiles and its metrics say so."""
    kw = dict(config=tiny.cfg, max_new_tokens=NEW, ignore_eos=True)
    jaxspec.generate(tiny.params, [PROMPT], **kw)
    again = jaxspec.generate(jax.tree_util.tree_map(lambda x: x * 1.0, tiny.params), [PROMPT], **kw)
    assert not again.metrics.compiled and again.metrics.summary()["compiled"] is False
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tiny.params)
    res = jaxspec.generate(half, [PROMPT], **kw)
    assert res.metrics.compiled and res.metrics.compile_s > 0
    assert np.isfinite(res.metrics.host_s) and res.metrics.host_s >= 0
