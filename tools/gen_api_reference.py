"""Write docs/api.md, the API reference of ckptd's public surface, from the docstrings.

Usage:
    python tools/gen_api_reference.py            (re)write docs/api.md
    python tools/gen_api_reference.py --check    exit 1 if docs/api.md differs from what would be written
    python tools/gen_api_reference.py --stdout   print the reference instead of writing it

What is documented is the list MODULES below, in its order: for each module the objects it names
(or, for None, the module's `__all__`, else the public classes and functions defined in it), with
their signatures, docstrings, fields and public methods. A module that is not in this version of
ckptd is skipped with a note; so is one whose optional library (transformers, lightning, ...) is
not installed, and then --check exits 3 (it cannot tell whether the file is stale). Standard
library only (importlib, inspect, ast, tokenize); the output holds no path, date or address, so
it is the same on every machine that has the same libraries installed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import io
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "docs" / "api.md"
COMMAND = "python tools/gen_api_reference.py"
SIGNATURE_WIDTH = 100  # a signature longer than this is written one parameter per line


@dataclass(frozen=True)
class Section:
    """One module of the reference.

    module: its import name. names: the objects to document, in this order; None takes the
    module's `__all__` (else its public classes and functions, in source order). extra: the pip
    extra that installs its optional library, named in the note when it is missing. required:
    the reference fails, instead of noting a skip, when the module cannot be imported.
    """

    module: str
    names: tuple[str, ...] | None = None
    extra: str = ""
    required: bool = False


# The public surface, one entry per module. Modules being written elsewhere are listed already:
# they are skipped until they exist (then run this script again).
MODULES: tuple[Section, ...] = (
    Section(
        "ckptd.client",
        ("CheckpointClient", "ClientOptions", "SaveHandle", "DurableInfo", "CheckpointInfo",
         "CheckpointError", "CheckpointNotFound", "DaemonUnavailable", "InvalidState"),
        required=True,
    ),
    Section(
        "ckptd.client.layout",
        ("LayoutRules", "Rule", "RankCoords", "Split", "Fused", "PaddedVocab", "Replicated",
         "LayoutError", "layout_key", "verify_replicated"),
        required=True,
    ),
    Section("ckptd.client.preemption", ("Preemption", "PreemptionSave"), required=True),
    Section("ckptd.integrations.transformers", extra="hf"),
    Section("ckptd.integrations.accelerate", extra="hf"),
    Section("ckptd.integrations.lightning", extra="lightning"),
    Section("ckptd.integrations.peft", extra="peft"),
    Section("ckptd.integrations.dcp"),
    Section("ckptd.integrations.deepspeed"),
    Section("ckptd.integrations.torchtitan"),
    Section("ckptd.offline"),
)


class ApiReferenceError(Exception):
    """The reference cannot be written as MODULES asks (a listed name that does not exist)."""


@dataclass(frozen=True)
class Skipped:
    """A listed module left out of the reference, and why. missing_library: an optional library
    is not installed here (the file cannot be judged stale or not)."""

    module: str
    reason: str
    missing_library: bool


# ------------------------------------------------------------------ importing


def import_section(section: Section) -> ModuleType | Skipped:
    """The section's module, or why it is skipped. Any other import error propagates: a module of
    ckptd that is present but broken must fail the reference, not vanish from it."""
    try:
        return importlib.import_module(section.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if section.required:
            raise
        if missing == section.module or section.module.startswith(missing + "."):
            return Skipped(section.module, "not in this version of ckptd", missing_library=False)
        extra = f" (`pip install 'ckptd[{section.extra}]'`)" if section.extra else ""
        return Skipped(section.module, f"needs `{missing}`, which is not installed{extra}", missing_library=True)


def public_names(module: ModuleType) -> list[str]:
    """The module's `__all__`, else its public classes and functions in source order."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    own = [
        (name, obj) for name, obj in vars(module).items()
        if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__
    ]
    return [name for name, obj in sorted(own, key=lambda item: _first_line(item[1]))]


def _first_line(obj: Any) -> int:
    try:
        return inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):  # no source (a C type): after the others, in name order
        return sys.maxsize


# ------------------------------------------------------------------ signatures


def _annotation_text(annotation: Any) -> str:
    """Annotations stay as written where the module postpones them (strings), else their name."""
    if isinstance(annotation, str):
        if len(annotation) > 1 and annotation[0] == annotation[-1] and annotation[0] in "'\"":
            return annotation[1:-1]  # written quoted in the source: 'CheckpointClient'
        return annotation
    return inspect.formatannotation(annotation)


def _default_text(default: Any) -> str:
    if isinstance(default, (set, frozenset)):  # a set's order follows string hashing, which changes from run to run
        items = ", ".join(sorted(repr(item) for item in default))
        return f"{type(default).__name__}({{{items}}})" if items else f"{type(default).__name__}()"
    text = repr(default)
    return "..." if " at 0x" in text else text  # an address would differ from run to run


def _parameter_texts(signature: inspect.Signature, drop_first: bool) -> list[str]:
    """Each parameter as written in a def, with the "/" and "*" markers; names starting with "_"
    (internal, e.g. test hooks) are left out."""
    params = list(signature.parameters.values())[1 if drop_first else 0:]
    texts: list[str] = []
    star_written = False
    for i, param in enumerate(params):
        if param.kind is param.KEYWORD_ONLY and not star_written:
            texts.append("*")
            star_written = True
        if param.kind is param.VAR_POSITIONAL:
            star_written = True
        if not param.name.startswith("_"):
            prefix = "*" if param.kind is param.VAR_POSITIONAL else "**" if param.kind is param.VAR_KEYWORD else ""
            text = prefix + param.name
            if param.annotation is not param.empty:
                text += ": " + _annotation_text(param.annotation)
            if param.default is not param.empty:
                text += (" = " if param.annotation is not param.empty else "=") + _default_text(param.default)
            texts.append(text)
        last_positional = param.kind is param.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not param.POSITIONAL_ONLY)
        if last_positional:
            texts.append("/")
    return texts


def format_signature(name: str, obj: Callable[..., Any], *, drop_first: bool = False, constructor: bool = False) -> str | None:
    """`name(parameters) -> return`, wrapped one parameter per line when long; None when the
    callable has no signature that inspect can read. drop_first: leave out `self` or `cls`.
    constructor: a class, whose `-> None` is left out."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = _parameter_texts(signature, drop_first)
    returns = ""
    if signature.return_annotation is not signature.empty and not constructor:
        returns = " -> " + _annotation_text(signature.return_annotation)
    one_line = f"{name}({', '.join(params)}){returns}"
    if len(one_line) <= SIGNATURE_WIDTH or not params:
        return one_line
    body = "".join(f"    {p},\n" for p in params)
    return f"{name}(\n{body}){returns}"


# ------------------------------------------------------------------ fields and attributes


def _trailing_comments(source: str) -> dict[int, str]:
    """Line number (1-based, within `source`) -> the text of a comment that ends that line."""
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    return comments


def class_attributes(cls: type) -> list[tuple[str, str, str]]:
    """(name, annotation, comment) of the public fields declared in the class body (dataclass and
    NamedTuple fields) and of the public attributes its __init__ assigns to self, in source order."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return []
    tree = ast.parse(source)
    comments = _trailing_comments(source)
    node = tree.body[0]
    if not isinstance(node, ast.ClassDef):
        return []
    found: dict[str, tuple[str, str, str]] = {}
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            name = statement.target.id
            if not name.startswith("_"):
                found[name] = (name, ast.unparse(statement.annotation), comments.get(statement.end_lineno or statement.lineno, ""))
        if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
            for inner in ast.walk(statement):
                if not isinstance(inner, (ast.Assign, ast.AnnAssign)):
                    continue
                for target, annotation in _self_targets(inner):
                    if not target.startswith("_") and target not in found:
                        found[target] = (target, annotation, comments.get(inner.end_lineno or inner.lineno, ""))
    return list(found.values())


def _self_targets(node: ast.Assign | ast.AnnAssign) -> list[tuple[str, str]]:
    """(name, annotation) of each `self.<name>` that the statement assigns (`self.a, self.b = ...`
    included)."""
    if isinstance(node, ast.Assign):
        targets, annotation = node.targets, ""
    else:
        targets, annotation = [node.target], ast.unparse(node.annotation)
    found = []
    for target in targets:
        for element in target.elts if isinstance(target, ast.Tuple) else [target]:
            if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and element.value.id == "self":
                found.append((element.attr, annotation))
    return found


# ------------------------------------------------------------------ markdown


def _escape(text: str) -> str:
    """Markdown-safe prose: backslashes and "<" kept literal outside `code spans`, and a line that
    would start a heading or a quote kept a plain line."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("\\", "\\\\").replace("<", "&lt;")
    lines = "`".join(parts).split("\n")
    return "\n".join("\\" + line if line.lstrip().startswith(("#", ">")) else line for line in lines)


def docstring_markdown(doc: str | None, *, dedent: bool = True) -> str:
    """A docstring as markdown: prose escaped, blocks indented by 4 spaces kept as code blocks.

    dedent: remove the indentation of the docstring's body (that of its def or class); a
    module's docstring has none, so an indented line there is code and keeps its indentation.
    """
    if not doc:
        return "*No docstring.*"
    text = inspect.cleandoc(doc) if dedent else doc.expandtabs().strip("\n").rstrip()
    blocks = text.split("\n\n")
    out = []
    for block in blocks:
        lines = block.split("\n")
        if all(line.startswith("    ") or not line.strip() for line in lines):
            out.append(block)
        else:
            out.append(_escape(block))
    return "\n\n".join(out)


def _own_doc(obj: Any) -> str | None:
    """The object's own docstring (not one inherited from a base class)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    if inspect.isclass(obj) and hasattr(obj, "__dataclass_fields__") and doc.startswith(obj.__name__ + "("):
        return None  # the signature that @dataclass writes where the class has no docstring
    return doc


def _code(text: str) -> list[str]:
    return ["```python", text, "```", ""]


def _anchor(text: str) -> str:
    """The anchor GitHub makes for a heading."""
    kept = "".join(c for c in text.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


# ------------------------------------------------------------------ rendering


def render_function(name: str, func: Callable[..., Any], level: str) -> list[str]:
    lines = [f"{level} `{name}`", ""]
    signature = format_signature(name, func)
    if signature is not None:
        lines += _code(signature)
    return lines + [docstring_markdown(_own_doc(func)), ""]


def render_class(name: str, cls: type) -> list[str]:
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    lines = [f"### class `{name}`", ""]
    constructor = format_signature(name, cls, constructor=True) if "__init__" in cls.__dict__ or _declares_fields(cls) else None
    if constructor is not None:
        lines += _code(constructor)
        if bases:
            lines += ["Bases: " + ", ".join(f"`{b}`" for b in bases) + ".", ""]
    else:
        lines += _code(f"class {name}({', '.join(bases)})" if bases else f"class {name}")
    lines += [docstring_markdown(_own_doc(cls)), ""]
    if "__enter__" in cls.__dict__:
        lines += [f"A context manager: `with {name}(...) as x:` calls `close()` on exit." if "close" in cls.__dict__
                  else f"A context manager (`with {name}(...) as x:`).", ""]
    attributes = class_attributes(cls)
    if attributes:
        lines += ["Fields and attributes:", ""]
        for attr, annotation, comment in attributes:
            typed = f"`{attr}: {annotation}`" if annotation else f"`{attr}`"
            lines.append(f"- {typed}" + (f" — {_escape(comment)}" if comment else ""))
        lines.append("")
    for member_name, member in cls.__dict__.items():
        if member_name.startswith("_"):
            continue
        qualified = f"{name}.{member_name}"
        if isinstance(member, property):
            returns = ""
            if member.fget is not None:
                annotation = inspect.signature(member.fget).return_annotation
                if annotation is not inspect.Signature.empty:
                    returns = ": " + _annotation_text(annotation)
            lines += [f"#### `{qualified}`", ""] + _code(f"{qualified}{returns}  # property") + [docstring_markdown(member.__doc__), ""]
        elif isinstance(member, (staticmethod, classmethod)):
            func = member.__func__
            signature = format_signature(qualified, func, drop_first=isinstance(member, classmethod))
            kind = "staticmethod" if isinstance(member, staticmethod) else "classmethod"
            lines += [f"#### `{qualified}`", ""] + _code(f"@{kind}\n{signature}") + [docstring_markdown(_own_doc(func)), ""]
        elif inspect.isfunction(member):
            signature = format_signature(qualified, member, drop_first=True)
            lines += [f"#### `{qualified}`", ""] + (_code(signature) if signature else []) + [docstring_markdown(_own_doc(member)), ""]
    return lines


def _declares_fields(cls: type) -> bool:
    return hasattr(cls, "__dataclass_fields__") or hasattr(cls, "_fields")


def render_object(module: ModuleType, name: str) -> list[str]:
    if not hasattr(module, name):
        raise ApiReferenceError(f"{module.__name__} has no {name!r}: fix its entry in MODULES ({COMMAND})")
    obj = getattr(module, name)
    if inspect.isclass(obj):
        return render_class(name, obj)
    if callable(obj):
        return render_function(name, obj, "###")
    return [f"### `{name}`", ""] + _code(f"{name} = {_default_text(obj)}")


def render(sections: tuple[Section, ...] = MODULES) -> tuple[str, list[Skipped]]:
    """The whole reference as markdown, and the modules it left out."""
    rendered: list[tuple[str, list[str]]] = []
    skipped: list[Skipped] = []
    for section in sections:
        module = import_section(section)
        if isinstance(module, Skipped):
            skipped.append(module)
            continue
        names = list(section.names) if section.names is not None else public_names(module)
        body = [f"## `{section.module}`", "", docstring_markdown(module.__doc__, dedent=False), ""]
        for name in names:
            body += render_object(module, name)
        rendered.append((section.module, body))
    lines = [
        "# API reference",
        "",
        f"Generated from the docstrings by `{COMMAND}`; do not edit this file by hand.",
        "`tests/test_api_reference.py` fails when it no longer matches the code: run the command again.",
        "Parameters whose names start with `_` are internal and not shown.",
        "",
        "Modules:",
        "",
    ]
    lines += [f"- [`{name}`](#{_anchor(name)})" for name, _ in rendered]
    for skip in skipped:
        lines.append(f"- `{skip.module}`: not documented here, {skip.reason}")
    lines.append("")
    for _, body in rendered:
        lines += body
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n", skipped


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/api.md from the docstrings of ckptd's public API.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale, 3 if an optional library is missing")
    mode.add_argument("--stdout", action="store_true", help="print the reference instead of writing docs/api.md")
    args = parser.parse_args(argv)
    try:
        text, skipped = render()
    except ApiReferenceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for skip in skipped:
        print(f"note: {skip.module} skipped: {skip.reason}", file=sys.stderr)
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current == text:
            return 0
        if any(skip.missing_library for skip in skipped):
            print("cannot check docs/api.md: an optional library is missing here (see the notes above); "
                  "install ckptd's extras ('.[test]') and run the check again", file=sys.stderr)
            return 3
        diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/api.md (committed)", "docs/api.md (generated)", lineterm="", n=1)
        shown = list(diff)[:60]
        print("\n".join(shown), file=sys.stderr)
        print(f"docs/api.md is stale: run `{COMMAND}` and commit the result", file=sys.stderr)
        return 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
