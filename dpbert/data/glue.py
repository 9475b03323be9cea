"""GLUE tasks: specs, loaders (GLUE TSV folders, CSV, JSON lines, parquet, the Hub) and encoding.

The nine tasks are frozen `GlueTask` specs in `GLUE_TASKS`, keyed by the `nyu-mll/glue` config
name: input columns, label names in ClassLabel order (`None` for STS-B regression), `evaluate`'s
metric names, and the original release's file layout (docs/INTERNALS.md, "dpbert.data.glue").

Guarantees: labels are accepted as the ClassLabel index or the label name; anything else (the
Hub's -1 test labels, a typo, an STS-B score outside [0, 5]) is a `ValueError` naming the file and
row. TSVs are read with `csv.QUOTE_NONE`, as the GLUE release and `datasets`' GLUE script do.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HUB_DATASET_ID = "nyu-mll/glue"
FILE_FORMATS = ("tsv", "csv", "jsonl", "parquet")


@dataclass(frozen=True, kw_only=True)
class GlueTask:
    """One GLUE task.

    `text_columns` are `nyu-mll/glue` column names; `tsv_text_columns` / `tsv_label_column` are
    header names in the GLUE release TSVs (or 0-based positions where `tsv_header` is None).
    `eval_splits` are `nyu-mll/glue` split names; `tsv_files` maps every split to its file.
    """

    name: str
    glue_dir: str
    text_columns: tuple[str, ...]
    label_names: tuple[str, ...] | None
    metric_names: tuple[str, ...]
    eval_splits: tuple[str, ...]
    tsv_files: tuple[tuple[str, str], ...]
    tsv_header: tuple[str, ...] | None
    tsv_text_columns: tuple[str | int, ...]
    tsv_label_column: str | int

    def __post_init__(self) -> None:
        if len(self.text_columns) not in (1, 2):
            raise ValueError(f"GlueTask.text_columns: expected 1 or 2 columns, got {self.text_columns!r}")
        if len(self.tsv_text_columns) != len(self.text_columns):
            raise ValueError("GlueTask.tsv_text_columns: must match text_columns in length")
        if self.label_names is not None and len(self.label_names) < 2:
            raise ValueError(f"GlueTask.label_names: expected >= 2 names or None, got {self.label_names!r}")
        files = dict(self.tsv_files)
        missing = [s for s in ("train", *self.eval_splits) if s not in files]
        if missing:
            raise ValueError(f"GlueTask.tsv_files: no file for splits {missing}")
        if self.tsv_header is None:
            if not all(isinstance(c, int) for c in (*self.tsv_text_columns, self.tsv_label_column)):
                raise ValueError("GlueTask.tsv_text_columns: positions (int) are required without a header")
        elif not all(c in self.tsv_header for c in (*self.tsv_text_columns, self.tsv_label_column)):
            raise ValueError("GlueTask.tsv_text_columns: every column must be named in tsv_header")

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        """Width of the classifier head (1 for regression)."""
        return 1 if self.label_names is None else len(self.label_names)

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *self.eval_splits)

    def tsv_file(self, split: str) -> str:
        files = dict(self.tsv_files)
        if split not in files:
            raise ValueError(f"task {self.name}: unknown split {split!r}; expected one of {sorted(files)}")
        return files[split]


_MNLI_TRAIN_HEADER = (
    "index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
    "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label",
)  # fmt: skip
_DEV = (("train", "train.tsv"), ("validation", "dev.tsv"))

GLUE_TASKS: Mapping[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask(
            name="cola", glue_dir="CoLA", text_columns=("sentence",),
            label_names=("unacceptable", "acceptable"), metric_names=("matthews_correlation",),
            eval_splits=("validation",), tsv_files=_DEV,
            # train/dev: source code, label, original annotation ('*' or empty), sentence; no header.
            tsv_header=None, tsv_text_columns=(3,), tsv_label_column=1,
        ),
        GlueTask(
            name="sst2", glue_dir="SST-2", text_columns=("sentence",),
            label_names=("negative", "positive"), metric_names=("accuracy",),
            eval_splits=("validation",), tsv_files=_DEV,
            tsv_header=("sentence", "label"), tsv_text_columns=("sentence",), tsv_label_column="label",
        ),
        GlueTask(
            name="mrpc", glue_dir="MRPC", text_columns=("sentence1", "sentence2"),
            label_names=("not_equivalent", "equivalent"), metric_names=("accuracy", "f1"),
            eval_splits=("validation",), tsv_files=_DEV,
            tsv_header=("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"),
            tsv_text_columns=("#1 String", "#2 String"), tsv_label_column="Quality",
        ),
        GlueTask(
            name="qqp", glue_dir="QQP", text_columns=("question1", "question2"),
            label_names=("not_duplicate", "duplicate"), metric_names=("accuracy", "f1"),
            eval_splits=("validation",), tsv_files=_DEV,
            tsv_header=("id", "qid1", "qid2", "question1", "question2", "is_duplicate"),
            tsv_text_columns=("question1", "question2"), tsv_label_column="is_duplicate",
        ),
        GlueTask(
            name="stsb", glue_dir="STS-B", text_columns=("sentence1", "sentence2"),
            label_names=None, metric_names=("pearson", "spearmanr"),
            eval_splits=("validation",), tsv_files=_DEV,
            tsv_header=(
                "index", "genre", "filename", "year", "old_index", "source1", "source2",
                "sentence1", "sentence2", "score",
            ),
            tsv_text_columns=("sentence1", "sentence2"), tsv_label_column="score",
        ),
        GlueTask(
            name="mnli", glue_dir="MNLI", text_columns=("premise", "hypothesis"),
            label_names=("entailment", "neutral", "contradiction"), metric_names=("accuracy",),
            eval_splits=("validation_matched", "validation_mismatched"),
            tsv_files=(
                ("train", "train.tsv"),
                ("validation_matched", "dev_matched.tsv"),
                ("validation_mismatched", "dev_mismatched.tsv"),
            ),
            # dev files carry label1..label5 before gold_label; columns are found by header name.
            tsv_header=_MNLI_TRAIN_HEADER, tsv_text_columns=("sentence1", "sentence2"),
            tsv_label_column="gold_label",
        ),
        GlueTask(
            name="qnli", glue_dir="QNLI", text_columns=("question", "sentence"),
            label_names=("entailment", "not_entailment"), metric_names=("accuracy",),
            eval_splits=("validation",), tsv_files=_DEV,
            tsv_header=("index", "question", "sentence", "label"),
            tsv_text_columns=("question", "sentence"), tsv_label_column="label",
        ),
        GlueTask(
            name="rte", glue_dir="RTE", text_columns=("sentence1", "sentence2"),
            label_names=("entailment", "not_entailment"), metric_names=("accuracy",),
            eval_splits=("validation",), tsv_files=_DEV,
            tsv_header=("index", "sentence1", "sentence2", "label"),
            tsv_text_columns=("sentence1", "sentence2"), tsv_label_column="label",
        ),
        GlueTask(
            name="wnli", glue_dir="WNLI", text_columns=("sentence1", "sentence2"),
            label_names=("not_entailment", "entailment"), metric_names=("accuracy",),
            eval_splits=("validation",), tsv_files=_DEV,
            tsv_header=("index", "sentence1", "sentence2", "label"),
            tsv_text_columns=("sentence1", "sentence2"), tsv_label_column="label",
        ),
    )
}  # fmt: skip


def get_task(name: str) -> GlueTask:
    """The task spec for a `nyu-mll/glue` config name or a GLUE folder name (`SST-2`, `sst-2`)."""
    key = name.strip().lower().replace("-", "")
    if key in GLUE_TASKS:
        return GLUE_TASKS[key]
    raise ValueError(f"unknown GLUE task {name!r}; expected one of {', '.join(GLUE_TASKS)}")


@dataclass(frozen=True, kw_only=True)
class GlueSplit:
    """One split of one task, parsed and validated.

    `texts` holds one tuple of strings per input column; `labels` is int64 class ids in the
    `nyu-mll/glue` order, or float32 scores for STS-B. `source` names the file(s) or Hub id.
    """

    task: GlueTask
    split: str
    texts: tuple[tuple[str, ...], ...]
    labels: np.ndarray
    source: str

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.task.text_columns):
            raise ValueError(f"GlueSplit.texts: expected {len(self.task.text_columns)} columns, got {len(self.texts)}")
        if any(len(col) != len(self.labels) for col in self.texts):
            raise ValueError("GlueSplit.texts: every column must have one entry per label")

    def __len__(self) -> int:
        return len(self.labels)


def parse_label(task: GlueTask, value: Any, *, where: str) -> int | float:
    """A raw label -> class id (int) or STS-B score (float); `where` names file and row in errors."""
    if task.label_names is None:
        try:
            score = float(value)
        except (TypeError, ValueError):
            score = math.nan
        if not 0.0 <= score <= 5.0:  # also rejects NaN
            raise ValueError(f"{where}: label {value!r} is not an {task.name} score in [0, 5]")
        return score
    text = str(value).strip()
    if text in task.label_names:
        return task.label_names.index(text)
    if isinstance(value, (int, np.integer)) or re.fullmatch(r"\d+", text):
        index = int(text)
        if 0 <= index < len(task.label_names):
            return index
    expected = ", ".join(f"{i}/{n}" for i, n in enumerate(task.label_names))
    raise ValueError(f"{where}: label {value!r} is not a {task.name} label (expected one of {expected})")


def _make_split(task: GlueTask, split: str, rows: Iterable[tuple[Sequence[str], Any, str]], source: str) -> GlueSplit:
    columns: list[list[str]] = [[] for _ in task.text_columns]
    labels: list[int | float] = []
    for texts, label, where in rows:
        for col, text in zip(columns, texts, strict=True):
            col.append(text)
        labels.append(parse_label(task, label, where=where))
    if not labels:
        raise ValueError(f"{source}: split {split!r} of task {task.name} has no examples")
    dtype = np.float32 if task.is_regression else np.int64
    return GlueSplit(
        task=task, split=split, texts=tuple(tuple(c) for c in columns), labels=np.asarray(labels, dtype), source=source
    )


def load_tsv(task: GlueTask, path: str | os.PathLike[str], split: str) -> GlueSplit:
    """Read one split from a file in the original GLUE TSV layout of `task`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing {task.name} split {split!r} (GLUE layout expects {path.name})")
    # utf-8-sig: MRPC's files start with a byte-order mark before "Quality".
    with path.open(encoding="utf-8-sig", newline="") as f:
        lines = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if task.tsv_header is None:
        first_row = 1
        positions = [int(c) for c in (*task.tsv_text_columns, task.tsv_label_column)]
    else:
        if not lines:
            raise ValueError(f"{path}: empty file; expected a header row {chr(9).join(task.tsv_header)!r}")
        header = [h.strip() for h in lines[0]]
        absent = [c for c in (*task.tsv_text_columns, task.tsv_label_column) if c not in header]
        if absent:
            raise ValueError(f"{path}: header has no column {absent[0]!r} (found {header}); not a {task.name} GLUE TSV")
        first_row = 2
        positions = [header.index(str(c)) for c in (*task.tsv_text_columns, task.tsv_label_column)]
        lines = lines[1:]
    needed = max(positions) + 1

    def rows() -> Iterable[tuple[Sequence[str], Any, str]]:
        for line_no, fields in enumerate(lines, start=first_row):
            if not fields:
                continue  # trailing blank line
            where = f"{path}: line {line_no}"
            if len(fields) < needed:
                raise ValueError(f"{where}: {len(fields)} tab-separated fields, {task.name} needs at least {needed}")
            yield [fields[p] for p in positions[:-1]], fields[positions[-1]], where

    return _make_split(task, split, rows(), str(path))


def _records_from_file(path: Path) -> list[Mapping[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(encoding="utf-8-sig", newline="") as f:
            return list(csv.DictReader(f))
    if suffix in (".jsonl", ".json"):
        records = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}: line {line_no}: not JSON ({err.msg})") from err
        return records
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # deferred: 86 ms at import, paid only for .parquet files

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {suffix!r}; expected one of .csv, .jsonl, .parquet")


def load_records(task: GlueTask, paths: Sequence[str | os.PathLike[str]], split: str) -> GlueSplit:
    """Read one split from CSV / JSON-lines / parquet files with the `nyu-mll/glue` column names
    (e.g. `premise`, `hypothesis`, `label`); several files (shards) are concatenated in order."""
    if not paths:
        raise FileNotFoundError(f"no files for {task.name} split {split!r}")
    wanted = (*task.text_columns, "label")

    def rows() -> Iterable[tuple[Sequence[str], Any, str]]:
        for raw in paths:
            path = Path(raw)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing {task.name} split {split!r}")
            records = _records_from_file(path)
            for row_no, record in enumerate(records, start=1):
                where = f"{path}: row {row_no}"
                absent = [c for c in wanted if c not in record]
                if absent:
                    raise ValueError(
                        f"{where}: no column {absent[0]!r} (found {sorted(record)}); {task.name} needs {list(wanted)}"
                    )
                yield [str(record[c]) for c in task.text_columns], record["label"], where

    return _make_split(task, split, rows(), ", ".join(str(p) for p in paths))


def load_hub(task: GlueTask, split: str, *, dataset_id: str = HUB_DATASET_ID) -> GlueSplit:
    """Read one split through `datasets.load_dataset(dataset_id, task.name)` (needs the Hub or its cache)."""
    import datasets  # deferred: 0.7-1.3 s at import, paid only by Hub loads

    data = datasets.load_dataset(dataset_id, task.name, split=split)
    absent = [c for c in (*task.text_columns, "label") if c not in data.column_names]
    if absent:
        raise ValueError(f"{dataset_id}/{task.name} [{split}]: no column {absent[0]!r} (found {data.column_names})")
    columns = [data[c] for c in task.text_columns]
    rows = (
        ([col[i] for col in columns], label, f"{dataset_id}/{task.name} [{split}]: row {i}")
        for i, label in enumerate(data["label"])
    )
    return _make_split(task, split, rows, f"{dataset_id}/{task.name}")


def _shard_files(folder: Path, split: str, fmt: str) -> list[Path]:
    exts = (".jsonl", ".json") if fmt == "jsonl" else (f".{fmt}",)
    files = [folder / f"{split}{e}" for e in exts if (folder / f"{split}{e}").is_file()]
    # Hub parquet exports name shards like `validation_matched-00000-of-00001.parquet`.
    files += sorted(p for e in exts for p in folder.glob(f"{split}-*{e}"))
    return files


def detect_format(task: GlueTask, folder: str | os.PathLike[str]) -> str:
    """Which file format a task folder holds: `tsv` (GLUE release layout) or csv/jsonl/parquet."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (expected the {task.name} data)")
    if (folder / task.tsv_file("train")).is_file():
        return "tsv"
    for fmt in FILE_FORMATS[1:]:
        if _shard_files(folder, "train", fmt):
            return fmt
    raise FileNotFoundError(
        f"{folder}: no {task.name} training data: expected {task.tsv_file('train')} (GLUE layout) "
        "or train.csv / train.jsonl / train*.parquet (nyu-mll/glue columns)"
    )


def load_split(task: GlueTask, source: str | os.PathLike[str], split: str, *, fmt: str | None = None) -> GlueSplit:
    """One split from a task folder (format detected unless `fmt`) or, if `source` is not an
    existing path and looks like `org/name`, from the Hub through `datasets`."""
    folder = Path(source)
    if not folder.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)):
        return load_hub(task, split, dataset_id=str(source))
    fmt = fmt or detect_format(task, folder)
    if fmt == "tsv":
        return load_tsv(task, folder / task.tsv_file(split), split)
    if fmt not in FILE_FORMATS:
        raise ValueError(f"fmt: expected one of {FILE_FORMATS}, got {fmt!r}")
    files = _shard_files(folder, split, fmt)
    if not files:
        raise FileNotFoundError(f"{folder / (split + '.' + fmt)}: missing {task.name} split {split!r}")
    return load_records(task, files, split)


def load_task(task: GlueTask, source: str | os.PathLike[str]) -> dict[str, GlueSplit]:
    """The training split and every evaluation split of `task` (both MNLI dev sets)."""
    if Path(source).exists():
        fmt = detect_format(task, source)
        return {s: load_split(task, source, s, fmt=fmt) for s in task.splits}
    return {s: load_split(task, source, s) for s in task.splits}


def find_tasks(glue_root: str | os.PathLike[str]) -> dict[str, Path]:
    """Task folders under a GLUE root (`CoLA/`, `SST-2/`, ... or `cola/`, `sst2/`), in GLUE order."""
    root = Path(glue_root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder (expected a GLUE root with CoLA/, SST-2/, ...)")
    found: dict[str, Path] = {}
    for name, task in GLUE_TASKS.items():
        for candidate in (task.glue_dir, name, task.glue_dir.lower()):
            folder = root / candidate
            if folder.is_dir():
                try:
                    detect_format(task, folder)
                except FileNotFoundError:
                    continue
                found[name] = folder
                break
    if not found:
        raise FileNotFoundError(
            f"{root}: no GLUE task folders with training data (CoLA/train.tsv, SST-2/train.tsv, ...)"
        )
    return found


def encode(split: GlueSplit, tokenizer: Any, max_seq_len: int) -> dict[str, np.ndarray]:
    """Tokenize to fixed-length int32 arrays `input_ids`, `attention_mask`, `token_type_ids` [N, max_seq_len]
    plus `labels`; pairs are joined BERT-style ([CLS] a [SEP] b [SEP]) and truncated longest-first."""
    if max_seq_len < 4:
        raise ValueError(f"max_seq_len: expected >= 4, got {max_seq_len}")
    a = list(split.texts[0])
    b = list(split.texts[1]) if split.task.is_pair else None
    enc = tokenizer(
        a, b, truncation=True, max_length=max_seq_len, padding="max_length",
        return_token_type_ids=True, return_attention_mask=True, return_tensors="np",
    )  # fmt: skip
    return {
        "input_ids": enc["input_ids"].astype(np.int32),
        "attention_mask": enc["attention_mask"].astype(np.int32),
        "token_type_ids": enc["token_type_ids"].astype(np.int32),
        "labels": split.labels,
    }
