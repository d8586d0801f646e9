r"""What SAO taught SmolLM2-135M-Instruct on `configs/smollm2_arith.py`: greedy held-out
responses of the base model and of a run's final checkpoint, split into format and arithmetic.

    python benchmarks/smollm2_arith_responses.py --which=base,trained \
        [--run runs/smollm2_arith] [--out benchmarks/results/smollm2_arith_responses]

For each policy (``base``: the packaged GGUF; ``trained``: ``<run>/checkpoints``, latest step)
it decodes the config's held-out problems greedily with the trainer's engine and env and writes
``<out>/<which>.jsonl`` (id, prompt, answer, reward, response) and ``<out>/summary.json``:

* ``accuracy``: the reward (a right number in the last ``\boxed{}``), as in the run's eval;
* ``boxed``: share of responses with a ``\boxed{...}`` holding a number (the format);
* ``last_number_correct``: the last number in the response equals the answer, boxed or not
  (the arithmetic, whatever the format);
* ``mean_response_tokens`` and ``truncated`` (no stop token within ``rollout.max_new_tokens``).

Raises FileNotFoundError when ``trained`` is asked for and the run has no checkpoint.
"""

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from sao_jax import build, configs, roles, tasks  # noqa: E402
from sao_jax.train.checkpoint import load_policy_params  # noqa: E402

_BOXED_NUM = re.compile(r"\\boxed\{\s*-?\d+\s*\}")


def last_number(text: str):
  """The last integer in ``text`` as a string, or None."""
  nums = re.findall(r"-?\d+", text)
  return nums[-1] if nums else None


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--which", default="base,trained")
  ap.add_argument("--run", default="runs/smollm2_arith")
  ap.add_argument("--out", default="benchmarks/results/smollm2_arith_responses")
  args = ap.parse_args()
  config = roles.from_config(configs.load("smollm2_arith"))
  task = tasks.make_task(config)
  policy = build.build_policy(config, task)
  engine = build.make_engine(config, policy.mcfg, policy.graphdef, task.tokenizer,
                             slots=config.eval.slots, temperature=0.0)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "summary.json")
  summary = json.load(open(path)) if os.path.isfile(path) else {}
  by_id = {p.id: p for p in task.eval_problems}
  for which in args.which.split(","):
    params = policy.params
    if which == "trained":
      params = load_policy_params(os.path.join(args.run, "checkpoints"), policy.params)
    ev = build.evaluate(engine, task, params, task.eval_problems, config)
    rows = []
    for t in ev["trajectories"]:
      p = by_id[t.problem_id]
      text = task.tokenizer.decode(t.tokens[t.action_mask > 0], skip_special=True)
      rows.append({"id": p.id, "prompt": p.prompt, "answer": p.answer, "reward": t.reward,
                   "boxed": bool(_BOXED_NUM.search(text)),
                   "last_number_correct": last_number(text) == p.answer,
                   "truncated": bool(t.truncated), "response": text})
    rows.sort(key=lambda r: r["id"])
    with open(os.path.join(args.out, f"{which}.jsonl"), "w") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
    summary[which] = {"n": len(rows), "accuracy": float(np.mean([r["reward"] for r in rows])),
                      "boxed": float(np.mean([r["boxed"] for r in rows])),
                      "last_number_correct": float(np.mean([r["last_number_correct"]
                                                            for r in rows])),
                      "truncated": float(np.mean([r["truncated"] for r in rows])),
                      "mean_response_tokens": ev["response_tokens"]}
    print(which, json.dumps(summary[which]), flush=True)
  with open(path, "w") as f:
    json.dump(summary, f, indent=2)


if __name__ == "__main__":
  main()
