"""Recipe schema: every shipped recipe parses; unknown or invalid fields are named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dpbert.config.recipe import (
    NONPRIVATE_OVERRIDES,
    Recipe,
    RecipeError,
    load_recipe,
    load_recipe_dict,
    recipe_to_dict,
    save_recipe,
)

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
MINIMAL = {
    "schedule": [{"steps": 4, "expected_batch_size": 8}],
    "privacy": {"target_epsilon": 3.0},
}


def test_recipes_folder_is_not_empty():
    names = {p.name for p in RECIPES}
    assert {"tiny.yaml", "tiny_nonprivate.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses_and_documents_itself(path):
    raw = yaml.safe_load(path.read_text())
    if "schedule" in raw and "recipe" not in raw:  # a pretraining recipe (this schema)
        recipe = load_recipe(path)
        assert isinstance(recipe, Recipe) and recipe.total_steps > 0
    elif "recipe" in raw:  # a sweep over a pretraining recipe
        from dpbert.train.sweep import build_arms, load_sweep

        assert len(build_arms(load_sweep(path))) >= 2
    else:  # a GLUE fine-tuning recipe: its own schema
        from dpbert.config.finetune import load_config

        load_config(path)
    head = path.read_text().splitlines()[0]
    assert head.startswith("#"), f"{path.name} must open with a comment"
    assert "Command" in path.read_text() and path.name in path.read_text()


@pytest.mark.parametrize("dp, twin", [("tiny.yaml", "tiny_nonprivate.yaml"), ("small.yaml", "small_nonprivate.yaml")])
def test_dp_recipe_and_its_twin_differ_only_in_privacy_and_learning_rate(dp, twin):
    """The non-private reference has the same model, data, schedule and compute; only its learning
    rate is tuned on its own (DP noise calls for a larger one), and DP-AdamBC and the moving average,
    which correct for the noise and average it out, are a private run's alone (`NONPRIVATE_OVERRIDES`)."""
    tiny = recipe_to_dict(load_recipe(next(p for p in RECIPES if p.name == dp)))
    base = recipe_to_dict(load_recipe(next(p for p in RECIPES if p.name == twin)))
    assert tiny["privacy"]["enabled"] and not base["privacy"]["enabled"]
    built = recipe_to_dict(load_recipe(next(p for p in RECIPES if p.name == dp), NONPRIVATE_OVERRIDES))
    assert built["optimizer"] == {**tiny["optimizer"], "noise_variance_correction": False, "ema_decay": None}
    for name in ("learning_rate", "noise_variance_correction", "noise_variance_floor_ratio"):
        tiny["optimizer"].pop(name), base["optimizer"].pop(name)
    assert base["optimizer"].pop("ema_decay") is None
    tiny["optimizer"].pop("ema_decay")
    for section in tiny:
        if section != "privacy":
            assert tiny[section] == base[section], section


@pytest.mark.parametrize(
    "raw, field",
    [
        ({**MINIMAL, "modle": {}}, "modle"),
        ({**MINIMAL, "model": {"hidden_sise": 64}}, "model.hidden_sise"),
        ({**MINIMAL, "model": {"hidden_size": 30, "num_attention_heads": 4}}, "model.hidden_size"),
        ({**MINIMAL, "model": {"hidden_size": "big"}}, "model.hidden_size"),
        ({**MINIMAL, "privacy": {"target_epsilon": -1.0}}, "privacy.target_epsilon"),
        ({**MINIMAL, "privacy": {"clip_norm": 1.0}}, "privacy.target_epsilon"),
        ({**MINIMAL, "privacy": {"target_epsilon": 1.0, "accountant": "moments"}}, "privacy.accountant"),
        (
            {**MINIMAL, "schedule": [{"steps": 4, "expected_batch_size": 8}, {"steps": 0, "expected_batch_size": 8}]},
            "schedule[1].steps",
        ),
        ({**MINIMAL, "schedule": [{"steps": 4}]}, "schedule[0].expected_batch_size"),
        ({**MINIMAL, "schedule": []}, "schedule"),
        ({**MINIMAL, "train": {"microbatch_size": 0}}, "train.microbatch_size"),
        ({**MINIMAL, "train": {"dtype": "float16"}}, "train.dtype"),
        ({**MINIMAL, "train": {"layer_mode": "fast"}}, "train.layer_mode"),
        ({**MINIMAL, "model": {"remat": "yes"}}, "model.remat"),
        (
            {**MINIMAL, "data": {"seq_len": 32}, "model": {"max_position_embeddings": 16}},
            "model.max_position_embeddings",
        ),
        ({**MINIMAL, "report": {"fill_mask": ["no mask here"]}}, "report.fill_mask[0]"),
        ({**MINIMAL, "reference": {"nonprivate_mlm_accuracy": 32.81}}, "reference.nonprivate_mlm_accuracy"),
        ({**MINIMAL, "reference": {"nonprivate_mlm_accuracy": 0.0}}, "reference.nonprivate_mlm_accuracy"),
        ({**MINIMAL, "reference": {"recipe": ""}}, "reference.recipe"),
        ({**MINIMAL, "reference": {"note": 3}}, "reference.note"),
        ({**MINIMAL, "reference": {"accuracy": 0.3}}, "reference.accuracy"),
        ({"schedule": MINIMAL["schedule"]}, "privacy"),
        ({**MINIMAL, "optimizer": {"cooldown_steps": -1, "decay": "constant"}}, "optimizer.cooldown_steps"),
        ({**MINIMAL, "optimizer": {"cooldown_steps": 2, "decay": "linear"}}, "optimizer.cooldown_steps"),
    ],
)
def test_bad_fields_are_named(raw, field):
    with pytest.raises(RecipeError) as info:
        load_recipe_dict(raw)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)


def test_overrides_are_yaml_parsed_and_validated():
    r = load_recipe_dict(MINIMAL, ["schedule.0.steps=20", "privacy.delta=1e-5", "train.dtype=bfloat16"])
    assert r.schedule[0].steps == 20 and r.privacy.delta == 1e-5 and r.train.dtype == "bfloat16"
    r = load_recipe_dict(MINIMAL, ["schedule=[{steps: 2, expected_batch_size: 4}, {steps: 3, expected_batch_size: 8}]"])
    assert r.total_steps == 5 and r.schedule[1].expected_batch_size == 8
    with pytest.raises(RecipeError, match="'train.sed'"):
        load_recipe_dict(MINIMAL, ["train.sed=3"])
    with pytest.raises(RecipeError, match="'optimizer.learning_rate'"):
        load_recipe_dict(MINIMAL, ["optimizer.learning_rate=-0.1"])
    with pytest.raises(RecipeError, match=r"'schedule.3'"):
        load_recipe_dict(MINIMAL, ["schedule.3.steps=1"])
    with pytest.raises(ValueError, match="key.path=value"):
        load_recipe_dict(MINIMAL, ["train.seed"])


def test_remat_and_layer_mode_reach_the_model_and_the_clipped_loss():
    """`model.remat` builds the encoder with jax.checkpoint; `train.layer_mode` reaches the
    ghost-clipping loss (the trainer's and the ahead-of-time compile's, which share it)."""
    import jax
    from flax import nnx

    from dpbert.train.mesh import make_mesh
    from dpbert.train.mlm import make_mlm_loss
    from dpbert.train.state import abstract_state, bert_config, make_optimizer

    raw = {
        **MINIMAL,
        "model": {"vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32},
        "data": {"seq_len": 16},
    }
    for remat in (False, True):
        recipe = load_recipe_dict(raw, [f"model.remat={str(remat).lower()}", "train.layer_mode=instantiate"])
        abstract = abstract_state(
            recipe, bert_config(recipe), make_optimizer(recipe), make_mesh(devices=jax.devices()[:1])
        )
        assert nnx.merge(abstract.graphdef, abstract.params).bert.encoder.remat is remat
        loss = make_mlm_loss(recipe, abstract.graphdef, masker=None, run_key=jax.random.key(0))
        assert loss.layer_mode == "instantiate"


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**MINIMAL, "train": {"seed": -1}}))
    with pytest.raises(RecipeError, match=r"'train.seed'.*bad.yaml"):
        load_recipe(bad)


def test_resolved_recipe_round_trips(tmp_path):
    r = load_recipe_dict(MINIMAL, ["model.hidden_size=64", "report.fill_mask=['a [MASK] b']"])
    save_recipe(r, tmp_path / "run" / "recipe.yaml")
    assert load_recipe(tmp_path / "run" / "recipe.yaml") == r
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["recipe.yaml"]  # no temp files left


def test_document_recipe_is_the_default_but_for_its_unit():
    """tiny_document.yaml compares units at tiny.yaml's model, data and compute."""
    tiny = recipe_to_dict(load_recipe(next(p for p in RECIPES if p.name == "tiny.yaml")))
    doc = recipe_to_dict(load_recipe(next(p for p in RECIPES if p.name == "tiny_document.yaml")))
    assert doc["privacy"]["unit"] == "document" and tiny["privacy"]["unit"] == "sequence"
    assert doc["model"] == tiny["model"] and doc["optimizer"] == tiny["optimizer"]
    assert doc["data"] == tiny["data"]
    steps = lambda r: [s["steps"] for s in r["schedule"]]  # noqa: E731
    assert steps(doc) == steps(tiny)
    per_step = doc["schedule"][0]["expected_batch_size"] * doc["privacy"]["max_sequences_per_document"]
    assert per_step == tiny["schedule"][0]["expected_batch_size"]
    assert doc["privacy"]["target_epsilon"] == tiny["privacy"]["target_epsilon"]


def test_cooldown_holds_the_rate_then_falls_linearly_over_the_last_steps():
    """Warmup-stable-decay: warmup 100, the rate held to step 900, then linear to 10% at step 1,100."""
    from dpbert.train.state import learning_rate

    raw = {
        **MINIMAL,
        "schedule": [{"steps": 1100, "expected_batch_size": 8}],
        "optimizer": {"learning_rate": 6e-3, "warmup_steps": 100, "decay": "constant", "cooldown_steps": 200,
                      "end_learning_rate_fraction": 0.1},
    }  # fmt: skip
    lr = learning_rate(load_recipe_dict(raw))
    expected = {0: 0.0, 50: 3e-3, 100: 6e-3, 500: 6e-3, 900: 6e-3, 1000: 3.3e-3, 1099: 6e-4 + 5.4e-3 / 200}
    for step, value in expected.items():
        assert float(lr(step)) == pytest.approx(value, rel=1e-5, abs=1e-12), step
    held = learning_rate(load_recipe_dict({**raw, "optimizer": {**raw["optimizer"], "cooldown_steps": 0}}))
    assert float(held(1099)) == pytest.approx(6e-3)
