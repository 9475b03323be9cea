"""The real `pretrain()` on 8 fake CPU devices (a data=8 mesh and a data=2 x fsdp=4 mesh) ends
with the same parameters (float tolerance), the same ledger and the same sampled batches as on
one device, with the trainer's default ghost clipping (its zero perturbations must vary per
device, or the output gradients come back summed over devices and one example can weigh more
than the clip norm; the noisy update would then differ from one device's).

XLA fixes the device count when jax initialises, so the 8-device runs go in a fresh interpreter
with XLA_FLAGS set before jax is imported; the 1-device run is this process's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
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

EIGHT = textwrap.dedent(
    """
    import json, sys
    import jax
    from dpbert.train.pretrain import pretrain

    assert jax.device_count() == 8, jax.devices()
    recipe, out, seed = sys.argv[1], sys.argv[2], sys.argv[3]
    for name, mesh in (("data8", ["mesh.data=8", "mesh.fsdp=1"]), ("data2_fsdp4", ["mesh.data=2", "mesh.fsdp=4"])):
        lines = []
        pretrain(recipe, f"{out}/{name}", overrides=mesh, progress=False, log=lines.append, noise_seed_file=seed)
        print("LOG " + json.dumps([name, lines]), flush=True)
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    recipe = write_recipe(root)
    assert jax.device_count() == 1
    one_log: list[str] = []
    pretrain(recipe, root / "one", progress=False, log=one_log.append, noise_seed_file=seed_file(root))
    env = subprocess_env(8)
    proc = subprocess.run(
        [sys.executable, "-c", EIGHT, str(recipe), str(root), str(seed_file(root))],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = dict(json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("LOG "))
    return root, {"one": one_log, **logs}


@pytest.mark.parametrize("name", ["data8", "data2_fsdp4"])
def test_eight_devices_train_like_one(runs, name):
    root, logs = runs
    mesh = {"data8": "data=8 x fsdp=1", "data2_fsdp4": "data=2 x fsdp=4"}[name]
    # The compiled batch is the ledger's physical batch padded to devices x micro-batch.
    physical = json.loads((root / "one" / "privacy.json").read_text())["stages"][0]["physical_batch_size"]
    assert f"mesh {mesh} over 1 process(es); compiled batch per stage {-(-physical // 16) * 16}" in "\n".join(
        logs[name]
    )
    assert f"mesh data=1 x fsdp=1 over 1 process(es); compiled batch per stage {-(-physical // 2) * 2}" in "\n".join(
        logs["one"]
    )
    # The ledger (incl. the physical batch where sampling truncates) does not depend on the devices.
    ledger = json.loads((root / name / "privacy.json").read_text())
    assert ledger == json.loads((root / "one" / "privacy.json").read_text())
    assert ledger["stages"][0]["steps"] == 2
    train = [r for r in read_metrics(root / name / "metrics.jsonl") if r["kind"] == "train"]
    ref = [r for r in read_metrics(root / "one" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for a, b in zip(train, ref, strict=True):
        assert a["realized_batch_size"] == b["realized_batch_size"] and a["epsilon"] == b["epsilon"]
        assert a["nonprivate_diagnostics"]["loss"] == pytest.approx(b["nonprivate_diagnostics"]["loss"], abs=1e-5)
    ref_params = load_file(str(root / "one" / "hf" / "model.safetensors"))
    params = load_file(str(root / name / "hf" / "model.safetensors"))
    assert params.keys() == ref_params.keys()
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-4, atol=2e-6, err_msg=k)


def test_the_comparison_is_not_vacuous(runs):
    """Two AdamW steps at learning rate 1e-2 moved the weights far more than the tolerance."""
    root, _ = runs
    from dpbert.config.recipe import load_recipe
    from dpbert.train.mesh import make_mesh
    from dpbert.train.state import (
        abstract_state,
        bert_config,
        init_state,
        make_optimizer,
    )

    recipe = load_recipe(root / "one" / "recipe.yaml")  # the resolved recipe (vocabulary size set)
    optimizer = make_optimizer(recipe)
    init, _ = init_state(recipe, abstract_state(recipe, bert_config(recipe), optimizer, make_mesh()), optimizer)
    init_leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(init)]
    final = load_file(str(root / "one" / "hf" / "model.safetensors"))
    assert sum(x.size for x in init_leaves) == sum(x.size for x in final.values())
    # Every leaf's squared norm changes; compare the multisets of norms (names differ between the two trees).
    init_norms = sorted(float(np.sum(x.astype(np.float64) ** 2)) for x in init_leaves)
    final_norms = sorted(float(np.sum(x.astype(np.float64) ** 2)) for x in final.values())
    assert abs(sum(final_norms) - sum(init_norms)) > 1.0, (sum(init_norms), sum(final_norms))
