"""Reference helpers the model tests compare against: greedy decoding with the KV cache, one token
per Python step, and a no-cache forward that also returns the MoE router logits. Test-only: the
rollout engine (``sao_jax/rollout/engine.py``) is what the package decodes with."""

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.transformer import (Transformer, default_positions, init_cache,
                                        load_balancing_loss)


def greedy_generate(model: Transformer, prompt: Sequence[int], max_new_tokens: int,
                    stop_ids: Sequence[int] = ()) -> list[int]:
  """Greedy decoding of one prompt with the KV cache (prefill once, then one token per step).

  prompt: token ids (len >= 1). Returns the generated ids (stops after a token in ``stop_ids``,
  which is included). Pure-Python loop over a jitted step."""
  cfg = model.cfg
  graphdef, state = nnx.split(model)
  n = len(prompt)
  cache = init_cache(cfg, 1, n + max_new_tokens)

  @jax.jit
  def step(state, tokens, positions, cache):
    m = nnx.merge(graphdef, state)
    logits, cache = m(tokens, positions, cache)
    return jnp.argmax(logits[0, -1]).astype(jnp.int32), cache

  tokens = jnp.asarray([list(prompt)], jnp.int32)
  tok, cache = step(state, tokens, default_positions(tokens), cache)
  out = []
  for i in range(max_new_tokens):
    out.append(int(tok))
    if out[-1] in stop_ids or i == max_new_tokens - 1:
      break
    tok, cache = step(state, tok.reshape(1, 1), jnp.full((1, 1), n + i, jnp.int32), cache)
  return out


def forward_with_aux(model: Transformer, tokens, positions, attention_mask=None):
  """No-cache forward that also returns the MoE router logits.

  Returns ``(logits [B, T, V] float32, aux)`` with ``aux = {"router_logits": [L_moe, B, T, E]
  float32 or None, "load_balancing_loss": scalar float32 (0 for a dense model)}``."""
  h, _, rl = model._run(tokens, positions, None, attention_mask)  # pylint: disable=protected-access
  if not rl:
    return model.logits_from_hidden(h), {"router_logits": None,
                                         "load_balancing_loss": jnp.float32(0.0)}
  rl = jnp.stack(rl)
  lb = load_balancing_loss(rl, model.cfg.n_experts_per_tok, attention_mask)
  return model.logits_from_hidden(h), {"router_logits": rl, "load_balancing_loss": lb}
