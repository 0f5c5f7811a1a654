"""accelport's build backend: setuptools, run on a copy of the checkout.

pip builds a project in place, and setuptools leaves ``build/`` and ``*.egg-info/`` in the
directory it builds, so ``pip install .`` would leave both in a user's checkout (and a stale
``build/lib`` can ship files deleted since). A wheel, an sdist and their metadata are built
here from a temporary copy of the tree instead. An editable install builds in place, as it
must: it points at the checkout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401 - PEP 660's hooks, unchanged: they build in place
    build_editable,
    get_requires_for_build_editable,
    prepare_metadata_for_build_editable,
)

#: Never copied: version control, environments, caches and earlier build outputs.
_SKIP = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "*.pyc")


@contextlib.contextmanager
def _in_copy() -> Iterator[None]:
    source = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="accelport-build-") as tmp:
        copy = os.path.join(tmp, "src")
        shutil.copytree(source, copy, ignore=_SKIP)
        os.chdir(copy)
        try:
            yield
        finally:
            os.chdir(source)


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    # setuptools writes *.egg-info while it answers this one too.
    with _in_copy():
        return list(_setuptools.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_sdist(config_settings: Any = None) -> list[str]:
    with _in_copy():
        return list(_setuptools.get_requires_for_build_sdist(config_settings))


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    out = os.path.abspath(metadata_directory)
    with _in_copy():
        return _setuptools.prepare_metadata_for_build_wheel(out, config_settings)


def build_wheel(wheel_directory: str, config_settings: Any = None, metadata_directory: Any = None) -> str:
    out = os.path.abspath(wheel_directory)
    meta = os.path.abspath(metadata_directory) if metadata_directory else None
    with _in_copy():
        return _setuptools.build_wheel(out, config_settings, meta)


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    out = os.path.abspath(sdist_directory)
    with _in_copy():
        return _setuptools.build_sdist(out, config_settings)
