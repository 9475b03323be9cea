"""Keys of a DP mechanism: a secret root, one key per purpose, and fold_in(run_key, t) per step.

Guarantees (rule 4 of `dpbert.privacy`): every DP mechanism's randomness derives from a 256-bit
`RunSecret` from the OS CSPRNG, written only to the run's checkpoint folder (mode 0600), never to a
release, card, metric or log; an auditor may supply it (`--noise-seed-file`) and the release then
says so. `mechanism_key(secret, purpose)` separates domains (HMAC-SHA256), so no two mechanisms
share a key. The keys of step t depend only on (run key, t): a resumed run replays step t
exactly; per-example keys depend on the example's global position only, so results do not change
with micro-batch size or device count. The key layout and the ciphers: docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import secrets
from pathlib import Path

import jax
import jax.numpy as jnp

from dpbert.atomic import write_text

SAMPLING = 0
EXAMPLE = 1
NOISE = 2
# Document-level DP: which sequences of each sampled document are taken (secret, like SAMPLING).
DOCUMENT_SEQUENCES = 3
NOISE_KEY_IMPL = "threefry4x32"
MECHANISM_KEY_IMPL = "threefry2x32"
SECRET_BYTES = 32
MIN_SUPPLIED_BYTES = 16
SECRET_FILE = "noise_secret"
OS_CSPRNG = "os-csprng"
SUPPLIED = "supplied-file"
_SECRET_FORMAT = "dpbert-noise-secret/1"


@dataclasses.dataclass(frozen=True)
class RunSecret:
    """The root secret of a DP run's randomness and where it came from (`OS_CSPRNG` or
    `SUPPLIED`). Its repr never shows the value."""

    value: bytes = dataclasses.field(repr=False)
    source: str

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SUPPLIED_BYTES:
            raise ValueError(f"noise secret: expected at least {MIN_SUPPLIED_BYTES} bytes, got {len(self.value)}")
        if self.source not in (OS_CSPRNG, SUPPLIED):
            raise ValueError(f"noise secret source: expected {OS_CSPRNG!r} or {SUPPLIED!r}, got {self.source!r}")


def draw_secret() -> RunSecret:
    """A fresh 256-bit secret from the operating system's CSPRNG."""
    return RunSecret(secrets.token_bytes(SECRET_BYTES), OS_CSPRNG)


def read_secret_file(path: str | Path) -> RunSecret:
    """An auditor-supplied secret: a text file holding at least 32 hex digits (128 bits), e.g.
    from `python -c "import secrets; print(secrets.token_hex(32))"`."""
    path = Path(path)
    try:
        text = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"--noise-seed-file {path}: cannot be read ({e.strerror})") from None
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise ValueError(
            f"--noise-seed-file {path}: expected hexadecimal digits only (e.g. secrets.token_hex(32))"
        ) from None
    if len(value) < MIN_SUPPLIED_BYTES:
        raise ValueError(
            f"--noise-seed-file {path}: {len(value) * 8} bits; expected at least {MIN_SUPPLIED_BYTES * 8} "
            f"({2 * MIN_SUPPLIED_BYTES} hex digits)"
        )
    return RunSecret(value, SUPPLIED)


def write_secret(path: str | Path, secret: RunSecret) -> None:
    """Store `secret` at `path`, readable by its owner only (0600), atomically."""
    write_text(
        path,
        json.dumps({"format": _SECRET_FORMAT, "source": secret.source, "secret": secret.value.hex()}) + "\n",
        private=True,
    )


def read_secret(path: str | Path) -> RunSecret:
    """The secret `write_secret` stored at `path`; ValueError naming the file if it is not one."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
        if record.get("format") != _SECRET_FORMAT:
            raise ValueError
        return RunSecret(bytes.fromhex(record["secret"]), record["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"noise secret {path}: missing or not a {_SECRET_FORMAT} file") from None


def run_secret(path: str | Path, *, reuse: bool, supplied: str | Path | None = None) -> RunSecret:
    """The secret of the run whose secret file is `path`, written there if new.

    With `reuse` (a resumed run) an existing file is read back, so the run replays exactly; a
    supplied secret must then equal it. Otherwise the supplied secret, or a fresh draw from the
    OS CSPRNG, replaces any old file."""
    path = Path(path)
    new = read_secret_file(supplied) if supplied is not None else None
    if reuse and path.exists():
        stored = read_secret(path)
        if new is not None and new.value != stored.value:
            raise ValueError(
                f"--noise-seed-file {supplied}: differs from the secret this run started with; "
                "a resumed run must replay the same noise"
            )
        return stored
    secret = new if new is not None else draw_secret()
    write_secret(path, secret)
    return secret


def mechanism_key(secret: RunSecret, purpose: str) -> jax.Array:
    """The key of one DP mechanism: HMAC-SHA256(secret, 'dpbert/v1/' + purpose), its first 64
    bits as a Threefry-2x32 key (JAX's default, as `jax.random.key(seed)` makes). Distinct
    purposes give independent keys."""
    if not purpose:
        raise ValueError("mechanism_key: purpose must name the mechanism, e.g. 'pretrain/stage/0'")
    digest = hmac.new(secret.value, f"dpbert/v1/{purpose}".encode(), "sha256").digest()
    words = jnp.asarray([int.from_bytes(digest[i : i + 4], "little") for i in range(0, 8, 4)], dtype=jnp.uint32)
    return jax.random.wrap_key_data(words, impl=MECHANISM_KEY_IMPL)


def step_key(run_key: jax.Array, step: int | jax.Array) -> jax.Array:
    """The key of global step `step`."""
    return jax.random.fold_in(run_key, step)


def example_key(key_of_step: jax.Array) -> jax.Array:
    """Parent of the per-example keys (masking, dropout) of a step."""
    return jax.random.fold_in(key_of_step, EXAMPLE)


def noise_key(key_of_step: jax.Array) -> jax.Array:
    """Key (Threefry-4x32) of the Gaussian noise added to a step's clipped gradient sum."""
    bits = jax.random.bits(jax.random.fold_in(key_of_step, NOISE), (4,), jnp.uint32)
    return jax.random.wrap_key_data(bits, impl=NOISE_KEY_IMPL)
