"""The pretraining train state: one frozen, registered pytree.

`params` and `opt_state` are the array leaves (what jit and Orbax see); `step` (the number
of completed steps) and `ledger` (the privacy ledger as canonical JSON text, or the
literal non-private record) are static metadata, so the state is hashable where it must be
and the ledger always travels with the arrays it describes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    """Arrays of the run after `step` completed steps, and the privacy ledger that covers them."""

    params: Any
    opt_state: Any
    step: int = dataclasses.field(metadata={"static": True})
    ledger_json: str = dataclasses.field(metadata={"static": True})

    def __post_init__(self) -> None:
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"TrainState.step: expected an integer >= 0, got {self.step!r}")
        try:
            json.loads(self.ledger_json)
        except (TypeError, ValueError):
            raise ValueError("TrainState.ledger_json: expected JSON text") from None

    @property
    def ledger(self) -> dict[str, Any]:
        return json.loads(self.ledger_json)

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


def ledger_text(ledger: dict[str, Any]) -> str:
    """Canonical JSON for a ledger dict (sorted keys), so equal ledgers compare equal as text."""
    return json.dumps(ledger, sort_keys=True)
