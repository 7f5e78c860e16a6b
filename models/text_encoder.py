"""A small text encoder trained jointly with the MMDiT, for caption datasets with a closed vocabulary.

It stands in for a pipeline's text encoders (models/sd3/text.py, ...): it yields what they yield, under the names a
latent dataset stores them by (data/latents.py): a token sequence `prompt_embeds` [B, L, dim], a pooled vector
`pooled_prompt_embeds` [B, dim] and the padding mask `prompt_embeds_mask` [B, L] (1: a word, 0: padding); each
family's transformer takes those it has inputs for (`TEXT_INPUTS`). Datasets of precomputed embeddings bypass the
encoder (see `TextToImage.encode`).
"""

import torch
import torch.nn as nn

from errors import InputError
from models.blocks import init_generator, initialize, xavier_uniform
from models.lora import adapter_initial_value, adapter_part

PAD = "<pad>"


class WordTokenizer:
    """Whitespace word tokenizer over a fixed vocabulary; the empty caption is all padding. Like every
    tokenizer here, it turns captions into the model's text input: {"input_ids": [B, max_length]}."""

    def __init__(self, words: list[str], max_length: int):
        self.vocab = [PAD] + sorted(set(words))
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.max_length = self.tokens = max_length

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids(captions)}

    def input_ids(self, captions: list[str]) -> torch.Tensor:
        out = torch.zeros(len(captions), self.max_length, dtype=torch.long)
        for row, caption in enumerate(captions):
            words = caption.lower().split()
            if len(words) > self.max_length:
                raise InputError(f"caption {caption!r} has {len(words)} words; the encoder takes {self.max_length}")
            unknown = [w for w in words if w not in self.ids]
            if unknown:
                raise InputError(f"caption {caption!r} has words outside the vocabulary: {unknown}; "
                                 f"known words: {self.vocab[1:]}")
            out[row, : len(words)] = torch.tensor([self.ids[w] for w in words], dtype=torch.long)
        return out


class TinyTextEncoder(nn.Module):
    def __init__(self, vocab_size: int, max_length: int, dim: int, num_layers: int, num_heads: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Parameter(torch.randn(1, max_length, dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, num_heads, 4 * dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(dim)
        if not self.final_norm.weight.is_meta:  # built on the meta device, the caller fills it
            initialize(self, seed=0)

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """A function of (seed, name) alone, as the MMDiT's, drawn from PyTorch's own initial distributions for
        these layers (the default run's fidelity was measured with them; Xavier feed-forward weights lose it):
        N(0, 0.02) embeddings, Xavier-uniform attention input projections, U(+-1/sqrt(fan_in)) other linear
        weights and feed-forward biases, zero attention biases, unit LayerNorm scales."""
        shape = self.get_parameter(name).shape
        generator = init_generator(seed, name)
        if name in ("position_embedding", "token_embedding.weight"):
            return torch.empty(shape).normal_(0.0, 0.02, generator=generator)
        module_name, _, kind = name.rpartition(".")
        module = self.get_submodule(module_name)
        if isinstance(module, nn.LayerNorm):
            return torch.ones(shape) if kind == "weight" else torch.zeros(shape)
        if kind == "in_proj_weight":
            return xavier_uniform(shape, generator)
        if kind == "in_proj_bias" or module_name.endswith("self_attn.out_proj") and kind == "bias":
            return torch.zeros(shape)
        bound = module.weight.shape[1] ** -0.5
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.token_embedding(input_ids) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        return {"prompt_embeds": x, "pooled_prompt_embeds": x.mean(dim=1),
                "prompt_embeds_mask": (input_ids != 0).to(x.dtype)}  # id 0: PAD


class TextToImage(nn.Module):
    """The trained unit: the MMDiT (`transformer`, of any family) and, for caption datasets, its text encoder
    (trained with it, or a pipeline's frozen encoders).

    `forward` encodes the text itself, so a DDP or FSDP wrapper around this module sees every trained parameter
    (sampling goes through `forward` too). A transformer with a guidance embedding (FLUX.1-dev) is given
    `guidance`: the constant it trains with, unless a call passes another (sampling).
    """

    def __init__(self, transformer: nn.Module, text_encoder: nn.Module | None = None, guidance: float | None = None):
        super().__init__()
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.guidance = guidance

    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """A fresh model's value of `name` (see MMDiT.initial_value); adapters start as peft starts them
        (models/lora.py: the adapted model starts as the base)."""
        part, _, inner = name.partition(".")
        if adapter_part(inner) is not None:
            return adapter_initial_value(name, self.get_parameter(name).shape, seed)
        return getattr(self, part).initial_value(inner.replace(".base_layer.", "."), seed)

    def encode(self, text: dict) -> dict[str, torch.Tensor]:
        """The text's embeddings by their dataset names (precomputed ones as they are)."""
        return text if "prompt_embeds" in text else self.text_encoder(**text)

    def forward(self, x_t: torch.Tensor, sigma: torch.Tensor, text: dict, guidance: float | None = None,
                references: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The velocity at noise level sigma, from the text (token ids of the text encoder, or precomputed
        embeddings) and, for an edit, the reference images' latents ([B, C, h, w] each; never noised)."""
        embeddings = self.encode(text)
        inputs = {argument: embeddings[name] for name, argument in self.transformer.TEXT_INPUTS.items()}
        guidance = self.guidance if guidance is None else guidance
        if guidance is not None:
            inputs["guidance"] = torch.full_like(sigma, guidance)
        if references:
            inputs["reference_latents"] = [r.to(x_t.dtype) for r in references]
        return self.transformer(x_t, timestep=sigma * 1000, **inputs)
