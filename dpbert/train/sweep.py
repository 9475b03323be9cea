"""`dpbert sweep`: the paper's batch-size result in miniature.

A sweep file trains arms of one pretraining recipe that differ only in their batch-size schedule,
each processing the same number of examples at the same epsilon (each private arm calibrated by the
same code as any run), plus a non-private arm and, optionally, a document-level arm; it writes
DIR/sweep.json, a table and DIR/sweep.png (held-out accuracy against batch size).

Guarantees: arms share one token store and differ in nothing but schedule (and privacy for the
non-private arm); an arm already computed with the same definition is not rerun. The sweep
file's fields and the outputs: docs/INTERNALS.md ("dpbert.train.sweep") and docs/USAGE.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dpbert.atomic import write_json
from dpbert.config.recipe import NONPRIVATE_OVERRIDES, load_recipe, read_yaml
from dpbert.train.pretrain import pretrain

SWEEP_FIELDS = (
    "recipe",
    "examples",
    "batch_sizes",
    "schedule",
    "nonprivate_batch_size",
    "nonprivate_set",
    "warmup_fraction",
    "target_epsilon",
    "set",
    "document_recipe",
)
# Overrides that would make arms differ in more than their batch-size schedule.
FORBIDDEN_SET_PREFIXES = ("schedule", "privacy", "optimizer.warmup_steps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """A validated sweep file (see the module docstring)."""

    recipe: Path
    examples: int
    batch_sizes: tuple[int, ...]
    schedule: tuple[int, ...] = ()
    nonprivate_batch_size: int | None = None
    nonprivate_set: tuple[str, ...] = ()
    warmup_fraction: float = 0.1
    target_epsilon: float | None = None
    set: tuple[str, ...] = ()
    document_recipe: Path | None = None

    def __post_init__(self) -> None:
        if self.examples < 1:
            raise ValueError(f"sweep field 'examples': expected a positive integer, got {self.examples!r}")
        for name in ("batch_sizes", "schedule"):
            sizes = getattr(self, name)
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
                raise ValueError(f"sweep field '{name}': expected positive integers, got {list(sizes)}")
        if not self.batch_sizes:
            raise ValueError("sweep field 'batch_sizes': expected at least one batch size")
        if self.schedule and list(self.schedule) != sorted(set(self.schedule)):
            raise ValueError(
                f"sweep field 'schedule': expected strictly increasing batch sizes, got {list(self.schedule)}"
            )
        if len(self.schedule) == 1:
            raise ValueError("sweep field 'schedule': an increasing schedule needs at least 2 stages")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(
                f"sweep field 'warmup_fraction': expected a fraction in [0, 1), got {self.warmup_fraction!r}"
            )
        for override in (*self.set, *self.nonprivate_set):
            key = override.partition("=")[0].strip()
            if key.startswith(FORBIDDEN_SET_PREFIXES):
                raise ValueError(
                    f"sweep field 'set': {override!r} would make the arms differ in more than the batch "
                    "size (the sweep sets schedule, warmup and privacy itself)"
                )


def load_sweep(path: str | os.PathLike[str]) -> SweepSpec:
    """Read and validate a sweep file; `recipe` is resolved relative to the file's folder."""
    path = Path(path)
    raw = read_yaml(path)
    unknown = sorted(set(raw) - set(SWEEP_FIELDS))
    if unknown:
        raise ValueError(f"sweep {path}: unknown field(s) {unknown}; expected {list(SWEEP_FIELDS)}")
    for name in ("recipe", "examples", "batch_sizes"):
        if name not in raw:
            raise ValueError(f"sweep {path}: missing field '{name}'")
    recipe, document_recipe = (None if raw.get(k) is None else Path(raw[k]) for k in ("recipe", "document_recipe"))
    recipe = recipe if recipe.is_absolute() else path.parent / recipe
    if document_recipe is not None and not document_recipe.is_absolute():
        document_recipe = path.parent / document_recipe
    try:
        return SweepSpec(
            recipe=recipe,
            examples=int(raw["examples"]),
            batch_sizes=tuple(raw["batch_sizes"]),
            schedule=tuple(raw.get("schedule") or ()),
            nonprivate_batch_size=raw.get("nonprivate_batch_size"),
            warmup_fraction=float(raw.get("warmup_fraction", 0.1)),
            target_epsilon=raw.get("target_epsilon"),
            set=tuple(str(s) for s in raw.get("set") or ()),
            nonprivate_set=tuple(str(s) for s in raw.get("nonprivate_set") or ()),
            document_recipe=document_recipe,
        )
    except ValueError as err:
        raise ValueError(f"sweep {path}: {err}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arm:
    """One training run of the sweep: its stages (steps, expected batch size) and the recipe
    overrides that make it (applied after the sweep's `set`)."""

    name: str
    private: bool
    stages: tuple[tuple[int, int], ...]
    overrides: tuple[str, ...]
    recipe: Path | None = None  # None: the sweep's recipe
    sequences_per_unit: int = 1  # a document arm's cap: its stages count documents

    @property
    def unit(self) -> str:
        return "sequence" if self.recipe is None else "document"

    @property
    def steps(self) -> int:
        return sum(t for t, _ in self.stages)

    @property
    def examples(self) -> int:
        """Expected sequences processed: sum over stages of steps x expected batch size (x the
        cap of sequences per document, for a document arm)."""
        return sum(t * b for t, b in self.stages) * self.sequences_per_unit

    @property
    def expected_batch_size(self) -> int:
        """The (largest, for a schedule) expected batch size, in sequences."""
        return max(b for _, b in self.stages) * self.sequences_per_unit


def _arm(name: str, private: bool, stages: Sequence[tuple[int, int]], spec: SweepSpec) -> Arm:
    steps = sum(t for t, _ in stages)
    own = () if private else spec.nonprivate_set
    overrides = [
        *spec.set,
        *own,
        f"schedule={json.dumps([{'steps': t, 'expected_batch_size': b} for t, b in stages])}",
        f"optimizer.warmup_steps={min(steps - 1, round(spec.warmup_fraction * steps))}",
        *(("privacy.enabled=true",) if private else NONPRIVATE_OVERRIDES),
    ]
    if private and spec.target_epsilon is not None:
        overrides.append(f"privacy.target_epsilon={spec.target_epsilon}")
    if private:
        # One noise multiplier for the whole schedule, calibrated to the target: every arm spends
        # the same epsilon.
        overrides += ["privacy.noise_multiplier=null", "privacy.calibrate=shared"]
    return Arm(name=name, private=private, stages=tuple(stages), overrides=tuple(overrides))


def build_arms(spec: SweepSpec) -> list[Arm]:
    """The sweep's arms: one private arm per batch size (steps = examples / B), the increasing
    schedule (one stage per size, each processing an equal share of the examples) and the
    non-private arm (with `nonprivate_set` on top: a non-private model may want its own learning
    rate). Steps are rounded, so examples differ from the budget by < B/2 per stage."""
    arms = []
    for b in spec.batch_sizes:
        arms.append(_arm(f"B={b}", True, [(max(1, round(spec.examples / b)), b)], spec))
    if spec.schedule:
        share = spec.examples / len(spec.schedule)
        stages = [(max(1, round(share / b)), b) for b in spec.schedule]
        arms.append(_arm("schedule " + "->".join(str(b) for b in spec.schedule), True, stages, spec))
    if spec.document_recipe is not None:
        doc = load_recipe(spec.document_recipe, spec.set)
        if doc.privacy.unit != "document":
            raise ValueError(
                f"sweep field 'document_recipe': {spec.document_recipe} has privacy.unit "
                f"{doc.privacy.unit!r}, expected 'document'"
            )
        d, cap = doc.schedule[0].expected_batch_size, doc.privacy.max_sequences_per_document
        arm = _arm(f"document unit D={d}x{cap}", True, [(max(1, round(spec.examples / (d * cap))), d)], spec)
        arms.append(dataclasses.replace(arm, recipe=spec.document_recipe, sequences_per_unit=cap))
    if spec.nonprivate_batch_size:
        b = spec.nonprivate_batch_size
        arms.append(_arm(f"non-private B={b}", False, [(max(1, round(spec.examples / b)), b)], spec))
    return arms


def arm_recipe(spec: SweepSpec, arm: Arm, store: str | os.PathLike[str] | None = None) -> Any:
    """The validated `Recipe` an arm trains (with the shared token store when given)."""
    extra = () if store is None else (f"data.store={store}",)
    return load_recipe(arm.recipe or spec.recipe, (*arm.overrides, *extra))


# ---------------------------------------------------------------------------- running


def _row(arm: Arm, result: Any, noise_multiplier: float | None) -> dict[str, Any]:
    return {
        "name": arm.name,
        "expected_batch_size": arm.expected_batch_size,
        "epsilon": result.epsilon,
        "examples": arm.examples,
        "steps": arm.steps,
        "mlm_accuracy": result.eval_mlm_accuracy,
        "unigram_accuracy": result.eval_unigram_accuracy,
        "private": arm.private,
        "noise_multiplier": noise_multiplier,
        "stages": [list(s) for s in arm.stages],
        "mlm_loss": result.eval_mlm_loss,
        "wall_time_s": result.wall_time_s,
        "unit": arm.unit,
    }


def run_sweep(
    sweep_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    log: Callable[[str], None] = print,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Train every arm (or reuse its finished row), then write sweep.json and sweep.png and
    print the table. Returns the rows in arm order."""

    spec = load_sweep(sweep_path)
    out = Path(output_dir)
    arms_dir = out / "arms"
    arms_dir.mkdir(parents=True, exist_ok=True)
    store = out / "store"
    arms = build_arms(spec)
    started = time.perf_counter()
    rows = []
    for i, arm in enumerate(arms):
        row_file = arms_dir / f"{_slug(arm.name)}.json"
        definition = {
            "stages": [list(s) for s in arm.stages],
            "overrides": list(arm.overrides),
            "recipe": str(arm.recipe or spec.recipe),
        }
        if row_file.is_file():
            saved = json.loads(row_file.read_text())
            if saved.get("definition") == definition:
                log(f"[{i + 1}/{len(arms)}] {arm.name}: done before, reusing its row")
                rows.append(saved["row"])
                continue
        run_dir = arms_dir / _slug(arm.name)
        if run_dir.exists():
            shutil.rmtree(run_dir)  # an unfinished arm restarts (a resume would need the same recipe)
        log(
            f"[{i + 1}/{len(arms)}] {arm.name}: {arm.steps} steps, {arm.examples} examples, "
            f"{'private' if arm.private else 'NOT private'}"
        )
        result = pretrain(
            arm.recipe or spec.recipe,
            run_dir,
            overrides=(*arm.overrides, f"data.store={store}"),
            progress=progress,
            log=lambda s: None,
            release=False,
        )
        sigma = _noise_multiplier(run_dir) if arm.private else None
        row = _row(arm, result, sigma)
        write_json(row_file, {"definition": definition, "row": row})
        rows.append(row)
        log(
            f"    held-out MLM accuracy {100 * row['mlm_accuracy']:.2f}% (unigram {100 * row['unigram_accuracy']:.2f}%)"
            + ("" if row["epsilon"] is None else f", epsilon {row['epsilon']:.3f}")
            + f", {row['wall_time_s']:.0f} s"
        )
    summary = {
        "sweep": str(sweep_path),
        "recipe": str(spec.recipe),
        "examples": spec.examples,
        "wall_time_s": time.perf_counter() - started,
        "arms": rows,
    }
    write_json(out / "sweep.json", summary)
    plot_sweep(rows, out / "sweep.png")
    log(format_table(rows))
    log(f"wrote {out / 'sweep.json'} and {out / 'sweep.png'}")
    return rows


def _noise_multiplier(run_dir: Path) -> float | None:
    path = run_dir / "privacy.json"
    if not path.is_file():
        return None
    ledger = json.loads(path.read_text())
    sigmas = {float(s["noise_multiplier"]) for s in ledger.get("stages", []) if "noise_multiplier" in s}
    return sigmas.pop() if len(sigmas) == 1 else None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The sweep's rows as a fixed-width table."""
    lines = [
        f"{'arm':<24}{'batch B':>9}{'steps':>7}{'examples':>10}{'epsilon':>9}{'sigma':>8}"
        f"{'MLM acc.':>10}{'unigram':>9}{'gain':>8}{'MLM loss':>10}"
    ]
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
        sigma = "-" if r.get("noise_multiplier") is None else f"{r['noise_multiplier']:.3f}"
        gain = 100 * (r["mlm_accuracy"] - r["unigram_accuracy"])
        lines.append(
            f"{r['name']:<24}{r['expected_batch_size']:>9,}{r['steps']:>7}{r['examples']:>10,}{eps:>9}"
            f"{sigma:>8}{100 * r['mlm_accuracy']:>9.2f}%{100 * r['unigram_accuracy']:>8.2f}%{gain:>+8.2f}"
            f"{r['mlm_loss']:>10.3f}"
        )
    lines.append(
        "gain: points of held-out masked-token accuracy above the unigram baseline (same masked positions); "
        "MLM loss: held-out cross-entropy (nats), which moves before accuracy leaves the unigram level"
    )
    return "\n".join(lines)


def plot_sweep(rows: Sequence[dict[str, Any]], out: str | os.PathLike[str]) -> Path:
    """DIR/sweep.png, two panels against batch size (log scale): held-out accuracy (with the
    unigram level) and held-out MLM loss, for the private fixed-batch arms, the schedule arm at its
    largest batch, and the non-private level as a line."""
    import matplotlib  # deferred: 0.56 s at import (measured), only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as matplotlib above

    sequence_rows = [r for r in rows if r.get("unit", "sequence") == "sequence"]
    fixed = [r for r in sequence_rows if r["private"] and len(r["stages"]) == 1]
    schedules = [r for r in sequence_rows if r["private"] and len(r["stages"]) > 1]
    documents = [r for r in rows if r.get("unit") == "document"]
    nonprivate = [r for r in rows if not r["private"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, scale, label in (
        (axes[0], "mlm_accuracy", 100, "held-out masked-token accuracy (%)"),
        (axes[1], "mlm_loss", 1, "held-out MLM loss (nats)"),
    ):
        if fixed:
            ax.plot(
                [r["expected_batch_size"] for r in fixed],
                [scale * r[key] for r in fixed],
                marker="o",
                label=f"DP-SGD, fixed batch (epsilon {fixed[0]['epsilon']:.2f})",
            )
        for r in schedules:
            ax.scatter(
                [r["expected_batch_size"]],
                [scale * r[key]],
                marker="*",
                s=160,
                color="C3",
                zorder=3,
                label=f"DP-SGD, increasing batch {r['name'].split(' ', 1)[1]}",
            )
        for r in documents:
            ax.scatter(
                [r["expected_batch_size"]],
                [scale * r[key]],
                marker="s",
                s=70,
                color="C4",
                zorder=3,
                label=f"DP-SGD, one document as the unit ({r['name']})",
            )
        for r in nonprivate:
            ax.axhline(scale * r[key], color="C2", linestyle="--", label=f"non-private ({r['name']})")
        if rows and key == "mlm_accuracy":
            ax.axhline(
                100 * rows[0]["unigram_accuracy"],
                color="gray",
                linestyle=":",
                label="unigram baseline (most frequent token)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("expected batch size B (log scale)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    examples = rows[0]["examples"] if rows else 0
    fig.suptitle(f"Batch size at a fixed privacy budget: same epsilon, {examples:,} examples per arm")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
