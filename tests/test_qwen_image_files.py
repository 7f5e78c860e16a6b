"""Qwen-Image's files that other tools write and read. The transformer as one safetensors file, as ComfyUI loads it
(diffusers' key names, bare or under model.diffusion_model., fp32, bf16 or float8 casts), loads with diffusers'
outputs for the same weights; blocks of rows read as their rows; an incomplete or damaged file is named. A LoRA run
from such a file exports the layout ComfyUI loads (`--format kohya`), checked against ComfyUI's loading rules as
written, and loaded by diffusers as the PEFT file is."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.blocks import pack, rotary_axes, unpack
from models.diffusers_io import CheckpointFormatError
from models.families import load_diffusers_transformer, read_config
from models.qwen_image.model import QwenImageConfig
from models.qwen_image.single_file import QwenSingleFileReader, assumed_rotary_axes
from tests.conftest import randomize

diffusers = pytest.importorskip("diffusers")

COMFY_PREFIX = "model.diffusion_model."
# a tiny QwenImageTransformer2DModel; the file holds no rotary split, which is read as rotary_axes(head dim)
CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=24, axes_dims_rope=rotary_axes(16))


def reference_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    model = diffusers.QwenImageTransformer2DModel(**CONFIG)
    randomize(model, seed)
    return model.state_dict()


def inputs(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0  # the second caption is padded
    return {"latents": torch.randn(2, 4, 6, 10, generator=gen), "text": torch.randn(2, 7, 24, generator=gen),
            "mask": mask, "sigma": torch.tensor([0.3, 0.8])}


def diffusers_model(weights: dict[str, torch.Tensor]):
    """QwenImageTransformer2DModel holding `weights` (in fp32)."""
    model = diffusers.QwenImageTransformer2DModel(**CONFIG).eval()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    return model


def diffusers_output(model, x: dict) -> torch.Tensor:
    """The transformer driven as QwenImagePipeline drives it."""
    h, w = x["latents"].shape[-2:]
    with torch.no_grad():
        out = model(hidden_states=pack(x["latents"], 2), encoder_hidden_states=x["text"],
                    encoder_hidden_states_mask=x["mask"], timestep=x["sigma"],
                    img_shapes=[[(1, h // 2, w // 2)]] * len(x["latents"]), return_dict=False)[0]
    return unpack(out, h, w, 2)


def ours_output(model, x: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x["latents"], x["text"], x["mask"], x["sigma"] * 1000)


def comfy_cast(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights as a repackaged file stores them: float8 casts the matrices, the vectors stay bf16."""
    if dtype != torch.float8_e4m3fn:
        return {k: v.to(dtype) for k, v in weights.items()}
    return {k: v.to(dtype if v.dim() == 2 else torch.bfloat16) for k, v in weights.items()}


@pytest.mark.parametrize("prefix, dtype", [("", torch.float32), (COMFY_PREFIX, torch.float32), ("", torch.bfloat16),
                                           (COMFY_PREFIX, torch.float8_e4m3fn)],
                         ids=["bare-fp32", "prefixed-fp32", "bare-bf16", "prefixed-fp8"])
def test_comfyuis_single_file_loads_with_diffusers_outputs(prefix, dtype, tmp_path):
    """Comfy-Org's repackaged file (bare keys) and a checkpoint ComfyUI saves (under its prefix), in fp32, bf16 and
    float8: the config from the shapes, the outputs of diffusers' model holding the same (cast) weights."""
    weights = comfy_cast(reference_weights(), dtype)
    save_file({prefix + k: v for k, v in weights.items()}, tmp_path / "qwen_image_tiny.safetensors")
    family, config = read_config(tmp_path / "qwen_image_tiny.safetensors")
    assert family.name == "qwen_image" and config == QwenImageConfig(**CONFIG)
    ours = load_diffusers_transformer(tmp_path / "qwen_image_tiny.safetensors")
    x = inputs()
    expected = diffusers_output(diffusers_model(weights), x)
    torch.testing.assert_close(ours_output(ours, x), expected, rtol=1e-5, atol=1e-5)


def test_the_assumed_rotary_split_is_said_once(tmp_path, caplog):
    """The file holds no rotary split: the one assumed is named, as a warning for a head dim not the released 128,
    once however often the file is opened."""
    assumed_rotary_axes.cache_clear()
    save_file(reference_weights(), tmp_path / "f.safetensors")
    for _ in range(2):
        read_config(tmp_path / "f.safetensors")
    said = [r for r in caplog.records if "holds no rotary split" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", said
    assert "head dim is 16 (released: 128): assuming axes_dims_rope=[2, 6, 8]" in said[0].getMessage()


def test_blocks_of_rows_read_as_their_rows_and_only_their_bytes(tmp_path):
    """What an FSDP rank reads of the file: its block of a tensor, and the bytes of that block alone."""
    weights = comfy_cast(reference_weights(), torch.float8_e4m3fn)
    save_file({COMFY_PREFIX + k: v for k, v in weights.items()}, tmp_path / "f.safetensors")
    reader = QwenSingleFileReader(tmp_path / "f.safetensors")
    for key in ("transformer_blocks.1.img_mlp.net.0.proj.weight", "transformer_blocks.0.txt_mod.1.bias"):
        tensor = weights[key]
        for start, rows in ((0, tensor.shape[0]), (5, 40), (tensor.shape[0] - 3, 3)):
            before = reader.bytes_read
            if tensor.dim() == 2:
                got, expected = reader.read(key, (start, 2), (rows, 9)), tensor[start:start + rows, 2:11]
            else:
                got, expected = reader.read(key, (start,), (rows,)), tensor[start:start + rows]
            assert got.dtype == tensor.dtype and torch.equal(got.float(), expected.float())
            assert reader.bytes_read - before == expected.numel() * expected.element_size()


def test_files_that_are_not_a_complete_transformer_are_named(tmp_path):
    weights = reference_weights()
    incomplete = {k: v for k, v in weights.items() if k != "transformer_blocks.1.attn.to_k.weight"}
    save_file({**incomplete, "transformer_blocks.0.attn.lora.weight": torch.zeros(2)}, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"broken\.safetensors is not a complete Qwen-Image transformer in "
                       r"diffusers' key names: missing \['transformer_blocks\.1\.attn\.to_k\.weight'\], not understood "
                       r"\['transformer_blocks\.0\.attn\.lora\.weight'\]"):
        read_config(tmp_path / "broken.safetensors")
    save_file({**weights, "scaled_fp8": torch.zeros(2)}, tmp_path / "scaled.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"scaled\.safetensors is a ComfyUI \"scaled fp8\" file"):
        read_config(tmp_path / "scaled.safetensors")
    save_file(weights, tmp_path / "cut.safetensors")
    with open(tmp_path / "cut.safetensors", "r+b") as f:  # a download that stopped early
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(CheckpointFormatError, match=r"cut\.safetensors is not a whole safetensors file .*download it "
                                                    r"again"):
        read_config(tmp_path / "cut.safetensors")


def test_a_setting_that_contradicts_the_file_names_the_file(tmp_path):
    """The architecture comes from the file's shapes: a size set otherwise names the file (it has no config.json)."""
    from configs.schema import DEFAULT_CONFIG, load_config
    from errors import ConfigError
    save_file(reference_weights(), tmp_path / "f.safetensors")
    with pytest.raises(ConfigError, match=r"model\.patch_size=4 contradicts \S*/f\.safetensors \(patch_size: 2\); "):
        load_config(DEFAULT_CONFIG, [f"model.init_from={tmp_path / 'f.safetensors'}"])  # shapes.yaml's patch 4


# ----------------------------------------------------------------------------------------------- LoRA for ComfyUI


def write_latents(directory: Path, items: int = 8, tokens: int = 7) -> Path:
    """A latent dataset as precompute writes it with a Qwen-Image pipeline of CONFIG's widths: text padded to
    `tokens`, with its mask."""
    from data.latents import shard_record, write_index
    gen = torch.Generator().manual_seed(0)
    directory.mkdir(parents=True)
    mask = (torch.arange(tokens) < torch.randint(2, tokens + 1, (items, 1), generator=gen)).float()
    text = torch.randn(items, tokens, CONFIG["joint_attention_dim"], generator=gen) * mask[..., None]
    tensors = {"latents": torch.randn(items, CONFIG["out_channels"], 4, 4, generator=gen), "prompt_embeds": text,
               "prompt_embeds_mask": mask}
    captions = [f"item {i}" for i in range(items)]
    save_file(tensors, directory / "shard-00000-4x4.safetensors", metadata={"captions": json.dumps(captions)})
    write_index(directory, [shard_record(directory, "shard-00000-4x4.safetensors", items, (4, 4))], [captions],
                {"family": "qwen_image", "channels": CONFIG["out_channels"], "text_embeddings": True,
                 "text_tokens": tokens, "text_dims": [CONFIG["joint_attention_dim"], 0], "text_mask": True,
                 "max_sequence_length": tokens, "flipped": False})
    return directory


@pytest.fixture(scope="module")
def lora_exports(tmp_path_factory):
    """A two-step LoRA run (rank 4, alpha 8: a scale to fold) from ComfyUI's float8 single file, exported in both
    layouts. Returns (the base's weights as the file holds them, the exports' directory)."""
    import export_mmdit
    from train_mmdit_stable import main
    root = tmp_path_factory.mktemp("qwen-lora")
    base = comfy_cast(reference_weights(), torch.float8_e4m3fn)
    save_file({COMFY_PREFIX + k: v for k, v in base.items()}, root / "qwen_image_fp8_e4m3fn.safetensors")
    assert main(["--config", "configs/qwen_image_lora.yaml", f"data.path={write_latents(root / 'data')}",
                 f"model.init_from={root / 'qwen_image_fp8_e4m3fn.safetensors'}", "lora.rank=4", "lora.alpha=8",
                 "optimizer.lr=5e-2", "optimizer.warmup_steps=1", "training.train_batch_size=4",
                 "training.gradient_accumulation_steps=1", "training.max_steps=2", "training.dtype=fp32",
                 "training.activation_checkpointing=none", "compile.enabled=false", "batch_sizer.enabled=false",
                 "checkpoint.every=0", "validation.at_end=false", "logging.log_every=1",
                 f"logging.output_dir={root / 'run'}"]) == 0
    for layout in ("peft", "kohya"):
        assert export_mmdit.main(["--checkpoint", str(root / "run"), "--out", str(root / layout),
                                  "--format", layout]) == 0
    return base, root


# ComfyUI a125cd84 (Comfy-Org/ComfyUI, formerly comfyanonymous/ComfyUI). What a LoRA file's tensors are called, for
# each adapter kind that ComfyUI's LoRA class reads: (up, down) of a module name x, tried in this order
# (comfy/weight_adapter/lora.py:93-99, 102-129; its A_name is the up matrix)
COMFY_LORA_NAMES = (("{}.lora_up.weight", "{}.lora_down.weight"), ("{}_lora.up.weight", "{}_lora.down.weight"),
                    ("{}.lora_B.weight", "{}.lora_A.weight"), ("{}.lora.up.weight", "{}.lora.down.weight"),
                    ("{}.lora_B", "{}.lora_A"), ("{}.lora_linear_layer.up.weight", "{}.lora_linear_layer.down.weight"),
                    ("{}.lora_B.default.weight", "{}.lora_A.default.weight"))


def comfy_key_map(model_keys) -> dict[str, str]:
    """comfy/lora.py `model_lora_keys_unet` for a QwenImage model, as written there: a LoRA module name -> the
    weight of ComfyUI's model it patches (the model's keys are diffusion_model.<its module's names>)."""
    key_map = {}
    for k in model_keys:  # every model, L179-186
        if k.startswith("diffusion_model."):
            if k.endswith(".weight"):
                key_lora = k[len("diffusion_model."):-len(".weight")].replace(".", "_")
                key_map["lora_unet_{}".format(key_lora)] = k
                key_map["{}".format(k[:-len(".weight")])] = k  # generic lora format without any weird key names
            else:
                key_map["{}".format(k)] = k
    for k in model_keys:  # isinstance(model, comfy.model_base.QwenImage), L306-314
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_lora = k[len("diffusion_model."):-len(".weight")]
            key_map["{}".format(key_lora)] = k
            key_map["transformer.{}".format(key_lora)] = k
            key_map["lycoris_{}".format(key_lora.replace(".", "_"))] = k
    return key_map


def comfy_patches(lora: dict[str, torch.Tensor], key_map: dict[str, str]) -> tuple[dict[str, torch.Tensor], set]:
    """What ComfyUI adds to each weight (comfy/lora.py `load_lora`, L37-58, with LoRA adapters): alpha / rank *
    up @ down (alpha: L41-45; its scale, 1 without it: weight_adapter/lora.py:174-177; the product: L194-196), and
    the file's keys it consumed (any other is logged "lora key not loaded" and ignored)."""
    patches, loaded = {}, set()
    for x, weight in key_map.items():
        alpha = lora["{}.alpha".format(x)].item() if "{}.alpha".format(x) in lora else None
        if alpha is not None:
            loaded.add("{}.alpha".format(x))
        for up, down in COMFY_LORA_NAMES:
            if up.format(x) in lora:
                mat1, mat2 = lora[up.format(x)].float(), lora[down.format(x)].float()
                scale = alpha / mat2.shape[0] if alpha is not None else 1.0
                patches[weight] = scale * torch.mm(mat1.flatten(start_dim=1), mat2.flatten(start_dim=1))
                loaded |= {up.format(x), down.format(x)}
                break
    return patches, loaded


def test_every_key_of_the_comfyui_file_patches_its_weight_by_the_trained_update(lora_exports):
    """The file against ComfyUI's LoRA loading rules, as written at a125cd84 (comfy/lora.py:37-58, 179-186,
    306-314; comfy/weight_adapter/lora.py:93-129, 174-177, 194-196), on the keys of ComfyUI's Qwen-Image model
    (diffusers' names: comfy/ldm/qwen_image/model.py:106-126, 191-205, 314-340): every key is consumed, and each
    adapted weight gets, in its shape, the update the run trained (alpha / rank * B @ A, at rank 4 and alpha 8); the
    last block's unused text-stream modules have none."""
    from perf.checkpoint import checkpoints, read_checkpoint
    base, root = lora_exports
    lora = load_file(root / "kohya" / "kohya.safetensors")
    model = {f"diffusion_model.{k}": v.shape for k, v in base.items()}
    patches, loaded = comfy_patches(lora, comfy_key_map(model))
    assert loaded == lora.keys()
    trained = read_checkpoint(checkpoints(root / "run")[-1])[0]["ema"]
    adapted = {k.removeprefix("transformer.").split(".lora_")[0] for k in trained if ".lora_" in k}
    assert {k.removeprefix("diffusion_model.").removesuffix(".weight") for k in patches} == adapted
    assert "transformer_blocks.0.txt_mlp.net.2" in adapted and "transformer_blocks.1.txt_mlp.net.2" not in adapted
    for module in adapted:
        a, b = (trained[f"transformer.{module}.lora_{ab}.default.weight"] for ab in "AB")
        patch = patches[f"diffusion_model.{module}.weight"]
        assert patch.shape == model[f"diffusion_model.{module}.weight"]
        torch.testing.assert_close(patch, 8 / 4 * b @ a, rtol=1e-6, atol=1e-7)


def test_comfyui_file_loads_in_diffusers_as_the_peft_file(lora_exports):
    """QwenImagePipeline.load_lora_weights: the ComfyUI file and the PEFT file (the default export) give the same
    transformer outputs, which the LoRA moved."""
    base, root = lora_exports
    x = inputs()

    def output(lora: Path | None) -> torch.Tensor:
        pipe = diffusers.QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                                           transformer=diffusers_model(base))
        if lora is not None:
            pipe.load_lora_weights(lora.parent, weight_name=lora.name)
        return diffusers_output(pipe.transformer, x)

    comfy = output(root / "kohya" / "kohya.safetensors")
    peft = output(root / "peft" / "pytorch_lora_weights.safetensors")
    torch.testing.assert_close(comfy, peft, rtol=1e-5, atol=1e-5)
    assert (peft - output(None)).abs().max() > 1e-3


def test_the_comfyui_layout_folds_the_rslora_scale_and_refuses_dora():
    """rsLoRA's alpha / sqrt(rank) is in lora_B, alpha is the rank (every loader's scale is 1); DoRA's magnitudes,
    which diffusers drops from such a file, are refused."""
    from errors import InputError
    from models.qwen_image.comfyui import comfyui_lora
    gen = torch.Generator().manual_seed(0)
    weights = {f"transformer_blocks.0.attn.to_q.lora_{ab}.default.weight": torch.randn(shape, generator=gen)
               for ab, shape in (("A", (4, 32)), ("B", (32, 4)))}
    settings = {"r": 4, "lora_alpha": 8, "use_rslora": True, "use_dora": False}
    tensors = comfyui_lora({"transformer": (weights, settings)}, "run")
    name = "diffusion_model.transformer_blocks.0.attn.to_q"
    assert tensors.keys() == {f"{name}.lora_A.weight", f"{name}.lora_B.weight", f"{name}.alpha"}
    assert tensors[f"{name}.alpha"].item() == 4
    torch.testing.assert_close(tensors[f"{name}.lora_B.weight"], 8 / 4**0.5 * weights[
        "transformer_blocks.0.attn.to_q.lora_B.default.weight"])
    with pytest.raises(InputError, match=r"run was trained with DoRA \(lora.use_dora=true\), which --format kohya "
                                         r"cannot carry: diffusers' Qwen-Image loader drops its dora_scale keys"):
        comfyui_lora({"transformer": (weights, {**settings, "use_dora": True})}, "run")
