"""Builds a task from the config: tokenizer, environment, train/eval problems, SFT demos."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass
class Task:
  """A built task. ``env`` is the training rollouts' environment; ``eval_env`` (None = ``env``)
  the one greedy evaluation uses: the arith task's tool latency (``task.tool_latency_median_s``)
  models the cost of training-time tool calls, so evaluation runs without the wait."""
  tokenizer: Any
  env: Any
  train_problems: list
  eval_problems: list
  stop_ids: tuple
  sft_demos: Optional[list] = None
  eval_env: Any = None


def make_task(config) -> Task:
  """``config.task.name``: "arith_tool" (CPU tool-use task), "chain_tool" (3-5 chained tool
  calls), "style_switch" (online style task) or "math" (JSONL benchmark files).

  Raises ValueError for an unknown task name."""
  from sao_jax.data.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  from sao_jax import pretrained  # pylint: disable=import-outside-toplevel
  name = config.task.name
  tok = pretrained.load_tokenizer(config) or CharTokenizer()
  if name == "arith_tool":
    from sao_jax.envs import arith_tool  # pylint: disable=import-outside-toplevel
    train = arith_tool.make_problems(config.task.n_train, seed=config.seed, split="train")
    evals = arith_tool.make_problems(config.task.n_eval, seed=config.seed, split="eval")
    env = arith_tool.ArithToolEnv(
        tok, max_turns=config.task.max_turns,
        tool_latency_median_s=config.task.get("tool_latency_median_s", 0.0),
        tool_latency_sigma=config.task.get("tool_latency_sigma", 1.0), seed=config.seed)
    eval_env = (arith_tool.ArithToolEnv(tok, max_turns=config.task.max_turns)
                if env.tool_latency_median_s > 0 else None)
    demos = arith_tool.make_sft_dataset(train[:config.sft.num_demos], p_tool=config.sft.p_tool,
                                        seed=config.seed, tokenizer=tok,
                                        p_guess_correct=config.sft.p_guess_correct)
    return Task(tok, env, train, evals, tuple(tok.stop_ids), demos, eval_env)
  if name == "chain_tool":  # 3-5 chained calculator calls (envs/chain_tool.py)
    from sao_jax.envs import chain_tool  # pylint: disable=import-outside-toplevel
    t = config.task
    lengths = tuple(t.get("chain_lengths", chain_tool.DEFAULT_LENGTHS))
    weights = tuple(t.get("chain_weights", chain_tool.DEFAULT_WEIGHTS))
    train = chain_tool.make_problems(t.n_train, config.seed, "train", lengths, weights)
    evals = chain_tool.make_problems(t.n_eval, config.seed, "eval", lengths, weights)
    env = chain_tool.ChainToolEnv(tok, max_turns=t.max_turns,
                                  tool_latency_median_s=t.get("tool_latency_median_s", 0.0),
                                  tool_latency_sigma=t.get("tool_latency_sigma", 1.0),
                                  seed=config.seed)
    eval_env = (chain_tool.ChainToolEnv(tok, max_turns=t.max_turns)
                if env.tool_latency_median_s > 0 else None)
    demos = chain_tool.make_sft_dataset(train[:config.sft.num_demos], p_tool=config.sft.p_tool,
                                        seed=config.seed, tokenizer=tok,
                                        p_guess_correct=config.sft.p_guess_correct,
                                        reliable_calls=config.sft.get("reliable_calls", 3))
    return Task(tok, env, train, evals, tuple(tok.stop_ids), demos, eval_env)
  if name == "style_switch":  # online-learning task (experiments/online_style.py)
    from sao_jax.envs import arith_tool, style_switch  # pylint: disable=import-outside-toplevel
    train = arith_tool.make_problems(config.task.n_train, seed=config.seed, split="train")
    evals = arith_tool.make_problems(config.task.n_eval, seed=config.seed, split="eval")
    env = style_switch.StyleSwitchEnv(
        tok, max_turns=config.task.max_turns,
        switch_every_episodes=config.task.get("switch_every", 20) * config.train.batch_size)
    demos = style_switch.make_sft_dataset(train[:config.sft.num_demos], p_tool=config.sft.p_tool,
                                          seed=config.seed, tokenizer=tok,
                                          p_guess_correct=config.sft.p_guess_correct)
    return Task(tok, env, train, evals, tuple(tok.stop_ids), demos)
  if name == "math":
    from sao_jax.data import jsonl  # pylint: disable=import-outside-toplevel
    from sao_jax.envs.math_env import MathEnv  # pylint: disable=import-outside-toplevel
    from sao_jax.envs.chat_math import ChatMathEnv  # pylint: disable=import-outside-toplevel

    def load(f):
      return jsonl.load_math_problems(jsonl.packaged_path(f) if "/" not in f else f,
                                      blank_lines="error")

    problems = load(config.task.train_file)
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(problems))
    problems = [problems[i] for i in order]
    evals = load(config.task.eval_file) if config.task.get("eval_file", "") else problems
    n_eval = min(config.task.n_eval, len(evals))
    if getattr(tok, "chat_template", None):  # a real checkpoint: prompts via its chat template
      env = ChatMathEnv(tok, system=config.task.get("system_prompt", None) or None)
      stop = tuple(tok.stop_ids)
    else:
      env, stop = MathEnv(tok, max_turns=1), (tok.eos_id,)
    return Task(tok, env, problems, evals[:n_eval], stop, None)
  raise ValueError(f"unknown task.name={name!r}; use 'arith_tool', 'chain_tool', 'style_switch' or "
                   "'math'.")
