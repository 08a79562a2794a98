# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The working tree stays small: the tracked files and the untracked, not ignored
ones, at most 23.75 MiB.

The trained pair in benchmarks/models/ takes about 17.5 MB of it; the rest is
code, docs and results. Copies of the tree (clones, CI, GPU machines) stay cheap;
the budget was once exceeded by engine logs committed uncompressed under
benchmarks/results/."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREE_LIMIT = 95 * 2**18  # 23.75 MiB


def _tree_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the tree's files are git's")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_tree_stays_small():
    files = [f for f in _tree_files() if f.is_file()]
    assert len(files) >= 100, f"only {len(files)} files listed: not this repo's tree"
    sizes = sorted(((f.stat().st_size, f) for f in files), reverse=True)
    total = sum(s for s, _ in sizes)
    limit = TREE_LIMIT
    largest = ", ".join(
        f"{f.relative_to(ROOT)} {s / 2**20:.1f} MiB" for s, f in sizes[:5]
    )
    print(
        f"tree: {len(files)} files, {total / 2**20:.2f} MiB (limit {limit / 2**20:.2f})"
    )
    assert total <= limit, (
        f"the tree is {total / 2**20:.2f} MiB, over {limit / 2**20:.2f} MiB "
        f"(gzip logs under benchmarks/results/; largest: {largest})"
    )
