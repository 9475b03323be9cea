"""GLUE task specs, loaders and metrics (fixtures in each task's GLUE release layout)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from hf_classifier import hf_dev_accuracy

from dpbert.data import glue
from dpbert.data.glue_metrics import compute_metrics, predictions_from_logits

_MNLI_DEV_HEADER = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
    "sentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label"
)


def _mnli_row(i: int, premise: str, hypothesis: str, label: str, dev: bool) -> str:
    labels = [label] * (5 if dev else 1)
    return "\t".join([str(i), "31193", f"{i}n", "government", "( x )", "( y )", "(ROOT x)", "(ROOT y)",
                      premise, hypothesis, *labels, label])  # fmt: skip


# Each task: {file: text}. Rows are (premise-ish, hypothesis-ish, raw label) as the GLUE release writes them;
# the expected parse is in EXPECTED below. A stray quote character sits in several sentences on purpose.
def write_glue_root(root: Path) -> None:
    files: dict[str, dict[str, str]] = {
        "CoLA": {
            "train.tsv": 'gj04\t1\t\tOur friends won\'t buy this analysis, let alone the next one we propose.\n'
                         'gj04\t0\t*\tThe more you eat, the "less you want.\n'
                         'gj04\t1\t\tThey drank the pub dry.\n',
            "dev.tsv": "gj04\t0\t*\tThey caused him to become angry by making him.\n"
                       "gj04\t1\t\tThe sailors rode the breeze clear of the rocks.\n",
        },
        "SST-2": {
            "train.tsv": 'sentence\tlabel\nhide new secretions from the parental units \t0\n'
                         'contains no wit , only labored " gags \t0\nthat loves its characters \t1\n',
            "dev.tsv": "sentence\tlabel\nit 's a charming and often affecting journey . \t1\n"
                       "unflinchingly bleak and desperate \t0\n",
        },
        "MRPC": {
            "train.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                         '1\t702876\t702977\tAmrozi accused his brother "the witness" .\tReferring to him as "the witness" .\n'
                         "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought Dominick 's in 1995 .\n",
            "dev.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                       "1\t1355540\t1355592\tHe said the foodservice pie business.\tThe foodservice pie business.\n"
                       "0\t2029631\t2029565\tMagnarelli said Racicot hated the Iraqi regime.\tHe hated it.\n",
        },
        "STS-B": {
            "train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                         "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
                         "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a flute.\tA man is eating.\t0.500\n",
            "dev.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                       "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man with a hard hat is dancing.\tA man wearing a hard hat is dancing.\t5.000\n"
                       "1\tmain-captions\tMSRvid\t2012test\t0002\tnone\tnone\tA young child is riding a horse.\tA child is riding a horse.\t4.750\n",
        },
        "QQP": {
            "train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                         "133273\t213221\t213222\tHow is the life of a math student?\tWhich level of prepration is enough?\t0\n"
                         '402555\t536040\t536041\tHow do I control my "horny emotions?\tHow do you control your horniness?\t1\n',
            "dev.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                       "201359\t303345\t303346\tWhy are African-Americans so beautiful?\tWhy are hispanics so beautiful?\t0\n",
        },
        "MNLI": {
            "train.tsv": "\t".join(glue._MNLI_TRAIN_HEADER) + "\n"
                         + _mnli_row(0, "Conceptually cream skimming has two dimensions.", "Product and geography.", "neutral", False) + "\n"
                         + _mnli_row(1, "you know during the season", "You lose the things.", "entailment", False) + "\n"
                         + _mnli_row(2, "One of our number will carry out", "A member will ignore it.", "contradiction", False) + "\n",
            "dev_matched.tsv": _MNLI_DEV_HEADER + "\n"
                               + _mnli_row(0, "The new rights are nice enough", "Everyone really likes them.", "neutral", True) + "\n",
            "dev_mismatched.tsv": _MNLI_DEV_HEADER + "\n"
                                  + _mnli_row(0, "Your contribution helped", "Your contributions were of no help.", "contradiction", True) + "\n"
                                  + _mnli_row(1, "The answer is yes.", "It is yes.", "entailment", True) + "\n",
        },
        "QNLI": {
            "train.tsv": "index\tquestion\tsentence\tlabel\n"
                         "0\tWhen did the third Digimon series begin?\tUnlike the two seasons before it.\tnot_entailment\n"
                         "1\tWhich missile batteries often have individual launchers?\tThey often have launchers.\tentailment\n",
            "dev.tsv": "index\tquestion\tsentence\tlabel\n"
                       "0\tWhat came into force after the new constitution?\tThe law came into force.\tentailment\n",
        },
        "RTE": {
            "train.tsv": "index\tsentence1\tsentence2\tlabel\n"
                         "0\tNo Weapons of Mass Destruction Found in Iraq Yet.\tWeapons Found in Iraq.\tnot_entailment\n"
                         "1\tA place of sorrow, after Pope John Paul II died.\tPope Benedict XVI is the new leader.\tentailment\n",
            "dev.tsv": "index\tsentence1\tsentence2\tlabel\n"
                       "0\tDana Reeve, the widow, died.\tChristopher Reeve had an accident.\tnot_entailment\n",
        },
        "WNLI": {
            "train.tsv": "index\tsentence1\tsentence2\tlabel\n"
                         "0\tI stuck a pin through a carrot.\tThe carrot had a hole.\t1\n"
                         "1\tJohn couldn't see the stage with Billy in front of him.\tJohn is so short.\t0\n",
            "dev.tsv": "index\tsentence1\tsentence2\tlabel\n"
                       "0\tThe drain is clogged with hair.\tThe hair has to be cleaned out.\t1\n",
        },
    }  # fmt: skip
    for folder, contents in files.items():
        (root / folder).mkdir(parents=True)
        for name, text in contents.items():
            (root / folder / name).write_text(text, encoding="utf-8")


# task -> split -> (first text of first row, labels)
EXPECTED = {
    "cola": {"train": ("Our friends won't buy", [1, 0, 1]), "validation": ("They caused him", [0, 1])},
    "sst2": {"train": ("hide new secretions", [0, 0, 1]), "validation": ("it 's a charming", [1, 0])},
    "mrpc": {"train": ("Amrozi accused", [1, 0]), "validation": ("He said the foodservice", [1, 0])},
    "stsb": {"train": ("A plane is taking off.", [5.0, 0.5]), "validation": ("A man with a hard hat", [5.0, 4.75])},
    "qqp": {"train": ("How is the life", [0, 1]), "validation": ("Why are African", [0])},
    "mnli": {
        "train": ("Conceptually cream", [1, 0, 2]),
        "validation_matched": ("The new rights", [1]),
        "validation_mismatched": ("Your contribution", [2, 0]),
    },
    "qnli": {"train": ("When did the third", [1, 0]), "validation": ("What came into force", [0])},
    "rte": {"train": ("No Weapons of Mass", [1, 0]), "validation": ("Dana Reeve", [1])},
    "wnli": {"train": ("I stuck a pin", [1, 0]), "validation": ("The drain is clogged", [1])},
}


@pytest.fixture()
def glue_root(tmp_path: Path) -> Path:
    write_glue_root(tmp_path / "glue")
    return tmp_path / "glue"


def test_all_nine_tasks_parse_from_glue_layout(glue_root: Path) -> None:
    found = glue.find_tasks(glue_root)
    assert list(found) == ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"]
    for name, folder in found.items():
        task = glue.get_task(name)
        splits = glue.load_task(task, folder)
        assert set(splits) == set(EXPECTED[name]), name
        for split_name, (first_text, labels) in EXPECTED[name].items():
            split = splits[split_name]
            assert split.texts[0][0].startswith(first_text), (name, split_name)
            np.testing.assert_allclose(split.labels, labels, err_msg=f"{name}/{split_name}")
            assert split.labels.dtype == (np.float32 if name == "stsb" else np.int64)
            assert len(split.texts) == (1 if name in ("cola", "sst2") else 2)


def test_quotes_are_ordinary_characters(glue_root: Path) -> None:
    cola = glue.load_tsv(glue.get_task("cola"), glue_root / "CoLA" / "train.tsv", "train")
    assert cola.texts[0][1] == 'The more you eat, the "less you want.'
    mrpc = glue.load_tsv(glue.get_task("mrpc"), glue_root / "MRPC" / "train.tsv", "train")
    assert mrpc.texts[1][0] == 'Referring to him as "the witness" .'
    mnli = glue.load_task(glue.get_task("mnli"), glue_root / "MNLI")
    assert mnli["train"].texts[1][0] == "Product and geography."


def test_task_specs_match_nyu_glue_and_evaluate() -> None:
    assert glue.get_task("mnli").label_names == ("entailment", "neutral", "contradiction")
    assert glue.get_task("wnli").label_names == ("not_entailment", "entailment")
    assert glue.get_task("rte").label_names == ("entailment", "not_entailment")
    assert glue.get_task("STS-B").is_regression and glue.get_task("stsb").num_labels == 1
    assert glue.get_task("SST-2").name == "sst2"
    assert {n: t.metric_names for n, t in glue.GLUE_TASKS.items()} == {
        "cola": ("matthews_correlation",), "sst2": ("accuracy",), "mrpc": ("accuracy", "f1"),
        "qqp": ("accuracy", "f1"), "stsb": ("pearson", "spearmanr"), "mnli": ("accuracy",),
        "qnli": ("accuracy",), "rte": ("accuracy",), "wnli": ("accuracy",),
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown GLUE task 'glue'"):
        glue.get_task("glue")


def test_bad_label_names_file_and_row(glue_root: Path) -> None:
    path = glue_root / "RTE" / "dev.tsv"
    path.write_text(path.read_text() + "1\tA.\tB.\tentailed\n")
    with pytest.raises(ValueError, match=r"RTE/dev.tsv: line 3: label 'entailed' is not a rte label"):
        glue.load_task(glue.get_task("rte"), glue_root / "RTE")
    path = glue_root / "STS-B" / "train.tsv"
    path.write_text(path.read_text() + "2\tg\tf\ty\to\ts\ts\tA.\tB.\t5.5\n")
    with pytest.raises(ValueError, match=r"STS-B/train.tsv: line 4: label '5.5' is not an stsb score"):
        glue.load_tsv(glue.get_task("stsb"), path, "train")
    path = glue_root / "SST-2" / "dev.tsv"
    path.write_text(path.read_text() + "fine\t2\n")
    with pytest.raises(ValueError, match=r"SST-2/dev.tsv: line 4: label '2'"):
        glue.load_tsv(glue.get_task("sst2"), path, "validation")


def test_missing_split_or_column_names_the_file(glue_root: Path) -> None:
    (glue_root / "MNLI" / "dev_mismatched.tsv").unlink()
    with pytest.raises(FileNotFoundError, match=r"MNLI/dev_mismatched.tsv: missing mnli split 'validation_mismatched'"):
        glue.load_task(glue.get_task("mnli"), glue_root / "MNLI")
    qnli_dev = glue_root / "QNLI" / "dev.tsv"
    qnli_dev.write_text("index\tquestion\tlabel\n0\tWhy?\tentailment\n")
    with pytest.raises(ValueError, match=r"QNLI/dev.tsv: header has no column 'sentence'"):
        glue.load_task(glue.get_task("qnli"), glue_root / "QNLI")
    cola_train = glue_root / "CoLA" / "train.tsv"
    cola_train.write_text("gj04\t1\tonly three fields\n")
    with pytest.raises(ValueError, match=r"CoLA/train.tsv: line 1: 3 tab-separated fields"):
        glue.load_tsv(glue.get_task("cola"), cola_train, "train")
    (glue_root / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no wnli training data"):
        glue.detect_format(glue.get_task("wnli"), glue_root / "empty")


def test_csv_jsonl_parquet_with_nyu_column_names(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = glue.get_task("mnli")
    rows = [
        {"premise": "A man sleeps.", "hypothesis": "A man rests.", "label": 0, "idx": 0},
        {"premise": 'A dog, "barking".', "hypothesis": "A cat.", "label": "contradiction", "idx": 1},
    ]
    csv_dir, jsonl_dir, pq_dir = tmp_path / "csv", tmp_path / "jsonl", tmp_path / "parquet"
    for d in (csv_dir, jsonl_dir, pq_dir):
        d.mkdir()
    for split in task.splits:
        import csv

        with (csv_dir / f"{split}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (jsonl_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        ints = [{**r, "label": [0, 2][i]} for i, r in enumerate(rows)]
        pq.write_table(pa.Table.from_pylist(ints), pq_dir / f"{split}-00000-of-00001.parquet")
    for folder, fmt in ((csv_dir, "csv"), (jsonl_dir, "jsonl"), (pq_dir, "parquet")):
        assert glue.detect_format(task, folder) == fmt
        splits = glue.load_task(task, folder)
        assert set(splits) == {"train", "validation_matched", "validation_mismatched"}
        assert splits["validation_mismatched"].texts == (
            ("A man sleeps.", 'A dog, "barking".'),
            ("A man rests.", "A cat."),
        )
        assert splits["train"].labels.tolist() == [0, 2]
    (jsonl_dir / "train.jsonl").write_text(json.dumps({"premise": "x", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=r"jsonl/train.jsonl: row 1: no column 'hypothesis'"):
        glue.load_split(task, jsonl_dir, "train")
    (jsonl_dir / "train.jsonl").write_text(json.dumps({"premise": "x", "hypothesis": "y", "label": -1}) + "\n")
    with pytest.raises(ValueError, match=r"jsonl/train.jsonl: row 1: label -1 is not a mnli label"):
        glue.load_split(task, jsonl_dir, "train")


def test_metrics_against_hand_computed_values() -> None:
    preds, refs = np.array([1, 0, 1, 1]), np.array([1, 0, 0, 1])
    # TP=2 TN=1 FP=1 FN=0: accuracy 3/4; F1 = 2PR/(P+R) with P=2/3, R=1 -> 0.8;
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = 2 / sqrt(3*2*2*1).
    assert compute_metrics(glue.get_task("mrpc"), preds, refs) == pytest.approx({"accuracy": 0.75, "f1": 0.8})
    assert compute_metrics(glue.get_task("cola"), preds, refs) == pytest.approx(
        {"matthews_correlation": 2 / np.sqrt(12)}
    )
    assert compute_metrics(glue.get_task("rte"), preds, refs) == pytest.approx({"accuracy": 0.75})
    # Pearson of [1,2,3,4] vs [1,2,3,5]: sum(dx*dy)=6.5, sum dx^2=5, sum dy^2=8.75 -> 6.5/sqrt(43.75).
    stsb = glue.get_task("stsb")
    got = compute_metrics(stsb, np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 2.0, 3.0, 5.0]))
    assert got == pytest.approx({"pearson": 6.5 / np.sqrt(43.75), "spearmanr": 1.0})
    # Spearman of ranks [1,2,3,4] vs [2,1,4,3]: sum d^2 = 4 -> 1 - 6*4/(4*(16-1)) = 0.6.
    got = compute_metrics(stsb, np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 1.0, 4.0, 3.0]))
    assert got["spearmanr"] == pytest.approx(0.6)
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert predictions_from_logits(glue.get_task("mnli"), logits).tolist() == [1, 0]
    assert predictions_from_logits(stsb, np.array([[4.5], [1.0]])).tolist() == [4.5, 1.0]
    with pytest.raises(ValueError, match="predictions"):
        compute_metrics(glue.get_task("rte"), np.array([1, 0]), np.array([1]))


# ----------------------------------------------------------------------------- fine-tuning


def _synthetic_sst2(folder: Path, n_train: int, n_dev: int, seed: int = 0) -> None:
    """A separable task in SST-2's layout: label 1 sentences use one word set, label 0 another."""
    rng = np.random.default_rng(seed)
    pos, neg, filler = ["alpha", "beta", "gamma", "delta"], ["omega", "psi", "chi", "phi"], ["the", "a", "cat", "sat"]
    folder.mkdir(parents=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        lines = ["sentence\tlabel"]
        for label in rng.integers(0, 2, size=n):
            words = list(rng.choice(pos if label else neg, size=rng.integers(2, 5))) + list(
                rng.choice(filler, size=rng.integers(0, 3))
            )
            rng.shuffle(words)
            lines.append(f"{' '.join(words)}\t{label}")
        (folder / name).write_text("\n".join(lines) + "\n")


def _tiny_model(folder: Path) -> None:
    """A 1-layer random BERT saved like a dpbert export, with a WordPiece tokenizer trained here.

    initializer_range 0.5 makes the random encoder's [CLS] features depend on the input (with
    BERT's 0.02 the untrained attention passes almost nothing), standing in for pretraining so
    that bias-only training has features to work with."""
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, PreTrainedTokenizerFast

    from dpbert.model import BertForMaskedLM

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = "alpha beta gamma delta omega psi chi phi the a cat sat"
    tok.train_from_iterator([words] * 10, trainers.WordPieceTrainer(vocab_size=100, special_tokens=special))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tok.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.5,
    )  # fmt: skip
    BertForMaskedLM(config, rngs=nnx.Rngs(0)).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


# Private pretraining guarantee of the source release. RDP keeps the (re)computations cheap: the PLD
# accountant is tested in test_privacy_accounting.py, here only its bookkeeping matters.
_PRETRAINING = {"steps": 1000, "expected_batch_size": 256, "noise_multiplier": 1.0, "dataset_size": 100_000}
# The source release's recipe (the packaged bert-base-uncased vocabulary, a fixed noise multiplier):
# `dpbert verify` rebuilds the pretraining ledger from it.
_PRETRAINING_RECIPE = {
    "model": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
    "data": {"corpus": "synthetic", "seq_len": 32},
    "schedule": [{"steps": _PRETRAINING["steps"], "expected_batch_size": _PRETRAINING["expected_batch_size"]}],
    "privacy": {"enabled": True, "clip_norm": 1.0, "delta": 1.0e-6, "accountant": "rdp",
                "noise_multiplier": _PRETRAINING["noise_multiplier"]},
    "train": {"microbatch_size": 16},
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SST-2-like data, a plain HF folder (`model`) and a dpbert release of it (`pretrained_dp`)."""
    import yaml

    from dpbert.config.plan import plan_recipe
    from dpbert.config.recipe import load_recipe_dict, recipe_to_dict
    from dpbert.release import CardInfo, Guarantee, ReleaseMetadata, write_release

    root = tmp_path_factory.mktemp("finetune")
    _synthetic_sst2(root / "SST-2", n_train=800, n_dev=200)
    _tiny_model(root / "model")
    # As the trainer writes it: the resolved recipe, and the ledger `plan_recipe` builds from it.
    recipe = load_recipe_dict(_PRETRAINING_RECIPE)
    ledger = plan_recipe(recipe, _PRETRAINING["dataset_size"]).ledger
    meta = ReleaseMetadata(
        guarantees=(Guarantee.from_ledger(scope="pretraining", data="synthetic corpus", ledger=ledger.to_dict(),
                                          randomness={"source": "os-csprng"}),),
        vocabulary_origin="public word list", vocabulary_covered=True,
        vocabulary_learned_from_private_data=False, vocabulary_kind="packaged",
        recipe_name="recipe.yaml", recipe_content=yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False),
    )  # fmt: skip
    info = CardInfo(model_name="tiny-dp", architecture="tiny BERT", reproduce_command="dpbert pretrain tiny.yaml")
    write_release(root / "pretrained_dp", model=root / "model", meta=meta, info=info)
    return root


@pytest.fixture(scope="module")
def nonprivate_run(tiny: Path) -> tuple[Path, dict]:
    """Non-private fine-tuning of the plain HF folder (no privacy metadata)."""
    from dpbert.config.finetune import load_config
    from dpbert.train.finetune import finetune

    config = load_config(None, ["max_seq_len=12", "nonprivate.learning_rate=1e-3", "nonprivate.epochs=1"])
    out = tiny / "out_np"
    result = finetune(
        task="sst2", model=str(tiny / "model"), output_dir=out, data=tiny / "SST-2", config=config, log=lambda _: None
    )
    return out, result


@pytest.fixture(scope="module")
def dp_run(tiny: Path) -> tuple[Path, str]:
    """DP fine-tuning from the CLI, of the release with a private pretraining guarantee; (OUT, stdout)."""
    from dpbert import cli

    out = tiny / "out_dp"
    argv = ["finetune", "--task", "sst2", "--model", str(tiny / "pretrained_dp"), "--data-dir", str(tiny / "SST-2"),
            "--output-dir", str(out), "--dp", "--epsilon", "8",
            "--set", "max_seq_len=12", "--set", "private.batch_size=200", "--set", "private.learning_rate=1e-2",
            "--set", "private.epochs=4", "--set", "privacy.accountant=rdp"]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(argv) == 0
    return out, printed.getvalue()


def test_recipe_is_the_default_config_and_overrides_name_fields() -> None:
    from dpbert.config.finetune import FinetuneConfig, load_config

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "glue_finetune.yaml"
    assert load_config(recipe) == FinetuneConfig()
    config = load_config(recipe, ["dp=true", "private.learning_rate=1e-3", "privacy.epsilon=3"])
    assert config.optim.learning_rate == 1e-3 and config.optim.trainable == "bias" and config.privacy.epsilon == 3.0
    with pytest.raises(ValueError, match=r"'private.lr': unknown field.* \(in .*glue_finetune.yaml\)"):
        load_config(recipe, ["private.lr=1"])
    with pytest.raises(
        ValueError, match=r"'nonprivate.trainable': expected one of 'all', 'bias', 'lora', 'head', got 'adapters'"
    ):
        load_config(None, ["nonprivate.trainable=adapters"])


def test_nonprivate_finetune_learns_and_writes_outputs(nonprivate_run: tuple[Path, dict]) -> None:
    out, result = nonprivate_run
    assert result["dev"]["validation"]["accuracy"] > 0.75  # chance is 0.5
    assert result["n_train"] == 800 and result["steps"] == 25  # ceil(800 / 32)
    assert (
        result["trained"]["subset"] == "all"
        and result["trained"]["parameters"] == result["trained"]["total_parameters"]
    )
    assert result["privacy"] is None
    assert json.loads((out / "metrics.json").read_text()) == result
    evals = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert [e["split"] for e in evals] == ["validation"] and evals[-1]["accuracy"] == result["dev"]["validation"][
        "accuracy"
    ]
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved["id2label"] == {"0": "negative", "1": "positive"}
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()


def test_nonprivate_release_claims_no_privacy_for_either_dataset(nonprivate_run: tuple[Path, dict]) -> None:
    from dpbert.release import verify_folder
    from dpbert.release.card import read_front_matter

    out, result = nonprivate_run
    check = verify_folder(out / "model")
    assert check.ok, check.summary()
    assert check.status == "non-private"
    assert [(c.scope, c.recomputed_epsilon) for c in check.checks] == [
        ("pretraining", float("inf")), ("fine-tuning (sst2)", float("inf"))
    ]  # fmt: skip
    privacy = json.loads((out / "model" / "privacy.json").read_text())
    assert privacy["private"] is False and [g["epsilon"] for g in privacy["guarantees"]] == ["inf", "inf"]
    assert "no dpbert privacy metadata" in privacy["guarantees"][0]["data"]  # unknown, said plainly
    assert result["release"]["private"] is False and len(result["release"]["guarantees"]) == 2
    matter = read_front_matter(out / "model" / "README.md")
    assert matter["pipeline_tag"] == "text-classification" and "non-private" in matter["tags"]
    assert not {"differential-privacy", "dp-sgd"} & set(matter["tags"])
    assert "NOT differentially private" in (out / "model" / "README.md").read_text()


def test_dp_finetune_from_the_cli_learns_and_spends_the_asked_epsilon(dp_run: tuple[Path, str]) -> None:
    from dpbert.privacy.accounting import PrivacyLedger

    out, printed = dp_run
    result = json.loads((out / "metrics.json").read_text())
    assert result["dev"]["validation"]["accuracy"] > 0.75  # chance is 0.5
    privacy = result["privacy"]
    n = 800
    assert privacy["delta"] == pytest.approx(1 / n**1.1) and privacy["delta_rule"] == "1/N^1.1"
    assert privacy["expected_batch_size"] == 200 and privacy["steps"] == 16  # 4 epochs * 800 / 200
    assert privacy["accountant"] == "rdp"
    assert 8 * 0.99 <= privacy["epsilon"] <= 8.0  # calibrated to spend the budget, never more
    ledger = PrivacyLedger.from_dict(json.loads((out / "privacy.json").read_text()))
    assert ledger.dataset_size == n and ledger.stages[0].noise_multiplier == privacy["noise_multiplier"]
    assert ledger.epsilon() == pytest.approx(privacy["epsilon"], rel=1e-6)
    trained = result["trained"]
    assert trained["subset"] == "bias" and 0 < trained["parameters"] < trained["total_parameters"] / 5
    assert "noise_multiplier=" in printed and "1/N^1.1" in printed and "sst2" in printed.splitlines()[-1]


def test_dp_release_states_both_guarantees_each_for_its_own_data(
    dp_run: tuple[Path, str], tiny: Path, tmp_path: Path
) -> None:
    import shutil

    from dpbert import cli
    from dpbert.release import verify_folder
    from dpbert.release.card import read_front_matter

    out, _ = dp_run
    model_dir = out / "model"
    result = json.loads((out / "metrics.json").read_text())
    source = json.loads((tiny / "pretrained_dp" / "privacy.json").read_text())["guarantees"][0]
    task_ledger = json.loads((out / "privacy.json").read_text())
    privacy = json.loads((model_dir / "privacy.json").read_text())
    pretraining, task = privacy["guarantees"]
    assert privacy["private"] is True
    assert (pretraining["scope"], pretraining["data"], pretraining["ledger"]) == (
        "pretraining",
        "synthetic corpus",
        source["ledger"],
    )
    assert (
        pretraining["epsilon"] == source["epsilon"]
        and pretraining["ledger"]["dataset_size"] == _PRETRAINING["dataset_size"]
    )
    assert (task["scope"], task["data"]) == ("fine-tuning (sst2)", "GLUE SST-2 training set (800 examples)")
    assert task["ledger"] == task_ledger and task["epsilon"] == pytest.approx(result["privacy"]["epsilon"], rel=1e-9)
    assert privacy["vocabulary"] == {
        "origin": "public word list",
        "covered": True,
        "learned_from_private_data": False,
        "source": "packaged",
    }  # inherited from the source

    check = verify_folder(model_dir)  # each epsilon recomputed from its own ledger
    assert check.ok and check.status == "private", check.summary()
    assert {c.scope: c.recomputed_epsilon for c in check.checks} == pytest.approx(
        {"pretraining": source["epsilon"], "fine-tuning (sst2)": result["privacy"]["epsilon"]}, rel=1e-3
    )
    assert cli.main(["verify", str(model_dir)]) == 0

    matter = read_front_matter(model_dir / "README.md")
    assert matter["pipeline_tag"] == "text-classification" and {"differential-privacy", "dp-sgd"} <= set(matter["tags"])
    (entry,) = matter["model-index"][0]["results"]
    assert entry["task"]["type"] == "text-classification" and entry["dataset"]["config"] == "sst2"
    assert entry["metrics"] == [
        {"type": "accuracy", "value": result["dev"]["validation"]["accuracy"], "name": "validation accuracy"}
    ]

    # Editing the task epsilon anywhere is caught; the pretraining one is untouched.
    edited = shutil.copytree(model_dir, tmp_path / "edited")
    card = (edited / "README.md").read_text()
    stated = matter["differential_privacy"]["guarantees"][1]["epsilon"]
    (edited / "README.md").write_text(card.replace(f"epsilon: {stated}", "epsilon: 1.0", 1))
    problems = verify_folder(edited).problems
    assert len(problems) == 1 and "epsilon for 'fine-tuning (sst2)'" in problems[0], problems
    edited_json = {**privacy, "guarantees": [pretraining, {**task, "epsilon": 1.0}]}
    (edited / "README.md").write_text(card)
    (edited / "privacy.json").write_text(json.dumps(edited_json))
    assert any("fine-tuning (sst2)" in p for p in verify_folder(edited).problems)
    assert cli.main(["verify", str(edited)]) == 1

    # transformers (PyTorch) loads the classifier with the task's labels and reproduces its dev accuracy.
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    assert config.num_labels == 2 and config.id2label == {0: "negative", 1: "positive"}
    assert hf_dev_accuracy(model_dir, tiny / "SST-2") == pytest.approx(
        result["dev"]["validation"]["accuracy"], abs=0.011
    )
