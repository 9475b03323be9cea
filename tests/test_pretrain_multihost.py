"""Two processes on 127.0.0.1 (jax.distributed over gloo, 2 CPU devices each, parameters and
Adam state FSDP-sharded over all 4 devices, so across the processes; ghost clipping) run the
real `dpbert pretrain` CLI and end with the parameters and ledger of one process on one device;
process 0 alone writes metrics, privacy.json, the HF folder and the release, and prints. Both
privacy units: a sequence, and a whole document (each process loads its share of the sampled
documents with their chosen sequences).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_run import seed_file, write_recipe
from xla import subprocess_env

from dpbert.train.metrics import read_metrics
from dpbert.train.pretrain import pretrain

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["sequence", "document"])
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    recipe = write_recipe(root, checkpoint_every=1, unit=request.param)
    env = subprocess_env(2)
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dpbert.cli",
                "pretrain",
                str(recipe),
                "--output-dir",
                str(root / "multi"),
                "--set",
                "mesh.data=1",
                "--set",
                "mesh.fsdp=4",
                "--coordinator-address",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--noise-seed-file",
                str(seed_file(root)),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(o[-3000:] for o in outs)
    assert jax.device_count() == 1
    single = pretrain(recipe, root / "single", progress=False, log=lambda s: None, noise_seed_file=seed_file(root))
    return root, outs, single


def test_two_processes_end_with_the_parameters_of_one(runs):
    root, _, single = runs
    assert single.steps_done == 2
    ref = load_file(str(root / "single" / "hf" / "model.safetensors"))
    multi = load_file(str(root / "multi" / "hf" / "model.safetensors"))
    assert multi.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(multi[k], ref[k], rtol=1e-4, atol=2e-6, err_msg=k)
    assert json.loads((root / "multi" / "privacy.json").read_text()) == json.loads(
        (root / "single" / "privacy.json").read_text()
    )
    # Orbax wrote the checkpoints collectively (the last two kept), restorable like any other.
    assert sorted(p.name for p in (root / "multi" / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]


def test_only_process_0_writes_and_prints(runs):
    root, (out0, out1), single = runs
    assert "mesh data=1 x fsdp=4 over 2 process(es)" in out0
    assert "privacy: epsilon" in out0 and "held-out MLM accuracy" in out0
    assert "privacy:" not in out1 and "held-out" not in out1 and "data:" not in out1
    # One writer: each step logged once (two appending processes would log it twice).
    records = read_metrics(root / "multi" / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2]
    ref = [r for r in read_metrics(root / "single" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["realized_batch_size"] for r in records if r["kind"] == "train"] == [
        r["realized_batch_size"] for r in ref
    ]
    release = json.loads((root / "multi" / "release" / "privacy.json").read_text())
    assert release["guarantees"][0]["epsilon"] == pytest.approx(single.epsilon, rel=1e-6)
    assert (root / "multi" / "recipe.yaml").is_file()
    assert not list((root / "multi").glob(".*"))  # no temporary folder left behind by a second writer
