"""GLUE fine-tuning of a BERT checkpoint, non-private or with DP-SGD on the task data.

`finetune(task=..., model=..., output_dir=..., data=..., config=...)` runs one task on the
training engine (`dpbert.train.engine`: exact replay on resume, SIGTERM, checkpoints) and writes
metrics, evaluation and train records, the task-data ledger and the fine-tuned release;
`finetune_glue` runs every task under a GLUE root.

Guarantees: with DP every stored example is Poisson-sampled at q = B/N with a public N (declared or
rounded), clipped and noised by `dpbert.privacy.dp_step`; delta follows the config's rule (1/N^1.1
by default); the release states the task guarantee beside the pretrained source's. The output
folder layout and every record: docs/INTERNALS.md ("dpbert.train.finetune").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from dpbert.atomic import write_json
from dpbert.config.finetune import (
    DEFAULT_CONFIG,
    RESCALE_ABOVE,
    DPPlan,
    FinetuneConfig,
    OptimConfig,
    plan_dp,
    resolve_dp,
    resolve_nonprivate,
)
from dpbert.config.finetune_defaults import describe as describe_derived
from dpbert.config.plan import Plan
from dpbert.data import glue
from dpbert.model import BertForSequenceClassification
from dpbert.model import load_config as load_bert_config
from dpbert.model.ghost import ClassifierGhostLoss
from dpbert.model.lora import add_lora, merge_lora
from dpbert.privacy.dp_step import make_dp_train_step, make_train_step
from dpbert.privacy.randomness import RunSecret, mechanism_key
from dpbert.privacy.sampling import poisson_sample
from dpbert.privacy.schedule import BatchSchedule, Stage
from dpbert.release.export import RANDOMNESS_FILE
from dpbert.release.hub import resolve_pretrained
from dpbert.train import distributed
from dpbert.train.checkpoint import CheckpointStore
from dpbert.train.classifier import (
    Forward,
    auto_clipping,
    count_params,
    describe_trainable,
    evaluate,
    example_loss,
    learning_rate_schedule,
    make_optimizer,
    trainable_filter,
)
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
from dpbert.train.finetune_release import config_record, export_model, source_privacy, task_scope
from dpbert.train.mesh import batch_axes, make_mesh
from dpbert.train.metrics import MetricsLog, truncate_after
from dpbert.train.state import TrainState

# fold_in stream of the epoch order, distinct from the step key's streams in dpbert.privacy.randomness (0-3).
_SHUFFLE_STREAM = 4


# ----------------------------------------------------------------------------- parameters


def encoder_kernel_std(net: Any) -> float:
    """The mean, over the encoder's dense layers, of each kernel's standard deviation."""
    stds = [
        jnp.std(module.kernel[...], axis=(-2, -1))
        for _, module in nnx.iter_graph(net.bert.encoder)
        if isinstance(module, nnx.Linear)
    ]
    return float(jnp.mean(jnp.concatenate([jnp.ravel(s) for s in stds])))


def rescale_pretrained(net: Any, std: float) -> None:
    """In place: each encoder dense layer's kernel and bias times std / the kernel's std (per
    layer of a stacked encoder), and the word, position and token-type tables times std / the
    word table's std. Reads no data: post-processing of the checkpoint."""
    emb = net.bert.embeddings
    factor = std / jnp.std(emb.word_embeddings.embedding[...])
    for table in (emb.word_embeddings, emb.position_embeddings, emb.token_type_embeddings):
        table.embedding[...] = table.embedding[...] * factor
    for _, module in nnx.iter_graph(net.bert.encoder):
        if isinstance(module, nnx.Linear):
            kernel = module.kernel[...]
            factors = std / jnp.std(kernel, axis=(-2, -1), keepdims=True)
            module.kernel[...] = kernel * factors
            module.bias[...] = module.bias[...] * factors[..., 0]


def _rescale(net: Any, config: FinetuneConfig) -> dict[str, Any]:
    """Apply `config.rescale_std` (null: derived, see `FinetuneConfig`); what was done, for the
    log and `metrics.json`."""
    before, init = encoder_kernel_std(net), net.config.initializer_range
    target = config.rescale_std
    rule = "set in the recipe"
    if target is None:
        rule = f"derived: rescaled when the encoder kernels average above {RESCALE_ABOVE:g} x initializer_range"
        target = init if before > RESCALE_ABOVE * init else 0.0
    if target:
        rescale_pretrained(net, target)
    return {"kernel_std": round(before, 5), "initializer_range": init, "rescaled_to": target or None, "rule": rule}


# ----------------------------------------------------------------------------- training


def _load_model_and_tokenizer(
    task: glue.GlueTask, model: str, config: FinetuneConfig
) -> tuple[Any, Any, Path, bool, dict[str, Any]]:
    """(model, tokenizer, model folder, whether the pooler was newly initialised, its position
    table: rows pretrained, rows used, and how they were grown)."""

    # A folder as is; a Hub id through the release's pull path (a privacy claim is verified first).
    model_dir = resolve_pretrained(model)
    pretrained_rows = load_bert_config(model_dir).max_position_embeddings
    if config.max_seq_len > pretrained_rows and not config.extend_positions:
        raise ValueError(
            f"max_seq_len: {config.max_seq_len} exceeds the {pretrained_rows} position embeddings of {model}; "
            f"set max_seq_len <= {pretrained_rows}, or extend_positions: true to repeat the table's rows"
        )
    overrides: dict[str, Any] = {"num_labels": task.num_labels}
    if config.optim.dropout is not None:
        overrides.update(hidden_dropout_prob=config.optim.dropout, attention_probs_dropout_prob=config.optim.dropout)
    if task.label_names is not None:
        overrides["id2label"] = dict(enumerate(task.label_names))
        overrides["label2id"] = {name: i for i, name in enumerate(task.label_names)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = BertForSequenceClassification.from_pretrained(
            str(model_dir), seed=config.seed, max_positions=config.max_seq_len, **overrides
        )
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    # hf_io names every weight it had to initialise; a pretrained pooler is not among them.
    fresh_pooler = any("pooler.dense.weight" in str(w.message) for w in caught)
    tok_dir = Path(config.tokenizer) if config.tokenizer else model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"{tok_dir}: no tokenizer found ({err}); pass --set tokenizer=FOLDER") from None
    rows = net.config.max_position_embeddings
    positions = {
        "pretrained": pretrained_rows,
        "rows": rows,
        "grown_by": "repeating rows" if rows > pretrained_rows else None,
    }
    return net, tokenizer, model_dir, fresh_pooler, positions


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RunFiles:
    """Where a DP fine-tuning run keeps its state: checkpoints (one folder per sweep run), the
    train records (`train.jsonl`) and the evaluation records (`evals.jsonl`)."""

    checkpoints: Path
    train_records: Path
    evals: Path
    resume: bool


def _nonprivate_plan(n: int, optim: OptimConfig) -> tuple[Plan, int]:
    """(plan, steps per epoch) of non-private fine-tuning: shuffled epochs of `batch_size`
    examples (the last batch of an epoch padded), for `epochs` epochs."""
    batch = min(optim.batch_size, n)
    steps_per_epoch = math.ceil(n / batch)
    stage = Stage(
        steps=max(1, math.ceil(optim.epochs * steps_per_epoch)), expected_batch_size=batch, noise_multiplier=0
    )
    return Plan(schedule=BatchSchedule(stages=(stage,)), physical_batch_sizes=(batch,), ledger=None), steps_per_epoch


def _dp_loop_plan(plan: DPPlan, run: int) -> Plan:
    """Run `run` of a DP plan as the engine sees it: one stage, the ledger after the runs before it."""
    stage = Stage(
        steps=plan.steps, expected_batch_size=plan.expected_batch_size, noise_multiplier=plan.noise_multiplier
    )
    return Plan(
        schedule=BatchSchedule(stages=(stage,)),
        physical_batch_sizes=(plan.physical_batch_size,),
        ledger=plan.ledger,
        steps_before=run * plan.steps,
    )


def _shuffled_rows(
    run_key: jax.Array, t: int, n: int, batch: int, steps_per_epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    """(rows, is_padding) of non-private step t: the epoch's order comes from the key of its first
    step, like all randomness of a step, so a resumed run draws the same batches."""
    first = t - t % steps_per_epoch
    order = np.asarray(
        jax.random.permutation(jax.random.fold_in(jax.random.fold_in(run_key, first), _SHUFFLE_STREAM), n)
    )
    chunk = order[(t - first) * batch : (t - first + 1) * batch]
    return np.resize(chunk, batch), np.arange(batch) >= len(chunk)


def _train(
    forward: Forward,
    trainable: nnx.State,
    task: glue.GlueTask,
    train: Mapping[str, np.ndarray],
    config: FinetuneConfig,
    loop_plan: Plan,
    steps_per_epoch: int,
    run_key: jax.Array,
    on_epoch: Callable[[int, int, nnx.State], None],
    files: _RunFiles,
    fingerprints: dict[str, str],
    log: Callable[[str], None],
    optim: OptimConfig,
    run: int | None = None,
) -> tuple[nnx.State, bool]:
    """Fine-tuning through the training engine (`dpbert.train.engine`). DP (`loop_plan.ledger`
    set): Poisson samples of step t and the step's noise from `run_key`; non-private: shuffled
    epochs and the mean gradient. One checkpoint folder per run (`files.checkpoints/run-<run>`),
    resumed with exact replay when `files.resume`; `optim`: the run's hyper-parameters (a sweep
    run's own learning rate), `run`: its index in a sweep. Only the trainable parameters are
    differentiated (and, with DP, clipped and noised). Returns (trained parameters, whether
    SIGTERM stopped the run)."""
    n = len(train["labels"])
    private = loop_plan.ledger is not None
    stage = loop_plan.schedule.stages[0]
    steps = loop_plan.schedule.total_steps
    physical = loop_plan.physical_batch_sizes[0]
    tx = make_optimizer(optim, steps, trainable)
    mesh = make_mesh()
    microbatch = min(config.microbatch_size, stage.expected_batch_size)
    padded = device_batch_size(physical, mesh.devices.size, microbatch)
    frozen = forward.frozen

    def loss_fn(params: nnx.State, example: Mapping[str, jax.Array], rng: jax.Array) -> jax.Array:
        return example_loss(task, forward(params, frozen, example, rng), example["labels"])

    clipping = auto_clipping(optim.trainable) if config.clipping == "auto" else config.clipping
    if private and clipping == "ghost":  # taps on the trained parameters only; the rest stays frozen
        loss_fn = ClassifierGhostLoss(
            graphdef=forward.graphdef,
            frozen=frozen,
            loss_from_logits=lambda logits, ex: example_loss(task, logits, ex["labels"]),
        )

    def sample(index: int, t: int) -> Sample:
        if private:
            drawn = poisson_sample(
                run_key, t, loop_plan.ledger.dataset_size, stage.expected_batch_size, physical, stored_units=n
            )
            chosen, chosen_padding = drawn.indices, drawn.is_padding
        else:
            chosen, chosen_padding = _shuffled_rows(run_key, t, n, physical, steps_per_epoch)
        rows = np.zeros(padded, np.int64)
        rows[: chosen.shape[0]] = chosen
        is_padding = np.ones(padded, bool)
        is_padding[: chosen_padding.shape[0]] = chosen_padding
        batch, is_padding = distributed.global_array(({k: v[rows] for k, v in train.items()}, is_padding), mesh)
        return Sample(batch=batch, is_padding=is_padding, realized_size=int(np.sum(~is_padding)))

    def make_stage_step(index: int) -> Any:
        common = {"microbatch_size": microbatch, "mesh": mesh, "data_axis": batch_axes(mesh)}
        if not private:
            return make_train_step(loss_fn, tx, **common)
        return make_dp_train_step(
            loss_fn,
            tx,
            clip_norm=config.privacy.clip_norm,
            noise_multiplier=stage.noise_multiplier,
            expected_batch_size=stage.expected_batch_size,
            clipping_method=clipping,
            **common,
        )

    record = {} if run is None else {"run": run}
    checkpoints = CheckpointStore(files.checkpoints / f"run-{run or 0}", keep=2)
    try:
        like = jax.eval_shape(lambda p: (p, tx.init(p)), trainable)
        state = restore_or_init(
            checkpoints,
            resume=files.resume,
            like=like,
            init=lambda: (trainable, tx.init(trainable)),
            fingerprints=fingerprints,
            plan=loop_plan,
            total_steps=steps,
            log=lambda line: log(f"[{task.name}] " + (f"run {run}: " if record else "") + line),
        )
        if files.resume:  # this run's records past its checkpoint, and its final evaluation, are redone
            for path in (files.train_records, files.evals):
                truncate_after(path, min(state.step, steps - 1), record)
        every = steps_per_epoch * config.eval_every_epochs

        def epoch_eval(state: TrainState) -> None:
            on_epoch(state.step // steps_per_epoch, state.step, state.params)

        metrics = MetricsLog(files.train_records) if distributed.is_primary() else None
        try:
            loop = run_loop(
                state,
                plan=loop_plan,
                stage_keys=(run_key,),
                make_step=make_stage_step,
                sample=sample,
                checkpointing=Checkpointing(store=checkpoints, fingerprints=fingerprints, every=every),
                metrics=metrics,
                log_every=max(1, steps_per_epoch),
                learning_rate=learning_rate_schedule(optim, steps),
                hooks=(Hook(every=every, fn=epoch_eval),),
                log=log,
                record={"task": task.name, **record},
            )
        finally:
            if metrics is not None:
                metrics.close()
    finally:
        checkpoints.close()
    return loop.state.params, loop.stopped


def _run_files(out: Path, *, resume: bool) -> _RunFiles:
    """The run's files; a new run refuses a folder with checkpoints and starts its records afresh."""
    files = _RunFiles(
        checkpoints=out / "checkpoints", train_records=out / "train.jsonl", evals=out / "evals.jsonl", resume=resume
    )
    if not resume:
        if has_checkpoints(files.checkpoints):
            raise ValueError(
                f"output folder {out} already holds checkpoints; pass --resume to continue it or choose another "
                "--output-dir"
            )
        files.evals.unlink(missing_ok=True)
        files.train_records.unlink(missing_ok=True)
    return files


def _run_key(
    config: FinetuneConfig,
    task: glue.GlueTask,
    files: _RunFiles,
    out: Path,
    noise_seed_file: str | os.PathLike[str] | None,
) -> tuple[RunSecret | None, jax.Array]:
    """(secret, key) of a DP run: the secret kept in the checkpoint folder (drawn, supplied, or
    read back on resume), the key domain-separated as "finetune/<task>". A non-private run has no
    secret and uses `config.seed`."""
    if config.dp:
        secret = secret_for_run(files.checkpoints, resume=files.resume, supplied=noise_seed_file)
        write_json(out / RANDOMNESS_FILE, {"source": secret.source})
        return secret, mechanism_key(secret, f"finetune/{task.name}")
    if noise_seed_file is not None:
        raise ValueError("--noise-seed-file: only meaningful with --dp (a non-private run has no noise)")
    return None, jax.random.key(config.seed)


def _data_fingerprint(train: Mapping[str, np.ndarray]) -> str:
    """A short hash of the encoded training set (what a checkpoint's arrays depend on)."""
    digest = hashlib.sha256()
    for name in sorted(train):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(train[name]).tobytes())
    return digest.hexdigest()[:16]


def _stopped(task: glue.GlueTask, files: _RunFiles) -> dict[str, Any]:
    return {"task": task.name, "stopped_early": True, "checkpoints": str(files.checkpoints)}


def finetune(
    *,
    task: str | glue.GlueTask,
    model: str,
    output_dir: str | os.PathLike[str],
    data: str | os.PathLike[str] = glue.HUB_DATASET_ID,
    config: FinetuneConfig = DEFAULT_CONFIG,
    log: Callable[[str], None] = print,
    noise_seed_file: str | os.PathLike[str] | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Fine-tune `model` (a BERT folder, or a Hub id resolvable by `dpbert.model`) on one GLUE
    task read from `data` (a task folder or a Hub dataset id). Returns what `metrics.json` holds,
    or, when SIGTERM stopped a DP run, `{"task", "stopped_early": True, "checkpoints"}`.

    With `config.dp`, the sampling, dropout and noise derive from a secret drawn from the OS
    CSPRNG (or read from `noise_seed_file`), kept in OUT/checkpoints/noise_secret (0600) and
    domain-separated as "finetune/<task>" (a sweep's run i: "finetune/<task>/sweep/<i>"): never
    from the published `config.seed`. A DP run checkpoints in OUT/checkpoints/run-<i>/ (the
    training engine's guarantees); `resume` continues it with the same secret and replays exactly
    the steps the uninterrupted run takes.

    Args:
      task: a GLUE task name or spec; model: a BERT folder or Hub id; output_dir: OUT;
      data: the task's folder or Hub dataset; config: the recipe (null fields are derived and
        printed); log: where lines go; noise_seed_file: an auditor's secret instead of the OS draw.
    Returns:
      What OUT/metrics.json holds: dev figures, the trained subset, steps, the privacy summary,
      the derived defaults and the release folder."""
    task = task if isinstance(task, glue.GlueTask) else glue.get_task(task)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    splits = glue.load_task(task, data)
    net, tokenizer, model_dir, fresh_pooler, positions = _load_model_and_tokenizer(task, model, config)
    if positions["grown_by"]:
        log(
            f"[{task.name}] position table grown from {positions['pretrained']} to {positions['rows']} rows by "
            f"repeating the pretrained rows (max_seq_len {config.max_seq_len}; extend_positions: false refuses)"
        )
    scale = _rescale(net, config)
    log(
        f"[{task.name}] pretrained encoder kernels at std {scale['kernel_std']:.3g} "
        f"({scale['kernel_std'] / scale['initializer_range']:.1f} x initializer_range {scale['initializer_range']:g}): "
        + (f"rescaled to {scale['rescaled_to']:g}" if scale["rescaled_to"] else "kept")
        + f" (rescale_std {config.rescale_std if config.rescale_std is not None else 'null'}; {scale['rule']})"
    )
    train_pooler = fresh_pooler if config.train_pooler is None else config.train_pooler
    source = source_privacy(model_dir, model)
    if task_scope(task) in {g.scope for g in source.guarantees}:
        raise ValueError(f"model {model}: already carries a '{task_scope(task)}' guarantee (fine-tuned on {task.name})")
    encoded = {name: glue.encode(s, tokenizer, config.max_seq_len) for name, s in splits.items()}
    train = encoded["train"]
    n = len(train["labels"])

    if config.dp:
        config, derived = resolve_dp(n, config)
        source_of = f"n={n} and epsilon={config.privacy.epsilon:g}"
    else:
        config, derived = resolve_nonprivate(n, net.config.hidden_size, config)
        source_of = f"n={n} and the model's width {net.config.hidden_size}"
    if derived is not None:
        log(f"[{task.name}] {'DP' if config.dp else 'non-private'} hyper-parameters derived from {source_of} "
            "(set them in the recipe to override):")  # fmt: skip
        for line in derived.lines():
            log(f"[{task.name}]   {line}")
    optim = config.optim

    if optim.trainable == "lora":
        add_lora(net, config.lora, nnx.Rngs(config.seed + 1))
    graphdef, params = nnx.split(net, nnx.Param)
    trainable, frozen = params.split(trainable_filter(optim.trainable, fresh_pooler=train_pooler), ...)
    initial = jax.tree_util.tree_map(jnp.copy, trainable)  # every sweep run starts here
    forward = Forward(graphdef, frozen)
    n_trained, n_total = count_params(trainable), count_params(frozen) + count_params(trainable)
    trained = {
        "subset": optim.trainable,
        "parameters": n_trained,
        "total_parameters": n_total,
        "description": describe_trainable(optim.trainable, config, train_pooler, fresh_pooler),
    }
    if optim.trainable == "lora":
        trained["lora"] = {"rank": config.lora.rank, "alpha": config.lora.alpha, "targets": list(config.lora.targets)}
    log(
        f"[{task.name}] n={n} train examples; training {trained['description']}: {n_trained:,} of {n_total:,} parameters"
    )

    files = _run_files(out, resume=resume)
    secret, run_key = _run_key(config, task, files, out, noise_seed_file)
    fingerprints = {
        "config": fingerprint(config_record(config)),
        "data": _data_fingerprint(train),
        "model": fingerprint([str(model), count_params(trainable), n_total]),
    }

    def evaluate_all(
        epoch: float, step: int, current: nnx.State, run: int | None = None
    ) -> dict[str, dict[str, float]]:
        results = {}
        extra = {} if run is None else {"run": run}
        for split in task.eval_splits:
            results[split] = evaluate(forward, current, task, encoded[split], config.eval_batch_size)
            if distributed.is_primary():  # opened per evaluation: a resume rewrites the file
                with contextlib.closing(MetricsLog(files.evals)) as evals_log:
                    evals_log.write({"task": task.name, "split": split, "epoch": epoch, "step": step, **extra,
                                     **results[split]})  # fmt: skip
        log(f"[{task.name}] " + (f"run {run} " if run is not None else "") + f"epoch {epoch} step {step}: "
            + json.dumps(results))  # fmt: skip
        return results

    privacy: dict[str, Any] | None = None
    plan: DPPlan | None = None
    sweep: dict[str, Any] | None = None
    if config.dp:
        plan = plan_dp(n, config)
        log(
            f"[{task.name}] DP: epsilon={plan.epsilon:g}, delta={plan.delta:.3g} ({plan.delta_rule}), "
            f"noise_multiplier={plan.noise_multiplier:.4g}, clip_norm={config.privacy.clip_norm:g}, "
            f"expected batch {plan.expected_batch_size} (q={plan.ledger.stages[0].sampling_rate:.4g}), "
            f"physical batch {plan.physical_batch_size}, {plan.steps} steps, lr {optim.learning_rate:g}"
            + (f", {plan.runs} sweep runs composed" if plan.runs > 1 else "")
        )
        write_json(out / "privacy.json", plan.ledger.to_dict(), sort_keys=False)
        if config.sweep.enabled:
            swept = _dp_sweep(
                forward, initial, task, train, config, plan, secret, evaluate_all, log, files, fingerprints
            )
            if swept is None:
                return _stopped(task, files)
            trainable, final, sweep = swept
        else:
            trainable, stopped = _train(
                forward, trainable, task, train, config, _dp_loop_plan(plan, 0), plan.steps_per_epoch, run_key,
                evaluate_all, files, fingerprints, log, optim,
            )  # fmt: skip
            if stopped:
                return _stopped(task, files)
        steps = plan.steps
        privacy = plan.summary()
    else:
        loop_plan, steps_per_epoch = _nonprivate_plan(n, optim)
        trainable, stopped = _train(
            forward, trainable, task, train, config, loop_plan, steps_per_epoch, run_key, evaluate_all, files,
            fingerprints, log, optim,
        )  # fmt: skip
        if stopped:
            return _stopped(task, files)
        steps = loop_plan.schedule.total_steps

    if sweep is None:
        final = evaluate_all(float(optim.epochs), steps, trainable)
    nnx.update(net, nnx.merge_state(trainable, frozen))
    merge_lora(net)  # LoRA folded into plain weights: the export is an ordinary BERT
    meta = export_model(
        out, net=net, tokenizer=tokenizer, task=task, model=model, config=config, source=source, n=n, plan=plan,
        dev=final, randomness=None if secret is None else secret.source, trained_parameters=n_trained,
        trained=trained, sweep=sweep,
    )  # fmt: skip

    result = {
        "task": task.name,
        "model": str(model),
        "data": str(data),
        "n_train": n,
        "dev": final,
        "trained": trained,
        "positions": positions,
        "pretrained_scale": scale,
        "steps": steps,
        "private": config.dp,
        "privacy": privacy,
        "derived_defaults": None if derived is None else describe_derived(derived),
        "sweep": sweep,
        "release": {"folder": "model", **meta.config_copy()},
        "config": config_record(config),
        "seconds": round(time.time() - started, 1),
    }
    write_json(out / "metrics.json", result, sort_keys=False)
    return result


def _dp_sweep(
    forward: Forward,
    initial: nnx.State,
    task: glue.GlueTask,
    train: Mapping[str, np.ndarray],
    config: FinetuneConfig,
    plan: DPPlan,
    secret: Any,
    evaluate_all: Callable[..., dict[str, dict[str, float]]],
    log: Callable[[str], None],
    files: _RunFiles,
    fingerprints: dict[str, str],
) -> tuple[nnx.State, dict[str, dict[str, float]], dict[str, Any]] | None:
    """One DP run per learning-rate factor (each its own stage of `plan.ledger`, its own key), the
    best kept by the first metric of the first dev split. Returns (trained, its dev metrics, record),
    or None when SIGTERM stopped a run (its checkpoint written; a resume continues there)."""
    split = task.eval_splits[0]
    metric = task.metric_names[0]
    runs, best = [], None
    for i, factor in enumerate(config.sweep.learning_rate_factors):
        optim = dataclasses.replace(config.private, learning_rate=config.private.learning_rate * factor)
        key = mechanism_key(secret, f"finetune/{task.name}/sweep/{i}")
        start = jax.tree_util.tree_map(jnp.copy, initial)
        run_on_epoch = functools.partial(evaluate_all, run=i)
        trained, stopped = _train(
            forward, start, task, train, config, _dp_loop_plan(plan, i), plan.steps_per_epoch, key, run_on_epoch,
            files, fingerprints, log, optim, run=i,
        )  # fmt: skip
        if stopped:
            return None
        dev = evaluate_all(float(optim.epochs), plan.steps, trained, run=i)
        runs.append({"run": i, "learning_rate": optim.learning_rate, "dev": dev})
        if best is None or dev[split][metric] > best[1][split][metric]:
            best = (trained, dev, i)
    assert best is not None
    record = {
        "runs": runs,
        "selected": best[2],
        "selected_by": f"{split} {metric} (the dev set; its own examples are not protected)",
        "accounting": (
            f"choosing the best of {len(runs)} runs spends the privacy of all {len(runs)} (Papernot and Steinke "
            f"2022): the task ledger composes every run, one stage each, so epsilon covers the selection"
        ),
    }
    log(f"[{task.name}] sweep: kept run {best[2]} (learning rate {runs[best[2]]['learning_rate']:g}) by {record['selected_by']}; "
        + record["accounting"])  # fmt: skip
    return best[0], best[1], record


# ----------------------------------------------------------------------------- all tasks


def finetune_all(
    *,
    model: str,
    output_dir: str | os.PathLike[str],
    glue_root: str | os.PathLike[str],
    config: FinetuneConfig = DEFAULT_CONFIG,
    log: Callable[[str], None] = print,
    noise_seed_file: str | os.PathLike[str] | None = None,
    resume: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run every task found under a GLUE root folder into OUT/<task>/ and log one table (stops at
    the first task that SIGTERM stopped; `resume` continues every task from its checkpoints)."""
    results = {}
    for name, folder in glue.find_tasks(glue_root).items():
        results[name] = finetune(
            task=name,
            model=model,
            output_dir=Path(output_dir) / name,
            data=folder,
            config=config,
            log=log,
            noise_seed_file=noise_seed_file,
            resume=resume,
        )
        if results[name].get("stopped_early"):
            return results
    log(summary_table(results.values()))
    return results


def summary_table(results: Iterable[Mapping[str, Any]]) -> str:
    """One row per task: dev metrics (x100, as GLUE tables print them), epsilon for DP runs."""
    rows = [("task", "dev set", "metrics", "n", "trained", "epsilon")]
    for r in results:
        eps = f"{r['privacy']['epsilon']:.2f}" if r.get("privacy") else "-"
        for split, metrics in r["dev"].items():
            text = ", ".join(f"{k} {100 * v:.1f}" for k, v in metrics.items())
            rows.append((r["task"], split, text, str(r["n_train"]), r["trained"]["subset"], eps))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
