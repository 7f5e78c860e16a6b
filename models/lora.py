"""LoRA adapters on the MMDiT through peft (exported by `models.diffusers_io.export_diffusers_lora`)."""

import torch.nn as nn

from errors import ConfigError

# The attention projections diffusers' SD3 LoRA training script targets (SD3.5's image-only attn2 is left alone).
DIFFUSERS_SD3_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                         "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
ADAPTER = "default"  # peft's adapter name; it appears in parameter names and is dropped on export


def adapter_settings(lora) -> dict:
    """The LoraConfig fields that define the adapter (from the config's `lora` section); diffusers rebuilds
    the adapter from exactly these, saved in the exported file's header."""
    return {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(lora.target_modules), "init_lora_weights": "gaussian"}


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Inject adapters into `model.transformer` and freeze everything but them; a no-op when lora.enabled is
    off. B starts at zero, so the adapted model is the base model until the first step."""
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
                          f"(e.g. {DIFFUSERS_SD3_TARGETS[0]!r}, 'attn2.to_q', 'ff.net.2')")
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(**adapter_settings(lora)), model.transformer, adapter_name=ADAPTER)
    for name, param in model.transformer.named_parameters():
        param.requires_grad = ".lora_" in name
    return model
