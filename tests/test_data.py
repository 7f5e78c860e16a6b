import pytest
import torch

from data.loader import StepBatchSampler, step_batches
from data.shapes import (COLORS, POSITIONS, SHAPES, ShapesDataset, all_prompts, analyze, caption,
                                      prompt_fidelity, render)
from configs.build import build_tokenizer


def test_items_are_a_function_of_seed_and_index():
    a, b = ShapesDataset(1000, seed=3), ShapesDataset(1000, seed=3)
    torch.manual_seed(0)
    first = a[17]
    torch.manual_seed(1)
    assert torch.equal(first["latents"], b[17]["latents"]) and first["caption"] == b[17]["caption"]
    assert not torch.equal(ShapesDataset(1000, seed=4)[17]["latents"], first["latents"]) or \
        ShapesDataset(1000, seed=4)[17]["caption"] != first["caption"]
    assert first["latents"].shape == (3, 32, 32) and first["latents"].min() == -1 and first["latents"].max() == 1


def test_dataset_covers_the_specification():
    ds = ShapesDataset(3000, seed=0)
    seen = {"colors": set(), "shapes": set(), "positions": set(), "sizes": set(), "jitter": set()}
    for i in range(600):
        color, shape, position, center, half = ds.attributes(i)
        seen["colors"].add(color), seen["shapes"].add(shape), seen["positions"].add(position)
        seen["sizes"].add(half), seen["jitter"].add((center[0] - POSITIONS[position][0], center[1] - POSITIONS[position][1]))
        assert ds[i]["caption"] == f"a {color} {shape} in the {position}"
    assert seen["colors"] == set(COLORS) and seen["shapes"] == set(SHAPES) and seen["positions"] == set(POSITIONS)
    assert seen["sizes"] == {4, 5, 6}
    assert {dy for dy, _ in seen["jitter"]} == {-2, -1, 0, 1, 2}


def test_render_geometry():
    square = render("red", "square", (16, 16), 4)[0]
    assert square.sum() == 81 and square[12:21, 12:21].all()
    triangle = render("green", "triangle", (16, 16), 4)[1]
    assert triangle[12].sum() == 1 and triangle[20].sum() == 9  # apex up, base down
    circle = render("blue", "circle", (16, 16), 5)[2]
    assert circle[16].sum() == 11 and circle[11].sum() == 1


def test_analysis_is_exact_on_ground_truth():
    ds = ShapesDataset(10_000, seed=1)
    items = [ds[i] for i in range(400)]
    images = torch.stack([(it["latents"] + 1) / 2 for it in items])
    prompts = [tuple(ds.attributes(i)[:3]) for i in range(400)]
    assert prompt_fidelity(images, prompts) == {"color": 1.0, "shape": 1.0, "position": 1.0}


def test_analysis_of_wrong_or_empty_images():
    image = render("red", "circle", (8, 8), 5)
    assert analyze(image) == {"color": "red", "shape": "circle", "position": "top left"}
    assert prompt_fidelity(image[None], [("blue", "square", "center")]) == {"color": 0, "shape": 0, "position": 0}
    assert analyze(torch.zeros(3, 32, 32))["shape"] is None


def test_prompt_set_is_all_90_combinations():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == 90
    build_tokenizer()([caption(*p) for p in prompts])  # every caption is in the vocabulary


def test_tokenizer_rejects_unknown_words():
    with pytest.raises(ValueError, match="purple"):
        build_tokenizer()(["a purple circle in the center"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_split_the_same_global_batch(world_size):
    def batches(rank, world):
        return list(StepBatchSampler(list(range(50)), 8, seed=0, rank=rank, world_size=world, start_step=0,
                                     end_step=12))

    single = batches(0, 1)
    per_rank = [batches(r, world_size) for r in range(world_size)]
    for step in range(12):
        assert sum((pr[step] for pr in per_rank), []) == single[step]


def test_epochs_are_permutations_and_resume_needs_only_the_step():
    sampler = StepBatchSampler(list(range(40)), 8, seed=0, rank=0, world_size=1, start_step=0, end_step=10)
    steps = list(sampler)
    assert sorted(idx for b in steps[:5] for _, _, idx, _ in b) == list(range(40))  # one epoch = 5 steps
    assert {epoch for b in steps[5:] for *_, epoch in b} == {1}
    resumed = list(StepBatchSampler(list(range(40)), 8, seed=0, rank=0, world_size=1, start_step=6, end_step=10))
    assert resumed == steps[6:]


def test_loader_batches_carry_step_positions_and_tokens():
    loader = step_batches(ShapesDataset(100, 0), build_tokenizer(), list(range(100)), global_batch=8, seed=0, rank=1,
                          world_size=2, start_step=3, end_step=5, device=torch.device("cpu"))
    batch = next(iter(loader))
    assert batch["step"] == 3 and batch["position"].tolist() == [4, 5, 6, 7]
    assert batch["latents"].shape == (4, 3, 32, 32) and batch["input_ids"].shape == (4, 7)


def test_worker_processes_change_nothing_in_the_batches():
    def batches(workers):
        loader = step_batches(ShapesDataset(100, 0), build_tokenizer(), list(range(100)), global_batch=8, seed=0,
                              rank=0, world_size=1, start_step=0, end_step=4, device=torch.device("cpu"),
                              num_workers=workers)
        return list(loader)

    for a, b in zip(batches(0), batches(2)):
        assert a["step"] == b["step"] and torch.equal(a["position"], b["position"])
        assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["input_ids"], b["input_ids"])
