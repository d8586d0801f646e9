"""Builds a task from the typed ``roles.Run``: tokenizer, environment, problems, SFT demos.

``make_task`` looks ``run.task.name`` up in ``sao_jax/envs/registry.py:TASKS`` and calls the
registered ``build_*(run, tokenizer) -> Task``; the builders of the packaged tasks are below.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from sao_jax import pretrained, roles
from sao_jax.data import jsonl, split
from sao_jax.data.tokenizer import CharTokenizer
from sao_jax.envs import arith_tool, chain_tool, chat_arith, registry, style_switch
from sao_jax.envs.chat_math import ChatMathEnv
from sao_jax.envs.math_env import MathEnv
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.tir_math import TirMathEnv


@dataclasses.dataclass
class Task:
  """A built task. ``env`` is the training rollouts' environment; ``eval_env`` (None = ``env``)
  the one greedy evaluation uses: the arith task's tool latency (``task.tool_latency_median_s``)
  models the cost of training-time tool calls, so evaluation runs without the wait.
  ``stop_strings``: strings that end a turn like a stop token (``RolloutWorker(stop_strings=)``;
  tir_math: ``("```output",)``, the tool-call fence).

  Hooks the driver calls for every task (no task is special-cased there):
  ``on_policy_start()`` once before the first policy step (after the critic warm-up; e.g. the
  style task starts its phase clock), ``batch_metrics(trajs) -> dict[str, float]`` for every
  policy step's trajectories (added to the step's metrics). ``grader``: what decides the reward,
  named in the run's results table (``train/report.py``)."""
  tokenizer: Any
  env: Any
  train_problems: list
  eval_problems: list
  stop_ids: tuple
  sft_demos: Optional[list] = None
  eval_env: Any = None
  stop_strings: tuple = ()
  on_policy_start: Callable[[], None] = lambda: None
  batch_metrics: Callable[[list], dict] = lambda trajs: {}
  grader: str = "math-verify"


def make_task(run: roles.Run) -> Task:
  """The task ``run.task.name`` names, built by its registered builder
  (``envs/registry.py:TASKS``) with the tokenizer of ``run.model`` (a checkpoint's, else
  characters).

  Raises ValueError for an unknown task name, TypeError for anything but a ``roles.Run`` (the
  top converts a ConfigDict once, with ``roles.from_config``)."""
  if not isinstance(run, roles.Run):
    raise TypeError(f"make_task takes a roles.Run, got {type(run).__name__}; convert a "
                    "ConfigDict once at the top with sao_jax.roles.from_config")
  build = registry.builder(run.task.name)
  tok = pretrained.load_tokenizer(run.model) or CharTokenizer()
  return build(run, tok)


def build_arith_tool(run: roles.Run, tok) -> Task:
  """The CPU tool-use task (``sao_jax/envs/arith_tool.py``)."""
  t, seed = run.task, run.seed
  train = arith_tool.make_problems(t.n_train, seed=seed, split="train")
  evals = arith_tool.make_problems(t.n_eval, seed=seed, split="eval")
  env = arith_tool.ArithToolEnv(tok, max_turns=t.max_turns,
                                tool_latency_median_s=t.tool_latency_median_s,
                                tool_latency_sigma=t.tool_latency_sigma, seed=seed)
  eval_env = (arith_tool.ArithToolEnv(tok, max_turns=t.max_turns)
              if env.tool_latency_median_s > 0 else None)
  demos = arith_tool.make_sft_dataset(train[:run.sft.num_demos], p_tool=run.sft.p_tool,
                                      seed=seed, tokenizer=tok,
                                      p_guess_correct=run.sft.p_guess_correct)
  return Task(tok, env, train, evals, tuple(tok.stop_ids), demos, eval_env)


def build_chain_tool(run: roles.Run, tok) -> Task:
  """3-5 chained calculator calls (``sao_jax/envs/chain_tool.py``)."""
  t, seed = run.task, run.seed
  lengths, weights = tuple(t.chain_lengths), tuple(t.chain_weights)
  train = chain_tool.make_problems(t.n_train, seed, "train", lengths, weights)
  evals = chain_tool.make_problems(t.n_eval, seed, "eval", lengths, weights)
  env = chain_tool.ChainToolEnv(tok, max_turns=t.max_turns,
                                tool_latency_median_s=t.tool_latency_median_s,
                                tool_latency_sigma=t.tool_latency_sigma, seed=seed,
                                obs_pad=t.obs_pad)
  eval_env = (chain_tool.ChainToolEnv(tok, max_turns=t.max_turns, obs_pad=t.obs_pad)
              if env.tool_latency_median_s > 0 else None)
  demos = chain_tool.make_sft_dataset(train[:run.sft.num_demos], p_tool=run.sft.p_tool,
                                      seed=seed, tokenizer=tok,
                                      p_guess_correct=run.sft.p_guess_correct,
                                      reliable_calls=run.sft.reliable_calls, obs_pad=t.obs_pad)
  return Task(tok, env, train, evals, tuple(tok.stop_ids), demos, eval_env)


def build_style_switch(run: roles.Run, tok) -> Task:
  """The online style task over ``task.style_base`` (experiments/online_style.py)."""
  base_run = dataclasses.replace(run, task=dataclasses.replace(run.task, name=run.task.style_base))
  base = registry.builder(run.task.style_base)(base_run, tok)
  env = style_switch.StyleSwitchEnv(
      base.env, switch_every_episodes=run.task.switch_every * run.train.batch_size)
  # greedy evaluation grades correctness only (the base env) and leaves the phase counter alone
  # the phase clock starts with policy step 1 (thread backend; Ray workers hold their own copies)
  return dataclasses.replace(base, env=env, eval_env=base.eval_env or base.env,
                             sft_demos=style_switch.add_styles(base.sft_demos, run.seed, tok),
                             on_policy_start=env.reset_phase_clock,
                             batch_metrics=style_switch.batch_metrics)


def build_math(run: roles.Run, tok) -> Task:
  """JSONL benchmark files, single turn (``task.train_file``, ``task.eval_file``)."""
  t = run.task

  def load(f):
    return jsonl.load_math_problems(jsonl.packaged_path(f) if "/" not in f else f,
                                    blank_lines="error")

  problems = load(t.train_file)
  order = np.random.default_rng(run.seed).permutation(len(problems))
  problems = [problems[i] for i in order]
  evals = load(t.eval_file) if t.eval_file else problems
  n_eval = min(t.n_eval, len(evals))
  if getattr(tok, "chat_template", None):  # a real checkpoint: prompts via its chat template
    env = ChatMathEnv(tok, system=t.system_prompt or None)
    stop = tuple(tok.stop_ids)
  else:
    env, stop = MathEnv(tok, max_turns=1), (tok.eos_id,)
  return Task(tok, env, problems, evals[:n_eval], stop, None)


def build_chat_arith(run: roles.Run, tok) -> Task:
  """Small-number arithmetic for a chat model (``sao_jax/envs/chat_arith.py``)."""
  if not getattr(tok, "chat_template", None):
    raise ValueError("task.name='chat_arith' needs a chat model (model.gguf or "
                     "model.checkpoint_dir with a chat template); use 'arith_tool' otherwise")
  t, m = run.task, run.task.max_operand
  train = chat_arith.make_problems(t.n_train, run.seed, "train", m)
  evals = chat_arith.make_problems(t.n_eval, run.seed, "eval", m)
  env = ChatMathEnv(tok, system=t.system_prompt or chat_arith.SYSTEM,
                    instruction=chat_arith.INSTRUCTION, answer_prefix=t.answer_prefix,
                    expression=chat_arith.expression)
  return Task(tok, env, train, evals, tuple(tok.stop_ids), None)


def build_tir_math(run: roles.Run, tok) -> Task:
  """JSONL files, multi-turn with the sandboxed Python tool (``sao_jax/envs/tir_math.py``);
  ``task.train_file`` is a comma-separated list of files or "paper_mix", checked against every
  evaluation set by ``sao_jax.data.split``."""
  t = run.task
  names = split.parse_file_list(t.train_file or "paper_mix")
  eval_file = t.eval_file or "aime25.jsonl"
  problems = split.load_train_mix(names, eval_sets=sorted(set(split.EVAL_SETS) | {eval_file}))
  problems = [problems[i] for i in np.random.default_rng(run.seed).permutation(len(problems))]
  evals = split.load_files([eval_file])
  limits = SandboxLimits(cpu_s=t.tool_cpu_s, wall_s=t.tool_wall_s,
                         memory_bytes=t.tool_memory_mb * 2**20)
  env = TirMathEnv(tok, max_turns=t.max_turns, limits=limits,
                   max_output_chars=t.tool_output_chars, system=t.system_prompt or None)
  stop = tuple(tok.stop_ids) if getattr(tok, "chat_template", None) else (tok.eos_id,)
  return Task(tok, env, problems, evals[:min(t.n_eval, len(evals))], stop, None,
              stop_strings=env.stop_strings)
