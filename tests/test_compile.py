"""`compile_step` compiles the trainer's own step (shared builder): the recipe's clipping method,
the trainer's compiled batch, the trainer's state shapes. Tiny model, one CPU device."""

from __future__ import annotations

import jax
import pytest

from dpbert.config.plan import plan_recipe
from dpbert.config.recipe import load_recipe_dict
from dpbert.train.compile import compile_step
from dpbert.train.engine import device_batch_size
from dpbert.train.mesh import make_mesh

RECIPE = {
    "model": {
        "vocab_size": 128,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
    },
    "data": {"seq_len": 16},
    "schedule": [{"steps": 10, "expected_batch_size": 40}, {"steps": 10, "expected_batch_size": 80}],
    "privacy": {"enabled": True, "clip_norm": 1.0, "delta": 1.0e-6, "noise_multiplier": 1.0, "target_epsilon": 50.0},
    "train": {"microbatch_size": 8},
    "target": {"dataset_size": 5000, "devices": 16, "peak_tflops_per_device": 100.0, "assumed_mfu": 0.5},
}


@pytest.fixture(scope="module")
def reports():
    mesh = make_mesh()
    out = {}
    for method in ("ghost", "vmap"):
        recipe = load_recipe_dict(RECIPE, [f"train.clipping={method}"])
        out[method] = (recipe, compile_step(recipe, mesh))
    return out


def test_compiles_the_trainers_batch_and_state(reports):
    recipe, r = reports["ghost"]
    ledger = plan_recipe(recipe, 5000).physical_batch_sizes  # target.dataset_size: the stored count
    assert r.physical_batch_size == device_batch_size(ledger[-1], jax.device_count(), 8)
    assert r.physical_batch_size >= 80 and r.expected_batch_size == 80 and r.stage_index == 1
    # float32 params + AdamW's two moments, replicated on the one device.
    assert r.state_bytes_per_device == pytest.approx(12 * r.num_params, abs=64)
    # The estimate pads each stage's ledger batch for the TARGET's 16 devices x 8.
    assert [s.physical_batch_size for s in r.stages] == [device_batch_size(b, 16, 8) for b in ledger]
    for s in r.stages:
        assert s.seconds_per_step == pytest.approx(s.flops_per_step / (16 * 100e12 * 0.5), rel=1e-9)


def test_the_recipes_clipping_method_is_what_compiles(reports):
    # Ghost clipping and per-example gradients are different programs: different FLOPs and memory.
    ghost, vmap = reports["ghost"][1], reports["vmap"][1]
    assert ghost.flops_per_example != pytest.approx(vmap.flops_per_example, rel=1e-3)
    assert ghost.num_params == vmap.num_params and ghost.physical_batch_size == vmap.physical_batch_size


def test_flops_count_every_encoder_layer(reports):
    # The encoder's layers run under one scan, whose body XLA's cost analysis counts once: the
    # count must still grow with depth (one more layer: one more layer's forward, backward and
    # clipping per example), as it did when the layers were unrolled.
    recipe, two = reports["ghost"]
    one = compile_step(load_recipe_dict(RECIPE, ["train.clipping=ghost", "model.num_hidden_layers=1"]), make_mesh())
    h, i, seq = 32, 64, 16
    layer_forward = 2 * seq * (4 * h * h + 2 * h * i) + 4 * seq * seq * h
    assert 2.0 < (two.flops_per_example - one.flops_per_example) / layer_forward < 6.0
    assert two.update_flops_per_device > one.update_flops_per_device


def test_bench_reports_compile_seconds_for_every_row():
    from dpbert.bench import NOISE_ROW, bert_config, format_table, run_bench

    result = run_bench(
        model="tiny", batch=4, microbatch=2, steps=1, peers=False, memory=False, vmap=False, layer_mode="ghost"
    )
    seconds = result["compile_seconds"]
    assert set(seconds) == set(result["examples_per_s"]) | {NOISE_ROW}
    for name, value in result["examples_per_s"].items():
        assert (seconds[name] > 0) if isinstance(value, float) else seconds[name] is None
    assert seconds[NOISE_ROW] > 0 and "compile s" in format_table(result)
    large = bert_config("large")
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads, large.vocab_size) == (
        24,
        1024,
        16,
        30522,
    )
