"""Names and versions of what the trainer writes and reads: the dtype names of configs and command lines,
a file's sha256, and the format-version check of run.json, a checkpoint's state.json and dataset.json.

It sits beside errors.py, below every folder, because each of them needs these: `models/` and `data/` may
not import `perf/` or `configs/`, and the scripts and `perf/` use the same names and checks as `data/`.
"""

import hashlib
from pathlib import Path

import torch

from errors import InputError

# training.dtype, precompute's and export's --dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_format(record: dict, expected: int, what: str, writer: str, remedy: str,
                 error: type[InputError] = InputError) -> None:
    """`record` (a JSON file's contents) is of the `expected` format, or `error` says that `what` was written
    by an earlier version of `writer` (before formats were recorded: format 1) and what to do (`remedy`)."""
    found = record.get("format", 1)
    if found != expected:
        raise error(f"{what} was written by an earlier version of {writer} (format {found}; this version "
                    f"reads {expected}): {remedy}")
