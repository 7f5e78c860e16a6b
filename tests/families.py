"""Each model family as the shared tests see it (tests/test_families.py runs every property over all of them): its
diffusers transformer and the configs to compare on, how its pipeline drives that transformer, a tiny shapes run, its
tiny pipeline (tests/conftest.py's fixtures) and how that pipeline encodes text and images. A new family costs an
entry here.

Configs are written out to cover what a mapping error would hide behind (head dims, rotary splits, guidance on and
off, several text widths) and drawn from a seeded generator too, so the mapping is not fitted to a hand-picked few.
"""

import random
from dataclasses import dataclass
from typing import Callable

import torch

from models.blocks import pack, unpack
from models.flux.model import position_ids as flux_position_ids


def axes(r: random.Random, head_dim: int) -> list[int]:
    """A random split of head_dim into three even rotary parts."""
    first = 2 * r.randint(1, head_dim // 2 - 2)
    second = 2 * r.randint(1, (head_dim - first) // 2 - 1)
    return [first, second, head_dim - first - second]


def text_inputs(gen: torch.Generator, config: dict, tokens: int, joint: str, pooled: str | None,
                masked: bool) -> dict:
    """Text embeddings by their dataset names: tokens of width config[joint], a pooled vector of width
    config[pooled], a ragged padding mask (the second sample's text ends two tokens early)."""
    text = {"prompt_embeds": torch.randn(2, tokens, config[joint], generator=gen)}
    if pooled:
        text["pooled_prompt_embeds"] = torch.randn(2, config[pooled], generator=gen)
    if masked:
        text["prompt_embeds_mask"] = torch.ones(2, tokens)
        text["prompt_embeds_mask"][1, tokens - 2:] = 0
    return text


def ours(model, x: dict) -> torch.Tensor:
    """This project's transformer on `x`: latents, timestep = sigma x 1000, the text its TEXT_INPUTS name (and the
    reference latents of an edit, where `x` has them)."""
    extra = {} if x.get("guidance") is None else {"guidance": x["guidance"]}
    if x.get("references"):
        extra["reference_latents"] = x["references"]
    return model(x["latents"], timestep=x["sigma"] * 1000,
                 **{arg: x["text"][name] for name, arg in model.TEXT_INPUTS.items()}, **extra)


# ----------------------------------------------------------------------------------------------- SD3


SD3_BASE = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, joint_attention_dim=24,
                pooled_projection_dim=20, pos_embed_max_size=12)


def sd3_config(**config) -> dict:
    config = {**SD3_BASE, **config}
    return {**config, "caption_projection_dim": config["num_attention_heads"] * config["attention_head_dim"]}


def sd3_random(seed: int) -> dict:
    r = random.Random(seed)
    layers = r.randint(1, 3)
    return sd3_config(num_layers=layers, attention_head_dim=4 * r.randint(2, 5), num_attention_heads=r.randint(1, 3),
                      qk_norm=r.choice([None, "rms_norm"]), joint_attention_dim=r.randint(3, 24),
                      pooled_projection_dim=r.randint(3, 24),
                      dual_attention_layers=sorted(r.sample(range(layers), r.randint(0, layers))))


def sd3_inputs(config: dict, height: int, width: int, tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(2, config["in_channels"], height, width, generator=gen),
            "text": text_inputs(gen, config, tokens, "joint_attention_dim", "pooled_projection_dim", False),
            "sigma": torch.tensor([0.25, 0.9])}


def sd3_theirs(model, x: dict) -> torch.Tensor:
    return model(hidden_states=x["latents"], encoder_hidden_states=x["text"]["prompt_embeds"],
                 pooled_projections=x["text"]["pooled_prompt_embeds"], timestep=x["sigma"] * 1000,
                 return_dict=False)[0]


# ----------------------------------------------------------------------------------------------- FLUX.1


FLUX_BASE = dict(in_channels=16, joint_attention_dim=24, pooled_projection_dim=16)


def flux_random(seed: int) -> dict:
    r = random.Random(seed)
    head_dim = 2 * r.randint(3, 10)
    return {**FLUX_BASE, "num_layers": r.randint(1, 2), "num_single_layers": r.randint(1, 3),
            "attention_head_dim": head_dim, "num_attention_heads": r.randint(1, 3), "axes_dims_rope": axes(r, head_dim),
            "guidance_embeds": r.random() < 0.5, "joint_attention_dim": r.randint(3, 24),
            "pooled_projection_dim": r.randint(3, 24)}


def flux_inputs(config: dict, height: int, width: int, tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(2, config["in_channels"] // 4, height, width, generator=gen),
            "text": text_inputs(gen, config, tokens, "joint_attention_dim", "pooled_projection_dim", False),
            "sigma": torch.tensor([0.25, 0.9]),
            "guidance": torch.tensor([3.5, 1.0]) if config["guidance_embeds"] else None}


def flux_theirs(model, x: dict) -> torch.Tensor:
    """What FluxPipeline does around its transformer: pack 2 x 2, ids (text zeros, image (0, row, column) on the
    packed grid), sigma as the timestep, guidance on its scale; then unpack."""
    h, w = x["latents"].shape[-2:]
    ids = flux_position_ids(0, h // 2, w // 2, torch.device("cpu"))
    out = model(hidden_states=pack(x["latents"], 2), encoder_hidden_states=x["text"]["prompt_embeds"],
                pooled_projections=x["text"]["pooled_prompt_embeds"], timestep=x["sigma"], img_ids=ids,
                txt_ids=torch.zeros(x["text"]["prompt_embeds"].shape[1], 3), guidance=x["guidance"],
                return_dict=False)[0]
    return unpack(out, h, w, 2)


def kontext_theirs(model, x: dict) -> torch.Tensor:
    """What FluxKontextPipeline does around its transformer: the target and the reference packed 2 x 2 and
    concatenated, the target's ids (0, row, column) then the reference's, a target's grid of its size with the
    first axis 1; the target's tokens of the output."""
    from diffusers import FluxKontextPipeline as P
    latents, [reference] = x["latents"], x["references"]
    (b, c, h, w), (rh, rw) = latents.shape, reference.shape[-2:]
    ids = P._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    image_ids = P._prepare_latent_image_ids(b, rh // 2, rw // 2, "cpu", torch.float32)
    image_ids[..., 0] = 1
    tokens = torch.cat([P._pack_latents(latents, b, c, h, w), P._pack_latents(reference, b, c, rh, rw)], dim=1)
    out = model(hidden_states=tokens, encoder_hidden_states=x["text"]["prompt_embeds"],
                pooled_projections=x["text"]["pooled_prompt_embeds"], timestep=x["sigma"],
                img_ids=torch.cat([ids, image_ids]), txt_ids=torch.zeros(x["text"]["prompt_embeds"].shape[1], 3),
                guidance=x["guidance"], return_dict=False)[0]
    return unpack(out[:, :(h // 2) * (w // 2)], h, w, 2)


# ----------------------------------------------------------------------------------------------- Qwen-Image


QWEN_BASE = dict(patch_size=2, in_channels=16, out_channels=4, joint_attention_dim=24)


def qwen_random(seed: int) -> dict:
    r = random.Random(seed)
    head_dim = 2 * r.randint(3, 10)
    return {**QWEN_BASE, "num_layers": r.randint(1, 3), "attention_head_dim": head_dim,
            "num_attention_heads": r.randint(1, 3), "axes_dims_rope": axes(r, head_dim),
            "joint_attention_dim": r.randint(3, 24), "zero_cond_t": r.random() < 0.5}


def qwen_inputs(config: dict, height: int, width: int, tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(2, config["out_channels"], height, width, generator=gen),
            "text": text_inputs(gen, config, tokens, "joint_attention_dim", None, True),
            "sigma": torch.tensor([0.25, 0.9])}


def qwen_theirs(model, x: dict) -> torch.Tensor:
    """What QwenImagePipeline does around its transformer: pack 2 x 2, the image's shape for its rotary positions,
    the text mask, sigma as the timestep; then unpack."""
    h, w = x["latents"].shape[-2:]
    out = model(hidden_states=pack(x["latents"], 2), encoder_hidden_states=x["text"]["prompt_embeds"],
                encoder_hidden_states_mask=x["text"]["prompt_embeds_mask"], timestep=x["sigma"],
                img_shapes=[[(1, h // 2, w // 2)]] * 2, return_dict=False)[0]
    return unpack(out, h, w, 2)


def qwen_edit_theirs(model, x: dict) -> torch.Tensor:
    """What QwenImageEditPlusPipeline (and QwenImageEditPipeline, with one reference) does around its transformer:
    the target and the references packed 2 x 2 and concatenated, every image's shape in `img_shapes` (target
    first), the text mask, sigma as the timestep; the target's tokens of the output."""
    from diffusers import QwenImageEditPlusPipeline as P
    latents, references = x["latents"], x["references"]
    b, c, h, w = latents.shape
    tokens = torch.cat([P._pack_latents(image, b, c, *image.shape[-2:]) for image in (latents, *references)], dim=1)
    shapes = [(1, image.shape[-2] // 2, image.shape[-1] // 2) for image in (latents, *references)]
    out = model(hidden_states=tokens, encoder_hidden_states=x["text"]["prompt_embeds"],
                encoder_hidden_states_mask=x["text"]["prompt_embeds_mask"], timestep=x["sigma"],
                img_shapes=[shapes] * b, return_dict=False)[0]
    return unpack(out[:, :(h // 2) * (w // 2)], h, w, 2)


# ----------------------------------------------------------------------------------------------- FLUX.2


FLUX2_BASE = dict(in_channels=16, joint_attention_dim=24)


def axes4(r: random.Random, head_dim: int) -> list[int]:
    """A random split of head_dim into four even rotary parts."""
    parts = [2] * 4
    for _ in range((head_dim - 8) // 2):
        parts[r.randrange(4)] += 2
    return parts


def flux2_random(seed: int) -> dict:
    r = random.Random(seed)
    head_dim = 2 * r.randint(4, 10)
    return {**FLUX2_BASE, "num_layers": r.randint(1, 2), "num_single_layers": r.randint(1, 3),
            "attention_head_dim": head_dim, "num_attention_heads": r.randint(1, 3),
            "axes_dims_rope": axes4(r, head_dim), "guidance_embeds": r.random() < 0.5,
            "joint_attention_dim": r.randint(3, 24), "mlp_ratio": r.choice([3.0, 2.0, 1.5])}


def flux2_inputs(config: dict, height: int, width: int, tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(2, config["in_channels"], height, width, generator=gen),
            "text": text_inputs(gen, config, tokens, "joint_attention_dim", None, False),
            "sigma": torch.tensor([0.25, 0.9]),
            "guidance": torch.tensor([4.0, 1.0]) if config.get("guidance_embeds", True) else None}


def flux2_theirs(model, x: dict) -> torch.Tensor:
    """What Flux2KleinPipeline (and Flux2Pipeline, with its guidance) does around its transformer: tokens of the
    (patchified) latents, its ids of them and of the text, sigma as the timestep; then its scatter back by ids."""
    from diffusers import Flux2KleinPipeline as P
    latents, text = x["latents"], x["text"]["prompt_embeds"]
    ids = P._prepare_latent_ids(latents)
    out = model(hidden_states=P._pack_latents(latents), encoder_hidden_states=text, timestep=x["sigma"], img_ids=ids,
                txt_ids=P._prepare_text_ids(text), guidance=x["guidance"], return_dict=False)[0]
    return P._unpack_latents_with_ids(out, ids, *latents.shape[-2:])


def flux2_edit_theirs(model, x: dict) -> torch.Tensor:
    """What Flux2KleinPipeline (and Flux2Pipeline) does with reference images (`image=`): their tokens after the
    target's, at the ids of `_prepare_image_ids` (reference i at time 10 + 10 i); the target's tokens of the
    output, scattered back by its ids."""
    from diffusers import Flux2KleinPipeline as P
    latents, text, references = x["latents"], x["text"]["prompt_embeds"], x["references"]
    ids, b = P._prepare_latent_ids(latents), len(latents)
    image_ids = P._prepare_image_ids([r[:1] for r in references]).repeat(b, 1, 1)
    tokens = torch.cat([P._pack_latents(latents), *(P._pack_latents(r) for r in references)], dim=1)
    out = model(hidden_states=tokens, encoder_hidden_states=text, timestep=x["sigma"],
                img_ids=torch.cat([ids, image_ids], dim=1), txt_ids=P._prepare_text_ids(text), guidance=x["guidance"],
                return_dict=False)[0]
    return P._unpack_latents_with_ids(out[:, :ids.shape[1]], ids, *latents.shape[-2:])


def with_references(x: dict, sizes: tuple[tuple[int, int], ...], seed: int) -> dict:
    """Inputs `x` of an edit: reference latents of `sizes`, of the target's channels."""
    gen = torch.Generator().manual_seed(seed)
    b, c = x["latents"].shape[:2]
    return {**x, "references": [torch.randn(b, c, h, w, generator=gen) for h, w in sizes]}


# ----------------------------------------------------------------------------------------------- the families


# ----------------------------------------------------------------------------------------------- pipelines


def sd3_encode(pipe, captions: list[str]) -> dict:
    from tests.conftest import T5_TOKENS
    embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False,
                                              max_sequence_length=T5_TOKENS)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def flux_encode(pipe, captions: list[str]) -> dict:
    embeds, pooled, _ = pipe.encode_prompt(captions, None, max_sequence_length=512)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def qwen_encode(pipe, captions: list[str]) -> dict:
    """The pipeline's embeddings, padded to the batch's longest caption, and its mask (None where nothing is
    padded: all ones)."""
    embeds, mask = pipe.encode_prompt(captions, max_sequence_length=16)
    return {"prompt_embeds": embeds, "prompt_embeds_mask": torch.ones(embeds.shape[:2]) if mask is None else mask}


def flux2_encode(pipe, captions: list[str]) -> dict:
    from tests.conftest import FLUX2_TOKENS
    embeds, _ = pipe.encode_prompt(captions, max_sequence_length=FLUX2_TOKENS)
    return {"prompt_embeds": embeds}


def kl_latents(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """AutoencoderKL's posterior mean, shifted and scaled by its config, as SD3's and FLUX.1's pipelines do."""
    config = pipe.vae.config
    return (pipe.vae.encode(pixels).latent_dist.mean - (config.shift_factor or 0.0)) * config.scaling_factor


def flux2_latents(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """As Flux2KleinPipeline encodes a reference image: the posterior's mode, patchified, BatchNorm-normalised."""
    return pipe._encode_vae_image(pixels, generator=None)


def qwen_latents(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """As QwenImageEditPipeline encodes an image: one frame, the posterior's mode, minus the mean, times 1 / std."""
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    scale = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    return ((pipe.vae.encode(pixels[:, :, None]).latent_dist.mode() - mean) * scale)[:, :, 0]


@dataclass(frozen=True)
class Pipeline:
    """A family's tiny pipeline (tests/conftest.py's fixtures) and what it computes."""
    folder: str  # the fixture of its folder
    data: str  # the fixture of a dataset precomputed with it
    config: str  # the shipped LoRA config a run on it starts from
    encode: Callable  # (pipeline, captions) -> its text embeddings by the dataset's names
    latents: Callable  # (pipeline, pixels in [-1, 1]) -> normalised latents
    generate: dict  # the pipeline's call for one small image


def kontext_encode(pipe, instruction: str, references: list) -> dict:
    return flux_encode(pipe, [instruction])  # the instruction alone, as a caption


def kontext_reference(pipe, image, resolution: int) -> torch.Tensor:
    """As FluxKontextPipeline sizes and encodes its reference: the preferred resolution nearest its aspect ratio,
    scaled by resolution / 1024 (its own at 1024), floored to its multiple, resized, then its VAE's mode, shifted
    and scaled."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    multiple = pipe.vae_scale_factor * 2
    height, width = pipe.image_processor.get_default_height_width(image)
    _, w, h = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    w, h = (max(multiple, side * resolution // 1024 // multiple * multiple) for side in (w, h))
    pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, h, w), h, w)
    return pipe._encode_vae_image(pixels, generator=None)


def qwen_edit_encode(pipe, instruction: str, references: list) -> dict:
    """QwenImageEditPlusPipeline's encode_prompt of the instruction with its references, each resized as its
    __call__ resizes them for Qwen2.5-VL (CONDITION_IMAGE_SIZE)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
    images = [pipe.image_processor.resize(r, *calculate_dimensions(CONDITION_IMAGE_SIZE, r.width / r.height)[::-1])
              for r in references]
    embeds, mask = pipe.encode_prompt(instruction, image=images)
    return {"prompt_embeds": embeds, "prompt_embeds_mask": torch.ones(embeds.shape[:2]) if mask is None else mask}


def qwen_edit_reference(pipe, image, resolution: int) -> torch.Tensor:
    """As QwenImageEditPlusPipeline sizes a reference for its VAE (`calculate_dimensions` of resolution^2 pixels:
    its VAE_IMAGE_SIZE at 1024) and encodes it (one frame, the mode, normalised)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions
    w, h = calculate_dimensions(resolution * resolution, image.width / image.height)
    return pipe._encode_vae_image(pipe.image_processor.preprocess(image, h, w).unsqueeze(2), generator=None)[:, :, 0]


def flux2_edit_encode(pipe, instruction: str, references: list) -> dict:
    return flux2_encode(pipe, [instruction])


def flux2_reference(pipe, image, resolution: int) -> torch.Tensor:
    """As Flux2KleinPipeline sizes a reference (down to resolution^2 pixels where larger: its 1024^2; floored to its
    multiple, covered and cropped) and encodes it."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    if image.width * image.height > resolution * resolution:
        image = Flux2ImageProcessor._resize_to_target_area(image, resolution * resolution)
    multiple = pipe.vae_scale_factor * 2
    w, h = image.width // multiple * multiple, image.height // multiple * multiple
    pixels = pipe.image_processor.preprocess(image, height=h, width=w, resize_mode="crop")
    return pipe._encode_vae_image(pixels, generator=None)


def tiny_kohya_converter(monkeypatch) -> None:
    """diffusers' kohya -> diffusers FLUX.1 converter at the tiny transformer's width (it hard-codes FLUX.1's)."""
    from diffusers.loaders import lora_pipeline

    from tests.test_flux_finetune import kohya_converter
    monkeypatch.setattr(lora_pipeline, "_convert_kohya_flux_lora_to_diffusers", kohya_converter(16))


def load_pipeline(name: str):
    def load(folder):
        import diffusers
        return getattr(diffusers, name).from_pretrained(folder)
    return load


def load_qwen_edit(folder):
    from tests.pipelines import load_qwen_image_edit_plus_pipeline
    return load_qwen_image_edit_plus_pipeline(folder)


@dataclass(frozen=True)
class Edit:
    """How the family's edit pipelines drive its transformer with reference images, its tiny edit pipeline
    (tests/conftest.py's fixtures) and what that pipeline computes of a (reference, instruction) pair."""
    pipelines: tuple[str, ...]  # diffusers' edit pipelines of the family
    theirs: Callable  # (diffusers' transformer, inputs with "references") -> velocity of the target
    references: tuple[tuple[tuple[int, int], ...], ...]  # reference latent sizes to compare on (sets of them)
    folder: str = ""  # the fixture of its tiny edit pipeline's folder
    data: str = ""  # the fixture of pairs precomputed with it
    config: str = ""  # the shipped config of an edit LoRA
    load: Callable = None  # folder -> the pipeline
    encode: Callable = None  # (pipeline, instruction, reference PIL images) -> its text embeddings
    reference: Callable = None  # (pipeline, reference PIL image, resolution) -> its normalised latents
    generate: dict = None  # the pipeline's call editing one small image
    areas: dict = None  # pipeline module -> its constant areas, set to the tests' (a 1024^2 reference is slow)
    comfy: Callable = lambda monkeypatch: None  # what loading its ComfyUI file into the tiny pipeline needs


# one reference of another size than the target's 8 x 8 latents, and two of two other sizes
ONE_REFERENCE, TWO_REFERENCES = ((6, 10),), ((6, 10), (12, 4))


@dataclass(frozen=True)
class Case:
    family: str  # model.family
    reference: str  # diffusers' transformer class
    configs: dict[str, dict]  # written-out configs of it (every key the class takes that matters)
    random_config: Callable[[int], dict]  # a config no one picked, from a seed
    inputs: Callable  # (config, height, width, text tokens, seed) -> inputs `ours` and `theirs` take
    theirs: Callable  # (diffusers' transformer, inputs) -> velocity [B, C, H, W]
    shapes: tuple[str, ...]  # overrides of a tiny shapes run (over tests/conftest.py's TINY)
    block_kinds: int  # distinct blocks (the graphs compiling them makes)
    three_blocks: tuple[str, ...]  # model.* overrides for 3 blocks, every kind among them
    float8: tuple[tuple[str, ...], tuple[str, ...]]  # a block's linears float8 converts, and ones it keeps
    pipeline: Pipeline
    edit: Edit | None = None  # families with an edit model

    def config(self, name: str) -> dict:
        return self.random_config(int(name.split("-")[1])) if name.startswith("random") else self.configs[name]

    def config_names(self) -> list[str]:
        return [*self.configs, "random-0", "random-1"]


CASES = {
    "sd3": Case(
        "sd3", "SD3Transformer2DModel",
        {"sd3-like": sd3_config(num_layers=2, attention_head_dim=16, num_attention_heads=2),
         "sd3.5-dual-attention": sd3_config(num_layers=3, attention_head_dim=8, num_attention_heads=4,
                                            qk_norm="rms_norm", dual_attention_layers=[0, 1]),
         "odd-sizes": sd3_config(num_layers=1, attention_head_dim=12, num_attention_heads=3, patch_size=1,
                                 in_channels=3, out_channels=5, sample_size=12, pos_embed_max_size=16)},
        sd3_random, sd3_inputs, sd3_theirs, ("model.family=sd3",), 2, ("model.num_layers=3",),
        (("attn.to_q", "ff.net.2"), ("attn.add_v_proj", "norm1.linear")),
        Pipeline("sd3_dir", "sd3_data", "sd3_medium_lora.yaml", sd3_encode, kl_latents, {"guidance_scale": 2.0})),
    "flux": Case(
        "flux", "FluxTransformer2DModel",
        {"dev-like": {**FLUX_BASE, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
                      "num_attention_heads": 2, "axes_dims_rope": [4, 6, 6], "guidance_embeds": True},
         "schnell-like": {**FLUX_BASE, "num_layers": 1, "num_single_layers": 3, "attention_head_dim": 16,
                          "num_attention_heads": 2, "axes_dims_rope": [2, 8, 6], "guidance_embeds": False},
         "odd-head-dim": {**FLUX_BASE, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 12,
                          "num_attention_heads": 3, "axes_dims_rope": [2, 6, 4], "guidance_embeds": True,
                          "joint_attention_dim": 20, "pooled_projection_dim": 6}},
        flux_random, flux_inputs, flux_theirs, ("model.family=flux", "model.num_single_layers=2"), 2,
        ("model.num_layers=1", "model.num_single_layers=2"),
        (("attn.to_q", "ff.net.2", "proj_mlp", "proj_out"), ("attn.add_v_proj", "ff_context.net.0.proj",
                                                               "norm1.linear", "norm.linear")),
        Pipeline("flux_dir", "flux_data", "flux_dev_lora.yaml", flux_encode, kl_latents,
                 {"guidance_scale": 3.5, "max_sequence_length": 512}),
        Edit(("FluxKontextPipeline",), kontext_theirs, (ONE_REFERENCE,), "kontext_dir", "kontext_pairs",
             "flux_kontext_lora.yaml", load_pipeline("FluxKontextPipeline"), kontext_encode, kontext_reference,
             {"guidance_scale": 3.5, "max_sequence_length": 512, "max_area": 16 * 16, "_auto_resize": False}, {},
             tiny_kohya_converter)),
    "qwen_image": Case(
        "qwen_image", "QwenImageTransformer2DModel",
        {"qwen-like": {**QWEN_BASE, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                       "axes_dims_rope": [4, 6, 6]},
         "odd-head-dim": {**QWEN_BASE, "num_layers": 3, "attention_head_dim": 12, "num_attention_heads": 3,
                          "axes_dims_rope": [2, 6, 4], "joint_attention_dim": 20},
         "edit-2511-like": {**QWEN_BASE, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                            "axes_dims_rope": [4, 6, 6], "zero_cond_t": True}},
        qwen_random, qwen_inputs, qwen_theirs, ("model.family=qwen_image",), 2, ("model.num_layers=3",),
        (("attn.to_q", "img_mlp.net.2"), ("attn.add_v_proj", "txt_mlp.net.0.proj", "img_mod.1", "txt_mod.1")),
        Pipeline("qwen_dir", "qwen_data", "qwen_image_lora.yaml", qwen_encode, qwen_latents,
                 {"negative_prompt": " ", "true_cfg_scale": 4.0, "max_sequence_length": 16}),
        Edit(("QwenImageEditPlusPipeline", "QwenImageEditPipeline"), qwen_edit_theirs,
             (ONE_REFERENCE, TWO_REFERENCES), "qwen_edit_dir", "qwen_edit_pairs", "qwen_image_edit_lora.yaml",
             load_qwen_edit, qwen_edit_encode, qwen_edit_reference, {"true_cfg_scale": 1.0},
             {"diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus": {"VAE_IMAGE_SIZE": 32 * 32}})),
    "flux2": Case(
        "flux2", "Flux2Transformer2DModel",
        {"dev-like": {**FLUX2_BASE, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
                      "num_attention_heads": 2, "axes_dims_rope": [4, 4, 4, 4], "guidance_embeds": True},
         "klein-like": {**FLUX2_BASE, "num_layers": 1, "num_single_layers": 3, "attention_head_dim": 16,
                        "num_attention_heads": 2, "axes_dims_rope": [2, 6, 4, 4], "guidance_embeds": False},
         "odd-sizes": {**FLUX2_BASE, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 12,
                       "num_attention_heads": 3, "axes_dims_rope": [2, 2, 4, 4], "guidance_embeds": True,
                       "joint_attention_dim": 20, "mlp_ratio": 2.5, "timestep_guidance_channels": 64}},
        flux2_random, flux2_inputs, flux2_theirs, ("model.family=flux2", "model.num_single_layers=2"), 2,
        ("model.num_layers=1", "model.num_single_layers=2"),
        (("attn.to_q", "ff.linear_out", "attn.to_out.0", "attn.to_qkv_mlp_proj"),
         ("attn.add_v_proj", "attn.to_add_out", "ff_context.linear_in")),
        Pipeline("flux2_dir", "flux2_data", "flux2_klein_4b_lora.yaml", flux2_encode, flux2_latents,
                 {"guidance_scale": 4.0, "max_sequence_length": 32}),
        Edit(("Flux2KleinPipeline", "Flux2Pipeline"), flux2_edit_theirs, (ONE_REFERENCE, TWO_REFERENCES),
             "flux2_dir", "flux2_pairs", "flux2_klein_4b_lora.yaml", load_pipeline("Flux2KleinPipeline"),
             flux2_edit_encode, flux2_reference, {"guidance_scale": 4.0, "max_sequence_length": 32}, {})),
}
