import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from configs.schema import DEFAULT_CONFIG, load_config
from errors import ConfigError
from train_mmdit_stable import main


def test_defaults_load_and_keep_the_design_keys():
    cfg = load_config()
    for key in ["training.train_batch_size", "training.gradient_accumulation_steps", "training.dtype",
                "compile.enabled", "profiler.enabled", "profiler.active_steps", "optimizer.lr",
                "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay",
                "optimizer.grad_clip_norm", "checkpoint.every", "loss.loss_scale", "training.max_steps",
                "training.seed", "logging.output_dir"]:
        assert OmegaConf.select(cfg, key, default="missing") != "missing", key


def test_overrides_apply():
    cfg = load_config(DEFAULT_CONFIG, ["training.max_steps=50", "optimizer.lr=3e-4"])
    assert cfg.training.max_steps == 50 and cfg.optimizer.lr == 3e-4



@pytest.mark.parametrize("overrides,batch", [([], 16), (["data.name=shapes_edit"], 8),
                                             (["data.name=shapes_edit", "training.train_batch_size=16"], 16),
                                             (["data.name=latents", "data.path=x"], 16)])
def test_an_unset_micro_batch_is_the_demos_and_a_given_one_is_kept(overrides, batch):
    """The edit demo's pairs are twice the tokens: half the micro-batch of the text-to-image demo, unless set."""
    assert load_config(DEFAULT_CONFIG, overrides).training.train_batch_size == batch

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
    ("flow.mode_scale=2", "flow.mode_scale"),
    ("data.holdout=-1", "data.holdout"),
    ("flow.sigma_sampling=beta", "flow.sigma_sampling"),
    ("parallel.shard_size=2", "parallel.shard_size must be 0 with strategy=ddp"),
    ("parallel.cpu_offload=true", "parallel.cpu_offload"),
    ("data.text_encoding=on_the_fly", "data.text_encoding=on_the_fly runs the pipeline's text encoders"),
    ("lora.base_quantization=nf4", "lora.enabled=true"),
    ("logging.wandb.mode=x", "logging.wandb.mode"),
    ("checkpoint.every=-1", "checkpoint.every"),
    ("data.datasets=[{path: a}, {path: b, wieght: 2}]", "invalid config key 'data.datasets[1].wieght'"),
    ("data.datasets=[{path: a}, {path: b, weight: abc}]", "invalid config key 'data.datasets[1].weight'"),
    ("data.datasets.1.weight=2", "data.datasets={'1': {'weight': 2}} is not a list: a section is set key by key"),
    ("model.dual_attention_layers=[1", "model.dual_attention_layers=[1: the value is not valid YAML"),
    ("model.dual_attention_layers.0=3", "invalid config: Cannot merge incompatible container types: a section is"),
    ("model=1", "invalid config: Merge error: int is not a subclass of ModelConfig"),
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


@pytest.mark.parametrize("text,message", [
    ("model:\n  patch_size: [2\n", "not valid YAML: line 3, column 1: did not find expected ',' or ']' "
                                   "(while parsing a flow sequence at line 2, column 15)"),
    ("training:\n  seed: 1\nmodel:\n\tpatch_size: 2\n", "not valid YAML: line 4, column 1: found character that "
                                                      "cannot start any token: a tab (YAML indents with spaces)"),
    ("training:\n  seed: 1\n\tmax_steps: 2\n", "not valid YAML: line 3, column 1: found a tab character that "
                                              "violates indentation (while scanning a plain scalar at line 2, column 9)"),
    ("training:\n  seed: 1\n  seed: 2\n", "not valid YAML: line 3, column 3: found duplicate key seed"),
    ("- a\n- b\n", "must hold a mapping"),
    ("training:\n  seed: caf\xe9\n".encode("latin-1"), "cannot be read: 'utf-8' codec can't decode byte 0xe9"),
])
def test_broken_config_files_name_the_file_line_column_and_cause(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config file {path} ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_key_inside_a_list_item_is_named_with_its_index(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text("data:\n  name: latents\n  datasets:\n    - path: a\n    - path: b\n      wieght: 2\n")
    with pytest.raises(ConfigError, match=r"invalid config key 'data\.datasets\[1\]\.wieght': Key 'wieght' not in "
                                          r"'DatasetEntry'\. Did you mean: 'weight'\?$"):
        load_config(path)
    path.write_text("data:\n  name: latents\n  datasets:\n    - path: a\n    - path: b\n")
    with pytest.raises(ConfigError, match=rf"^data\.datasets\.1\.weight=2 does not fit the structure of {path} "):
        load_config(path, ["data.datasets.1.weight=2"])


def test_hidden_size_must_split_four_ways():
    with pytest.raises(ConfigError, match="model.num_attention_heads"):
        load_config(DEFAULT_CONFIG, ["model.num_attention_heads=3", "model.attention_head_dim=30"])


def test_paths_mean_the_working_directory_and_are_saved_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEFAULT_CONFIG, ["logging.output_dir=runs/a", "data.path=data", "validation.vae_from=~/vae"])
    assert cfg.logging.output_dir == str(tmp_path / "runs" / "a") and cfg.data.path == str(tmp_path / "data")
    assert cfg.validation.vae_from == str(Path("~/vae").expanduser())
    assert load_config(DEFAULT_CONFIG, ["logging.output_dir=runs/a"], resolve=False).logging.output_dir == "runs/a"


def test_the_architecture_comes_from_init_from_and_a_contradiction_names_the_key(tmp_path, monkeypatch):
    from configs.build import build_model, build_tokenizer
    from data.shapes import ShapesDataset
    from models.diffusers_io import export_diffusers_transformer
    released = load_config(DEFAULT_CONFIG, ["model.num_layers=3", "model.patch_size=2", "model.qk_norm=null",
                                            "model.dual_attention_layers=[1]"])
    export_diffusers_transformer(build_model(released, ShapesDataset, build_tokenizer()).transformer,
                                 tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "finetune.yaml").write_text("training:\n  max_steps: 10\n")  # no model sizes of its own
    cfg = load_config("finetune.yaml", ["model.init_from=base"])
    assert (cfg.model.num_layers, cfg.model.patch_size, cfg.model.qk_norm) == (3, 2, None)
    assert list(cfg.model.dual_attention_layers) == [1] and cfg.model.init_from == str(tmp_path / "base")
    with pytest.raises(ConfigError, match=r"model\.num_layers=4 contradicts .*base/config\.json \(num_layers: 3\)"):
        load_config("finetune.yaml", ["model.init_from=base", "model.num_layers=4"])
    assert load_config("finetune.yaml", ["model.init_from=base", "model.num_layers=3"]).model.num_layers == 3
    with pytest.raises(ConfigError, match=r"model\.patch_size=4 contradicts .* set model\.patch_size=2 or leave it "
                                          r"unset \(configs/sd3_\*\.yaml set no sizes\)"):  # shapes.yaml sets them
        load_config(DEFAULT_CONFIG, ["model.init_from=base"])
    assert load_config(DEFAULT_CONFIG, ["model.init_from=base", "model.patch_size=2", "model.qk_norm=null"])
    with pytest.raises(ConfigError, match=r"set model\.dual_attention_layers=\[1\] or leave"):  # a list, as typed
        load_config("finetune.yaml", ["model.init_from=base", "model.dual_attention_layers=[0,1]"])
    with pytest.raises(ConfigError, match=r"model\.init_from=.*nowhere.*does not exist"):
        load_config("finetune.yaml", ["model.init_from=nowhere"])
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({**config, "caption_projection_dim": 96}))
    with pytest.raises(ConfigError, match=r"broken/config\.json is inconsistent: caption_projection_dim=96 must "
                                          r"equal num_attention_heads\*attention_head_dim=128"):
        load_config("finetune.yaml", ["model.init_from=broken"])  # the folder is named, not the data


def test_keys_left_to_the_user_and_renamed_keys_are_named(tmp_path):
    config = tmp_path / "finetune.yaml"
    config.write_text("data:\n  name: latents\n  path: ???\n")
    with pytest.raises(ConfigError, match=r"leaves \['data.path'\] to you"):
        load_config(config)
    with pytest.raises(ConfigError, match="sampling.every is now validation.every"):
        load_config(DEFAULT_CONFIG, ["sampling.every=5"])
    config.write_text("logging:\n  save_freq: 5\ntraining:\n  compile_model: true\n")
    with pytest.raises(ConfigError, match=r"logging\.save_freq is now checkpoint\.every; training\.compile_model is "
                                          r"now compile\.enabled: rename them in .*finetune\.yaml"):
        load_config(config)
    with pytest.raises(ConfigError, match="training.attention_backend=flash is now training.attention_backend="
                                          "flash_attn_2"):
        load_config(DEFAULT_CONFIG, ["training.attention_backend=flash"])
    config.write_text("training:\n  attention_backend: flash\n")  # a run directory's saved config resumes
    assert load_config(config, resolve=False).training.attention_backend == "flash_attn_2"


def test_hsdp_shard_size_must_divide_the_world():
    from perf.parallel import check_parallel
    from runtime.distributed import World
    cfg = load_config(DEFAULT_CONFIG, ["parallel.strategy=hsdp", "parallel.shard_size=3"])
    with pytest.raises(ValueError, match="parallel.shard_size=3 must divide the world size 4"):
        check_parallel(cfg, World(0, 4, 0))
    check_parallel(cfg, World(0, 6, 0))
