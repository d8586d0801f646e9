r"""Tool-integrated math reasoning (the paper's math setting): the policy writes Python, a sandbox
runs it, the output comes back as observation tokens, up to ``max_turns`` turns, and the final
``\boxed{}`` is graded with math-verify.

Format (told to the policy by ``INSTRUCTION``; the convention of ToRA / Qwen2.5-Math TIR)
------------------------------------------------------------------------------------------
A tool call is a fenced Python block followed by an ``output`` fence, which is the turn's stop
string (``STOP_STRINGS``: the rollout worker ends the turn when the decoded turn ends with it)::

    ...so I compute it.
    ```python
    print(sum(range(1, 101)))
    ```
    ```output                                   <- action ends here (action_mask 1)
    5050                                        <- observation (action_mask 0)
    ```
    The sum is \boxed{5050}.<eos>               <- next action

The observation is ``"\n" + OUTPUT + "\n```\n"``: OUTPUT is the program's stdout on success, or
``error: <reason>`` and the last 3 lines of stderr (``SandboxResult.observation``; reasons:
``timeout``, ``cpu_limit``, ``memory``, ``output_limit``, ``signal:SIGSEGV``, ``exit:1``, ...),
cut to ``max_output_chars`` characters (the first and last halves, joined by
``...[N characters cut]...``); special tokens the program prints (``<eos>``, ``<|im_end|>``) are
dropped from the observation ids, so output cannot forge a turn end or a chat role. The code is
the *last* complete ```` ```python ```` block before the final ```` ```output ````; blocks of
earlier turns are not re-run (each run starts from a fresh interpreter, so a program must
recompute what it needs).

Episode rules (``TirMathEnv.step``; ``turn`` counts from 0)
-----------------------------------------------------------
* the action (trailing whitespace and stop tokens ignored) ends with ```` ```output ````: a tool
  call. The code runs in ``sao_jax.envs.sandbox.run_python`` (own PID/mount/network namespaces, an
  unprivileged uid per run, CPU/wall/memory/process/file limits: ``SandboxLimits``); anything the
  program does -- an endless loop, a fork bomb, a write outside its tmpfs, a network connection, a
  crash -- comes back as an observation, never as an exception. Not done, reward 0; on the last
  allowed turn (``turn == max_turns - 1``) done instead, with ``reward = grade(action text)``.
* the action ends with a stop token (``eos`` / ``<|im_end|>``): done, reward =
  ``grade(action text, answer)`` (math-verify on the last ``\boxed{}`` of this turn; 0 without).
* no stop (the per-turn token limit): done, graded the same way (a box before the cut counts),
  ``info["truncated"] = True``.

``info``: ``tool_calls`` (0/1 for this step), ``stop`` (``"tool" | "eos" | "length"``),
``truncated``, ``answer`` (this turn's boxed content or None); tool steps add ``tool_error``
(None or the sandbox's reason), ``tool_wall_s`` and ``tool_output_chars``.

Prompts: with a chat template (``HFTokenizer``) the system message is ``INSTRUCTION`` and the
user message the problem; without one (``CharTokenizer``) the text is
``<bos>INSTRUCTION\n\nPROBLEM\n``.

Sandbox calls take up to ``limits.wall_s`` seconds: run ``env.step`` off the decode loop
(``RolloutWorker(env_workers=N)``, ``rollout.env_workers``) so a slow program stalls only its
own slot. The sandbox needs root (or CAP_SYS_ADMIN): ``TirMathEnv`` checks at construction and
raises ``SandboxUnavailable`` with the fix, never running model code unconfined.
"""

from __future__ import annotations

import re
import time
from typing import Optional, Sequence

from sao_jax.data.jsonl import Problem
from sao_jax.envs.base import EnvStep
from sao_jax.envs.grading import extract_boxed, grade
from sao_jax.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python

__all__ = ["TirMathEnv", "INSTRUCTION", "STOP_STRINGS", "extract_code", "cut_middle",
           "sandbox_check"]

OUTPUT_FENCE = "```output"
STOP_STRINGS: tuple[str, ...] = (OUTPUT_FENCE,)
INSTRUCTION = (
    "Solve the math problem. You may run Python (standard library only): write\n"
    "```python\n<code>\n```\n```output\n"
    "and stop; the printed output is shown to you, then continue. "
    "Put the final answer in \\boxed{}."
)
_CODE_RE = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> Optional[str]:
  """Source of the last complete ```` ```python ... ``` ```` block before the final
  ```` ```output ```` of ``text`` (None if there is none)."""
  end = text.rfind(OUTPUT_FENCE)
  blocks = _CODE_RE.findall(text[:end] if end >= 0 else text)
  return blocks[-1] if blocks else None


def encode_prompt(tokenizer, text: str) -> list[int]:
  """``text``'s token ids (ints), with ``tokenizer.bos_id`` in front when the tokenizer has one,
  has no chat template (a template writes its own start) and did not put it there itself."""
  ids = [int(i) for i in tokenizer.encode(text)]
  bos = getattr(tokenizer, "bos_id", None)
  if not getattr(tokenizer, "chat_template", None) and bos is not None and (
      not ids or ids[0] != bos):
    ids.insert(0, int(bos))
  return ids


def special_token_ids(tokenizer) -> frozenset:
  """The tokenizer's stop, special, BOS and pad ids (ints; absent ones skipped): ids an
  observation must not contain."""
  return frozenset(
      int(i) for i in (*(getattr(tokenizer, "stop_ids", ()) or ()),
                       *getattr(tokenizer, "special_ids", ()),
                       getattr(tokenizer, "bos_id", None), getattr(tokenizer, "pad_id", None))
      if i is not None)


def cut_middle(text: str, max_chars: int) -> str:
  """``text`` if it has at most ``max_chars`` characters, else its first and last
  ``max_chars // 2`` characters around ``...[N characters cut]...``."""
  if len(text) <= max_chars:
    return text
  half = max_chars // 2
  return f"{text[:half]}...[{len(text) - 2 * half} characters cut]...{text[len(text) - half:]}"


def sandbox_check(limits: SandboxLimits = SandboxLimits()) -> None:
  """Runs ``print(1)`` in the sandbox. Raises ``SandboxUnavailable`` (with the fix) if the OS
  does not allow its isolation (not root / no namespaces) or it does not print 1."""
  try:
    res = run_python("print(1)", limits)
  except SandboxUnavailable as e:
    raise SandboxUnavailable(
        f"{e}. task.name='tir_math' runs model-written Python only inside the sandbox "
        "(sao_jax/envs/sandbox.py), which needs root or CAP_SYS_ADMIN: run as root (e.g. in a "
        "container), or use task.name='math' (no tool).") from None
  if res.stdout != "1\n":
    raise SandboxUnavailable(f"the sandbox does not run Python here: {res.observation()!r}")


class TirMathEnv:
  """Multi-turn math environment with a sandboxed Python tool (module doc).

  Args:
    tokenizer: ``CharTokenizer`` or ``HFTokenizer`` (``encode``, ``decode``, ``bos_id``,
      ``stop_ids``; ``apply_chat_template`` selects chat prompts).
    max_turns: policy turns per episode (>= 1; paper: 50).
    limits: ``SandboxLimits`` of each program run (CPU/wall seconds, memory bytes, ...).
    max_output_chars: observation cut (characters of OUTPUT, >= 16).
    system: instruction / system message (default ``INSTRUCTION``).
    check_sandbox: run ``sandbox_check`` now (raises ``SandboxUnavailable``).

  Stateless: one instance serves many concurrent episodes and threads.
  Raises ValueError for ``max_turns < 1`` or ``max_output_chars < 16``.
  """

  stop_strings = STOP_STRINGS

  def __init__(self, tokenizer, max_turns: int = 50, limits: SandboxLimits = SandboxLimits(),
               max_output_chars: int = 1024, system: Optional[str] = None,
               check_sandbox: bool = True):
    if max_turns < 1:
      raise ValueError(f"task.max_turns must be >= 1, got {max_turns} (paper: 50).")
    if max_output_chars < 16:
      raise ValueError(f"task.tool_output_chars must be >= 16, got {max_output_chars}.")
    self.tokenizer = tokenizer
    self.max_turns = int(max_turns)
    self.limits = limits
    self.max_output_chars = int(max_output_chars)
    self.system = INSTRUCTION if system is None else system
    self._no_obs_ids = special_token_ids(tokenizer)
    if check_sandbox:
      sandbox_check(limits)

  # ---- prompt -----------------------------------------------------------------------------------
  def prompt_text(self, problem: Problem) -> str:
    if getattr(self.tokenizer, "chat_template", None):
      return self.tokenizer.apply_chat_template(
          [{"role": "system", "content": self.system}, {"role": "user", "content": problem.prompt}],
          add_generation_prompt=True)
    return f"{self.system}\n\n{problem.prompt}\n"

  def prompt_ids(self, problem: Problem) -> list[int]:
    return encode_prompt(self.tokenizer, self.prompt_text(problem))

  def observation_text(self, output: str) -> str:
    """``"\\n" + cut(OUTPUT) + "\\n```\\n"`` (closes the ```` ```output ```` fence)."""
    body = cut_middle(output.rstrip("\n"), self.max_output_chars)
    return f"\n{body}\n```\n"

  def run_tool(self, code: Optional[str]) -> tuple[str, Optional[str], float]:
    """(OUTPUT, error reason or None, wall seconds) of one tool call; never raises."""
    if code is None:
      return "error: no ```python code block before ```output", "no_code", 0.0
    t0 = time.perf_counter()
    try:
      res = run_python(code, self.limits)
    except Exception as e:  # pylint: disable=broad-except  (the rollout must go on)
      return f"error: sandbox failed: {type(e).__name__}", "sandbox", time.perf_counter() - t0
    out = res.observation(max_chars=max(4 * self.max_output_chars, 4096))
    return out, (None if res.ok else res.error), res.wall_s

  # ---- step -------------------------------------------------------------------------------------
  def step(self, problem: Problem, turn: int, action_ids: Sequence[int]) -> EnvStep:
    tok = self.tokenizer
    ids = [int(t) for t in action_ids]
    try:
      text = tok.decode(ids)
    except Exception:  # pylint: disable=broad-except
      text = ""
    boxed = extract_boxed(text)
    info: dict = {"tool_calls": 0, "truncated": False, "answer": boxed}
    stop_ids = tuple(int(s) for s in getattr(tok, "stop_ids", ()) or ())
    visible = tok.decode([t for t in ids if t not in stop_ids]) if ids else ""

    def graded() -> float:
      return grade(text, problem.answer) if boxed is not None else 0.0

    if visible.rstrip().endswith(OUTPUT_FENCE):
      output, error, wall = self.run_tool(extract_code(visible))
      info.update(stop="tool", tool_calls=1, tool_error=error, tool_wall_s=wall,
                  tool_output_chars=len(output))
      if turn >= self.max_turns - 1:
        return EnvStep(observation_ids=[], done=True, reward=graded(), info=info)
      obs = [i for i in (int(t) for t in tok.encode(self.observation_text(output)))
             if i not in self._no_obs_ids]  # printed "<|im_end|>" must not become the token
      return EnvStep(observation_ids=obs, done=False, reward=0.0, info=info)
    if ids and ids[-1] in stop_ids:
      info["stop"] = "eos"
    else:
      info.update(stop="length", truncated=True)
    return EnvStep(observation_ids=[], done=True, reward=graded(), info=info)
