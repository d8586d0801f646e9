"""Pure-function RL kernels for the SAO algorithm family: policy objectives (DIS, PPO clip,
TIS, IcePop, REINFORCE), advantage estimators (skip-observation / naive / step-level GAE,
decoupled lambda, GRPO, running-mean baseline), value loss and diagnostics.

Arrays in, arrays (+ metrics dict) out; no state, no I/O. Layout `[batch, time]`.
"""

from sao_jax.algo.advantages import length_adaptive_lambda
from sao_jax.algo.advantages import skip_observation_gae
from sao_jax.algo.estimators import ESTIMATORS
from sao_jax.algo.estimators import Estimator
from sao_jax.algo.estimators import baseline_advantages
from sao_jax.algo.estimators import broadcast_to_tokens
from sao_jax.algo.estimators import get_estimator
from sao_jax.algo.estimators import group_normalized_advantages
from sao_jax.algo.estimators import naive_token_gae
from sao_jax.algo.estimators import response_span
from sao_jax.algo.estimators import step_level_gae
from sao_jax.algo.estimators import turn_index
from sao_jax.algo.objectives import OBJECTIVES
from sao_jax.algo.objectives import aggregate
from sao_jax.algo.objectives import dis_objective
from sao_jax.algo.objectives import get_objective
from sao_jax.algo.objectives import icepop_objective
from sao_jax.algo.objectives import ppo_clip_objective
from sao_jax.algo.objectives import reinforce_objective
from sao_jax.algo.objectives import tis_objective
from sao_jax.algo.value_loss import explained_variance
from sao_jax.algo.value_loss import value_loss

__all__ = (
    'ESTIMATORS',
    'Estimator',
    'OBJECTIVES',
    'aggregate',
    'baseline_advantages',
    'broadcast_to_tokens',
    'dis_objective',
    'explained_variance',
    'get_estimator',
    'get_objective',
    'group_normalized_advantages',
    'icepop_objective',
    'length_adaptive_lambda',
    'naive_token_gae',
    'ppo_clip_objective',
    'reinforce_objective',
    'response_span',
    'skip_observation_gae',
    'step_level_gae',
    'tis_objective',
    'turn_index',
    'value_loss',
)
