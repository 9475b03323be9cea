"""`dpbert audit`: an empirical lower bound on a recipe's epsilon, from canaries, in one run.

Two kinds of canaries: `input` (black box: sequences join the recipe's training set with
probability 1/2, the recipe is trained as usual on an audit token store, and each canary is scored
by its pseudo-log-likelihood under the final model; each canary is one rare token of its own
repeated, or uniform random tokens, `CANARY_DESIGNS`) and `gradient` (white box: the recipe's privacy
plan run through the real DP step with Dirac gradient canaries, `dpbert.privacy.gradient_canaries`). Two
bounds on the same scores at the stated confidence: Steinke et al.'s and the f-DP bound
(`dpbert.privacy.audit_fdp`). A gradient audit may switch the noise off (claim: infinity).
`--card RELEASE` adds the result to a release as an audited figure (`dpbert.release.audit_figures`).
`--kind exposure` (memorization of planted secrets, not a bound) is `dpbert.train.exposure_audit`.

Guarantees: canaries exist only in OUTPUT_DIR's audit store; the recipe's own store is read, never
written; canary tokens and coin flips come from the audit's own secret, disjoint from every training
key; the audit model is never released. Outputs: docs/INTERNALS.md ("dpbert.train.audit").
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpbert.atomic import replace_dir, write_json
from dpbert.config.plan import plan_recipe
from dpbert.config.recipe import Recipe, apply_overrides, load_recipe, read_yaml
from dpbert.data.store import MANIFEST, TOKENIZER_DIR, prepare_store, read_manifest
from dpbert.data.tokenizer import resolve_tokenizer
from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.privacy.accounting import PrivacyLedger
from dpbert.privacy.audit_bounds import audit_scores, empirical_figures
from dpbert.privacy.gradient_canaries import (
    GradientCanaryConfig,
    audit_keys,
    canary_inclusion,
    run_gradient_canary_audit,
)
from dpbert.privacy.randomness import SECRET_FILE, run_secret
from dpbert.privacy.schedule import BatchSchedule
from dpbert.release.export import AUDIT_RUN_FILE
from dpbert.release.metadata import epsilon_to_json
from dpbert.train.metrics import MetricsLog
from dpbert.train.pretrain import pretrain

KINDS = ("input", "gradient")
# Input canary designs: `rare` (each canary is one token of its own, among the least frequent of
# the training split, at every position: Panda et al. 2025's new-token canaries) and `random`
# (uniform ordinary tokens). Which separates better: docs/RESULTS.md, "Audits".
CANARY_DESIGNS = ("rare", "random")
# Gradient canaries cost one coordinate each, so more are cheap; with a recipe's small sampling
# rate only the canaries sampled at least once can be told apart, and their number grows with m.
# How the bound grows with the number of canaries: docs/RESULTS.md, "Audits".
DEFAULT_CANARIES = {"input": 2000, "gradient": 10000}
# fold_in constants under the canary key: the coin flips use the canary key itself.
_TOKENS = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditReport:
    """What `dpbert audit` prints and writes to audit.json."""

    kind: str
    recipe: str
    epsilon_claimed: float
    delta: float
    epsilon_lower_bound: float
    epsilon_lower_bound_max_over_k: float
    confidence: float
    num_canaries: int
    num_included: int
    num_guesses: int
    num_correct: int
    k_plus: int
    k_minus: int
    num_candidates: int
    score: str
    date: str
    audit: bool = True
    # The f-DP one-run bound (Mahloujifar et al. 2025) on the same scores and guess counts.
    epsilon_lower_bound_fdp: float | None = None
    fdp_trade_off: str | None = None
    fdp_num_guesses: int | None = None
    fdp_num_correct: int | None = None
    fdp_k_plus: int | None = None
    fdp_k_minus: int | None = None
    # True when the audited run had its noise switched off (claim: epsilon = infinity).
    noise_free: bool = False
    # Input audits: the canary design (CANARY_DESIGNS).
    canary_design: str | None = None
    # Which run was audited: the recipe's overrides (`--set`) and the DP steps it ran.
    overrides: list[str] = dataclasses.field(default_factory=list)
    steps: int | None = None
    # Empirical figures of the canary scores (`dpbert.privacy.audit_bounds.empirical_figures`): dpbert's ROC
    # figures and, next to them, jax-privacy's auditor's. None of them is a privacy guarantee.
    auroc: float | None = None
    tpr_at_fpr: list[dict[str, float]] | None = None
    jax_privacy: dict[str, Any] | None = None
    empirical: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {list(KINDS)}, got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        """As audit.json holds it (an infinite claim as "inf")."""
        return {**dataclasses.asdict(self), "epsilon_claimed": epsilon_to_json(self.epsilon_claimed)}


def random_canaries(
    key: jax.Array,
    num: int,
    *,
    seq_len: int,
    vocab_size: int,
    cls_id: int,
    sep_id: int,
    special_token_ids: Iterable[int],
) -> np.ndarray:
    """int32 [num, seq_len]: [CLS], seq_len - 2 tokens uniform over the non-special ids, [SEP]."""
    special = np.asarray(sorted(set(special_token_ids) | {cls_id, sep_id}), np.int64)
    ordinary = np.setdiff1d(np.arange(vocab_size), special)
    body = np.asarray(jax.random.randint(key, (num, seq_len - 2), 0, ordinary.size))
    rows = np.empty((num, seq_len), np.int32)
    rows[:, 0], rows[:, -1] = cls_id, sep_id
    rows[:, 1:-1] = ordinary[body]
    return rows


def token_counts(store_dir: Path, split: str = "train", *, chunk_rows: int = 1 << 20) -> np.ndarray:
    """int64 [vocab_size]: how often each token id occurs in the store's `split` (read in chunks)."""
    manifest = read_manifest(store_dir)
    info = manifest.splits[split]
    rows = np.memmap(store_dir / info.file, dtype=np.dtype(manifest.dtype).newbyteorder("<"), mode="r").reshape(
        -1, manifest.seq_len
    )
    counts = np.zeros(manifest.vocab_size, np.int64)
    for start in range(0, len(rows), chunk_rows):
        counts += np.bincount(np.asarray(rows[start : start + chunk_rows]).ravel(), minlength=manifest.vocab_size)
    return counts


def rare_token_canaries(
    key: jax.Array,
    num: int,
    *,
    counts: np.ndarray,
    seq_len: int,
    cls_id: int,
    sep_id: int,
    special_token_ids: Iterable[int],
) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [num, seq_len] canaries, int32 [num] their tokens): canary i is [CLS], its own token
    repeated seq_len - 2 times, [SEP]. The tokens are the `num` least frequent non-special ids of
    `counts` (ties broken at random by `key`), one per canary, so no canary shares its token with
    another, and a token absent from the training split is seen only in its canary."""
    special = set(special_token_ids) | {cls_id, sep_id}
    ordinary = np.asarray([t for t in range(counts.size) if t not in special], np.int64)
    if num > ordinary.size:
        raise ValueError(
            f"canaries: the rare-token design needs one ordinary token per canary; "
            f"the vocabulary has {ordinary.size}, got {num}"
        )
    tiebreak = np.asarray(jax.random.permutation(key, ordinary.size))
    order = np.lexsort((tiebreak, counts[ordinary]))
    tokens = ordinary[order[:num]].astype(np.int32)
    rows = np.empty((num, seq_len), np.int32)
    rows[:, 0], rows[:, -1] = cls_id, sep_id
    rows[:, 1:-1] = tokens[:, None]
    return rows, tokens


def write_canary_store(
    base_dir: Path, out_dir: Path, canaries: np.ndarray, *, what: str = "audit canaries (random token sequences)"
) -> None:
    """A token store = the base store with `canaries` appended to its train split (atomic); the
    manifest's `source` says "<base source> + <number> <what>"."""

    manifest = read_manifest(base_dir)
    train, evals = manifest.splits["train"], manifest.splits["eval"]
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    with replace_dir(out_dir) as tmp:
        shutil.copytree(base_dir / TOKENIZER_DIR, tmp / TOKENIZER_DIR)
        shutil.copyfile(base_dir / evals.file, tmp / evals.file)
        with open(tmp / train.file, "wb") as f:
            with open(base_dir / train.file, "rb") as src:
                shutil.copyfileobj(src, f)
            f.write(canaries.astype(dtype).tobytes())
        data = manifest.to_dict()
        data["source"] = f"{manifest.source} + {len(canaries)} {what}"
        data["splits"]["train"] = {
            **dataclasses.asdict(train),
            "num_examples": train.num_examples + len(canaries),
            "num_documents": train.num_documents + len(canaries),
            "num_tokens": train.num_tokens + int(canaries.size),
            # Each canary is a one-sequence document: the largest document is unchanged.
            "mean_sequences_per_document": None,
        }
        data["splits"]["eval"] = dataclasses.asdict(evals)
        (tmp / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True))


def pseudo_log_likelihood(hf_dir: Path, sequences: np.ndarray, *, mask_id: int, batch_size: int = 256) -> np.ndarray:
    """float64 [num]: mean over positions 1..L-2 of log p(true token | sequence with it masked)."""

    graphdef, params = functional.split_params(BertForMaskedLM.from_pretrained(str(hf_dir)))
    num, seq_len = sequences.shape
    positions = np.arange(1, seq_len - 1)

    @jax.jit
    def logprob(ids: jax.Array, pos: jax.Array) -> jax.Array:
        target = jnp.take_along_axis(ids, pos[:, None], axis=1)[:, 0]
        masked = ids.at[jnp.arange(ids.shape[0]), pos].set(mask_id)
        logits = functional.mlm_logits(
            graphdef, params, masked, jnp.ones_like(masked), None, None, masked_positions=pos[:, None]
        )[:, 0].astype(jnp.float32)
        return jax.nn.log_softmax(logits)[jnp.arange(ids.shape[0]), target]

    rows = np.repeat(np.arange(num), positions.size)
    pos = np.tile(positions, num)
    out = np.empty(rows.size, np.float64)
    for start in range(0, rows.size, batch_size):
        sl = slice(start, min(start + batch_size, rows.size))
        n = sl.stop - sl.start
        # Pad the last batch to a fixed shape (one compilation).
        r = np.resize(rows[sl], batch_size)
        p = np.resize(pos[sl], batch_size).astype(np.int32)
        out[sl] = np.asarray(logprob(jnp.asarray(sequences[r]), jnp.asarray(p)))[:n]
    return out.reshape(num, positions.size).mean(axis=1)


def base_store(recipe: Recipe, output_dir: Path) -> Path:
    """The recipe's token store (its `data.store`, else OUTPUT_DIR/base_store, prepared if needed)."""
    d = recipe.data
    base = Path(d.store) if d.store else output_dir / "base_store"
    prepare_store(
        base,
        corpus=d.corpus,
        tokenizer=resolve_tokenizer(
            d.tokenizer, declared_public=d.tokenizer_declared_public, private=recipe.privacy.enabled
        ),
        seq_len=d.seq_len,
        eval_fraction=d.eval_fraction,
        seed=d.split_seed,
        train_vocab_size=d.train_vocab_size,
        num_proc=d.num_proc,
    )
    return base


def audit_dataset_size(recipe: Recipe, n_train: int, extra_rows: int) -> list[str]:
    """Overrides that keep the release's public N (so its q and sigma) for an audit run whose store
    holds `extra_rows` more rows than the recipe's own, widening the bound on stored rows for them."""
    release_ledger = plan_recipe(recipe, n_train).ledger
    return [
        f"privacy.dataset_size={release_ledger.dataset_size}",
        f"privacy.dataset_size_bound={release_ledger.dataset_size_bound + extra_rows}",
    ]


class AuditStopped(RuntimeError):
    """SIGTERM stopped an audit's training run: the audit stops whole (nothing scored, no audit.json;
    an audit does not resume: its next run starts in a fresh folder)."""


def train_audit_run(
    recipe_path: str | os.PathLike[str],
    run_dir: Path,
    *,
    store: Path,
    kind: str,
    marker: dict[str, Any],
    overrides: Iterable[str],
    progress: bool,
    log: Callable[[str], None],
    noise_seed_file: str | os.PathLike[str] | None,
    mechanism: str | None = None,
    noise_free: bool = False,
) -> tuple[Any, dict[str, Any] | None]:
    """(run result, its ledger as written or None for a non-private run): the recipe trained on the
    audit `store` in `run_dir`, marked AUDIT_RUN.json before the first step (so even an interrupted
    audit run says what it is), which makes it unreleasable: the trainer writes no `release/` for it
    and `dpbert export` refuses it; its privacy.json is marked 'audit' too (unreadable as a release
    ledger). Keys: `mechanism` (default "audit/<kind>/run"). `noise_free`: the recipe's clipping without
    noise (no ledger is written: nothing is claimed). Raises `AuditStopped` when SIGTERM stopped the run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / AUDIT_RUN_FILE, {"audit": True, "kind": kind, **marker, "store": str(store)})
    run = pretrain(
        recipe_path,
        run_dir,
        overrides=[*overrides, f"data.store={store}"],
        progress=progress,
        log=log,
        noise_seed_file=noise_seed_file,
        mechanism=mechanism or f"audit/{kind}/run",
        noise_free=noise_free,
    )
    if run.stopped_early:
        raise AuditStopped(
            f"the audit's training run in {run_dir} was stopped (SIGTERM) at step {run.steps_done} of "
            f"{run.total_steps}; the audit stops here: nothing scored, no audit.json written (start it again in a "
            "new --output-dir)"
        )
    ledger_path = run_dir / "privacy.json"
    if not ledger_path.is_file():
        return run, None
    ledger_dict = json.loads(ledger_path.read_text())
    write_json(ledger_path, {**ledger_dict, "audit": True})
    return run, ledger_dict


def _figures(scores: np.ndarray, included: np.ndarray, result: Any) -> dict[str, Any]:
    """The empirical figures of the canary scores, at the audit's delta and confidence."""
    return empirical_figures(scores, included, delta=result.delta, confidence=result.confidence)


def _report(
    kind: str,
    recipe_path: str,
    claimed: float,
    result: Any,
    score: str,
    figures: dict[str, Any] | None = None,
    *,
    noise_free: bool = False,
    canary_design: str | None = None,
    overrides: list[str],
    steps: int,
) -> AuditReport:
    return AuditReport(
        kind=kind,
        recipe=str(recipe_path),
        epsilon_claimed=claimed,
        delta=result.delta,
        epsilon_lower_bound=result.epsilon_lower_bound,
        epsilon_lower_bound_max_over_k=result.epsilon_lower_bound_max_over_k,
        confidence=result.confidence,
        num_canaries=result.num_canaries,
        num_included=result.num_included,
        num_guesses=result.num_guesses,
        num_correct=result.num_correct,
        k_plus=result.k_plus,
        k_minus=result.k_minus,
        num_candidates=result.num_candidates,
        epsilon_lower_bound_fdp=result.epsilon_lower_bound_fdp,
        fdp_trade_off=result.fdp_trade_off,
        fdp_num_guesses=result.fdp_num_guesses,
        fdp_num_correct=result.fdp_num_correct,
        fdp_k_plus=result.fdp_k_plus,
        fdp_k_minus=result.fdp_k_minus,
        score=score,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        noise_free=noise_free,
        canary_design=canary_design,
        overrides=overrides,
        steps=steps,
        **(figures or {}),
    )


def _noise_free_overrides(recipe_path: str | os.PathLike[str], overrides: list[str]) -> tuple[list[str], bool]:
    """(overrides, noise_free): a private recipe whose overrides switch the noise off
    (`privacy.noise_multiplier` 0) validates with a placeholder multiplier instead, which the
    audit then replaces by 0 in its own run (never a release); any other recipe is unchanged."""
    privacy = apply_overrides(read_yaml(recipe_path), overrides).get("privacy")
    if not isinstance(privacy, dict) or privacy.get("enabled", True) is not True:
        return overrides, False
    sigma = privacy.get("noise_multiplier")
    if isinstance(sigma, bool) or not isinstance(sigma, int | float) or sigma != 0:
        return overrides, False
    if privacy.get("target_epsilon") is not None:
        raise ValueError(
            "recipe field 'privacy.target_epsilon': expected null with privacy.noise_multiplier=0 (a run without "
            f"noise has no finite epsilon to aim at), got {privacy['target_epsilon']!r}"
        )
    return [*overrides, "privacy.noise_multiplier=1.0"], True


def run_audit(
    recipe_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    num_canaries: int | None = None,
    kind: str = "input",
    overrides: Iterable[str] = (),
    confidence: float = 0.95,
    progress: bool = True,
    log: Callable[[str], None] = print,
    noise_seed_file: str | os.PathLike[str] | None = None,
    canary_design: str = "rare",
) -> AuditReport:
    """Audit the recipe with `num_canaries` canaries of `kind` (default `DEFAULT_CANARIES[kind]`;
    input canaries of `canary_design`, one of CANARY_DESIGNS); writes OUTPUT_DIR/audit.json. The
    canary draw and the audit's training run take keys from the audit's own secret (OS CSPRNG, or `noise_seed_file`; kept in OUTPUT_DIR/checkpoints),
    domain-separated from each other and from training ("audit/<kind>/...")."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    num_canaries = DEFAULT_CANARIES[kind] if num_canaries is None else num_canaries
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, int) or num_canaries < 2:
        raise ValueError(f"canaries: expected an integer >= 2, got {num_canaries!r}")
    if canary_design not in CANARY_DESIGNS:
        raise ValueError(f"canary design: expected one of {list(CANARY_DESIGNS)}, got {canary_design!r}")
    user_overrides = list(overrides)
    overrides, noise_free = _noise_free_overrides(recipe_path, user_overrides)
    recipe = load_recipe(recipe_path, overrides)
    if not recipe.privacy.enabled:
        raise ValueError("recipe field 'privacy.enabled': an audit needs a private recipe (there is no claim to test)")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = base_store(recipe, out)

    manifest = read_manifest(base)
    n_train = manifest.num_examples("train")
    secret = run_secret(out / "checkpoints" / SECRET_FILE, reuse=False, supplied=noise_seed_file)
    _, canary_key = audit_keys(secret, kind)
    included = canary_inclusion(canary_key, num_canaries)

    if kind == "gradient":
        # The release's plan: its public N, q and sigma; canaries are stored rows beside the others.
        plan = plan_recipe(recipe, n_train)
        schedule = plan.schedule
        if noise_free:
            schedule = BatchSchedule(
                stages=tuple(dataclasses.replace(s, noise_multiplier=0.0) for s in schedule.stages)
            )
        config = GradientCanaryConfig(
            dataset_size=plan.ledger.dataset_size,
            dataset_size_bound=plan.ledger.dataset_size_bound + num_canaries,
            schedule=schedule,
            num_canaries=num_canaries,
            num_other_examples=n_train,
            clip_norm=recipe.privacy.clip_norm,
            delta=recipe.privacy.delta,
            secret=secret,
            microbatch_size=recipe.train.microbatch_size,
            accountant=recipe.privacy.accountant,
            confidence=confidence,
        )
        log(
            f"audit: {num_canaries} gradient canaries ({int(included.sum())} in) through the real DP step, "
            f"{plan.schedule.total_steps} steps over {n_train} + canaries examples"
            + (" (noise switched off: the claim is epsilon = infinity)" if noise_free else "")
        )
        result = run_gradient_canary_audit(config)
        report = _report(
            kind,
            str(recipe_path),
            result.epsilon_claimed,
            result.audit,
            result.score,
            _figures(result.scores, result.included, result.audit),
            noise_free=noise_free,
            overrides=user_overrides,
            steps=schedule.total_steps,
        )
    else:
        token_key = jax.random.fold_in(canary_key, _TOKENS)
        shape = {"seq_len": manifest.seq_len, "cls_id": manifest.cls_id, "sep_id": manifest.sep_id}
        if canary_design == "rare":
            counts = token_counts(base)
            canaries, tokens = rare_token_canaries(
                token_key, num_canaries, counts=counts, special_token_ids=manifest.special_token_ids, **shape
            )
            what = f"rare-token audit canaries ({int((counts[tokens] == 0).sum())} of their tokens unseen in training)"
        else:
            canaries = random_canaries(
                token_key,
                num_canaries,
                vocab_size=manifest.vocab_size,
                special_token_ids=manifest.special_token_ids,
                **shape,
            )
            what = "audit canaries (random token sequences)"
        store = out / "store"
        write_canary_store(base, store, canaries[included], what=what)
        log(f"audit: {num_canaries} {what}, {int(included.sum())} appended to the training set in {store}")
        run, ledger_dict = train_audit_run(
            recipe_path,
            out / "run",
            store=store,
            kind=kind,
            marker={"num_canaries": num_canaries, "num_included": int(included.sum()), "noise_free": noise_free},
            overrides=[*overrides, *audit_dataset_size(recipe, n_train, num_canaries)],
            progress=progress,
            log=log,
            noise_seed_file=noise_seed_file,
            noise_free=noise_free,
        )
        run_dir = out / "run"
        scores = pseudo_log_likelihood(run_dir / "hf", canaries, mask_id=manifest.mask_id)
        if noise_free:  # nothing claimed: the bound is computed at the recipe's delta
            claimed, delta = math.inf, recipe.privacy.delta
        else:
            ledger = PrivacyLedger.from_dict(ledger_dict)
            claimed = float(run.epsilon)
            delta = ledger.delta + ledger.truncation_delta(claimed)
        bound = audit_scores(scores, included, delta=min(delta, 1.0), confidence=confidence)
        report = _report(
            kind,
            str(recipe_path),
            claimed,
            bound,
            "pseudo_log_likelihood",
            _figures(scores, included, bound),
            noise_free=noise_free,
            canary_design=canary_design,
            overrides=user_overrides,
            steps=run.steps_done,
        )
        with contextlib.closing(MetricsLog(run_dir / "metrics.jsonl")) as metrics:
            metrics.write({**report.to_dict(), "kind": "audit", "canary_kind": kind, "step": run.steps_done})
    write_json(out / "audit.json", report.to_dict())
    return report


def _tprs(rows: Any) -> str:
    return ", ".join(f"{r['tpr']:.4g} at {100 * r['fpr']:g}%" for r in rows or ())


def _figure_rows(report: AuditReport) -> list[tuple[str, str]]:
    """The empirical figures, dpbert's then jax-privacy's, each labelled as empirical."""
    if report.auroc is None:
        return []
    rows = [("AUROC (empirical)", f"{report.auroc:.4g}"), ("TPR at low FPR (empirical)", _tprs(report.tpr_at_fpr))]
    jp = report.jax_privacy or {}
    if not jp.get("available"):
        return [*rows, ("jax-privacy auditor", str(jp.get("note", "not run")))]
    return [
        *rows,
        (f"jax-privacy {jp.get('version')} AUROC", f"{jp['auroc']:.4g} (empirical)"),
        ("jax-privacy TPR at low FPR", f"{_tprs(jp['tpr_at_fpr'])} (empirical)"),
        (
            "jax-privacy lower bounds",
            f"{jp['epsilon_lower_bound']:.4g} one-run, {jp['epsilon_lower_bound_fdp']:.4g} f-DP one-run (empirical)",
        ),
    ]


def _fdp_rows(report: AuditReport) -> list[tuple[str, str]]:
    if report.epsilon_lower_bound_fdp is None:
        return []
    curve = "Gaussian curve" if report.fdp_trade_off == "gaussian" else "(epsilon, delta) curve"
    return [
        (
            f"f-DP lower bound ({100 * report.confidence:g}% conf.)",
            f"{report.epsilon_lower_bound_fdp:.4g} (Mahloujifar et al., {curve}; same correction); "
            f"{report.fdp_num_guesses} guesses ({report.fdp_num_correct} correct)",
        )
    ]


def format_table(report: AuditReport) -> str:
    """The audit as a two-column text table."""
    rows = [
        ("canary kind", report.kind + (f" ({report.canary_design} design)" if report.canary_design else "")),
        (
            "audited run",
            report.recipe
            + "".join(f" --set {o}" for o in report.overrides)
            + ("" if report.steps is None else f": {report.steps} steps"),
        ),
        ("canaries (included)", f"{report.num_canaries} ({report.num_included})"),
        ("guesses (correct)", f"{report.num_guesses} ({report.num_correct}); k+={report.k_plus}, k-={report.k_minus}"),
        (
            "claimed epsilon",
            f"{report.epsilon_claimed:.4g} at delta {report.delta:g}"
            + (" (noise switched off: nothing is claimed)" if report.noise_free else ""),
        ),
        (
            f"lower bound ({100 * report.confidence:g}% conf.)",
            f"{report.epsilon_lower_bound:.4g} (Steinke et al.; Bonferroni over {report.num_candidates} guess counts)",
        ),
        ("max over guess counts", f"{report.epsilon_lower_bound_max_over_k:.4g} (as the paper reports; uncorrected)"),
        *_fdp_rows(report),
        ("score", report.score),
        *_figure_rows(report),
        ("date (UTC)", report.date),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
