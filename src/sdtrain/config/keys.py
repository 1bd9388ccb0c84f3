"""Every config key with its type, default and docstring: ``train.py --help`` and the generated
docs/configuration.md read them from here."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing

import yaml

from sdtrain.config.coercion import ConfigTree, type_name
from sdtrain.config.schema import Config


def describe_keys(tree: type[ConfigTree] = Config) -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every key of ``tree``'s sections, in declaration order."""
    rows = []
    for name, cls in tree.SECTIONS.items():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n...")
            rows.append((f"{name}.{f.name}", type_name(hints[f.name]), shown, docs.get(f.name, "")))
    return rows


def help_text(tree: type[ConfigTree] = Config) -> str:
    lines = ["config keys (set in the YAML file, or as key.sub=value on the command line):", ""]
    for key, shown_type, default, doc in describe_keys(tree):
        lines.append(f"  {key}  ({shown_type}, default {default})")
        lines.extend("      " + line for line in textwrap.wrap(doc, 88))
    return "\n".join(lines)


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field: the field's docstring."""
    class_def = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(class_def, ast.ClassDef)  # the source of a class is its class statement
    body = class_def.body
    docs = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
