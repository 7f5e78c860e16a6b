"""What a config describes, built: the dataset, its tokenizer, the model and the held-out split. The entry
points compose these; `models/` and `data/` stay free of configs."""

import dataclasses
from pathlib import Path

import torch
from omegaconf import DictConfig

from configs.schema import ConfigError
from data.latents import DataFormatError, LatentDataset
from data.loader import split_holdout
from data.shapes import MAX_CAPTION_WORDS, VOCABULARY, ShapesDataset
from models.diffusers_io import CheckpointFormatError, load_diffusers_weights, read_config
from models.lora import apply_lora
from models.mmdit import MMDiT, MMDiTConfig
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
        raise ConfigError("data.name=latents needs data.path, a directory written by "
                          "python precompute_latents.py")
    try:
        return LatentDataset(cfg.data.path, cfg.data.aspect_buckets), None
    except DataFormatError as e:
        raise ConfigError(str(e)) from None


def holdout_split(cfg: DictConfig, dataset) -> tuple[list[int], list[int]]:
    """(training items, held-out items) of `data.holdout`."""
    try:
        return split_holdout(len(dataset), cfg.data.holdout, cfg.training.seed)
    except ValueError as e:
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


def build_trained_model(cfg: DictConfig, dataset, tokenizer: WordTokenizer | None = None) -> TextToImage:
    """The model as training starts it: built, loaded from model.init_from when set, then with LoRA adapters
    (a no-op unless lora.enabled)."""
    model = build_model(cfg, dataset, tokenizer)
    if cfg.model.init_from:
        init_from_diffusers(model.transformer, cfg.model.init_from)
    return apply_lora(model, cfg.lora)


def init_from_diffusers(transformer: MMDiT, directory: str) -> None:
    """Load a diffusers transformer directory. Its sizes are the configured ones (`load_config` took them from
    it); what can still differ comes from the data: latent channels and the text encoders' widths."""
    try:
        theirs = dataclasses.asdict(read_config(Path(directory)))
        ours = dataclasses.asdict(transformer.cfg)
        different = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
        if different:
            raise CheckpointFormatError(f"the data does not fit it (its config.json, the data): {different}; "
                                        f"latent channels and text widths come from data.path, which must be "
                                        f"encoded with the VAE and text encoders of this transformer's pipeline")
        load_diffusers_weights(transformer, Path(directory))
    except CheckpointFormatError as e:
        raise ConfigError(f"model.init_from={directory}: {e}") from None


def example_text(dataset, tokenizer: WordTokenizer | None) -> dict[str, torch.Tensor]:
    """One sample's text input of the model (the empty caption), to count its tokens and FLOPs."""
    if tokenizer is not None:
        return {"input_ids": tokenizer([""])}
    joint, pooled = dataset.text_dims
    return {"prompt_embeds": torch.zeros(1, dataset.text_tokens, joint), "pooled_prompt_embeds": torch.zeros(1, pooled)}
