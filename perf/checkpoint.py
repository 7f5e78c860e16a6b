"""Checkpoints as directories of safetensors files plus JSON, written atomically and verifiable.

A checkpoint is written into `.tmp-step_XXXXXXXX`, fsynced, given a manifest (sizes and sha256 of every file)
last, and only then renamed to `step_XXXXXXXX`. A directory without a valid manifest is never resumed from.
"""

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger("mmdit")
MANIFEST = "manifest.json"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(run_dir: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], meta: dict,
                     extra_files: dict[str, str] = {}) -> Path:
    """tensors: file stem -> state dict (CPU tensors); meta: JSON-able loop state; extra_files: name -> text."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
    if final.exists() and verify(final) is None:  # same step, same state: keep what is on disk
        return final
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for stem, state in tensors.items():
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / f"{stem}.safetensors")
    (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    for name, text in extra_files.items():
        (tmp / name).write_text(text)
    files = sorted(p for p in tmp.iterdir())
    for path in files:
        fsync_path(path)
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
    fsync_path(tmp / MANIFEST)
    if final.exists():  # an invalid leftover of this step: replaced only now that the new one is complete
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    return final


def verify(path: Path) -> str | None:
    """None if the checkpoint is complete and intact, else the reason it is not."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest: {e}"
    for name, expected in manifest.items():
        file = Path(path) / name
        if not file.is_file():
            return f"missing file {name}"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, manifest says {expected['bytes']}"
        if sha256(file) != expected["sha256"]:
            return f"{name} checksum mismatch"
    return None


def checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoint directories, oldest first (temporary directories excluded)."""
    root = checkpoint_root(run_dir)
    return sorted(root.glob("step_[0-9]*")) if root.is_dir() else []


def latest_valid_checkpoint(run_dir: Path) -> Path | None:
    for path in reversed(checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def read_checkpoint(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    path = Path(path)
    tensors = {p.name.removesuffix(".safetensors"): load_file(p) for p in path.glob("*.safetensors")}
    return tensors, json.loads((path / "state.json").read_text())


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints; called only after a newer one is complete."""
    for old in checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into flat CPU tensors (safetensors) and JSON-able metadata."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach().cpu()
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for flat, value in [*tensors.items(), *meta["scalars"].items()]:
        pid, key = flat.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}
