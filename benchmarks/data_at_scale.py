"""Data at scale: bytes per sample, opening a dataset of 10,000 shards, and the loader's images/s against what an
SD3-medium 1024 px step needs on an H100.

    python benchmarks/data_at_scale.py [--only bytes,variants,open,loader] [--before PATH]
        [--out benchmarks/data_at_scale.json]

- bytes: datasets of SD3's shapes (16 latent channels, the VAE's /8, prompt_embeds [333, 4096], pooled [2048],
  fp16 as precompute stores them) written by precompute's own writer (`UnitWriter`, `write_index`) from a stand-in
  encoder, with and without text embeddings, and without text embeddings but with a loss mask per image, at 512
  and 1024 px; bytes per sample = the files on disk (shards, index, dataset.json) / samples.
- variants: the same for Qwen-Image's shapes (16 channels at /8, prompt_embeds [512, 3584] and its mask [512], fp16)
  at 1024 px with 1, 2 and 4 encodings per caption (precompute --caption-variants): what each variant adds.
- open: a synthetic dataset of --shards shards x --per-shard items (tiny tensors, captions of about 60 bytes),
  opened in a fresh process by this checkout and by the checkout at --before (an earlier version, which reads
  every shard's header and keeps Python lists); wall time and the resident memory it adds.
- loader: the data path alone (LatentDataset, Collate, DataLoader as training builds it) over 1024 px datasets on
  local disk (page cache warm: written just before), 0, 2 and 4 workers, interleaved rounds, medians; on-the-fly
  text is tokenized in the workers by BPE tokenizers the size of CLIP's and T5's vocabularies (stand-ins: no
  download). Next to it: the images/s one H100 needs at 40 % MFU for SD3-medium at 1024 px (FLOPs counted by
  torch's counter on meta-device models: the MMDiT's forward and backward, plus for on-the-fly text the frozen
  CLIP-L, CLIP-G and T5-XXL forwards).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project folders import by their names

SD3 = {"channels": 16, "tokens": 333, "joint": 4096, "pooled": 2048, "clip_tokens": 77, "t5_tokens": 256}
QWEN_IMAGE = {"channels": 16, "tokens": 512, "joint": 3584, "pooled": 0}  # masked text, no pooled vector
H100_BF16_TFLOPS, MFU = 989.4, 0.40
WORDS = ("a photo of the red blue green small large old new dog cat house tree car street city woman man child "
         "painting portrait landscape night sunset beach mountain river forest with and in on at by").split()


def captions(count: int, seed: int, words: int = 16) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (count, words), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in row) for row in picks]


class StandInEncoders:
    """What PipelineEncoders.encode returns, in a family's shapes (random values: sizes are what is measured); one
    text encoding per variant, stacked as precompute stacks them."""

    def __init__(self, text: bool, shapes: dict = SD3):
        self.text, self.shapes = text, shapes

    def encode(self, pixels, variants, flip, store):
        n, (h, w), s = len(variants[0]), pixels.shape[-2:], self.shapes
        k = [len(variants)] if len(variants) > 1 else []
        rows = {"latents": torch.randn(n, s["channels"], h // 8, w // 8)}
        if self.text:
            rows["prompt_embeds"] = torch.randn(n, *k, s["tokens"], s["joint"])
            if s["pooled"]:
                rows["pooled_prompt_embeds"] = torch.randn(n, *k, s["pooled"])
            else:  # a padded text: its mask
                rows["prompt_embeds_mask"] = torch.ones(n, *k, s["tokens"])
        return {k: v.to(store) for k, v in rows.items()}


def write_sd3_dataset(out: Path, resolution: int, text: bool, samples: int, shard_size: int = 64,
                      masks: bool = False, shapes: dict = SD3, variants: int = 1) -> Path:
    """A dataset as precompute writes it, through its writer, with stand-in encodings (`variants` per caption)."""
    from data.captions import CaptionStyle
    from data.latents import EMPTY_PROMPT, write_index
    from data.precompute.units import UnitWriter
    from models.diffusers_io import save_safetensors
    out.mkdir(parents=True)
    settings = {"batch_size": 8, "shard_size": shard_size, "random_flip": False, "dtype": "fp16",
                **({"captions": CaptionStyle(shuffle_tags=True).record(variants)} if variants > 1 else {})}
    writer = UnitWriter(0, StandInEncoders(text, shapes), settings, out, lambda images: None)
    pixels = torch.zeros(3, resolution, resolution, dtype=torch.uint8)
    mask = torch.full((1, resolution, resolution), 255, dtype=torch.uint8) if masks else None
    for caption in captions(samples, resolution):
        writer.add((resolution, resolution), pixels, caption, mask)
    writer.finish()
    if text:
        empty = StandInEncoders(True, shapes).encode(pixels[None], [[""]], False, torch.float16)
        save_safetensors({k: v for k, v in empty.items() if k != "latents"}, out / EMPTY_PROMPT)
    write_index(out, writer.shards, writer.captions,
                {"channels": shapes["channels"], "text_embeddings": text, "text_tokens": shapes["tokens"],
                 "text_dims": [shapes["joint"], shapes["pooled"]], "text_mask": not shapes["pooled"],
                 "max_sequence_length": shapes["tokens"], "flipped": False, "model": None, "masks": masks,
                 **({"captions": settings["captions"]} if variants > 1 else {})})
    return out


def variant_bytes(work: Path, samples: int) -> list[dict]:
    """Bytes per sample of Qwen-Image datasets at 1024 px with 1, 2 and 4 encodings per caption."""
    rows = []
    for variants in (1, 2, 4):
        data = write_sd3_dataset(work / f"variants-{variants}", 1024, True, samples, shapes=QWEN_IMAGE,
                                 variants=variants)
        rows.append({"family": "qwen_image", "resolution": 1024, "caption_variants": variants, "samples": samples,
                     "bytes_per_sample": disk_bytes(data) / samples})
        print(f"Qwen-Image 1024 px, {variants} encoding(s) per caption: {rows[-1]['bytes_per_sample'] / 1e6:8.3f} "
              f"MB/sample", flush=True)
    return rows


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def bytes_per_sample(work: Path, samples: int) -> list[dict]:
    rows = []
    for resolution in (512, 1024):
        for text, masks in ((True, False), (False, False), (False, True)):
            data = write_sd3_dataset(work / f"bytes-{resolution}-{text}-{masks}", resolution, text, samples,
                                     masks=masks)
            total = disk_bytes(data)
            rows.append({"resolution": resolution, "text_embeddings": "precomputed" if text else "none (on_the_fly)",
                         "masks": masks, "samples": samples, "bytes_per_sample": total / samples,
                         "index_bytes_per_sample": disk_bytes(data / "index") / samples})
            print(f"{resolution:>5} px  {rows[-1]['text_embeddings']:<18}{' + masks' if masks else ''} "
                  f"{total / samples / 1e6:8.3f} MB/sample (index {rows[-1]['index_bytes_per_sample']:.0f} B)",
                  flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- open


def write_many_shards(out: Path, shards: int, per_shard: int) -> Path:
    """Tiny tensors (the cost measured is the number of shards and items, not their bytes), published with
    dataset.json and the index: readable by this version and by earlier ones (which read the headers)."""
    from safetensors.torch import save_file

    from data.latents import shard_record, write_index
    if (out / "dataset.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    records, texts = [], []
    tensors = {"latents": torch.zeros(per_shard, 4, 2, 2, dtype=torch.float16),
               "prompt_embeds": torch.zeros(per_shard, 2, 8, dtype=torch.float16),
               "pooled_prompt_embeds": torch.zeros(per_shard, 8, dtype=torch.float16)}
    for s in range(shards):
        name = f"shard-{s:05d}-2x2-000.safetensors"
        texts.append([f"{c} {s}-{i}" for i, c in enumerate(captions(per_shard, s, words=10))])
        save_file(tensors, out / name, metadata={"captions": json.dumps(texts[-1])})
        records.append(shard_record(out, name, per_shard, (2, 2)))
        if s % 1000 == 999:
            print(f"  wrote {s + 1} shards", flush=True)
    write_index(out, records, texts, {"channels": 4, "text_embeddings": True, "text_tokens": 2, "text_dims": [8, 8],
                                      "max_sequence_length": 0, "flipped": False, "model": None})
    return out


OPEN = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from data.latents import LatentDataset
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * {page} / 2**20
before = rss()
start = time.perf_counter()
ds = LatentDataset(sys.argv[2])
seconds = time.perf_counter() - start
caption = ds[len(ds) - 1]["caption"]
print(json.dumps({{"seconds": seconds, "rss_mib": rss() - before, "items": len(ds),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def open_cost(tree: Path, data: Path) -> dict:
    script = OPEN.format(page=os.sysconf("SC_PAGE_SIZE"))
    proc = subprocess.run([sys.executable, "-c", script, str(tree), str(data)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"opening with {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def open_many(work: Path, before: Path | None, shards: int, per_shard: int, rounds: int) -> list[dict]:
    data = write_many_shards(work / f"many-{shards}x{per_shard}", shards, per_shard)
    trees = {"this version (index)": ROOT, **({"before (headers)": before} if before else {})}
    results = {name: [] for name in trees}
    for _ in range(rounds):  # interleaved
        for name, tree in trees.items():
            results[name].append(open_cost(tree, data))
    rows = []
    for name, runs in results.items():
        rows.append({"version": name, "shards": shards, "items": runs[0]["items"],
                     "seconds": statistics.median(r["seconds"] for r in runs),
                     "rss_mib": statistics.median(r["rss_mib"] for r in runs), "rounds": rounds})
        print(f"{name:<22} {shards} shards, {runs[0]['items']} items: open {rows[-1]['seconds']:.2f} s, "
              f"+{rows[-1]['rss_mib']:.0f} MiB resident", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- loader


def stand_in_tokenizers(work: Path) -> Path:
    """A pipeline folder holding only tokenizers: byte-level BPE with CLIP's vocabulary size (49,408) for both
    CLIPs and a 32,100-token one for T5, trained on the benchmark's captions; the sizes decide the cost."""
    folder = work / "tokenizers"
    if folder.exists():
        return folder
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    corpus = captions(20000, 7) + [" ".join(f"{w}{i}" for w in WORDS) for i in range(2000)]
    for name, vocab, length in (("tokenizer", 49408, 77), ("tokenizer_2", 49408, 77), ("tokenizer_3", 32100, 256)):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<unk>", "</s>"]))
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                             eos_token="</s>", model_max_length=length).save_pretrained(folder / name)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        (folder / name).mkdir()
    return folder


def loader_rate(data: Path, tokenizers: Path | None, workers: int, batch: int, steps: int) -> float:
    from data.latents import LatentDataset
    from data.loader import Collate, split_holdout, step_batches
    from models.rectified_flow import batch_sigmas
    from models.sd3.text import SD3Tokenizers
    dataset = LatentDataset(data, text_embeddings=tokenizers is None)
    tokenizer = SD3Tokenizers(tokenizers, SD3["t5_tokens"]) if tokenizers else None
    sigmas = partial(batch_sigmas, patch_size=2, by_resolution=False, shift=3.0, sampling="logit_normal",
                     logit_mean=0.0, logit_std=1.0)
    collate = Collate(0, sigmas, 0.1, tokenizer, dataset.empty_prompt)
    items, _ = split_holdout(len(dataset), 0, 0)
    loader = step_batches(dataset, collate, items, batch, 0, 0, 1, 0, steps + 2, torch.device("cpu"), workers,
                          pin_memory=False)
    batches = iter(loader)
    next(batches), next(batches)  # workers started, first batches in flight
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return steps * batch / (time.perf_counter() - start)


def needed_rate(on_the_fly: bool) -> dict:
    """Images/s one H100 consumes at 40 % MFU training SD3-medium at 1024 px (FLOPs counted on meta models)."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    from models.sd3.model import MMDiT, MMDiTConfig
    from models.text_encoder import TextToImage
    from runtime.step_stats import train_flops_per_sample
    config = MMDiTConfig(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                         attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                         caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192)
    mmdit = train_flops_per_sample(lambda: TextToImage(MMDiT(config)), lambda: (
        torch.zeros(1, 16, 128, 128), torch.full((1,), 0.5),
        {"prompt_embeds": torch.zeros(1, 333, 4096), "pooled_prompt_embeds": torch.zeros(1, 2048)}))
    text = 0
    if on_the_fly:
        clip = lambda hidden, layers, heads: transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
            hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
            projection_dim=hidden, max_position_embeddings=77))
        t5 = lambda: transformers.T5EncoderModel(transformers.T5Config(  # T5 v1.1 XXL, as SD3 ships it
            d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64, vocab_size=32128,
            feed_forward_proj="gated-gelu"))
        for build, tokens in ((lambda: clip(768, 12, 12), 77), (lambda: clip(1280, 32, 20), 77), (t5, 256)):
            with torch.device("meta"):
                model = build()
                ids = torch.zeros(1, tokens, dtype=torch.long)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                model(ids)
            text += counter.get_total_flops()
    flops = mmdit + text
    return {"mmdit_tflop_per_sample": mmdit / 1e12, "text_tflop_per_sample": text / 1e12,
            "images_per_s": H100_BF16_TFLOPS * 1e12 * MFU / flops}


def loader(work: Path, samples: int, rounds: int, steps: int, batch: int) -> dict:
    tokenizers = stand_in_tokenizers(work)
    datasets = {"precomputed": (write_sd3_dataset(work / "loader-text", 1024, True, samples)
                                if not (work / "loader-text").exists() else work / "loader-text", None),
                "on_the_fly": (write_sd3_dataset(work / "loader-captions", 1024, False, samples)
                               if not (work / "loader-captions").exists() else work / "loader-captions", tokenizers)}
    rates = {(mode, w): [] for mode in datasets for w in (0, 2, 4)}
    for _ in range(rounds):  # interleaved rounds
        for (mode, workers), runs in rates.items():
            data, tok = datasets[mode]
            runs.append(loader_rate(data, tok, workers, batch, steps))
    rows = [{"text_encoding": mode, "workers": w, "images_per_s": statistics.median(r), "rounds": rounds}
            for (mode, w), r in rates.items()]
    need = {mode: needed_rate(mode == "on_the_fly") for mode in datasets}
    for row in rows:
        n = need[row["text_encoding"]]["images_per_s"]
        print(f"{row['text_encoding']:<12} {row['workers']} workers: {row['images_per_s']:7.1f} img/s "
              f"(an H100 at 40 % MFU needs {n:.1f} img/s: x{row['images_per_s'] / n:.1f})", flush=True)
    return {"rows": rows, "needed_per_h100": need, "batch": batch, "steps": steps, "cpu_cores": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="bytes,variants,open,loader")
    parser.add_argument("--before", type=Path, help="a checkout of an earlier version, for the open comparison")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mmdit-data-at-scale")
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=256, help="of each dataset in bytes and loader")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data_at_scale.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    only = args.only.split(",")
    if "bytes" in only:
        work = Path(tempfile.mkdtemp(dir=args.work))
        results["bytes_per_sample"] = bytes_per_sample(work, args.samples)
    if "variants" in only:
        results["caption_variants"] = variant_bytes(Path(tempfile.mkdtemp(dir=args.work)), args.samples)
    if "open" in only:
        results["open"] = open_many(args.work, args.before, args.shards, args.per_shard, args.rounds)
    if "loader" in only:
        results["loader"] = loader(args.work, args.samples, args.rounds, steps=24, batch=8)
    results["machine"] = {"cpu_cores": os.cpu_count(), "torch": torch.__version__,
                          "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
