"""The config boundary: every field declared once (sao_jax/roles.py), the ConfigDict converted
once at the top (roles.from_config), no per-module fallback defaults, docs/config.md current."""

import ast
import dataclasses
import os
import re

import ml_collections
import pytest

from sao_jax import configs, docs_gen, roles
from sao_jax.roles import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_no_fallback_defaults_on_config_reads():
  """One place per default: no ``config.x.get("field", default)`` below the top (the typed roles
  carry every field). distributed.initialize takes a plain mapping + environment variables;
  validation checks the user's ConfigDict before it is converted."""
  hits = [f"{rel}:{i}: {line.strip()}" for rel, src in _modules()
          if rel not in ("train/distributed.py", "train/validation.py")
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
