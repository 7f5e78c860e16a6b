"""Training-thread stall per checkpoint save: async (CPU snapshot + background write) vs synchronous.

    python benchmarks/checkpoint_stall.py [--layers 8 --heads 8 --saves 5 --out benchmarks/checkpoint_stall.json]

Builds an MMDiT with AdamW state and EMA (the full state a training checkpoint holds), saves it repeatedly in
each mode into a temporary run directory, and reports the median time `save()` kept the caller busy. The
async write is waited for between saves (outside the timed region), as a training run with a sensible
save_freq would never have two saves overlap.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.mmdit import MMDiT, MMDiTConfig  # noqa: E402
from optim.ema import EMA  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: E402

from perf.checkpoint import Checkpointer  # noqa: E402


def training_state(layers: int, heads: int, device: torch.device):
    cfg = MMDiTConfig(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
                      attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=256,
                      caption_projection_dim=64 * heads, pooled_projection_dim=256, pos_embed_max_size=32)
    model = MMDiT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # materialise exp_avg / exp_avg_sq
    ema = EMA(model, 0.999)
    # what the training loop checkpoints (train_mmdit_stable.checkpoint_state): AdamW state keyed by name
    state = {"model": model.state_dict(), "ema": ema.state_dict(),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    return state, {"step": 1}, sum(p.numel() for p in model.parameters())


def tensors_of(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors_of(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors_of(value)


def measure(async_save: bool, tensors, meta, saves: int) -> dict:
    stalls, totals = [], []
    with tempfile.TemporaryDirectory() as run_dir:
        checkpointer = Checkpointer(Path(run_dir), keep_last=1, async_save=async_save, fail_on_error=True)
        for step in range(1, saves + 1):
            start = time.perf_counter()
            checkpointer.save(step, tensors, meta, {})
            stalls.append(checkpointer.last_stall_s)
            checkpointer.wait()
            totals.append(time.perf_counter() - start)
        checkpointer.close()
        staging = checkpointer.staging_bytes()
    return {"median_stall_s": statistics.median(stalls), "median_save_total_s": statistics.median(totals),
            "stalls_s": stalls, "staging_mib": staging / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "checkpoint_stall.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    tensors, meta, params = training_state(args.layers, args.heads, device)
    state_mib = sum(t.numel() * t.element_size() for t in tensors_of(tensors)) / 2**20
    results = {"device": str(device), "params": params, "state_mib": state_mib, "saves": args.saves,
               "sync": measure(False, tensors, meta, args.saves), "async": measure(True, tensors, meta, args.saves)}
    results["stall_ratio_async_over_sync"] = results["async"]["median_stall_s"] / results["sync"]["median_stall_s"]
    print(f"state: {params / 1e6:.1f}M params, {state_mib:.0f} MiB to save, device {device}")
    print(f"{'mode':<6} {'median stall (s)':>17} {'median save total (s)':>22}")
    for mode in ("sync", "async"):
        r = results[mode]
        print(f"{mode:<6} {r['median_stall_s']:>17.4f} {r['median_save_total_s']:>22.4f}")
    print(f"async stall / sync stall = {results['stall_ratio_async_over_sync']:.3f}")
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
