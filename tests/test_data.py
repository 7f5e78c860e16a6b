import pytest
import torch

from configs.build import build_tokenizer
from data.loader import StepBatchSampler, step_batches
from data.shapes import (COLORS, POSITIONS, SHAPES, ShapesDataset, all_prompts, analyze, caption,
                         prompt_fidelity, render)


def test_items_are_a_function_of_seed_and_index():
    a, b = ShapesDataset(1000, seed=3), ShapesDataset(1000, seed=3)
    torch.manual_seed(0)
    first = a[17]
    torch.manual_seed(1)
    assert torch.equal(first["latents"], b[17]["latents"]) and first["caption"] == b[17]["caption"]
    other = ShapesDataset(1000, seed=4)
    assert [a[i]["caption"] for i in range(20)] != [other[i]["caption"] for i in range(20)]
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


def shapes_batches(rank: int, world_size: int, start: int, end: int, workers: int = 0) -> list[dict]:
    from configs.build import build_collate
    from configs.schema import load_config
    dataset, tokenizer = ShapesDataset(100, 0), build_tokenizer()
    collate = build_collate(load_config(overrides=["data.caption_dropout=0.5"]), dataset, tokenizer)
    return list(step_batches(dataset, collate, list(range(100)), global_batch=8, seed=0, rank=rank,
                             world_size=world_size, start_step=start, end_step=end, device=torch.device("cpu"),
                             num_workers=workers))


def test_loader_batches_carry_the_step_noise_and_dropped_captions():
    """Noise, noise levels and caption dropout are drawn in the loader from (seed, step, position): rank 1's
    half of the global batch holds positions 4-7, the same draws one rank would make for them."""
    batch = shapes_batches(rank=1, world_size=2, start=3, end=5)[0]
    whole = shapes_batches(rank=0, world_size=1, start=3, end=4)[0]
    assert batch["step"] == 3 and batch["first_position"] == 4
    assert batch["latents"].shape == (4, 3, 32, 32) and batch["text"]["input_ids"].shape == (4, 7)
    for key in ("latents", "noise", "sigma"):
        assert torch.equal(batch[key], whole[key][4:])
    assert torch.equal(batch["text"]["input_ids"], whole["text"]["input_ids"][4:])
    dropped = whole["text"]["input_ids"].eq(0).all(dim=1)
    assert 0 < dropped.sum() < 8  # caption dropout 0.5: some captions became the empty caption (all padding)


def test_worker_processes_change_nothing_in_the_batches():
    from tests.conftest import assert_close
    for a, b in zip(shapes_batches(0, 1, 0, 4), shapes_batches(0, 1, 0, 4, workers=2), strict=True):
        assert a["step"] == b["step"] and a["first_position"] == b["first_position"]
        assert_close({k: v for k, v in a.items() if isinstance(v, (torch.Tensor, dict))},
                     {k: v for k, v in b.items() if isinstance(v, (torch.Tensor, dict))})
