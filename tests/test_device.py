"""dpbert.train.device: the recipe's settings on a CPU, measured ones on an accelerator."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import pytest
from transformers import BertConfig

from dpbert.config.recipe import load_recipe
from dpbert.train.device import compiled_rows_per_device, device_settings, expected_microbatches, is_accelerator

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"


def test_cpu_keeps_the_recipe_as_written():
    recipe = load_recipe(TINY)
    # config=None: on a CPU nothing is built or timed, so no model is needed.
    settings = device_settings(
        recipe, None, num_predictions=14, dataset_size=94000, physical_batch_sizes=(1216,), backend="cpu"
    )
    assert (settings.microbatch_size, settings.dtype, settings.layer_mode) == (32, "float32", "mixed")
    assert settings.schedule_seconds == {} and settings.layer_mode_seconds == {}
    assert settings.apply(recipe.train) is recipe.train
    assert "not measured" in settings.describe()
    assert not is_accelerator("cpu") and is_accelerator("gpu") and is_accelerator("tpu")


def test_several_processes_measure_nothing(monkeypatch):
    """Hosts could time different winners and must run one program: bfloat16, recipe's sizes."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    recipe = load_recipe(TINY)
    settings = device_settings(
        recipe, None, num_predictions=14, dataset_size=94000, physical_batch_sizes=(1216,), backend="gpu"
    )
    assert (settings.microbatch_size, settings.dtype, settings.layer_mode) == (32, "bfloat16", "mixed")
    assert settings.schedule_seconds == {} and settings.apply(recipe.train).dtype == "bfloat16"


def test_expected_microbatches_counts_the_ones_holding_real_rows():
    # B = 4,096 of N = 94,000: sd = sqrt(4096 (1 - 4096/94000)) = 62.59. At m = 1,024 over 5,120
    # compiled rows: 1 + P[R > 1024] + P[R > 2048] + P[R > 3072] + P[R > 4096] = 4 + P[Z > 0.5/62.59].
    sd = math.sqrt(4096 * (1 - 4096 / 94000))
    expected = 4 + 0.5 * math.erfc(0.5 / sd / math.sqrt(2))
    got = expected_microbatches(1024, expected_batch_size=4096, dataset_size=94000, compiled_rows=5120)
    assert abs(got - expected) < 1e-9 and 4.49 < got < 4.50
    # One micro-batch always runs; at m = 1 the count is the realized size: E[R] = B (within 1).
    assert expected_microbatches(4096, expected_batch_size=10, dataset_size=100, compiled_rows=4096) == 1.0
    assert abs(expected_microbatches(1, expected_batch_size=512, dataset_size=94000, compiled_rows=1024) - 512) < 1
    # q = 1 (no sampling noise): exactly ceil(B / m) micro-batches.
    assert expected_microbatches(3, expected_batch_size=7, dataset_size=7, compiled_rows=9) == 3.0
    with pytest.raises(ValueError, match="multiple of microbatch_size=4"):
        expected_microbatches(4, expected_batch_size=8, dataset_size=100, compiled_rows=10)
    # The physical batch padded to devices x micro-batch, then split: as pretrain.device_batch_size.
    assert compiled_rows_per_device(1100, 1, 1024) == 2048 and compiled_rows_per_device(1100, 4, 32) == 288


def test_accelerator_settings_are_measured_and_bfloat16():
    """The accelerator path, forced on a CPU with a toy model: bfloat16 compute, the micro-batch
    size with the least expected schedule time, and the fastest layer mode at that size."""
    recipe = load_recipe(TINY, ["data.seq_len=16", "schedule.0.expected_batch_size=8", "train.layer_mode=ghost"])
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    settings = device_settings(
        recipe,
        config,
        num_predictions=4,
        dataset_size=94000,
        physical_batch_sizes=(16,),
        backend="gpu",
        candidates=(2, 4, 32),
        layer_modes=("ghost", "instantiate"),
    )
    # 32 exceeds the 16 compiled rows: not tried.
    assert set(settings.schedule_seconds) == {2, 4}
    assert settings.microbatch_size == min(settings.schedule_seconds, key=settings.schedule_seconds.get)
    assert set(settings.layer_mode_seconds) == {"ghost", "instantiate"}
    assert settings.layer_mode == min(settings.layer_mode_seconds, key=settings.layer_mode_seconds.get)
    train = settings.apply(recipe.train)
    assert (train.microbatch_size, train.dtype, train.layer_mode) == (
        settings.microbatch_size,
        "bfloat16",
        settings.layer_mode,
    )
    assert train.seed == recipe.train.seed and "measured on placeholder inputs" in settings.describe()
