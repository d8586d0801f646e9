"""Builds a task from the config: tokenizer, environment, train/eval problems, SFT demos."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass
class Task:
  tokenizer: Any
  env: Any
  train_problems: list
  eval_problems: list
  stop_ids: tuple
  sft_demos: Optional[list] = None


def make_task(config) -> Task:
  """``config.task.name``: "arith_tool" (CPU tool-use task) or "math" (JSONL benchmark files).

  Raises ValueError for an unknown task name."""
  from sao_jax.data.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  name = config.task.name
  tok = CharTokenizer()
  if name == "arith_tool":
    from sao_jax.envs import arith_tool  # pylint: disable=import-outside-toplevel
    train = arith_tool.make_problems(config.task.n_train, seed=config.seed, split="train")
    evals = arith_tool.make_problems(config.task.n_eval, seed=config.seed, split="eval")
    env = arith_tool.ArithToolEnv(tok, max_turns=config.task.max_turns)
    demos = arith_tool.make_sft_dataset(train[:config.sft.num_demos], p_tool=config.sft.p_tool,
                                        seed=config.seed, tokenizer=tok,
                                        p_guess_correct=config.sft.p_guess_correct)
    return Task(tok, env, train, evals, tuple(tok.stop_ids), demos)
  if name == "math":
    from sao_jax.data import jsonl  # pylint: disable=import-outside-toplevel
    from sao_jax.envs.math_env import MathEnv  # pylint: disable=import-outside-toplevel
    problems = jsonl.load_math_problems(jsonl.packaged_path(config.task.train_file)
                                        if "/" not in config.task.train_file
                                        else config.task.train_file,
                                        blank_lines="error")
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(problems))
    problems = [problems[i] for i in order]
    n_eval = min(config.task.n_eval, len(problems))
    return Task(tok, MathEnv(tok, max_turns=1), problems, problems[:n_eval],
                (tok.eos_id,), None)
  raise ValueError(f"unknown task.name={name!r}; use 'arith_tool' or 'math'.")
