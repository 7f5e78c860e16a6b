"""LoRA on SD3's CLIP text encoders (lora.text_encoders, with data.text_encoding=on_the_fly), here with DoRA and rsLoRA
on all adapters: the export loads into diffusers' SD3 pipeline with equal prompt embeddings and transformer output, the
text encoders' adapters train at their own learning rate, a run on a quantized base killed with SIGKILL resumes bit
for bit and trains on two FSDP ranks like on one process, and a dataset of precomputed embeddings is refused."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import export_mmdit
from configs.build import build_data
from models.diffusers_io import LORA_METADATA_KEY, LORA_WEIGHTS
from perf.checkpoint import checkpoints
from sample_mmdit import load_trained
from tests.conftest import (LATENT_RUN, T5_TOKENS, assert_close, export_random_base, final_weights,
                            sigkill_after, trains)
from tests.test_precompute import pipeline
from train_mmdit_stable import main

diffusers = pytest.importorskip("diffusers")
ADAPTED = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.use_dora=true", "lora.use_rslora=true",
           "lora.text_encoders=[clip_l,clip_g]"]


@pytest.fixture
def run(sd3_data, tmp_path):
    """A LoRA run over a random "released" transformer, encoding the captions in the step."""
    base = export_random_base([*LATENT_RUN, f"data.path={sd3_data}"], tmp_path / "base")

    def make(*extra: str, name: str = "run") -> list[str]:
        return [*LATENT_RUN, f"data.path={sd3_data}", "data.text_encoding=on_the_fly", f"model.init_from={base}",
                *ADAPTED, "training.max_steps=3", "optimizer.lr=5e-2", "optimizer.eps=1e-3",
                f"logging.output_dir={tmp_path / name}", *extra]
    return make


def test_export_loads_into_the_sd3_pipeline_with_equal_embeddings_and_output(run, sd3_dir, tmp_path):
    assert main(run("lora.text_encoder_lr=2e-2")) == 0
    state = {"optimizer": {"param_groups": [{"lr": None, "lr_scale": None} for _ in range(6)]}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoints(tmp_path / "run")[-1]), no_dist=True)
    groups = state["optimizer"]["param_groups"]
    assert [g["lr_scale"] for g in groups] == pytest.approx([1, 1, 0.4, 0.4, 0.4, 0.4])  # CLIP-L, CLIP-G adapters
    assert [g["lr"] for g in groups[2:]] == pytest.approx([0.4 * groups[0]["lr"]] * 4)
    out = tmp_path / "lora"
    assert export_mmdit.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0
    with safe_open(out / LORA_WEIGHTS, "pt") as f:
        keys, header = list(f.keys()), json.loads(f.metadata()[LORA_METADATA_KEY])
    for prefix, adapted in (("transformer.", 8 + 7), ("text_encoder.", 2 * 4), ("text_encoder_2.", 2 * 4)):
        assert sum(k.startswith(prefix) and k.endswith(".lora_magnitude_vector.weight") for k in keys) == adapted
        # rsLoRA's scale alpha / sqrt(rank) = 4 folded into lora_B: the header says alpha = rank, no rsLoRA
        assert header[f"{prefix}lora_alpha"] == 4 and header[f"{prefix}use_dora"] and not header[f"{prefix}use_rslora"]
    model, cfg = load_trained(checkpoints(tmp_path / "run")[-1])
    captions = ["a red cat", "a dog on the grass in snow"]
    pipe = pipeline(sd3_dir, diffusers.SD3Transformer2DModel.from_pretrained(cfg.model.init_from))
    encode = lambda: pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False,
                                        max_sequence_length=T5_TOKENS)
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([250.0, 900.0])
    with torch.no_grad():
        base, _, base_pooled, _ = encode()
        pipe.load_lora_weights(out)
        embeds, _, pooled, _ = encode()
        theirs = pipe.transformer(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
                                  timestep=t, return_dict=False)[0]
        ours = model.text_encoder(**build_data(cfg)[1](captions))
        our_embeds, our_pooled = ours["prompt_embeds"], ours["pooled_prompt_embeds"]
        ours = model.transformer(x, our_embeds, our_pooled, t)
    assert (embeds - base).abs().max() > 1e-3 and (pooled - base_pooled).abs().max() > 1e-3  # the adapters act
    assert_close({"embeds": embeds, "pooled": pooled}, {"embeds": our_embeds, "pooled": our_pooled}, atol=1e-5)
    assert_close(theirs, ours, atol=1e-5)


def test_killed_with_sigkill_resumes_bit_for_bit_and_fsdp_trains_alike(run, tmp_path):
    """On an nf4 base. Adapter dropout, off here (two ranks draw other masks than one process), replays after a
    resume as for the MMDiT's adapters (tests/test_lora.py): the text encoders' adapters draw from the same RNG."""
    common = ["training.max_steps=4", "checkpoint.every=2", "logging.log_every=2", "lora.base_quantization=nf4"]
    killed = run(*common, name="killed")
    sigkill_after(killed, "step_00000002 complete", tmp_path / "killed.log")
    assert checkpoints(tmp_path / "killed")
    assert main(killed) == 0
    assert main(run(*common, name="straight")) == 0
    for part in ("model", "ema"):
        assert_close(final_weights(tmp_path / "killed", part), final_weights(tmp_path / "straight", part))
    # the same global batch of 4 over two FSDP ranks
    trains(2, run(*common, "parallel.strategy=fsdp", "training.train_batch_size=2", name="fsdp"), tmp_path)
    one = final_weights(tmp_path / "straight")
    assert any(k.startswith("text_encoder.clip_g.") and "lora_magnitude_vector" in k for k in one)
    assert_close(final_weights(tmp_path / "fsdp"), one, atol=2e-4, mean_atol=1e-6)


def test_mistakes_are_named_before_compute(run, tmp_path, caplog):
    assert main(run("data.text_encoding=precomputed")) == 2
    assert "lora.text_encoders=['clip_l', 'clip_g'] needs data.text_encoding=on_the_fly" in caplog.text
    assert main(run("lora.text_encoders=[t5]")) == 2
    assert "lora.text_encoders must be distinct names of ['clip_l', 'clip_g']" in caplog.text
    assert not (tmp_path / "run").exists()


def test_a_resume_may_change_the_text_encoders_lr_only(run):
    from configs.run_dir import identity_changes
    from configs.schema import load_config
    config = lambda *extra: load_config(overrides=run(*extra))
    assert identity_changes(config(), config("lora.text_encoder_lr=1e-5")) == []
    assert identity_changes(config(), config("lora.text_encoders=[clip_l]")) == \
        ["lora.text_encoders: ['clip_l', 'clip_g'] -> ['clip_l']"]
