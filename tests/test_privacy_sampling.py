"""Poisson sampling: inclusion rate, batch-size law, determinism, hosts, truncation, scale."""

import itertools

import jax
import numpy as np
import pytest
from scipy import stats

from dpbert.privacy import physical_batch_size, poisson_sample
from dpbert.privacy.accounting import overflow_probability
from dpbert.privacy.sampling import document_sample

N, B, STEPS = 200, 20, 1500  # q = 0.1


@pytest.fixture(scope="module")
def draws():
    key = jax.random.key(42)
    phys = physical_batch_size(B, N)
    return [poisson_sample(key, t, N, B, phys) for t in range(STEPS)], phys


def test_inclusion_frequencies_match_q(draws):
    batches, _ = draws
    counts = np.zeros(N)
    for b in batches:
        real = b.indices[~b.is_padding]
        assert len(np.unique(real)) == real.size  # no duplicates within a step
        counts[real] += 1
    q = B / N
    # Each count ~ Binomial(STEPS, q) independently: chi-square with N degrees of freedom.
    chi2 = np.sum((counts - STEPS * q) ** 2 / (STEPS * q * (1 - q)))
    assert stats.chi2.sf(chi2, df=N) > 1e-3
    assert stats.chi2.cdf(chi2, df=N) > 1e-3  # not suspiciously uniform either


def test_realized_sizes_follow_binomial(draws):
    batches, _ = draws
    sizes = np.array([b.realized_size for b in batches])
    q = B / N
    assert sizes.mean() == pytest.approx(N * q, abs=4 * np.sqrt(N * q * (1 - q) / STEPS))
    # A fixed-size sampler (variance 0) or sampling with replacement fails this.
    assert sizes.var() == pytest.approx(N * q * (1 - q), rel=0.15)
    # Pearson chi-square of the size histogram against the Binomial(N, q) pmf.
    edges = np.arange(8, 33)
    observed = np.array(
        [np.sum(sizes <= edges[0])] + [np.sum(sizes == k) for k in edges[1:-1]] + [np.sum(sizes >= edges[-1])]
    )
    pmf = stats.binom(N, q)
    expected = STEPS * np.array([pmf.cdf(edges[0])] + [pmf.pmf(k) for k in edges[1:-1]] + [pmf.sf(edges[-1] - 1)])
    chi2 = np.sum((observed - expected) ** 2 / expected)
    assert stats.chi2.sf(chi2, df=len(edges) - 1) > 1e-3


def test_pairs_are_included_independently(draws):
    batches, _ = draws
    both = sum(bool(np.isin([3, 7], b.indices[~b.is_padding]).all()) for b in batches)
    q = B / N
    # P(both) = q^2 for independent inclusion; contiguous or correlated picks break this.
    assert both == pytest.approx(STEPS * q * q, abs=4 * np.sqrt(STEPS * q * q))


def test_same_key_and_step_replay_exactly():
    key = jax.random.key(0)
    a = poisson_sample(key, 17, 10_000, 100, 200)
    b = poisson_sample(key, 17, 10_000, 100, 200)
    c = poisson_sample(key, 18, 10_000, 100, 200)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.is_padding, b.is_padding)
    assert not np.array_equal(a.indices, c.indices)
    assert not np.array_equal(poisson_sample(jax.random.key(1), 17, 10_000, 100, 200).indices, a.indices)
    # Integer seeds are accepted too, and deterministic.
    np.testing.assert_array_equal(
        poisson_sample(5, 3, 1000, 10, 40).indices, poisson_sample(5, 3, 1000, 10, 40).indices
    )


def test_padding_is_static_shape_and_at_the_end():
    b = poisson_sample(jax.random.key(3), 0, 1000, 50, 120)
    assert b.indices.shape == (120,) and b.is_padding.shape == (120,) and b.indices.dtype == np.int64
    real = b.indices[~b.is_padding]
    assert real.size == b.realized_size and not b.truncated
    assert np.all(np.diff(real) > 0) and real.min() >= 0 and real.max() < 1000
    assert np.all(b.is_padding[b.realized_size :]) and not np.any(b.is_padding[: b.realized_size])


def test_processes_take_contiguous_shares_of_the_same_global_batch():
    key, args = jax.random.key(9), (4, 5000, 300, 400)
    whole = poisson_sample(key, *args)
    parts = [poisson_sample(key, *args, process_index=p, process_count=4) for p in range(4)]
    assert all(p.indices.shape == (100,) for p in parts)
    np.testing.assert_array_equal(np.concatenate([p.indices for p in parts]), whole.indices)
    np.testing.assert_array_equal(np.concatenate([p.is_padding for p in parts]), whole.is_padding)
    with pytest.raises(ValueError, match="process_count"):
        poisson_sample(key, 4, 5000, 300, 401, process_index=0, process_count=4)


def test_truncation_keeps_a_uniform_subset_of_the_cap():
    b = poisson_sample(jax.random.key(1), 0, 1000, 500, 100)  # realized ~500 > 100
    assert b.truncated and b.realized_size == 100 and not b.is_padding.any()
    assert len(np.unique(b.indices)) == 100


def test_physical_batch_size_bounds_overflow():
    for expected, n in ((1024, 500_000_000), (50, 1000), (65_536, 10_000_000)):
        p = physical_batch_size(expected, n, overflow_probability_bound=1e-12)
        assert overflow_probability(expected, n, p) <= 1e-12 < overflow_probability(expected, n, p - 1)
    assert physical_batch_size(1000, 10**6, multiple=64) % 64 == 0


def test_memory_is_independent_of_dataset_size():
    # N = 5e8 (the paper's scale): only O(B) arrays are built.
    b = poisson_sample(jax.random.key(0), 0, 500_000_000, 4096, physical_batch_size(4096, 500_000_000))
    real = b.indices[~b.is_padding]
    assert b.indices.nbytes < 100_000
    assert abs(real.size - 4096) < 6 * 64 and real.max() < 500_000_000
    assert len(np.unique(real)) == real.size


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="sampling_rate"):
        poisson_sample(0, 0, 100, 101, 200)
    with pytest.raises(ValueError, match="dataset_size"):
        poisson_sample(0, 0, 0, 1, 2)
    with pytest.raises(ValueError, match="physical_batch_size"):
        poisson_sample(0, 0, 100, 10, 0)


def test_within_document_choice_is_a_uniform_subset_of_the_cap():
    """Every document joins (rate 1); each of a 6-sequence document's C(6, 2) = 15 pairs is taken
    with probability 1/15: 7,680 draws, each pair's count within 5 binomial standard deviations
    (a choice biased to the first or last sequences, or a repeated sequence, fails)."""
    n_docs, length, cap = 512, 6, 2
    offsets = np.arange(n_docs + 1) * length
    counts = dict.fromkeys(itertools.combinations(range(length), cap), 0)
    for step in range(15):
        b = document_sample(jax.random.key(11), step, offsets, n_docs, n_docs, cap)
        assert b.realized_size == n_docs and not b.sequence_padding.any()
        for row in range(n_docs):
            pair = tuple(int(i) - int(offsets[b.documents[row]]) for i in b.indices[row])
            counts[pair] += 1  # a KeyError means an unsorted, repeated or out-of-document choice
    total, p = 15 * n_docs, 1 / len(counts)
    sd = np.sqrt(total * p * (1 - p))
    assert all(abs(c - total * p) < 5 * sd for c in counts.values()), counts
