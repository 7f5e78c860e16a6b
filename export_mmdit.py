"""Export a trained MMDiT for diffusers (and a FLUX.1, Qwen-Image or FLUX.2 LoRA for ComfyUI too).

    python export_mmdit.py --checkpoint PATH --out DIR [--weights ema|trained] [--dtype fp32|bf16|fp16]
                           [--format peft|kohya]

PATH is a run directory (its newest complete checkpoint is used) or one checkpoint directory. DIR must not exist:
nothing is ever overwritten.

A full fine-tune becomes a transformer directory of the run's family (`SD3Transformer2DModel`,
`FluxTransformer2DModel`, ...: `.from_pretrained(DIR)`, or a pipeline's `transformer=`). A LoRA run becomes, by --format:
  peft (default)  DIR/pytorch_lora_weights.safetensors, diffusers' own format (`StableDiffusion3Pipeline` or
                  `FluxPipeline.load_lora_weights(DIR)`; an edit run's: `FluxKontextPipeline`,
                  `QwenImageEditPlusPipeline`), with the text encoders' adapters of lora.text_encoders
                  (`text_encoder.*` for CLIP-L, `text_encoder_2.*` for SD3's CLIP-G) beside the transformer's.
  kohya           FLUX.1, Qwen-Image, FLUX.2: DIR/<DIR's name>.safetensors in the layout ComfyUI loads. Not for DoRA
                  runs.
                  FLUX.1: kohya's names (`lora_unet_...`, `lora_te1_...` for CLIP-L; lora_down / lora_up / alpha),
                  for ComfyUI and Forge (models/flux/kohya.py); diffusers loads it too but drops the adapters outside
                  the blocks (the final proj_out, which the target name proj_out adapts too): in diffusers, load the
                  peft file. Qwen-Image: diffusers' module names under `diffusion_model.` (lora_A / lora_B / alpha),
                  which QwenImagePipeline.load_lora_weights loads too (models/qwen_image/comfyui.py). FLUX.2: BFL's
                  module names under `diffusion_model.` (lora_A / lora_B, the q/k/v adapters fused, no alpha), which
                  the FLUX.2 pipelines' load_lora_weights loads too (models/flux2/comfyui.py). Its header has
                  kohya's ss_* metadata (`kohya_metadata`: what ComfyUI's LoRA browsers and model sites read).

A LoRA run writes both files beside each complete checkpoint, with the same code (runtime/export.py's
`CheckpointLoras`): loras/step_XXXXXXXX.safetensors and, where the family has the kohya layout, loras/step_XXXXXXXX_kohya.safetensors.
A LoKr or LoHa run (lora.type) of any family (models/lycoris.py): kohya writes DIR/<DIR's name>.safetensors in
ComfyUI's layout (`transformer.<diffusers module>.lokr_w1`, `….hada_w1_a`, ...); peft writes
DIR/pytorch_lora_weights.safetensors for diffusers where its pipeline loads the kind (LoKr: FLUX.2), and is refused
with the reason elsewhere.
"""

import argparse
import logging
import sys
from pathlib import Path

from errors import InputError
from formats import DTYPES
from perf.checkpoint import find_checkpoint
from runtime.directory_lock import writable_directory
from runtime.export import FORMATS, export
from runtime.quiet_imports import torchao_only_if

log = logging.getLogger("mmdit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path, help="run directory or checkpoint directory")
    parser.add_argument("--out", required=True, type=Path, help="new directory to write")
    parser.add_argument("--weights", choices=["ema", "trained"], default="ema",
                        help="the EMA of the weights (smoother) or the last trained weights")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="dtype of the written weights")
    parser.add_argument("--format", choices=FORMATS, default="peft",
                        help="a LoRA's layout: diffusers' (peft) or, for FLUX.1, Qwen-Image and FLUX.2 (a LoKr or "
                             "LoHa: any family), ComfyUI's (kohya)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        checkpoint = find_checkpoint(args.checkpoint)
        writable_directory(args.out.parent, f"--out {args.out}")  # before the checkpoint is read and converted
        out = export(checkpoint, args.out, args.weights == "ema", DTYPES[args.dtype], args.format)
    except (InputError, OSError) as e:  # also: an existing output, a file where a folder must be, a full disk
        log.error("export failed: %s", e)
        return 2
    log.info("exported %s weights of %s to %s", args.weights, checkpoint, out)
    return 0


if __name__ == "__main__":
    with torchao_only_if(used=False):  # transformers and peft would import it, and its noise, at start-up
        sys.exit(main())
