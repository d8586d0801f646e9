"""Training modes of the one trainer: what each mode means and the plumbing it needs.

| mode         | rollouts / prompt | critic | default objective | default advantages        | waits |
|--------------|-------------------|--------|-------------------|---------------------------|-------|
| `sao`        | 1                 | yes    | `dis`             | `skip_obs_gae`            | no    |
| `vapo`       | 1                 | yes    | `ppo_clip`        | `skip_obs_gae`            | no    |
| `grpo_async` | G (group_size)    | no     | `ppo_clip`        | `grpo` (group-normalised) | no: groups are consumed as they complete, stale |
| `grpo_sync`  | G                 | no     | `ppo_clip`        | `grpo`                    | yes: batch n is generated with weights n-1 only, and step n waits for its slowest rollout |

``train.objective`` / ``train.advantage_estimator`` = "auto" pick the defaults above; any other
value overrides them (e.g. `sao` + `running_mean_prompt` is the paper's running-mean-baseline
ablation). Nothing here touches arrays; the kernels are in ``sao_jax.algo``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Iterator, Optional, Sequence

from sao_jax.rollout import staleness
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train.steps import CRITIC_ESTIMATORS

MODES = ("sao", "vapo", "grpo_async", "grpo_sync")
CRITIC_FREE_ESTIMATORS = ("grpo", "grpo_no_std", "running_mean_prompt", "running_mean_global")
_DEFAULT_OBJECTIVE = {"sao": "dis", "vapo": "ppo_clip", "grpo_async": "ppo_clip",
                      "grpo_sync": "ppo_clip"}
_DEFAULT_ESTIMATOR = {"sao": "skip_obs_gae", "vapo": "skip_obs_gae", "grpo_async": "grpo",
                      "grpo_sync": "grpo"}
GROUP_SEP = "#g"  # problem_id of a group member: "<prompt id>#g<group ordinal>"


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
  from sao_jax import algo  # pylint: disable=import-outside-toplevel
  if mode not in MODES:
    raise ValueError(f"unknown train.mode {mode!r}; use one of {MODES}.")
  objective = _DEFAULT_OBJECTIVE[mode] if objective == "auto" else objective
  algo.get_objective(objective)
  estimator = _DEFAULT_ESTIMATOR[mode] if estimator == "auto" else estimator
  if estimator not in CRITIC_ESTIMATORS + CRITIC_FREE_ESTIMATORS:
    raise ValueError(f"unknown train.advantage_estimator {estimator!r}; use 'auto' or one of "
                     f"{CRITIC_ESTIMATORS + CRITIC_FREE_ESTIMATORS}.")
  grouped = mode.startswith("grpo")
  g = int(group_size) if grouped else 1
  if grouped:
    if g < 2:
      raise ValueError(f"train.group_size must be >= 2 for mode {mode!r}, got {group_size}.")
    if batch_size % g:
      raise ValueError(f"train.batch_size ({batch_size}) must be a multiple of train.group_size "
                       f"({g}) in mode {mode!r}.")
  if estimator.startswith("grpo") and not grouped:
    raise ValueError(f"train.advantage_estimator={estimator!r} needs groups: use "
                     "train.mode='grpo_sync' or 'grpo_async'.")
  return ModeSpec(mode=mode, objective=objective, estimator=estimator, group_size=g,
                  uses_critic=estimator in CRITIC_ESTIMATORS, synchronous=mode == "grpo_sync")


def prompt_key(problem_id: str) -> str:
  """The prompt id of a trajectory (drops the group suffix, if any)."""
  return problem_id.split(GROUP_SEP, 1)[0]


def repeat_groups(problems: Iterator, group_size: int) -> Iterator:
  """Yields each problem ``group_size`` times in a row, ids suffixed ``#g<ordinal>`` so that the
  members of one group share a problem_id distinct from any other group's."""
  for ordinal, problem in enumerate(problems):
    member = dataclasses.replace(problem, id=f"{problem.id}{GROUP_SEP}{ordinal}")
    for _ in range(group_size):
      yield member


class GatedProblems:
  """A problem iterator that hands out only as many problems as the trainer released.

  ``next()`` returns None (not StopIteration) when the quota is used up: the rollout worker then
  leaves the slot empty and asks again later. The grpo_sync barrier: the trainer publishes the
  new weights and only then calls ``release(n)``, so batch n+1 is sampled entirely by the weights
  of step n. Thread-safe."""

  def __init__(self, problems: Iterator):
    self._problems = problems
    self._quota = 0
    self._lock = threading.Lock()

  def release(self, n: int) -> None:
    with self._lock:
      self._quota += int(n)

  def __iter__(self):
    return self

  def __next__(self):
    with self._lock:
      if self._quota <= 0:
        return None
      self._quota -= 1
    return next(self._problems)


class GroupCollector:
  """Assembles trajectories into complete groups of ``group_size`` (by problem_id), in order of
  completion. ``add`` returns the list of groups completed by that trajectory (0 or 1)."""

  def __init__(self, group_size: int):
    self.group_size = group_size
    self._pending: dict[str, list[Trajectory]] = collections.OrderedDict()

  def add(self, traj: Trajectory) -> list[list[Trajectory]]:
    members = self._pending.setdefault(traj.problem_id, [])
    members.append(traj)
    if len(members) == self.group_size:
      del self._pending[traj.problem_id]
      return [members]
    return []

  @property
  def pending(self) -> int:
    return sum(len(v) for v in self._pending.values())


def too_stale(trajs: Sequence[Trajectory], version: int, max_staleness: Optional[int]) -> bool:
  """True if any action token of ``trajs`` (a group, or one trajectory) was sampled more than
  ``max_staleness`` policy versions before ``version`` (None or < 0: never). The per-trajectory
  rule is ``rollout.staleness.is_too_stale`` (GLM-5 drop-on-arrival)."""
  if max_staleness is None or max_staleness < 0:
    return False
  return any(staleness.is_too_stale(t, version, max_staleness) for t in trajs)
