# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's own tests with and without the vllm-ddtree plugin, compared test for test.

Installing vllm-ddtree must change nothing for engines that do not ask for
``method="ddtree"``. This runs CPU-runnable test files of vLLM 0.26.0's release
sdist twice in fresh pytest processes, with ``VLLM_PLUGINS=""`` (vLLM loads no
general plugin) and ``VLLM_PLUGINS=ddtree`` (this checkout's plugin, first on
``PYTHONPATH``), and compares the outcome of every test. Not part of CI (it
needs the sdist and takes minutes); see docs/ddtree.md.

    pip download --no-deps --no-binary :all: vllm==0.26.0 -d /tmp/sdist
    python tools/compare_vllm_tests.py --sdist /tmp/sdist/vllm-0.26.0.tar.gz \
        --out /tmp/vllm_tests_cmp [--tests tests/engine/test_arg_utils.py ...]

vLLM's test suite needs a few packages of its own (its conftest imports
``tblib``; pass ``--install-test-deps`` to pip-install the ones listed below).
Both runs set ``HF_HUB_OFFLINE=1`` (tests that need a hub model fail alike) and,
without a GPU, give vLLM's platform a device type (``CPU_SHIM``).
Only the sdist's ``tests/`` folder is unpacked (into ``--out``), so the tests
import the installed vLLM, never the sdist's uncompiled sources. Exit status 1
if any test's outcome differs between the two runs.
"""

import argparse
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# vLLM 0.26.0 test files that run on a CPU-only machine: engine arguments and
# configs, the scheduler (sync and async), spec-decode config and dynamic
# speculative decoding, sampling parameters, the attention backend registry.
DEFAULT_TESTS = (
    "tests/engine/test_arg_utils.py",
    "tests/test_config.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/config/test_speculative_draft_hf_overrides.py",
    "tests/v1/spec_decode/test_dynamic_sd.py",
    "tests/v1/spec_decode/test_dflash_lookahead.py",
    "tests/test_sampling_params.py",
    "tests/test_attention_backend_registry.py",
    "tests/v1/attention/test_attention_backends_selection.py",
)


# Packages vLLM's test suite imports (beyond pytest) for the files above.
TEST_DEPS = ("tblib",)


def unpack_tests(sdist: Path, out: Path) -> Path:
    """The sdist's ``tests/`` folder under ``out`` (a tarball or an unpacked
    source tree)."""
    dest = out / "vllm_tests"
    if (dest / "tests").is_dir():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    if sdist.is_dir():
        subprocess.run(["cp", "-r", str(sdist / "tests"), str(dest)], check=True)
        return dest
    with tarfile.open(sdist) as tar:
        members = [
            m for m in tar.getmembers() if m.name.split("/", 2)[1:2] == ["tests"]
        ]
        for m in members:
            m.name = m.name.split("/", 1)[1]
        tar.extractall(dest, members=members, filter="data")
    return dest


# A pytest plugin for both runs: on a machine without a GPU, vLLM's CUDA build
# finds no device type and EngineArgs fails before any test logic runs.
CPU_SHIM = """
def pytest_configure(config):
    from vllm.platforms import current_platform

    if current_platform.device_type == "":
        type(current_platform).device_type = "cuda"
"""


def run(tests_root: Path, files: list[str], plugin: bool, out: Path) -> dict:
    """{test id: outcome} of one pytest run."""
    mode = "on" if plugin else "off"
    xml = out / f"junit_{mode}.xml"
    # Nothing is downloaded: tests that need a hub model fail the same way in
    # both runs instead of waiting on the network.
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{tests_root}",
        VLLM_PLUGINS="ddtree" if plugin else "",
        HF_HUB_OFFLINE="1",
    )
    (tests_root / "ddtree_cpu_shim.py").write_text(CPU_SHIM)
    start = time.perf_counter()
    with open(out / f"pytest_{mode}.log", "w") as log:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "ddtree_cpu_shim",
                f"--junitxml={xml}",
                *files,
            ],
            cwd=tests_root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    print(
        f"plugin {mode}: {time.perf_counter() - start:.0f} s "
        f"(log {out / f'pytest_{mode}.log'})",
        flush=True,
    )
    if not xml.exists():
        tail = (out / f"pytest_{mode}.log").read_text()[-2000:]
        raise SystemExit(f"pytest wrote no report (plugin {mode}):\n{tail}")
    return outcomes(xml)


def outcomes(xml: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = next(
            (k for k in ("error", "failure", "skipped") if k in kinds), "passed"
        )
        result[test] = outcome
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sdist",
        type=Path,
        required=True,
        help="vllm-0.26.0.tar.gz or its unpacked folder",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tests",
        nargs="*",
        default=list(DEFAULT_TESTS),
        help="test files, relative to the sdist's root",
    )
    parser.add_argument(
        "--install-test-deps",
        action="store_true",
        help=f"pip install {' '.join(TEST_DEPS)} first",
    )
    args = parser.parse_args()
    if args.install_test_deps:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", *TEST_DEPS], check=True
        )
    args.out.mkdir(parents=True, exist_ok=True)
    tests_root = unpack_tests(args.sdist, args.out)
    files = [f for f in args.tests if (tests_root / f).exists()]
    for missing in sorted(set(args.tests) - set(files)):
        print(f"not in this sdist, skipped: {missing}")
    if not files:
        print("no test files to run", file=sys.stderr)
        return 2
    off = run(tests_root, files, plugin=False, out=args.out)
    on = run(tests_root, files, plugin=True, out=args.out)
    differ = sorted(t for t in set(off) | set(on) if off.get(t) != on.get(t))
    for name, res in (("off", off), ("on", on)):
        counts = {k: list(res.values()).count(k) for k in sorted(set(res.values()))}
        print(f"plugin {name}: {len(res)} tests, {counts}")
    for test in differ:
        print(f"DIFFERS {test}: off={off.get(test)} on={on.get(test)}")
    print(f"{len(differ)} of {len(set(off) | set(on))} tests differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
