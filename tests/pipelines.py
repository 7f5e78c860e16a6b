"""Tiny random pipelines of the families whose text encoders need more than tests/conftest.py's word-level
tokenizers, built locally (nothing is downloaded) and saved by diffusers' own pipeline class.

Qwen-Image: its pipeline drops the first 34 tokens of its prompt template by position, so the tokenizer must cut
the template into exactly the real tokenizer's pieces. It is the real class (transformers' `Qwen2Tokenizer`, a
byte-level BPE) over a small vocabulary: the 256 byte symbols, one token (reached by a chain of merges) for every
pre-token of the template and of the captions' words, and Qwen's special tokens. The real tokenizer, too, maps each
of these common pre-tokens to one token, so the template is 34 tokens here as there (the test checks it); other
words still tokenize, letter by letter.
"""

from pathlib import Path

import torch

from models.qwen_image.text import EDIT_TEMPLATE, EDIT_TEMPLATE_TOKENS, PICTURE, TEMPLATE, TEMPLATE_TOKENS

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                       "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
CAPTION_WORDS = ("a red blue green yellow white black circle square triangle cat dog on in of the grass snow photo "
                 "make it top bottom left right").split()
QWEN_TEXT_WIDTH = 32  # the tiny Qwen2.5-VL's hidden size: the transformer's joint_attention_dim
# Qwen/Qwen-Image's scheduler/scheduler_config.json (docs/qwen-image-architecture.md)
QWEN_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                      base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                      time_shift_type="exponential")


def byte_symbols() -> list[str]:
    """The 256 symbols of byte-level BPE (GPT-2's table, which Qwen's tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]


def pretokens(texts: list[str]) -> list[str]:
    """The byte-level pre-tokens of `texts` as Qwen2Tokenizer cuts them (special tokens apart)."""
    from transformers import Qwen2Tokenizer
    pre = Qwen2Tokenizer()._tokenizer.pre_tokenizer
    pieces = []
    for text in texts:
        for special in QWEN_SPECIAL_TOKENS:
            text = text.replace(special, "\0")
        pieces += [token for part in text.split("\0") if part for token, _ in pre.pre_tokenize_str(part)]
    return list(dict.fromkeys(pieces))


def merged(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE: merge the lowest-ranked adjacent pair until none has a rank."""
    while len(symbols) > 1:
        pairs = [(ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:])) if pair in ranks]
        if not pairs:
            break
        i = min(pairs)[1]
        symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2:]]
    return symbols


def qwen_tokenizer():
    """Qwen2Tokenizer over the byte symbols, the template's and the captions' pre-tokens (one token each) and the
    special tokens; eos <|im_end|>, pad <|endoftext|>, as Qwen2.5-VL's tokenizer_config has them."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    merges, ranks = [], {}
    texts = [TEMPLATE.replace("{}", " "), EDIT_TEMPLATE.replace("{}", " "), "".join(PICTURE.format(i) for i in (1, 2, 3)),
             " ".join(CAPTION_WORDS), "\n".join(CAPTION_WORDS)]
    for word in pretokens(texts):
        while len(pieces := merged(list(word), ranks)) > 1:  # a merge added last never fires before the others
            ranks[pieces[0], pieces[1]] = len(merges)
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))
    vocab.update({token: len(vocab) + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)})
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", errors="replace")
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS],
                         special_tokens=True)
    return tokenizer


def template_tokens(tokenizer, template: str = TEMPLATE) -> int:
    """The template's tokens before a caption's first token."""
    ids = tokenizer(template.format("cat")).input_ids
    return ids.index(tokenizer.convert_tokens_to_ids("cat"))


def qwen_text_encoder(tokenizer):
    """A tiny Qwen2.5-VL (2 layers, 32 wide; a 2-block vision tower, which the text-to-image pipeline never uses)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=QWEN_TEXT_WIDTH, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=QWEN_TEXT_WIDTH,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_vae():
    """A tiny AutoencoderKLQwenImage: 4 latent channels with their own means and stds, one downsampling (the
    released VAE has 16 channels and three)."""
    import diffusers
    return diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                            temperal_downsample=[False], latents_mean=[0.1, -0.2, 0.3, 0.05],
                                            latents_std=[1.5, 0.8, 2.0, 1.1]).eval()


def qwen_transformer(**config):
    import diffusers
    return diffusers.QwenImageTransformer2DModel(**{
        "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": QWEN_TEXT_WIDTH, "axes_dims_rope": [4, 6, 6], **config}).eval()


def build_qwen_image_pipeline(root: Path) -> Path:
    """A tiny random QwenImagePipeline saved at `root` (model_index.json and all)."""
    import diffusers
    torch.manual_seed(0)
    tokenizer = qwen_tokenizer()
    assert template_tokens(tokenizer) == TEMPLATE_TOKENS, "the tiny tokenizer must cut the template as Qwen's does"
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), vae=qwen_vae(),
        text_encoder=qwen_text_encoder(tokenizer), tokenizer=tokenizer, transformer=qwen_transformer())
    pipe.save_pretrained(root)
    return root


# ----------------------------------------------------------------------------------------------- Qwen-Image-Edit-Plus


def qwen_vl_processor(tokenizer):
    """Qwen2VLProcessor without torchvision: transformers 5 builds its video processor with torchvision, and its
    constructor refuses none, so the object is assembled by hand (what its __init__ sets, the PIL image processor
    of Qwen2.5-VL's settings), and saves its image processor and tokenizer only."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.chat_template, processor.video_processor = None, None
    processor.image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                                                         patch_size=14, temporal_patch_size=2, merge_size=2)
    processor.tokenizer = tokenizer
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    processor.get_attributes = lambda: ["image_processor", "tokenizer"]  # this object's, for save_pretrained
    return processor


def build_qwen_image_edit_plus_pipeline(root: Path, **transformer) -> Path:
    """A tiny random QwenImageEditPlusPipeline (Edit-2509's layout; `zero_cond_t=True`: 2511's) saved at `root`:
    QwenImagePipeline's tiny parts and the processor above."""
    import diffusers
    torch.manual_seed(0)
    tokenizer = qwen_tokenizer()
    assert template_tokens(tokenizer, EDIT_TEMPLATE) == EDIT_TEMPLATE_TOKENS, "the edit template must be 64 tokens"
    diffusers.QwenImageEditPlusPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), vae=qwen_vae(),
        text_encoder=qwen_text_encoder(tokenizer), tokenizer=tokenizer, processor=qwen_vl_processor(tokenizer),
        transformer=qwen_transformer(**transformer)).save_pretrained(root)
    return root


def load_qwen_image_edit_plus_pipeline(root: Path):
    """The pipeline saved above, its processor given (from_pretrained would build one with torchvision)."""
    import diffusers
    from transformers import Qwen2Tokenizer
    tokenizer = Qwen2Tokenizer.from_pretrained(Path(root) / "tokenizer")
    return diffusers.QwenImageEditPlusPipeline.from_pretrained(root, processor=qwen_vl_processor(tokenizer))


# ----------------------------------------------------------------------------------------------- FLUX.2 [klein]

# Qwen3's chat template as Flux2KleinPipeline applies it (a user message, the generation prompt, thinking off):
# "<|im_start|>user\n{caption}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n". Nothing of it is dropped
# (the transformer sees all max_sequence_length tokens), so how the tiny tokenizer cuts it does not matter.
QWEN3_CHAT_TEMPLATE = ("{%- for message in messages -%}"
                       "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
                       "{%- endfor -%}"
                       "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
                       "{%- if enable_thinking is defined and enable_thinking is false -%}"
                       "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}")
QWEN3_WIDTH = 16  # the tiny Qwen3's hidden size: the transformer's joint_attention_dim is 3 x this
FLUX2_LATENT_CHANNELS = 4  # the tiny VAE's (the released one has 32): 16 channels once patchified


def qwen3_tokenizer():
    """qwen_tokenizer with Qwen3's thinking tags and chat template."""
    from tokenizers import AddedToken
    tokenizer = qwen_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")],
                         special_tokens=True)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def qwen3_text_encoder(tokenizer):
    """A tiny Qwen3ForCausalLM: 28 layers (the pipeline reads the states after layers 9, 18 and 27; with 27 layers
    the last of them would be after the final norm, which the released 36-layer models' is not), 16 wide."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=QWEN3_WIDTH, intermediate_size=32,
                         num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                         bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>"))
    return Qwen3ForCausalLM(config).eval()


def flux2_vae():
    """A tiny AutoencoderKLFlux2: one downsampling, 4 latent channels, random BatchNorm statistics (the released
    VAE: three downsamplings, 32 channels)."""
    import diffusers
    vae = diffusers.AutoencoderKLFlux2(down_block_types=["DownEncoderBlock2D"] * 2,
                                       up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16],
                                       layers_per_block=1, latent_channels=FLUX2_LATENT_CHANNELS, norm_num_groups=4,
                                       sample_size=32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=gen) * 0.1)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=gen) + 0.5)
    return vae


def flux2_transformer(**config):
    import diffusers
    return diffusers.Flux2Transformer2DModel(**{
        "in_channels": 4 * FLUX2_LATENT_CHANNELS, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 8,
        "num_attention_heads": 2, "joint_attention_dim": 3 * QWEN3_WIDTH, "axes_dims_rope": [2, 2, 2, 2],
        "guidance_embeds": False, **config}).eval()


def build_flux2_klein_pipeline(root: Path) -> Path:
    """A tiny random Flux2KleinPipeline (base: classifier-free guidance, `is_distilled` false) saved at `root`."""
    import diffusers
    torch.manual_seed(0)
    tokenizer = qwen3_tokenizer()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)  # mu: the pipeline's
    diffusers.Flux2KleinPipeline(scheduler=scheduler, vae=flux2_vae(), text_encoder=qwen3_text_encoder(tokenizer),
                                 tokenizer=tokenizer, transformer=flux2_transformer()).save_pretrained(root)
    return root


# ----------------------------------------------------------------------------------------------- FLUX.2 [dev]

# A stand-in for Mistral-Small-3's chat template (the released one is in its processor's folder): the system message
# and the user's, each message's text from its typed content, as Flux2Pipeline's format_input builds them
MISTRAL_CHAT_TEMPLATE = ("<s>{%- for message in messages -%}"
                         "{%- if message['role'] == 'system' -%}"
                         "[SYSTEM_PROMPT]{{ message['content'][0]['text'] }}[/SYSTEM_PROMPT]"
                         "{%- else -%}[INST]{{ message['content'][0]['text'] }}[/INST]{%- endif -%}{%- endfor -%}")


def build_flux2_dev_pipeline(root: Path) -> Path:
    """A tiny random Flux2Pipeline saved at `root`: Mistral3 with a 31-layer, 16-wide language model (the pipeline
    reads the states after layers 10, 20 and 30) and a one-layer Pixtral vision tower it never runs. Its
    `tokenizer` is the tiny byte-level tokenizer with MISTRAL_CHAT_TEMPLATE, not a PixtralProcessor (which needs
    torchvision): for text the processor's chat template call is its tokenizer's."""
    import diffusers
    from tokenizers import AddedToken
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    torch.manual_seed(0)
    tokenizer = qwen_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in
                          ("<s>", "[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]")],
                         special_tokens=True)
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=QWEN3_WIDTH, intermediate_size=32,
                         num_hidden_layers=31, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024, pad_token_id=ids("<|endoftext|>")),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=64, patch_size=16, head_dim=8),
        image_token_index=ids("[IMG]"), spatial_merge_size=1)
    pipe = diffusers.Flux2Pipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
                                   vae=flux2_vae(), text_encoder=Mistral3ForConditionalGeneration(config).eval(),
                                   tokenizer=tokenizer, transformer=flux2_transformer(guidance_embeds=True))
    pipe.save_pretrained(root)
    return root
