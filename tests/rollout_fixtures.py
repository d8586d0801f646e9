"""Toy model config, tokenizer, problem and env-step types shared by the rollout tests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.transformer import ModelConfig, default_positions
from sao_jax.train.steps import token_logprobs

CFG = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_seq_len=64)


class Tok:
  """Character ids 10..39; pad 0, bos 1, eos 2; 5 is a second stop token."""
  pad_id, bos_id, eos_id = 0, 1, 2
  vocab_size = 40
  stop_ids = (2, 5)

  def encode(self, s):
    return [10 + (ord(c) % 30) for c in s]

  def decode(self, ids):
    return "".join(chr(97 + (i % 26)) for i in ids)


@dataclasses.dataclass(frozen=True)
class P:
  id: str
  prompt: list


@dataclasses.dataclass(frozen=True)
class Step:
  observation_ids: list
  done: bool
  reward: float
  info: dict


class EchoEnv:
  """Two turns: turn 0 is answered with 4 observation tokens [6, 7, 8, 9]; turn 1 ends the
  episode with reward ``len(action_ids)``."""
  max_turns = 2

  def prompt_ids(self, p):
    return [1] + p.prompt

  def step(self, p, turn, action_ids):
    if turn == 0:
      return Step([6, 7, 8, 9], False, 0.0, {})
    return Step([], True, float(len(action_ids)), {"tool_calls": 1})


# ---- a scripted rollout: the same trajectories on every backend, no model ----------------------
# (policy versions of members 0 and 1 of the rollouts of ledger position p; the response has
# 1 + (p + member) % 3 action tokens). Positions not listed are sampled at version 0.
SCRIPT_VERSIONS = {0: (0, 0), 1: (0, 0), 2: (0, 0), 3: (1, 1), 4: (0, 1), 5: (2, 2), 6: (1, 2),
                   7: (1, 1), 8: (2, 1), 9: (3, 3), 10: (2, 3)}


def scripted_trajectory(handout, member: int):
  """The scripted rollout of ``handout`` (a ``Handout``), as group member ``member``: one
  prompt token, then ``1 + (position + member) % 3`` action tokens all sampled at
  ``SCRIPT_VERSIONS[position][member]``, log-prob -0.5 each, reward 1."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from sao_jax.rollout.trajectory import Trajectory  # pylint: disable=import-outside-toplevel
  p = int(handout.position)
  n = 1 + (p + member) % 3
  v = SCRIPT_VERSIONS.get(p, (0, 0))[member % 2]
  mask = np.array([0] + [1] * n, np.float32)
  return Trajectory(handout.id, np.arange(10, 11 + n, dtype=np.int32), mask,
                    np.where(mask > 0, -0.5, 0.0).astype(np.float32),
                    np.where(mask > 0, v, -1).astype(np.int32), 1.0, prompt_position=p)


class _Members:
  """Member index of each arrival of a position (group members are consecutive hand-outs)."""

  def __init__(self):
    self.seen = {}

  def __call__(self, handout) -> int:
    k = self.seen.get(handout.position, 0)
    self.seen[handout.position] = k + 1
    return k


class ScriptedWorker:
  """Stands in for ``RolloutWorker`` in ``ThreadSource``: rolls out each hand-out with
  ``scripted_trajectory``, in order, asking the admission control like the real worker."""

  def __init__(self, engine, env, problems, sink, weights, *, admission=None, **_):
    from sao_jax.rollout.worker import WorkerStats  # pylint: disable=import-outside-toplevel
    self.problems, self.sink, self.weights, self.admission = problems, sink, weights, admission
    self.stats, self.slots, self.error = WorkerStats(), [None], None
    self.member = _Members()

  def sink_s_now(self) -> float:
    return 0.0

  def start_thread(self, stop):
    import threading  # pylint: disable=import-outside-toplevel
    t = threading.Thread(target=self._run, args=(stop,), daemon=True)
    t.start()
    return t

  def _run(self, stop):
    import time  # pylint: disable=import-outside-toplevel
    try:
      while not stop.is_set():
        if self.admission is not None and not self.admission.try_start(self.weights.version):
          time.sleep(0.005)
          continue
        handout = next(self.problems)
        if handout is None:
          if self.admission is not None:
            self.admission.finish(accepted=False)
          time.sleep(0.005)
          continue
        traj = scripted_trajectory(handout, self.member(handout))
        self.stats.trajectories += 1
        self.stats.tokens_sampled += traj.num_action_tokens
        if self.admission is not None:
          self.admission.finish(accepted=True)
        self.sink(traj)
    except BaseException as e:  # pylint: disable=broad-except  (reported by take)
      self.error = e


class ScriptedActor:
  """Stands in for ``RolloutActor`` in ``RaySource`` (same methods): rolls out the submitted
  hand-outs with ``scripted_trajectory``, in order; weights are acknowledged, not pulled."""

  def __init__(self, run, model_config, index):  # pylint: disable=unused-argument
    import uuid  # pylint: disable=import-outside-toplevel
    self.incarnation, self.version, self.items = uuid.uuid4().hex, -1, []
    self.member = _Members()

  def set_weights(self, ref) -> int:
    self.version = max(self.version, int(ref.version))
    return self.version

  def submit(self, incarnation, items) -> int:
    if incarnation == self.incarnation:
      self.items.extend(items)
    return len(self.items)

  def poll(self, timeout_s: float = 0.2, layout: bool = False) -> dict:  # pylint: disable=unused-argument
    import time  # pylint: disable=import-outside-toplevel
    if not self.items:
      time.sleep(min(timeout_s, 0.05))
    out = [(ticket, scripted_trajectory(h, self.member(h))) for ticket, h in self.items]
    self.items = []
    return {"incarnation": self.incarnation, "version": self.version,
            "first_serve_version": 0, "trajectories": out, "stats": {}, "pull_s": 0.0,
            "layout": None}  # None: whole leaves

  def pid(self) -> int:
    import os  # pylint: disable=import-outside-toplevel
    return os.getpid()

  def stop(self) -> None:
    pass


def full_logprobs(graphdef, params, trajs, temperature: float) -> list:
  """Per trajectory, the log-prob (at ``temperature``) of every token under one jitted causal
  forward pass over all ``trajs``, right-padded to ``CFG.max_seq_len``: float32 [len(tokens)]."""
  padded = np.zeros((len(trajs), CFG.max_seq_len), np.int32)
  for b, traj in enumerate(trajs):
    padded[b, :len(traj.tokens)] = traj.tokens
  fwd = jax.jit(lambda p, t: token_logprobs(
      nnx.merge(graphdef, p)(t, default_positions(t))[0], t, temperature))
  full = np.asarray(fwd(params, jnp.asarray(padded)))
  return [full[b, :len(traj.tokens)] for b, traj in enumerate(trajs)]
