"""Train steps (DIS policy step, critic step): sao_jax (JAX) vs a PyTorch + transformers peer and
Tunix's PPO steps (the JAX peer).

    python benchmarks/bench_train_step.py [--quick] [--no_tunix] [--json out.json]

Torch peer: ``transformers.Qwen3ForCausalLM`` on the same weights (written by
``sao_jax.models.hf.save_hf_checkpoint`` and read back with ``from_pretrained``), the same DIS
loss (ratio band mask, token mean), global-norm clipping and AdamW; the critic peer is
``Qwen3Model`` + a linear value head, squared error on action tokens, attention parameters
frozen (``requires_grad=False``, like our ``optax.set_to_zero`` partition).

Tunix peer (``google-tunix==0.1.7``), measured when it imports; like ``bench_sampler.py`` it is
kept out of the project venv (``--no-deps`` leaves its jax, flax and transformers alone):
``pip install --target DIR --no-deps google-tunix==0.1.7 einops jaxtyping wadler_lindig qwix
google_metrax sentencepiece perfetto pandas``, then run with ``PYTHONPATH=$PWD:DIR``;
``--no_tunix`` skips it. Its Qwen3
(``tunix.models.qwen3``) is loaded from the same HF folder, and each step is one call of the
jitted step ``Trainer.train`` runs (``tunix.rl.trainer.Trainer``: ``nnx.value_and_grad`` over
every ``nnx.Param``, ``optax.global_norm``, ``nnx.Optimizer.update``, in one ``nnx.jit`` with a
cached graph) with the loss functions ``PPOLearner`` registers: ``algo_core.ppo_policy_loss_fn``
(``epsilon_low`` / ``epsilon_high`` = our band 0.3 / 5.0, no KL, no entropy) and
``algo_core.ppo_value_loss_fn`` on the critic ``tunix.rl.utils.create_critic_model`` builds (the
same backbone, its LM head replaced by a bias-free ``Linear(d_model, 1)``). Optimizer: the same
optax chain as ours (global-norm clip 1.0, then AdamW, no weight decay). Batch: prompt = the
leading columns without action tokens, completion = the rest, ``completion_mask`` = our action
mask, ``old_per_token_logps`` = our rollout log-probs (both ratios are pi / pi_rollout),
``returns`` / ``old_values`` = ours; the pad id is one no token has, so Tunix's attention mask
is plain causal like ours. What differs:

- policy loss: PPO clip, ``l = max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)``, where DIS masks
  (``l = -r A`` inside the band, 0 outside; PPO clip still passes a gradient below the band when
  A > 0 and above it when A < 0). The same ratio and model work; the loss is a clip and a max
  (plus Tunix's dual-clip select and clip-fraction metrics) instead of a compare and a select,
  O(B*T) either way. While every ratio is inside the band, as in this benchmark, both are
  ``-r A``: the first-step losses agree, and so do later steps' (the optimizers match);
- value loss: ``0.5 * max((V-R)^2, (V_clip-R)^2)``, clipped around ``old_values`` at half-width
  1e6 here (never binds; ours does not clip): half our loss, O(B*T) more elementwise work;
- frozen critic attention: Tunix differentiates every ``nnx.Param`` (it can only restrict the
  gradient to LoRA parameters), so attention is frozen through the optimizer argument
  (``optax.multi_transform`` with ``set_to_zero`` on ``attn``): the same update, but its step
  still computes the attention weights' gradients -- more work than a step that skips them
  ("tunix note" column);
- Tunix's value head has no bias; its Qwen3 applies RoPE with theta 1e6 whatever its config
  says, hence ``rope_theta=1e6`` in ``CONFIGS`` (Qwen3's value).

Reports tokens/s (B*T per step), the ratios ours/torch and ours/tunix, model FLOP utilisation
against a ``jnp.dot`` peak measured in the same run, compile time of each of our jitted steps
(and the first call of each Tunix step, compile included), the jit cache size after all
repeats (1 = no recompilation), and the first-step losses of all three on the same inputs (the
value heads start equal: one random kernel, zero bias).

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

# rope_theta: Qwen3's 1e6. Tunix 0.1.7's Qwen3 attention applies RoPE with its default theta of
# 1e6 whatever ModelConfig.rope_theta says, so any other value makes its model a different function
CONFIGS = {
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=128, max_seq_len=256, rope_theta=1e6, arch="qwen3"),
    "small": ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                         head_dim=32, d_ff=768, max_seq_len=512, rope_theta=1e6, arch="qwen3"),
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
def torch_steps(path, cfg, batch, value_kernel):
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  policy = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
  policy.train()
  backbone = transformers.Qwen3Model.from_pretrained(path, dtype=torch.float32)
  head = torch.nn.Linear(cfg.d_model, 1)
  with torch.no_grad():  # the value head ours and Tunix's start from
    head.weight.copy_(torch.from_numpy(np.asarray(value_kernel).T))
    head.bias.zero_()
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


# ---- the Tunix peer (JAX) ---------------------------------------------------------------------
TUNIX_VALUE_CLIP = 1e6  # Tunix's value loss always clips around old_values; this never binds
TUNIX_NOTES = {"policy": f"PPO clip (eps {EPS_LOW}/{EPS_HIGH}) where ours masks (DIS)",
               "critic": "attention frozen by its optimizer: its gradients still computed"}


def tunix_steps(hf_dir, cfg, batch, value_kernel):
  """Tunix's PPO policy and critic train steps on the HF folder's weights and ``batch`` (the
  ``make_batch`` dict, rollout log-probs filled in); ``value_kernel`` float32 [d_model, 1] is the
  critic head's initial kernel (ours too). Returns ``(policy_step, critic_step)``, each a
  no-argument function that runs one jitted step and returns its loss (a scalar jax.Array), or
  None (printing "tunix not measured: <reason>") when tunix does not import. See the module
  docstring for what differs from our steps."""
  try:
    import dataclasses  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from tunix.models.qwen3 import model as tmodel  # pylint: disable=import-outside-toplevel
    from tunix.models.qwen3 import params as tparams  # pylint: disable=import-outside-toplevel
    from tunix.rl import algo_core  # pylint: disable=import-outside-toplevel
    from tunix.rl import trainer as rl_trainer  # pylint: disable=import-outside-toplevel
    from tunix.rl import utils as rl_utils  # pylint: disable=import-outside-toplevel
    from tunix.rl.ppo import ppo_learner  # pylint: disable=import-outside-toplevel
    from tunix.sft import peft_trainer  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    print(f"tunix not measured: {e}")
    return None
  tcfg = common.tunix_qwen3_config(cfg, dtype=cfg.compute_dtype, param_dtype=jnp.float32)
  policy = tparams.create_model_from_safe_tensors(hf_dir, tcfg)
  # create_critic_model swaps the module's `lm_head` for Linear(d_model, 1); a tied model has no
  # lm_head (it decodes with the embedding), so the critic starts from an untied copy of the
  # same weights (its random LM head is the part replaced)
  untied = tmodel.Qwen3(dataclasses.replace(tcfg, use_tied_embedding=False), rngs=nnx.Rngs(0))
  nnx.update(untied, nnx.state(tparams.create_model_from_safe_tensors(hf_dir, tcfg)))
  critic = rl_utils.create_critic_model(untied)
  critic.lm_head.kernel[...] = jnp.asarray(value_kernel, critic.lm_head.kernel[...].dtype)

  def adamw():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=0.0))

  def attention_frozen(state):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if ".attn" in jax.tree_util.keystr(path, simple=True,
                                                                   separator=".")
        else "trainable", state)

  c_tx = optax.multi_transform({"trainable": adamw(), "frozen": optax.set_to_zero()},
                               attention_frozen)
  pad_id, eos_id = -1, -1  # no token equals them: no padding in Tunix's attention mask
  train_cfg = peft_trainer.TrainingConfig(eval_every_n_steps=1 << 30)
  algo = ppo_learner.PPOConfig(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.0,
                               entropy_coef=None)
  actor = rl_trainer.Trainer(policy, adamw(), train_cfg, custom_checkpoint_metadata_fn=dict)
  actor.with_loss_fn(algo_core.ppo_policy_loss_fn, has_aux=True)
  actor.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo,
                                           "pad_id": pad_id, "eos_id": eos_id})
  value = rl_trainer.Trainer(critic, c_tx, train_cfg, custom_checkpoint_metadata_fn=dict)
  value.with_loss_fn(algo_core.ppo_value_loss_fn, has_aux=True)
  value.with_gen_model_input_fn(lambda x: {"train_example": x,
                                           "clip_range_value": TUNIX_VALUE_CLIP,
                                           "pad_id": pad_id, "eos_id": eos_id})
  for trainer in (actor, value):
    # committed to the device as the step's outputs are: an uncommitted Adam count otherwise
    # compiles the step a second time on its second call (without a mesh, Trainer._shard_optimizer
    # does nothing)
    for part in (trainer.model, trainer.optimizer):
      nnx.update(part, jax.device_put(nnx.state(part), jax.devices()[0]))
  # Trainer.train's own jitted step (cache_nnx_graph=True is its default)
  p_step, _ = actor.jit_train_and_eval_step(cache_nnx_graph=True)
  c_step, _ = value.jit_train_and_eval_step(cache_nnx_graph=True)

  mask = np.asarray(batch["action_mask"]) > 0
  prompt = max(1, int(np.argmax(mask.any(0))))  # leading columns without action tokens
  tokens = jnp.asarray(batch["tokens"])
  completion = lambda k: jnp.asarray(batch[k][:, prompt:])
  example = ppo_learner.TrainExample(
      prompt_ids=tokens[:, :prompt], prompt_mask=jnp.ones_like(tokens[:, :prompt]),
      completion_ids=tokens[:, prompt:], completion_mask=jnp.asarray(mask[:, prompt:]),
      advantages=completion("advantages"), ref_per_token_logps=None,
      old_per_token_logps=completion("rollout_logprobs"), returns=completion("returns"),
      old_values=completion("values"))

  def policy_step():
    return p_step(example)[0]

  def critic_step():
    return c_step(example)[0]

  # pylint: disable=protected-access
  policy_step.cache_size = lambda: p_step.func.jitted_fn._cache_size()
  critic_step.cache_size = lambda: c_step.func.jitted_fn._cache_size()
  # pylint: enable=protected-access
  return policy_step, critic_step


def main():
  ap = common.parser(__doc__, malloc_flag=True)
  ap.add_argument("--configs", default="tiny,small")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--torch_threads", type=int, default=1,
                  help="torch intra-op threads; 1 is the fastest on a loaded 2-core host "
                       "(2 threads spin-wait and run 10-100x slower when cores are contended)")
  ap.add_argument("--no_tunix", action="store_true", help="skip the Tunix peer")
  args = ap.parse_args()
  malloc_tuned = common.apply_malloc(args)
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(args.torch_threads)
  b, t = (2, 32) if args.quick else (args.batch, args.seq)
  repeats = 1 if args.quick else args.repeats
  peak = common.measure_matmul_peak(256 if args.quick else 1024)
  rows, compile_info, first_losses = [], {}, {}
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
    # every critic starts from one random value-head kernel (zero bias): a zero head (Critic's
    # init) gives the backbone no gradient on the first step, and equal heads make the three
    # first-step critic losses comparable
    value_kernel = 0.02 * np.random.default_rng(1).standard_normal((cfg.d_model, 1))
    value_kernel = value_kernel.astype(np.float32)
    c_params["value_head"]["kernel"] = jnp.asarray(value_kernel,
                                                   c_params["value_head"]["kernel"].dtype)
    with tempfile.TemporaryDirectory() as d:
      hf.save_hf_checkpoint(d, cfg, params)
      t_policy, t_critic = torch_steps(d, cfg, np_batch, value_kernel)
      tunix = None if args.no_tunix else tunix_steps(d, cfg, np_batch, value_kernel)
    # the critic peer starts from the policy weights; so does ours (build.critic_from_policy)
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

    fns = {"ours policy": ours_policy, "torch policy": t_policy,
           "ours critic": ours_critic, "torch critic": t_critic}
    if tunix is not None:
      fns["tunix policy"], fns["tunix critic"] = tunix
    losses = {}

    def first_loss(key, fn):
      def run():
        out = fn()
        losses.setdefault(key, out)
        return out
      return run

    fns = {k: first_loss(k, fn) for k, fn in fns.items()}
    if tunix is not None:  # the first call compiles: its time, step included
      for kind in ("policy", "critic"):
        t0 = time.perf_counter()
        common.block(fns[f"tunix {kind}"]())
        compile_info[f"{name}/tunix_{kind}_first_call_s"] = time.perf_counter() - t0
    times = common.time_interleaved(fns, warmup=1, repeats=repeats)
    first_losses[name] = {k: float(v) for k, v in losses.items()}
    print(f"{name} first-step losses (same inputs; Tunix's value loss is 0.5 x ours): "
          + ", ".join(f"{k} {v:.6g}" for k, v in first_losses[name].items()))
    compile_info[f"{name}/jit_cache_size_policy"] = p_step._cache_size()  # pylint: disable=protected-access
    compile_info[f"{name}/jit_cache_size_critic"] = c_step._cache_size()  # pylint: disable=protected-access
    if tunix is not None:
      compile_info[f"{name}/tunix_jit_cache_size_policy"] = tunix[0].cache_size()
      compile_info[f"{name}/tunix_jit_cache_size_critic"] = tunix[1].cache_size()
    for kind, head in (("policy", True), ("critic", False)):
      fl = train_flops_per_token(cfg, t, head) * b * t
      mo, mp = common.median(times[f"ours {kind}"]), common.median(times[f"torch {kind}"])
      row = {"config": name, "step": kind, "B x T": f"{b}x{t}",
             "ours tok/s": b * t / mo, "torch tok/s": b * t / mp, "ours/torch": mp / mo,
             "ours MFU": fl / mo / peak, "torch MFU": fl / mp / peak}
      if tunix is not None:
        mt = common.median(times[f"tunix {kind}"])
        row.update({"tunix tok/s": b * t / mt, "ours/tunix": mt / mo, "tunix MFU": fl / mt / peak,
                    "tunix note": TUNIX_NOTES[kind]})
      rows.append(row)
  common.report("train_step", rows, args,
                {"matmul_peak_flops": peak, "torch_threads": torch.get_num_threads(),
                 "host_malloc.keep_freed_memory": malloc_tuned, "first_step_losses": first_losses,
                 **compile_info})


if __name__ == "__main__":
  main()
