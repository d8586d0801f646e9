"""The SAO trainer: one policy update per batch of single rollouts, K critic updates before it.

Per policy step (SAO §3, Algorithm 1):
  1. values V from the current critic on the batch;
  2. advantages with skip-observation GAE and the policy lambda (length-adaptive), returns with
     lambda = 1 -- both from the same values;
  3. K critic updates (attention frozen) on those fixed returns;
  4. one policy update with the DIS loss against the engine's rollout log-probs;
  5. the caller publishes the new weights (policy_version + 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax import algo
from sao_jax.rollout.trajectory import Trajectory, collate
from sao_jax.train import optim, steps


@dataclasses.dataclass
class SAOConfig:
  """Hyper-parameters of one SAO policy step (defaults: the paper's math/tool setting)."""
  eps_low: float = 0.3
  eps_high: float = 5.0
  gamma: float = 1.0
  lam_policy: Any = "adaptive"
  lam_alpha: float = 1.5
  lam_critic: float = 1.0
  critic_updates_per_step: int = 2
  policy_lr: float = 1e-6
  critic_lr: float = 5e-6
  critic_lr_warmup_steps: int = 10
  max_grad_norm: float = 1.0
  freeze_critic_attention: bool = True
  critic_frozen_patterns: Sequence[str] = (r"/attn/",)
  temperature: float = 1.0
  batch_length: int = 0  # pad every batch to this many tokens (one compiled shape); 0 = bucket

  def __post_init__(self):
    if not 0.0 <= self.eps_low < 1.0:
      raise ValueError(f"train.eps_low must be in [0, 1), got {self.eps_low}.")
    if self.eps_high <= 0.0:
      raise ValueError(f"train.eps_high must be > 0, got {self.eps_high}.")
    if self.critic_updates_per_step < 1:
      raise ValueError("train.critic_updates_per_step (K) must be >= 1, got "
                       f"{self.critic_updates_per_step}.")


class SAOTrainer:
  """Holds policy and critic train states and runs SAO policy steps on trajectories.

  Args:
    cfg: ``SAOConfig``.
    policy_graphdef / policy_params: the policy ``Transformer`` split with ``nnx.split``.
    critic_graphdef / critic_params: the ``Critic``.
    pad_id: token id used to pad batches.
  """

  def __init__(self, cfg: SAOConfig, policy_graphdef, policy_params, critic_graphdef,
               critic_params, pad_id: int):
    self.cfg, self.pad_id = cfg, pad_id
    self.policy_tx = optim.make_optimizer(policy_params, lr=cfg.policy_lr,
                                          max_grad_norm=cfg.max_grad_norm)
    frozen = tuple(cfg.critic_frozen_patterns) if cfg.freeze_critic_attention else ()
    self.critic_tx = optim.make_optimizer(critic_params, lr=cfg.critic_lr,
                                          warmup_steps=cfg.critic_lr_warmup_steps,
                                          max_grad_norm=cfg.max_grad_norm,
                                          frozen_patterns=frozen)
    self.policy = steps.TrainState.create(policy_params, self.policy_tx)
    self.critic = steps.TrainState.create(critic_params, self.critic_tx)
    self._adv = steps.make_advantage_fn(critic_graphdef, gamma=cfg.gamma,
                                        lam_policy=cfg.lam_policy, lam_critic=cfg.lam_critic,
                                        lam_alpha=cfg.lam_alpha)
    self._critic_step = steps.make_critic_step(critic_graphdef, self.critic_tx)
    self._policy_step = steps.make_policy_step(policy_graphdef, self.policy_tx,
                                               eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                               temperature=cfg.temperature)

  def batch(self, trajectories: Sequence[Trajectory]) -> dict:
    return {k: jnp.asarray(v) for k, v in
            collate(trajectories, self.pad_id, length=self.cfg.batch_length or None).items()}

  def _critic_updates(self, batch, k: int) -> dict:
    metrics = {}
    for _ in range(k):
      self.critic, metrics = self._critic_step(self.critic, batch)
    return metrics

  def critic_only_step(self, trajectories: Sequence[Trajectory]) -> dict:
    """Critic warm-up: K value updates on rollouts of the current policy, no policy update."""
    batch = self.batch(trajectories)
    batch.update(self._adv(self.critic.params, batch))
    metrics = self._critic_updates(batch, self.cfg.critic_updates_per_step)
    metrics["explained_variance"] = algo.explained_variance(batch["values"], batch["returns"],
                                                            batch["action_mask"])
    return {k: float(v) for k, v in metrics.items()}

  def step(self, trajectories: Sequence[Trajectory], policy_version: int) -> dict:
    """One SAO policy step. Returns float metrics (staleness against ``policy_version``) and
    ``staleness_hist``: list of int, entry s = action tokens with staleness s."""
    batch = self.batch(trajectories)
    batch.update(self._adv(self.critic.params, batch))
    critic_metrics = self._critic_updates(batch, self.cfg.critic_updates_per_step)
    self.policy, policy_metrics = self._policy_step(self.policy, batch)
    mask = np.asarray(batch["action_mask"]) > 0
    staleness = policy_version - np.asarray(batch["policy_version"])[mask]
    adv = np.asarray(batch["advantages"])[mask]
    out = {k: float(v) for k, v in {**critic_metrics, **policy_metrics}.items()}
    out.update(
        explained_variance=float(algo.explained_variance(batch["values"], batch["returns"],
                                                         batch["action_mask"])),
        staleness_mean=float(staleness.mean()) if staleness.size else 0.0,
        staleness_max=float(staleness.max()) if staleness.size else 0.0,
        staleness_hist=np.bincount(np.maximum(staleness, 0)).tolist() if staleness.size else [],
        advantage_mean=float(adv.mean()) if adv.size else 0.0,
        advantage_std=float(adv.std()) if adv.size else 0.0,
        action_tokens=float(mask.sum()),
    )
    return out

  def policy_params_copy(self):
    """A copy of the policy params safe to hand to the engine (train steps donate theirs)."""
    return jax.tree.map(jnp.copy, self.policy.params)
