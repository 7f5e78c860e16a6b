"""Building the text-to-image model from a config, and generating images from captions."""

import torch
from omegaconf import DictConfig

from configs.schema import ConfigError
from data.shapes import MAX_CAPTION_WORDS, VOCABULARY
from models.mmdit import MMDiT, MMDiTConfig
from models.rectified_flow import SAMPLING_STREAM, euler_sample, sample_key
from models.text_encoder import TextToImage, TinyTextEncoder, WordTokenizer


def build_tokenizer() -> WordTokenizer:
    return WordTokenizer(VOCABULARY, MAX_CAPTION_WORDS)


def mmdit_config(cfg: DictConfig, latent_channels: int, latent_size: int, text_dim: int) -> MMDiTConfig:
    m = cfg.model
    if latent_size % m.patch_size:
        raise ConfigError(f"model.patch_size={m.patch_size} does not divide the {latent_size}-pixel input")
    if latent_size // m.patch_size > m.pos_embed_max_size:
        raise ConfigError(f"model.pos_embed_max_size={m.pos_embed_max_size} is smaller than the "
                          f"{latent_size // m.patch_size}-patch grid")
    dim = m.num_attention_heads * m.attention_head_dim
    return MMDiTConfig(sample_size=m.sample_size, patch_size=m.patch_size, in_channels=latent_channels,
                       out_channels=latent_channels, num_layers=m.num_layers,
                       attention_head_dim=m.attention_head_dim, num_attention_heads=m.num_attention_heads,
                       joint_attention_dim=text_dim, caption_projection_dim=dim, pooled_projection_dim=text_dim,
                       pos_embed_max_size=m.pos_embed_max_size, qk_norm=m.qk_norm,
                       dual_attention_layers=list(m.dual_attention_layers))


def build_model(cfg: DictConfig, latent_channels: int, latent_size: int, vocab_size: int) -> TextToImage:
    t = cfg.text_encoder
    text_encoder = TinyTextEncoder(vocab_size, MAX_CAPTION_WORDS, t.dim, t.num_layers, t.num_heads)
    return TextToImage(MMDiT(mmdit_config(cfg, latent_channels, latent_size, t.dim)), text_encoder)


def initial_noise(seed: int, count: int, shape: tuple) -> torch.Tensor:
    """Starting noise for the i-th generated image, keyed by (seed, i)."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        sample_key(seed, SAMPLING_STREAM, i))) for i in range(count)])


@torch.no_grad()
def generate(model: TextToImage, tokenizer: WordTokenizer, captions: list[str], seed: int, steps: int,
             cfg_scale: float, shift: float, shape: tuple, batch_size: int = 96) -> torch.Tensor:
    """Images in [0, 1], [N, C, H, W], on the CPU; image i depends only on (seed, i, caption i)."""
    device = next(model.parameters()).device
    noise = initial_noise(seed, len(captions), shape)
    uncond = model.encode({"input_ids": tokenizer([""]).to(device)})
    out = []
    for start in range(0, len(captions), batch_size):
        ids = tokenizer(captions[start : start + batch_size]).to(device)
        cond = model.encode({"input_ids": ids})
        n = ids.shape[0]
        x = euler_sample(model.velocity, noise[start : start + n].to(device), cond,
                         tuple(u.expand(n, *u.shape[1:]) for u in uncond), steps, cfg_scale, shift)
        out.append(((x.float().clamp(-1, 1) + 1) / 2).cpu())
    return torch.cat(out)
