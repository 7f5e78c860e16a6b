"""SD3's text conditioning: CLIP-L, CLIP-G and (optionally) T5-XXL combined as diffusers'
`StableDiffusion3Pipeline.encode_prompt` combines them (the machinery is models/pipeline_text.py's):

- tokens [B, clip_length + max_sequence_length, joint]: the penultimate hidden states of CLIP-L and CLIP-G
  (both padded to CLIP-L's length), concatenated, zero-padded to T5's width, then T5's last hidden states (zeros
  when the pipeline has no T5, as the pipeline does);
- pooled [B, pooled]: CLIP-L's and CLIP-G's projected pooled outputs, concatenated.

The pipeline directory is diffusers' layout: text_encoder/ + tokenizer/ (CLIP-L), text_encoder_2/ +
tokenizer_2/ (CLIP-G), text_encoder_3/ + tokenizer_3/ (T5, optional). With data.text_encoding=on_the_fly the
encoders run frozen, without gradients, unless lora.text_encoders adapts CLIP-L or CLIP-G: those then run with
gradients for their adapters.
"""

import json
from pathlib import Path

import torch
import torch.nn as nn

from models.pipeline_text import PipelineTextEncoders, PipelineTokenizers

PARTS = {"clip_l": ("text_encoder", "tokenizer"), "clip_g": ("text_encoder_2", "tokenizer_2"),
         "t5": ("text_encoder_3", "tokenizer_3")}
T5_WIDTH = 4096  # T5-XXL's width: the width of the zeros that stand in for T5 when the pipeline has none


class SD3Tokenizers(PipelineTokenizers):
    """Both CLIPs padded to CLIP-L's length, T5 to max_sequence_length (as the pipeline pads them)."""

    PARTS, OPTIONAL = PARTS, ("t5",)

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__(folder, max_sequence_length)
        self.tokens = self.length("clip_l") + max_sequence_length  # of the encoding the MMDiT sees


class SD3TextEncoders(PipelineTextEncoders):
    PARTS, OPTIONAL, NAME = PARTS, ("t5",), "Stable Diffusion 3"

    def __init__(self, folder: Path, max_sequence_length: int):
        super().__init__(folder, max_sequence_length)
        transformer = self.folder / "transformer" / "config.json"
        self.joint_dim = (self.t5.config.d_model if self.t5 else
                          json.loads(transformer.read_text())["joint_attention_dim"] if transformer.is_file()
                          else T5_WIDTH)
        self.pooled_dim = self.clip_l.config.projection_dim + self.clip_g.config.projection_dim

    def build(self, part: str, config) -> nn.Module:
        from transformers import CLIPTextModelWithProjection, T5EncoderModel
        return T5EncoderModel(config) if part == "t5" else CLIPTextModelWithProjection(config)

    def forward(self, clip_l_ids: torch.Tensor, clip_g_ids: torch.Tensor,
                t5_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        hidden, pooled = [], []
        for encoder, ids in ((self.clip_l, clip_l_ids), (self.clip_g, clip_g_ids)):
            out = self.run(encoder, ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])  # the penultimate layer, as SD3 was trained
            pooled.append(out.text_embeds)
        clip = torch.cat(hidden, dim=-1)
        if self.t5 is None:
            t5 = clip.new_zeros(len(clip), self.max_sequence_length, self.joint_dim)
        else:
            with torch.no_grad():
                t5 = self.t5(t5_ids).last_hidden_state.to(clip.dtype)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"prompt_embeds": torch.cat([clip, t5], dim=-2), "pooled_prompt_embeds": torch.cat(pooled, dim=-1)}
