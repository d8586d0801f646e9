"""Pure-function RL kernels for SAO: DIS policy loss, skip-observation GAE,
length-adaptive lambda, running-mean baseline, value loss and diagnostics.

Arrays in, arrays (+ metrics dict) out; no state, no I/O. Layout `[batch, time]`.
"""

from sao_jax.algo.advantages import length_adaptive_lambda
from sao_jax.algo.advantages import running_mean_baseline_advantage
from sao_jax.algo.advantages import skip_observation_gae
from sao_jax.algo.policy_loss import dis_keep_mask
from sao_jax.algo.policy_loss import dis_policy_loss
from sao_jax.algo.value_loss import explained_variance
from sao_jax.algo.value_loss import value_loss

__all__ = (
    'dis_keep_mask',
    'dis_policy_loss',
    'explained_variance',
    'length_adaptive_lambda',
    'running_mean_baseline_advantage',
    'skip_observation_gae',
    'value_loss',
)
