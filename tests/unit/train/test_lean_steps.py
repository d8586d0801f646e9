"""Memory-lean train steps (issue 31): chunked log-probs from hidden states at action tokens,
frozen critic leaves outside the differentiated set, one critic forward for the targets and the
first critic update.

References are the full computations these replace: ``token_logprobs_and_entropy`` on the
``[B, T, V]`` logits (``train.logprob_chunk = 0``), ``critic_update`` with every leaf
differentiated (``frozen_patterns=()``), and ``advantage_targets`` followed by ``critic_update``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import presets
from sao_jax.models.transformer import Transformer, default_positions
from sao_jax.train import optim, steps
from sao_jax.train.batch import Batch, build_batch
from sao_jax.train.learner import Learner, _to_host

import sharding_helpers as H  # noqa: E402  pylint: disable=wrong-import-position

TOL = 1e-5
B, T, V = 4, 21, 97


def _policy(tie: bool):
  cfg = presets.get_preset("tiny-qwen3", tie_embeddings=tie, vocab_size=V)
  g, st = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  return g, nnx.to_pure_dict(st)


def _data(seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  where = rng.random((B, T)) < 0.4
  where[0] = False  # a row without any needed position
  where[1, 1:] = True  # a row needing every position
  weights = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
  return tokens, jnp.asarray(where), weights


def _assert_trees_close(got, want, tol=TOL):
  """Every leaf within ``tol`` x max(1, max |want leaf|)."""
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(1.0, float(np.abs(b).max()))
    assert np.abs(a - b).max() <= tol * scale, (jax.tree_util.keystr(path),
                                                 float(np.abs(a - b).max()), scale)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_chunked_logprobs_and_entropy_equal_the_full_computation(tie):
  """Values at the needed positions (0 elsewhere) and gradients w.r.t. every parameter equal the
  full [B, T, V] path within 1e-5, for chunk sizes that divide T = 21 (7, 21), that do not (4),
  and one larger than T (30); the entropy's gradient flows only with entropy="grad"."""
  g, params = _policy(tie)
  tokens, where, w = _data()
  temp = 0.7

  def full(p):
    logits, _ = nnx.merge(g, p)(tokens, default_positions(tokens))
    return steps.token_logprobs_and_entropy(logits, tokens, temp)

  def loss(p, chunk, entropy):
    logp, ent = steps.policy_logprobs(g, p, tokens, where, chunk=chunk, temperature=temp,
                                      entropy=entropy)
    return (logp * w).sum() + (0.0 if ent is None else 0.3 * (ent * w).sum()), (logp, ent)

  ref_logp, ref_ent = jax.jit(full)(params)
  mask = np.asarray(where).copy()
  mask[:, 0] = False
  ref_grads = jax.jit(jax.grad(lambda p: (jnp.where(mask, full(p)[0], 0.0) * w).sum()
                               + 0.3 * (jnp.where(mask, full(p)[1], 0.0) * w).sum()))(params)
  fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(1, 2))
  for chunk in (4, 7, 21, 30):
    (_, (logp, ent)), grads = fn(params, chunk, "grad")
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(ref_logp)[mask], atol=TOL,
                               rtol=TOL)
    np.testing.assert_allclose(np.asarray(ent)[mask], np.asarray(ref_ent)[mask], atol=TOL,
                               rtol=TOL)
    assert np.all(np.asarray(logp)[~mask] == 0) and np.all(np.asarray(ent)[~mask] == 0)
    _assert_trees_close(grads, ref_grads)
  # entropy "off": log-probs alone; "metric": the same values, no gradient through the entropy
  (_, (logp_off, ent_off)), _ = fn(params, 4, "off")
  assert ent_off is None
  np.testing.assert_allclose(np.asarray(logp_off), np.asarray(logp), rtol=1e-6)
  metric_grads = jax.grad(lambda p: loss(p, 4, "metric")[0])(params)
  logp_grads = jax.grad(lambda p: loss(p, 4, "off")[0])(params)
  _assert_trees_close(metric_grads, logp_grads, tol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_chunked_logprobs_in_bfloat16(tie):
  """bfloat16 params and compute: the chunked path gives the full path's log-probs (the same
  logits per position) and gradients of the same dtype within bfloat16 rounding (head gradients
  accumulate over chunks in float32)."""
  cfg = presets.get_preset("tiny-qwen3", tie_embeddings=tie, vocab_size=V, dtype="bfloat16",
                           param_dtype="bfloat16")
  g, st = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(st)
  tokens, where, w = _data()

  def loss(p, chunk):
    logp, ent = steps.policy_logprobs(g, p, tokens, where, chunk=chunk, entropy="grad")
    return (logp * w).sum() + 0.3 * (ent * w).sum(), logp

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, ref), ref_g = fn(params, 0)
  (_, got), got_g = fn(params, 5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(ref_g)):
    assert a.dtype == b.dtype == jnp.bfloat16
  _assert_trees_close(jax.tree.map(lambda x: x.astype(jnp.float32), got_g),
                      jax.tree.map(lambda x: x.astype(jnp.float32), ref_g), tol=2e-2)


def test_chunks_without_needed_positions_are_skipped():
  """Each row's needed positions move to its front, so with at most 3 per row and 2 positions
  per chunk only the first 2 of ceil(21 / 2) = 11 chunks run the LM head, in the forward and in
  the backward alike (counted by a callback inside the head)."""
  g, params = _policy(True)
  tokens, _, w = _data()
  where = np.zeros((B, T), bool)
  where[0, [3, 9, 20]] = True
  where[2, [5, 6]] = True
  calls = []
  model_head, leaves = steps.lm_head_of(g, params, jnp.zeros((1, 1, 64)))

  def head(ls, h):
    jax.debug.callback(lambda: calls.append(1))
    return model_head(ls, h)

  def loss(ls, hidden):
    logp, _ = steps.hidden_logprobs(head, ls, hidden, tokens, jnp.asarray(where), chunk=2)
    return (logp * w).sum()

  hidden, _ = nnx.merge(g, params).hidden(tokens, default_positions(tokens))
  jax.block_until_ready(jax.jit(loss)(leaves, hidden))
  assert len(calls) == 2
  calls.clear()
  jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(leaves, hidden))
  assert len(calls) == 4  # 2 chunks forward, the same 2 recomputed backward


def test_chunk_positions_per_device():
  assert steps.chunk_positions(512, 16, 96) == 32
  assert steps.chunk_positions(512, 16, 96, row_shards=8) == 96  # 2 rows per device, capped at T
  assert steps.chunk_positions(3, 16, 96) == 1
  assert steps.chunk_positions(0, 16, 96) == 0
  with pytest.raises(ValueError, match="train.logprob_chunk"):
    steps.chunk_positions(-1, 16, 96)


def _batch(seed=0):
  pg, pp, cg, cp = H.make_models()
  return pg, pp, cg, cp, build_batch(H.make_trajectories(pg, pp, rows=H.ROWS, seed=seed), 0,
                                     length=H.LENGTH)


@pytest.mark.parametrize("setting", [
    dict(),
    dict(entropy_coef=0.1, kl=True, microbatches=2, minibatches=2, objective="ppo_clip"),
], ids=["dis", "entropy_kl_micro_mini"])
@pytest.mark.slow
def test_policy_update_equals_the_full_logits_path(setting):
  """One policy update (DIS; PPO with an entropy bonus, a KL term, 2 micro-batches and 2
  mini-batches): loss, every metric and the updated params equal ``logprob_chunk=0``."""
  setting = dict(setting)
  pg, pp, _, _, batch = _batch()
  kl = setting.pop("kl", False)
  objective = setting.pop("objective", "dis")
  kwargs = dict(eps_low=0.2, eps_high=0.28) if objective == "ppo_clip" else dict(eps_low=0.3,
                                                                                eps_high=5.0)
  if "entropy_coef" in setting:
    kwargs.update(entropy_coef=setting.pop("entropy_coef"), kl_coef=0.5)
  tx = optim.make_optimizer(pp, lr=1e-3, eps=1e-5)  # Adam's eps 1e-8 amplifies ~0 gradients' noise
  adv = jnp.where(batch.action_mask, jnp.asarray(
      np.random.default_rng(1).normal(size=batch.tokens.shape), jnp.float32), 0.0)
  out = {}
  for chunk in (0, 24):
    fn = jax.jit(functools.partial(steps.policy_update, pg, tx, objective=objective,
                                   objective_kwargs=kwargs, temperature=1.0,
                                   logprob_chunk=chunk, **setting))
    state = steps.TrainState.create(pp, tx)
    out[chunk] = fn(state, batch, adv, pp if kl else None)
  (s0, m0), (s1, m1) = out[0], out[24]
  assert set(m0) == set(m1)
  for k in m0:
    np.testing.assert_allclose(np.asarray(m1[k]), np.asarray(m0[k]), atol=TOL, rtol=TOL,
                               err_msg=k)
  assert float(m0["entropy"]) > 0.01  # the entropy metric is computed, not 0
  _assert_trees_close(s1.params, s0.params)
  assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(pp))) > 1e-4


@pytest.mark.slow
def test_compiled_policy_step_never_holds_the_full_logits():
  """Temp bytes of one compiled policy step (XLA's ``memory_analysis``) at B x T = 8 x 64 and a
  8192-token vocabulary: the chunked path (64 tokens per chunk) saves more than one float32
  [B, T, V] array (16 MiB) against the full path."""
  cfg = presets.get_preset("tiny-qwen3", vocab_size=8192, max_seq_len=64)
  pg, st = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  params = nnx.to_pure_dict(st)
  tx = optim.make_optimizer(params, lr=1e-3)
  state = jax.eval_shape(lambda p: steps.TrainState.create(p, tx), params)
  rows, length = 8, 64
  batch = Batch.of(np.ones((rows, length), np.int32), np.ones((rows, length), bool))
  adv = jax.ShapeDtypeStruct((rows, length), jnp.float32)
  temp = {}
  for chunk in (0, 64):
    fn = jax.jit(functools.partial(steps.policy_update, pg, tx, objective="dis",
                                   objective_kwargs=dict(eps_low=0.3, eps_high=5.0),
                                   temperature=1.0, logprob_chunk=chunk))
    temp[chunk] = fn.lower(state, batch, adv, None).compile().memory_analysis().temp_size_in_bytes
  assert temp[0] - temp[64] > rows * length * 8192 * 4, temp


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, 2])
def test_frozen_leaves_are_not_differentiated(microbatches):
  """``critic_update`` with the optimizer's frozen patterns gives the same updated params as
  differentiating every leaf (the frozen attention unchanged), ``critic_grad_norm`` is the
  trainable leaves' norm, and the compiled step does fewer FLOPs (no attention weight
  gradients)."""
  _, _, cg, cp, batch = _batch()
  patterns = (r"/attn/",)
  tx = optim.make_optimizer(cp, lr=1e-3, frozen_patterns=patterns)
  targets = steps.advantage_targets(cg, cp, batch, estimator="skip_obs_gae", gamma=1.0,
                                    lam_policy="adaptive", lam_alpha=1.5, lam_critic=1.0,
                                    bootstrap_truncated=False, grpo_eps=1e-6)
  out, flops = {}, {}
  for name, pats in (("all", ()), ("trainable", patterns)):
    fn = jax.jit(functools.partial(steps.critic_update, cg, tx, microbatches=microbatches,
                                   frozen_patterns=pats))
    state = steps.TrainState.create(cp, tx)
    compiled = fn.lower(state, batch, targets).compile()
    cost = compiled.cost_analysis()
    flops[name] = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
    out[name] = compiled(state, batch, targets)
  (s_all, m_all), (s_tr, m_tr) = out["all"], out["trainable"]
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(s_tr.params)[0],
                          jax.tree.leaves(s_all.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7, rtol=0,
                               err_msg=jax.tree_util.keystr(path))
  for p, a, b in zip(jax.tree.leaves(optim.freeze_labels(cp, patterns)),
                     jax.tree.leaves(s_tr.params), jax.tree.leaves(cp)):
    if p == "frozen":
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(m_tr["value_loss"], m_all["value_loss"], rtol=1e-6)
  # the trainable norm: below the all-leaves norm by the attention's share
  assert 0.0 < float(m_tr["critic_grad_norm"]) < float(m_all["critic_grad_norm"])
  # the attention / rest split: 0 on frozen attention; the two parts make up the global norm
  assert float(m_tr["critic_grad_norm_attn"]) == 0.0
  assert float(m_all["critic_grad_norm_attn"]) > 0.0
  np.testing.assert_allclose(m_tr["critic_grad_norm_rest"], m_tr["critic_grad_norm"], rtol=1e-5)
  np.testing.assert_allclose(np.hypot(m_all["critic_grad_norm_attn"],
                                      m_all["critic_grad_norm_rest"]),
                             m_all["critic_grad_norm"], rtol=1e-5)
  assert flops["trainable"] < 0.97 * flops["all"], flops


@pytest.mark.parametrize("microbatches,extra", [
    (1, dict()),
    (2, dict(value_bounds=(0.0, 1.0), center_advantages=True, bootstrap_truncated=True)),
], ids=["plain", "micro_bounds_centred"])
@pytest.mark.slow
def test_targets_and_first_critic_update_share_one_forward(microbatches, extra):
  """``targets_and_critic_update`` = ``advantage_targets`` then ``critic_update`` (value
  clipping on): same targets, metrics and updated critic."""
  _, _, cg, cp, batch = _batch(seed=3)
  kw = dict(estimator="skip_obs_gae", gamma=1.0, lam_policy="adaptive", lam_alpha=1.5,
            lam_critic=1.0, bootstrap_truncated=False, grpo_eps=1e-6)
  kw.update(extra)
  tx = optim.make_optimizer(cp, lr=1e-3, frozen_patterns=(r"/attn/",))
  ckw = dict(value_clip_eps=0.05, microbatches=microbatches, frozen_patterns=(r"/attn/",))
  targets = jax.jit(functools.partial(steps.advantage_targets, cg, **kw))(cp, batch)
  ref_state, ref_m = jax.jit(functools.partial(steps.critic_update, cg, tx, **ckw))(
      steps.TrainState.create(cp, tx), batch, targets)
  state, m, got = jax.jit(functools.partial(steps.targets_and_critic_update, cg, tx,
                                            target_kwargs=kw, **ckw))(
      steps.TrainState.create(cp, tx), batch)
  for k in ("values", "advantages", "returns"):
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(targets[k]), atol=TOL, err_msg=k)
  assert set(m) == set(ref_m)
  for k in m:
    np.testing.assert_allclose(np.asarray(m[k]), np.asarray(ref_m[k]), atol=TOL, rtol=TOL,
                               err_msg=k)
  _assert_trees_close(state.params, ref_state.params)


@pytest.mark.slow
def test_learner_step_equals_the_unshared_full_path():
  """``Learner.step`` (targets inside the first critic update, chunked log-probs) against the
  same learner run the old way on ``logprob_chunk=0``: targets, then K = 2 critic updates, then
  the policy update. Metrics and both new states agree; the compiled steps are the ones used."""
  pg, pp, cg, cp = H.make_models()
  new = Learner(H.learner_config("sao"), pg, pp, cg, cp, pad_id=0, vocab_size=64)
  old = Learner(H.learner_config("sao", logprob_chunk=0), pg, pp, cg, cp, pad_id=0,
                vocab_size=64)
  for s in range(2):
    trajs = H.make_trajectories(pg, pp, seed=40 + s, version=s)
    got = new.train_step(trajs, s)
    batch, micro = old.batch(trajs)
    targets_fn, critic_fn, policy_fn, metrics_fn, _ = old.jitted_steps(micro)
    targets = targets_fn(old.critic.params, batch)
    for _ in range(2):
      old.critic, want = critic_fn(old.critic, batch, targets)
    old.policy, pm = policy_fn(old.policy, batch, targets["advantages"], None)
    want = _to_host({**want, **pm, **metrics_fn(batch, targets, jnp.int32(s))}, True)
    assert set(got) == set(want)
    for k, v in want.items():
      np.testing.assert_allclose(np.asarray(got[k], float), np.asarray(v, float), atol=TOL,
                                 rtol=TOL, err_msg=k)
  _assert_trees_close(new.policy.params, old.policy.params)
  _assert_trees_close(new.critic.params, old.critic.params)
  assert new.compilations() == {"critic": 1, "policy": 1, "metrics": 1, "first_critic": 1}
