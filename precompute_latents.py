"""Encode image-caption collections once into a latent dataset (see data/latents.py).

    python precompute_latents.py --model PIPELINE_DIR (--images DIR | --manifest FILE | --shards PATTERN ...) --out DIR
        [--resolution 1024] [--aspect-buckets] [--random-flip] [--validation-prompts FILE] [--batch-size 8]
        [--shard-size 1000] [--text-embeddings precomputed|none] [--caption-field NAME] [--max-bad-fraction 0.01]
        [--workers 4] [--device auto] [--dtype fp16] [--text-encoder-quantization auto|none|int8|nf4]
        [--caption-prefix TEXT] [--shuffle-caption-tags] [--keep-tags K] [--tag-dropout P] [--caption-variants K]
    NPROC_PER_NODE=N ./launch.sh precompute_latents.py ...   (the same command on N processes; NNODES=... too)

PIPELINE_DIR is a diffusers pipeline directory, whose model_index.json names its family:
- Stable Diffusion 3 / 3.5: vae/, text_encoder/ + tokenizer/ (CLIP-L), text_encoder_2/ + tokenizer_2/ (CLIP-G)
  and, optionally, text_encoder_3/ + tokenizer_3/ (T5; without it the T5 part is zeros, as the pipeline does);
- FLUX.1 (dev or schnell): vae/ (FLUX's scale and shift), text_encoder/ + tokenizer/ (CLIP-L, pooled),
  text_encoder_2/ + tokenizer_2/ (T5: 512 tokens for dev, 256 for schnell by default);
- Qwen-Image: vae/ (AutoencoderKLQwenImage: one frame, per-channel mean and std), text_encoder/ + tokenizer/
  (Qwen2.5-VL's last hidden states in the pipeline's prompt template, padded to 512 tokens with a mask);
- FLUX.2 (klein or dev): vae/ (latents patchified 2 x 2 into 128 channels at 1/16 and normalised by its BatchNorm's
  statistics), text_encoder/ + tokenizer/ (klein: Qwen3; dev: Mistral-Small-3 and its processor; 512 tokens).
Nothing is downloaded. The dataset records the family; training checks it against model.family.

Inputs:
- --images DIR: every image file with a same-named .txt caption beside it; --manifest FILE: JSONL of
  {"image": path relative to the manifest, "caption": text}. Every image and caption (UTF-8 text) is checked
  before anything is written or loaded; bad inputs stop the run, all named at once (fix them and rerun).
- --shards PATTERN ...: webdataset tar shards as img2dataset writes them (data/webdataset.py): local paths, globs,
  brace ranges ('data/{00000..00999}.tar') or `pipe:` commands ('pipe:aws s3 cp s3://b/{00000..00999}.tar -').
  A bad sample (corrupt image, no caption, unsupported format) is skipped, counted and named in its shard's
  report; past --max-bad-fraction of all samples the job fails, because then the input is wrong, not noisy.
- Edit pairs (docs/editing.md): --images with --references REFS (each image's reference(s) by its stem); a
  manifest line's "references": [path, ...]; a shard sample's KEY.reference.png (or KEY.reference_0.png, ...), its
  count per pair the most common among the first shard's first samples.

Loss masks (white = train): `NAME.mask.png` beside an image of a folder or manifest, `KEY.mask.png` in a shard,
else a PNG's or WebP's alpha channel unless it is opaque everywhere; cropped with the image and averaged over
each latent element's pixels into `loss_mask` weights stored with the latents (data.use_masks). An image whose
mask is black over its whole crop is skipped as bad ("empty mask").

The latents are the VAE posterior mean, shifted and scaled as the pipeline expects; the text embeddings are what
the pipeline's `encode_prompt` gives (models/sd3/text.py, models/flux/text.py, models/qwen_image/text.py,
models/flux2/text.py), or, with --text-embeddings none, not
stored: training encodes the captions itself (data.text_encoding=on_the_fly), and a sample costs its latents
alone. The captions encoded can get a prefix (a trigger word) and, with --caption-variants K, K encodings each of
its tags shuffled (the first --keep-tags in place) and dropped (--tag-dropout), from which training draws one per
step (data/captions.py; training's data.caption_prefix, shuffle_caption_tags, keep_tags and tag_dropout must say
the same); the index keeps the captions as written. Each image is resized to cover its target size and
centre-cropped; the target is --resolution squared, or with --aspect-buckets the bucket of about that area nearest
its aspect ratio.

The work is split into units: each input shard (or, for folder and JSONL inputs, each run of --shard-size
items), spread over the processes of a launch (each holds one copy of the encoders, on its own GPU).
A unit becomes output shards of at most about --shard-size items each, then its report (`reports/NNNNN.json`:
its samples, what was skipped and why, its shards' sizes and checksums), published last, by rename: the marker
that the unit is finished. A rerun of the same command, on any number of processes, verifies finished units
(sizes and checksums) and redoes only the unfinished or damaged ones; the result is the same, bitwise on CPU,
for any number of processes and interruptions. Rank 0 writes the index and `dataset.json` last, in unit order,
once every unit is finished.
"""

import argparse
import logging
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed.nn  # noqa: F401  imported before the group exists: see Ranks.close

from data.captions import CaptionStyle
from data.precompute.encoders import QUANTIZATIONS, PipelineEncoders, text_storage
from data.precompute.inputs import (PrecomputeError, Unit, check_items, default_sequence_length, fingerprint,
                                    folder_references, item_units, pipeline_family, read_image_folder, read_manifest,
                                    read_validation_prompts, shard_references, shard_units, vae_downsampling)
from data.precompute.job import (INPUT_NAMES, check_output_directory, precompute, recorded_settings,
                                 start_output_directory)
from data.precompute.ranks import Ranks
from data.precompute.units import REPORTS
from data.webdataset import ShardError, expand_shards
from errors import InputError
from formats import DTYPES
from runtime.directory_lock import lock_directory
from runtime.distributed import stop_together
from runtime.preemption import mark_exit
from runtime.quiet_imports import torchao_only_if

log = logging.getLogger("mmdit")
PATCH = 2  # latent pixels per token side of the released models (SD3's patches, FLUX.1's and Qwen-Image's packing)
MAX_INPUT_NAMES = 100_000  # images of a folder or manifest named in precompute.json (to say what changed on a rerun)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="SD3 / SD3.5, FLUX.1, Qwen-Image or FLUX.2 "
                        "pipeline directory (local)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", type=Path, help="folder of images with same-named .txt captions")
    source.add_argument("--manifest", type=Path, help='JSONL of {"image": ..., "caption": ...}')
    source.add_argument("--shards", nargs="+", help="webdataset tar shards: paths, globs, {000..999} ranges, pipe:")
    parser.add_argument("--references", type=Path, help="edit pairs: the folder of each --images image's reference "
                        "image(s), by its stem (cat.png -> REFS/cat.png, or cat_0.png, cat_1.png, ...); the caption "
                        "is the instruction")
    parser.add_argument("--out", required=True, type=Path, help="dataset directory to write (or resume)")
    parser.add_argument("--resolution", type=int, default=1024, help="side of the square target size in pixels")
    parser.add_argument("--aspect-buckets", action="store_true", help="keep aspect ratios (train with "
                        "data.aspect_buckets=true)")
    parser.add_argument("--bucket-step", type=int, default=64, help="bucket sides are multiples of this")
    parser.add_argument("--random-flip", action="store_true", help="also store each image mirrored left-right")
    parser.add_argument("--validation-prompts", type=Path, help="text file, one prompt per line, for the "
                        "validation images of training (validation.every)")
    parser.add_argument("--text-embeddings", choices=("precomputed", "none"), default="precomputed",
                        help="none: store captions only (2.7 MB less per SD3 sample); train with "
                             "data.text_encoding=on_the_fly")
    parser.add_argument("--caption-field", help="--shards: take captions from this field of each sample's .json "
                        "instead of its .txt")
    parser.add_argument("--max-bad-fraction", type=float, default=0.01, help="--shards: fail when more of the "
                        "samples than this are skipped as bad")
    parser.add_argument("--batch-size", type=int, default=8, help="images encoded at once")
    parser.add_argument("--shard-size", type=int, default=1000, help="items per output shard (and per unit of "
                        "folder and JSONL inputs)")
    parser.add_argument("--workers", type=int, default=4, help="threads decoding images")
    parser.add_argument("--max-sequence-length", type=int, help="text tokens (default: the pipeline's: SD3 "
                        "256, FLUX.1-dev 512, FLUX.1-schnell 256, Qwen-Image 512 (at most 1024), FLUX.2 512)")
    parser.add_argument("--device", default="auto", help="auto (under torchrun: this process's GPU), cpu, cuda:1")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16",
                        help="storage dtype; also the encoders' dtype on a GPU (they run in fp32 on the CPU), but "
                        "Qwen-Image's and FLUX.2's language models, which run in bf16 there as their pipelines do")
    parser.add_argument("--text-encoder-quantization", choices=QUANTIZATIONS, default="auto",
                        help="store the text encoders' linear layers in int8 or nf4 (less memory, embeddings a "
                        "little off the pipeline's); auto: on a GPU only where they do not fit it unquantized")
    parser.add_argument("--caption-prefix", default="", help="put before every caption (a trigger word); train "
                        "with data.caption_prefix set the same")
    parser.add_argument("--shuffle-caption-tags", action="store_true", help="each variant's comma-separated tags "
                        "in another order (with --caption-variants)")
    parser.add_argument("--keep-tags", type=int, default=0, help="the first tags that stay in place, never dropped")
    parser.add_argument("--tag-dropout", type=float, default=0.0, help="each variant drops each other tag with "
                        "this probability (with --caption-variants)")
    parser.add_argument("--caption-variants", type=int, default=1, help="encodings stored per caption, each a draw "
                        "of the shuffling and dropout: K times the text's disk and encoding time")
    args = parser.parse_args(argv)
    for name in ("resolution", "bucket_step", "batch_size", "shard_size", "max_sequence_length", "workers",
                 "caption_variants"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.max_bad_fraction <= 1:
        parser.error("--max-bad-fraction must be between 0 and 1")
    if args.references and not args.images:
        parser.error("--references goes with --images: a manifest lists each line's \"references\", a shard holds "
                     "each sample's (KEY.reference.png, or KEY.reference_0.png, KEY.reference_1.png, ...)")
    check_caption_flags(parser, args)
    return args


def check_caption_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    style = CaptionStyle(args.caption_prefix, args.shuffle_caption_tags, args.keep_tags, args.tag_dropout)
    if args.keep_tags < 0 or not 0 <= args.tag_dropout < 1:
        parser.error("--keep-tags must be >= 0 and --tag-dropout in [0, 1)")
    if style != CaptionStyle() and args.text_embeddings == "none":
        parser.error("the caption flags make the captions that are encoded; with --text-embeddings none nothing is "
                     "encoded: set data.caption_prefix, shuffle_caption_tags, keep_tags, tag_dropout in training")
    if style.random and args.caption_variants < 2:
        parser.error("--shuffle-caption-tags / --tag-dropout need --caption-variants K >= 2: one encoding per "
                     "caption would fix one draw for the whole run")
    if args.caption_variants > 1 and not style.random:
        parser.error("--caption-variants > 1 stores draws of --shuffle-caption-tags / --tag-dropout; without them "
                     "every variant is the same caption")


def read_inputs(args: argparse.Namespace, ranks: Ranks) -> tuple[list[Unit], dict]:
    """The units of work, and the inputs' fingerprint and names (for the settings: a rerun says what changed) and
    an edit dataset's references per target; folder and JSONL inputs are checked whole first, shards are streamed:
    rank 0 reads the first samples for the references (every rank then checks each sample against its count)."""
    if args.shards:
        try:
            sources = expand_shards(args.shards)
        except ShardError as e:
            raise PrecomputeError(str(e)) from None
        count = ranks.share(shard_references(sources, args.caption_field) if ranks.rank == 0 else None)[0]
        units = shard_units(sources, args.caption_field, count)
        return units, {"inputs": fingerprint(units, None), INPUT_NAMES: [unit.name for unit in units],
                       **({"references": count} if count else {})}
    if args.caption_field:
        raise PrecomputeError("--caption-field applies to --shards inputs (folders and manifests give captions)")
    if args.images:
        items, bad = read_image_folder(args.images)
        references, unmatched = folder_references(items, args.images, args.references) if args.references \
            else ({}, [])
        bad += unmatched
    else:
        items, bad, references = read_manifest(args.manifest)
    source = f"--images {args.images}" if args.images else f"--manifest {args.manifest}"
    check_items(items, bad, source, references)
    units = item_units(items, args.shard_size, source, references)
    names = [str(path) for path, _ in items] if len(items) <= MAX_INPUT_NAMES else None  # precompute.json stays small
    count = len(next(iter(references.values()), ()))  # an edit dataset's references per target (check_items)
    return units, {"inputs": fingerprint(units, items, references), INPUT_NAMES: names,
                   **({"references": count} if count else {})}  # absent: settings of a text-to-image set as before


def check_edit(args: argparse.Namespace, family, references: int) -> None:
    """An edit dataset (references per target) needs an edit model of the pipeline's family that takes that many,
    and refuses what would separate a target from its references."""
    if not references:
        return
    most = family.max_references
    if not family.edits or (most is not None and references > most):
        raise PrecomputeError(f"--model {args.model} is a {family.title} pipeline, and each target has {references} "
                              f"reference image(s): " + (f"{family.title} has no edit model (edit families: "
                              f"FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2)" if not family.edits else
                              f"{family.edit_pipelines[0]} takes {most}"))
    if args.random_flip:
        raise PrecomputeError("--random-flip mirrors the target alone, and an edit's instruction may name left and "
                              "right: precompute edit pairs without it")
    if args.validation_prompts:
        raise PrecomputeError("--validation-prompts: an edit dataset's validation images edit held-out pairs' "
                              "references by their instructions (data.holdout); precompute it without prompts")
    if args.text_embeddings == "none" and family.edit_text is not None:
        raise PrecomputeError(f"--text-embeddings none: {family.title}'s edit pipeline encodes the instruction with "
                              f"the reference images, which training does not do in the step; precompute the text")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ranks = Ranks()
    logging.basicConfig(level=logging.INFO if ranks.rank == 0 else logging.ERROR, format="%(message)s",
                        stream=sys.stdout)
    gpu = torch.cuda.is_available() and args.device == "auto"
    device = torch.device(f"cuda:{ranks.local_rank}" if gpu else "cpu" if args.device == "auto" else args.device)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a scheduler's stop, taken as Ctrl-C is
    try:
        with stop_together():  # one job per output directory, refused before anything is read or computed
            lock = lock_directory(args.out, f"--out {args.out}", PrecomputeError) if ranks.rank == 0 else nullcontext()
        with lock:
            status = run(args, ranks, device)
    except InputError as e:  # the user's input: one line, once (every rank stops alike: stop_together)
        if ranks.rank == 0:
            log.error("precompute: %s", e)
        return mark_exit(ranks.rank, "input-error", status=2)
    except KeyboardInterrupt:
        if ranks.rank == 0:
            done = len(list((args.out / REPORTS).glob("*.json")))
            log.error("precompute: interrupted with %d unit(s) finished; the same command resumes from there", done)
        return mark_exit(ranks.rank, "interrupted", status=130)
    except Exception as e:
        if getattr(e, "reported_by_main", False):  # rank 0 prints this rank's traceback (stop_together)
            return 1
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        ranks.close()
    return mark_exit(ranks.rank, "failed", status=1) if status else 0  # rank 0 has said why


def text_quantization_asked(args: argparse.Namespace) -> str:
    """--text-encoder-quantization; auto, resuming a directory, is what that directory was started with (auto's
    choice depends on the memory free at the time, and a resume must not mix precisions)."""
    started = recorded_settings(args.out)
    if args.text_encoder_quantization != "auto" or started.get("text_embeddings") != "precomputed":
        return args.text_encoder_quantization
    return started.get("text_encoders", {}).get("linears", "none")


def run(args: argparse.Namespace, ranks: Ranks, device: torch.device) -> int:
    with stop_together():  # every rank checks the inputs alike and loads the encoders; rank 0 the output directory
        units, inputs = read_inputs(args, ranks)
        prompts = read_validation_prompts(args.validation_prompts) if args.validation_prompts else None
        family = pipeline_family(args.model)
        check_edit(args, family, inputs.get("references", 0))
        length = args.max_sequence_length or default_sequence_length(args.model, family)
        if family.max_text_tokens and length > family.max_text_tokens:
            raise PrecomputeError(f"--max-sequence-length {length}: {family.title}'s pipeline takes at most "
                                  f"{family.max_text_tokens} text tokens")
        patch = family.packing or PATCH  # FLUX.2's latents are patchified by its VAE step: one pixel a token
        multiple = vae_downsampling(args.model) * patch  # every latent side must divide into patches
        name = "bucket_step" if args.aspect_buckets else "resolution"
        if getattr(args, name) % multiple:
            raise PrecomputeError(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of {multiple} "
                                  f"(VAE downsampling {multiple // patch} x patch {patch})")
        compute = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
        settings = {"model": str(args.model.resolve()), **inputs, "resolution": args.resolution,
                    "aspect_buckets": args.aspect_buckets, "bucket_step": args.bucket_step,
                    "random_flip": args.random_flip, "shard_size": args.shard_size, "dtype": args.dtype,
                    "max_sequence_length": length, "text_embeddings": args.text_embeddings,
                    "caption_field": args.caption_field,
                    "compute_dtype": str(compute),  # a resume must not mix latents encoded at two precisions
                    **caption_settings(args)}
        text = None
        if args.text_embeddings == "precomputed":
            text = text_storage(args.model, family, length, device, compute, text_quantization_asked(args),
                                ranks.share, args.batch_size * args.resolution**2)
            if text != (compute, "none"):  # nor text embeddings; recorded where they differ (earlier versions' default)
                settings["text_encoders"] = {"dtype": str(text[0]).removeprefix("torch."), "linears": text[1]}
        if ranks.rank == 0:
            check_output_directory(args.out, settings)
            start_output_directory(args.out, settings)
        encoders = PipelineEncoders(args.model, family, device, compute, length, text, args.resolution, multiple,
                                    inputs.get("references", 0))
    work = {**settings, "batch_size": args.batch_size, "workers": args.workers}
    return precompute(units, encoders, args.out, work, ranks, prompts, args.max_bad_fraction)


def caption_settings(args: argparse.Namespace) -> dict:
    """How captions are made before encoding, where not as written (the settings and dataset.json of earlier
    datasets have no such key)."""
    style = CaptionStyle(args.caption_prefix, args.shuffle_caption_tags, args.keep_tags, args.tag_dropout)
    return {"captions": style.record(args.caption_variants)} if style != CaptionStyle() else {}


if __name__ == "__main__":
    with torchao_only_if(used=False):  # transformers and peft would import it, and its noise, at start-up
        sys.exit(main())
