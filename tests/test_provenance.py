"""code_version(): the environment's commit, else the git checkout the module is imported from (real git)."""

import importlib.util
import os
import shutil
import subprocess

import pytest

from sdtrain.artifacts import provenance
from sdtrain.artifacts.provenance import COMMIT_ENV, code_version


def _import_copy(directory):
    """provenance.py copied into ``directory`` and imported from there."""
    path = directory / "provenance.py"
    shutil.copy(provenance.__file__, path)
    spec = importlib.util.spec_from_file_location("provenance_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(directory, *args):
    # No HOME: the user's git config (signing, hooks) stays out of it.
    identity = {f"GIT_{who}_{what}": "t@t" for who in ("AUTHOR", "COMMITTER") for what in ("NAME", "EMAIL")}
    env = {"PATH": os.environ["PATH"], **identity}
    result = subprocess.run(["git", *args], cwd=directory, env=env, check=True, capture_output=True, text=True)
    return result.stdout.strip()


@pytest.fixture
def no_commit_env(monkeypatch):
    monkeypatch.delenv(COMMIT_ENV, raising=False)


def test_the_environment_names_the_commit_first(monkeypatch):
    monkeypatch.setenv(COMMIT_ENV, "0123abc")
    assert code_version() == "0123abc"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_git_checkout_names_its_head(tmp_path, no_commit_env):
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    module = _import_copy(package)
    _git(tmp_path, "init", "-q")
    assert module.code_version() is None  # untracked: no commit has this code
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert module.code_version() == head and len(head) == 40


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_an_installed_copy_inside_a_checkout_names_nothing(tmp_path, no_commit_env):
    """A .venv within a checkout is inside its work tree, but its HEAD need not be the installed code."""
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    site = tmp_path / ".venv" / "site-packages" / "pkg"
    site.mkdir(parents=True)
    assert _import_copy(site).code_version() is None


def test_no_checkout_or_no_git_names_nothing(tmp_path, monkeypatch, no_commit_env):
    module = _import_copy(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path either
    assert module.code_version() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert module.code_version() is None
