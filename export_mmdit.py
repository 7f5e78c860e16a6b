"""Export a trained MMDiT in the format diffusers loads.

    python export_mmdit.py --checkpoint PATH --out DIR [--weights ema|trained] [--dtype fp32|bf16|fp16]

PATH is a run directory (its newest complete checkpoint is used) or one checkpoint directory. A full
fine-tune becomes an `SD3Transformer2DModel` directory (`SD3Transformer2DModel.from_pretrained(DIR)`, or a
pipeline's `transformer=`); a LoRA run becomes `DIR/pytorch_lora_weights.safetensors`
(`StableDiffusion3Pipeline.load_lora_weights(DIR)`), with the text encoders' adapters of lora.text_encoders
(`text_encoder.*` for CLIP-L, `text_encoder_2.*` for CLIP-G) beside the transformer's. DIR must not exist:
nothing is ever overwritten.
"""

import argparse
import logging
import sys
from pathlib import Path

import torch

from errors import InputError
from formats import DTYPES
from models.diffusers_io import (CheckpointFormatError, check_state_dict, export_diffusers_lora,
                                 export_diffusers_transformer, transformers4_clip_names)
from models.families import FAMILIES, transformer_of_record
from perf.checkpoint import find_checkpoint, read_checkpoint

log = logging.getLogger("mmdit")
PREFIX = "transformer."  # the MMDiT's place in the trained TextToImage module


def export(checkpoint: Path, out: Path, use_ema: bool = True, dtype: torch.dtype = torch.float32) -> Path:
    tensors, meta = read_checkpoint(checkpoint)
    if "mmdit" not in meta:
        raise CheckpointFormatError(f"{checkpoint} predates export support (no 'mmdit' in state.json); "
                                    f"resume it for one step to write a new checkpoint")
    weights = {**tensors["model"], **(tensors["ema"] if use_ema else {})}  # the EMA covers trained parameters
    part = lambda prefix: {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
    transformer = part(PREFIX)
    family = FAMILIES[meta.get("family", "sd3")]  # recorded since FLUX.1
    if meta["lora"]:
        adapters = {"transformer": (transformer, meta["lora"])}
        for encoder, settings in meta.get("text_encoder_lora", {}).items():  # lora.text_encoders
            clip = transformers4_clip_names(part(f"text_encoder.{encoder}."))
            adapters[family.text_encoders.PARTS[encoder][0]] = (clip, settings)
        return export_diffusers_lora(adapters, out, dtype)
    model = transformer_of_record(family.name, meta["mmdit"])
    check_state_dict(model.state_dict(), transformer, checkpoint)
    model.load_state_dict(transformer)
    return export_diffusers_transformer(model, out, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path, help="run directory or checkpoint directory")
    parser.add_argument("--out", required=True, type=Path, help="new directory to write")
    parser.add_argument("--weights", choices=["ema", "trained"], default="ema",
                        help="the EMA of the weights (smoother) or the last trained weights")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="dtype of the written weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        checkpoint = find_checkpoint(args.checkpoint)
        out = export(checkpoint, args.out, args.weights == "ema", DTYPES[args.dtype])
    except (InputError, OSError) as e:  # also: an existing output, a file where a folder must be, a full disk
        log.error("export failed: %s", e)
        return 2
    log.info("exported %s weights of %s to %s", args.weights, checkpoint, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
