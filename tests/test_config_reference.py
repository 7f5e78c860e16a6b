"""docs/config-reference.md is what configs/reference.py makes of configs/schema.py's comments, and the comment
reading pairs each field with its own comment."""

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import List, Literal, Optional

import pytest

from configs import reference, schema

SOURCE = '''
@dataclass
class Section:  # what the section is for
    trailing: int = 1  # after the field
    # above the field,
    # on two lines
    above: float = 2.0
    continued: bool = True  # a trailing comment
    #                         continued under itself
    # and the next field's own line
    after_continued: str = "x"
    both: int = 3  # the line above is blank, so only this
    bare: int = 4
'''


def test_the_reference_is_regenerated_from_the_schema():
    assert reference.render() == reference.REFERENCE.read_text(), (
        f"docs/config-reference.md differs from configs/schema.py's comments: run `{reference.COMMAND}` and "
        f"commit the result")


def test_every_key_of_the_schema_is_in_the_reference_with_its_default():
    text = reference.render()
    for name, cls in reference.sections(schema.Config):
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(f.type):
                assert f"| `{name}.{f.name}` | " in text, f"{name}.{f.name}"
    assert "| `training.attention_backend` | one of `auto`, `sdpa`," in text
    assert "| `logging.output_dir` | str | `runs/shapes` |" in text
    assert "| `data.datasets[i].loss_weight` | float | `1.0` |" in text
    assert "| `logging.wandb.mode` | one of `online`, `offline` | `online` |" in text


def test_comments_pair_with_their_fields():
    notes, comments = reference.field_comments(SOURCE)
    assert notes == {"Section": "what the section is for"}
    assert comments == {
        ("Section", "trailing"): "after the field",
        ("Section", "above"): "above the field, on two lines",
        ("Section", "continued"): "a trailing comment continued under itself",
        ("Section", "after_continued"): "and the next field's own line",
        ("Section", "both"): "the line above is blank, so only this",
        ("Section", "bare"): ""}


def test_a_field_without_a_comment_is_named():
    @dataclass
    class Section:
        trailing: int = 1
        bare: Optional[List[int]] = None

    @dataclass
    class Root:
        section: Section = field(default_factory=Section)

    assert reference.undocumented(Root, reference.field_comments(SOURCE)[1]) == ["Section.bare"]


def test_types_and_defaults_read_as_yaml():
    assert reference.type_name(Optional[Literal["rms_norm"]]) == "one of `rms_norm`, or null"
    assert reference.type_name(List[float]) == "list of float"
    assert reference.type_name(typing.Optional[str]) == "str, or null"
    assert reference.type_name(typing.Union[int, str, None]) == "int or str, or null"
    assert reference.type_name(typing.Dict[str, float]) == "mapping of str to float"
    f = {x.name: x for x in dataclasses.fields(schema.SamplingConfig)}
    assert reference.default_of(f["guidance_interval"]) == "`[0.0, 1.0]`"
    assert reference.default_of(dataclasses.fields(schema.ModelConfig)[2]) == "`null`"
