"""The workspace environment (``sao_jax/envs/workspace.py``): path confinement, hostile tests
contained by the sandbox, binary reward from the hidden tests only, solutions that edit tests
rejected, and whole episodes through the real ``RolloutWorker`` (its begin/end episode hooks)."""

import repo_paths  # tests/repo_paths.py
import os
import socket
import threading

import pytest

from sao_jax.data.swebench import Instance
from sao_jax.data.tokenizer import CharTokenizer
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.workspace import (STOP_STRINGS, PathError, SandboxBackend, Workspace,
                                    WorkspaceEnv, grade, parse_tool_call)
from test_tir_math import ScriptedEngine  # noqa: E402  (tests/ is on sys.path)
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker

ROOT = repo_paths.ROOT
TOK = CharTokenizer()
LIMITS = SandboxLimits(cpu_s=2, wall_s=6.0, memory_bytes=256 * 2**20, processes=16)
BACKEND = SandboxBackend(LIMITS, test_timeout_s=1.0)

CALC = "def mean(xs):\n  return sum(xs) / len(xs)\n"
VISIBLE = ("from calc import mean\n\n\ndef test_mean():\n  assert mean([1, 2, 3]) == 2\n")
HIDDEN = ("import unittest\n\nfrom calc import mean\n\n\ndef test_mean():\n"
          "  assert mean([1, 2, 3]) == 2\n\n\nclass TestEmpty(unittest.TestCase):\n"
          "  def test_empty(self):\n    self.assertEqual(mean([]), 0.0)\n")
FIX_OLD, FIX_NEW = "  return sum(xs) / len(xs)", "  return sum(xs) / len(xs) if xs else 0.0"


def _instance(**kw):
  args = dict(instance_id="calc-1", problem_statement="mean([]) raises; it should return 0.0",
              files={"calc.py": CALC, "tests/test_calc.py": VISIBLE},
              fail_to_pass=("tests/test_hidden.py::TestEmpty::test_empty",),
              pass_to_pass=("tests/test_hidden.py::test_mean",),
              test_files={"tests/test_hidden.py": HIDDEN})
  args.update(kw)
  return Instance(**args)


def _env(inst=None, max_turns=6):
  return WorkspaceEnv(TOK, [inst or _instance()], max_turns=max_turns, backend=BACKEND,
                      max_output_chars=2000)


def _call(tool, args="", body=""):
  return f"```{tool}{' ' + args if args else ''}\n{body + chr(10) if body else ''}```\n```output"


def _step(env, ep, turn, text, eos=False):
  return env.step(ep, turn, TOK.encode(text) + ([TOK.eos_id] if eos else []))


def _obs(st):
  return TOK.decode(st.observation_ids)


# ---- tool-call parsing and confinement ------------------------------------------------------


def test_line_addressed_replace_and_undo():
  """``replace PATH LINE``: OLD must occur once in that line (a hand example where it occurs
  in other lines too); ``undo`` restores the text before the last edit, a created file is
  deleted, and nothing left to undo is an error."""
  env = _env(_instance(files={"calc.py": "a = 1\nb = 1\n", "tests/test_calc.py": VISIBLE}))
  ep = env.begin_episode(env.problems()[0])
  assert "occurs 2 times" in _obs(_step(env, ep, 0, _call("replace", "calc.py", "1\n=======\n2")))
  st = _step(env, ep, 0, _call("replace", "calc.py 2", "1\n=======\n2"))
  assert st.info["tool_error"] is None and _obs(st) == "\nedited calc.py\n2| b = 2\n```\n"
  assert "outside 1-3" in _obs(_step(env, ep, 0, _call("replace", "calc.py 7", "1\n=======\n2")))
  assert "occurs 0 times in line 1" in _obs(
      _step(env, ep, 0, _call("replace", "calc.py 1", "b\n=======\nc")))
  assert "usage: replace PATH [LINE]" in _obs(
      _step(env, ep, 0, _call("replace", "calc.py x", "1\n=======\n2")))
  assert _obs(_step(env, ep, 0, _call("undo", "calc.py"))) == "\nreverted calc.py\n2| b = 1\n```\n"
  assert ep.workspace.snapshot()["calc.py"] == "a = 1\nb = 1\n"
  assert "no edit of calc.py" in _obs(_step(env, ep, 0, _call("undo", "calc.py")))
  _step(env, ep, 0, _call("create", "new.py", "x = 1"))
  assert "deleted" in _obs(_step(env, ep, 0, _call("undo", "new.py")))
  assert "new.py" not in ep.workspace.snapshot()
  assert "absolute" in _obs(_step(env, ep, 0, _call("undo", "/etc/passwd")))
  env.end_episode(ep)


def test_parse_tool_call_takes_the_last_block_before_the_output_fence():
  text = "look\n```view a.py\n```\nthen\n```replace a.py\nx = 1\n=======\nx = 2\n```\n```output"
  assert parse_tool_call(text) == ("replace", "a.py", "x = 1\n=======\nx = 2")
  assert parse_tool_call("```test\n```\n```output") == ("test", "", "")
  assert parse_tool_call("no call ```output") is None


@pytest.mark.parametrize("path", ["../escape.py", "a/../../escape.py", "/etc/passwd", "~/x",
                                  "", "a\x00b"])
def test_paths_outside_the_workspace_are_refused(path):
  ws = Workspace({"a/b.py": "x\n"})
  try:
    with pytest.raises(PathError):
      ws.resolve(path)
  finally:
    ws.close()
  assert not os.path.exists(ws.root)


def test_tool_calls_with_hostile_paths_get_an_error_observation_and_touch_nothing(tmp_path):
  env = _env()
  ep = env.begin_episode(env.problems()[0])
  outside = tmp_path / "outside.py"
  outside.write_text("secret = 1\n")
  rel_out = os.path.relpath(outside, ep.workspace.root)
  cases = [(_call("view", "/etc/passwd"), "absolute paths are not allowed"),
           (_call("view", "../../etc/passwd"), "'..' is not allowed"),
           (_call("view", rel_out), "'..' is not allowed"),
           (_call("replace", str(outside), "secret = 1\n=======\nsecret = 2"), "absolute"),
           (_call("create", "../pwned.py", "x = 1"), "'..' is not allowed"),
           (_call("test", "../../x.py::test_a"), "'..' is not allowed")]
  for turn, (text, expect) in enumerate(cases):
    st = _step(env, ep, turn % 5, text)
    assert not st.done and st.info["tool_error"] == "path", text
    assert expect in _obs(st) and _obs(st).startswith("\nerror: ")
  assert outside.read_text() == "secret = 1\n"
  assert not os.path.exists(os.path.join(os.path.dirname(ep.workspace.root), "pwned.py"))
  env.end_episode(ep)


def test_a_symlink_out_of_the_workspace_is_refused(tmp_path):
  outside = tmp_path / "target.py"
  outside.write_text("x = 1\n")
  env = _env()
  ep = env.begin_episode(env.problems()[0])
  root = ep.workspace.root
  os.symlink(str(outside), os.path.join(root, "link.py"))   # a hostile snapshot's symlinks
  os.symlink(str(tmp_path), os.path.join(root, "linkdir"))
  os.symlink("calc.py", os.path.join(root, "inside.py"))    # one that stays inside is fine
  for text in (_call("view", "link.py"), _call("replace", "link.py", "x = 1\n=======\nx = 2"),
               _call("create", "linkdir/new.py", "y = 1"), _call("view", "linkdir")):
    st = _step(env, ep, 0, text)
    assert st.info["tool_error"] == "path" and "resolves outside the repository" in _obs(st)
  assert outside.read_text() == "x = 1\n" and not (tmp_path / "new.py").exists()
  assert "1| def mean(xs):" in _obs(_step(env, ep, 0, _call("view", "inside.py")))
  assert "link.py" not in ep.workspace.snapshot()  # symlinks never reach the sandbox
  env.end_episode(ep)
  assert not os.path.exists(root)


def test_view_replace_create_and_their_errors():
  env = _env()
  ep = env.begin_episode(env.problems()[0])
  assert _obs(_step(env, ep, 0, _call("view", "calc.py 2 2"))) == (
      "\n2|   return sum(xs) / len(xs)\n```\n")
  assert "calc.py\ntests/test_calc.py" in _obs(_step(env, ep, 0, _call("view", ".")))
  st = _step(env, ep, 0, _call("replace", "calc.py", "nothing like this\n=======\nx"))
  assert st.info["tool_error"] == "value" and "occurs 0 times" in _obs(st)
  st = _step(env, ep, 0, _call("replace", "calc.py", "xs\n=======\nys"))
  assert "occurs 3 times" in _obs(st)
  st = _step(env, ep, 0, _call("replace", "calc.py", f"{FIX_OLD}\n=======\n{FIX_NEW}"))
  assert st.info["tool_error"] is None and f"2| {FIX_NEW}" in _obs(st)
  assert "created util/x.py" in _obs(_step(env, ep, 0, _call("create", "util/x.py", "y = 1")))
  assert "already exists" in _obs(_step(env, ep, 0, _call("create", "calc.py", "y = 1")))
  assert "no such file" in _obs(_step(env, ep, 0, _call("view", "tests/test_hidden.py")))
  assert "outside 1-2" in _obs(_step(env, ep, 0, _call("view", "calc.py 5 9")))
  env.end_episode(ep)


# ---- hostile tests inside the sandbox -------------------------------------------------------

def _run_test_file(body, tmp_path, name="test_evil"):
  inst = _instance(files={"calc.py": CALC, f"tests/{name}.py": body})
  env = _env(inst)
  ep = env.begin_episode(env.problems()[0])
  st = _step(env, ep, 0, _call("test"))
  snap = ep.workspace.snapshot()
  env.end_episode(ep)
  assert snap == dict(inst.files)  # nothing a test did came back into the workspace
  return st


def _children():
  out = set()
  for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/children") as f:
      out |= set(f.read().split())
  return out


def test_a_forking_test_is_contained_and_leaves_no_process(tmp_path):
  before = _children()
  st = _run_test_file("import os\n\ndef test_bomb():\n  while True:\n    os.fork()\n", tmp_path)
  obs = _obs(st)
  assert ("FAILED tests/test_evil.py::test_bomb" in obs
          or st.info["tool_error"] in ("timeout", "cpu_limit")), obs
  assert obs.count("FAILED") <= 1 and "@@RESULT@@" not in obs  # forked copies report nothing
  assert _children() <= before   # the sandbox's PID namespace took every fork with it


def test_a_test_that_writes_outside_fails_and_the_host_is_unchanged(tmp_path):
  targets = [os.path.join(ROOT, "PWNED"), "/etc/pwned", "/usr/pwned", str(tmp_path / "pwned")]
  body = ("def test_write():\n  errors = []\n"
          f"  for t in {targets!r}:\n"
          "    try:\n      open(t, 'w').write('x')\n    except OSError as e:\n"
          "      errors.append(type(e).__name__)\n"
          f"  assert len(errors) == {len(targets)}, errors\n")
  obs = _obs(_run_test_file(body, tmp_path))
  assert obs == "\n1 passed\n```\n", obs
  assert not any(os.path.exists(t) for t in targets)


def test_a_test_that_reads_etc_sees_no_secret_and_cannot_write_it(tmp_path):
  secret = tmp_path / "secret.txt"
  secret.write_text("token")
  body = ("import os\n\ndef test_read():\n"
          "  assert open('/etc/passwd').read()  # public, read-only\n"
          "  for p in ('/etc/shadow', " + repr(str(secret)) + ", " + repr(ROOT + "/README.md")
          + "):\n"
          "    try:\n      open(p).read()\n      raise AssertionError('read ' + p)\n"
          "    except OSError:\n      pass\n"
          "  try:\n    open('/etc/passwd', 'a').write('evil')\n    raise AssertionError('w')\n"
          "  except OSError:\n    pass\n")
  passwd = open("/etc/passwd").read()
  obs = _obs(_run_test_file(body, tmp_path))
  assert obs == "\n1 passed\n```\n", obs
  assert open("/etc/passwd").read() == passwd


def test_a_test_that_opens_a_socket_cannot_connect(tmp_path):
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(1)
  srv.settimeout(8.0)
  port = srv.getsockname()[1]
  got = []
  t = threading.Thread(target=lambda: got.append(_try_accept(srv)))
  t.start()
  body = ("import socket\n\ndef test_net():\n"
          f"  socket.create_connection(('127.0.0.1', {port}), timeout=1)\n")
  obs = _obs(_run_test_file(body, tmp_path))
  srv.close()
  t.join()
  assert "FAILED tests/test_evil.py::test_net" in obs and "Error" in obs, obs
  assert got == [False]


def _try_accept(srv):
  try:
    srv.accept()[0].close()
    return True
  except OSError:
    return False


def test_a_sleeping_test_is_stopped_by_its_timeout_and_a_stubborn_one_by_the_wall_limit(
    tmp_path):
  obs = _obs(_run_test_file("import time\n\ndef test_sleep():\n  time.sleep(60)\n"
                            "\ndef test_ok():\n  pass\n", tmp_path))
  assert "FAILED tests/test_evil.py::test_sleep" in obs and "longer than 1.0 s" in obs, obs
  assert obs.endswith("1 passed, 1 failed\n```\n")
  st = _run_test_file("import signal, time\n\ndef test_sleep():\n"
                      "  signal.signal(signal.SIGALRM, signal.SIG_IGN)\n  time.sleep(60)\n",
                      tmp_path)
  assert st.info["tool_error"] == "timeout"
  assert _obs(st).startswith("\nerror: timeout") and "longer than 6.0 s" in _obs(st)


# ---- reward ---------------------------------------------------------------------------------

def test_reward_is_one_only_when_the_hidden_tests_pass():
  inst = _instance()
  fixed = {**inst.files, "calc.py": CALC.replace(FIX_OLD, FIX_NEW)}
  assert grade(inst, dict(inst.files), BACKEND)[0] == 0.0
  r, info = grade(inst, fixed, BACKEND)
  assert r == 1.0 and info["resolved"] and info["tests"] == {
      "tests/test_hidden.py::TestEmpty::test_empty": "passed",
      "tests/test_hidden.py::test_mean": "passed"}
  # passes the visible test but breaks what PASS_TO_PASS checks
  wrong = {**inst.files, "calc.py": "def mean(xs):\n  return 0.0\n"}
  assert grade(inst, wrong, BACKEND)[0] == 0.0


def test_a_solution_that_edits_or_adds_tests_is_rejected():
  inst = _instance()
  fixed = CALC.replace(FIX_OLD, FIX_NEW)
  for files in ({**inst.files, "calc.py": fixed, "tests/test_calc.py": "def test_a():\n  pass\n"},
                {**inst.files, "calc.py": fixed, "conftest.py": ""},
                {"calc.py": fixed},   # deleted the visible tests
                {**inst.files, "calc.py": fixed, "tests/test_hidden.py": "def test_mean():\n"
                 "  pass\n\nclass TestEmpty:\n  def test_empty(self):\n    pass\n"}):
    r, info = grade(inst, files, BACKEND)
    assert r == 0.0 and info["rejected"], files


def test_whole_episodes_through_the_rollout_worker():
  """Scripted policies: view -> test -> fix -> test -> finish resolves (reward 1); editing the
  visible test instead is rejected (0); the worker's hooks give each episode its own workspace
  and delete it at the end."""
  inst_a, inst_b = _instance(instance_id="fix"), _instance(instance_id="cheat")
  env = WorkspaceEnv(TOK, [inst_a, inst_b], max_turns=6, backend=BACKEND,
                     system="Fix it.", max_output_chars=2000)
  problems = [p for p in env.problems()]
  fix = [_call("view", "calc.py"), _call("test"),
         _call("replace", "calc.py", f"{FIX_OLD}\n=======\n{FIX_NEW}"), _call("test"),
         _call("finish")]
  cheat = [_call("replace", "tests/test_calc.py", "assert mean([1, 2, 3]) == 2\n=======\n"
                 "assert True"), _call("test"), "done"]
  engine = ScriptedEngine({"cheat": cheat, "fix": fix}, slots=2)
  env.prompt_text = lambda p: f"Fix it.\n\n{p.id} {p.prompt}\n"  # the script key in the prompt
  roots = []
  begin = env.begin_episode
  env.begin_episode = lambda p: roots.append(begin(p)) or roots[-1]
  out = []
  RolloutWorker(engine, env, iter(problems), lambda t: out.append(t) or True, WeightStore({}, 0),
                stop_ids=(TOK.eos_id,), stop_strings=STOP_STRINGS, max_new_tokens=600,
                max_seq_len=8192, temperature=1.0, env_workers=2).run()
  trajs = {t.problem_id: t for t in out}
  assert trajs["fix"].reward == 1.0 and trajs["fix"].info["finished"]
  assert trajs["fix"].num_turns == 5 and trajs["fix"].info["tool_calls"] == 5
  assert trajs["cheat"].reward == 0.0
  assert trajs["cheat"].info["rejected"] == ["tests/test_calc.py"]
  seq = next(s for s in engine.started if s.turns is fix)
  assert "1| def mean(xs):" in seq.observations[0]
  assert seq.observations[1].endswith("\n1 passed\n```\n")
  assert f"2| {FIX_NEW}" in seq.observations[2]
  n_obs = int((trajs["fix"].action_mask == 0).sum()) - len(env.prompt_ids(problems[0]))
  assert n_obs > 100   # file views and test logs: long observations
  assert len(roots) == 2 and not any(os.path.exists(ep.workspace.root) for ep in roots)


def test_step_rules_eos_length_last_turn_and_bad_calls():
  env = _env(max_turns=2)
  p = env.problems()[0]
  ep = env.begin_episode(p)
  st = _step(env, ep, 0, "I do not know", eos=True)
  assert st.done and st.reward == 0.0 and st.info["stop"] == "eos" and st.info["finished"]
  st = _step(env, ep, 0, "```view calc.py")      # cut by the token limit
  assert st.done and st.info["truncated"] and st.info["stop"] == "length"
  st = _step(env, ep, 0, "```output")
  assert not st.done and st.info["tool_error"] == "no_call"
  st = _step(env, ep, 1, _call("replace", "calc.py", f"{FIX_OLD}\n=======\n{FIX_NEW}"))
  assert st.done and st.info["stop"] == "last_turn" and st.reward == 1.0  # graded at the end
  env.end_episode(ep)
  with pytest.raises(ValueError, match="begin_episode"):
    env.step(p, 0, TOK.encode(_call("finish")))
  with pytest.raises(ValueError, match="max_turns"):
    WorkspaceEnv(TOK, [_instance()], max_turns=0, backend=BACKEND)


def test_special_tokens_in_files_cannot_forge_a_turn_end():
  inst = _instance(files={"calc.py": "# <eos> <tool>\n" + CALC, "tests/test_calc.py": VISIBLE})
  env = _env(inst)
  ep = env.begin_episode(env.problems()[0])
  st = _step(env, ep, 0, _call("view", "calc.py 1 1"))
  assert TOK.eos_id not in st.observation_ids and 4 not in st.observation_ids
  env.end_episode(ep)


def test_the_backend_cache_reuses_reports_but_not_failed_runs():
  backend = SandboxBackend(LIMITS, test_timeout_s=1.0, cache_size=2)
  files = {"calc.py": CALC, "tests/test_calc.py": VISIBLE}
  first = backend.run(files)
  again = backend.run(files)
  assert backend.runs == 1 and again.status == first.status == {
      "tests/test_calc.py::test_mean": "passed"}
  slow = {**files, "tests/test_slow.py": "import signal, time\n\ndef test_s():\n"
          "  signal.signal(signal.SIGALRM, signal.SIG_IGN)\n  time.sleep(60)\n"}
  assert backend.run(slow, ["tests/test_slow.py::test_s"]).error == "timeout"
  assert backend.run(slow, ["tests/test_slow.py::test_s"]).error == "timeout"
  assert backend.runs == 3  # a timed-out run is not cached
