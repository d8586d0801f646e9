"""Toy model config, tokenizer, problem and env-step types shared by the rollout tests."""

import dataclasses
import importlib.util
import os

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


# ---- the inference-host tests: configs/arith_tool.py:smoke with a tiny model ---------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_SETTINGS = {"rollout.slots": 8, "rollout.queue_size": 2, "model.d_model": 32,
                 "model.head_dim": 8, "model.d_ff": 64}


def host_overrides(**extra) -> list:
  """``--config.<field>=<value>`` flags for ``python -m sao_jax.rollout.host`` (HOST_SETTINGS plus
  ``extra``, given with "__" for "." e.g. ``rollout__kv_on_update="recompute"``)."""
  items = dict(HOST_SETTINGS, **{k.replace("__", "."): v for k, v in extra.items()})
  return [f"--config.{k}={v}" for k, v in items.items()]


def host_config(**extra):
  """The same settings as an ``ml_collections.ConfigDict`` for the trainer side of the test."""
  spec = importlib.util.spec_from_file_location("arith_cfg", os.path.join(ROOT, "configs",
                                                                          "arith_tool.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config("smoke")
  for key, value in dict(HOST_SETTINGS, **{k.replace("__", "."): v
                                           for k, v in extra.items()}).items():
    section, field = key.split(".")
    c[section][field] = value
  return c
