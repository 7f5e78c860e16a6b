"""Will this config fit on these GPUs? A memory plan per rank, before renting them.

    python plan_memory.py --config configs/sd35_large_lora.yaml --gpus 1 --gpu-gib 24 [key=value ...]
    python plan_memory.py --table [--model qwen-image]   # what fits 24/48/80 GB, each released model (or one):
                                                         # the tables of docs/sd3.md, docs/flux.md, docs/qwen-image.md

For the config as given and for the choices near it (activation checkpointing, a quantized base, FSDP over the
GPUs, CPU offload, another micro-batch, and for a LoRA run that does not fit, the fewest blocks to swap) it prints,
per rank, the weights, gradients, optimizer state, EMA, weights in flight, activations and overhead, the total,
whether it fits, and the step time activation checkpointing adds (estimated for an H100); then the activation
checkpointing setting that fits with the least recompute, and for a LoRA run the smallest offload.blocks_to_swap
that fits (runtime/memory_plan.py says how each is counted). The architecture comes from model.init_from when that folder
exists, else from the released model the config is named after (or --model); the data's sizes from the family's
released pipeline at --resolution (its text encoders' tokens and widths, a text mask where it pads the text).
"""

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.build import SHAPES, build_data, build_model, example_text
from configs.schema import Config, resolve_defaults
from data.latents import text_shapes
from errors import ConfigError, InputError
from models.families import FAMILIES, read_config
from models.lora import apply_lora
from models.quantized import quantize_linears
from optim.optimizers import KINDS
from runtime.memory_plan import GIB, cheapest_checkpointing, count_model, plan, smallest_swap, vae_count
from runtime.quiet_imports import torchao_only_if

# The released transformers' sizes (each family's record: models/<family>/family.py)
RELEASED = {name: {"family": family.name, **settings} for family in FAMILIES.values()
            for name, settings in family.released.items()}


def released_text(cfg) -> dict:
    """What the transformer sees of a sample of the family's released pipeline: its text and latents."""
    return family_text(FAMILIES[cfg.model.family], cfg.model)


def family_text(family, settings) -> dict:
    """The same for a transformer of `settings` (model.* values, as attributes) of `family`."""
    return {**dataclasses.asdict(family.text_of(settings)), "tokens": family.text_tokens(settings)}


def planning_config(path: str, overrides: list[str], model: str | None):
    """The config as training would read it, with what planning cannot know left open (a dataset or checkpoint
    that is not here yet), and the architecture of model.init_from or of a released model."""
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as e:  # an unknown key, a wrong type, invalid YAML
        raise ConfigError(f"{path}: {e}".split("\n")[0]) from None
    for key in OmegaConf.missing_keys(cfg):
        OmegaConf.update(cfg, key, None)
    name = model or next((m for m in RELEASED if path.split("/")[-1].replace("_", "-").startswith(m + "-")
                          or path.split("/")[-1].replace("_", "-").startswith(m + ".")), None)
    found = read_config_or_none(cfg.model.init_from) if cfg.model.init_from else None
    if found:
        family, config = found
        architecture = {"family": family.name, **family.settings(config)}
    elif name:
        architecture = RELEASED[name]
    elif cfg.data.name in SHAPES:
        architecture = {}
    else:
        raise ConfigError(f"{path}: no model.init_from here to read the architecture from; name one with --model "
                          f"({', '.join(RELEASED)})")
    for key, value in architecture.items():
        OmegaConf.update(cfg, f"model.{key}", value)
    resolve_defaults(cfg)
    return cfg, name


def read_config_or_none(folder: str):
    try:
        return read_config(folder)
    except (ValueError, OSError):
        return None


def data_like(cfg, resolution: int):
    """What the model needs to know of the data: the dataset when it is here, else the released pipeline's latents
    and text at `resolution` (its largest bucket sets the activations), with data.references reference images of
    that size (edit pairs)."""
    if cfg.data.name in SHAPES or (cfg.data.path and Path(cfg.data.path, "dataset.json").is_file()):
        return build_data(cfg)
    return released_data(cfg, resolution), None


def released_data(cfg, resolution: int) -> SimpleNamespace:
    """The released pipeline's data as the model sees it: square latents at `resolution` and its text."""
    text = released_text(cfg)
    return data_of(text, resolution // text["vae_factor"], cfg.data.references or 0)


def data_of(text: dict, side: int, references: int = 0) -> SimpleNamespace:
    """A dataset's description (what building a model reads of it) for `text` (`family_text`'s) and latents of
    `side` a side, each with `references` reference images of that size (edit pairs)."""
    dims = (text["joint"], text["pooled"])
    return SimpleNamespace(latent_channels=text["latent_channels"], latent_sizes=[(side, side)],
                           buckets=[((side, side), ((side, side),) * references)], references=references,
                           text_dims=dims, text_tokens=text["tokens"],
                           text_shapes=text_shapes(text["tokens"], dims, text["masked"]))


def count(cfg, dataset, tokenizer, quantization: str):
    """The meta-device count of the model as training builds it (LoRA, frozen base in the compute dtype or
    quantized)."""
    lora = OmegaConf.merge(cfg.lora, {"base_quantization": quantization})
    with torch.device("meta"):
        model = apply_lora(build_model(cfg, dataset, tokenizer), lora)
        if lora.enabled and quantization != "none":
            quantize_linears(model.transformer, quantization)
        target, references = max(dataset.buckets, key=lambda b: sum(h * w for h, w in (b[0], *b[1])))  # the longest
        latents = lambda size: torch.empty(1, dataset.latent_channels, *size)  # noqa: E731
        inputs = (latents(target), torch.empty(1), example_text(dataset, tokenizer), None,
                  tuple(map(latents, references)))  # an edit's references: more tokens in every block
    compute = 4 if cfg.training.dtype == "fp32" else 2
    counted = count_model(model, inputs, activation_bytes=compute, frozen_bytes=compute)  # frozen: the compute dtype
    if cfg.data.name in SHAPES or not validation_rows(cfg, 1):  # pixels, or no validation: no VAE
        return counted
    family = FAMILIES[cfg.model.family]
    side = max(dataset.latent_sizes[-1]) * family.text_of(cfg.model).vae_factor  # the largest image, in pixels
    return dataclasses.replace(counted, vae=vae_count(family.released_vae, side, compute))


def validation_rows(cfg, micro_batch: int) -> int:
    """The rows of validation's forwards without autograd (0: none): sampling micro-batch prompts (twice, with
    classifier-free guidance), the held-out loss an item's validation.loss_sigmas noise levels."""
    if not (cfg.validation.every or cfg.validation.at_end):
        return 0
    sampling = micro_batch * (2 if cfg.sampling.cfg_scale != 1 else 1)
    return max(sampling, cfg.validation.loss_sigmas if cfg.data.holdout else 0)


def choices(cfg, gpus: int) -> list[tuple[str, dict]]:
    """The config as given, then one change at a time."""
    t, p = cfg.training, cfg.parallel
    given = {"strategy": p.strategy if gpus > 1 or p.cpu_offload else "ddp", "micro_batch": t.train_batch_size,
             "checkpointing": t.activation_checkpointing, "every": t.activation_checkpointing_every,
             "quantization": cfg.lora.base_quantization, "cpu_offload": p.cpu_offload,
             "swapped": cfg.offload.blocks_to_swap}
    rows = [("as configured", given)]
    rows += [(f"activation checkpointing {mode}", {**given, "checkpointing": mode, "every": 1})
             for mode in ("none", "selective", "full") if (mode, 1) != (given["checkpointing"], given["every"])]
    if cfg.lora.enabled:
        rows += [(f"base {q}", {**given, "quantization": q}) for q in ("none", "int8", "nf4") if q != given["quantization"]]
    shards = not KINDS[cfg.optimizer.name].sharded  # only such optimizers train under FSDP
    if gpus > 1 and given["strategy"] == "ddp" and shards:
        rows.append((f"FSDP over {gpus}", {**given, "strategy": "fsdp", "swapped": 0}))
    if not given["cpu_offload"] and shards:
        rows.append(("FSDP + CPU offload", {**given, "strategy": "fsdp", "cpu_offload": True, "swapped": 0}))
    if given["micro_batch"] > 1:
        rows.append((f"micro-batch {given['micro_batch'] // 2}", {**given, "micro_batch": given["micro_batch"] // 2}))
    rows.append((f"micro-batch {given['micro_batch'] * 2}", {**given, "micro_batch": given["micro_batch"] * 2}))
    return rows


def settings(cfg, choice: dict, gpus: int) -> dict:
    """plan()'s arguments for one choice, but for the activation checkpointing setting."""
    shard_group = (cfg.parallel.shard_size or gpus) if choice["strategy"] == "hsdp" else gpus
    return {"strategy": choice["strategy"], "ranks": shard_group, "micro_batch": choice["micro_batch"],
            "dtype": cfg.training.dtype, "reshard_after_forward": cfg.parallel.reshard_after_forward,
            "cpu_offload": choice["cpu_offload"], "swapped": choice["swapped"],
            "validation_rows": validation_rows(cfg, choice["micro_batch"]), "optimizer": cfg.optimizer.name,
            "adapter": cfg.lora.type}


def unswapped(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k != "swapped"}


def swappable(cfg, choice: dict) -> bool:
    """Block swapping can run with this choice: a LoRA run, unsharded, without CPU offload."""
    return cfg.lora.enabled and choice["strategy"] == "ddp" and not choice["cpu_offload"]


def counter(cfg, dataset, tokenizer):
    """count() by base quantization, each made once: a large model's count takes seconds."""
    return functools.cache(lambda quantization: count(cfg, dataset, tokenizer, quantization))


def plan_rows(cfg, counts, gpus: int, gpu_gib: float) -> list[dict]:
    rows, options = [], choices(cfg, gpus)
    given = options[0][1]
    if swappable(cfg, given):  # a LoRA run that does not fit as configured: the fewest blocks to swap that fit
        found = smallest_swap(counts(given["quantization"]), gpu_gib * GIB, checkpointing=given["checkpointing"],
                              every=given["every"], **unswapped(settings(cfg, given, gpus)))
        if found and found[0] > given["swapped"]:
            options.append((f"offload.blocks_to_swap={found[0]} (fewest)", {**given, "swapped": found[0]}))
    for name, choice in options:
        result = plan(counts(choice["quantization"]), checkpointing=choice["checkpointing"], every=choice["every"],
                      **settings(cfg, choice, gpus))
        rows.append({"choice": name, **{k: getattr(result, k) / GIB for k in
                                        ("weights", "gradients", "optimizer", "ema", "in_flight", "activations",
                                         "workspace", "validation", "overhead", "host")},
                     "total": result.peak / GIB, "fits": result.peak / GIB <= gpu_gib,
                     "recompute": 100 * result.recompute})
    return rows


def cheapest_line(cfg, counts, gpus: int, gpu_gib: float) -> str:
    """The activation checkpointing setting that fits with the least recompute, the rest as configured."""
    given = choices(cfg, gpus)[0][1]
    found = cheapest_checkpointing(counts(given["quantization"]), gpu_gib * GIB, **settings(cfg, given, gpus))
    if found is None:
        return f"no activation checkpointing setting fits {gpu_gib:g} GiB as configured otherwise"
    mode, every, result = found
    return (f"least recompute that fits {gpu_gib:g} GiB: training.activation_checkpointing={mode}"
            + (f" training.activation_checkpointing_every={every}" if every > 1 else "")
            + f" ({result.peak / GIB:.2f} GiB, +{100 * result.recompute:.0f} % step time)")


def swap_line(cfg, counts, gpus: int, gpu_gib: float) -> str | None:
    """For a LoRA run: the smallest offload.blocks_to_swap that fits, the rest as configured (None otherwise)."""
    given = choices(cfg, gpus)[0][1]
    if not swappable(cfg, given):
        return None
    count = counts(given["quantization"])
    found = smallest_swap(count, gpu_gib * GIB, checkpointing=given["checkpointing"], every=given["every"],
                          **unswapped(settings(cfg, given, gpus)))
    if found is None:
        every = plan(count, checkpointing=given["checkpointing"], every=given["every"],
                     **{**settings(cfg, given, gpus), "swapped": len(count.block_frozen)})
        return (f"no offload.blocks_to_swap fits {gpu_gib:g} GiB as configured otherwise (all "
                f"{len(count.block_frozen)} blocks swapped: {every.peak / GIB:.2f} GiB)")
    swapped, result = found
    if not swapped:
        return f"fits {gpu_gib:g} GiB without block swapping"
    return (f"smallest offload.blocks_to_swap that fits {gpu_gib:g} GiB: {swapped} of {len(count.block_frozen)} "
            f"blocks ({result.peak / GIB:.2f} GiB; {result.host / GIB:.2f} GiB of weights in host memory; "
            f"{result.swap_bytes / 2**30:.2f} GiB copied to the GPU per micro-step: benchmarks/roofline.py prices it)")


def print_rows(rows: list[dict], gpu_gib: float) -> None:
    columns = ("weights", "gradients", "optimizer", "ema", "in_flight", "activations", "workspace", "validation",
               "overhead", "total", "host")
    print(f"{'per rank, GiB':<36}" + "".join(f"{c:>12}" for c in columns) + f"{'+time %':>12}"
          + f"{'fits ' + format(gpu_gib, 'g') + ' GiB':>14}")
    for r in rows:
        print(f"{r['choice']:<36}" + "".join(f"{r[c]:>12.2f}" for c in columns) + f"{r['recompute']:>12.0f}"
              + f"{'yes' if r['fits'] else 'NO':>14}")


def readme_table(resolution: int, models: list[str] | None = None) -> str:
    """For each released model (or those of `models`), full and LoRA, at micro-batch 1 in bf16: the lightest
    setting that fits one GPU of 24, 48 and 80 GiB, and the per-GPU figure of FSDP over 8 GPUs of 80 GiB."""
    tried = [  # in order: the first that fits is shown
        ("bf16", {}), ("bf16 + selective AC", {"checkpointing": "selective"}),
        ("bf16 + AC", {"checkpointing": "full"}),
        ("bf16 + AC, int8 base", {"checkpointing": "full", "quantization": "int8"}),
        ("bf16 + AC, nf4 base", {"checkpointing": "full", "quantization": "nf4"}),
        # LoRA only: the fewest blocks to swap (offload.blocks_to_swap) that fit
        ("bf16 + AC, int8 base, {} blocks swapped", {"checkpointing": "full", "quantization": "int8", "swap": True}),
        ("bf16 + AC, nf4 base, {} blocks swapped", {"checkpointing": "full", "quantization": "nf4", "swap": True}),
        ("bf16 + AC + CPU offload", {"checkpointing": "full", "cpu_offload": True, "strategy": "fsdp"})]
    lines = [f"| model ({resolution} px) | training | 1 x 24 GiB | 1 x 48 GiB | 1 x 80 GiB | 8 x 80 GiB, FSDP |",
             "|---|---|---|---|---|---|"]
    for model in models or RELEASED:
        for lora in (False, True):
            path = f"configs/{model.replace('-', '_')}{'_lora' if lora else ''}.yaml"
            if not Path(path).is_file():  # FLUX.1-schnell: LoRA only
                continue
            cfg, _ = planning_config(path, ["training.train_batch_size=1", "training.activation_checkpointing=none"],
                                     model)
            dataset, tokenizer = data_like(cfg, resolution)
            counts = {}

            def peak(quantization="none", ranks=1, swap=False, gib=0, **change):
                if quantization not in counts:
                    counts[quantization] = count(cfg, dataset, tokenizer, quantization)
                settings = {"ranks": ranks, "micro_batch": 1, "dtype": "bf16", "strategy": "ddp", **change}
                if swap:  # the fewest blocks that fit `gib`, or all of them
                    found = smallest_swap(counts[quantization], gib * GIB, **settings)
                    return found or (None, plan(counts[quantization], swapped=len(counts[quantization].block_frozen),
                                                **settings))
                return None, plan(counts[quantization], **settings)

            cells = []
            for gib in (24, 48, 80):
                cell = "no single-GPU setting fits"
                for label, change in tried:
                    if change.get("quantization", "none") != "none" and not lora:
                        continue
                    swapped, result = peak(gib=gib, **change)
                    if result.peak / GIB <= gib:
                        host = f" (+{result.host / GIB:.0f} GiB host)" if result.host else ""
                        cell = f"{label.format(swapped)}: {result.peak / GIB:.1f} GiB{host}"
                        break
                cells.append(cell)
            sharded = peak(strategy="fsdp", ranks=8)[1]
            checkpointed = peak(strategy="fsdp", ranks=8, checkpointing="full")[1]
            cells.append(f"{sharded.peak / GIB:.1f} GiB ({checkpointed.peak / GIB:.1f} with AC)")
            lines.append(f"| {model} | {'LoRA r16' if lora else 'full'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the YAML config to plan")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the run will use (FSDP's shard group)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument("--model", choices=list(RELEASED), help="the architecture, when model.init_from is not here")
    parser.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latents: /8)")
    parser.add_argument("--table", action="store_true", help="print what fits 24/48/80 GB for each released model "
                        "(--model: for that one), as the families' guides show it")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    if args.table:
        print(readme_table(args.resolution, [args.model] if args.model else None))
        return 0
    if not args.config:
        parser.error("--config is required (or --table)")
    try:  # the user's input (the config, its files, the dataset): one line, exit 2
        cfg, name = planning_config(args.config, args.overrides, args.model)
        dataset, tokenizer = data_like(cfg, args.resolution)
    except InputError as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    print(f"{args.config}: {name or 'the configured architecture'}, {cfg.training.dtype}, {args.gpus} GPU(s) of "
          f"{args.gpu_gib:g} GiB" + (f", {args.resolution} px" if tokenizer is None else ""))
    counts = counter(cfg, dataset, tokenizer)
    print_rows(plan_rows(cfg, counts, args.gpus, args.gpu_gib), args.gpu_gib)
    print(cheapest_line(cfg, counts, args.gpus, args.gpu_gib))
    swapping = swap_line(cfg, counts, args.gpus, args.gpu_gib)
    if swapping:
        print(swapping)
    return 0


if __name__ == "__main__":
    with torchao_only_if(used=False):  # transformers and peft would import it, and its noise, at start-up
        sys.exit(main())
