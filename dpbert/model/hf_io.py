"""Hugging Face BERT folders <-> dpbert NNX models: the one weight-name mapping.

A dpbert parameter path is the Hugging Face name with the Flax leaf name (kernels transposed,
`embedding`/`scale` <-> `weight`), the encoder's layers stacked along a leading axis; files on
disk keep one tensor per layer under transformers' names.

Guarantees: loading accepts checkpoints with or without the `bert.` prefix, old LayerNorm names,
safetensors (single or sharded) or `pytorch_model.bin`; weights are stored in float32; only head
weights may be missing (a warning names them), anything else missing or mis-shaped is a
`ValueError` naming file, parameter and shapes; `save_pretrained` writes exactly the tensors
transformers saves, so it loads them with nothing missing, and a folder appears whole (atomic).
Details: docs/INTERNALS.md ("dpbert.model.hf_io").
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import BertConfig

from dpbert.atomic import replace_dir, replace_files

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TORCH_WEIGHTS_NAME = "pytorch_model.bin"

# Weights a checkpoint may lack: they are initialised fresh (with a warning), as transformers does.
_HEAD_PREFIXES = ("cls.", "classifier.", "pooler.", "bert.pooler.")
# Checkpoint entries that are buffers, not parameters: never reported as unexpected.
_BUFFERS = re.compile(r"(^|\.)embeddings\.(position_ids|token_type_ids)$")
_LEAF_TO_HF = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}
_POSITION_TABLE = re.compile(r"(^|\.)embeddings\.position_embeddings\.weight$")


def model_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` as a local model folder; FileNotFoundError (a Hub id, a missing folder) says how to get one.

    Hub ids are resolved one layer up, by ``dpbert.release.resolve_pretrained`` (download through the
    Hugging Face cache, verification of any privacy claim), before the folder reaches this module.
    """
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ValueError(f"{folder}: expected a model folder (config.json + weights), found a file")
    raise FileNotFoundError(
        f"{path}: no such model folder; for a Hub id, run `dpbert pull {path}` (or call "
        "dpbert.release.resolve_pretrained) and load the folder it returns"
    )


def load_config(folder: str | os.PathLike[str]) -> BertConfig:
    """Read ``folder/config.json`` as a BertConfig; FileNotFoundError / ValueError name the file."""
    config_path = Path(folder) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no config.json in model folder {folder}")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from err
    if not isinstance(data, dict) or data.get("model_type") != "bert":
        found = data.get("model_type") if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{config_path}: model_type is {found!r}, expected 'bert' (dpbert loads BERT checkpoints only)"
        )
    return BertConfig.from_dict(data)


def _normalise_key(key: str) -> str:
    # Checkpoints converted from the original TF BERT name LayerNorm parameters gamma/beta.
    if key.endswith("LayerNorm.gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith("LayerNorm.beta"):
        return key[: -len("beta")] + "bias"
    return key


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    # The flax framework reads bfloat16/float16 checkpoints too (numpy has no bfloat16).
    with safe_open(str(path), framework="flax") as f:
        return {key: np.asarray(f.get_tensor(key), dtype=np.float32) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def _read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch  # deferred: the optional interop extra, 1.7 s at import; read only for pytorch_model.bin
    except ImportError as err:
        raise ImportError(
            f"{path}: reading pytorch_model.bin needs torch (pip install 'dpbert[interop]'); "
            "or convert the folder to model.safetensors"
        ) from err
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    return {key: value.detach().float().numpy() for key, value in state.items() if torch.is_floating_point(value)}


def read_state_dict(folder: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], Path]:
    """The checkpoint's float tensors (float32, Hugging Face names) and the weights file read."""
    folder = Path(folder)
    safe = folder / SAFE_WEIGHTS_NAME
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    torch_bin = folder / TORCH_WEIGHTS_NAME
    if safe.is_file():
        state, source = _read_safetensors(safe), safe
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        state, source = {}, index
        for shard in shards:
            state.update(_read_safetensors(folder / shard))
    elif torch_bin.is_file():
        state, source = _read_torch_bin(torch_bin), torch_bin
    else:
        looked_for = ", ".join((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, TORCH_WEIGHTS_NAME))
        raise FileNotFoundError(f"{folder}: no weights file (looked for {looked_for})")
    return {_normalise_key(k): v for k, v in state.items()}, source


def hf_name(path: tuple[Any, ...]) -> str:
    """Hugging Face parameter name of an nnx state path (per-layer: with its layer index)."""
    *module, leaf = (str(p) for p in path)
    if leaf not in _LEAF_TO_HF:
        raise ValueError(f"{'.'.join(map(str, path))}: no Hugging Face name for parameter leaf {leaf!r}")
    return ".".join([*module, _LEAF_TO_HF[leaf]])


def stacked_layer_axis(path: tuple[Any, ...]) -> int | None:
    """Where the layer index goes in `path` when it names a stacked encoder-layer parameter
    (``(..., "encoder", "layer", "attention", ...)``: the position after "layer"); None for every
    other parameter, and for a per-layer path that already has its index."""
    for j in range(1, len(path) - 1):
        if path[j - 1] == "encoder" and path[j] == "layer":
            return None if isinstance(path[j + 1], int) or str(path[j + 1]).isdigit() else j + 1
    return None


def layer_path(path: tuple[Any, ...], layer: int) -> tuple[Any, ...]:
    """The per-layer path of row `layer` of a stacked parameter path."""
    at = stacked_layer_axis(path)
    if at is None:
        raise ValueError(f"{'.'.join(map(str, path))}: not a stacked encoder-layer parameter")
    return (*path[:at], layer, *path[at:])


def _hf_layout(path: tuple[Any, ...], value: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(value.T) if path[-1] == "kernel" else value


def _hf_shape(path: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[::-1]) if path[-1] == "kernel" else tuple(shape)


def _model_params(model: nnx.Module) -> dict[str, tuple[tuple[Any, ...], nnx.Variable, int | None]]:
    """{Hugging Face name: (nnx path, variable, layer row or None)}: a stacked encoder parameter
    appears once per layer, under each layer's name."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if stacked_layer_axis(path) is None:
            out[hf_name(path)] = (path, var, None)
        else:
            for i in range(var.get_value().shape[0]):
                out[hf_name(layer_path(path, i))] = (path, var, i)
    return out


def to_hf_state(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters as float32 numpy arrays under Hugging Face names and layouts."""
    host: dict[tuple[Any, ...], np.ndarray] = {}
    out = {}
    for name, (path, var, row) in _model_params(model).items():
        if path not in host:
            host[path] = np.asarray(var[...], dtype=np.float32)
        out[name] = _hf_layout(path, host[path] if row is None else host[path][row])
    return out


def _align_prefix(state: Mapping[str, np.ndarray], prefix: str | None) -> dict[str, np.ndarray]:
    """Rename checkpoint keys to the model's naming: add or strip the ``bert.`` base prefix."""
    has_prefix = any(k.startswith("bert.") for k in state)
    if prefix and not has_prefix:  # a bare BertModel checkpoint loaded into a model with a head
        return {k if k.startswith(("cls.", "classifier.")) else f"{prefix}.{k}": v for k, v in state.items()}
    if not prefix and has_prefix:  # a checkpoint with a head loaded into a bare BertModel
        return {(k[len("bert.") :] if k.startswith("bert.") else k): v for k, v in state.items()}
    return dict(state)


def load_hf_state(model: nnx.Module, state: Mapping[str, np.ndarray], source: str | os.PathLike[str]) -> list[str]:
    """Copy ``state`` (Hugging Face names) into ``model``; return the names left initialised.

    Raises ValueError naming ``source`` for missing encoder weights or any shape mismatch.
    """
    state = _align_prefix(state, getattr(model, "base_model_prefix", None))
    # A tied checkpoint may also carry the decoder bias under its tied alias.
    if "cls.predictions.bias" not in state and "cls.predictions.decoder.bias" in state:
        state["cls.predictions.bias"] = state.pop("cls.predictions.decoder.bias")
    params = _model_params(model)
    tied = getattr(model, "cls", None) is not None and model.cls.predictions.decoder is None
    ignored = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"} if tied else set()

    missing = [name for name in params if name not in state]
    fatal = [name for name in missing if not name.startswith(_HEAD_PREFIXES)]
    if fatal:
        shown = ", ".join(fatal[:8]) + (f" ... ({len(fatal)} in all)" if len(fatal) > 8 else "")
        raise ValueError(f"{source}: missing weights for {shown}; is this a BERT checkpoint for this config?")
    mismatched = []
    for name, (path, var, row) in params.items():
        if name in state:
            shape = var.get_value().shape
            expected = _hf_shape(path, shape if row is None else shape[1:])
            if tuple(state[name].shape) != expected:
                mismatched.append(f"{name}: expected shape {expected}, found {tuple(state[name].shape)}")
    if mismatched:
        raise ValueError(f"{source}: weights do not match config.json: " + "; ".join(mismatched))

    # Stacked encoder parameters: every layer's row from the checkpoint (all present: only head
    # weights may be missing), stacked along the leading layer axis.
    values: dict[tuple[Any, ...], Any] = {}
    variables: dict[tuple[Any, ...], nnx.Variable] = {}
    for name, (path, var, row) in params.items():
        if name not in state:
            continue
        variables[path] = var
        value = _hf_layout(path, state[name])
        if row is None:
            values[path] = value
        else:
            values.setdefault(path, {})[row] = value
    updates = [
        (
            path,
            variables[path].replace(jnp.asarray(v if not isinstance(v, dict) else np.stack([v[i] for i in sorted(v)]))),
        )
        for path, v in values.items()
    ]
    nnx.update(model, nnx.from_flat_state(updates))

    unexpected = sorted(k for k in state if k not in params and k not in ignored and not _BUFFERS.search(k))
    if unexpected:
        warnings.warn(
            f"{source}: ignored weights not used by {type(model).__name__}: {', '.join(unexpected)}", stacklevel=4
        )
    if missing:
        warnings.warn(
            f"{source}: {type(model).__name__} weights not in the checkpoint were newly initialised: "
            f"{', '.join(missing)}. Train them before use.",
            stacklevel=4,
        )
    return missing


def repeat_positions(state: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """``state`` with its position table grown to ``rows`` rows by repeating its learned ones (row i
    takes row i mod n), as Beltagy et al. (2020) grew RoBERTa's 512 positions to 4,096: each block of
    n positions keeps the learned neighbourhood. A table of ``rows`` rows or more is left as it is;
    ValueError when ``state`` holds no position table."""
    names = [name for name in state if _POSITION_TABLE.search(name)]
    if len(names) != 1:
        raise ValueError(f"expected one position table (*embeddings.position_embeddings.weight), found {names}")
    table = state[names[0]]
    if table.shape[0] >= rows:
        return dict(state)
    return {**state, names[0]: table[np.arange(rows) % table.shape[0]]}


def from_pretrained(
    cls: type,
    path: str | os.PathLike[str],
    *,
    dtype: Any,
    seed: int,
    max_positions: int | None = None,
    **config_overrides: Any,
):
    """Build ``cls`` from a local Hugging Face BERT folder (see ``load_hf_state`` for what may be missing).

    ``max_positions`` larger than the folder's ``max_position_embeddings``: the position table is
    grown to that many rows by `repeat_positions` (the config says so); smaller or None: as saved."""
    folder = model_folder(path)
    config = load_config(folder)
    for field, value in config_overrides.items():
        if not hasattr(config, field):
            raise ValueError(f"{field}: not a BertConfig field (config overrides must name existing fields)")
        setattr(config, field, value)
    state, source = read_state_dict(folder)
    if max_positions is not None and max_positions > config.max_position_embeddings:
        state = repeat_positions(state, max_positions)
        config.max_position_embeddings = max_positions

    def build() -> nnx.Module:
        return cls(config, rngs=nnx.Rngs(seed), dtype=dtype)

    # Random initialisation is skipped when the checkpoint covers every parameter: the shapes
    # come from an abstract model, and a BERT-Large load costs no 340M-parameter init.
    model = nnx.eval_shape(build)
    if any(
        name not in _align_prefix(state, getattr(model, "base_model_prefix", None)) for name in _model_params(model)
    ):
        model = build()
    load_hf_state(model, state, source)
    return model


def _write_folder(folder: Path, config: BertConfig, state: dict[str, np.ndarray]) -> None:
    config.to_json_file(str(folder / CONFIG_NAME), use_diff=True)
    # transformers refuses safetensors files without a known "format" in the metadata.
    save_file(state, str(folder / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})


def save_pretrained(model: nnx.Module, path: str | os.PathLike[str]) -> None:
    """Write ``config.json`` + ``model.safetensors`` that transformers loads for the same class."""
    target = Path(path)
    config = model.config
    config.architectures = [type(model).__name__]
    state = to_hf_state(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target}: exists and is not a folder")
    with replace_files(target) if target.exists() else replace_dir(target) as tmp:
        _write_folder(tmp, config, state)
