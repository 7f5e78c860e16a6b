"""Qwen-Image's text conditioning, as diffusers' `QwenImagePipeline.encode_prompt` computes it (the machinery is
models/pipeline_text.py's): the caption inside the pipeline's prompt template goes through Qwen2.5-VL's language
model; of its last hidden states, the template's first 34 tokens are dropped and the rest kept (the caption and the
template's closing `<|im_end|>\\n<|im_start|>assistant\\n`), with a mask of the tokens that are there:

- `prompt_embeds` [B, max_sequence_length, 3584]: those hidden states, zero after each caption's last token;
- `prompt_embeds_mask` [B, max_sequence_length]: 1 for a token, 0 for padding.

The pipeline pads a batch to its longest caption; padded further to max_sequence_length here, the tokens that are
there are the same (the language model is causal, and the padding comes after them), and the transformer, which
masks the padding, gives the same output.

The pipeline folder is diffusers' layout: text_encoder/ (`Qwen2_5_VLForConditionalGeneration`, whose files name
the language model `model.*` and the vision tower `visual.*`, as transformers has always saved them) + tokenizer/.
Only the language model is built here: the text-to-image pipeline shows it no image.
"""

from pathlib import Path

import torch
import torch.nn as nn

from errors import InputError
from models.pipeline_text import PipelineTextEncoders, PipelineTokenizers

PARTS = {"qwen": ("text_encoder", "tokenizer")}
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
TEMPLATE_TOKENS = 34  # the template's tokens before the caption, dropped (QwenImagePipeline.prompt_template_encode_start_idx)
MAX_SEQUENCE_LENGTH = 1024  # the most the pipeline takes


class QwenTokenizers(PipelineTokenizers):
    """Captions in the pipeline's template, padded (on the right) to the template's tokens + max_sequence_length."""

    PARTS = PARTS

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__(folder, max_sequence_length)
        self.tokens = max_sequence_length  # the transformer sees the tokens after the template's first 34

    def length(self, part: str) -> int:
        return TEMPLATE_TOKENS + self.max_sequence_length

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        encoded = self.parts["qwen"]([TEMPLATE.format(c) for c in captions], padding="max_length",
                                     max_length=self.length("qwen"), truncation=True, padding_side="right",
                                     return_tensors="pt")
        return {"qwen_ids": encoded.input_ids, "qwen_mask": encoded.attention_mask}

    def truncated(self, captions: list[str]) -> int:
        tokenizer = self.parts["qwen"]
        return sum(len(tokenizer(TEMPLATE.format(c)).input_ids) > self.length("qwen") for c in captions)


class QwenTextEncoders(PipelineTextEncoders):
    PARTS, NAME, MASKED = PARTS, "Qwen-Image", True
    GPU_DTYPE = torch.bfloat16  # as the pipeline runs it (fp16 overflows in Qwen2 models: transformers issue 33294)

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__(folder, max_sequence_length)
        self.joint_dim = self.qwen.config.text_config.hidden_size

    def build(self, part: str, config) -> nn.Module:
        from transformers import Qwen2_5_VLModel
        model = Qwen2_5_VLModel(config)
        model.visual = None  # no image is shown to it
        return model

    def file_key(self, part: str, name: str) -> str:
        """The language model's parameters are `model.*` in the files (`language_model.*` in transformers 5's
        module)."""
        return name.replace("language_model.", "model.", 1) if name.startswith("language_model.") else name

    def blocks(self) -> list[nn.Module]:
        return list(self.qwen.language_model.layers)

    def forward(self, qwen_ids: torch.Tensor, qwen_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        # the causal mask over the tokens that are there, as transformers makes it of the pipeline's padding mask, made
        # here: transformers asks whether any padding is present (a host sync, and no answer on the meta device,
        # where the FLOPs are counted)
        length = qwen_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=qwen_ids.device).tril()
        mask = causal[None, None] & qwen_mask[:, None, None, :].bool()
        with torch.no_grad():
            hidden = self.qwen(input_ids=qwen_ids, attention_mask=mask).last_hidden_state
        keep = slice(TEMPLATE_TOKENS, TEMPLATE_TOKENS + self.max_sequence_length)
        mask = qwen_mask[:, keep]
        return {"prompt_embeds": hidden[:, keep] * mask[..., None].to(hidden.dtype),
                "prompt_embeds_mask": mask.to(hidden.dtype)}


# ----------------------------------------------------------------------------------------------- edit instructions

# QwenImageEditPlusPipeline (Qwen-Image-Edit-2509, -2511): its template, the tokens of it dropped (the system part
# and "<|im_start|>user\n"), each reference's place in the instruction, and the area of the images its
# Qwen2.5-VL sees (CONDITION_IMAGE_SIZE)
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the image. "
                 "Generate a new image that meets the user's requirements while maintaining consistency with the "
                 "original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_TEMPLATE_TOKENS = 64
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
CONDITION_AREA = 384 * 384


def area_size(width: int, height: int, area: int) -> tuple[int, int]:
    """The edit pipelines' `calculate_dimensions`: (width, height) of about `area` pixels at the image's aspect
    ratio, multiples of 32 (here at least 32)."""
    w = (area * width / height) ** 0.5
    return max(32, round(w / 32) * 32), max(32, round(w * height / width / 32) * 32)


class QwenEditText:
    """QwenImageEditPlusPipeline's `encode_prompt(instruction, image=references)` for one sample: "Picture i: " and
    the reference's vision tokens before the instruction, in the edit template; the whole Qwen2.5-VL (its vision
    tower sees each reference at about 384^2 pixels) gives its last hidden states, of which the template's first 64
    tokens are dropped; padded with zeros to max_sequence_length, with the mask. The pipeline does not cut its
    encoding at max_sequence_length: a longer one is an error here (raise --max-sequence-length, up to 1024).

    Precompute only (training does not run it in the step): the model is loaded whole (transformers'
    `from_pretrained`), the references' pixels made by the pipeline folder's image processor (its `processor/`
    folder; without torchvision, which its video processor needs, the same settings in transformers' PIL image
    processor) and their tokens counted as its processor counts them."""

    def __init__(self, folder: Path, max_sequence_length: int, device: torch.device, dtype: torch.dtype):
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        self.max_sequence_length, self.device = max_sequence_length, device
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder", dtype=dtype).to(device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder / "processor")
        self.images = image_processor(folder / "processor")

    @staticmethod
    def condition_image(image):
        """A reference as the pipeline shows it to Qwen2.5-VL: about 384^2 pixels at its aspect ratio, sides multiples
        of 32, stretched (its `calculate_dimensions`, `VaeImageProcessor.resize`)."""
        from PIL import Image
        return image.resize(area_size(*image.size, CONDITION_AREA), Image.LANCZOS)

    @torch.no_grad()
    def __call__(self, instruction: str, images: list) -> dict[str, torch.Tensor]:
        text = EDIT_TEMPLATE.format("".join(PICTURE.format(i + 1) for i in range(len(images))) + instruction)
        vision = self.images(images=images, return_tensors="pt") if images else {}
        merge = getattr(self.images, "merge_size", 2) ** 2
        for grid in vision.get("image_grid_thw", []):  # each reference's pad token becomes its vision tokens
            text = text.replace(IMAGE_PAD, "<|placeholder|>" * int(grid.prod() // merge), 1)
        ids = self.tokenizer(text.replace("<|placeholder|>", IMAGE_PAD), return_tensors="pt").input_ids
        hidden = self.model(input_ids=ids.to(self.device), attention_mask=torch.ones_like(ids).to(self.device),
                            pixel_values=vision.get("pixel_values", torch.zeros(0)).to(self.device, self.model.dtype)
                            if images else None, image_grid_thw=vision.get("image_grid_thw"),
                            output_hidden_states=True).hidden_states[-1][0, EDIT_TEMPLATE_TOKENS:]
        if len(hidden) > self.max_sequence_length:
            raise InputError(f"the instruction {instruction!r} with its {len(images)} reference image(s) makes "
                             f"{len(hidden)} tokens, more than --max-sequence-length {self.max_sequence_length}")
        embeds = hidden.new_zeros(self.max_sequence_length, hidden.shape[-1])
        embeds[:len(hidden)] = hidden
        mask = torch.zeros(self.max_sequence_length, dtype=hidden.dtype, device=hidden.device)
        mask[:len(hidden)] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


def image_processor(folder: Path):
    """The Qwen2-VL image processor of a pipeline's processor/ folder: transformers' own where it can be built
    (the processor's video part needs torchvision), else its PIL one with the folder's settings."""
    import json
    try:
        from transformers import AutoProcessor
        return AutoProcessor.from_pretrained(folder).image_processor
    except (OSError, ImportError, ValueError):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        single = folder / "preprocessor_config.json"
        config = json.loads(single.read_text()) if single.is_file() else \
            json.loads((folder / "processor_config.json").read_text())["image_processor"]
        return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items()
                                           if k not in ("image_processor_type", "processor_class")})
