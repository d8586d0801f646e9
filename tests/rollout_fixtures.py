"""Toy model config, tokenizer, problem and env-step types shared by the rollout tests."""

import dataclasses

from sao_jax.models.transformer import ModelConfig

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
