"""What a config describes, built: the dataset, its tokenizer, the model, the held-out split, the batches'
collation and validation. The entry points compose these; `models/`, `data/` and `perf/` stay free of configs
and of each other's specifics (this is where a dataset's prompts meet the validation plugin, say)."""

import dataclasses
import logging
import math
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig

from data.captions import caption_style, recorded_style
from data.images import to_unit
from data.latents import TEXT_FIELDS, LatentDataset, bucket_name, empty_text, vae_folder
from data.loader import Collate, split_holdout
from data.mixture import MixedDataset
from data.shapes import ShapesDataset, ShapesEditDataset
from errors import ConfigError, InputError
from formats import DTYPES
from models.diffusers_io import CheckpointFormatError
from models.families import FAMILIES, family_of_pipeline, open_weights, read_config
from models.family import ResolutionShift
from models.lora import adapter_part, apply_lora
from models.quantized import QuantizedLinear, QuantizingReader, dequantize, quantize_linears
from models.pipeline import Sampler
from models.rectified_flow import batch_sigmas, resolution_shift
from models.pipeline_text import PipelineTextEncoders, PipelineTokenizers
from models.text_encoder import TextToImage, TinyTextEncoder, WordTokenizer
from models.vae import load_vae
from runtime.distributed import World
from runtime.validation import HeldOutLoss, PromptImages, Validation

log = logging.getLogger("mmdit")


SHAPES = {"shapes": ShapesDataset, "shapes_edit": ShapesEditDataset}  # the built-in data.name values


def build_tokenizer(dataset=ShapesDataset) -> WordTokenizer:
    """The tokenizer of the text encoder trained with the model on a built-in dataset (its words)."""
    return WordTokenizer(dataset.vocabulary, dataset.max_caption_words)


def transformer_config(cfg: DictConfig, latent_channels: int, latent_sizes: list[tuple[int, int]],
                       text_dims: tuple[int, int]):
    """The transformer's config (diffusers' config.json keys) of model.family, sized for the data."""
    m, family = cfg.model, FAMILIES[cfg.model.family]
    for size in latent_sizes:  # an edit's reference sizes among them
        if size[0] % m.patch_size or size[1] % m.patch_size:
            raise ConfigError(f"model.patch_size={m.patch_size} does not divide the {size[0]}x{size[1]} latents "
                              f"({'packed tokens' if family.packing else 'patches'} of {m.patch_size}x{m.patch_size})")
    return family.build_config(m, latent_channels, tuple(text_dims))


def check_position_table(cfg: DictConfig, dataset) -> None:
    """SD3's position table covers patch grids of up to model.pos_embed_max_size a side. Latents larger than that
    come from a latent dataset's precompute resolution, which is what the user chose: the error names it, and
    what to change (FLUX.1's rotary positions have no such limit)."""
    m = cfg.model
    if "pos_embed_max_size" not in FAMILIES[m.family].options:  # rotary positions (the others) have no table
        return
    parts = getattr(dataset, "datasets", [dataset])
    for number, part in enumerate(parts):
        largest = max(max(size) for size in part.latent_sizes)
        if largest // m.patch_size <= m.pos_embed_max_size:
            continue
        grid = f"a patch grid of {largest // m.patch_size} a side (model.patch_size={m.patch_size})"
        table = (f"model.pos_embed_max_size={m.pos_embed_max_size}" +
                 (f", from model.init_from={m.init_from}" if m.init_from else ""))
        if not hasattr(part, "index"):  # the shapes data: its size is fixed
            raise ConfigError(f"{table} is smaller than {grid}")
        resolution = part.index["resolution"]
        key = f"data.datasets[{number}].path" if len(parts) > 1 else "data.path"
        covered = m.pos_embed_max_size * m.patch_size  # latent pixels a side
        fits = ("about " if len(part.latent_sizes) > 1 else "") + str(resolution * covered // largest)
        raise ConfigError(
            f"{key}={part.directory} was precomputed at --resolution {resolution}: its latents, up to {largest} a "
            f"side, make {grid}, and the model's position table covers {m.pos_embed_max_size} ({table}). Precompute "
            f"the images again at --resolution {fits} or less" + (
                " (model.init_from's table cannot be enlarged)" if m.init_from else
                f", or set model.pos_embed_max_size={largest // m.patch_size} or more"))


def check_references(cfg: DictConfig, dataset, source: str) -> None:
    """An edit dataset's reference images fit model.family's edit model (it has one, taking that many) and the
    config (data.references, where it says)."""
    family, count = FAMILIES[cfg.model.family], dataset.references
    if cfg.data.references is not None and cfg.data.references != count:
        raise ConfigError(f"data.references={cfg.data.references}: the config is made for pairs with that many reference "
                          f"images, and {source} has {count or 'none'}" + (
                              " (precompute the pairs with --references)" if not count else ""))
    most = family.max_references
    if count and most is not None and count > most:
        takes = f"takes {most} reference image{'s' if most != 1 else ''}" if most else "has no edit model"
        raise ConfigError(f"{source} pairs each target with {count} reference image(s), and model.family="
                          f"{family.name}: {family.title} {takes}" +
                          (f" ({', '.join(family.edit_pipelines)})" if most else
                           f" (the edit families: {', '.join(f.name for f in FAMILIES.values() if f.edits)})"))


def build_transformer(cfg: DictConfig, latent_channels: int, latent_sizes: list[tuple[int, int]],
                      text_dims: tuple[int, int]) -> nn.Module:
    config = transformer_config(cfg, latent_channels, latent_sizes, text_dims)
    return FAMILIES[cfg.model.family].transformer(config)


def build_data(cfg: DictConfig) -> tuple[torch.utils.data.Dataset, WordTokenizer | PipelineTokenizers | None]:
    """The dataset, and the tokenizer of the text encoder in the model: the one trained jointly for the shapes
    data, the pipeline's for latents whose captions are encoded in the step (data.text_encoding=on_the_fly), None
    for precomputed embeddings."""
    if cfg.data.name in SHAPES:
        dataset = SHAPES[cfg.data.name](cfg.data.num_items, cfg.training.seed)
        check_references(cfg, dataset, f"data.name={cfg.data.name}")
        return dataset, build_tokenizer(dataset)
    if not cfg.data.path and not cfg.data.datasets:
        raise ConfigError("data.name=latents needs data.path, a directory written by "
                          "python precompute_latents.py (or data.datasets, several of them)")
    on_the_fly = cfg.data.text_encoding == "on_the_fly"
    paths = [entry.path for entry in cfg.data.datasets] or [cfg.data.path]
    try:
        datasets = [open_latents(cfg, path, not on_the_fly) for path in paths]
        dataset = (MixedDataset(datasets, dataset_names(paths), mixture_weights(cfg.data.datasets, datasets))
                   if cfg.data.datasets else datasets[0])
    except InputError as e:
        raise ConfigError(str(e)) from None
    if len(dataset.buckets) > 1 and not cfg.data.aspect_buckets:  # a batch is of one size
        raise ConfigError(f"data.datasets hold latents of {len(dataset.buckets)} sizes "
                          f"({'; '.join(map(bucket_name, dataset.buckets))}); set data.aspect_buckets=true to train "
                          f"on several sizes")
    return dataset, pipeline_tokenizers(cfg, dataset) if on_the_fly else None


def mixture_weights(entries, datasets: list[LatentDataset]) -> list[float]:
    """The datasets' shares: their weights, or where repeats are given (kohya's num_repeats) items x repeats."""
    if all(e.repeats is None for e in entries):
        return [e.weight for e in entries]
    return [len(d) * (e.repeats or 1) for e, d in zip(entries, datasets)]


def check_captions(cfg: DictConfig, dataset: LatentDataset, path: str) -> None:
    """Precomputed text was encoded from captions made once, at precompute: data.caption_* must say how."""
    ours, (theirs, variants) = caption_style(cfg.data), recorded_style(dataset.index)
    if ours == theirs:
        return
    keys = {"prefix": "caption_prefix", "shuffle_tags": "shuffle_caption_tags", "keep_tags": "keep_tags",
            "tag_dropout": "tag_dropout"}
    differ = "; ".join(f"data.{keys[k]}={v!r}, its precompute {getattr(theirs, k)!r}"
                       for k, v in dataclasses.asdict(ours).items() if getattr(theirs, k) != v)
    flags = " ".join(filter(None, [f"--caption-prefix '{ours.prefix}'" if ours.prefix else "",
                                   "--shuffle-caption-tags" if ours.shuffle_tags else "",
                                   f"--keep-tags {ours.keep_tags}" if ours.keep_tags else "",
                                   f"--tag-dropout {ours.tag_dropout}" if ours.tag_dropout else "",
                                   "--caption-variants K" if ours.random else ""]))
    raise ConfigError(f"{path} holds text embeddings of captions made otherwise ({differ}; {variants} encoding(s) "
                      f"per caption): the captions were encoded once, at precompute. Precompute them again"
                      f"{f' with {flags}' if flags else ' without caption flags'}, set the data.* keys to the "
                      f"precompute's, or encode the text in the step (data.text_encoding=on_the_fly)")


def open_latents(cfg: DictConfig, path: str, text_embeddings: bool) -> LatentDataset:
    """A latent dataset, with loss masks as data.use_masks says (auto: where it has them), encoded by a pipeline
    of model.family; its precomputed text made from captions as data.caption_* say."""
    masks = {"auto": None, "true": True, "false": False}[cfg.data.use_masks]
    dataset = LatentDataset(path, cfg.data.aspect_buckets, text_embeddings, masks)
    family = dataset.index.get("family", "sd3")  # recorded since FLUX.1
    if family != cfg.model.family:
        raise ConfigError(f"{path} was encoded by a {family} pipeline, and model.family={cfg.model.family}: its "
                          f"latents and text embeddings are another model's (set model.family={family}, or "
                          f"precompute the images with a {cfg.model.family} pipeline)")
    if masks is None and dataset.masks:
        log.info("%s has loss masks: the loss is weighted by them (data.use_masks=false to ignore them)", path)
    check_references(cfg, dataset, path)
    if text_embeddings:
        check_captions(cfg, dataset, path)
    return dataset


def dataset_names(paths: list[str]) -> list[str]:
    """The datasets' names in metrics: their folder names, numbered where two are the same."""
    names = [Path(p).name for p in paths]
    return [f"{n}.{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def pipeline_tokenizers(cfg: DictConfig, dataset: LatentDataset) -> PipelineTokenizers:
    """The tokenizers of the pipeline whose text encoders run in the step: data.text_encoders_from, else the
    pipeline the dataset's precompute recorded; a pipeline of model.family."""
    folder, source = cfg.data.text_encoders_from, "data.text_encoders_from"
    if not folder:
        folder, source = dataset.index.get("model"), f"the pipeline recorded in {dataset.directory}/dataset.json"
    family = FAMILIES[cfg.model.family]
    try:
        family.text_encoders.check_pipeline(Path(folder or ""), source)
        found = family_of_pipeline(Path(folder)) if (Path(folder) / "model_index.json").is_file() else family
    except CheckpointFormatError as e:
        raise ConfigError(f"data.text_encoding=on_the_fly needs the text encoders of a {family.name} pipeline: "
                          f"{e}") from None
    if found is not family:
        raise ConfigError(f"{source}={folder} is a {found.name} pipeline ({found.pipeline_class}), and "
                          f"model.family={family.name}: its text encoders are another model's")
    return family.tokenizers(Path(folder), dataset.index["max_sequence_length"])


def holdout_split(cfg: DictConfig, dataset) -> tuple[np.ndarray, list[int]]:
    """(training items, held-out items) of `data.holdout`: in a mixture, data.holdout items of each dataset."""
    parts = list(zip(dataset.datasets, dataset.offsets)) if isinstance(dataset, MixedDataset) else [(dataset, 0)]
    items, held = [], []
    for number, (part, offset) in enumerate(parts):
        try:
            kept, out = split_holdout(len(part), cfg.data.holdout, cfg.training.seed, number)
        except ValueError as e:
            raise ConfigError(f"{e}{f' ({part.directory})' if len(parts) > 1 else ''}") from None
        items.append(kept + offset)
        held += [int(i + offset) for i in out]
    return (items[0] if len(items) == 1 else np.concatenate(items)), held


def build_model(cfg: DictConfig, dataset, tokenizer: WordTokenizer | PipelineTokenizers | None = None) -> TextToImage:
    """The MMDiT sized for the dataset, with the text encoder `tokenizer` belongs to: a pipeline's frozen encoders, or
    one trained jointly with it. Datasets of precomputed embeddings bring their own text widths (`text_dims`)."""
    channels = dataset.latent_channels
    sizes = sorted({size for target, references in dataset.buckets for size in (target, *references)})
    if tokenizer is None:
        text_encoder, dims = None, dataset.text_dims
    elif isinstance(tokenizer, PipelineTokenizers):
        text_encoder = FAMILIES[cfg.model.family].text_encoders(tokenizer.folder, tokenizer.max_sequence_length)
        dims = (text_encoder.joint_dim, text_encoder.pooled_dim)
    else:
        t = cfg.text_encoder
        text_encoder = TinyTextEncoder(len(tokenizer.vocab), tokenizer.max_length, t.dim, t.num_layers, t.num_heads)
        dims = (t.dim, t.dim)
    check_position_table(cfg, dataset)
    transformer = build_transformer(cfg, channels, sizes, dims)
    guidance = cfg.flux.train_guidance if cfg.model.guidance_embeds else None  # FLUX.1-dev's embedding
    return TextToImage(transformer, text_encoder, guidance)


def build_trained_model(cfg: DictConfig, dataset, tokenizer: WordTokenizer | PipelineTokenizers | None = None) -> TextToImage:
    """The model as training starts it, built on the meta device (nothing allocated yet: each rank later fills
    only what it holds, from `InitialValues`): with LoRA adapters (lora.enabled) on a base quantized
    (lora.base_quantization) or not. What is frozen (a LoRA base, a pipeline's text encoders) is kept in the compute
    dtype: bf16 halves fp32's memory, and autocast computes in bf16 anyway."""
    with torch.device("meta"):
        model = apply_lora(build_model(cfg, dataset, tokenizer), cfg.lora)
    if cfg.lora.enabled and cfg.lora.base_quantization != "none":
        quantize_linears(model.transformer, cfg.lora.base_quantization)
    compute = DTYPES[cfg.training.dtype]
    for p in model.parameters():
        frozen_fp32 = not p.requires_grad and p.dtype == torch.float32  # not the scales of quantized codes
        if frozen_fp32 and compute != torch.float32:
            p.data = torch.empty_like(p, dtype=compute)
    if isinstance(model.text_encoder, PipelineTextEncoders):
        try:
            model.text_encoder.check(f"data.text_encoding=on_the_fly: {model.text_encoder.folder}")
        except CheckpointFormatError as e:
            raise ConfigError(str(e)) from None
    if cfg.model.init_from:
        check_init_from(cfg, dataset, tokenizer, cfg.model.init_from)
    return model


def check_init_from(cfg: DictConfig, dataset, tokenizer, directory: str) -> None:
    """model.init_from fits the model before a byte of its weights is read: its sizes are the configured ones
    (`load_config` took them from it); what can still differ comes from the data (latent channels and the text
    encoders' widths); and its files hold every weight, in the right shape."""
    try:
        theirs = dataclasses.asdict(read_config(Path(directory))[1])
        with torch.device("meta"):
            transformer = build_model(cfg, dataset, tokenizer).transformer
        ours = dataclasses.asdict(transformer.cfg)
        different = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
        if different:
            raise CheckpointFormatError(f"the data does not fit it (its config.json, the data): {different}; "
                                        f"latent channels and text widths come from data.path, which must be "
                                        f"encoded with the VAE and text encoders of this transformer's pipeline")
        open_weights(Path(directory)).check({k: v.shape for k, v in transformer.state_dict().items()}, directory)
    except CheckpointFormatError as e:
        raise ConfigError(f"model.init_from={directory}: {e}") from None


class InitialValues:
    """Where each parameter and buffer of a trained model starts, one block at a time (`(name, offsets, sizes)`:
    the block a rank holds): the transformer's from model.init_from's files, reading only that block (its
    quantized layers from the rows they quantize), a pipeline's frozen text encoders' from its files,
    everything else (a fresh model, the adapters, a jointly trained text encoder) from the model's own
    `initial_value`, a function of (seed, name)."""

    def __init__(self, model: TextToImage, seed: int, init_from: str | None):
        self.model, self.seed = model, seed
        self.reader = open_weights(Path(init_from)) if init_from else None
        self.quantized = QuantizingReader(self.reader.read) if init_from else None

    def __call__(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        if ".lora_magnitude_vector." in name:
            return self.dora_magnitude(name, offsets, sizes)
        block = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        if adapter_part(name) is not None:
            return self.model.initial_value(name, self.seed)[block]
        if name.startswith("text_encoder.") and isinstance(self.model.text_encoder, PipelineTextEncoders):
            return self.model.text_encoder.read(name.removeprefix("text_encoder."), offsets, sizes)
        if self.reader is None or not name.startswith("transformer."):
            return self.model.initial_value(name, self.seed)[block]
        module_name, _, kind = name.rpartition(".")
        key = f"{module_name.removeprefix('transformer.').replace('.base_layer', '')}.{kind}"
        module = self.model.get_submodule(module_name)
        if not isinstance(module, QuantizedLinear) or kind == "bias":
            return self.reader.read(key, offsets, sizes)
        return self.quantized(key.rpartition(".")[0] + ".weight", module, kind, offsets, sizes)

    def dora_magnitude(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """DoRA's magnitude for rows offsets[0]...: the norms of those rows of the frozen weight as the model holds
        it (dequantized, or in its dtype), as peft computes them when it injects the adapter into a filled layer,
        so that the adapted model starts as the base."""
        layer = name.partition(".lora_magnitude_vector.")[0]
        base = self.model.get_submodule(layer).get_base_layer()
        rows = lambda kind: self(f"{layer}.base_layer.{kind}", (offsets[0], 0),
                                 (sizes[0], getattr(base, kind).shape[1]))
        if isinstance(base, QuantizedLinear):
            weight = dequantize(rows("codes"), rows("scales"), base.scheme, torch.float32)
        else:
            weight = rows("weight").to(base.weight.dtype)
        return torch.linalg.norm(weight.float(), dim=1)


def build_collate(cfg: DictConfig, dataset, tokenizer: WordTokenizer | None) -> Collate:
    """Batches with their noise, noise levels (the configured timestep sampling) and caption dropout."""
    flow = cfg.flow
    sigmas = partial(batch_sigmas, patch_size=cfg.model.patch_size,
                     by_resolution=resolution_constants(cfg) if flow.resolution_shift else None,
                     shift=flow.shift, sampling=flow.sigma_sampling, logit_mean=flow.logit_mean,
                     logit_std=flow.logit_std, mode_scale=flow.mode_scale)
    entries = cfg.data.datasets or [None]
    dropout = [cfg.data.caption_dropout if e is None or e.caption_dropout is None else e.caption_dropout
               for e in entries]
    return Collate(cfg.training.seed, sigmas, dropout, tokenizer, getattr(dataset, "empty_prompt", None),
                   [1.0 if e is None else e.loss_weight for e in entries], caption_style(cfg.data))


def build_validation(cfg: DictConfig, dataset, tokenizer: WordTokenizer | PipelineTokenizers | None, holdout: list[int],
                     world: World, device: torch.device) -> Validation:
    """What validation runs for this config: the dataset's prompts (scored for the shapes data, decoded by a VAE
    loaded on rank 0 for latents) and the held-out loss, every validation.every steps and at the end
    (validation.at_end, also with validation.every=0). Nothing is built when it would not run; a VAE that cannot be
    found is an error here, before any training."""
    v, on = cfg.validation, cfg.validation.every > 0
    wanted = on or v.at_end
    images = None
    if isinstance(dataset, ShapesDataset) and wanted:
        captions = dataset.validation_captions()
        shown = torch.linspace(0, len(captions) - 1, cfg.sampling.grid_size).long().tolist()
        references = dataset.validation_references() if dataset.references else ()
        images = prompt_images(cfg, dataset, captions, tokenizer(captions), tokenizer([""]), to_unit,
                               dataset.score_images, shown, references)
    elif wanted and dataset.references:  # an edit dataset: its held-out items' references and instructions
        images = held_out_edits(cfg, dataset, tokenizer, holdout, world, device)
    elif wanted and dataset.validation_captions is not None:
        captions = dataset.validation_captions
        if tokenizer is not None:  # encoded by the model; the unconditional input as precompute stores it
            text, uncond = tokenizer(captions), tokenizer([FAMILIES[cfg.model.family].negative_prompt])
        else:
            text = dataset.validation_prompts
            uncond = dataset.negative_prompt or {k: torch.zeros_like(t[:1]) for k, t in text.items()}
        images = prompt_images(cfg, dataset, captions, text, uncond, latent_decoder(cfg, dataset, world, device),
                               None, list(range(len(captions))))
    elif on:
        log.warning("%s holds no validation prompts (precompute_latents.py --validation-prompts FILE): no "
                    "validation images", cfg.data.path or "no dataset of data.datasets")
    losses = []
    if wanted and holdout:
        groups = [("val/", holdout)]
        if isinstance(dataset, MixedDataset):
            groups = [(f"val/{name}/", [i for i in holdout if dataset.sources(i) == d])
                      for d, name in enumerate(dataset.names)]
        losses = [HeldOutLoss(dataset, items, partial(item_text, tokenizer), v.loss_sigmas, cfg.training.seed,
                              cfg.training.dtype, prefix) for prefix, items in groups]
    return Validation(v.every, v.at_end, cfg.training.max_steps, images, losses, world, device)


def resolution_constants(cfg: DictConfig) -> dict:
    """`resolution_shift`'s constants: the family's pipeline's (FLUX.1's for a family without one)."""
    schedule = FAMILIES[cfg.model.family].schedule or ResolutionShift()
    return {k: v for k, v in dataclasses.asdict(schedule).items() if k != "terminal"}


def build_sampler(cfg: DictConfig, latent_size: tuple[int, int], steps: int | None = None) -> Sampler:
    """The sampler of sampling.* for latents of `latent_size` (and `steps`, sampling.steps unless given): the
    schedule shifted by sampling.shift or by the resolution (sampling.resolution_shift, the family's pipeline's
    schedule: its mu of the token count, and of the steps where the family has its own, its end stretched as that
    pipeline does), a guidance-distilled model's embedded guidance, and the family's way of guiding."""
    s, p, family = cfg.sampling, cfg.model.patch_size, FAMILIES[cfg.model.family]
    steps = s.steps if steps is None else steps
    tokens = (latent_size[0] // p) * (latent_size[1] // p)
    if not s.resolution_shift:
        shift = s.shift
    elif family.sampling_mu is not None:
        shift = math.exp(family.sampling_mu(tokens, steps))
    else:
        shift = resolution_shift(tokens, **resolution_constants(cfg))
    terminal = family.schedule.terminal if s.resolution_shift and family.schedule else None
    return Sampler(steps, s.cfg_scale, shift, tuple(s.guidance_interval),
                   cfg.flux.sample_guidance if cfg.model.guidance_embeds else None, terminal,
                   p if family.cfg_renorm else None)


def prompt_images(cfg: DictConfig, dataset, captions, text, uncond, decode, score, shown, references=(),
                  size: tuple[int, int] | None = None) -> PromptImages:
    shape = (dataset.latent_channels, *(size or dataset.commonest_size))
    return PromptImages(captions, text, uncond, shape, decode, score, shown, build_sampler(cfg, shape[1:]),
                        cfg.training.seed, cfg.training.dtype, cfg.training.train_batch_size, references)


def held_out_edits(cfg: DictConfig, dataset, tokenizer, holdout: list[int], world: World,
                   device: torch.device) -> PromptImages | None:
    """Validation images of an edit dataset: its held-out items (data.holdout) of the most common bucket among
    them (a batch stacks references of one size), each an edit of its references by its instruction."""
    if not holdout:
        log.warning("%s is an edit dataset: its validation images edit held-out items' references; set "
                    "data.holdout to keep some out of training", cfg.data.path or "data.datasets")
        return None
    buckets = dataset.items_by_bucket(np.asarray(holdout))
    bucket, items = max(buckets.items(), key=lambda entry: len(entry[1]))
    rows = [dataset[int(i)] for i in items]
    captions = [row["caption"] for row in rows]
    references = tuple(torch.stack(images) for images in zip(*(row["references"] for row in rows)))
    if tokenizer is not None:
        text, uncond = tokenizer(captions), tokenizer([FAMILIES[cfg.model.family].negative_prompt])
    else:
        text = {k: torch.stack([row[k] for row in rows]) for k in TEXT_FIELDS if k in rows[0]}
        uncond = dataset.negative_prompt or {k: torch.zeros_like(t[:1]) for k, t in text.items()}
    return prompt_images(cfg, dataset, captions, text, uncond, latent_decoder(cfg, dataset, world, device), None,
                         list(range(len(captions))), references, bucket[0])


def latent_decoder(cfg: DictConfig, dataset, world: World, device: torch.device, key: str = "validation.vae_from"):
    """Latents [N, C, h, w] -> images [N, 3, H, W] in [0, 1] through the dataset's VAE (cfg.validation.vae_from, which
    `key` names in errors), undoing the scale and shift the dataset recorded; on rank 0 only (the others never
    decode). The VAE is loaded now (a missing one stops the run before training) into host memory, and is on
    `device` only while it decodes, one image at a time: a 1024-px decode holds gigabytes of activations, which
    training's steps then have back (runtime/memory_plan.py counts them as validation's)."""
    recorded = {k: v for k, v in dataset.index.get("vae", {}).items() if k != "folder"}
    try:
        folder = vae_folder(dataset, cfg.validation.vae_from, key)
        vae = load_vae(folder, torch.device("cpu"), DTYPES[cfg.training.dtype], **recorded) if world.is_main else None
    except InputError as e:
        raise ConfigError(str(e)) from None
    log.info("latents decoded by the VAE in %s", folder)

    def decode(latents: torch.Tensor) -> torch.Tensor:
        vae.autoencoder.to(device)
        try:
            return torch.stack([to_unit(vae.decode(x[None])[0].float()).cpu() for x in latents])
        finally:
            vae.autoencoder.to("cpu")
    return decode


def item_text(tokenizer: WordTokenizer | PipelineTokenizers | None, item: dict, rows: int) -> dict[str, torch.Tensor]:
    """A dataset item's text input of the model, repeated `rows` times."""
    if tokenizer is not None:
        return tokenizer([item["caption"]] * rows)
    return {k: item[k][None].expand(rows, *item[k].shape) for k in TEXT_FIELDS if k in item}


def example_text(dataset, tokenizer: WordTokenizer | PipelineTokenizers | None) -> dict[str, torch.Tensor]:
    """One sample's text input of the model (the empty caption), to count its FLOPs."""
    if tokenizer is not None:
        return tokenizer([""])
    return empty_text(dataset.text_shapes)


def text_tokens(dataset, tokenizer: WordTokenizer | PipelineTokenizers | None) -> int:
    """The text tokens the MMDiT attends to per sample."""
    return tokenizer.tokens if tokenizer is not None else dataset.text_tokens
