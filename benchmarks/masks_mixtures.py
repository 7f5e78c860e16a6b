"""What masked loss and dataset mixtures cost: step time and memory held for backward with and without a loss
mask, and the batch sampler's time per step for one dataset against a mixture of three.

    python benchmarks/masks_mixtures.py [--layers 2 --heads 4 --latent 32 --batch 4 --steps 8 --rounds 3
                                         --global-batch 256 --out benchmarks/masks_mixtures_cpu.json]

- step: forward + backward of an SD3-shaped MMDiT (16 latent channels, patch 2, 77 + 64 text tokens; as
  benchmarks/finetune.py) with the plain per-sample loss and with a loss mask (half of each image masked out),
  in alternating rounds in one process, median step time of each; the bytes autograd keeps for backward are
  counted (saved-tensor hooks, each storage once), not sampled, and so are the mask's bytes in a batch.
- sampler: StepBatchSampler.global_batch_of for --steps steps of a --global-batch batch, one dataset of 100,000
  items against three datasets (weights 0.6, 0.3, 0.1), median of rounds.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.loader import StepBatchSampler  # noqa: E402
from models.sd3.model import MMDiT, MMDiTConfig  # noqa: E402
from models.rectified_flow import per_sample_loss  # noqa: E402
from models.text_encoder import TextToImage  # noqa: E402

TEXT_TOKENS, JOINT, POOLED, CHANNELS = 77 + 64, 256, 128, 16


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while `fn` runs (each storage counted once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def step_costs(args) -> dict:
    torch.manual_seed(0)
    cfg = MMDiTConfig(sample_size=64, patch_size=2, in_channels=CHANNELS, out_channels=CHANNELS,
                      num_layers=args.layers, attention_head_dim=64, num_attention_heads=args.heads,
                      joint_attention_dim=JOINT, caption_projection_dim=64 * args.heads, pooled_projection_dim=POOLED,
                      pos_embed_max_size=64)
    model = TextToImage(MMDiT(cfg))
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    b, s = args.batch, args.latent
    x0, noise = torch.randn(b, CHANNELS, s, s), torch.randn(b, CHANNELS, s, s)
    sigma = torch.rand(b)
    text = {"prompt_embeds": torch.randn(b, TEXT_TOKENS, JOINT), "pooled_prompt_embeds": torch.randn(b, POOLED)}
    mask = torch.cat([torch.zeros(b, 1, s, s // 2), torch.ones(b, 1, s, s - s // 2)], -1)
    xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise

    def loss(masked: bool) -> torch.Tensor:
        return per_sample_loss(model(xt, sigma, text), x0, noise, mask if masked else None).mean()

    times = {False: [], True: []}
    for _ in range(args.rounds):
        for masked in (False, True):
            for _ in range(args.steps):
                start = time.perf_counter()
                loss(masked).backward()
                times[masked].append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
    plain_saved, masked_saved = saved_bytes(lambda: loss(False)), saved_bytes(lambda: loss(True))
    return {"config": {"layers": args.layers, "heads": args.heads, "latent": s, "batch": b},
            "plain_step_s": statistics.median(times[False]), "masked_step_s": statistics.median(times[True]),
            "saved_for_backward_plain_bytes": plain_saved, "saved_for_backward_masked_bytes": masked_saved,
            "mask_bytes_per_batch": mask.nbytes}


def sampler_costs(args) -> dict:
    one = [np.arange(100_000)]
    three = [np.arange(0, 60_000), np.arange(60_000, 90_000), np.arange(90_000, 100_000)]
    out = {}
    for name, parts, weights in (("one dataset", one, [1.0]), ("three datasets", three, [0.6, 0.3, 0.1])):
        rounds = []
        for _ in range(args.rounds):
            sampler = StepBatchSampler(parts, args.global_batch, 0, 0, 1, 0, args.steps, [None] * len(parts), weights)
            start = time.perf_counter()
            for step in range(1000, 1000 + args.steps):
                sampler.global_batch_of(step)
            rounds.append((time.perf_counter() - start) / args.steps)
        out[name] = statistics.median(rounds)
    return {"global_batch": args.global_batch, "sampler_s_per_step": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 2), ("heads", 4), ("latent", 32), ("batch", 4), ("steps", 8), ("rounds", 3),
                          ("global-batch", 256)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "masks_mixtures_cpu.json")
    args = parser.parse_args()
    results = {"device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
               "step": step_costs(args), "sampler": sampler_costs(args)}
    step, sampler = results["step"], results["sampler"]["sampler_s_per_step"]
    print(f"{'':<34} {'plain':>12} {'masked':>12} {'ratio':>7}")
    print(f"{'step s (forward + backward)':<34} {step['plain_step_s']:>12.4f} {step['masked_step_s']:>12.4f} "
          f"{step['masked_step_s'] / step['plain_step_s']:>7.3f}")
    print(f"{'bytes saved for backward':<34} {step['saved_for_backward_plain_bytes']:>12,} "
          f"{step['saved_for_backward_masked_bytes']:>12,} "
          f"{step['saved_for_backward_masked_bytes'] / step['saved_for_backward_plain_bytes']:>7.4f}")
    print(f"{'sampler ms per step':<34} {'one dataset':>12} {'three':>12}")
    print(f"{f'  global batch {args.global_batch}':<34} {sampler['one dataset'] * 1e3:>12.2f} "
          f"{sampler['three datasets'] * 1e3:>12.2f} {sampler['three datasets'] / sampler['one dataset']:>7.3f}")
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
