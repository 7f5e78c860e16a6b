"""Generate one PNG per prompt line with a trained MMDiT.

    python sample_mmdit.py --checkpoint PATH --prompts FILE --out DIR [--steps N] [--cfg W] [--seed S]

PATH is a run directory (its newest complete checkpoint is used) or one checkpoint directory. Images are
written as 0000.png, 0001.png, ... in prompt order, from the EMA weights unless --no-ema is given.
"""

import argparse
import logging
import sys
from pathlib import Path

from configs.schema import ConfigError, load_config
from data.images import save_png
from data.shapes import ShapesDataset
from models.pipeline import build_model, build_tokenizer, generate
from perf.checkpoint import find_checkpoint, read_checkpoint

log = logging.getLogger("mmdit")


def load_for_sampling(path: Path, use_ema: bool = True):
    try:
        checkpoint = find_checkpoint(path)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        cfg = load_config(checkpoint / "config.yaml")
    except ConfigError as e:
        raise SystemExit(f"{checkpoint}: {e}") from None
    tokenizer = build_tokenizer()
    model = build_model(cfg, ShapesDataset, tokenizer)
    tensors, _ = read_checkpoint(checkpoint)
    model.load_state_dict(tensors["model"])
    if use_ema:
        result = model.load_state_dict(tensors["ema"], strict=False)  # every trained parameter, no buffers
        buffers = {name for name, _ in model.named_buffers()}
        if result.unexpected_keys or set(result.missing_keys) - buffers:
            raise SystemExit(f"{checkpoint}: EMA weights do not match the model "
                             f"(missing {sorted(set(result.missing_keys) - buffers)[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]})")
    return model.eval(), tokenizer, cfg, checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path, help="run directory or checkpoint directory")
    parser.add_argument("--prompts", required=True, type=Path, help="text file, one prompt per line")
    parser.add_argument("--out", required=True, type=Path, help="output directory for NNNN.png")
    parser.add_argument("--steps", type=int, help="Euler steps (default: the run's sampling.steps)")
    parser.add_argument("--cfg", type=float, help="guidance scale (default: the run's sampling.cfg_scale)")
    parser.add_argument("--seed", type=int, default=0, help="image i uses noise keyed by (seed, i)")
    parser.add_argument("--no-ema", action="store_true", help="use the raw trained weights instead of the EMA")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    if not args.prompts.is_file():
        raise SystemExit(f"prompts file {args.prompts} does not exist")
    prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"prompts file {args.prompts} has no prompts")
    model, tokenizer, cfg, checkpoint = load_for_sampling(args.checkpoint, use_ema=not args.no_ema)
    try:
        tokenizer(prompts)
    except ValueError as e:
        raise SystemExit(f"{args.prompts}: {e}") from None
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    steps = cfg.sampling.steps if args.steps is None else args.steps
    cfg_scale = cfg.sampling.cfg_scale if args.cfg is None else args.cfg
    shape = (ShapesDataset.latent_channels, *ShapesDataset.latent_sizes[0])
    images = generate(model, tokenizer, prompts, args.seed, steps, cfg_scale, cfg.sampling.shift, shape)
    for i, image in enumerate(images):
        save_png(image, args.out / f"{i:04d}.png")
    log.info("wrote %d images to %s from %s (%d steps, cfg %.1f, %s weights)", len(images), args.out,
             checkpoint, steps, cfg_scale, "raw" if args.no_ema else "EMA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
