"""LoRA adapters on the MMDiT, and optionally on SD3's CLIP text encoders, through peft (exported by
`models.diffusers_io.export_diffusers_lora`). Variants are peft's: DoRA (`use_dora`: a trained magnitude per output
row, `lora_magnitude_vector`, initialised to the row norms of the frozen weight) and rsLoRA (`use_rslora`: the
update is scaled by alpha / sqrt(rank) instead of alpha / rank).

lora.type picks the adapter (peft's LoraConfig, LoKrConfig or LoHaConfig; files: models/lycoris.py for LoKr and LoHa):
- lora: W + alpha / r * B A, B [out, r] and A [r, in];
- lokr: W + alpha / r * kron(w1, w2), w1 [a, c] and w2 [out / a, in / c] (peft's near-square factors of out and in;
  w2, and w1 where small, itself a rank-r product w2_a w2_b): far fewer parameters for a full-rank update;
- loha: W + alpha / r * (w1_a w1_b) * (w2_a w2_b), the elementwise product of two rank-r products: rank up to r^2.
LoKr and LoHa form the dense update of each layer in every forward (and keep it, in the compute dtype, for the
backward: a weight-sized tensor per adapted layer that LoRA does not need)."""

import math

import torch
import torch.nn as nn

from errors import ConfigError
from models.blocks import init_generator

# The CLIP projections diffusers' scripts adapt when they train the text encoders (T5 is never adapted).
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
TEXT_ENCODER_PARTS = ("clip_l", "clip_g")  # lora.text_encoders' names (FLUX.1's pipeline has CLIP-L only)
ADAPTER = "default"  # peft's adapter name; it appears in parameter names and is dropped on export
PREFIXES = {"lora": "lora_", "lokr": "lokr_", "loha": "hada_"}  # the names of each kind's parameters begin so
# the factor peft starts at zero, so that the adapted model starts as the base; the others start random
ZERO_AT_START = ("lora_B", "lokr_w1", "lokr_w1_a", "hada_w2_b")


def adapter_settings(lora, targets: list[str] | None = None) -> dict:
    """The fields of peft's config of lora.type (LoraConfig, LoKrConfig, LoHaConfig) that define the adapter (from
    the config's `lora` section; `targets`: other modules than lora.target_modules); diffusers rebuilds the adapter
    from exactly these, saved in the exported file's header."""
    modules = sorted(targets or lora.target_modules)
    if lora.type == "lora":
        return {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
                "init_lora_weights": "gaussian", "use_dora": lora.use_dora, "use_rslora": lora.use_rslora}
    lokr = {"decompose_both": False, "decompose_factor": -1} if lora.type == "lokr" else {}
    return {"r": lora.rank, "alpha": lora.alpha, "target_modules": modules, "init_weights": True, **lokr}


def adapter_config(lora_type: str, settings: dict):
    """peft's config of the adapter kind."""
    import peft
    return {"lora": peft.LoraConfig, "lokr": peft.LoKrConfig, "loha": peft.LoHaConfig}[lora_type](**settings)


def adapter_part(name: str) -> str | None:
    """The adapter factor a parameter name holds (`lora_A`, `lokr_w2_a`, `hada_w1_b`, ...), or None."""
    return next((part for part in name.split(".") if part.startswith(tuple(PREFIXES.values()))), None)


def adapter_initial_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """An adapter factor's start, as peft initialises it: the factor of ZERO_AT_START zero, LoRA's A ~ N(0, 1/rank),
    LoKr's and LoHa's others Kaiming-uniform (a = sqrt 5: U(-1/sqrt(fan_in), 1/sqrt(fan_in))); drawn from (seed,
    name)."""
    part, generator = adapter_part(name), init_generator(seed, name)
    if part in ZERO_AT_START:
        return torch.zeros(shape)
    if part == "lora_A":
        return torch.empty(shape).normal_(0.0, 1.0 / shape[0], generator=generator)
    bound = 1 / math.sqrt(math.prod(shape[1:]))
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def transformer_settings(lora, transformer: nn.Module) -> dict:
    """The LoraConfig fields of the transformer's adapters: lora.target_modules but for the modules whose output
    reaches nothing (Qwen-Image's last text stream), where an adapter would get no gradient."""
    unused = getattr(transformer, "unused_modules", list)()
    return {**adapter_settings(lora), **({"exclude_modules": unused} if unused else {})}


def text_encoder_settings(lora) -> dict[str, dict]:
    """{"clip_l": LoraConfig fields, ...} of the adapted text encoders; empty when none is."""
    return {part: adapter_settings(lora, TEXT_ENCODER_TARGETS) for part in lora.text_encoders}


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Inject adapters into `model.transformer` (and into the text encoders lora.text_encoders names) and freeze
    everything but them; a no-op when lora.enabled is off. B starts at zero (and DoRA's magnitude at the frozen
    weight's row norms), so the adapted model is the base model until the first step."""
    if not lora.enabled:
        return model
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise ConfigError("lora.enabled=true needs peft: pip install -e '.[finetune]'") from None
    names = [name for name, _ in model.transformer.named_modules()]
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ConfigError(f"lora.target_modules {missing} match no module of the MMDiT "
                          f"(names inside a block, e.g. 'attn.to_q', 'attn2.to_q', 'ff.net.2')")
    model.requires_grad_(False)
    adapted = {"transformer": (model.transformer, transformer_settings(lora, model.transformer))}
    for part, settings in text_encoder_settings(lora).items():
        encoder = getattr(model.text_encoder, part, None)
        if encoder is None:
            raise ConfigError(f"lora.text_encoders names {part}, but the model runs no such text encoder "
                              f"(data.text_encoding=on_the_fly runs the pipeline's encoders: SD3's CLIP-L and "
                              f"CLIP-G, FLUX.1's CLIP-L)")
        adapted[part] = (encoder, settings)
    for module, settings in adapted.values():
        inject_adapter_in_model(adapter_config(lora.type, settings), module, adapter_name=ADAPTER)
        for name, param in module.named_parameters():
            param.requires_grad = adapter_part(name) is not None
    return model
