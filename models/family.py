"""What a model family is to the trainer: one record each (`FAMILY` in models/<family>/family.py, registered in
models/families.py), so the trainer, its plugins and its tools serve every family through the same calls and a new
family costs its folder and its record.

A record names the family's modules and files (its transformer and config, diffusers' pipeline classes, its text
encoders, its original single-file layout), what the config's `model` section means for it (which keys it uses, its
demo's sizes, the config a transformer is built from), what its released pipelines give the transformer (text
widths and tokens, latent channels, the scheduler's resolution shift, or its own mu of the sampling schedule) and the
LoRA targets of diffusers' training script for it. Each transformer module has `cfg` (its config.json keys),
`blocks` (the repeated blocks the plugins wrap), `initial_value(name, seed)`, `DIFFUSERS_CLASS` and `TEXT_INPUTS`
(the text embeddings it takes).
"""

from dataclasses import dataclass, field
from typing import Callable

from errors import FieldError


@dataclass(frozen=True)
class ReleasedText:
    """What a released pipeline gives its transformer for one sample (its text tokens: `Family.text_tokens`)."""
    joint: int  # the text tokens' width
    pooled: int  # the pooled vector's width (0: none)
    latent_channels: int
    vae_factor: int  # image pixels per latent pixel
    masked: bool = False  # the text is padded, with a mask


@dataclass(frozen=True)
class ResolutionShift:
    """The pipeline's shift of the sigma schedule by image size (diffusers' `calculate_shift`): mu is linear in the
    token count, from base_shift at base_tokens to max_shift at max_tokens, and the shift is e^mu."""
    base_tokens: int = 256
    max_tokens: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    terminal: float | None = None  # sampling only: the schedule stretched to end at this sigma (`shift_terminal`)


@dataclass(frozen=True)
class Family:
    name: str  # model.family
    title: str  # its name in messages and docs
    transformer: type  # the module, built from its config
    config: type  # the config dataclass: diffusers' config.json keys
    pipelines: tuple[str, ...]  # model_index.json's _class_name of its pipelines (the first is the one named)
    # the modules diffusers' LoRA training script adapts, by their names in a block; or a function of the model section
    # (after its defaults) giving them, where a name means another module in another kind of block (FLUX.2's
    # single blocks' `attn.to_out`, which is a ModuleList in its double blocks): such modules by their full names
    lora_targets: tuple[str, ...] | Callable
    text_encoders: type  # its pipeline's frozen text encoders (models/pipeline_text.py)
    tokenizers: type  # and their tokenizers
    max_sequence_length: int  # text tokens its pipelines use by default (`--max-sequence-length` of precompute)
    options: tuple[str, ...]  # the model.* keys it uses beyond the common ones (others must stay unset)
    architecture: tuple[str, ...]  # the model.* keys a transformer folder fixes (model.init_from sets them)
    demo: dict  # model.* values of the tiny shapes demo, for the sizes left unset
    released: dict[str, dict]  # released transformers (plan_memory.py --model NAME): their model.* values
    # what its released pipeline gives the transformer; or a function of the model.* settings giving it, where its
    # released transformers take different text (FLUX.2's klein-4B, klein-9B and dev: three language models)
    released_text: ReleasedText | Callable
    settings: Callable  # its config -> the model.* values it means (model.init_from)
    build_config: Callable  # (model section, latent channels, (joint, pooled) text widths) -> its config
    check: Callable = lambda model: None  # the model section's values, with the family's rules (FieldError)
    fill_defaults: Callable = lambda model: None  # model.* values derived from others, where left unset
    # the pipeline's resolution shift (None: a fixed shift); of the training sigmas (flow.resolution_shift) and, unless
    # `sampling_mu` says otherwise, of the sampling schedule (sampling.resolution_shift)
    schedule: ResolutionShift | None = None
    # (image tokens, sampling steps) -> mu, the shift e^mu of its pipeline's sampling schedule, where that is not
    # `schedule`'s (FLUX.2's `compute_empirical_mu`, which depends on the step count)
    sampling_mu: Callable[[int, int], float] | None = None
    single_file: type | None = None  # the reader of its original single-file checkpoint
    packing: int | None = None  # latent pixels its pipeline packs into a token (None: patches inside the transformer)
    cfg_renorm: bool = False  # its pipeline rescales guided velocities per token (Qwen-Image's true CFG)
    negative_prompt: str = ""  # the negative prompt its pipelines are used with (the unconditional input of CFG)
    # (adapters, config, out, dtype, source) -> the file of a LoRA in the kohya / ComfyUI layout (None: no such layout)
    kohya: Callable | None = None
    # LoKr / LoHa files (models/lycoris.py): the kinds its diffusers pipeline loads (lora.type values), and the
    # modules whose stem in ComfyUI's LoRA key map is not `transformer.<diffusers name>` (diffusers name -> stem)
    diffusers_lycoris: tuple[str, ...] = ()
    comfyui_names: dict = field(default_factory=dict)
    # the default max_sequence_length for a transformer of these model.* settings (FLUX.1: dev's or schnell's)
    sequence_length: Callable | None = None
    extra_text_tokens: int = 0  # text tokens beside those max_sequence_length counts (SD3: CLIP's 77)
    max_text_tokens: int | None = None  # the most max_sequence_length its pipelines take (None: no limit of theirs)
    # config.json keys of newer diffusers versions this module does not implement: accepted at these values only
    neutral_values: dict = field(default_factory=dict)

    @property
    def diffusers_class(self) -> str:
        return self.transformer.DIFFUSERS_CLASS

    @property
    def pipeline_class(self) -> str:
        return self.pipelines[0]

    def default_sequence_length(self, settings) -> int:
        """The text tokens its pipeline pads to for a transformer of `settings` (config.json's or model.*'s)."""
        return self.sequence_length(settings) if self.sequence_length else self.max_sequence_length

    def default_lora_targets(self, model) -> list[str]:
        """lora.target_modules when left unset, for the model section `model`."""
        return list(self.lora_targets(model) if callable(self.lora_targets) else self.lora_targets)

    def text_of(self, settings) -> ReleasedText:
        """What its released pipeline gives a transformer of `settings` (model.* values, as attributes)."""
        return self.released_text(settings) if callable(self.released_text) else self.released_text

    def text_tokens(self, settings) -> int:
        """The text tokens its transformer sees per sample by default."""
        return self.extra_text_tokens + self.default_sequence_length(settings)


def check_rotary_axes(model, count: int) -> None:
    """model.axes_dims_rope splits a head's channels over `count` position axes, each an even number."""
    axes = list(model.axes_dims_rope or [])
    if len(axes) != count or sum(axes) != model.attention_head_dim or any(d % 2 for d in axes):
        raise FieldError("axes_dims_rope", axes, f"{count} even numbers that sum to attention_head_dim "
                         f"({model.attention_head_dim})")


def check_qk_norm(model, title: str) -> None:
    if model.qk_norm != "rms_norm":
        raise FieldError("qk_norm", model.qk_norm, f"rms_norm with family={model.family} ({title} always normalises "
                         f"q and k)")
