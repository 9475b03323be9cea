"""Every stored unit is Poisson-sampled at q = B/N (N public), wherever it sits in the store.

Sampling only "the first N rows" would turn add-or-remove into replace-one: a record inserted
early pushes another out of range. These tests fail for such a sampler."""

import jax
import numpy as np
import pytest

from dpbert.config.plan import MAX_STORE_FACTOR, plan_recipe, public_dataset_size
from dpbert.config.recipe import load_recipe
from dpbert.privacy import physical_batch_size
from dpbert.privacy.accounting import overflow_probability
from dpbert.privacy.sampling import document_sample
from dpbert.train import distributed

N, B, STEPS = 200, 20, 1500  # q = 0.1; the store holds 2N rows
STORED = 2 * N
Q = B / N


def _counts(store_rows: int, key: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """Inclusion counts per row over STEPS steps of the trainer's sampler, and realized sizes."""
    store = np.arange(store_rows)
    physical = physical_batch_size(B, N, dataset_size_bound=STORED + 1)
    counts, sizes = np.zeros(store_rows), []
    for t in range(STEPS):
        sample, rows = distributed.local_batch(
            store, key, t, expected_batch_size=B, physical_batch_size=physical, dataset_size=N
        )
        counts[rows[~sample.is_padding]] += 1
        sizes.append(sample.realized_size)
    return counts, np.array(sizes)


@pytest.fixture(scope="module")
def sampled():
    key = jax.random.key(7)
    return _counts(STORED, key), _counts(STORED + 1, key)


def test_every_row_is_sampled_at_q_wherever_it_sits(sampled):
    (counts, sizes), _ = sampled
    sd = np.sqrt(STEPS * Q * (1 - Q))
    assert np.all(np.abs(counts - STEPS * Q) < 5 * sd), (counts.min(), counts.max())
    # Rows past N are sampled as often as the first N (a first-N sampler gives them 0).
    assert counts[N:].mean() == pytest.approx(counts[:N].mean(), abs=5 * sd / np.sqrt(N))
    # The realized batch is q times the store's size, not q * N = B.
    assert sizes.mean() == pytest.approx(Q * STORED, abs=5 * np.sqrt(STORED * Q * (1 - Q) / STEPS))


def test_inserting_a_record_first_changes_no_other_frequency(sampled):
    (before, _), (after, _) = sampled
    sd = np.sqrt(STEPS * Q * (1 - Q))
    # The record inserted at position 0 and every record it shifted are sampled at q; in
    # particular the last record, which a first-N sampler would push out (or keep out) of range.
    assert np.all(np.abs(after - STEPS * Q) < 5 * sd)
    assert abs(after[-1] - STEPS * Q) < 5 * sd and abs(before[-1] - STEPS * Q) < 5 * sd
    # Same law before and after: mean inclusion of the old records is unchanged.
    assert after[1:].mean() == pytest.approx(before.mean(), abs=5 * sd / np.sqrt(STORED))


def test_every_document_is_sampled():
    lengths = np.random.default_rng(0).integers(1, 6, size=STORED)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    physical = physical_batch_size(B, N, dataset_size_bound=STORED)
    counts = np.zeros(STORED)
    for t in range(STEPS):
        sample = document_sample(7, t, offsets, B, physical, 3, num_documents=N)
        counts[sample.documents[~sample.is_padding]] += 1
    sd = np.sqrt(STEPS * Q * (1 - Q))
    assert np.all(np.abs(counts - STEPS * Q) < 5 * sd), (counts.min(), counts.max())


def test_truncation_is_accounted_for_the_public_bound():
    """The physical batch covers a store at the bound, not only N rows."""
    physical = physical_batch_size(B, N, dataset_size_bound=STORED)
    assert overflow_probability(B, N, physical, dataset_size_bound=STORED) <= 1e-20
    assert physical > physical_batch_size(B, N)  # a store of 2N rows draws about 2B
    with pytest.raises(ValueError, match="dataset_size_bound"):
        overflow_probability(B, N, physical, dataset_size_bound=N - 1)


def _tiny(*overrides: str):
    return load_recipe(
        "recipes/tiny.yaml",
        ["schedule=[{steps: 200, expected_batch_size: 1024}]", "optimizer.warmup_steps=5", *overrides],
    )


def test_public_size_and_bound():
    declared = public_dataset_size(_tiny(), 202_033)
    assert (declared.n, declared.source, declared.bound) == (180_000, "declared", int(MAX_STORE_FACTOR * 180_000))
    rounded = public_dataset_size(_tiny("privacy.dataset_size=null"), 202_033)
    assert (rounded.n, rounded.source) == (200_000, "rounded")
    with pytest.raises(
        ValueError, match=r"more training sequences than the public bound 190000 \(privacy.dataset_size_bound\)"
    ):
        public_dataset_size(_tiny("privacy.dataset_size_bound=190000"), 202_033)
    with pytest.raises(ValueError, match=r"public bound 225000 \(1.25 x N\)"):
        public_dataset_size(_tiny(), 230_000)
    with pytest.raises(ValueError, match="exceeds the 100000 training sequences"):
        public_dataset_size(_tiny(), 100_000)


def test_plan_with_declared_n_needs_no_store():
    """With a declared N the plan is a function of the recipe alone: the store's count only checks it."""
    recipe = _tiny()
    without = plan_recipe(recipe).ledger.to_dict()
    with_store = plan_recipe(recipe, 202_033).ledger.to_dict()
    assert without == with_store
    assert without["dataset_size"] == 180_000 and without["dataset_size_bound"] == 225_000
    assert without["stages"][0]["physical_batch_size"] > 1024 * MAX_STORE_FACTOR
