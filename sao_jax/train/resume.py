"""Exact resume and fault guards for the SAO main job (hooks used by ``sao_jax/train/loop.py``).

* ``PromptLedger`` -- the deterministic prompt stream (epoch ``e`` is the permutation
  ``default_rng([seed, e])`` of the train problems; position ``p`` is problem
  ``order(p // n)[p % n]``) and the ledger of consumed positions. A checkpoint stores the
  ledger's cursor (every position below ``low`` consumed, plus the consumed positions above it);
  after a crash the stream restarts at the first unconsumed position and skips consumed ones, so
  trajectories that were in flight or queued are regenerated and none is counted twice.
  ``ledger.jsonl`` in the run folder records the prompt ids consumed by each step.
* ``lockstep_batch`` -- deterministic rollout (``rollout.lockstep=True``): step ``s`` samples the
  next ``batch_size`` prompts with the current weights and an engine key derived from
  ``(seed, s)``. Asynchronous rollout is not deterministic even without a crash (which tokens a
  weight update reaches depends on thread timing), so bit-exact comparison with an uninterrupted
  run is only defined in this mode.
* ``NonFiniteGuard`` -- counts policy steps whose loss or gradients were NaN/inf (their updates
  are dropped by ``optax.apply_if_finite`` in ``train/optim.py``) and stops the run with a clear
  message after ``max_consecutive`` in a row.
* ``truncate_jsonl`` -- drops metric/ledger records of steps after the restored checkpoint, so
  redone steps are not logged twice.

RNG: every key is derived from ``config.seed`` and the step (``lockstep``) or the resumed step
(the asynchronous worker's decode key), so the checkpoint's ``seed`` and ``step`` fix them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Iterator, Optional, Sequence

import numpy as np


class PromptLedger:
  """Deterministic prompt stream over ``problems`` with a ledger of consumed positions.

  Args:
    problems: the train problems (each with an ``id``).
    seed: data-order seed.
    low: every position < low is consumed (from a checkpoint; 0 for a fresh run).
    extra: consumed positions >= low (from a checkpoint).
  """

  def __init__(self, problems: Sequence, seed: int, low: int = 0, extra: Sequence[int] = ()):
    if not problems:
      raise ValueError("the prompt ledger needs at least one train problem.")
    self.problems, self.seed = list(problems), int(seed)
    self.low = int(low)
    self.consumed = {int(p) for p in extra if int(p) >= self.low}
    self._orders: dict[int, np.ndarray] = {}
    self._pending: dict[str, list[int]] = {}   # problem id -> positions handed out, FIFO
    self._next = self.low

  def order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
          len(self.problems))
    return self._orders[epoch]

  def problem_at(self, position: int):
    n = len(self.problems)
    return self.problems[int(self.order(position // n)[position % n])]

  def iterator(self) -> Iterator:
    """Problems from the first unconsumed position on, skipping consumed positions."""
    while True:
      p = self._next
      self._next += 1
      if p < self.low or p in self.consumed:
        continue
      problem = self.problem_at(p)
      self._pending.setdefault(str(problem.id), []).append(p)
      yield problem

  def take_positions(self, n: int) -> list[int]:
    """The next ``n`` unconsumed positions, handed out (lockstep mode)."""
    it = self.iterator()
    out = []
    for _ in range(n):
      problem = next(it)
      out.append(self._pending[str(problem.id)][-1])
    return out

  def consume(self, problem_ids: Sequence[str]) -> list[int]:
    """Marks one handed-out position per id consumed; returns them. Raises ValueError for an id
    that was never handed out or is consumed twice (the never-counted-twice guarantee)."""
    out = []
    for pid in problem_ids:
      queue = self._pending.get(str(pid))
      if not queue:
        raise ValueError(f"trajectory for prompt {pid!r} was not handed out by the ledger "
                         "(or is consumed twice).")
      p = queue.pop(0)
      if p < self.low or p in self.consumed:
        raise ValueError(f"prompt position {p} ({pid}) is consumed twice.")
      self.consumed.add(p)
      out.append(p)
    while self.low in self.consumed:
      self.consumed.discard(self.low)
      self.low += 1
    return out

  def state(self) -> dict:
    """JSON-serialisable cursor: ``{"low": int, "extra": sorted list, "seed": int}``."""
    return {"low": self.low, "extra": sorted(self.consumed), "seed": self.seed}

  @classmethod
  def from_state(cls, problems, state: dict) -> "PromptLedger":
    return cls(problems, state["seed"], state["low"], state["extra"])


class NonFiniteError(RuntimeError):
  """The run stopped: too many policy steps in a row had NaN/inf loss or gradients."""


class NonFiniteGuard:
  """``check(step, metrics)`` -> True if this step's update was skipped (non-finite
  ``policy_loss``, ``policy_grad_norm``, ``value_loss`` or ``critic_grad_norm``); raises
  ``NonFiniteError`` after ``max_consecutive`` skipped steps in a row."""

  KEYS = ("policy_loss", "policy_grad_norm", "value_loss", "critic_grad_norm")

  def __init__(self, max_consecutive: int = 3):
    if max_consecutive < 1:
      raise ValueError(f"train.max_consecutive_nonfinite must be >= 1, got {max_consecutive}.")
    self.max_consecutive = max_consecutive
    self.consecutive = 0
    self.total = 0

  def check(self, step: int, metrics: dict) -> bool:
    bad = [k for k in self.KEYS if k in metrics and not math.isfinite(float(metrics[k]))]
    if not bad:
      self.consecutive = 0
      return False
    self.consecutive += 1
    self.total += 1
    print(f"step {step}: non-finite {', '.join(bad)}; update skipped "
          f"({self.consecutive} in a row, {self.total} in total)", flush=True)
    if self.consecutive >= self.max_consecutive:
      raise NonFiniteError(
          f"stopping at step {step}: {self.consecutive} policy steps in a row had non-finite "
          f"{', '.join(bad)} (limit train.max_consecutive_nonfinite={self.max_consecutive}); no "
          "update was applied in those steps and the last checkpoint is intact. Lower "
          "train.policy_lr / critic_lr, check the reward for NaN, or resume from the checkpoint.")
    return True


def lockstep_batch(engine, env, params, ledger: PromptLedger, n: int, *, step: int, seed: int,
                   version: int, stop_ids, max_new_tokens: int, max_seq_len: int,
                   temperature: float):
  """Deterministic batch for ``step``: the next ``n`` ledger prompts rolled out with ``params``
  and an engine key derived from ``(seed, step)``. Returns trajectories in prompt order."""
  from sao_jax.rollout.worker import generate_trajectories  # pylint: disable=import-outside-toplevel
  positions = ledger.take_positions(n)
  problems = [ledger.problem_at(p) for p in positions]
  engine.reseed(step_seed(seed, step))
  return generate_trajectories(engine, env, params, problems, stop_ids=stop_ids,
                               max_new_tokens=max_new_tokens, max_seq_len=max_seq_len,
                               temperature=temperature, version=version,
                               seed=step_seed(seed, step))


def step_seed(seed: int, step: int) -> int:
  """A 31-bit seed derived from (seed, step) (numpy SeedSequence)."""
  return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1)[0] >> 1)


def truncate_jsonl(path: str, max_step: int) -> int:
  """Rewrites ``path`` keeping records with ``step <= max_step`` (atomically: temp + rename);
  returns the number of records dropped. A missing file is left alone; a torn last line
  (killed mid-write) is dropped."""
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        dropped += 1
        continue
      if rec.get("step", 0) <= max_step:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)
  return dropped


def append_ledger(run_dir: str, step: int, trajectories: Sequence,
                  positions: Sequence[int]) -> None:
  """Appends ``{"step", "problem_ids", "positions", "tokens_sha1"}`` to ``run_dir/ledger.jsonl``
  (the digest covers every trajectory's tokens, log-probs and reward, in batch order)."""
  h = hashlib.sha1()
  for t in trajectories:
    h.update(np.asarray(t.tokens, np.int32).tobytes())
    h.update(np.asarray(t.logprobs, np.float32).tobytes())
    h.update(np.float64(t.reward).tobytes())
  with open(os.path.join(run_dir, "ledger.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps({"step": int(step), "problem_ids": [str(t.problem_id) for t in trajectories],
                        "positions": [int(p) for p in positions],
                        "tokens_sha1": h.hexdigest()}) + "\n")


def resume_point(directory: str) -> Optional[int]:
  """Latest complete checkpoint step in ``directory`` (None if none); half-written ones
  (orbax temporary folders) are never returned."""
  if not os.path.isdir(directory):
    return None
  from sao_jax.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  ck = Checkpointer(directory)
  try:
    return ck.latest_step()
  finally:
    ck.close()


def maybe_kill(point: str, step: int) -> None:
  """Fault injection for the crash tests: if ``$SAO_FAULT_KILL`` is ``"<point>:<step>"`` (point:
  ``rollout`` -- half a batch collected, ``train`` -- after the update, before it is published or
  saved, ``checkpoint`` -- right after an asynchronous save started), the process SIGKILLs itself
  there. Unset in real runs."""
  if os.environ.get("SAO_FAULT_KILL") == f"{point}:{step}":
    import signal  # pylint: disable=import-outside-toplevel
    print(f"fault injection: SIGKILL at {point} of step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# Fields that may change when a run is resumed: how long it runs, how it checkpoints, logs and
# evaluates, and where its processes meet. Anything else changes *what* is trained.
RESUMABLE_CHANGES = ("run_dir", "train.num_steps", "checkpoint.", "log.", "eval.", "distributed.")


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_resume_config(run_dir: str, config_json: str, resume_step: Optional[int],
                        num_steps: int) -> None:
  """Refuses to resume ``run_dir`` (whose latest complete checkpoint is ``resume_step``) with a
  config that trains something else.

  ``config_json``: the new resolved config as JSON (``ConfigDict.to_json_best_effort()``);
  it is compared with ``run_dir/config.json`` written by the run that made the checkpoint.
  Only the fields in ``RESUMABLE_CHANGES`` may differ. Raises ValueError naming every other
  changed field (old and new value) and the fix; and when ``num_steps < resume_step`` (the
  checkpoint is already past the requested end). No-op when there is nothing to resume or no
  saved config."""
  if resume_step is None:
    return
  fix = ("use a new --config.run_dir, or --config.checkpoint.resume=False to start over in "
         "this folder")
  if num_steps < resume_step:
    raise ValueError(f"{run_dir} has a checkpoint at step {resume_step}, past "
                     f"train.num_steps={num_steps}: nothing left to train. Raise "
                     f"--config.train.num_steps to continue that run, or {fix}.")
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    old = _flat(json.load(f))
  new = _flat(json.loads(config_json))
  changed = [k for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k) and not any(
                 k == p or (p.endswith(".") and k.startswith(p)) for p in RESUMABLE_CHANGES)]
  if changed:
    diff = ", ".join(f"{k} (was {old.get(k)!r}, now {new.get(k)!r})" for k in changed[:8])
    more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    raise ValueError(f"{run_dir} holds a checkpoint (step {resume_step}) of a run with another "
                     f"config: {diff}{more}. Resuming would continue that run, not this one; "
                     f"{fix}.")
