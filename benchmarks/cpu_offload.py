"""What parallel.cpu_offload costs per step: the AdamW step on the host, measured here, and the copies between
host and GPU, by arithmetic.

    python benchmarks/cpu_offload.py [--params 100e6] [--rounds 5] [--out benchmarks/cpu_offload.json]

Measured: the fused AdamW step (the kernel the trainer uses; `torch.optim.AdamW(fused=True)`) on fp32
parameters in host memory, in seconds per billion parameters, with this machine's cores. Projected: FSDP2's
offload copies each rank's fp32 weight shards to the GPU once per step (then all-gathers them in the compute
dtype) and its fp32 gradient shards back: 8 bytes per parameter of the shard per step, at the stated PCIe
bandwidth. The optimizer step does not overlap the next forward (it must finish first), the copies overlap
compute only partly.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PCIE_GBPS = {"PCIe 4.0 x16 (A100)": 25.0, "PCIe 5.0 x16 (H100 PCIe/SXM host link)": 50.0}  # sustained, one way


def adamw_seconds(params: int, rounds: int) -> float:
    tensors = [torch.randn(params // 8) for _ in range(8)]  # a few large tensors, as FSDP shards are
    for t in tensors:
        t.grad = torch.randn_like(t) * 1e-3
    optimizer = torch.optim.AdamW(tensors, lr=1e-4, fused=True)
    optimizer.step()  # makes the state
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "cpu_offload.json")
    args = parser.parse_args()
    params = int(args.params)
    seconds = adamw_seconds(params, args.rounds)
    per_billion = seconds / params * 1e9
    print(f"fused AdamW on the host ({torch.get_num_threads()} threads): {seconds:.3f} s for {params / 1e6:.0f}M "
          f"parameters = {per_billion:.1f} s per billion parameters per step")
    rows = []
    for model, total in (("SD3.5-large full fine-tune", 8.1e9), ("SD3.5-medium full fine-tune", 2.5e9)):
        for gpus in (1, 8):
            shard = total / gpus
            row = {"model": model, "gpus": gpus, "params_per_rank": shard,
                   "host_adamw_s_here": shard / 1e9 * per_billion,
                   "copies_s": {link: 8 * shard / (gbps * 1e9) for link, gbps in PCIE_GBPS.items()}}
            rows.append(row)
            print(f"  {model} on {gpus} GPU(s): {shard / 1e9:.2f}B parameters per rank; AdamW on this host "
                  f"{row['host_adamw_s_here']:.1f} s; copies " + ", ".join(
                      f"{s:.2f} s over {link}" for link, s in row["copies_s"].items()))
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "measured_params": params,
                                    "adamw_s": seconds, "adamw_s_per_billion": per_billion, "projection": rows},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
