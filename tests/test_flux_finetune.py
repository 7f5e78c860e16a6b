"""FLUX.1 fine-tuning on a tiny random FluxPipeline saved by diffusers (tests/conftest.py: flux_dir): precompute
stores what the pipeline computes (FLUX's VAE constants, T5 tokens and CLIP-L's pooled output), text encoded in the
step equals precomputed, and mistakes are named before compute."""

import pytest
import torch

import precompute_latents
from data.latents import LatentDataset
from tests.conftest import T5_TOKENS, image_folder
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")


def precompute(flux_dir, images, out, *extra) -> int:
    return precompute_latents.main(["--model", str(flux_dir), "--images", str(images), "--out", str(out),
                                    "--resolution", "16", "--dtype", "fp32", *extra])


@pytest.fixture(scope="module")
def flux_data(flux_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("flux-data")
    images = image_folder(root / "images", [(16, 16), (20, 18), (16, 16), (24, 24)] * 2)
    (root / "prompts.txt").write_text("a red cat\na dog on the grass\n")
    assert precompute(flux_dir, images, root / "data", "--validation-prompts", str(root / "prompts.txt")) == 0
    return root / "data"


def test_precompute_stores_what_the_flux_pipeline_computes(flux_dir, flux_data):
    """The VAE latents with FLUX's scale and shift, T5's 512 tokens (dev's default), CLIP-L's pooled output: as
    the pipeline computes them for the same batch of captions."""
    from tests.test_precompute import load_image
    pipe = diffusers.FluxPipeline.from_pretrained(flux_dir)
    ds = LatentDataset(flux_data)
    assert ds.index["family"] == "flux" and ds.index["max_sequence_length"] == 512
    assert ds.index["vae"]["scaling_factor"] == 0.3611 and ds.index["vae"]["shift_factor"] == 0.1159
    assert ds.text_dims == (24, 8) and ds.text_tokens == 512 and len(ds) == 8
    images = flux_data.parent / "images"
    captions = [(images / f"img{i:02d}.txt").read_text() for i in range(8)]
    order = {ds[i]["caption"]: i for i in range(8)}
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(captions, None, max_sequence_length=512)
        pixels = torch.stack([load_image(images / f"img{i:02d}.png", (16, 16)) for i in range(8)])
        latents = (pipe.vae.encode(pixels).latent_dist.mean - 0.1159) * 0.3611
    assert len(order) == 8
    for i, caption in enumerate(captions):
        item = ds[order[caption]]
        torch.testing.assert_close(item["prompt_embeds"], embeds[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(item["pooled_prompt_embeds"], pooled[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(item["latents"], latents[i], rtol=1e-5, atol=1e-5)


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


def test_encoding_in_the_step_under_fsdp_equals_precomputed_embeddings(flux_lora, tmp_path):
    """CLIP-L and T5 run in the step, sharded layer by layer over 2 FSDP ranks with the transformer: the weights of
    one process on precomputed embeddings (fp32 summation order apart)."""
    from tests.conftest import assert_close, final_weights, trains
    assert main(flux_lora("optimizer.eps=1e-3", name="precomputed")) == 0
    trains(2, flux_lora("optimizer.eps=1e-3", "data.text_encoding=on_the_fly", "parallel.strategy=fsdp",
                        "training.train_batch_size=2", name="on_the_fly"), tmp_path)
    assert_close(final_weights(tmp_path / "on_the_fly"), final_weights(tmp_path / "precomputed"), atol=1e-5)


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
    assert ("flux.train_guidance sets the guidance a guidance-distilled model (FLUX.1-dev) embeds, and "
            f"{schnell} has no guidance embedding" in caplog.text)
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
    from tests.conftest import final_weights, metric_rows
    run = flux_lora("lora.use_dora=true", "lora.use_rslora=true", "lora.text_encoders=[clip_l]",
                    "data.text_encoding=on_the_fly", "lora.base_quantization=nf4", "data.holdout=2",
                    "validation.every=2", "validation.loss_sigmas=2", "sampling.steps=2", "sampling.cfg_scale=1",
                    "sampling.resolution_shift=true", "flow.resolution_shift=true")
    assert main(run) == 0
    weights = final_weights(tmp_path / "run")
    for part in ("transformer.transformer_blocks.0.attn.to_q", "transformer.single_transformer_blocks.1.proj_mlp",
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
