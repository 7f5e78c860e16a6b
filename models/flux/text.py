"""FLUX.1's text conditioning, as diffusers' `FluxPipeline.encode_prompt` computes it (the machinery is
models/pipeline_text.py's):

- tokens [B, max_sequence_length, 4096]: T5-XXL's last hidden states over the caption padded to
  max_sequence_length (512 for dev, 256 for schnell), no attention mask;
- pooled [B, 768]: CLIP-L's pooled output (not projected), over the caption padded to 77 tokens.

The pipeline directory is diffusers' layout: text_encoder/ + tokenizer/ (CLIP-L), text_encoder_2/ + tokenizer_2/
(T5). CLIP-L can train LoRA adapters (lora.text_encoders=[clip_l]); T5 stays frozen.
"""

from pathlib import Path

import torch
import torch.nn as nn

from models.pipeline_text import PipelineTextEncoders, PipelineTokenizers

PARTS = {"clip_l": ("text_encoder", "tokenizer"), "t5": ("text_encoder_2", "tokenizer_2")}


class FluxTokenizers(PipelineTokenizers):
    PARTS = PARTS

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__(folder, max_sequence_length)
        self.tokens = max_sequence_length  # the MMDiT sees T5's tokens only


class FluxTextEncoders(PipelineTextEncoders):
    PARTS, NAME = PARTS, "FLUX.1"

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__(folder, max_sequence_length)
        self.joint_dim, self.pooled_dim = self.t5.config.d_model, self.clip_l.config.hidden_size

    def build(self, part: str, config) -> nn.Module:
        from transformers import CLIPTextModel, T5EncoderModel
        return T5EncoderModel(config) if part == "t5" else CLIPTextModel(config)

    def forward(self, clip_l_ids: torch.Tensor, t5_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = self.run(self.clip_l, clip_l_ids).pooler_output
        with torch.no_grad():
            tokens = self.t5(t5_ids).last_hidden_state.to(pooled.dtype)
        return {"prompt_embeds": tokens, "pooled_prompt_embeds": pooled}
