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
