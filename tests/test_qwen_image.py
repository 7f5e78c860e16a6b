"""What is Qwen-Image's own (what every family has is tests/test_families.py's; its files for ComfyUI,
tests/test_qwen_image_files.py's): the tiny tokenizer cuts the prompt template as the real one does, rotary tables
made once per shape, the pipeline's schedule (its resolution shift and its last sigma stretched to 0.02) and its true
CFG rescaled per token, the negative prompt validation uses, and mistakes named before anything runs."""

import pytest
import torch

from configs.build import build_sampler
from configs.schema import load_config
from models.blocks import pack, unpack
from models.qwen_image.model import QwenImage, QwenImageConfig
from models.qwen_image.text import TEMPLATE, TEMPLATE_TOKENS
from models.rectified_flow import guided, sampling_sigmas
from tests.families import CASES, ours, qwen_encode
from tests.pipelines import QWEN_SCHEDULER, qwen_tokenizer, template_tokens
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")


def test_the_tiny_tokenizer_cuts_the_template_into_its_34_tokens():
    """The pipeline drops the template's first 34 tokens by position: a tokenizer that cut it otherwise would drop
    caption tokens (or keep template ones). What stays is the caption and the template's closing tokens."""
    tokenizer = qwen_tokenizer()
    assert template_tokens(tokenizer) == TEMPLATE_TOKENS == 34
    kept = tokenizer.convert_ids_to_tokens(tokenizer(TEMPLATE.format("a red cat")).input_ids[TEMPLATE_TOKENS:])
    assert kept == ["a", "Ġred", "Ġcat", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]


def test_rotary_tables_are_computed_once_per_shape():
    config = CASES["qwen_image"].configs["qwen-like"]
    model = QwenImage(QwenImageConfig(**config))
    with torch.no_grad():
        for height, width in ((8, 8), (8, 8), (8, 12)):
            ours(model, CASES["qwen_image"].inputs(config, height, width, 5, seed=0))
    assert len(model.rope_cache) == 2


@pytest.mark.parametrize("resolution,steps", [(1024, 4), (1328, 30), (512, 50)])
def test_the_sampling_schedule_is_the_pipelines(resolution, steps):
    """sampling.resolution_shift: the sigmas of QwenImagePipeline's scheduler for that image (mu from the packed
    token count, 0.5 at 256 tokens to 0.9 at 8192; the last sigma before 0 stretched to 0.02)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    cfg = load_config(overrides=["model.family=qwen_image", "model.patch_size=2", "sampling.resolution_shift=true",
                                 f"sampling.steps={steps}"])
    latent = resolution // 8
    sampler = build_sampler(cfg, (latent, latent))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    tokens = (latent // 2) ** 2
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(),
                            mu=calculate_shift(tokens, 256, 8192, 0.5, 0.9))
    ours_sigmas = sampling_sigmas(sampler.steps, sampler.shift, sampler.terminal)
    torch.testing.assert_close(ours_sigmas, scheduler.sigmas.float(), rtol=0, atol=1e-6)
    assert sampler.renorm == 2


def test_true_cfg_rescales_each_packed_tokens_velocity_as_the_pipeline_does():
    """QwenImagePipeline: guided = uncond + s (cond - uncond), then each packed token's guided velocity scaled to its
    conditional one's norm over the token's channels."""
    gen = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 4, 6, 8, generator=gen)
    packed_cond, packed_uncond = pack(cond, 2), pack(uncond, 2)
    combined = packed_uncond + 4.0 * (packed_cond - packed_uncond)
    theirs = combined * (packed_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(guided(cond, uncond, 4.0, renorm=2), unpack(theirs, 6, 8, 2), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(guided(cond, uncond, 4.0, renorm=None), unpack(theirs, 6, 8, 2))


def test_validation_images_are_guided_against_the_negative_prompt(qwen_dir, qwen_data):
    """Precompute with validation prompts also encodes the pipeline's negative prompt " ", which validation takes
    as the unconditional input (the empty prompt stays caption dropout's)."""
    from data.latents import LatentDataset
    pipe = diffusers.QwenImagePipeline.from_pretrained(qwen_dir)
    dataset = LatentDataset(qwen_data)
    with torch.no_grad():
        negative = qwen_encode(pipe, [" "])
    length = negative["prompt_embeds"].shape[1]
    for name, values in negative.items():
        torch.testing.assert_close(dataset.negative_prompt[name][0, :length], values[0].float(), rtol=0, atol=1e-5)
    assert not torch.equal(dataset.negative_prompt["prompt_embeds"], dataset.empty_prompt["prompt_embeds"])


def test_mistakes_are_named_before_anything_runs(qwen_dir, qwen_data, tmp_path, caplog):
    """A Qwen-Image transformer under an SD3 or a FLUX.1 config; latents that do not pack into 2 x 2 tokens;
    a longer text than the pipeline takes: exit 2, one line, nothing written."""
    import precompute_latents
    run = ["training.max_steps=1", f"data.path={qwen_data}", f"model.init_from={qwen_dir / 'transformer'}",
           f"logging.output_dir={tmp_path / 'run'}"]
    for config in ("sd3_medium_lora", "flux_dev_lora"):
        assert main(["--config", f"configs/{config}.yaml", *run]) == 2
        assert "holds a qwen_image transformer (QwenImageTransformer2DModel): use a config of that family" in caplog.text
        caplog.clear()
    assert main(["--config", "configs/qwen_image_lora.yaml", *run[1:3], "model.init_from=null", "lora.enabled=false",
                 "model.patch_size=3", f"logging.output_dir={tmp_path / 'run'}"]) == 2
    assert "model.patch_size=3 does not divide the 8x8 latents (packed tokens of 3x3)" in caplog.text
    assert not (tmp_path / "run").exists()
    assert precompute_latents.main(["--model", str(qwen_dir), "--images", str(qwen_data.parent / "images"),
                                    "--out", str(tmp_path / "data"), "--max-sequence-length", "2000"]) == 2
    assert "--max-sequence-length 2000: Qwen-Image's pipeline takes at most 1024 text tokens" in caplog.text
    assert not (tmp_path / "data").exists()
