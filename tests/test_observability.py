"""The profiler and the numbers and pictures a run shows: traces, metrics.jsonl, TensorBoard, wandb."""

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from configs.build import build_model, build_tokenizer
from configs.schema import load_config
from data.shapes import ShapesDataset
from models.attention import math_attention, use_attention
from perf.profiler import build_profiler
from runtime.metrics import RunLogger
from runtime.step_stats import SigmaBuckets, train_flops_per_sample
from tests.conftest import TINY
from tests.conftest import metric_rows as rows
from train_mmdit_stable import main

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ["profiler.enabled=true", "profiler.active_steps=2", "profiler.skip_first=1"]


def load_with_tb_profiler(trace_dir: Path):
    """The run as TensorBoard's PyTorch Profiler tab loads it (torch-tb-profiler's own loader)."""
    from torch_tb_profiler import io
    from torch_tb_profiler.profiler.loader import RunLoader
    return RunLoader("run", str(trace_dir), io.Cache()).load()


def test_profiler_trace_loads_into_the_tensorboard_profiler_views(tiny, tmp_path):
    assert main(tiny("training.max_steps=6", *PROFILE)) == 0
    traces = list((tmp_path / "run" / "tensorboard").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]
    run = load_with_tb_profiler(tmp_path / "run" / "tensorboard")
    assert run.workers == ["rank0"]
    assert {"Overview", "Operator", "Trace"} <= {view.display_name for view in run.views}


def test_profiler_stops_itself_after_its_schedule(tmp_path):
    cfg = OmegaConf.structured(load_config().profiler)
    cfg.enabled, cfg.active_steps, cfg.skip_first, cfg.repeat = True, 2, 1, 2
    with build_profiler(cfg, tmp_path, 0, torch.device("cpu")) as profiler:
        for step in range(12):  # 1 skipped + 2 cycles of (1 wait + 1 warmup + 2 active) = 9 steps
            torch.ones(8).sum()
            profiler.step()
            if step == 7:
                assert torch.autograd.profiler._is_profiler_enabled
        assert not torch.autograd.profiler._is_profiler_enabled
    assert len(list(tmp_path.glob("rank0*.pt.trace.json"))) == 2


def test_profiler_off_creates_no_profiler(tiny, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a profiler was created with profiling off")
    monkeypatch.setattr(torch.profiler, "profile", refuse)
    assert main(tiny("training.max_steps=2")) == 0
    assert not list((tmp_path / "run").rglob("*.pt.trace.json"))


def test_metrics_reach_jsonl_and_tensorboard(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    assert main(tiny("training.max_steps=4", "logging.log_every=2", "logging.peak_tflops=0.1",
                     "validation.at_end=true")) == 0
    run_dir = tmp_path / "run"
    logged = [r for r in rows(run_dir) if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    expected = {"loss", "lr", "grad_norm", "skipped_steps", "samples_per_s", "samples_per_s_per_rank", "tokens_per_s",
                "tokens_per_s_per_rank", "tflops_per_s_per_rank", "mfu", "time/data_s", "time/forward_backward_s",
                "time/optimizer_s", "time/step_s", "memory/rss_gib", "memory/peak_rss_gib", "memory/train_state_gib",
                "checkpoint/stall_s", "checkpoint/staging_gib"}
    assert expected <= logged[-1].keys()
    assert any(k.startswith("loss_by_sigma/") for k in logged[-1])
    tokens = (32 // 4) ** 2 + build_tokenizer().tokens
    assert logged[-1]["tokens_per_s"] == pytest.approx(logged[-1]["samples_per_s"] * tokens)
    assert logged[-1]["mfu"] == pytest.approx(logged[-1]["tflops_per_s_per_rank"] / 0.1)
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    scalars = events.Tags()["scalars"]
    assert expected <= set(scalars)
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in logged])
    assert events.Tags()["images"] == ["samples"]  # the final sample grid
    assert Image.open(run_dir / "loss_curve.png").size == (640, 360)


def test_loss_curve_smoothed_line_ends_at_the_logged_loss(tmp_path):
    """The default run logs 15 rows, its loss falling from ~1.5 to ~0.08: the smoothed line (dark) must end
    where the logged losses do, not where an average lagging over most of the run puts it (it ended near 0.35)."""
    import numpy as np
    from runtime.metrics import save_loss_curve
    steps = np.arange(100, 1501, 100)
    losses = 0.08 + 1.42 * np.exp(-steps / 150) + np.random.default_rng(0).normal(0, 0.01, len(steps))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": int(s), "loss": float(v)}) + "\n"
                                                    for s, v in zip(steps, losses)) + '{"step": 1600, "lo')  # killed
    save_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss_curve.png")
    image = np.asarray(Image.open(tmp_path / "loss_curve.png").convert("RGB"))
    height, (top, bottom, right) = image.shape[0], (30, 40, 20)
    dark = np.flatnonzero((image[:, image.shape[1] - right - 1] == (20, 60, 200)).all(axis=1))
    end_loss = losses.max() - (dark.mean() - top) / (height - top - bottom) * (losses.max() - losses.min())
    assert end_loss == pytest.approx(losses[-3:].mean(), abs=0.02)


def test_a_metrics_row_the_disk_refuses_is_dropped_whole_and_the_next_one_written(tmp_path, monkeypatch, caplog):
    """A full disk takes part of a row and refuses the rest: the cut line must go (the next row would be written
    after it, into the same line), with one warning naming the file and the reason; the rows after are tried
    again, and once there is space they are written, with one line saying so."""
    caplog.set_level(logging.INFO, logger="mmdit")
    logger = RunLogger(tmp_path, load_config(overrides=["logging.tensorboard=false"]), enabled=True)
    logger.scalars(1, {"loss": 1.0})
    real_write, written_part = os.write, []

    def disk_full(fd: int, data) -> int:
        if fd != logger.jsonl.fd:
            return real_write(fd, data)
        if not written_part:
            written_part.append(fd)
            return real_write(fd, data[:20])  # what fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", disk_full)
    logger.scalars(2, {"loss": 0.5})
    logger.scalars(3, {"loss": 0.4})
    assert written_part  # the write did fail part-way
    monkeypatch.setattr(os, "write", real_write)  # space was freed
    logger.scalars(4, {"loss": 0.3})
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"{tmp_path / 'metrics.jsonl'} (OSError: [Errno 28] No space left" in warnings[0]
    assert caplog.text.count("metrics.jsonl: written again") == 1


def test_sigma_buckets_average_per_noise_level():
    buckets = SigmaBuckets(torch.device("cpu"))
    buckets.add(torch.tensor([0.1, 0.2, 0.9, 0.6]), torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert buckets.metrics() == {"loss_by_sigma/0.00-0.25": 2.0, "loss_by_sigma/0.50-0.75": 7.0,
                                 "loss_by_sigma/0.75-1.00": 5.0}
    assert buckets.metrics() == {}  # reset after reading


def test_flop_count_on_meta_matches_a_real_count():
    """The meta-device count (what MFU uses) agrees with torch's flop counter on a real model whose attention
    is plain matmuls, which it counts (within 0.1 %: SDPA's meta decomposition and our math kernel shape their
    matmuls differently); with the CPU SDPA kernel the real count would miss attention (~8 % of the total)."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = load_config(overrides=["model.num_layers=2", "model.dual_attention_layers=[0]"])
    tokenizer = build_tokenizer()
    inputs = lambda: (torch.zeros(1, 3, 32, 32), torch.full((1,), 0.5), {"input_ids": torch.ones(1, 7).long()})
    meta = train_flops_per_sample(lambda: build_model(cfg, ShapesDataset, tokenizer), inputs)
    with FlopCounterMode(display=False) as counter:
        use_attention(build_model(cfg, ShapesDataset, tokenizer), math_attention)(*inputs()).sum().backward()
    assert meta == pytest.approx(counter.get_total_flops(), rel=1e-3) and meta > 0


@pytest.mark.parametrize("family, lora", [("sd3", False), ("flux", True)])
def test_flop_count_predicts_the_backward_it_does_not_run(family, lora, monkeypatch):
    """The count runs the forward alone and predicts the backward's products from which factors require a gradient:
    equal to torch's counter over a forward and backward run in full, with everything trained and under LoRA (frozen
    base weights: no weight gradients); an op it has no prediction for makes it run the backward instead."""
    from torch.utils.flop_counter import FlopCounterMode
    from models.lora import apply_lora
    from runtime import step_stats
    cfg = load_config(overrides=[*TINY, f"model.family={family}"])
    cfg.lora.enabled = lora  # adapters on a fresh model: the count needs no trained base
    tokenizer = build_tokenizer()
    build = lambda: apply_lora(build_model(cfg, ShapesDataset, tokenizer), cfg.lora)
    inputs = lambda: (torch.zeros(1, 3, 32, 32), torch.full((1,), 0.5), {"input_ids": torch.ones(1, 7).long()})
    with torch.device("meta"):
        model = use_attention(build(), math_attention)
        x = inputs()
    with FlopCounterMode(display=False) as full:
        model(*x).float().sum().backward()
    assert train_flops_per_sample(build, inputs) == full.get_total_flops() > 0
    monkeypatch.delitem(step_stats.FACTORS, torch.ops.aten.mm)
    assert train_flops_per_sample(build, inputs) == full.get_total_flops()


def test_flop_count_does_not_depend_on_the_attention_kernel():
    """flash-attn's kernels are custom ops in which the flop counter sees no FLOPs (and an FA2 build may have no
    meta kernel): MFU counts attention with the math formula whatever kernel trains."""
    from models.attention import sdpa_attention

    @torch.library.custom_op("mmdit_test::opaque_attention", mutates_args=())
    def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    @opaque_attention.register_fake
    def _(q, k, v):
        return torch.empty_like(q)

    opaque_attention.register_autograd(lambda ctx, grad: (grad, grad, grad))
    cfg = load_config(overrides=["model.num_layers=2"])
    tokenizer = build_tokenizer()
    inputs = lambda: (torch.zeros(1, 3, 32, 32), torch.full((1,), 0.5), {"input_ids": torch.ones(1, 7).long()})
    counts = []
    for kernel in (sdpa_attention, math_attention, opaque_attention):
        built = lambda: use_attention(build_model(cfg, ShapesDataset, tokenizer), kernel)  # noqa: E731
        counts.append(train_flops_per_sample(built, inputs))
    assert counts[0] == counts[1] == counts[2] > 0


def test_wandb_offline_writes_a_run_directory(tiny, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(tiny("training.max_steps=2", "logging.wandb.enabled=true", "logging.wandb.mode=offline")) == 0
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    records = list(runs[0].glob("*.wandb"))
    assert len(runs) == 1 and len(records) == 1
    assert b"attention_head_dim" in records[0].read_bytes()  # the resolved config is attached


def test_a_missing_wandb_is_a_warning(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    assert main(tiny("training.max_steps=2", "logging.wandb.enabled=true")) == 0
    assert "wandb is off" in caplog.text
    assert [r["step"] for r in rows(tmp_path / "run") if "loss" in r] == [1, 2]


def test_launcher_enable_profiling(tmp_path):
    """ENABLE_PROFILING=true ./train_mmdit_stable.sh: a trace that TensorBoard's profiler tab loads."""
    from tests.conftest import TINY
    env = {**os.environ, "ENABLE_PROFILING": "true", "PROFILE_STEPS": "2"}
    out = subprocess.run([str(ROOT / "train_mmdit_stable.sh"), *TINY, "training.max_steps=10",
                          f"logging.output_dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "profiling is on" in out.stderr
    assert "Trace" in {view.display_name for view in load_with_tb_profiler(tmp_path / "tensorboard").views}


@pytest.mark.parametrize("name,dtype,tf32,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989.4), ("NVIDIA H100 PCIe", "bf16", True, 756.0),
    ("NVIDIA H100 NVL", "fp16", True, 835.5), ("NVIDIA H200", "bf16", True, 989.4),
    ("NVIDIA H200 NVL", "bf16", True, 835.5), ("NVIDIA H800", "bf16", True, 989.4),
    ("NVIDIA A800-SXM4-80GB", "bf16", True, 312.0), ("NVIDIA A100-SXM4-40GB", "fp32", True, 156.0),
    ("NVIDIA A100-PCIE-80GB", "fp32", False, 19.5), ("NVIDIA B200", "bf16", True, 2250.0),
    ("NVIDIA GB200", "bf16", True, 2500.0), ("NVIDIA L40S", "bf16", True, 362.1), ("NVIDIA L4", "bf16", True, 121.0),
    ("NVIDIA A10G", "bf16", True, 70.0), ("NVIDIA GeForce RTX 4090", "bf16", True, 165.2),
    ("NVIDIA RTX A6000", "bf16", True, None), ("Tesla T4", "fp16", True, None)])
def test_peak_flops_of_known_gpus(name, dtype, tf32, expected):
    from runtime.step_stats import known_peak_tflops
    assert known_peak_tflops(name, dtype, tf32) == expected


def test_an_unknown_gpu_gets_no_mfu_and_one_line_saying_why(monkeypatch, caplog):
    import logging

    from runtime.step_stats import peak_flops
    caplog.set_level(logging.INFO, logger="mmdit")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA RTX A6000")
    assert peak_flops(torch.device("cuda"), "bf16", True, 0.0) is None
    assert "MFU is not reported: the peak FLOP/s of NVIDIA RTX A6000 is not known" in caplog.text
    assert peak_flops(torch.device("cuda"), "bf16", True, 150.0) == 150e12  # logging.peak_tflops


def test_torchao_is_imported_only_by_a_run_that_uses_it_and_quietly(monkeypatch, caplog):
    """transformers and peft import torchao at start-up whenever it is installed, and its import logs warnings
    about kernels and triton that say nothing about a run (what a LoRA run printed first). A run without float8
    sees no torchao (and imports none); one with float8 keeps its import warnings out of the log, not its errors."""
    import importlib.util

    from runtime.quiet_imports import torchao_only_if
    monkeypatch.delitem(sys.modules, "torchao", raising=False)  # as in a fresh process (restored after)
    with torchao_only_if(used=False):
        assert importlib.util.find_spec("torchao") is None
        with pytest.raises(ImportError):
            import torchao  # noqa: F401
    assert "torchao" not in sys.modules
    with torchao_only_if(used=True):
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("torch.utils._pytree").warning("register_constant() on Enum subclasses is deprecated")
        logging.getLogger("torchao.kernel").error("a real failure")
    assert "Failed to load" not in caplog.text and "deprecated" not in caplog.text and "a real failure" in caplog.text
    logging.getLogger("torchao").warning("after the run")
    assert "after the run" in caplog.text
