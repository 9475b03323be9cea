"""Release: Hugging Face export with the privacy ledger attached, model cards, push/pull, verification.

Public API: `export_run`, `write_release`, `ReleaseMetadata`, `Guarantee`, `CardInfo`, `push`, `pull`,
`resolve_pretrained`, `verify`, `verify_folder`, `VerificationResult`.
"""

from dpbert.release.card import CardInfo, render_card
from dpbert.release.export import export_run, write_release
from dpbert.release.hub import pull, push, resolve_pretrained
from dpbert.release.metadata import Guarantee, ReleaseMetadata, recompute_epsilon
from dpbert.release.verify import VerificationResult, verify, verify_folder

__all__ = [
    "CardInfo",
    "Guarantee",
    "ReleaseMetadata",
    "VerificationResult",
    "export_run",
    "pull",
    "push",
    "recompute_epsilon",
    "render_card",
    "resolve_pretrained",
    "verify",
    "verify_folder",
    "write_release",
]
