r"""Tool-integrated math (``sao_jax/envs/tir_math.py``): the policy's ```` ```python ```` block runs
in the sandbox, its output comes back as observation tokens (action_mask 0), the episode goes on
for several turns and ends with a graded ``\boxed{}``; hostile programs are contained and become
observations while the rollout goes on. The multi-turn episodes run through the real
``RolloutWorker`` (env steps on its thread pool) driven by a scripted policy engine."""

import repo_paths  # tests/repo_paths.py
import dataclasses
import os
import socket

import numpy as np
import pytest

from sao_jax.data.jsonl import Problem
from sao_jax.data.tokenizer import CharTokenizer
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.tir_math import (INSTRUCTION, STOP_STRINGS, TirMathEnv, cut_middle,
                                   extract_code)
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker

ROOT = repo_paths.ROOT
TOK = CharTokenizer()
LIMITS = SandboxLimits(cpu_s=1, wall_s=10.0, memory_bytes=256 * 2**20, processes=16)


def _env(max_turns=8, **kw):
  return TirMathEnv(TOK, max_turns=max_turns, limits=LIMITS, **kw)


def _code(src: str) -> str:
  """One tool-call action: a python block and the ```output fence (the stop string)."""
  return f"```python\n{src}\n```\n```output"


# ---- a scripted policy behind the engine interface the worker drives --------------------------
@dataclasses.dataclass
class _Seq:
  """One sequence's place in its script (what a KV-cache prefix is for the real engine)."""
  turns: list            # action text per turn
  turn: int = 0
  queue: list = dataclasses.field(default_factory=list)
  observations: list = dataclasses.field(default_factory=list)
  token: int = 0
  logprob: float = -0.5

  def start_turn(self):
    self.queue = TOK.encode(self.turns[self.turn])
    if not self.turns[self.turn].endswith("```output"):  # an answer turn: ends with <eos>
      self.queue.append(TOK.eos_id)
    self.token = self.queue.pop(0)


class ScriptedEngine:
  """Plays ``scripts[key]`` (a list of per-turn action texts) for a prompt containing ``key``;
  a turn not ending with the ```output fence ends with ``<eos>``. Observations prefilled onto a
  sequence are recorded in its ``observations``; every sequence started is in ``started``."""

  def __init__(self, scripts: dict, slots: int = 2):
    self.scripts, self.tokenizer, self.started = scripts, TOK, []
    self.cfg = type("Cfg", (), {"max_seq_len": 8192})()
    self.max_concurrent_decodes, self.max_prefill_length = slots, 4096

  def pad_to_bucket(self, ids):
    return list(ids), len(ids)

  def init_decode_state(self, seed=0):
    return [None] * self.max_concurrent_decodes

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length, temperature=None):
    if existing_prefix is None:
      text = TOK.decode(padded_tokens[:true_length])
      seq = _Seq(turns=next(v for k, v in self.scripts.items() if k in text))
      self.started.append(seq)
    else:
      seq = existing_prefix
      seq.observations.append(TOK.decode(padded_tokens[1:true_length]))  # [stop token] + obs
      seq.turn += 1
    seq.start_turn()
    return seq

  def insert(self, prefix, state, slot):
    state[slot] = prefix
    return state

  def slot_prefix(self, state, slot):
    return state[slot]

  def generate(self, params, state, temperature=None):
    toks = np.zeros((len(state), 1), np.int32)
    for i, seq in enumerate(state):
      if seq is not None and seq.queue:
        toks[i, 0] = seq.queue.pop(0)
    res = type("R", (), {"data": toks, "logprobs": np.full((len(state), 1), -0.5, np.float32)})
    return state, res()


def _rollout(env, problems, scripts, env_workers=2):
  engine = ScriptedEngine(scripts, slots=2)
  out = []
  worker = RolloutWorker(engine, env, iter(problems), lambda t: out.append(t) or True,
                         WeightStore({}, 0), stop_ids=(TOK.eos_id,), stop_strings=STOP_STRINGS,
                         max_new_tokens=600, max_seq_len=8192, temperature=1.0,
                         env_workers=env_workers)
  worker.run()
  return {t.problem_id: t for t in out}, engine, worker


def _observation_runs(traj, prompt_len):
  """Decoded maximal runs of action_mask-0 tokens after the prompt."""
  runs, cur = [], []
  for tok, m in zip(traj.tokens[prompt_len:], traj.action_mask[prompt_len:]):
    if m == 0:
      cur.append(int(tok))
    elif cur:
      runs.append(TOK.decode(cur))
      cur = []
  return runs + ([TOK.decode(cur)] if cur else [])


GAUSS = Problem("gauss", "What is 1 + 2 + ... + 100?", "5050")


def test_scripted_policy_runs_code_for_several_turns_and_ends_with_a_graded_box():
  env = _env()
  script = ["Let me add them.\n" + _code("print(sum(range(1, 101)))"),
            "Check with Gauss' formula.\n" + _code("n = 100\nprint(n * (n + 1) // 2, 'ok')"),
            "Both agree, so the answer is \\boxed{5050}."]
  trajs, engine, worker = _rollout(env, [GAUSS], {"1 + 2 + ... + 100": script})
  t = trajs["gauss"]
  assert t.reward == 1.0 and t.num_turns == 3 and t.info["tool_calls"] == 2
  assert t.info["finish_reason"] == "eos" and not t.truncated
  # the program's stdout came back as observation tokens, in the fenced format
  assert engine.started[0].observations == ["\n5050\n```\n", "\n5050 ok\n```\n"]
  prompt = env.prompt_ids(GAUSS)
  assert TOK.decode(t.tokens[:len(prompt)]) == f"<bos>{INSTRUCTION}\n\n{GAUSS.prompt}\n"
  assert np.all(t.action_mask[:len(prompt)] == 0)
  assert _observation_runs(t, len(prompt)) == ["\n5050\n```\n", "\n5050 ok\n```\n"]
  # every other token after the prompt is the policy's (mask 1), text exactly the script's
  acts = [int(x) for x, m in zip(t.tokens, t.action_mask) if m == 1]
  assert TOK.decode(acts) == "".join(script) + "<eos>"
  assert np.all(t.logprobs[t.action_mask == 0][len(prompt):] == 0.0)
  assert worker.stats.env_errors == 0


def test_hostile_programs_are_contained_become_observations_and_the_rollout_goes_on(tmp_path):
  """Fork bomb, a write outside the sandbox, a network connection to the host, an endless loop
  and a crash: five tool turns of error observations, then a correct box (reward 1); a second,
  concurrent episode completes normally."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  server.settimeout(0.5)
  port = server.getsockname()[1]
  target = tmp_path / "PWNED"
  hostile = [
      _code("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"),
      _code(f"open({str(target)!r}, 'w').write('x')"),
      _code(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"),
      _code("while True:\n  pass"),
      _code("import ctypes\nctypes.string_at(0)"),
      "None of that worked; by hand it is \\boxed{5050}.",
  ]
  other = Problem("easy", "What is 6 times 7?", "42")
  env = _env(max_turns=8)
  trajs, engine, worker = _rollout(
      env, [GAUSS, other], {"1 + 2 + ... + 100": hostile,
                             "6 times 7": [_code("print(6 * 7)"), "\\boxed{42}"]})
  with pytest.raises(socket.timeout):
    server.accept()  # the connection never arrived
  server.close()
  assert not target.exists()
  assert worker.stats.env_errors == 0
  t = trajs["gauss"]
  assert t.reward == 1.0 and t.num_turns == 6 and t.info["tool_calls"] == 5
  obs = next(s for s in engine.started if s.turns is hostile).observations
  assert len(obs) == 5 and all(o.startswith("\nerror: ") and o.endswith("\n```\n") for o in obs)
  assert "PermissionError" in obs[1] or "OSError" in obs[1] or "FileNotFoundError" in obs[1]
  assert "OSError" in obs[2] or "Error" in obs[2]
  assert obs[3].startswith("\nerror: cpu_limit") or obs[3].startswith("\nerror: timeout")
  assert obs[4].startswith("\nerror: signal:SIGSEGV")
  assert _observation_runs(t, len(env.prompt_ids(GAUSS))) == obs
  e = trajs["easy"]
  assert e.reward == 1.0 and e.num_turns == 2
  assert next(s for s in engine.started if s.turns[-1] == "\\boxed{42}").observations == [
      "\n42\n```\n"]


def test_inline_env_steps_give_the_same_episode():
  """env_workers=0 (inline env.step) plays the same script to the same tokens and reward."""
  env = _env()
  script = [_code("print(2 ** 10)"), "\\boxed{5050}"]
  a, _, _ = _rollout(env, [GAUSS], {"1 + 2": script}, env_workers=0)
  b, _, _ = _rollout(env, [GAUSS], {"1 + 2": script}, env_workers=2)
  assert a["gauss"].reward == b["gauss"].reward == 1.0
  np.testing.assert_array_equal(a["gauss"].tokens, b["gauss"].tokens)
  np.testing.assert_array_equal(a["gauss"].action_mask, b["gauss"].action_mask)


# ---- TirMathEnv.step rules ------------------------------------------------------------------
def _step(env, text, turn=0, problem=GAUSS, stop=True):
  ids = TOK.encode(text) + ([TOK.eos_id] if stop and not text.endswith("```output") else [])
  return env.step(problem, turn, ids)


def test_step_rules_eos_length_last_turn_and_missing_code():
  env = _env(max_turns=3)
  s = _step(env, "The answer is \\boxed{5050}.")
  assert (s.done, s.reward, s.info["stop"], s.info["answer"]) == (True, 1.0, "eos", "5050")
  s = _step(env, "The answer is \\boxed{\\frac{10100}{2}}.")  # math-verify: equal value
  assert s.done and s.reward == 1.0
  s = _step(env, "I think it is 5050.")  # no box
  assert s.done and s.reward == 0.0
  s = _step(env, "so \\boxed{5050} and then I kept writ", stop=False)
  assert s.done and s.reward == 1.0 and s.info["truncated"] and s.info["stop"] == "length"
  s = _step(env, "no code here\n```output")
  assert not s.done and TOK.decode(s.observation_ids) == (
      "\nerror: no ```python code block before ```output\n```\n")
  assert s.info["tool_error"] == "no_code"
  s = _step(env, "\\boxed{5050}\n" + _code("print(1)"), turn=2)  # last turn: done, graded
  assert s.done and s.observation_ids == [] and s.reward == 1.0 and s.info["tool_calls"] == 1
  s = _step(env, _code("raise SystemExit(3)"))
  assert TOK.decode(s.observation_ids) == "\nerror: exit:3\n```\n"


def test_output_is_cut_and_special_tokens_cannot_be_forged():
  env = _env(max_output_chars=64)
  s = _step(env, _code("print('a' * 1000)"))
  text = TOK.decode(s.observation_ids)
  assert text == "\n" + "a" * 32 + "...[936 characters cut]..." + "a" * 32 + "\n```\n"
  s = _step(env, _code("print('x<eos>y<bos><tool>z')"))
  assert TOK.eos_id not in s.observation_ids and TOK.bos_id not in s.observation_ids
  assert TOK.decode(s.observation_ids) == "\nxyz\n```\n"


def test_extract_code_and_cut_middle():
  text = "a\n```python\nprint(1)\n```\nb\n```python  \nprint(2)\n```\n```output"
  assert extract_code(text) == "print(2)\n"
  assert extract_code("```python\nprint(1)\n") is None  # unterminated
  assert extract_code("```py\nx\n```\n```output") is None
  assert cut_middle("abcdef", 6) == "abcdef"
  assert cut_middle("abcdefgh", 4) == "ab...[4 characters cut]...gh"


def test_chat_template_prompt():
  class ChatTok:
    chat_template = "{{ messages }}"
    stop_ids, bos_id, pad_id = (2,), 1, 0

    def apply_chat_template(self, messages, add_generation_prompt=True):
      return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    def encode(self, text):
      return [ord(c) for c in text]

  env = TirMathEnv(ChatTok(), max_turns=2, limits=LIMITS, check_sandbox=False)
  assert env.prompt_text(GAUSS) == f"system:{INSTRUCTION}|user:{GAUSS.prompt}|assistant:"
  assert env.prompt_ids(GAUSS)[0] == ord("s")  # no bos prepended to a chat prompt


def test_bad_arguments_name_the_field():
  with pytest.raises(ValueError, match="task.max_turns"):
    TirMathEnv(TOK, max_turns=0, check_sandbox=False)
  with pytest.raises(ValueError, match="task.tool_output_chars"):
    TirMathEnv(TOK, max_output_chars=4, check_sandbox=False)


# ---- the task and the main job ------------------------------------------------------------------
def test_aime_config_builds_the_tool_task_on_the_train_mix():
  import importlib.util
  from sao_jax import roles, tasks
  from sao_jax.data import split
  spec = importlib.util.spec_from_file_location("aime_cfg",
                                                os.path.join(ROOT, "configs", "aime.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config("")
  assert c.task.name == "tir_math" and c.task.max_turns == 50
  assert c.rollout.temperature == 1.0 and c.rollout.env_workers == c.rollout.slots
  task = tasks.make_task(roles.from_config(mod.get_config("smoke")))
  assert isinstance(task.env, TirMathEnv) and task.stop_strings == ("```output",)
  assert len(task.train_problems) == 8073 and [p.id for p in task.eval_problems] == [
      "aime-2025-I-01", "aime-2025-I-02", "aime-2025-I-03", "aime-2025-I-04"]
  assert split.overlaps(task.train_problems, split.load_files(split.EVAL_SETS)) == []


# configs/aime.py:smoke end to end: tests/unit/models/test_pretrained.py (from a tiny Hugging Face
# checkpoint,
# the way the config is used)
