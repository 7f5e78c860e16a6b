import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(2)

TINY = ["model.patch_size=4", "model.num_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=16",
        "text_encoder.dim=32", "text_encoder.num_heads=2", "training.train_batch_size=8", "optimizer.warmup_steps=2",
        "sampling.steps=2", "sampling.grid_size=4", "sampling.every=0", "logging.log_every=1", "logging.save_freq=0"]


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metric_rows(run_dir) if "loss" in r]


@pytest.fixture
def tiny(tmp_path):
    """Overrides for a seconds-long run in a fresh run directory; extend with more key=value strings."""
    def make(*extra: str, run: str = "run") -> list[str]:
        return [*TINY, f"logging.output_dir={tmp_path / run}", *extra]
    return make


@pytest.fixture(autouse=True)
def default_attention_kernel():
    """A run may select another attention kernel for the process; tests start from the default."""
    from models.attention import sdpa_attention, set_attention_kernel
    yield
    set_attention_kernel(sdpa_attention)
