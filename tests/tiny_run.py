"""A tiny pretraining set-up shared by the multi-device and multi-host tests: a synthetic
corpus of State-of-the-Union-like phrases and a small DP recipe (2 layers x hidden 32,
sequence length 32, a WordPiece trained on the corpus, 2 steps at expected batch 8, micro-
batches of 2 so the compiled batch is a multiple of 16 on 8 devices, dropout on so that the
per-example keys must not depend on the devices)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import yaml

PHRASES = [
    "the president of the united states {w} the congress .",
    "we the people of the nation {w} our freedom .",
    "the secretary of the treasury {w} the public debt .",
    "my fellow citizens , we {w} the future .",
]
SLOTS = ["protect", "address", "serve", "defend"]


def seed_file(root: Path) -> Path:
    """ROOT/noise_seed.hex: the auditor's secret that makes runs on different meshes comparable
    (fresh OS CSPRNG secrets would give every run its own noise)."""
    return root / "noise_seed.hex"


def write_recipe(root: Path, *, checkpoint_every: int = 2, unit: str = "sequence") -> Path:
    """Write ROOT/corpus (40 documents), ROOT/recipe.yaml (store in ROOT/store) and
    `seed_file(root)`; return the recipe. `unit: document` samples and clips whole documents
    (up to 2 sequences each; the batch then counts documents)."""
    seed_file(root).write_text("0123456789abcdef" * 4 + "\n")
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for d in range(40):
        (corpus / f"doc{d:02d}.txt").write_text(
            " ".join(rng.choice(PHRASES).format(w=rng.choice(SLOTS)) for _ in range(8))
        )
    recipe: dict[str, Any] = {
        "model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
        "data": {
            "corpus": str(corpus),
            "store": str(root / "store"),
            "tokenizer": "train",
            "train_vocab_size": 200,
            "seq_len": 32,
            "eval_fraction": 0.1,
            "num_proc": 1,
        },
        "schedule": [{"steps": 2, "expected_batch_size": 8}],
        "privacy": {
            "enabled": True,
            "clip_norm": 1.0,
            "delta": 1.0e-3,
            "accountant": "rdp",
            "noise_multiplier": 1.0,
            "target_epsilon": 30.0,
            "unit": unit,
            **({"max_sequences_per_document": 2} if unit == "document" else {}),
        },
        "optimizer": {"learning_rate": 1.0e-2, "warmup_steps": 0},
        "train": {
            "microbatch_size": 2,
            "checkpoint_every": checkpoint_every,
            "eval_every": 0,
            "eval_batches": 1,
            "eval_batch_size": 16,
        },
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@contextlib.contextmanager
def persistent_compilation_cache(cache_dir: Path) -> Iterator[None]:
    """One persistent XLA cache for this process and the trainer subprocesses it starts (they set
    JAX_COMPILATION_CACHE_DIR): resumed runs reuse the reference run's compiled steps."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        cc.reset_cache()
