"""Model tests: KV-cache decoding equals the full forward pass; critic freezing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import (Critic, ModelConfig, Transformer, default_positions,
                                        init_cache)
from sao_jax.train.batch import Batch
from sao_jax.train import optim, steps

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_seq_len=32)


@pytest.mark.slow
def test_kv_cache_decoding_equals_full_forward():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, CFG.vocab_size)
  full, _ = model(tokens, default_positions(tokens))
  # prefill 5 tokens, then decode one at a time; rows at the same offsets
  cache = init_cache(CFG, 3, 20)
  logits, cache = model(tokens[:, :5], default_positions(tokens[:, :5]), cache)
  outs = [logits]
  for t in range(5, 12):
    step_logits, cache = model(tokens[:, t:t + 1], jnp.full((3, 1), t, jnp.int32), cache)
    outs.append(step_logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_kv_cache_rows_at_different_positions():
  """Each row decodes at its own offset (continuous batching): row 1 is 3 tokens behind."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, CFG.vocab_size)
  full, _ = model(tokens, default_positions(tokens))
  cache = init_cache(CFG, 2, 16)
  # row 0 prefilled with 6 tokens, row 1 with 3: prefill each row separately into its slot
  c0 = init_cache(CFG, 1, 16)
  _, c0 = model(tokens[:1, :6], default_positions(tokens[:1, :6]), c0)
  c1 = init_cache(CFG, 1, 16)
  _, c1 = model(tokens[1:, :3], default_positions(tokens[1:, :3]), c1)
  cache = [(jnp.concatenate([a[0], b[0]]), jnp.concatenate([a[1], b[1]])) for a, b in zip(c0, c1)]
  pos = np.array([6, 3])
  for _ in range(4):
    tok = tokens[jnp.arange(2), pos][:, None]
    logits, cache = model(tok, jnp.asarray(pos)[:, None], cache)
    np.testing.assert_allclose(logits[0, 0], full[0, pos[0]], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[1, 0], full[1, pos[1]], atol=2e-5, rtol=1e-5)
    pos = pos + 1


def test_frozen_critic_attention_is_bit_identical_after_k_updates():
  critic = Critic(CFG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(critic)
  params = nnx.to_pure_dict(params)
  tx = optim.make_optimizer(params, lr=1e-2, frozen_patterns=(r"/attn/",))
  state = steps.TrainState.create(params, tx)
  before = jax.tree.map(np.array, params)
  step = jax.jit(functools.partial(steps.critic_update, graphdef, tx), donate_argnums=0)
  tokens = jax.random.randint(jax.random.key(3), (4, 16), 0, CFG.vocab_size)
  mask = jnp.ones((4, 16)).at[:, 0].set(0)
  batch = Batch.of(tokens, mask)
  targets = {"returns": mask * 1.0, "values": mask * 0.0}
  for _ in range(2):
    state, metrics = step(state, batch, targets)
  assert np.isfinite(float(metrics["value_loss"]))
  flat_before = dict((optim.param_path(p), v) for p, v in
                     jax.tree_util.tree_flatten_with_path(before)[0])
  n_frozen = n_moved = 0
  for p, v in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    path = optim.param_path(p)
    if "/attn/" in path:
      n_frozen += 1
      np.testing.assert_array_equal(np.asarray(v), flat_before[path])
    elif not np.array_equal(np.asarray(v), flat_before[path]):
      n_moved += 1
  assert n_frozen == 2 * 6  # q,k,v,o projections + q/k norms in each of 2 layers
  assert n_moved >= 10      # MLPs, norms, embedding, value head all train
  # no Adam moments allocated for frozen leaves
  n_moment_leaves = sum(x.size for x in jax.tree.leaves(state.opt_state) if hasattr(x, "size"))
  n_trainable = sum(np.size(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]
                    if "/attn/" not in optim.param_path(p))
  assert 2 * n_trainable <= n_moment_leaves < 2 * n_trainable + 10


def test_freeze_pattern_matching_nothing_fails_loudly():
  params = nnx.to_pure_dict(nnx.split(Critic(CFG, rngs=nnx.Rngs(0)))[1])
  with pytest.raises(ValueError, match="matched no parameter"):
    optim.make_optimizer(params, lr=1e-3, frozen_patterns=("/attention_typo/",))


def test_config_rejects_bad_heads():
  with pytest.raises(ValueError, match="n_kv_heads"):
    ModelConfig(vocab_size=10, n_heads=3, n_kv_heads=2)


@pytest.mark.slow
def test_blocked_training_attention_equals_one_block_over_the_cache():
  """150 tokens: the no-cache forward attends in query blocks of 64 rows (64, 64, 22), each over
  the keys up to its last row only; a KV-cache prefill of the same tokens attends in one block
  over the whole cache. Logits and parameter gradients agree."""
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(params)
  tokens = jax.random.randint(jax.random.key(3), (2, 150), 0, CFG.vocab_size)

  def loss(p, cache):
    logits, _ = nnx.merge(graphdef, p)(tokens, default_positions(tokens), cache)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * jnp.linspace(0, 1, 150)), logits

  (_, blocked), g_blocked = jax.value_and_grad(loss, has_aux=True)(params, None)
  (_, one), g_one = jax.value_and_grad(loss, has_aux=True)(params, init_cache(CFG, 2, 160))
  np.testing.assert_allclose(blocked, one, atol=2e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_one)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
