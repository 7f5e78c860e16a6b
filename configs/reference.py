"""docs/config-reference.md, generated from configs/schema.py: every section and key with its type, default and
choices, and the comment the schema gives it. Each field's comment is the one at the end of its line (with the
lines that continue it, aligned under it) or the comment lines right above it; a field without one is an error,
since the schema's comments are the reference.

    python -m configs.reference            # rewrite docs/config-reference.md
    python -m configs.reference --check    # exit 1 if docs/config-reference.md differs (tests/test_docs.py)
"""

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

from configs import schema

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
COMMAND = "python -m configs.reference"


def comments_by_line(source: str) -> tuple[dict[int, tokenize.TokenInfo], set[int]]:
    """The comment token of each line, and the lines that hold code."""
    comments, code = {}, set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER):
            code.update(range(token.start[0], token.end[0] + 1))
    return comments, code


def text_of(comment: tokenize.TokenInfo) -> str:
    return comment.string.lstrip("#").strip()


def text_column(comment: tokenize.TokenInfo) -> int:
    """Where the comment's words start: a continuation line aligns its words under the first line's."""
    return comment.start[1] + len(comment.string) - len(comment.string.lstrip("#").lstrip())


def field_comments(source: str) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """Per class, the comment after `class X:`; per (class, field), the field's comment."""
    comments, code = comments_by_line(source)
    notes, trailing, continued = {}, {}, set()
    classes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    fields = [(cls, node) for cls in classes for node in cls.body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    for cls, node in fields:  # the comment at the end of the line, and the lines aligned under it
        if node.end_lineno in comments:
            first, line = comments[node.end_lineno], node.end_lineno + 1
            lines = [text_of(first)]
            while line in comments and line not in code and text_column(comments[line]) == text_column(first):
                lines.append(text_of(comments[line]))
                continued.add(line)
                line += 1
            trailing[cls.name, node.target.id] = lines
    result = {}
    for cls, node in fields:  # the comment lines right above, not continuing the field before
        above, line = [], node.lineno - 1
        while line in comments and line not in code and line not in continued:
            above.insert(0, text_of(comments[line]))
            line -= 1
        result[cls.name, node.target.id] = " ".join(above + trailing.get((cls.name, node.target.id), []))
    for cls in classes:
        if cls.lineno in comments:
            notes[cls.name] = text_of(comments[cls.lineno])
    return notes, result


def type_name(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        inner = " or ".join(type_name(a) for a in args if a is not type(None))
        return f"{inner}, or null" if type(None) in args else inner
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (list, typing.List):
        return f"list of {type_name(args[0])}"
    if origin in (dict, typing.Dict):
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if dataclasses.is_dataclass(annotation):
        return "entries (below)"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def default_of(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return f"`{json.dumps(value)}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def sections(cls, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted name, dataclass) of every section under cls, depth first in the schema's order; a list of
    dataclasses (data.datasets) is a section of its own, `name[i]`."""
    found = []
    for f in dataclasses.fields(cls):
        inner = typing.get_args(f.type)[0] if typing.get_origin(f.type) in (list, typing.List) else f.type
        if dataclasses.is_dataclass(inner):
            name = f"{prefix}{f.name}" + ("[i]" if inner is not f.type else "")
            found += [(name, inner), *sections(inner, f"{name}.")]
    return found


def undocumented(root, comments: dict[tuple[str, str], str]) -> list[str]:
    """The fields under root (sections aside) that have no comment."""
    return [f"{cls.__name__}.{f.name}" for _, cls in sections(root) for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(f.type) and not comments.get((cls.__name__, f.name))]


def render() -> str:
    notes, comments = field_comments(inspect.getsource(schema))
    missing = undocumented(schema.Config, comments)
    if missing:
        raise ValueError(f"configs/schema.py: {', '.join(missing)} ha{'ve' if len(missing) > 1 else 's'} no comment; "
                         f"every field says, in a comment on its line or above it, what it trades off")
    intro = (f"Generated from the comments of `configs/schema.py` by `{COMMAND}`; do not edit by hand (a test "
             f"fails when this file and the schema differ). A config is YAML over these sections; any key can be "
             f"overridden on the command line as `section.key=value` (docs/training.md). Where a default is `null`, "
             f"the key's comment says what decides the value.")
    out = ["# Config reference", "", textwrap.fill(intro, 110, break_on_hyphens=False, break_long_words=False), ""]
    out += ["Sections: " + ", ".join(f"[`{name}`](#{anchor(name)})" for name, _ in sections(schema.Config)), ""]
    for name, cls in sections(schema.Config):
        out += [f"## `{name}`", ""]
        if cls.__name__ in notes:
            out += [notes[cls.__name__][0].upper() + notes[cls.__name__][1:] + ".", ""]
        out += ["| key | type | default | what it does and trades off |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type):
                continue  # its own section
            comment = comments[cls.__name__, f.name].replace("|", "\\|")
            out.append(f"| `{name}.{f.name}` | {type_name(f.type)} | {default_of(f)} | {comment} |")
        out.append("")
    out += ["## Renamed keys", "", "A config or command line that uses an old name stops with the new one:", "",
            "| old | new |", "|---|---|"]
    out += [f"| `{old}` | `{new}` |" for old, new in schema.RENAMED.items()]
    out += [f"| `{key}={old}` | `{key}={new}` |" for (key, old), new in schema.RENAMED_VALUES.items()]
    return "\n".join(out) + "\n"


def anchor(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config-reference.md is out of date")
    text = render()
    if parser.parse_args().check:
        if REFERENCE.is_file() and REFERENCE.read_text() == text:
            return 0
        print(f"{REFERENCE} is out of date with configs/schema.py: run `{COMMAND}`", file=sys.stderr)
        return 1
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
