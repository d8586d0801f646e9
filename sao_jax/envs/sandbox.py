"""A sandbox for model-written Python (tool-integrated tasks): OS isolation, not a blocklist.

``run_python(code, limits)`` runs ``code`` in a separate process and returns a ``SandboxResult``
whose ``observation()`` is the text to show the policy. Nothing the program does can raise in
the caller: every failure (timeout, memory, crash, output flood, setup error) is a result.

What is enforced, and how (Linux; the launcher is ``_sandbox_init.py``):

* separate process, killable as a whole: new PID namespace: the program's first process is PID 1
  there; when it exits or is killed every process it started dies with it; it gets SIGKILL if the
  launcher dies (``PR_SET_PDEATHSIG``)
* CPU time: ``RLIMIT_CPU`` (soft = ``cpu_s``: SIGXCPU, hard = ``cpu_s`` + 1: SIGKILL)
* wall time: the caller kills the launcher's process group after ``wall_s``
* memory: ``RLIMIT_AS`` = ``memory_bytes`` (a 10 GB allocation fails with MemoryError)
* processes (fork bomb): ``RLIMIT_NPROC`` = ``processes``, effective because the program runs as an
  unprivileged uid; the limit counts every process of that uid, so each run gets its own uid
  (``sandbox_uid``): a fork bomb in one sandbox cannot starve a concurrent one's ``fork``
* output size: the caller reads at most ``max_output_bytes`` of stdout + stderr, then kills the
  program
* file size / disk: ``RLIMIT_FSIZE`` = ``file_bytes``; the only writable place is a fresh tmpfs on
  /tmp of ``tmp_bytes`` (also the cwd)
* no writes elsewhere: private mount namespace; / remounted read-only; an unprivileged uid that owns
  no file, gid ``nogroup``
* no access to the trainer's files: tmpfs mounted over /root, /home, /work, /mnt, /srv, /opt, /run,
  /var/tmp, /dev/shm, the caller's cwd and $HOME and ``extra_masks``; a fresh /proc shows only the
  sandbox's processes
* no trainer environment variables: ``execve`` with ``PATH``, ``HOME=/tmp``, ``LANG``,
  ``PYTHONIOENCODING`` only; ``/proc/<trainer>/environ`` is not visible (own PID namespace)
* no network: new network namespace (only a down loopback device)
* no privilege regain: ``PR_SET_NO_NEW_PRIVS``, all capabilities dropped with the uid change
* no project packages: the base interpreter in isolated mode (``python -I -S``): standard library
  only

It needs root (or CAP_SYS_ADMIN) for the namespaces and mounts; without it ``run_python`` raises
``SandboxUnavailable`` (it never falls back to running code unconfined).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
DEFAULT_MASKS = ("/root", "/home", "/work", "/mnt", "/srv", "/opt", "/run", "/var/tmp", "/dev/shm",
                 "/farm", "/old_root")
NOBODY = 65534  # the gid (nogroup); the uid comes from sandbox_uid
UID_BASE, UID_COUNT = 1 << 20, 1 << 16  # uids 1048576 .. 1114111: no passwd entry, own no file
_uid_counter = itertools.count()


def sandbox_uid() -> int:
  """A fresh unprivileged uid for one run: ``UID_BASE`` + (this process's pid and a per-process
  counter, mod ``UID_COUNT``). RLIMIT_NPROC counts all processes of a uid, so concurrent runs
  (``rollout.env_workers`` threads, several trainer processes) must not share one: with a shared
  ``nobody`` a fork bomb held the count and the other sandboxes' setup ``fork`` failed with
  EAGAIN (seen in ``tests/unit/envs/test_tir_math.py`` under load)."""
  return UID_BASE + (os.getpid() * 7919 + next(_uid_counter)) % UID_COUNT


class SandboxUnavailable(RuntimeError):
  """The OS does not allow the isolation this sandbox requires (not root / no namespaces)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Limits of one sandboxed run. Units: seconds and bytes.

  Raises ValueError naming the field if any limit is not positive."""
  cpu_s: int = 2
  wall_s: float = 5.0
  memory_bytes: int = 512 * 2**20
  max_output_bytes: int = 64 * 2**10
  file_bytes: int = 8 * 2**20
  tmp_bytes: int = 16 * 2**20
  processes: int = 16
  open_files: int = 64
  extra_masks: tuple = ()

  def __post_init__(self):
    for f in ("cpu_s", "wall_s", "memory_bytes", "max_output_bytes", "file_bytes", "tmp_bytes",
              "processes", "open_files"):
      if not getattr(self, f) > 0:
        raise ValueError(f"SandboxLimits.{f} must be > 0, got {getattr(self, f)!r}.")


@dataclasses.dataclass
class SandboxResult:
  """Outcome of one run. ``error`` is None on success, else one of "timeout", "cpu_limit",
  "memory", "output_limit", "signal:<NAME>", "exit:<code>", "setup: <reason>"."""
  stdout: str
  stderr: str
  returncode: Optional[int]
  error: Optional[str]
  wall_s: float
  truncated: bool = False

  @property
  def ok(self) -> bool:
    return self.error is None

  def observation(self, max_chars: int = 2000) -> str:
    """Text for the policy: stdout on success, else ``error: <reason>`` and the stderr tail."""
    if self.ok:
      return self.stdout[-max_chars:]
    tail = self.stderr.strip().splitlines()[-3:]
    return (f"error: {self.error}" + ("\n" + "\n".join(tail) if tail else ""))[-max_chars:]


def _base_python() -> tuple[str, str]:
  """(interpreter path, prefix) of the base installation (not the venv)."""
  prefix = os.path.realpath(sys.base_prefix)
  exe = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
  if not os.path.exists(exe):
    exe = os.path.realpath(sys.executable)
  return exe, prefix


def _classify(rc: int, stderr: str, limits: SandboxLimits) -> Optional[str]:
  if rc == 0:
    return None
  if rc == 125 and "SANDBOX-SETUP-ERROR" in stderr:
    return "setup: " + stderr.split("SANDBOX-SETUP-ERROR:", 1)[1].strip().splitlines()[0]
  if rc > 128:
    sig = rc - 128
    if sig == signal.SIGXCPU:
      return "cpu_limit"
    try:
      return f"signal:{signal.Signals(sig).name}"
    except ValueError:
      return f"signal:{sig}"
  if "MemoryError" in stderr:
    return "memory"
  return f"exit:{rc}"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
  """Runs ``code`` (Python source) in the sandbox described in the module docstring.

  Returns a ``SandboxResult``; raises ``SandboxUnavailable`` only if the launcher cannot start
  (e.g. not root), never for anything the program does."""
  python, prefix = _base_python()
  host_tmp = tempfile.mkdtemp(prefix="sao-sandbox-")
  stage = os.path.join(host_tmp, "stage")
  os.makedirs(stage)
  masks = list(DEFAULT_MASKS) + [os.getcwd(), os.path.expanduser("~")] + list(limits.extra_masks)
  masks = sorted({os.path.realpath(m) for m in masks} - {"/", "/usr", "/etc", "/proc", "/dev",
                                                       "/tmp", "/bin", "/lib", "/lib64"})
  masks = [m for m in masks if not any(m.startswith(o + "/") for o in masks)]  # covered already
  cfg = {"prefix": prefix, "python": python, "stage": stage, "mask": masks, "uid": sandbox_uid(),
         "gid": NOBODY, "tmp_bytes": limits.tmp_bytes,
         "limits": {"cpu_s": int(limits.cpu_s), "memory_bytes": int(limits.memory_bytes),
                    "file_bytes": int(limits.file_bytes), "open_files": int(limits.open_files),
                    "processes": int(limits.processes)}}
  t0 = time.monotonic()
  try:
    proc = subprocess.Popen([python, "-I", "-S", "-B", _INIT, json.dumps(cfg)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd=host_tmp,
                            start_new_session=True, close_fds=True)
  except OSError as e:
    shutil.rmtree(host_tmp, ignore_errors=True)
    raise SandboxUnavailable(f"cannot start the sandbox launcher: {e}") from e
  try:
    proc.stdin.write(code.encode("utf-8", "replace"))
    proc.stdin.close()
  except BrokenPipeError:
    pass
  out, err = bytearray(), bytearray()
  error, truncated = None, False
  sel = selectors.DefaultSelector()
  sel.register(proc.stdout, selectors.EVENT_READ, out)
  sel.register(proc.stderr, selectors.EVENT_READ, err)
  open_streams = 2
  deadline = t0 + limits.wall_s
  while open_streams:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      error = "timeout"
      break
    for key, _ in sel.select(timeout=min(remaining, 0.5)):
      chunk = os.read(key.fileobj.fileno(), 65536)
      if not chunk:
        sel.unregister(key.fileobj)
        open_streams -= 1
        continue
      key.data.extend(chunk)
      if len(out) + len(err) > limits.max_output_bytes:
        error, truncated = "output_limit", True
        break
    if error:
      break
  sel.close()
  if error:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  try:
    rc = proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
  proc.stdout.close()
  proc.stderr.close()
  shutil.rmtree(host_tmp, ignore_errors=True)
  stdout = bytes(out[:limits.max_output_bytes]).decode("utf-8", "replace")
  stderr = bytes(err[:limits.max_output_bytes]).decode("utf-8", "replace")
  if error is None:
    error = _classify(rc, stderr, limits)
    if error and error.startswith("setup: ") and ("namespaces" in error or "EPERM" in error
                                                  or "Operation not permitted" in error):
      raise SandboxUnavailable(f"sandbox isolation is not available here: {error[7:]}")
  return SandboxResult(stdout=stdout, stderr=stderr, returncode=rc, error=error,
                       wall_s=time.monotonic() - t0, truncated=truncated)


class PythonTool:
  """A tool for environments: ``tool(code) -> observation text`` through ``run_python``.

  Counts calls and failures by reason in ``self.errors`` (dict reason -> count)."""

  def __init__(self, limits: SandboxLimits = SandboxLimits()):
    self.limits = limits
    self.calls = 0
    self.errors: dict[str, int] = {}

  def __call__(self, code: str) -> str:
    self.calls += 1
    res = run_python(code, self.limits)
    if not res.ok:
      reason = res.error.split(":")[0]
      self.errors[reason] = self.errors.get(reason, 0) + 1
    return res.observation()
