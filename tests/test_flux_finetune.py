"""FLUX.1 fine-tuning on a tiny random FluxPipeline saved by diffusers (tests/conftest.py: flux_dir), what is
FLUX.1's own (what every family has, precompute, text in the step, a LoRA loading into its pipeline, is
tests/test_families.py's): mistakes named before compute; DoRA, rsLoRA and CLIP-L's LoRA on a quantized base; FSDP
ranks reading their rows of the original single file; its kohya / ComfyUI file, which loads through diffusers'
converter as the PEFT file does; DoRA, full fine-tunes and refusals."""

import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import export_mmdit
from configs.build import build_data
from models.diffusers_io import save_named_lora_file
from models.flux.kohya import kohya_lora
from models.flux.model import pack, position_ids, unpack
from perf.checkpoint import checkpoints, step_of
from runtime.export import kohya_metadata
from sample_mmdit import load_trained
from tests.conftest import assert_close, final_weights
from tests.families import flux_inputs as inputs, flux_theirs, ours
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")


FLUX_RUN = ["model.family=flux", "data.name=latents", "model.patch_size=2", "model.num_layers=1",
            "model.num_single_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=8",
            "model.guidance_embeds=true", "training.train_batch_size=4", "optimizer.warmup_steps=1",
            "logging.log_every=1", "checkpoint.every=0", "training.max_steps=2"]


@pytest.fixture
def flux_lora(flux_data, tmp_path):
    """A LoRA run over a random "released" FLUX transformer on the precomputed data."""
    from tests.conftest import LORA, export_random_base
    base = export_random_base([*FLUX_RUN, f"data.path={flux_data}"], tmp_path / "base")

    def make(*extra: str, name: str = "run") -> list[str]:
        return [*FLUX_RUN, *LORA, f"data.path={flux_data}", f"model.init_from={base}",
                f"logging.output_dir={tmp_path / name}", *extra]
    return make


def test_mistakes_are_named_before_compute(flux_dir, flux_data, tmp_path, caplog):
    """A FLUX folder given to an SD3 config; guidance given to a model without its embedding (schnell); latents
    that cannot pack into 2x2 tokens; SD3 data under a FLUX model: exit 2, one line, no run directory."""
    from tests.conftest import export_random_base
    run = ["training.max_steps=1", f"data.path={flux_data}", f"logging.output_dir={tmp_path / 'run'}"]
    assert main(["--config", "configs/sd3_medium_lora.yaml", *run, f"model.init_from={flux_dir / 'transformer'}"]) == 2
    assert ("model.family=sd3, and model.init_from=" in caplog.text and "holds a flux transformer "
            "(FluxTransformer2DModel): use a config of that family (configs/flux_*.yaml)" in caplog.text)
    schnell = export_random_base([*FLUX_RUN, f"data.path={flux_data}", "model.guidance_embeds=false"],
                                 tmp_path / "schnell")
    assert main(["--config", "configs/flux_schnell_lora.yaml", *run, f"model.init_from={schnell}",
                 "flux.train_guidance=3.5"]) == 2
    assert ("flux.train_guidance sets the guidance a guidance-distilled model (FLUX.1-dev, FLUX.2-dev) embeds, and "
            f"{schnell} has no guidance embedding (FLUX.1-schnell, FLUX.2-klein, Qwen-Image and SD3 have none): leave "
            "flux.train_guidance off the command line" in caplog.text)
    assert main(["--config", "configs/flux_dev_lora.yaml", *run, f"model.init_from={schnell}"]) == 2  # flux: in it
    assert ("has no guidance embedding (FLUX.1-schnell, FLUX.2-klein, Qwen-Image and SD3 have none): "
            "configs/flux_dev_lora.yaml is a config for a model with one; use one for a model without "
            "(FLUX.1-schnell: configs/flux_schnell_lora.yaml, FLUX.2-klein: configs/flux2_klein_*_lora.yaml), or a "
            "copy of configs/flux_dev_lora.yaml without its flux section" in caplog.text)
    assert main([*FLUX_RUN, *run, "model.patch_size=3"]) == 2
    assert "model.patch_size=3 does not divide the 8x8 latents (packed tokens of 3x3)" in caplog.text
    assert main([*FLUX_RUN, *run[:2], "model.family=sd3", "model.num_single_layers=0", "model.guidance_embeds=false",
                 f"logging.output_dir={tmp_path / 'run'}"]) == 2
    assert f"{flux_data} was encoded by a flux pipeline, and model.family=sd3" in caplog.text
    assert not (tmp_path / "run").exists()


def test_dora_rslora_clip_lora_on_a_quantized_base_with_validation(flux_lora, tmp_path):
    """The fine-tuning features together on FLUX: DoRA and rsLoRA adapters on both block kinds and on CLIP-L (text
    encoded in the step), an nf4 base, held-out loss and validation images (FLUX's sampler: resolution shift,
    embedded guidance, no CFG)."""
    from tests.conftest import metric_rows
    run = flux_lora("lora.use_dora=true", "lora.use_rslora=true", "lora.text_encoders=[clip_l]",
                    "data.text_encoding=on_the_fly", "lora.base_quantization=nf4", "data.holdout=2",
                    "validation.every=2", "validation.loss_sigmas=2", "sampling.steps=2", "sampling.cfg_scale=1",
                    "sampling.resolution_shift=true", "flow.resolution_shift=true")
    assert main(run) == 0
    weights = final_weights(tmp_path / "run")
    for part in ("transformer.transformer_blocks.0.ff.net.2", "transformer.single_transformer_blocks.1.attn.to_q",
                 "text_encoder.clip_l.encoder.layers.0.self_attn.q_proj"):
        assert f"{part}.lora_magnitude_vector.default.weight" in weights, sorted(weights)[:5]
    assert (tmp_path / "run" / "samples" / "step_00000002.png").is_file()
    assert [r["step"] for r in metric_rows(tmp_path / "run") if "val/loss" in r] == [2]


def test_fsdp_ranks_read_only_their_rows_of_the_original_single_file(flux_data, tmp_path):
    """12B parameters are never whole on one rank: two FSDP ranks build FLUX on the meta device and fill their
    shards from BFL's single file (`model.init_from=FILE`), each reading about half of it, across its fused and
    swapped tensors; gathered, the weights equal an eager load of the file, bitwise."""
    from safetensors.torch import save_file

    from tests.conftest import spawn
    from tests.test_big_models import shards_against_eager
    from tests.test_flux_model import bfl_checkpoint
    config = {"in_channels": 16, "joint_attention_dim": 24, "pooled_projection_dim": 8, "num_layers": 1,
              "num_single_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8, "guidance_embeds": True}
    checkpoint = bfl_checkpoint(config)
    save_file(checkpoint, tmp_path / "flux1-tiny.safetensors")
    overrides = [*FLUX_RUN, f"data.path={flux_data}", "parallel.strategy=fsdp", "training.seed=5",
                 f"model.init_from={tmp_path / 'flux1-tiny.safetensors'}", f"logging.output_dir={tmp_path / 'run'}"]
    ranks = spawn(2, shards_against_eager, overrides, tmp_path=tmp_path)
    assert all(isinstance(r, dict) for r in ranks), ranks
    assert [r["different"] for r in ranks] == [[], []] and all(r["keys"] for r in ranks)
    file_bytes = sum(t.numel() * 4 for t in checkpoint.values())
    assert sum(r["bytes_read"] for r in ranks) == file_bytes  # every byte read once
    assert all(0.4 * file_bytes < r["bytes_read"] < 0.6 * file_bytes for r in ranks), ranks


# ----------------------------------------------------------------------------------------------- export

PIPELINE_LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.text_encoders=[clip_l]",
                 "data.text_encoding=on_the_fly", "optimizer.lr=5e-2", "optimizer.eps=1e-3"]
CAPTIONS = ["a red cat", "a dog on the grass in snow"]


@pytest.fixture
def pipeline_lora(flux_dir, flux_data, tmp_path):
    """A LoRA run over the tiny pipeline's own transformer (a released checkpoint's folder, guidance embedding and
    all), adapting CLIP-L too."""
    def make(*extra: str, name: str = "run") -> list[str]:
        return [*FLUX_RUN, f"data.path={flux_data}", f"model.init_from={flux_dir / 'transformer'}", *PIPELINE_LORA,
                f"logging.output_dir={tmp_path / name}", *extra]
    return make


def flux_inputs() -> dict:
    """Inputs of the tiny pipeline's transformer (4-channel 8x8 latents, T5 width 24, CLIP-L width 8, guidance)."""
    return inputs({"in_channels": 16, "joint_attention_dim": 24, "pooled_projection_dim": 8, "guidance_embeds": True},
                  8, 8, 7, 0)


def run_outputs(run_dir, use_ema: bool = True):
    """This project's adapted model of the run's last checkpoint: transformer output and CLIP-L's pooled output."""
    model, cfg = load_trained(checkpoints(run_dir)[-1], use_ema)
    with torch.no_grad():
        return (ours(model.transformer, flux_inputs()),
                model.text_encoder(**build_data(cfg)[1](CAPTIONS))["pooled_prompt_embeds"])


def theirs(pipe):
    """The same of a FluxPipeline."""
    with torch.no_grad():
        return flux_theirs(pipe.transformer, flux_inputs()), pipe.encode_prompt(CAPTIONS, None)[1]


def image(pipe) -> torch.Tensor:
    return pipe("a red cat", num_inference_steps=2, height=16, width=16, guidance_scale=3.5, max_sequence_length=512,
                generator=torch.Generator().manual_seed(0), output_type="pt").images


def kohya_converter(width: int):
    """diffusers' own kohya -> diffusers FLUX LoRA converter, with the rows of linear1's parts it hard-codes for
    FLUX.1 (3072 x 3 + 12288) set to a transformer of hidden size `width`'s."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers as convert
    flux1, replaced = (3072, 3072, 3072, 12288), []

    def patched(code: types.CodeType) -> types.CodeType:
        consts = []
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                c = patched(c)
            elif c == flux1:
                c = (width,) * 3 + (4 * width,)
                replaced.append(c)
            consts.append(c)
        return code.replace(co_consts=tuple(consts))
    code = patched(convert.__code__)
    assert len(replaced) == 1, "diffusers' converter changed: see how it splits linear1 now"
    return types.FunctionType(code, convert.__globals__)


def fresh_pipeline(flux_dir, lora_dir, monkeypatch=None):
    pipe = diffusers.FluxPipeline.from_pretrained(flux_dir)
    if monkeypatch is not None:  # a kohya file: diffusers' converter at the tiny width
        from diffusers.loaders import lora_pipeline
        monkeypatch.setattr(lora_pipeline, "_convert_kohya_flux_lora_to_diffusers", kohya_converter(16))
    pipe.load_lora_weights(lora_dir)
    return pipe


# targets that fuse partly in BFL's modules (img_attn.qkv: to_q and to_v; txt_attn.qkv: add_k_proj; linear1: to_q,
# to_v and proj_mlp), whole ones of every kind, and two outside the blocks (proj_out, norm_out.linear)
PARTIAL = "[attn.to_q,attn.to_v,attn.add_k_proj,attn.to_out.0,attn.to_add_out,ff.net.0.proj,ff_context.net.2," \
          "proj_mlp,proj_out,norm1.linear,norm.linear,norm_out.linear]"


def test_kohya_export_loads_through_diffusers_converter_as_the_peft_file(pipeline_lora, flux_dir, tmp_path,
                                                                         monkeypatch, caplog):
    """The kohya file and the PEFT file of one run, each loaded by FluxPipeline.load_lora_weights into a fresh
    pipeline, give the same transformer output, CLIP-L output and image, but for what diffusers drops
    from a kohya file: the adapters outside the blocks (its converter names them without the transformer. prefix),
    which ComfyUI and Forge apply and which the file holds as they expect."""
    assert main(pipeline_lora(f"lora.target_modules={PARTIAL}", "lora.use_rslora=true")) == 0
    run = tmp_path / "run"
    assert export_mmdit.main(["--checkpoint", str(run), "--out", str(tmp_path / "peft")]) == 0
    assert export_mmdit.main(["--checkpoint", str(run), "--out", str(tmp_path / "comfy"), "--format", "kohya"]) == 0
    assert "adapts ['norm_out.linear', 'proj_out'] outside the blocks" in caplog.text
    kohya = load_file(tmp_path / "comfy" / "comfy.safetensors")
    peft = load_file(tmp_path / "peft" / "pytorch_lora_weights.safetensors")
    assert "lora_unet_single_blocks_1_linear1.lora_up.weight" in kohya
    assert "lora_te1_text_model_encoder_layers_1_self_attn_out_proj.alpha" in kohya
    with safe_open(tmp_path / "comfy" / "comfy.safetensors", "pt") as f:  # kohya_metadata's, as in a run's loras/
        assert {k: f.metadata()[k] for k in ("ss_network_module", "ss_steps")} == {
            "ss_network_module": "networks.lora_flux", "ss_steps": str(step_of(checkpoints(run)[-1]))}

    ours = fresh_pipeline(flux_dir, tmp_path / "peft")
    comfy = fresh_pipeline(flux_dir, tmp_path / "comfy", monkeypatch)
    assert not hasattr(comfy.transformer.proj_out, "lora_A")  # dropped by diffusers
    with torch.no_grad():
        for module in (ours.transformer.proj_out, ours.transformer.norm_out.linear):
            for p in module.lora_B.parameters():
                p.zero_()  # what diffusers drops from the kohya file
    padded = comfy.transformer.transformer_blocks[0].attn.to_k.lora_B.parameters()  # not adapted: a zero block
    assert [p.abs().max().item() for p in padded] == [0.0]
    base = theirs(diffusers.FluxPipeline.from_pretrained(flux_dir))
    a, b = theirs(ours), theirs(comfy)
    assert (a[0] - base[0]).abs().max() > 1e-3 and (a[1] - base[1]).abs().max() > 1e-3
    # the same math in two pipelines: equal but for fp32 rounding (MKL's matmuls may round by memory alignment;
    # measured 0 here, 3e-8 in the pipeline's transformer steps, 4e-7 in its image)
    assert_close({"output": a[0], "pooled": a[1], "image": image(ours)},
                 {"output": b[0], "pooled": b[1], "image": image(comfy)}, atol=1e-5)
    # ComfyUI adds alpha / rank * up @ down to BFL's weights: final_layer.linear is proj_out, and
    # final_layer.adaLN_modulation.1 is norm_out.linear with its (scale, shift) halves as (shift, scale)
    final, modulation = "lora_unet_final_layer_linear", "lora_unet_final_layer_adaLN_modulation_1"
    assert torch.equal(kohya[f"{final}.lora_up.weight"], peft["transformer.proj_out.lora_B.weight"])
    up = peft["transformer.norm_out.linear.lora_B.weight"]
    assert torch.equal(kohya[f"{modulation}.lora_up.weight"], torch.cat(up.chunk(2)[::-1]))
    assert kohya[f"{modulation}.alpha"].item() == 4 and kohya[f"{final}.alpha"].dtype == torch.float32


def test_diffusers_converter_splits_fused_adapters_of_flux1_width_into_the_separate_ones():
    """At FLUX.1's width (3072, whose linear1 split diffusers' converter hard-codes), unpatched: the fused
    adapters of a double block's qkv (whole and partly adapted) and of single blocks' linear1 come back as exactly
    each module's A and scale x B, and zero adapters for the parts that had none."""
    from diffusers.loaders.lora_pipeline import FluxLoraLoaderMixin

    gen, rank, width = torch.Generator().manual_seed(0), 4, 3072
    modules = {"transformer_blocks.0.attn.to_q": width, "transformer_blocks.0.attn.to_k": width,
               "transformer_blocks.0.attn.to_v": width, "transformer_blocks.0.attn.add_v_proj": width,
               **{f"single_transformer_blocks.0.attn.to_{p}": width for p in "qkv"},
               "single_transformer_blocks.0.proj_mlp": 4 * width, "single_transformer_blocks.1.proj_mlp": 4 * width,
               "single_transformer_blocks.1.attn.to_k": width}
    weights = {}
    for name, rows in modules.items():
        weights[f"{name}.lora_A.default.weight"] = torch.randn(rank, width, generator=gen)
        weights[f"{name}.lora_B.default.weight"] = torch.randn(rows, rank, generator=gen)
    settings = {"r": rank, "lora_alpha": 8, "use_rslora": False, "use_dora": False}
    converted = FluxLoraLoaderMixin.lora_state_dict(kohya_lora({"transformer": (weights, settings)}, (width, 1, 2), "x"))
    expected = {f"transformer.{k.replace('.default.', '.')}": v * 2 if ".lora_B." in k else v for k, v in weights.items()}
    absent = {"transformer_blocks.0.attn.add_q_proj": width, "transformer_blocks.0.attn.add_k_proj": width,
              **{f"single_transformer_blocks.1.attn.to_{p}": width for p in "qv"}}
    for name, rows in absent.items():
        expected.update({f"transformer.{name}.lora_A.weight": torch.zeros(rank, width),
                         f"transformer.{name}.lora_B.weight": torch.zeros(rows, rank)})
    assert converted.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(converted[key], tensor), key


def test_dora_exports_in_diffusers_format_with_equal_outputs_and_kohya_is_refused(pipeline_lora, flux_dir, tmp_path,
                                                                                   caplog):
    """DoRA on the transformer and CLIP-L: FluxPipeline.load_lora_weights loads the magnitudes of the PEFT file
    (lora_magnitude_vector) and gives this project's outputs; the kohya format, whose dora_scale diffusers drops,
    is refused in one line naming the checkpoint and the reason, and nothing is written. An existing folder is
    never written into."""
    assert main(pipeline_lora("lora.use_dora=true")) == 0
    run, out = tmp_path / "run", tmp_path / "lora"
    assert export_mmdit.main(["--checkpoint", str(run), "--out", str(out)]) == 0
    pipe = fresh_pipeline(flux_dir, out)
    assert any("lora_magnitude_vector" in n for n, _ in pipe.transformer.named_parameters())
    assert any("lora_magnitude_vector" in n for n, _ in pipe.text_encoder.named_parameters())
    assert_close(theirs(pipe), run_outputs(run), atol=1e-5)

    caplog.clear()
    assert export_mmdit.main(["--checkpoint", str(run), "--out", str(tmp_path / "comfy"), "--format", "kohya"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0] and "trained with DoRA (lora.use_dora=true)" in errors[0]
    assert "drops its dora_scale keys" in errors[0] and str(run / "checkpoints") in errors[0]
    assert not (tmp_path / "comfy").exists() and not list(tmp_path.glob(".comfy*"))
    before = (out / "pytorch_lora_weights.safetensors").read_bytes()
    assert export_mmdit.main(["--checkpoint", str(run), "--out", str(out)]) == 2
    assert f"{out} exists; write into a new directory (nothing was overwritten)" in caplog.text
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == before and len(list(out.iterdir())) == 1


def packed_output(model, x: dict, p: int) -> torch.Tensor:
    """diffusers' FluxTransformer2DModel on latents packed p x p (FluxPipeline packs 2 x 2)."""
    h, w = x["latents"].shape[-2:]
    ids = position_ids(0, h // p, w // p, torch.device("cpu"))
    text = x["text"]["prompt_embeds"]
    out = model(hidden_states=pack(x["latents"], p), encoder_hidden_states=text,
                pooled_projections=x["text"]["pooled_prompt_embeds"], timestep=x["sigma"], img_ids=ids,
                txt_ids=torch.zeros(text.shape[1], 3), guidance=x["guidance"], return_dict=False)[0]
    return unpack(out, h, w, p)


@pytest.mark.parametrize("packing", [2, 4])
def test_full_fine_tune_exports_a_flux_transformer(packing, flux_data, tmp_path, caplog):
    """A FLUX full fine-tune becomes a FluxTransformer2DModel folder with this project's outputs (1e-5). Trained
    on latents packed 4 x 4 (model.patch_size=4), it is still exported, with a warning: FluxPipeline packs 2 x 2
    and cannot drive it. --format kohya is refused: there are no adapters."""
    assert main([*FLUX_RUN, f"data.path={flux_data}", f"model.patch_size={packing}", "training.max_steps=1",
                 f"logging.output_dir={tmp_path / 'run'}"]) == 0
    out = tmp_path / "transformer"
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    warned = "packs 4x4 latents into a token (model.patch_size=4): FluxTransformer2DModel loads it, FluxPipeline " \
             "(which packs 2x2) cannot drive it"
    assert (warned in caplog.text) == (packing == 4)
    loaded = diffusers.FluxTransformer2DModel.from_pretrained(out).eval()
    model = load_trained(checkpoints(tmp_path / "run")[-1])[0].transformer
    x = flux_inputs()
    with torch.no_grad():
        torch.testing.assert_close(packed_output(loaded, x, packing), ours(model, x), rtol=0, atol=1e-5)
    if packing == 2:
        assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "k"),
                                  "--format", "kohya"]) == 2
        assert "--format kohya writes a FLUX.1, Qwen-Image or FLUX.2 LoRA, and" in caplog.text
        assert "is a full fine-tune" in caplog.text
        assert not (tmp_path / "k").exists()


def test_kohya_format_of_an_sd3_run_is_refused(lora_run, tmp_path, caplog):
    assert main(lora_run("training.max_steps=1")) == 0
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "k"), "--format",
                              "kohya"]) == 2
    assert "is of model.family=sd3: export it in the default format (--format peft)" in caplog.text
    assert not (tmp_path / "k").exists()


def test_kohya_file_keeps_alpha_exact_at_any_dtype(tmp_path):
    """alpha is the fused rank, stored in fp32 whatever --dtype: in bf16 a rank of 3 x 87 = 261 would round to
    260, and every loader would scale the adapter by 260 / 261."""
    weights = {f"transformer_blocks.0.attn.to_{p}.lora_{ab}.default.weight": torch.randn(shape)
               for p in "qkv" for ab, shape in (("A", (87, 16)), ("B", (16, 87)))}
    settings = {"r": 87, "lora_alpha": 87, "use_rslora": False, "use_dora": False}
    tensors = kohya_lora({"transformer": (weights, settings)}, (16, 1, 0), "test")
    file = save_named_lora_file(tensors, tmp_path / "bf16", torch.bfloat16)
    assert file == tmp_path / "bf16" / "bf16.safetensors"
    tensors = load_file(file)
    assert torch.tensor(261.0).bfloat16().item() == 260
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 261
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].dtype == torch.bfloat16


def test_kohya_metadata_says_what_model_sites_read_and_the_trigger_words_where_the_run_has_them():
    """kohya's ss_* keys from the run's config and state.json (the epoch the last step is in: 500 steps of 8 over 20
    images end in epoch 200); the trigger words (data.caption_prefix) as ss_tag_frequency's one tag and the SAI
    model spec's trigger phrase, only where the config has them."""
    from omegaconf import OmegaConf
    from models.families import FAMILIES
    cfg = OmegaConf.create({"model": {"init_from": "/m/FLUX.1-dev/transformer"}, "logging": {"output_dir": "/runs/me"},
                            "data": {"path": "/latents/me"},
                            "training": {"train_batch_size": 1, "gradient_accumulation_steps": 4}})
    meta = {"lora": {"r": 16, "lora_alpha": 32}, "step": 500, "world_size": 2, "data": {"items": 20, "resolution": 1024}}
    found = kohya_metadata(cfg, meta, FAMILIES["flux"])
    assert found == {"ss_base_model_version": "flux1", "ss_network_module": "networks.lora_flux",
                     "ss_network_dim": "16", "ss_network_alpha": "16.0", "ss_steps": "500", "ss_output_name": "me",
                     "ss_sd_model_name": "FLUX.1-dev", "ss_num_train_images": "20", "ss_epoch": "200",
                     "ss_resolution": "(1024, 1024)"}
    cfg.data.caption_prefix = "sks person"
    assert kohya_metadata(cfg, meta, FAMILIES["flux"]) == {
        **found, "modelspec.trigger_phrase": "sks person", "ss_tag_frequency": '{"me": {"sks person": 20}}'}
