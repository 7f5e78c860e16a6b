"""What is FLUX.1's own in its transformer: packing 2 x 2, rotary tables made once per shape, its split of the head
dim, inputs it cannot run named, and its original single file (Black Forest Labs' key names, fused and swapped
tensors; dev's and schnell's) read as diffusers' conversion reads it. Its outputs against diffusers' both ways:
tests/test_families.py."""

import logging

import pytest
import torch

from models.families import load_diffusers_transformer, read_config
from models.blocks import rotary_axes
from models.flux.model import Flux, FluxConfig, pack, unpack
from tests.families import CASES, flux_inputs, flux_theirs, ours

diffusers = pytest.importorskip("diffusers")

CONFIGS = CASES["flux"].configs


def config_of(name: str) -> dict:
    return CASES["flux"].config(name)


def inputs(config: dict, height: int, width: int, text: int = 5, seed: int = 0) -> dict:
    return flux_inputs(config, height, width, text, seed)


def test_packing_is_fluxs_and_inverts():
    latents = torch.randn(2, 16, 6, 4)
    tokens = pack(latents, 2)
    assert tokens.shape == (2, 6, 64)
    assert torch.equal(tokens[0, 1], latents[0, :, 0:2, 2:4].reshape(-1))  # token (row 0, col 1): (c, dy, dx)
    assert torch.equal(unpack(tokens, 6, 4, 2), latents)


def test_rotary_tables_are_computed_once_per_shape():
    model = Flux(FluxConfig(**CONFIGS["schnell-like"]))
    x = inputs(CONFIGS["schnell-like"], 8, 8)
    with torch.no_grad():
        ours(model, x)
        ours(model, x)
        assert len(model.rope_cache) == 1
        ours(model, inputs(CONFIGS["schnell-like"], 8, 12))
    assert len(model.rope_cache) == 2


def test_fluxs_split_of_the_head_dim():
    assert rotary_axes(128) == [16, 56, 56]
    for head_dim in (16, 32, 64, 96, 12):
        axes = rotary_axes(head_dim)
        assert sum(axes) == head_dim and all(a % 2 == 0 and a > 0 for a in axes), (head_dim, axes)


def test_inputs_that_cannot_run_are_named():
    config = CONFIGS["dev-like"]
    model = Flux(FluxConfig(**config))
    x = inputs(config, 8, 8)
    x["text"], x["pooled"] = x["text"]["prompt_embeds"], x["text"]["pooled_prompt_embeds"]
    with pytest.raises(ValueError, match="has a guidance embedding: pass guidance"):
        model(x["latents"], x["text"], x["pooled"], x["sigma"] * 1000)
    schnell = Flux(FluxConfig(**CONFIGS["schnell-like"]))
    with pytest.raises(ValueError, match="has no guidance embedding"):
        schnell(x["latents"], x["text"], x["pooled"], x["sigma"] * 1000, guidance=x["guidance"])
    with pytest.raises(ValueError, match="latents of 7x8 do not pack into 2x2 patches"):
        model(x["latents"][..., :7, :], x["text"], x["pooled"], x["sigma"] * 1000, guidance=x["guidance"])
    with pytest.raises(ValueError, match="3-channel latents do not pack into in_channels=16"):
        model(x["latents"][:, :3], x["text"], x["pooled"], x["sigma"] * 1000, guidance=x["guidance"])
    with pytest.raises(ValueError, match=r"axes_dims_rope=\[4, 6, 4\] must be three even numbers that sum to "
                                         r"attention_head_dim=16"):
        Flux(FluxConfig(**{**config, "axes_dims_rope": [4, 6, 4]}))


# ----------------------------------------------------------------------------------------------- the BFL file


def bfl_checkpoint(config: dict, seed: int = 4) -> dict[str, torch.Tensor]:
    """Random tensors under the original (BFL) FLUX code's names and shapes, written from its module layout."""
    gen = torch.Generator().manual_seed(seed)
    dim, head = config["num_attention_heads"] * config["attention_head_dim"], config["attention_head_dim"]
    shapes = {"img_in": (dim, config["in_channels"]), "txt_in": (dim, config["joint_attention_dim"]),
              "time_in.in_layer": (dim, 256), "time_in.out_layer": (dim, dim),
              "vector_in.in_layer": (dim, config["pooled_projection_dim"]), "vector_in.out_layer": (dim, dim),
              "final_layer.linear": (config["in_channels"], dim), "final_layer.adaLN_modulation.1": (2 * dim, dim)}
    if config["guidance_embeds"]:
        shapes.update({"guidance_in.in_layer": (dim, 256), "guidance_in.out_layer": (dim, dim)})
    for i in range(config["num_layers"]):
        for s in ("img", "txt"):
            shapes.update({f"double_blocks.{i}.{s}_mod.lin": (6 * dim, dim), f"double_blocks.{i}.{s}_attn.qkv": (3 * dim, dim),
                           f"double_blocks.{i}.{s}_attn.proj": (dim, dim), f"double_blocks.{i}.{s}_mlp.0": (4 * dim, dim),
                           f"double_blocks.{i}.{s}_mlp.2": (dim, 4 * dim)})
    for i in range(config["num_single_layers"]):
        shapes.update({f"single_blocks.{i}.linear1": (7 * dim, dim), f"single_blocks.{i}.linear2": (dim, 5 * dim),
                       f"single_blocks.{i}.modulation.lin": (3 * dim, dim)})
    tensors = {}
    for name, shape in shapes.items():
        tensors[f"{name}.weight"] = torch.randn(shape, generator=gen) * 0.05
        tensors[f"{name}.bias"] = torch.randn(shape[0], generator=gen) * 0.05
    norms = [f"double_blocks.{i}.{s}_attn.norm.{q}_norm.scale" for i in range(config["num_layers"])
             for s in ("img", "txt") for q in ("query", "key")]
    norms += [f"single_blocks.{i}.norm.{q}_norm.scale" for i in range(config["num_single_layers"]) for q in ("query", "key")]
    tensors.update({name: 1 + torch.randn(head, generator=gen) * 0.05 for name in norms})
    return tensors


def diffusers_conversion(checkpoint: dict, width: int) -> dict:
    """diffusers' own BFL -> diffusers conversion, with the FLUX.1 width it hard-codes (3072) set to `width`."""
    import types

    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers as convert
    code = convert.__code__
    patched = code.replace(co_consts=tuple(width if c == 3072 else c for c in code.co_consts))
    return types.FunctionType(patched, convert.__globals__)(dict(checkpoint))


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])  # BFL's file, and ComfyUI's
@pytest.mark.parametrize("variant", ["dev-like", "schnell-like"])  # with a guidance embedding, and without
def test_the_original_single_file_loads_as_diffusers_converts_it(variant, prefix, tmp_path, caplog):
    from safetensors.torch import save_file
    config = {**config_of(variant), "axes_dims_rope": rotary_axes(16)}  # the file holds no rotary split: FLUX.1's
    checkpoint = bfl_checkpoint(config)
    assert any(k.startswith("guidance_in.") for k in checkpoint) == config["guidance_embeds"]
    save_file({prefix + k: v for k, v in checkpoint.items()}, tmp_path / "flux1-tiny.safetensors")
    reference = diffusers.FluxTransformer2DModel(**config).eval()
    reference.load_state_dict(diffusers_conversion(checkpoint, 32), strict=True)
    family, found = read_config(tmp_path / "flux1-tiny.safetensors")
    assert family.name == "flux" and found == FluxConfig(**config)
    model = load_diffusers_transformer(tmp_path / "flux1-tiny.safetensors").eval()  # reads the config again
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "rotary split" in r.getMessage()]
    assert said == [("WARNING", f"{tmp_path / 'flux1-tiny.safetensors'}: head dim 16 is not FLUX.1's (128), and the "
                     f"file holds no rotary split: assuming FLUX.1's scaled to it, [2, 6, 8]; a model trained with "
                     f"another gives wrong outputs")], said  # once
    x = inputs(config, 6, 10)
    with torch.no_grad():
        torch.testing.assert_close(ours(model, x), flux_theirs(reference, x), rtol=1e-5, atol=1e-5)


def test_the_single_files_rotary_split_is_said_once(tmp_path, caplog):
    """FLUX.1's head dim (128): the split it takes is FLUX.1's own, said once however often the config is read."""
    from safetensors.torch import save_file
    caplog.set_level(logging.INFO, logger="mmdit")
    config = {**CASES["flux"].configs["schnell-like"], "num_layers": 1, "num_single_layers": 1,
              "attention_head_dim": 128, "num_attention_heads": 1, "axes_dims_rope": [16, 56, 56]}
    save_file(bfl_checkpoint(config), tmp_path / "flux1.safetensors")
    for _ in range(2):
        assert read_config(tmp_path / "flux1.safetensors")[1].axes_dims_rope == [16, 56, 56]
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "rotary split" in r.getMessage()]
    assert said == [("INFO", f"{tmp_path / 'flux1.safetensors'}: FLUX.1's rotary split [16, 56, 56] of its head dim "
                             f"128 (the file does not hold one)")], said


def test_blocks_of_fused_and_swapped_tensors_read_as_their_rows(tmp_path):
    """What an FSDP rank reads: any block of rows of a diffusers tensor, across the fused and swapped BFL ones."""
    from safetensors.torch import save_file

    from models.flux.bfl import BFLReader
    config = config_of("dev-like")
    checkpoint = bfl_checkpoint(config)
    save_file(checkpoint, tmp_path / "f.safetensors")
    whole = diffusers_conversion(checkpoint, 32)
    reader = BFLReader(tmp_path / "f.safetensors")
    for key in ("norm_out.linear.weight", "single_transformer_blocks.0.proj_mlp.weight",
                "transformer_blocks.1.attn.add_k_proj.bias", "single_transformer_blocks.1.attn.to_v.weight"):
        tensor = whole[key]
        for start, rows in ((0, tensor.shape[0]), (5, 40), (30, 7), (tensor.shape[0] - 3, 3)):
            columns = ((2,), (9,)) if tensor.dim() == 2 else ((), ())
            got = reader.read(key, (start, *columns[0]), (rows, *columns[1]))
            assert torch.equal(got, tensor[start:start + rows, 2:11] if tensor.dim() == 2 else tensor[start:start + rows])


def test_a_single_file_that_is_not_complete_is_named(tmp_path):
    from safetensors.torch import save_file

    from models.diffusers_io import CheckpointFormatError
    checkpoint = bfl_checkpoint(config_of("dev-like"))
    del checkpoint["single_blocks.1.linear2.weight"]
    save_file(checkpoint, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"broken\.safetensors is not a complete FLUX\.1 checkpoint .* "
                                                    r"missing \['single_blocks\.1\.linear2\.weight'\]"):
        read_config(tmp_path / "broken.safetensors")
    save_file({"weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"other.safetensors is not the original single-file checkpoint of a "
                                                    r"family this trainer reads \(FLUX.1: Black Forest Labs. key names"):
        read_config(tmp_path / "other.safetensors")
