"""The install users get (pyproject.toml): every module sao_jax imports at module level comes from a
declared dependency, and importing the whole package loads no test-only or optional package
(torch, transformers, ray, pytest, ...)."""

import repo_paths  # tests/repo_paths.py
import pytest
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

ROOT = repo_paths.ROOT
# installed with `pip install --no-deps` (its metadata pulls TensorFlow): requirements-nodeps.txt
NODEPS = {"google-jetstream"}
OPTIONAL = ["torch", "transformers", "ray", "pytest", "hypothesis", "rlax", "nbclient", "wandb"]


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
  return {_norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in deps}


def _module_level_imports() -> set:
  """Top-level names imported outside functions by every module of sao_jax."""
  names = set()
  for folder, _, files in os.walk(os.path.join(ROOT, "sao_jax")):
    for name in files:
      if not name.endswith(".py"):
        continue
      tree = ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
      for node in tree.body:  # module level only: imports inside functions are lazy
        if isinstance(node, ast.Import):
          names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
          names.add(node.module.split(".")[0])
  return names


def test_module_level_imports_are_declared_dependencies():
  dists = importlib.metadata.packages_distributions()
  declared = _declared() | NODEPS
  missing = {}
  for mod in sorted(_module_level_imports() - set(sys.stdlib_module_names) - {"sao_jax"}):
    owners = {_norm(d) for d in dists.get(mod, [])}
    if not owners & declared:
      missing[mod] = sorted(owners)
  assert not missing, f"imported at module level but not in pyproject dependencies: {missing}"
  assert "torch" not in declared and "ray" not in declared and "transformers" not in declared


@pytest.mark.slow
def test_importing_every_module_loads_no_optional_package():
  code = (
      "import importlib, json, pkgutil, sys\n"
      "import sao_jax\n"
      "for m in pkgutil.walk_packages(sao_jax.__path__, 'sao_jax.'):\n"
      "  if not m.name.endswith('_sandbox_init'):\n"
      "    importlib.import_module(m.name)\n"
      f"print(json.dumps([n for n in {OPTIONAL!r} if n in sys.modules]))\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_ruff_check_is_clean():
  """`ruff check .` (the pinned ruff of requirements.txt, settings in pyproject.toml) finds
  nothing."""
  proc = subprocess.run([sys.executable, "-m", "ruff", "check", ".", "--output-format=concise"],
                        cwd=ROOT, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
