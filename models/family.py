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
from models.blocks import check_rotary_split


@dataclass(frozen=True)
class ReleasedText:
    """What a released pipeline gives its transformer for one sample (its text tokens: `Family.text_tokens`)."""
    joint: int  # the text tokens' width
    pooled: int  # the pooled vector's width (0: none)
    latent_channels: int
    vae_factor: int  # image pixels per latent pixel
    masked: bool = False  # the text is padded, with a mask


# SD3's and FLUX.1's VAE (stabilityai/stable-diffusion-3-medium-diffusers' and black-forest-labs/FLUX.1-dev's
# vae/config.json): 16 latent channels at 1/8, four stages of 128 to 512 channels, no quant convs
KL_VAE = ("AutoencoderKL", {"down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
                            "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 16,
                            "use_quant_conv": False, "use_post_quant_conv": False})


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
    # its released pipeline's VAE: diffusers' class and the config.json values beside that class's defaults (the memory
    # plan builds it on the meta device to count validation's decoding)
    released_vae: tuple[str, dict]
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
    # (adapters, config, source) -> the tensors of a LoRA in the kohya / ComfyUI layout (None: no such layout)
    kohya: Callable | None = None
    # that file's ss_base_model_version and ss_network_module, as the trainers that write its layout name them (model
    # sites and ComfyUI's LoRA browsers read them)
    kohya_names: tuple[str, str] | None = None
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
    # its edit pipelines' _class_name (the first is the one named; none: no edit model), which give the transformer
    # reference images' latents (the transformer's `reference_latents`, at most its MAX_REFERENCES)
    edit_pipelines: tuple[str, ...] = ()
    # (PIL image, resolution, multiple) -> the reference image as its edit pipeline resizes it before the VAE, at
    # `resolution` (1024: the pipeline's own areas; another scales them), sides multiples of `multiple` pixels
    reference_image: Callable | None = None
    # the edit pipeline's instruction encoder where it sees the reference images (Qwen-Image-Edit-Plus: its
    # language model with its vision tower): (pipeline folder, max_sequence_length) -> the encoder; None: the
    # instruction is encoded as a caption
    edit_text: Callable | None = None

    @property
    def diffusers_class(self) -> str:
        return self.transformer.DIFFUSERS_CLASS

    @property
    def pipeline_class(self) -> str:
        return self.pipelines[0]

    @property
    def edits(self) -> bool:
        return bool(self.edit_pipelines)

    @property
    def max_references(self) -> int | None:
        """The reference images an edit takes (None: any number; 0: the family has no edit model)."""
        return self.transformer.MAX_REFERENCES

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
    """model.axes_dims_rope splits a head's channels over `count` position axes, each an even number (the
    module's check, as the config's error)."""
    axes = list(model.axes_dims_rope or [])
    try:
        check_rotary_split(axes, model.attention_head_dim, count)
    except ValueError:
        raise FieldError("axes_dims_rope", axes, f"{count} even numbers that sum to attention_head_dim "
                         f"({model.attention_head_dim})") from None


def check_qk_norm(model, title: str) -> None:
    if model.qk_norm != "rms_norm":
        raise FieldError("qk_norm", model.qk_norm, f"rms_norm with family={model.family} ({title} always normalises "
                         f"q and k)")
