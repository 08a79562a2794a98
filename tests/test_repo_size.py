# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The working tree a GPU-machine call carries stays small enough for the vLLM
bundle's chunks beside it.

Each call to the device machine carries the tracked files and the untracked,
not ignored ones, plus what it names, at most 64 MiB in all
(../shared/gpu/README.md); setting vLLM up takes calls that carry two 20 MB
chunks of the bundle each. A tree past the rest refuses those calls (it did once,
with engine logs committed uncompressed under benchmarks/results/)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 * 2**20
# Two bundle chunks, install.sh and manifest.txt, and some room for them.
BUNDLE_SHARE = 2 * 20 * 2**20 + 256 * 2**10


def _carried_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the carried files are git's")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_tree_leaves_room_for_two_bundle_chunks():
    files = [f for f in _carried_files() if f.is_file()]
    assert len(files) >= 100, f"only {len(files)} files listed: not this repo's tree"
    sizes = sorted(((f.stat().st_size, f) for f in files), reverse=True)
    total = sum(s for s, _ in sizes)
    limit = CALL_LIMIT - BUNDLE_SHARE
    largest = ", ".join(
        f"{f.relative_to(ROOT)} {s / 2**20:.1f} MiB" for s, f in sizes[:5]
    )
    print(
        f"carried tree: {len(files)} files, {total / 2**20:.2f} MiB (limit {limit / 2**20:.2f})"
    )
    assert total <= limit, (
        f"the tree a device call carries is {total / 2**20:.2f} MiB, over "
        f"{limit / 2**20:.2f} MiB: two bundle chunks no longer fit beside it "
        f"(gzip logs under benchmarks/results/; largest: {largest})"
    )
