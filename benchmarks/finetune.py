"""Full fine-tune against LoRA on the same MMDiT: step time, trained parameters, training-state memory and
checkpoint size.

    python benchmarks/finetune.py [--layers 8 --heads 8 --latent 32 --batch 4 --steps 8 --rounds 2
                                   --out benchmarks/finetune_cpu.json]

One step is forward + backward + AdamW (+ EMA), on SD3-shaped inputs (16 latent channels, patch 2, 77 + 64
text tokens). The two modes are measured in alternating rounds in one process and the median step time of
each is reported, so machine noise hits both alike. Memory is counted, not sampled: the bytes of gradients,
Adam moments and EMA that each mode keeps (the frozen weights are the same in both).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.families import SD3_LORA_TARGETS  # noqa: E402
from models.lora import apply_lora  # noqa: E402
from models.sd3.model import MMDiT, MMDiTConfig  # noqa: E402
from models.rectified_flow import per_sample_loss  # noqa: E402
from models.text_encoder import TextToImage  # noqa: E402
from optim.ema import EMA  # noqa: E402

TEXT_TOKENS, JOINT, POOLED = 77 + 64, 256, 128


def build(layers: int, heads: int, lora_rank: int) -> TextToImage:
    torch.manual_seed(0)
    cfg = MMDiTConfig(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=layers,
                      attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=JOINT,
                      caption_projection_dim=64 * heads, pooled_projection_dim=POOLED, pos_embed_max_size=64)
    model = TextToImage(MMDiT(cfg))
    for p in model.parameters():  # released-like weights: non-zero gates, so adapters get gradients
        p.data.normal_(0, 0.02)
    lora = SimpleNamespace(enabled=lora_rank > 0, rank=lora_rank, alpha=lora_rank, dropout=0.0,
                           target_modules=list(SD3_LORA_TARGETS), use_dora=False, use_rslora=False, text_encoders=[])
    return apply_lora(model, lora)


class Mode:
    """A model's training step (forward + backward + AdamW + EMA), timed, and the training state it keeps
    (benchmarks/lora_variants.py's modes are these with their own text input)."""

    def __init__(self, name: str, model: TextToImage):
        self.name, self.model = name, model
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=1e-5, fused=True)
        self.ema = EMA(model, 0.999)
        self.times = []

    def loss(self, batch: tuple) -> torch.Tensor:
        x, context, pooled, sigma, noise = batch
        x_t = x * (1 - sigma[:, None, None, None]) + noise * sigma[:, None, None, None]
        v = self.model(x_t, sigma, {"prompt_embeds": context, "pooled_prompt_embeds": pooled})
        return per_sample_loss(v, x, noise).mean()

    def step(self, batch: tuple, step: int) -> float:
        start = time.perf_counter()
        self.loss(batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.ema.update(step)
        return time.perf_counter() - start

    def state_bytes(self) -> dict[str, int]:
        moments = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        grads = sum(p.numel() * p.element_size() for p in self.trained)
        ema = sum(t.numel() * t.element_size() for t in self.ema.state_dict().values())
        return {"gradients": grads, "adam_moments": moments, "ema": ema}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--latent", type=int, default=32, help="latent side (32: a 256-px image through the SD3 VAE)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "finetune_cpu.json")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch, 16, args.latent, args.latent, generator=gen),
             torch.randn(args.batch, TEXT_TOKENS, JOINT, generator=gen), torch.randn(args.batch, POOLED, generator=gen),
             torch.rand(args.batch, generator=gen), torch.randn(args.batch, 16, args.latent, args.latent, generator=gen))
    modes = [Mode("full", build(args.layers, args.heads, 0)),
             Mode(f"lora r{args.rank}", build(args.layers, args.heads, args.rank))]
    for mode in modes:
        mode.step(batch, 0)  # warm-up: allocator, optimizer state
    for _ in range(args.rounds):
        for mode in modes:
            mode.times += [mode.step(batch, s) for s in range(1, args.steps + 1)]

    rows = []
    for mode in modes:
        state = mode.state_bytes()
        rows.append({"mode": mode.name, "median_step_s": statistics.median(mode.times),
                     "trained_params": sum(p.numel() for p in mode.trained),
                     "total_params": sum(p.numel() for p in mode.model.parameters()),
                     "training_state_mib": sum(state.values()) / 2**20, **{f"{k}_mib": v / 2**20 for k, v in state.items()},
                     # a checkpoint holds the trained weights (as many bytes as their gradients), EMA and moments
                     "checkpoint_mib": (state["gradients"] + state["ema"] + state["adam_moments"]) / 2**20})
    full = rows[0]["median_step_s"]
    print(f"{'mode':<10} {'step s':>8} {'vs full':>8} {'trained':>12} {'grad+Adam+EMA MiB':>18} {'ckpt MiB':>9}")
    for r in rows:
        print(f"{r['mode']:<10} {r['median_step_s']:>8.3f} {r['median_step_s'] / full:>8.2f} {r['trained_params']:>12,} "
              f"{r['training_state_mib']:>18.1f} {r['checkpoint_mib']:>9.1f}")
    result = {"config": vars(args) | {"out": str(args.out)}, "device": "cpu", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
