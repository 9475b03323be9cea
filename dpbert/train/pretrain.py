"""`dpbert pretrain`: masked-LM pretraining of BERT with DP-SGD (or without, for baselines).

Reading order: `pretrain` opens the data (`open_data`; each step's Poisson sample is
`sample_batch`), builds the step once (`build_setup`: model, optimizer, masking, keys, loss, and
each stage's DP step from `dpbert.privacy.dp_step`), runs the engine's loop (`_train`,
`dpbert.train.engine.run_loop`) and writes the Hugging Face folder and the release.

Guarantees: the privacy plan is fixed before anything is written (`dpbert.config.plan.plan_recipe`);
the DP mechanism's keys come from a secret in the checkpoint folder only; a resumed run replays the
uninterrupted run's steps exactly; held-out figures of the private corpus stay in the run folder.
The run folder's layout: docs/INTERNALS.md ("dpbert.train.pretrain").
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from dpbert.atomic import write_json
from dpbert.config.plan import Plan, dp_vocabulary_event, dp_vocabulary_window, plan_recipe, public_dataset_size
from dpbert.config.recipe import Recipe, load_recipe, recipe_to_dict, save_recipe
from dpbert.data.store import TokenStore, prepare_store, train_texts
from dpbert.data.tokenizer import load_tokenizer, resolve_tokenizer, train_dp_wordpiece
from dpbert.model import functional
from dpbert.privacy.documents import SEQUENCE_PADDING
from dpbert.privacy.dp_step import StepFn, ema_params, make_dp_train_step, make_train_step
from dpbert.privacy.randomness import SECRET_FILE, RunSecret, mechanism_key, read_secret
from dpbert.privacy.sampling import check_document_offsets
from dpbert.privacy.schedule import BatchSchedule
from dpbert.release.export import AUDIT_RUN_FILE, RANDOMNESS_FILE
from dpbert.train import distributed
from dpbert.train.checkpoint import CheckpointStore
from dpbert.train.device import device_settings
from dpbert.train.engine import (
    Checkpointing,
    Hook,
    Sample,
    device_batch_size,
    fingerprint,
    has_checkpoints,
    restore_or_init,
    run_loop,
    secret_for_run,
)
from dpbert.train.mesh import batch_axes, make_mesh
from dpbert.train.metrics import MetricsLog
from dpbert.train.mlm import (
    evaluate,
    fill_mask,
    make_eval_fn,
    make_masker,
    make_mlm_loss,
    max_predictions,
    unigram_token,
)
from dpbert.train.pretrain_report import RunResult, export_release, print_report, recipe_reference, write_hf
from dpbert.train.state import (
    AbstractState,
    TrainState,
    abstract_state,
    bert_config,
    init_state,
    learning_rate,
    make_optimizer,
    run_keys,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainData:
    """The run's token store opened for training: its count of units (sequences or documents;
    private, never released), the public dataset size N of q = B/N (`n_train`), documents'
    offsets when the unit is a document, and the unigram baseline's token (a non-private
    diagnostic)."""

    manifest: Any
    train_store: TokenStore
    eval_store: TokenStore
    tokenizer: Any
    offsets: np.ndarray | None
    stored_units: int
    n_train: int
    unigram: int


def open_data(recipe: Recipe, run_dir: Path, log: Callable[[str], None]) -> TrainData:
    """Prepare (process 0, on storage every host sees) and open the recipe's token store."""
    store_dir = Path(recipe.data.store) if recipe.data.store else run_dir / "store"
    t0 = time.perf_counter()

    def prepare(out: Path, corpus: str, tokenizer: str) -> Any:
        return prepare_store(
            out,
            corpus=corpus,
            tokenizer=tokenizer,
            seq_len=recipe.data.seq_len,
            eval_fraction=recipe.data.eval_fraction,
            seed=recipe.data.split_seed,
            train_vocab_size=recipe.data.train_vocab_size,
            num_proc=recipe.data.num_proc,
        )

    def prepared(out: Path, corpus: str, tokenizer: str) -> Any:
        # Process 0 builds the store; the others then find it ready.
        manifest = prepare(out, corpus, tokenizer) if distributed.is_primary() else None
        distributed.barrier(f"dpbert pretrain: token store {out.name} ready")
        return manifest or prepare(out, corpus, tokenizer)

    tokenizer = (
        str(run_dir / "vocabulary")
        if recipe.data.tokenizer == "dp"
        else resolve_tokenizer(
            recipe.data.tokenizer, declared_public=recipe.data.tokenizer_declared_public, private=recipe.privacy.enabled
        )
    )
    manifest = prepared(store_dir, recipe.data.corpus, tokenizer)
    train_store = TokenStore.open(store_dir, "train")
    eval_store = TokenStore.open(store_dir, "eval")
    if recipe.data.eval_corpus is not None:  # public: all of it is held out, with the run's vocabulary
        public_dir = run_dir / "eval_store"
        prepared(public_dir, recipe.data.eval_corpus, str(train_store.tokenizer_dir))
        eval_store = TokenStore.open(public_dir, "train")
        log(f"data: held-out figures on the public corpus {recipe.data.eval_corpus} (data.eval_corpus)")
    document_unit = recipe.privacy.enabled and recipe.privacy.unit == "document"
    offsets = train_store.document_offsets() if document_unit else None
    if offsets is not None:
        offsets = check_document_offsets(offsets)  # an empty document is refused here
    stored = len(train_store) if offsets is None else offsets.size - 1
    size = public_dataset_size(recipe, stored)
    log(
        f"data: {len(train_store)} train / {len(eval_store)} held-out sequences of {manifest.seq_len} tokens "
        f"({manifest.source}; vocabulary {manifest.vocab_origin}, {manifest.vocab_size} tokens) "
        f"[{time.perf_counter() - t0:.0f} s]"
    )
    units = "sequences" if offsets is None else "documents"
    if size.source != "exact":
        log(
            f"data: every stored {units[:-1]} is sampled at q = B/N with N = {size.n}, the public dataset size "
            f"({'declared in the recipe' if size.source == 'declared' else 'rounded down to 2 significant digits'}); "
            f"truncation accounted for stores of up to {size.bound} {units}"
        )
    if offsets is not None:
        log(
            f"privacy unit: one document (at most {recipe.privacy.max_sequences_per_document} sequences of a "
            "sampled document per step)"
        )
    return TrainData(
        manifest=manifest,
        train_store=train_store,
        eval_store=eval_store,
        tokenizer=load_tokenizer(train_store.tokenizer_dir),
        offsets=offsets,
        stored_units=stored,
        n_train=size.n,
        unigram=unigram_token(
            train_store if recipe.data.eval_corpus is None else eval_store,
            len(train_store if recipe.data.eval_corpus is None else eval_store),
            manifest.special_token_ids,
        ),
    )


def dp_vocabulary_dir(
    recipe: Recipe, run_dir: Path, secret: RunSecret, mechanism: str, *, resume: bool, log: Callable[[str], None]
) -> Path:
    """The run's DP vocabulary folder (RUN_DIR/vocabulary), learned from the train documents with
    the key `mechanism_key(secret, mechanism + "/vocabulary")`, or reused by a resumed run (its
    secret is the same, so is the folder)."""
    out = run_dir / "vocabulary"
    if resume and (out / "tokenizer.json").is_file():
        return out
    d, event = recipe.data, dp_vocabulary_event(recipe)
    t0 = time.perf_counter()
    tokenizer = train_dp_wordpiece(
        train_texts(d.corpus, eval_fraction=d.eval_fraction, seed=d.split_seed),
        event=event,
        key=mechanism_key(secret, f"{mechanism}/vocabulary"),
        vocab_size=d.train_vocab_size,
        out_dir=out,
        window=dp_vocabulary_window(recipe),
        origin=(
            "DP WordPiece learned from the run's private training corpus (Gaussian partition selection, epsilon "
            f"{event.epsilon_share:.3g} "
            f"alone, selection delta {event.selection_delta:g}, unit {event.unit}; in the run's ledger)"
        ),
    )
    log(
        f"vocabulary: DP WordPiece of {len(tokenizer)} tokens (noise std {event.noise_stddev:.1f} on word counts, "
        f"threshold {event.threshold:.1f}) [{time.perf_counter() - t0:.0f} s]"
    )
    return out


def sample_batch(
    recipe: Recipe,
    data: TrainData,
    plan: Plan,
    stage_keys: tuple[jax.Array, ...],
    device_batches: tuple[int, ...],
    mesh: Mesh,
    index: int,
    t: int,
) -> Sample:
    """Step t's Poisson sample (stage `index`): this process's rows only, truncated at the
    ledger's physical batch, padded to the stage's compiled batch, as global arrays on `mesh`."""
    stage = plan.schedule.stages[index]
    if data.offsets is None:
        drawn, rows = distributed.local_batch(
            data.train_store,
            stage_keys[index],
            t,
            dataset_size=data.n_train,
            expected_batch_size=stage.expected_batch_size,
            physical_batch_size=plan.physical_batch_sizes[index],
            padded_batch_size=device_batches[index],
        )
        extra = {}
    else:
        drawn, rows = distributed.local_document_batch(
            data.train_store,
            stage_keys[index],
            t,
            document_offsets=data.offsets,
            num_documents=data.n_train,
            expected_batch_size=stage.expected_batch_size,
            physical_batch_size=plan.physical_batch_sizes[index],
            max_sequences_per_document=recipe.privacy.max_sequences_per_document,
            padded_batch_size=device_batches[index],
        )
        extra = {SEQUENCE_PADDING: drawn.sequence_padding}
    batch, is_padding = distributed.global_array(
        (
            {
                "input_ids": rows.astype(np.int32),
                "index": drawn.indices.astype(np.int32),
                "step": np.full(drawn.indices.shape, t, np.int32),
                **extra,
            },
            drawn.is_padding,
        ),
        mesh,
    )
    return Sample(batch=batch, is_padding=is_padding, realized_size=drawn.realized_size)


def state_fingerprints(recipe: Recipe, manifest: Any, n_train: int) -> dict[str, str]:
    """What a checkpoint's arrays depend on; a resume must match every entry."""
    return {
        # remat trades memory for compute and changes no result: a resume may switch it.
        "model": fingerprint({k: v for k, v in recipe_to_dict(recipe)["model"].items() if k != "remat"}),
        "data": f"{manifest.tokenizer_fingerprint[:16]}/{manifest.corpus_sha256[:16]}/{n_train}/{manifest.seq_len}",
        "optimizer": fingerprint(_optimizer_record(recipe)),
        "seed": str(recipe.train.seed),
        "private": str(recipe.privacy.enabled),
    }


def _optimizer_record(recipe: Recipe) -> dict[str, Any]:
    """The optimizer section as a checkpoint depends on it: fields added later are left out at
    their old behaviour (DP-AdamBC's two when off, `decay_matrices_only` when false,
    `cooldown_steps` when 0), so that checkpoints written before they existed still resume."""
    record = recipe_to_dict(recipe)["optimizer"]
    if not recipe.optimizer.noise_variance_correction:
        for name in ("noise_variance_correction", "noise_variance_floor_ratio"):
            del record[name]
    if not recipe.optimizer.decay_matrices_only:
        del record["decay_matrices_only"]
    if not recipe.optimizer.cooldown_steps:
        del record["cooldown_steps"]
    return record


def _shared_secret(ckpt_dir: Path, *, resume: bool, supplied: str | os.PathLike[str] | None) -> RunSecret:
    """The run's secret, drawn (or read back) by process 0; the other processes read its file."""
    secret = secret_for_run(ckpt_dir, resume=resume, supplied=supplied) if distributed.is_primary() else None
    distributed.barrier("dpbert pretrain: noise secret ready")
    return secret or read_secret(ckpt_dir / SECRET_FILE)


def _log_setup(
    recipe: Recipe, plan: Plan, mesh: Mesh, device_batches: tuple[int, ...], log: Callable[[str], None]
) -> None:
    log(
        f"devices: mesh {' x '.join(f'{k}={v}' for k, v in mesh.shape.items())} over {jax.process_count()} "
        f"process(es); compiled batch per stage {', '.join(map(str, device_batches))}"
    )
    if plan.ledger is None:
        if recipe.privacy.enabled:  # an audit's noise-free run
            log(
                f"privacy: clipping to {recipe.privacy.clip_norm} with the noise switched off (an audit's run: no claim)"
            )
        else:
            log("privacy: NOT private (baseline: no clipping, no noise)")
        return
    sigmas = ", ".join(f"{s.noise_multiplier:.4g}" for s in plan.schedule.stages)
    log(
        f"privacy: DP-SGD, clip norm {recipe.privacy.clip_norm}, noise multiplier(s) {sigmas}, "
        f"planned epsilon {plan.ledger.epsilon():.3f} at delta {recipe.privacy.delta:g} ({recipe.privacy.accountant})"
    )


def _finish(
    recipe: Recipe,
    recipe_path: str | os.PathLike[str],
    data: TrainData,
    plan: Plan,
    state: TrainState,
    *,
    run_dir: Path,
    graphdef: Any,
    last_eval: dict[str, Any] | None,
    started: float,
    release: bool,
    show_fill_mask: bool,
    log: Callable[[str], None],
) -> RunResult:
    """The run's result; after a complete run (`last_eval` given) also the exports (`hf/`,
    `release/`, process 0 only), fill-mask predictions and the printed report."""
    common = {
        "run_dir": run_dir,
        "steps_done": state.step,
        "total_steps": recipe.total_steps,
        "epsilon": plan.epsilon_after(state.step),
        "delta": None if plan.ledger is None else recipe.privacy.delta,
    }
    if last_eval is None:
        return RunResult(
            **common,
            stopped_early=True,
            eval_mlm_accuracy=None,
            eval_mlm_loss=None,
            wall_time_s=time.perf_counter() - started,
        )
    host_params = distributed.host_copy(state.params)  # collective; then process 0 alone writes
    filled: tuple[Any, ...] = ()
    release_dir: Path | None = None
    primary = distributed.is_primary()
    if primary:
        if release:
            write_hf(
                functional.merge(graphdef, jax.tree_util.tree_map(jnp.asarray, host_params)),
                data.tokenizer,
                run_dir / "hf",
                ledger=None if plan.ledger is None else state.ledger,
            )
            release_dir = export_release(run_dir, private=plan.ledger is not None)
        if show_fill_mask:
            filled = fill_mask(
                graphdef,
                host_params,
                data.tokenizer,
                recipe.report.fill_mask,
                recipe.report.top_k,
                data.manifest.seq_len,
            )
    distributed.barrier("dpbert pretrain: exports written")
    result = RunResult(
        **common,
        stopped_early=False,
        eval_mlm_accuracy=last_eval["eval_mlm_accuracy"],
        eval_mlm_loss=last_eval["eval_mlm_loss"],
        wall_time_s=time.perf_counter() - started,
        fill_mask=filled,
        eval_unigram_accuracy=last_eval["eval_unigram_accuracy"],
        unigram_token=data.tokenizer.convert_ids_to_tokens(data.unigram),
        reference=recipe_reference(recipe),
        params=last_eval.get("params"),
        last_iterate=(
            (last_eval["eval_mlm_accuracy_last_iterate"], last_eval["eval_mlm_loss_last_iterate"])
            if "eval_mlm_accuracy_last_iterate" in last_eval
            else None
        ),
    )
    if primary:
        print_report(result, release_dir, log)
    return result


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """What every pretraining step of a recipe is built from (`build_setup`): the model config,
    the optimizer, the abstract state in the mesh's shardings, the masking (training's, and
    held-out scoring's at `data.eval_mask_prob`), the run's keys and the per-example masked-LM
    loss. `pretrain`, `dpbert pretrain --compile-only` and the audit build it the same way, so
    they compile the same step."""

    recipe: Recipe
    mesh: Mesh
    config: Any
    optimizer: optax.GradientTransformation
    abstract: AbstractState
    masker: Callable[..., dict[str, jax.Array]]
    eval_masker: Callable[..., dict[str, jax.Array]]
    masking_key: jax.Array
    stage_keys: tuple[jax.Array, ...]
    loss_fn: Any

    def stage_step(self, *, noise_multiplier: float, expected_batch_size: int) -> StepFn:
        """The jitted step of one schedule stage: the DP-SGD step of `dpbert.privacy.dp_step`
        (clipped sum, noise once, division by the expected batch) or, without privacy, its
        non-private twin; batch split over all mesh axes, state in its shardings, donated."""
        r = self.recipe
        common: dict[str, Any] = {
            "microbatch_size": r.train.microbatch_size,
            "mesh": self.mesh,
            "data_axis": batch_axes(self.mesh),
            "state_shardings": self.abstract.shardings,
        }
        if not r.privacy.enabled:
            return make_train_step(self.loss_fn, self.optimizer, **common)
        return make_dp_train_step(
            self.loss_fn,
            self.optimizer,
            clip_norm=r.privacy.clip_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            clipping_method=r.train.clipping,
            **common,
        )


def build_setup(
    recipe: Recipe,
    mesh: Mesh,
    *,
    config: Any,
    seq_len: int,
    token_ids: dict[str, Any],
    secret: RunSecret | None,
    mechanism: str,
    schedule: BatchSchedule | None = None,
) -> Setup:
    """The `Setup` of `recipe` on `mesh` for a model `config` (`bert_config`).

    Args:
      seq_len: tokens per stored sequence (the store's).
      token_ids: `mask_token_id`, `special_token_ids` and `pad_id` of the vocabulary.
      secret: the run's secret (private runs; None for a non-private run, whose keys come from
        `train.seed`); `mechanism` names the purpose the keys are derived for.
      schedule: the plan's schedule (its noise multipliers), which DP-AdamBC needs
        (`optimizer.noise_variance_correction`); otherwise unused.
    Returns:
      `Setup`: the abstract state and its shardings, the optimizer, the masker, the keys, the loss,
      and `stage_step` to build each stage's jitted step.
    """
    optimizer = make_optimizer(recipe, schedule)
    abstract = abstract_state(recipe, config, optimizer, mesh)
    masking_key, stage_keys = run_keys(recipe, secret, mechanism)
    masker = make_masker(
        vocab_size=config.vocab_size,
        mask_prob=recipe.data.mask_prob,
        num_predictions=max_predictions(seq_len, recipe.data.mask_prob),
        max_position_offset=max_position_offset(recipe, config, seq_len),
        **token_ids,
    )
    eval_prob = recipe.data.eval_mask_prob or recipe.data.mask_prob
    eval_masker = make_masker(
        vocab_size=config.vocab_size,
        mask_prob=eval_prob,
        num_predictions=max_predictions(seq_len, eval_prob),
        **token_ids,
    )
    return Setup(
        recipe=recipe,
        mesh=mesh,
        config=config,
        optimizer=optimizer,
        abstract=abstract,
        masker=masker,
        eval_masker=eval_masker,
        masking_key=masking_key,
        stage_keys=stage_keys,
        loss_fn=make_mlm_loss(recipe, abstract.graphdef, masker, masking_key),
    )


def max_position_offset(recipe: Recipe, config: Any, seq_len: int) -> int:
    """The largest training position offset: config.max_position_embeddings - seq_len with
    `data.random_position_offsets`, else 0 (every example at positions 0..seq_len-1)."""
    return max(config.max_position_embeddings - seq_len, 0) if recipe.data.random_position_offsets else 0


def _train(
    setup: Setup,
    plan: Plan,
    data: TrainData,
    state: TrainState,
    *,
    checkpoints: CheckpointStore,
    fingerprints: dict[str, str],
    run_dir: Path,
    device_batches: tuple[int, ...],
    eval_fn: Any,
    progress: bool,
) -> tuple[TrainState, dict[str, Any] | None]:
    """The loop of a pretraining run (`run_loop` with this task's step, sample, evaluation and
    ledger file); returns the final state and the final evaluation (None after SIGTERM)."""
    recipe, mesh, stage_keys = setup.recipe, setup.mesh, setup.stage_keys
    primary = distributed.is_primary()
    metrics = MetricsLog(run_dir / "metrics.jsonl") if primary else None
    total = recipe.total_steps
    bar = _progress_bar(total, state.step, enabled=progress)

    def make_stage_step(index: int) -> StepFn:
        stage = plan.schedule.stages[index]
        return setup.stage_step(noise_multiplier=stage.noise_multiplier, expected_batch_size=stage.expected_batch_size)

    def run_eval(state: TrainState) -> dict[str, Any]:
        result = evaluate(
            state.params,
            eval_fn,
            data.eval_store,
            batches=recipe.train.eval_batches,
            batch_size=recipe.train.eval_batch_size,
            mesh=mesh,
            unigram=data.unigram,
        )
        public = recipe.data.eval_corpus is not None
        labels = {"eval_public": public, "eval_corpus": recipe.data.eval_corpus if public else recipe.data.corpus}
        return {"kind": "eval", "step": state.step, **result, **labels}

    def periodic_eval(state: TrainState) -> dict[str, Any]:
        record = run_eval(state)
        bar.write(
            f"step {state.step}: held-out MLM accuracy {record['eval_mlm_accuracy']:.4f}, "
            f"loss {record['eval_mlm_loss']:.3f} (unigram baseline {record['eval_unigram_accuracy']:.4f})"
        )
        return record

    def after_save(state: TrainState) -> None:
        if plan.ledger is not None:
            write_json(run_dir / "privacy.json", state.ledger)

    try:
        loop = run_loop(
            state,
            plan=plan,
            stage_keys=stage_keys,
            make_step=make_stage_step,
            sample=functools.partial(sample_batch, recipe, data, plan, stage_keys, device_batches, mesh),
            checkpointing=Checkpointing(
                store=checkpoints, fingerprints=fingerprints, every=recipe.train.checkpoint_every, after_save=after_save
            ),
            metrics=metrics,
            log_every=recipe.train.log_every,
            learning_rate=learning_rate(recipe),
            hooks=(Hook(every=recipe.train.eval_every, fn=periodic_eval),),
            progress=bar,
            log=bar.write if primary else _silent,
        )
        state = loop.state
        last_eval = None
        if not loop.stopped:
            last_eval = run_eval(state)
            decay = recipe.optimizer.ema_decay
            if decay is not None:  # the average is what is evaluated and released; the last iterate is logged
                last = {f"{k}_last_iterate": last_eval[k] for k in ("eval_mlm_accuracy", "eval_mlm_loss")}
                average = jax.jit(ema_params, static_argnums=2, out_shardings=setup.abstract.shardings[0])
                state = state.replace(params=average(state.opt_state, state.params, decay))
                last_eval = {**run_eval(state), **last, "params": f"moving average (decay {decay:g})"}
            if metrics is not None:
                metrics.write(last_eval)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
        checkpoints.close()

    return state, last_eval


def pretrain(
    recipe_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    overrides: Iterable[str] = (),
    resume: bool = False,
    show_fill_mask: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    noise_seed_file: str | os.PathLike[str] | None = None,
    mechanism: str = "pretrain",
    release: bool = True,
    noise_free: bool = False,
) -> RunResult:
    """Run (or resume) the recipe in `output_dir`; see the module docstring for guarantees.

    Args:
      recipe_path, overrides: the recipe and its `--set KEY=VALUE` overrides.
      output_dir: the run folder; resume: continue its checkpoints (exact replay).
      show_fill_mask, progress, log: what is printed.
      noise_seed_file: an auditor's secret (hex) instead of a fresh OS CSPRNG draw, so that the
        run can be reproduced by whoever holds the file; the release says so.
      mechanism: the purpose the keys are derived for (an audit's training run passes its own).
      release: False skips the final `hf/` and `release/` folders (a sweep's arms).
      noise_free: an audit's run only (OUTPUT_DIR holds AUDIT_RUN.json, so it is never released):
        the recipe's clipping with the noise switched off; nothing is claimed (epsilon = infinity).
    Returns:
      `RunResult`: steps, epsilon and delta, held-out figures, wall time and the release folder."""
    started = time.perf_counter()
    primary = distributed.is_primary()
    if not primary:
        log = _silent
    recipe = load_recipe(recipe_path, overrides)
    run_dir = Path(output_dir)
    ckpt_dir = run_dir / "checkpoints"
    _check_run_folder(recipe, run_dir, resume=resume, noise_seed_file=noise_seed_file, noise_free=noise_free)

    # --- data (the DP vocabulary is the run's first mechanism: it needs the secret before the data)
    secret = None
    if recipe.data.tokenizer == "dp":
        secret = _shared_secret(ckpt_dir, resume=resume, supplied=noise_seed_file)
        if primary:
            dp_vocabulary_dir(recipe, run_dir, secret, mechanism, resume=resume, log=log)
        distributed.barrier("dpbert pretrain: DP vocabulary ready")
    data = open_data(recipe, run_dir, log)
    manifest = data.manifest

    # --- privacy plan (refuses a schedule that would pass the target epsilon, before anything is
    # written), from the recipe as written: the device's settings below never change the ledger
    mesh = make_mesh(data=recipe.mesh.data, fsdp=recipe.mesh.fsdp)
    config = bert_config(recipe, manifest.vocab_size)
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, vocab_size=config.vocab_size))
    plan = plan_recipe(recipe, data.stored_units)
    if noise_free:
        plan = _without_noise(plan)
    written = recipe
    recipe = _tuned_for_device(recipe, config, data, plan, mesh.devices.size, log)
    if recipe.privacy.enabled and secret is None:
        secret = _shared_secret(ckpt_dir, resume=resume, supplied=noise_seed_file)

    # --- model, optimizer, masking, keys and the DP step
    setup = build_setup(
        recipe,
        mesh,
        config=config,
        seq_len=manifest.seq_len,
        token_ids=_token_ids(manifest),
        secret=secret,
        mechanism=mechanism,
        schedule=plan.schedule,
    )
    mb = recipe.train.microbatch_size
    device_batches = tuple(device_batch_size(b, mesh.devices.size, mb) for b in plan.physical_batch_sizes)
    _log_setup(recipe, plan, mesh, device_batches, log)

    # --- state: restored into its shardings, or created in them
    fingerprints = state_fingerprints(recipe, manifest, data.n_train)
    checkpoints = CheckpointStore(ckpt_dir, keep=recipe.train.keep_checkpoints)
    state = restore_or_init(
        checkpoints,
        resume=resume,
        like=(setup.abstract.params, setup.abstract.opt_state),
        init=lambda: init_state(recipe, setup.abstract, setup.optimizer),
        fingerprints=fingerprints,
        plan=plan,
        total_steps=recipe.total_steps,
        metrics_paths=(run_dir / "metrics.jsonl",),
        log=log,
    )
    if primary:
        save_recipe(written, run_dir / "recipe.yaml")
        if secret is not None:
            write_json(run_dir / RANDOMNESS_FILE, {"source": secret.source})

    # --- loop, then the Hugging Face folder and the release
    state, last_eval = _train(
        setup,
        plan,
        data,
        state,
        checkpoints=checkpoints,
        fingerprints=fingerprints,
        run_dir=run_dir,
        device_batches=device_batches,
        eval_fn=make_eval_fn(setup.abstract.graphdef, setup.eval_masker, manifest.mask_id),
        progress=progress and primary,
    )
    return _finish(
        recipe,
        recipe_path,
        data,
        plan,
        state,
        run_dir=run_dir,
        graphdef=setup.abstract.graphdef,
        last_eval=last_eval,
        started=started,
        release=release,
        show_fill_mask=show_fill_mask,
        log=log,
    )


def _without_noise(plan: Plan) -> Plan:
    """The plan with every stage's noise multiplier 0 and no ledger: nothing is claimed."""
    stages = tuple(dataclasses.replace(s, noise_multiplier=0.0) for s in plan.schedule.stages)
    return dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, stages=stages), ledger=None)


def _check_run_folder(
    recipe: Recipe,
    run_dir: Path,
    *,
    resume: bool,
    noise_seed_file: str | os.PathLike[str] | None,
    noise_free: bool,
) -> None:
    """Refuse, before anything is written, a fresh run over checkpoints, a seed for a non-private
    run, and a noise-free run outside an audit's run folder (marked AUDIT_RUN.json: never released)."""
    if noise_free and not (run_dir / AUDIT_RUN_FILE).is_file():
        raise ValueError(
            f"noise_free: only an audit's run trains a private recipe without noise ({run_dir / AUDIT_RUN_FILE} "
            "marks one; `dpbert audit` writes it), since such a model must never be released"
        )
    if not resume and has_checkpoints(run_dir / "checkpoints"):
        raise ValueError(
            f"run folder {run_dir} already holds checkpoints; pass --resume to continue it or choose another --output-dir"
        )
    if not recipe.privacy.enabled and noise_seed_file is not None:
        raise ValueError(
            "--noise-seed-file: the recipe is non-private (privacy.enabled: false); there is no noise to seed"
        )
    run_dir.mkdir(parents=True, exist_ok=True)


def _tuned_for_device(
    recipe: Recipe, config: Any, data: TrainData, plan: Plan, devices: int, log: Callable[[str], None]
) -> Recipe:
    """The recipe with `train.tune_for_device`'s micro-batch and dtype applied (document batches keep
    the recipe's micro-batch). Only memory and speed change: the plan and ledger do not."""
    if not recipe.train.tune_for_device or data.offsets is not None:
        return recipe
    settings = device_settings(
        recipe,
        config,
        num_predictions=max_predictions(data.manifest.seq_len, recipe.data.mask_prob),
        dataset_size=data.n_train,
        physical_batch_sizes=plan.physical_batch_sizes,
        devices=devices,
    )
    log(settings.describe())
    return dataclasses.replace(recipe, train=settings.apply(recipe.train))


def _token_ids(manifest: Any) -> dict[str, Any]:
    """The special token ids the masker needs, from a token store's manifest."""
    return {
        "mask_token_id": manifest.mask_id,
        "special_token_ids": tuple(manifest.special_token_ids),
        "pad_id": manifest.pad_id,
    }


def _silent(_: str) -> None:
    """The log of processes other than 0: they print nothing."""


def _progress_bar(total: int, initial: int, *, enabled: bool) -> Any:

    return tqdm(
        total=total,
        initial=initial,
        desc="pretrain",
        unit="step",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
    )
