"""Push releases to, and pull them from, the Hugging Face Hub (or any Hub-compatible endpoint).

- `push` verifies the folder first (`dpbert.release.verify`: epsilon recomputed, ledger rebuilt from the
  recipe, weight hashes, every copy) and refuses one that does not verify, then
  `create_repo(exist_ok=True)` (+ `create_branch` for a revision) and `upload_folder`.
- `pull` downloads with `snapshot_download` through the Hugging Face cache (HF_HOME / HF_HUB_CACHE),
  so a pulled repo loads again offline (HF_HUB_OFFLINE=1); it verifies by default.
- `resolve_pretrained` turns a folder or Hub id into a local folder for `from_pretrained`; it verifies
  every release that makes a privacy claim (has privacy.json or a `differential_privacy` card block)
  and lets plain Hugging Face BERT folders through.
- `verify` verifies a local folder or a Hub repo pulled through the cache (`dpbert.release.verify`).

The endpoint comes from HF_ENDPOINT and the token from `token=`, HF_TOKEN or the saved login
(`huggingface_hub.get_token`). The token is only ever handed to `huggingface_hub`: dpbert never prints,
logs or writes it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dpbert.release.card import CARD_FILE, read_front_matter
from dpbert.release.metadata import PRIVACY_FILE
from dpbert.release.verify import DEFAULT_RTOL, VerificationResult, verify_folder

# A Hub model id: "name" or "namespace/name" (letters, digits, '-', '_', '.').
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def _check_repo_id(repo_id: str) -> None:
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise ValueError(f"repo_id: expected 'ORG/NAME' (letters, digits, '-', '_', '.'), got {repo_id!r}")


def push(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a verified release folder to `repo_id` (created if needed); returns the commit URL.

    `private` sets the Hub visibility of a *new* repo (unrelated to differential privacy); `revision` is a
    branch, created from main when missing.
    """
    from huggingface_hub import HfApi  # deferred: 336 ms at import, paid by push and pull only

    folder = Path(folder)
    _check_repo_id(repo_id)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder (expected a release written by `dpbert export`)")
    result = verify_folder(folder)
    result.raise_if_failed()
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    status = "private" if result.private else "NOT private"
    commit = api.upload_folder(
        folder_path=folder,
        repo_id=repo_id,
        repo_type="model",
        revision=revision,
        commit_message=commit_message or f"dpbert release ({status})",
    )
    return str(commit.commit_url)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download  # deferred: 336 ms at import, paid by push and pull only
    from huggingface_hub.errors import (  # deferred: as above
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    _check_repo_id(repo_id)
    try:
        return Path(snapshot_download(repo_id, repo_type="model", revision=revision))
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(f"{repo_id!r}: no such local folder or Hub repo (or no access to it)") from err
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"{repo_id!r}: not in the Hugging Face cache and the Hub is not reachable (offline?); run "
            f"`dpbert pull {repo_id}` where the Hub is reachable, or pass a local folder ({err})"
        ) from err
    except HfHubHTTPError as err:
        raise ValueError(f"{repo_id!r}: the Hub answered {err}") from err


def pull(repo_id_or_path: str | os.PathLike[str], *, revision: str | None = None, verify: bool = True) -> Path:
    """A local folder for a Hub repo (downloaded through the HF cache) or an existing folder.

    With `verify=True` (the default) the release's privacy metadata must verify, else ValueError lists
    the problems; missing metadata counts as a failure.
    """
    path = Path(repo_id_or_path).expanduser()
    if not path.is_dir() and not _REPO_ID.match(str(repo_id_or_path)):
        raise FileNotFoundError(f"{str(repo_id_or_path)!r}: no such folder, and not a Hub repo id ORG/NAME")
    folder = path if path.is_dir() else _download(str(repo_id_or_path), revision)
    if verify:
        verify_folder(folder).raise_if_failed()
    return folder


def has_privacy_claims(folder: str | os.PathLike[str]) -> bool:
    """Whether a folder claims anything about privacy (privacy.json, or a card privacy block)."""
    folder = Path(folder)
    if (folder / PRIVACY_FILE).exists():
        return True
    card = folder / CARD_FILE
    if not card.is_file():
        return False
    try:
        return "differential_privacy" in read_front_matter(card)
    except ValueError:
        return False


def resolve_pretrained(
    path_or_repo_id: str | os.PathLike[str], *, revision: str | None = None, verify: bool = True
) -> Path:
    """A local model folder for `from_pretrained`: a folder as is, a Hub id through the HF cache.

    A release that makes a privacy claim is verified (ValueError when it does not verify); a plain
    Hugging Face folder without any claim is returned unverified.
    """
    folder = pull(path_or_repo_id, revision=revision, verify=False)
    if verify and has_privacy_claims(folder):
        verify_folder(folder).raise_if_failed()
    return folder


def verify(
    path_or_repo_id: str | os.PathLike[str], *, revision: str | None = None, rtol: float = DEFAULT_RTOL
) -> VerificationResult:
    """Verify a local release folder, or a Hub repo downloaded through the Hugging Face cache."""
    return verify_folder(pull(path_or_repo_id, revision=revision, verify=False), rtol=rtol)
