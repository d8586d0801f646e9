"""Train steps (DIS policy step, critic step): sao_jax (JAX) vs a PyTorch + transformers peer.

    python benchmarks/bench_train_step.py [--quick] [--json out.json]

Peer: ``transformers.Qwen3ForCausalLM`` on the same weights (written by
``sao_jax.models.hf.save_hf_checkpoint`` and read back with ``from_pretrained``), the same DIS
loss (ratio band mask, token mean), global-norm clipping and AdamW; the critic peer is
``Qwen3Model`` + a linear value head, squared error on action tokens, attention parameters
frozen (``requires_grad=False``, like our ``optax.set_to_zero`` partition). Tunix's PPO learner
is not used: Tunix is not installed in this environment (and its learner wraps the same
JAX/Flax NNX step we benchmark, so it would not be an independent peer on CPU).

Reports tokens/s (B*T per step), the ratio ours/peer, model FLOP utilisation against a
``jnp.dot`` peak measured in the same run, compile time of each jitted step, and the jit cache
size after all repeats (1 = no recompilation).

Like the main job (``sao_jax.main``), the process first calls
``sao_jax.host_malloc.keep_freed_memory()`` (glibc keeps XLA:CPU's per-call temp buffers for
reuse instead of page-faulting them in on every step; it applies to the torch peer in the same
process too); ``--glibc_malloc_defaults`` skips it.
"""

from __future__ import annotations

import tempfile
import time

import common  # pylint: disable=import-error
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import hf
from sao_jax.models.transformer import Critic, ModelConfig, Transformer, default_positions
from sao_jax.train.batch import Batch
from sao_jax.train import steps

CONFIGS = {
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=128, max_seq_len=256, arch="qwen3"),
    "small": ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                         head_dim=32, d_ff=768, max_seq_len=512, arch="qwen3"),
}
EPS_LOW, EPS_HIGH, LR = 0.3, 5.0, 1e-5


def matmul_params(cfg: ModelConfig) -> int:
  """Parameters that take part in matmuls per token (attention + MLP + LM head)."""
  attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  mlp = 3 * cfg.d_model * cfg.d_ff
  return cfg.n_layers * (attn + mlp) + cfg.d_model * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq: int, head: bool = True) -> float:
  """PaLM-style estimate (Chowdhery et al. 2022, App. B): 6 N + 12 L H Q T FLOP per token for
  forward + backward (N = matmul params; the critic has no LM head but a d_model head)."""
  n = matmul_params(cfg) - (0 if head else cfg.d_model * cfg.vocab_size)
  return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq


def make_batch(cfg, b, t, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  mask = (rng.random((b, t)) > 0.3).astype(np.float32)
  mask[:, : t // 8] = 0.0  # prompt
  return {"tokens": tokens, "action_mask": mask,
          "rollout_logprobs": (-np.abs(rng.standard_normal((b, t))) - 5.0).astype(np.float32),
          "advantages": rng.standard_normal((b, t)).astype(np.float32),
          "returns": rng.standard_normal((b, t)).astype(np.float32),
          "values": np.zeros((b, t), np.float32)}


# ---- the PyTorch peer ----------------------------------------------------------------------
def torch_steps(path, cfg, batch):
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  policy = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
  policy.train()
  backbone = transformers.Qwen3Model.from_pretrained(path, dtype=torch.float32)
  head = torch.nn.Linear(cfg.d_model, 1)
  for name, p in backbone.named_parameters():
    if ".self_attn." in name:
      p.requires_grad_(False)
  p_opt = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
  c_params = [p for p in list(backbone.parameters()) + list(head.parameters()) if p.requires_grad]
  c_opt = torch.optim.AdamW(c_params, lr=LR, weight_decay=0.0)
  tb = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()}
  tokens = tb["tokens"].long()
  mask = tb["action_mask"]

  def policy_step():
    logits = policy(input_ids=tokens).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))
    log_ratio = torch.where(mask > 0, logp - tb["rollout_logprobs"], 0.0).clamp(-20, 20)
    ratio = log_ratio.exp()
    keep = (mask > 0) & (ratio > 1 - EPS_LOW) & (ratio < 1 + EPS_HIGH)
    loss = -(ratio * tb["advantages"] * keep).sum() / mask.sum().clamp(min=1.0)
    p_opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    p_opt.step()
    return loss.detach()

  def critic_step():
    h = backbone(input_ids=tokens).last_hidden_state
    values = torch.nn.functional.pad(head(h)[..., 0][:, :-1], (1, 0))
    loss = ((values - tb["returns"]) ** 2 * mask).sum() / mask.sum().clamp(min=1.0)
    c_opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(c_params, 1.0)
    c_opt.step()
    return loss.detach()

  return policy_step, critic_step


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--configs", default="tiny,small")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--torch_threads", type=int, default=1,
                  help="torch intra-op threads; 1 is the fastest on a loaded 2-core host "
                       "(2 threads spin-wait and run 10-100x slower when cores are contended)")
  args = ap.parse_args()
  malloc_tuned = common.apply_malloc(args)
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(args.torch_threads)
  b, t = (2, 32) if args.quick else (args.batch, args.seq)
  repeats = 1 if args.quick else args.repeats
  peak = common.measure_matmul_peak(256 if args.quick else 1024)
  rows, compile_info = [], {}
  names = ["tiny"] if args.quick else args.configs.split(",")
  for name in names:
    cfg = CONFIGS[name]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    critic = Critic(cfg, rngs=nnx.Rngs(1))
    c_graphdef, c_params = nnx.split(critic)
    c_params = nnx.to_pure_dict(c_params)
    np_batch = make_batch(cfg, b, t)
    # rollout log-probs = the initial policy's own: ratios start at 1, inside the DIS band, so the
    # policy gradient is not zero (random log-probs put every token outside the band)
    tok = jnp.asarray(np_batch["tokens"])
    logits, _ = model(tok, default_positions(tok))
    np_batch["rollout_logprobs"] = np.asarray(steps.token_logprobs(logits, tok))
    with tempfile.TemporaryDirectory() as d:
      hf.save_hf_checkpoint(d, cfg, params)
      t_policy, t_critic = torch_steps(d, cfg, np_batch)
    # the critic peer starts from the policy weights; so does ours (setup.critic_from_policy)
    c_params["backbone"] = jax.tree.map(jnp.copy, params)
    learner, p_step, c_step = common.learner_steps(graphdef, params, c_graphdef, c_params, LR)
    state = {"p": learner.policy, "c": learner.critic}
    batch = Batch.of(np_batch["tokens"], np_batch["action_mask"],
                     rollout_logprobs=np_batch["rollout_logprobs"])
    adv = jnp.asarray(np_batch["advantages"])
    targets = {"returns": jnp.asarray(np_batch["returns"]),
               "values": jnp.asarray(np_batch["values"])}
    t0 = time.perf_counter()
    p_step.lower(state["p"], batch, adv, None).compile()
    compile_info[f"{name}/policy_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    c_step.lower(state["c"], batch, targets).compile()
    compile_info[f"{name}/critic_compile_s"] = time.perf_counter() - t0

    def ours_policy():
      state["p"], m = p_step(state["p"], batch, adv, None)
      return m["policy_loss"]

    def ours_critic():
      state["c"], m = c_step(state["c"], batch, targets)
      return m["value_loss"]

    times = common.time_interleaved({"ours policy": ours_policy, "torch policy": t_policy,
                                     "ours critic": ours_critic, "torch critic": t_critic},
                                    warmup=1, repeats=repeats)
    compile_info[f"{name}/jit_cache_size_policy"] = p_step._cache_size()  # pylint: disable=protected-access
    compile_info[f"{name}/jit_cache_size_critic"] = c_step._cache_size()  # pylint: disable=protected-access
    for kind, head in (("policy", True), ("critic", False)):
      fl = train_flops_per_token(cfg, t, head) * b * t
      mo, mp = common.median(times[f"ours {kind}"]), common.median(times[f"torch {kind}"])
      rows.append({"config": name, "step": kind, "B x T": f"{b}x{t}",
                   "ours tok/s": b * t / mo, "torch tok/s": b * t / mp, "ours/torch": mp / mo,
                   "ours MFU": fl / mo / peak, "torch MFU": fl / mp / peak})
  common.report("train_step", rows, args,
                {"matmul_peak_flops": peak, "torch_threads": torch.get_num_threads(),
                 "host_malloc.keep_freed_memory": malloc_tuned, **compile_info})


if __name__ == "__main__":
  main()
