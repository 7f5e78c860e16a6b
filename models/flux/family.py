"""FLUX.1 (dev and schnell) as a family of the trainer (models/family.py): models/flux/model.py's double- and
single-stream blocks over latents packed 2 x 2 into tokens, conditioned on T5 tokens and CLIP-L's pooled output
(models/flux/text.py); its original single file is read by models/flux/bfl.py."""

import logging

from PIL import Image

from models.family import KL_VAE, Family, ReleasedText, ResolutionShift, check_qk_norm, check_rotary_axes
from models.flux.bfl import BFLReader
from models.flux.kohya import kohya_lora, outside_the_blocks
from models.blocks import rotary_axes
from models.flux.model import Flux, FluxConfig
from models.flux.text import FluxTextEncoders, FluxTokenizers

log = logging.getLogger("mmdit")
ARCHITECTURE = ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "axes_dims_rope",
                "guidance_embeds")
PACKING = 2  # FluxPipeline packs 2x2 latents of its 16-channel VAE into a token: model.patch_size of FLUX.1


def settings(config: FluxConfig) -> dict:
    return {**{key: getattr(config, key) for key in ARCHITECTURE}, "patch_size": PACKING, "qk_norm": "rms_norm"}


def build_config(model, latent_channels: int, text_dims: tuple[int, int]) -> FluxConfig:
    channels = latent_channels * model.patch_size**2  # p x p latents packed into a token
    return FluxConfig(in_channels=channels, out_channels=channels, num_layers=model.num_layers,
                      num_single_layers=model.num_single_layers, attention_head_dim=model.attention_head_dim,
                      num_attention_heads=model.num_attention_heads, joint_attention_dim=text_dims[0],
                      pooled_projection_dim=text_dims[1], guidance_embeds=model.guidance_embeds,
                      axes_dims_rope=list(model.axes_dims_rope))


def check(model) -> None:
    check_qk_norm(model, "FLUX.1")
    check_rotary_axes(model, 3)


def fill_defaults(model) -> None:
    """FLUX.1's ratio of single to double blocks (38 to 19), and its rotary split scaled to the head dim."""
    if model.num_single_layers is None:
        model.num_single_layers = 2 * model.num_layers
    if model.axes_dims_rope is None:
        model.axes_dims_rope = rotary_axes(model.attention_head_dim)


def kohya_tensors(adapters: dict, config: FluxConfig, source: str) -> dict:
    """The tensors of a FLUX.1 LoRA's kohya / ComfyUI file (models/flux/kohya.py)."""
    tensors = kohya_lora(adapters, (config.hidden_size, config.num_layers, config.num_single_layers), source)
    dropped = outside_the_blocks(adapters["transformer"][0])
    if dropped:
        log.warning("%s adapts %s outside the blocks: ComfyUI and Forge apply them, diffusers (0.42) drops them from "
                    "a kohya file; load the default --format peft in diffusers", source, dropped)
    return tensors


# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS (width, height): the sizes Kontext was trained at, about 1 MP
KONTEXT_RESOLUTIONS = [(672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
                       (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
                       (1456, 720), (1504, 688), (1568, 672)]


def kontext_reference(image: Image.Image, resolution: int, multiple: int) -> Image.Image:
    """As FluxKontextPipeline resizes its reference (`_auto_resize`): to the preferred resolution nearest its aspect
    ratio (of its sides floored to `multiple`), scaled by resolution / 1024, floored to `multiple`; stretched
    (Lanczos)."""
    width, height = (side - side % multiple for side in image.size)
    _, w, h = min((abs(width / height - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    w, h = (max(multiple, side * resolution // 1024 // multiple * multiple) for side in (w, h))
    return image.resize((w, h), Image.LANCZOS)


# diffusers' train_dreambooth_lora_flux.py: the attention projections of both block kinds (a name matches in every
# block that has it) and the double blocks' feed-forwards. Adding "proj_mlp" adapts the single blocks' MLPs too;
# "proj_out" would also adapt the final projection, outside the blocks
LORA_TARGETS = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2")
RELEASED = {"num_layers": 19, "num_single_layers": 38, "num_attention_heads": 24, "attention_head_dim": 128,
            "patch_size": PACKING, "qk_norm": "rms_norm", "axes_dims_rope": [16, 56, 56]}

FAMILY = Family(
    name="flux", title="FLUX.1", transformer=Flux, config=FluxConfig, pipelines=("FluxPipeline",),
    lora_targets=LORA_TARGETS, text_encoders=FluxTextEncoders, tokenizers=FluxTokenizers,
    # FLUX.1-dev's pipeline pads T5 to 512 tokens; schnell (no guidance embedding) is used with 256
    max_sequence_length=512, sequence_length=lambda model: 512 if getattr(model, "guidance_embeds", True) else 256,
    options=("num_single_layers", "axes_dims_rope", "guidance_embeds"), architecture=ARCHITECTURE,
    # 3 double- and 4 single-stream blocks train in about sd3's time and read position from the caption (FLUX.1's
    # ratio, 2 + 4, learned it in one run of three: docs/flux.md)
    demo={"num_layers": 3, "num_single_layers": 4},
    # FLUX.1 Kontext [dev] is FLUX.1-dev's transformer (its configs: configs/flux_kontext_*.yaml)
    released={"flux-dev": {**RELEASED, "guidance_embeds": True}, "flux-schnell": {**RELEASED, "guidance_embeds": False},
              "flux-kontext": {**RELEASED, "guidance_embeds": True}},
    # T5 tokens, CLIP-L's pooled output; 16-channel latents at 1/8
    released_text=ReleasedText(joint=4096, pooled=768, latent_channels=16, vae_factor=8),
    released_vae=KL_VAE,
    settings=settings, build_config=build_config, check=check, fill_defaults=fill_defaults,
    schedule=ResolutionShift(), single_file=BFLReader, packing=PACKING, kohya=kohya_tensors,
    kohya_names=("flux1", "networks.lora_flux"), edit_pipelines=("FluxKontextPipeline",),
    reference_image=kontext_reference)
