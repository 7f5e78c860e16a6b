"""Building the text-to-image model from a config, and generating images from captions."""

import torch
from omegaconf import DictConfig

from configs.schema import ConfigError
from data.latents import DataFormatError, LatentDataset
from data.shapes import MAX_CAPTION_WORDS, VOCABULARY, ShapesDataset
from models.mmdit import MMDiT, MMDiTConfig
from models.rectified_flow import SAMPLING_STREAM, euler_sample, sample_key
from models.text_encoder import TextToImage, TinyTextEncoder, WordTokenizer


def build_tokenizer() -> WordTokenizer:
    return WordTokenizer(VOCABULARY, MAX_CAPTION_WORDS)


def mmdit_config(cfg: DictConfig, latent_channels: int, latent_sizes: list[tuple[int, int]], joint_dim: int,
                 pooled_dim: int) -> MMDiTConfig:
    m = cfg.model
    for size in latent_sizes:
        if size[0] % m.patch_size or size[1] % m.patch_size:
            raise ConfigError(f"model.patch_size={m.patch_size} does not divide the {size[0]}x{size[1]} latents")
        if max(size) // m.patch_size > m.pos_embed_max_size:
            raise ConfigError(f"model.pos_embed_max_size={m.pos_embed_max_size} is smaller than the "
                              f"{size[0] // m.patch_size}x{size[1] // m.patch_size} patch grid")
    dim = m.num_attention_heads * m.attention_head_dim
    return MMDiTConfig(sample_size=m.sample_size, patch_size=m.patch_size, in_channels=latent_channels,
                       out_channels=latent_channels, num_layers=m.num_layers,
                       attention_head_dim=m.attention_head_dim, num_attention_heads=m.num_attention_heads,
                       joint_attention_dim=joint_dim, caption_projection_dim=dim, pooled_projection_dim=pooled_dim,
                       pos_embed_max_size=m.pos_embed_max_size, qk_norm=m.qk_norm,
                       dual_attention_layers=list(m.dual_attention_layers))


def build_data(cfg: DictConfig) -> tuple[torch.utils.data.Dataset, WordTokenizer | None]:
    """The dataset, and the tokenizer of the jointly trained text encoder (None for precomputed embeddings)."""
    if cfg.data.name == "shapes":
        return ShapesDataset(cfg.data.num_items, cfg.training.seed), build_tokenizer()
    if not cfg.data.path:
        raise ConfigError("data.name=latents needs data.path, a directory written by python -m data.precompute")
    try:
        return LatentDataset(cfg.data.path, cfg.data.aspect_buckets), None
    except DataFormatError as e:
        raise ConfigError(str(e)) from None


def build_model(cfg: DictConfig, dataset, tokenizer: WordTokenizer | None = None) -> TextToImage:
    """The MMDiT sized for the dataset; with a tokenizer, also the text encoder trained jointly with it.
    Datasets of precomputed embeddings bring their own text widths (`text_dims`)."""
    channels, sizes = dataset.latent_channels, dataset.latent_sizes
    if tokenizer is None:
        return TextToImage(MMDiT(mmdit_config(cfg, channels, sizes, *dataset.text_dims)))
    t = cfg.text_encoder
    text_encoder = TinyTextEncoder(len(tokenizer.vocab), tokenizer.max_length, t.dim, t.num_layers, t.num_heads)
    return TextToImage(MMDiT(mmdit_config(cfg, channels, sizes, t.dim, t.dim)), text_encoder)


def example_text(dataset, tokenizer: WordTokenizer | None) -> dict[str, torch.Tensor]:
    """One sample's text input of the model (the empty caption), to count its tokens and FLOPs."""
    if tokenizer is not None:
        return {"input_ids": tokenizer([""])}
    joint, pooled = dataset.text_dims
    return {"prompt_embeds": torch.zeros(1, dataset.text_tokens, joint), "pooled_prompt_embeds": torch.zeros(1, pooled)}


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
