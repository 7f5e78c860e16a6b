"""SD3 / SD3.5 as a family of the trainer (models/family.py): the joint blocks of models/sd3/model.py, patchified
inside the transformer, conditioned on CLIP-L + CLIP-G + T5 (models/sd3/text.py)."""

from errors import FieldError
from models.family import KL_VAE, Family, ReleasedText
from models.sd3.model import MMDiT, MMDiTConfig
from models.sd3.text import SD3TextEncoders, SD3Tokenizers

ARCHITECTURE = ("patch_size", "num_layers", "num_attention_heads", "attention_head_dim", "sample_size",
                "pos_embed_max_size", "qk_norm", "dual_attention_layers")


def settings(config: MMDiTConfig) -> dict:
    return {key: getattr(config, key) for key in ARCHITECTURE}


def build_config(model, latent_channels: int, text_dims: tuple[int, int]) -> MMDiTConfig:
    joint, pooled = text_dims
    return MMDiTConfig(sample_size=model.sample_size, patch_size=model.patch_size, in_channels=latent_channels,
                       out_channels=latent_channels, num_layers=model.num_layers,
                       attention_head_dim=model.attention_head_dim, num_attention_heads=model.num_attention_heads,
                       joint_attention_dim=joint, caption_projection_dim=model.num_attention_heads * model.attention_head_dim,
                       pooled_projection_dim=pooled, pos_embed_max_size=model.pos_embed_max_size, qk_norm=model.qk_norm,
                       dual_attention_layers=list(model.dual_attention_layers))


def check(model) -> None:
    if (model.num_attention_heads * model.attention_head_dim) % 4:
        raise FieldError("num_attention_heads", model.num_attention_heads, f"such that heads * attention_head_dim "
                         f"({model.attention_head_dim}) divides by 4 (the 2-D sin-cos position table splits the width "
                         f"four ways)")
    if model.sample_size < model.patch_size:
        raise FieldError("sample_size", model.sample_size, f">= patch_size ({model.patch_size})")
    outside = [i for i in model.dual_attention_layers if not 0 <= i < model.num_layers]
    if outside:
        raise FieldError("dual_attention_layers", list(model.dual_attention_layers),
                         f"block indices in 0..{model.num_layers - 1}")


# diffusers' train_dreambooth_lora_sd3.py: the joint attention's projections
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out")

FAMILY = Family(
    name="sd3", title="SD3 / SD3.5", transformer=MMDiT, config=MMDiTConfig, pipelines=("StableDiffusion3Pipeline",),
    lora_targets=LORA_TARGETS, text_encoders=SD3TextEncoders, tokenizers=SD3Tokenizers, max_sequence_length=256,
    options=("sample_size", "pos_embed_max_size", "dual_attention_layers"), architecture=ARCHITECTURE,
    demo={"num_layers": 6},
    # docs/sd3-architecture.md
    released={"sd3-medium": {"num_layers": 24, "num_attention_heads": 24, "attention_head_dim": 64, "patch_size": 2,
                             "sample_size": 128, "pos_embed_max_size": 192, "qk_norm": None,
                             "dual_attention_layers": []},
              "sd35-medium": {"num_layers": 24, "num_attention_heads": 24, "attention_head_dim": 64, "patch_size": 2,
                              "sample_size": 128, "pos_embed_max_size": 384, "qk_norm": "rms_norm",
                              "dual_attention_layers": list(range(13))},
              "sd35-large": {"num_layers": 38, "num_attention_heads": 38, "attention_head_dim": 64, "patch_size": 2,
                             "sample_size": 128, "pos_embed_max_size": 192, "qk_norm": "rms_norm",
                             "dual_attention_layers": []}},
    # CLIP-L + CLIP-G (77 tokens) and T5 (256), pooled CLIP-L ++ CLIP-G; 16-channel latents at 1/8
    released_text=ReleasedText(joint=4096, pooled=2048, latent_channels=16, vae_factor=8), extra_text_tokens=77,
    released_vae=KL_VAE,
    settings=settings, build_config=build_config, check=check,
    neutral_values={"pos_embed_type": "sincos", "use_pos_embed": True, "context_pre_only": None, "qk_norm_eps": 1e-6})
