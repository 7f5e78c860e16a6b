import pytest
from omegaconf import OmegaConf

from configs.schema import DEFAULT_CONFIG, ConfigError, load_config
from train_mmdit_stable import main


def test_defaults_load_and_keep_the_design_keys():
    cfg = load_config()
    for key in ["training.train_batch_size", "training.gradient_accumulation_steps", "training.dtype",
                "training.compile_model", "training.enable_profiling", "training.profile_steps", "optimizer.lr",
                "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay",
                "optimizer.grad_clip_norm", "logging.save_freq", "loss.loss_scale", "training.max_steps",
                "training.seed", "logging.output_dir"]:
        assert OmegaConf.select(cfg, key, default="missing") != "missing", key


def test_overrides_apply():
    cfg = load_config(DEFAULT_CONFIG, ["training.max_steps=50", "optimizer.lr=3e-4"])
    assert cfg.training.max_steps == 50 and cfg.optimizer.lr == 3e-4


@pytest.mark.parametrize("override,message", [
    ("training.max_stepz=5", "training.max_stepz"),
    ("nonsense.key=1", "nonsense"),
    ("training.max_steps=abc", "training.max_steps"),
    ("training.dtype=fp8", "training.dtype"),
    ("training.max_steps=0", "training.max_steps"),
    ("optimizer.lr=-1", "optimizer.lr"),
    ("optimizer.beta2=1.5", "optimizer.beta2"),
    ("data.caption_dropout=1", "data.caption_dropout"),
    ("model.dual_attention_layers=[9]", "model.dual_attention_layers"),
    ("text_encoder.dim=30", "text_encoder.dim"),
    ("training.max_steps", "key=value"),
    ("sampling.grid_size=-1", "sampling.grid_size"),
    ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio"),
    ("model.sample_size=2", "model.sample_size"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_config(DEFAULT_CONFIG, [override])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("override,message", [("model.patch_size=3", "model.patch_size"),
                                              ("model.pos_embed_max_size=4", "model.pos_embed_max_size"),
                                              ("training.max_steps=-3", "training.max_steps")])
def test_training_refuses_bad_config_before_any_compute(tmp_path, caplog, override, message):
    run_dir = tmp_path / "run"
    assert main([override, f"logging.output_dir={run_dir}"]) == 2
    assert message in caplog.text
    assert not run_dir.exists()  # nothing was written


@pytest.mark.parametrize("text,message", [("model: [unclosed", "not valid YAML"), ("- a\n- b\n", "mapping")])
def test_broken_config_files_name_the_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "bad.yaml" in str(info.value)


def test_hidden_size_must_split_four_ways():
    with pytest.raises(ConfigError, match="model.num_attention_heads"):
        load_config(DEFAULT_CONFIG, ["model.num_attention_heads=3", "model.attention_head_dim=30"])
