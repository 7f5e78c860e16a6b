"""What the LoRA variants cost against plain LoRA on the same MMDiT, with SD3-style CLIP-L and CLIP-G text encoders
run in the step (data.text_encoding=on_the_fly): DoRA (lora.use_dora), rsLoRA (lora.use_rslora) and LoRA on both
CLIPs (lora.text_encoders). Per mode: median time of one step (forward + backward + AdamW), trained parameters, the
training state (gradients, AdamW moments, EMA) and the activations autograd keeps for the backward.

    python benchmarks/lora_variants.py [--layers 4 --heads 4 --latent 16 --batch 4 --rank 16 --steps 6 --rounds 2
                                        --out benchmarks/lora_variants_cpu.json]

The MMDiT is SD3-shaped (16 latent channels, patch 2, head dim 64); the text encoders are CLIP-L and CLIP-G at 1/3
of their width and depth (256 wide x 4 layers, 384 wide x 6 layers, 77 tokens), random, without T5. Modes are timed
in alternating rounds in one process (median per mode), so machine noise hits all alike. Memory is counted, not
sampled: activations are the bytes of the distinct tensors autograd saves in one forward (frozen weights, which
exist anyway, left out).
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.finetune import Mode as FinetuneMode  # noqa: E402
from models.families import SD3_LORA_TARGETS  # noqa: E402
from models.lora import apply_lora  # noqa: E402
from models.sd3.model import MMDiT, MMDiTConfig  # noqa: E402
from models.rectified_flow import per_sample_loss  # noqa: E402
from models.sd3.text import SD3TextEncoders  # noqa: E402
from models.text_encoder import TextToImage  # noqa: E402

CLIP_TOKENS, VOCAB = 77, 1000
MODES = {"lora": {}, "dora": {"use_dora": True}, "rslora": {"use_rslora": True},
         "lora + CLIP-L/G lora": {"text_encoders": ["clip_l", "clip_g"]}}


def pipeline_folder(root: Path) -> Path:
    """Configs of the two CLIPs (no weights: they are built with random values), and of a transformer whose
    joint width the text tokens are padded to."""
    import transformers
    for folder, width, layers in (("text_encoder", 256, 4), ("text_encoder_2", 384, 6)):
        transformers.CLIPTextConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width, bos_token_id=0,
                                    eos_token_id=2, pad_token_id=1,
                                    num_hidden_layers=layers, num_attention_heads=width // 64,
                                    max_position_embeddings=CLIP_TOKENS,
                                    projection_dim=width).save_pretrained(root / folder)
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps({"joint_attention_dim": 640}))
    return root


def build(args, folder: Path, mode: dict) -> TextToImage:
    torch.manual_seed(0)
    encoders = SD3TextEncoders(folder, max_sequence_length=0)
    cfg = MMDiTConfig(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=args.layers,
                      attention_head_dim=64, num_attention_heads=args.heads, joint_attention_dim=encoders.joint_dim,
                      caption_projection_dim=64 * args.heads, pooled_projection_dim=encoders.pooled_dim,
                      pos_embed_max_size=64)
    model = TextToImage(MMDiT(cfg), encoders)
    for p in model.transformer.parameters():  # released-like weights: non-zero gates, so adapters get gradients
        p.data.normal_(0, 0.02)
    lora = SimpleNamespace(**{"enabled": True, "rank": args.rank, "alpha": args.rank, "dropout": 0.0,
                              "target_modules": list(SD3_LORA_TARGETS), "use_dora": False, "use_rslora": False,
                              "text_encoders": [], **mode})
    return apply_lora(model, lora)


class Mode(FinetuneMode):
    """A step of benchmarks/finetune.py's, its text given as CLIP token ids (encoded in the step)."""

    def loss(self, batch: tuple) -> torch.Tensor:
        x, ids_l, ids_g, sigma, noise = batch
        x_t = x * (1 - sigma[:, None, None, None]) + noise * sigma[:, None, None, None]
        v = self.model(x_t, sigma, {"clip_l_ids": ids_l, "clip_g_ids": ids_g})
        return per_sample_loss(v, x, noise).mean()

    def activation_bytes(self, batch: tuple) -> int:
        frozen = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in frozen:
                seen[ptr] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.loss(batch)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=False)
        return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--latent", type=int, default=16, help="latent side (16: a 128-px image through the SD3 VAE)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="adapter rank")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "lora_variants_cpu.json")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch, 16, args.latent, args.latent, generator=gen),
             torch.randint(VOCAB, (args.batch, CLIP_TOKENS), generator=gen),
             torch.randint(VOCAB, (args.batch, CLIP_TOKENS), generator=gen),
             torch.rand(args.batch, generator=gen),
             torch.randn(args.batch, 16, args.latent, args.latent, generator=gen))
    with tempfile.TemporaryDirectory() as tmp:
        folder = pipeline_folder(Path(tmp))
        modes = [Mode(name, build(args, folder, mode)) for name, mode in MODES.items()]
    activations = {mode.name: mode.activation_bytes(batch) for mode in modes}  # also the warm-up step
    for _ in range(args.rounds):
        for mode in modes:
            mode.times += [mode.step(batch, s) for s in range(1, args.steps + 1)]

    rows = []
    for mode in modes:
        state = mode.state_bytes()
        rows.append({"mode": mode.name, "median_step_s": statistics.median(mode.times),
                     "trained_params": sum(p.numel() for p in mode.trained),
                     "training_state_mib": sum(state.values()) / 2**20,
                     "activations_mib": activations[mode.name] / 2**20})
    plain = rows[0]
    print(f"{'mode':<22} {'step s':>8} {'vs lora':>8} {'trained':>11} {'grad+Adam+EMA MiB':>18} "
          f"{'activations MiB':>16}")
    for r in rows:
        print(f"{r['mode']:<22} {r['median_step_s']:>8.3f} {r['median_step_s'] / plain['median_step_s']:>8.2f} "
              f"{r['trained_params']:>11,} {r['training_state_mib']:>18.2f} {r['activations_mib']:>16.1f}")
    result = {"config": vars(args) | {"out": str(args.out)}, "device": "cpu", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
