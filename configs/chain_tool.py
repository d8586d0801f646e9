"""SAO on the chained tool-use task (sao_jax/envs/chain_tool.py): 3-4 calculator calls per problem.

A task in which the critic has something to learn: the reward is binary and final, but every tool
observation reveals progress. Derived from `configs/arith_tool.py`; only what differs is set here.
`python -m sao_jax.main --config=configs/chain_tool.py [--config.sft.cache_dir=runs/sft_cache]`;
variant `configs/chain_tool.py:smoke` runs a few steps only.
"""

import ml_collections

from sao_jax import configs



def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = configs.load("arith_tool")
  c.run_dir = "runs/chain_tool"
  c.task.name = "chain_tool"
  c.task.chain_lengths = (3, 4)           # calculator calls a problem needs
  c.task.chain_weights = (0.12, 0.88)     # their probabilities (greedy warm start ~ 12% x 0.8)
  c.task.max_turns = 6                    # max(chain_lengths) calls + answer + one spare turn

  c.model.max_seq_len = 128               # longest correct 4-call episode is ~110 tokens
  c.rollout.max_new_tokens = 20           # per turn: "<tool>99999-999</tool>" is 11 tokens

  c.sft.steps = 600                       # (batch 32: ~5 epochs of the 4000 demonstrations)
  c.sft.batch_size = 32
  c.sft.p_tool = 0.3                      # the demonstrator's chance of each call past the 3rd
  c.sft.reliable_calls = 3                # calls every demonstration makes (if the chain has them)

  if variant == "smoke":                  # a wiring check (tiny model, 2 steps), not a result
    c.task.n_train, c.task.n_eval = 64, 8
    c.model.d_model, c.model.n_layers, c.model.d_ff = 32, 1, 64
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 2, 1, 16
    c.sft.steps, c.sft.num_demos = 10, 64
    c.rollout.slots, c.eval.slots = 8, 8
    c.train.num_steps, c.train.batch_size = 2, 8
    c.eval.every_steps, c.checkpoint.every_steps = 0, 0
    c.run_dir = "runs/chain_tool_smoke"
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/chain_tool.py; use '' or 'smoke'.")
  return c
