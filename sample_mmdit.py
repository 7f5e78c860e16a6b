"""Generate one PNG per prompt with a trained MMDiT: any run (the shapes demo, or a fine-tune on precomputed latents,
full or LoRA) of any family; an edit run of the edit shapes edits one reference image per line.

    python sample_mmdit.py --checkpoint PATH --out DIR [--prompts FILE] [--references DIR] [--pipeline DIR]
                           [--lora-scale X] [--steps N] [--cfg W] [--seed S] [--no-ema] [--device cpu|cuda]

PATH is a run directory (its newest complete checkpoint is used) or one checkpoint directory. Images are written as
0000.png, 0001.png, ... in prompt order, from the EMA weights unless --no-ema is given. DIR must not exist: nothing
is ever overwritten.

A run of the edit shapes (data.name=shapes_edit) edits images: the prompts are instructions, and --references DIR
holds the image each edits, DIR/0000.png for the first line (as OUT/0000.png is its result), 0001.png for the
second, ... (NNNN_0.png, NNNN_1.png, ... where a run takes several). An edit run on latents is not sampled here yet:
its validation images edit held-out items, and its export loads into the family's edit pipeline.

A run on latents is sampled as its validation images are (the family's sampler with the run's sampling.* and
flux.sample_guidance, at its data's commonest latent size, decoded by the VAE its data was encoded with): the lines
of FILE are encoded by the text encoders of the pipeline its precompute recorded (dataset.json); without --prompts,
the validation prompts stored with its data are used. --pipeline points at another copy of that pipeline (its vae/
and text encoders). --lora-scale multiplies a LoRA run's adapters (0: the base model, 1: as trained).
"""

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from configs.build import SHAPES, build_data, build_model, build_sampler, build_tokenizer, latent_decoder
from configs.schema import load_config
from data.images import save_png, to_unit
from errors import ConfigError, InputError
from formats import DTYPES
from models.diffusers_io import load_diffusers_weights, refuse_existing, write_new_directory
from models.families import FAMILIES, open_weights, transformer_of_record
from models.lora import apply_lora
from models.pipeline import generate, initial_noise
from models.pipeline_text import PipelineTextEncoders
from models.text_encoder import TextToImage
from perf.checkpoint import find_checkpoint, read_checkpoint
from perf.precision import autocast
from runtime.directory_lock import writable_directory
from runtime.distributed import World
from runtime.quiet_imports import torchao_only_if

log = logging.getLogger("mmdit")


def run_config(checkpoint: Path) -> DictConfig:
    return load_config(checkpoint / "config.yaml", resolve=False)  # as the run resolved it


def load_trained(checkpoint: Path, use_ema: bool = True,
                 encoders: PipelineTextEncoders | None = None) -> tuple[TextToImage, DictConfig]:
    """The model a checkpoint describes: built from its config (latent runs: from the MMDiT config it records, so the
    data need not be present), with `encoders` (a pipeline's text encoders, loaded) or, where the run adapted its
    pipeline's text encoders, those (found as in training); the base weights from model.init_from under LoRA, then
    the checkpoint's trained weights, or their EMA."""
    cfg = run_config(checkpoint)
    tensors, meta = read_checkpoint(checkpoint)
    if cfg.data.name in SHAPES:
        model = build_model(cfg, SHAPES[cfg.data.name], build_tokenizer(SHAPES[cfg.data.name]))
    else:
        if encoders is None and cfg.lora.enabled and cfg.lora.text_encoders:
            tokenizer = build_data(cfg)[1]
            encoders = FAMILIES[cfg.model.family].text_encoders(tokenizer.folder, tokenizer.max_sequence_length).load(
                torch.device("cpu"), torch.float32)
        model = TextToImage(transformer_of_record(meta.get("family", "sd3"), meta["mmdit"]), encoders)
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
    """A shapes run's model, its tokenizer and config, and the checkpoint (benchmarks/fidelity.py's)."""
    checkpoint = find_checkpoint(path)
    model, cfg = load_trained(checkpoint, use_ema)
    return model, build_tokenizer(SHAPES[cfg.data.name]), cfg, checkpoint


def scale_adapters(model: TextToImage, scale: float) -> None:
    """Multiply every LoRA adapter's output by `scale` (peft's scale_layer: what diffusers' `scale` does)."""
    from peft.tuners.lora import LoraLayer
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.scale_layer(scale)


@dataclasses.dataclass
class Job:
    """What one sampling call needs: the model, the text rows (and the one unconditional row), the shape of a sample,
    and how samples become images in [0, 1]."""
    model: TextToImage
    cfg: DictConfig
    prompts: list[str]
    text: dict
    uncond: dict
    shape: tuple
    decode: object
    references: tuple = ()  # an edit run's reference images, each [N, C, h, w]


def shapes_job(checkpoint: Path, prompts_file: Path | None, references_dir: Path | None, use_ema: bool) -> Job:
    if prompts_file is None:
        raise InputError(f"{checkpoint} is a shapes run: give --prompts FILE (docs/shapes_prompts.txt holds three)")
    prompts = read_prompts(prompts_file)
    name = run_config(checkpoint).data.name
    dataset, tokenizer = SHAPES[name], build_tokenizer(SHAPES[name])
    try:
        text = tokenizer(prompts)
    except ValueError as e:  # a word outside the dataset's vocabulary
        raise InputError(f"{prompts_file}: {e}") from None
    references = read_references(references_dir, len(prompts), name, checkpoint)
    model, cfg = load_trained(checkpoint, use_ema)
    shape = (dataset.latent_channels, *dataset.latent_sizes[0])
    return Job(model, cfg, prompts, text, tokenizer([""]), shape, to_unit, references)  # pixels in [-1, 1]


def latent_job(checkpoint: Path, prompts_file: Path | None, pipeline: Path | None, use_ema: bool,
               device: torch.device) -> Job:
    """A latent run's job: its dataset (for the pipeline, the VAE, the stored prompts and the latent size), the text
    encoders of its pipeline where prompts are new (or the run adapted them), the model in the run's dtype on
    `device`, the VAE decoding there as validation's does."""
    cfg = run_config(checkpoint)
    if pipeline is not None:  # where training found the pipeline's parts, sampling looks now
        cfg.validation.vae_from = str(pipeline)
        if cfg.data.text_encoding == "on_the_fly":
            cfg.data.text_encoders_from = str(pipeline)
    hint = "" if pipeline else "; --pipeline DIR points at another copy of that pipeline"
    try:
        dataset = build_data(cfg)[0]
    except InputError as e:  # the data is gone, or (text encoded in the step) the pipeline
        raise InputError(f"{checkpoint}'s run: {e}{hint if cfg.data.text_encoding == 'on_the_fly' else ''}") from None
    if dataset.references:
        raise InputError(f"{checkpoint} is an edit run on latents, which sample_mmdit.py does not sample yet: its "
                         f"validation images (samples/) edit held-out items, and its export (export_mmdit.py) loads "
                         f"into {' or '.join(FAMILIES[cfg.model.family].edit_pipelines)}")
    decode = latent_decoder(cfg, dataset, World(), device, "--pipeline")
    prompts = read_prompts(prompts_file) if prompts_file else dataset.validation_captions
    if not prompts:
        raise InputError(f"{dataset.directory} holds no validation prompts (precompute_latents.py "
                         f"--validation-prompts): give --prompts FILE")
    stored = prompts_file is None and dataset.validation_prompts is not None and not cfg.lora.text_encoders
    encoders = None if stored else pipeline_encoders(cfg, dataset, pipeline, hint)
    model, cfg = load_trained(checkpoint, use_ema, encoders)
    model.to(device=device, dtype=DTYPES[cfg.training.dtype])
    if stored:
        text = dataset.validation_prompts
        uncond = dataset.negative_prompt or {k: torch.zeros_like(t[:1]) for k, t in text.items()}
    else:
        family = FAMILIES[cfg.model.family]
        tokenizer = family.tokenizers(encoders.folder, dataset.index["max_sequence_length"])
        encode = lambda captions: model.encode({k: v.to(device) for k, v in tokenizer(captions).items()})  # noqa: E731
        with torch.no_grad(), autocast(device, cfg.training.dtype):  # once, not in every step
            text, uncond = encode(prompts), encode([family.negative_prompt])
    return Job(model, cfg, prompts, text, uncond, (dataset.latent_channels, *dataset.commonest_size), decode)


def pipeline_encoders(cfg: DictConfig, dataset, pipeline: Path | None, hint: str) -> PipelineTextEncoders:
    """The text encoders of `pipeline`, else of the pipeline the run's text came from (data.text_encoders_from, or
    the one its precompute recorded): named when they cannot be found."""
    folder = Path(pipeline or cfg.data.text_encoders_from or dataset.index.get("model") or "")
    source = "--pipeline" if pipeline else f"the pipeline of {dataset.directory}/dataset.json"
    family = FAMILIES[cfg.model.family]
    try:
        family.text_encoders.check_pipeline(folder, source)
    except InputError as e:
        raise InputError(f"new prompts are encoded by the pipeline's text encoders: {e}{hint}") from None
    return family.text_encoders(folder, dataset.index["max_sequence_length"]).load(torch.device("cpu"), torch.float32)


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
    parser.add_argument("--prompts", type=Path, help="text file, one prompt per line (latent runs: default, the "
                        "validation prompts stored with the data)")
    parser.add_argument("--out", required=True, type=Path, help="new directory for NNNN.png")
    parser.add_argument("--references", type=Path, help="an edit run's reference images: NNNN.png for line NNNN + 1")
    parser.add_argument("--pipeline", type=Path, help="latent runs: the pipeline folder of the VAE and text encoders "
                        "(default: the one the dataset's precompute recorded)")
    parser.add_argument("--lora-scale", type=float, default=1.0, help="LoRA runs: the adapters' strength (0: the base)")
    parser.add_argument("--steps", type=int, help="Euler steps (default: the run's sampling.steps)")
    parser.add_argument("--cfg", type=float, help="guidance scale (default: the run's sampling.cfg_scale)")
    parser.add_argument("--seed", type=int, default=0, help="image i uses noise keyed by (seed, i)")
    parser.add_argument("--no-ema", action="store_true", help="use the raw trained weights instead of the EMA")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda where there is one")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, and no CUDA device is available")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:  # the user's input (prompts, checkpoint, its config and data, the output folder): one line, exit 2
        refuse_existing(args.out)  # before the sampling, not after it
        writable_directory(args.out.parent, f"--out {args.out}")
        checkpoint = find_checkpoint(args.checkpoint)
        if run_config(checkpoint).data.name in SHAPES:
            job = shapes_job(checkpoint, args.prompts, args.references, not args.no_ema)
        elif args.references is not None:
            raise InputError(f"--references edits with a run of the edit shapes (data.name=shapes_edit); {checkpoint} "
                             f"was trained on latents")
        else:
            job = latent_job(checkpoint, args.prompts, args.pipeline, not args.no_ema, device)
        if args.lora_scale != 1.0 and not job.cfg.lora.enabled:
            raise InputError(f"--lora-scale scales a LoRA run's adapters, and {checkpoint} is a full fine-tune")
    except (InputError, FileExistsError) as e:
        log.error("sample: %s", e)
        return 2
    scale_adapters(job.model, args.lora_scale)
    steps = job.cfg.sampling.steps if args.steps is None else args.steps
    sampler = build_sampler(job.cfg, job.shape[1:], steps)
    if args.cfg is not None:
        sampler = dataclasses.replace(sampler, cfg_scale=args.cfg)
    noise = initial_noise(args.seed, list(range(len(job.prompts))), job.shape)
    with autocast(device, job.cfg.training.dtype):
        x = generate(job.model.to(device), job.text, job.uncond, noise, sampler, job.cfg.training.train_batch_size,
                     job.references)
        images = job.decode(x)
    write_new_directory(args.out, lambda tmp: save_pngs(images, tmp))  # whole or not at all
    log.info("wrote %d images to %s from %s (%d steps, cfg %g, %s weights%s)", len(images), args.out, checkpoint,
             steps, sampler.cfg_scale, "raw" if args.no_ema else "EMA",
             f", LoRA scale {args.lora_scale:g}" if job.cfg.lora.enabled else "")
    return 0


if __name__ == "__main__":
    with torchao_only_if(used=False):  # transformers and peft would import it, and its noise, at start-up
        sys.exit(main())
