"""LoRA adapters on the MMDiT, and optionally on SD3's CLIP text encoders, through peft (exported by
`models.diffusers_io.export_diffusers_lora`). Variants are peft's: DoRA (`use_dora`: a trained magnitude per output
row, `lora_magnitude_vector`, initialised to the row norms of the frozen weight) and rsLoRA (`use_rslora`: the
update is scaled by alpha / sqrt(rank) instead of alpha / rank)."""

import torch.nn as nn

from errors import ConfigError

# The CLIP projections diffusers' scripts adapt when they train the text encoders (T5 is never adapted).
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
TEXT_ENCODER_PARTS = ("clip_l", "clip_g")  # lora.text_encoders' names (FLUX.1's pipeline has CLIP-L only)
ADAPTER = "default"  # peft's adapter name; it appears in parameter names and is dropped on export


def adapter_settings(lora, targets: list[str] | None = None) -> dict:
    """The LoraConfig fields that define the adapter (from the config's `lora` section; `targets`: other
    modules than lora.target_modules); diffusers rebuilds the adapter from exactly these, saved in the exported
    file's header."""
    return {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(targets or lora.target_modules), "init_lora_weights": "gaussian",
            "use_dora": lora.use_dora, "use_rslora": lora.use_rslora}


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
        from peft import LoraConfig, inject_adapter_in_model
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
        inject_adapter_in_model(LoraConfig(**settings), module, adapter_name=ADAPTER)
        for name, param in module.named_parameters():
            param.requires_grad = ".lora_" in name
    return model
