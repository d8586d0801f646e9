"""SAO on the chained tool-use task (sao_jax/envs/chain_tool.py): 3-5 calculator calls per problem.

A task in which the critic has something to learn: the reward is binary and final, but the chain's
length (in the prompt) and every tool observation reveal how likely success is. Derived from
`configs/arith_tool.py`; only what differs is set here. Seed 0, these defaults (2026-12-01 16:30
UTC, load ~3-5, `sft.cache_dir` warm): warm start 11.5% greedy on 200 held-out problems, 60 SAO
steps -> 50.0% (+38.5 pts; 50% at step 20), explained variance 0.61 mean over the last 10 steps
(0.24-0.82 over the last 20), 265 s wall.
`python -m sao_jax.main --config=configs/chain_tool.py [--config.sft.cache_dir=runs/sft_cache]`;
variant `configs/chain_tool.py:smoke` runs a few steps only; `:long_obs` pads every tool output with
100 noise characters (experiments/ablations.py's naive-GAE cell).
"""

import ml_collections

from sao_jax import configs



def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = configs.load("arith_tool")
  c.run_dir = "runs/chain_tool"
  c.task.name = "chain_tool"
  c.task.chain_lengths = (3, 4, 5)        # calculator calls a problem needs
  c.task.chain_weights = (0.2, 0.5, 0.3)  # their probabilities (warm start solves ~ 3-call ones)
  c.task.max_turns = 7                    # max(chain_lengths) calls + answer + one spare turn

  c.model.max_seq_len = 160               # longest correct 5-call episode is ~140 tokens
  c.rollout.max_new_tokens = 20           # per turn: "<tool>99999-999</tool>" is 11 tokens

  c.sft.steps = 600                       # (batch 32: ~5 epochs of the 4000 demonstrations)
  c.sft.batch_size = 32
  c.sft.p_tool = 0.3                      # the demonstrator's chance of each call past the 3rd
  c.sft.reliable_calls = 3                # calls every demonstration makes (if the chain has them)

  c.train.critic_warmup_steps = 10        # value pre-training on warm-start rollouts (10 x 32)
  c.train.num_steps = 60                  # policy steps (most of the gain comes by step 20)

  if variant == "long_obs":               # tool outputs of 100+ tokens (naive-GAE ablation)
    c.task.obs_pad = 100                  # <obs> + 100 noise chars + =RESULT</obs>: ~108 tokens
    c.model.max_seq_len = 160 + 5 * 104   # 5 calls' padding on top of the plain episode
    c.rollout.max_prefill_length = 160    # one padded observation (<= 132 tokens) per chunk
    c.run_dir = "runs/chain_tool_long_obs"
  elif variant == "smoke":                # a wiring check (tiny model, 2 steps), not a result
    c.task.n_train, c.task.n_eval = 64, 8
    c.model.d_model, c.model.n_layers, c.model.d_ff = 32, 1, 64
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 2, 1, 16
    c.sft.steps, c.sft.num_demos = 10, 64
    c.rollout.slots, c.eval.slots = 8, 8
    c.train.num_steps, c.train.batch_size = 2, 8
    c.train.critic_warmup_steps = 2
    c.eval.every_steps, c.checkpoint.every_steps = 0, 0
    c.run_dir = "runs/chain_tool_smoke"
    c.rollout.kv_bucket = c.model.max_seq_len  # fewest compiles (a wiring check): one decode
    c.rollout.prefill_rows = "all"             # program per shape, one prefill per length
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/chain_tool.py; use '', 'long_obs' "
                     "or 'smoke'.")
  return c
