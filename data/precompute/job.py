"""The precompute job: the output directory, which units are left, encoding them, and the dataset written last."""

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

from data.latents import EMPTY_PROMPT, NEGATIVE_PROMPT
from data.latents import PRECOMPUTE_SETTINGS as SETTINGS
from data.latents import VALIDATION_PROMPTS, publish_json, write_index
from data.precompute.encoders import PipelineEncoders, encode_prompts
from data.precompute.inputs import PrecomputeError, Unit
from data.precompute.ranks import Progress, Ranks
from data.precompute.units import PROGRESS, REPORTS, encode_unit, report_path, verified
from data.webdataset import ShardError
from formats import DTYPES
from runtime.directory_lock import LOCK_FILE, unwritable, writable_directory

log = logging.getLogger("mmdit")
INPUT_NAMES = "input_names"  # in the settings: the shards or images given, to name what changed on a rerun
INPUTS_NAMED = 10  # of the inputs added or removed, named in the error


def recorded_settings(out: Path) -> dict:
    """The settings a directory was started with ({} for a new one)."""
    return json.loads((out / SETTINGS).read_text()) if (out / SETTINGS).is_file() else {}


def check_output_directory(out: Path, settings: dict) -> None:
    """`out` must be new (or hold no finished unit of this tool's), or have been started with the same settings
    (it is then resumed). Anything else is refused: a directory of other files, or finished work of other
    settings. Nothing is created here (see `start_output_directory`)."""
    for parent in [out, *out.parents]:
        if parent.exists() and not parent.is_dir():
            raise PrecomputeError(f"--out {out}: {parent} is a file, not a directory")
    if not (out / SETTINGS).is_file():
        if out.exists() and any(path.name != LOCK_FILE for path in out.iterdir()):  # the lock: this job's
            raise PrecomputeError(f"--out {out} exists and was not written by this tool; choose a new directory")
        return
    old = recorded_settings(out)
    changed = [k for k in {**old, **settings} if old.get(k) != settings.get(k) and k != INPUT_NAMES]
    if changed and any((out / REPORTS).glob("*.json")):
        raise PrecomputeError(f"--out {out} was started with other settings: "
                              f"{'; '.join(describe_change(key, old, settings) for key in changed)}. Use a new "
                              f"directory, or the same settings to resume")
    if changed:  # nothing finished yet (an earlier attempt stopped early): start over
        log.info("--out %s holds no finished unit; starting over with the new settings %s", out, sorted(changed))
        for path in [*out.glob("shard-*.safetensors"), *out.glob(".*.tmp"), out / SETTINGS]:
            path.unlink()


def describe_change(key: str, old: dict, new: dict) -> str:
    """A changed setting as `key: before -> now`; changed inputs as the inputs added and removed, by name."""
    if key != "inputs":
        return f"{key}: {old.get(key, 'unset')} -> {new.get(key, 'unset')}"
    if old.get(INPUT_NAMES) is None or new[INPUT_NAMES] is None:  # too many to keep, or an earlier version's
        return "the inputs differ"
    before, now = old[INPUT_NAMES], new[INPUT_NAMES]
    added = [n for n in now if n not in set(before)]
    removed = [n for n in before if n not in set(now)]
    if not added and not removed:
        return "the same inputs with other contents (a caption, an image's size or modification time)"
    return "inputs " + "; ".join(f"{what} {len(names)}: {', '.join(names[:INPUTS_NAMED])}" +
                                 (f" and {len(names) - INPUTS_NAMED} more" if len(names) > INPUTS_NAMED else "")
                                 for what, names in (("added", added), ("removed", removed)) if names)


def start_output_directory(out: Path, settings: dict) -> None:
    """The settings first (a directory that holds anything else then has them, and is resumed), then the folders
    the units write into; one that cannot be written (a read-only mount at reports/, no space left) is refused
    now, before anything is encoded."""
    try:
        if not (out / SETTINGS).is_file():
            publish_json(out / SETTINGS, settings)
        shutil.rmtree(out / PROGRESS, ignore_errors=True)
        (out / PROGRESS).mkdir()
    except OSError as e:
        raise PrecomputeError(unwritable(f"--out {out}", out, e)) from None
    writable_directory(out / REPORTS, f"--out {out}", PrecomputeError)  # written to only as units finish


def remaining_units(out: Path, count: int, ranks: Ranks) -> list[int]:
    """Units without a verified report; each rank verifies a share of the finished ones, and a damaged unit's
    report is removed, so it is redone."""
    mine = {}
    for number in range(ranks.rank, count, ranks.size):
        mine[number] = verified(out, number)
        if mine[number] is False:
            report_path(out, number).unlink()
    shared = {n: ok for part in ranks.share(mine) for n, ok in part.items()}
    damaged = [n for n, ok in shared.items() if ok is False]
    if damaged:
        log.warning("%d finished unit(s) have damaged or missing shards and are redone: %s", len(damaged),
                    damaged[:10])
    done = sum(1 for ok in shared.values() if ok)
    if done:
        log.info("resuming: %d of %d units already finished", done, count)
    return [n for n in range(count) if not shared[n]]


def precompute(units: list[Unit], encoders: PipelineEncoders, out: Path, settings: dict, ranks: Ranks,
               validation_prompts: list[str] | None = None, max_bad_fraction: float = 1.0) -> int:
    """Encode the units left to do (this rank's share), then on rank 0 write the dataset; the exit status."""
    left = remaining_units(out, len(units), ranks)
    progress, failed = Progress(out, ranks, len(units), len(units) - len(left)), []
    for number in left[ranks.rank :: ranks.size]:
        try:
            encode_unit(number, units[number], encoders, settings, out, progress)
        except ShardError as e:
            failed.append(str(e))
            progress(failed=1)  # not a finished unit: the bar must not reach its end
        else:
            progress(units=1)
    store = DTYPES[settings["dtype"]]
    if ranks.rank == 0 and encoders.text is not None:
        encode_prompts(encoders, [""], store, out / EMPTY_PROMPT)
        if validation_prompts and encoders.family.negative_prompt:
            encode_prompts(encoders, [encoders.family.negative_prompt], store, out / NEGATIVE_PROMPT)
        if validation_prompts:
            encode_prompts(encoders, validation_prompts, store, out / VALIDATION_PROMPTS)
    failed = progress.finish(failed)
    if ranks.rank != 0:
        return 0
    if failed:
        log.error("precompute: %d input shard(s) could not be read; the others are finished. Fix or replace them "
                  "(or rerun: a download may have failed) and rerun the same command:\n  %s%s", len(failed),
                  "\n  ".join(failed[:5]), f"\n  ... and {len(failed) - 5} more" if len(failed) > 5 else "")
        return 1
    reports = [json.loads(report_path(out, n).read_text()) for n in range(len(units))]
    if not summarize(reports, out, max_bad_fraction):
        return 1
    shutil.rmtree(out / PROGRESS, ignore_errors=True)
    write_dataset(reports, encoders, out, settings, validation_prompts)
    return 0


def summarize(reports: list[dict], out: Path, max_bad_fraction: float) -> bool:
    """Log what was encoded and skipped; False when more than `max_bad_fraction` of the samples were bad."""
    samples = sum(r["samples"] for r in reports)
    skipped = [(r["input"], s) for r in reports for s in r["skipped"]]
    reasons = Counter(s["why"].partition(":")[0] for _, s in skipped)
    log.info("%d samples from %d unit(s): %d encoded, %d skipped%s", samples, len(reports), samples - len(skipped),
             len(skipped), f" ({', '.join(f'{why} {n}' for why, n in reasons.most_common())}); each unit's "
                           f"skipped samples are in {out / REPORTS}/" if skipped else "")
    for unit, s in skipped[:5]:
        log.info("  skipped %s: %s", s["key"], s["why"])
    if samples and len(skipped) > max_bad_fraction * samples:
        log.error("precompute: %d of %d samples (%.1f %%) were bad, more than --max-bad-fraction %g: the input is "
                  "likely wrong rather than noisy (%s). See %s/; rerun with a higher --max-bad-fraction to accept "
                  "them (finished units are kept)", len(skipped), samples, 100 * len(skipped) / samples,
                  max_bad_fraction, ", ".join(f"{why} {n}" for why, n in reasons.most_common()), out / REPORTS)
        return False
    if samples == len(skipped):
        log.error("precompute: no sample could be encoded")
        return False
    return True


def write_dataset(reports: list[dict], encoders: PipelineEncoders, out: Path, settings: dict,
                  validation_prompts: list[str] | None) -> None:
    shards = [s for r in reports for s in r["shards"]]
    vae = encoders.vae
    info = {"family": encoders.family.name, "channels": vae.latent_channels, "text_embeddings": encoders.text is not None,
            "text_tokens": encoders.tokenizers.tokens, "text_dims": list(encoders.text_dims),
            "text_mask": encoders.text_mask,
            "max_sequence_length": settings["max_sequence_length"], "flipped": settings["random_flip"],
            "resolution": settings["resolution"], "model": settings["model"],
            "vae": {**vae.record(), "folder": str(Path(settings["model"]) / "vae")},
            "validation_prompts": validation_prompts if encoders.text is None else None,
            "masks": any(s.get("masks") for s in shards),  # a loss mask per item (items of other shards: all 1)
            "references": settings.get("references", 0),  # an edit dataset's reference images per item
            "skipped": sum(len(r["skipped"]) for r in reports),
            **({"captions": settings["captions"]} if "captions" in settings else {})}  # data/captions.py
    write_index(out, shards, (captions for r in reports for captions in r["captions"]), info)
    if encoders.truncated:
        log.warning("%d captions were longer than a text encoder's token limit and were cut", encoders.truncated)
    log.info("wrote %d items in %d shards to %s%s", sum(s["count"] for s in shards), len(shards), out,
             f", and {len(validation_prompts)} validation prompts" if validation_prompts else "")
