"""What a non-editable install (the Docker image, a wheel) ships: every file the packages read
at run time that is not Python must be named in ``[tool.setuptools.package-data]``, or the
installed command fails where the checkout works (the simulator's cost models once did)."""

from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("scheduler", "kv_transfer", "actors", "cluster")


def _tracked_data_files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in listed if not f.endswith(".py")]


def test_every_data_file_of_the_packages_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data: dict[str, list[str]] = config["tool"]["setuptools"]["package-data"]
    files = _tracked_data_files()
    assert any(f.endswith(".json") for f in files)  # the cost models are among them
    missing = []
    for path in files:
        package, _, rest = path.partition("/")
        patterns = package_data.get(package, [])
        if not any(fnmatch.fnmatch(rest, pattern) for pattern in patterns):
            missing.append(path)
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
