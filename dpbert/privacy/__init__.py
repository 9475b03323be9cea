"""dpbert.privacy: the DP-SGD core, model-agnostic.

It sees a pure `loss_fn(params, example, rng) -> scalar` and a params pytree, never a BERT.

- `clipped_grad_sum` (clipping): per-example clipped *sum*, micro-batched; sensitivity clip_norm.
- `privatize` (noise): Gaussian noise once on the global sum, divided by the expected batch size.
- `make_dp_train_step` / `make_train_step` (dp_step): jitted steps, optionally on a data mesh.
- `poisson_sample`, `physical_batch_size` (sampling): Poisson sampling padded to a static shape.
- `Stage`, `BatchSchedule` (schedule): the increasing batch-size schedule.
- `compute_epsilon`, `calibrate_noise_multiplier`, `PrivacyLedger` (accounting).
- `step_key`, `example_key`, `noise_key` (randomness): all of step t from fold_in(run_key, t).

Guarantees: see each module's docstring; together they implement the six rules of the DP core
(sum then noise once then divide by the expected batch; micro-batching and devices are
performance knobs only; Poisson sampling told to the accountant; replayable randomness;
non-private diagnostics labelled; a ledger that recomputes epsilon).
"""

from dpbert.privacy.accounting import (
    LedgerStage,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    sampling_rate,
    schedule_event,
)
from dpbert.privacy.clipping import ClipStats, clipped_grad_sum, grad_sum
from dpbert.privacy.dp_step import data_mesh, default_optimizer, make_dp_train_step, make_train_step
from dpbert.privacy.noise import privatize
from dpbert.privacy.randomness import example_key, noise_key, step_key
from dpbert.privacy.sampling import PoissonBatch, physical_batch_size, poisson_sample
from dpbert.privacy.schedule import BatchSchedule, Stage

__all__ = [
    "BatchSchedule",
    "ClipStats",
    "LedgerStage",
    "PoissonBatch",
    "PrivacyLedger",
    "Stage",
    "calibrate_noise_multiplier",
    "clipped_grad_sum",
    "compute_epsilon",
    "data_mesh",
    "default_optimizer",
    "example_key",
    "grad_sum",
    "make_dp_train_step",
    "make_train_step",
    "noise_key",
    "physical_batch_size",
    "poisson_sample",
    "privatize",
    "sampling_rate",
    "schedule_event",
    "step_key",
]
