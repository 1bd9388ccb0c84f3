"""The local filesystem as a pyarrow ``PyFileSystem`` whose opens go through a wrapper: the tests count them (and how
many are in flight at once), the benchmarks delay them by a request's round trip."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


class InFlight:
    """A :data:`Wrap` that counts the calls running at once and in all (each takes 20 ms, as a request to object
    storage)."""

    def __init__(self):
        self.lock, self.now, self.most, self.calls = threading.Lock(), 0, 0, 0

    def __call__(self, function):
        def counted(*args, **kwargs):
            with self.lock:
                self.now, self.calls = self.now + 1, self.calls + 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(0.02)
                return function(*args, **kwargs)
            finally:
                with self.lock:
                    self.now -= 1

        return counted


class WrappedLocal(pafs.FileSystemHandler):
    """The local filesystem, each open called through ``wrap(open)``; writes are not taken."""

    def __init__(self, wrap: Wrap):
        self.fs, self.wrap = pafs.LocalFileSystem(), wrap

    def __eq__(self, other):
        return isinstance(other, WrappedLocal)

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "wrapped-local"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def open_input_stream(self, path):  # raw: PyFileSystem applies the caller's compression
        return self.wrap(self.fs.open_input_stream)(path, compression=None)

    def open_input_file(self, path):
        return self.wrap(self.fs.open_input_file)(path)

    def create_dir(self, *a): ...
    def delete_dir(self, *a): ...
    def delete_dir_contents(self, *a): ...
    def delete_root_dir_contents(self, *a): ...
    def delete_file(self, *a): ...
    def move(self, *a): ...
    def copy_file(self, *a): ...
    def open_output_stream(self, *a): ...
    def open_append_stream(self, *a): ...


def wrapped_local(wrap: Wrap) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(WrappedLocal(wrap))
