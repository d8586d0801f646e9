"""Shared pieces of the sharding / multi-host tests (imported by their subprocess workers).

* ``TinyMoELM`` / ``TinyMoECritic``: a minimal Mixture-of-Experts decoder (attention from
  ``sao_jax.models.transformer`` + a top-k routed SwiGLU expert MLP with dense dispatch), used
  because this branch has no MoE model yet. Expert weights are ``[E, D, F]`` / ``[E, F, D]``
  under ``.../moe/{gate,up,down}_proj`` and so get the ``expert`` logical axis.
* ``make_models`` / ``make_batch``: tiny dense or MoE policy + critic and a deterministic SAO
  batch (prompt, actions, an observation span, padding; rollout log-probs near the policy's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.transformer import Attention, Critic, ModelConfig, RMSNorm, Transformer
from sao_jax.models.transformer import default_positions
from sao_jax.train.optim import param_path
from sao_jax.train.sao import SAOConfig
from sao_jax.train.steps import token_logprobs

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=128, max_seq_len=32)
N_EXPERTS, TOP_K = 4, 2
# SAO settings of the multi-host test (default AdamW eps 1e-8; lr 1e-5 moves the params by
# ~3e-5 in 3 steps while Adam's amplification of float32 noise on near-zero gradients stays
# below 1e-5)
SAO_CFG = SAOConfig(policy_lr=1e-5, critic_lr=1e-5, critic_lr_warmup_steps=0, batch_length=32)
STEPS = 3


def flat(tree, prefix: str) -> dict[str, np.ndarray]:
  """{"prefix/layers/0/attn/q_proj/kernel": array, ...} of a params pytree."""
  return {f"{prefix}/{param_path(p)}": np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


class MoEMLP(nnx.Module):
  """Top-k routed SwiGLU experts, computed densely (every expert on every token, weighted by
  the renormalised top-k router probabilities; zero weight for unselected experts)."""

  def __init__(self, cfg: ModelConfig, n_experts: int, top_k: int, rngs: nnx.Rngs):
    d, f, e = cfg.d_model, cfg.d_ff, n_experts
    self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs)
    self.gate_proj = nnx.Param(nnx.initializers.normal(d ** -0.5)(rngs.params(), (e, d, f)))
    self.up_proj = nnx.Param(nnx.initializers.normal(d ** -0.5)(rngs.params(), (e, d, f)))
    self.down_proj = nnx.Param(nnx.initializers.normal(f ** -0.5)(rngs.params(), (e, f, d)))
    self.n_experts, self.top_k = n_experts, top_k

  def __call__(self, x):
    top_v, top_i = jax.lax.top_k(self.router(x), self.top_k)
    gates = jnp.sum(jax.nn.one_hot(top_i, self.n_experts) * jax.nn.softmax(top_v)[..., None], -2)
    h = (jax.nn.silu(jnp.einsum("btd,edf->btef", x, self.gate_proj[...]))
         * jnp.einsum("btd,edf->btef", x, self.up_proj[...]))
    y = jnp.einsum("btef,efd->bted", h, self.down_proj[...])
    return jnp.einsum("bted,bte->btd", y, gates)


class MoEBlock(nnx.Module):

  def __init__(self, cfg, rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
    self.moe = MoEMLP(cfg, N_EXPERTS, TOP_K, rngs)

  def __call__(self, x, positions):
    x = x + self.attn(self.attn_norm(x), positions)[0]
    return x + self.moe(self.mlp_norm(x))


class TinyMoELM(nnx.Module):
  """Decoder LM with MoE blocks; same call signature as ``Transformer`` (no KV cache)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.layers = nnx.List([MoEBlock(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps)

  def hidden(self, tokens, positions, cache=None):
    del cache
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x, positions)
    return self.final_norm(x), None

  def __call__(self, tokens, positions, cache=None):
    h, _ = self.hidden(tokens, positions)
    return self.embed.attend(h).astype(jnp.float32), None


class TinyMoECritic(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.backbone = TinyMoELM(cfg, rngs=rngs)
    self.value_head = nnx.Linear(cfg.d_model, 1, rngs=rngs)

  def __call__(self, tokens, positions):
    return self.value_head(self.backbone.hidden(tokens, positions)[0])[..., 0]


def make_models(moe: bool = False, seed: int = 0):
  """(policy_graphdef, policy_params, critic_graphdef, critic_params); params are pure dicts."""
  lm, critic = (TinyMoELM, TinyMoECritic) if moe else (Transformer, Critic)
  pg, pp = nnx.split(lm(CFG, rngs=nnx.Rngs(seed)))
  cg, cp = nnx.split(critic(CFG, rngs=nnx.Rngs(seed + 1)))
  cp = nnx.to_pure_dict(cp)
  # a non-zero value head so the critic gradient reaches the backbone in one step
  cp["value_head"]["kernel"] = 0.1 * jnp.ones_like(cp["value_head"]["kernel"])
  return pg, nnx.to_pure_dict(pp), cg, cp


def make_batch(policy_graphdef, policy_params, rows: int = 16, length: int = 32, seed: int = 0,
               version: int = 0) -> dict[str, np.ndarray]:
  """A deterministic SAO batch: prompt tokens 0..5, actions, a 4-token observation, more
  actions, then padding (row-dependent lengths; two rows have no actions at all). Rollout
  log-probs = the policy's own plus N(0, 0.2) noise, so some tokens leave the DIS band."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CFG.vocab_size, size=(rows, length)).astype(np.int32)
  action = np.zeros((rows, length), np.float32)
  rewards = np.zeros((rows, length), np.float32)
  for i in range(rows):
    end = 12 + (i * 5) % (length - 12)
    if i % 8 == 7:
      tokens[i, 8:] = 0
      continue
    action[i, 6:end] = 1.0
    action[i, 9:13] = 0.0  # observation span
    tokens[i, end:] = 0
    last = np.nonzero(action[i])[0]
    if last.size:
      rewards[i, last[-1]] = float(rng.integers(0, 2))
  model = nnx.merge(policy_graphdef, policy_params)
  logits, _ = model(jnp.asarray(tokens), default_positions(jnp.asarray(tokens)))
  logp = np.asarray(token_logprobs(logits, jnp.asarray(tokens)))
  logp = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32) * action
  return {"tokens": tokens, "action_mask": action, "rollout_logprobs": logp,
          "policy_version": np.where(action > 0, version, -1).astype(np.int32),
          "rewards": rewards, "num_action_tokens": action.sum(1).astype(np.int32)}


def max_abs_diff(a, b) -> float:
  """Largest |a - b| over two pytrees of the same structure."""
  diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64)
                                                         - np.asarray(y, np.float64)))), a, b)
  return max(jax.tree.leaves(diffs))


def make_trajectories(batch: dict[str, np.ndarray]):
  """The rows of a ``make_batch`` batch as ``Trajectory`` records (padding cut off), so that
  ``collate(..., pad_id=0, length=T)`` gives the batch back."""
  from sao_jax.rollout.trajectory import Trajectory  # pylint: disable=import-outside-toplevel
  out = []
  for i in range(len(batch["tokens"])):
    act = np.nonzero(batch["action_mask"][i])[0]
    n = int(act[-1]) + 1 if act.size else 8
    out.append(Trajectory(
        problem_id=str(i), tokens=batch["tokens"][i, :n], action_mask=batch["action_mask"][i, :n],
        logprobs=batch["rollout_logprobs"][i, :n], policy_version=batch["policy_version"][i, :n],
        reward=float(batch["rewards"][i, act[-1]]) if act.size else 0.0))
  return out
