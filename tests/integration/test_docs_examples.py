"""The Python examples in docs/ run as written."""

import repo_paths  # tests/repo_paths.py
import os
import re

ROOT = repo_paths.ROOT


def _python_blocks(name):
  text = open(os.path.join(ROOT, "docs", name), encoding="utf-8").read()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_extending_example_runs(monkeypatch):
  from sao_jax import roles  # pylint: disable=import-outside-toplevel
  from sao_jax.envs import registry  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(roles, "SECTIONS", dict(roles.SECTIONS))  # the example swaps a role
  monkeypatch.setattr(registry, "TASKS", dict(registry.TASKS))  # and registers a task
  blocks = _python_blocks("extending.md")
  assert len(blocks) == 2  # an environment; then a new task and config field
  scope = {}
  for block in blocks:
    exec(compile(block, "docs/extending.md", "exec"), scope)  # pylint: disable=exec-used
  assert "vowels" in registry.TASKS and scope["task"].eval_problems[0].answer == "4"
  assert scope["step"].reward == 1.0
  env, tok, problem = scope["env"], scope["tok"], scope["problem"]
  wrong = env.step(problem, 0, tok.encode("\\boxed{4}") + [tok.eos_id])
  assert wrong.reward == 0.1 and not wrong.info["truncated"]
  cut = env.step(problem, 0, tok.encode("\\boxed{3"))
  assert cut.reward == 0.0 and cut.info["truncated"]
