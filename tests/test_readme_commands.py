"""The shell commands of the README and of the guides (docs/*.md, its ```bash blocks), as printed.

Run, in a fresh clone of this checkout (its committed state), in the environment `. .venv/bin/activate` gives
(this interpreter's bin/ first on PATH, no PYTHON set), from the clone's root:
- the README's commands, in the README's order, after `make train`. `make train` runs as
  `make -o .venv/.installed PY=python train ARGS="training.max_steps=3 validation.at_end=false"`: the Makefile's
  train rule without creating .venv (no package index here; this environment stands for it) and with 3 steps, so
  that a later command reusing runs/shapes would meet a checkpoint beyond its own steps, as after the real 1500.
  Every training command runs with the README's quick-try suffix `QUICK` appended (inside ARGS for make); a
  command that asks for more than 2 processes or several nodes, names a placeholder this test does not bind (an
  upper-case name such as `FLUX_DIR`) is checked only (below), and so are
  `make test` (this suite), `make selfcheck` and `pip install` (no package index here; this environment has the
  extras).
- then the fine-tuning guide's flow (docs/fine-tuning.md, up to its first `## ` heading) in the same clone: the
  commands the README already ran are not run again, its short LoRA run must be the full one plus `QUICK`, its
  LoRA export runs, and its diffusers snippet runs on the exported adapter and on the base transformer standing in
  for the full fine-tune's export. Checked only there: the image-folder and shard variants of step 1 whose output
  the README's commands did not write, and the full fine-tune (tests/test_precompute.py runs both in-process).
The README's placeholders are bound under the names it gives them: `SD3_DIR`, `IMAGES` and `SHARDS` are symlinks
in the clone to a tiny random SD3 pipeline (saved by diffusers, with a VAE that downsamples 32x, so that 1024 px
make 32x32 latents, and a transformer whose default sample size makes the snippet's image 256 px), to an image
folder and to tar shards; `prompts.txt` is a file there.

Checked only, every other command of the README and the guides (they need a GPU, a released checkpoint or
hours), statically: the environment variables before a launcher are ones the launchers read; a training
command's `--config` exists and `configs.schema.load_config(config, overrides, resolve=False)` accepts it with
its overrides (keys, types, ranges, required keys, combinations); `python SCRIPT.py` / `./launch.sh SCRIPT.py`:
the script exists and each `--option` it is given is in its `--help`, which runs; `make TARGET`: the target
exists; `pip install -e '.[EXTRA]'`: the extra exists; `tensorboard --logdir DIR`: DIR is the `tensorboard/` of
a run an earlier command of the same document trains; a script block (`#!`): `bash -n`; a ```python block:
it compiles. A command of any other program fails the test, so that no new kind of command goes unchecked.
Every training command of the README (run or checked) writes to a run directory of its own, other than
runs/shapes; the README's inline `make ...` and `./train_mmdit_stable.sh ...` commands are checked as well; every
relative link and every backticked source path of the README and the guides exists.
"""

import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, T5_TOKENS, WORDS, clip, word_tokenizer, write_shard

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUICK = "training.max_steps=2 compile.enabled=false validation.at_end=false"
MAKE_TRAIN = 'make -o .venv/.installed PY=python train ARGS="training.max_steps=3 validation.at_end=false"'
BOUND = {"SD3_DIR", "IMAGES", "SHARDS"}
SNIPPET_SD3_DIR = '"path/to/stable-diffusion-3-medium-diffusers"'
FINE_TUNING = ROOT / "docs" / "fine-tuning.md"


@dataclass
class Command:
    doc: Path
    text: str  # as printed, continuation lines joined
    env: dict[str, str]
    argv: list[str]

    def __str__(self):
        return f"{self.doc.relative_to(ROOT)}: {self.text}"


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def commands(doc: Path, text: str | None = None) -> list[Command]:
    """The shell commands of a document's ```bash blocks (scripts aside), in order."""
    found = []
    for block in code_blocks(doc.read_text() if text is None else text, "bash"):
        if block.startswith("#!"):
            continue
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(parse(doc, line.strip()))
    return found


def parse(doc: Path, text: str) -> Command:
    tokens = shlex.split(text, comments=True)
    env = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    return Command(doc, text.split("  #")[0].rstrip(), env, tokens)


@functools.cache
def launcher_variables() -> set[str]:
    text = (ROOT / "launch.sh").read_text() + (ROOT / "train_mmdit_stable.sh").read_text()
    return set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", text))


def training(command: Command) -> tuple[str, list[str]] | None:
    """(config, overrides) of a training command, or None."""
    argv = command.argv
    if argv[:2] == ["make", "train"]:
        args = [a.split("=", 1)[1] for a in argv[2:] if a.startswith("ARGS=")]
        return "configs/shapes.yaml", shlex.split(args[0]) if args else []
    if argv[:1] == ["./train_mmdit_stable.sh"] or argv[:2] == ["./launch.sh", "train_mmdit_stable.py"]:
        rest = argv[1:] if argv[0] == "./train_mmdit_stable.sh" else argv[2:]
        if rest[:1] == ["--config"]:
            return rest[1], rest[2:]
        return "configs/shapes.yaml", rest
    return None


def script(command: Command) -> tuple[str, list[str]] | None:
    """(script, arguments) of `python SCRIPT.py ...` or `./launch.sh SCRIPT.py ...`, or None."""
    argv = command.argv
    if argv[:1] in (["python"], ["./launch.sh"]) and len(argv) > 1 and argv[1].endswith(".py"):
        return argv[1], argv[2:]
    return None


def helps(scripts: set[str]) -> dict[str, str]:
    """Each script's --help, from one process (the imports paid once)."""
    code = textwrap.dedent("""
        import contextlib, io, json, os, runpy, sys
        out = {}
        for script in sys.argv[1:]:
            sys.argv, text = [script, "--help"], io.StringIO()
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            try:
                with contextlib.redirect_stdout(text):
                    runpy.run_path(script, run_name="__main__")
                out[script] = "--help did not exit"
            except SystemExit as e:
                out[script] = text.getvalue() if e.code == 0 else f"--help exited {e.code}"
        print("HELPS" + json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", code, *sorted(scripts)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert "HELPS" in done.stdout, done.stdout[-3000:]
    return json.loads(done.stdout.split("HELPS", 1)[1])


def check(command: Command, help_texts: dict[str, str], run_dirs: list[str]) -> str | None:
    """The static check of one command; returns the run directory a training command writes to."""
    from configs.schema import load_config
    from errors import ConfigError

    argv = command.argv
    unknown = set(command.env) - launcher_variables()
    assert not unknown, f"{command}: {sorted(unknown)} are not read by launch.sh or train_mmdit_stable.sh"
    if (spec := training(command)) is not None:
        config, overrides = spec
        assert (ROOT / config).is_file(), f"{command}: {config} does not exist"
        try:
            return load_config(ROOT / config, overrides, resolve=False).logging.output_dir
        except ConfigError as e:
            raise AssertionError(f"{command}: {e}") from None
    if (spec := script(command)) is not None:
        path, args = spec
        assert (ROOT / path).is_file(), f"{command}: {path} does not exist"
        options = {a.split("=")[0] for a in args if a.startswith("--")}
        missing = [o for o in sorted(options) if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])",
                                                              help_texts[path])]
        assert not missing, f"{command}: {missing} are not options of {path}:\n{help_texts[path]}"
    elif argv[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert argv[1] in targets, f"{command}: no make target {argv[1]}"
    elif argv[:3] == ["pip", "install", "-e"]:
        extras = re.findall(r"^(\w+) = \[", (ROOT / "pyproject.toml").read_text(), re.M)
        extra = re.fullmatch(r"\.\[(\w+)\]", argv[3])
        assert extra and extra.group(1) in extras, f"{command}: not an extra of pyproject.toml ({extras})"
    elif argv[0] == "tensorboard":
        logdir = argv[argv.index("--logdir") + 1]
        assert logdir.endswith("/tensorboard") and logdir[: -len("/tensorboard")] in run_dirs, (
            f"{command}: no command before it in {command.doc.name} trains {logdir[: -len('/tensorboard')]}")
    elif argv[:1] != ["."]:  # `. .venv/bin/activate`: this test's environment stands for it
        raise AssertionError(f"{command}: this test does not know how to check {argv[0]}; teach it")
    return None


def test_every_command_of_the_readme_and_the_guides_checks():
    all_commands = [c for doc in DOCS for c in commands(doc)]
    readme_inline = [parse(ROOT / "README.md", span) for span in
                     re.findall(r"`((?:make |\./train_mmdit_stable\.sh )[^`]+)`", (ROOT / "README.md").read_text())]
    help_texts = helps({script(c)[0] for c in all_commands + readme_inline if script(c)
                        and (ROOT / script(c)[0]).is_file()})
    for doc in DOCS:
        run_dirs = []
        for command in commands(doc):
            run_dir = check(command, help_texts, run_dirs)
            run_dirs += [run_dir] if run_dir and command.argv != ["make", "train"] else []
        if doc.name == "README.md":
            assert "runs/shapes" not in run_dirs and len(set(run_dirs)) == len(run_dirs), (
                f"the README's training commands after make train must each write to a run directory of their own "
                f"(issue 35), other than make train's runs/shapes: {run_dirs}")
        for block in code_blocks(doc.read_text(), "bash"):
            if block.startswith("#!"):
                done = subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True)
                assert done.returncode == 0, f"{doc.name}: {done.stderr}\n{block}"
        for block in code_blocks(doc.read_text(), "python"):
            compile(block, str(doc), "exec")
    for command in readme_inline:
        check(command, help_texts, [])


def test_links_and_source_paths_of_the_docs_exist():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            target = (doc.parent / link).resolve()
            if not link.startswith("http") and not target.exists():
                missing.append(f"{doc.name}: link {link}")
        for path in re.findall(r"`((?:models|configs|data|perf|runtime|optim|benchmarks|tests|docs)/[\w./-]+"
                               r"\.(?:py|yaml|md|png|txt|sh))`", text):
            if not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


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


def samples(count: int, seed: int):
    """(key, PNG bytes, caption) of square random images, so that 16 items fill one global batch (2 x 8 in
    configs/sd3_medium_lora.yaml) of one aspect bucket."""
    from PIL import Image
    gen = torch.Generator().manual_seed(seed)
    for i in range(count):
        image = io.BytesIO()
        Image.fromarray(torch.randint(0, 256, (16, 16, 3), generator=gen, dtype=torch.uint8).numpy()).save(
            image, format="PNG")
        yield f"{i:05d}", image.getvalue(), " ".join(WORDS[j] for j in torch.randint(len(WORDS), (4,), generator=gen))


def image_folder(directory: Path) -> Path:
    directory.mkdir()
    for key, png, caption in samples(16, seed=1):
        (directory / f"{key}.png").write_bytes(png)
        (directory / f"{key}.txt").write_text(caption)
    return directory


def tar_shards(directory: Path, shards: int = 2) -> Path:
    """img2dataset's layout: KEY.png and KEY.txt per sample."""
    directory.mkdir()
    items = list(samples(16, seed=2))
    for s in range(shards):
        members = {f"{key}.{suffix}": data for key, png, caption in items[s::shards]
                   for suffix, data in (("png", png), ("txt", caption.encode()))}
        write_shard(directory / f"{s:05d}.tar", members)
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


def placeholders(command: Command) -> set[str]:
    """The upper-case names a command uses for the user's folders and files (SD3_DIR, IMAGES, ...)."""
    return set(re.findall(r"(?<![\w$])([A-Z][A-Z0-9_]{2,})(?=[/\s']|$)", command.text))


def as_run(command: Command) -> str | None:
    """The command line this test runs for a command, or None where it only checks it (why: the docstring)."""
    argv, env = command.argv, command.env
    if int(env.get("NPROC_PER_NODE", 1)) > 2 or int(env.get("NNODES", 1)) > 1 or "MASTER_ADDR" in env:
        return None
    if placeholders(command) - BOUND:
        return None
    if argv[:2] == ["make", "train"] and len(argv) == 2:
        return MAKE_TRAIN
    if training(command) is not None:
        if argv[0] == "make":
            return re.sub(r'ARGS="([^"]*)"', rf'ARGS="\1 {QUICK}"', command.text)
        return command.text if command.text.endswith(QUICK) else f"{command.text} {QUICK}"
    if (spec := script(command)) is not None and spec[0] in ("precompute_latents.py", "export_mmdit.py"):
        return command.text
    return None


def test_the_readme_then_the_fine_tuning_guide_run_as_printed(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    (clone / "SD3_DIR").symlink_to(tiny_sd3_pipeline(tmp_path / "sd3"))
    (clone / "IMAGES").symlink_to(image_folder(tmp_path / "images"))
    (clone / "SHARDS").symlink_to(tar_shards(tmp_path / "shards"))
    (clone / "prompts.txt").write_text("a red cat\na dog on the grass\n")
    env = activated_environment()
    readme = (ROOT / "README.md").read_text()
    assert ". .venv/bin/activate" in readme.split("## Quickstart")[1].split("\n## ")[0]
    assert run("command -v pip python torchrun", clone, env).split() == [
        f"{Path(sys.executable).parent}/{name}" for name in ("pip", "python", "torchrun")]
    assert QUICK in readme, "the README prints the quick-try suffix this test appends"

    ran, said = [], {}
    guide = FINE_TUNING.read_text()
    flow = commands(FINE_TUNING, guide[: guide.index("\n## ")])
    for command in commands(ROOT / "README.md") + flow:
        line = as_run(command)
        if line is None or line in ran:
            continue
        if command.doc == FINE_TUNING and command.argv[:1] == ["python"] and "precompute_latents.py" in command.argv \
                and not (clone / command.argv[command.argv.index("--out") + 1]).exists():
            continue  # the variants of step 1 the README did not run: checked only
        if command.doc == FINE_TUNING and "configs/sd3_medium.yaml" in command.text:
            continue  # the full fine-tune: checked only
        if command.argv[:2] == ["python", "export_mmdit.py"] and \
                not (clone / command.argv[command.argv.index("--checkpoint") + 1]).exists():
            continue  # the export of a run this test did not train
        said[line] = run(line, clone, env)
        ran.append(line)

    summary = "\n".join(ran)
    assert ran[0] == MAKE_TRAIN and "steps 0 -> 3" in said[MAKE_TRAIN], summary
    assert (clone / "runs" / "shapes" / "checkpoints" / "step_00000003").is_dir()
    assert any("--images IMAGES" in line and "wrote 16 items" in said[line] for line in ran), summary
    assert any("--shards" in line and "wrote 16 items" in said[line] for line in ran), summary
    assert any(line.startswith("NPROC_PER_NODE=2 ") and "over 2 process(es)" in said[line] for line in ran), summary
    assert any(line.startswith("ENABLE_PROFILING=true ") for line in ran), summary
    assert (clone / "exports" / "lora" / "pytorch_lora_weights.safetensors").is_file(), summary

    noise = [f"{line}: {out}" for line in ran for out in said[line].splitlines()
             if any(mark in out for mark in ("Failed to load", "Detected no triton", "_pytree"))]
    assert not noise, noise  # torchao's start-up warnings, which say nothing about the run (runtime/quiet_imports.py)
    untracked = run("git status --porcelain --untracked-files=all", clone, env).splitlines()
    assert sorted(untracked) == ["?? IMAGES", "?? SD3_DIR", "?? SHARDS", "?? prompts.txt"], untracked  # outputs apart

    lora = [c.text for c in flow if c.text.startswith("./train_mmdit_stable.sh --config configs/sd3_medium_lora")]
    assert len(lora) == 2 and lora[0] == f"{lora[1]} {QUICK}", lora  # the short run, then the same run continued
    assert lora[0] in ran, summary

    # step 2a's export (a full fine-tune, not run here) would be exports/transformer: the base stands in for it
    shutil.copytree(tmp_path / "sd3" / "transformer", clone / "exports" / "transformer")
    snippet = code_blocks(guide[: guide.index("\n## ")], "python")
    assert len(snippet) == 1 and snippet[0].count(SNIPPET_SD3_DIR) == 1, snippet
    (clone / "snippet.py").write_text(snippet[0].replace(SNIPPET_SD3_DIR, '"SD3_DIR"') +
                                      "\nassert image.size == (256, 256)\n")  # sample_size 8 x the VAE's 32
    said = run("python snippet.py", clone, env)
    assert "torch_dtype" not in said, said[-2000:]  # no deprecation warning from current diffusers
