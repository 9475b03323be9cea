"""Random position offsets (`data.random_position_offsets`): the offset draw (range, every offset
used, a function of (step, store index) only), the masker and loss with the flag off as before,
the clipped sum reaching position rows past seq_len for any micro-batch size, and a tiny DP run
whose release has 64 trained positions and runs 64 tokens in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from tiny_run import seed_file, write_recipe

from dpbert.config.recipe import load_recipe_dict, recipe_to_dict
from dpbert.data.masking import example_mask_key, example_position_offset
from dpbert.model import functional
from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.ghost_clipping import ghost_clipped_grad_sum
from dpbert.privacy.randomness import SUPPLIED, RunSecret
from dpbert.train.mesh import make_mesh
from dpbert.train.pretrain import build_setup, pretrain
from dpbert.train.state import bert_config

SEQ_LEN, POSITIONS, VOCAB = 16, 64, 50
TOKEN_IDS = {"mask_token_id": 4, "special_token_ids": (0, 1, 2, 3, 4), "pad_id": 0}
POSITION_ROWS = "bert.embeddings.position_embeddings.weight"


def _recipe(random_position_offsets: bool, **privacy):
    return load_recipe_dict(
        {
            "model": {
                "vocab_size": VOCAB,
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 32,
                "max_position_embeddings": POSITIONS,
            },
            "data": {"seq_len": SEQ_LEN, "random_position_offsets": random_position_offsets},
            "schedule": [{"steps": 2, "expected_batch_size": 8}],
            "privacy": {"noise_multiplier": 1.0, "delta": 1e-5, **privacy},
            "train": {"microbatch_size": 4},
        }
    )


def _setup(random_position_offsets: bool):
    recipe = _recipe(random_position_offsets)
    secret = RunSecret(bytes(range(32)), SUPPLIED)
    return build_setup(
        recipe,
        make_mesh(devices=jax.devices()[:1]),
        config=bert_config(recipe),
        seq_len=SEQ_LEN,
        token_ids=TOKEN_IDS,
        secret=secret,
        mechanism="pretrain",
    )


def _batch(n: int, step: int = 3) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, (n, SEQ_LEN))
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    return {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "index": jnp.arange(100, 100 + n, dtype=jnp.int32),
        "step": jnp.full((n,), step, jnp.int32),
    }


def test_offsets_are_uniform_in_range_and_every_offset_is_drawn():
    key = jax.random.key(0)
    n, top = 20_000, POSITIONS - SEQ_LEN
    draw = jax.jit(jax.vmap(lambda i: example_position_offset(key, 7, i, top)))
    offsets = np.asarray(draw(jnp.arange(n)))
    assert offsets.dtype == np.int32 and offsets.min() >= 0 and offsets.max() <= top
    # Each of the 49 offsets is expected n/49 = 408 times (sd ~20): a missing one would be a
    # 20-sd event, so this cannot fail by chance; 6 sd either side bounds the counts.
    counts = np.bincount(offsets, minlength=top + 1)
    expected, sd = n / (top + 1), np.sqrt(n / (top + 1))
    assert counts.size == top + 1 and np.all(np.abs(counts - expected) < 6 * sd), counts
    # No room to move (the table has seq_len rows): always 0.
    assert set(np.asarray(jax.vmap(lambda i: example_position_offset(key, 7, i, 0))(jnp.arange(50)))) == {0}


def test_offsets_depend_on_step_and_store_index_only():
    key = jax.random.key(1)
    draw = jax.jit(jax.vmap(lambda s, i: example_position_offset(key, s, i, 48)))
    steps, index = jnp.repeat(jnp.arange(4), 50), jnp.tile(jnp.arange(50), 4)
    offsets = np.asarray(draw(steps, index)).reshape(4, 50)
    # The same (step, index) in another order, alone, or in chunks of any size: the same offset.
    perm = np.random.default_rng(0).permutation(200)
    np.testing.assert_array_equal(np.asarray(draw(steps[perm], index[perm])), offsets.reshape(-1)[perm])
    for chunk in (1, 8, 40):
        parts = [draw(steps[i : i + chunk], index[i : i + chunk]) for i in range(0, 200, chunk)]
        np.testing.assert_array_equal(np.concatenate(parts), offsets.reshape(-1))
    assert int(example_position_offset(key, 2, 17, 48)) == offsets[2, 17]
    # Fresh draws per step and per example, and a key of its own (not the mask key's first draw).
    assert (offsets[0] != offsets[1]).mean() > 0.8 and len(set(offsets[0])) > 20
    mask_key_draw = jax.vmap(lambda i: jax.random.randint(example_mask_key(key, 0, i), (), 0, 49))(jnp.arange(50))
    assert (np.asarray(mask_key_draw) != offsets[0]).mean() > 0.8


def test_flag_off_leaves_masker_and_loss_as_before_and_flag_on_only_adds_positions():
    off, on = _setup(False), _setup(True)
    batch = _batch(6)
    masked = jax.vmap(off.masker, in_axes=(None, 0, 0, 0))
    x_off = masked(off.masking_key, batch["step"], batch["index"], batch["input_ids"])
    x_on = jax.vmap(on.masker, in_axes=(None, 0, 0, 0))(
        on.masking_key, batch["step"], batch["index"], batch["input_ids"]
    )
    assert set(x_off) == {"input_ids", "attention_mask", "masked_positions", "labels", "label_weights"}
    # The offsets change no mask: same tokens, targets and weights.
    assert set(x_on) == set(x_off) | {"position_ids"}
    for k, v in x_off.items():
        np.testing.assert_array_equal(x_on[k], v)
    offsets = np.asarray(x_on["position_ids"][:, 0])
    np.testing.assert_array_equal(x_on["position_ids"], offsets[:, None] + np.arange(SEQ_LEN))
    assert offsets.min() >= 0 and offsets.max() <= POSITIONS - SEQ_LEN
    # Flag off: the clipped loss is that of the plain forward at positions 0..L-1 (no position ids).
    params = jax.jit(lambda: functional.split_params(off.abstract.build())[1])()
    example = jax.tree_util.tree_map(lambda a: a[0], batch)
    rng = jax.random.key(5)
    x = jax.tree_util.tree_map(lambda a: a[0], x_off)

    def plain(p):
        logits = functional.mlm_logits(
            off.abstract.graphdef,
            p,
            x["input_ids"],
            x["attention_mask"],
            None,
            rng,
            masked_positions=x["masked_positions"],
        )
        ce = jax.nn.log_softmax(logits.astype(jnp.float32))[jnp.arange(logits.shape[0]), x["labels"]]
        return -jnp.sum(ce * x["label_weights"]) / jnp.maximum(jnp.sum(x["label_weights"]), 1.0)

    got = jax.jit(lambda p: off.loss_fn(p, example, rng))(params)
    np.testing.assert_allclose(float(got), float(jax.jit(plain)(params)), rtol=1e-6)
    # The recipe default is off; the field round-trips.
    plain_recipe = recipe_to_dict(_recipe(False))
    del plain_recipe["data"]["random_position_offsets"]
    assert load_recipe_dict(plain_recipe) == _recipe(False)
    assert load_recipe_dict(recipe_to_dict(_recipe(True))).data.random_position_offsets is True


def test_clipped_sum_reaches_rows_past_seq_len_only_with_offsets_for_any_micro_batch():
    off, on = _setup(False), _setup(True)
    params = jax.jit(lambda: functional.split_params(on.abstract.build())[1])()
    batch, is_padding = _batch(8), jnp.zeros(8, bool).at[5].set(True)
    key = jax.random.key(9)

    def rows(setup, impl, mb):
        total, _ = jax.jit(lambda p: impl(setup.loss_fn, p, batch, is_padding, key, clip_norm=1.0, microbatch_size=mb))(
            params
        )
        return np.asarray(total["bert"]["embeddings"]["position_embeddings"]["embedding"])

    base = rows(on, ghost_clipped_grad_sum, 4)
    # Every real example's rows o..o+15 receive gradient; nothing else does.
    x = jax.vmap(on.masker, in_axes=(None, 0, 0, 0))(on.masking_key, batch["step"], batch["index"], batch["input_ids"])
    used = np.zeros(POSITIONS, bool)
    for o, pad in zip(np.asarray(x["position_ids"][:, 0]), np.asarray(is_padding)):
        used[o : o + SEQ_LEN] |= not pad
    assert used[SEQ_LEN:].any()
    np.testing.assert_array_equal(np.abs(base).sum(-1) > 0, used)
    # Micro-batch size and clipping path change nothing but float rounding.
    for impl, mb in ((ghost_clipped_grad_sum, 2), (clipped_grad_sum, 8)):
        np.testing.assert_allclose(rows(on, impl, mb), base, atol=1e-6)
    # Flag off: rows seq_len.. get exactly nothing (only the noise would move them).
    assert not rows(off, ghost_clipped_grad_sum, 4)[SEQ_LEN:].any()


def _run(root: Path, name: str, *, offsets: bool) -> Path:
    recipe = yaml.safe_load((root / "recipe.yaml").read_text())
    recipe["model"]["max_position_embeddings"] = POSITIONS
    recipe["model"]["num_hidden_layers"] = 1
    recipe["data"].update(seq_len=SEQ_LEN, random_position_offsets=offsets)
    recipe["schedule"] = [{"steps": 2, "expected_batch_size": 16}]
    recipe["train"].update(microbatch_size=8, checkpoint_every=100)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = root / name
    pretrain(path, run_dir, progress=False, log=lambda s: None, noise_seed_file=seed_file(root))
    return run_dir


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """Two 2-step DP runs of the tiny recipe (seq_len 16, 64 positions) with the same secret, so
    the same samples, masks and noise: with and without random position offsets."""
    root = tmp_path_factory.mktemp("positions")
    write_recipe(root)
    return _run(root, "on", offsets=True), _run(root, "off", offsets=False)


def test_dp_run_trains_every_position_row_and_records_the_flag(dp_runs):
    on, off = dp_runs
    rows_on, rows_off = (load_file(str(d / "hf" / "model.safetensors"))[POSITION_ROWS] for d in (on, off))
    assert rows_on.shape == rows_off.shape == (POSITIONS, 32)
    # Same noise in both runs: rows seq_len.. of the run without offsets moved by noise alone (no
    # clipped gradient reaches them, above); with offsets the clipped gradient reached them too.
    changed = np.abs(rows_on - rows_off).max(-1) > 0
    assert changed[SEQ_LEN:].any()
    # The ledger is that of the same schedule: offsets are data-independent randomness.
    ledger_on, ledger_off = (json.loads((d / "privacy.json").read_text()) for d in (on, off))
    assert ledger_on == ledger_off
    # The release publishes the recipe, with the flag.
    release = json.loads((on / "release" / "privacy.json").read_text())
    assert yaml.safe_load(release["recipe"]["content"])["data"]["random_position_offsets"] is True


def test_release_has_64_positions_and_runs_64_tokens_in_transformers(dp_runs):
    import torch
    from transformers import BertForMaskedLM

    release = dp_runs[0] / "release"
    model = BertForMaskedLM.from_pretrained(release).eval()
    assert model.config.max_position_embeddings == POSITIONS
    ids = torch.randint(5, model.config.vocab_size, (2, POSITIONS))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert logits.shape == (2, POSITIONS, model.config.vocab_size) and torch.isfinite(logits).all()
    # The trained rows are the released rows.
    released = model.bert.embeddings.position_embeddings.weight.detach().numpy()
    np.testing.assert_array_equal(released, load_file(str(dp_runs[0] / "hf" / "model.safetensors"))[POSITION_ROWS])


def test_repeated_position_rows_keep_short_inputs_exact_and_tile_the_table(tmp_path: Path) -> None:
    """A checkpoint loaded with more positions than it has: rows 0..n-1 as saved, row i = row i mod n,
    the same outputs on inputs of up to n tokens, and a folder that transformers loads."""
    import torch
    from flax import nnx
    from transformers import BertConfig
    from transformers import BertForMaskedLM as HFBertForMaskedLM

    from dpbert.model import BertForMaskedLM
    from dpbert.model.hf_io import repeat_positions

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQ_LEN)  # fmt: skip
    BertForMaskedLM(config, rngs=nnx.Rngs(0)).save_pretrained(str(tmp_path / "short"))
    saved = load_file(tmp_path / "short" / "model.safetensors")[POSITION_ROWS]
    grown = BertForMaskedLM.from_pretrained(str(tmp_path / "short"), max_positions=40)
    assert grown.config.max_position_embeddings == 40
    table = np.asarray(grown.bert.embeddings.position_embeddings.embedding[...])
    np.testing.assert_array_equal(table[:SEQ_LEN], saved)
    np.testing.assert_array_equal(table[SEQ_LEN : 2 * SEQ_LEN], saved)
    np.testing.assert_array_equal(table[2 * SEQ_LEN :], saved[: 40 - 2 * SEQ_LEN])

    short = BertForMaskedLM.from_pretrained(str(tmp_path / "short"))
    ids = jnp.asarray(np.random.default_rng(0).integers(5, VOCAB, size=(2, SEQ_LEN)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(grown(ids).logits), np.asarray(short(ids).logits))
    long_ids = jnp.concatenate([ids, ids, ids[:, :8]], axis=1)
    assert grown(long_ids).logits.shape == (2, 40, VOCAB)  # the short model refuses 40 tokens

    grown.save_pretrained(str(tmp_path / "grown"))
    hf = HFBertForMaskedLM.from_pretrained(str(tmp_path / "grown"))
    assert hf.config.max_position_embeddings == 40
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor(np.asarray(long_ids)).long()).logits.numpy()
    np.testing.assert_allclose(hf_logits, np.asarray(grown(long_ids).logits), atol=2e-4)

    assert repeat_positions({POSITION_ROWS: saved}, SEQ_LEN)[POSITION_ROWS] is saved  # no rows to add
    with pytest.raises(ValueError, match="one position table"):
        repeat_positions({"bert.embeddings.word_embeddings.weight": saved}, 40)
