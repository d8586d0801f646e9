r"""A CPU-sized agentic-coding task: bug-fix instances generated from small Python modules.

Instances
---------
Every module of ``swe_lite_modules.MODULES`` (one function with 3-5 ``assert call == expected``
cases) is mutated at one site, in one of four ways (``KINDS``):

* ``comparison``: ``<`` -> ``<=`` or ``>``, ``>`` -> ``>=`` or ``<`` (and back), ``==`` <-> ``!=``,
  ``and`` <-> ``or``;
* ``operator``: ``+`` -> ``-`` or ``*``, ``-`` / ``*`` -> ``+``, ``//`` -> ``/``, ``%`` -> ``//``;
* ``off_by_one``: an integer literal ``k`` -> ``k + 1`` or ``k - 1``;
* ``missing_edge_case``: an ``if ...:`` guard and its ``return`` line deleted.

With ``task.swe_generated`` = N, the N modules of ``swe_lite_gen.generate`` join them (same
format, templated names, constants and operators); ``task.swe_kinds`` keeps only some kinds.

A mutant becomes an ``Instance`` (``data/swebench.py``) when it compiles and fails at least one
case: the repository is ``NAME.py`` (the mutant) and ``tests/test_NAME.py`` (the visible tests:
every case but the last); the hidden ``tests/test_NAME.py`` has every case, one ``test_K``
function each; FAIL_TO_PASS are the cases the mutant fails, PASS_TO_PASS the rest; the gold
``patch`` restores the original. The problem statement is an issue report of the first failing
case: ``"clamp(0, 0, 10) returns 10, expected 0."`` (or ``"... raises ZeroDivisionError, ..."``).
Mutants are checked by running the cases in this process (the code is the package's own; the
policy's code only ever runs in the sandbox).

The train / eval split is by module (``split_of``: a stable hash of the module name; about a third
of the modules are held out), so no held-out instance shares code with a training one.

Demonstrations (``make_sft_dataset``)
-------------------------------------
Whole episodes replayed through ``WorkspaceEnv`` (real observations): ``view NAME.py`` ->
``test`` -> then, w.p. ``p_fix``, a resolving episode: half of them ``replace`` (the gold fix)
-> ``test`` -> ``finish`` ("fix"), half first make a wrong edit (another mutation of the same
file that the visible tests catch), ``test`` and ``undo`` it, then the fix ("retry"). Otherwise
three quarters make such a wrong edit, ``test`` and ``finish`` ("wrong"), one quarter give up
(``finish`` after the first test run). So a minority of demos resolve their instance; RL has to
learn which edit is right and to keep trying while the tests fail. Single-line edits use the
line-addressed form (``replace NAME.py LINE`` with the smallest OLD unique in that line:
``fix_edit_in_line``), so the model writes a line number and an operator, not a copied line.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import hashlib
import itertools
import re
from typing import Optional, Sequence

import numpy as np

from sao_jax.data import swebench
from sao_jax.data.swebench import Instance
from sao_jax.envs import swe_lite_gen
from sao_jax.envs.sandbox import SandboxLimits
from sao_jax.envs.swe_lite_modules import MODULES
from sao_jax.envs.tir_math import sandbox_check
from sao_jax.envs.workspace import SandboxBackend, WorkspaceEnv

__all__ = ["KINDS", "SYSTEM", "split_of", "mutants", "make_instances", "demo_actions",
           "make_demo", "make_sft_dataset", "fix_edit", "fix_edit_in_line", "DEMO_KINDS"]

KINDS = ("comparison", "operator", "off_by_one", "missing_edge_case")
DEMO_KINDS = ("fix", "retry", "wrong", "give_up")
SYSTEM = "Fix the bug. Tools: view, test, replace, undo, finish."
EVAL_MODULE_FRACTION = 0.35
_CMP = {"<=": ("<", ">"), ">=": (">", "<"), "<": ("<=", ">"), ">": (">=", "<"), "==": ("!=",),
        "!=": ("==",), "and": ("or",), "or": ("and",)}
_CMP_RE = re.compile(r"<=|>=|==|!=|(?<![<>])<(?![<=])|(?<![<>-])>(?![>=])|\band\b|\bor\b")
_OPS = {"+": ("-", "*"), "-": ("+",), "*": ("+",), "//": ("/",), "%": ("//",)}
_OP_RE = re.compile(r"(?<=\s)(?:[+*%-]|//)(?=\s)")
_INT_RE = re.compile(r"(?<![\w.])\d+(?![\w.])")


def split_of(module: str) -> str:
  """``"eval"`` for about ``EVAL_MODULE_FRACTION`` of module names (stable hash), else
  ``"train"``."""
  h = int.from_bytes(hashlib.blake2b(module.encode(), digest_size=8).digest(), "little")
  return "eval" if (h % 1000) < EVAL_MODULE_FRACTION * 1000 else "train"


def _cases_pass(source: str, name: str, cases) -> list[bool]:
  """Whether each ``(call, expected)`` holds for ``source`` (run here: the package's own code)."""
  ns: dict = {}
  try:
    exec(compile(source, f"{name}.py", "exec"), ns)  # pylint: disable=exec-used
  except Exception:  # pylint: disable=broad-except
    return [False] * len(cases)
  out = []
  for call, expected in cases:
    try:
      out.append(eval(call, dict(ns)) == eval(expected))  # pylint: disable=eval-used
    except Exception:  # pylint: disable=broad-except
      out.append(False)
  return out


def _outcome(source: str, call: str) -> str:
  ns: dict = {}
  try:
    exec(compile(source, "m.py", "exec"), ns)  # pylint: disable=exec-used
    return f"returns {eval(call, ns)!r}"  # pylint: disable=eval-used
  except Exception as e:  # pylint: disable=broad-except
    return f"raises {type(e).__name__}"


def _line_mutations(line: str) -> list[tuple[str, str]]:
  """``(kind, mutated line)`` for every single-site mutation of one code line."""
  out = []
  for kind, regex, table in (("comparison", _CMP_RE, _CMP), ("operator", _OP_RE, _OPS)):
    for m in regex.finditer(line):
      out += [(kind, line[:m.start()] + v + line[m.end():]) for v in table[m.group()]]
  for m in _INT_RE.finditer(line):
    k = int(m.group())
    for v in (k + 1, k - 1):
      if v >= 0:
        out.append(("off_by_one", line[:m.start()] + str(v) + line[m.end():]))
  return out


def mutants(source: str) -> list[tuple[str, str]]:
  """``(kind, mutant source)`` for every single-site mutation of ``source`` (module doc), the
  ``def`` line excluded; duplicates removed, in a fixed order."""
  lines = source.split("\n")
  out, seen = [], {source}
  for i, line in enumerate(lines):
    if line.startswith("def "):
      continue
    for kind, new in _line_mutations(line):
      src = "\n".join(lines[:i] + [new] + lines[i + 1:])
      if src not in seen:
        seen.add(src)
        out.append((kind, src))
    nxt = lines[i + 1] if i + 1 < len(lines) else ""
    indent = len(line) - len(line.lstrip())
    if (line.lstrip().startswith("if ") and line.rstrip().endswith(":")
        and nxt.lstrip().startswith("return") and len(nxt) - len(nxt.lstrip()) > indent):
      src = "\n".join(lines[:i] + lines[i + 2:])
      if src not in seen:
        seen.add(src)
        out.append(("missing_edge_case", src))
  return out


def fix_edit(broken: str, fixed: str) -> tuple[str, str]:
  """``(OLD, NEW)`` for the ``replace`` tool turning ``broken`` into ``fixed``: whole lines, the
  changed ones (a deletion is anchored on the line before), grown until OLD occurs once."""
  a, b = broken.split("\n"), fixed.split("\n")
  ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
         if op[0] != "equal"]
  i1, i2, j1, j2 = ops[0][1], ops[-1][2], ops[0][3], ops[-1][4]
  if i1 == i2:  # an insertion: anchor it on the line before
    i1, j1 = i1 - 1, j1 - 1
  while True:
    old, new = "\n".join(a[i1:i2]), "\n".join(b[j1:j2])
    if broken.count(old) == 1 or (i1 == 0 and i2 == len(a)):
      return old, new
    if i2 < len(a):
      i2, j2 = i2 + 1, j2 + 1
    else:
      i1, j1 = i1 - 1, j1 - 1


_TOKEN_CLASS = (r"\w", r"[<>=!+\-*/%]")


def fix_edit_in_line(broken: str, fixed: str) -> Optional[tuple[int, str, str]]:
  """``(LINE, OLD, NEW)`` for the line-addressed ``replace PATH LINE`` turning ``broken`` into
  ``fixed`` when they differ in one line (else None): the changed characters, widened to whole
  tokens (a word or an operator) and then by one character at a time until OLD occurs once in
  that line. LINE is 1-based. Example: ``"  if x < lo:"`` -> ``"  if x <= lo:"`` gives
  ``(2, "<", "<=")`` (when it is line 2)."""
  a, b = broken.split("\n"), fixed.split("\n")
  if len(a) != len(b):
    return None
  diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
  if len(diff) != 1:
    return None
  i = diff[0]
  x, y = a[i], b[i]
  pre = 0
  while pre < min(len(x), len(y)) and x[pre] == y[pre]:
    pre += 1
  suf = 0
  while suf < min(len(x), len(y)) - pre and x[-1 - suf] == y[-1 - suf]:
    suf += 1
  lo, hi_x, hi_y = pre, len(x) - suf, len(y) - suf  # x[lo:hi_x] -> y[lo:hi_y]
  for cls in _TOKEN_CLASS:  # widen to whole tokens of the changed characters' class
    changed = x[lo:hi_x] + y[lo:hi_y]
    if changed and all(re.fullmatch(cls, c) for c in changed) or not changed and (
        lo > 0 and re.fullmatch(cls, x[lo - 1]) or hi_x < len(x) and re.fullmatch(cls, x[hi_x])):
      while lo > 0 and re.fullmatch(cls, x[lo - 1]):
        lo -= 1
      while hi_x < len(x) and re.fullmatch(cls, x[hi_x]):
        hi_x, hi_y = hi_x + 1, hi_y + 1
      break
  while not x[lo:hi_x] or x.count(x[lo:hi_x]) != 1:
    if lo > 0:
      lo -= 1
    elif hi_x < len(x):
      hi_x, hi_y = hi_x + 1, hi_y + 1
    else:
      break
  return i + 1, x[lo:hi_x], y[lo:hi_y]


def _test_file(name: str, cases) -> str:
  body = "".join(f"\n\ndef test_{k + 1}():\n  assert {call} == {exp}\n"
                 for k, (call, exp) in enumerate(cases))
  return f"from {name} import {name}\n{body}"


def _patch(name: str, broken: str, fixed: str) -> str:
  diff = difflib.unified_diff(broken.splitlines(True), fixed.splitlines(True),
                              f"a/{name}.py", f"b/{name}.py")
  return f"diff --git a/{name}.py b/{name}.py\n" + "".join(diff)


def make_instances(split: str, seed: int = 0, n: Optional[int] = None, generated: int = 0,
                   kinds: Sequence[str] = KINDS) -> list[Instance]:
  """The instances of ``split`` ("train" | "eval") in a ``seed``-shuffled order, the first
  ``n`` (None = all): mutants of the hand-written modules and of ``generated`` modules of
  ``swe_lite_gen.generate`` (``task.swe_generated``), of the mutation ``kinds`` only
  (``task.swe_kinds``, a curriculum). Raises ValueError for a bad split or kind."""
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  bad = [k for k in kinds if k not in KINDS]
  if bad or not kinds:
    raise ValueError(f"task.swe_kinds={tuple(kinds)!r}: each must be one of {KINDS} (at least "
                     "one)")
  out = []
  for name, source, cases in list(MODULES) + swe_lite_gen.generate(generated):
    if split_of(name) != split:
      continue
    if not all(_cases_pass(source, name, cases)):
      raise AssertionError(f"swe_lite module {name}: its own cases fail")
    for k, (kind, broken) in enumerate(mutants(source)):
      if kind not in kinds:
        continue
      ok = _cases_pass(broken, name, cases)
      if all(ok):
        continue  # an equivalent mutant
      ids = [f"tests/test_{name}.py::test_{j + 1}" for j in range(len(cases))]
      first = ok.index(False)
      call, exp = cases[first]
      old, new = fix_edit(broken, source)
      out.append(Instance(
          instance_id=f"swe_lite-{name}-{k:03d}",
          problem_statement=f"{call} {_outcome(broken, call)}, expected {exp}.",
          files={f"{name}.py": broken, f"tests/test_{name}.py": _test_file(name, cases[:-1])},
          fail_to_pass=tuple(i for i, o in zip(ids, ok) if not o),
          pass_to_pass=tuple(i for i, o in zip(ids, ok) if o),
          test_files={f"tests/test_{name}.py": _test_file(name, cases)},
          patch=_patch(name, broken, source),
          meta={"module": name, "kind": kind, "split": split, "fix_old": old, "fix_new": new,
                "cases": [list(c) for c in cases]}))
  order = np.random.default_rng(np.random.SeedSequence([int(seed), 29])).permutation(len(out))
  out = [out[i] for i in order]
  return out if n is None else out[:n]


def _call(tool: str, args: str = "", body: str = "") -> str:
  return f"```{tool}{' ' + args if args else ''}\n{body + chr(10) if body else ''}```\n```output"


def _edit(path: str, broken: str, target: str) -> str:
  """The ``replace`` call turning ``broken`` into ``target``: line-addressed when one line
  changes (``fix_edit_in_line``), else whole lines (``fix_edit``)."""
  one = fix_edit_in_line(broken, target)
  if one is not None:
    line, old, new = one
    return _call("replace", f"{path} {line}", f"{old}\n=======\n{new}")
  old, new = fix_edit(broken, target)
  return _call("replace", path, f"{old}\n=======\n{new}")


def demo_actions(instance: Instance, kind: str, rng: np.random.Generator) -> list[str]:
  """Action texts of one demonstration, ``kind`` one of ``DEMO_KINDS`` (module doc). Raises
  ValueError for another kind."""
  if kind not in DEMO_KINDS:
    raise ValueError(f"demo kind must be one of {DEMO_KINDS}, got {kind!r}")
  name = instance.meta["module"]
  path = f"{name}.py"
  broken = instance.files[path]
  head = [_call("view", path), _call("test")]
  if kind == "give_up":
    return head + [_call("finish")]
  fixed = broken.replace(instance.meta["fix_old"], instance.meta["fix_new"], 1)
  visible = [tuple(c) for c in instance.meta["cases"][:-1]]
  cands = [src for _, src in mutants(broken)
           if src != fixed and not all(_cases_pass(src, name, visible))]
  tries = []
  if kind in ("retry", "wrong") and cands:  # one wrong edit that the visible tests catch
    tries = [_edit(path, broken, cands[int(rng.integers(len(cands)))]), _call("test")]
  if kind == "wrong":
    return head + tries + [_call("finish")]
  fix = [_edit(path, broken, fixed), _call("test"), _call("finish")]
  return head + (tries + [_call("undo", path)] if tries else []) + fix


def make_demo(env: WorkspaceEnv, instance: Instance, actions: Sequence[str]
              ) -> tuple[list[int], list[int], float]:
  """``(token_ids, loss_mask, reward)``: ``actions`` replayed through ``env`` (a
  ``WorkspaceEnv`` holding ``instance``); loss mask 1 on action tokens, 0 on the prompt and the
  observations."""
  tok = env.tokenizer
  problem = next(p for p in env.problems() if p.id == instance.instance_id)
  episode = env.begin_episode(problem)
  try:
    ids = env.prompt_ids(problem)
    mask = [0] * len(ids)
    reward = 0.0
    for turn, action in enumerate(actions):
      a = [int(t) for t in tok.encode(action)]
      st = env.step(episode, turn, a)
      ids += a + list(st.observation_ids)
      mask += [1] * len(a) + [0] * len(st.observation_ids)
      if st.done:
        reward = st.reward
        break
    return ids, mask, reward
  finally:
    env.end_episode(episode)


def make_sft_dataset(env: WorkspaceEnv, instances: Sequence[Instance], p_fix: float, seed: int,
                     num_demos: int = 0, workers: int = 4) -> list[tuple[list[int], list[int]]]:
  """``num_demos`` demonstrations (0 = one per instance), cycling over ``instances`` (module
  doc): a resolving episode w.p. ``p_fix`` ("fix" or "retry", equally likely), else "wrong"
  (3/4) or "give_up" (1/4). Deterministic in
  ``seed``; episodes replayed on ``workers`` threads (each test run is a sandbox process).
  Raises ValueError for ``p_fix`` outside [0, 1]."""
  if not 0.0 <= p_fix <= 1.0:
    raise ValueError(f"sft.p_tool={p_fix} (swe_lite: the fraction of demos that fix the bug) "
                     "must be in [0, 1]")
  rng = np.random.default_rng(seed)
  plans = []
  for inst in itertools.islice(itertools.cycle(instances), num_demos or len(instances)):
    u = rng.random()
    kind = ("fix" if u < p_fix / 2 else "retry" if u < p_fix
            else "wrong" if u < p_fix + 0.75 * (1 - p_fix) else "give_up")
    plans.append((inst, demo_actions(inst, kind, rng)))
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    demos = list(pool.map(lambda p: make_demo(env, *p), plans))
  return [(ids, mask) for ids, mask, _ in demos]


# ---- tasks (sao_jax/envs/registry.py) ---------------------------------------------------------


def _backend(t, cache_size: int = 0) -> SandboxBackend:
  limits = SandboxLimits(cpu_s=t.tool_cpu_s, wall_s=t.tool_wall_s,
                         memory_bytes=t.tool_memory_mb * 2**20)
  return SandboxBackend(limits, test_timeout_s=min(5.0, t.tool_wall_s / 2), cache_size=cache_size)


def _stop(tok) -> tuple:
  return tuple(tok.stop_ids) if getattr(tok, "chat_template", None) else (tok.eos_id,)


def batch_metrics(trajs) -> dict[str, float]:
  """``obs_tokens_mean``: mean observation tokens (``action_mask`` 0 after the first action
  token) per trajectory of a policy step."""
  counts = []
  for t in trajs:
    mask = np.asarray(t.action_mask)
    first = int(np.argmax(mask > 0)) if mask.any() else len(mask)
    counts.append(float((mask[first:] == 0).sum()))
  return {"obs_tokens_mean": float(np.mean(counts)) if counts else 0.0}


def build_task(run, tok):
  """``task.name='swe_lite'``: generated instances (module doc), ``task.n_train`` / ``n_eval``
  of the train / eval modules, ``sft.num_demos`` demonstrations that fix w.p. ``sft.p_tool``
  (cut to ``model.max_seq_len`` tokens). Test runs are cached (the generated tests are
  deterministic)."""
  from sao_jax import tasks  # pylint: disable=import-outside-toplevel  (tasks imports envs)
  t = run.task
  train = make_instances("train", run.seed, t.n_train, t.swe_generated, t.swe_kinds)
  evals = make_instances("eval", run.seed, t.n_eval, t.swe_generated, t.swe_kinds)
  env = WorkspaceEnv(tok, train + evals, max_turns=t.max_turns, backend=_backend(t, 4096),
                     max_output_chars=t.tool_output_chars, system=t.system_prompt or SYSTEM)
  sandbox_check(env.backend.limits)
  demos = None
  if run.sft.num_demos and run.sft.steps:  # a demo longer than the model's context: its prefix
    cap = run.model.max_seq_len
    demos = [(ids[:cap], mask[:cap]) for ids, mask in
             make_sft_dataset(env, train, run.sft.p_tool, run.seed, run.sft.num_demos)]
  problems = env.problems()
  return tasks.Task(tok, env, problems[:len(train)], problems[len(train):], _stop(tok), demos,
                    stop_strings=env.stop_strings, batch_metrics=batch_metrics,
                    grader="hidden tests pass: resolved rate")


def load_source(spec: str, seed: int = 0, n: Optional[int] = None) -> list[Instance]:
  """Instances named by ``spec``: a SWE-bench-format JSONL path (``data/swebench.py``), or
  ``swe_lite:train`` / ``swe_lite:eval`` (the generated ones). Raises ValueError for an empty
  spec, FileNotFoundError for a missing file."""
  if not spec:
    raise ValueError("task.train_file must name the instances for task.name='swe': a "
                     "SWE-bench-format JSONL file (docs/coding.md) or 'swe_lite:train'")
  if spec.startswith("swe_lite:"):
    return make_instances(spec.split(":", 1)[1], seed, n)
  out = swebench.load_instances(spec)
  return out if n is None else out[:n]


def build_swe_task(run, tok):
  """``task.name='swe'``: SWE-bench-format instances from ``task.train_file`` /
  ``task.eval_file`` (``load_source``; '' eval = the last ``task.n_eval`` of train) in the
  workspace environment with the full ``workspace.INSTRUCTION``; no demonstrations (start from a
  checkpoint). Tests run in the sandbox backend, uncached."""
  from sao_jax import tasks  # pylint: disable=import-outside-toplevel
  t = run.task
  train = load_source(t.train_file, run.seed, t.n_train)
  evals = (load_source(t.eval_file, run.seed, t.n_eval) if t.eval_file
           else train[-t.n_eval:])
  if not t.eval_file:
    train = train[:-t.n_eval] or train
  by_id = {i.instance_id: i for i in train + evals}
  env = WorkspaceEnv(tok, list(by_id.values()), max_turns=t.max_turns, backend=_backend(t),
                     max_output_chars=t.tool_output_chars, system=t.system_prompt or None)
  sandbox_check(env.backend.limits)
  problems = {p.id: p for p in env.problems()}
  return tasks.Task(tok, env, [problems[i.instance_id] for i in train],
                    [problems[i.instance_id] for i in evals], _stop(tok), None,
                    stop_strings=env.stop_strings, batch_metrics=batch_metrics,
                    grader="hidden tests pass: resolved rate")
