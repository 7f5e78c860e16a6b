"""Qwen-Image as a family of the trainer (models/family.py): the dual-stream blocks of models/qwen_image/model.py over
latents packed 2 x 2 into tokens, conditioned on Qwen2.5-VL's hidden states with their padding mask
(models/qwen_image/text.py); latents from its Wan-style VAE, normalised per channel (models/vae.py). ComfyUI's files:
its single file of the transformer is read by models/qwen_image/single_file.py, its LoRA layout written by
models/qwen_image/comfyui.py."""

from PIL import Image

from models.blocks import rotary_axes
from models.family import Family, ReleasedText, ResolutionShift, check_qk_norm, check_rotary_axes
from models.qwen_image.comfyui import comfyui_tensors
from models.qwen_image.model import QwenImage, QwenImageConfig
from models.qwen_image.single_file import QwenSingleFileReader
from models.qwen_image.text import MAX_SEQUENCE_LENGTH, QwenEditText, QwenTextEncoders, QwenTokenizers, area_size

ARCHITECTURE = ("patch_size", "num_layers", "num_attention_heads", "attention_head_dim", "axes_dims_rope",
                "zero_cond_t")


def settings(config: QwenImageConfig) -> dict:
    return {**{key: getattr(config, key) for key in ARCHITECTURE}, "qk_norm": "rms_norm"}


def build_config(model, latent_channels: int, text_dims: tuple[int, int]) -> QwenImageConfig:
    return QwenImageConfig(patch_size=model.patch_size, in_channels=latent_channels * model.patch_size**2,
                           out_channels=latent_channels, num_layers=model.num_layers,
                           attention_head_dim=model.attention_head_dim, num_attention_heads=model.num_attention_heads,
                           joint_attention_dim=text_dims[0], axes_dims_rope=list(model.axes_dims_rope),
                           zero_cond_t=model.zero_cond_t)


def check(model) -> None:
    check_qk_norm(model, "Qwen-Image")
    check_rotary_axes(model, 3)


def fill_defaults(model) -> None:
    if model.axes_dims_rope is None:
        model.axes_dims_rope = rotary_axes(model.attention_head_dim)


def edit_reference(image: Image.Image, resolution: int, multiple: int) -> Image.Image:
    """As QwenImageEditPlusPipeline resizes a reference for its VAE: about resolution^2 pixels (its VAE_IMAGE_SIZE,
    1024^2) at its aspect ratio, sides multiples of 32; stretched (Lanczos)."""
    return image.resize(area_size(*image.size, resolution * resolution), Image.LANCZOS)


# Both streams' attention projections and feed-forwards, as diffusers' FLUX.1 script adapts them and musubi-tuner's
# and ai-toolkit's block linears do (without the modulations). diffusers' train_dreambooth_lora_qwen_image.py takes
# the image stream's attention alone by default (to_q, to_k, to_v, to_out.0): lora.target_modules narrows to that
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
           "txt_mlp.net.2")

FAMILY = Family(
    name="qwen_image", title="Qwen-Image", transformer=QwenImage, config=QwenImageConfig,
    pipelines=("QwenImagePipeline",), lora_targets=TARGETS, text_encoders=QwenTextEncoders, tokenizers=QwenTokenizers,
    max_sequence_length=512, max_text_tokens=MAX_SEQUENCE_LENGTH,  # QwenImagePipeline.__call__'s default; its most
    options=("axes_dims_rope", "zero_cond_t"), architecture=ARCHITECTURE,
    # 6 dual-stream blocks: sd3's demo in blocks and width
    demo={"num_layers": 6},
    # docs/qwen-image-architecture.md: Qwen/Qwen-Image's transformer/config.json
    released={"qwen-image": {"num_layers": 60, "num_attention_heads": 24, "attention_head_dim": 128, "patch_size": 2,
                             "qk_norm": "rms_norm", "axes_dims_rope": [16, 56, 56], "zero_cond_t": False}},
    # Qwen2.5-VL-7B's last hidden states, padded, with a mask; 16-channel latents at 1/8
    released_text=ReleasedText(joint=3584, pooled=0, latent_channels=16, vae_factor=8, masked=True),
    released_vae=("AutoencoderKLQwenImage", {}),  # its defaults are Qwen/Qwen-Image's vae/config.json
    settings=settings, build_config=build_config, check=check, fill_defaults=fill_defaults,
    # Qwen/Qwen-Image's scheduler/scheduler_config.json
    schedule=ResolutionShift(base_tokens=256, max_tokens=8192, base_shift=0.5, max_shift=0.9, terminal=0.02),
    single_file=QwenSingleFileReader, kohya=comfyui_tensors, kohya_names=("qwen_image", "networks.lora_qwen_image"),
    packing=2, cfg_renorm=True, negative_prompt=" ",  # true CFG, as the model card's true_cfg_scale=4.0
    edit_pipelines=("QwenImageEditPlusPipeline", "QwenImageEditPipeline"), reference_image=edit_reference,
    edit_text=QwenEditText,
    # Qwen-Image-Layered's extra conditioning and layered rotary positions: not implemented, accepted off
    neutral_values={"use_additional_t_cond": False, "use_layer3d_rope": False})
