"""The README's fine-tuning commands, run as it prints them, in a fresh clone of this checkout (its committed
state), on tiny data: webdataset shards -> precompute -> a LoRA fine-tune through the launcher -> export -> the
diffusers snippet.

The commands run in the environment `. .venv/bin/activate` gives (this interpreter's bin/ first on PATH, no
PYTHON set), from the clone's root. Only the README's placeholders are bound, under the names it gives them:
`SD3_DIR` and `SHARDS` are symlinks in the clone to a tiny random SD3 pipeline (saved by diffusers, with a VAE
that downsamples 32x, so that the README's 1024 px make 32x32 latents, and a transformer whose default
sample size makes the snippet's image 256 px) and to tar shards; `prompts.txt` is a
file there; the snippet's "path/to/stable-diffusion-3-medium-diffusers" is that pipeline. Not run: `pip install`
(no package index here; this environment has the extras), the image-folder variant of step 1 and the full
fine-tune of step 2a (tests/test_precompute.py runs both in-process), and the long LoRA run, which the test
checks is the short one without its two overrides.
"""

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, T5_TOKENS, WORDS, clip, word_tokenizer

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
SECTION = "## Fine-tuning SD3 / SD3.5 on your own images"
SNIPPET_SD3_DIR = '"path/to/stable-diffusion-3-medium-diffusers"'


def readme_blocks(kind: str) -> list[str]:
    """The section's ```kind blocks (its text up to the next heading of the same or a higher level)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION):]
    section = section[: section.index("\n## ", 1)]
    section = section[: section.index("\n### ")] if "\n### " in section else section
    return re.findall(rf"```{kind}\n(.*?)```", section, re.S)


def commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


def tiny_sd3_pipeline(directory: Path) -> Path:
    """A random SD3 pipeline saved by diffusers (model_index.json and all): the text encoders of
    tests/conftest.py, a VAE with five downsamplings (32x) and a 2-block transformer."""
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 6,
                                  up_block_types=["UpDecoderBlock2D"] * 6, block_out_channels=[2] * 6,
                                  layers_per_block=1, latent_channels=4, norm_num_groups=1, shift_factor=0.0609,
                                  scaling_factor=1.5305)
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(WORDS) + 3, d_model=24, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2))
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=32)
    diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip(8), tokenizer=word_tokenizer(8), text_encoder_2=clip(16), tokenizer_2=word_tokenizer(8),
        text_encoder_3=t5, tokenizer_3=word_tokenizer(T5_TOKENS)).save_pretrained(directory)
    return directory


def tar_shards(directory: Path, shards: int = 2, per_shard: int = 8) -> Path:
    """img2dataset's layout: KEY.png and KEY.txt per sample; square images, so that the 16 items fill one
    global batch (2 x 8 in configs/sd3_medium_lora.yaml) of one aspect bucket."""
    from PIL import Image
    directory.mkdir()
    gen = torch.Generator().manual_seed(2)
    for s in range(shards):
        with tarfile.open(directory / f"{s:05d}.tar", "w") as tar:
            for i in range(per_shard):
                image = io.BytesIO()
                Image.fromarray(torch.randint(0, 256, (16, 16, 3), generator=gen, dtype=torch.uint8).numpy()).save(
                    image, format="PNG")
                caption = " ".join(WORDS[j] for j in torch.randint(len(WORDS), (4,), generator=gen)).encode()
                for name, data in ((f"{s:05d}{i:04d}.png", image.getvalue()), (f"{s:05d}{i:04d}.txt", caption)):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return directory


def activated_environment() -> dict:
    """What `. .venv/bin/activate` does to the environment of this interpreter's venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=sys.prefix,
               PYTHONUNBUFFERED="1")
    return env


def run(command: str, cwd: Path, env: dict) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, f"$ {command}\n" + "\n".join(
        line for line in done.stdout.splitlines() if "%|" not in line)[-4000:]
    return done.stdout


def test_the_readme_fine_tuning_commands_run_as_printed(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    (clone / "SD3_DIR").symlink_to(tiny_sd3_pipeline(tmp_path / "sd3"))
    (clone / "SHARDS").symlink_to(tar_shards(tmp_path / "shards"))
    (clone / "prompts.txt").write_text("a red cat\na dog on the grass\n")
    env = activated_environment()
    shell = [c for block in readme_blocks("bash") for c in commands(block)]
    python = readme_blocks("python")

    quickstart = (ROOT / "README.md").read_text().split("## Quickstart")[1].split("\n## ")[0]
    assert ". .venv/bin/activate" in quickstart  # what this test's environment stands for
    assert "pip install -e '.[finetune]'" in shell  # in the activated environment: pip is the venv's
    assert run("command -v pip python torchrun", clone, env).split() == [
        f"{Path(sys.executable).parent}/{name}" for name in ("pip", "python", "torchrun")]
    precompute = [c for c in shell if c.startswith("python precompute_latents.py") and "--shards" in c]
    lora = [c for c in shell if c.startswith("./train_mmdit_stable.sh --config configs/sd3_medium_lora.yaml")]
    export = [c for c in shell if c.startswith("python export_mmdit.py") and "runs/sd3_medium_lora" in c]
    assert len(precompute) == 1 and len(lora) == 2 and len(export) == 1 and len(python) == 1, shell
    short, full = lora
    assert short == full + " training.max_steps=2 compile.enabled=false"

    said = run(precompute[0], clone, env)
    assert "wrote 16 items" in said, said[-2000:]
    said = run(short, clone, env)
    assert "steps 0 -> 2" in said, said[-2000:]
    run(export[0], clone, env)
    assert (clone / "out" / "lora" / "pytorch_lora_weights.safetensors").is_file()

    # step 2a's export (a full fine-tune, not run here) would be out/transformer: the base stands in for it
    shutil.copytree(tmp_path / "sd3" / "transformer", clone / "out" / "transformer")
    snippet = python[0]
    assert snippet.count(SNIPPET_SD3_DIR) == 1
    (clone / "snippet.py").write_text(snippet.replace(SNIPPET_SD3_DIR, '"SD3_DIR"') +
                                      "\nassert image.size == (256, 256)\n")  # sample_size 8 x the VAE's 32
    said = run("python snippet.py", clone, env)
    assert "torch_dtype" not in said, said[-2000:]  # no deprecation warning from current diffusers
