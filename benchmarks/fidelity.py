"""Prompt fidelity of a shapes run over several sampling seeds, and under other sampler settings.

    python benchmarks/fidelity.py RUN_DIR [--seeds 0 1 2 3] [--steps N] [--cfg W] [--shift S]
                                  [--interval LOW HIGH] [--no-ema] [--out FILE.json]

One seed judges 90 images, so a single figure moves by several points from seed to seed; the recipe search in
benchmarks/RESULTS.md quotes the mean over seeds and each seed. The images are the ones `sample_mmdit.py`
writes for the same seed (noise keyed by (seed, image index)); defaults come from the run's config.
"""

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from data.images import to_unit  # noqa: E402
from data.shapes import ShapesDataset, all_prompts, caption, prompt_fidelity  # noqa: E402
from configs.build import build_sampler  # noqa: E402
from models.pipeline import Sampler, generate, initial_noise  # noqa: E402
from sample_mmdit import load_for_sampling  # noqa: E402


SHAPE = (ShapesDataset.latent_channels, *ShapesDataset.latent_sizes[0])


def fidelity(model, tokenizer, seed: int, sampler: Sampler) -> dict:
    prompts = all_prompts()
    x = generate(model, tokenizer([caption(*p) for p in prompts]), tokenizer([""]),
                 initial_noise(seed, list(range(len(prompts))), SHAPE), sampler)
    return prompt_fidelity(to_unit(x), prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="run directory or checkpoint directory")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--cfg", type=float)
    parser.add_argument("--shift", type=float)
    parser.add_argument("--interval", type=float, nargs=2)
    parser.add_argument("--no-ema", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, tokenizer, cfg, checkpoint = load_for_sampling(args.checkpoint, use_ema=not args.no_ema)
    s = build_sampler(cfg, SHAPE[1:])
    sampler = dataclasses.replace(s, steps=args.steps or s.steps, cfg_scale=s.cfg_scale if args.cfg is None else args.cfg,
                                  shift=args.shift or s.shift, guidance_interval=tuple(args.interval or s.guidance_interval))
    settings = {"steps": sampler.steps, "cfg": sampler.cfg_scale, "shift": sampler.shift,
                "interval": sampler.guidance_interval}
    torch.set_grad_enabled(False)
    per_seed = {seed: fidelity(model, tokenizer, seed, sampler) for seed in args.seeds}
    mean = {k: statistics.mean(f[k] for f in per_seed.values()) for k in ("color", "shape", "position")}
    for seed, f in per_seed.items():
        print(f"seed {seed}: color {f['color']:.2f} shape {f['shape']:.2f} position {f['position']:.2f}")
    print(f"{checkpoint} {settings}: mean color {mean['color']:.3f} shape {mean['shape']:.3f} "
          f"position {mean['position']:.3f}, shape min {min(f['shape'] for f in per_seed.values()):.2f}")
    if args.out:
        args.out.write_text(json.dumps({"checkpoint": str(checkpoint), "settings": settings, "ema": not args.no_ema,
                                        "per_seed": per_seed, "mean": mean}, indent=1) + "\n")


if __name__ == "__main__":
    main()
