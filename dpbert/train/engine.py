"""The DP training engine: one loop for every task that trains with DP-SGD (or its non-private twin).

A task hands `run_loop` its step builder, its Poisson sampler, its plan and one secret-derived key
per stage, hooks (evaluation) and a checkpoint store; export is the task's.

Guarantees: resume replays the uninterrupted run exactly (step t uses `step_key(stage_key, t)`), so
nothing is spent twice; a damaged checkpoint costs a step range, not the run; SIGTERM checkpoints
and stops at a step boundary; the device is synced only at log, evaluation and checkpoint steps,
where a non-finite loss stops the run before anything is saved; training diagnostics are
labelled non-private. The details of each: docs/INTERNALS.md ("dpbert.train.engine").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax

from dpbert.config.plan import Plan
from dpbert.privacy import step_key
from dpbert.privacy.dp_step import StepFn
from dpbert.privacy.randomness import SECRET_FILE, RunSecret, run_secret
from dpbert.train import distributed
from dpbert.train.checkpoint import CheckpointStore, DamagedCheckpointError
from dpbert.train.metrics import MetricsLog, truncate_after
from dpbert.train.state import TrainState, ledger_text


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss."""


class NoRestorableCheckpointError(ValueError):
    """A resume found checkpoints but none of them restores (each is damaged)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One step's batch as the compiled step takes it: `batch` and `is_padding` (global arrays,
    leading axis = the compiled batch), `realized_size` the Poisson sample's size."""

    batch: Any
    is_padding: Any
    realized_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hook:
    """`fn(state)` after every `every`-th completed step except the last (the task evaluates the
    final state itself); what it returns, when not None, is written as a metrics record."""

    every: int
    fn: Callable[[TrainState], dict[str, Any] | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Checkpoints every `every` steps, at the end and on SIGTERM; `after_save(state)` runs on
    process 0 after each save (e.g. the ledger file beside the checkpoints)."""

    store: CheckpointStore
    fingerprints: dict[str, str]
    every: int
    after_save: Callable[[TrainState], None] = lambda state: None

    def save(self, state: TrainState) -> None:
        self.store.save(state, self.fingerprints)  # collective: every process writes its shards
        if distributed.is_primary():
            self.after_save(state)


class Progress(Protocol):
    """A progress bar (tqdm's interface)."""

    def update(self, n: int) -> Any: ...
    def set_postfix_str(self, s: str) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopResult:
    state: TrainState
    stopped: bool


def device_batch_size(physical: int, devices: int, microbatch_size: int) -> int:
    """Rows of the compiled step: `physical` rounded up to a multiple of devices x micro-batch
    (the extra rows are padding, never sampled)."""
    multiple = devices * microbatch_size
    return -(-physical // multiple) * multiple


def fingerprint(obj: Any) -> str:
    """A short hash of JSON data (what a checkpoint's arrays depend on)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def has_checkpoints(ckpt_dir: Path) -> bool:
    """Whether `ckpt_dir`, or a folder in it (one per run of a fine-tuning sweep), holds a step
    folder (the noise secret alone is not a checkpoint)."""
    if not ckpt_dir.is_dir():
        return False
    return any(
        p.name.isdigit() or (p.is_dir() and any(q.name.isdigit() for q in p.iterdir())) for p in ckpt_dir.iterdir()
    )


def secret_for_run(ckpt_dir: Path, *, resume: bool, supplied: str | os.PathLike[str] | None) -> RunSecret:
    """The run's secret, kept in `ckpt_dir` (see `dpbert.privacy.randomness.run_secret`); a resume
    whose checkpoints outlived their secret is refused, since it could not replay its steps."""
    path = ckpt_dir / SECRET_FILE
    if resume and has_checkpoints(ckpt_dir) and not path.exists():
        raise ValueError(
            f"{path}: missing; the checkpoints of this private run cannot be resumed without the "
            "secret they were trained with (start a new run in another --output-dir)"
        )
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return run_secret(path, reuse=resume, supplied=supplied)


def restore_or_init(
    checkpoints: CheckpointStore,
    *,
    resume: bool,
    like: tuple[Any, Any],
    init: Callable[[], tuple[Any, Any]],
    fingerprints: dict[str, str],
    plan: Plan,
    total_steps: int,
    metrics_paths: Iterable[Path] = (),
    log: Callable[[str], None] = print,
) -> TrainState:
    """The latest checkpoint restored into the structure (and shardings) of `like` = (params,
    opt_state) when resuming, else `init()`'s fresh (params, opt_state) at step 0. A restored
    state must be within `total_steps` and carry the plan's ledger for its steps; metrics
    records past it are dropped (a fresh start removes the files)."""
    primary = distributed.is_primary()
    if resume and checkpoints.latest_step() is not None:
        params, opt_state = like
        template = TrainState(params=params, opt_state=opt_state, step=0, ledger_json=ledger_text(plan.ledger_after(0)))
        state, damaged = _restore_newest_intact(checkpoints, template, fingerprints, log)
        if state.step > total_steps:
            raise ValueError(
                f"checkpoint at step {state.step} is past the recipe's {total_steps} steps; "
                "the schedule cannot shrink below the steps already taken"
            )
        if state.ledger != plan.ledger_after(state.step):
            raise ValueError(
                f"checkpoint {checkpoints.directory / str(state.step)}: its privacy ledger does not match this "
                "recipe's plan for the steps already taken (noise multiplier, batch sizes, delta or dataset "
                "changed); a resumed run must replay the same steps"
            )
        if damaged:
            _set_aside(checkpoints, damaged, log)
        if primary:
            for path in metrics_paths:
                truncate_after(path, state.step)
        if damaged:
            newest = max(err.step for err in damaged)
            replayed = f"step {newest}" if newest == state.step + 1 else f"steps {state.step + 1}-{newest}"
            log(
                f"resumed from step {state.step}, the newest checkpoint that restores: {replayed} "
                "will be replayed exactly (same secret, same per-step keys), so repeating them spends no "
                "privacy twice and the ledger counts each step once"
            )
        else:
            log(f"resumed from step {state.step}")
        return state
    params, opt_state = init()
    if primary:
        for path in metrics_paths:
            path.unlink(missing_ok=True)
    return TrainState(params=params, opt_state=opt_state, step=0, ledger_json=ledger_text(plan.ledger_after(0)))


def _restore_newest_intact(
    checkpoints: CheckpointStore, template: TrainState, fingerprints: dict[str, str], log: Callable[[str], None]
) -> tuple[TrainState, list[DamagedCheckpointError]]:
    """The newest checkpoint that restores, and the damaged ones newer than it (each logged by step,
    folder and the error's first line). Every process takes the same checkpoint: one that fails on
    any process counts as damaged. A refusal that is not damage (another recipe, a foreign folder)
    is raised at once: an older checkpoint of the same folder would be refused the same way."""
    damaged: list[DamagedCheckpointError] = []
    steps = checkpoints.steps()
    for step in steps:
        error: DamagedCheckpointError | None = None
        try:
            state = checkpoints.restore(template, fingerprints, step=step)
        except DamagedCheckpointError as err:
            error = err
        if distributed.any_process(error is not None):
            if error is None:
                error = DamagedCheckpointError(
                    step, checkpoints.directory / str(step), "restore", "failed on another process"
                )
            damaged.append(error)
            log(
                f"checkpoint at step {step} ({error.path}) is damaged and does not restore: {error.reason}; "
                + ("trying the one before it" if step != steps[-1] else "no checkpoint before it")
            )
            continue
        return state, damaged
    listed = "; ".join(f"step {err.step} ({err.path}): {err.reason}" for err in damaged)
    raise NoRestorableCheckpointError(
        f"no checkpoint in {checkpoints.directory} restores, so this run folder cannot be resumed "
        f"(damaged: {listed}); start a fresh run in a new run folder (another --output-dir, without --resume)"
    )


def _set_aside(
    checkpoints: CheckpointStore, damaged: Sequence[DamagedCheckpointError], log: Callable[[str], None]
) -> None:
    """Move the damaged checkpoints out of the steps Orbax tracks (process 0 renames, every process
    re-reads the folder), so that none is taken for the latest and their steps are saved anew."""
    if distributed.is_primary():
        for err in damaged:
            moved = checkpoints.set_aside(err.step)
            log(
                f"moved the damaged checkpoint of step {err.step} aside to {moved} (kept for inspection, never restored)"
            )
    distributed.barrier("dpbert: damaged checkpoints set aside")
    checkpoints.reload()


class StopFlag:
    """Set by SIGTERM; the loop checkpoints and returns at the next step boundary."""

    def __init__(self) -> None:
        self.stop = False
        self._previous: Any = None

    def __enter__(self) -> StopFlag:
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling, nothing to restore
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.stop = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def run_loop(
    state: TrainState,
    *,
    plan: Plan,
    stage_keys: Sequence[jax.Array],
    make_step: Callable[[int], StepFn],
    sample: Callable[[int, int], Sample],
    checkpointing: Checkpointing,
    metrics: MetricsLog | None,
    log_every: int,
    learning_rate: Callable[[int], Any],
    hooks: Sequence[Hook] = (),
    progress: Progress | None = None,
    log: Callable[[str], None] = print,
    record: dict[str, Any] | None = None,
) -> LoopResult:
    """Train from `state.step` to the end of `plan.schedule` (see the module docstring).

    Args:
      state: the restored or fresh state (`restore_or_init`).
      plan, stage_keys: the privacy plan and one secret-derived key per stage; step t of stage i
        runs with `step_key(stage_keys[i], t)`.
      make_step, sample: the task's `make_step(stage_index)` (built once per stage) and
        `sample(stage_index, t) -> Sample` (the Poisson sample of step t).
      checkpointing, metrics, log_every, learning_rate: where and how often state and train
        records go (process 0 passes `metrics`, the others None); `record` fields are added.
      hooks: called after every k-th step (evaluation); progress, log: the progress bar and log.
    Returns:
      `LoopResult`: the final (after SIGTERM, the checkpointed) state and whether it stopped early.
    Raises:
      NonFiniteLossError: a step's training loss was not finite (nothing after it is saved)."""
    total = plan.schedule.total_steps
    step_fns: dict[int, StepFn] = {}
    losses: list[tuple[int, jax.Array]] = []  # (step, loss) not yet read back from the device
    window = {"since": time.perf_counter(), "steps": 0, "examples": 0}  # throughput between log syncs

    def settle(state: TrainState) -> TrainState:
        """Read back the losses since the last sync (one host sync), stop at a non-finite one, and
        put the ledger of the steps taken on the state before it leaves the loop."""
        values = jax.device_get([loss for _, loss in losses])
        for (step, _), value in zip(losses, values, strict=True):
            if not math.isfinite(float(value)):
                first = losses[0][0]
                raise NonFiniteLossError(
                    f"non-finite training loss {float(value)} at step {step} (steps {first}-{state.step} ran "
                    "since the last check; learning rate too high, or bad data); the last good checkpoint is "
                    f"in {checkpointing.store.directory}"
                )
        losses.clear()
        return state.replace(ledger_json=ledger_text(plan.ledger_after(state.step)))

    with StopFlag() as flag:
        while state.step < total:
            t = state.step
            pos = plan.schedule.stage_at(t)
            stage = pos.stage
            if pos.index not in step_fns:
                step_fns[pos.index] = make_step(pos.index)
            batch = sample(pos.index, t)
            params, opt_state, out = step_fns[pos.index](
                state.params, state.opt_state, batch.batch, batch.is_padding, step_key(stage_keys[pos.index], t)
            )
            losses.append((t + 1, out["nonprivate/loss"]))
            state = state.replace(params=params, opt_state=opt_state, step=t + 1)
            window["steps"] += 1
            window["examples"] += batch.realized_size
            logs = metrics is not None and (state.step % log_every == 0 or state.step == total)
            hooked = [h for h in hooks if h.every and state.step % h.every == 0 and state.step < total]
            saves = state.step % checkpointing.every == 0 or state.step == total
            if logs or hooked or saves:
                state = settle(state)
            if logs:
                # Steps run asynchronously between syncs: time per step is measured over the window.
                seconds = time.perf_counter() - window["since"]
                step_time, examples_per_s = seconds / window["steps"], window["examples"] / seconds
                window.update(since=time.perf_counter(), steps=0, examples=0)
                epsilon = plan.epsilon_after(state.step)
                host = jax.device_get({k: v for k, v in out.items() if k.startswith("nonprivate/")})
                diagnostics = {k.split("/", 1)[1]: float(v) for k, v in host.items()}
                metrics.write(
                    {
                        **(record or {}),
                        "kind": "train",
                        "step": state.step,
                        "expected_batch_size": stage.expected_batch_size,
                        "realized_batch_size": batch.realized_size,
                        "physical_batch_size": plan.physical_batch_sizes[pos.index],
                        "epsilon": epsilon,
                        "learning_rate": float(learning_rate(t)),
                        "examples_per_s": examples_per_s,
                        "step_time_s": step_time,
                        "nonprivate_diagnostics": diagnostics,
                    }
                )
                if progress is not None:
                    progress.set_postfix_str(
                        f"loss {diagnostics['loss']:.3f} (non-private diag.)"
                        + ("" if epsilon is None else f", eps {epsilon:.2f}")
                    )
            if progress is not None:
                progress.update(1)
            for hook in hooked:
                result = hook.fn(state)
                if result is not None and metrics is not None:
                    metrics.write({**(record or {}), **result})
            if saves:
                checkpointing.save(state)
            # Every process stops at the same step, whichever of them got the signal (a hook included).
            if distributed.any_process(flag.stop) and state.step < total:
                state = settle(state)
                checkpointing.save(state)
                log(
                    f"SIGTERM: checkpoint written at step {state.step} in {checkpointing.store.directory}; "
                    "rerun with --resume to continue"
                )
                return LoopResult(state=state, stopped=True)
    state = settle(state)
    checkpointing.save(state)
    return LoopResult(state=state, stopped=False)
