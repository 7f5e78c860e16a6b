"""Peak host memory of each training process at start, for a LoRA fine-tune of a 0.87B-parameter SD3-style
transformer (SD3.5-large's width: 38 heads x 64, 4 blocks), in one process and on 2 FSDP ranks.

    python benchmarks/host_memory.py [--tree PATH] [--out benchmarks/host_memory.json]

Makes (once, in --work) a random "released" transformer in diffusers' layout, saved in bf16 as released models
are, and a small latent dataset with SD3's shapes (16 channels, 4096-wide text tokens, 2048-wide pooled
text); then trains one step with each layout through the launcher of the checkout at --tree (default: this
one; another checkout measures an earlier version) and reports rank 0's peak resident memory from its
metrics row (`memory/peak_rss_gib`: the process's maximum RSS, start-up included).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

ARCHITECTURE = dict(sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=4, attention_head_dim=64,
                    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=38 * 64,
                    pooled_projection_dim=2048, pos_embed_max_size=16, qk_norm="rms_norm")


def make_inputs(work: Path) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    from data.latents import shard_record, write_index
    from models.diffusers_io import export_diffusers_transformer
    from models.sd3.model import MMDiT, MMDiTConfig
    base, data = work / "base", work / "data"
    if not base.exists():
        torch.manual_seed(0)
        model = MMDiT(MMDiTConfig(**ARCHITECTURE))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        export_diffusers_transformer(model, base, dtype=torch.bfloat16)
        print(f"base: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters in {base}", flush=True)
    if not data.exists():
        data.mkdir(parents=True)
        generator = torch.Generator().manual_seed(0)
        n = 16
        name, captions = "shard-00000-16x16.safetensors", [f"c{i}" for i in range(n)]
        save_file({"latents": torch.randn(n, 16, 16, 16, generator=generator).half(),
                   "prompt_embeds": torch.randn(n, 16, 4096, generator=generator).half(),
                   "pooled_prompt_embeds": torch.randn(n, 2048, generator=generator).half()},
                  data / name, metadata={"captions": json.dumps(captions)})
        # dataset.json lists the shards (what earlier versions read) beside this version's index
        write_index(data, [shard_record(data, name, n, (16, 16))], [captions],
                    {"channels": 16, "text_embeddings": True, "text_tokens": 16, "text_dims": [4096, 2048],
                     "flipped": False})
    return base, data


def peak_rss(tree: Path, processes: int, base: Path, data: Path, run_dir: Path) -> float:
    strategy = "fsdp" if processes > 1 else "ddp"
    overrides = ["data.name=latents", f"data.path={data}", f"model.init_from={base}", "lora.enabled=true",
                 "lora.rank=16", "training.max_steps=1", "training.train_batch_size=2", "logging.log_every=1",
                 f"parallel.strategy={strategy}", "training.dtype=bf16", f"logging.output_dir={run_dir}"]
    env = {**os.environ, "NPROC_PER_NODE": str(processes), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    config = run_dir.parent / "finetune.yaml"  # no sizes of its own: they come from model.init_from
    config.write_text("training:\n  seed: 0\n")
    proc = subprocess.run([str(tree / "train_mmdit_stable.sh"), "--config", str(config), *overrides], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{processes} process(es) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return rows[-1]["memory/peak_rss_gib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose launcher trains")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mmdit-host-memory")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "host_memory.json")
    args = parser.parse_args()
    base, data = make_inputs(args.work)
    results = {}
    for processes in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            results[f"{processes} process(es)"] = peak_rss(args.tree.resolve(), processes, base, data, Path(tmp) / "run")
        print(f"  {processes} process(es), {'FSDP' if processes > 1 else 'one process'}: rank 0 peak RSS "
              f"{results[f'{processes} process(es)']:.2f} GiB", flush=True)
    record = json.loads(args.out.read_text()) if args.out.is_file() else {}
    record[str(args.tree.resolve())] = results
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
