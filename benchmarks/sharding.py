"""Sharded training on this machine, and what it means for SD3.5-large on GPUs.

    python benchmarks/sharding.py [--steps 6] [--out benchmarks/sharding_cpu.json]

Measured (CPU, gloo, the real training loop through ./train_mmdit_stable.sh): per-rank training state
(`memory/train_state_gib`: the rank's parameters, gradients, AdamW state and EMA) and peak RSS of rank 0, and
step time, for 1, 2 and 4 processes under DDP, FSDP and HSDP (2 shards x 2 replicas), at the same global
batch. (The checkpoint stall is benchmarks/checkpoint_stall.py's.)

Projected (arithmetic, plus autograd's saved tensors counted on the meta device, which allocates nothing):
SD3.5-large full fine-tuning at 1024 px on 8, 16 and 64 GPUs of 80 GB: training state per GPU, activation
memory per sample with and without activation checkpointing, and the largest micro-batch that fits.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names
# A 74M-parameter MMDiT (8 blocks of width 512) on the shapes data: big enough that its training state
# (~1.4 GB in one process) dominates the runtime's own memory.
MODEL = ["model.num_layers=8", "model.num_attention_heads=8", "model.attention_head_dim=64",
         "text_encoder.dim=128", "sampling.steps=1", "sampling.grid_size=4", "logging.log_every=1"]
GLOBAL_BATCH = 8
RUNS = [  # (name, processes, strategy overrides)
    ("1 process", 1, []),
    ("DDP x2", 2, ["parallel.strategy=ddp"]),
    ("FSDP x2", 2, ["parallel.strategy=fsdp"]),
    ("DDP x4", 4, ["parallel.strategy=ddp"]),
    ("FSDP x4", 4, ["parallel.strategy=fsdp"]),
    ("HSDP 2x2", 4, ["parallel.strategy=hsdp", "parallel.shard_size=2"]),
]
GIB = 2**30


def train(processes: int, overrides: list[str], run_dir: Path) -> list[dict]:
    env = {**os.environ, "NPROC_PER_NODE": str(processes), "OMP_NUM_THREADS": str(max(1, 2 // processes)),
           "PYTHON": sys.executable}
    micro = GLOBAL_BATCH // processes
    proc = subprocess.run([str(ROOT / "train_mmdit_stable.sh"), *MODEL, *overrides,
                           f"training.train_batch_size={micro}", f"logging.output_dir={run_dir}"],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{overrides} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def measure(steps: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, processes, overrides in RUNS:
            metrics = train(processes, [*overrides, f"training.max_steps={steps}", "checkpoint.every=0"],
                            Path(tmp) / name.replace(" ", "_"))
            steady = metrics[len(metrics) // 2:]  # after start-up
            rows.append({"run": name, "processes": processes, "train_state_gib": metrics[-1]["memory/train_state_gib"],
                         "peak_rss_gib": metrics[-1]["memory/peak_rss_gib"],
                         "step_s": statistics.median(r["time/step_s"] for r in steady)})
            print(f"  {name}: {rows[-1]}", flush=True)
    return rows


def sd35_large_projection(gpus: tuple[int, ...] = (8, 16, 64), gpu_gib: float = 80.0) -> dict:
    """Training state per GPU under FSDP (fp32 weights, gradients, AdamW moments, EMA: 20 bytes per parameter,
    sharded N ways; bf16 weights of the blocks in flight are gathered); activations per 1024-px sample from
    autograd's saved tensors of one block, counted on the meta device, in bf16."""
    from models.attention import math_attention, use_attention
    from models.sd3.model import MMDiT, MMDiTConfig
    cfg = MMDiTConfig(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                      attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                      caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                      qk_norm="rms_norm")
    with torch.device("meta"):
        model = MMDiT(cfg)
    params = sum(p.numel() for p in model.parameters())
    block_params = sum(p.numel() for p in model.transformer_blocks[0].parameters())
    tokens, text = (1024 // 8 // 2) ** 2, 333  # 1024 px -> 128x128 latents -> 64x64 patches; CLIP 77x2 + T5 256
    saved = {}
    for kernel, name in ((math_attention, "math attention (scores kept: L^2)"), (None, "flash attention")):
        if kernel is not None:
            use_attention(model, kernel)
        saved[name] = block_saved_bytes(model, tokens, text, cfg.hidden_size, flash=kernel is None)
    per_sample = saved["flash attention"]
    checkpointed = (tokens + text) * cfg.hidden_size * 2  # each checkpointed block keeps its inputs x, c (bf16)
    out = {"parameters": params, "hidden": cfg.hidden_size, "blocks": cfg.num_layers, "image_tokens": tokens,
           "text_tokens": text, "block_saved_bytes_per_sample": saved, "rows": []}
    for n in gpus:
        state = 20 * params / n
        # gathered bf16 weights of the running block and the prefetched one (2 x 2 bytes), plus one block's
        # unsharded fp32 gradient before its reduce-scatter (4 bytes)
        in_flight = (2 * 2 + 4) * block_params
        free = gpu_gib * GIB * 0.9 - state - in_flight  # 10 % for the allocator, CUDA context and buffers
        full = cfg.num_layers * per_sample
        ckpt = cfg.num_layers * checkpointed + per_sample  # + one block recomputed in backward
        out["rows"].append({"gpus": n, "state_gib": state / GIB, "gathered_blocks_gib": in_flight / GIB,
                            "activations_gib_per_sample": full / GIB,
                            "activations_gib_per_sample_checkpointed": ckpt / GIB,
                            "max_micro_batch": int(free // full), "max_micro_batch_checkpointed": int(free // ckpt)})
    return out


def block_saved_bytes(model, tokens: int, text: int, hidden: int, flash: bool) -> int:
    """Bytes autograd saves for backward in one joint block at batch 1 in bf16, counted on the meta device.
    With `flash`, the attention is counted as a flash kernel saves it (q, k, v, output, log-sum-exp)."""
    from torch.autograd.graph import saved_tensors_hooks

    from models import attention
    total = [0]
    block = model.transformer_blocks[0]
    weights = {id(p) for p in block.parameters()}

    def pack(t):
        if id(t) not in weights and id(t._base) not in weights:  # weights are not activations
            total[0] += t.numel() * 2  # bf16
        return t

    def flash_attention(q, k, v):  # what a flash kernel keeps for backward: inputs, output, row statistics
        total[0] += (q.numel() + k.numel() + v.numel() + q.numel()) * 2 + q.shape[0] * q.shape[1] * q.shape[2] * 4
        with torch.no_grad():
            return attention.math_attention(q, k, v)

    with torch.device("meta"):
        x, c, temb = (torch.empty(1, tokens, hidden, requires_grad=True), torch.empty(1, text, hidden, requires_grad=True),
                      torch.empty(1, hidden, requires_grad=True))
    with attention.attention_kernel(block, flash_attention if flash else block.attn.attention_kernel), \
            saved_tensors_hooks(pack, lambda t: t):
        block(x, c, temb)
    return total[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "sharding_cpu.json")
    parser.add_argument("--projection-only", action="store_true")
    args = parser.parse_args()
    rows = [] if args.projection_only else measure(args.steps)
    projection = sd35_large_projection()
    if rows:
        print(f"\n{'run':<12}{'state GiB/rank':>16}{'vs 1 process':>14}{'peak RSS GiB':>14}{'step s':>9}")
        one = rows[0]["train_state_gib"]
        for r in rows:
            print(f"{r['run']:<12}{r['train_state_gib']:>16.3f}{r['train_state_gib'] / one:>14.2f}"
                  f"{r['peak_rss_gib']:>14.2f}{r['step_s']:>9.3f}")
    p = projection
    print(f"\nSD3.5-large projection: {p['parameters'] / 1e9:.2f}B parameters, {p['image_tokens']} + "
          f"{p['text_tokens']} tokens at 1024 px")
    for name, value in p["block_saved_bytes_per_sample"].items():
        print(f"  one block saves {value / GIB:.2f} GiB per sample with {name}")
    print(f"{'GPUs':>5}{'state GiB':>11}{'acts GiB/sample':>17}{'with AC':>9}{'max batch':>11}{'with AC':>9}")
    for r in p["rows"]:
        print(f"{r['gpus']:>5}{r['state_gib']:>11.1f}{r['activations_gib_per_sample']:>17.1f}"
              f"{r['activations_gib_per_sample_checkpointed']:>9.2f}{r['max_micro_batch']:>11}"
              f"{r['max_micro_batch_checkpointed']:>9}")
    args.out.write_text(json.dumps({"cpu_runs": rows, "sd35_large": projection,
                                    "global_batch": GLOBAL_BATCH, "torch": torch.__version__}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
