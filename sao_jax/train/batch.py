"""The typed training batch, built on the learner side from ``Trajectory`` records.

``Batch`` is a frozen pytree of arrays (no strings, no Python objects), so the jitted steps take
it as one argument and shard it on its leading (row) axis. One trajectory = one row; rows are
right-padded to a common length ``T``; extra empty rows (``group_id`` -1, no action tokens) pad
the batch to a row count the mesh divides and change no loss, gradient or metric.

``build_batch`` checks every trajectory before anything reaches a device and names the
trajectory and the field it refuses (``BatchError``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sao_jax.envs.guard import check_reward
from sao_jax.rollout.trajectory import Trajectory, bucket_length


@struct.dataclass
class Batch:
  """One training batch of B rows x T tokens (token-major, right-padded).

  Attributes:
    tokens: int32 [B, T] prompt, action and observation token ids (pad id after the end).
    action_mask: bool [B, T] True on tokens the policy sampled.
    rollout_logprobs: float32 [B, T] log-prob the engine recorded when it sampled each action
      token (``logp_rollout`` of DIS); 0 elsewhere.
    policy_version: int32 [B, T] policy version that sampled each action token; -1 elsewhere.
    reward: float32 [B] one outcome reward per row (placed on ``last_action`` by the steps).
    last_action: int32 [B] index of the row's last action token (-1: no action token).
    last_index: int32 [B] index of the row's last token (bootstrap of truncated rows).
    truncated: bool [B] the trajectory hit a length limit instead of ending.
    group_id: int32 [B] rows of one GRPO group share it (0..G-1 in order of appearance);
      single-rollout rows each have their own; padding rows -1.
    baseline: float32 [B] running-mean reward baseline of the row (0 unless the estimator
      keeps one).
  """
  tokens: jax.Array
  action_mask: jax.Array
  rollout_logprobs: jax.Array
  policy_version: jax.Array
  reward: jax.Array
  last_action: jax.Array
  last_index: jax.Array
  truncated: jax.Array
  group_id: jax.Array
  baseline: jax.Array

  @property
  def rows(self) -> int:
    return int(self.tokens.shape[0])

  @classmethod
  def of(cls, tokens, action_mask, *, rollout_logprobs=None, policy_version=None, reward=None,
         truncated=None, group_id=None, baseline=None) -> "Batch":
    """A batch from arrays (tests, benchmarks): ``tokens`` int [B, T] and ``action_mask``
    [B, T] (any dtype, non-zero = action); omitted fields get their empty values (log-probs 0,
    version 0 on actions, reward 0, one group per row). ``last_action`` / ``last_index`` are
    derived from the mask (``last_index`` = the last action token)."""
    tokens = np.asarray(tokens, np.int32)
    mask = np.asarray(action_mask) > 0
    b, t = tokens.shape
    has = mask.any(-1)
    last = np.where(has, t - 1 - np.argmax(mask[:, ::-1], -1), -1).astype(np.int32)
    fill = lambda x, default: np.asarray(default if x is None else x)
    return cls(tokens=tokens, action_mask=mask,
               rollout_logprobs=fill(rollout_logprobs, np.zeros((b, t))).astype(np.float32),
               policy_version=np.where(mask, fill(policy_version, 0), -1).astype(np.int32),
               reward=fill(reward, np.zeros(b)).astype(np.float32), last_action=last,
               last_index=np.maximum(last, 0), truncated=fill(truncated, np.zeros(b, bool)),
               group_id=fill(group_id, np.arange(b)).astype(np.int32),
               baseline=fill(baseline, np.zeros(b)).astype(np.float32))

  def token_rewards(self) -> jax.Array:
    """float32 [B, T]: each row's reward on its last action token, 0 elsewhere (the project's
    reward placement; never on observation tokens)."""
    t = jnp.arange(self.tokens.shape[1])[None, :]
    return jnp.where(t == self.last_action[:, None], self.reward[:, None], 0.0).astype(
        jnp.float32)


class BatchError(ValueError):
  """A trajectory that cannot be trained on; the message names the trajectory and the field."""


def _check(i: int, t: Trajectory, vocab_size: Optional[int]) -> None:
  name = f"trajectory {i} (prompt {t.problem_id!r})"
  n = len(t.tokens)
  if n == 0:
    raise BatchError(f"{name}: field 'tokens' is empty.")
  for field in ("action_mask", "logprobs", "policy_version"):
    m = len(getattr(t, field))
    if m != n:
      raise BatchError(f"{name}: field {field!r} has {m} entries but 'tokens' has {n}; every "
                       "per-token field must be as long as 'tokens'.")
  tokens = np.asarray(t.tokens)
  if not np.issubdtype(tokens.dtype, np.integer):
    raise BatchError(f"{name}: field 'tokens' must hold integer ids, got dtype {tokens.dtype}.")
  bad = (tokens < 0) | (tokens >= vocab_size if vocab_size else False)
  if bad.any():
    j = int(np.argmax(bad))
    raise BatchError(f"{name}: field 'tokens'[{j}] = {int(tokens[j])} is outside the vocabulary "
                     f"[0, {vocab_size}).")
  act = np.asarray(t.action_mask) > 0
  versions = np.asarray(t.policy_version)
  if (versions[act] < 0).any():
    j = int(np.nonzero(act & (versions < 0))[0][0])
    raise BatchError(f"{name}: field 'policy_version'[{j}] = {int(versions[j])} on an action "
                     "token; the engine must record the version (>= 0) that sampled it.")
  logp = np.asarray(t.logprobs, np.float64)[act]
  if not np.isfinite(logp).all() or (logp > 1e-6).any():
    raise BatchError(f"{name}: field 'logprobs' holds a non-finite or positive log-prob on an "
                     "action token; it must be the engine's log-prob (<= 0).")
  try:  # the env guard's check (the same rules at both boundaries)
    check_reward(t.reward, name, field="Trajectory.reward")
  except ValueError as e:
    raise BatchError(str(e)) from None


def require_trajectories(trajectories: Sequence[Trajectory]) -> None:
  """Raises ``BatchError`` ("no trajectories") for an empty list (called before any batch
  planning, whose own error would name an internal argument)."""
  if len(trajectories) == 0:
    raise BatchError("no trajectories: a training step needs at least one (the sources' "
                     "take(n) returns n = train.batch_size / processes >= 1).")


def _check_groups(trajectories: Sequence[Trajectory], group_size: int) -> None:
  sizes: dict = {}
  for i, t in enumerate(trajectories):
    sizes.setdefault(t.prompt_position if t.prompt_position >= 0 else ("row", i), []).append(i)
  for key, rows in sizes.items():
    if len(rows) != group_size:
      what = (f"prompt position {key}" if not isinstance(key, tuple)
              else f"trajectory {rows[0]} (no prompt position)")
      raise BatchError(
          f"{what}: a group of {len(rows)} trajectories (rows {rows[:8]}), but "
          f"train.group_size={group_size}: a grpo mode normalises advantages over whole groups "
          f"of G rollouts of one prompt; feed whole groups (the sources do: "
          "rollout/assembler.py:GroupCollector).")


def build_batch(trajectories: Sequence[Trajectory], pad_id: int, *, length: int = 0,
                rows: int = 0, vocab_size: Optional[int] = None,
                baseline: Optional[Sequence[float]] = None, group_size: int = 1) -> Batch:
  """``Trajectory`` records -> a host (NumPy) ``Batch``.

  Args:
    trajectories: the rows, in order.
    pad_id: token id of padding.
    length: T (0 = the longest trajectory rounded up to a multiple of 32, which bounds the
      number of compiled shapes).
    rows: pad the batch with empty rows to this many (0 = ``len(trajectories)``).
    vocab_size: token ids must be in ``[0, vocab_size)`` (None: only ``>= 0`` is checked).
    baseline: per-row running-mean baselines (None: 0).
    group_size: G of a grpo mode (``train.group_size``): every group must hold exactly G
      trajectories (1: no check).

  Group ids: trajectories with the same ``prompt_position`` (>= 0) form one group (GRPO); a
  trajectory without one (-1) is a group of its own.

  Raises:
    BatchError naming the trajectory and the field, for: no trajectories, per-token fields of
    different lengths, token ids outside the vocabulary, an action token without a policy
    version (< 0), a non-finite or positive rollout log-prob, a non-finite reward, a
    trajectory longer than ``length``, more trajectories than ``rows``, a group of other than
    ``group_size`` trajectories (its advantages would be normalised over a partial group).
  """
  require_trajectories(trajectories)
  for i, t in enumerate(trajectories):
    _check(i, t, vocab_size)
  if group_size > 1:
    _check_groups(trajectories, group_size)
  longest = max(len(t.tokens) for t in trajectories)
  t_len = length or bucket_length(longest)
  if longest > t_len:
    i = int(np.argmax([len(t.tokens) for t in trajectories]))
    raise BatchError(f"trajectory {i} (prompt {trajectories[i].problem_id!r}): field 'tokens' "
                     f"has {longest} entries, more than the batch length {t_len} "
                     "(train.batch_length / model.max_seq_len).")
  b = len(trajectories)
  n_rows = rows or b
  if b > n_rows:
    raise BatchError(f"{b} trajectories do not fit a batch of {n_rows} rows.")
  out = dict(tokens=np.full((n_rows, t_len), pad_id, np.int32),
             action_mask=np.zeros((n_rows, t_len), bool),
             rollout_logprobs=np.zeros((n_rows, t_len), np.float32),
             policy_version=np.full((n_rows, t_len), -1, np.int32),
             reward=np.zeros((n_rows,), np.float32),
             last_action=np.full((n_rows,), -1, np.int32),
             last_index=np.zeros((n_rows,), np.int32),
             truncated=np.zeros((n_rows,), bool),
             group_id=np.full((n_rows,), -1, np.int32),
             baseline=np.zeros((n_rows,), np.float32))
  groups: dict = {}
  for i, t in enumerate(trajectories):
    n = len(t.tokens)
    act = np.asarray(t.action_mask) > 0
    out["tokens"][i, :n] = t.tokens
    out["action_mask"][i, :n] = act
    out["rollout_logprobs"][i, :n] = np.where(act, t.logprobs, 0.0)
    out["policy_version"][i, :n] = np.where(act, t.policy_version, -1)
    out["reward"][i] = t.reward
    idx = np.nonzero(act)[0]
    out["last_action"][i] = idx[-1] if idx.size else -1
    out["last_index"][i] = n - 1
    out["truncated"][i] = bool(t.truncated)
    key = t.prompt_position if t.prompt_position >= 0 else ("row", i)
    out["group_id"][i] = groups.setdefault(key, len(groups))
  if baseline is not None:
    out["baseline"][:b] = np.asarray(baseline, np.float32)
  return Batch(**out)
