"""The config boundary: every field declared once (sao_jax/roles.py), the ConfigDict converted
once at the top (roles.from_config), no per-module fallback defaults, docs/config.md current."""

import repo_paths  # tests/repo_paths.py
import ast
import dataclasses
import os
import re

import ml_collections
import pytest

from sao_jax import configs, docs_gen, roles
from sao_jax.roles import ConfigError

ROOT = repo_paths.ROOT
PKG = os.path.join(ROOT, "sao_jax")

# modules that may import ml_collections: the CLI entry points (main, eval, plan: flags ->
# ConfigDict), the role declarations, the configs/ loader, the docs generator (it reads configs/),
# and validation (it checks a user's ConfigDict before conversion)
ML_COLLECTIONS_ALLOWED = {"main.py", "roles.py", "configs.py", "docs_gen.py", "eval.py", "plan.py",
                          "train/validation.py"}
# a fallback default on a config read, e.g. config.task.get("n", 3) or _config_get(r, "x", 2)
SECTIONS = "|".join(roles.SECTIONS)
FALLBACK = re.compile(rf"\b(config|cfg)(\.({SECTIONS}))?\.get\(\"|_config_get\(")


def _modules():
  for d, _, files in os.walk(PKG):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        yield os.path.relpath(path, PKG), open(path, encoding="utf-8").read()


def test_only_the_top_imports_ml_collections():
  importers = set()
  for rel, src in _modules():
    for node in ast.walk(ast.parse(src)):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      if any(n.split(".")[0] == "ml_collections" for n in names):
        importers.add(rel)
  assert importers <= ML_COLLECTIONS_ALLOWED, sorted(importers - ML_COLLECTIONS_ALLOWED)


# the top: the modules that receive the user's ConfigDict and convert it once (roles.from_config)
# or check it before conversion; every other module gets typed roles (sao_jax/roles.py)
TOP = {"main.py", "eval.py", "plan.py", "train/loop.py", "train/validation.py", "roles.py",
       "configs.py", "docs_gen.py"}
# calls that only a ConfigDict answers, or that convert between it and the roles
CONFIGDICT_CALLS = {"to_dict", "to_json_best_effort", "copy_and_resolve_references", "unlock",
                    "get_ref", "from_config", "to_config"}


def _receiver(node: ast.Attribute) -> tuple[str, list[str]]:
  """(root name, attribute chain) of ``a.b.c`` in ``a.b.c.f(...)``: ("a", ["b", "c"])."""
  chain, v = [], node.value
  while isinstance(v, ast.Attribute):
    chain.insert(0, v.attr)
    v = v.value
  return (v.id if isinstance(v, ast.Name) else ""), chain


def test_no_module_below_the_top_reads_a_configdict():
  """Below the top (``TOP``) no module converts a config (``roles.from_config`` /
  ``to_config``), calls a ConfigDict-only method (``config.to_dict()``, ...) or reads a config
  as a mapping (``config.get(...)``, ``config.<section>.get(...)``): they get typed roles."""
  hits = []
  for rel, src in _modules():
    if rel in TOP:
      continue
    for node in ast.walk(ast.parse(src)):
      if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        continue
      root, chain = _receiver(node.func)
      attr = node.func.attr
      as_mapping = (attr in ("get", "items", "keys", "values")
                    and root in ("config", "cfg", "run", "dist")
                    and all(c in roles.SECTIONS for c in chain))
      if attr in CONFIGDICT_CALLS or as_mapping:
        hits.append(f"{rel}:{node.lineno}: {ast.unparse(node.func)}(...)")
  assert not hits, hits


def test_loop_run_hands_its_callees_typed_roles(tmp_path, monkeypatch):
  """``loop.run`` given the user's ConfigDict converts it once: every builder it calls (the
  task, run folder, mesh, policy, learner, engine, evaluation, source) receives typed roles and
  no ConfigDict. Stops at the source (nothing is trained)."""
  from sao_jax import build, tasks  # pylint: disable=import-outside-toplevel
  from sao_jax.train import loop, resume  # pylint: disable=import-outside-toplevel

  class Stop(Exception):
    pass

  seen = []

  def spy(name, fn):
    def wrapped(*args, **kwargs):
      seen.append((name, list(args) + list(kwargs.values())))
      return fn(*args, **kwargs)
    return wrapped

  def stop(*args, **kwargs):
    raise Stop
  monkeypatch.setattr(resume, "prepare_run_dir", spy("prepare_run_dir", resume.prepare_run_dir))
  monkeypatch.setattr(tasks, "make_task", spy("make_task", tasks.make_task))
  for name in ("make_mesh", "build_policy", "make_learner", "make_engine"):
    monkeypatch.setattr(build, name, spy(name, getattr(build, name)))
  monkeypatch.setattr(build, "evaluate", spy("evaluate", lambda *a, **k: {
      "accuracy": 0.0, "tool_use": 0.0, "n": 0}))
  monkeypatch.setattr(build, "make_source", spy("make_source", stop))
  c = configs.load("arith_tool", "smoke")
  c.run_dir, c.sft.steps, c.log.progress, c.log.tensorboard = str(tmp_path), 0, "off", False
  with pytest.raises(Stop):
    loop.run(c)
  assert {name for name, _ in seen} == {"prepare_run_dir", "make_task", "make_mesh",
                                       "build_policy", "make_learner", "make_engine",
                                       "evaluate", "make_source"}
  for name, args in seen:
    assert not any(isinstance(a, ml_collections.ConfigDict) for a in args), name
    typed = [a for a in args if isinstance(a, (roles.Run, roles.Mesh))]
    assert typed, (name, [type(a).__name__ for a in args])
  run = next(a for _, args in seen for a in args if isinstance(a, roles.Run))
  assert run == roles.from_config(c)  # the one conversion, of the whole config


def test_no_fallback_defaults_on_config_reads():
  """One place per default: no ``config.x.get("field", default)`` below the top (the typed roles
  carry every field). Validation checks the user's ConfigDict before it is converted."""
  hits = [f"{rel}:{i}: {line.strip()}" for rel, src in _modules()
          if rel != "train/validation.py"
          for i, line in enumerate(src.splitlines(), 1) if FALLBACK.search(line)]
  assert not hits, hits


def test_defaults_round_trip_and_every_field_is_declared_once():
  assert roles.from_config(roles.default_config()) == roles.Run()
  specs = roles.fields()
  assert len(specs) == len(roles.flatten(roles.default_config())) > 100
  for name, spec in specs.items():
    assert spec.doc, name
    assert spec.check is None or spec.check in roles._CHECKS, name  # pylint: disable=protected-access
    allowed = spec.allowed()
    assert allowed is None or spec.default in allowed, name
  # the shipped configs start from the defaults: arith_tool *is* them (but its run_dir)
  assert roles.from_config(configs.load("arith_tool")) == roles.Run()


def test_from_config_types_and_fills_defaults():
  c = ml_collections.ConfigDict({"seed": 3, "train": {"gamma": 1, "critic_frozen_patterns":
                                                      ["/attn/"]}})
  run = roles.from_config(c)
  assert run.seed == 3 and run.train.gamma == 1.0 and isinstance(run.train.gamma, float)
  assert run.train.critic_frozen_patterns == ("/attn/",)
  assert run.rollout.decode_steps == 4 and run.rollout.num_workers == 1  # one default each
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.seed = 4  # pylint: disable=assigning-non-slot


def test_from_config_names_each_bad_field_and_its_fix():
  d = roles.default_config().to_dict()
  d["train"]["eps_lo"] = 0.2          # typo
  d["rollout"]["slots"] = "8"         # wrong type
  d["train"]["gamma"] = 1.5           # out of range
  d["train"]["mode"] = "ppo"          # not one of the modes
  with pytest.raises(ConfigError) as ei:
    roles.from_config(ml_collections.ConfigDict(d))
  p = ei.value.problems
  assert len(p) == 4, p
  assert "config.train.eps_lo: unknown key; fix: remove it or use config.train.eps_low" in p
  assert "config.rollout.slots = '8': wrong type str; fix: give a int" in p
  assert "config.train.gamma = 1.5: must be in [0, 1] (discount); fix: use e.g. 1.0" in p
  assert any(x.startswith("config.train.mode = 'ppo': must be one of ('sao', 'vapo', "
                          "'grpo_async', 'grpo_sync'); fix: use") for x in p)


def test_config_docs_are_generated_from_the_fields():
  text = docs_gen.render_config_docs()
  assert text == open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8").read(), (
      "run `python -m sao_jax.docs_gen`")
  for name, spec in roles.fields().items():
    assert f"| `{name}` | " in text and spec.doc in text, name
