"""Shared test helpers: tiny runs, comparisons that can fail, and ranks in real processes."""

import errno
import io
import itertools
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

# One thread per process, here and (through OMP_NUM_THREADS) in every process a test starts: the suite's
# tensors are tiny, `make test` runs two workers on two cores, and a second thread per process only contends.
# Runs compared bit for bit then also sum in the same order wherever they ran.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180  # a hung collective fails the test instead of the suite

# Without the final validation (validation.at_end): sampling and scoring the 90 shapes captions was a tenth of a
# tiny run; the tests of the end of a run (test_training, test_validation, test_observability) turn it on.
TINY = ["model.patch_size=4", "model.num_layers=2", "model.num_attention_heads=2", "model.attention_head_dim=16",
        "text_encoder.dim=32", "text_encoder.num_heads=2", "training.train_batch_size=8", "optimizer.warmup_steps=2",
        "sampling.steps=2", "sampling.grid_size=4", "logging.log_every=1", "checkpoint.every=0",
        "validation.at_end=false"]


def assert_close(a, b, atol: float = 0.0, mean_atol: float | None = None) -> float:
    """Two state dicts (nested dicts of tensors) hold the same keys, at least one tensor, and values equal
    (bitwise with atol=0) or within `atol` of each other (and on average within `mean_atol`). Returns the
    largest difference."""
    flat_a, flat_b = flatten(a), flatten(b)
    assert flat_a, "nothing to compare"
    assert flat_a.keys() == flat_b.keys(), (sorted(flat_a.keys() - flat_b.keys())[:5],
                                            sorted(flat_b.keys() - flat_a.keys())[:5])
    worst, total, count = 0.0, 0.0, 0
    for key, x in flat_a.items():
        y = flat_b[key]
        assert x.shape == y.shape and x.dtype == y.dtype, (key, x.shape, y.shape, x.dtype, y.dtype)
        if atol == 0:
            assert torch.equal(x, y), f"{key} differs by {(x.double() - y.double()).abs().max()}"
            continue
        diff = (x.double() - y.double()).abs()
        worst, total, count = max(worst, float(diff.max()) if diff.numel() else 0.0), total + float(diff.sum()), \
            count + diff.numel()
    assert worst <= atol, f"largest difference {worst} > {atol}"
    if mean_atol is not None:
        assert total / max(count, 1) <= mean_atol, f"mean difference {total / count} > {mean_atol}"
    return worst


def assert_differs(a, b) -> None:
    """Two state dicts with the same keys that differ somewhere (training moved the weights)."""
    flat_a, flat_b = flatten(a), flatten(b)
    assert flat_a and flat_a.keys() == flat_b.keys()
    assert any(not torch.equal(flat_a[k], flat_b[k]) for k in flat_a), "all values are equal"


def flatten(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in flatten(value, f"{prefix}{i}.").items()}
    return {}


# ----------------------------------------------------------------------------------------------- ranks

PORTS_PER_WORKER = 1500
_next_port = itertools.count()


def free_port() -> int:
    """A free port that no other test process will be handed: each pytest-xdist worker (`make test` runs two)
    walks a range of its own below the kernel's ephemeral ports (32768 and up), where neither bind(0) nor gloo's
    own connections land, so two workers' rendezvous never meet."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    first = 20000 + worker * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_next_port) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT from an earlier run
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{first + PORTS_PER_WORKER - 1}")


def gloo_threads() -> list[str]:
    """The threads of this process that gloo's process groups run (Linux names them): none once every group
    is freed."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return [name for name in names if "gloo" in name]


# `make test` (16-18 minutes on 2 cores) runs the heavier checks the family matrix and the multi-process tests
# repeat on the parameters below only; `make test-all` runs every parameter (the `full` mark). Each family keeps
# several of them in `make test`, and every check runs on at least one family there.
MAKE_TEST_KEEPS = {
    "test_text_encoded_in_the_step_under_fsdp_trains_like_precomputed_text": {"qwen_image"},
    "test_an_edit_run_compiled_checkpointed_and_sharded_trains_the_eager_runs_weights": {"flux"},
    "test_fsdp_trains_ddps_weights_and_resumes_bit_for_bit": {"flux2"},
    "test_checkpointed_blocks_compile_without_graph_breaks": {"sd3-full", "flux-selective", "qwen_image-full",
                                                               "flux2-selective"},
    "test_lokr_and_loha_on_an_nf4_base_resume_bit_for_bit_and_export_what_comfyui_applies": {
        "sd3-lokr", "flux-loha", "qwen_image-lokr", "flux2-loha"},
    "test_the_oom_splitter_and_cpu_offload_keep_the_math": {"sd3", "flux2"},
    "test_two_rank_steps_make_no_host_sync": {"ddp"},
    "test_one_rank_out_of_memory_under_fsdp_never_hangs_and_keeps_the_math": {"backward"},
    "test_oom_on_one_rank_shrinks_both_without_a_hang": {"forward"},
}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        keeps = MAKE_TEST_KEEPS.get(getattr(item, "originalname", None))
        if keeps is not None and item.callspec.id not in keeps:
            item.add_marker(pytest.mark.full)


def rank_main(rank: int, world_size: int, port: int, func, args: tuple, out: Path) -> None:
    """One rank with torchrun's environment; writes its result (or error) to `out`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        result = func(*args)
    except Exception as e:  # reported to the test, which fails with it
        result = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(result))


def forkserver():
    """Ranks are forked from a server that imported torch and this project once: a rank starts in ~20 ms
    instead of a few seconds of imports, and each is still a fresh process."""
    context = multiprocessing.get_context("forkserver")
    # torch._inductor: torch.use_deterministic_algorithms imports it (0.5 s in each rank otherwise)
    context.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torch._inductor", "train_mmdit_stable",
                                    "tests.conftest"])
    return context


def spawn(world_size: int, func, *args, tmp_path: Path) -> list:
    """Run func(*args) on `world_size` gloo ranks; results in rank order. Fails (not hangs) on a timeout."""
    context, port = forkserver(), free_port()
    outs = [tmp_path / f"rank{r}-{port}.json" for r in range(world_size)]
    procs = [context.Process(target=rank_main, args=(r, world_size, port, func, args, outs[r]))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung, f"ranks {hung} still running after {TIMEOUT_S}s"
    return [json.loads(o.read_text()) if o.is_file() else f"rank {r} died ({procs[r].exitcode})"
            for r, o in enumerate(outs)]


def config_and_overrides(arguments: list[str]) -> tuple[str, list[str]]:
    """load_config's (path, overrides) of a command line's arguments: `--config FILE` first, if given."""
    from configs.schema import DEFAULT_CONFIG
    if arguments[:1] == ["--config"]:
        return arguments[1], arguments[2:]
    return DEFAULT_CONFIG, arguments


def train(overrides: list[str]) -> dict:
    """main() on one rank, for spawn()."""
    from train_mmdit_stable import main
    return {"status": main(overrides)}


def trains(world_size: int, overrides: list[str], tmp_path: Path) -> None:
    """A run on `world_size` ranks (in this process for one) that must succeed."""
    if world_size == 1:
        from train_mmdit_stable import main
        assert main(overrides) == 0
        return
    results = spawn(world_size, train, overrides, tmp_path=tmp_path)
    assert results == [{"status": 0}] * world_size, results


def train_logging_to(path: Path, overrides: list[str]) -> None:
    """main() in a child whose output (both streams, line by line) goes to `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    from train_mmdit_stable import main
    sys.exit(main(overrides))


def start_run(overrides: list[str], log: Path) -> multiprocessing.Process:
    """A one-process run in a child process of its own, forked from the forkserver (the imports paid once),
    writing its output to `log`."""
    proc = forkserver().Process(target=train_logging_to, args=(log, overrides))
    proc.start()
    return proc


def wait_for(proc: multiprocessing.Process, log: Path, marker: str) -> str:
    """Block until the run has written a line containing `marker` or ended; returns its output so far."""
    deadline, text = time.monotonic() + TIMEOUT_S, ""
    while proc.is_alive() and time.monotonic() < deadline and marker not in text:
        time.sleep(0.01)
        text = log.read_text() if log.is_file() else ""
    return text


def sigkill_after(overrides: list[str], line_marker: str, log: Path) -> None:
    """A one-process run (start_run), SIGKILLed as soon as it prints a line containing `line_marker` (e.g. a
    checkpoint's "complete"): somewhere in the steps that follow."""
    proc = start_run(overrides, log)
    seen = line_marker in wait_for(proc, log, line_marker)
    proc.kill()  # SIGKILL, unless it ended (and was reaped) already
    proc.join(timeout=60)
    said = log.read_text()[-3000:] if log.is_file() else ""
    assert seen, f"the run never printed {line_marker!r} (killed after {TIMEOUT_S}s or ended):\n{said}"
    assert proc.exitcode == -signal.SIGKILL, f"the run ended ({proc.exitcode}) before printing {line_marker!r}:\n{said}"


def sigint_at_first_step(overrides: list[str]) -> int:
    """main() in this process, sent SIGINT (Ctrl-C, a scheduler's pre-emption) as it logs its first step: the
    run must checkpoint at that step's end and return 130 (128 + SIGINT: not finished)."""
    class Interrupt(logging.Handler):
        def emit(self, record):
            if " loss " in record.getMessage() and not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGINT)
    handler, logger = Interrupt(), logging.getLogger("mmdit")
    handler.sent, level = False, logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the step lines are INFO records
    try:
        from train_mmdit_stable import main
        return main(overrides)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl (a line cut by a kill mid-write is none)."""
    from runtime.metrics import read_rows
    return read_rows(run_dir / "metrics.jsonl")


def checkpoint_disk_full(monkeypatch, where: str = "") -> None:
    """Make writing the checkpoint files whose path contains `where` fail as on a full disk, inside DCP's file
    writer: what the checkpointer gets is then DCP's own wrapping of the error, as from a real disk."""
    from torch.distributed.checkpoint import filesystem
    real_write_item = filesystem._write_item

    def write_item(transforms, stream, *args, **kwargs):
        if where in str(stream.name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_item(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", write_item)


def final_weights(run_dir: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """The trained weights (or their EMA) of a run's newest checkpoint, whole, however it was sharded."""
    from perf.checkpoint import checkpoints, read_checkpoint
    return read_checkpoint(checkpoints(run_dir)[-1], (part,))[0][part]


def checkpoint_state(path: Path, parts=("model", "ema", "optimizer")) -> dict:
    from perf.checkpoint import read_checkpoint
    return read_checkpoint(path, parts)[0]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metric_rows(run_dir) if "loss" in r]


class RunsCode:
    """Unpickled, this creates `marker` (through a shell): what the author of a crafted checkpoint could run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def reseal(checkpoint: Path) -> None:
    """Make a checkpoint's manifest match its files again, as the author of a crafted one can."""
    from perf.checkpoint import MANIFEST, file_record
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"] = {name: file_record(checkpoint / name) for name in manifest["files"]}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-zero everywhere (adaLN-Zero initialises gates to zero, which would hide mapping errors)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)



@pytest.fixture
def tiny(tmp_path):
    """Overrides for a seconds-long run in a fresh run directory; extend with more key=value strings."""
    def make(*extra: str, run: str = "run") -> list[str]:
        return [*TINY, f"logging.output_dir={tmp_path / run}", *extra]
    return make


# sysfs: nobody may create a file or folder under it, root included (EPERM; EACCES inside /sys/kernel)
SYSFS_NEW = Path("/sys/mmdit-test")
needs_sysfs = pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="no sysfs at /sys (not Linux)")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(name, options) mounts a tmpfs at tmp_path / name: "ro" a read-only one, "size=4k" one that a 4 KiB file
    fills. Unmounted after the test. Root ignores permission bits, so only a mount makes a directory read-only or
    full for it; skipped where this process may not mount."""
    import subprocess
    mounted = []

    def mount(name: str, options: str) -> Path:
        directory = tmp_path / name
        directory.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs ({done.stderr.strip()}): needs root")
        mounted.append(directory)
        return directory
    yield mount
    for directory in reversed(mounted):
        subprocess.run(["umount", "--lazy", str(directory)], check=True)  # even while a file there is open


LATENT_DIMS = {"channels": 4, "tokens": 6, "joint": 24, "pooled": 16}


def write_latent_shards(directory: Path, sizes=((8, 8),), per_shard: int = 12, seed: int = 0,
                        empty_prompt: bool = True, flipped: bool = False, validation_prompts: int = 0) -> Path:
    """A small latent dataset as precompute_latents.py lays it out: one shard per latent size, random tensors
    (fp16 latents, as precompute writes them in half precision), captions in the header and the index; with
    `flipped`, mirrored latents too, and `validation_prompts` encoded prompts."""
    from safetensors.torch import save_file

    from data.latents import shard_record, write_index
    gen = torch.Generator().manual_seed(seed)
    d = LATENT_DIMS
    directory.mkdir(parents=True, exist_ok=True)
    shards, captions = [], []
    for i, (h, w) in enumerate(sizes):
        name = f"shard-{i:05d}-{h}x{w}.safetensors"
        tensors = {"latents": torch.randn(per_shard, d["channels"], h, w, generator=gen).half(),
                   "prompt_embeds": torch.randn(per_shard, d["tokens"], d["joint"], generator=gen),
                   "pooled_prompt_embeds": torch.randn(per_shard, d["pooled"], generator=gen)}
        if flipped:
            tensors["latents_flipped"] = tensors["latents"].flip(-1)
        captions.append([f"item {i}/{j}" for j in range(per_shard)])
        save_file(tensors, directory / name, metadata={"captions": json.dumps(captions[-1])})
        shards.append(shard_record(directory, name, per_shard, (h, w)))
    if empty_prompt:
        save_file({"prompt_embeds": torch.randn(1, d["tokens"], d["joint"], generator=gen),
                   "pooled_prompt_embeds": torch.randn(1, d["pooled"], generator=gen)},
                  directory / "empty_prompt.safetensors")
    if validation_prompts:
        save_file({"prompt_embeds": torch.randn(validation_prompts, d["tokens"], d["joint"], generator=gen),
                   "pooled_prompt_embeds": torch.randn(validation_prompts, d["pooled"], generator=gen)},
                  directory / "validation_prompts.safetensors",
                  metadata={"captions": json.dumps([f"prompt {i}" for i in range(validation_prompts)])})
    write_index(directory, shards, captions, {"channels": d["channels"], "text_tokens": d["tokens"],
                                              "text_dims": [d["joint"], d["pooled"]], "text_embeddings": True,
                                              "flipped": flipped})
    return directory


# A tiny run on latent shards: patch 2 over 8x8 latents is a 4x4 grid of image tokens.
LATENT_RUN = ["data.name=latents", "model.patch_size=2", "model.num_layers=2", "model.num_attention_heads=2",
              "model.attention_head_dim=8", "model.sample_size=8", "model.pos_embed_max_size=8",
              "training.train_batch_size=4", "optimizer.warmup_steps=1", "logging.log_every=1",
              "checkpoint.every=0"]


@pytest.fixture
def latent_run(tmp_path):
    """Overrides for a seconds-long run on a fresh latent dataset (made on first use)."""
    def make(*extra: str, run: str = "run", data: Path | None = None) -> list[str]:
        if data is None:
            data = tmp_path / "latents"
            if not data.exists():
                write_latent_shards(data)
        return [*LATENT_RUN, f"data.path={data}", f"logging.output_dir={tmp_path / run}", *extra]
    return make


def export_random_base(overrides: list[str], directory: Path, seed: int = 3, config: Path | None = None) -> Path:
    """A "released" checkpoint for the run `config` + `overrides` describe: the same architecture, random
    non-zero weights, as a diffusers SD3Transformer2DModel directory."""
    from configs.build import build_data, build_model
    from configs.schema import DEFAULT_CONFIG, load_config
    from models.diffusers_io import export_diffusers_transformer
    cfg = load_config(config or DEFAULT_CONFIG, [*overrides, "model.init_from=null"])
    transformer = build_model(cfg, build_data(cfg)[0]).transformer
    randomize(transformer, seed)
    return export_diffusers_transformer(transformer, directory)


LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8"]  # alpha != rank: the scale must survive export


@pytest.fixture
def lora_run(latent_run, tmp_path):
    """A LoRA fine-tune of a random "released" base on the latent test data."""
    base = export_random_base(latent_run(), tmp_path / "base")

    def make(*extra: str, run: str = "run") -> list[str]:
        return latent_run(*LORA, f"model.init_from={base}", *extra, run=run)
    return make


# ----------------------------------------------------------------------------------------------- SD3 pipeline

WORDS = "a red blue green circle square cat dog on the grass in snow photo of".split()
CLIP_TOKENS, T5_TOKENS = 8, 6


def word_tokenizer(max_length: int):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                eos_token="<eos>", model_max_length=max_length)


def clip(hidden: int, projection: bool = True):
    """A tiny CLIP text model: with its projection (SD3's CLIP-L and CLIP-G), or without (FLUX.1's CLIP-L)."""
    import transformers
    config = transformers.CLIPTextConfig(vocab_size=len(WORDS) + 3, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
                                         projection_dim=8, pad_token_id=0, eos_token_id=2)
    return (transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel)(config)


def t5(width: int = 24):
    import transformers
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(WORDS) + 3, d_model=width, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2))


@pytest.fixture(scope="session")
def sd3_dir(tmp_path_factory):
    """A tiny, random SD3 pipeline saved by diffusers' StableDiffusion3Pipeline (nothing is downloaded): a 4-channel
    VAE with one downsampling, CLIP-L (8 wide), CLIP-G (16 wide), T5 (24 wide): joint dim 24, pooled dim 8 + 8; a
    transformer of 2 joint blocks."""
    import diffusers
    root = tmp_path_factory.mktemp("sd3")
    torch.manual_seed(0)
    transformer = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4,
                                                  num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                                  joint_attention_dim=24, caption_projection_dim=16,
                                                  pooled_projection_dim=16, pos_embed_max_size=8)
    randomize(transformer, 5)
    diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer,
        vae=tiny_vae(shift_factor=0.0609, scaling_factor=1.5305), text_encoder=clip(8),
        tokenizer=word_tokenizer(CLIP_TOKENS), text_encoder_2=clip(16), tokenizer_2=word_tokenizer(CLIP_TOKENS),
        text_encoder_3=t5(), tokenizer_3=word_tokenizer(T5_TOKENS)).save_pretrained(root)
    return root


# FLUX.1's VAE constants (SD3's are 1.5305 / 0.0609)
FLUX_VAE = {"scaling_factor": 0.3611, "shift_factor": 0.1159}


def tiny_vae(latent_channels: int = 4, **constants):
    import diffusers
    return diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                                   up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16],
                                   layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4, **constants)


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    """A tiny, random FLUX.1-dev pipeline saved by diffusers' FluxPipeline (model_index.json and all; nothing is
    downloaded): a 4-channel VAE with FLUX's constants and one downsampling, CLIP-L (8 wide, pooled), T5 (24 wide,
    T5_TOKENS long), and a transformer of 1 double and 2 single blocks with a guidance embedding."""
    return build_flux_pipeline(tmp_path_factory.mktemp("flux"), "FluxPipeline")


@pytest.fixture(scope="session")
def kontext_dir(tmp_path_factory):
    """The same tiny FLUX.1 saved as a FluxKontextPipeline (Kontext is FLUX.1-dev's transformer)."""
    return build_flux_pipeline(tmp_path_factory.mktemp("flux-kontext"), "FluxKontextPipeline")


def build_flux_pipeline(root: Path, pipeline: str) -> Path:
    import diffusers
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(in_channels=16, num_layers=1, num_single_layers=2,
                                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=24,
                                                   pooled_projection_dim=8, guidance_embeds=True,
                                                   axes_dims_rope=[2, 2, 4])
    randomize(transformer, 5)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                          base_image_seq_len=256, max_image_seq_len=4096)
    getattr(diffusers, pipeline)(scheduler=scheduler, vae=tiny_vae(**FLUX_VAE), text_encoder=clip(8, projection=False),
                                 tokenizer=word_tokenizer(CLIP_TOKENS), text_encoder_2=t5(),
                                 tokenizer_2=word_tokenizer(T5_TOKENS), transformer=transformer).save_pretrained(root)
    return root


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    """A tiny, random QwenImagePipeline saved by diffusers (tests/pipelines.py: Qwen2.5-VL 32 wide, a 4-channel VAE
    with one downsampling, a transformer of 2 blocks)."""
    from tests.pipelines import build_qwen_image_pipeline
    return build_qwen_image_pipeline(tmp_path_factory.mktemp("qwen-image"))


@pytest.fixture(scope="session")
def flux2_dir(tmp_path_factory):
    """A tiny, random Flux2KleinPipeline saved by diffusers (tests/pipelines.py: Qwen3 28 layers 16 wide, a VAE of 4
    latent channels with one downsampling, 16 once patchified, a transformer of 1 double and 2 single blocks)."""
    from tests.pipelines import build_flux2_klein_pipeline
    return build_flux2_klein_pipeline(tmp_path_factory.mktemp("flux2-klein"))


@pytest.fixture(scope="session")
def qwen_edit_dir(tmp_path_factory):
    """A tiny, random QwenImageEditPlusPipeline (tests/pipelines.py: the QwenImagePipeline's parts, a processor
    without torchvision; an Edit-2511 transformer: zero_cond_t)."""
    from tests.pipelines import build_qwen_image_edit_plus_pipeline
    return build_qwen_image_edit_plus_pipeline(tmp_path_factory.mktemp("qwen-image-edit"), zero_cond_t=True)


FLUX2_TOKENS = 32  # the tiny FLUX.2 pipeline's text tokens (the released pipelines pad to 512)
QWEN_EDIT_TOKENS = 260  # the tiny Qwen-Image-Edit's: an instruction with one reference's 196 vision tokens


def precomputed(pipeline: Path, root: Path, *extra: str) -> Path:
    """Latents and fp32 embeddings of eight captioned images (three sizes, cropped to 16 px) by a tiny pipeline,
    with two validation prompts."""
    import precompute_latents
    images = image_folder(root / "images", [(16, 16), (20, 18), (16, 16), (24, 24)] * 2)
    (root / "prompts.txt").write_text("a red cat\na dog on the grass\n")
    assert precompute_latents.main(["--model", str(pipeline), "--images", str(images), "--out", str(root / "data"),
                                    "--resolution", "16", "--dtype", "fp32", "--validation-prompts",
                                    str(root / "prompts.txt"), *extra]) == 0
    return root / "data"


@pytest.fixture(scope="session")
def sd3_data(sd3_dir, tmp_path_factory):
    return precomputed(sd3_dir, tmp_path_factory.mktemp("sd3-data"), "--max-sequence-length", str(T5_TOKENS))


@pytest.fixture(scope="session")
def flux_data(flux_dir, tmp_path_factory):
    return precomputed(flux_dir, tmp_path_factory.mktemp("flux-data"))  # T5: dev's 512 tokens


@pytest.fixture(scope="session")
def qwen_data(qwen_dir, tmp_path_factory):
    return precomputed(qwen_dir, tmp_path_factory.mktemp("qwen-data"), "--max-sequence-length", "16")


@pytest.fixture(scope="session")
def flux2_data(flux2_dir, tmp_path_factory):
    return precomputed(flux2_dir, tmp_path_factory.mktemp("flux2-data"), "--max-sequence-length", str(FLUX2_TOKENS))


def edit_pairs(pipeline: Path, root: Path, resolution: int, *extra: str) -> Path:
    """Eight (reference, instruction, result) pairs encoded by a tiny edit pipeline: results of two sizes, each with a
    reference of another size (REFS/imgNN.png), instructions of the tokenizers' words."""
    import precompute_latents
    images = image_folder(root / "images", [(16, 16), (20, 18)] * 4)
    image_folder(root / "references", [(24, 16), (16, 20), (16, 16), (18, 24)] * 2, seed=1)
    for caption in (root / "references").glob("*.txt"):
        caption.unlink()
    assert precompute_latents.main(["--model", str(pipeline), "--images", str(images), "--references",
                                    str(root / "references"), "--out", str(root / "data"), "--resolution",
                                    str(resolution), "--dtype", "fp32", *extra]) == 0
    return root / "data"


@pytest.fixture(scope="session")
def kontext_pairs(kontext_dir, tmp_path_factory):
    return edit_pairs(kontext_dir, tmp_path_factory.mktemp("kontext-pairs"), 16)


@pytest.fixture(scope="session")
def qwen_edit_pairs(qwen_edit_dir, tmp_path_factory):
    """At 48 px: the pipeline's reference areas round to multiples of 32 pixels."""
    return edit_pairs(qwen_edit_dir, tmp_path_factory.mktemp("qwen-edit-pairs"), 48, "--max-sequence-length",
                      str(QWEN_EDIT_TOKENS))


@pytest.fixture(scope="session")
def flux2_pairs(flux2_dir, tmp_path_factory):
    return edit_pairs(flux2_dir, tmp_path_factory.mktemp("flux2-pairs"), 16, "--max-sequence-length",
                      str(FLUX2_TOKENS))


def image_folder(directory: Path, sizes, seed: int = 0) -> Path:
    """Random-coloured images of the given (width, height) with captions from the tokenizers' vocabulary."""
    from PIL import Image
    directory.mkdir()
    gen = torch.Generator().manual_seed(seed)
    for i, (w, h) in enumerate(sizes):
        pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(directory / f"img{i:02d}.png")
        words = [WORDS[j] for j in torch.randint(len(WORDS), (4 + i % 5,), generator=gen)]
        (directory / f"img{i:02d}.txt").write_text(" ".join(words))
    return directory


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, members: dict[str, bytes]) -> Path:
    """A webdataset tar shard of `members` (file name -> bytes), in their order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            add_member(tar, name, data)
    return path
