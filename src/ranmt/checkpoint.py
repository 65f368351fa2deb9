"""Checkpoints: safetensors for tensors, JSON for everything else; nothing is unpickled.

A checkpoint is a directory::

    model.safetensors       model weights (shared tensors stored once)
    optimizer.safetensors   Adam moments, step counters, RNG states (training checkpoints)
    checkpoint.json         format version, config, vocab info, trainer state
    spm.src.model / spm.tgt.model

It is written to a temporary directory, fsynced and renamed into place, so a kill at any
moment leaves the previous checkpoint intact. A run directory holds ``checkpoints/step_N``
(the last K), ``best`` (best validation BLEU) and ``last`` is the newest step directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from ranmt.config import Config, from_dict, to_dict
from ranmt.model import Seq2Seq, build_model

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: Path) -> None:
    for file in path.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Split an optimizer state dict into flat tensors and JSON-able metadata."""
    state = optimizer.state_dict()
    tensors, meta_state = {}, {}
    for index, param_state in state["state"].items():
        meta_state[str(index)] = {}
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                meta_state[str(index)][key] = value
    return tensors, {"param_groups": state["param_groups"], "state": meta_state}


def optimizer_from_tensors(tensors: dict, meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in meta["state"].items()}
    for name, value in tensors.items():
        if name.startswith("state."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(directory: str | Path, model: Seq2Seq, config: Config, vocab_files: dict,
                    trainer_state: dict | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra_tensors: dict | None = None) -> Path:
    """Write a checkpoint directory atomically; return its path."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    meta = {"format_version": FORMAT_VERSION, "config": to_dict(config),
            "trainer": trainer_state or {}}
    if optimizer is not None or extra_tensors:
        tensors, optim_meta = optimizer_to_tensors(optimizer) if optimizer else ({}, None)
        tensors.update({f"extra.{k}": v.detach().cpu().contiguous()
                        for k, v in (extra_tensors or {}).items()})
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta["optimizer"] = optim_meta
    for side in ("src", "tgt"):
        shutil.copyfile(vocab_files[side], tmp / f"spm.{side}.model")
    (tmp / "checkpoint.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    _fsync_dir(tmp)
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        shutil.rmtree(old, ignore_errors=True)
        directory.replace(old)
    tmp.replace(directory)
    # also a NAME.old left by a kill between the two renames (then NAME did not exist)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def step_checkpoints(run: str | Path) -> list[Path]:
    """Complete ``RUN/checkpoints/step_N`` directories, oldest first (a ``.tmp`` or ``.old``
    left by a kill mid-write is not one)."""
    return sorted(p.parent for p in (Path(run) / "checkpoints").glob("step_*/checkpoint.json")
                  if re.fullmatch(r"step_\d{8}", p.parent.name))


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory (-> its best, else newest checkpoint), a checkpoint dir, or a file in it."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / "checkpoint.json").is_file():
        return path
    # best.old exists only if a kill hit the instant between two renames of save_checkpoint
    for name in ("best", "best.old"):
        if (path / name / "checkpoint.json").is_file():
            return path / name
    steps = step_checkpoints(path)
    if steps:
        return steps[-1]
    raise CheckpointError(f"{path} holds no ranmt checkpoint (no checkpoint.json, best/ or "
                          "checkpoints/step_*)")


def read_meta(directory: Path) -> dict:
    try:
        meta = json.loads((directory / "checkpoint.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{directory}/checkpoint.json is unreadable or corrupted "
                              f"({err})") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: checkpoint format version {version!r}, this "
                              f"ranmt reads version {FORMAT_VERSION}")
    return meta


def write_meta(directory: Path, meta: dict) -> None:
    """Replace a checkpoint's checkpoint.json atomically (a temporary file renamed over it):
    with :func:`read_meta`, the only way ranmt reads and writes the file."""
    target = Path(directory) / "checkpoint.json"
    tmp = target.with_name("checkpoint.json.tmp")
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    tmp.replace(target)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu"
                    ) -> tuple[Seq2Seq, Config, dict, Path]:
    """(model in eval mode, config, checkpoint.json contents, checkpoint dir)."""
    directory = resolve_checkpoint(path)
    meta = read_meta(directory)
    config = from_dict(meta["config"])
    model = build_model(config.model)
    try:
        missing, unexpected = load_model(model, str(directory / "model.safetensors"),
                                         strict=False, device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"{directory}/model.safetensors cannot be loaded: {err}") from None
    if missing or unexpected:
        raise CheckpointError(f"{directory}: weights do not match the config "
                              f"(missing {sorted(missing)[:5]}, unexpected "
                              f"{sorted(unexpected)[:5]})")
    model.to(device).eval()
    return model, config, meta, directory


def load_training_state(directory: Path) -> tuple[dict, dict]:
    """(optimizer state dict, extra tensors) of a training checkpoint."""
    meta = read_meta(directory)
    path = directory / "optimizer.safetensors"
    if not path.is_file() or meta.get("optimizer") is None:
        raise CheckpointError(f"{directory} has no optimizer state; cannot resume from it")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} cannot be loaded: {err}") from None
    extra = {k[len("extra."):]: v for k, v in tensors.items() if k.startswith("extra.")}
    optim = optimizer_from_tensors({k: v for k, v in tensors.items()
                                    if not k.startswith("extra.")}, meta["optimizer"])
    return optim, extra


def average_checkpoints(run: str | Path, last: int, out: str | Path) -> Path:
    """Average the weights of the ``last`` newest step checkpoints of a run into ``out``.

    The result is an ordinary (inference) checkpoint directory with the newest checkpoint's
    config and vocabularies.
    """
    run = Path(run)
    if last < 1:
        raise CheckpointError("--last must be >= 1")
    if not run.is_dir():
        raise CheckpointError(f"run {run} does not exist")
    steps = step_checkpoints(run)
    if len(steps) < last:
        raise CheckpointError(f"{run} holds {len(steps)} step checkpoint(s), fewer than "
                              f"--last {last} (raise train.keep_last to keep more)")
    chosen = steps[-last:]
    model, config, meta, _ = load_checkpoint(chosen[-1])
    total = {name: tensor.detach().double().clone() for name, tensor in
             model.state_dict().items()}
    for directory in chosen[:-1]:
        other, _, _, _ = load_checkpoint(directory)
        for name, tensor in other.state_dict().items():
            total[name] += tensor.double()
    averaged = {name: (value / last).to(model.state_dict()[name].dtype)
                for name, value in total.items()}
    model.load_state_dict(averaged)
    trainer = {**meta.get("trainer", {}), "averaged": [d.name for d in chosen]}
    return save_checkpoint(Path(out), model, config,
                           {"src": chosen[-1] / "spm.src.model",
                            "tgt": chosen[-1] / "spm.tgt.model"}, trainer)
