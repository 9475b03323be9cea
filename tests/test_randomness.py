"""The secret randomness of DP mechanisms: a CSPRNG root secret, stored owner-only, and one
independent key per mechanism by domain separation."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dpbert.privacy.gradient_canaries import audit_keys
from dpbert.privacy.randomness import (
    OS_CSPRNG,
    SUPPLIED,
    RunSecret,
    draw_secret,
    mechanism_key,
    noise_key,
    read_secret,
    read_secret_file,
    run_secret,
    step_key,
)

SECRET = RunSecret(bytes(range(32)), SUPPLIED)
PURPOSES = [
    "pretrain/masking",
    "pretrain/stage/0",
    "pretrain/stage/1",
    "finetune/sst2",
    "finetune/cola",
    "audit/gradient/run",
    "audit/gradient/canaries",
    "audit/input/run",
    "audit/input/canaries",
]


def _noise(key: jax.Array, step: int = 0, n: int = 200_000) -> np.ndarray:
    return np.asarray(jax.random.normal(noise_key(step_key(key, step)), (n,)))


def test_secrets_are_fresh_256_bit_draws_and_never_printed():
    a, b = draw_secret(), draw_secret()
    assert a.source == OS_CSPRNG and len(a.value) == 32 and a.value != b.value
    assert a.value.hex() not in repr(a) and a.value.hex() not in str(a)


def test_every_purpose_gets_its_own_key_and_independent_noise():
    keys = {p: mechanism_key(SECRET, p) for p in PURPOSES}
    data = {p: tuple(np.asarray(jax.random.key_data(k)).tolist()) for p, k in keys.items()}
    assert len(set(data.values())) == len(PURPOSES)
    # The same secret and purpose give the same key (a resume replays); another secret does not.
    assert np.array_equal(
        jax.random.key_data(mechanism_key(SECRET, "finetune/sst2")), jax.random.key_data(keys["finetune/sst2"])
    )
    other = RunSecret(bytes(range(1, 33)), SUPPLIED)
    assert not np.array_equal(
        jax.random.key_data(mechanism_key(other, "finetune/sst2")), jax.random.key_data(keys["finetune/sst2"])
    )
    # Pretraining's and fine-tuning's noise at the same step are uncorrelated standard normals:
    # |r| < 5 / sqrt(n) (a shared or shifted stream would give |r| near 1).
    pre, fine = _noise(keys["pretrain/stage/0"]), _noise(keys["finetune/sst2"])
    assert abs(np.corrcoef(pre, fine)[0, 1]) < 5 / np.sqrt(pre.size)
    assert abs(pre.std() - 1) < 0.01 and abs(fine.std() - 1) < 0.01
    assert abs(
        np.corrcoef(_noise(keys["pretrain/stage/0"], 0), _noise(keys["pretrain/stage/0"], 1))[0, 1]
    ) < 5 / np.sqrt(pre.size)


def test_audit_keys_are_disjoint_from_training_keys():
    training = {
        tuple(np.asarray(jax.random.key_data(mechanism_key(SECRET, p))).tolist())
        for p in PURPOSES
        if not p.startswith("audit/")
    }
    for kind in ("gradient", "input"):
        run, canaries = audit_keys(SECRET, kind)
        for key in (run, canaries):
            assert tuple(np.asarray(jax.random.key_data(key)).tolist()) not in training
        assert abs(np.corrcoef(_noise(run), _noise(mechanism_key(SECRET, "pretrain/stage/0")))[0, 1]) < 0.012


def test_secret_file_is_owner_only_and_replays_on_resume(tmp_path):
    path = tmp_path / "checkpoints" / "noise_secret"
    first = run_secret(path, reuse=False)
    assert path.stat().st_mode & 0o777 == 0o600 and read_secret(path) == first
    assert run_secret(path, reuse=True) == first  # a resume reads it back
    assert run_secret(path, reuse=False) != first  # a new run draws a new one
    supplied = tmp_path / "seed.hex"
    supplied.write_text("ab" * 32 + "\n")
    assert run_secret(path, reuse=False, supplied=supplied) == RunSecret(bytes([0xAB] * 32), SUPPLIED)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("zz" * 32, "expected hexadecimal digits only"),
        ("ab" * 8, "64 bits; expected at least 128"),
    ],
)
def test_bad_seed_files_are_named(tmp_path, text, message):
    path = tmp_path / "seed.hex"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"--noise-seed-file {path}: {message}"):
        read_secret_file(path)
    with pytest.raises(ValueError, match="cannot be read"):
        read_secret_file(tmp_path / "missing.hex")
    (tmp_path / "bad_store").write_text("{}")
    with pytest.raises(ValueError, match="not a dpbert-noise-secret/1 file"):
        read_secret(tmp_path / "bad_store")
