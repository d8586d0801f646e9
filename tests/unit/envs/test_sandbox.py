"""Hostile snippets against the tool sandbox: each is contained, reported as a tool error, and
the trainer (this test process) and its files are unharmed."""

import repo_paths  # tests/repo_paths.py
import concurrent.futures
import os
import socket
import textwrap
import time

import pytest

from sao_jax.envs import sandbox
from sao_jax.envs.sandbox import PythonTool, SandboxLimits, SandboxResult, run_python

ROOT = repo_paths.ROOT
LIMITS = SandboxLimits(cpu_s=1, wall_s=20.0, memory_bytes=256 * 2**20,
                       max_output_bytes=64 * 2**10, processes=16)


def _nobody_processes() -> int:
  """Processes running as a sandbox uid (``sandbox.UID_BASE`` .. + ``UID_COUNT``)."""
  n = 0
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/status") as f:
          if any(l.startswith("Uid:") and
                 sandbox.UID_BASE <= int(l.split()[1]) < sandbox.UID_BASE + sandbox.UID_COUNT
                 for l in f):
            n += 1
      except OSError:
        pass
  return n


def _run(code: str, **kw) -> SandboxResult:
  return run_python(textwrap.dedent(code), SandboxLimits(**{**LIMITS.__dict__, **kw}))


def test_plain_code_runs_and_returns_stdout_as_observation():
  res = _run("import json, math\nprint(json.dumps([math.factorial(10), 7 * 6]))")
  assert res.ok and res.returncode == 0
  assert res.observation() == "[3628800, 42]\n"


def test_infinite_loop_is_stopped_by_the_cpu_limit():
  res = _run("while True:\n  pass\n")
  assert res.error in ("cpu_limit", "timeout")  # timeout only if the machine is starved
  assert res.observation().startswith("error: ")


def test_wall_time_limit_kills_a_sleeping_program():
  res = _run("import time\ntime.sleep(60)\n", wall_s=1.0)
  assert res.error == "timeout"


@pytest.mark.slow
def test_fork_bomb_is_contained_and_leaves_no_process_behind():
  res = _run("""
      import os
      while True:
        try:
          os.fork()
        except OSError:
          pass
      """)
  assert not res.ok
  for _ in range(50):  # the kernel tears the PID namespace down asynchronously
    if _nobody_processes() == 0:
      break
    time.sleep(0.1)
  assert _nobody_processes() == 0  # the PID namespace took every child down


@pytest.mark.slow
def test_a_fork_bomb_does_not_starve_a_concurrent_sandbox():
  """RLIMIT_NPROC counts a uid's processes system-wide: each run has its own uid, so a program
  started while another sandbox's fork bomb is at its process limit still runs."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    bomb = pool.submit(_run, "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n"
                             "    pass\n")
    time.sleep(0.5)  # the bomb is at its limit by now
    res = _run("print(6 * 7)")
    assert not bomb.result().ok
  assert res.ok and res.observation() == "42\n", res.observation()
  assert len({sandbox.sandbox_uid() for _ in range(100)}) == 100


def test_10gb_allocation_fails_with_memory_error():
  res = _run("x = bytearray(10 * 2**30)\nprint(len(x))")
  assert res.error == "memory"
  assert "MemoryError" in res.observation()


def test_100mb_of_output_is_cut_at_the_limit():
  res = _run("import sys\nchunk = 'x' * 2**20\nfor _ in range(100):\n  sys.stdout.write(chunk)\n")
  assert res.error == "output_limit" and res.truncated
  assert len(res.stdout) <= LIMITS.max_output_bytes


def test_trainer_environment_variables_are_not_visible(monkeypatch):
  monkeypatch.setenv("SAO_TRAINER_SECRET", "hunter2-do-not-leak")
  res = _run(f"""
      import os
      print(sorted(os.environ))
      print(open('/proc/{os.getpid()}/environ', 'rb').read())
      """)
  assert res.error == "exit:1"
  assert "FileNotFoundError" in res.observation()  # its PID namespace has no such process
  assert "hunter2" not in res.stdout + res.stderr
  assert res.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING']"


@pytest.mark.parametrize("path", [os.path.join(ROOT, "README.md"), os.path.expanduser("~/.bashrc"),
                                  "/work/shared/DESIGN.md"])
def test_trainer_and_home_files_cannot_be_read(path):
  res = _run(f"print(open({path!r}).read())")
  assert res.error == "exit:1"
  assert "FileNotFoundError" in res.stderr or "PermissionError" in res.stderr
  assert res.stdout == ""


def test_writes_outside_the_temp_folder_fail_and_inside_succeed(tmp_path):
  targets = [os.path.join(ROOT, "PWNED"), "/etc/pwned", "/usr/pwned", str(tmp_path / "pwned")]
  res = _run(f"""
      open('inside.txt', 'w').write('ok')
      print(open('/tmp/inside.txt').read())
      for p in {targets!r}:
        try:
          open(p, 'w').write('x')
          print('WROTE', p)
        except OSError as e:
          print('denied', type(e).__name__)
      open({targets[0]!r}, 'w')
      """)
  assert res.error == "exit:1"
  assert res.stdout.splitlines()[0] == "ok"
  assert "WROTE" not in res.stdout
  assert all(not os.path.exists(p) for p in targets)


def test_network_socket_cannot_reach_the_host_or_outside():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  server.settimeout(0.5)
  port = server.getsockname()[1]
  res = _run(f"""
      import socket
      for addr in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:
        try:
          socket.create_connection(addr, timeout=2).close()
          print('CONNECTED', addr)
        except OSError as e:
          print('blocked', type(e).__name__)
      socket.create_connection(('127.0.0.1', {port}), timeout=2)
      """)
  with pytest.raises(socket.timeout):
    server.accept()  # nothing ever arrived
  server.close()
  assert res.error == "exit:1"
  assert "CONNECTED" not in res.stdout and res.stdout.count("blocked") == 2


def test_ctypes_segfault_is_reported_as_a_signal():
  res = _run("import ctypes\nctypes.string_at(0)\n")
  assert res.error == "signal:SIGSEGV"
  assert res.observation() .startswith("error: signal:SIGSEGV")


def test_python_tool_counts_errors_and_the_trainer_is_unharmed():
  pid, cwd, env = os.getpid(), os.getcwd(), dict(os.environ)
  readme = open(os.path.join(ROOT, "README.md"), "rb").read()
  tool = PythonTool(LIMITS)
  assert tool("print(6 * 7)") == "42\n"
  # the trainer's PID does not exist in the sandbox's PID namespace
  assert "ProcessLookupError" in tool(f"import os, signal\nos.kill({pid}, signal.SIGKILL)")
  assert tool("raise SystemExit(3)") == "error: exit:3"
  assert tool.calls == 3 and tool.errors == {"exit": 2}
  assert (os.getpid(), os.getcwd(), dict(os.environ)) == (pid, cwd, env)
  assert open(os.path.join(ROOT, "README.md"), "rb").read() == readme


def test_limits_validate_their_fields():
  with pytest.raises(ValueError, match="SandboxLimits.wall_s"):
    SandboxLimits(wall_s=0)
