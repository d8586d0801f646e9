r"""Single-turn math environment whose prompt goes through the model's chat template.

For instruction-tuned checkpoints (SmolLM2, Qwen3): the prompt is
``tokenizer.apply_chat_template([system?, {"role": "user", "content": problem + instruction}],
add_generation_prompt=True)``; grading and episode logic are ``MathEnv``'s (one turn, reward
``grade(decoded response, answer)`` with math-verify).
"""

from __future__ import annotations

from typing import Optional

from sao_jax.data.jsonl import Problem
from sao_jax.envs.math_env import MathEnv

CHAT_INSTRUCTION = "\nReason step by step, then put the final answer in \\boxed{}."


class ChatMathEnv(MathEnv):
  """``MathEnv`` with chat-template prompts. ``tokenizer`` needs ``apply_chat_template``
  (``sao_jax.data.hf_tokenizer.HFTokenizer``); ``system``: optional system message (None keeps
  the template's default, if it has one)."""

  def __init__(self, tokenizer, max_turns: int = 1, system: Optional[str] = None,
               instruction: str = CHAT_INSTRUCTION):
    super().__init__(tokenizer, max_turns)
    if not hasattr(tokenizer, "apply_chat_template"):
      raise ValueError("ChatMathEnv needs a tokenizer with apply_chat_template (HFTokenizer).")
    self.system = system
    self.instruction = instruction

  def messages(self, problem: Problem) -> list[dict]:
    msgs = [] if self.system is None else [{"role": "system", "content": self.system}]
    return msgs + [{"role": "user", "content": problem.prompt + self.instruction}]

  def prompt_text(self, problem: Problem) -> str:
    return self.tokenizer.apply_chat_template(self.messages(problem), add_generation_prompt=True)

  def prompt_ids(self, problem: Problem) -> list[int]:
    return [int(i) for i in self.tokenizer.encode(self.prompt_text(problem))]
