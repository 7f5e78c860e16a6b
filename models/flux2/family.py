"""FLUX.2 (klein 4B and 9B, dev) as a family of the trainer (models/family.py): models/flux2/model.py's double- and
single-stream blocks with shared modulations, over latents that its VAE step patchified 2 x 2 into 128 channels
(models/vae.py: one latent pixel per token), conditioned on three layers of one language model, Qwen3 for klein,
Mistral-Small-3 for dev (models/flux2/text.py). Its original single file (BFL's names) is read by
models/flux2/bfl.py, its LoRA written for ComfyUI by models/flux2/comfyui.py. docs/flux2-architecture.md has the
facts and their sources."""

from PIL import Image

from models.family import Family, ReleasedText, ResolutionShift, check_qk_norm, check_rotary_axes
from models.flux2.bfl import TOP, Flux2BFLReader
from models.flux2.comfyui import comfyui_tensors
from models.flux2.model import Flux2, Flux2Config, rotary_axes
from models.flux2.text import Flux2TextEncoders, Flux2Tokenizers

ARCHITECTURE = ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "axes_dims_rope",
                "guidance_embeds")
PACKING = 1  # the pipelines' VAE step patchifies 2 x 2; the transformer's token is one latent pixel of that


def settings(config: Flux2Config) -> dict:
    return {**{key: getattr(config, key) for key in ARCHITECTURE}, "patch_size": PACKING, "qk_norm": "rms_norm"}


def build_config(model, latent_channels: int, text_dims: tuple[int, int]) -> Flux2Config:
    channels = latent_channels * model.patch_size**2  # p x p latent pixels packed into a token (released: p = 1)
    return Flux2Config(in_channels=channels, out_channels=channels, num_layers=model.num_layers,
                       num_single_layers=model.num_single_layers, attention_head_dim=model.attention_head_dim,
                       num_attention_heads=model.num_attention_heads, joint_attention_dim=text_dims[0],
                       guidance_embeds=model.guidance_embeds, axes_dims_rope=list(model.axes_dims_rope))


def check(model) -> None:
    check_qk_norm(model, "FLUX.2")
    check_rotary_axes(model, 4)


def fill_defaults(model) -> None:
    """klein-4B's ratio of single to double blocks (20 to 5), and FLUX.2's rotary split scaled to the head dim."""
    if model.num_single_layers is None:
        model.num_single_layers = 4 * model.num_layers
    if model.axes_dims_rope is None:
        model.axes_dims_rope = rotary_axes(model.attention_head_dim)


def empirical_mu(image_tokens: int, steps: int) -> float:
    """mu of FLUX.2's sampling schedule (its pipelines' `compute_empirical_mu`, from BFL's flux2 sampling code): two
    lines in the token count fitted at 10 and 200 steps, interpolated linearly in the step count; above 4300 tokens
    the 200-step line for every step count (so the shift jumps there for few steps: 1024 px, 4096 tokens, 4 steps
    -> 2.29; 1088 px, 4624 tokens -> 1.24). The sigmas are e^mu-shifted like FLUX.1's."""
    a1, b1 = 8.73809524e-05, 1.89833333  # 10 steps
    a2, b2 = 0.00016927, 0.45666666  # 200 steps
    if image_tokens > 4300:
        return a2 * image_tokens + b2
    m200, m10 = a2 * image_tokens + b2, a1 * image_tokens + b1
    slope = (m200 - m10) / 190.0
    return slope * steps + m200 - 200.0 * slope


def pipeline_reference(image: Image.Image, resolution: int, multiple: int) -> Image.Image:
    """As Flux2KleinPipeline and Flux2Pipeline resize a reference image: down to resolution^2 pixels where larger
    (Lanczos; 1024^2 theirs), then centre-cropped to its sides floored to `multiple` (Flux2ImageProcessor's
    `_resize_and_crop` crops only)."""
    width, height = image.size
    if width * height > resolution * resolution:
        scale = (resolution * resolution / (width * height)) ** 0.5
        image = image.resize((int(width * scale), int(height * scale)), Image.LANCZOS)
    width, height = (max(multiple, side // multiple * multiple) for side in image.size)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


# diffusers' train_dreambooth_lora_flux2.py and _klein.py: the double blocks' image attention (to_q, to_k, to_v,
# to_out.0) and the single blocks' fused projections (to_qkv_mlp_proj, to_out: the latter by full name, since
# `attn.to_out` is a ModuleList in the double blocks). The text stream and the double blocks' feed-forwards are
# left, and so are the shared modulations: they are outside the blocks (one matrix drives the shift, scale and gate
# of every block of a kind, so an adapter there moves all blocks at once), diffusers' scripts and musubi-tuner's
# LoRA leave them, and the trainer wraps, shards and offloads blocks. Adding `double_stream_modulation_img.linear`
# (etc.) to lora.target_modules adapts them; the exports carry them.
BLOCK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")


def lora_targets(model) -> list[str]:
    single = [f"single_transformer_blocks.{i}.attn.to_out" for i in range(model.num_single_layers)]
    return [*BLOCK_TARGETS, *(["attn.to_qkv_mlp_proj"] if single else []), *single]


# the language models' hidden size x 3 layers: klein-4B Qwen3-4B (2560), klein-9B Qwen3-8B (4096), dev
# Mistral-Small-3 (5120); 32 latent channels patchified to 128 at 1/16
JOINT_BY_HEADS = {24: 3 * 2560, 32: 3 * 4096, 48: 3 * 5120}


def released_text(model) -> ReleasedText:
    """The released pipeline's text for a transformer of these sizes (by its heads: klein-4B 24, klein-9B 32, dev
    48; other sizes: dev's)."""
    joint = JOINT_BY_HEADS.get(getattr(model, "num_attention_heads", 48), JOINT_BY_HEADS[48])
    return ReleasedText(joint=joint, pooled=0, latent_channels=128, vae_factor=16)


COMFYUI_UNMAPPED = ("time_guidance_embed.", "double_stream_modulation_", "single_stream_modulation")
RELEASED = {"patch_size": PACKING, "qk_norm": "rms_norm", "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32]}

FAMILY = Family(
    name="flux2", title="FLUX.2", transformer=Flux2, config=Flux2Config,
    pipelines=("Flux2KleinPipeline", "Flux2Pipeline"), lora_targets=lora_targets, text_encoders=Flux2TextEncoders,
    tokenizers=Flux2Tokenizers, max_sequence_length=512,  # both pipelines' default
    options=("num_single_layers", "axes_dims_rope", "guidance_embeds"), architecture=ARCHITECTURE,
    # FLUX.1's demo: 3 double- and 4 single-stream blocks at width 128 learn the shapes in about sd3's time
    demo={"num_layers": 3, "num_single_layers": 4},
    # docs/flux2-architecture.md: diffusers' defaults (dev) and the klein releases' config.json values
    released={"flux2-klein-4b": {**RELEASED, "num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
                                 "guidance_embeds": False},
              "flux2-klein-9b": {**RELEASED, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
                                 "guidance_embeds": False},
              "flux2-dev": {**RELEASED, "num_layers": 8, "num_single_layers": 48, "num_attention_heads": 48,
                            "guidance_embeds": True}},
    released_text=released_text, released_vae=("AutoencoderKLFlux2", {}),  # its defaults: the releases' vae/
    settings=settings, build_config=build_config, check=check,
    fill_defaults=fill_defaults,
    # training sigmas (flow.resolution_shift): FLUX.1's e^mu, mu 0.5 at 256 tokens to 1.15 at 4096, over FLUX.2's
    # tokens, as musubi-tuner's `flux2_shift` (docs/flux2-architecture.md: schedule); sampling: its pipelines' own mu
    schedule=ResolutionShift(), sampling_mu=empirical_mu,
    single_file=Flux2BFLReader, packing=PACKING, kohya=comfyui_tensors,
    kohya_names=("flux2", "networks.lora_flux_2"),
    # its pipelines take reference images natively (`image=`)
    edit_pipelines=("Flux2KleinPipeline", "Flux2Pipeline"), reference_image=pipeline_reference,
    # Flux2LoraLoaderMixin loads LoKr (diffusers 0.42); ComfyUI's diffusers-name map for FLUX (comfy/utils.py,
    # `flux_to_diffusers`) has FLUX.1's embedder names and no shared modulations: those by their BFL names
    diffusers_lycoris=("lokr",),
    comfyui_names={ours: f"diffusion_model.{bfl}" for bfl, ours in TOP.items() if ours.startswith(COMFYUI_UNMAPPED)})
