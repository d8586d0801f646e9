"""Shared pieces of the sharding / multi-host tests (imported by their subprocess workers).

* ``make_models(moe)``: a tiny dense Qwen3 or the real Qwen3-MoE of ``sao_jax.models``
  (``presets.get_preset("tiny-qwen3-moe")``, shrunk), policy + critic, pure-dict params.
* ``make_trajectories``: deterministic SAO rollouts (prompt, actions, a 4-token observation,
  more actions; two rows without actions) whose rollout log-probs are the policy's own plus
  N(0, 0.2) noise, so some tokens leave the DIS band.
* ``learner_config(mode, **train)``: the ``LearnerConfig`` of ``configs/arith_tool.py`` with
  ``train`` fields overridden, batch length 32.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax import configs, roles
from sao_jax.models import presets
from sao_jax.models.transformer import Critic, Transformer, default_positions
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train.learner import LearnerConfig
from sao_jax.train.optim import param_path
from sao_jax.train.steps import token_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTH, ROWS, STEPS = 32, 16, 3
DENSE = presets.get_preset("tiny-qwen3", vocab_size=64, d_model=32, n_layers=1, head_dim=16,
                           d_ff=64, max_seq_len=LENGTH)
MOE = presets.get_preset("tiny-qwen3-moe", vocab_size=64, d_model=32, n_layers=1, head_dim=16,
                         d_ff=64, moe_d_ff=16, moe_layers=(0,), max_seq_len=LENGTH)


def arith_config():
  return configs.load("arith_tool")


def learner_config(mode: str = "sao", **train) -> LearnerConfig:
  """lr 1e-3 with no warm-up, group size 4 for the grpo modes, batch ``ROWS``."""
  c = arith_config()
  c.model.max_seq_len = LENGTH
  base = dict(mode=mode, policy_lr=1e-3, critic_lr=1e-3, critic_lr_warmup_steps=0,
              group_size=4, batch_size=ROWS)
  base.update(train)
  return LearnerConfig.from_run(roles.from_config(c), **base)


def flat(tree, prefix: str) -> dict[str, np.ndarray]:
  """{"prefix/layers/0/attn/q_proj/kernel": array, ...} of a params pytree."""
  return {f"{prefix}/{param_path(p)}": np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def make_models(moe: bool = False, seed: int = 0):
  """(policy_graphdef, policy_params, critic_graphdef, critic_params); params are pure dicts;
  the critic's value head is non-zero so its gradient reaches the backbone in one step."""
  cfg = MOE if moe else DENSE
  pg, pp = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))
  cg, cp = nnx.split(Critic(cfg, rngs=nnx.Rngs(seed + 1)))
  cp = nnx.to_pure_dict(cp)
  cp["value_head"]["kernel"] = 0.1 * jnp.ones_like(cp["value_head"]["kernel"])
  return pg, nnx.to_pure_dict(pp), cg, cp


def make_trajectories(policy_graphdef, policy_params, rows: int = ROWS, seed: int = 0,
                      version: int = 0, group_size: int = 1) -> list[Trajectory]:
  """Deterministic rollouts; rows ``g*group_size .. (g+1)*group_size-1`` answer one prompt
  (``prompt_position`` g). Rewards are 0/1 with both values in every group of 4."""
  rng = np.random.default_rng(seed)
  vocab = int(policy_params["embed"]["embedding"].shape[0])
  tokens = rng.integers(1, vocab, size=(rows, LENGTH)).astype(np.int32)
  model = nnx.merge(policy_graphdef, policy_params)
  logits, _ = model(jnp.asarray(tokens), default_positions(jnp.asarray(tokens)))
  logp = np.asarray(token_logprobs(logits, jnp.asarray(tokens)))
  logp = np.minimum(logp + rng.normal(0, 0.2, logp.shape), 0.0).astype(np.float32)
  out = []
  for i in range(rows):
    end = 12 + (i * 5) % (LENGTH - 12)
    action = np.zeros(end, np.float32)
    if i % 8 != 7:
      action[6:end] = 1.0
      action[9:13] = 0.0  # observation span
    out.append(Trajectory(
        problem_id=f"p{i // group_size}", tokens=tokens[i, :end], action_mask=action,
        logprobs=logp[i, :end] * action,
        policy_version=np.where(action > 0, version, -1).astype(np.int32),
        reward=float((i + seed) % 2), truncated=i % 3 == 0,
        prompt_position=1000 * seed + i // group_size))
  return out


def max_abs_diff(a, b) -> float:
  """Largest |a - b| over two pytrees of the same structure."""
  diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64)
                                                         - np.asarray(y, np.float64)))), a, b)
  return max(jax.tree.leaves(diffs))


def bytes_per_device(tree) -> dict:
  """Bytes each device holds of a pytree of jax Arrays (from ``addressable_shards``)."""
  out: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard_ in leaf.addressable_shards:
      out[shard_.device] = out.get(shard_.device, 0) + shard_.data.nbytes
  return out


def total_bytes(tree) -> int:
  """Bytes of one full copy of a pytree (shapes x itemsize)."""
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
