"""The trainer of the SAO family: one policy update per batch, K critic updates before it.

``SAOConfig.mode`` / ``objective`` / ``advantage_estimator`` select SAO or a baseline (see
``sao_jax.train.modes``); the defaults are SAO exactly as below.

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
from sao_jax.train import modes, optim, steps
from sao_jax.train.baselines import RunningMeanBaseline


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
  mode: str = "sao"                  # sao | vapo | grpo_async | grpo_sync (modes.MODES)
  objective: str = "auto"            # auto (mode default) or a key of algo.OBJECTIVES
  advantage_estimator: str = "auto"  # auto (mode default), modes.CRITIC_ESTIMATORS or
                                     # modes.CRITIC_FREE_ESTIMATORS
  group_size: int = 8                # G rollouts per prompt (grpo modes)
  batch_size: int = 0                # trajectories per step (checked against group_size; 0 = skip)
  objective_kwargs: dict = dataclasses.field(default_factory=dict)  # dual_clip, tis_cap, ...
  ppo_eps_low: float = 0.2           # clip band of the PPO family (clip-higher, DAPO / VAPO)
  ppo_eps_high: float = 0.28
  grpo_eps: float = 1e-6             # added to the group std
  baseline_window: int = 8           # running_mean_prompt: last N rewards of the same prompt
  global_baseline_window: int = 128  # running_mean_global: last N rewards overall
  bootstrap_truncated: bool = False  # truncated rows bootstrap from V(last state) instead of 0
  kl_coef: float = 0.0               # KL(pi_theta || pi_ref) coefficient (ref = initial policy)

  def __post_init__(self):
    self.spec = modes.resolve(self.mode, self.objective, self.advantage_estimator,
                              self.group_size, self.batch_size or self.group_size)
    if not 0.0 <= self.eps_low < 1.0:
      raise ValueError(f"train.eps_low must be in [0, 1), got {self.eps_low}.")
    if self.eps_high <= 0.0:
      raise ValueError(f"train.eps_high must be > 0, got {self.eps_high}.")
    if self.critic_updates_per_step < 1:
      raise ValueError("train.critic_updates_per_step (K) must be >= 1, got "
                       f"{self.critic_updates_per_step}.")


def make_optimizers(cfg: "SAOConfig", policy_params, critic_params):
  """(policy_tx, critic_tx): AdamW for the policy; AdamW with linear warm-up for the critic, its
  ``cfg.critic_frozen_patterns`` frozen (``set_to_zero``, no Adam moments) when
  ``cfg.freeze_critic_attention`` (SAO §3.2). Raises ValueError if a pattern matches nothing."""
  policy_tx = optim.make_optimizer(policy_params, lr=cfg.policy_lr,
                                   max_grad_norm=cfg.max_grad_norm)
  frozen = tuple(cfg.critic_frozen_patterns) if cfg.freeze_critic_attention else ()
  critic_tx = optim.make_optimizer(critic_params, lr=cfg.critic_lr,
                                   warmup_steps=cfg.critic_lr_warmup_steps,
                                   max_grad_norm=cfg.max_grad_norm, frozen_patterns=frozen)
  return policy_tx, critic_tx


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
    self.policy_tx, self.critic_tx = make_optimizers(cfg, policy_params, critic_params)
    self.policy = steps.TrainState.create(policy_params, self.policy_tx)
    self.critic = steps.TrainState.create(critic_params, self.critic_tx)
    spec = self.spec = cfg.spec
    if spec.uses_critic:
      self._adv = steps.make_advantage_fn(critic_graphdef, gamma=cfg.gamma,
                                          lam_policy=cfg.lam_policy, lam_critic=cfg.lam_critic,
                                          lam_alpha=cfg.lam_alpha, estimator=spec.estimator,
                                          bootstrap_truncated=cfg.bootstrap_truncated)
    self._baseline = None
    if spec.estimator == "running_mean_prompt":
      self._baseline = RunningMeanBaseline(cfg.baseline_window, per_key=True)
    elif spec.estimator == "running_mean_global":
      self._baseline = RunningMeanBaseline(cfg.global_baseline_window, per_key=False)
    self._critic_step = steps.make_critic_step(critic_graphdef, self.critic_tx)
    band = ((cfg.eps_low, cfg.eps_high) if spec.objective == "dis"
            else (cfg.ppo_eps_low, cfg.ppo_eps_high))
    kwargs = dict(cfg.objective_kwargs)
    if cfg.kl_coef:
      kwargs["kl_coef"] = cfg.kl_coef
    self._policy_step = steps.make_policy_step(policy_graphdef, self.policy_tx,
                                               eps_low=band[0], eps_high=band[1],
                                               temperature=cfg.temperature,
                                               objective=spec.objective, objective_kwargs=kwargs)
    self._ref_params, self._ref_logp = None, None
    if cfg.kl_coef:
      self._ref_params = jax.tree.map(jnp.copy, policy_params)
      self._ref_logp = steps.make_logprob_fn(policy_graphdef, cfg.temperature)

  def batch(self, trajectories: Sequence[Trajectory]) -> dict:
    """Collated ``[B, T]`` arrays plus ``truncated`` bool [B] and ``last_index`` int32 [B]."""
    out = {k: jnp.asarray(v) for k, v in
           collate(trajectories, self.pad_id, length=self.cfg.batch_length or None).items()}
    if self.cfg.bootstrap_truncated:
      out["truncated"] = jnp.asarray([bool(t.truncated) for t in trajectories])
      out["last_index"] = jnp.asarray([len(t.tokens) - 1 for t in trajectories], jnp.int32)
    return out

  def row_advantages(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
    """Critic-free per-trajectory advantages float32 [B] (GRPO groups or running mean).

    GRPO: trajectories of one group share a problem_id; every group must have ``group_size``
    members (ValueError otherwise)."""
    rewards = np.asarray([t.reward for t in trajectories], np.float32)
    est = self.spec.estimator
    if est in ("grpo", "grpo_no_std"):
      groups: dict[str, list[int]] = {}
      for i, t in enumerate(trajectories):
        groups.setdefault(t.problem_id, []).append(i)
      sizes = {len(v) for v in groups.values()}
      if sizes != {self.spec.group_size}:
        raise ValueError(f"GRPO needs complete groups of train.group_size="
                         f"{self.spec.group_size}; got group sizes {sorted(sizes)}.")
      idx = np.asarray(list(groups.values()))
      adv = np.asarray(algo.grpo_advantages(rewards[idx], normalize_std=est == "grpo",
                                            eps=self.cfg.grpo_eps))
      out = np.zeros_like(rewards)
      out[idx.reshape(-1)] = adv.reshape(-1)
      return out
    if self._baseline is not None:
      return self._baseline([modes.prompt_key(t.problem_id) for t in trajectories], rewards)
    raise ValueError(f"estimator {est!r} is not critic-free.")

  def _critic_updates(self, batch, k: int) -> dict:
    metrics = {}
    for _ in range(k):
      self.critic, metrics = self._critic_step(self.critic, batch)
    return metrics

  def critic_only_step(self, trajectories: Sequence[Trajectory]) -> dict:
    """Critic warm-up: K value updates on rollouts of the current policy, no policy update."""
    if not self.spec.uses_critic:
      return {}
    batch = self.batch(trajectories)
    batch.update(self._adv(self.critic.params, batch))
    metrics = self._critic_updates(batch, self.cfg.critic_updates_per_step)
    metrics["explained_variance"] = algo.explained_variance(batch["values"], batch["returns"],
                                                            batch["action_mask"])
    return {k: float(v) for k, v in metrics.items()}

  def step(self, trajectories: Sequence[Trajectory], policy_version: int) -> dict:
    """One policy step of the configured mode. Returns float metrics (staleness against
    ``policy_version``) and ``staleness_hist``: list of int, entry s = action tokens with
    staleness s."""
    batch = self.batch(trajectories)
    critic_metrics = {}
    if self.spec.uses_critic:
      batch.update(self._adv(self.critic.params, batch))
      critic_metrics = self._critic_updates(batch, self.cfg.critic_updates_per_step)
    else:
      batch["advantages"] = algo.broadcast_to_tokens(
          jnp.asarray(self.row_advantages(trajectories)), batch["action_mask"])
    if self._ref_logp is not None:
      batch["ref_logprobs"] = self._ref_logp(self._ref_params, batch)
    self.policy, policy_metrics = self._policy_step(self.policy, batch)
    mask = np.asarray(batch["action_mask"]) > 0
    staleness = policy_version - np.asarray(batch["policy_version"])[mask]
    adv = np.asarray(batch["advantages"])[mask]
    out = {k: float(v) for k, v in {**critic_metrics, **policy_metrics}.items()}
    if self.spec.uses_critic:
      out["explained_variance"] = float(algo.explained_variance(
          batch["values"], batch["returns"], batch["action_mask"]))
    out.update(
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
