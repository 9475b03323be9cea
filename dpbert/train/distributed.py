"""Multi-host runs: `jax.distributed` start-up, per-process data, process-0-only writes.

`initialize(...)` starts JAX's own multi-host runtime. With no arguments it lets JAX detect
the cluster (Cloud TPU pods, SLURM, Open MPI, ... as `jax.distributed.initialize()` does);
with `coordinator_address`, `num_processes` and `process_id` it uses those (e.g. two local
processes on 127.0.0.1). On CPU, cross-process collectives go through gloo.

Per-process data: `local_batch` draws the step's Poisson sample (the same on every process:
it depends only on (run_key, step)) and returns this process's contiguous share of the
physical batch, reading only those rows from the token store; `global_array` assembles the
shares into one global `jax.Array` sharded over the mesh's batch axes, without moving data
between hosts. Because `dpbert.train.mesh.make_mesh` lays devices out process by process,
process p's share is exactly the rows its devices hold.

Guarantees: the global batch, and hence the update, is the one a single process computes
for the same step (tested with two processes on CPU); `is_primary()` is true on exactly
one process, which alone should write metrics, privacy.json and exports (Orbax writes
checkpoints collectively from every process).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dpbert.privacy.sampling import PoissonBatch, poisson_sample
from dpbert.train.mesh import batch_sharding


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
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
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
) -> tuple[PoissonBatch, np.ndarray]:
    """This process's share of step `step`'s Poisson sample and its rows of `store`
    (anything indexable by an index array, e.g. a `TokenStore`); only those rows are read."""
    sample = poisson_sample(
        run_key, step, len(store), expected_batch_size, physical_batch_size,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    return sample, np.asarray(store[sample.indices])


def global_array(local: Any, mesh: Mesh) -> Any:
    """Assemble every process's rows (a pytree of host arrays, leading axis = this process's
    share) into global arrays split over the mesh's batch axes."""
    sharding = batch_sharding(mesh)
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local)
