"""Training-thread stall per checkpoint save: async (a copy into host memory by torch's stager, then a background
write) against synchronous, in one process, under 2-rank DDP and under 2-rank FSDP.

    python benchmarks/checkpoint_stall.py [--layers 8 --heads 8 --saves 5 --out benchmarks/checkpoint_stall.json]

Each rank builds an MMDiT with AdamW state and EMA (the full state a training checkpoint holds), wrapped as the
strategy does, and saves it through the real `Checkpointer` in rounds that alternate async and sync saves (the
machine's noise then hits both alike). The stall is the time `save()` kept the caller busy; the async write
is waited for between saves (outside the timed region), as a run with a sensible checkpoint.every never has
two saves overlap. "Copy left" is what an optimizer step right after the save would wait for: the part of
the background copy into host memory still running (in training it overlaps the next forward and backward).
Medians over the rounds, with the host memory the staging holds per rank. "Small ops after / before" is the
training thread's time for many small ops (a tiny model's step is made of them) after the saves against before
them: a background copy thread that kept its own OpenMP team alive once made it 2.9x (and the default run 35 %
slower after its first save); 1.0 means the saves leave the training thread as fast as they found it.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names


def small_ops_s() -> float:
    """Best of five: the calling thread's time for 2000 small matmuls and reductions."""
    x, w = torch.randn(256, 128), torch.randn(128, 128)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            (x @ w).relu_().sum()
        times.append(time.perf_counter() - start)
    return min(times)


def rank_stalls(strategy: str, layers: int, heads: int, saves: int, run_dir: str, result_file: str) -> None:
    """One rank of one strategy: the stall of each async and each sync save, alternating."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from models.sd3.model import MMDiT, MMDiTConfig
    from optim.ema import EMA
    from perf.checkpoint import Checkpointer, OptimizerState, TrainedWeights
    torch.set_num_threads(1 if strategy != "one process" else 2)
    if strategy != "one process":
        dist.init_process_group("gloo")
    cfg = MMDiTConfig(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
                      attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=256,
                      caption_projection_dim=64 * heads, pooled_projection_dim=256, pos_embed_max_size=32)
    torch.manual_seed(0)
    model = MMDiT(cfg)
    if strategy == "FSDP x2":
        mesh = init_device_mesh("cpu", (2,))
        for block in model.transformer_blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy == "DDP x2":
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # materialise exp_avg / exp_avg_sq
    ema = EMA(model.module if strategy == "DDP x2" else model, 0.999)
    states = {"model": TrainedWeights(model), "ema": ema, "optimizer": OptimizerState(model, optimizer)}
    stalls = {"async": [], "sync": [], "async copy left after save": []}
    checkpointers = {mode: Checkpointer(Path(run_dir) / mode, SimpleNamespace(
        every=1, keep_last=1, async_save=mode == "async", fail_on_error=True), states, {}, {}, torch.device("cpu"))
        for mode in ("async", "sync")}
    small_ops_before = small_ops_s()
    for step in range(1, saves + 1):
        for mode, checkpointer in checkpointers.items():
            checkpointer.save(step)
            stalls[mode].append(checkpointer.last_stall_s)
            if mode == "async":  # what an optimizer step right after the save would wait for (the pre-hook)
                start = time.perf_counter()
                checkpointer.wait_for_staging()
                stalls["async copy left after save"].append(time.perf_counter() - start)
            checkpointer.wait()
    small_ops_after = small_ops_s()
    for checkpointer in checkpointers.values():
        checkpointer.close()
    staging = checkpointers["async"].staging_bytes
    if strategy != "one process":
        dist.destroy_process_group()
    Path(result_file).write_text(json.dumps({"stalls": stalls, "staging_mib": staging / 2**20,
                                              "small_ops_after_over_before": small_ops_after / small_ops_before}))


def spawned_rank(rank: int, world: int, port: int, *args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank_stalls(*args[:-1], f"{args[-1]}.{rank}")


def measure(strategy: str, layers: int, heads: int, saves: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        if strategy == "one process":
            rank_stalls(strategy, layers, heads, saves, tmp, f"{result}.0")
        else:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            torch.multiprocessing.spawn(spawned_rank, args=(2, port, strategy, layers, heads, saves, tmp, str(result)),
                                        nprocs=2)
        rank0 = json.loads(Path(f"{result}.0").read_text())
    out = {mode: statistics.median(values) for mode, values in rank0["stalls"].items()}
    return {"async_stall_s": out["async"], "sync_stall_s": out["sync"], "ratio": out["async"] / out["sync"],
            "copy_left_after_save_s": out["async copy left after save"],
            "staging_mib_per_rank": rank0["staging_mib"],
            "small_ops_after_over_before": rank0["small_ops_after_over_before"], "rounds": saves,
            "stalls_s": rank0["stalls"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "checkpoint_stall.json")
    args = parser.parse_args()
    results = {}
    print(f"{'strategy':<12} {'async stall (s)':>16} {'sync stall (s)':>15} {'async/sync':>11} "
          f"{'copy left (s)':>14} {'staging MiB/rank':>17} {'small ops after/before':>23}")
    for strategy in ("one process", "DDP x2", "FSDP x2"):
        r = results[strategy] = measure(strategy, args.layers, args.heads, args.saves)
        print(f"{strategy:<12} {r['async_stall_s']:>16.4f} {r['sync_stall_s']:>15.4f} {r['ratio']:>11.3f} "
              f"{r['copy_left_after_save_s']:>14.4f} {r['staging_mib_per_rank']:>17.1f} "
              f"{r['small_ops_after_over_before']:>23.2f}", flush=True)
    params = 64 * args.heads
    args.out.write_text(json.dumps({"layers": args.layers, "width": params, "device": "cpu", "results": results},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
