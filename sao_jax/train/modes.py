"""Training modes of the one trainer: what each mode means and the plumbing it needs.

| mode         | rollouts / prompt | critic | default objective | default advantages       | waits |
|--------------|-------------------|--------|-------------------|--------------------------|-------|
| `sao`        | 1                 | yes    | `dis`             | `skip_obs_gae`           | no    |
| `vapo`       | 1                 | yes    | `ppo_clip`        | `skip_obs_gae`           | no    |
| `grpo_async` | G (group_size)    | no     | `ppo_clip`        | `grpo` (group-normalised)| no    |
| `grpo_sync`  | G                 | no     | `ppo_clip`        | `grpo`                   | yes   |

`grpo_async` consumes groups as they complete (stale); in `grpo_sync` batch n is generated with
weights n-1 only, and step n waits for its slowest rollout.

``train.objective`` / ``train.advantage_estimator`` = "auto" pick the defaults above; any other
value overrides them (e.g. `sao` + `running_mean_prompt` is the paper's running-mean-baseline
ablation). Nothing here touches arrays; the kernels are in ``sao_jax.algo`` (``OBJECTIVES``,
``ESTIMATORS``); groups and the sync barrier are the trajectory source's
(``sao_jax.rollout.source``).
"""

from __future__ import annotations

import dataclasses

from sao_jax import algo

MODES = ("sao", "vapo", "grpo_async", "grpo_sync")
_DEFAULT_OBJECTIVE = {"sao": "dis", "vapo": "ppo_clip", "grpo_async": "ppo_clip",
                      "grpo_sync": "ppo_clip"}
_DEFAULT_ESTIMATOR = {"sao": "skip_obs_gae", "vapo": "skip_obs_gae", "grpo_async": "grpo",
                      "grpo_sync": "grpo"}


@dataclasses.dataclass(frozen=True)
class ModeSpec:
  """A resolved training mode.

  Attributes: mode; objective (key of ``algo.OBJECTIVES``); estimator; group_size (1 for the
  single-rollout modes); uses_critic; synchronous (the grpo_sync batch barrier)."""
  mode: str
  objective: str
  estimator: str
  group_size: int
  uses_critic: bool
  synchronous: bool


def resolve(mode: str, objective: str = "auto", estimator: str = "auto", group_size: int = 8,
            batch_size: int = 1) -> ModeSpec:
  """Validates ``train.mode`` / ``objective`` / ``advantage_estimator`` / ``group_size``.

  Raises ValueError naming the config field and the valid values."""
  if mode not in MODES:
    raise ValueError(f"unknown train.mode {mode!r}; use one of {MODES}.")
  objective = _DEFAULT_OBJECTIVE[mode] if objective == "auto" else objective
  algo.get_objective(objective)
  estimator = _DEFAULT_ESTIMATOR[mode] if estimator == "auto" else estimator
  est = algo.get_estimator(estimator)
  grouped = mode.startswith("grpo")
  g = int(group_size) if grouped else 1
  if grouped:
    if g < 2:
      raise ValueError(f"train.group_size must be >= 2 for mode {mode!r}, got {group_size}.")
    if batch_size % g:
      raise ValueError(f"train.batch_size ({batch_size}) must be a multiple of train.group_size "
                       f"({g}) in mode {mode!r}.")
  if est.needs_groups and not grouped:
    raise ValueError(f"train.advantage_estimator={estimator!r} needs groups: use "
                     "train.mode='grpo_sync' or 'grpo_async'.")
  return ModeSpec(mode=mode, objective=objective, estimator=estimator, group_size=g,
                  uses_critic=est.uses_critic, synchronous=mode == "grpo_sync")
