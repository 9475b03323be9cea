"""dpbert.privacy: the DP-SGD core, model-agnostic.

It sees a pure `loss_fn(params, example, rng) -> scalar` and a params pytree, never a BERT.

- `clipped_grad_sum` (clipping): per-example clipped *sum*, micro-batched; sensitivity clip_norm.
- `privatize` (noise): Gaussian noise once on the global sum, divided by the expected batch size.
- `make_dp_train_step` / `make_train_step` (dp_step): jitted steps, optionally on a data mesh.
- `adam_bc` (adam_bc): DP-AdamBC, Adam's second moment less the noise variance (post-processing).
- `poisson_sample`, `physical_batch_size` (sampling): Poisson sampling padded to a static shape.
- `Stage`, `BatchSchedule` (schedule): the increasing batch-size schedule.
- `compute_epsilon`, `calibrate_noise_multiplier`, `PrivacyLedger` (accounting).
- `step_key`, `example_key`, `noise_key` (randomness): all of step t from fold_in(run_key, t).

The rules of the DP core (the one list; "rule N" anywhere in dpbert means this list; each
module's docstring says which it implements, and tests check them):

1. Clip every example's whole gradient to C, *sum*, add N(0, (sigma C)^2) once per step, divide
   by the public expected batch size, never by the realized one.
2. Micro-batch size, device count and accumulation are performance knobs only: the same update
   for any of them; noise once, on the global sum.
3. Poisson sampling of *every* stored unit at q = B/N (N public), told to the accountant as
   such; batches padded to a static physical size, the truncation beyond it accounted.
4. All randomness of step t comes from fold_in(run key, t): a resumed run replays the same step.
   The run key is a secret from the OS CSPRNG, never published, one per mechanism.
5. Only noised quantities are "private" outputs; loss and clip fractions on the private batch are
   labelled non-private, and nothing computed from private data without noise is released
   unless the user asks (and then the card says so).
6. The ledger travels with every checkpoint and export; epsilon is recomputable from it, and
   `verify` rebuilds it from the recipe.
7. The noise is the Gaussian the accountant assumes: a sampler's deviation is bounded below
   delta or added to it, and the release says which.
8. The clipping bound holds in the arithmetic run: norms, clip factors, the clipped sum and the
   noise in float32 at full precision whatever the compute dtype.
9. Nothing about the private data is assumed public (vocabulary, tokenizer folder, counts)
   unless the user declared it or dpbert made it public under DP and accounted it.
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
