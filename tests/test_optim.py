import math

import torch

from configs.build import build_model, build_tokenizer
from configs.schema import load_config
from data.shapes import ShapesDataset
from optim.adamw import build_adamw, decay_groups
from optim.ema import EMA
from optim.schedule import warmup_cosine


def test_decay_groups_of_the_mmdit():
    cfg = load_config(overrides=["model.num_layers=2", "model.dual_attention_layers=[0]"])
    model = build_model(cfg, ShapesDataset, build_tokenizer())
    decay, no_decay = decay_groups(model)
    assert set(decay) | set(no_decay) == {n for n, _ in model.named_parameters()}
    assert not set(decay) & set(no_decay)
    for name in decay:  # only matmul / conv weights
        assert name.endswith("weight") and model.get_parameter(name).dim() >= 2, name
    expected_no_decay = ["transformer.pos_embed.proj.bias", "transformer.transformer_blocks.0.attn.norm_q.weight",
                         "transformer.transformer_blocks.0.attn2.norm_k.weight", "text_encoder.token_embedding.weight",
                         "text_encoder.position_embedding", "text_encoder.final_norm.weight",
                         "transformer.transformer_blocks.1.ff.net.2.bias"]
    assert set(expected_no_decay) <= set(no_decay)
    expected_decay = ["transformer.pos_embed.proj.weight", "transformer.transformer_blocks.0.attn.to_add_out.weight",
                      "transformer.proj_out.weight", "text_encoder.layers.0.linear1.weight",
                      "text_encoder.layers.0.self_attn.in_proj_weight"]
    assert set(expected_decay) <= set(decay)
    assert "transformer.pos_embed.pos_embed" not in decay + no_decay  # a fixed buffer, never trained


def test_warmup_cosine():
    lrs = [warmup_cosine(s, 1.0, 10, 110, 0.1) for s in range(120)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0 and math.isclose(lrs[60], 0.55)
    assert math.isclose(lrs[110], 0.1) and lrs[119] == lrs[110]
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_ema_follows_with_warm_start():
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, decay=0.9)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(num_updates=0)  # warm start: decay (1+0)/(10+0) = 0.1, mostly the new value
    torch.testing.assert_close(ema.shadow["weight"], 0.1 * start + 0.9)
    before = ema.shadow["weight"].clone()
    ema.update(num_updates=1000)  # capped at the configured 0.9
    torch.testing.assert_close(ema.shadow["weight"], 0.9 * before + 0.1)


def test_ema_update_with_a_device_flag_never_reads_it_on_the_host():
    """The flag of the non-finite guard stays on the device: on meta tensors, which cannot be read, the update
    runs (the one-weight foreach overload reads its weight with .item(), a sync found by make selfcheck on an
    H100); and on real tensors a skipped step (flag 0) leaves the average where it was."""
    meta = torch.nn.Linear(3, 2, device="meta")
    EMA(meta, 0.9).update(num_updates=5, applied=torch.ones((), device="meta"))
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, decay=0.9)
    before = ema.shadow["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(num_updates=1000, applied=torch.zeros(()))
    assert torch.equal(ema.shadow["weight"], before)
    ema.update(num_updates=1000, applied=torch.ones(()))
    torch.testing.assert_close(ema.shadow["weight"], 0.9 * before + 0.1 * model.weight.detach())


def test_fused_adamw_trains_like_foreach():
    """Same update rule, one kernel: equal within fp32 rounding."""
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        opt = build_adamw(model, 1e-2, (0.9, 0.99), 1e-8, 0.1, torch.device("cpu"), fused=fused)
        assert opt.defaults["fused"] is (True if fused else None) and opt.defaults["foreach"] is (None if fused else True)
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(32, 8, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
