"""Document-level DP: a document's sequences are clipped together, sampled as one unit, and the
accountant is told the document sampling rate.

The references are computed the slow, obvious way: each sequence's gradient by its own
`jax.grad`, summed per document, then clipped."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import BertConfig
from xla import subprocess_env

from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.model.ghost import MLMGhostLoss
from dpbert.privacy.clipping import clipped_grad_sum
from dpbert.privacy.documents import SEQUENCE_PADDING, document_loss
from dpbert.privacy.ghost_clipping import ghost_clipped_grad_sum, ghost_sq_norms
from dpbert.privacy.sampling import check_document_offsets, document_sample

V, L, P = 61, 12, 4
D, K = 4, 3  # documents per batch, sequence slots per document


def _tree_sum(trees):
    return jax.tree_util.tree_map(lambda *x: sum(x), *trees)


@pytest.fixture(scope="module")
def bert():
    # Dropout 0: a document's forward is then exactly its sequences' forwards, one by one.
    config = BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    graphdef, params = functional.split_params(BertForMaskedLM(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    ids = rng.integers(1, V, (D, K, L))
    ids[0, 1, 3] = ids[0, 0, 5]  # a token in two sequences of one document: one table row, two gradients
    mask = np.ones((D, K, L), np.int32)
    mask[1, 2, 6:] = 0
    positions = rng.integers(1, L - 1, (D, K, P))
    labels = rng.integers(0, V, (D, K, P))
    labels[0, 0, 0] = ids[0, 1, positions[0, 1, 0]]  # decoder row of one sequence = input row of another
    padding = np.zeros((D, K), bool)
    padding[1, 2] = padding[2, 1:] = True  # documents with 2 and 1 real sequences
    batch = {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "attention_mask": jnp.asarray(mask),
        "token_type_ids": jnp.asarray(rng.integers(0, 2, (D, K, L)), jnp.int32),
        "masked_positions": jnp.asarray(positions, jnp.int32),
        "labels": jnp.asarray(labels, jnp.int32),
        "label_weights": jnp.ones((D, K, P), jnp.float32),
        SEQUENCE_PADDING: jnp.asarray(padding),
    }
    loss = MLMGhostLoss(graphdef=graphdef)
    grad_one = jax.jit(jax.grad(loss))
    # Each document's gradient: the sum of its real sequences' gradients, each from its own jax.grad.
    per_document = []
    for d in range(D):
        grads = [
            grad_one(params, {k: v[d, s] for k, v in batch.items() if k != SEQUENCE_PADDING}, None)
            for s in range(K)
            if not padding[d, s]
        ]
        per_document.append(_tree_sum(grads))
    return loss, params, batch, per_document


def _clipped_reference(per_document, is_padding, clip_norm):
    out = jax.tree_util.tree_map(jnp.zeros_like, per_document[0])
    for g, pad in zip(per_document, is_padding):
        if not pad:
            scale = min(1.0, clip_norm / float(optax.tree.norm(g)))
            out = jax.tree_util.tree_map(lambda t, x, s=scale: t + s * x, out, g)
    return out


def _max_error(got, want):
    return max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    )


@pytest.mark.parametrize("layer_mode", ["ghost", "instantiate"])
def test_ghost_document_norm_is_the_norm_of_the_summed_sequence_gradients(bert, layer_mode):
    loss, params, batch, per_document = bert
    loss = MLMGhostLoss(graphdef=loss.graphdef, layer_mode=layer_mode)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(D))
    _, sq = jax.jit(lambda p, b: ghost_sq_norms(loss, p, b, keys))(params, batch)
    want = np.array([float(optax.tree.norm(g)) for g in per_document])
    np.testing.assert_allclose(np.sqrt(np.asarray(sq)), want, rtol=2e-5)


def test_both_clipping_paths_clip_each_document_whole(bert):
    loss, params, batch, per_document = bert
    want = np.array([float(optax.tree.norm(g)) for g in per_document])
    is_padding = jnp.asarray([False, False, False, True])
    clip_norm = float(np.median(want[:3]))
    ref = _clipped_reference(per_document, np.asarray(is_padding), clip_norm)
    scale = float(optax.tree.norm(ref))
    for impl in (ghost_clipped_grad_sum, clipped_grad_sum):
        got, stats = jax.jit(
            lambda p, b, impl=impl: impl(
                loss, p, b, is_padding, jax.random.key(0), clip_norm=clip_norm, microbatch_size=2
            )
        )(params, batch)
        assert _max_error(got, ref) <= 2e-5 * scale + 1e-6, impl.__name__
        assert float(stats.num_examples) == 3


def _toy_loss(params, sequence, rng):
    # Linear in the parameters: the gradient of one sequence is its "x" times its weight.
    return sequence["w"] * jnp.sum(params["theta"] * sequence["x"])


def test_adversarial_documents_are_clipped_as_a_whole():
    """Many sequences with huge, aligned gradients: the document's contribution is still <= C,
    and removing the document changes the step's sum by at most C (before noise)."""
    dim, cap, clip = 5, 64, 0.7
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, cap, dim)).astype(np.float32)
    x[0] = 1e6  # adversarial: 64 aligned sequences of norm ~2e6 each
    w = np.ones((3, cap), np.float32)
    padding = np.zeros((3, cap), bool)
    padding[2, 5:] = True
    batch = {"x": jnp.asarray(x), "w": jnp.asarray(w), SEQUENCE_PADDING: jnp.asarray(padding)}
    params = {"theta": jnp.zeros(dim)}
    loss = document_loss(_toy_loss)
    key = jax.random.key(0)

    def clipped(is_padding):
        total, _ = clipped_grad_sum(
            loss, params, batch, jnp.asarray(is_padding), key, clip_norm=clip, microbatch_size=1
        )
        return np.asarray(total["theta"], np.float64)

    with_all = clipped([False, False, False])
    alone = clipped([False, True, True])
    assert np.linalg.norm(alone) <= clip * (1 + 1e-6)
    assert np.linalg.norm(alone) > 0.99 * clip  # clipped, not dropped
    # The document's summed gradient, normalised: the clip applies to the sum, not per sequence.
    direction = x[0].sum(0) / np.linalg.norm(x[0].sum(0))
    np.testing.assert_allclose(alone, clip * direction, rtol=1e-5)
    for removed in range(3):
        others = [i != removed for i in range(3)]
        without = clipped([not o for o in others])
        assert np.linalg.norm(with_all - without) <= clip * (1 + 1e-5)


def test_document_sample_takes_at_most_the_cap_of_each_document_at_random():
    lengths = np.array([1, 3, 40, 7, 2])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cap = 4
    seen = {d: set() for d in range(5)}
    for step in range(200):
        b = document_sample(jax.random.key(3), step, offsets, 3, 5, cap)
        assert b.indices.shape == (5, cap) and b.sequence_padding.shape == (5, cap)
        for row in range(5):
            if b.is_padding[row]:
                assert b.sequence_padding[row].all()
                continue
            d = int(b.documents[row])
            taken = b.indices[row][~b.sequence_padding[row]]
            assert taken.size == min(cap, lengths[d]) and len(set(taken)) == taken.size
            assert np.all((taken >= offsets[d]) & (taken < offsets[d + 1]))  # one document's sequences only
            seen[d].update(taken.tolist())
    assert len(seen[2]) == 40  # a long document: different sequences on different steps
    # Replays agree; a different key (the secret) gives different choices.
    a = document_sample(jax.random.key(3), 7, offsets, 3, 5, cap)
    b = document_sample(jax.random.key(3), 7, offsets, 3, 5, cap)
    assert np.array_equal(a.indices, b.indices)


def test_empty_document_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="document 2 has no sequence"):
        check_document_offsets(np.array([0, 3, 5, 5, 9]))


def test_document_sampling_rate_is_what_the_accountant_is_told():
    """Each document joins a step with the ledger's rate q = B / N documents, independently of
    its length: over many steps the inclusion frequency of every document is q (binomial
    tolerance of 5 standard deviations), and a length-weighted bug (q * n_d / mean) fails."""
    from dpbert.privacy.accounting import PrivacyLedger
    from dpbert.privacy.schedule import BatchSchedule, Stage

    lengths = np.array([1] * 10 + [50] * 10)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n, b, steps = 20, 4, 4000
    ledger = PrivacyLedger.for_schedule(
        BatchSchedule(stages=(Stage(steps=steps, expected_batch_size=b, noise_multiplier=1.0),)),
        dataset_size=n,
        delta=1e-5,
        clip_norm=1.0,
        accountant="rdp",
        privacy_unit="one document",
        max_sequences_per_document=8,
    )
    q = ledger.stages[0].sampling_rate
    counts = np.zeros(n)
    for step in range(steps):
        s = document_sample(7, step, offsets, b, n, 8)
        counts[s.documents[~s.is_padding]] += 1
    freq = counts / steps
    tol = 5 * math.sqrt(q * (1 - q) / steps)
    assert np.all(np.abs(freq - q) < tol), (freq, q)
    # Short and long documents alike (a length-weighted sampler would give 0.004 vs 0.38).
    assert abs(freq[:10].mean() - freq[10:].mean()) < tol


def test_document_level_pretraining_replays_exactly_on_resume(tmp_path):
    """The real loop with documents as units: the ledger says so, and a run resumed from its
    step-1 checkpoint ends with the same weights as the uninterrupted run (exact replay of the
    secret document sample and of the sequences chosen within each document)."""

    import yaml

    from dpbert.train.pretrain import pretrain
    from tests.tiny_run import seed_file, write_recipe

    path = write_recipe(tmp_path, checkpoint_every=1)
    recipe = yaml.safe_load(path.read_text())
    recipe["schedule"] = [{"steps": 2, "expected_batch_size": 4}]
    recipe["privacy"].update(unit="document", max_sequences_per_document=2)
    recipe["train"]["keep_checkpoints"] = 3
    path.write_text(yaml.safe_dump(recipe))
    kw = dict(progress=False, log=lambda s: None, noise_seed_file=seed_file(tmp_path))
    from jax.experimental.compilation_cache import compilation_cache as cc

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))  # the resumed run reuses the programs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    try:
        ref = pretrain(path, tmp_path / "ref", **kw)
        _resume_and_compare(tmp_path, path, ref, kw)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        cc.reset_cache()


def _resume_and_compare(tmp_path, path, ref, kw):
    import json
    import shutil

    from safetensors.numpy import load_file

    from dpbert.train.pretrain import pretrain

    ledger = json.loads((tmp_path / "ref" / "privacy.json").read_text())
    assert ledger["privacy_unit"] == "one document" and ledger["max_sequences_per_document"] == 2
    assert ledger["dataset_size"] == 36  # the 36 train documents of 40 (4 held out), not their sequences
    assert ledger["stages"][0]["sampling_rate"] == 4 / 36
    shutil.copytree(tmp_path / "ref", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "2")
    resumed = pretrain(path, tmp_path / "resumed", resume=True, **kw)
    assert resumed.steps_done == 2 and resumed.epsilon == ref.epsilon
    a, b = (load_file(str(tmp_path / d / "hf" / "model.safetensors")) for d in ("ref", "resumed"))
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6, err_msg=name)
    # The release says so, and verify recomputes epsilon and rebuilds the document-level plan.
    from dpbert.release.verify import verify_folder

    release = tmp_path / "ref" / "release"
    result = verify_folder(release)
    assert result.ok, result.problems
    card = (release / "README.md").read_text()
    assert "privacy unit: one document: a whole document, at most 2 of its sequences per step" in card
    assert "privacy_unit: one document" in card.split("---")[1]


MESH_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np, optax
from dpbert.privacy import data_mesh, make_dp_train_step, step_key
from dpbert.privacy.documents import SEQUENCE_PADDING, document_loss

assert jax.device_count() == 4, jax.devices()

def sequence_loss(params, sequence, rng):
    keep = jax.random.bernoulli(rng, 0.8, sequence["x"].shape)  # per-slot randomness
    return (jnp.tanh(params["w"] @ (sequence["x"] * keep)) @ params["v"] - sequence["y"]) ** 2

rng = np.random.default_rng(0)
params = {"w": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), "v": jnp.asarray(rng.normal(size=6), jnp.float32)}
docs, cap = 16, 5
batch = {"x": jnp.asarray(rng.normal(size=(docs, cap, 3)) * 3, jnp.float32),
         "y": jnp.asarray(rng.normal(size=(docs, cap)), jnp.float32),
         SEQUENCE_PADDING: jnp.asarray(rng.random((docs, cap)) < 0.3)}
pad = jnp.asarray(np.arange(docs) >= 13)
key = step_key(jax.random.key(5), 3)
out = {}
for name, mesh, micro in (("one", None, 16), ("one-mb2", None, 2), ("mesh-mb2", data_mesh(), 2), ("mesh-mb1", data_mesh(), 1)):
    step = make_dp_train_step(document_loss(sequence_loss), optax.sgd(1.0), clip_norm=0.5, noise_multiplier=0.7,
                              expected_batch_size=10, microbatch_size=micro, mesh=mesh, donate=False)
    new, _, _ = step(params, optax.sgd(1.0).init(params), batch, pad, key)
    out[name] = {k: np.asarray(v).tolist() for k, v in new.items()}
print(json.dumps(out))
"""


def test_document_step_is_the_same_on_any_mesh_and_micro_batch():
    """Documents as units keep rule 2 of `dpbert.privacy`: the update (noise included) is the same for any micro-batch
    size and on 4 devices (fresh interpreter: the device count is fixed when jax starts)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {**subprocess_env(4), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = out.pop("one")
    for name, got in out.items():
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=f"{name}/{k}")


def test_store_records_each_documents_sequences_and_refuses_an_empty_document(tmp_path):
    from dpbert.data.store import DOCUMENTS_SUFFIX, TokenStore, prepare_store

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = [
        "the",
        "president",
        "of",
        "the",
        "united",
        "states",
        "addresses",
        "the",
        "congress",
        "on",
        "the",
        "state",
        "of",
        "the",
        "union",
    ]
    for d, n in enumerate([5, 40, 90, 12, 60]):
        (corpus / f"doc{d}.txt").write_text(" ".join(words[i % len(words)] for i in range(n)))
    manifest = prepare_store(
        tmp_path / "store",
        corpus=str(corpus),
        tokenizer="train",
        train_vocab_size=60,
        seq_len=16,
        eval_fraction=0.0,
        num_proc=1,
    )
    store = TokenStore.open(tmp_path / "store", "train")
    offsets = check_document_offsets(store.document_offsets())
    lengths = np.diff(offsets)
    assert lengths.size == manifest.splits["train"].num_documents == 5 and offsets[-1] == len(store)
    assert lengths.max() == manifest.splits["train"].max_sequences_per_document
    # Each document's rows hold its own tokens only, [CLS] first: a row starts every document.
    cls = manifest.cls_id
    assert np.all(store[offsets[:-1]][:, 0] == cls)
    # An empty document (offsets repeat) is refused by the document sampler, naming it.
    with pytest.raises(ValueError, match="document 2 has no sequence"):
        check_document_offsets(np.insert(offsets, 2, offsets[2]))
    (tmp_path / "store" / f"train{DOCUMENTS_SUFFIX}").unlink()
    with pytest.raises(ValueError, match="predates document-level DP; prepare it again"):
        store.document_offsets()
