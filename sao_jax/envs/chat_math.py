r"""Single-turn math environment whose prompt goes through the model's chat template.

For instruction-tuned checkpoints (SmolLM2, Qwen3): the prompt is
``tokenizer.apply_chat_template([system?, {"role": "user", "content": problem + instruction}],
add_generation_prompt=True)``; grading and episode logic are ``MathEnv``'s (one turn, reward
``grade(decoded response, answer)`` with math-verify).
"""

from __future__ import annotations

from typing import Callable, Optional

from sao_jax.data.jsonl import Problem
from sao_jax.envs.math_env import MathEnv

CHAT_INSTRUCTION = "\nReason step by step, then put the final answer in \\boxed{}."


class ChatMathEnv(MathEnv):
  """``MathEnv`` with chat-template prompts. ``tokenizer`` needs ``apply_chat_template``
  (``sao_jax.data.hf_tokenizer.HFTokenizer``); ``system``: optional system message (None keeps
  the template's default, if it has one); ``answer_prefix``: text that starts the assistant's
  turn in the prompt and is graded as the response's start, "" (default) = none; ``{expr}`` in
  it is replaced by ``expression(problem)`` (chat_arith: ``"{expr} ="`` starts the answer as
  ``13 + 14 =``, which fixes the one-line format). Raises ValueError without a chat template, or
  for ``{expr}`` without ``expression``."""

  def __init__(self, tokenizer, max_turns: int = 1, system: Optional[str] = None,
               instruction: str = CHAT_INSTRUCTION, answer_prefix: str = "",
               expression: Optional[Callable[[Problem], str]] = None):
    super().__init__(tokenizer, max_turns)
    if not hasattr(tokenizer, "apply_chat_template"):
      raise ValueError("ChatMathEnv needs a tokenizer with apply_chat_template (HFTokenizer).")
    if "{expr}" in answer_prefix and expression is None:
      raise ValueError(f"task.answer_prefix={answer_prefix!r} uses {{expr}}, which only "
                       "task.name='chat_arith' defines; remove it")
    self.system = system
    self.instruction = instruction
    self.answer_prefix = str(answer_prefix)
    self.expression = expression

  def response_prefix(self, problem: Problem) -> str:
    """``answer_prefix`` with ``{expr}`` filled in for ``problem``."""
    if "{expr}" not in self.answer_prefix:
      return self.answer_prefix
    return self.answer_prefix.replace("{expr}", self.expression(problem))

  def messages(self, problem: Problem) -> list[dict]:
    msgs = [] if self.system is None else [{"role": "system", "content": self.system}]
    return msgs + [{"role": "user", "content": problem.prompt + self.instruction}]

  def prompt_text(self, problem: Problem) -> str:
    return (self.tokenizer.apply_chat_template(self.messages(problem), add_generation_prompt=True)
            + self.response_prefix(problem))

  def prompt_ids(self, problem: Problem) -> list[int]:
    return [int(i) for i in self.tokenizer.encode(self.prompt_text(problem))]
