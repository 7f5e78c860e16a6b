"""DoRA (lora.use_dora) with rsLoRA (lora.use_rslora): the adapted model starts as its base (quantized or not) when
each rank fills its part of the meta-device model. Export into diffusers, resume after SIGKILL and FSDP are tested
together with the text encoders' adapters (tests/test_text_encoder_lora.py), whose runs use DoRA and rsLoRA too."""

import pytest
import torch

from configs.build import InitialValues, build_data, build_trained_model
from configs.schema import load_config
from perf.parallel import materialize
from tests.test_lora import inputs

pytest.importorskip("diffusers")
DORA = ["lora.use_dora=true", "lora.use_rslora=true"]


def started_model(overrides: list[str]):
    """The model as a training rank fills it: built on the meta device, then every tensor from InitialValues."""
    cfg = load_config(overrides=overrides)
    model = build_trained_model(cfg, *build_data(cfg))
    materialize(model, torch.device("cpu"), InitialValues(model, cfg.training.seed, cfg.model.init_from))
    with torch.no_grad():
        return model, model.transformer(*inputs())


@pytest.mark.parametrize("quantization", ["none", "nf4", "int8"])
def test_dora_starts_as_the_base(lora_run, quantization):
    """The magnitudes are the row norms of the weights the layers compute with (dequantized nf4 or int8 codes), so
    the DoRA model's output is the plain LoRA model's (B = 0: the base's), bit for bit."""
    base = [f"lora.base_quantization={quantization}"]
    model, dora = started_model(lora_run(*base, *DORA))
    plain = started_model(lora_run(*base))[1]
    magnitudes = [n for n, _ in model.named_parameters() if "lora_magnitude_vector" in n]
    assert len(magnitudes) == 8 + 7  # one per adapted projection (the last block has no to_add_out)
    assert torch.equal(dora, plain)
