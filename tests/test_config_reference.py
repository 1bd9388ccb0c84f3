"""docs/configuration.md is generated from the config's field docstrings and checked in: it must be
what tools/config_reference.py renders now, and name every key. The README and docs/ link only to
files that exist, and the README's test command is the one CI runs."""

import re

from conftest import REPO

from sdtrain.config.keys import describe_keys
from tools.config_reference import REGENERATE, render_markdown

PAGE = REPO / "docs" / "configuration.md"


def test_the_checked_in_reference_is_what_the_docstrings_render():
    assert PAGE.is_file(), f"docs/configuration.md is missing; generate it: {REGENERATE}"
    assert PAGE.read_text() == render_markdown(), f"docs/configuration.md is out of date; regenerate it: {REGENERATE}"


def test_every_key_of_every_section_is_in_the_reference():
    page = PAGE.read_text()
    rows = describe_keys()
    sections = {key.split(".", 1)[0] for key, _type, _default, _doc in rows}
    assert {"data", "model", "train", "scaling", "run", "failure", "storage", "retrain"} <= sections
    for section in sections:
        assert f"\n## {section}\n" in page, f"docs/configuration.md has no section {section}"
    for key, _type, _default, _doc in rows:
        assert f"| `{key}` |" in page, f"docs/configuration.md does not document {key}; regenerate it: {REGENERATE}"


def _anchors(page) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_readme_and_docs_link_only_to_files_and_headings_that_exist():
    pages = [REPO / "README.md", REPO / "bench" / "README.md"]
    pages += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "bench" / "results").glob("*.md"))
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)} links to {target}"
            assert path.exists(), f"{where}, which does not exist"
            if anchor:
                assert path.suffix == ".md" and anchor in _anchors(path), f"{where}: no such heading"


def test_the_readme_gives_the_commands_that_make_and_ci_run():
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", readme, re.M), f"the README's quick start lost `{command}`"
        assert re.search(rf"^{command.split()[1]}:", makefile, re.M), f"the Makefile has no target for `{command}`"
    assert re.search(r"^make test$", ci, re.M), "CI (.ci/run) no longer runs the README's test command"
