"""Orbax checkpoints of a `TrainState` (pretraining, fine-tuning), with the privacy ledger beside the arrays.

Layout: `RUN_DIR/checkpoints/<step>/{state,meta}` (arrays; a JSON record with the format tag,
completed steps, the ledger and the fingerprints of what the arrays depend on).

Guarantees: saves are atomic and synchronous; a checkpoint is accepted only with this module's
format tag and the expected tree, else `ValueError` names the path; a folder whose files cannot be
read raises `DamagedCheckpointError`, so a resume can fall back to the one before it; a failed
restore leaves no Orbax read running; checkpoints written before the scanned layer layout are
restored exactly. Details: docs/INTERNALS.md ("dpbert.train.checkpoint").
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from dpbert.model.functional import stack_layers, unstack_layers
from dpbert.train.state import TrainState, ledger_text

FORMAT = "dpbert-pretrain-checkpoint/2"
# Written before the encoder's layers were stacked for the scan: per-layer arrays.
LEGACY_FORMAT = "dpbert-pretrain-checkpoint/1"


# How long a closing restore loop waits for its unfinished reads (a damaged local checkpoint's
# remaining reads end in milliseconds; a hung remote file system must not hang the run).
_DRAIN_TIMEOUT_S = 60.0


class DamagedCheckpointError(ValueError):
    """Checkpoint `step` (folder `path`) cannot be read: its metadata or arrays failed to restore.
    `reason` is the error's first line (of its root cause, when Orbax wraps a TensorStore error)."""

    def __init__(self, step: int, path: Path, what: str, reason: str):
        self.step, self.path, self.reason = step, path, reason
        super().__init__(f"checkpoint {path}: cannot {what} ({reason})")


def first_line(err: BaseException) -> str:
    """`Type: first line` of the innermost cause of `err` (Orbax wraps TensorStore's error, which
    names the file and the byte range, in a message that dumps the array's spec)."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first lets its unfinished tasks end (see the module docstring)."""

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            pending = [task for task in asyncio.all_tasks(self) if not task.done()]
            if pending:
                self.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_TIMEOUT_S))
                for task in pending:
                    if task.done() and not task.cancelled():
                        task.exception()  # retrieved: no "Task exception was never retrieved" at exit
        super().close()


@contextlib.contextmanager
def _draining_loops() -> Iterator[None]:
    """Orbax's event loops drain before they close while inside (it makes them with
    `asyncio.new_event_loop`, i.e. through the event loop policy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the policy API is deprecated from Python 3.14
        previous = asyncio.get_event_loop_policy()

        class Policy(asyncio.DefaultEventLoopPolicy):  # type: ignore[misc, valid-type]
            _loop_factory = _DrainingLoop

        asyncio.set_event_loop_policy(Policy())
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.set_event_loop_policy(previous)


def _map_states(tree: Any, fn: Any) -> Any:
    """`fn` applied to every nnx.State in `tree` (params, and each optimizer moment shaped like them)."""
    is_state = lambda x: isinstance(x, nnx.State)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: fn(x) if is_state(x) else x, tree, is_leaf=is_state)


class CheckpointStore:
    """Saves and restores `TrainState`s under one folder, keeping the newest `keep`."""

    def __init__(self, directory: str | Path, *, keep: int = 2):
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint folder {self.directory}: exists and is not a folder")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=False, cleanup_tmp_directories=True, create=True
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, newest first."""
        return sorted(self._manager.all_steps(), reverse=True)

    def set_aside(self, step: int) -> Path:
        """Rename the (damaged) folder of checkpoint `step` to `<step>.damaged` (`.damaged-2`, ... when
        taken), which Orbax does not take for a step: it is never restored, and saving `step` again
        writes a new folder. Returns the new path; call `reload` afterwards (on every process)."""
        source = self.directory / str(step)
        target = self.directory / f"{step}.damaged"
        n = 2
        while target.exists():
            target = self.directory / f"{step}.damaged-{n}"
            n += 1
        source.rename(target)
        self.reload()
        return target

    def reload(self) -> None:
        """Re-read the steps on disk (after another process set a folder aside)."""
        self._manager.reload()

    def save(self, state: TrainState, fingerprints: dict[str, str]) -> None:
        """Write `state` as checkpoint `state.step` (replacing nothing: a step is saved once)."""
        if state.step in self._manager.all_steps():
            return
        meta = {"format": FORMAT, "step": state.step, "ledger": state.ledger, "fingerprints": fingerprints}
        self._manager.save(
            state.step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": state.params, "opt_state": state.opt_state}),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, like: TrainState, fingerprints: dict[str, str], step: int | None = None) -> TrainState:
        """Restore checkpoint `step` (default: the latest) into the structure of `like`.

        `fingerprints` must equal the saved ones: resuming with another recipe shape or token
        store would not continue the same run.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.directory}")
        path = self.directory / str(step)
        try:
            with _draining_loops():
                meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:  # Orbax raises many types for unreadable folders; name the path.
            raise DamagedCheckpointError(step, path, "read its metadata", first_line(err)) from None
        if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, LEGACY_FORMAT):
            raise ValueError(f"checkpoint {path}: not a dpbert pretraining checkpoint (expected format {FORMAT!r})")
        legacy = meta["format"] == LEGACY_FORMAT
        if meta.get("step") != step:
            raise ValueError(f"checkpoint {path}: metadata says step {meta.get('step')!r}, folder says {step}")
        saved = meta.get("fingerprints", {})
        for key, value in fingerprints.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"checkpoint {path}: was written with a different {key} "
                    f"({saved.get(key)!r}, now {value!r}); resume with the run's own recipe and data"
                )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": like.params, "opt_state": like.opt_state})
        if legacy:
            arrays = self._restore_legacy(step, path, abstract)
        else:
            try:
                with _draining_loops():
                    arrays = self._manager.restore(
                        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
                    )["state"]
            except Exception as err:  # same reason as above
                raise DamagedCheckpointError(step, path, "restore its arrays", first_line(err)) from None
        return TrainState(
            params=arrays["params"],
            opt_state=arrays["opt_state"],
            step=step,
            ledger_json=ledger_text(meta["ledger"]),
        )

    def _restore_legacy(self, step: int, path: Path, abstract: Any) -> Any:
        """A checkpoint of the per-layer layout: restored as per-layer arrays, then stacked and
        placed as `abstract` says (its shardings)."""
        try:
            per_layer = _map_states(abstract, unstack_layers)
            with _draining_loops():
                arrays = self._manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(per_layer))
                )["state"]
            shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), abstract)
            placed = all(s is not None for s in jax.tree.leaves(shardings, is_leaf=lambda s: s is None))
            stack = lambda a: _map_states(a, stack_layers)  # noqa: E731
            return jax.jit(stack, out_shardings=shardings)(arrays) if placed else jax.jit(stack)(arrays)
        except Exception as err:  # Orbax raises many types; name the checkpoint and the layout
            raise ValueError(
                f"checkpoint {path}: written before the scanned-layer layout (format {LEGACY_FORMAT!r}, one "
                f"array per encoder layer) and its arrays could not be stacked into this model's layout "
                f"({type(err).__name__}: {err}); resume it with a dpbert release before the scan, or start anew"
            ) from None

    def close(self) -> None:
        self._manager.close()
