"""LoRA (Hu et al. 2021) on the encoder's dense layers, and its merge into plain weights.

`add_lora(model, LoRAConfig(rank=8, alpha=16, targets=("query", "value")), rngs)` replaces each
target `nnx.Linear` of the stacked encoder layer by `LoRALinear`: y = x W + b + (alpha/rank)(x A) B,
A uniform(+-1/sqrt(d_in)) (PEFT's default), B zero, so the model is unchanged at initialisation;
each layer has its own A and B. `merge_lora(model)` folds them back into plain `nnx.Linear`
layers, which export under the usual Hugging Face names (outputs equal up to 1e-5).

Guarantees: the factors are ordinary `nnx.Param` leaves whose paths end in `lora_a` / `lora_b`
(`is_lora_path`), so per-example clipping over the params pytree clips them with everything else
trained; both enter linearly, so ghost clipping covers them as two dense taps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# Target name -> the sub-layer's path inside a BERT layer (`dpbert.model.bert.BertLayer`).
TARGETS: dict[str, tuple[str, ...]] = {
    "query": ("attention", "self", "query"),
    "key": ("attention", "self", "key"),
    "value": ("attention", "self", "value"),
    "attention_output": ("attention", "output", "dense"),
    "intermediate": ("intermediate", "dense"),
    "output": ("output", "dense"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Rank r, scale numerator alpha (the update is scaled by alpha / r) and target sub-layers."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("query", "value")

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank: expected an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha: expected a positive number, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if not self.targets or unknown or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets: expected distinct names among {list(TARGETS)}, got {list(self.targets)}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


Record = Callable[[str, jax.Array, jax.Array], jax.Array]


def _unrecorded(part: str, output: jax.Array, inputs: jax.Array) -> jax.Array:
    return output


class LoRALinear(nnx.Module):
    """A pretrained `nnx.Linear` (`base`) plus a low-rank update scaled by `scale`."""

    def __init__(self, base: nnx.Linear, lora_a: jax.Array, lora_b: jax.Array, scale: float):
        self.base = base
        self.lora_a = nnx.Param(lora_a)
        self.lora_b = nnx.Param(lora_b)
        self.scale = scale

    def __call__(self, x: jax.Array, record: Record = _unrecorded) -> jax.Array:
        """y = x W + b + scale * (x A) B. `record(part, output, input) -> output` sees each of the
        three products ("base", "lora_a": x -> x A, "lora_b": x A -> (x A) B) as it is computed
        (the ghost-clipping taps, `dpbert.model.ghost`); the default returns the output as is."""
        y = record("base", self.base(x), x)
        dtype = y.dtype
        x = x.astype(dtype)
        u = record("lora_a", x @ self.lora_a[...].astype(dtype), x)
        update = record("lora_b", u @ self.lora_b[...].astype(dtype), u)
        return y + update * jnp.asarray(self.scale, dtype)

    def merged_kernel(self) -> jax.Array:
        """W + scale * A B (float32, same shape as the base kernel, layer axis included)."""
        delta = jnp.einsum("...ir,...ro->...io", self.lora_a[...], self.lora_b[...])
        return self.base.kernel[...] + self.scale * delta


def _encoder_layer(model: Any) -> nnx.Module:
    bert = getattr(model, "bert", model)
    return bert.encoder.layer


def _parent_and_name(layer: nnx.Module, path: tuple[str, ...]) -> tuple[nnx.Module, str]:
    parent = layer
    for name in path[:-1]:
        parent = getattr(parent, name)
    return parent, path[-1]


def add_lora(model: Any, config: LoRAConfig, rngs: nnx.Rngs) -> Any:
    """Wrap the target dense layers of `model`'s encoder (a dpbert BERT, in place) with LoRA;
    returns the model. Raises ValueError if a target already carries LoRA."""
    layer = _encoder_layer(model)
    for target in config.targets:
        parent, name = _parent_and_name(layer, TARGETS[target])
        base = getattr(parent, name)
        if not isinstance(base, nnx.Linear):
            raise ValueError(f"lora.targets: {target} is already a {type(base).__name__}, expected nnx.Linear")
        kernel = base.kernel[...]  # [L, d_in, d_out]
        *lead, d_in, d_out = kernel.shape
        bound = 1.0 / d_in**0.5
        a = jax.random.uniform(rngs.params(), (*lead, d_in, config.rank), jnp.float32, -bound, bound)
        b = jnp.zeros((*lead, config.rank, d_out), jnp.float32)
        setattr(parent, name, LoRALinear(base, a, b, config.scale))
    return model


def lora_layers(model: Any) -> Iterator[tuple[nnx.Module, str, LoRALinear]]:
    """(parent, attribute name, LoRALinear) for every LoRA layer of the model's encoder."""
    layer = _encoder_layer(model)
    for path in TARGETS.values():
        parent, name = _parent_and_name(layer, path)
        module = getattr(parent, name)
        if isinstance(module, LoRALinear):
            yield parent, name, module


def merge_lora(model: Any) -> Any:
    """Fold every LoRA update into its base kernel and put the plain `nnx.Linear` back (in place);
    returns the model. A model without LoRA is returned unchanged."""
    for parent, name, module in list(lora_layers(model)):
        base = module.base
        base.kernel[...] = module.merged_kernel()
        setattr(parent, name, base)
    return model


def is_lora_path(path: tuple[Any, ...]) -> bool:
    """True for the path of a LoRA factor in a params tree."""
    return str(path[-1]) in ("lora_a", "lora_b")
