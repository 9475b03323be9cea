"""Poisson sampling of example indices (or documents), padded to a fixed physical batch.

Guarantees (rule 3 of `dpbert.privacy`): each of the S stored units joins step t's batch
independently with probability q = B/N, N the public dataset size, so adding or removing one
unit changes no other unit's inclusion; the realized size is Binomial(S, q) and the indices a
uniform subset of that size (exactly Poisson sampling), in O(k) memory. Batches are padded to
the static physical size with `is_padding`; a sample above it is truncated to a uniform subset,
and `physical_batch_size` keeps that below a bound for any store of at most the public bound M,
the accountant adding it to delta. The sample of step t is a pure function of (key, t, N, B,
physical size); process p gets slice p of the global batch. `document_sample` does the same for
documents, each contributing at most its declared number of sequences. Details: docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dpbert.privacy.accounting import overflow_probability, sampling_rate
from dpbert.privacy.randomness import DOCUMENT_SEQUENCES, SAMPLING, step_key

# Default per-step overflow bound: with 1e5 steps and epsilon 10 the truncation adds < 1e-11
# to delta, while the margin costs ~9.5 standard deviations (0.7% of B = 2M).
DEFAULT_OVERFLOW_PROBABILITY = 1e-20


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoissonBatch:
    """This process's share of one step's Poisson sample.

    indices: int64 [physical_batch_size // process_count], sorted real indices then padding (0).
    is_padding: bool, same shape. realized_size: size of the *global* sample after truncation
    (non-private: log it only as a labelled diagnostic). truncated: whether truncation occurred.
    """

    indices: np.ndarray
    is_padding: np.ndarray
    realized_size: int
    truncated: bool


def physical_batch_size(
    expected_batch_size: int,
    dataset_size: int,
    *,
    overflow_probability_bound: float = DEFAULT_OVERFLOW_PROBABILITY,
    multiple: int = 1,
    dataset_size_bound: int | None = None,
) -> int:
    """Smallest multiple of `multiple` with P[Binomial(M+1, q) > size] <= the bound (capped at M+1),
    q = B/N and M the public bound on the stored units (default N)."""
    if not 0 < overflow_probability_bound < 1:
        raise ValueError(f"overflow_probability_bound must be in (0, 1), got {overflow_probability_bound!r}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple!r}")
    sampling_rate(expected_batch_size, dataset_size)
    bound = dataset_size if dataset_size_bound is None else dataset_size_bound
    lo, hi = expected_batch_size, bound + 1
    # Binary search on the monotone tail; scipy's isf is unreliable this far out.
    while lo < hi:
        mid = (lo + hi) // 2
        overflow = overflow_probability(expected_batch_size, dataset_size, mid, dataset_size_bound=bound)
        if overflow <= overflow_probability_bound:
            hi = mid
        else:
            lo = mid + 1
    return -(-lo // multiple) * multiple


def _generator(key: jax.Array | int, step: int, stream: int = SAMPLING) -> np.random.Generator:
    """A numpy generator determined by (key, step, stream): fold_in(run_key, step) then `stream`."""
    if isinstance(key, int | np.integer):
        return np.random.default_rng([int(key), int(step), stream])
    k = jax.random.fold_in(step_key(key, step), stream)
    data = jax.random.key_data(k) if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) else k
    return np.random.default_rng(np.asarray(data, dtype=np.uint32).ravel().tolist())


def _distinct_uniform(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """k distinct integers uniform over [0, n) as a sorted int64 array (a uniform k-subset).

    The procedure only looks at which draws coincide, never at their values, so the result is
    invariant under relabelling [0, n) and hence uniform over subsets of its size."""
    out = np.empty(0, dtype=np.int64)
    while out.size < k:
        out = np.concatenate([out, rng.integers(0, n, size=k - out.size, dtype=np.int64)])
        out.sort()
        keep = np.ones(out.size, dtype=bool)
        np.not_equal(out[1:], out[:-1], out=keep[1:])
        out = out[keep]
    return out


def _uniform_subsets(rng: np.random.Generator, lengths: np.ndarray, cap: int) -> np.ndarray:
    """Row r: a uniform min(cap, lengths[r])-subset of [0, lengths[r]), sorted, padded with -1 to
    [R, cap]. Floyd's algorithm, one vectorised draw per column: at column i each row draws t
    uniform in [0, j] with j = n - k + i, and takes j instead when t is already taken; every
    k-subset then has probability 1 / C(n, k)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    k = np.minimum(lengths, cap)
    out = np.full((lengths.size, cap), -1, dtype=np.int64)
    for i in range(cap):
        j = np.maximum(lengths - k + i, 0)
        t = rng.integers(0, j + 1, dtype=np.int64)
        t = np.where(np.any(out[:, :i] == t[:, None], axis=1), j, t)
        out[:, i] = np.where(i < k, t, -1)
    big = np.iinfo(np.int64).max  # sorts the -1 padding last
    ordered = np.sort(np.where(out < 0, big, out), axis=1)
    return np.where(ordered == big, -1, ordered)


def poisson_sample(
    key: jax.Array | int,
    step: int,
    dataset_size: int,
    expected_batch_size: int,
    physical_batch_size: int,
    *,
    process_index: int = 0,
    process_count: int = 1,
    stored_units: int | None = None,
) -> PoissonBatch:
    """Step `step`'s Poisson sample of every stored unit (rule 3 of `dpbert.privacy`).

    Args:
      key: the run key (a jax PRNG key; the step's sampling key is fold_in(key, step)) or a seed.
      dataset_size: the public N; each unit is included independently at q = B / N.
      expected_batch_size: the public B.
      physical_batch_size: the static batch the step compiles for (padding beyond the sample).
      process_index, process_count: this process's share of the padded batch.
      stored_units: how many units the store holds (default N); every one of them is sampled.
    Returns:
      `PoissonBatch`: this process's indices, padding mask and the realized size."""
    q = sampling_rate(expected_batch_size, dataset_size)
    population = dataset_size if stored_units is None else stored_units
    if isinstance(population, bool) or not isinstance(population, int | np.integer) or population < 1:
        raise ValueError(f"stored_units must be an integer >= 1, got {stored_units!r}")
    if physical_batch_size < 1:
        raise ValueError(f"physical_batch_size must be >= 1, got {physical_batch_size!r}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, process_count={process_count}), got {process_index!r}")
    if physical_batch_size % process_count:
        raise ValueError(
            f"physical_batch_size={physical_batch_size} must be divisible by process_count={process_count}"
        )
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    rng = _generator(key, step)
    realized = int(rng.binomial(population, q))
    chosen = _distinct_uniform(rng, int(population), realized)
    truncated = realized > physical_batch_size
    if truncated:
        chosen = np.sort(rng.choice(chosen, size=physical_batch_size, replace=False))
    size = chosen.size
    indices = np.zeros(physical_batch_size, dtype=np.int64)
    indices[:size] = chosen
    is_padding = np.arange(physical_batch_size) >= size
    share = physical_batch_size // process_count
    part = slice(process_index * share, (process_index + 1) * share)
    return PoissonBatch(indices=indices[part], is_padding=is_padding[part], realized_size=size, truncated=truncated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DocumentBatch:
    """This process's share of one step's Poisson sample of documents.

    indices: int64 [physical documents // process_count, max_sequences_per_document], the store
    indices of each sampled document's taken sequences (0 in unused slots). sequence_padding:
    bool, same shape, True in unused slots (a short document, or a padding document).
    is_padding: bool [physical documents // process_count], True for padding documents.
    documents: int64, the document number of each row (0 for padding). realized_size: documents
    in the *global* sample after truncation (non-private diagnostic). truncated: whether the
    document sample was truncated at the physical size.
    """

    indices: np.ndarray
    sequence_padding: np.ndarray
    is_padding: np.ndarray
    documents: np.ndarray
    realized_size: int
    truncated: bool


def check_document_offsets(offsets: np.ndarray) -> np.ndarray:
    """`offsets` as int64 [D + 1] (document d = sequences offsets[d] .. offsets[d+1]-1), or
    ValueError: not starting at 0, decreasing, or with an empty document (a document without a
    sequence cannot be a unit of document-level DP: remove it from the corpus)."""
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or offsets.size < 2 or offsets.dtype.kind not in "iu":
        raise ValueError("document offsets: expected an integer array [num_documents + 1] with at least one document")
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0:
        raise ValueError(f"document offsets: must start at 0, got {offsets[0]}")
    lengths = np.diff(offsets)
    empty = np.flatnonzero(lengths <= 0)
    if empty.size:
        raise ValueError(
            f"document {int(empty[0])} has no sequence ({empty.size} empty document(s) in all): every document of "
            "document-level DP must contribute at least one sequence; remove empty documents from the corpus"
        )
    return offsets


def document_sample(
    key: jax.Array | int,
    step: int,
    document_offsets: np.ndarray,
    expected_batch_size: int,
    physical_batch_size: int,
    max_sequences_per_document: int,
    *,
    num_documents: int | None = None,
) -> DocumentBatch:
    """Step `step`'s Poisson sample of every stored document (rate expected_batch_size /
    num_documents) and up to `max_sequences_per_document` uniformly chosen sequences of each.

    `num_documents` (default: the stored count) is the public N of q = B/N; every stored
    document is sampled whatever N is. `expected_batch_size` and `physical_batch_size` count
    documents."""
    offsets = check_document_offsets(document_offsets)
    stored = offsets.size - 1
    n = stored if num_documents is None else num_documents
    if n < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents!r}")
    if isinstance(max_sequences_per_document, bool) or max_sequences_per_document < 1:
        raise ValueError(f"max_sequences_per_document must be >= 1, got {max_sequences_per_document!r}")
    docs = poisson_sample(key, step, n, expected_batch_size, physical_batch_size, stored_units=stored)
    rows = docs.indices[: docs.realized_size]
    taken = _uniform_subsets(
        _generator(key, step, DOCUMENT_SEQUENCES), offsets[rows + 1] - offsets[rows], max_sequences_per_document
    )
    indices = np.zeros((physical_batch_size, max_sequences_per_document), dtype=np.int64)
    sequence_padding = np.ones((physical_batch_size, max_sequences_per_document), dtype=bool)
    indices[: docs.realized_size] = np.where(taken >= 0, offsets[rows][:, None] + taken, 0)
    sequence_padding[: docs.realized_size] = taken < 0
    return DocumentBatch(
        indices=indices,
        sequence_padding=sequence_padding,
        is_padding=docs.is_padding,
        documents=np.where(docs.is_padding, 0, docs.indices),
        realized_size=docs.realized_size,
        truncated=docs.truncated,
    )
