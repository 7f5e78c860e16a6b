"""Precompute at scale: webdataset tar shards in (with bad samples), the same dataset out on one rank or two,
after a SIGKILL, and after damage; the index opens in constant memory and trains like any latent dataset."""

import io
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

import precompute_latents
from data.latents import LatentDataset
from data.webdataset import ShardError, expand_braces, expand_shards, read_samples
from tests.conftest import (LATENT_RUN, ROOT, T5_TOKENS, WORDS, add_member, assert_close, final_weights, free_port,
                            image_folder, trains)
from train_mmdit_stable import main

pytest.importorskip("diffusers")
SHARDS, PER_SHARD = 4, 3
BAD = {"00001.tar:000010001": "corrupt image", "00002.tar:000020000": "no caption",
       "00003.tar:000030002": "unsupported format"}  # report keys: the shard and the sample's key
# every process computes with one thread: the VAE's convolutions sum in another order with another thread count;
# a process that crashes prints its Python stacks
UNBUFFERED = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def write_tar_shards(directory: Path) -> Path:
    """img2dataset-style shards: KEY.jpg / KEY.png, KEY.txt and KEY.json per sample, with one corrupt image,
    one sample without a caption and one GIF among them (BAD)."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(1)
    for s in range(SHARDS):
        with tarfile.open(directory / f"{s:05d}.tar", "w") as tar:
            for i in range(PER_SHARD):
                key = f"{s:05d}{i:04d}"
                why = BAD.get(f"{s:05d}.tar:{key}")
                w, h = [(16, 16), (24, 16), (16, 20)][i]
                pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
                image = io.BytesIO()
                Image.fromarray(pixels).save(image, format="GIF" if why == "unsupported format" else
                                             "PNG" if i % 2 else "JPEG")
                suffix = {"unsupported format": "gif", None: "png" if i % 2 else "jpg"}.get(why, "jpg")
                data = image.getvalue()[:40] if why == "corrupt image" else image.getvalue()
                add_member(tar, f"{key}.{suffix}", data)
                caption = " ".join(WORDS[j] for j in torch.randint(len(WORDS), (3 + i,), generator=gen))
                if why != "no caption":
                    add_member(tar, f"{key}.txt", caption.encode())
                record = {"key": key, "caption": caption, "status": "success"}
                add_member(tar, f"{key}.json", json.dumps(record).encode())
    return directory


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    return write_tar_shards(tmp_path_factory.mktemp("wds") / "shards")


def arguments(sd3_dir, out, *inputs, extra=()) -> list[str]:
    return ["--model", str(sd3_dir), "--shards", *inputs, "--out", str(out), "--resolution", "16",
            "--aspect-buckets", "--bucket-step", "4", "--batch-size", "2", "--shard-size", "2", "--dtype", "fp32",
            "--max-sequence-length", str(T5_TOKENS), "--max-bad-fraction", "0.3", *extra]


def run_in_process(sd3_dir, out, *inputs, extra=()) -> int:
    return precompute_latents.main(arguments(sd3_dir, out, *inputs, extra=extra))


def torchrun(nproc: int, args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                             f"--master_port={free_port()}", str(ROOT / "precompute_latents.py"), *args], cwd=ROOT, env=UNBUFFERED,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def without_progress_bars(output: str) -> str:
    """A failed launch's output for the test report: its last lines, without the progress bar's redraws."""
    return "\n".join(line for line in output.splitlines() if "%|" not in line)[-4000:]


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_same_dataset(a: Path, b: Path) -> None:
    ours, theirs = files(a), files(b)
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if ours[name] != theirs[name]] == []


@pytest.fixture(scope="module")
def one_rank(sd3_dir, tars, tmp_path_factory):
    """The reference: the four shards on one rank, in this process."""
    out = tmp_path_factory.mktemp("one") / "data"
    assert run_in_process(sd3_dir, out, f"{tars}/{{00000..00003}}.tar") == 0
    return out


def test_shards_give_their_good_samples_and_name_the_bad_ones(one_rank, tars):
    ds = LatentDataset(one_rank, aspect_buckets=True)
    assert len(ds) == SHARDS * PER_SHARD - len(BAD) and len(ds.latent_sizes) == 2
    reports = [json.loads((one_rank / "reports" / f"{s:05d}.json").read_text()) for s in range(SHARDS)]
    skipped = {r["key"]: r["why"] for report in reports for r in report["skipped"]}
    assert {key: why.split(":")[0] for key, why in skipped.items()} == BAD
    assert skipped["00003.tar:000030002"].startswith("unsupported format: .gif")
    assert reports[1]["input"] == f"{tars}/00001.tar" and reports[1]["samples"] == PER_SHARD
    with tarfile.open(tars / "00000.tar") as tar:
        captions = [tar.extractfile(m).read().decode() for m in tar if m.name.endswith(".txt")]
    assert sorted(ds.caption(i) for i in range(PER_SHARD)) == sorted(captions)  # unit 0 comes first
    index = json.loads((one_rank / "dataset.json").read_text())
    assert index["skipped"] == len(BAD) and index["text_embeddings"] and index["items"] == len(ds)
    assert all(s["sha256"] and s["bytes"] == (one_rank / s["file"]).stat().st_size for s in index["shards"])


def test_captions_from_a_json_field_give_the_same_dataset(sd3_dir, tars, one_rank, tmp_path):
    assert run_in_process(sd3_dir, tmp_path / "json", f"{tars}/0000[0-3].tar", extra=["--caption-field", "caption"]) == 0
    ds, reference = LatentDataset(tmp_path / "json", aspect_buckets=True), LatentDataset(one_rank, aspect_buckets=True)
    assert len(ds) == len(reference) + 1  # the sample without a .txt has its caption in the .json
    assert set(ds.caption(i) for i in range(len(ds))) >= set(reference.caption(i) for i in range(len(reference)))


def test_two_ranks_write_the_same_dataset_as_one(sd3_dir, tars, one_rank, tmp_path):
    proc = torchrun(2, arguments(sd3_dir, tmp_path / "two", f"{tars}/{{00000..00003}}.tar"))
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, without_progress_bars(output)
    assert "per rank" in output and "img/s" in output
    assert_same_dataset(tmp_path / "two", one_rank)


def test_two_ranks_agree_on_the_references_of_shards_of_pairs(kontext_dir, tmp_path):
    """Rank 0 reads the first samples for the references per sample (1) and tells the other rank, which checks its
    shard's samples against it: the dataset of one rank."""
    images = image_folder(tmp_path / "images", [(16, 16), (20, 16)] * 2)
    references = image_folder(tmp_path / "references", [(16, 20), (16, 16)] * 2, seed=1)
    for s in range(2):
        with tarfile.open(tmp_path / f"{s:05d}.tar", "w") as tar:
            for i in (2 * s, 2 * s + 1):
                add_member(tar, f"{i:04d}.png", (images / f"img{i:02d}.png").read_bytes())
                add_member(tar, f"{i:04d}.txt", (images / f"img{i:02d}.txt").read_bytes())
                add_member(tar, f"{i:04d}.reference.png", (references / f"img{i:02d}.png").read_bytes())
    args = ["--model", str(kontext_dir), "--shards", f"{tmp_path}/{{00000..00001}}.tar", "--resolution", "16",
            "--aspect-buckets", "--bucket-step", "4", "--dtype", "fp32"]
    assert precompute_latents.main([*args, "--out", str(tmp_path / "one")]) == 0
    proc = torchrun(2, [*args, "--out", str(tmp_path / "two")])
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, without_progress_bars(output)
    assert_same_dataset(tmp_path / "two", tmp_path / "one")
    assert LatentDataset(tmp_path / "two", aspect_buckets=True).references == 1


def test_a_precompute_killed_with_sigkill_reruns_to_the_same_dataset(sd3_dir, tars, tmp_path):
    """The same `pipe:` commands each time; the last shard's stalls while a flag file exists, so that the kill
    lands with three units finished and the fourth read but not published. The rerun is on two ranks."""
    stall = tmp_path / "stall"
    shards = [f"pipe:cat {tars}/{s:05d}.tar" + (f"; [ ! -e {stall} ] || sleep 120" if s == SHARDS - 1 else "")
              for s in range(SHARDS)]
    assert run_in_process(sd3_dir, tmp_path / "clean", *shards) == 0
    stall.touch()
    args = arguments(sd3_dir, tmp_path / "killed", *shards)
    proc = subprocess.Popen([sys.executable, str(ROOT / "precompute_latents.py"), *args], cwd=ROOT, env=UNBUFFERED,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    reports, deadline = tmp_path / "killed" / "reports", time.monotonic() + 120
    while len(list(reports.glob("*.json"))) < SHARDS - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the tool and its pipe command
    proc.wait()
    assert sorted(p.name for p in reports.glob("*.json")) == ["00000.json", "00001.json", "00002.json"]
    stall.unlink()
    rerun = torchrun(2, args)
    output = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, without_progress_bars(output)
    assert "resuming: 3 of 4 units already finished" in output
    assert_same_dataset(tmp_path / "killed", tmp_path / "clean")


def launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """NPROC_PER_NODE=nproc ./launch.sh precompute_latents.py ARGS, as docs/data.md runs it."""
    env = {**UNBUFFERED, "PYTHON": sys.executable, "NPROC_PER_NODE": str(nproc), "MASTER_PORT": str(free_port())}
    return subprocess.run([str(ROOT / "launch.sh"), "precompute_latents.py", *args], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def test_an_input_error_of_precompute_on_two_ranks_is_one_line_and_exit_2(sd3_dir, tars, tmp_path):
    """Rank 0 says it once, and no torchrun traceback (ChildFailedError) follows: the status of one process."""
    proc = launch(2, arguments(sd3_dir, tmp_path / "out", f"{tars}/00000.tar", extra=["--bucket-step", "6"]))
    output = without_progress_bars(proc.stdout)
    assert proc.returncode == 2, output
    assert output.count("precompute: --bucket-step 6 must be a multiple of 4") == 1, output
    assert "Traceback" not in output and "ChildFailedError" not in output, output


def test_a_shard_that_cannot_be_read_ends_a_launch_with_exit_1_and_no_traceback(sd3_dir, tmp_path, monkeypatch,
                                                                                 caplog):
    """Under the launcher, precompute leaves "failed" for it (rank 0 has said why) and exits 0 for torchrun; the
    launcher turns that into exit 1, as one process gives, without torchrun's traceback (shown with stand-in
    workers: a real two-rank launch is the test above)."""
    monkeypatch.setenv("MMDIT_STATUS_DIR", str(tmp_path))
    assert run_in_process(sd3_dir, tmp_path / "out", f"pipe:cat {tmp_path}/missing.tar") == 0
    assert (tmp_path / "rank0").read_text() == "failed 1" and "1 input shard(s) could not be read" in caplog.text
    worker = tmp_path / "worker.py"
    worker.write_text("import os, pathlib, sys\n"
                      "rank = os.environ['RANK']\n"
                      "print(f'rank {rank} said why')\n"
                      "pathlib.Path(os.environ['MMDIT_STATUS_DIR'], f'rank{rank}').write_text(sys.argv[1])\n")
    env = {**UNBUFFERED, "PYTHON": sys.executable, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([str(ROOT / "launch.sh"), str(worker), "failed"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout


@pytest.mark.full  # training's ranks free theirs in `make test` (test_distributed.py)
def test_the_ranks_free_their_process_group_before_the_interpreter_exits(tmp_path):
    """diffusers imports torch.distributed.nn on first use; first imported after the group exists, its functions
    hold the group in default arguments past destroy_process_group, until the interpreter shuts down, where gloo
    aborts a finished precompute now and then (exit -6, "terminate called without an active exception")."""
    script = tmp_path / "ranks.py"
    script.write_text("from data.precompute.ranks import Ranks\n"
                      "ranks = Ranks()\n"
                      "ranks.share(ranks.rank)\n"
                      "from diffusers import AutoencoderKL  # as SD3Encoders does, once the group exists\n"
                      "ranks.close()\n"
                      "import json, sys\n"
                      "from tests.conftest import gloo_threads\n"
                      "open(f'{sys.argv[1]}/rank{ranks.rank}.json', 'w').write(json.dumps(gloo_threads()))\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(script), str(tmp_path)], cwd=ROOT,
                          env={**UNBUFFERED, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, without_progress_bars(proc.stdout)
    assert [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)] == [[], []]


def test_too_many_bad_samples_stop_the_job_and_a_higher_limit_accepts_them(sd3_dir, tars, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mmdit")
    out = tmp_path / "data"
    assert run_in_process(sd3_dir, out, f"{tars}/*.tar", extra=["--max-bad-fraction", "0.1"]) == 1
    said = caplog.text
    assert "3 of 12 samples (25.0 %) were bad, more than --max-bad-fraction 0.1" in said
    assert "corrupt image 1" in said and "no caption 1" in said and "unsupported format 1" in said
    assert not (out / "dataset.json").exists()
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert run_in_process(sd3_dir, out, f"{tars}/*.tar", extra=["--max-bad-fraction", "0.3"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("shard-*")} == mtimes  # nothing re-encoded
    assert len(LatentDataset(out, aspect_buckets=True)) == 9


def test_an_unreadable_input_shard_fails_the_job_and_is_redone_once_fixed(sd3_dir, tars, tmp_path, caplog, capsys):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for s in range(SHARDS):
        (inputs / f"{s:05d}.tar").write_bytes((tars / f"{s:05d}.tar").read_bytes())
    whole = (inputs / "00002.tar").read_bytes()
    (inputs / "00002.tar").write_bytes(whole[: len(whole) // 2])  # a download cut short
    out = tmp_path / "data"
    assert run_in_process(sd3_dir, out, f"{inputs}/*.tar") == 1
    said = caplog.text
    assert "1 input shard(s) could not be read" in said and "00002.tar: not a readable tar shard" in said
    bar = capsys.readouterr().out.split("\r")[-1]
    assert "3/4" in bar and "1 failed" in bar, bar  # not 4/4, 100 %
    assert sorted(p.name for p in (out / "reports").glob("*.json")) == ["00000.json", "00001.json", "00003.json"]
    finished = {p: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    (inputs / "00002.tar").write_bytes(whole)  # downloaded again
    assert run_in_process(sd3_dir, out, f"{inputs}/*.tar") == 0
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # only the failed shard was encoded
    assert len(LatentDataset(out, aspect_buckets=True)) == SHARDS * PER_SHARD - len(BAD)


@pytest.mark.parametrize("command, said", [("false", "exit status 1 (nothing on stderr)"),
                                            ("cat {tars}/missing.tar", "missing.tar: No such file or directory"),
                                            ("cat {tars}/00000.tar; echo denied >&2; exit 3", "exit status 3; its "
                                             "stderr ended with:\n    denied")])
def test_a_failed_pipe_command_is_reported_as_the_command_failing(tars, command, said):
    """Not as a bad tar: an object-store download refused for its credentials must not look like corrupt data."""
    with pytest.raises(ShardError, match="the command failed") as failure:
        list(read_samples("pipe:" + command.format(tars=tars)))
    assert said in str(failure.value) and "tar" not in str(failure.value).split(":")[-1]


def test_an_edit_samples_references_are_its_numbered_files_in_order_and_never_its_target(tmp_path):
    """`KEY.reference_0.jpg`, `KEY.reference_1.png` (suffixes the target's choice would prefer to .webp) are the
    references, in their numbers' order; `KEY.webp` the target; of one reference in two formats, the target's
    preferred one; a sample without references has none."""
    files = {"pair.webp": b"target", "pair.txt": b"make it red", "pair.reference_1.png": b"second",
             "pair.reference_0.jpg": b"first", "pair.reference_0.bmp": b"first as bmp", "plain.png": b"image",
             "plain.txt": b"a cat"}
    with tarfile.open(tmp_path / "pairs.tar", "w") as tar:
        for name, data in files.items():
            add_member(tar, name, data)
    pair, plain = read_samples(str(tmp_path / "pairs.tar"))
    assert (pair.image, pair.references, pair.problem) == (b"target", (b"first", b"second"), None)
    assert (plain.image, plain.references, plain.problem) == (b"image", (), None)


def test_a_damaged_output_shard_is_named_by_training_and_redone_by_the_rerun(sd3_dir, tars, one_rank, tmp_path,
                                                                              caplog):
    out = tmp_path / "data"
    os.system(f"cp -rp {one_rank} {out}")
    index = json.loads((out / "dataset.json").read_text())
    shard = out / index["shards"][1]["file"]
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) * 2 // 3])
    with pytest.raises(ValueError, match=f"{shard.name} has {len(good) * 2 // 3} bytes, {len(good)} were published"):
        LatentDataset(out, aspect_buckets=True)
    assert run_in_process(sd3_dir, out, f"{tars}/{{00000..00003}}.tar") == 0
    assert "1 finished unit(s) have damaged or missing shards and are redone: [0]" in caplog.text
    assert shard.read_bytes() == good
    assert_same_dataset(out, one_rank)


def test_a_dataset_of_captions_without_text_embeddings(sd3_dir, tars, one_rank, tmp_path):
    assert run_in_process(sd3_dir, tmp_path / "captions", f"{tars}/{{00000..00003}}.tar",
                          extra=["--text-embeddings", "none", "--validation-prompts", str(tars / "00000.tar")]) == 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n")
    assert run_in_process(sd3_dir, tmp_path / "captions", f"{tars}/{{00000..00003}}.tar",
                          extra=["--text-embeddings", "none", "--validation-prompts", str(prompts)]) == 0
    size = lambda d: sum(s["bytes"] for s in json.loads((d / "dataset.json").read_text())["shards"])
    assert size(tmp_path / "captions") < size(one_rank) / 2
    with pytest.raises(ValueError, match="set data.text_encoding=on_the_fly"):
        LatentDataset(tmp_path / "captions", aspect_buckets=True)
    ds = LatentDataset(tmp_path / "captions", aspect_buckets=True, text_embeddings=False)
    reference = LatentDataset(one_rank, aspect_buckets=True)
    assert ds.validation_captions == ["a red cat"] and ds.validation_prompts is None
    for i in range(len(ds)):
        assert ds.caption(i) == reference.caption(i) and torch.equal(ds[i]["latents"], reference[i]["latents"])


def test_brace_ranges_lists_and_globs_expand_in_order(tmp_path):
    assert expand_braces("s3/{00008..00011}.tar") == [f"s3/{n:05d}.tar" for n in range(8, 12)]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
    for name in ("b.tar", "a.tar"):
        (tmp_path / name).write_bytes(b"")
    assert expand_shards([f"{tmp_path}/*.tar", "pipe:curl -s http://x/{0..1}.tar"]) == [
        f"{tmp_path}/a.tar", f"{tmp_path}/b.tar", "pipe:curl -s http://x/0.tar", "pipe:curl -s http://x/1.tar"]
    for patterns, message in (([f"{tmp_path}/none-*.tar"], "matches no file"), ([f"{tmp_path}/c.tar"], "does not exist"),
                              ([f"{tmp_path}/a.tar", f"{tmp_path}/a.tar"], "more than once"),
                              ([f"{tmp_path}/{{a,b,c,d}}.tar"], f"2 of 4 shards are missing: {tmp_path}/c.tar does "
                                                                 f"not exist, {tmp_path}/d.tar does not exist$")):
        with pytest.raises(ValueError, match=message):
            expand_shards(patterns)


def test_training_on_it_resumes_across_world_sizes(one_rank, tmp_path):
    """Aspect buckets and exact resume hold for a dataset made from shards: two steps on one process then two
    on 2-rank DDP equal four steps on one process (summation order differs across world sizes: 1e-5)."""
    common = [*LATENT_RUN, f"data.path={one_rank}", "data.aspect_buckets=true", "training.max_steps=4",
              "checkpoint.every=2", "optimizer.eps=1e-3", "optimizer.min_lr_ratio=1"]
    chain = [*common, f"logging.output_dir={tmp_path / 'chain'}"]
    assert main([*chain, "training.train_batch_size=2", "training.max_steps=2"]) == 0
    trains(2, [*chain, "training.train_batch_size=1"], tmp_path)  # the same global batch of 2
    assert main([*common, "training.train_batch_size=2", f"logging.output_dir={tmp_path / 'straight'}"]) == 0
    assert_close(final_weights(tmp_path / "chain"), final_weights(tmp_path / "straight"), atol=1e-5)
