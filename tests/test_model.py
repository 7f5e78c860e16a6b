import numpy as np
import pytest
import torch

from models.sd3.model import MMDiT, MMDiTConfig, sincos_2d_table


def small(**kw) -> MMDiTConfig:
    base = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8,
                num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16, pooled_projection_dim=10,
                pos_embed_max_size=16)
    return MMDiTConfig(**{**base, **kw})


def inputs(cfg: MMDiTConfig, h=16, w=16, batch=2, text_len=5):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, cfg.in_channels, h, w, generator=g),
            torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
            torch.randn(batch, cfg.pooled_projection_dim, generator=g), torch.rand(batch, generator=g) * 1000)


def randomize(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("kw,hw", [
    (dict(patch_size=1), (8, 8)),
    (dict(patch_size=2), (16, 16)),
    (dict(patch_size=4), (16, 16)),
    (dict(qk_norm="rms_norm"), (16, 16)),
    (dict(dual_attention_layers=[0, 1], qk_norm="rms_norm"), (16, 16)),
    (dict(), (12, 20)),  # non-square
])
def test_output_shape_and_gradients(kw, hw):
    cfg = small(**kw)
    model = MMDiT(cfg)
    randomize(model)
    out = model(*inputs(cfg, *hw))
    assert out.shape == (2, cfg.out_channels, *hw)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters()), "every parameter takes part in the forward"


def test_fresh_model_blocks_are_identity_and_output_is_zero():
    cfg = small(dual_attention_layers=[1], qk_norm="rms_norm")
    model = MMDiT(cfg)
    x, c, pooled, t = inputs(cfg)
    tokens = model.pos_embed(x)
    context = model.context_embedder(c)
    temb = model.time_text_embed(t, pooled)
    for i, block in enumerate(model.transformer_blocks):
        new_tokens, new_context = block(tokens, context, temb)
        assert torch.equal(new_tokens, tokens)
        if i < cfg.num_layers - 1:
            assert torch.equal(new_context, context)
        else:
            assert new_context is None  # the last block updates only the image stream
    assert torch.equal(model(x, c, pooled, t), torch.zeros_like(x))


def test_parameter_names_follow_diffusers_sd3():
    cfg = small(qk_norm="rms_norm", dual_attention_layers=[0])
    sd = MMDiT(cfg).state_dict()
    D, last = cfg.hidden_size, cfg.num_layers - 1
    expected_shapes = {
        "pos_embed.proj.weight": (D, cfg.in_channels, 2, 2),
        "pos_embed.pos_embed": (1, cfg.pos_embed_max_size**2, D),
        "time_text_embed.timestep_embedder.linear_1.weight": (D, 256),
        "time_text_embed.text_embedder.linear_1.weight": (D, cfg.pooled_projection_dim),
        "context_embedder.weight": (D, cfg.joint_attention_dim),
        "transformer_blocks.0.norm1.linear.weight": (9 * D, D),
        "transformer_blocks.0.attn2.to_q.weight": (D, D),
        "transformer_blocks.0.attn2.norm_q.weight": (cfg.attention_head_dim,),
        "transformer_blocks.1.norm1.linear.weight": (6 * D, D),
        "transformer_blocks.1.norm1_context.linear.weight": (6 * D, D),
        "transformer_blocks.1.attn.add_q_proj.bias": (D,),
        "transformer_blocks.1.attn.to_out.0.weight": (D, D),
        "transformer_blocks.1.attn.to_add_out.weight": (D, D),
        "transformer_blocks.1.attn.norm_added_k.weight": (cfg.attention_head_dim,),
        "transformer_blocks.1.ff.net.0.proj.weight": (4 * D, D),
        "transformer_blocks.1.ff.net.2.weight": (D, 4 * D),
        "transformer_blocks.1.ff_context.net.2.bias": (D,),
        f"transformer_blocks.{last}.norm1_context.linear.weight": (2 * D, D),
        "norm_out.linear.weight": (2 * D, D),
        "proj_out.weight": (4 * cfg.out_channels, D),
    }
    for key, shape in expected_shapes.items():
        assert tuple(sd[key].shape) == shape, key
    last_keys = [k for k in sd if k.startswith(f"transformer_blocks.{last}.")]
    assert not [k for k in last_keys if "to_add_out" in k or "ff_context" in k]
    assert not [k for k in sd if k.startswith("transformer_blocks.1.attn2")]


def reference_table(dim, max_size, base_size):
    """The diffusers formula, written independently with numpy: meshgrid(w, h), first half from grid[0]."""
    coords = np.arange(max_size, dtype=np.float64) / (max_size / base_size)
    grid = np.stack(np.meshgrid(coords, coords), axis=0).reshape(2, 1, max_size, max_size)

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([one_d(dim // 2, grid[0]), one_d(dim // 2, grid[1])], axis=1)


def test_position_table_matches_reference_and_is_centre_cropped():
    table = sincos_2d_table(16, 12, 4)
    np.testing.assert_allclose(table.numpy(), reference_table(16, 12, 4), atol=1e-6)
    model = MMDiT(small(pos_embed_max_size=12, sample_size=8))  # base size 8 // patch 2 = 4, as above
    crop = model.pos_embed.cropped_pos_embed(4, 6)[0].reshape(4, 6, 16)
    full = table.reshape(12, 12, 16)
    assert torch.equal(crop, full[4:8, 3:9])


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="caption_projection_dim"):
        MMDiT(small(caption_projection_dim=17))
    cfg = small()
    model = MMDiT(cfg)
    with pytest.raises(ValueError, match="patch_size"):
        model(*inputs(cfg, 15, 16))
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        model(*inputs(cfg, 64, 16))
