"""Throughput and memory of a DP-SGD step of BERT, next to the non-private step and the peers.

`run_bench(model="tiny", ...)` times, on one BERT masked-LM configuration, dpbert's non-private
steps, its DP step with each clipping path (vmap, ghost), the PyTorch step of transformers'
`BertForMaskedLM` and Opacus' DP steps, and the noise draw alone, and reports examples per second,
ratios within one run, peak memory from XLA's memory analysis of the DP step, and compile seconds.

Guarantees: all rows time the same configuration and batch, take turns step by step on a CPU (a
change of load hits all of them alike), and name the device they ran on; a missing or failing
peer says why. Rows, units and models in full: docs/INTERNALS.md ("dpbert.bench").
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from transformers import BertConfig

from dpbert.model import functional
from dpbert.model.bert import BertForMaskedLM
from dpbert.model.ghost import MLMGhostLoss
from dpbert.privacy.clipping import grad_sum
from dpbert.privacy.dp_step import clipped_sum_for, make_dp_train_step, make_train_step
from dpbert.privacy.noise import privatize
from dpbert.privacy.randomness import noise_key, step_key
from dpbert.privacy.tuning import fastest_microbatch_size, peak_bytes
from dpbert.train.device import ACCELERATOR_MICROBATCH_SIZES, is_accelerator

SEQ_LEN = 128
PREDICTIONS = 20
VOCAB = 8192
MODELS = {"micro": (2, 64, 2), "tiny": (2, 128, 2), "mini": (4, 256, 4), "base": (12, 768, 12)}  # layers, hidden, heads
# BERT-Large, the paper's model, with its full 30,522-token vocabulary (tests/test_bench.py).
MODELS["large"] = (24, 1024, 16)
MODEL_VOCAB = {"large": 30522}
# The shipped recipes' real shapes: recipes/tiny.yaml (and tiny_nonprivate.yaml) trains "micro" (2 x 64) on
# sequences of 16 tokens with its public 8,192-token vocabulary ("bert-base-uncased-8k") and decodes
# `dpbert.train.mlm.max_predictions(16, 0.3)` = 4 positions per example; "-30k" is the same
# recipe with the full bert-base-uncased vocabulary (`--set data.tokenizer=bert-base-uncased`).
# tests/test_tiny_recipe.py checks these against the recipe file.
RECIPE_PRESETS = {"tiny-recipe": ("micro", 8192, 16, 4), "tiny-recipe-30k": ("micro", 30522, 16, 4)}
MODELS |= {name: MODELS[base] for name, (base, *_) in RECIPE_PRESETS.items()}


def shapes(model: str) -> tuple[int, int, int]:
    """(vocabulary, sequence length, decoded positions per example) of a model or recipe preset."""
    if model in RECIPE_PRESETS:
        return RECIPE_PRESETS[model][1:]
    return MODEL_VOCAB.get(model, VOCAB), SEQ_LEN, PREDICTIONS


def bert_config(model: str):
    if model not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {model!r}")
    layers, hidden, heads = MODELS[model]
    vocab, seq_len, _ = shapes(model)
    return BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def _data(batch: int, seed: int = 0, model: str = "tiny") -> dict[str, np.ndarray]:
    vocab, seq_len, predictions = shapes(model)
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(5, vocab, (batch, seq_len)).astype(np.int32),
        "attention_mask": np.ones((batch, seq_len), np.int32),
        "masked_positions": np.sort(rng.choice(np.arange(1, seq_len - 1), predictions, replace=False))[None]
        .repeat(batch, 0)
        .astype(np.int32),
        "labels": rng.integers(5, vocab, (batch, predictions)).astype(np.int32),
        "label_weights": np.ones((batch, predictions), np.float32),
    }


def _time_round_robin(runs: dict[str, Callable[[], Any]], steps: int) -> dict[str, float]:
    """Best seconds per call of each run after one warm-up (compilation) call each. The runs
    take turns, so a change in machine load during the benchmark hits every row alike."""
    for run in runs.values():
        jax.block_until_ready(run())
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(steps):
        for name, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


NONPRIVATE_ROWS = ("dpbert non-private (one pass)", "dpbert non-private (micro-batches)")
DP_ROWS = ("dpbert DP (vmap)", "dpbert DP (ghost)")
NOISE_ROW = "noise draw"
TORCH_ROW, TORCH_BF16_ROW = "torch non-private", "torch non-private (bf16 autocast)"
OPACUS_ROWS = ("opacus DP (hooks)", "opacus DP (ghost)")
PEER_ROWS = (TORCH_ROW, TORCH_BF16_ROW, "opacus DP", *OPACUS_ROWS)
ROWS = NONPRIVATE_ROWS + DP_ROWS + PEER_ROWS
# Default batch per model: DP-SGD trains with large batches (the paper's reach millions), and
# the per-step costs (noise, optimizer update) are amortized over them. base stays at 16 so
# that Opacus's per-example gradients (16 x 92M floats) fit a 24 GiB machine: at 32 the
# process reached 24.3 GB resident and was killed during the first Opacus step.
DEFAULT_BATCH = {"micro": 64, "tiny": 64, "mini": 64, "base": 16, "tiny-recipe": 256, "tiny-recipe-30k": 256}
# large: Opacus's per-example gradients are 335M floats per example (1.3 GB): 4 fit a 24 GiB machine.
DEFAULT_BATCH["large"] = 4
DEFAULT_MICROBATCH = 4
# Timed steps per row: the best of 3 moved tiny's DP / non-private ratio between 0.85 and 1.01
# from run to run on a shared 2-core machine; the best of 10 steps (under 1 s each) is steadier.
# base steps take seconds each, and its rows are long enough to ride out short interruptions.
DEFAULT_STEPS = {"micro": 10, "tiny": 10, "mini": 10, "base": 3, "tiny-recipe": 5, "tiny-recipe-30k": 5}
DEFAULT_STEPS["large"] = 2


def _jax_runs(
    model: str, batch: int, microbatch: int | str, dtype: Any, layer_mode: str, remat: bool, vmap: bool
) -> tuple[dict[str, Callable[[], Any]], dict[str, str], dict[str, int], Any, dict[str, float]]:
    """One step callable per dpbert row (and the noise draw alone), the reason of each row that
    does not run, each row's micro-batch size, (loss, optimizer, params) for the memory
    analysis, and each row's compile seconds (ahead-of-time lowering + XLA compilation)."""
    net = BertForMaskedLM(bert_config(model), rngs=nnx.Rngs(0), dtype=dtype, remat=remat)
    graphdef, params = functional.split_params(net)
    loss = MLMGhostLoss(graphdef=graphdef, layer_mode=layer_mode)
    optimizer = optax.sgd(1e-4)
    data = {k: jnp.asarray(v) for k, v in _data(batch, model=model).items()}
    padding = jnp.zeros((batch,), jnp.bool_)
    methods = ("vmap", "ghost") if vmap else ("ghost",)
    sums = {NONPRIVATE_ROWS[1]: lambda *a, **kw: grad_sum(loss, *a, **kw)}
    sums |= {f"dpbert DP ({m})": functools.partial(clipped_sum_for(m, loss), loss, clip_norm=1.0) for m in methods}
    sizes = {
        name: microbatch if isinstance(microbatch, int) else _fastest_microbatch(fn, params, batch, model)
        for name, fn in sums.items()
    }
    # The best non-private step of dpbert: the plain gradient of the mean loss, in one batched
    # pass, and accumulated over micro-batches (often faster on CPU caches).
    steps_fns = {
        NONPRIVATE_ROWS[0]: make_train_step(loss, optimizer, microbatch_size=batch, donate=False),
        NONPRIVATE_ROWS[1]: make_train_step(loss, optimizer, microbatch_size=sizes[NONPRIVATE_ROWS[1]], donate=False),
    }
    for method in methods:
        name = f"dpbert DP ({method})"
        steps_fns[name] = make_dp_train_step(
            loss,
            optimizer,
            clip_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=batch,
            microbatch_size=sizes[name],
            donate=False,
            clipping_method=method,
        )
    state = (params, optimizer.init(params))
    key0 = jax.random.key(0)
    # Compiled ahead of time, and timed: each row's compile seconds; its runs call the compiled step.
    compiled = {name: _aot(step, *state, data, padding, key0) for name, step in steps_fns.items()}
    runs = {name: (lambda c=c: c(*state, data, padding, key0)) for name, (c, _) in compiled.items()}
    compile_seconds = {name: sec for name, (_, sec) in compiled.items()}
    # The Gaussian noise of one step on its own: a fixed cost per step (one draw of a normal per
    # parameter, added to the sum), whatever the batch, so DP-SGD's large batches amortize it. The
    # key is an argument, as in the DP step, so that XLA cannot fold any of the draw into constants.
    noise = jax.jit(
        lambda p, key: privatize(p, noise_key(key), clip_norm=1.0, noise_multiplier=1.0, expected_batch_size=batch)
    )
    noise_step_key = step_key(jax.random.key(1), 0)
    runs[NOISE_ROW] = lambda: noise(params, noise_step_key)
    compile_seconds[NOISE_ROW] = _aot(noise, params, noise_step_key)[1]
    notes = {} if vmap else {"dpbert DP (vmap)": "skipped: --no-vmap"}
    return runs, notes, sizes, (loss, optimizer, params), compile_seconds


def _aot(fn: Any, *args: Any) -> tuple[Any, float]:
    """(`fn` lowered and compiled for `args`, the seconds that took): a row's compile time."""
    started = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - started


def _fastest_microbatch(sum_fn: Callable[..., Any], params: Any, batch: int, model: str = "tiny") -> int:
    """The fastest micro-batch size of `sum_fn` among the candidates that divide `batch` and are
    smaller than it (the whole batch is the one-pass row), on placeholders: powers of two up to
    32 on a CPU (its caches), `dpbert.train.device.ACCELERATOR_MICROBATCH_SIZES` on a GPU or TPU."""
    sizes = ACCELERATOR_MICROBATCH_SIZES if is_accelerator() else (1, 2, 4, 8, 16, 32)
    candidates = [m for m in sizes if m < batch and batch % m == 0] or [batch]
    example = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in _data(1, model=model).items()}
    return fastest_microbatch_size(sum_fn, params, example, candidates=candidates)[0]


def dp_step_peak_bytes(
    loss: Any,
    optimizer: Any,
    params: Any,
    *,
    expected_batch: int,
    microbatch: int,
    clipping_method: str,
    model: str = "tiny",
) -> int:
    """Compiled peak bytes of a DP step on `expected_batch` examples, minus the batch inputs."""
    step = make_dp_train_step(
        loss,
        optimizer,
        clip_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=expected_batch,
        microbatch_size=microbatch,
        donate=True,
        clipping_method=clipping_method,
    )
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    data = {k: jax.ShapeDtypeStruct((expected_batch,) + v.shape[1:], v.dtype) for k, v in _data(1, model=model).items()}
    args = (
        jax.tree_util.tree_map(shape, params),
        jax.tree_util.tree_map(shape, optimizer.init(params)),
        data,
        jax.ShapeDtypeStruct((expected_batch,), jnp.bool_),
        jax.random.key(0),
    )
    batch_bytes = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in data.values()) + expected_batch
    return peak_bytes(step.lower(*args).compile()) - batch_bytes


def torch_device() -> str | None:
    """The device the PyTorch peers run on: "cuda" where PyTorch sees a GPU, else "cpu"; None
    without torch. Only the driver is queried: no CUDA context is created here."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch  # deferred: the optional bench extra; torch costs 1.7 s at import

    return "cuda" if torch.cuda.is_available() else "cpu"


def _peer_rows() -> tuple[list[str], dict[str, str]]:
    """(peer rows that can run, the reason of each that cannot): torch and opacus installed?"""
    if importlib.util.find_spec("torch") is None:
        return [], {TORCH_ROW: "skipped: torch is not installed"}
    if importlib.util.find_spec("opacus") is None:
        return [TORCH_ROW, TORCH_BF16_ROW], {"opacus DP": "skipped: opacus is not installed"}
    return [TORCH_ROW, TORCH_BF16_ROW, *OPACUS_ROWS], {}


def _torch_setup(device: str) -> str:
    """Thread count (CPU) or TF32 matmuls (CUDA) for the peers; returns the device's label."""
    import torch  # deferred: the optional bench extra; torch costs 1.7 s at import

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return f"cuda:{torch.cuda.get_device_name()}"
    torch.set_num_threads(os.cpu_count() or 1)  # XLA's CPU backend uses every core
    return f"cpu:{torch.get_num_threads()} threads"


def _peer_step(row: str, model: str, batch: int, device: str) -> Callable[[], None]:
    """One training step of a peer row on `device` ("cpu" or "cuda"), called once already (so a
    row that cannot run fails here), on the batch `_data(batch, model=model)`."""
    import torch  # deferred: the optional bench extra; torch costs 1.7 s at import

    np_data = _data(batch, model=model)
    seq_len = shapes(model)[1]
    ids = torch.from_numpy(np_data["input_ids"]).long()
    labels = torch.full_like(ids, -100)
    labels.scatter_(1, torch.from_numpy(np_data["masked_positions"]).long(), torch.from_numpy(np_data["labels"]).long())
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.from_numpy(np_data["attention_mask"]).long(),
        # Explicit per-example position and token-type ids: Opacus needs a batch axis on every input.
        "position_ids": torch.arange(seq_len).expand(batch, seq_len).contiguous(),
        "token_type_ids": torch.zeros_like(ids),
    }
    inputs = {k: v.to(device) for k, v in inputs.items()}
    labels = labels.to(device)
    if row in OPACUS_ROWS:
        step = _opacus_step(model, row.split("(")[1].rstrip(")"), inputs, labels, device)
    else:
        step = _torch_step(model, inputs, labels, device, autocast=row == TORCH_BF16_ROW)
    step()
    return step


def _torch_step(model: str, inputs: dict[str, Any], labels: Any, device: str, *, autocast: bool) -> Callable[[], None]:
    import torch  # deferred: the optional bench extra; torch costs 1.7 s at import
    from transformers import BertForMaskedLM as TorchBert  # deferred: needs torch (as above)

    torch.manual_seed(0)
    net = TorchBert(bert_config(model)).to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        # bfloat16 autocast: matmuls in bfloat16, float32 parameters and optimizer (dpbert's --bfloat16).
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = net(**inputs, labels=labels).loss
        loss.backward()
        opt.step()

    return step


def _opacus_step(model: str, mode: str, inputs: dict[str, Any], labels: Any, device: str) -> Callable[[], None]:
    import torch  # deferred: the optional bench extra; torch costs 1.7 s at import
    from opacus import PrivacyEngine  # deferred: the optional bench extra
    from transformers import BertForMaskedLM as TorchBert  # deferred: needs torch (as above)

    torch.manual_seed(0)
    net = TorchBert(bert_config(model)).to(device).train()
    # The head's `bias` is an alias of decoder.bias; as a bare parameter of the head module it
    # sends Opacus to its functorch fallback, which fails on this torch. Same tensor, kept once.
    if net.cls.predictions.bias is net.cls.predictions.decoder.bias:
        del net.cls.predictions.bias
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    dataset = torch.utils.data.TensorDataset(inputs["input_ids"], labels)
    loader = torch.utils.data.DataLoader(dataset, batch_size=len(labels))
    criterion = torch.nn.CrossEntropyLoss(reduction="mean")
    made = PrivacyEngine().make_private(
        module=net,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
        criterion=criterion,
    )
    module, dp_opt = made[0], made[1]
    vocab = net.config.vocab_size

    def step() -> None:
        dp_opt.zero_grad(set_to_none=True)
        logits = module(**inputs).logits
        flat = (logits.reshape(-1, vocab), labels.reshape(-1))
        if mode == "ghost":
            # Per-example mean over the masked tokens (ignore_index), as in dpbert's loss.
            made[2](*flat, shape=labels.shape).backward()
        else:
            per_token = torch.nn.functional.cross_entropy(*flat, reduction="none").reshape(labels.shape)
            per_example = per_token.sum(1) / (labels != -100).sum(1).clamp(min=1)
            per_example.mean().backward()
        dp_opt.step()

    return step


def _failure(err: BaseException) -> str:
    """A peer's failure in one line: exception type and the first line of its message."""
    text = str(err).splitlines()[0][:120] if str(err) else ""
    return f"failed: {type(err).__name__}: {text}"


def _peer_runs_here(model: str, batch: int) -> tuple[dict[str, Callable[[], Any]], dict[str, str], dict[str, str]]:
    """CPU peers in this process, for the round robin: (step per row, reason per row that does
    not run, device label per row)."""
    rows, notes = _peer_rows()
    if not rows:
        return {}, notes, {}
    label = _torch_setup("cpu")
    runs: dict[str, Callable[[], Any]] = {}
    for row in rows:
        try:
            runs[row] = _peer_step(row, model, batch, "cpu")
        except Exception as err:  # a peer that does not support this BERT is reported, not fatal
            notes[row] = _failure(err)
    return runs, notes, dict.fromkeys(runs, label)


def _peer_rows_in_processes(
    model: str, batch: int, steps: int, timeout: float, *, device: str = "cuda", rows: Sequence[str] | None = None
) -> tuple[dict[str, float], dict[str, str], dict[str, str]]:
    """Peers on `device`, one child process per row (`python -m dpbert.bench ROW_JSON`, JAX kept
    off the GPU there), each timed like the JAX rows (best of `steps` after one warm-up, the
    device synchronized): (examples/s per row, reason per row that does not run, device per row).
    `rows`: a subset of the rows that can run (default: all of them)."""
    runnable, notes = _peer_rows()
    rows = runnable if rows is None else [r for r in rows if r in runnable]
    rates: dict[str, float] = {}
    devices: dict[str, str] = {}
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    for row in rows:
        spec = json.dumps({"row": row, "model": model, "batch": batch, "steps": steps, "device": device})
        try:
            done = subprocess.run(
                [sys.executable, "-m", "dpbert.bench", spec],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            notes[row] = f"failed: no result within {timeout:g} s"
            continue
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            notes[row] = f"failed: {tail[:160]}"
            continue
        out = json.loads(lines[-1])
        if "note" in out:
            notes[row] = out["note"]
        else:
            rates[row], devices[row] = out["examples_per_s"], out["device"]
    return rates, notes, devices


def _peer_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One peer row, timed in this (child) process: {"examples_per_s", "device"} or {"note"}."""
    import torch  # deferred: the optional bench extra; torch costs 1.7 s at import

    device = spec["device"]
    label = _torch_setup(device)
    try:
        step = _peer_step(spec["row"], spec["model"], spec["batch"], device)
    except Exception as err:  # e.g. out of memory: the parent reports it in the row
        return {"note": _failure(err)}

    def synced() -> None:
        step()
        if device == "cuda":
            torch.cuda.synchronize()

    seconds = _time_round_robin({spec["row"]: synced}, spec["steps"])[spec["row"]]
    return {"examples_per_s": spec["batch"] / seconds, "device": label}


def run_bench(
    *,
    model: str = "tiny",
    batch: int | None = None,
    microbatch: int | str = DEFAULT_MICROBATCH,
    steps: int | None = None,
    bfloat16: bool = False,
    peers: bool = True,
    memory: bool = True,
    layer_mode: str = "mixed",
    remat: bool = False,
    vmap: bool = True,
    peer_timeout: float = 600.0,
) -> dict[str, Any]:
    """Run the benchmark; returns the rows (examples/s or a reason), the device of each row and
    the headline ratios. `batch` and `steps` default to DEFAULT_BATCH[model] and
    DEFAULT_STEPS[model]; `microbatch` "auto" times each micro-batched row's candidate sizes
    first and runs it at its fastest. `peer_timeout`: seconds each CUDA peer process may take."""
    if model not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {model!r}")
    batch = DEFAULT_BATCH[model] if batch is None else batch
    steps = DEFAULT_STEPS[model] if steps is None else steps
    if microbatch != "auto" and (not isinstance(microbatch, int) or microbatch < 1):
        raise ValueError(f"microbatch: expected a positive integer or 'auto', got {microbatch!r}")
    if batch < 1 or (microbatch != "auto" and batch % microbatch):
        raise ValueError(f"batch: expected a positive multiple of microbatch ({microbatch}), got {batch}")
    if steps < 1:
        raise ValueError(f"steps: expected >= 1, got {steps}")
    dtype = jnp.bfloat16 if bfloat16 else jnp.float32
    peer_device = torch_device() if peers else None
    peer_rates: dict[str, float] = {}
    peer_notes: dict[str, str] = {}
    peer_devices: dict[str, str] = {}
    if peer_device == "cuda":
        # Before this process's JAX first touches the GPU and preallocates most of its memory.
        peer_rates, peer_notes, peer_devices = _peer_rows_in_processes(model, batch, steps, peer_timeout)
    runs, notes, sizes, (loss, optimizer, params), compile_s = _jax_runs(
        model, batch, microbatch, dtype, layer_mode, remat, vmap
    )
    dev = jax.devices()[0]
    devices = dict.fromkeys([*NONPRIVATE_ROWS, *DP_ROWS], f"{dev.platform}:{dev.device_kind}") | peer_devices
    if peer_device is not None and peer_device != "cuda":
        cpu_runs, peer_notes, cpu_devices = _peer_runs_here(model, batch)
        runs.update(cpu_runs)
        devices |= cpu_devices
    # Every row of this process, PyTorch and Opacus on a CPU included, takes its turn in the same round robin.
    seconds = _time_round_robin(runs, steps)
    noise_s = seconds.pop(NOISE_ROW)
    measured = {name: batch / sec for name, sec in seconds.items()} | peer_rates | notes | peer_notes
    rows: dict[str, float | str] = {name: measured[name] for name in ROWS if name in measured}
    best_np_name = max(NONPRIVATE_ROWS, key=rows.get)
    nonprivate = rows[best_np_name]
    best_dp_name = max((k for k in DP_ROWS if isinstance(rows[k], float)), key=rows.get)
    best_dp = rows[best_dp_name]
    opacus = [v for k, v in rows.items() if k.startswith("opacus") and isinstance(v, float)]
    # dpbert's non-private step against PyTorch's at the same precision: bfloat16 against autocast.
    torch_row = TORCH_BF16_ROW if bfloat16 else TORCH_ROW
    torch_np = rows.get(torch_row)
    memory_ratio = None
    peak = {}
    if memory:
        method = best_dp_name.split("(")[1].rstrip(")")
        for n in (1024, 65536):
            peak[n] = dp_step_peak_bytes(
                loss,
                optimizer,
                params,
                expected_batch=n,
                microbatch=sizes[best_dp_name],
                clipping_method=method,
                model=model,
            )
        memory_ratio = peak[65536] / peak[1024]
    return {
        "model": model,
        "layers_hidden_heads": MODELS[model],
        "vocab_size": shapes(model)[0],
        "seq_len": shapes(model)[1],
        "batch": batch,
        "microbatch": microbatch,
        "microbatch_by_row": sizes,
        "dtype": "bfloat16" if bfloat16 else "float32",
        "layer_mode": layer_mode,
        "remat": remat,
        "backend": jax.default_backend(),
        "device": f"{dev.platform}:{dev.device_kind}",
        "xla_cpu_threads": os.cpu_count(),
        "peer_device": peer_device,
        "examples_per_s": rows,
        "device_by_row": {name: devices.get(name) if isinstance(v, float) else None for name, v in rows.items()},
        "best_dp": best_dp_name,
        "best_nonprivate": best_np_name,
        "torch_reference": torch_row,
        # XLA compile seconds per row (None: eager PyTorch / Opacus rows, and rows that did not run).
        "compile_seconds": {name: compile_s.get(name) for name in [*rows, NOISE_ROW]},
        "peak_bytes": {str(k): v for k, v in peak.items()},
        "noise_ms_per_step": noise_s * 1e3,
        "noise_fraction_of_dp_step": noise_s * best_dp / batch,
        "dp_over_nonprivate": best_dp / nonprivate,
        "over_opacus": best_dp / max(opacus) if opacus else None,
        "nonprivate_over_torch": nonprivate / torch_np if isinstance(torch_np, float) else None,
        "memory_65536_over_1024": memory_ratio,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"dpbert bench: BERT {result['model']} {result['layers_hidden_heads']} (layers, hidden, heads), "
        f"vocab {result['vocab_size']}, seq len {result['seq_len']}, batch {result['batch']}, "
        f"micro-batch {result['microbatch']}, {result['dtype']}, ghost layer mode {result['layer_mode']}, "
        f"remat {result['remat']}",
        f"JAX backend {result['backend']}, device {result['device']}, XLA CPU threads {result['xla_cpu_threads']}, "
        f"PyTorch peers on {result['peer_device'] or 'nothing'}",
        f"{'step':<36}{'examples/s':>12}{'compile s':>11}   device",
    ]
    compile_s = result.get("compile_seconds", {})
    for name, value in result["examples_per_s"].items():
        if not isinstance(value, float):
            lines.append(f"{name:<36}  {value}")
            continue
        size = result["microbatch_by_row"].get(name) if result["microbatch"] == "auto" else None
        sec = compile_s.get(name)
        lines.append(
            f"{name:<36}{value:>12.1f}{'' if sec is None else f'{sec:11.1f}':<11}   "
            f"{result['device_by_row'][name]}" + (f"   (fastest micro-batch: {size})" if size else "")
        )
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    lines += [
        f"best DP path: {result['best_dp']}; best non-private: {result['best_nonprivate']}",
        f"noise draw: {result['noise_ms_per_step']:.1f} ms per step, {100 * result['noise_fraction_of_dp_step']:.1f}% "
        "of the best DP step (fixed per step: amortized by larger batches)"
        + ("" if compile_s.get(NOISE_ROW) is None else f"; compiles in {compile_s[NOISE_ROW]:.1f} s"),
        f"best DP / best non-private:     {fmt(result['dp_over_nonprivate'])}   (target >= 0.95)",
        f"dpbert DP / best Opacus DP:     {fmt(result['over_opacus'])}   (target >= 2.5)",
        f"dpbert / {result['torch_reference'] + ':':<22}{fmt(result['nonprivate_over_torch'])}   (target >= 1.0)",
        f"peak memory 65,536 / 1,024:     {fmt(result['memory_65536_over_1024'])}   (target <= 1.10; "
        + ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in result["peak_bytes"].items())
        + ")",
    ]
    return "\n".join(lines)


def bench_main(args: argparse.Namespace) -> int:
    result = run_bench(
        model=args.model,
        batch=args.batch,
        microbatch=args.microbatch,
        steps=args.steps,
        bfloat16=args.bfloat16,
        peers=args.peers,
        memory=args.memory,
        layer_mode=args.layer_mode,
        remat=args.remat,
        vmap=args.vmap,
        peer_timeout=args.peer_timeout,
    )
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":  # one CUDA peer row, in the child process `_peer_rows_in_processes` starts
    print(json.dumps(_peer_child(json.loads(sys.argv[1]))))
