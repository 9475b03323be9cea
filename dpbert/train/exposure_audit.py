"""`dpbert audit --kind exposure`: how much a recipe memorizes planted secrets (Carlini et al. 2019).

Secrets "my id is d d d d d d" (each digit one token) are planted in a copy of the token store, each
a chosen number of times (0 = control, never planted); the recipe is trained with DP and, on the same
store, as its non-private twin (the recipe's `reference.recipe` when it names one, which carries the
twin's own tuning, else the recipe itself with `privacy.enabled=false`); each model scores all 10^6 candidates by
masking the six digits in one pass, and each secret's exposure (`dpbert.privacy.exposure`) is
reported for both models side by side. A measurement, not a guarantee.

Guarantees: the secrets, and which are planted how often, come from the audit's own secret
(`audit_keys(secret, "exposure")`), disjoint from every training key; the recipe's own store is read,
never written; neither model is ever released (`train_audit_run`). Both runs train on the private
data: the DP run spends its own (epsilon, delta), the twin spends unbounded privacy; the report says
so and a release's stated guarantee does not change.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpbert.atomic import write_json
from dpbert.config.recipe import NONPRIVATE_OVERRIDES, Recipe, load_recipe
from dpbert.data.store import TOKENIZER_DIR, StoreManifest, read_manifest
from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.privacy.accounting import PrivacyLedger
from dpbert.privacy.exposure import NUM_DIGITS, TIES, exposure, exposure_summary, ranks
from dpbert.privacy.gradient_canaries import audit_keys
from dpbert.privacy.randomness import SECRET_FILE, run_secret
from dpbert.release.metadata import EXPOSURE_MEANING, EXPOSURE_SPENT
from dpbert.train.audit import audit_dataset_size, base_store, train_audit_run, write_canary_store

KIND = "exposure"
PREFIX = "my id is"
NUM_POSITIONS = 6
DEFAULT_REPETITIONS = (1, 4, 16)
DEFAULT_SECRETS = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExposureReport:
    """What `dpbert audit --kind exposure` prints and writes to audit.json."""

    recipe: str
    steps: int
    steps_nonprivate: int
    epsilon: float
    delta: float
    tokenizer: str
    prefix: str
    num_candidates: int
    repetitions: list[int]
    secrets_per_count: int
    secrets: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    date: str
    overrides: list[str] = dataclasses.field(default_factory=list)
    wall_time_s: float | None = None
    twin_recipe: str | None = None
    kind: str = KIND
    audit: bool = True
    ties: str = TIES
    privacy_spent: str = EXPOSURE_SPENT
    meaning: str = EXPOSURE_MEANING

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_repetitions(value: str | Sequence[int]) -> tuple[int, ...]:
    """Distinct positive integers, sorted ("1,4,16" or a sequence); ValueError names --repetitions."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    out = []
    for v in items:
        try:
            n = int(v) if isinstance(v, str) else v
        except ValueError:
            n = None
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--repetitions: expected positive integers separated by commas (e.g. 1,4,16), got {v!r}")
        out.append(n)
    if not out:
        raise ValueError("--repetitions: expected at least one positive integer (e.g. 1,4,16)")
    return tuple(sorted(set(out)))


def secret_token_ids(store: Path, manifest: StoreManifest) -> tuple[list[int], list[int]]:
    """(ids of PREFIX, ids of the digits 0..9) under the store's tokenizer; ValueError naming the
    tokenizer when a digit is not one token of its own (alone and inside a secret)."""
    import tokenizers  # deferred: only this audit kind tokenizes text

    tok = tokenizers.Tokenizer.from_file(str(store / TOKENIZER_DIR / "tokenizer.json"))
    name = manifest.tokenizer_source

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    prefix = encode(PREFIX)
    digits = []
    for d in range(NUM_DIGITS):
        ids = encode(str(d))
        if len(ids) != 1 or tok.id_to_token(ids[0]) != str(d):
            pieces = [tok.id_to_token(i) for i in ids]
            raise ValueError(
                f"tokenizer {name!r}: the digit {d} is tokenized as {pieces}; the exposure audit needs each digit "
                "0-9 to be one token of its own (a vocabulary with the ten digits)"
            )
        digits.append(ids[0])
    for sample in ("0 1 2 3 4 5", "6 7 8 9 0 1"):
        if encode(f"{PREFIX} {sample}") != prefix + [digits[int(c)] for c in sample.split()]:
            raise ValueError(
                f"tokenizer {name!r}: '{PREFIX} {sample}' is not the prefix's tokens followed by one token per digit"
            )
    if len(prefix) + NUM_POSITIONS + 2 > manifest.seq_len:
        raise ValueError(
            f"recipe field 'data.seq_len': {manifest.seq_len} cannot hold [CLS] '{PREFIX}' and {NUM_POSITIONS} "
            f"digits [SEP] ({len(prefix) + NUM_POSITIONS + 2} tokens)"
        )
    return prefix, digits


def secret_rows(
    manifest: StoreManifest, prefix: list[int], digit_ids: Sequence[int], secrets: np.ndarray
) -> np.ndarray:
    """int32 [n, seq_len]: [CLS] prefix digits [SEP] then padding, one row per secret (digits [n, 6])."""
    body = np.asarray(prefix, np.int64)[None, :].repeat(len(secrets), 0)
    ids = np.concatenate([body, np.asarray(digit_ids, np.int64)[secrets]], axis=1)
    rows = np.full((len(secrets), manifest.seq_len), manifest.pad_id, np.int32)
    rows[:, 0] = manifest.cls_id
    rows[:, 1 : 1 + ids.shape[1]] = ids
    rows[:, 1 + ids.shape[1]] = manifest.sep_id
    return rows


def draw_secrets(key: jax.Array, num: int) -> np.ndarray:
    """int64 [num, 6]: `num` distinct secrets, uniform over the 10^6 digit strings."""
    values = np.asarray(jax.random.choice(key, NUM_DIGITS**NUM_POSITIONS, (num,), replace=False), np.int64)
    powers = NUM_DIGITS ** np.arange(NUM_POSITIONS - 1, -1, -1, dtype=np.int64)
    return (values[:, None] // powers) % NUM_DIGITS


def digit_log_probs(
    hf_dir: Path, row: np.ndarray, positions: np.ndarray, digit_ids: Sequence[int], *, mask_id: int, pad_id: int
) -> np.ndarray:
    """float64 [6, 10]: log p(digit | the row with every digit position masked), one forward pass,
    normalized over the ten digit tokens."""
    graphdef, params = functional.split_params(BertForMaskedLM.from_pretrained(str(hf_dir)))
    ids = np.asarray(row, np.int32).copy()
    ids[positions] = mask_id
    logits = functional.mlm_logits(
        graphdef,
        params,
        jnp.asarray(ids[None]),
        jnp.asarray((ids != pad_id).astype(np.int32)[None]),
        None,
        None,
        masked_positions=jnp.asarray(positions[None].astype(np.int32)),
    )[0].astype(jnp.float32)
    digit_logits = np.asarray(logits, np.float64)[:, np.asarray(digit_ids)]
    return digit_logits - np.logaddexp.reduce(digit_logits, axis=1, keepdims=True)


def run_exposure_audit(
    recipe_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    repetitions: str | Sequence[int] = DEFAULT_REPETITIONS,
    secrets_per_count: int = DEFAULT_SECRETS,
    overrides: Iterable[str] = (),
    progress: bool = True,
    log: Callable[[str], None] = print,
    noise_seed_file: str | os.PathLike[str] | None = None,
) -> ExposureReport:
    """Plant, train twice, score (see the module docstring); writes OUTPUT_DIR/audit.json.
    `secrets_per_count` secrets per repetition count, and as many never planted (the control)."""
    started = time.perf_counter()
    counts = parse_repetitions(repetitions)
    s = secrets_per_count
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise ValueError(f"--secrets: expected a positive integer (secrets per repetition count), got {s!r}")
    overrides = list(overrides)
    recipe = load_recipe(recipe_path, overrides)
    if not recipe.privacy.enabled:
        raise ValueError(
            "recipe field 'privacy.enabled': the exposure audit needs a private recipe (it trains the recipe and "
            "its non-private twin side by side)"
        )
    if recipe.data.tokenizer == "dp":
        raise ValueError(
            "recipe field 'data.tokenizer': 'dp' (a DP vocabulary) is not supported by the exposure audit, whose "
            "non-private twin would learn its vocabulary again; audit a recipe with a public tokenizer"
        )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = base_store(recipe, out)
    manifest = read_manifest(base)
    prefix, digit_ids = secret_token_ids(base, manifest)

    secret = run_secret(out / "checkpoints" / SECRET_FILE, reuse=False, supplied=noise_seed_file)
    _, canary_key = audit_keys(secret, KIND)
    all_counts = (0, *counts)
    drawn = draw_secrets(canary_key, s * len(all_counts))
    planted_times = np.repeat(np.asarray(all_counts, np.int64), s)
    rows = secret_rows(manifest, prefix, digit_ids, np.repeat(drawn, planted_times, axis=0))
    store = out / "store"
    write_canary_store(base, store, rows, what=f"rows of audit secrets ('{PREFIX} d d d d d d', exposure audit)")
    log(
        f"audit: {len(drawn)} secrets '{PREFIX} d d d d d d', {s} each planted {', '.join(map(str, all_counts))} "
        f"times ({len(rows)} rows appended to the training set in {store})"
    )
    n_train = manifest.num_examples("train")
    marker = {"secrets": len(drawn), "repetitions": list(all_counts), "rows": len(rows)}
    common = {"store": store, "kind": KIND, "progress": progress, "log": log}
    run, ledger = train_audit_run(
        recipe_path,
        out / "run",
        marker={**marker, "model": "dp"},
        overrides=[*overrides, *audit_dataset_size(recipe, n_train, len(rows))],
        noise_seed_file=noise_seed_file,
        **common,
    )
    twin_path = nonprivate_twin(recipe_path, recipe)
    log(f"audit: the non-private twin ({twin_path.name}, privacy.enabled=false) on the same planted store")
    twin, _ = train_audit_run(
        twin_path,
        out / "run_nonprivate",
        marker={**marker, "model": "nonprivate"},
        overrides=[*overrides, *NONPRIVATE_OVERRIDES],
        noise_seed_file=None,
        mechanism=f"audit/{KIND}/nonprivate",
        **common,
    )
    if ledger is None or run.epsilon is None:
        raise RuntimeError("the exposure audit's DP run wrote no ledger")

    template = secret_rows(manifest, prefix, digit_ids, np.zeros((1, NUM_POSITIONS), np.int64))[0]
    positions = np.arange(1 + len(prefix), 1 + len(prefix) + NUM_POSITIONS)
    tables = {
        name: digit_log_probs(
            d / "hf", template, positions, digit_ids, mask_id=manifest.mask_id, pad_id=manifest.pad_id
        )
        for name, d in (("dp", out / "run"), ("nonprivate", out / "run_nonprivate"))
    }
    per_model = {name: (exposure(t, drawn), *ranks(t, drawn)) for name, t in tables.items()}
    secrets = [
        {
            "secret": "".join(map(str, drawn[i])),
            "repetitions": int(planted_times[i]),
            **{f"exposure_{m}": float(v[0][i]) for m, v in per_model.items()},
            **{f"rank_{m}": int(v[1][i]) for m, v in per_model.items()},
            **{f"ties_{m}": int(v[2][i]) for m, v in per_model.items()},
        }
        for i in range(len(drawn))
    ]
    epsilon = float(run.epsilon)
    dp_ledger = PrivacyLedger.from_dict(ledger)
    report = ExposureReport(
        recipe=str(recipe_path),
        steps=run.steps_done,
        steps_nonprivate=twin.steps_done,
        epsilon=epsilon,
        delta=dp_ledger.delta + dp_ledger.truncation_delta(epsilon),
        tokenizer=manifest.tokenizer_source,
        prefix=PREFIX,
        num_candidates=NUM_DIGITS**NUM_POSITIONS,
        repetitions=list(all_counts),
        secrets_per_count=s,
        secrets=secrets,
        summary=exposure_summary(secrets, all_counts),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        overrides=overrides,
        wall_time_s=round(time.perf_counter() - started, 1),
        twin_recipe=str(twin_path),
    )
    write_json(out / "audit.json", report.to_dict())
    return report


def nonprivate_twin(recipe_path: str | os.PathLike[str], recipe: Recipe) -> Path:
    """The recipe file the twin trains: `reference.recipe` (beside the recipe) when the recipe names
    one, since a non-private run needs its own tuning (the tiny recipe's DP learning rate leaves a
    run without clipping at the unigram baseline), else the recipe itself."""
    named = recipe.reference.recipe
    if named is None:
        return Path(recipe_path)
    twin = Path(recipe_path).parent / named
    if not twin.is_file():
        raise FileNotFoundError(
            f"recipe field 'reference.recipe': {twin} does not exist; expected the twin's recipe file"
        )
    return twin


def format_table(report: ExposureReport) -> str:
    """The exposure audit as text: what was run, then one row per repetition count."""
    head = [
        ("audit kind", f"exposure ({EXPOSURE_MEANING})"),
        ("recipe", report.recipe + "".join(f" --set {o}" for o in report.overrides)),
        ("DP run", f"{report.steps} steps, epsilon {report.epsilon:.4g} at delta {report.delta:g}"),
        ("non-private twin", f"{report.twin_recipe}: {report.steps_nonprivate} steps, epsilon infinity"),
        ("secrets", f"'{report.prefix} d d d d d d' ({report.tokenizer}); {report.secrets_per_count} per count"),
        ("candidates", f"{report.num_candidates} (max exposure {math.log2(report.num_candidates):.2f} bits)"),
        ("ties", report.ties),
        ("privacy spent", report.privacy_spent),
        ("date (UTC)", report.date + (f"; {report.wall_time_s:.0f} s" if report.wall_time_s is not None else "")),
    ]
    width = max(len(k) for k, _ in head)
    lines = [f"{k:<{width}}  {v}" for k, v in head]
    cols = ("repetitions", "secrets", "DP mean", "DP max", "non-private mean", "non-private max")
    lines += ["", "  ".join(f"{c:>16}" for c in cols)]
    for row in report.summary:
        values = (row["repetitions"], row["num_secrets"], row["mean_dp"], row["max_dp"])
        values += (row["mean_nonprivate"], row["max_nonprivate"])
        lines.append("  ".join(f"{v:>16.2f}" if isinstance(v, float) else f"{v:>16}" for v in values))
    lines.append("(exposure in bits; repetitions 0 = control secrets, never planted)")
    return "\n".join(lines)
