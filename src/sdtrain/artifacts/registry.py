"""Model versions and the production pointer, under ``retrain.models_root``::

    production.json              {"version": "v0002"}: replaced whole, never edited in place
    versions/v0001/unet/         UNet2DConditionModel.save_pretrained (safetensors)
    versions/v0001/scheduler/    the noise schedule
    versions/v0001/manifest.json written last, whole: a version directory without it is incomplete

A reader resolves production.json and loads that version. Because a version is complete
(manifest written) before the pointer can name it, and the pointer is swapped by a rename (a
single object write on object stores), a reader never sees a pointer to a half-written version.
"""

from __future__ import annotations

import json
import posixpath
import re
import tempfile
import uuid
from typing import Any

import pyarrow.fs as pafs
from diffusers import DDPMScheduler, UNet2DConditionModel

from sdtrain.errors import DataError
from sdtrain.storage.filesystems import filesystem_for
from sdtrain.storage.uris import absolute

PRODUCTION_FILE = "production.json"
MANIFEST_FILE = "manifest.json"
_VERSION = re.compile(r"v(\d{4,})")


class ModelRegistry:
    def __init__(self, root: str):
        self.root_uri = absolute(root)
        self.fs, self.root = filesystem_for(self.root_uri)

    def versions(self) -> list[str]:
        """Complete versions (with a manifest), oldest first."""
        return [v for v in self._version_dirs() if self._exists(self._path("versions", v, MANIFEST_FILE))]

    def manifest(self, version: str) -> dict[str, Any]:
        path = self._path("versions", version, MANIFEST_FILE)
        try:
            return json.loads(self._read(path))
        except json.JSONDecodeError as e:
            raise DataError(f"retrain.models_root: {path} is not valid JSON ({e}); restore or remove it") from None

    def production(self) -> str | None:
        pointer = self._path(PRODUCTION_FILE)
        if not self._exists(pointer):
            return None
        text = self._read(pointer)
        try:
            version = json.loads(text)["version"]
        except (json.JSONDecodeError, KeyError, TypeError):
            version = None
        # The name is joined into paths: anything but vNNNN could point outside the registry.
        if not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise DataError(
                f'retrain.models_root: {pointer} must hold {{"version": "vNNNN"}}, not {text[:80]!r}; '
                "point it at a complete version under versions/"
            )
        return version

    def location(self, version: str) -> str:
        """The version's directory (unet/ and scheduler/ inside): usable as ``model.pretrained``, and
        loaded by ``sdtrain.artifacts.loading.load_model``."""
        return posixpath.join(self.root_uri, "versions", version)

    def write_version(self, unet: UNet2DConditionModel, scheduler: DDPMScheduler, manifest: dict[str, Any]) -> str:
        """Write a new version (weights first, manifest last) and return its name."""
        numbers = [int(v[1:]) for v in self._version_dirs()]  # every name matched _VERSION
        version = f"v{max(numbers, default=0) + 1:04d}"
        destination = self._path("versions", version)
        with tempfile.TemporaryDirectory() as local:
            unet.save_pretrained(posixpath.join(local, "unet"))
            scheduler.save_pretrained(posixpath.join(local, "scheduler"))
            self.fs.create_dir(destination)
            pafs.copy_files(local, destination, destination_filesystem=self.fs)
        self._write(posixpath.join(destination, MANIFEST_FILE), json.dumps({"version": version, **manifest}, indent=2))
        return version

    def set_production(self, version: str) -> None:
        if version not in self.versions():
            raise ValueError(f"version {version} is not a complete version under {self.root_uri}")
        self._write(self._path(PRODUCTION_FILE), json.dumps({"version": version}))

    def _version_dirs(self) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self._path("versions"), allow_not_found=True))
        names = [posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory]
        return sorted((n for n in names if _VERSION.fullmatch(n)), key=lambda n: int(n[1:]))

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def _read(self, path: str) -> str:
        with self.fs.open_input_stream(path) as f:
            return f.read().decode()

    def _write(self, path: str, text: str) -> None:
        """Write ``path`` whole: under a temporary name first, then moved into place, so a crash
        mid-write never leaves a truncated file under the real name."""
        self.fs.create_dir(posixpath.dirname(path))
        staged = f"{posixpath.dirname(path)}/.{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp"
        self._write_new(staged, text)
        self.fs.move(staged, path)

    def _write_new(self, path: str, text: str) -> None:
        with self.fs.open_output_stream(path) as f:
            f.write(text.encode())
