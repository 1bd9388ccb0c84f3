"""The configuration reference (docs/configuration.md), generated from the config's own field docstrings.

    python -m tools.config_reference > docs/configuration.md

One table per section (key | type | default | description), from the same rows that
``train.py --help`` prints, so the page cannot drift from the code: tests/test_config_reference.py
checks that the checked-in page is what this renders.
"""

from __future__ import annotations

REGENERATE = "python -m tools.config_reference > docs/configuration.md"

_INTRO = f"""\
# Configuration reference

<!-- Generated from the config dataclasses' field docstrings: do not edit by hand.
     Regenerate with: {REGENERATE} -->

This page is generated from the field docstrings of the config dataclasses in
`src/sdtrain/config/`; to change it, change a docstring and run
`{REGENERATE}` (a test fails while the two differ).
`python entrypoints/train.py --help` prints the same keys.

A run's config is a YAML file of sections (`--config`; `entrypoints/train.py` defaults to
`configs/demo.yaml`, `entrypoints/retrain.py` to `configs/retrain.yaml`), then any number of
`key.sub=value` overrides on the command line, each value read as YAML (`train.lr=3e-4`,
`scaling.num_workers=[2,8]`, `model.unet.cross_attention_dim=768`). The whole config is checked
before Ray starts: an unknown key, a wrong type or an impossible value stops the job with one line
that names the key and what is allowed.
"""


def render_markdown() -> str:
    """The whole reference page, as Markdown."""
    from sdtrain.config.keys import describe_keys

    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in describe_keys():
        sections.setdefault(row[0].split(".", 1)[0], []).append(row)
    lines = [_INTRO]
    for section, rows in sections.items():
        lines += [f"## {section}", "", "| key | type | default | description |", "|---|---|---|---|"]
        for key, type_name, default, doc in rows:
            lines.append(f"| `{key}` | {_cell(type_name)} | `{_code_cell(default)}` | {_cell(doc)} |")
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Plain text for a table cell: pipes would end the cell, ``*`` and ``<`` would turn into markup."""
    for char in ("\\", "|", "*", "<"):
        text = text.replace(char, "\\" + char)
    return text


def _code_cell(text: str) -> str:
    """Text inside backticks in a table cell: only the pipe needs escaping there."""
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(render_markdown(), end="")
