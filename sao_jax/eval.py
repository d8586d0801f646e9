r"""pass@1 / pass@k of a checkpoint on a benchmark file, with n samples per problem.

    python -m sao_jax.eval --config=configs/aime.py --checkpoint=runs/aime/checkpoints \
        --benchmark=../shared/data/aime25.jsonl --n=16 --k=1,4,16

Each problem is rolled out ``n`` times through the same JetStream engine the trainer uses
(``sao_jax/rollout/worker.py:generate_trajectories``; temperature 1.0 and top-p 1.0 by default,
the paper's evaluation setting) and graded by the environment (math-verify on the last
``\boxed{}``). ``--responses=FILE.jsonl`` grades given responses instead of sampling
(``{"id": <problem id>, "response": <text>}`` per line, n lines per problem): useful for outputs
of another system, and how the estimator is tested against analytic values.

Reported per k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Eq. 1):

    pass@k_i = 1 - C(n_i - c_i, k) / C(n_i, k)          (unbiased; c_i correct of n_i samples)
    mean     = (1/P) sum_i pass@k_i
    stderr   = std_i(pass@k_i, ddof=1) / sqrt(P)         (standard error over the P problems)

and for pass@1 also ``stderr_runs``: the standard error of the mean accuracy over the n sample
"runs" (run j = the j-th sample of every problem), std_j(acc_j, ddof=1) / sqrt(n) -- the
"mean +- s.e. over 16 samples" convention of the paper's tables. A sample is correct when its
reward is > 0.5 (rewards are 0 / 1).

The paper's protocol (``--protocol=paper``): AIME 2025, HMMT Feb 2025, BeyondAIME and
IMO-AnswerBench (``sao_jax/data/split.py:PAPER_BENCHMARKS``), mean accuracy (pass@1) over 16
samples per problem (4 for BeyondAIME) at temperature 1.0 and top-p 1.0, each sample a full
multi-turn episode of the config's environment (with ``configs/aime.py``: the policy writes
Python, the sandbox runs it, up to ``task.max_turns`` turns), printed as one table row per
benchmark with both standard errors and the mean tool calls and turns per sample::

    python -m sao_jax.eval --config=configs/aime.py --config.model.checkpoint_dir=/path/to/hf \
        --protocol=paper

``--n`` (samples) and ``--limit`` (problems per benchmark) shrink it for a quick check (the
header then says it is not the full protocol); ``--benchmarks=aime25,beyondaime`` picks some.

Benchmark files: JSONL ``{"id", "problem", "answer"}`` (AIME, MATH-500, GSM8K, ... in
``../shared/data/``); a bare name such as ``aime25.jsonl`` means the copy packaged in
``sao_jax/data/files``. Without ``--benchmark`` the config's own held-out problems are used.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Optional, Sequence

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from sao_jax import build, configs, pretrained, roles
from sao_jax.data.jsonl import read_jsonl
from sao_jax.envs.grading import grade
from flax import nnx
from sao_jax.models.transformer import Transformer
from sao_jax.rollout.sync import WeightStore
from sao_jax.rollout.worker import RolloutWorker
from sao_jax.train.checkpoint import load_policy_params
from sao_jax.data import jsonl
from sao_jax import tasks
from sao_jax.envs.math_env import MathEnv
from sao_jax.rollout.worker import env_workers_for
from sao_jax.data import split

FLAGS = flags.FLAGS


# ---- estimators (pure) ---------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k for one problem: 1 - C(n - c, k) / C(n, k).

  Computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i) (no big binomials). Chen et al. 2021,
  Eq. 1 and its numerically stable form.

  Args: n samples (>= 1), c correct (0 <= c <= n), k (1 <= k <= n); python ints.
  Returns: float in [0, 1]; exactly 1.0 when n - c < k, c / n when k = 1.
  Raises ValueError when the arguments are outside those ranges.
  """
  if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, "
                     f"k={k}. Use k values no larger than --n.")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def default_ks(n: int) -> list[int]:
  """1, 2, 4, ... below n, then n: ``default_ks(16) == [1, 2, 4, 8, 16]``."""
  ks, k = [], 1
  while k < n:
    ks.append(k)
    k *= 2
  return ks + [n]


def summarize(outcomes: dict[str, Sequence[bool]], ks: Sequence[int]) -> dict:
  """pass@k statistics from per-problem sample outcomes.

  Args:
    outcomes: problem id -> list of n booleans (sample j correct); every problem must have the
      same n (the run estimate needs aligned samples).
    ks: k values, each 1 <= k <= n.
  Returns:
    ``{"problems": P, "n": n, "pass@k": {"mean", "stderr"}, ..., "pass@1": {..., "stderr_runs"},
    "per_problem": {id: {"n", "correct"}}}``. stderr is 0.0 when P == 1; stderr_runs 0.0
    when n == 1.
  Raises ValueError on no problems or unequal sample counts (naming a problem).
  """
  if not outcomes:
    raise ValueError("no problems to evaluate.")
  ns = {pid: len(v) for pid, v in outcomes.items()}
  n = next(iter(ns.values()))
  bad = [pid for pid, m in ns.items() if m != n]
  if bad:
    raise ValueError(f"problem {bad[0]!r} has {ns[bad[0]]} samples, others {n}: every problem "
                     "needs the same number of samples.")
  ids = list(outcomes)
  corr = np.array([[bool(x) for x in outcomes[i]] for i in ids], dtype=bool)  # [P, n]
  p = len(ids)
  out = {"problems": p, "n": n,
         "per_problem": {i: {"n": n, "correct": int(corr[j].sum())} for j, i in enumerate(ids)}}
  for k in ks:
    est = np.array([pass_at_k(n, int(c), int(k)) for c in corr.sum(axis=1)])
    se = float(est.std(ddof=1) / math.sqrt(p)) if p > 1 else 0.0
    out[f"pass@{k}"] = {"mean": float(est.mean()), "stderr": se}
  if 1 in ks:
    runs = corr.mean(axis=0)  # accuracy of sample j over the problems, [n]
    out["pass@1"]["stderr_runs"] = float(runs.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
  return out


def evaluate_pass_at_k(problems: Sequence, rollout: Callable[[list], list], n: int,
                       ks: Sequence[int]) -> dict:
  """Rolls every problem out ``n`` times with ``rollout`` and summarises pass@k.

  ``rollout(list_of_problems) -> list of (problem_id, reward)`` receives the problems repeated
  (problem i appears n times) and may return them in any order; the j-th returned sample of a
  problem is its sample j. Raises ValueError if a problem comes back with fewer/more than n
  samples or ``ks`` has a k > n."""
  if n < 1:
    raise ValueError(f"--n must be >= 1, got {n}.")
  if any(not 1 <= k <= n for k in ks):
    raise ValueError(f"--k values {list(ks)} must lie in [1, n={n}].")
  expanded = [p for p in problems for _ in range(n)]
  results = rollout(expanded)
  outcomes: dict[str, list[bool]] = {str(p.id): [] for p in problems}
  for pid, reward in results:
    if str(pid) not in outcomes:
      raise ValueError(f"rollout returned an unknown problem id {pid!r}.")
    outcomes[str(pid)].append(float(reward) > 0.5)
  for pid, v in outcomes.items():
    if len(v) != n:
      raise ValueError(f"problem {pid!r} got {len(v)} samples, expected n={n}.")
  return summarize(outcomes, ks)


# ---- sampling backends ---------------------------------------------------------------------------
def responses_rollout(path: str, problems: Sequence) -> Callable[[list], list]:
  """A rollout that grades responses from ``path`` (JSONL ``{"id", "response"}``) with
  ``sao_jax.envs.grading.grade``; sample j of a problem is its j-th line in the file."""
  answers = {str(p.id): p.answer for p in problems}
  rows = read_jsonl(path, required=("id", "response"))

  def rollout(expanded):
    del expanded
    out = []
    for r in rows:
      pid = str(r["id"])
      if pid not in answers:
        raise ValueError(f"{path}: response for id {pid!r}, which is not in the benchmark.")
      out.append((pid, grade(str(r["response"]), answers[pid])))
    return out
  return rollout


def engine_rollout(run: roles.Run, params, mcfg, task, *, temperature: float,
                   max_new_tokens: int, seed: int, env=None, env_workers: int = 0,
                   trajectories: Optional[list] = None) -> Callable[[list], list]:
  """A rollout through ``SAOEngine`` + ``RolloutWorker`` (the trainer's engine path, built by
  ``build.make_engine`` with ``run.eval.slots`` slots).

  ``task`` (``sao_jax.tasks.Task``) gives the tokenizer, stop ids and stop strings; ``env``
  (default the task's eval env) answers every turn -- multi-turn with the sandboxed tool for
  ``tir_math``, ``env_workers`` threads running ``env.step`` off the decode loop. Finished
  ``Trajectory`` objects are appended to ``trajectories`` when given (turns, tool calls)."""
  env = env if env is not None else (task.eval_env if task.eval_env is not None else task.env)
  engine = build.make_engine(run, mcfg, build.graphdef_of(mcfg), task.tokenizer,
                             slots=run.eval.slots, temperature=temperature, seed=seed)
  weights = WeightStore(params, 0)

  def rollout(expanded):
    out: list = []
    worker = RolloutWorker(engine, env, iter(expanded), lambda t: out.append(t) or True, weights,
                           stop_ids=task.stop_ids, stop_strings=task.stop_strings,
                           max_new_tokens=max_new_tokens, max_seq_len=run.model.max_seq_len,
                           temperature=temperature, seed=seed, env_workers=env_workers)
    worker.run()
    if trajectories is not None:
      trajectories.extend(out)
    return [(t.problem_id, t.reward) for t in out]
  return rollout


WARM_START = "warm_start"  # --checkpoint value: the SFT warm start (sft.cache_dir)


def load_params(run: roles.Run, checkpoint: str, vocab_size: int, task=None):
  """``(ModelConfig, policy params)`` of ``run.model``: a Hugging Face folder / GGUF
  (``model.checkpoint_dir`` / ``model.gguf``, shapes from the checkpoint), an orbax
  ``checkpoint`` written by ``sao_jax.main``, ``checkpoint="warm_start"``: the SFT warm start of
  ``task`` that ``sao_jax.main`` starts RL from (``build.build_policy``: loaded from
  ``sft.cache_dir`` when cached there, else trained now), or random init when there is none and
  the config allows it. Raises ValueError naming the flag to set."""
  if checkpoint == WARM_START:
    if task is None or not task.sft_demos:
      raise ValueError("--checkpoint=warm_start: this task has no SFT demonstrations to warm "
                       "start from; pass an orbax checkpoint folder instead.")
    policy = build.build_policy(run, task)
    return policy.mcfg, policy.params
  if not checkpoint or checkpoint == run.model.checkpoint_dir:
    loaded = pretrained.load_model(run.model)
    if loaded:
      return loaded
  mcfg = pretrained.model_config(run.model, vocab_size)
  params = nnx.to_pure_dict(nnx.split(Transformer(mcfg, rngs=nnx.Rngs(run.seed)))[1])
  if checkpoint:
    return mcfg, load_policy_params(checkpoint, params)
  if not run.allow_random_init:
    raise ValueError("no checkpoint: pass --checkpoint=<run_dir>/checkpoints (a folder written "
                     "by `python -m sao_jax.main`) or --config.model.checkpoint_dir=<HF folder>.")
  print("warning: no --checkpoint, evaluating a RANDOMLY initialised model", flush=True)
  return mcfg, params


def format_table(summary: dict, ks: Sequence[int]) -> str:
  """The printed result table (percentages)."""
  lines = [f"{'metric':10s}{'mean':>10s}{'± s.e.':>10s}{'± s.e. (runs)':>16s}"]
  for k in ks:
    s = summary[f"pass@{k}"]
    runs = f"{100 * s['stderr_runs']:.2f}" if "stderr_runs" in s else ""
    lines.append(f"{'pass@' + str(k):10s}{100 * s['mean']:>9.2f}%{100 * s['stderr']:>10.2f}"
                 f"{runs:>16s}")
  return "\n".join(lines)


def format_protocol_table(rows: Sequence[dict]) -> str:
  """The paper-style per-benchmark table: one row per benchmark (percentages).

  ``rows``: dicts with ``title``, ``problems``, ``n``, ``pass@1`` (``mean``, ``stderr``,
  ``stderr_runs``) and optional ``tool_calls`` / ``turns`` (means per sample)."""
  head = (f"{'benchmark':18s}{'problems':>9s}{'samples':>9s}{'mean acc':>10s}{'± s.e.':>9s}"
          f"{'± s.e. runs':>13s}{'tool calls':>12s}{'turns':>7s}")
  lines = [head, "-" * len(head)]
  for r in rows:
    s = r["pass@1"]
    tools = f"{r['tool_calls']:.2f}" if "tool_calls" in r else ""
    turns = f"{r['turns']:.2f}" if "turns" in r else ""
    lines.append(f"{r['title']:18s}{r['problems']:>9d}{r['n']:>9d}{100 * s['mean']:>9.2f}%"
                 f"{100 * s['stderr']:>9.2f}{100 * s.get('stderr_runs', 0.0):>13.2f}"
                 f"{tools:>12s}{turns:>7s}")
  return "\n".join(lines)


def _benchmark_path(name: str) -> str:
  return name if os.path.exists(name) or os.sep in name else jsonl.packaged_path(name)


def main(argv):
  del argv
  if FLAGS.config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/arith_tool.py")
  config = roles.from_config(FLAGS.config)  # the top: converted once, typed roles below
  if FLAGS.top_p != 1.0:
    raise app.UsageError("--top_p: only 1.0 is supported (the engine samples the full "
                         "distribution so that its log-probs are the ones DIS needs).")
  if FLAGS.protocol not in ("", "paper"):
    raise app.UsageError(f"--protocol={FLAGS.protocol!r}: use '' or 'paper'.")
  if FLAGS.protocol == "paper":
    if FLAGS.temperature != 1.0:
      raise app.UsageError("--protocol=paper samples at temperature 1.0 and top-p 1.0; drop "
                           "--temperature.")
    if FLAGS.benchmark or FLAGS.responses:
      raise app.UsageError("--protocol=paper evaluates its own benchmarks; drop --benchmark / "
                           "--responses.")
    return _main_protocol(config)
  ks = [int(k) for k in FLAGS.k] if FLAGS.k else default_ks(FLAGS.n)
  if FLAGS.n < 1 or any(not 1 <= k <= FLAGS.n for k in ks):
    raise app.UsageError(f"--k={ks} and --n={FLAGS.n}: need n >= 1 and every k in [1, n].")
  task = None if FLAGS.responses else tasks.make_task(config)
  env = None
  if FLAGS.benchmark:
    path = _benchmark_path(FLAGS.benchmark)
    problems = jsonl.load_math_problems(path)
    name = os.path.splitext(os.path.basename(path))[0]
    if task is not None and config.task.name not in ("math", "tir_math"):
      env = MathEnv(task.tokenizer)  # a math benchmark under a non-math task: boxed answer
      task.stop_ids, task.stop_strings = (task.tokenizer.eos_id,), ()
  else:
    task = task or tasks.make_task(config)
    problems = task.eval_problems
    name = f"{config.task.name}_heldout"
  if FLAGS.limit:
    problems = problems[:FLAGS.limit]
  checkpoint = FLAGS.checkpoint or config.model.checkpoint_dir
  t0 = time.time()
  if FLAGS.responses:
    rollout = responses_rollout(FLAGS.responses, problems)
    source = f"responses {FLAGS.responses}"
  else:
    mcfg, params = load_params(config, checkpoint, task.tokenizer.vocab_size, task)
    rollout = engine_rollout(config, params, mcfg, task, temperature=FLAGS.temperature,
                             max_new_tokens=FLAGS.max_new_tokens or config.rollout.max_new_tokens,
                             seed=FLAGS.seed, env=env, env_workers=env_workers_for(config))
    source = f"checkpoint {checkpoint or '(random init)'}"
  summary = evaluate_pass_at_k(problems, rollout, FLAGS.n, ks)
  summary.update(benchmark=name, source=source, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                 wall_s=time.time() - t0)
  print(f"\n{name}: {summary['problems']} problems x {FLAGS.n} samples, {source}, "
        f"temperature {FLAGS.temperature}, top-p {FLAGS.top_p} ({summary['wall_s']:.0f}s)")
  print(format_table(summary, ks))
  _write(summary, FLAGS.out or _default_out(config, checkpoint, f"{name}.json"))


def _default_out(config, checkpoint: str, filename: str) -> str:
  if checkpoint == WARM_START:
    return os.path.join(config.run_dir, "eval", f"{WARM_START}_{filename}")
  base = (os.path.dirname(os.path.normpath(checkpoint))
          if checkpoint and not os.path.isfile(os.path.join(checkpoint, "config.json"))
          else config.run_dir)
  return os.path.join(base, "eval", filename)


def _write(summary: dict, out: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  print(f"results: {out}", flush=True)


def _main_protocol(config: roles.Run) -> None:
  """The paper's evaluation: every benchmark of ``split.PAPER_BENCHMARKS`` (or ``--benchmarks``)
  with its own sample count (16; BeyondAIME 4), temperature 1.0, top-p 1.0, multi-turn with the
  config's environment (the Python tool for ``configs/aime.py``); prints the table."""
  benches = {b.name: b for b in split.PAPER_BENCHMARKS}
  names = FLAGS.benchmarks or list(benches)
  unknown = [b for b in names if b not in benches]
  if unknown:
    raise app.UsageError(f"--benchmarks: unknown {unknown}; use some of {list(benches)}.")
  n_override = FLAGS.n if FLAGS["n"].present else 0
  task = tasks.make_task(config)
  checkpoint = FLAGS.checkpoint or config.model.checkpoint_dir
  mcfg, params = load_params(config, checkpoint, task.tokenizer.vocab_size, task)
  trajs: list = []
  rollout = engine_rollout(config, params, mcfg, task, temperature=1.0,
                           max_new_tokens=FLAGS.max_new_tokens or config.rollout.max_new_tokens,
                           seed=FLAGS.seed, env_workers=env_workers_for(config),
                           trajectories=trajs)
  source = f"checkpoint {checkpoint or '(random init)'}"
  rows, t0 = [], time.time()
  for name in names:
    b = benches[name]
    problems = split.load_files([b.file])
    if FLAGS.limit:
      problems = problems[:FLAGS.limit]
    n = n_override or b.samples
    del trajs[:]
    t1 = time.time()
    summary = evaluate_pass_at_k(problems, rollout, n, [1])
    summary.update(benchmark=name, title=b.title, source=source, temperature=1.0, top_p=1.0,
                   protocol_samples=b.samples, wall_s=time.time() - t1,
                   tool_calls=float(np.mean([t.info.get("tool_calls", 0) for t in trajs])),
                   turns=float(np.mean([t.num_turns for t in trajs])))
    rows.append(summary)
  note = "" if not (n_override or FLAGS.limit) else (
      " -- NOT the full protocol:" + (f" --n={n_override}" if n_override else "")
      + (f" --limit={FLAGS.limit}" if FLAGS.limit else ""))
  print(f"\nPaper protocol: mean accuracy over samples per problem, temperature 1.0, top-p 1.0, "
        f"{config.task.name} (max {config.task.max_turns} turns), {source} "
        f"({time.time() - t0:.0f}s){note}")
  print(format_protocol_table(rows))
  _write({"protocol": "paper", "source": source, "benchmarks": rows},
         FLAGS.out or _default_out(config, checkpoint, "paper_protocol.json"))


def define_flags() -> None:
  """Defines the CLI flags (only when run as a program, so importing this module for its
  functions never clashes with ``sao_jax.main``'s ``--config``)."""
  config_flags.DEFINE_config_file("config", None, "ml_collections config file (model shape, task, "
                                  "rollout settings), e.g. configs/aime.py.", lock_config=False)
  flags.DEFINE_string("checkpoint", "", "sao_jax orbax checkpoint folder (<run_dir>/checkpoints); "
                      "'' uses the config's model.checkpoint_dir; 'warm_start': the SFT warm "
                      "start RL begins from (from --config.sft.cache_dir when cached there).")
  flags.DEFINE_string("benchmark", "", "JSONL benchmark file (or packaged name); '' = the config's "
                      "held-out problems.")
  flags.DEFINE_integer("n", 16, "samples per problem (paper: 16).")
  flags.DEFINE_list("k", [], "k values of pass@k (each <= n); default: 1, 2, 4, ... up to n.")
  flags.DEFINE_float("temperature", 1.0, "sampling temperature (paper: 1.0; 0 = greedy).")
  flags.DEFINE_float("top_p", 1.0, "nucleus top-p; only 1.0 (the full distribution) is supported.")
  flags.DEFINE_integer("max_new_tokens", 0,
                       "per-turn token cap; 0 = config.rollout.max_new_tokens.")
  flags.DEFINE_integer("limit", 0, "evaluate only the first LIMIT problems (0 = all).")
  flags.DEFINE_integer("seed", 0, "sampling seed.")
  flags.DEFINE_string("responses", "", "grade these responses instead of sampling: JSONL with "
                      "{'id', 'response'} per sample.")
  flags.DEFINE_string("out", "",
                      "result JSON path; default <checkpoint or run_dir>/eval/<name>.json.")
  flags.DEFINE_string("protocol", "", "'paper': the paper's evaluation (AIME 2025, HMMT Feb 2025, "
                      "BeyondAIME, IMO-AnswerBench; 16 samples, 4 for BeyondAIME; temperature "
                      "1.0, top-p 1.0) and its per-benchmark table; --n / --limit shrink it.")
  flags.DEFINE_list("benchmarks", [], "with --protocol=paper: a subset of aime25, hmmt_feb25, "
                    "beyondaime, imo_answerbench (default all).")


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=configs.parse_flags)
