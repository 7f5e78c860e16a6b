"""Generate one PNG per prompt line with a trained MMDiT (or edit one reference image per line with an edit run).

    python sample_mmdit.py --checkpoint PATH --prompts FILE --out DIR [--references DIR] [--steps N] [--cfg W]
        [--seed S]

PATH is a run directory (its newest complete checkpoint is used) or one checkpoint directory. Images are
written as 0000.png, 0001.png, ... in prompt order, from the EMA weights unless --no-ema is given. DIR must not
exist: nothing is ever overwritten. A run of the edit shapes (data.name=shapes_edit) edits images: the prompts are
instructions, and --references DIR holds the image each edits, DIR/0000.png for the first line (as OUT/0000.png is
its result), 0001.png for the second, ... (NNNN_0.png, NNNN_1.png, ... where a run takes several).
"""

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from configs.build import SHAPES, build_data, build_model, build_sampler, build_tokenizer
from configs.schema import load_config
from data.images import save_png, to_unit
from errors import ConfigError, InputError
from models.diffusers_io import load_diffusers_weights, refuse_existing, write_new_directory
from models.lora import apply_lora
from models.families import FAMILIES, open_weights, transformer_of_record
from models.pipeline import generate, initial_noise
from models.text_encoder import TextToImage
from perf.checkpoint import find_checkpoint, read_checkpoint
from runtime.directory_lock import writable_directory
from runtime.quiet_imports import torchao_only_if

log = logging.getLogger("mmdit")


def load_trained(checkpoint: Path, use_ema: bool = True) -> tuple[TextToImage, DictConfig]:
    """The model a checkpoint describes: built from its config (latent runs: from the MMDiT config it
    records, so the data need not be present, unless it adapted SD3's text encoders: their pipeline is found as in
    training), the base weights from model.init_from under LoRA, then the
    checkpoint's trained weights, or their EMA."""
    cfg = load_config(checkpoint / "config.yaml", resolve=False)  # as the run resolved it
    tensors, meta = read_checkpoint(checkpoint)
    if cfg.data.name in SHAPES:
        model = build_model(cfg, SHAPES[cfg.data.name], build_tokenizer(SHAPES[cfg.data.name]))
    elif cfg.lora.enabled and cfg.lora.text_encoders:  # adapted text encoders: the pipeline's, read from its files
        tokenizer = build_data(cfg)[1]
        encoders = FAMILIES[cfg.model.family].text_encoders(tokenizer.folder, tokenizer.max_sequence_length).load(
            torch.device("cpu"), torch.float32)
        model = TextToImage(transformer_of_record(meta.get("family", "sd3"), meta["mmdit"]), encoders)
    else:
        model = TextToImage(transformer_of_record(meta.get("family", "sd3"), meta["mmdit"]))
    if cfg.lora.enabled:
        load_diffusers_weights(model.transformer, Path(cfg.model.init_from), reader=open_weights(cfg.model.init_from))
    apply_lora(model, cfg.lora)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    for part in ("model", "ema") if use_ema else ("model",):
        result = model.load_state_dict(tensors[part], strict=False)  # the EMA covers trained parameters only
        if result.unexpected_keys or trained & set(result.missing_keys):
            raise ConfigError(f"{checkpoint}: {part} weights do not match the model (missing "
                              f"{sorted(trained & set(result.missing_keys))[:5]}, unexpected {result.unexpected_keys[:5]})")
    return model.eval(), cfg


def load_for_sampling(path: Path, use_ema: bool = True):
    checkpoint = find_checkpoint(path)
    cfg = load_config(checkpoint / "config.yaml", resolve=False)
    if cfg.data.name not in SHAPES:
        raise InputError(f"{checkpoint} was trained on precomputed latents: export it (export_mmdit.py) and "
                         f"sample with diffusers' {FAMILIES[cfg.model.family].pipeline_class}")
    model, cfg = load_trained(checkpoint, use_ema)
    return model, build_tokenizer(SHAPES[cfg.data.name]), cfg, checkpoint


def read_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise InputError(f"prompts file {path} does not exist")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"prompts file {path} has no prompts")
    return prompts


def read_references(directory: Path | None, lines: int, name: str, checkpoint: Path) -> tuple[torch.Tensor, ...]:
    """The reference images of an edit run's prompt lines, in [-1, 1] ([lines, 3, h, w] per reference): line i's
    DIR/{i:04d}.png (or {i:04d}_{j}.png, one per reference j); none for a text-to-image run."""
    dataset = SHAPES[name]
    if not dataset.references:
        if directory is not None:
            raise InputError(f"--references {directory}: {checkpoint} generates images from text (its data "
                             f"data.name={name} has no reference images)")
        return ()
    if directory is None or not directory.is_dir():
        raise InputError(f"{checkpoint} edits images: --references DIR must name a folder of the reference images, "
                         f"DIR/0000.png for the first prompt line" + (f" ({directory} is not one)" if directory else ""))
    names = [[f"{i:04d}.png"] if dataset.references == 1 else [f"{i:04d}_{j}.png" for j in range(dataset.references)]
             for i in range(lines)]
    missing = [f"line {i + 1}: {directory / name}" for i, row in enumerate(names) for name in row
               if not (directory / name).is_file()]
    if missing:
        raise InputError(f"--references {directory}: no reference image for {len(missing)} prompt line(s): "
                         f"{'; '.join(missing[:5])}")
    return tuple(torch.stack([reference_pixels(directory / row[j], size) for row in names])
                 for j, size in enumerate(dataset.buckets[0][1]))


def reference_pixels(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """[3, h, w] in [-1, 1] of an image file that must be `size` (h, w) pixels."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as image:
            pixels = torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8).float()
            width, height = image.size
    except (OSError, UnidentifiedImageError) as e:
        raise InputError(f"reference {path} is not a readable image ({e})") from None
    if (height, width) != tuple(size):
        raise InputError(f"reference {path} is {width}x{height} pixels; this run edits {size[1]}x{size[0]} images")
    return pixels.view(height, width, 3).permute(2, 0, 1) / 127.5 - 1


def save_pngs(images: torch.Tensor, directory: Path) -> None:
    for i, image in enumerate(images):
        save_png(image, directory / f"{i:04d}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path, help="run directory or checkpoint directory")
    parser.add_argument("--prompts", required=True, type=Path, help="text file, one prompt per line")
    parser.add_argument("--out", required=True, type=Path, help="new directory for NNNN.png")
    parser.add_argument("--references", type=Path, help="an edit run's reference images: NNNN.png for line NNNN + 1")
    parser.add_argument("--steps", type=int, help="Euler steps (default: the run's sampling.steps)")
    parser.add_argument("--cfg", type=float, help="guidance scale (default: the run's sampling.cfg_scale)")
    parser.add_argument("--seed", type=int, default=0, help="image i uses noise keyed by (seed, i)")
    parser.add_argument("--no-ema", action="store_true", help="use the raw trained weights instead of the EMA")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:  # the user's input (prompts, checkpoint, its config, the output folder): one line, exit 2
        prompts = read_prompts(args.prompts)
        model, tokenizer, cfg, checkpoint = load_for_sampling(args.checkpoint, use_ema=not args.no_ema)
        try:
            tokenizer(prompts)
        except ValueError as e:  # a word outside the dataset's vocabulary
            raise InputError(f"{args.prompts}: {e}") from None
        references = read_references(args.references, len(prompts), cfg.data.name, checkpoint)
        refuse_existing(args.out)  # before the sampling, not after it
        writable_directory(args.out.parent, f"--out {args.out}")
    except (InputError, FileExistsError) as e:
        log.error("sample: %s", e)
        return 2
    steps = cfg.sampling.steps if args.steps is None else args.steps
    cfg_scale = cfg.sampling.cfg_scale if args.cfg is None else args.cfg
    dataset = SHAPES[cfg.data.name]
    shape = (dataset.latent_channels, *dataset.latent_sizes[0])
    noise = initial_noise(args.seed, list(range(len(prompts))), shape)
    sampler = dataclasses.replace(build_sampler(cfg, shape[1:], steps), cfg_scale=cfg_scale)
    x = generate(model, tokenizer(prompts), tokenizer([""]), noise, sampler, references=references)
    images = to_unit(x)
    write_new_directory(args.out, lambda tmp: save_pngs(images, tmp))  # whole or not at all
    log.info("wrote %d images to %s from %s (%d steps, cfg %.1f, %s weights)", len(images), args.out,
             checkpoint, steps, cfg_scale, "raw" if args.no_ema else "EMA")
    return 0


if __name__ == "__main__":
    with torchao_only_if(used=False):  # transformers and peft would import it, and its noise, at start-up
        sys.exit(main())
