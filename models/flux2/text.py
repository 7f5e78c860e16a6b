"""FLUX.2's text conditioning, as diffusers' pipelines compute it (the machinery is models/pipeline_text.py's): one
language model, whose hidden states after three of its layers are stacked per token, [h_a | h_b | h_c], into the
transformer's text tokens `prompt_embeds` [B, max_sequence_length, 3 x hidden], with no mask (the transformer attends
to the padding too).

- klein (`Flux2KleinPipeline._get_qwen3_prompt_embeds`): Qwen3 (4B: hidden 2560, 9B: 4096) over the caption in
  Qwen3's chat template as the user's message, no system message, a generation prompt with thinking off; layers 9,
  18 and 27 (hidden_states[9], [18], [27]: the residual stream after that many layers);
- dev (`Flux2Pipeline._get_mistral_3_small_prompt_embeds`): Mistral-Small-3's language model (hidden 5120) over
  [system: SYSTEM_MESSAGE, user: caption] in its processor's chat template, no generation prompt; layers 10, 20, 30.

Both pad (on the tokenizer's side) and truncate to max_sequence_length (512 by default), and the pipeline folder says
which one it is (text_encoder/config.json: `qwen3` or `mistral3`). Only the layers up to the last one tapped are
built and read (27 of Qwen3's 36, 30 of Mistral's 40), and the final norm is not: nothing after them reaches the
embeddings. Forward hooks on the tapped layers keep their outputs (the model runs through its own forward, which
FSDP's wrapper of it needs). The dev path follows diffusers' code; it has run on a tiny Mistral3 with a made-up chat
template only (the released processor's template is read from the pipeline folder).
"""

import copy
import json
import logging
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from models.diffusers_io import CheckpointFormatError
from models.pipeline_text import PipelineTextEncoders, PipelineTokenizers

log = logging.getLogger("mmdit")
PARTS = {"lm": ("text_encoder", "tokenizer")}
LAYERS = {"qwen3": (9, 18, 27), "mistral3": (10, 20, 30)}  # the hidden states stacked, by the language model's type
# the file keys of the language model's parameters: Qwen3ForCausalLM's, Mistral3ForConditionalGeneration's (as
# transformers 5 saves it, and as older versions did)
FILE_PREFIXES = {"qwen3": ("model.",), "mistral3": ("model.language_model.", "language_model.model.")}
# diffusers' pipelines/flux2/system_messages.py (from BFL's flux2 repository), the dev pipeline's system message
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")


def language_model_type(folder: Path) -> str:
    """qwen3 (klein) or mistral3 (dev), from text_encoder/config.json."""
    path = Path(folder) / PARTS["lm"][0] / "config.json"
    try:
        kind = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{path} is not readable JSON ({e}): expected a FLUX.2 pipeline's text "
                                    f"encoder") from None
    if kind not in LAYERS:
        raise CheckpointFormatError(f"{path}: model_type {kind!r}; a FLUX.2 pipeline's text encoder is Qwen3 "
                                    f"(klein: qwen3) or Mistral-Small-3 (dev: mistral3)")
    return kind


def messages(caption: str, kind: str) -> list[dict]:
    """The chat the pipeline makes of a caption: the user's message alone (klein), after the system message
    (dev, whose processor takes typed contents; diffusers drops "[IMG]" from the caption first)."""
    if kind == "qwen3":
        return [{"role": "user", "content": caption}]
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
            {"role": "user", "content": [{"type": "text", "text": caption.replace("[IMG]", "")}]}]


def with_processors_template(tokenizer, path: Path):
    """The tokenizer with the processor's chat template, which a tokenizer reads only from chat_template.jinja:
    an older processor keeps it in chat_template.json."""
    legacy = path / "chat_template.json"
    if tokenizer.chat_template is None and legacy.is_file():
        tokenizer.chat_template = json.loads(legacy.read_text()).get("chat_template")
    if tokenizer.chat_template is None:
        raise CheckpointFormatError(f"{path} has no chat template its tokenizer can read, and its processor could "
                                    f"not be loaded: install torchvision (pip install torchvision), which it needs")
    return tokenizer


class Flux2Tokenizers(PipelineTokenizers):
    """Captions in the pipeline's chat template, padded and truncated to max_sequence_length: klein's Qwen3
    tokenizer (the template applied as text, then tokenized), dev's processor (it tokenizes the chat itself)."""

    PARTS = PARTS

    def __init__(self, folder: Path, max_sequence_length: int):
        from transformers import AutoProcessor, AutoTokenizer
        self.folder, self.max_sequence_length = Path(folder), max_sequence_length
        self.kind = language_model_type(self.folder)
        path = self.folder / PARTS["lm"][1]
        try:
            tokenizer = (AutoTokenizer if self.kind == "qwen3" else AutoProcessor).from_pretrained(path)
        except ImportError as e:  # dev's PixtralProcessor needs torchvision, for images this pipeline never shows
            log.warning("%s: %s; its tokenizer stands in for the processor (text only)", path, str(e).strip()[:200])
            tokenizer = with_processors_template(AutoTokenizer.from_pretrained(path), path)
        self.parts = {"lm": tokenizer}
        self.tokens = max_sequence_length

    def length(self, part: str) -> int:
        return self.max_sequence_length

    def encode(self, captions: list[str], **padding) -> dict:
        tokenizer = self.parts["lm"]
        if self.kind == "qwen3":
            texts = [tokenizer.apply_chat_template(messages(c, self.kind), tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=False) for c in captions]
            return tokenizer(texts, return_tensors="pt" if padding else None, **padding)
        return tokenizer.apply_chat_template([messages(c, self.kind) for c in captions], add_generation_prompt=False,
                                             tokenize=True, return_dict=True, return_tensors="pt" if padding else None,
                                             **padding)

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        encoded = self.encode(captions, padding="max_length", truncation=True, max_length=self.max_sequence_length)
        return {"lm_ids": encoded["input_ids"], "lm_mask": encoded["attention_mask"]}

    def truncated(self, captions: list[str]) -> int:
        return sum(len(ids) > self.max_sequence_length for ids in self.encode(captions)["input_ids"])


class Flux2TextEncoders(PipelineTextEncoders):
    PARTS, NAME = PARTS, "FLUX.2"
    GPU_DTYPE = torch.bfloat16  # as the pipeline runs it (fp16 overflows in Qwen2 models: transformers issue 33294)

    def __init__(self, folder: Path, max_sequence_length: int):
        self.kind = language_model_type(folder)
        self.layers = LAYERS[self.kind]
        super().__init__(folder, max_sequence_length)
        self.joint_dim = len(self.layers) * self.lm.config.hidden_size

    def build(self, part: str, config) -> nn.Module:
        """The language model up to its last tapped layer, without the final norm (Qwen3Model, MistralModel)."""
        from transformers import AutoModel
        config = copy.deepcopy(getattr(config, "text_config", config))  # Mistral3's language model
        if config.num_hidden_layers < max(self.layers):
            raise CheckpointFormatError(f"{self.folder}/{PARTS['lm'][0]}: {config.num_hidden_layers} layers, and the "
                                        f"pipeline reads the hidden states after layers {self.layers}")
        config.num_hidden_layers = max(self.layers)
        model = AutoModel.from_config(config)
        model.norm = nn.Identity()  # the last tapped layer's output is the raw residual stream, as in the pipeline
        self.states = {}  # layer -> its output in the current forward
        for layer in self.layers:  # (transformers' output_hidden_states records nothing under FSDP's wrapped layers)
            model.layers[layer - 1].register_forward_hook(partial(self.keep, layer))
        return model

    def keep(self, layer: int, module: nn.Module, inputs, output) -> None:
        self.states[layer] = output

    def file_key(self, part: str, name: str) -> str:
        """The language model's parameter `name` in the files (`model.layers.0...` for Qwen3ForCausalLM)."""
        prefixes = FILE_PREFIXES[self.kind]
        found = self.reader(part).shapes
        return next((p + name for p in prefixes if p + name in found), prefixes[0] + name)

    def blocks(self) -> list[nn.Module]:
        return list(self.lm.layers)

    def forward(self, lm_ids: torch.Tensor, lm_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        # the causal mask over the tokens that are there, as transformers makes it of the pipeline's padding mask,
        # made here (as for Qwen-Image: transformers would ask whether any padding is present, a host sync)
        length = lm_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=lm_ids.device).tril()
        mask = causal[None, None] & lm_mask[:, None, None, :].bool()
        with torch.no_grad():
            self.lm(input_ids=lm_ids, attention_mask=mask, use_cache=False)
        states, self.states = self.states, {}
        return {"prompt_embeds": torch.stack([states[layer] for layer in self.layers], dim=2).flatten(2)}
