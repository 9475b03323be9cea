"""What a pretraining run leaves and says at its end: `RunResult`, the Hugging Face folder and
release, and the printed report (held-out accuracy beside the unigram baseline and the recipe's
non-private reference).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpbert.atomic import replace_dir, write_json
from dpbert.config.recipe import Recipe
from dpbert.model.bert import BertForMaskedLM
from dpbert.release.export import AUDIT_RUN_FILE, export_run
from dpbert.release.metadata import VOCAB_ORIGIN_FILE


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What a finished (or stopped) run reports. `epsilon` is None for non-private runs."""

    run_dir: Path
    steps_done: int
    total_steps: int
    stopped_early: bool
    epsilon: float | None
    delta: float | None
    eval_mlm_accuracy: float | None
    eval_mlm_loss: float | None
    wall_time_s: float
    fill_mask: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    # The unigram baseline (the most frequent train token predicted at every held-out masked
    # position, same masks): its accuracy and the token. A non-private diagnostic.
    eval_unigram_accuracy: float | None = None
    unigram_token: str | None = None
    # The recipe's `reference` section: (accuracy, note) of its non-private twin, same compute.
    reference: tuple[float, str] | None = None
    # With `optimizer.ema_decay`: what was evaluated and released ("moving average (decay D)"), and
    # the last iterate's held-out (accuracy, loss) on the same masks.
    params: str | None = None
    last_iterate: tuple[float, float] | None = None


def write_hf(
    model: BertForMaskedLM,
    tokenizer: Any,
    out: Path,
    *,
    ledger: dict[str, Any] | None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> None:
    """The final model and its tokenizer as a Hugging Face folder (atomic: temp sibling, rename),
    with the run's privacy ledger beside the weights when the run was private, and dpbert's
    vocabulary origin marker (`VOCAB_ORIGIN_FILE`) when the tokenizer folder has one
    (`tokenizer_dir`, default the folder the tokenizer was loaded from), so that the folder,
    reused as a tokenizer, still tells where its vocabulary came from."""
    source = Path(tokenizer_dir) if tokenizer_dir is not None else Path(str(getattr(tokenizer, "name_or_path", "")))
    marker = source / VOCAB_ORIGIN_FILE
    with replace_dir(out) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if str(source) and marker.is_file():
            shutil.copy2(marker, tmp / VOCAB_ORIGIN_FILE)
        if ledger is not None:
            write_json(tmp / "privacy.json", ledger)


def export_release(run_dir: Path, *, private: bool) -> Path | None:
    """RUN_DIR/release, as `dpbert export RUN_DIR` writes it by default: no held-out figure of the
    private corpus, no diagnostic value (both stay in the run folder). None for an audit's run
    (marked AUDIT_RUN.json by `dpbert audit`), which is never released."""
    if (run_dir / AUDIT_RUN_FILE).is_file():
        return None
    return export_run(run_dir, run_dir / "release", non_private=not private, overwrite=True)


def recipe_reference(recipe: Recipe) -> tuple[float, str] | None:
    """The recipe's non-private reference (its `reference` section) as (accuracy, note): the
    held-out MLM accuracy that the recipe's non-private twin reached with the same compute, and
    how it was measured (the twin's file name first when the recipe names it). None when the
    recipe gives no `reference.nonprivate_mlm_accuracy`."""
    ref = recipe.reference
    if ref.nonprivate_mlm_accuracy is None:
        return None
    note = ", ".join(part for part in (ref.recipe, ref.note.strip()) if part)
    return ref.nonprivate_mlm_accuracy, note


def print_report(result: RunResult, release: Path | None, log: Callable[[str], None]) -> None:
    log("")
    log(f"run {result.run_dir}: {result.steps_done} steps in {result.wall_time_s:.0f} s")
    if result.epsilon is None:
        log("privacy: NOT private (baseline)")
    else:
        log(f"privacy: epsilon = {result.epsilon:.3f} at delta = {result.delta:g}")
    log(f"held-out MLM accuracy: {100 * result.eval_mlm_accuracy:.2f}%  (loss {result.eval_mlm_loss:.3f})")
    if result.params is not None and result.last_iterate is not None:
        accuracy, loss = result.last_iterate
        log(f"  of the released {result.params}; the last iterate: {100 * accuracy:.2f}% (loss {loss:.3f})")
    rows = [
        (
            "this run, " + ("NOT private" if result.epsilon is None else f"DP at epsilon {result.epsilon:.2f}"),
            result.eval_mlm_accuracy,
            "",
        )
    ]
    if result.eval_unigram_accuracy is not None:
        rows.append(
            (
                f"unigram baseline ('{result.unigram_token}' everywhere)",
                result.eval_unigram_accuracy,
                "the most frequent train token (non-private diagnostic)",
            )
        )
    if result.reference is not None:
        rows.append(("non-private reference, same compute", result.reference[0], result.reference[1]))
    log("held-out masked-token accuracy, same masked positions:")
    for name, value, note in rows:
        log(f"  {name:<40}{100 * value:6.2f}%   {note}".rstrip())
    if release is not None:
        log(f"Hugging Face folder: {result.run_dir / 'hf'}; release with privacy metadata: {release}")
    for sentence, preds in result.fill_mask:
        log(f"  {sentence}")
        log("    -> " + ", ".join(f"{tok} ({p:.2f})" for tok, p in preds))
