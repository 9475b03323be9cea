"""The fill-mask demo: numbers match the model run directly, bad input is refused clearly, and the
page works in a real headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from gradio_client import Client
from gradio_client.exceptions import AppError
from tokenizers import BertWordPieceTokenizer
from transformers import AutoTokenizer, BertConfig, BertTokenizerFast

from dpbert.demo import MAX_MASKS, FillMaskInputError, FillMaskModel, ModelPrivacy, serve
from dpbert.demo.app import EXAMPLES
from dpbert.demo.fill_mask import length_buckets, verified_privacy
from dpbert.model import BertForMaskedLM, mlm_logits, split_params
from dpbert.release import CardInfo, Guarantee, ReleaseMetadata, verify_folder, write_release

CORPUS = [
    "the president spoke to congress about the economy and the budget",
    "the capital of france is paris and the capital of italy is rome",
    "we went to the store to buy some bread and some milk",
    "the people of the united states elect a president every four years",
    "congress passed the budget after a long debate about taxes",
] * 4
SENTENCE = "the president spoke to [MASK] about the [MASK] ."
# One mask in each corpus line, at each word: candidates on which a model may or may not use the context.
CORPUS_SENTENCES = sorted(
    {" ".join([*line.split()[:i], "[MASK]", *line.split()[i + 1 :]]) for line in set(CORPUS) for i in range(0, 10, 3)}
)
DP_DELTA = 1e-5


# The DP release's recipe, as the trainer saves it: a vocabulary trained on the (private) corpus, a
# fixed noise multiplier, PLD accounting, N = 1000 sequences. `dpbert verify` (and so the demo)
# rebuilds the release's ledger from it.
RECIPE = {
    "model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
    "data": {"corpus": "test corpus", "seq_len": 32, "tokenizer": "train", "eval_corpus": "public-eval.txt"},
    "schedule": [{"steps": 20, "expected_batch_size": 64}],
    "privacy": {"enabled": True, "clip_norm": 1.0, "delta": DP_DELTA, "accountant": "pld", "noise_multiplier": 1.1},
    "train": {"microbatch_size": 16},
    "report": {"fill_mask": ["congress passed the [MASK] after a long debate ."]},
}
DATASET_SIZE = 1000


def _recipe_and_ledger() -> tuple[str, dict]:
    """The recipe as the trainer writes RUN_DIR/recipe.yaml, and the ledger `plan_recipe` builds from it."""
    from dpbert.config.plan import plan_recipe
    from dpbert.config.recipe import load_recipe_dict, recipe_to_dict

    recipe = load_recipe_dict(RECIPE)
    text = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)
    return text, plan_recipe(recipe, DATASET_SIZE).ledger.to_dict()


def _write_release(
    out: Path,
    tokenizer_dir: Path,
    *,
    seed: int,
    guarantee: Guarantee,
    evaluation: dict | None = None,
    bias_scale: float = 1.0,
) -> Path:
    """A real dpbert release (weights, tokenizer, privacy.json, card) of a random tiny BERT."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = BertForMaskedLM(config, rngs=nnx.Rngs(seed))
    # Random init gives near-uniform probabilities; a random decoder bias makes the top-k distinct.
    # (bias_scale 0: the answer is the encoder's, which depends on the context.)
    model.cls.predictions.bias[...] = bias_scale * jax.random.normal(jax.random.key(seed), (config.vocab_size,))
    private = guarantee.private
    meta = ReleaseMetadata(
        guarantees=(guarantee,),
        vocabulary_origin="trained on the test corpus",
        vocabulary_covered=False,
        vocabulary_learned_from_private_data=True,  # the recipe's data.tokenizer is "train"
        vocabulary_kind="train",
        recipe_name="recipe.yaml" if private else None,
        recipe_content=_recipe_and_ledger()[0] if private else None,
        evaluation=evaluation,
    )
    info = CardInfo(model_name=out.name, architecture="tiny BERT", reproduce_command="(test fixture)")
    return write_release(out, model=model, meta=meta, info=info, tokenizer_dir=tokenizer_dir)


# Held-out figures on a public corpus, which a release always states (`dpbert.release.export`).
PUBLIC_EVALUATION = {
    "corpus": "public-eval.txt",
    "public": True,
    "step": 20,
    "included": True,
    "values": {"eval_mlm_accuracy": 0.1234, "eval_unigram_accuracy": 0.0627},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo")
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(CORPUS, vocab_size=200, min_frequency=1)
    tokenizer_dir = root / "tokenizer"
    BertTokenizerFast(tokenizer_object=wordpiece._tokenizer).save_pretrained(str(tokenizer_dir))
    dp = Guarantee.from_ledger(
        scope="pretraining", data="test corpus", ledger=_recipe_and_ledger()[1], randomness={"source": "os-csprng"}
    )
    nonprivate = Guarantee.non_private(scope="pretraining", data="test corpus")
    return {
        "tokenizer": tokenizer_dir,
        "dp": _write_release(root / "dp-bert", tokenizer_dir, seed=1, guarantee=dp, evaluation=PUBLIC_EVALUATION),
        "nonprivate": _write_release(root / "bert", tokenizer_dir, seed=2, guarantee=nonprivate),
    }


@pytest.fixture(scope="module")
def server(checkpoints: dict[str, Path]):
    # No port given: gradio binds the first free one from 7860 up, which cannot race with others.
    app = serve([str(checkpoints["dp"]), str(checkpoints["nonprivate"])], prevent_thread_lock=True)
    assert app.local_url.startswith("http://127.0.0.1:")
    yield app.local_url
    app.close()


def _direct_probs(folder: Path, text: str) -> tuple[np.ndarray, list[int]]:
    """Softmax of dpbert logits at the mask positions of the unpadded sentence."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = BertForMaskedLM.from_pretrained(str(folder))
    ids = tokenizer(text)["input_ids"]
    positions = [i for i, t in enumerate(ids) if t == tokenizer.mask_token_id]
    graphdef, params = split_params(model)
    # Full-length logits of the unpadded sentence: not the demo's padded, position-gathered path.
    logits = jax.jit(lambda p, x: mlm_logits(graphdef, p, x))(params, np.array(ids, np.int32))
    logits = np.asarray(logits, dtype=np.float64)[positions]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True), positions


def test_client_predictions_match_the_model_run_directly(server, checkpoints):
    result = Client(server, verbose=False).predict(SENTENCE, api_name="/fill_mask")
    assert list(result) == [str(checkpoints["dp"]), str(checkpoints["nonprivate"])]
    for folder in (checkpoints["dp"], checkpoints["nonprivate"]):
        entry = result[str(folder)]
        probs, positions = _direct_probs(folder, SENTENCE)
        assert len(entry["masks"]) == len(positions) == 2
        for mask, expected in zip(entry["masks"], probs, strict=True):
            assert len(mask) == 5
            top = np.argsort(-expected)[:5]
            assert [c["token_id"] for c in mask] == top.tolist()
            np.testing.assert_allclose([c["score"] for c in mask], expected[top], atol=1e-5)
        assert entry["filled"].startswith("the president spoke to")
    dp, nonprivate = result[str(checkpoints["dp"])], result[str(checkpoints["nonprivate"])]
    (check,) = verify_folder(checkpoints["dp"]).checks
    assert dp["privacy"]["private"] and 1.0 < check.recomputed_epsilon < 20.0
    assert dp["privacy"]["guarantees"] == [
        {"scope": "pretraining", "epsilon": check.recomputed_epsilon, "delta": DP_DELTA, "accountant": "pld"}
    ]
    assert dp["privacy"]["label"] == f"ε = {check.recomputed_epsilon:.3g}, δ = 1e-05 (pld, verified)"
    assert dp["privacy"]["vocabulary"] == ("Vocabulary: trained on the test corpus; not covered by the guarantee.")
    assert not nonprivate["privacy"]["private"]
    assert nonprivate["privacy"]["guarantees"][0]["epsilon"] is None
    assert nonprivate["privacy"]["label"] == "non-private (ε = ∞)"
    assert nonprivate["privacy"]["vocabulary"] is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("the president spoke to congress .", "No [MASK]"),
        (" ".join(["[MASK]"] * (MAX_MASKS + 1)), f"at most {MAX_MASKS}"),
        ("the budget [MASK] " + "the people of congress " * 10, "Text too long"),
        ("   ", "Type a sentence"),
    ],
)
def test_bad_input_gets_a_clear_error_through_the_api(server, text, message):
    with pytest.raises(AppError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Client(server, verbose=False).predict(text, api_name="/fill_mask")


def test_one_compile_per_length_bucket(checkpoints):
    model = FillMaskModel.load(str(checkpoints["dp"]))
    assert model.buckets == (16, 32)
    model.warm_up()
    model.predict("the [MASK] .")
    model.predict("the president spoke to [MASK] about the budget .")
    assert model.traced_lengths == [16]
    long = "the president spoke to [MASK] about the budget and the economy and the taxes again ."
    assert 16 < len(model.encode(long)[0]) <= 32
    model.predict(long)
    assert model.traced_lengths == [16, 32]
    with pytest.raises(FillMaskInputError, match="Too many masks: 6"):
        model.encode("[MASK] " * 6)


def test_the_tokenizers_own_mask_token_works_like_mask():
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<mask>"]
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(CORPUS, vocab_size=200, min_frequency=1, special_tokens=specials)
    tokenizer = BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, mask_token="<mask>")
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = FillMaskModel(
        name="mask-model",
        tokenizer=tokenizer,
        model=BertForMaskedLM(config, rngs=nnx.Rngs(0)),
        privacy=ModelPrivacy(checks=()),
    )
    ids, positions = model.encode("the [MASK] spoke to <mask> .")
    assert len(positions) == 2 and {ids[p] for p in positions} == {tokenizer.mask_token_id}
    with pytest.raises(FillMaskInputError, match=r"No \[MASK\] \(or <mask>\)"):
        model.encode("the president spoke .")


def test_length_buckets():
    assert length_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert length_buckets(100) == (16, 32, 64, 100)
    assert length_buckets(8) == (8,)
    with pytest.raises(ValueError, match="max_length"):
        length_buckets(2)


def test_privacy_comes_from_verified_metadata_only(checkpoints, tmp_path):
    # A plain Hugging Face folder (no privacy claim at all) is shown as non-private.
    plain = tmp_path / "plain"
    BertForMaskedLM.from_pretrained(str(checkpoints["nonprivate"])).save_pretrained(str(plain))
    assert verified_privacy(plain).label() == "non-private (ε = ∞, no privacy metadata)"
    # A release whose stated epsilon was edited does not load.
    forged = shutil.copytree(checkpoints["dp"], tmp_path / "forged")
    data = json.loads((forged / "privacy.json").read_text())
    data["guarantees"][0]["epsilon"] = 0.5
    (forged / "privacy.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not verify"):
        FillMaskModel.load(str(forged))


def test_launcher_script_and_cli_show_the_demo_flags():
    root = Path(__file__).resolve().parents[1]
    for command in (
        [sys.executable, str(root / "demo" / "app.py"), "--help"],
        [sys.executable, "-m", "dpbert.cli", "demo", "--help"],
    ):
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        assert "--port" in out and "--share" in out and "--host" in out


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make browser)")
def test_headless_chromium_submits_and_sees_predictions(server, checkpoints, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    from PIL import Image

    expected = Client(server, verbose=False).predict(SENTENCE, api_name="/fill_mask")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(server, wait_until="networkidle")
            page.locator("#sentence textarea").fill(SENTENCE)
            page.locator("#fill").click()
            tables = page.locator("table.dp-mask")
            tables.first.wait_for(timeout=30_000)
            assert tables.count() == 4  # two masks for each of two models
            for number, entry in enumerate(expected.values()):
                shown = page.locator(f"#predictions-{number}").inner_text()
                for mask in entry["masks"]:
                    for candidate in mask:
                        assert f"{candidate['token']}\t{candidate['score']:.1%}" in shown
            body = page.inner_text("body")
            assert "(pld, verified)" in body and "non-private (ε = ∞)" in body
            assert "As released: held-out MLM accuracy 12.3% (unigram baseline 6.3%) on public-eval.txt" in body
            assert "top answer" in page.locator("#examples-note").inner_text()  # how they were chosen
            shot = tmp_path / "demo.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    image = Image.open(shot).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50
    assert np.asarray(image).std() > 10


def test_offered_examples_are_those_the_dp_model_answers_by_context(checkpoints, tmp_path):
    """The judge is the private model; every offered sentence gets a top-1 other than that of the
    judge's average distribution over the candidates; the shifts are the total variation from that
    average, computed here from the model's own logits, in decreasing order; no better sentence is
    left out; a sentence too long for a model is never offered. A model that answers by its decoder
    bias whatever the context gets its sentences by shift alone, and the page says so."""
    from dpbert.demo.app import MAX_OFFERED, offered_examples

    dp_guarantee = Guarantee.from_ledger(
        scope="pretraining", data="test corpus", ledger=_recipe_and_ledger()[1], randomness={"source": "os-csprng"}
    )
    folder = _write_release(tmp_path / "dp-context", checkpoints["tokenizer"], seed=3, guarantee=dp_guarantee,
                            evaluation=PUBLIC_EVALUATION, bias_scale=0.0)  # fmt: skip
    nonprivate = FillMaskModel.load(str(checkpoints["nonprivate"]))
    dp = FillMaskModel.load(str(folder), name="dp")
    too_long = "the president " * 20 + "[MASK] ."
    offered = offered_examples([nonprivate, dp], [*CORPUS_SENTENCES, too_long])
    assert offered.judge == "dp" and offered.context_dependent and too_long not in offered.sentences
    assert 1 <= len(offered.sentences) <= MAX_OFFERED and "depends on the context" in offered.note()

    direct = np.stack([_direct_probs(folder, t)[0][0] for t in CORPUS_SENTENCES])  # unpadded, full logits
    average = direct.mean(axis=0)
    shift = dict(zip(CORPUS_SENTENCES, 0.5 * np.abs(direct - average).sum(axis=1), strict=True))
    moved = {t for t, p in zip(CORPUS_SENTENCES, direct, strict=True) if p.argmax() != average.argmax()}
    assert set(offered.sentences) <= moved and len(moved) < len(CORPUS_SENTENCES)  # a real choice was made
    np.testing.assert_allclose(offered.shifts, [shift[t] for t in offered.sentences], atol=1e-5)
    assert list(offered.shifts) == sorted(offered.shifts, reverse=True)
    assert all(shift[t] <= offered.shifts[-1] + 1e-6 for t in moved - set(offered.sentences))

    # The fixture's DP model answers by its random decoder bias: every sentence gets the same top-1.
    flat = FillMaskModel.load(str(checkpoints["dp"]), name="dp-flat")
    by_shift = offered_examples([flat], CORPUS_SENTENCES)
    assert not by_shift.context_dependent and len(by_shift.sentences) == MAX_OFFERED
    assert list(by_shift.shifts) == sorted(by_shift.shifts, reverse=True) and "whatever the context" in by_shift.note()

    # Defaults: the release recipe's sentence, then EXAMPLES; the page states the released figures.
    assert dp.sentences == ("congress passed the [MASK] after a long debate .",)
    assert set(offered_examples([dp, nonprivate]).sentences) <= {*dp.sentences, *EXAMPLES}
    assert dp.evaluation == "held-out MLM accuracy 12.3% (unigram baseline 6.3%) on public-eval.txt, step 20"
    assert nonprivate.evaluation is None and nonprivate.sentences == ()
