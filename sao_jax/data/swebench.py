"""SWE-bench-format coding instances: the record, a JSONL loader and writer.

One JSON object per line (SWE-bench's field names where they exist)::

    {"instance_id": "calc-001",
     "problem_statement": "mean([]) should return 0.0, it raises ZeroDivisionError",
     "repo_path": "repos/calc",            # a repository snapshot folder (relative to the JSONL)
     "files": {"calc.py": "..."},          # ... or the snapshot inline (path -> text)
     "FAIL_TO_PASS": ["tests/test_calc.py::test_mean_empty"],
     "PASS_TO_PASS": ["tests/test_calc.py::test_mean"],
     "test_files": {"tests/test_calc.py": "..."},   # hidden tests, written at grading only
     "test_patch": "diff --git ...",       # ... or SWE-bench's test patch (applied with git apply)
     "patch": "diff --git ..."}            # optional gold patch (unified diff)

Exactly one of ``repo_path`` / ``files`` gives the snapshot; ``test_files`` and ``test_patch``
may both be absent (the tests named are then those of the snapshot). ``FAIL_TO_PASS`` and
``PASS_TO_PASS`` may be JSON lists or, as in SWE-bench's own files, strings holding a JSON list.
Test ids are pytest's ``path/to/test_x.py::test_name`` or ``path::Class::method``.

Snapshots are text: files that are not UTF-8, symlinks and anything under ``.git`` are left out
of a ``repo_path`` snapshot. Grading (``grade``) runs the named tests through a ``TestBackend``
(``sao_jax.envs.workspace``: ``SandboxBackend`` runs them in ``envs/sandbox.py`` with the
standard library only; a repository that needs its own packages needs a backend that has them,
docs/coding.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

__all__ = ["Instance", "load_instances", "write_instances", "read_snapshot", "apply_patch",
           "is_test_path"]

MAX_SNAPSHOT_BYTES = 8 * 2**20  # a snapshot (or a patched one) larger than this is refused


def is_test_path(path: str) -> bool:
  """True for a test file: a ``test_*.py`` / ``*_test.py`` / ``conftest.py`` file or any file
  under a ``tests`` / ``test`` folder (the files a solution must not change)."""
  parts = path.replace("\\", "/").split("/")
  base = parts[-1]
  return (base.startswith("test_") or base.endswith("_test.py") or base == "conftest.py"
          or any(p in ("tests", "test") for p in parts[:-1]))


@dataclasses.dataclass(frozen=True)
class Instance:
  """One coding instance.

  ``files``: the repository snapshot (relative POSIX path -> text) each episode starts from;
  ``test_files``: hidden tests (path -> text) written over the repository at grading only;
  ``fail_to_pass`` / ``pass_to_pass``: test ids that must pass after the fix (the first fail
  before it); ``patch``: the gold patch (unified diff) or ''. Raises ValueError naming the field
  for an empty id, no tests named, or a path that is absolute or has ``..``."""
  instance_id: str
  problem_statement: str
  files: Mapping[str, str]
  fail_to_pass: tuple = ()
  pass_to_pass: tuple = ()
  test_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
  patch: str = ""
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.instance_id:
      raise ValueError("Instance.instance_id must be a non-empty string")
    if not self.fail_to_pass and not self.pass_to_pass:
      raise ValueError(f"instance {self.instance_id}: FAIL_TO_PASS and PASS_TO_PASS are both "
                       "empty; name the tests that decide whether it is resolved")
    for field in ("files", "test_files"):
      for p in getattr(self, field):
        _check_rel(p, f"instance {self.instance_id}: {field}")

  @property
  def tests(self) -> tuple:
    """Every test id that grading runs (FAIL_TO_PASS then PASS_TO_PASS)."""
    return tuple(self.fail_to_pass) + tuple(self.pass_to_pass)

  def to_json(self) -> dict:
    """The JSONL record (inline ``files``) that ``load_instances`` reads back."""
    out = {"instance_id": self.instance_id, "problem_statement": self.problem_statement,
           "files": dict(self.files), "FAIL_TO_PASS": list(self.fail_to_pass),
           "PASS_TO_PASS": list(self.pass_to_pass)}
    if self.test_files:
      out["test_files"] = dict(self.test_files)
    if self.patch:
      out["patch"] = self.patch
    if self.meta:
      out["meta"] = dict(self.meta)
    return out


def _check_rel(path: str, where: str) -> None:
  p = path.replace("\\", "/")
  if not p or p.startswith("/") or ".." in p.split("/") or "\x00" in p:
    raise ValueError(f"{where}: path {path!r} must be relative, without '..'")


def read_snapshot(root: str | os.PathLike) -> dict[str, str]:
  """The text files under ``root`` (relative POSIX path -> text): regular UTF-8 files only;
  symlinks, ``.git`` and ``__pycache__`` are skipped. Raises FileNotFoundError for a missing
  folder and ValueError past ``MAX_SNAPSHOT_BYTES``."""
  root = Path(root)
  if not root.is_dir():
    raise FileNotFoundError(f"repository snapshot folder {str(root)!r} does not exist")
  out, total = {}, 0
  for d, dirs, names in os.walk(root, followlinks=False):
    dirs[:] = sorted(x for x in dirs if x not in (".git", "__pycache__"))
    for name in sorted(names):
      full = Path(d) / name
      if full.is_symlink() or not full.is_file():
        continue
      try:
        text = full.read_bytes().decode("utf-8")
      except UnicodeDecodeError:
        continue
      total += len(text)
      if total > MAX_SNAPSHOT_BYTES:
        raise ValueError(f"snapshot {str(root)!r} has more than {MAX_SNAPSHOT_BYTES} bytes of "
                         "text; the sandbox backend copies it into every test run")
      out[full.relative_to(root).as_posix()] = text
  return out


def apply_patch(files: Mapping[str, str], patch: str) -> dict[str, str]:
  """``files`` with the unified diff ``patch`` applied (``git apply`` in a temporary folder,
  which refuses paths outside it). Raises ValueError with git's message if it does not apply."""
  with tempfile.TemporaryDirectory(prefix="sao-patch-") as d:
    for rel, text in files.items():
      p = os.path.join(d, rel)
      os.makedirs(os.path.dirname(p), exist_ok=True)
      with open(p, "w", encoding="utf-8") as f:
        f.write(text)
    proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=patch, cwd=d,
                          capture_output=True, text=True, check=False, timeout=60,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                               "GIT_CEILING_DIRECTORIES": os.path.dirname(d)})
    if proc.returncode != 0:
      raise ValueError(f"patch does not apply: {proc.stderr.strip()[:500]}")
    return read_snapshot(d)


def _test_list(row: dict, key: str, where: str) -> tuple:
  v = row.get(key, [])
  if isinstance(v, str):  # SWE-bench stores these as strings holding a JSON list
    try:
      v = json.loads(v) if v.strip() else []
    except json.JSONDecodeError:
      raise ValueError(f"{where}: {key} is a string that is not a JSON list") from None
  if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
    raise ValueError(f"{where}: {key} must be a list of test ids (strings)")
  return tuple(v)


def load_instances(path: str | os.PathLike) -> list[Instance]:
  """Instances of the JSONL file ``path`` (module doc); ``repo_path`` is relative to the file's
  folder unless absolute. Raises ValueError("<path>:<line>: ...") naming the field for a bad
  record, FileNotFoundError for a missing file or snapshot folder."""
  path = Path(path)
  out = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
      for key in ("instance_id", "problem_statement"):
        if not isinstance(row.get(key), str):
          raise ValueError(f"{where}: missing string field {key!r}")
      if ("repo_path" in row) == ("files" in row):
        raise ValueError(f"{where}: give exactly one of 'repo_path' (a snapshot folder) and "
                         "'files' (the snapshot inline)")
      if "files" in row:
        files = row["files"]
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
          raise ValueError(f"{where}: 'files' must map paths to text")
      else:
        files = read_snapshot(path.parent / row["repo_path"])
      tests = row.get("test_files") or {}
      if not isinstance(tests, dict) or not all(isinstance(v, str) for v in tests.values()):
        raise ValueError(f"{where}: 'test_files' must map paths to text")
      if row.get("test_patch"):
        try:
          patched = apply_patch({**files, **tests}, row["test_patch"])
        except ValueError as e:
          raise ValueError(f"{where}: test_patch: {e}") from None
        tests = {**tests, **{p: t for p, t in patched.items() if files.get(p) != t}}
      try:
        out.append(Instance(
            instance_id=row["instance_id"], problem_statement=row["problem_statement"],
            files=dict(files), fail_to_pass=_test_list(row, "FAIL_TO_PASS", where),
            pass_to_pass=_test_list(row, "PASS_TO_PASS", where), test_files=dict(tests),
            patch=row.get("patch") or "", meta=row.get("meta") or {}))
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
  return out


def write_instances(path: str | os.PathLike, instances: Sequence[Instance]) -> None:
  """Writes ``instances`` as JSONL with inline snapshots (``Instance.to_json``)."""
  with open(path, "w", encoding="utf-8") as f:
    for inst in instances:
      f.write(json.dumps(inst.to_json()) + "\n")


def gold_files(instance: Instance) -> Optional[dict[str, str]]:
  """The snapshot with the gold patch applied, or None without one."""
  return apply_patch(instance.files, instance.patch) if instance.patch else None
