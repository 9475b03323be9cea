"""Exact per-example clipping without per-example gradients ("ghost" norms + book-keeping), for any
loss that exposes taps: the DP core's side of ghost clipping, model-free.

For every layer whose parameters enter linearly, the per-example gradient is a^T g (the layer's
input and the gradient at its output, from the perturbation trick); its squared norm is computed as
a ghost norm or from the instantiated product, chosen statically per layer shape
(`dense_layer_mode`), and the clipped sum is one weighted contraction per layer.

Guarantees: the same clipped sum as vmap clipping (`dpbert.privacy.clipping`) to float tolerance,
every example's contribution at most C (norms in float32 at full precision, rule 8 of
`dpbert.privacy`). The derivation and the tap protocol: docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from dpbert.privacy.clipping import ClipStats, clip_scale, example_keys, scan_microbatches

Path = tuple[Any, ...]
_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
LAYER_MODES = ("mixed", "ghost", "instantiate")


# ---------------------------------------------------------------------------- the interface


@dataclasses.dataclass(frozen=True)
class Dense:
    """y = a @ kernel (+ bias): input a [..., d_in], output [..., d_out]; the kernel is stored
    [d_in, d_out], or [d_out, d_in] when `transposed` (a decoder reading an embedding table).
    `mode` picks how the kernel is clipped ("mixed", "ghost", "instantiate": `dense_layer_mode`);
    speed and memory only, the result is the same."""

    kernel: Path
    bias: Path | None = None
    transposed: bool = False
    mode: str = "mixed"

    def __post_init__(self) -> None:
        if self.mode not in LAYER_MODES:
            raise ValueError(f"Dense.mode: expected one of {LAYER_MODES}, got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class ScaleBias:
    """y = xhat * scale + bias elementwise over the last axis (LayerNorm's affine part):
    input xhat [..., d] (the normalized input), output [..., d]; either parameter may be None."""

    scale: Path | None
    bias: Path | None = None


@dataclasses.dataclass(frozen=True)
class Bias:
    """y = x + bias over the last axis (an output bias): no input, output [..., d]."""

    bias: Path


@dataclasses.dataclass(frozen=True)
class Lookup:
    """y = table[ids]: input int ids [...], output [..., d] (an embedding lookup). Tables with
    no more rows than the example has ids get per-example row gradients (one-hot), others a
    scatter of the output gradients."""

    table: Path


@dataclasses.dataclass(frozen=True)
class Positions:
    """Position embeddings, output [..., L, d]. Input None: y[..., l, :] = table[l] for l < L,
    the leading axes (e.g. the sequences of a document) all adding to the same rows. Input int
    position ids [..., L]: y = table[ids], clipped exactly as a `Lookup` of those ids."""

    table: Path


TapKind = Dense | ScaleBias | Bias | Lookup | Positions


@dataclasses.dataclass(frozen=True)
class TapGroup:
    """Taps (name -> kind) whose parameter paths are full paths in params (`stacked_at` None),
    or, for a stack of layers, paths inside one layer under the prefix `stacked_at`: every
    parameter there has a leading layer axis, the group's tap inputs and outputs carry it too,
    and `scan(f, init, xs)` (`jax.lax.scan` by default; a model may pass its own) runs the
    core's per-layer norms and sums over it."""

    taps: Mapping[str, TapKind]
    stacked_at: Path | None = None
    scan: Callable[..., tuple[Any, Any]] = jax.lax.scan


@runtime_checkable
class GhostLoss(Protocol):
    """A per-example loss with taps (see the module docstring)."""

    def __call__(self, params: Any, example: Any, rng: jax.Array) -> jax.Array: ...

    def tap_groups(self, params: Any) -> Mapping[str, TapGroup]: ...

    def tapped(
        self, params: Any, example: Any, rng: jax.Array | None, z: Mapping[str, Any] | None
    ) -> tuple[jax.Array, Mapping[str, Any], Mapping[str, Any]]: ...


class Tape:
    """Records one group's taps during a traced forward: `tape(name, y, x)` stores the input x
    and the output y of tap `name` and returns y plus its perturbation (y itself when z is None;
    the perturbation broadcasts: a Bias tap's has the bias's shape)."""

    def __init__(self, z: Mapping[str, jax.Array] | None):
        self.z = z
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, jax.Array] = {}

    def __call__(self, name: str, y: jax.Array, x: Any = None) -> jax.Array:
        self.inputs[name] = x
        self.outputs[name] = y
        return y if self.z is None else y + self.z[name]


# ---------------------------------------------------------------------------- per-layer algebra
# Every function below takes float32 taps of a micro-batch of M examples: inputs `a` [M, T, d_in]
# and output gradients `g` [M, T, d_out].


def _flat(x: jax.Array) -> jax.Array:
    """[M, 1, ..., d] -> [M, T, d] float32 (T = product of the middle axes)."""
    return x.reshape(x.shape[0], -1, x.shape[-1]).astype(_F32)


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    """`jnp.einsum` in float32 at HIGHEST precision (an accelerator's default is TF32 or bf16)."""
    operands = tuple(x.astype(_F32) for x in operands)
    return jnp.einsum(spec, *operands, precision=_HIGHEST, preferred_element_type=_F32)


def dense_layer_mode(layer_mode: str, t: int, d_in: int, d_out: int, *, backend: str | None = None) -> str:
    """How a dense kernel's per-example norm and clipped sum are computed (static, per shape).

    "ghost": norm from the Gram matrices, sum_{t,s} (a_t . a_s)(g_t . g_s) (T^2 (d_in + d_out)
    flops per example), then the clipped sum as one weighted einsum (T d_in d_out, the cost of
    the non-private weight gradient). "instantiate": the per-example gradient a_i^T g_i
    (T d_in d_out per example: the non-private weight gradient's flops, once), whose norm and
    clip-weighted sum over examples are then passes of M d_in d_out. "mixed" takes, per layer,
    the cheaper one for `backend` (default: JAX's default backend):
    - accelerators, by flops: instantiate when 2 d_in d_out <= T^2 (d_in + d_out) (Bu et al.,
      mixed ghost clipping);
    - CPU: XLA CPU runs the batched per-example product slower than the plain weight gradient
      and streams M d_in d_out fresh floats through memory, so instantiate only when
      2 T (d_in + d_out) >= d_in d_out (at T = 128: every layer of BERT tiny and mini; ghost for
      every encoder layer of base). Measurements: docs/RESULTS.md, "Design measurements"."""
    if layer_mode != "mixed":
        return layer_mode
    if (backend or jax.default_backend()) == "cpu":
        return "instantiate" if 2 * t * (d_in + d_out) >= d_in * d_out else "ghost"
    return "instantiate" if 2 * d_in * d_out <= t * t * (d_in + d_out) else "ghost"


def _ghost_sq_norm(a: jax.Array, g: jax.Array) -> jax.Array:
    """||a_i^T g_i||_F^2 per example from the Gram matrices of a and g."""
    return jnp.sum(_einsum("mtd,msd->mts", a, a) * _einsum("mtd,msd->mts", g, g), axis=(1, 2))


def _kernels_transposed(a: jax.Array, g: jax.Array) -> bool:
    """Whether `_per_example_kernels` lays out a_i^T g_i as [M, d_out, d_in] (when d_in > d_out)."""
    return a.shape[2] > g.shape[2]


def _per_example_kernels(a: jax.Array, g: jax.Array) -> jax.Array:
    """Per-example kernel gradients a_i^T g_i, laid out [M, d_in, d_out], or [M, d_out, d_in]
    when d_in > d_out: XLA CPU computes the batched product with the larger dimension last
    faster (docs/RESULTS.md, "Design measurements")."""
    return _einsum("mti,mto->moi" if _kernels_transposed(a, g) else "mti,mto->mio", a, g)


def _weighted_outer(a: jax.Array, g: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """sum_i w_i a_i^T g_i, [d_in, d_out] ([d_out, d_in] when `transposed`); w multiplies the
    smaller operand (fewer bytes moved)."""
    spec = "mti,mto->oi" if transposed else "mti,mto->io"
    if a.shape[2] <= g.shape[2]:
        return _einsum(spec, a * w[:, None, None], g)
    return _einsum(spec, a, g * w[:, None, None])


# Micro-batches up to this size sum per-example gradients as an unrolled chain of M
# multiply-adds (one fused elementwise loop: the fastest form on XLA CPU for M = 4); larger ones
# as one [M] x [M, N] dot. The unrolled chain made the program, its compile time and its compile
# memory grow linearly with M (one multiply-add per example per per-example tensor, ~35 tensors
# for tiny BERT): the tiny recipe's DP step at micro-batch 256 took 2.5x the compile seconds
# and memory of micro-batch 16, and at 1,024 it went past 9 GB resident before the compile ended.
_UNROLL_MAX = 8


def _weighted_example_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    """sum_i w_i x_i over the leading (example) axis: unrolled for M <= _UNROLL_MAX, else one dot
    (its program size does not depend on M)."""
    m = x.shape[0]
    w, x = w.astype(_F32), x.astype(_F32)
    if m <= _UNROLL_MAX:
        return sum((w[i] * x[i] for i in range(1, m)), w[0] * x[0])
    return jnp.matmul(w, x.reshape(m, -1), precision=_HIGHEST, preferred_element_type=_F32).reshape(x.shape[1:])


def _sq(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(_F32)), axis=tuple(range(1, x.ndim)))


def _where_kept(keep: jax.Array, x: jax.Array) -> jax.Array:
    """x with the rows of dropped examples set to exactly 0 (0 * NaN would still be NaN)."""
    return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


# ---------------------------------------------------------------------------- per-tap rules


def _param_path(path: tuple[Any, ...]) -> Path:
    return tuple(k.key if hasattr(k, "key") else k.idx for k in path if hasattr(k, "key") or hasattr(k, "idx"))


def _tap_params(tap: TapKind) -> list[Path]:
    if isinstance(tap, Dense):
        return [tap.kernel] + ([] if tap.bias is None else [tap.bias])
    if isinstance(tap, ScaleBias):
        return [p for p in (tap.scale, tap.bias) if p is not None]
    if isinstance(tap, Bias):
        return [tap.bias]
    if isinstance(tap, Lookup | Positions):
        return [tap.table]
    raise ValueError(f"tap kind: expected one of Dense, ScaleBias, Bias, Lookup, Positions, got {type(tap).__name__}")


@dataclasses.dataclass(frozen=True)
class _Group:
    """A checked `TapGroup`: its parameters' shapes (one layer's, for a stack) and its tied
    pairs (table path -> (Lookup tap, transposed Dense tap))."""

    spec: TapGroup
    shapes: dict[Path, tuple[int, ...]]
    tied: dict[Path, tuple[str, str]]

    @property
    def stacked(self) -> bool:
        return self.spec.stacked_at is not None

    def full(self, path: Path) -> Path:
        return (*self.spec.stacked_at, *path) if self.stacked else path


def _plan(loss: GhostLoss, params: Any) -> dict[str, _Group]:
    """The loss's tap groups, checked against params: every parameter covered exactly once (a
    tied Lookup + transposed Dense pair excepted), every tapped path a parameter."""
    groups = loss.tap_groups(params)
    leaves = {_param_path(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    owners: dict[Path, list[tuple[str, str, Path, TapKind]]] = {}
    shapes: dict[str, dict[Path, tuple[int, ...]]] = {}
    for group_name, spec in groups.items():
        if not isinstance(spec, TapGroup):
            raise ValueError(f"tap_groups()[{group_name!r}]: expected a TapGroup, got {type(spec).__name__}")
        prefix = () if spec.stacked_at is None else tuple(spec.stacked_at)
        shapes[group_name] = {}
        for name, tap in spec.taps.items():
            for rel in _tap_params(tap):
                path = (*prefix, *rel)
                if path not in leaves:
                    raise ValueError(f"tap {group_name}/{name}: {'/'.join(map(str, path))} is not a parameter")
                shapes[group_name][rel] = leaves[path][1:] if spec.stacked_at is not None else leaves[path]
                owners.setdefault(path, []).append((group_name, name, rel, tap))
    tied: dict[str, dict[Path, tuple[str, str]]] = {name: {} for name in groups}
    for path, users in owners.items():
        if len(users) == 1:
            continue
        by_kind = {type(tap): (group, name, rel, tap) for group, name, rel, tap in users}
        lookup, dense = by_kind.get(Lookup), by_kind.get(Dense)
        if len(users) == 2 and lookup and dense and lookup[0] == dense[0] and dense[3].transposed:
            tied[lookup[0]][lookup[2]] = (lookup[1], dense[1])
            continue
        raise ValueError(
            f"{'/'.join(map(str, path))} is tapped by {', '.join(f'{g}/{n}' for g, n, _, _ in users)}: a parameter "
            "has one tap, or a Lookup and a transposed Dense (a tied decoder) in the same group"
        )
    missing = ["/".join(map(str, p)) for p in leaves if p not in owners]
    if missing:
        raise ValueError(f"ghost clipping: parameters without a tap would escape clipping: {missing}")
    return {name: _Group(spec, shapes[name], tied[name]) for name, spec in groups.items()}


def _dense_instantiated(tap: Dense, a: jax.Array, g: jax.Array, tied: bool) -> bool:
    # A tied decoder's kernel is a whole table: never per example.
    return not tied and dense_layer_mode(tap.mode, a.shape[1], a.shape[2], g.shape[2]) == "instantiate"


def _lookup_instantiated(ids: jax.Array, n_rows: int) -> bool:
    return n_rows <= ids.shape[1]


def _group_sq_norms(
    group: _Group, inputs: Mapping[str, Any], grads: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[Path, jax.Array]]:
    """(squared norm [M] of the group's part of each example's gradient, the per-example
    gradients it was computed from, keyed by the path inside the group: biases, scales,
    small tables' rows, instantiated kernels laid out as `_per_example_kernels`)."""
    total: jax.Array | float = 0.0
    per_example: dict[Path, jax.Array] = {}
    tied_dense = {dense for _, dense in group.tied.values()}
    for name, tap in group.spec.taps.items():
        g = grads[name]
        m = g.shape[0]
        if isinstance(tap, Dense):
            a, g = _flat(inputs[name]), _flat(g)
            if tap.bias is not None:
                per_example[tap.bias] = jnp.sum(g, axis=1)
            if _dense_instantiated(tap, a, g, name in tied_dense):
                per_example[tap.kernel] = _per_example_kernels(a, g)
            else:
                total += _ghost_sq_norm(a, g)
        elif isinstance(tap, ScaleBias):
            a, g = _flat(inputs[name]), _flat(g)
            if tap.scale is not None:
                per_example[tap.scale] = jnp.sum(g * a, axis=1)
            if tap.bias is not None:
                per_example[tap.bias] = jnp.sum(g, axis=1)
        elif isinstance(tap, Bias):
            per_example[tap.bias] = jnp.sum(_flat(g), axis=1)
        elif isinstance(tap, Lookup) or inputs[name] is not None:  # a Lookup, or Positions with ids
            ids, g = inputs[name].reshape(m, -1), _flat(g)
            n_rows = group.shapes[tap.table][0]
            if _lookup_instantiated(ids, n_rows):
                per_example[tap.table] = _einsum("mtk,mth->mkh", jax.nn.one_hot(ids, n_rows, dtype=_F32), g)
            else:
                # Each row receives the sum of its tokens' gradients: add every token's gradient at
                # its id's first position (a T x T id comparison and a scatter; the T^2 d Gram of g
                # it replaces took 1.6x longer on CPU for tiny BERT).
                first = jnp.argmax(ids[:, :, None] == ids[:, None, :], axis=2)
                total += _sq(jnp.zeros_like(g).at[jnp.arange(m)[:, None], first].add(g))
        else:  # Positions: row l receives the gradients at position l of every leading index.
            total += _sq(jnp.sum(g.reshape(m, -1, *g.shape[-2:]).astype(_F32), axis=1))
    for lookup, dense in group.tied.values():
        ids = inputs[lookup].reshape(grads[lookup].shape[0], -1)
        g, x, e = _flat(grads[lookup]), _flat(inputs[dense]), _flat(grads[dense])
        e_at_ids = jnp.take_along_axis(e, ids[:, None, :], axis=2)  # [M, P, T]: e_p[id_t]
        total += 2.0 * jnp.sum(e_at_ids * _einsum("mph,mth->mpt", x, g), axis=(1, 2))
    return total + sum(_sq(x) for x in per_example.values()), per_example


def _group_weighted_sums(
    group: _Group,
    inputs: Mapping[str, Any],
    grads: Mapping[str, jax.Array],
    w: jax.Array,
    per_example: Mapping[Path, jax.Array],
) -> dict[Path, jax.Array]:
    """sum_i w_i grad_i of the group's parameters (float32), keyed by the path inside the group."""
    out = {path: _weighted_example_sum(x, w) for path, x in per_example.items()}

    def add(path: Path, x: jax.Array) -> None:
        out[path] = out[path] + x if path in out else x

    tied_dense = {dense for _, dense in group.tied.values()}
    for name, tap in group.spec.taps.items():
        g = grads[name]
        if isinstance(tap, Dense):
            a, g = _flat(inputs[name]), _flat(g)
            if not _dense_instantiated(tap, a, g, name in tied_dense):
                add(tap.kernel, _weighted_outer(a, g, w, tap.transposed))
            elif _kernels_transposed(a, g) != tap.transposed:
                out[tap.kernel] = out[tap.kernel].T
        elif isinstance(tap, Lookup) or (isinstance(tap, Positions) and inputs[name] is not None):
            ids, g = inputs[name].reshape(g.shape[0], -1), _flat(g)
            shape = group.shapes[tap.table]
            if not _lookup_instantiated(ids, shape[0]):
                g = g * w[:, None, None]
                add(tap.table, jnp.zeros(shape, _F32).at[ids.reshape(-1)].add(g.reshape(-1, g.shape[-1])))
        elif isinstance(tap, Positions):
            length = g.shape[-2]
            rows = jnp.sum((_flat(g) * w[:, None, None]).reshape(-1, length, g.shape[-1]), axis=0)
            add(tap.table, jnp.zeros(group.shapes[tap.table], _F32).at[:length].set(rows))
    return out


# ---------------------------------------------------------------------------- the clipped sum


def _sq_norms(
    plan: dict[str, _Group], inputs: Mapping[str, Any], grads: Mapping[str, Any], zero: jax.Array
) -> tuple[jax.Array, dict[str, dict[Path, jax.Array]]]:
    """(squared norm [M] of each example's whole gradient, per-example gradients per group;
    a stacked group's with their leading layer axis, from one scan over it)."""
    total, per_example = zero, {}
    for name, group in plan.items():
        if not group.stacked:
            part, per_example[name] = _group_sq_norms(group, inputs[name], grads[name])
            total = total + part
            continue

        def layer(total: jax.Array, taps: tuple[Any, Any], group: _Group = group):
            part, pe = _group_sq_norms(group, *taps)
            return total + part, pe

        # The carry starts from the other taps' total: it varies per device like them under shard_map.
        total, per_example[name] = group.spec.scan(layer, total, (inputs[name], grads[name]))
    return total, per_example


def _weighted_sums(
    plan: dict[str, _Group],
    inputs: Mapping[str, Any],
    grads: Mapping[str, Any],
    w: jax.Array,
    per_example: Mapping[str, Any],
    clean: Callable[[jax.Array], jax.Array],
) -> dict[Path, jax.Array]:
    """sum_i w_i grad_i for every parameter, keyed by its full path (float32). `clean` is applied
    to every float tap input, output gradient and per-example gradient ([M, ...]) first."""

    def cleaned(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: clean(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    out = {}
    for name, group in plan.items():
        if not group.stacked:
            sums = _group_weighted_sums(group, *cleaned((inputs[name], grads[name])), w, cleaned(per_example[name]))
        else:

            def layer(carry: None, taps: tuple[Any, Any, Any], group: _Group = group):
                return None, _group_weighted_sums(group, *cleaned(taps[:2]), w, cleaned(taps[2]))

            _, sums = group.spec.scan(layer, None, (inputs[name], grads[name], per_example[name]))
        out |= {group.full(path): x for path, x in sums.items()}
    return out


def _ghost_norms(
    loss: GhostLoss, plan: dict[str, _Group], params: Any, examples: Any, keys: jax.Array, like: jax.Array
):
    """(losses [M], squared gradient norms [M], per-example gradients, tap inputs, output
    gradients) of one micro-batch: one tapped forward and one backward to the tap outputs.
    `like` ([M], e.g. the padding mask) types the zero perturbations (see below)."""
    # Examples vmapped; a stacked group keeps its layer axis first, so the scans over layers
    # read its taps without a transpose.
    axes = {name: 1 if group.stacked else 0 for name, group in plan.items()}
    shapes = jax.eval_shape(
        jax.vmap(lambda p, e, k: loss.tapped(p, e, k, None)[2], in_axes=(None, 0, 0), out_axes=axes),
        params,
        examples,
        keys,
    )
    if set(shapes) != set(plan):
        raise ValueError(f"tapped(): output groups {sorted(shapes)} differ from tap_groups() {sorted(plan)}")
    for name, group in plan.items():
        if set(shapes[name]) != set(group.spec.taps):
            raise ValueError(
                f"tapped(): group {name!r} recorded taps {sorted(shapes[name])}, declared {sorted(group.spec.taps)}"
            )
    tapped = jax.vmap(lambda p, e, k, z: loss.tapped(p, e, k, z)[:2], in_axes=(None, 0, 0, axes), out_axes=(0, axes))
    # Zeros shaped like the taps but typed like `like`: under shard_map they vary per device,
    # so each device's output gradients stay its own examples' (not a sum over devices).
    z = {
        name: {tap: _zeros(like, shape, group.spec.taps[tap], group.stacked) for tap, shape in shapes[name].items()}
        for name, group in plan.items()
    }
    # Params are closed over: the backward pass stops at the layer outputs (no weight grads).
    losses, vjp, inputs = jax.vjp(lambda z: tapped(params, examples, keys, z), z, has_aux=True)
    (out_grads,) = vjp(jnp.ones_like(losses))
    sq_norms, per_example = _sq_norms(plan, inputs, out_grads, jnp.zeros_like(like, dtype=_F32))
    return losses, sq_norms, per_example, inputs, out_grads


def _zeros(like: jax.Array, shape: jax.ShapeDtypeStruct, tap: TapKind, stacked: bool) -> jax.Array:
    """The zero perturbation of one tap output [(layers,) M, ..., d]: [(layers,) M, d] for a Bias
    tap (broadcast over the output's other axes: its gradient is then summed over them)."""
    dims = shape.shape
    if isinstance(tap, Bias):
        lead = 2 if stacked else 1
        dims = (*dims[:lead], *(1,) * (len(dims) - lead - 1), dims[-1])
    return jnp.zeros_like(like, shape=dims, dtype=shape.dtype)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, GhostLoss):
        raise ValueError(
            f"loss_fn: the ghost clipping path needs a loss with taps (the GhostLoss interface of "
            f"dpbert.privacy.ghost_clipping), got {type(loss).__name__}; use clipping_method='vmap' for other losses"
        )


def ghost_sq_norms(loss: GhostLoss, params: Any, examples: Any, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(losses [M], squared norms [M] of each example's whole gradient) by ghost norms, example i
    with key keys[i]: the quantities `ghost_clipped_grad_sum` clips with (diagnostics, tests)."""
    _check_loss(loss)
    plan = _plan(loss, params)
    losses, sq_norms, *_ = _ghost_norms(loss, plan, params, examples, keys, jnp.zeros(keys.shape[:1], jnp.bool_))
    return losses, sq_norms


def ghost_clipped_grad_sum(
    loss: GhostLoss,
    params: Any,
    batch: Any,
    is_padding: jax.Array,
    rng: jax.Array,
    *,
    clip_norm: float,
    microbatch_size: int,
    position_offset: int | jax.Array = 0,
) -> tuple[Any, ClipStats]:
    """`clipping.clipped_grad_sum` by ghost norms and book-keeping (same arguments, same result
    to float tolerance, same guarantees); `loss` must be a `GhostLoss` whose taps cover every
    parameter (ValueError otherwise)."""
    _check_loss(loss)
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
    plan = _plan(loss, params)
    paths = [_param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]

    def one_microbatch(carry: tuple[dict[Path, jax.Array], ClipStats], xs: tuple[Any, jax.Array, jax.Array]):
        total, stats = carry
        examples, padding, index = xs
        keys = example_keys(rng, position_offset, index, microbatch_size)
        losses, sq_norms, per_example, inputs, out_grads = _ghost_norms(loss, plan, params, examples, keys, padding)
        keep, scale, stats = clip_scale(stats, jnp.sqrt(sq_norms), losses, padding, clip_norm)

        def weighted_sums(clean: Callable[[jax.Array], jax.Array]) -> dict[Path, jax.Array]:
            return _weighted_sums(plan, inputs, out_grads, scale, per_example, clean)

        # Every tap enters its example's squared norm multiplied by itself, so finite norms mean
        # finite taps, and a factor of 0 (padding, non-finite loss) then gives exact zeros. Only a
        # micro-batch with a non-finite norm pays for zeroing the dropped rows first (0 * NaN = NaN).
        # (Cleaning inside one weighted sum, each tree behind its own cond, compiled 15-30% faster
        # but ran 15-20% slower: the identity branches copy every tap.)
        sums = jax.lax.cond(
            jnp.all(jnp.isfinite(sq_norms)),
            lambda: weighted_sums(lambda x: x),
            lambda: weighted_sums(lambda x: _where_kept(keep, x)),
        )
        return ({k: total[k] + sums[k] for k in total}, stats), None

    leaves = jax.tree_util.tree_leaves(params)
    init_total = {p: jnp.zeros(x.shape, _F32) for p, x in zip(paths, leaves, strict=True)}
    total, stats = scan_microbatches(one_microbatch, init_total, batch, is_padding, microbatch_size)
    grads = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), [total[p] for p in paths])
    return grads, stats
