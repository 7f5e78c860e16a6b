"""Mixed precision: autocast for bf16/fp16, a GradScaler for fp16. Master weights stay fp32; in fp32 both
the autocast context and the scaler are no-ops."""

from contextlib import nullcontext

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, dtype: str):
    if dtype == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def grad_scaler(device: torch.device, dtype: str) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device.type, enabled=dtype == "fp16")
