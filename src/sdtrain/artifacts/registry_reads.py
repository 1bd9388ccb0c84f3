"""The model registry's reads of what never changes once written, each made once per registry object, and the
catalog that keeps copies of them for the next run.

A complete version's ``manifest.json`` is created exclusively, last, and never changed; so is each pointer log entry
(``production_log/00000001.json``). A registry object reads each at most once; ``catalog.json`` holds copies of all
of them as a run knew them, rewritten after each version a run writes. A daily run (or a rollback) then reads the
catalog, one listing of versions/ and of production_log/, and only what was written since: its requests no longer
grow with the years of versions and moves behind it. A registry without the catalog (written before it, or the
catalog unreadable) is read one file at a time as before, and its next version writes the catalog.

What can change is always read afresh: which versions and log entries there are (a listing, every time: a rollback
takes no lock and may append to the log at any moment), production.json, the lock, and whether a version the
pointer is to name is complete. A version directory removed by hand is dropped with its manifest once a listing
misses it; a manifest edited by hand in place is not seen by a registry whose catalog holds it (manifests are never
edited: remove the version, or the catalog with it).
"""

from __future__ import annotations

import copy
import json
import posixpath
import re
from typing import Any

import pyarrow.fs as pafs

from sdtrain.artifacts.conditional_writes import ConditionalStore, RegistryConflict
from sdtrain.artifacts.loading import VERSION_MANIFEST_FILE
from sdtrain.errors import DataError, SdtrainError
from sdtrain.logs import log

CATALOG_FILE = "catalog.json"
LOG_DIR = "production_log"
MANIFEST_FILE = VERSION_MANIFEST_FILE
LOG_ENTRY = re.compile(r"\d{8}\.json")
VERSION = re.compile(r"v(\d{4,})")


class RegistryReads(ConditionalStore):
    """A registry root's versions, manifests and pointer log, each immutable file read once (see the module)."""

    def __init__(self, root: str):
        super().__init__(root)
        self._manifests: dict[str, dict[str, Any]] = {}  # version -> its manifest, as written
        self._complete: set[str] = set()  # versions seen to have a manifest
        self._entries: dict[str, dict[str, Any]] = {}  # log file name -> its entry
        self._catalog: tuple[str | None, str | None] | None = None  # (text, tag) as read; None: not read yet
        self._cataloged: set[str] = set()  # the versions the catalog holds

    def versions(self) -> list[str]:
        """Complete versions (with a manifest), oldest first."""
        self._read_catalog()
        dirs = self._version_dirs()
        for version in dirs:
            if version not in self._complete and self._exists(self._manifest_path(version)):
                self._complete.add(version)
        return [v for v in dirs if v in self._complete]

    def manifest(self, version: str) -> dict[str, Any]:
        if version not in self._manifests:
            path = self._manifest_path(version)
            try:
                self._manifests[version] = json.loads(self._read(path))
            except json.JSONDecodeError as e:
                raise DataError(f"retrain.models_root: {path} is not valid JSON ({e}); restore or remove it") from None
            self._complete.add(version)
        return copy.deepcopy(self._manifests[version])

    def _is_complete(self, version: str) -> bool:
        """Whether ``version`` is a complete version now: one request, never the cache (the pointer may name it)."""
        return bool(VERSION.fullmatch(version)) and self._exists(self._manifest_path(version))

    def _manifest_path(self, version: str) -> str:
        return self._path("versions", version, MANIFEST_FILE)

    def pointer_log(self) -> list[dict[str, Any]]:
        """The moves of the production pointer, oldest first: {seq, from, to, kind, reason, by, at}.
        Append-only: each entry is created exclusively under production_log/ and never changed. Listed afresh on each
        call; only the entries this object has not read yet are read."""
        return [copy.deepcopy(self._entries[name]) for name in self._log_names()]

    def _log_names(self) -> list[str]:
        """The log's file names, oldest first, each one's entry read into the cache."""
        self._read_catalog()
        infos = self.fs.get_file_info(pafs.FileSelector(self._path(LOG_DIR), allow_not_found=True))
        names = sorted(posixpath.basename(i.path) for i in infos if LOG_ENTRY.fullmatch(posixpath.basename(i.path)))
        for gone in [n for n in self._entries if n not in names]:  # never removed: see docs/retraining.md
            del self._entries[gone]
        for name in names:
            if name not in self._entries:
                path = self._path(LOG_DIR, name)
                try:
                    self._entries[name] = json.loads(self._read(path))
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"retrain.models_root: {self._uri(path)} is not valid JSON ({e}); restore it"
                    ) from None
        return names

    def _version_dirs(self) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self._path("versions"), allow_not_found=True))
        names = [posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory]
        dirs = sorted((n for n in names if VERSION.fullmatch(n)), key=lambda n: int(n[1:]))
        # A directory removed by hand takes its manifest with it: a later version may be given its number.
        listed = set(dirs)
        self._complete &= listed
        for gone in [v for v in self._manifests if v not in listed]:
            del self._manifests[gone]
        return dirs

    # --- the catalog: copies of the manifests and log entries, so that a run reads one object, not thousands ------

    def _read_catalog(self) -> None:
        if self._catalog is not None:
            return
        path = self._path(CATALOG_FILE)
        text, tag = self._read_tagged(path)
        self._catalog = (text, tag)
        if text is None:
            return
        try:
            record = json.loads(text)
            manifests, entries = record["manifests"], record["log"]
            if not all(isinstance(d, dict) for d in (manifests, entries, *manifests.values(), *entries.values())):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            log.warning(f"{self._uri(path)} is not a registry catalog: ignored; rewritten with the next version")
            return
        for version, manifest in manifests.items():
            if VERSION.fullmatch(version):
                self._manifests.setdefault(version, manifest)
                self._complete.add(version)
                self._cataloged.add(version)
        for name, entry in entries.items():
            if LOG_ENTRY.fullmatch(name):
                self._entries.setdefault(name, entry)

    def _forget_before_claiming(self, version: str) -> None:
        """Before ``version`` is claimed: a catalog that holds it (its directory was removed by hand, and its number
        is given again) is rewritten without it first, so that no reader takes that manifest for the new version's."""
        self._read_catalog()
        if version not in self._cataloged or version in self._version_dirs():
            return  # not held, or its directory is there: claiming it fails as another writer's (RegistryConflict)
        self._write_catalog()  # the listing above forgot the removed version's manifest
        if version in self._cataloged:
            raise RegistryConflict(
                f"retrain.models_root: {self._uri(self._path(CATALOG_FILE))} holds {version}, removed since, and could "
                f"not be rewritten without it; nothing was written. Remove {CATALOG_FILE} (a copy: it is written again)"
            )

    def _write_catalog(self) -> None:
        """Rewrite the catalog with every complete version's manifest and every log entry (read first where this
        object has not: a run has read them all by then). A copy of what never changes: if another writer replaced
        it meanwhile, or it cannot be written, it is left as it is, and the next run reads what it lacks one by one."""
        try:
            versions = self.versions()
            for version in versions:
                self.manifest(version)  # read into the cache, if this object has not yet
            record = {
                "manifests": {v: self._manifests[v] for v in versions},
                "log": {name: self._entries[name] for name in self._log_names()},
            }
            text = json.dumps(record, separators=(",", ":"))
            assert self._catalog is not None  # read by versions()
            if text == self._catalog[0]:
                return
            path, tag = self._path(CATALOG_FILE), self._catalog[1]
            new_tag = self._create(path, text) if tag is None else self._replace(path, text, tag)
            if new_tag is not None:
                self._catalog, self._cataloged = (text, new_tag), set(versions)
        except (SdtrainError, OSError) as e:
            log.warning(f"{self._uri(self._path(CATALOG_FILE))} not rewritten ({e}): the next run reads more")
