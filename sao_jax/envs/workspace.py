r"""A repository-editing environment (the paper's agentic-coding setting, OpenHands / SWE-agent
style): each episode gets a fresh copy of an instance's repository in a temporary folder; the
policy views and edits files and runs the tests through text tool calls; the reward is 1 when the
instance's hidden tests pass at the end of the episode, else 0.

Tool calls (the fence convention of ``tir_math``)
--------------------------------------------------
A tool call is a fenced block whose first line names the tool, followed by an ``output`` fence,
the turn's stop string (``STOP_STRINGS``)::

    ```view calc.py 1 20          view lines 1-20 (1-based, inclusive; no range = the whole file;
    ```                            a folder = its file list)
    ```output

    ```replace calc.py [LINE]     replace the one occurrence of OLD by NEW (error if OLD occurs
    OLD                            0 or several times); with LINE, OLD must occur once in that
    =======                        line and only that line changes (SWE-agent's line-addressed
    NEW                            edit, for models that cannot copy whole lines)
    ```
    ```output

    ```undo calc.py               revert the last replace / create of that file (OpenHands'
    ```                            ``undo_edit``)
    ```output

    ```create notes/x.py          create a new file with the body as its content (no overwrite)
    CONTENT
    ```
    ```output

    ```test tests/test_calc.py::test_mean     run one test, or (no argument) every visible test
    ```
    ```output

    ```finish                     end the episode; the repository is graded
    ```
    ```output

The observation is ``"\n" + OUTPUT + "\n```\n"`` with OUTPUT cut to ``max_output_chars``
characters like ``tir_math`` (first and last halves around ``...[N characters cut]...``); special
tokens in it are dropped (a file cannot forge a turn end). Only the last tool block before the
final ``output`` fence runs.

Episodes and state
------------------
Unlike the stateless math environments, a workspace changes from turn to turn. The rollout
worker calls ``begin_episode(problem) -> Episode`` when it starts a trajectory (a fresh copy of
the repository) and passes that handle to every ``step``; ``end_episode(episode)`` deletes the
folder (also done when the handle is garbage collected). ``step`` on a plain ``Problem`` raises
ValueError saying so.

Episode rules (``turn`` counts from 0): a tool call runs and returns its observation (not done);
``finish``, an action ending in a stop token without a tool call, a turn cut by the token limit,
and the last allowed turn (``turn == max_turns - 1``, after running its tool) end the episode,
and the repository as it is then is graded (``grade``):

1. a solution that changed a test file (``swebench.is_test_path``: created, edited or deleted)
   is rejected: reward 0, ``info["rejected"]`` lists the paths;
2. the hidden tests (``Instance.test_files``) are written over the repository copy sent to the
   backend (never into the workspace, so they are not visible during the episode);
3. FAIL_TO_PASS + PASS_TO_PASS run; reward 1.0 iff every one passes.

Confinement: every path argument is resolved (``Workspace.resolve``): absolute paths, ``~``,
``..`` components and paths that resolve (through a symlink) outside the workspace are refused
with an ``error:`` observation. Tests run in ``sandbox.run_python`` (own PID / mount / network
namespaces, an unprivileged uid, CPU / wall / memory / process / file limits), on a copy of the
repository inside the sandbox's own tmpfs: nothing a test does reaches the workspace or the host.
Each test also gets ``test_timeout_s`` of wall time (SIGALRM; the sandbox's ``wall_s`` bounds the
whole run).

``info``: ``tool`` (the tool name or None), ``tool_calls`` (0/1), ``tool_error`` (None or a
reason), ``stop`` (``"tool" | "finish" | "eos" | "length" | "last_turn"``), ``truncated``; at the
end ``resolved`` (bool), ``rejected`` (None or the test paths changed), ``tests`` (id ->
status) and ``finished`` (the policy called ``finish`` or stopped by itself).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from typing import Mapping, Optional, Sequence

from sao_jax.data.jsonl import Problem
from sao_jax.data.swebench import Instance, is_test_path
from sao_jax.envs.base import EnvStep
from sao_jax.envs import _sandbox_init as sandbox_program
from sao_jax.envs.sandbox import SandboxLimits, run_python
from sao_jax.envs.tir_math import cut_middle, encode_prompt, sandbox_check, special_token_ids

__all__ = ["Workspace", "PathError", "TestReport", "TestBackend", "SandboxBackend", "Episode",
           "WorkspaceEnv", "INSTRUCTION", "STOP_STRINGS", "parse_tool_call", "grade"]

OUTPUT_FENCE = "```output"
STOP_STRINGS: tuple[str, ...] = (OUTPUT_FENCE,)
TOOLS = ("view", "replace", "undo", "create", "test", "finish")
SEPARATOR = "======="
INSTRUCTION = (
    "Fix the issue in the repository. Tools (one per turn, then stop):\n"
    "```view PATH [START END]\n```\n```output\n"
    "```replace PATH [LINE]\nOLD\n=======\nNEW\n```\n```output\n"
    "```undo PATH\n```\n```output\n"
    "```create PATH\nCONTENT\n```\n```output\n"
    "```test [TEST_ID]\n```\n```output\n"
    "```finish\n```\n```output\n"
    "Hidden tests decide; do not edit tests.")
_CALL_RE = re.compile(r"```(" + "|".join(TOOLS) + r")([^\n`]*)\n(.*?)```", re.DOTALL)
MAX_FILE_BYTES = 256 * 2**10      # a file created or edited larger than this is refused
MAX_WORKSPACE_BYTES = 4 * 2**20   # what one test run may copy into the sandbox
MAX_LIST = 200                    # entries a folder view lists


class PathError(ValueError):
  """A path argument that is not confined to the workspace (or not usable)."""


def parse_tool_call(text: str) -> Optional[tuple[str, str, str]]:
  """``(tool, args, body)`` of the last tool block before the final ```` ```output ```` of
  ``text`` (args stripped, body without its last newline), or None if there is none."""
  end = text.rfind(OUTPUT_FENCE)
  calls = _CALL_RE.findall(text[:end] if end >= 0 else text)
  if not calls:
    return None
  tool, args, body = calls[-1]
  return tool, args.strip(), body[:-1] if body.endswith("\n") else body


class Workspace:
  """A repository copy in a fresh temporary folder, with path-confined file operations.

  ``files``: relative path -> text. Every method that takes a path raises ``PathError`` (with
  the reason) for a path outside the folder; ``close()`` deletes it (idempotent)."""

  def __init__(self, files: Mapping[str, str]):
    self.root = os.path.realpath(tempfile.mkdtemp(prefix="sao-ws-"))
    self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
    self._history: dict[str, list[Optional[str]]] = {}  # path -> texts before each edit
    for rel, text in files.items():
      full = self.resolve(rel)
      os.makedirs(os.path.dirname(full), exist_ok=True)
      with open(full, "w", encoding="utf-8") as f:
        f.write(text)

  def close(self) -> None:
    self._finalizer()

  def resolve(self, path: str) -> str:
    """The absolute host path of workspace path ``path``. Raises PathError for an empty path,
    an absolute one, ``~``, a ``..`` component, a NUL, or one that resolves (symlinks followed)
    outside the workspace."""
    p = (path or "").strip()
    if not p:
      raise PathError("a path is required (relative to the repository root)")
    if "\x00" in p:
      raise PathError("a path must not contain NUL")
    if p.startswith(("/", "~", "\\")):
      raise PathError(f"{p}: absolute paths are not allowed; use a path relative to the "
                      "repository root")
    if ".." in re.split(r"[/\\]", p):
      raise PathError(f"{p}: '..' is not allowed; paths stay inside the repository")
    full = os.path.realpath(os.path.join(self.root, p))
    if full != self.root and not full.startswith(self.root + os.sep):
      raise PathError(f"{p}: resolves outside the repository (a symlink); refused")
    return full

  def _rel(self, full: str) -> str:
    return os.path.relpath(full, self.root).replace(os.sep, "/")

  def view(self, path: str, start: Optional[int] = None, end: Optional[int] = None) -> str:
    """Lines ``start..end`` (1-based, inclusive) of a file as ``"N| text"`` lines, or a folder's
    file list. Raises PathError / FileNotFoundError / ValueError (bad range)."""
    full = self.resolve(path)
    if os.path.isdir(full):
      names = self.list_files(full)
      more = f"\n... {len(names) - MAX_LIST} more" if len(names) > MAX_LIST else ""
      return "\n".join(names[:MAX_LIST]) + more
    if not os.path.isfile(full):
      raise FileNotFoundError(f"{path}: no such file")
    lines = _read(full).split("\n")
    if lines and lines[-1] == "":
      lines.pop()
    lo = 1 if start is None else start
    hi = len(lines) if end is None else min(end, len(lines))
    if lo < 1 or hi < lo - 1 or lo > max(len(lines), 1):
      raise ValueError(f"{path}: line range {start}-{end} outside 1-{len(lines)}")
    return "\n".join(f"{i}| {lines[i - 1]}" for i in range(lo, hi + 1))

  def replace(self, path: str, old: str, new: str, line: Optional[int] = None) -> str:
    """Replaces the one occurrence of ``old`` in a file (or, with ``line``, 1-based, in that
    line, which must not contain a newline of ``old``) by ``new``; returns the edited lines as
    ``view`` shows them. Raises PathError / FileNotFoundError / ValueError (``old`` empty, found
    0 or several times, ``line`` outside the file, or the result too large)."""
    full = self.resolve(path)
    if not os.path.isfile(full):
      raise FileNotFoundError(f"{path}: no such file")
    if not old:
      raise ValueError("replace: OLD is empty")
    text = _read(full)
    if line is None:
      n = text.count(old)
      if n != 1:
        raise ValueError(f"replace: OLD occurs {n} times in {path}; it must occur exactly once")
      start = text.index(old)
    else:
      lines = text.split("\n")
      if not 1 <= line <= len(lines):
        raise ValueError(f"replace: line {line} outside 1-{len(lines)} of {path}")
      if "\n" in old:
        raise ValueError("replace: with a LINE, OLD must be part of that one line")
      n = lines[line - 1].count(old)
      if n != 1:
        raise ValueError(f"replace: OLD occurs {n} times in line {line} of {path}; it must "
                         "occur exactly once there")
      start = sum(len(x) + 1 for x in lines[:line - 1]) + lines[line - 1].index(old)
    out = text[:start] + new + text[start + len(old):]
    _write(full, out)
    self._history.setdefault(full, []).append(text)
    first = text[:start].count("\n") + 1
    return f"edited {path}\n" + self.view(path, first, first + new.count("\n"))

  def undo(self, path: str) -> str:
    """Reverts the last ``replace`` / ``create`` of a file (a created file is deleted); returns
    the restored lines as ``view`` shows them. Raises PathError / ValueError (nothing to undo)."""
    full = self.resolve(path)
    stack = self._history.get(full)
    if not stack:
      raise ValueError(f"undo: no edit of {path} to undo")
    before = stack.pop()
    if before is None:
      os.remove(full)
      return f"reverted {path} (deleted)"
    now = _read(full) if os.path.isfile(full) else ""
    _write(full, before)
    a, b = now.split("\n"), before.split("\n")
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    last = first + max(0, len(b) - len(a))
    return f"reverted {path}\n" + self.view(path, min(first + 1, len(b)), min(last + 1, len(b)))

  def create(self, path: str, content: str) -> str:
    """Creates a new file (and its folders). Raises PathError / FileExistsError / ValueError
    (too large)."""
    full = self.resolve(path)
    if os.path.lexists(full):
      raise FileExistsError(f"{path}: already exists; edit it with replace")
    os.makedirs(os.path.dirname(full), exist_ok=True)
    _write(full, content)
    self._history.setdefault(full, []).append(None)
    return f"created {path} ({content.count(chr(10)) + 1} lines)"

  def list_files(self, under: Optional[str] = None) -> list[str]:
    """Relative paths of the regular files under ``under`` (default: the root), sorted; no
    symlink is followed or listed."""
    out = []
    for d, dirs, names in os.walk(under or self.root, followlinks=False):
      dirs[:] = sorted(x for x in dirs if x != "__pycache__")
      for name in sorted(names):
        full = os.path.join(d, name)
        if not os.path.islink(full) and os.path.isfile(full):
          out.append(self._rel(full))
    return out

  def snapshot(self) -> dict[str, str]:
    """Every regular file's text (path -> text). Raises ValueError past
    ``MAX_WORKSPACE_BYTES``."""
    out, total = {}, 0
    for rel in self.list_files():
      out[rel] = _read(os.path.join(self.root, rel))
      total += len(out[rel])
      if total > MAX_WORKSPACE_BYTES:
        raise ValueError(f"the repository exceeds {MAX_WORKSPACE_BYTES} bytes")
    return out


def _read(full: str) -> str:
  with open(full, "rb") as f:
    return f.read(MAX_FILE_BYTES + 1).decode("utf-8", "replace")


def _write(full: str, text: str) -> None:
  if len(text.encode("utf-8")) > MAX_FILE_BYTES:
    raise ValueError(f"a file may hold at most {MAX_FILE_BYTES} bytes")
  with open(full, "w", encoding="utf-8") as f:
    f.write(text)


# ---- tests ----------------------------------------------------------------------------------


@dataclasses.dataclass
class TestReport:
  """One test run. ``status``: test id -> ``"passed" | "failed" | "error" | "skipped"``
  (``"error"``: not collected, e.g. an import failure or a missing test); ``output``: the text
  the policy sees; ``error``: None, or the sandbox's reason when the whole run failed
  (``"timeout"``, ``"cpu_limit"``, ``"memory"``, ``"output_limit"``, ...)."""
  status: dict
  output: str
  error: Optional[str] = None
  wall_s: float = 0.0

  def passed(self, test_ids: Sequence[str]) -> bool:
    """Every id in ``test_ids`` passed (skipped counts as passed, as in SWE-bench)."""
    return self.error is None and all(self.status.get(t) in ("passed", "skipped")
                                      for t in test_ids)


class TestBackend:
  """Runs tests on a repository state: the one interface grading and the ``test`` tool use.

  ``run(files, test_ids)``: ``files`` the repository (path -> text), ``test_ids`` pytest-style
  ids or None (every test of every test file). Returns a ``TestReport``; never raises for
  anything the tests do. ``SandboxBackend`` is the standard-library implementation; a container
  backend (docker / podman with the repository's own environment) is another subclass
  (docs/coding.md)."""

  def run(self, files: Mapping[str, str], test_ids: Optional[Sequence[str]] = None
          ) -> TestReport:
    raise NotImplementedError


_RUNNER = r'''
import importlib.util, io, json, os, signal, sys, traceback, unittest
FILES = json.loads(__FILES__)
IDS = json.loads(__IDS__)
NONCE, PER_TEST_S = __NONCE__, __PER_TEST__
PROGRAM = __PROGRAM__  # this runner's own path in the sandbox's private /tmp
ROOT, MAIN_PID = os.path.join(os.path.dirname(PROGRAM), "ws"), os.getpid()
_out = os.fdopen(os.dup(1), "w")
for rel, text in FILES.items():
  p = os.path.join(ROOT, rel)
  os.makedirs(os.path.dirname(p), exist_ok=True)
  with open(p, "w") as f:
    f.write(text)
os.chdir(ROOT)
sys.path.insert(0, ROOT)
sys.dont_write_bytecode = True
mods, status, lines = {}, {}, []

class _Timeout(Exception):
  pass

def _alarm(*_):
  raise _Timeout(f"test took longer than {PER_TEST_S} s")

signal.signal(signal.SIGALRM, _alarm)

def load(rel):
  if rel not in mods:
    name = rel[:-3].replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    mods[rel] = mod
  return mods[rel]

def is_test_file(rel):
  b = os.path.basename(rel)
  return b.endswith(".py") and (b.startswith("test_") or b.endswith("_test.py"))

def tb():
  t = [x.replace(ROOT + "/", "") for x in traceback.format_exc().strip().splitlines()
       if x.strip() and set(x.strip()) - set("^~") and not x.startswith("Traceback")]
  keep = [x for i, x in enumerate(t) if PROGRAM not in x
          and not (i > 0 and PROGRAM in t[i - 1] and x.startswith("    "))]
  return "\n".join("  " + x for x in keep[-4:])

def collect(rel):
  mod = load(rel)
  out = []
  for name, obj in vars(mod).items():
    if name.startswith("test") and callable(obj) and getattr(obj, "__module__", "") == mod.__name__:
      out.append(f"{rel}::{name}")
    elif isinstance(obj, type) and name.startswith("Test") and obj.__module__ == mod.__name__:
      out += [f"{rel}::{name}::{m}" for m in sorted(dir(obj)) if m.startswith("test")]
  return out

if IDS is None:
  IDS = []
  for rel in sorted(FILES):
    if is_test_file(rel):
      try:
        IDS += collect(rel)
      except BaseException:
        status[rel] = "error"
        lines.append(f"ERROR {rel} (collection)\n{tb()}")

def run_one(tid):
  parts = tid.split("::")
  try:
    obj = load(parts[0])
    for p in parts[1:]:
      obj = getattr(obj, p)
  except BaseException:
    return "error", f"ERROR {tid} (not collected)\n{tb()}"
  buf = io.StringIO()
  so, se = sys.stdout, sys.stderr
  sys.stdout = sys.stderr = buf
  signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
  try:
    if len(parts) == 3:
      cls = getattr(load(parts[0]), parts[1])
      if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
        res = unittest.TestResult()
        cls(parts[2]).run(res)
        bad = res.failures + res.errors
        if bad:
          msg = bad[0][1].strip().splitlines()
          return "failed", f"FAILED {tid}\n" + "\n".join("  " + x for x in msg[-4:])
        return ("skipped" if res.skipped else "passed"), None
      getattr(cls(), parts[2])()
    else:
      obj()
    return "passed", None
  except BaseException:
    return "failed", f"FAILED {tid}\n{tb()}"
  finally:
    if os.getpid() != MAIN_PID:  # a process the test forked: it reports nothing
      os._exit(1)
    signal.setitimer(signal.ITIMER_REAL, 0)
    sys.stdout, sys.stderr = so, se

for tid in IDS:
  st, msg = run_one(tid)
  status[tid] = st
  if msg:  # pytest -q style: failures in full, passes only in the summary
    lines.append(msg)
n = {k: sum(1 for v in status.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
lines.append(", ".join(f"{v} {k}" for k, v in n.items() if v) or "no tests ran")
_out.write("\n".join(lines) + "\n@@RESULT@@ " + NONCE + " " + json.dumps(status) + "\n")
_out.flush()
os._exit(0)
'''


class SandboxBackend(TestBackend):
  """Runs tests in ``sandbox.run_python`` with the standard library only: a small runner writes
  the files into the sandbox's own tmpfs and runs pytest-style test functions (plain ``assert``)
  and ``unittest.TestCase`` methods, each with ``test_timeout_s`` of wall time.

  A repository whose tests need third-party packages needs another backend (docs/coding.md).
  Trust: the runner prints its result after a random nonce; code under test that deliberately
  reads the runner's source to forge that line is not defended against."""

  def __init__(self, limits: SandboxLimits = SandboxLimits(cpu_s=10, wall_s=20.0),
               test_timeout_s: float = 5.0, cache_size: int = 0):
    if not test_timeout_s > 0:
      raise ValueError(f"test_timeout_s must be > 0, got {test_timeout_s}")
    if cache_size < 0:
      raise ValueError(f"cache_size must be >= 0, got {cache_size}")
    self.limits = limits
    self.test_timeout_s = float(test_timeout_s)
    self.cache_size = int(cache_size)
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self.runs = 0  # sandbox runs started (cache hits excluded)

  def run(self, files: Mapping[str, str], test_ids: Optional[Sequence[str]] = None
          ) -> TestReport:
    """``TestBackend.run``. With ``cache_size`` > 0 the reports of the last ``cache_size``
    distinct (files, test_ids) are reused (for deterministic tests, such as generated ones);
    runs that failed as a whole (timeout, ...) are not cached."""
    if not self.cache_size:
      return self._run(files, test_ids)
    key = hashlib.sha256(json.dumps([sorted(files.items()), test_ids]).encode()).hexdigest()
    with self._lock:
      hit = self._cache.get(key)
      if hit is not None:
        self._cache.move_to_end(key)
        return dataclasses.replace(hit, status=dict(hit.status))
    report = self._run(files, test_ids)
    if report.error is None:
      with self._lock:
        self._cache[key] = report
        while len(self._cache) > self.cache_size:
          self._cache.popitem(last=False)
    return report

  def _run(self, files, test_ids) -> TestReport:
    self.runs += 1
    nonce = secrets.token_hex(8)
    code = (_RUNNER.replace("__FILES__", repr(json.dumps(dict(files))))
            .replace("__IDS__", repr(json.dumps(None if test_ids is None else list(test_ids))))
            .replace("__NONCE__", repr(nonce)).replace("__PER_TEST__", repr(self.test_timeout_s))
            .replace("__PROGRAM__", repr(sandbox_program.PROGRAM)))
    t0 = time.perf_counter()
    try:
      res = run_python(code, self.limits)
    except Exception as e:  # pylint: disable=broad-except  (the rollout must go on)
      return TestReport({}, f"error: sandbox failed: {type(e).__name__}", "sandbox",
                        time.perf_counter() - t0)
    marker = f"@@RESULT@@ {nonce} "
    head, sep, tail = res.stdout.rpartition(marker)
    if res.ok and sep:
      try:
        status = json.loads(tail.splitlines()[0])
        head = "\n".join(x for x in head.split("\n") if not x.startswith("@@RESULT@@"))
        return TestReport(status, head.rstrip("\n"), None, res.wall_s)
      except (json.JSONDecodeError, IndexError):
        pass
    reason = res.error or "no_result"
    msg = {"timeout": f"the test run took longer than {self.limits.wall_s} s and was stopped",
           "cpu_limit": f"the test run used more than {self.limits.cpu_s} s of CPU",
           "output_limit": f"the tests printed more than {self.limits.max_output_bytes} bytes",
           "memory": "the tests ran out of memory"}.get(reason.split(":")[0], "")
    obs = res.observation(max_chars=2000) if not res.ok else "error: the test run gave no result"
    return TestReport({}, obs + (f" ({msg})" if msg else ""), reason, res.wall_s)


# ---- grading --------------------------------------------------------------------------------


def changed_test_paths(instance: Instance, files: Mapping[str, str]) -> list[str]:
  """Test files (``is_test_path``) that ``files`` created, edited or deleted relative to the
  instance's snapshot."""
  paths = set(instance.files) | set(files)
  return sorted(p for p in paths if is_test_path(p) and instance.files.get(p) != files.get(p))


def grade(instance: Instance, files: Mapping[str, str], backend: TestBackend
          ) -> tuple[float, dict]:
  """``(reward, info)`` of the repository state ``files`` (module doc, steps 1-3): 0.0 and
  ``info["rejected"]`` if a test file changed; else 1.0 iff every FAIL_TO_PASS and PASS_TO_PASS
  test passes with the hidden tests written over ``files``. ``info``: ``resolved``,
  ``rejected``, ``tests`` (id -> status), ``test_error``."""
  changed = changed_test_paths(instance, files)
  if changed:
    return 0.0, {"resolved": False, "rejected": changed, "tests": {}, "test_error": None}
  report = backend.run({**files, **instance.test_files}, instance.tests)
  ok = report.passed(instance.tests)
  return float(ok), {"resolved": ok, "rejected": None, "tests": report.status,
                     "test_error": report.error}


# ---- the environment ------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Episode:
  """One episode's handle: the problem (``id`` / ``prompt`` / ``answer`` forwarded, so the
  worker records it as the problem) and its ``Workspace``."""
  problem: Problem
  workspace: Workspace

  @property
  def id(self) -> str:
    return self.problem.id

  @property
  def prompt(self) -> str:
    return self.problem.prompt

  @property
  def answer(self) -> str:
    return self.problem.answer


class WorkspaceEnv:
  """The workspace environment of the module doc.

  Args:
    tokenizer: ``CharTokenizer`` or ``HFTokenizer``.
    instances: the instances (``Problem.id`` == ``Instance.instance_id``); ``problems()`` gives
      their ``Problem`` s (prompt = the problem statement).
    max_turns: policy turns per episode (>= 1).
    backend: ``TestBackend`` (default: ``SandboxBackend`` with ``limits``).
    limits: sandbox limits of each test run (default backend only).
    max_output_chars: observation cut (characters, >= 16).
    system: instruction / system message (default ``INSTRUCTION``).
    check_sandbox: run ``tir_math.sandbox_check`` now (raises ``SandboxUnavailable``).

  One instance serves many concurrent episodes and threads (state is in the ``Episode``).
  Raises ValueError for ``max_turns < 1``, ``max_output_chars < 16`` or duplicate ids.
  """

  stop_strings = STOP_STRINGS

  def __init__(self, tokenizer, instances: Sequence[Instance], max_turns: int = 20,
               backend: Optional[TestBackend] = None,
               limits: SandboxLimits = SandboxLimits(cpu_s=10, wall_s=20.0),
               max_output_chars: int = 1024, system: Optional[str] = None,
               check_sandbox: bool = True):
    if max_turns < 1:
      raise ValueError(f"task.max_turns must be >= 1, got {max_turns}.")
    if max_output_chars < 16:
      raise ValueError(f"task.tool_output_chars must be >= 16, got {max_output_chars}.")
    self.instances = {i.instance_id: i for i in instances}
    if len(self.instances) != len(instances):
      raise ValueError("instances have duplicate instance_id values")
    self.tokenizer = tokenizer
    self.max_turns = int(max_turns)
    self.backend = backend or SandboxBackend(limits)
    self.max_output_chars = int(max_output_chars)
    self.system = INSTRUCTION if system is None else system
    self._no_obs_ids = special_token_ids(tokenizer)
    if check_sandbox and backend is None:
      sandbox_check(limits)

  def problems(self) -> list[Problem]:
    """One ``Problem`` per instance, in order (answer: '' -- the tests decide)."""
    return [Problem(id=i.instance_id, prompt=i.problem_statement, answer="")
            for i in self.instances.values()]

  # ---- episodes -------------------------------------------------------------------------------
  def begin_episode(self, problem) -> Episode:
    """A fresh ``Episode`` (a new workspace copy of the instance's repository)."""
    problem = problem.problem if isinstance(problem, Episode) else problem
    inst = self._instance(problem)
    return Episode(problem, Workspace(inst.files))

  def end_episode(self, episode) -> None:
    """Deletes the episode's workspace (idempotent; anything else is ignored)."""
    if isinstance(episode, Episode):
      episode.workspace.close()

  def _instance(self, problem) -> Instance:
    try:
      return self.instances[problem.id]
    except KeyError:
      raise ValueError(f"problem {problem.id!r} is not one of this env's instances") from None

  # ---- prompt ---------------------------------------------------------------------------------
  def prompt_text(self, problem) -> str:
    if getattr(self.tokenizer, "chat_template", None):
      return self.tokenizer.apply_chat_template(
          [{"role": "system", "content": self.system}, {"role": "user", "content": problem.prompt}],
          add_generation_prompt=True)
    return f"{self.system}\n\n{problem.prompt}\n" if self.system else f"{problem.prompt}\n"

  def prompt_ids(self, problem) -> list[int]:
    return encode_prompt(self.tokenizer, self.prompt_text(problem))

  def observation_text(self, output: str) -> str:
    """``"\\n" + cut(OUTPUT) + "\\n```\\n"`` (closes the ```` ```output ```` fence)."""
    return f"\n{cut_middle(output.rstrip(chr(10)), self.max_output_chars)}\n```\n"

  # ---- tools ----------------------------------------------------------------------------------
  def run_tool(self, episode: Episode, tool: str, args: str, body: str
               ) -> tuple[str, Optional[str]]:
    """(OUTPUT, error reason or None) of one tool call on the episode's workspace; never
    raises for anything the policy wrote."""
    ws = episode.workspace
    argv = args.split()
    try:
      if tool == "view":
        if not argv or len(argv) not in (1, 3):
          return "error: usage: view PATH [START END]", "usage"
        rng = (int(argv[1]), int(argv[2])) if len(argv) == 3 else (None, None)
        return ws.view(argv[0], *rng), None
      if tool == "replace":
        if len(argv) not in (1, 2) or (len(argv) == 2 and not argv[1].isdigit()):
          return "error: usage: replace PATH [LINE], then OLD, a line =======, NEW", "usage"
        old, sep, new = body.partition("\n" + SEPARATOR + "\n")
        if not sep:
          if body.endswith("\n" + SEPARATOR):  # NEW empty: delete OLD
            old, new = body[:-len(SEPARATOR) - 1], ""
          else:
            return f"error: replace needs a line {SEPARATOR} between OLD and NEW", "usage"
        return ws.replace(argv[0], old, new, int(argv[1]) if len(argv) == 2 else None), None
      if tool == "undo":
        if len(argv) != 1:
          return "error: usage: undo PATH", "usage"
        return ws.undo(argv[0]), None
      if tool == "create":
        if len(argv) != 1:
          return "error: usage: create PATH, then the content", "usage"
        return ws.create(argv[0], body + "\n" if body else ""), None
      if tool == "test":
        if len(argv) > 1:
          return "error: usage: test [TEST_ID]", "usage"
        if argv:
          ws.resolve(argv[0].split("::")[0])
        report = self.backend.run(ws.snapshot(), argv or None)
        return report.output, report.error
    except PathError as e:
      return f"error: {e}", "path"
    except (FileNotFoundError, FileExistsError, IsADirectoryError) as e:
      return f"error: {e}", "file"
    except ValueError as e:
      return f"error: {e}", "value"
    except OSError as e:
      return f"error: {type(e).__name__}: {e.strerror}", "os"
    return f"error: unknown tool {tool!r}; use one of {', '.join(TOOLS)}", "usage"

  def grade_episode(self, episode: Episode) -> tuple[float, dict]:
    """``grade`` of the episode's workspace as it is now."""
    try:
      files = episode.workspace.snapshot()
    except (ValueError, OSError) as e:
      return 0.0, {"resolved": False, "rejected": None, "tests": {}, "test_error": str(e)}
    return grade(self._instance(episode.problem), files, self.backend)

  # ---- step -----------------------------------------------------------------------------------
  def step(self, episode, turn: int, action_ids: Sequence[int]) -> EnvStep:
    """One turn (module doc). ``episode`` must come from ``begin_episode``."""
    if not isinstance(episode, Episode):
      raise ValueError("WorkspaceEnv.step needs the Episode from begin_episode(problem) (the "
                       "rollout worker calls it); got a plain problem")
    tok = self.tokenizer
    ids = [int(t) for t in action_ids]
    stop_ids = tuple(int(s) for s in getattr(tok, "stop_ids", ()) or ())
    visible = tok.decode([t for t in ids if t not in stop_ids]) if ids else ""
    info: dict = {"tool": None, "tool_calls": 0, "tool_error": None, "truncated": False}

    def end(stop: str, finished: bool) -> EnvStep:
      reward, g = self.grade_episode(episode)
      info.update(g, stop=stop, finished=finished)
      return EnvStep(observation_ids=[], done=True, reward=reward, info=info)

    if visible.rstrip().endswith(OUTPUT_FENCE):
      call = parse_tool_call(visible)
      if call is not None and call[0] == "finish":
        info.update(tool="finish", tool_calls=1)
        return end("finish", True)
      if call is None:
        output, error = f"error: no tool block before ```output; tools: {', '.join(TOOLS)}", \
            "no_call"
      else:
        info.update(tool=call[0], tool_calls=1)
        output, error = self.run_tool(episode, *call)
      info.update(tool_error=error, tool_output_chars=len(output))
      if turn >= self.max_turns - 1:
        return end("last_turn", False)
      obs = [i for i in (int(t) for t in tok.encode(self.observation_text(output)))
             if i not in self._no_obs_ids]
      info["stop"] = "tool"
      return EnvStep(observation_ids=obs, done=False, reward=0.0, info=info)
    if ids and ids[-1] in stop_ids:
      return end("eos", True)
    info["truncated"] = True
    return end("length", False)
