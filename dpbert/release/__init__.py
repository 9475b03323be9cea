"""Release: Hugging Face export with the privacy ledger attached, model cards, push/pull, verification.

A release states its guarantees (ledgers, randomness source, unit), what they treat as public (dataset
size N and its source, vocabulary, recipe), the recipe itself and the sha256 of its weights; `verify`
recomputes epsilon, rebuilds each ledger from the recipe, checks the hashes and every copy (see
`dpbert.release.verify`), and push/pull/resolve_pretrained refuse a release that does not verify.

Public API: `export_run`, `write_release`, `ReleaseMetadata`, `Guarantee`, `CardInfo`, `push`, `pull`,
`resolve_pretrained`, `verify`, `verify_folder`, `VerificationResult`, `metadata_from_json`.
"""

from dpbert.release.card import CardInfo, render_card
from dpbert.release.export import export_run, write_release
from dpbert.release.hub import pull, push, resolve_pretrained, verify
from dpbert.release.metadata import Guarantee, ReleaseMetadata, metadata_from_json, recompute_epsilon
from dpbert.release.verify import VerificationResult, verify_folder

__all__ = [
    "CardInfo",
    "Guarantee",
    "ReleaseMetadata",
    "VerificationResult",
    "export_run",
    "metadata_from_json",
    "pull",
    "push",
    "recompute_epsilon",
    "render_card",
    "resolve_pretrained",
    "verify",
    "verify_folder",
    "write_release",
]
