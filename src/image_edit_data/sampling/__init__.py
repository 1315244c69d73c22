"""Which samples form which batch: a mixture's draw, the pure epoch plan and the resumable bucket batch samplers."""

from .mixture_draw import Mixture
from .plan import BucketOrder, EpochPlan, plan_epoch, step_count
from .sampler import BucketBatchSampler, EvalBatchSampler, ResumeMismatchError, check_rank, migrate_state

__all__ = [
    "BucketBatchSampler",
    "BucketOrder",
    "EpochPlan",
    "EvalBatchSampler",
    "Mixture",
    "ResumeMismatchError",
    "check_rank",
    "migrate_state",
    "plan_epoch",
    "step_count",
]
