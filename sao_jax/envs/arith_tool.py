r"""Tool-integrated arithmetic: "math with a Python tool" in miniature (CPU-sized).

Problems
--------
``make_problems(n, seed, split)`` draws expressions from five templates of the
same difficulty (a, c: 3-digit; b, d, e: 2-digit; all results are positive
4-6 digit integers, so guessing is hopeless)::

    a*b+c      a*b-c      c+a*b      (a+c)*b      a*b+d*e

``Problem(id="arith-train-0-000000", prompt="Compute 347*29-118.", answer="9945")``.

Train/eval disjointness: (1) the two splits draw from independent random
streams (``SeedSequence([seed, 0])`` for train, ``[seed, 1]`` for eval), and
(2) the problem space itself is partitioned by a stable hash of the
expression text: an expression belongs to eval iff
``blake2b(expr) % EVAL_HASH_BUCKETS == 0`` (10%), otherwise to train;
candidates of the other split are dropped while sampling.  Hence no eval
problem text can ever occur in any train set, whatever ``n`` or ``seed``.
Problems are unique within a split.

Token format (CharTokenizer; ``<x>`` are single special tokens)
-------------------------------------------------------------
Prompt (not trained on)::

    <bos>Compute 347*29-118.\n

Turn actions end with a stop token: ``</tool>`` (tool call) or ``<eos>``
(final answer).  A tool call is answered by an observation (not trained on)::

    <tool>347*29-118</tool>           action, turn 0   (loss_mask 1)
    <obs>9945</obs>                   observation      (loss_mask 0)
    \boxed{9945}<eos>                 action, turn 1   (loss_mask 1)

so a full tool demonstration is the token sequence of the text
``<bos>Compute 347*29-118.\n<tool>347*29-118</tool><obs>9945</obs>\boxed{9945}<eos>``
(no spaces or newlines between the parts).  A "guess" demonstration is
``<bos>Compute 347*29-118.\n\boxed{9812}<eos>``.  An invalid tool expression
is answered with ``<obs>error</obs>``.

Episode rules (``ArithToolEnv.step``)
-------------------------------------
* action ends with ``</tool>``: the expression between the last ``<tool>``
  and ``</tool>`` is evaluated with ``safe_eval_arith``; observation
  ``<obs>RESULT</obs>`` (or ``<obs>error</obs>``), not done.  On the last
  allowed turn (``turn == max_turns - 1``) the episode ends instead (empty
  observation), with reward ``grade(action text)`` (1.0 only if that turn's
  text also contains a correct ``\boxed{}``).
* action ends with ``<eos>``: done, reward = ``grade(action text, answer)``
  (0.0 without a box).
* no stop token (length limit) or empty action: done, reward 0.0,
  ``info["truncated"] = True``.

``info`` always has ``tool_calls`` (0/1 for this step; sum over steps for an
episode), ``truncated``, ``stop`` (``"tool" | "eos" | "length"``) and
``answer`` (this turn's boxed content or None); tool steps add
``tool_expr`` / ``tool_result`` / ``tool_latency_s``.

Tool latency (the long-tailed setting, ``task.tool_latency_median_s`` > 0)
----------------------------------------------------------------------------
Real agentic RL waits on sandboxes and tools whose call times are heavy-tailed.
With ``tool_latency_median_s=m`` and ``tool_latency_sigma=s`` every tool call
(a step that runs the calculator) sleeps ``tool_latency(...)`` seconds before it
returns: a lognormal draw ``m * exp(s * z)``, ``z ~ N(0, 1)``, so the median is
``m``, the 84th percentile ``m * e^s`` and the 99th ``m * e^(2.326 s)``
(m=0.2 s, s=1: median 0.2 s, mean 0.33 s, p99 2.05 s).  ``z`` is drawn from
``SeedSequence([seed, hash(problem id), turn, hash(action tokens)])``: the same
trajectory always waits the same time, while different samples of a prompt
draw independently unless they make the identical call.  The wait is a real
``time.sleep`` inside ``step`` (what a slow tool call looks like to the rollout
worker); ``m = 0`` (the default) is off.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Sequence

import numpy as np

from sao_jax.data.jsonl import Problem
from sao_jax.envs.arith_eval import safe_eval_arith
from sao_jax.envs.base import EnvStep
from sao_jax.envs.grading import extract_boxed, grade

__all__ = [
    "ArithToolEnv",
    "tool_latency",
    "EVAL_HASH_BUCKETS",
    "TEMPLATES",
    "make_demo",
    "make_problems",
    "make_sft_dataset",
    "problem_expression",
    "split_of",
]

TEMPLATES: tuple[str, ...] = (
    "{a}*{b}+{c}",
    "{a}*{b}-{c}",
    "{c}+{a}*{b}",
    "({a}+{c})*{b}",
    "{a}*{b}+{d}*{e}",
)
EVAL_HASH_BUCKETS = 10
_SPLITS = {"train": 0, "eval": 1}
_PROMPT_RE = re.compile(r"Compute (.+)\.")


def split_of(expr: str) -> str:
  """The split an expression belongs to ("train" or "eval"), by stable hash."""
  h = int.from_bytes(hashlib.blake2b(expr.encode("utf-8"), digest_size=8).digest(), "little")
  return "eval" if h % EVAL_HASH_BUCKETS == 0 else "train"


def _sample_expr(rng: np.random.Generator) -> str:
  t = int(rng.integers(len(TEMPLATES)))
  a, c = (int(x) for x in rng.integers(100, 1000, size=2))
  b, d, e = (int(x) for x in rng.integers(10, 100, size=3))
  return TEMPLATES[t].format(a=a, b=b, c=c, d=d, e=e)


def make_problems(n: int, seed: int = 0, split: str = "train") -> list[Problem]:
  """``n`` distinct deterministic problems of ``split`` ("train" | "eval")."""
  if split not in _SPLITS:
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  rng = np.random.default_rng(np.random.SeedSequence([int(seed), _SPLITS[split]]))
  seen: set[str] = set()
  problems: list[Problem] = []
  while len(problems) < n:
    expr = _sample_expr(rng)
    if expr in seen or split_of(expr) != split:
      continue
    seen.add(expr)
    problems.append(
        Problem(
            id=f"arith-{split}-{seed}-{len(problems):06d}",
            prompt=f"Compute {expr}.",
            answer=str(safe_eval_arith(expr)),
        )
    )
  return problems


def problem_expression(problem: Problem) -> str:
  """``"347*29-118"`` from ``Problem(prompt="Compute 347*29-118.")``."""
  m = _PROMPT_RE.fullmatch(problem.prompt.strip())
  if m is None:
    raise ValueError(f"not an arithmetic problem prompt: {problem.prompt!r}")
  return m.group(1)


def _hash64(data: bytes) -> int:
  return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def tool_latency(
    problem_id: str,
    turn: int,
    action_ids: Sequence[int],
    median_s: float,
    sigma: float,
    seed: int = 0,
) -> float:
  """Seconds one tool call waits: ``median_s * exp(sigma * z)``, ``z ~ N(0, 1)`` (lognormal).

  Args:
    problem_id: the problem's id (grpo group members carry ``#g<ordinal>``).
    turn: the policy turn (0-based) that made the call.
    action_ids: that turn's action tokens (ints).
    median_s: median latency in seconds (0 = off: returns 0.0).
    sigma: standard deviation of ``log(latency)`` (0 = always exactly ``median_s``).
    seed: ``config.seed``.

  Returns a float >= 0, deterministic in all arguments: ``z`` is the first standard normal of
  ``np.random.default_rng(SeedSequence([seed, blake2b(problem_id), turn, blake2b(action)]))``.
  Raises ValueError for ``median_s < 0`` or ``sigma < 0``.
  """
  if median_s < 0 or sigma < 0 or not math.isfinite(median_s) or not math.isfinite(sigma):
    raise ValueError(
        f"task.tool_latency_median_s={median_s} and task.tool_latency_sigma={sigma} must be "
        "finite and >= 0 (use e.g. 0.2 and 1.0, or median 0 for no latency)"
    )
  if median_s == 0:
    return 0.0
  action = np.asarray([int(t) for t in action_ids], np.int64).tobytes()
  ss = np.random.SeedSequence(
      [int(seed) & 0xFFFFFFFF, _hash64(str(problem_id).encode("utf-8")), int(turn),
       _hash64(action)]
  )
  z = float(np.random.default_rng(ss).standard_normal())
  return float(median_s * math.exp(sigma * z))


def _prompt_text(problem: Problem) -> str:
  return problem.prompt + "\n"


def _observation_ids(tokenizer, result: str) -> list[int]:
  return [tokenizer.obs_start_id, *tokenizer.encode(result), tokenizer.obs_end_id]


def _run_tool(expr: str | None) -> str:
  if expr is None:
    return "error"
  try:
    return str(safe_eval_arith(expr))
  except ValueError:
    return "error"


class ArithToolEnv:
  """Multi-turn arithmetic environment with a calculator tool (see module doc).

  Args:
    tokenizer: a ``CharTokenizer`` (or one with the same special tokens).
    max_turns: policy turns per episode (>= 1).
    tool_latency_median_s: median seconds each tool call sleeps (0 = no latency).
    tool_latency_sigma: log-std of the lognormal tool latency (``tool_latency``).
    seed: seed of the latency draws.

  Raises ValueError for ``max_turns < 1`` or a negative latency parameter.
  """

  def __init__(self, tokenizer, max_turns: int = 3, tool_latency_median_s: float = 0.0,
               tool_latency_sigma: float = 1.0, seed: int = 0):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    tool_latency("", 0, (), tool_latency_median_s, tool_latency_sigma)  # validates
    self.tokenizer = tokenizer
    self.max_turns = int(max_turns)
    self.tool_latency_median_s = float(tool_latency_median_s)
    self.tool_latency_sigma = float(tool_latency_sigma)
    self.seed = int(seed)

  def prompt_ids(self, problem: Problem) -> list[int]:
    return [self.tokenizer.bos_id, *self.tokenizer.encode(_prompt_text(problem))]

  @staticmethod
  def run_tool(expr: str | None) -> str:
    """The calculator: ``str(safe_eval_arith(expr))``, or ``"error"`` (subclasses narrow it)."""
    return _run_tool(expr)

  def observation_ids(self, result: str) -> list[int]:
    """Tokens of ``<obs>RESULT</obs>``."""
    return _observation_ids(self.tokenizer, result)

  def step(self, problem: Problem, turn: int, action_ids: Sequence[int]) -> EnvStep:
    tok = self.tokenizer
    ids = [int(t) for t in action_ids]
    text = tok.decode(ids)
    boxed = extract_boxed(text)
    info: dict = {"tool_calls": 0, "truncated": False, "answer": boxed}
    last_turn = turn >= self.max_turns - 1

    if not ids or ids[-1] not in (tok.eos_id, tok.tool_end_id):
      info.update(truncated=True, stop="length")
      return EnvStep(observation_ids=[], done=True, reward=0.0, info=info)

    if ids[-1] == tok.eos_id:
      info["stop"] = "eos"
      reward = grade(text, problem.answer) if boxed is not None else 0.0
      return EnvStep(observation_ids=[], done=True, reward=reward, info=info)

    # Tool call: expression between the last <tool> and the final </tool>.
    info["stop"] = "tool"
    info["tool_calls"] = 1
    starts = [i for i in range(len(ids) - 1) if ids[i] == tok.tool_start_id]
    expr = tok.decode(ids[starts[-1] + 1 : -1]) if starts else None
    result = self.run_tool(expr)
    wait = tool_latency(getattr(problem, "id", ""), turn, ids, self.tool_latency_median_s,
                        self.tool_latency_sigma, self.seed)
    if wait > 0:
      time.sleep(wait)  # a slow tool / sandbox call
    info.update(tool_expr=expr, tool_result=result, tool_latency_s=wait)
    if last_turn:
      reward = grade(text, problem.answer) if boxed is not None else 0.0
      return EnvStep(observation_ids=[], done=True, reward=reward, info=info)
    return EnvStep(observation_ids=self.observation_ids(result), done=False, reward=0.0,
                   info=info)


def _guess(answer: int, rng: np.random.Generator, p_correct: float) -> int:
  if rng.random() < p_correct:
    return answer
  scale = max(2, abs(answer) // 4)
  offset = int(rng.integers(1, scale + 1)) * (1 if rng.random() < 0.5 else -1)
  guess = answer + offset
  if (guess <= 0) != (answer <= 0):  # keep the sign (and rough magnitude)
    guess = answer - offset
  return guess


def make_demo(
    problem: Problem,
    use_tool: bool,
    rng: np.random.Generator,
    tokenizer,
    p_guess_correct: float = 0.1,
) -> tuple[list[int], list[int]]:
  """SFT demonstration ``(token_ids, loss_mask)`` for ``problem``.

  Tool demo: ``prompt <tool>EXPR</tool><obs>RESULT</obs>\\boxed{RESULT}<eos>``;
  guess demo: ``prompt \\boxed{GUESS}<eos>`` with GUESS correct w.p.
  ``p_guess_correct``, else answer + a nonzero offset of up to ~25% of the
  answer.  ``loss_mask`` is 1 exactly on action tokens (including
  ``</tool>`` and ``<eos>``), 0 on the prompt and on ``<obs>...</obs>``.
  The sequence is exactly what ``ArithToolEnv`` produces for these actions.
  """
  prompt = [tokenizer.bos_id, *tokenizer.encode(_prompt_text(problem))]
  ids: list[int] = list(prompt)
  mask: list[int] = [0] * len(prompt)

  def add(tokens: list[int], m: int) -> None:
    ids.extend(tokens)
    mask.extend([m] * len(tokens))

  if use_tool:
    expr = problem_expression(problem)
    result = _run_tool(expr)
    add([tokenizer.tool_start_id, *tokenizer.encode(expr), tokenizer.tool_end_id], 1)
    add(_observation_ids(tokenizer, result), 0)
    final = result
  else:
    final = str(_guess(int(problem.answer), rng, p_guess_correct))
  add([*tokenizer.encode("\\boxed{" + final + "}"), tokenizer.eos_id], 1)
  return ids, mask


def make_sft_dataset(
    problems: Sequence[Problem],
    p_tool: float,
    seed: int,
    tokenizer,
    p_guess_correct: float = 0.1,
) -> list[tuple[list[int], list[int]]]:
  """One demo per problem; each uses the tool with probability ``p_tool``."""
  rng = np.random.default_rng(seed)
  out = []
  for problem in problems:
    use_tool = bool(rng.random() < p_tool)
    out.append(make_demo(problem, use_tool, rng, tokenizer, p_guess_correct))
  return out
