"""Mixed precision: autocast for bf16/fp16, a GradScaler for fp16. Master weights stay fp32; in fp32 both
the autocast context and the scaler are no-ops. On CUDA, TF32 matmuls, cuDNN autotuning and deterministic
kernels are switches."""

import os
from contextlib import nullcontext

import torch

from formats import DTYPES


def autocast(device: torch.device, dtype: str):
    if dtype == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def grad_scaler(device: torch.device, dtype: str) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device.type, enabled=dtype == "fp16")


def configure_cuda_math(device: torch.device, allow_tf32: bool) -> None:
    """TF32 runs fp32 matmuls/convolutions on tensor cores (10-bit mantissa); cuDNN benchmark picks the
    fastest convolution algorithm for the fixed input shapes. Nothing changes on other devices."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.backends.cudnn.benchmark = True


def deterministic_kernels(enabled: bool) -> None:
    """Kernels that repeat bit for bit, or the fastest ones. On GPUs cuDNN and cuBLAS pick kernels that do not
    repeat: two runs of one command differed in 268 of 283 tensors after 8 steps on an H100, and so does a
    resumed run from an uninterrupted one; with deterministic kernels both were bitwise equal. cuBLAS reads its
    workspace setting when it starts: call this before any CUDA work. CPU kernels repeat either way."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
