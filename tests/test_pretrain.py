"""The pretraining loop, run for real and small: a 1-layer BERT on a few KB of templated text
with a WordPiece trained on it, DP-SGD through the real DP core, real Orbax checkpoints.

The corpus has strong local structure (fixed phrases with one free slot), so masked tokens
are predictable from context: a model that learned anything beats the unigram baseline.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from tiny_run import persistent_compilation_cache

from dpbert.data.store import TokenStore
from dpbert.privacy import PrivacyLedger
from dpbert.train.checkpoint import CheckpointStore
from dpbert.train.engine import NonFiniteLossError  # noqa: F401  (public API)
from dpbert.train.metrics import plot_run, read_metrics
from dpbert.train.pretrain import pretrain

PHRASES = [
    "the president of the united states {w} the congress .",
    "we the people of the nation {w} our freedom .",
    "the army and the navy {w} the republic .",
    "in the year of our lord we {w} peace .",
    "the secretary of the treasury {w} the public debt .",
    "my fellow citizens , we {w} the future .",
]
SLOTS = ["protect", "address", "serve", "defend", "support", "honor"]

RECIPE = {
    "model": {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
    "data": {"tokenizer": "train", "train_vocab_size": 300, "seq_len": 32, "eval_fraction": 0.1, "num_proc": 1},
    # One stage: each stage is its own compiled step, and compiling dominates a test this small.
    "schedule": [{"steps": 6, "expected_batch_size": 24}],
    "privacy": {
        "enabled": True,
        "clip_norm": 1.0,
        "delta": 1.0e-3,
        "accountant": "rdp",
        "noise_multiplier": 1.0,
        "target_epsilon": 20.0,
    },
    "optimizer": {"learning_rate": 1.0e-2, "warmup_steps": 1},
    "train": {
        "microbatch_size": 24,
        "checkpoint_every": 2,
        "eval_every": 3,
        "eval_batches": 2,
        "eval_batch_size": 16,
        "log_every": 1,
    },
    "report": {"fill_mask": ["the president of the [MASK] states the congress ."], "top_k": 3},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A corpus folder and a prepared token store shared by the tests of this module."""
    root = tmp_path_factory.mktemp("pretrain")
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for d in range(80):
        lines = [rng.choice(PHRASES).format(w=rng.choice(SLOTS)) for _ in range(8)]
        (corpus / f"doc{d:03d}.txt").write_text(" ".join(lines))
    cache = root / "jax_cache"
    # An auditor's secret: the runs that must replay each other share it (fresh secrets differ).
    seed_file = root / "noise_seed.hex"
    seed_file.write_text("5eed" * 16 + "\n")
    return {"root": root, "corpus": corpus, "store": root / "store", "cache": cache, "seed_file": seed_file}


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(workspace):
    """One persistent XLA cache for this process and the trainer subprocesses: the killed and
    resumed runs reuse the reference run's compiled steps (the same programs, so the same bits)."""
    with persistent_compilation_cache(workspace["cache"]):
        yield


def write_recipe(workspace, path: Path, **sections) -> Path:
    recipe = json.loads(json.dumps(RECIPE))
    recipe["data"].update(corpus=str(workspace["corpus"]), store=str(workspace["store"]))
    for name, values in sections.items():
        if isinstance(values, dict):
            recipe[name].update(values)
        else:
            recipe[name] = values
    path.write_text(yaml.safe_dump(recipe))
    return path


def final_params(run_dir: Path) -> dict[str, np.ndarray]:
    return load_file(str(run_dir / "hf" / "model.safetensors"))


def run_cli(workspace, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(workspace["cache"]),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "dpbert.cli", "pretrain", *args, "--noise-seed-file", str(workspace["seed_file"])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early (rc {proc.returncode}):\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("trainer did not reach the expected point in time")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference_run(workspace):
    """An uninterrupted private run (in this process), with the auditor's secret."""
    recipe = write_recipe(workspace, workspace["root"] / "ref.yaml")
    run_dir = workspace["root"] / "ref"
    result = pretrain(
        recipe, run_dir, show_fill_mask=True, progress=False, log=lambda s: None, noise_seed_file=workspace["seed_file"]
    )
    return recipe, run_dir, result


def test_tiny_private_run_end_to_end(reference_run):
    recipe, run_dir, result = reference_run
    assert result.steps_done == result.total_steps == 6 and not result.stopped_early
    # Ledger: every step once, epsilon recomputable from privacy.json, within the target.
    ledger = PrivacyLedger.from_dict(json.loads((run_dir / "privacy.json").read_text()))
    assert [s.steps for s in ledger.stages] == [6]
    assert [s.expected_batch_size for s in ledger.stages] == [24]
    assert ledger.epsilon() == pytest.approx(result.epsilon, rel=1e-9)
    assert 0 < result.epsilon <= 20.0
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["expected_batch_size"] for r in train] == [24] * 6
    eps = [r["epsilon"] for r in train]
    assert all(a < b for a, b in zip(eps, eps[1:])) and eps[-1] == pytest.approx(result.epsilon)
    for r in train:
        assert set(r["nonprivate_diagnostics"]) >= {"loss", "clipped_fraction"}
        assert "loss" not in r  # the private-batch loss only appears labelled as non-private
        assert r["realized_batch_size"] <= r["physical_batch_size"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert evals[-1]["eval_mlm_accuracy"] == pytest.approx(result.eval_mlm_accuracy)
    # The Hugging Face folder loads in transformers and matches the Flax model's predictions.
    from transformers import AutoTokenizer, BertConfig

    config = BertConfig.from_pretrained(run_dir / "hf")
    assert (config.hidden_size, config.num_hidden_layers) == (32, 1)
    assert AutoTokenizer.from_pretrained(run_dir / "hf").mask_token == "[MASK]"
    release = json.loads((run_dir / "release" / "privacy.json").read_text())
    assert release["private"] is True
    assert release["guarantees"][0]["epsilon"] == pytest.approx(result.epsilon, rel=1e-6)
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["model"]["vocab_size"] == config.vocab_size
    ((sentence, preds),) = result.fill_mask
    assert len(preds) == 3 and all(0 <= p <= 1 for _, p in preds)
    png = plot_run(run_dir)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_account_plans_what_pretrain_runs(reference_run, capsys):
    """`dpbert account RECIPE` (store counted, N rounded or declared) prints the run's ledger, field by field."""
    from dpbert.cli import main

    recipe, run_dir, _ = reference_run
    ran = json.loads((run_dir / "privacy.json").read_text())
    capsys.readouterr()
    assert main(["account", str(recipe), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ledger"] == ran
    assert ran["dataset_size_source"] == "rounded" and "dataset_size_bound" in ran
    # A declared N: account needs no store and still equals the run's ledger.
    assert main(["account", str(recipe), "--set", f"privacy.dataset_size={ran['dataset_size']}", "--json"]) == 0
    declared = json.loads(capsys.readouterr().out)["ledger"]
    assert {k: v for k, v in declared.items() if k != "dataset_size_source"} == {
        k: v for k, v in ran.items() if k != "dataset_size_source"
    }


def test_sigkill_then_sigterm_then_resume_equals_uninterrupted(workspace, reference_run):
    recipe, ref_dir, ref = reference_run
    run_dir = workspace["root"] / "interrupted"
    ckpts = run_dir / "checkpoints"

    # 1. SIGKILL once the first checkpoint (step 2) is complete.
    proc = run_cli(workspace, str(recipe), "--output-dir", str(run_dir))
    wait_for(lambda: (ckpts / "2").is_dir(), proc)  # Orbax renames a step folder into place when complete
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_before = CheckpointStore(ckpts).latest_step()
    assert steps_before is not None and steps_before < 6, "the kill came too late to test anything"

    # 2. Resume, then SIGTERM: a clean exit (rc 0) with a checkpoint at the step reached.
    proc = run_cli(workspace, str(recipe), "--output-dir", str(run_dir), "--resume")
    metrics = run_dir / "metrics.jsonl"

    def advanced() -> bool:
        return any(r["kind"] == "train" and r["step"] > steps_before for r in read_metrics(metrics))

    wait_for(advanced, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    stopped_at = CheckpointStore(ckpts).latest_step()
    if stopped_at < 6:  # it may legitimately have finished before the signal landed
        assert "SIGTERM" in out and stopped_at > steps_before
        assert json.loads((run_dir / "privacy.json").read_text())["stages"][-1]["steps"] == stopped_at

    # 3. Resume to the end: same params, same ledger, same metrics as the uninterrupted run.
    result = pretrain(recipe, run_dir, resume=True, progress=False, log=lambda s: None)
    assert result.steps_done == 6
    ref_params, params = final_params(ref_dir), final_params(run_dir)
    assert ref_params.keys() == params.keys()
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=1e-6, err_msg=name)
    assert json.loads((run_dir / "privacy.json").read_text()) == json.loads((ref_dir / "privacy.json").read_text())
    assert result.epsilon == ref.epsilon
    ref_train = [r for r in read_metrics(ref_dir / "metrics.jsonl") if r["kind"] == "train"]
    train = [r for r in read_metrics(metrics) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # each step logged once
    for a, b in zip(train, ref_train):
        assert a["realized_batch_size"] == b["realized_batch_size"] and a["epsilon"] == b["epsilon"]
        assert a["nonprivate_diagnostics"]["loss"] == pytest.approx(b["nonprivate_diagnostics"]["loss"], abs=1e-5)


def test_moving_average_is_released_at_the_same_ledger(workspace, reference_run, tmp_path):
    """`optimizer.ema_decay`: post-processing of the noisy iterates. With the reference run's secret the
    iterates, the ledger and epsilon are the reference run's; what is evaluated, exported and released is
    the average, and the last iterate's held-out figures are the reference run's."""
    recipe, ref_dir, ref = reference_run
    run_dir = tmp_path / "ema"
    lines: list[str] = []
    result = pretrain(
        recipe,
        run_dir,
        overrides=["optimizer.ema_decay=0.5"],
        progress=False,
        log=lines.append,
        noise_seed_file=workspace["seed_file"],
    )
    assert json.loads((run_dir / "privacy.json").read_text()) == json.loads((ref_dir / "privacy.json").read_text())
    assert result.epsilon == ref.epsilon
    released = json.loads((run_dir / "release" / "privacy.json").read_text())["guarantees"]
    assert released == json.loads((ref_dir / "release" / "privacy.json").read_text())["guarantees"]
    (last,) = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"][-1:]
    (ref_last,) = [r for r in read_metrics(ref_dir / "metrics.jsonl") if r["kind"] == "eval"][-1:]
    assert last["params"] == "moving average (decay 0.5)"
    assert last["eval_mlm_loss_last_iterate"] == pytest.approx(ref_last["eval_mlm_loss"], abs=1e-5)
    assert last["eval_mlm_loss"] != pytest.approx(ref_last["eval_mlm_loss"], abs=1e-4)
    assert result.eval_mlm_accuracy == pytest.approx(last["eval_mlm_accuracy"])
    assert result.params == last["params"] and ref.params is None and ref.last_iterate is None
    assert result.last_iterate == (last["eval_mlm_accuracy_last_iterate"], last["eval_mlm_loss_last_iterate"])
    accuracy, loss = result.last_iterate
    assert (
        f"  of the released moving average (decay 0.5); the last iterate: {100 * accuracy:.2f}% (loss {loss:.3f})"
        in lines
    )
    averaged, last_iterate = final_params(run_dir), final_params(ref_dir)
    assert load_file(str(run_dir / "release" / "model.safetensors")).keys() == averaged.keys()
    for name, value in load_file(str(run_dir / "release" / "model.safetensors")).items():
        np.testing.assert_array_equal(value, averaged[name], err_msg=name)
    moved = [n for n in averaged if not np.allclose(averaged[n], last_iterate[n], rtol=0, atol=1e-6)]
    assert len(moved) > len(averaged) // 2, moved  # the release is the average, not the last iterate


def test_resume_that_would_pass_the_target_epsilon_is_refused(workspace, reference_run):
    recipe, ref_dir, ref = reference_run
    with pytest.raises(ValueError, match="privacy budget exceeded"):
        pretrain(recipe, ref_dir, resume=True, overrides=["schedule.0.steps=3000"], progress=False, log=lambda s: None)
    # Nothing was spent or written by the refused resume.
    assert CheckpointStore(ref_dir / "checkpoints").latest_step() == 6
    assert PrivacyLedger.from_dict(json.loads((ref_dir / "privacy.json").read_text())).total_steps == 6
    # A fresh run with that schedule is refused the same way, before any step.
    with pytest.raises(ValueError, match="privacy budget exceeded"):
        pretrain(
            recipe,
            workspace["root"] / "too_long",
            overrides=["schedule.0.steps=3000"],
            progress=False,
            log=lambda s: None,
        )
    assert not (workspace["root"] / "too_long" / "checkpoints").exists()


def test_resume_with_a_changed_plan_is_refused(workspace, reference_run):
    recipe, ref_dir, _ = reference_run
    with pytest.raises(ValueError, match="privacy ledger does not match"):
        pretrain(
            recipe, ref_dir, resume=True, overrides=["privacy.noise_multiplier=1.5"], progress=False, log=lambda s: None
        )
    with pytest.raises(ValueError, match="already holds checkpoints"):
        pretrain(recipe, ref_dir, progress=False, log=lambda s: None)


def test_corrupted_or_foreign_checkpoint_is_named(workspace, reference_run, tmp_path):
    recipe, ref_dir, _ = reference_run
    import shutil

    run_dir = tmp_path / "corrupt"
    shutil.copytree(ref_dir, run_dir)
    for f in (run_dir / "checkpoints").glob("*/state/**/*"):  # every checkpoint: none to fall back to
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(
        ValueError, match=r"no checkpoint in .*corrupt.checkpoints restores.*step 6 \(.*corrupt.checkpoints.6\)"
    ):
        pretrain(recipe, run_dir, resume=True, progress=False, log=lambda s: None)

    foreign = tmp_path / "foreign"
    (foreign / "checkpoints" / "7" / "meta").mkdir(parents=True)
    (foreign / "checkpoints" / "7" / "meta" / "metadata").write_text('{"hello": "world"}')
    (foreign / "checkpoints" / "7" / "_CHECKPOINT_METADATA").write_text("{}")
    shutil.copy2(ref_dir / "checkpoints" / "noise_secret", foreign / "checkpoints" / "noise_secret")
    with pytest.raises(ValueError, match=r"checkpoint .*foreign.checkpoints.7"):
        pretrain(recipe, foreign, resume=True, progress=False, log=lambda s: None)


def test_nonprivate_run_beats_the_unigram_baseline(workspace):
    recipe = write_recipe(
        workspace,
        workspace["root"] / "nonprivate.yaml",
        privacy={"enabled": False, "noise_multiplier": None, "target_epsilon": None},
        schedule=[{"steps": 150, "expected_batch_size": 32}],
        train={"checkpoint_every": 150, "eval_every": 0, "eval_batches": 4, "log_every": 50},
    )
    run_dir = workspace["root"] / "nonprivate"
    result = pretrain(recipe, run_dir, progress=False, log=lambda s: None)
    assert result.epsilon is None and not (run_dir / "privacy.json").exists()
    assert json.loads((run_dir / "release" / "privacy.json").read_text())["private"] is False

    # Unigram baseline: always predict the most frequent non-special train token. Its held-out
    # accuracy is that token's share of the eligible held-out tokens (masking is uniform over them).
    train = TokenStore.open(workspace["store"], "train")
    held = TokenStore.open(workspace["store"], "eval")
    specials = set(train.manifest.special_token_ids)
    counts = Counter(int(t) for t in train[np.arange(len(train))].ravel() if int(t) not in specials)
    top = counts.most_common(1)[0][0]
    eval_tokens = [int(t) for t in held[np.arange(len(held))].ravel() if int(t) not in specials]
    baseline = sum(t == top for t in eval_tokens) / len(eval_tokens)
    assert result.eval_mlm_accuracy > baseline + 0.05, (result.eval_mlm_accuracy, baseline)


def _files_under(folder: Path) -> list[Path]:
    return [f for f in folder.rglob("*") if f.is_file()]


def test_private_runs_draw_a_secret_that_never_leaves_the_checkpoint_folder(workspace, reference_run, capsys):
    """Two runs of one recipe with the published seed release different weights; the secret is
    0600 in checkpoints/ and nowhere else (release, hf, metrics, recipe, printed output)."""
    recipe, ref_dir, _ = reference_run
    lines: list[str] = []
    dirs = [workspace["root"] / f"secret{i}" for i in range(2)]
    for run_dir in dirs:
        pretrain(recipe, run_dir, overrides=["train.eval_every=0"], progress=False, log=lines.append)
    secrets = []
    for run_dir in dirs:
        path = run_dir / "checkpoints" / "noise_secret"
        assert path.stat().st_mode & 0o777 == 0o600
        record = json.loads(path.read_text())
        assert record["source"] == "os-csprng" and len(bytes.fromhex(record["secret"])) == 32
        assert json.loads((run_dir / "randomness.json").read_text()) == {"source": "os-csprng"}
        secrets.append(record["secret"])
        outside = [f for f in _files_under(run_dir) if "checkpoints" not in f.relative_to(run_dir).parts]
        assert any(f.parent.name == "release" for f in outside)
        for f in outside:
            assert record["secret"].encode() not in f.read_bytes(), f
    assert secrets[0] != secrets[1]
    printed = "\n".join(lines) + capsys.readouterr().out
    assert not any(s in printed for s in secrets)
    a, b = final_params(dirs[0]), final_params(dirs[1])
    differing = [name for name in a if not np.array_equal(a[name], b[name])]
    assert len(differing) == len(a), sorted(set(a) - set(differing))  # every tensor got other noise
    # Every folder holding weights of a DP run carries its ledger.
    assert json.loads((dirs[0] / "hf" / "privacy.json").read_text()) == json.loads(
        (dirs[0] / "privacy.json").read_text()
    )
    # The auditor's secret reproduces: same file, same recipe -> the reference run's weights.
    assert json.loads((ref_dir / "randomness.json").read_text()) == {"source": "supplied-file"}


def test_resume_needs_its_secret_and_its_corpus(workspace, reference_run, tmp_path):
    import shutil

    recipe, ref_dir, _ = reference_run
    run_dir = tmp_path / "lost_secret"
    shutil.copytree(ref_dir, run_dir)
    (run_dir / "checkpoints" / "noise_secret").unlink()
    with pytest.raises(
        ValueError, match=r"noise_secret: missing; the checkpoints of this private run cannot be resumed"
    ):
        pretrain(recipe, run_dir, resume=True, progress=False, log=lambda s: None)
    with pytest.raises(ValueError, match=r"--noise-seed-file .*: differs from the secret this run started with"):
        other = tmp_path / "other.hex"
        other.write_text("ab" * 32)
        pretrain(recipe, ref_dir, resume=True, progress=False, log=lambda s: None, noise_seed_file=other)
    with pytest.raises(ValueError, match=r"--noise-seed-file .*: expected hexadecimal digits"):
        bad = tmp_path / "bad.hex"
        bad.write_text("not hex")
        pretrain(recipe, tmp_path / "bad_seed", progress=False, log=lambda s: None, noise_seed_file=bad)
    # Resuming on another corpus (same tokenizer, same shapes) is refused by the corpus hash.
    corpus = tmp_path / "corpus2"
    corpus.mkdir()
    for d in range(80):
        (corpus / f"doc{d:03d}.txt").write_text(
            " ".join([PHRASES[d % 6].format(w=SLOTS[(d + i) % 6]) for i in range(8)])
        )
    moved = tmp_path / "moved"
    shutil.copytree(ref_dir, moved)
    # The run's vocabulary (learned without DP; its hf/ copy says so) copied without dpbert's marker,
    # declared public by the user: only the corpus differs.
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (ref_dir / "hf" / name).is_file():
            shutil.copy2(ref_dir / "hf" / name, vocab / name)
    with pytest.raises(ValueError, match="was written with a different data"):
        pretrain(
            recipe,
            moved,
            resume=True,
            progress=False,
            log=lambda s: None,
            overrides=[
                f"data.corpus={corpus}",
                f"data.store={tmp_path / 'store2'}",
                f"data.tokenizer={vocab}",
                "data.tokenizer_declared_public=true",
            ],
        )


def test_public_eval_corpus_figures_are_released_private_ones_are_not(workspace, tmp_path):
    """Held-out figures on a public `data.eval_corpus` leave in the release, labelled; without one,
    the private held-out figures stay in the run folder."""
    public = tmp_path / "public_corpus"
    public.mkdir()
    for d in range(20):
        (public / f"pub{d:02d}.txt").write_text(" ".join(PHRASES[(d + i) % 6].format(w=SLOTS[i % 6]) for i in range(8)))
    recipe = write_recipe(
        workspace,
        tmp_path / "public_eval.yaml",
        schedule=[{"steps": 2, "expected_batch_size": 24}],
        data={"eval_corpus": str(public)},
        optimizer={"learning_rate": 1.0e-2, "warmup_steps": 0},
    )
    run_dir = tmp_path / "public_eval"
    result = pretrain(recipe, run_dir, progress=False, log=lambda s: None, noise_seed_file=workspace["seed_file"])
    (last,) = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"][-1:]
    assert last["eval_public"] is True and last["eval_corpus"] == str(public)
    assert last["eval_mlm_accuracy"] == pytest.approx(result.eval_mlm_accuracy)
    evaluation = json.loads((run_dir / "release" / "privacy.json").read_text())["evaluation"]
    assert evaluation["public"] is True and "public_corpus" in evaluation["corpus"]
    assert str(tmp_path) not in (run_dir / "release" / "privacy.json").read_text()
    with pytest.raises(ValueError, match="eval_corpus"):
        write_recipe(workspace, tmp_path / "same.yaml", data={"eval_corpus": str(workspace["corpus"])})
        pretrain(tmp_path / "same.yaml", tmp_path / "same", progress=False, log=lambda s: None)
