"""What every model family has, proven the same way for each (tests/families.py describes them; a new family is a
new entry there): its transformer equals diffusers' both ways, key for key, on configs the tests never saw; and
every plugin trains a tiny model of it (on the shapes data) like the run without the plugin: FSDP like DDP and
resumed bit for bit, compiled and checkpointed blocks (each kind of block one graph, no graph break) like eager ones,
the OOM splitter, CPU offload, float8 on its image-stream linears, a SIGKILL resumed bit for bit; and a LoRA run on
its pipeline's transformer with blocks swapped like the run without, bit for bit.

Each property runs at the smallest size that shows it: 2-3 blocks, 2 heads, 2-4 steps."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import export_mmdit
import sample_mmdit
from configs.build import build_model, build_tokenizer
from configs.schema import load_config
from data.shapes import ShapesDataset
from models.diffusers_io import export_diffusers_transformer
from models.families import FAMILIES, load_diffusers_transformer, read_config
from perf.activation_checkpointing import apply_activation_checkpointing
from perf.checkpoint import checkpoints
from tests.conftest import (TINY, assert_close, final_weights, metric_rows, randomize, sigint_at_first_step,
                            sigkill_after, spawn, train)
from tests.families import CASES, ours, with_references
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")

INTEROP = [(family, name) for family, case in CASES.items() for name in case.config_names()]
SIZES = ((8, 8, 5), (6, 10, 3), (12, 4, 9))  # square, wide and tall latents; several text lengths


@pytest.mark.parametrize("family,name", INTEROP)
def test_a_diffusers_folder_loads_with_diffusers_outputs(family, name, tmp_path):
    """A transformer folder that diffusers saved (sharded, with an index) loads key for key, and computes what
    diffusers' module computes as the family's pipeline drives it."""
    case = CASES[family]
    config = case.config(name)
    reference = getattr(diffusers, case.reference)(**config).eval()
    randomize(reference, 1)
    reference.save_pretrained(tmp_path / "transformer", max_shard_size="20KB")
    assert any(tmp_path.glob("transformer/*.index.json"))
    found, _ = read_config(tmp_path / "transformer")
    model = load_diffusers_transformer(tmp_path / "transformer").eval()
    assert found.name == family and model.state_dict().keys() == reference.state_dict().keys()
    for height, width, tokens in SIZES:
        x = case.inputs(config, height, width, tokens, seed=height)
        with torch.no_grad():
            torch.testing.assert_close(ours(model, x), case.theirs(reference, x), rtol=1e-5, atol=1e-5)


EDITS = [(family, name, references) for family, case in CASES.items() if case.edit
         for name in case.config_names() for references in case.edit.references]


@pytest.mark.parametrize("family,name,references", EDITS)
def test_an_edit_computes_what_diffusers_computes_as_the_edit_pipeline_drives_it(family, name, references):
    """With reference latents of other sizes than the target's (one, and two where the family's pipelines take
    several): the velocity of the target is diffusers' transformer's as the family's edit pipeline calls it (its
    sequence, positions, `img_shapes`, Edit-2511's zero_cond_t), and the references change it."""
    case = CASES[family]
    config = case.config(name)
    reference = getattr(diffusers, case.reference)(**config).eval()
    randomize(reference, 1)
    model = FAMILIES[family].transformer(FAMILIES[family].config(**config)).eval()
    model.load_state_dict(reference.state_dict())
    plain = case.inputs(config, 8, 8, 5, seed=7)
    x = with_references(plain, references, seed=8)
    with torch.no_grad():
        edited = ours(model, x)
        torch.testing.assert_close(edited, case.edit.theirs(reference, x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(edited, ours(model, plain), rtol=1e-5, atol=1e-5)  # beyond the comparison's tolerance


def test_flux_kontext_takes_one_reference():
    case = CASES["flux"]
    config = case.config("dev-like")
    model = FAMILIES["flux"].transformer(FAMILIES["flux"].config(**config))
    x = with_references(case.inputs(config, 8, 8, 5, seed=0), ((4, 4), (4, 4)), seed=1)
    with pytest.raises(ValueError, match="2 reference images: FLUX.1 Kontext takes one"):
        ours(model, x)


@pytest.mark.parametrize("family,name", INTEROP)
def test_an_export_loads_in_diffusers_with_the_same_outputs(family, name, tmp_path):
    case = CASES[family]
    config = case.config(name)
    family_record = FAMILIES[family]
    model = family_record.transformer(family_record.config(**{k: v for k, v in config.items()})).eval()
    randomize(model, 2)
    export_diffusers_transformer(model, tmp_path / "exported")
    loaded = getattr(diffusers, case.reference).from_pretrained(tmp_path / "exported").eval()
    x = case.inputs(config, 6, 10, 5, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(case.theirs(loaded, x), ours(model, x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- plugins


def run(family: str, *extra: str) -> list[str]:
    """A tiny shapes run of the family: 3 steps."""
    return [*TINY, *CASES[family].shapes, "optimizer.eps=1e-3", "training.max_steps=3", *extra]


def last_block(family: str) -> str:
    """The name of the last block of the family's tiny model (where an injected failure comes last)."""
    from configs.build import build_data, build_model
    from configs.schema import load_config
    cfg = load_config(overrides=run(family))
    with torch.device("meta"):
        model = build_model(cfg, *build_data(cfg))
    return next(name for name, module in model.named_modules() if module is model.transformer.blocks[-1])


@pytest.mark.parametrize("family", CASES)
def test_fsdp_trains_ddps_weights_and_resumes_bit_for_bit(family, tmp_path):
    """Two gloo ranks: FSDP's weights within 1e-5 of DDP's (fp32 summation order apart); its checkpoint of step 2
    resumed gives the same weights bit for bit. Eager, for time: compiled blocks under FSDP are
    tests/test_sharding.py's."""
    ddp = run(family, "training.train_batch_size=4", f"logging.output_dir={tmp_path / 'ddp'}")
    assert spawn(2, train, ddp, tmp_path=tmp_path) == [{"status": 0}] * 2
    fsdp = run(family, "training.train_batch_size=4", "parallel.strategy=fsdp", "checkpoint.every=2",
               "checkpoint.async_save=false", f"logging.output_dir={tmp_path / 'fsdp'}")
    assert spawn(2, train, fsdp, tmp_path=tmp_path) == [{"status": 0}] * 2
    whole = final_weights(tmp_path / "fsdp")
    assert_close(whole, final_weights(tmp_path / "ddp"), atol=1e-5)
    shutil.rmtree(checkpoints(tmp_path / "fsdp")[-1])  # resume from step 2
    assert spawn(2, train, fsdp, tmp_path=tmp_path) == [{"status": 0}] * 2
    assert_close(final_weights(tmp_path / "fsdp"), whole)


@pytest.mark.parametrize("family", CASES)
def test_compiled_and_checkpointed_blocks_train_like_eager_ones_in_one_graph_each(family, tmp_path):
    """Each kind of block compiles to one graph (compile.scope=blocks compiles them with fullgraph=True), with full
    activation checkpointing inside, and trains eager's weights (aot_eager: fp32 rounding of decomposed ops)."""
    assert main(run(family, f"logging.output_dir={tmp_path / 'eager'}")) == 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert main(run(family, "compile.enabled=true", "compile.backend=aot_eager",
                    "training.activation_checkpointing=full", f"logging.output_dir={tmp_path / 'compiled'}")) == 0
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == CASES[family].block_kinds
    assert_close(final_weights(tmp_path / "compiled"), final_weights(tmp_path / "eager"), atol=1e-5)


@pytest.mark.parametrize("family", CASES)
def test_the_oom_splitter_and_cpu_offload_keep_the_math(family, tmp_path):
    """An out-of-memory error injected in the last block halves the micro-batch and redoes the step; FSDP's CPU
    offload over one process trains the same model: both within fp32 summation order of the plain run."""
    assert main(run(family, f"logging.output_dir={tmp_path / 'plain'}")) == 0
    assert main(run(family, "batch_sizer.enabled=true", "batch_sizer.debug_oom_above=4",
                    f"batch_sizer.debug_oom_module={last_block(family)}", f"logging.output_dir={tmp_path / 'split'}")) == 0
    assert [r["micro_batch"] for r in metric_rows(tmp_path / "split") if "micro_batch" in r] == [4, 4, 4]
    assert main(run(family, "parallel.strategy=fsdp", "parallel.cpu_offload=true",
                    f"logging.output_dir={tmp_path / 'offload'}")) == 0
    plain = final_weights(tmp_path / "plain")
    assert_close(final_weights(tmp_path / "split"), plain, atol=2e-4, mean_atol=1e-7)
    assert_close(final_weights(tmp_path / "offload"), plain, atol=1e-5)


@pytest.mark.parametrize("family", CASES)
def test_a_run_killed_with_sigkill_resumes_bit_for_bit(family, tmp_path):
    straight = run(family, "training.max_steps=4", f"logging.output_dir={tmp_path / 'straight'}")
    assert main(straight) == 0
    killed = run(family, "training.max_steps=4", "checkpoint.every=2", f"logging.output_dir={tmp_path / 'killed'}")
    sigkill_after(killed, "step_00000002 complete", tmp_path / "killed.log")
    assert main(killed) == 0
    for part in ("model", "ema", "optimizer"):
        assert_close(final_weights(tmp_path / "killed", part), final_weights(tmp_path / "straight", part))


def checkpointing_model(mode: str, every: int, family: str = "sd3"):
    """A 3-block model of the family (every kind of block among them) with non-zero weights (adaLN-Zero left as
    initialised would make blocks identities)."""
    cfg = load_config(overrides=[*CASES[family].shapes, *CASES[family].three_blocks, "text_encoder.dim=32",
                                 "text_encoder.num_heads=2"])
    torch.manual_seed(0)
    model = build_model(cfg, ShapesDataset, build_tokenizer())
    for p in model.parameters():
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    apply_activation_checkpointing(model, mode, every)
    return model


class OpCount(TorchDispatchMode):
    """How many times the forward and backward ran matmuls and layer norms."""

    def __init__(self):
        super().__init__()
        self.matmuls = self.norms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        self.norms += func is torch.ops.aten.native_layer_norm.default
        return func(*args, **(kwargs or {}))


def gradients(model) -> dict:
    g = torch.Generator().manual_seed(1)
    x, sigma = torch.randn(4, 3, 32, 32, generator=g), torch.rand(4, generator=g)
    model(x, sigma, build_tokenizer()(["a red circle in the center"] * 4)).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def gradients_and_op_counts(model) -> tuple[dict, OpCount]:
    with OpCount() as count:
        return gradients(model), count


@pytest.mark.parametrize("family", CASES)
def test_activation_checkpointing_gives_the_same_gradients_and_recomputes_what_it_says(family):
    """In blocks 0 and 2 of 3 (every 2nd): the same gradients bitwise, and the recompute each mode promises,
    counted in the ops the step runs: selective runs the layer norms of those blocks again and no matmul; full runs
    both again (each block's forward once more: both layer norms and matmuls of a forward, so it recomputes
    matmuls)."""
    (grads, none), (selective_grads, selective), (full_grads, full) = (
        gradients_and_op_counts(checkpointing_model(mode, 2, family)) for mode in ("none", "selective", "full"))
    assert_close(selective_grads, grads)
    assert_close(full_grads, grads)
    assert selective.matmuls == none.matmuls and selective.norms > none.norms
    assert full.norms == selective.norms and full.matmuls > none.matmuls


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("family", CASES)
def test_checkpointed_blocks_compile_without_graph_breaks(family, mode):
    """Each kind of block compiles to one graph with its checkpointed region in it (fullgraph would raise on a
    break; dynamo's counters say none happened), forward and backward, and computes what the eager blocks do."""
    eager, compiled = checkpointing_model(mode, 1, family), checkpointing_model(mode, 1, family)
    torch._dynamo.reset()
    counters.clear()
    for block in compiled.transformer.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    grads, compiled_grads = gradients(eager), gradients(compiled)
    assert counters["stats"]["unique_graphs"] == CASES[family].block_kinds and not counters["graph_break"]
    assert_close(compiled_grads, grads, atol=1e-6)


@pytest.mark.parametrize("family", CASES)
def test_float8_converts_the_image_streams_linears(family):
    """Its image-token linears (attention, feed-forward; a FLUX single block's fused ones), not the text stream's
    (perf/float8.py: no gain at 512 tokens) nor the modulations (tests/test_float8.py trains float8 steps)."""
    pytest.importorskip("torchao")
    from configs.build import build_data, build_trained_model
    from configs.schema import load_config
    from perf.float8 import apply_float8
    cfg = load_config(overrides=run(family, "training.dtype=bf16", "float8.enabled=true", "float8.emulate=true"))
    model = build_trained_model(cfg, *build_data(cfg))
    apply_float8(model, cfg.float8, torch.device("cpu"), sharded=False)
    converted, kept = CASES[family].float8
    kinds = {}
    for block in model.transformer.blocks:
        for name, module in block.named_modules():
            kinds.setdefault(name, set()).add(type(module).__name__)
    assert all(kinds.get(name) == {"Float8Linear"} for name in converted), {n: kinds.get(n) for n in converted}
    assert all(kinds.get(name) == {"Linear"} for name in kept), {n: kinds.get(n) for n in kept}


# ----------------------------------------------------------------------------------------------- a pipeline's files


CAPTIONS = ["a red cat", "a dog on the grass in snow"]


def test_each_family_has_a_case():
    assert CASES.keys() == FAMILIES.keys()


@pytest.mark.parametrize("family", CASES)
def test_precompute_stores_what_the_pipeline_computes(family, request):
    """The latents (the family's VAE normalisation) and the text embeddings (the family's text path: padded, with
    a mask where it has one) of the family's pipeline for the same images and captions, and the encoding of ""."""
    from data.latents import LatentDataset
    from tests.test_precompute import load_image
    case = CASES[family].pipeline
    folder, data = request.getfixturevalue(case.folder), request.getfixturevalue(case.data)
    pipe = getattr(diffusers, FAMILIES[family].pipeline_class).from_pretrained(folder)
    dataset = LatentDataset(data)
    assert dataset.index["family"] == family and len(dataset) == 8
    images = data.parent / "images"
    by_caption = {dataset[i]["caption"]: dataset[i] for i in range(len(dataset))}
    captions = sorted(by_caption)
    with torch.no_grad():
        text, empty = case.encode(pipe, captions), case.encode(pipe, [""])
        pixels = torch.stack([load_image(images / f"img{i:02d}.png", (16, 16)) for i in range(8)])
        latents = case.latents(pipe, pixels)
    for i, caption in enumerate(captions):
        item = by_caption[caption]
        for name, values in text.items():
            length = values.shape[1] if name != "pooled_prompt_embeds" else None
            torch.testing.assert_close(item[name][:length], values[i].float(), rtol=0, atol=1e-5)
            if length is not None:  # padded beyond: zero, and masked
                assert not item[name][length:].any()
    for i in range(8):
        caption = (images / f"img{i:02d}.txt").read_text()
        torch.testing.assert_close(by_caption[caption]["latents"], latents[i], rtol=1e-5, atol=1e-5)
    for name, values in empty.items():
        length = values.shape[1] if name != "pooled_prompt_embeds" else None
        torch.testing.assert_close(dataset.empty_prompt[name][0, :length], values[0].float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", CASES)
def test_quantized_text_encoders_take_the_bytes_planned_and_encode_close_to_the_pipeline(family, request):
    """precompute's --text-encoder-quantization: each linear of the family's text encoders filled as int8 or nf4
    codes from its weight's rows; they hold the bytes `stored_bytes` plans for them on the meta device (which
    auto's choice rests on; in fp32 and, the rest cast, bf16), and their embeddings stay within 2% (int8) and 35% (nf4) of the unquantized ones,
    relative RMS (these tiny random encoders, 8 to 24 wide: 0.3-0.8% and 3-26%); masks are the same."""
    from models.quantized import QuantizedLinear, stored_bytes
    folder = request.getfixturevalue(CASES[family].pipeline.folder)
    record = FAMILIES[family]
    tokens = record.tokenizers(folder, 16)(["a red cat", "a dog on the grass in snow", ""])
    embeddings, errors = {}, {}
    for scheme, dtype in [("none", torch.float32), ("int8", torch.float32), ("nf4", torch.float32),
                          ("int8", torch.bfloat16)]:
        with torch.device("meta"):
            encoders = record.text_encoders(folder, 16)
        planned = stored_bytes(encoders, scheme, dtype)
        encoders.load(torch.device("cpu"), dtype, scheme)
        held = [*encoders.parameters(), *encoders.buffers()]
        assert sum(t.numel() * t.element_size() for t in held) == planned
        assert any(isinstance(m, QuantizedLinear) for m in encoders.modules()) == (scheme != "none")
        if dtype == torch.float32:
            with torch.no_grad():
                embeddings[scheme] = encoders(**tokens)
    for scheme in ("int8", "nf4"):
        for name, values in embeddings["none"].items():
            if name == "prompt_embeds_mask":
                assert torch.equal(embeddings[scheme][name], values)
            else:
                errors[scheme, name] = ((embeddings[scheme][name] - values).norm() / values.norm()).item()
    assert all(0 < error < (0.02 if scheme == "int8" else 0.5) for (scheme, _), error in errors.items()), errors


@pytest.mark.parametrize("family", CASES)
def test_fsdp_ranks_read_only_their_shards_of_the_pipelines_transformer(family, request, tmp_path):
    """The model is never whole on one rank: two FSDP ranks build it on the meta device and fill their shards from
    the pipeline's transformer folder, each reading about half of its bytes; gathered, the weights equal an eager
    load, bitwise."""
    from tests.test_big_models import shards_against_eager
    case = CASES[family].pipeline
    folder, data = request.getfixturevalue(case.folder), request.getfixturevalue(case.data)
    overrides = ["--config", f"configs/{case.config}", f"data.path={data}", f"model.init_from={folder / 'transformer'}",
                 "lora.enabled=false", "lora.base_quantization=none", "compile.enabled=false", "training.dtype=fp32",
                 "parallel.strategy=fsdp", f"logging.output_dir={tmp_path / 'run'}"]
    ranks = spawn(2, shards_against_eager, overrides, tmp_path=tmp_path)
    assert all(isinstance(r, dict) for r in ranks), ranks
    assert [r["different"] for r in ranks] == [[], []] and all(r["keys"] for r in ranks)
    file_bytes = sum(f.stat().st_size for f in (folder / "transformer").glob("*.safetensors"))
    assert all(0.3 * file_bytes < r["bytes_read"] < 0.7 * file_bytes for r in ranks), (file_bytes, ranks)


def pipeline_lora(case, folder: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """A LoRA run from the family's shipped config on its tiny pipeline's transformer, at the tests' size."""
    return ["--config", f"configs/{case.config}", f"data.path={data}", f"model.init_from={folder / 'transformer'}",
            "lora.rank=4", "lora.alpha=8", "lora.base_quantization=none", "training.dtype=fp32", "compile.enabled=false",
            "batch_sizer.enabled=false", "training.activation_checkpointing=none", "training.train_batch_size=4",
            "training.gradient_accumulation_steps=1", "optimizer.lr=5e-2", "optimizer.eps=1e-3",
            "optimizer.warmup_steps=1", "logging.log_every=1", "validation.every=0", "validation.at_end=false",
            "checkpoint.every=3", f"logging.output_dir={run_dir}", *extra]


@pytest.mark.parametrize("family", CASES)
def test_a_lora_run_stopped_twice_resumes_bit_for_bit_and_loads_into_the_pipeline(family, request, tmp_path,
                                                                                  caplog):
    """precompute -> a LoRA run from the family's shipped config on its pipeline's transformer, stopped by SIGINT
    at its first step and by SIGKILL after step 3's checkpoint, resumed each time: bit for bit the uninterrupted
    run -> export -> the family's pipeline loads the file (`load_lora_weights`), and its transformer then computes
    this project's adapted model's output (1e-5); its image changes. (sample_mmdit.py on such a run: below.)"""
    from sample_mmdit import load_trained
    case = CASES[family]
    folder, data = request.getfixturevalue(case.pipeline.folder), request.getfixturevalue(case.pipeline.data)
    assert main(pipeline_lora(case.pipeline, folder, data, tmp_path / "straight", "training.max_steps=6")) == 0
    interrupted = pipeline_lora(case.pipeline, folder, data, tmp_path / "interrupted", "training.max_steps=6")
    assert sigint_at_first_step(interrupted) == 130
    assert "pre-empted: checkpoint of step 1 written; exit 130" in caplog.text
    sigkill_after(interrupted, "step_00000003 complete", tmp_path / "killed.log")
    assert main(interrupted) == 0
    for part in ("model", "ema"):
        assert_close(final_weights(tmp_path / "interrupted", part), final_weights(tmp_path / "straight", part))

    out = tmp_path / "lora"
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "interrupted"), "--out", str(out)]) == 0
    pipe = getattr(diffusers, FAMILIES[family].pipeline_class).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    x = case.inputs(dict(pipe.transformer.config), 8, 8, 5, seed=3)
    image = lambda: pipe(prompt="a red cat", num_inference_steps=2, height=16, width=16, output_type="pt",  # noqa
                         generator=torch.Generator().manual_seed(0), **case.pipeline.generate).images
    with torch.no_grad():
        base, base_image = case.theirs(pipe.transformer, x), image()
        pipe.load_lora_weights(out)
        adapted, adapted_image = case.theirs(pipe.transformer, x), image()
        model = load_trained(checkpoints(tmp_path / "interrupted")[-1], True)[0].transformer
        assert (adapted - base).abs().max() > 1e-3  # the adapters act
        torch.testing.assert_close(adapted, ours(model, x), rtol=0, atol=1e-5)
    assert torch.isfinite(adapted_image).all() and not torch.equal(adapted_image, base_image)


@pytest.mark.parametrize("family", CASES)
def test_a_lora_run_with_blocks_swapped_trains_bit_for_bit_like_without(family, request, tmp_path):
    """offload.blocks_to_swap=2 on the family's pipeline transformer (SD3's and Qwen-Image's 2 blocks, FLUX's double
    block and last single block): their frozen weights are copied in before each use, forward and backward, and
    freed after, as planned, and the run trains the adapters and their EMA of the run without, bit for bit."""
    from perf import block_swap
    case = CASES[family].pipeline
    folder, data = request.getfixturevalue(case.folder), request.getfixturevalue(case.data)
    common = ["training.max_steps=2", "checkpoint.every=0"]
    assert main(pipeline_lora(case, folder, data, tmp_path / "plain", *common)) == 0
    assert main(pipeline_lora(case, folder, data, tmp_path / "swapped", *common, "offload.blocks_to_swap=2")) == 0
    swap = block_swap.active
    assert swap.loads == block_swap.planned_loads(swap.blocks, 2) * 2  # two steps of one micro-step
    for part in ("model", "ema"):
        assert_close(final_weights(tmp_path / "swapped", part), final_weights(tmp_path / "plain", part))


@pytest.mark.parametrize("family", CASES)
def test_a_lora_run_shows_grids_and_writes_the_lora_file_of_each_checkpoint(family, request, tmp_path):
    """A LoRA run from the family's shipped config on its pipeline's data, whose precompute stored validation prompts:
    sample grids at the planned steps and at the end (the family's sampler; the pipeline's VAE decodes them), and
    beside each complete checkpoint, pruned with it, the LoRA file the family's pipeline loads
    (`load_lora_weights(FILE)`), which then computes this project's model of that checkpoint (1e-5); where the family
    has a kohya / ComfyUI layout, that file too, with kohya's metadata."""
    from safetensors import safe_open
    from sample_mmdit import load_trained
    case, record = CASES[family], FAMILIES[family]
    folder, data = request.getfixturevalue(case.pipeline.folder), request.getfixturevalue(case.pipeline.data)
    run = tmp_path / "run"
    assert main(pipeline_lora(case.pipeline, folder, data, run, "training.max_steps=4", "checkpoint.every=1",
                              "validation.every=2", "validation.at_end=true", "sampling.steps=2")) == 0
    assert sorted(p.name for p in (run / "samples").glob("*.png")) == ["step_00000002.png", "step_00000004.png"]
    kept = [f"step_0000000{step}{kind}.safetensors" for step in (3, 4)
            for kind in ("", *(["_kohya"] if record.kohya else []))]
    assert sorted(p.name for p in (run / "loras").iterdir()) == kept  # checkpoint.keep_last=2
    pipe = getattr(diffusers, record.pipeline_class).from_pretrained(folder)
    pipe.load_lora_weights(run / "loras" / "step_00000004.safetensors")
    x = case.inputs(dict(pipe.transformer.config), 8, 8, 5, seed=5)
    model = load_trained(checkpoints(run)[-1])[0].transformer
    with torch.no_grad():
        torch.testing.assert_close(case.theirs(pipe.transformer, x), ours(model, x), rtol=0, atol=1e-5)
    if record.kohya:
        with safe_open(run / "loras" / "step_00000004_kohya.safetensors", "pt") as f:
            header = f.metadata()
        assert {k: header[k] for k in ("ss_base_model_version", "ss_network_module", "ss_network_dim", "ss_steps",
                                       "ss_epoch", "ss_num_train_images", "ss_resolution")} == {
            "ss_base_model_version": record.kohya_names[0], "ss_network_module": record.kohya_names[1],
            "ss_network_dim": "4", "ss_steps": "4", "ss_epoch": "2", "ss_num_train_images": "8",
            "ss_resolution": "(16, 16)"}


@pytest.mark.parametrize("family", CASES)
def test_sample_mmdit_samples_a_lora_run_from_its_stored_prompts_or_new_ones(family, request, tmp_path, monkeypatch):
    """sample_mmdit.py on a LoRA run of the family, from the pipeline its precompute recorded: the validation prompts
    stored with the data, and the same prompts given as new ones (encoded by the pipeline's text encoders), give the
    same images; --lora-scale 0 (the base model) others."""
    case = CASES[family].pipeline
    folder, data = request.getfixturevalue(case.folder), request.getfixturevalue(case.data)
    assert main(pipeline_lora(case, folder, data, tmp_path / "run", "training.max_steps=2", "checkpoint.every=0")) == 0
    (tmp_path / "prompts.txt").write_text((data.parent / "prompts.txt").read_text())  # precompute's
    written, save_pngs = {}, sample_mmdit.save_pngs
    monkeypatch.setattr(sample_mmdit, "save_pngs", lambda images, tmp: (written.setdefault(len(written), images),
                                                                        save_pngs(images, tmp)))
    sample = ["--checkpoint", str(tmp_path / "run"), "--steps", "2"]
    assert sample_mmdit.main([*sample, "--out", str(tmp_path / "stored")]) == 0
    assert sample_mmdit.main([*sample, "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "new")]) == 0
    assert sample_mmdit.main([*sample, "--lora-scale", "0", "--out", str(tmp_path / "base")]) == 0
    stored, new, base = written.values()
    assert len(stored) == 2 and len(list((tmp_path / "stored").glob("*.png"))) == 2
    torch.testing.assert_close(new, stored, rtol=0, atol=1e-5)
    assert (base - stored).abs().amax(dim=(1, 2, 3)).min() > 1e-4  # 10x what equal ones may differ by


@pytest.mark.parametrize("family", CASES)
def test_text_encoded_in_the_step_under_fsdp_trains_like_precomputed_text(family, request, tmp_path):
    """The pipeline's text encoders run in the step (data.text_encoding=on_the_fly), sharded layer by layer over 2
    FSDP ranks with the transformer: the weights of one process trained on the precomputed embeddings (fp32
    summation order apart)."""
    from tests.conftest import trains
    case = CASES[family].pipeline
    folder, data = request.getfixturevalue(case.folder), request.getfixturevalue(case.data)
    assert main(pipeline_lora(case, folder, data, tmp_path / "precomputed", "training.max_steps=2",
                              "checkpoint.every=0")) == 0
    on_the_fly = pipeline_lora(case, folder, data, tmp_path / "on_the_fly", "training.max_steps=2", "checkpoint.every=0",
                               "data.text_encoding=on_the_fly", "parallel.strategy=fsdp", "training.train_batch_size=2")
    trains(2, on_the_fly, tmp_path)
    assert_close(final_weights(tmp_path / "on_the_fly"), final_weights(tmp_path / "precomputed"), atol=1e-5)
    shares = spawn(2, text_encoder_share, on_the_fly, tmp_path=tmp_path)
    assert all(s["local"] <= s["total"] // 2 + 64 for s in shares) and \
        sum(s["local"] for s in shares) == shares[0]["total"], shares


def text_encoder_share(overrides: list[str]) -> dict:
    """Under FSDP: the elements of the text encoders this rank holds, and their total."""
    from configs.build import InitialValues, build_data, build_trained_model
    from configs.schema import load_config
    from perf.parallel import apply_parallelism
    from runtime.distributed import init_distributed, world_from_env
    from tests.conftest import config_and_overrides
    cfg = load_config(*config_and_overrides(overrides))
    world = world_from_env()
    device = init_distributed(world, torch.device("cpu"), 60)
    model = build_trained_model(cfg, *build_data(cfg))
    total = sum(p.numel() for p in model.text_encoder.parameters())
    model = apply_parallelism(model, cfg, world, device, InitialValues(model, 0, cfg.model.init_from))
    return {"local": sum(p.to_local().numel() for p in model.text_encoder.parameters()), "total": total}


@pytest.mark.parametrize("family", CASES)
def test_dora_and_rslora_on_an_nf4_base_with_validation_images_and_held_out_loss(family, request, tmp_path):
    """The fine-tuning features together on the family's pipeline: DoRA and rsLoRA adapters on its default targets,
    the frozen base in 4-bit NormalFloat, the held-out loss and validation images (its sampler and its
    pipeline's VAE decode them)."""
    case = CASES[family].pipeline
    folder, data = request.getfixturevalue(case.folder), request.getfixturevalue(case.data)
    assert main(pipeline_lora(case, folder, data, tmp_path / "run", "training.max_steps=2", "checkpoint.every=0",
                              "lora.use_dora=true", "lora.use_rslora=true", "lora.base_quantization=nf4",
                              "data.holdout=2", "validation.every=2", "validation.at_end=true", "validation.loss_sigmas=2",
                              "sampling.steps=2")) == 0
    weights = final_weights(tmp_path / "run")
    assert any(".lora_magnitude_vector." in name for name in weights) and all(".lora_" in name for name in weights)
    assert (tmp_path / "run" / "samples" / "step_00000002.png").is_file()
    assert [r["step"] for r in metric_rows(tmp_path / "run") if "val/loss" in r] == [2]


@pytest.mark.parametrize("kind", ["lokr", "loha"])
@pytest.mark.parametrize("family", CASES)
def test_lokr_and_loha_on_an_nf4_base_resume_bit_for_bit_and_export_what_comfyui_applies(family, kind, request,
                                                                                        tmp_path):
    """LoKr / LoHa adapters (lora.type; LoKr's second factor a rank-1 product) on the family's default targets of its
    pipeline's transformer, the base in 4-bit NormalFloat: the checkpoint of step 2 resumed gives the run's weights
    bit for bit; the file exported in ComfyUI's layout, applied to the pipeline's transformer as ComfyUI applies it
    (tests/test_lycoris.py), computes the trained adapters' output on that base (1e-5); where the family's diffusers
    pipeline loads the kind (FLUX.2: LoKr), its `load_lora_weights` of the default export does too."""
    from safetensors.torch import load_file

    from sample_mmdit import load_trained
    from tests.test_lycoris import apply_as_comfyui
    case, record = CASES[family], FAMILIES[family]
    folder, data = request.getfixturevalue(case.pipeline.folder), request.getfixturevalue(case.pipeline.data)
    run_dir = tmp_path / "run"
    overrides = pipeline_lora(case.pipeline, folder, data, run_dir, f"lora.type={kind}", "lora.base_quantization=nf4",
                              f"lora.rank={1 if kind == 'lokr' else 2}", "training.max_steps=3", "checkpoint.every=2")
    assert main(overrides) == 0
    trained = {part: final_weights(run_dir, part) for part in ("model", "ema")}
    assert all(f".{'hada' if kind == 'loha' else kind}_" in name for name in trained["model"])
    shutil.rmtree(checkpoints(run_dir)[-1])  # resume from step 2
    assert main(overrides) == 0
    for part in ("model", "ema"):
        assert_close(final_weights(run_dir, part), trained[part])

    assert export_mmdit.main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "comfy"), "--format", "kohya"]) == 0
    model = load_trained(checkpoints(run_dir)[-1], True)[0].transformer
    patched = load_diffusers_transformer(folder / "transformer").eval()
    x = case.inputs(dataclasses.asdict(patched.cfg), 8, 8, 5, seed=3)
    with torch.no_grad():
        base = ours(patched, x)
        comfy = load_file(tmp_path / "comfy" / "comfy.safetensors")
        apply_as_comfyui(patched.state_dict(), comfy, record.comfyui_names)
        adapted = ours(model, x)
        assert (adapted - base).abs().max() > 1e-4  # the adapters act (ten times the tolerance below)
        torch.testing.assert_close(ours(patched, x), adapted, rtol=0, atol=1e-5)
    if kind in record.diffusers_lycoris:
        assert export_mmdit.main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "peft")]) == 0
        pipe = getattr(diffusers, record.pipeline_class).from_pretrained(folder)
        pipe.load_lora_weights(tmp_path / "peft")
        with torch.no_grad():
            torch.testing.assert_close(case.theirs(pipe.transformer, x), adapted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", CASES)
def test_a_full_fine_tune_exports_a_folder_its_pipeline_loads(family, request, tmp_path):
    """A full fine-tune of the pipeline's transformer becomes a diffusers transformer folder of the family's class,
    which computes this project's trained model's output (1e-5)."""
    from sample_mmdit import load_trained
    case = CASES[family]
    folder, data = request.getfixturevalue(case.pipeline.folder), request.getfixturevalue(case.pipeline.data)
    assert main(pipeline_lora(case.pipeline, folder, data, tmp_path / "run", "lora.enabled=false",
                              "training.max_steps=1", "optimizer.lr=1e-3")) == 0
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    loaded = getattr(diffusers, case.reference).from_pretrained(tmp_path / "out").eval()
    model = load_trained(checkpoints(tmp_path / "run")[-1])[0].transformer
    x = case.inputs(dict(loaded.config), 8, 8, 5, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(case.theirs(loaded, x), ours(model, x), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- edits


EDIT_FAMILIES = [family for family, case in CASES.items() if case.edit]


def test_the_edit_families_are_the_records_and_the_cases():
    assert EDIT_FAMILIES == [name for name, family in FAMILIES.items() if family.edits]
    assert all(FAMILIES[f].edit_pipelines == CASES[f].edit.pipelines for f in EDIT_FAMILIES)


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_an_edit_run_compiled_checkpointed_and_sharded_trains_the_eager_runs_weights(family, tmp_path):
    """The edit shapes (data.name=shapes_edit: the reference's tokens after the target's) on two FSDP ranks, each
    kind of block compiled to one graph with full activation checkpointing, train one process's eager weights
    (fp32 summation order apart)."""
    edit = ("data.name=shapes_edit", "training.max_steps=2")
    assert main(run(family, *edit, f"logging.output_dir={tmp_path / 'eager'}")) == 0
    sharded = run(family, *edit, "training.train_batch_size=4", "parallel.strategy=fsdp", "compile.enabled=true",
                  "compile.backend=aot_eager", "training.activation_checkpointing=full",
                  f"logging.output_dir={tmp_path / 'sharded'}")
    assert spawn(2, train, sharded, tmp_path=tmp_path) == [{"status": 0}] * 2
    assert_close(final_weights(tmp_path / "sharded"), final_weights(tmp_path / "eager"), atol=1e-5)


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_precompute_of_pairs_stores_what_the_edit_pipeline_computes(family, request):
    """Each pair's reference latents (sized as the family's edit pipeline sizes a reference, at the dataset's
    resolution: other sizes than the results') and its instruction's embeddings (Qwen-Image-Edit's with the
    reference seen by Qwen2.5-VL) are what the edit pipeline computes."""
    from PIL import Image

    from data.latents import LatentDataset
    edit = CASES[family].edit
    folder, data = request.getfixturevalue(edit.folder), request.getfixturevalue(edit.data)
    pipe = edit.load(folder)
    dataset = LatentDataset(data, aspect_buckets=True)
    assert dataset.references == 1 and any(target != refs[0] for target, refs in dataset.buckets)
    by_caption = {dataset.caption(i): i for i in range(len(dataset))}
    root = data.parent
    with torch.no_grad():
        for image in sorted((root / "images").glob("*.png")):
            item = dataset[by_caption[image.with_suffix(".txt").read_text()]]
            reference = Image.open(root / "references" / image.name).convert("RGB")
            torch.testing.assert_close(item["references"][0], edit.reference(pipe, reference, dataset.index[
                "resolution"])[0], rtol=1e-5, atol=1e-5)
            for name, values in edit.encode(pipe, item["caption"], [reference]).items():
                length = values.shape[1] if name != "pooled_prompt_embeds" else None
                torch.testing.assert_close(item[name][:length], values[0].float(), rtol=0, atol=1e-5)
                if length is not None:  # padded beyond: zero, and masked
                    assert not item[name][length:].any()


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_an_edit_lora_killed_resumes_bit_for_bit_and_loads_into_the_edit_pipeline(family, request, tmp_path,
                                                                                  monkeypatch, caplog):
    """pairs -> a LoRA run from the family's shipped edit config, SIGKILLed after step 2's checkpoint and resumed:
    bit for bit the uninterrupted run -> export -> the family's edit pipeline loads the file, its transformer then
    computes this project's adapted model's edit (1e-5), and its edited image changes; the family's ComfyUI layout
    (--format kohya) loads into the edit pipeline with the same edit."""
    import importlib

    from PIL import Image

    from sample_mmdit import load_trained
    case, edit = CASES[family], CASES[family].edit
    folder, data = request.getfixturevalue(edit.folder), request.getfixturevalue(edit.data)
    steps = ("training.max_steps=4", "checkpoint.every=2", "data.holdout=0", "validation.every=0")
    assert main(pipeline_lora(edit, folder, data, tmp_path / "straight", *steps)) == 0
    killed = pipeline_lora(edit, folder, data, tmp_path / "killed", *steps)
    sigkill_after(killed, "step_00000002 complete", tmp_path / "killed.log")
    assert main(killed) == 0
    for part in ("model", "ema"):
        assert_close(final_weights(tmp_path / "killed", part), final_weights(tmp_path / "straight", part))
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "killed"), "--out", str(tmp_path / "lora")]) == 0
    (tmp_path / "edits.txt").write_text("make it red\n")  # sample_mmdit.py does not edit with a latent run: named
    sample = ["--checkpoint", str(tmp_path / "killed"), "--prompts", str(tmp_path / "edits.txt")]
    assert sample_mmdit.main([*sample, "--out", str(tmp_path / "edits")]) == 2
    assert sample_mmdit.main([*sample, "--references", str(tmp_path), "--out", str(tmp_path / "edits")]) == 2
    assert "is an edit run on latents" in caplog.text and "--references edits with a run of the edit shapes" in \
        caplog.text and not (tmp_path / "edits").exists()

    for module, constants in edit.areas.items():
        for name, value in constants.items():
            monkeypatch.setattr(importlib.import_module(module), name, value)
    pipe = edit.load(folder)
    pipe.set_progress_bar_config(disable=True)
    x = with_references(case.inputs(dict(pipe.transformer.config), 8, 8, 5, seed=3), ((6, 10),), seed=4)
    reference = Image.open(data.parent / "references" / "img00.png").convert("RGB").resize((64, 64))  # FLUX.2's least
    image = lambda: pipe(image=reference, prompt="make it red", num_inference_steps=2, height=16, width=16,  # noqa
                         output_type="pt", generator=torch.Generator().manual_seed(0), **edit.generate).images
    with torch.no_grad():
        base, base_image = edit.theirs(pipe.transformer, x), image()
        pipe.load_lora_weights(tmp_path / "lora")
        adapted, adapted_image = edit.theirs(pipe.transformer, x), image()
        model = load_trained(checkpoints(tmp_path / "killed")[-1], True)[0].transformer
        assert (adapted - base).abs().max() > 1e-3  # the adapters act
        torch.testing.assert_close(adapted, ours(model, x), rtol=0, atol=1e-5)
    assert torch.isfinite(adapted_image).all() and not torch.equal(adapted_image, base_image)
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "killed"), "--out", str(tmp_path / "comfy"),
                              "--format", "kohya"]) == 0
    comfy = edit.load(folder)
    edit.comfy(monkeypatch)
    comfy.load_lora_weights(tmp_path / "comfy" / "comfy.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(edit.theirs(comfy.transformer, x), adapted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_an_edit_lora_on_an_nf4_base_validates_by_editing_held_out_pairs(family, request, tmp_path):
    """The edit config's validation on an nf4 base: the held-out pairs' references edited by their instructions,
    each shown beside its reference, and their held-out loss."""
    edit = CASES[family].edit
    folder, data = request.getfixturevalue(edit.folder), request.getfixturevalue(edit.data)
    assert main(pipeline_lora(edit, folder, data, tmp_path / "run", "training.max_steps=2", "checkpoint.every=0",
                              "lora.base_quantization=nf4", "training.train_batch_size=2", "data.holdout=2",
                              "validation.every=2", "validation.at_end=true", "sampling.steps=2")) == 0
    captions = (tmp_path / "run" / "samples" / "step_00000002.txt").read_text().splitlines()
    assert captions[0] == "reference 1" and captions[1] not in ("", "reference 1") and len(captions) >= 2
    assert [r["step"] for r in metric_rows(tmp_path / "run") if "val/loss" in r] == [2]
