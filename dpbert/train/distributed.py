"""Multi-host runs: `jax.distributed` start-up, per-process data, process-0-only writes.

`initialize(...)` starts JAX's multi-host runtime (auto-detected, or from an explicit coordinator
address, process count and id; gloo on CPU). `local_batch` draws the step's Poisson sample (the
same on every process: it depends only on (run_key, step)) and reads only this process's
contiguous share of rows; `global_array` assembles the shares into one global `jax.Array`
without moving data between hosts.

Guarantees: the global batch, and hence the update, is the one a single process computes for the
same step (tested with two processes on CPU); `is_primary()` is true on exactly one process, which
alone writes metrics, privacy.json and exports (Orbax checkpoints are written collectively).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from dpbert.privacy.sampling import DocumentBatch, PoissonBatch, document_sample, poisson_sample
from dpbert.train.mesh import batch_sharding, replicated


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
) -> None:
    """Start jax.distributed: auto-detected when no argument is given, else explicit.

    Must run before any other JAX call that touches devices. Explicit mode needs all of
    coordinator_address ("host:port"), num_processes and process_id."""
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise ValueError(
            "distributed: give all of coordinator_address, num_processes and process_id, or none "
            f"(auto-detect); got {coordinator_address=}, {num_processes=}, {process_id=}"
        )
    if num_processes is not None and not 0 <= process_id < num_processes:  # type: ignore[operator]
        raise ValueError(f"distributed: process_id must be in [0, {num_processes}), got {process_id}")
    # CPU processes exchange collectives through gloo (the TPU/GPU backends bring their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )


def is_primary() -> bool:
    """True on the one process that writes metrics, the ledger file and exports."""
    return jax.process_index() == 0


def local_batch(
    store: Any,
    run_key: jax.Array,
    step: int,
    *,
    expected_batch_size: int,
    physical_batch_size: int,
    padded_batch_size: int | None = None,
    dataset_size: int | None = None,
) -> tuple[PoissonBatch, np.ndarray]:
    """This process's share of step `step`'s Poisson sample and its rows of `store`
    (anything indexable by an index array, e.g. a `TokenStore`); only those rows are read.

    The sample is truncated at `physical_batch_size` (the size the privacy ledger records),
    then padded with padding rows (index 0, `is_padding` True) to `padded_batch_size`
    (default: no padding), the rows the compiled step takes; the padded size must divide
    evenly over the processes. Padding never changes which examples are sampled, so the
    sample, the ledger and the update do not depend on the number of devices or processes.
    Every row of `store` is sampled at q = expected_batch_size / dataset_size (`dataset_size`:
    the public N, default the store's row count)."""
    padded, share = _process_share(physical_batch_size, padded_batch_size)
    n = len(store) if dataset_size is None else dataset_size
    full = poisson_sample(run_key, step, n, expected_batch_size, physical_batch_size, stored_units=len(store))
    indices = np.zeros(padded, dtype=full.indices.dtype)
    indices[:physical_batch_size] = full.indices
    is_padding = np.ones(padded, dtype=bool)
    is_padding[:physical_batch_size] = full.is_padding
    sample = dataclasses.replace(full, indices=indices[share], is_padding=is_padding[share])
    return sample, np.asarray(store[sample.indices])


def _process_share(physical_batch_size: int, padded_batch_size: int | None) -> tuple[int, slice]:
    """(padded rows of the compiled step, this process's slice of them): the physical batch padded
    to `padded_batch_size` (default: no padding), which must divide evenly over the processes."""
    padded = physical_batch_size if padded_batch_size is None else padded_batch_size
    count, index = jax.process_count(), jax.process_index()
    if padded < physical_batch_size or padded % count:
        raise ValueError(
            f"padded_batch_size={padded} must be >= physical_batch_size={physical_batch_size} and "
            f"divisible by the {count} processes"
        )
    return padded, slice(index * (padded // count), (index + 1) * (padded // count))


def local_document_batch(
    store: Any,
    run_key: jax.Array,
    step: int,
    *,
    document_offsets: np.ndarray,
    num_documents: int,
    expected_batch_size: int,
    physical_batch_size: int,
    max_sequences_per_document: int,
    padded_batch_size: int | None = None,
) -> tuple[DocumentBatch, np.ndarray]:
    """`local_batch` with documents as units (`dpbert.privacy.sampling.document_sample`): this
    process's share of the step's document sample, padded with padding documents to
    `padded_batch_size`, and its rows [documents, max_sequences_per_document, seq_len] (only the
    taken sequences are read; unused slots read row 0 and are masked by `sequence_padding`)."""
    padded, share = _process_share(physical_batch_size, padded_batch_size)
    full = document_sample(
        run_key,
        step,
        document_offsets,
        expected_batch_size,
        physical_batch_size,
        max_sequences_per_document,
        num_documents=num_documents,
    )
    cap = max_sequences_per_document
    fields = {
        "indices": (np.zeros((padded, cap), np.int64), full.indices),
        "sequence_padding": (np.ones((padded, cap), bool), full.sequence_padding),
        "is_padding": (np.ones(padded, bool), full.is_padding),
        "documents": (np.zeros(padded, np.int64), full.documents),
    }
    out = {}
    for name, (buffer, value) in fields.items():
        buffer[:physical_batch_size] = value
        out[name] = buffer[share]
    sample = dataclasses.replace(full, **out)
    rows = np.asarray(store[np.where(sample.sequence_padding, 0, sample.indices)])
    return sample, rows


def global_array(local: Any, mesh: Mesh) -> Any:
    """Assemble every process's rows (a pytree of host arrays, leading axis = this process's
    share) into global arrays split over the mesh's batch axes."""
    sharding = batch_sharding(mesh)
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local)


def replicate(local: Any, mesh: Mesh) -> Any:
    """Host arrays that are the same on every process as global arrays replicated over `mesh`."""
    sharding = replicated(mesh)
    return jax.tree_util.tree_map(lambda x: from_host(x, sharding), local)


def from_host(x: Any, sharding: Any) -> jax.Array:
    """A global array with `sharding` from a host array whose full value every process holds;
    each device receives only its shard."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def host_copy(tree: Any) -> Any:
    """The full value of every (possibly sharded, multi-process) array of `tree` as numpy, on
    every process. Collective: every process must call it."""
    if jax.process_count() == 1:
        return jax.device_get(tree)

    return multihost_utils.process_allgather(tree, tiled=True)


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on at least one (collective; e.g. a SIGTERM
    that reached only some hosts stops all of them at the same step)."""
    if jax.process_count() == 1:
        return flag

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
