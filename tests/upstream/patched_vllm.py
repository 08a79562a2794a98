# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A copy of the installed vLLM 0.26.0 with the upstream series applied, and
pytest runs against it in a subprocess with the DDTree plugin disabled.

The copy takes exactly the files vLLM's own distribution lists (its RECORD),
so the overlay's modules that ``pip install vllm-ddtree`` put into the same
``site-packages/vllm`` are left out and come only from the series. Python files
are copied (``git apply`` edits them); compiled extensions and data files are
symlinked.

``python -m tests.upstream.patched_vllm DEST`` writes the series from this
checkout and the patched copy to ``DEST/vllm`` (the end-to-end tests run it with
``DDTREE_E2E_PATCHED_VLLM=DEST``).
"""

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]

VLLM_VERSION = "0.26.0"
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
# Set to 1 (.ci/run does), the sdist must be had: the series applies whole
# (its edits to vLLM's docs included) and vLLM's own tests are compared.
REQUIRE_SDIST_ENV = "VLLM_DDTREE_REQUIRE_SDIST"

# The DDTree plugin's entry-point name is "ddtree"; vLLM loads only the general
# plugins named in VLLM_PLUGINS.
NO_PLUGINS = "none"

# Test infrastructure for the patched tree (not part of the series): Triton in
# the interpreter without a GPU, as the overlay's conftest.py does.
CONFTEST = """\
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    import vllm.triton_utils as triton_utils

    if not triton_utils.HAS_TRITON:
        triton_utils.triton, triton_utils.tl = triton, tl
        triton_utils.tldevice = tldevice
        triton_utils.HAS_TRITON = True
        triton_utils.importing.HAS_TRITON = True
"""

PYTEST_INI = """\
[pytest]
markers =
    gpu: needs a CUDA GPU (skipped on the CPU)
    slow: long-running
"""


def series_patches(series: Path) -> list[Path]:
    names = (series / "series").read_text().split()
    return [series / name for name in names]


def copy_installed_vllm(dest: Path) -> Path:
    """``dest/vllm``: vLLM's own installed files; returns ``dest``."""
    dist = importlib.metadata.distribution("vllm")
    copied = 0
    for entry in dist.files or ():
        parts = Path(entry).parts
        if not parts or parts[0] != "vllm" or "__pycache__" in parts:
            continue
        src = Path(dist.locate_file(entry))
        if not src.is_file():
            continue
        out = dest / entry
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".py":
            shutil.copyfile(src, out)
        else:
            out.symlink_to(src)
        copied += 1
    assert copied > 1000, f"only {copied} files of vLLM's RECORD found"
    return dest


def sdist_required() -> bool:
    return os.environ.get(REQUIRE_SDIST_ENV) == "1"


def sdist_cache() -> Path:
    """Where the tests keep vLLM's release sdist (``tests/upstream/test_series.py``
    downloads it there)."""
    cache = os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree")
    return Path(cache) / SDIST


def edited_outside_package(series: Path) -> list[str]:
    """Files the series edits (not adds) outside ``vllm/``: vLLM's docs,
    which its wheel, and so the installed copy, does not ship."""
    paths = set()
    for patch in series_patches(series):
        for line in patch.read_text().splitlines():
            if line.startswith("--- a/") and not line.startswith("--- a/vllm/"):
                paths.add(line.removeprefix("--- a/"))
    return sorted(paths)


def add_sdist_files(tree: Path, paths: list[str]) -> list[str]:
    """Copy ``paths`` from the cached release sdist into ``tree``, so the
    series' edits to them apply there too; returns those it could not add:
    all of them without a cached sdist, none with one (a path the sdist lacks
    is an error: the series was made against its files)."""
    sdist = sdist_cache()
    if not sdist.is_file():
        return list(paths)
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        lacking = [path for path in paths if prefix + path not in names]
        if lacking:
            raise FileNotFoundError(f"not in {sdist}: {lacking}")
        for path in paths:
            data = tar.extractfile(prefix + path)
            assert data is not None, path
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_bytes(data.read())
    return [path for path in paths if not (tree / path).is_file()]


def apply_series(tree: Path, series: Path) -> list[str]:
    """Apply every patch of ``series`` in order (``git apply --check``
    first); returns the applied names. Edits to files ``tree`` lacks outside
    ``vllm/`` (vLLM's docs, where :func:`add_sdist_files` found no sdist)
    are left out, and said so, only for a developer offline: with the sdist
    cached, or REQUIRE_SDIST_ENV set, a missing file is an error."""
    applied = []
    # Inside a git work tree, ``git apply`` takes paths from that tree's root
    # and skips those outside the current folder without an error: stop its
    # repository search above ``tree``.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.resolve().parent))
    absent = [p for p in edited_outside_package(series) if not (tree / p).is_file()]
    if absent:
        if sdist_cache().is_file() or sdist_required():
            raise FileNotFoundError(
                f"not in {tree}, so the series' edits to them would be left out "
                f"({sdist_cache()} exists or {REQUIRE_SDIST_ENV}=1): {absent}"
            )
        print(f"not in {tree}, so the series' edits to them are left out: {absent}")
    excludes = [f"--exclude={path}" for path in absent]
    for patch in series_patches(series):
        for args in (["--check", *excludes], excludes):
            proc = subprocess.run(
                ["git", "apply", *args, str(patch.resolve())],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert proc.returncode == 0, (
                f"git apply {args} {patch.name}:\n{proc.stderr}"
            )
        applied.append(patch.name)
    return applied


def add_test_infra(tree: Path) -> None:
    (tree / "conftest.py").write_text(CONFTEST)
    (tree / "pytest.ini").write_text(PYTEST_INI)


class Outcome(NamedTuple):
    passed: set[str]
    failed: set[str]
    skipped: set[str]
    output: str


def run_pytest(
    cwd: Path,
    args: list[str],
    pythonpath: list[Path],
    timeout: int,
    junit: Path,
    extra_env: dict[str, str] | None = None,
) -> Outcome:
    """pytest in a fresh process with the plugin disabled; per-test outcomes
    from its JUnit report (a skipped test is never a pass)."""
    env = dict(os.environ, **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env["VLLM_PLUGINS"] = NO_PLUGINS
    env.setdefault("TRITON_INTERPRET", "1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert junit.is_file(), f"pytest wrote no report (rc {proc.returncode}):\n{output}"
    passed, failed, skipped = set(), set(), set()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is not None:
            skipped.add(name)
        else:
            passed.add(name)
    return Outcome(passed, failed, skipped, output)


def build_patched_vllm(dest: Path) -> list[str]:
    """The series from this checkout, applied to a copy of the installed vLLM
    in ``dest``; returns the applied patch names."""
    sys.path.insert(0, str(ROOT / "upstream"))
    try:
        import make_series
    finally:
        sys.path.pop(0)
    series = dest / "series"
    make_series.build(series)
    copy_installed_vllm(dest)
    add_sdist_files(dest, edited_outside_package(series))
    applied = apply_series(dest, series)
    added = [
        make_series.upstream_path(path)
        for patch in make_series.PATCHES
        for path in patch.files
    ]
    missing = [path for path in added if not (dest / path).is_file()]
    assert not missing, f"the series' files missing after git apply: {missing}"
    return applied


def main() -> None:
    parser = argparse.ArgumentParser(description=build_patched_vllm.__doc__)
    parser.add_argument("dest", type=Path, help="an empty or missing folder")
    dest = parser.parse_args().dest.resolve()
    if dest.exists() and any(dest.iterdir()):
        parser.error(f"{dest} is not empty")
    for name in build_patched_vllm(dest):
        print(f"applied {name}")
    print(f"patched vLLM in {dest / 'vllm'}")


if __name__ == "__main__":
    main()
