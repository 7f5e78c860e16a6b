import os

import torch

from perf.checkpoint import (checkpoints, latest_valid_checkpoint, optimizer_from_tensors, optimizer_to_tensors,
                             prune_checkpoints, read_checkpoint, verify, write_checkpoint)


def write(run_dir, step):
    return write_checkpoint(run_dir, step, {"model": {"w": torch.full((4,), float(step))}}, {"step": step})


def test_round_trip_and_manifest(tmp_path):
    path = write(tmp_path, 3)
    assert path.name == "step_00000003" and verify(path) is None
    tensors, meta = read_checkpoint(path)
    assert torch.equal(tensors["model"]["w"], torch.full((4,), 3.0)) and meta == {"step": 3}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_corrupt_truncated_and_partial_checkpoints_are_skipped(tmp_path):
    for step in (1, 2, 3, 4):
        write(tmp_path, step)
    root = tmp_path / "checkpoints"
    (root / "step_00000004" / "manifest.json").unlink()  # interrupted before the manifest
    data = root / "step_00000003" / "model.safetensors"
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))  # flipped byte
    with open(root / "step_00000002" / "model.safetensors", "r+b") as f:
        f.truncate(10)  # truncated
    (root / ".tmp-step_00000005").mkdir()  # a write in progress
    assert "manifest" in verify(root / "step_00000004")
    assert "checksum" in verify(root / "step_00000003")
    assert "bytes" in verify(root / "step_00000002")
    assert latest_valid_checkpoint(tmp_path) == root / "step_00000001"


def test_resave_of_a_valid_step_leaves_it_untouched(tmp_path):
    path = write(tmp_path, 2)
    before = os.stat(path / "model.safetensors").st_mtime_ns
    write_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(4)}}, {"step": 2})
    assert os.stat(path / "model.safetensors").st_mtime_ns == before


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        write(tmp_path, step)
    prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]


def test_optimizer_state_round_trip():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    tensors, meta = optimizer_to_tensors(opt)
    restored = torch.optim.AdamW(model.parameters(), lr=0.5)
    restored.load_state_dict(optimizer_from_tensors(tensors, meta))
    a, b = opt.state_dict(), restored.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for pid in a["state"]:
        for key, value in a["state"][pid].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][pid][key]))
