"""What is FLUX.2's own (what every family has is tests/test_families.py's, its configs
tests/test_finetune_configs.py's): its pipelines' sampling schedule; a fresh model's zero velocity and every
parameter's gradient; BFL's single file (fused and swapped tensors, klein or dev from the shapes) loading with the
outputs of diffusers' conversion of it, blocks of its rows read alone; a LoRA run from that file exported in
ComfyUI's layout, checked against ComfyUI's rule (BFL's weights patched by up @ down) through diffusers'
conversion, and loaded by diffusers' FLUX.2 loader as the PEFT file is; dev's text path against Flux2Pipeline's;
mistakes named before compute; the VAE's decoding of a dataset's latents as the pipeline decodes."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.diffusers_io import CheckpointFormatError
from models.families import load_diffusers_transformer, read_config, single_file_family
from models.flux2.bfl import Flux2BFLReader
from tests.conftest import FLUX2_TOKENS
from tests.families import flux2_inputs, flux2_theirs, ours
from tests.pipelines import QWEN3_WIDTH

diffusers = pytest.importorskip("diffusers")

# the tiny pipeline's transformer (tests/pipelines.py), and a dev-like one with a guidance embedding
KLEIN = dict(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
             joint_attention_dim=3 * QWEN3_WIDTH, axes_dims_rope=[2, 2, 2, 2], guidance_embeds=False)
DEV = dict(in_channels=16, num_layers=2, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
           joint_attention_dim=24, axes_dims_rope=[4, 4, 4, 4], guidance_embeds=True, mlp_ratio=2.0)
COMFY_PREFIX = "model.diffusion_model."


def test_sampling_follows_the_pipelines_schedule():
    """sampling.resolution_shift: the sigmas of Flux2KleinPipeline's scheduler for the image's tokens and the step
    count (its compute_empirical_mu, e^mu-shifted), across the 4300-token jump, for 4 and 28 steps."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    from configs.build import build_sampler
    from configs.schema import load_config
    from models.rectified_flow import sampling_sigmas
    cfg = load_config(overrides=["model.family=flux2", "sampling.resolution_shift=true", "model.patch_size=1"])
    for side in (32, 64, 68):  # 1024 tokens, 4096, 4624
        for steps in (4, 28):
            sampler = build_sampler(cfg, (side, side), steps)
            scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(side**2, steps))
            assert sampler.steps == steps
            torch.testing.assert_close(sampling_sigmas(steps, sampler.shift), scheduler.sigmas, rtol=0, atol=1e-6)


def test_a_fresh_model_predicts_zero_and_every_parameter_takes_part():
    """adaLN-Zero with the shared modulations: zero velocity from a fresh model, and a gradient for every parameter
    (outside the blocks too: the modulations, the embedders, the final norm)."""
    from models.flux2.model import Flux2, Flux2Config
    model = Flux2(Flux2Config(**DEV))
    x = flux2_inputs(DEV, 4, 6, 5, seed=0)
    out = ours(model, x)
    assert torch.equal(out, torch.zeros_like(out))
    out.square().mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


# ----------------------------------------------------------------------------------------------- BFL's file


def bfl_checkpoint(config: dict, seed: int = 4) -> dict[str, torch.Tensor]:
    """Random tensors under BFL's FLUX.2 names and shapes, written from its module layout (no biases; norms'
    `scale`)."""
    gen = torch.Generator().manual_seed(seed)
    dim, head = config["num_attention_heads"] * config["attention_head_dim"], config["attention_head_dim"]
    hidden = int(dim * config.get("mlp_ratio", 3.0))
    shapes = {"img_in": (dim, config["in_channels"]), "txt_in": (dim, config["joint_attention_dim"]),
              "time_in.in_layer": (dim, 256), "time_in.out_layer": (dim, dim),
              "double_stream_modulation_img.lin": (6 * dim, dim), "double_stream_modulation_txt.lin": (6 * dim, dim),
              "single_stream_modulation.lin": (3 * dim, dim), "final_layer.adaLN_modulation.1": (2 * dim, dim),
              "final_layer.linear": (config["in_channels"], dim)}
    if config["guidance_embeds"]:
        shapes.update({"guidance_in.in_layer": (dim, 256), "guidance_in.out_layer": (dim, dim)})
    for i in range(config["num_layers"]):
        for stream in ("img", "txt"):
            shapes.update({f"double_blocks.{i}.{stream}_attn.qkv": (3 * dim, dim),
                           f"double_blocks.{i}.{stream}_attn.proj": (dim, dim),
                           f"double_blocks.{i}.{stream}_mlp.0": (2 * hidden, dim),
                           f"double_blocks.{i}.{stream}_mlp.2": (dim, hidden)})
    for i in range(config["num_single_layers"]):
        shapes.update({f"single_blocks.{i}.linear1": (3 * dim + 2 * hidden, dim),
                       f"single_blocks.{i}.linear2": (dim, dim + hidden)})
    tensors = {f"{k}.weight": torch.randn(shape, generator=gen) * 0.1 for k, shape in shapes.items()}
    norms = [f"double_blocks.{i}.{s}_attn.norm.{n}_norm.scale" for i in range(config["num_layers"])
             for s in ("img", "txt") for n in ("query", "key")]
    norms += [f"single_blocks.{i}.norm.{n}_norm.scale" for i in range(config["num_single_layers"])
              for n in ("query", "key")]
    return {**tensors, **{k: 1 + torch.randn(head, generator=gen) * 0.1 for k in norms}}


def diffusers_conversion(checkpoint: dict[str, torch.Tensor], config: dict):
    """Flux2Transformer2DModel holding diffusers' own conversion of the BFL tensors."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as convert
    model = diffusers.Flux2Transformer2DModel(**config).eval()
    model.load_state_dict(convert(dict(checkpoint)))
    return model


@pytest.mark.parametrize("config,prefix", [(KLEIN, ""), (DEV, COMFY_PREFIX)], ids=["klein-bare", "dev-prefixed"])
def test_bfls_single_file_loads_with_the_outputs_of_diffusers_conversion(config, prefix, tmp_path):
    """The file is FLUX.2's (not FLUX.1's, whose names it shares), its shapes give the config (klein without a
    guidance embedding, dev with, the MLP ratio), and it computes what diffusers' conversion of it computes."""
    checkpoint = bfl_checkpoint(config)
    save_file({prefix + k: v for k, v in checkpoint.items()}, tmp_path / "flux2.safetensors")
    family, found = read_config(tmp_path / "flux2.safetensors")
    assert family.name == "flux2" and single_file_family(tmp_path / "flux2.safetensors") is family
    assert {k: getattr(found, k) for k in config} == {**config, "in_channels": 16}
    model = load_diffusers_transformer(tmp_path / "flux2.safetensors").eval()
    reference = diffusers_conversion(checkpoint, config)
    for height, width, tokens in ((4, 4, 5), (3, 6, 2)):
        x = flux2_inputs(config, height, width, tokens, seed=height)
        with torch.no_grad():
            torch.testing.assert_close(ours(model, x), flux2_theirs(reference, x), rtol=1e-5, atol=1e-5)


def test_blocks_of_rows_read_as_their_rows_and_only_their_bytes_and_a_broken_file_is_named(tmp_path):
    """What an FSDP rank reads of the file: its rows of a fused tensor (q, k, v of img_attn.qkv) and of the swapped
    final modulation, and the bytes of those rows alone; a file with a tensor missing or one too many is named."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as convert
    checkpoint = bfl_checkpoint(DEV)
    save_file(checkpoint, tmp_path / "flux2.safetensors")
    converted, reader = convert(dict(checkpoint)), Flux2BFLReader(tmp_path / "flux2.safetensors")
    dim = 32
    for key, start, rows in (("transformer_blocks.1.attn.to_k.weight", 3, 20), ("norm_out.linear.weight", dim - 5, 10),
                             ("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight", 90, 60)):
        before = reader.bytes_read
        got = reader.read(key, (start, 1), (rows, 7))
        assert torch.equal(got, converted[key][start:start + rows, 1:8])
        assert reader.bytes_read - before == rows * 7 * 4
    broken = {k: v for k, v in checkpoint.items() if k != "double_blocks.0.txt_mlp.2.weight"}
    save_file({**broken, "double_blocks.0.txt_mlp.3.weight": torch.zeros(2)}, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"broken\.safetensors is not a complete FLUX\.2 checkpoint in the "
                       r"original \(BFL\) layout: missing \['double_blocks\.0\.txt_mlp\.2\.weight'\], not understood "
                       r"\['double_blocks\.0\.txt_mlp\.3\.weight'\]"):
        read_config(tmp_path / "broken.safetensors")


# ----------------------------------------------------------------------------------------------- LoRA for ComfyUI

# targets that fuse partly in BFL's img_attn.qkv (to_q, to_k) and txt_attn.qkv (add_q_proj), whole modules of each
# kind (single blocks' linear1, one linear2 by its full name, both streams' feed-forwards), and a shared modulation
TARGETS = "[attn.to_q,attn.to_k,attn.add_q_proj,attn.to_qkv_mlp_proj,single_transformer_blocks.1.attn.to_out," \
          "ff.linear_in,ff_context.linear_out,double_stream_modulation_img.linear]"


@pytest.fixture(scope="module")
def lora_exports(flux2_data, tmp_path_factory):
    """A two-step LoRA run (rank 4, alpha 8: a scale to fold) of the klein config from BFL's single file of the
    tiny pipeline's transformer's sizes, exported in both layouts (the EMA is the weights: ema_decay 0). Returns
    (the file's tensors, the exports' directory)."""
    import export_mmdit
    from train_mmdit_stable import main
    root = tmp_path_factory.mktemp("flux2-lora")
    base = bfl_checkpoint(KLEIN)
    save_file(base, root / "flux-2-klein-tiny.safetensors")
    assert main(["--config", "configs/flux2_klein_4b_lora.yaml", f"data.path={flux2_data}",
                 f"model.init_from={root / 'flux-2-klein-tiny.safetensors'}", f"lora.target_modules={TARGETS}",
                 "lora.rank=4", "lora.alpha=8", "optimizer.lr=5e-2", "optimizer.warmup_steps=1",
                 "optimizer.ema_decay=0",
                 "training.train_batch_size=4", "training.gradient_accumulation_steps=1", "training.max_steps=2",
                 "training.dtype=fp32", "training.activation_checkpointing=none", "compile.enabled=false",
                 "batch_sizer.enabled=false", "checkpoint.every=0", "validation.at_end=false", "logging.log_every=1",
                 f"logging.output_dir={root / 'run'}"]) == 0
    for layout in ("peft", "kohya"):
        assert export_mmdit.main(["--checkpoint", str(root / "run"), "--out", str(root / layout),
                                  "--format", layout]) == 0
    return base, root


def test_the_comfyui_file_patches_bfls_weights_by_the_trained_update(lora_exports):
    """ComfyUI adds up @ down (alpha / rank with an alpha; the file has none: 1) to the weight of its model named by
    the key without `diffusion_model.` (comfy/lora.py's generic rule), its model having BFL's names: every key names
    a weight of the file, in its shape, and the patched file, converted by diffusers, is the base plus exactly the
    update the run trained (8 / 4 * B @ A) in each adapted module, the fused ones included."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as convert

    from perf.checkpoint import checkpoints, read_checkpoint
    base, root = lora_exports
    lora = load_file(root / "kohya" / "kohya.safetensors")
    modules = {k.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for k in lora}
    assert lora.keys() == {f"diffusion_model.{m}.lora_{ab}.weight" for m in modules for ab in "AB"}
    patched = dict(base)
    for m in modules:
        update = lora[f"diffusion_model.{m}.lora_B.weight"] @ lora[f"diffusion_model.{m}.lora_A.weight"]
        assert update.shape == base[f"{m}.weight"].shape, m
        patched[f"{m}.weight"] = base[f"{m}.weight"] + update
    assert {"double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv", "single_blocks.0.linear1",
            "single_blocks.1.linear2", "double_stream_modulation_img.lin"} <= modules
    trained = read_checkpoint(checkpoints(root / "run")[-1])[0]["ema"]
    adapted = {k.removeprefix("transformer.").split(".lora_")[0] for k in trained if ".lora_" in k}
    expected = convert(dict(base))
    for module in adapted:
        a, b = (trained[f"transformer.{module}.lora_{ab}.default.weight"] for ab in "AB")
        expected[f"{module}.weight"] = expected[f"{module}.weight"] + 8 / 4 * b @ a
    got = convert(patched)
    assert got.keys() == expected.keys()
    for key in got:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_the_comfyui_file_loads_in_diffusers_as_the_peft_file(lora_exports):
    """Flux2KleinPipeline.load_lora_weights: the ComfyUI file (through diffusers' FLUX.2 converter) and the PEFT
    file give the same transformer outputs, which the LoRA moved."""
    base, root = lora_exports
    x = flux2_inputs(KLEIN, 4, 4, 5, seed=1)

    def output(lora: Path | None) -> torch.Tensor:
        pipe = diffusers.Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                                            transformer=diffusers_conversion(base, KLEIN))
        if lora is not None:
            pipe.load_lora_weights(lora.parent, weight_name=lora.name)
        with torch.no_grad():
            return flux2_theirs(pipe.transformer, x)

    peft = output(root / "peft" / "pytorch_lora_weights.safetensors")
    torch.testing.assert_close(output(root / "kohya" / "kohya.safetensors"), peft, rtol=1e-5, atol=1e-5)
    assert (peft - output(None)).abs().max() > 1e-3


def test_the_comfyui_layout_folds_the_scale_and_refuses_dora_and_other_components():
    from errors import InputError
    from models.flux2.comfyui import comfyui_lora
    gen = torch.Generator().manual_seed(0)
    weights = {f"single_transformer_blocks.0.attn.to_out.lora_{ab}.default.weight": torch.randn(shape, generator=gen)
               for ab, shape in (("A", (4, 80)), ("B", (16, 4)))}
    settings = {"r": 4, "lora_alpha": 8, "use_rslora": True, "use_dora": False}
    tensors = comfyui_lora({"transformer": (weights, settings)}, (16, 1, 1), "run")
    name = "diffusion_model.single_blocks.0.linear2"
    assert tensors.keys() == {f"{name}.lora_A.weight", f"{name}.lora_B.weight"}
    torch.testing.assert_close(tensors[f"{name}.lora_B.weight"], 8 / 4**0.5 * weights[
        "single_transformer_blocks.0.attn.to_out.lora_B.default.weight"])
    with pytest.raises(InputError, match=r"run was trained with DoRA \(lora.use_dora=true\), which --format kohya "
                                         r"cannot carry"):
        comfyui_lora({"transformer": (weights, {**settings, "use_dora": True})}, (16, 1, 1), "run")
    with pytest.raises(InputError, match=r"holds the transformer's adapters, not \['text_encoder'\]"):
        comfyui_lora({"transformer": (weights, settings), "text_encoder": ({}, settings)}, (16, 1, 1), "run")


# ----------------------------------------------------------------------------------------------- dev's text


def test_devs_text_path_is_flux2pipelines(tmp_path):
    """Mistral3's language model over [system: SYSTEM_MESSAGE, user: caption], layers 10, 20 and 30 stacked per
    token (a tiny Mistral3 and a stand-in chat template: tests/pipelines.py), as Flux2Pipeline.encode_prompt; the
    weights found under the files' `language_model.model.` names."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    from models.flux2.text import SYSTEM_MESSAGE as OURS, Flux2TextEncoders, Flux2Tokenizers
    from tests.pipelines import build_flux2_dev_pipeline
    assert OURS == SYSTEM_MESSAGE
    root = build_flux2_dev_pipeline(tmp_path / "dev")
    pipe = diffusers.Flux2Pipeline.from_pretrained(root)
    captions = ["a red cat", "a dog on the grass in snow", ""]
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(captions, max_sequence_length=FLUX2_TOKENS)
    with torch.device("meta"):
        encoders = Flux2TextEncoders(root, FLUX2_TOKENS)
    encoders.check("--model")
    encoders.load(torch.device("cpu"), torch.float32)
    assert len(encoders.lm.layers) == 30 and encoders.joint_dim == 3 * QWEN3_WIDTH
    got = encoders(**Flux2Tokenizers(root, FLUX2_TOKENS)(captions))["prompt_embeds"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_without_torchvision_devs_tokenizer_takes_the_processors_chat_template(tmp_path, monkeypatch, caplog):
    """dev's PixtralProcessor needs torchvision; without it the tokenizer stands in, with the processor's chat
    template from chat_template.jinja or an older processor's chat_template.json (the same ids), or, with
    neither, the folder is refused naming the package to install."""
    import transformers

    from models.flux2.text import Flux2Tokenizers
    from tests.pipelines import build_flux2_dev_pipeline
    root = build_flux2_dev_pipeline(tmp_path / "dev")
    captions = ["a red cat", ""]
    expected = Flux2Tokenizers(root, FLUX2_TOKENS)(captions)

    def no_torchvision(*args, **kwargs):
        raise ImportError("PixtralImageProcessorFast requires the Torchvision library")
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", no_torchvision)
    template = root / "tokenizer" / "chat_template.jinja"
    assert torch.equal(Flux2Tokenizers(root, FLUX2_TOKENS)(captions)["lm_ids"], expected["lm_ids"])
    assert "requires the Torchvision library; its tokenizer stands in for the processor" in caplog.text
    (root / "tokenizer" / "chat_template.json").write_text(json.dumps({"chat_template": template.read_text()}))
    template.unlink()
    assert torch.equal(Flux2Tokenizers(root, FLUX2_TOKENS)(captions)["lm_ids"], expected["lm_ids"])
    (root / "tokenizer" / "chat_template.json").unlink()
    with pytest.raises(CheckpointFormatError, match="has no chat template its tokenizer can read, and its processor "
                       r"could not be loaded: install torchvision \(pip install torchvision\)"):
        Flux2Tokenizers(root, FLUX2_TOKENS)


# ----------------------------------------------------------------------------------------------- mistakes


def test_mistakes_are_named_before_compute(flux2_dir, flux2_data, tmp_path, caplog):
    """A FLUX.2 folder under a FLUX.1 config and the reverse; the dev config on a klein transformer (its guidance
    keys); a dev-sized transformer on klein's text: exit 2, one line, no run directory."""
    from train_mmdit_stable import main
    run = ["training.max_steps=1", f"data.path={flux2_data}", f"logging.output_dir={tmp_path / 'run'}"]
    assert main(["--config", "configs/flux_dev_lora.yaml", *run, f"model.init_from={flux2_dir / 'transformer'}"]) == 2
    assert ("model.family=flux, and model.init_from=" in caplog.text and "holds a flux2 transformer "
            "(Flux2Transformer2DModel): use a config of that family (configs/flux2_*.yaml)" in caplog.text)
    diffusers.FluxTransformer2DModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                     num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=8,
                                     axes_dims_rope=[2, 2, 4]).save_config(tmp_path / "flux1")
    assert main(["--config", "configs/flux2_klein_4b_lora.yaml", *run, f"model.init_from={tmp_path / 'flux1'}"]) == 2
    assert "model.family=flux2, and model.init_from=" in caplog.text and "holds a flux transformer" in caplog.text
    assert main(["--config", "configs/flux2_dev_lora.yaml", *run, f"model.init_from={flux2_dir / 'transformer'}"]) == 2
    assert (f"flux.train_guidance sets the guidance a guidance-distilled model (FLUX.1-dev, FLUX.2-dev) embeds, and "
            f"{flux2_dir / 'transformer'} has no guidance embedding" in caplog.text and
            "FLUX.2-klein: configs/flux2_klein_*_lora.yaml), or a copy of configs/flux2_dev_lora.yaml" in caplog.text)
    dev = {**DEV, "joint_attention_dim": 96, "mlp_ratio": 3.0}  # (model.* holds no MLP ratio: the released 3)
    diffusers.Flux2Transformer2DModel(**dev).save_config(tmp_path / "dev")
    assert main(["--config", "configs/flux2_dev_lora.yaml", *run, f"model.init_from={tmp_path / 'dev'}"]) == 2
    assert "the data does not fit it (its config.json, the data): {'joint_attention_dim': (96, 48)}" in caplog.text
    assert not (tmp_path / "run").exists()


def test_the_vae_decodes_as_the_pipeline_does_with_the_statistics_the_dataset_recorded(flux2_dir, flux2_data):
    """Validation's decode (models/vae.py, given dataset.json's statistics): the pipeline's inverse BatchNorm
    normalisation, unpatchify and decode; the dataset records the family, 16 patchified channels and the text
    tokens as padded."""
    from models.vae import load_vae
    index = json.loads((flux2_data / "dataset.json").read_text())
    assert index["family"] == "flux2" and index["channels"] == 16 and index["text_tokens"] == FLUX2_TOKENS
    recorded = {k: v for k, v in index["vae"].items() if k != "folder"}
    assert len(recorded["latents_mean"]) == len(recorded["latents_std"]) == 16
    vae = load_vae(flux2_dir / "vae", torch.device("cpu"), torch.float32, **recorded)
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(flux2_dir)
    latents = torch.randn(2, 16, 3, 5, generator=torch.Generator().manual_seed(0))
    bn = pipe.vae.bn
    with torch.no_grad():
        z = latents * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps) + \
            bn.running_mean.view(1, -1, 1, 1)
        expected = pipe.vae.decode(pipe._unpatchify_latents(z), return_dict=False)[0]
        torch.testing.assert_close(vae.decode(latents), expected, rtol=1e-5, atol=1e-5)
