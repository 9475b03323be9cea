"""The device mesh of a run and the shardings of its train step.

A run's devices form a 2-D `jax.sharding.Mesh` with axes `data` x `fsdp` (the recipe's
`mesh` section; `data: -1` takes whatever the `fsdp` axis leaves). Every device works on
different examples, so the physical batch (leading axis) is split over BOTH axes
(`batch_sharding`); the `fsdp` axis additionally shards parameters and optimizer state at
rest (`state_shardings`): each leaf is split along its largest dimension that `fsdp`
divides, and stays replicated when none does. With `fsdp: 1` everything is replicated
(plain data parallelism).

Device order: the mesh is laid out data-major over `jax.devices()`, which lists devices
process by process, so process p's devices hold a contiguous block of batch rows, the
block that `poisson_sample(..., process_index=p, process_count=P)` returns to it.

Guarantees: shardings never change results (the DP step computes the same global clipped
sum; noise is drawn once on it); `make_mesh` uses every device given, or fails naming the
field whose value does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"
FSDP = "fsdp"
# The batch is split over every device: data-parallel replicas and FSDP shards alike.
BATCH_AXES = (DATA, FSDP)


def parse_mesh_flags(flags: Sequence[str]) -> dict[str, int]:
    """`["data=8", "fsdp=2"]` -> {"data": 8, "fsdp": 2}; ValueError naming a bad flag."""
    out: dict[str, int] = {}
    for flag in flags:
        name, sep, value = flag.partition("=")
        if not sep or name not in (DATA, FSDP):
            raise ValueError(f"--mesh {flag!r}: expected data=N or fsdp=N")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh {flag!r}: {value!r} is not an integer") from None
    return out


def make_mesh(*, data: int = -1, fsdp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A `data` x `fsdp` mesh over `devices` (default: all devices of all processes)."""
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    if fsdp < 1 or n % fsdp:
        raise ValueError(f"mesh field 'fsdp': {fsdp} must be a positive divisor of the {n} devices")
    if data == -1:
        data = n // fsdp
    if data < 1 or data * fsdp != n:
        raise ValueError(
            f"mesh field 'data': data x fsdp = {data} x {fsdp} must equal the {n} devices (or set data: -1)"
        )
    return Mesh(np.asarray(devs, dtype=object).reshape(data, fsdp), (DATA, FSDP))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over (all of them, in mesh order)."""
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (example) axis split over every device of the mesh."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def fsdp_spec(shape: Sequence[int], fsdp_size: int) -> P:
    """Shard the largest dimension divisible by `fsdp_size` over the fsdp axis (ties: the
    first); replicate leaves with no such dimension (scalars, odd-sized biases)."""
    if fsdp_size <= 1:
        return P()
    best = None
    for i, d in enumerate(shape):
        if d % fsdp_size == 0 and (best is None or d > shape[best]):
            best = i
    if best is None:
        return P()
    return P(*([None] * best + [FSDP]))


def state_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a params / optimizer-state pytree (arrays or ShapeDtypeStructs):
    FSDP-sharded when the mesh has an fsdp axis of size > 1, else replicated."""
    size = mesh.shape.get(FSDP, 1)
    return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, fsdp_spec(np.shape(x), size)), tree)


def bytes_per_device(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of `tree` under `shardings` (the largest shard of each leaf)."""
    total = 0
    for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings), strict=True):
        shard = s.shard_shape(tuple(np.shape(x)))
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total
