"""The metric vocabulary: every name a run writes, with its unit and meaning.

One vocabulary for every mode and every sink (stdout, ``metrics.jsonl`` / ``metrics.csv``,
TensorBoard, Weights & Biases). ``docs/metrics.md`` is generated from this table
(``python -m sao_jax.docs_gen``) and ``sao_jax.plot`` takes its axis labels from it, so a
metric is described in exactly one place. A test checks that every key a smoke run logs is
listed here.

Records may carry a prefix: ``critic_warmup/`` (critic-only steps before RL) and ``final/``
(the held-out evaluation after the last step); the name after the prefix is from this table.
"""

from __future__ import annotations

import re

import dataclasses

PREFIXES = ("critic_warmup/", "final/")


@dataclasses.dataclass(frozen=True)
class MetricDef:
  """One metric: ``unit`` (for axis labels), ``group`` (docs section), ``doc`` (one sentence)."""
  unit: str
  group: str
  doc: str


def _m(unit, group, doc):
  return MetricDef(unit, group, doc)


METRICS: dict[str, MetricDef] = {
    # ---- outcome -------------------------------------------------------------------------------
    "reward_mean": _m("reward", "outcome", "mean outcome reward of the batch's trajectories "
                      "(1 = correct answer, 0 = wrong)"),
    "eval_accuracy": _m("fraction", "outcome", "greedy pass@1 on the held-out problems (periodic "
                        "eval on the first `eval.periodic_problems`; `final/` = all of them)"),
    "eval_formatted": _m("fraction", "outcome", "math tasks: fraction of held-out responses "
                         "with a non-empty final \\boxed{} (accuracy / this = accuracy given "
                         "the format)"),
    "eval_tool_use": _m("fraction", "outcome", "fraction of held-out trajectories that called "
                        "the tool at least once"),
    **{f"style{k}_fraction": _m("fraction", "outcome", f"style_switch: fraction of the batch "
                                f"ending in style {k} (envs/style_switch.py STYLES[{k}])")
       for k in range(3)},
    "correct_mean": _m("fraction", "outcome", "style_switch: fraction of the batch whose answer "
                       "is correct, whatever its style"),
    "tool_use": _m("fraction", "outcome", "fraction of the batch's trajectories that called the "
                   "tool at least once"),
    "response_tokens_mean": _m("tokens", "outcome", "mean action (policy-sampled) tokens per "
                               "trajectory"),
    "obs_tokens_mean": _m("tokens", "outcome", "swe / swe_lite: mean observation (tool output) "
                          "tokens per trajectory, prompt excluded"),
    "truncated_fraction": _m("fraction", "outcome", "fraction of the batch's trajectories "
                             "cut by a length limit (model.max_seq_len, a prefill chunk, "
                             "task.max_turns) instead of ending by themselves"),
    "failed": _m("trajectories", "outcome", "trajectories in the batch whose environment or "
                 "reward function raised (recorded with reward 0, see `info['error']`)"),
    # ---- DIS (policy) --------------------------------------------------------------------------
    "policy_loss": _m("loss", "DIS policy", "DIS surrogate loss, token mean over action tokens "
                      "(Eq. 1-3)"),
    "policy_grad_norm": _m("norm", "DIS policy", "global gradient norm of the policy before "
                           "clipping"),
    "masked_fraction": _m("fraction", "DIS policy", "action tokens whose ratio left the band "
                          "(1-eps_low, 1+eps_high) and got no gradient (paper: ~0.006)"),
    "masked_fraction_low": _m("fraction", "DIS policy", "action tokens masked because "
                              "ratio <= 1-eps_low"),
    "masked_fraction_high": _m("fraction", "DIS policy", "action tokens masked because "
                               "ratio >= 1+eps_high"),
    "ratio_mean": _m("ratio", "DIS policy", "mean importance ratio exp(logp - logp_rollout) over "
                     "action tokens"),
    "ratio_max": _m("ratio", "DIS policy", "largest importance ratio over action tokens"),
    "abs_logp_diff_mean": _m("nats", "DIS policy", "mean |logp - logp_rollout| over action "
                             "tokens (trainer vs engine mismatch plus staleness)"),
    "approx_kl_k3": _m("nats", "DIS policy", "k3 estimate of KL(rollout || current), mean of "
                       "(r - 1) - log r over action tokens"),
    "advantage_mean": _m("advantage", "DIS policy", "mean advantage over action tokens"),
    "advantage_std": _m("advantage", "DIS policy", "standard deviation of the advantages over "
                        "action tokens"),
    "action_tokens": _m("tokens", "DIS policy", "action tokens in the batch (the loss "
                        "denominator)"),
    "router_aux_loss": _m("loss", "DIS policy", "MoE policy with model.router_aux_loss_coef "
                          "> 0: router load-balancing loss over action tokens (Hugging Face "
                          "formula; top_k when routing is uniform); policy_loss includes coef "
                          "x this"),
    # ---- critic --------------------------------------------------------------------------------
    "value_loss": _m("loss", "critic", "(V - R)^2, token mean over action tokens, last of the K "
                     "critic updates"),
    "value_mean": _m("value", "critic", "mean critic value V over action tokens"),
    "return_mean": _m("return", "critic", "mean lambda=1 return target R over action tokens"),
    "value_clipped_fraction": _m("fraction", "critic", "action tokens where PPO-style value "
                                 "clipping was active (0 unless clipping is on)"),
    "critic_grad_norm": _m("norm", "critic", "global gradient norm of the critic's trainable "
                           "parameters (frozen attention excluded) before clipping (paper: 3-5 "
                           "with frozen attention)"),
    "critic_grad_norm_attn": _m("norm", "critic", "gradient norm of the critic's attention "
                                "parameters (paths matching /attn/) before clipping; 0 when "
                                "they are frozen"),
    "critic_grad_norm_rest": _m("norm", "critic", "gradient norm of every other critic "
                                "parameter (MLP, norms, embeddings, value head)"),
    "critic_router_aux_loss": _m("loss", "critic", "MoE critic with model.router_aux_loss_coef "
                                 "> 0: router load-balancing loss over action tokens, last of "
                                 "the K critic updates; value_loss includes coef x this"),
    "explained_variance": _m("fraction", "critic", "1 - Var(R - V) / Var(R) over action tokens, "
                             "before the critic updates (paper: ~0.6)"),
    # ---- asynchrony ----------------------------------------------------------------------------
    "policy_version": _m("version", "asynchrony", "policy version after this step (one per "
                         "policy step)"),
    "staleness_mean": _m("versions", "asynchrony", "mean over action tokens of (trainer version "
                         "- version that sampled the token)"),
    "staleness_max": _m("versions", "asynchrony", "largest token staleness in the batch"),
    "staleness_hist": _m("tokens", "asynchrony", "list: entry s = action tokens with staleness "
                         "s in the batch (JSONL only; plotted by sao_jax.plot)"),
    "queue_size": _m("trajectories", "asynchrony", "trajectories waiting in the queue after the "
                     "batch was taken"),
    "queue_age_s": _m("s", "asynchrony", "mean time the batch's trajectories spent in the "
                      "queue"),
    # ---- throughput ----------------------------------------------------------------------------
    "tokens_per_s": _m("tokens/s", "throughput", "tokens sampled by the rollout engine per "
                       "second of wall time since the previous step"),
    "wait_s": _m("s", "throughput", "time the trainer waited for the batch's rollouts"),
    "train_s": _m("s", "throughput", "time of the SAO step itself (K critic updates + policy "
                  "update + weight publish)"),
    "rollout_generate_s": _m("s", "throughput", "cumulative engine time in generate() since the "
                             "start"),
    "rollout_prefill_s": _m("s", "throughput", "cumulative engine time in prefill() / "
                            "prefill_insert() (prompts and observations; a call that returns "
                            "its sampled token includes its device time) since the start"),
    "rollout_env_wait_s": _m("s", "throughput", "cumulative time the rollout worker waited "
                             "because every running slot awaited its env.step (tool latency, "
                             "rollout.env_workers > 0)"),
    "rollout_sink_s": _m("s", "throughput", "cumulative time the rollout worker was blocked "
                         "handing finished trajectories to the full queue (backpressure), "
                         "including a block still in progress"),
    "rollout_idle_s": _m("s", "throughput", "cumulative time the rollout worker had nothing to "
                         "admit (grpo_sync barrier, staleness admission control)"),
    "rollout_trajectories": _m("trajectories", "throughput", "cumulative trajectories the "
                               "rollout worker finished (handed to the queue) since the start"),
    "rollout_generate_steps": _m("steps", "throughput", "cumulative decode steps of the "
                                 "rollout engine since the start (`rollout.decode_steps` per "
                                 "engine call)"),
    "rollout_tokens_discarded": _m("tokens", "throughput", "cumulative tokens decoded past the "
                                   "end of a turn within one engine call and thrown away "
                                   "(`rollout.decode_steps` > 1), or in a call dispatched "
                                   "before the turn ended (`rollout.overlap_host`)"),
    "rollout_overlapped_calls": _m("calls", "throughput", "cumulative engine decode calls "
                                   "dispatched before the host read the previous call's tokens "
                                   "(`rollout.overlap_host`)"),
    "rollout_slot_occupancy": _m("fraction", "throughput", "decoding slots / all slots, averaged "
                                 "over the generate steps since the start (slots that wait on "
                                 "their env or are empty do not count)"),
    "elapsed_s": _m("s", "throughput", "wall time since the job started"),
    "eval_total_s": _m("s", "throughput", "wall time of the held-out evals so far (the one "
                       "before training and the periodic ones before this step), part of "
                       "`elapsed_s`"),
    "warm_start_s": _m("s", "throughput", "wall time of building the policy (the SFT warm-up, "
                       "or loading it or a checkpoint), part of `elapsed_s`: `elapsed_s - "
                       "warm_start_s - eval_total_s` is the training clock"),
    # ---- the algorithm family's shared vocabulary (sao_jax/algo/objectives.py) ----------------
    "ratio_min": _m("ratio", "DIS policy", "smallest importance ratio over action tokens"),
    "masked_fraction_pos_adv": _m("fraction", "DIS policy", "masked / clipped fraction among "
                                  "action tokens with advantage > 0"),
    "masked_fraction_neg_adv": _m("fraction", "DIS policy", "masked / clipped fraction among "
                                  "action tokens with advantage < 0"),
    "ess_fraction": _m("fraction", "DIS policy", "effective sample size of the importance "
                       "weights, (sum w)^2 / sum w^2, over the number of action tokens"),
    "mismatch_abs_logp": _m("nats", "DIS policy", "engine-vs-trainer mismatch: mean "
                            "|logp - logp_rollout| over action tokens"),
    "mismatch_exp_abs_minus_1": _m("ratio", "DIS policy", "mean exp(|logp - logp_rollout|) - 1"),
    "mismatch_kl_k3": _m("nats", "DIS policy", "k3 estimate of KL(rollout || current) over "
                         "action tokens"),
    "entropy": _m("nats", "DIS policy", "mean policy entropy over action tokens"),
    "kl_ref": _m("nats", "DIS policy", "k3 KL to the reference (warm-started) policy"),
    "tis_weight_mean": _m("ratio", "DIS policy", "objective=tis: mean truncated IS weight"),
    "icepop_masked_fraction": _m("fraction", "DIS policy", "objective=icepop: fraction of "
                                 "action tokens masked by the IcePop band"),
    # ---- faults and staleness control ------------------------------------------------------------
    "dropped_stale": _m("trajectories", "asynchrony", "trajectories dropped on arrival for "
                        "staleness (rollout.staleness_policy with 'drop'), cumulative"),
    "env_errors_total": _m("trajectories", "outcome", "failed trajectories (env/reward "
                           "exception, timeout, NaN reward), cumulative"),
    "nonfinite_skipped": _m("flag", "outcome", "1 if this step's update was skipped for "
                            "NaN/inf gradients"),
    "nonfinite_total": _m("steps", "outcome", "skipped non-finite updates, cumulative"),
    # ---- timestamps (seconds since the epoch): the grpo_sync barrier is visible in these -------
    "step_t_begin": _m("s", "throughput", "wall-clock time the policy step began"),
    "step_t_publish": _m("s", "throughput", "wall-clock time the new weights were published"),
    "traj_t_start_min": _m("s", "throughput", "earliest rollout start in the batch"),
    "traj_t_start_max": _m("s", "throughput", "latest rollout start in the batch"),
    "traj_t_end_max": _m("s", "throughput", "latest rollout end in the batch"),
    # ---- the critic against the reward range, and the drop policy's length bias ---------------
    "value_min": _m("value", "critic", "smallest critic value over the batch's action tokens "
                    "(before the K updates); compare with the reward range; null (NaN) in a "
                    "batch without action tokens"),
    "value_max": _m("value", "critic", "largest critic value over the batch's action tokens "
                    "(above the largest reward: the value overshoots); null (NaN) in a batch "
                    "without action tokens"),
    "baseline_nonempty_fraction": _m("fraction", "DIS policy", "running-mean estimators: share "
                                     "of the batch's trajectories whose reward window held an "
                                     "earlier reward (0 = the baseline is 0, A = R)"),
    "response_tokens_generated_mean": _m("tokens", "asynchrony", "mean action tokens of every "
                                         "trajectory that arrived, since the start"),
    "response_tokens_trained_mean": _m("tokens", "asynchrony", "mean action tokens of the "
                                       "trajectories trained on, since the start"),
    "response_tokens_dropped_mean": _m("tokens", "asynchrony", "mean action tokens of the "
                                       "trajectories dropped for staleness (0 if none)"),
    # ---- rollout.backend=ray (sao_jax/rollout/ray_source.py); <i> = the actor's index ---------
    "ray/actor<i>_trajectories": _m("trajectories", "ray", "trajectories received from actor i"),
    "ray/actor<i>_version": _m("version", "ray", "newest weights version actor i reported"),
    "ray/actor<i>_restarts": _m("restarts", "ray", "times actor i was restarted by Ray"),
    "ray/restarts": _m("restarts", "ray", "actor restarts, all actors"),
    "ray/reissued": _m("prompts", "ray", "prompts issued again after their actor died"),
    "ray/duplicates": _m("trajectories", "ray", "trajectories that came back twice (dropped)"),
    "ray/outstanding": _m("prompts", "ray", "prompts handed out and not yet returned"),
}


def describe(name: str) -> MetricDef:
  """The definition of ``name`` (prefixes in ``PREFIXES`` are stripped).

  Raises KeyError naming the metric and pointing at this table when it is unknown."""
  base = name
  for p in PREFIXES:
    if base.startswith(p):
      base = base[len(p):]
  base = re.sub(r"^ray/actor\d+_", "ray/actor<i>_", base)
  if base not in METRICS:
    raise KeyError(f"metric {name!r} is not in the vocabulary; add it to "
                   "sao_jax/train/metric_defs.py:METRICS (and regenerate docs/metrics.md).")
  return METRICS[base]


def label(name: str) -> str:
  """Axis label ``"name [unit]"`` for a metric (falls back to the bare name if unknown)."""
  try:
    return f"{name} [{describe(name).unit}]"
  except KeyError:
    return name
