"""Builds a task from the config: tokenizer, environment, train/eval problems, SFT demos."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from sao_jax.data.tokenizer import CharTokenizer
from sao_jax import pretrained
from sao_jax.envs import arith_tool, chain_tool, chat_arith, style_switch
from sao_jax.data import jsonl
from sao_jax.envs.math_env import MathEnv
from sao_jax.envs.chat_math import ChatMathEnv
from sao_jax.data import split
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.tir_math import TirMathEnv


@dataclasses.dataclass
class Task:
  """A built task. ``env`` is the training rollouts' environment; ``eval_env`` (None = ``env``)
  the one greedy evaluation uses: the arith task's tool latency (``task.tool_latency_median_s``)
  models the cost of training-time tool calls, so evaluation runs without the wait.
  ``stop_strings``: strings that end a turn like a stop token (``RolloutWorker(stop_strings=)``;
  tir_math: ``("```output",)``, the tool-call fence)."""
  tokenizer: Any
  env: Any
  train_problems: list
  eval_problems: list
  stop_ids: tuple
  sft_demos: Optional[list] = None
  eval_env: Any = None
  stop_strings: tuple = ()


def make_task(config) -> Task:
  """``config.task.name``: "arith_tool" (CPU tool-use task), "chain_tool" (3-5 chained tool
  calls, ``sao_jax/envs/chain_tool.py``), "style_switch" (online style task over ``task.style_base``, "arith_tool" or "chain_tool"), "math" (JSONL
  benchmark files, single turn), "chat_arith" (small-number sums for a chat model,
  ``sao_jax/envs/chat_arith.py``) or "tir_math" (JSONL files, multi-turn with the sandboxed Python
  tool: ``sao_jax/envs/tir_math.py``; ``task.train_file`` is a comma-separated list of files or
  "paper_mix", checked against every evaluation set by ``sao_jax.data.split``).

  Raises ValueError for an unknown task name."""
  name = config.task.name
  tok = pretrained.load_tokenizer(config) or CharTokenizer()
  if name == "arith_tool":
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
    base_name = config.task.get("style_base", "arith_tool")
    if base_name not in ("arith_tool", "chain_tool"):
      raise ValueError(f"task.style_base={base_name!r}: the style task wraps 'arith_tool' or "
                       "'chain_tool'")
    base_config = config.copy_and_resolve_references()
    base_config.task.name = base_name
    base = make_task(base_config)
    env = style_switch.StyleSwitchEnv(
        base.env, switch_every_episodes=config.task.get("switch_every", 20) *
        config.train.batch_size)
    # greedy evaluation grades correctness only (the base env) and leaves the phase counter alone
    return dataclasses.replace(base, env=env, eval_env=base.eval_env or base.env,
                               sft_demos=style_switch.add_styles(base.sft_demos, config.seed, tok))
  if name == "math":

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
  if name == "tir_math":
    return _make_tir_math(config, tok)
  if name == "chat_arith":  # small-number arithmetic for a chat model (envs/chat_arith.py)
    if not getattr(tok, "chat_template", None):
      raise ValueError("task.name='chat_arith' needs a chat model (model.gguf or "
                       "model.checkpoint_dir with a chat template); use 'arith_tool' otherwise")
    m = int(config.task.get("max_operand", 30))
    train = chat_arith.make_problems(config.task.n_train, config.seed, "train", m)
    evals = chat_arith.make_problems(config.task.n_eval, config.seed, "eval", m)
    env = ChatMathEnv(tok, system=config.task.get("system_prompt", "") or chat_arith.SYSTEM,
                      instruction=chat_arith.INSTRUCTION)
    return Task(tok, env, train, evals, tuple(tok.stop_ids), None)
  raise ValueError(f"unknown task.name={name!r}; use 'arith_tool', 'chain_tool', "
                   "'style_switch', 'math', 'tir_math' or 'chat_arith'.")


def _make_tir_math(config, tok) -> Task:
  """The tool-integrated math task (``make_task`` doc)."""
  t = config.task
  names = split.parse_file_list(t.train_file or "paper_mix")
  eval_file = t.get("eval_file", "") or "aime25.jsonl"
  problems = split.load_train_mix(names, eval_sets=sorted(set(split.EVAL_SETS) | {eval_file}))
  rng = np.random.default_rng(config.seed)
  problems = [problems[i] for i in rng.permutation(len(problems))]
  evals = split.load_files([eval_file])
  limits = SandboxLimits(cpu_s=int(t.get("tool_cpu_s", 5)), wall_s=float(t.get("tool_wall_s", 10.0)),
                         memory_bytes=int(t.get("tool_memory_mb", 1024)) * 2**20)
  env = TirMathEnv(tok, max_turns=t.max_turns, limits=limits,
                   max_output_chars=int(t.get("tool_output_chars", 1024)),
                   system=t.get("system_prompt", "") or None)
  stop = tuple(tok.stop_ids) if getattr(tok, "chat_template", None) else (tok.eos_id,)
  return Task(tok, env, problems, evals[:min(t.n_eval, len(evals))], stop, None,
              stop_strings=env.stop_strings)
