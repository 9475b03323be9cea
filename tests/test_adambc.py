"""DP-AdamBC (`dpbert.privacy.adam_bc`): optax.adamw without noise, the noise variance phi_hat of
a two-stage schedule against numpy, the floor, the recipe's validation and wiring, and a tiny DP
run whose ledger is the one planned without the correction."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from tiny_run import seed_file, write_recipe

from dpbert.config.plan import plan_recipe
from dpbert.config.recipe import RecipeError, load_recipe, load_recipe_dict, recipe_to_dict
from dpbert.data.store import TokenStore
from dpbert.privacy.adam_bc import ScaleByAdamBCState, adam_bc, noise_variance_schedule, scale_by_adam_bc
from dpbert.privacy.schedule import BatchSchedule, Stage
from dpbert.train.engine import fingerprint
from dpbert.train.pretrain import pretrain, state_fingerprints
from dpbert.train.state import make_optimizer

# Two stages: 3 steps of B = 4 at sigma 1.5, then 4 steps of B = 16 at sigma 0.8; C = 0.5.
TWO_STAGES = BatchSchedule(
    stages=(
        Stage(steps=3, expected_batch_size=4, noise_multiplier=1.5),
        Stage(steps=4, expected_batch_size=16, noise_multiplier=0.8),
    )
)
CLIP = 0.5


def _params_and_grads(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
    grads = [
        jax.tree_util.tree_map(
            lambda p: jnp.asarray(rng.choice([-1, 1], p.shape) * rng.uniform(0.1, 1.0, p.shape), jnp.float32), params
        )
        for _ in range(steps)
    ]
    return params, grads


def _run(tx, params, grads):
    state = tx.init(params)
    out = []
    for g in grads:
        updates, state = jax.jit(tx.update)(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out, state


def test_without_noise_it_is_adamw_with_weight_decay_and_a_schedule():
    params, grads = _params_and_grads(7)
    lr = optax.linear_schedule(1e-2, 1e-3, 7)
    zero = BatchSchedule(
        stages=tuple(
            Stage(steps=s.steps, expected_batch_size=s.expected_batch_size, noise_multiplier=0.0)
            for s in TWO_STAGES.stages
        )
    )
    got, _ = _run(adam_bc(lr, noise_variance_schedule(zero, CLIP), weight_decay=0.1, b2=0.99), params, grads)
    want, _ = _run(optax.adamw(lr, weight_decay=0.1, b2=0.99), params, grads)
    for a, b in zip(got, want, strict=True):
        jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9), a, b)


def test_noise_variance_of_two_stages_against_numpy():
    b1, b2, eps, floor = 0.9, 0.9, 1e-8, 0.5
    phi_steps = [(1.5 * CLIP / 4) ** 2] * 3 + [(0.8 * CLIP / 16) ** 2] * 4
    schedule = noise_variance_schedule(TWO_STAGES, CLIP)
    np.testing.assert_allclose(
        [float(schedule(jnp.int32(t))) for t in range(9)], phi_steps + phi_steps[-1:] * 2, rtol=1e-6
    )
    # Gradients near the noise level of each stage, so that v_hat - phi_hat is sometimes below the floor.
    rng = np.random.default_rng(3)
    grads = [{"w": jnp.asarray(rng.normal(0, 2 * np.sqrt(p), 6), jnp.float32)} for p in phi_steps]
    params = {"w": jnp.zeros(6, jnp.float32)}
    tx = scale_by_adam_bc(schedule, b1=b1, b2=b2, eps=eps, floor=floor)
    state = tx.init(params)
    m = v = np.zeros(6)
    phi = 0.0
    for t, (g, phi_t) in enumerate(zip(grads, phi_steps, strict=True), start=1):
        updates, state = tx.update(g, state, params)
        g = np.asarray(g["w"], np.float64)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
        phi = b2 * phi + (1 - b2) * phi_t
        phi_hat = phi / (1 - b2**t)
        np.testing.assert_allclose(float(state.phi) / (1 - b2**t), phi_hat, rtol=1e-5)
        floored = v / (1 - b2**t) - phi_hat < floor * phi_hat
        assert 0 < floored.sum() < 6 or t < 3  # both branches are exercised
        want = m / (1 - b1**t) / (np.sqrt(np.maximum(v / (1 - b2**t) - phi_hat, floor * phi_hat)) + eps)
        np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-4)
    # One stage: phi_hat is that stage's phi exactly (the bias correction undoes the EMA's start).
    one = scale_by_adam_bc(noise_variance_schedule(BatchSchedule(stages=TWO_STAGES.stages[:1]), CLIP), b2=b2)
    state = one.init(params)
    for g in grads[:3]:
        _, state = one.update(g, state, params)
    np.testing.assert_allclose(float(state.phi) / (1 - b2**3), phi_steps[0], rtol=1e-6)


def test_floor_is_a_multiple_of_the_noise_variance_in_every_stage():
    # Gradients far below the noise level: v_hat - phi_hat < 0, the floor (a multiple of phi_hat) takes over.
    schedule = noise_variance_schedule(TWO_STAGES, CLIP)
    g = {"w": jnp.full(4, 1e-3, jnp.float32)}
    phi_1 = (1.5 * CLIP / 4) ** 2
    for floor in (0.25, 1.0):
        tx = scale_by_adam_bc(schedule, floor=floor, eps=1e-8)
        updates, _ = tx.update(g, tx.init({"w": jnp.zeros(4)}), None)
        # Step 1: m_hat = g and phi_hat = phi_1, so the update is g / (sqrt(floor phi_1) + eps).
        np.testing.assert_allclose(np.asarray(updates["w"]), 1e-3 / (np.sqrt(floor * phi_1) + 1e-8), rtol=1e-4)
    # Over both stages, a coordinate with no signal steps m_hat / sqrt(floor phi_hat), phi_hat the
    # bias-corrected b2-average of the stages' phi: the floor follows the noise from stage to stage.
    b2, floor = 0.9, 0.5
    tx = scale_by_adam_bc(schedule, floor=floor, b2=b2, eps=0.0)
    state, m, phi = tx.init({"w": jnp.zeros(4)}), 0.0, 0.0
    for t in range(1, 8):  # three steps of the first stage, four of the second
        updates, state = tx.update(g, state, None)
        m, phi = 0.9 * m + 0.1 * 1e-3, b2 * phi + (1 - b2) * float(schedule(jnp.int32(t - 1)))
        want = m / (1 - 0.9**t) / np.sqrt(floor * phi / (1 - b2**t))
        np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-5)
    with pytest.raises(ValueError, match="floor"):
        scale_by_adam_bc(schedule, floor=0.0)
    with pytest.raises(ValueError, match="clip_norm"):
        noise_variance_schedule(TWO_STAGES, 0.0)


RECIPE = {
    "schedule": [{"steps": 3, "expected_batch_size": 8}, {"steps": 2, "expected_batch_size": 32}],
    "privacy": {"noise_multiplier": 1.1, "delta": 1e-5, "dataset_size": 1000, "clip_norm": 0.5},
}


def test_recipe_fields_are_validated_and_named():
    on = load_recipe_dict(
        RECIPE, ["optimizer.noise_variance_correction=true", "optimizer.noise_variance_floor_ratio=0.5"]
    )
    assert on.optimizer.noise_variance_correction and on.optimizer.noise_variance_floor_ratio == 0.5
    with pytest.raises(RecipeError, match="optimizer.noise_variance_correction") as err:
        load_recipe_dict(RECIPE, ["optimizer.noise_variance_correction=true", "privacy.enabled=false"])
    assert err.value.field == "optimizer.noise_variance_correction"
    for bad in ("0", "-1e-8"):
        with pytest.raises(RecipeError, match="optimizer.noise_variance_floor_ratio"):
            load_recipe_dict(RECIPE, [f"optimizer.noise_variance_floor_ratio={bad}"])
    # The optimizer needs the plan's noise multipliers; given them, its state keeps phi.
    with pytest.raises(ValueError, match="optimizer.noise_variance_correction"):
        make_optimizer(on)
    plan = plan_recipe(on)
    state = make_optimizer(on, plan.schedule).init({"w": jnp.zeros(3)})
    assert isinstance(state[0], ScaleByAdamBCState)
    # Off, the checkpoint fingerprint is the one written before the fields existed.
    manifest = type("M", (), {"tokenizer_fingerprint": "t" * 16, "corpus_sha256": "c" * 16, "seq_len": 128})
    off = load_recipe_dict(RECIPE)
    assert state_fingerprints(off, manifest, 1000)["optimizer"] != state_fingerprints(on, manifest, 1000)["optimizer"]
    later = ("noise_variance_correction", "noise_variance_floor_ratio", "decay_matrices_only", "cooldown_steps")
    before = {k: v for k, v in recipe_to_dict(off)["optimizer"].items() if k not in later}
    assert state_fingerprints(off, manifest, 1000)["optimizer"] == fingerprint(before)


def test_the_correction_changes_neither_plan_nor_ledger(tmp_path):
    off, on = load_recipe_dict(RECIPE), load_recipe_dict(RECIPE, ["optimizer.noise_variance_correction=true"])
    assert plan_recipe(on).ledger.to_dict() == plan_recipe(off).ledger.to_dict()
    # A tiny DP run with the correction: its ledger is the plan of the same recipe without it.
    path = write_recipe(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["optimizer"]["noise_variance_correction"] = True
    raw["model"]["num_hidden_layers"] = 1
    raw["data"]["seq_len"] = 16
    raw["train"].update(microbatch_size=8, checkpoint_every=100)
    path.write_text(yaml.safe_dump(raw))
    result = pretrain(
        path, tmp_path / "run", progress=False, log=lambda s: None, noise_seed_file=seed_file(tmp_path), release=False
    )
    assert result.steps_done == 2 and not result.stopped_early
    stored = len(TokenStore.open(tmp_path / "store", "train"))
    raw["optimizer"]["noise_variance_correction"] = False
    path.write_text(yaml.safe_dump(raw))
    planned = plan_recipe(load_recipe(path), stored).ledger_after(2)
    assert json.loads((tmp_path / "run" / "privacy.json").read_text()) == planned
    assert result.epsilon == pytest.approx(plan_recipe(load_recipe(path), stored).epsilon_after(2), rel=1e-12)


@pytest.mark.parametrize("correction", [False, True])
def test_decay_matrices_only_spares_layernorm_gains_and_biases(correction):
    """With `optimizer.decay_matrices_only`, a zero-gradient step of the real model's parameters (two
    scanned layers: their gains and biases are stacked into 2-D arrays) moves every kernel and
    embedding by the decay alone and leaves every LayerNorm gain and bias as it is; without it every
    parameter decays (AdamW's and DP-AdamBC's chains alike)."""
    from dpbert.train.mesh import make_mesh
    from dpbert.train.state import abstract_state, bert_config, init_state

    raw = {
        **RECIPE,
        "model": {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 32},
        "data": {"seq_len": 16},
        "optimizer": {"learning_rate": 0.1, "weight_decay": 0.5, "noise_variance_correction": correction},
    }  # fmt: skip
    for only in (False, True):
        recipe = load_recipe_dict(raw, [f"optimizer.decay_matrices_only={str(only).lower()}"])
        schedule = plan_recipe(recipe).schedule if correction else None
        optimizer = make_optimizer(recipe, schedule)
        abstract = abstract_state(recipe, bert_config(recipe), optimizer, make_mesh(devices=jax.devices()[:1]))
        params, opt_state = init_state(recipe, abstract, optimizer)
        params = jax.tree_util.tree_map(lambda p: p + 1.0, params)  # no zeros: biases start at 0
        updates, _ = optimizer.update(jax.tree_util.tree_map(jnp.zeros_like, params), opt_state, params)
        decayed, spared = [], []
        flat = zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree_util.tree_leaves(params), strict=True)
        for (path, u), p in flat:
            name = jax.tree_util.keystr(path)
            last = name.removesuffix(".value").rsplit("[", 1)[-1]
            (decayed if last in ("'kernel']", "'embedding']") else spared).append((name, u, p))
        assert len(decayed) == 10 and len(spared) == 16  # 3 tables, 7 kernels; 5 gains, 11 biases
        assert any(u.ndim == 3 for _, u, _ in decayed) and any(u.ndim == 2 for _, u, _ in spared)  # stacked
        for name, u, p in decayed:  # Adam's step of a zero gradient is 0: the update is the decay alone
            np.testing.assert_allclose(np.asarray(u), -0.1 * 0.5 * np.asarray(p), rtol=1e-5, err_msg=name)
        for name, u, _ in spared:
            assert np.abs(np.asarray(u)).max() == 0 if only else np.abs(np.asarray(u)).min() > 0, name
