"""The Python examples in docs/ run as written."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks(name):
  text = open(os.path.join(ROOT, "docs", name), encoding="utf-8").read()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_extending_example_runs():
  blocks = _python_blocks("extending.md")
  assert len(blocks) == 1
  scope = {}
  exec(compile(blocks[0], "docs/extending.md", "exec"), scope)  # pylint: disable=exec-used
  assert scope["step"].reward == 1.0
  env, tok, problem = scope["env"], scope["tok"], scope["problem"]
  wrong = env.step(problem, 0, tok.encode("\\boxed{4}") + [tok.eos_id])
  assert wrong.reward == 0.1 and not wrong.info["truncated"]
  cut = env.step(problem, 0, tok.encode("\\boxed{3"))
  assert cut.reward == 0.0 and cut.info["truncated"]
