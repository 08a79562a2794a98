# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The upstream series (upstream/series/), tested as applied (CPU).

* upstream/make_series.py places every module of the package in the series,
  and its ``--check`` tells a stale series; every file the series adds equals
  the package's file.
* It applies with ``git apply``, in order, to a copy of the installed vLLM
  0.26.0, and in that copy, with the DDTree plugin disabled
  (``VLLM_PLUGINS=none``), the tests the series adds pass, and so do the
  checks of its edits to vLLM's files (tests/upstream/applied_wiring.py),
  which fail on stock vLLM.
* Its edits to vLLM's docs (from the release sdist, which the patched copy
  must have unless a developer is offline without REQUIRE_SDIST_ENV) land,
  and on the sdist's source tree with the series applied vLLM's pre-commit
  check of the attention backends' table passes.
* vLLM 0.26.0's own scheduler, spec-decode and config tests (from its release
  sdist) pass and fail the same with and without the series, and those of
  them that cover the series' edits (REQUIRED_VLLM_TESTS) pass on both.
"""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

from tests.upstream import patched_vllm as pv

ROOT = pv.ROOT
WIRING = ROOT / "tests" / "upstream" / "applied_wiring.py"
WIRING_IN_TREE = "tests/upstream_applied/test_ddtree_wiring.py"
# The plugin's source, as text beside the checks (which compare the DFlash
# steps it adds on stock vLLM with the patched DFlash's; they never import it).
GLUE = ROOT / "vllm_ddtree" / "glue.py"
GLUE_IN_TREE = "tests/upstream_applied/ddtree_plugin_glue.py.txt"

# Floors: what the runs pass today, less a margin for tests the package's
# authors may merge or drop. A run that passes fewer means tests went missing.
MIN_SERIES_PASSED = 600
MIN_WIRING_PASSED = 66
MIN_VLLM_PASSED = 210

# vLLM's tests that exercise what the series edits (the scheduler, speculative
# decoding, engine arguments and configs) and collect on the CPU; the
# spec-decode files left out build GPU engines at collection.
VLLM_TESTS = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/spec_decode/test_dflash_lookahead.py",
    "tests/v1/spec_decode/test_dynamic_sd.py",
    "tests/v1/spec_decode/test_ngram.py",
    "tests/v1/spec_decode/test_vocab_mapping.py",
    "tests/v1/spec_decode/test_mtp.py",
    "tests/v1/spec_decode/test_rejection_sampler_utils.py",
    "tests/config",
    "tests/test_config.py",
    "tests/test_attention_backend_registry.py",
)
# vLLM's tests of what the series edits, which must pass on both copies (the
# equal-results check alone would pass were they to fail alike): DFlash's
# scheduler lookahead and the spec-decode stats, padding and structured-output
# scheduling (patch 6), dynamic speculation's schedule lookup (patch 8), the
# speculative config (patch 5).
_REQUIRED_BY_FILE = {
    "tests/v1/spec_decode/test_dflash_lookahead.py": (
        "test_dflash_prefill_reserves_lookahead_blocks",
        "test_dflash_first_prefill_query_window_fits_allocated_blocks",
        "test_dflash_drafter_window_reserves_bonus_token",
    ),
    "tests/v1/core/test_scheduler.py": (
        *(
            "test_schedule_spec_decoding_stats"
            f"[spec_tokens{i}-output_tokens{i}-expected{i}]"
            for i in range(6)
        ),
        "test_spec_decoding_stats_empty_output",
        "test_no_spec_tokens_scheduled_for_prefill_chunks",
        "test_spec_decode_padding_first_decode_step",
        "test_spec_decode_padding_skipped_with_prefill_in_batch",
        "test_schedule_skip_tokenizer_init_structured_output_request",
        "test_abort_request_when_structured_output_fsm_cannot_advance",
    ),
    "tests/v1/spec_decode/test_dynamic_sd.py": (
        "test_scheduler_initializes_dynamic_sd_lookup_from_speculative_config",
        "test_scheduler_uses_dsd_k_based_on_number_of_scheduled_requests",
        "test_scheduler_clamps_dsd_k_to_runtime_num_speculative_tokens",
        "test_scheduler_falls_back_to_static_k_when_dsd_not_configured",
        "test_dynamic_sd_uses_batch_size_schedule",
    ),
    "tests/test_config.py": (
        "test_draft_sample_method_probabilistic_is_accepted",
        "test_draft_sample_method_gumbel_is_rejected",
    ),
    "tests/config/test_speculative_draft_hf_overrides.py": (
        "test_callable_overrides_reach_the_draft_config",
    ),
}
REQUIRED_VLLM_TESTS = tuple(
    f"{path}::{test}" for path, tests in _REQUIRED_BY_FILE.items() for test in tests
)
# The series' edits to vLLM's docs (files its wheel does not ship, so the
# patched tree takes them from the sdist): a line each edit adds.
DOCS_EDITS = {
    "docs/design/attention_backends.md": "| `TREE_ATTN` |",
    "docs/features/speculative_decoding/README.md": "DDTree",
}


def _junit_name(node_id: str) -> str:
    """A pytest node id as run_pytest names it (JUnit: the module, or
    module.Class, dotted; then the test)."""
    path, _, rest = node_id.partition("::")
    module = path.removesuffix(".py").replace("/", ".")
    *classes, test = rest.split("::")
    return "::".join([".".join([module, *classes]), test])


# A pytest plugin for vLLM's tests on a CPU-only machine: EngineArgs and
# ModelConfig ask the platform for a device type, which is empty there (the
# overlay's own tests do the same).
CPU_DEVICE_TYPE = """\
from vllm.platforms import current_platform

if current_platform.device_type == "":
    type(current_platform).device_type = "cuda"
"""
# vLLM's scheduler tests build their configs from facebook/opt-125m (config and
# tokenizer only, no weights). Both runs read a stand-in from a private,
# offline Hugging Face cache: OPT-125m's architecture values and a byte-level
# tokenizer, so the runs need no Hugging Face access and see the same model.
OPT_125M = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "activation_function": "relu",
    "enable_bias": True,
    "layer_norm_elementwise_affine": True,
}


def _model_config(name: str) -> dict:
    return json.loads(
        (ROOT / "benchmarks" / "model_configs" / name / "config.json").read_text()
    )


# The models vLLM's tests name that the cache holds. tests/v1/spec_decode/
# test_dflash_lookahead.py (the scheduler's lookahead for DFlash, which the
# series edits) builds a Qwen3-8B target and its z-lab DFlash drafter: the
# repository's Qwen3-8B config.json and its DFlash-8B-shaped drafter
# (benchmarks/model_configs/) stand in. The other models vLLM's tests name
# (llava-1.5, MiMo, the config tests' dozens) have no config.json here to
# copy, so their tests still fail alike on both runs.
OFFLINE_MODELS = {
    "facebook/opt-125m": lambda: OPT_125M,
    "Qwen/Qwen3-8B": lambda: _model_config("qwen3_8b"),
    "z-lab/Qwen3-8B-DFlash-b16": lambda: _model_config("dflash_qwen3_8b"),
}


def _make_series():
    sys.path.insert(0, str(ROOT / "upstream"))
    try:
        import make_series
    finally:
        sys.path.pop(0)
    return make_series


def _series_new_files() -> dict[str, str]:
    """Upstream path -> repository path of every file the series adds."""
    make_series = _make_series()
    return {
        make_series.upstream_path(path): path
        for patch in make_series.PATCHES
        for path in patch.files
    }


@pytest.fixture(scope="session")
def series(tmp_path_factory) -> Path:
    """The series as upstream/make_series.py writes it from the package now."""
    out = tmp_path_factory.mktemp("series")
    _make_series().build(out)
    return out


def test_every_module_is_in_the_series(monkeypatch):
    make_series = _make_series()
    make_series.check_coverage()
    patches = list(make_series.PATCHES)
    # The first patch that adds files (a patch may only edit vLLM's).
    i = next(i for i, patch in enumerate(patches) if patch.files)
    dropped = patches[i].files[0]
    patches[i] = dataclasses.replace(patches[i], files=patches[i].files[1:])
    monkeypatch.setattr(make_series, "PATCHES", tuple(patches))
    with pytest.raises(SystemExit, match=dropped):
        make_series.check_coverage()


def test_series_files_name_no_overlay_path(monkeypatch):
    """A file the series adds may not point a vLLM reader at a path only this
    repository has: the generator names the file and the path."""
    make_series = _make_series()
    make_series.check_coverage()
    patch = next(patch for patch in make_series.PATCHES if patch.files)
    first = patch.files[0]
    # A string every file of the series carries stands in for such a path.
    monkeypatch.setattr(make_series, "OVERLAY_ONLY", ("SPDX-License-Identifier",))
    with pytest.raises(SystemExit, match=f"{first}.*SPDX-License-Identifier"):
        make_series.check_coverage()


def test_check_tells_a_stale_series(series, tmp_path):
    """``make_series.py --check`` passes on a fresh build and fails once a
    patch differs from what the package gives."""
    copy = tmp_path / "series"
    shutil.copytree(series, copy)
    script = str(ROOT / "upstream" / "make_series.py")

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, script, "--check", "--out", str(copy)],
            capture_output=True,
            text=True,
            check=False,
        )

    fresh = check()
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    patch = copy / (copy / "series").read_text().split()[-1]
    patch.write_text(patch.read_text().replace("+", "+ ", 1))
    stale = check()
    assert stale.returncode == 1
    assert patch.name in stale.stderr


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory, series, vllm_sdist) -> Path:
    tree = pv.copy_installed_vllm(tmp_path_factory.mktemp("patched_vllm"))
    # vLLM's docs the series edits, from the sdist (none only for a developer
    # offline: apply_series then leaves those edits out).
    pv.add_sdist_files(tree, pv.edited_outside_package(series))
    applied = pv.apply_series(tree, series)
    assert applied == [p.name for p in pv.series_patches(series)]
    _add_checks(tree)
    return tree


def _add_checks(tree: Path) -> None:
    """The test infrastructure and the checks of the edits (the test helpers
    they import, tests/models/tiny_models.py among them, are the series')."""
    pv.add_test_infra(tree)
    for src, dest in ((WIRING, WIRING_IN_TREE), (GLUE, GLUE_IN_TREE)):
        (tree / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tree / dest)


def test_applied_files_are_the_package_files(patched_tree):
    files = _series_new_files()
    assert len(files) >= 20
    for dest, src in files.items():
        assert (patched_tree / dest).read_bytes() == (ROOT / src).read_bytes(), dest
    print(f"{len(files)} files added by the series equal the package's")


def _added_lines(series: Path, path: str) -> list[str]:
    """The lines the series' patches add to ``path``."""
    added, current = [], None
    for patch in pv.series_patches(series):
        for line in patch.read_text().splitlines():
            if line.startswith("+++ "):
                current = line.removeprefix("+++ b/")
            elif current == path and line.startswith("+"):
                added.append(line[1:])
    return added


def test_docs_edits_applied(patched_tree, series, vllm_sdist):
    """The series' edits to vLLM's docs landed in the patched tree (with no
    sdist they are left out, which only a developer offline may skip)."""
    if vllm_sdist is None:
        _skip_or_fail(f"no {pv.SDIST}: the series' docs edits were left out")
    assert sorted(DOCS_EDITS) == pv.edited_outside_package(series)
    for path, marker in DOCS_EDITS.items():
        text = (patched_tree / path).read_text()
        added = _added_lines(series, path)
        assert any(marker in line for line in added), (path, added)
        missing = [line for line in added if line not in text.splitlines()]
        assert not missing, f"{path}: lines the series adds are missing: {missing}"
    print(f"the series' edits to {sorted(DOCS_EDITS)} are in the patched tree")


def test_attention_backend_docs_are_current(series, vllm_sdist, tmp_path):
    """vLLM's pre-commit check of the attention backends' table (it parses the
    backends' sources, so it runs on the CPU) passes on the sdist's source
    tree with the series applied: TREE_ATTN's row is what the script writes."""
    if vllm_sdist is None:
        _skip_or_fail(f"no {pv.SDIST} to check the attention backends' table on")
    prefix = f"vllm-{pv.VLLM_VERSION}/"
    with tarfile.open(vllm_sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    tree = tmp_path / prefix

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "tools/pre_commit/generate_attention_backend_docs.py"]
            + ["--check"],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    # The control: the release's own table is current.
    stock = check()
    assert stock.returncode == 0, stock.stdout + stock.stderr
    pv.apply_series(tree, series)
    patched = check()
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert "`TREE_ATTN`" in (tree / "docs/design/attention_backends.md").read_text()


def test_series_tests_pass_as_applied(patched_tree, tmp_path):
    """The series' own tests and the checks of its edits, in the patched tree
    with the plugin disabled."""
    tests = sorted(
        str(p.relative_to(patched_tree))
        for p in (patched_tree / "tests").rglob("test_*.py")
    )
    assert WIRING_IN_TREE in tests
    out = pv.run_pytest(
        patched_tree,
        tests,
        [patched_tree],
        timeout=2400,
        junit=tmp_path / "series.xml",
    )
    assert not out.failed, f"{sorted(out.failed)}\n{out.output}"
    wiring = {n for n in out.passed if "test_ddtree_wiring" in n}
    print(
        f"patched tree: {len(out.passed)} passed ({len(wiring)} of them checks "
        f"of the edits), {len(out.skipped)} skipped, over {len(tests)} files"
    )
    assert len(wiring) >= MIN_WIRING_PASSED, out.output
    assert len(out.passed) >= MIN_SERIES_PASSED, out.output
    # Every file passes tests of its own, so none is lost to an import or
    # collection problem the totals would hide (JUnit names a test by its
    # module, or module.Class).
    passed = [n.split("::", 1)[0] + "." for n in out.passed]
    silent = [
        t
        for t in tests
        if not any(
            c.startswith(t.removesuffix(".py").replace("/", ".") + ".") for c in passed
        )
    ]
    assert not silent, f"no test passed in {silent}\n{out.output}"


def test_edit_checks_fail_on_stock_vllm(tmp_path):
    """The control: the checks of the edits, against stock vLLM 0.26.0 plus
    only the series' new files (no edits), fail where the edits matter."""
    tree = pv.copy_installed_vllm(tmp_path / "stock")
    files = _series_new_files()
    for dest, src in files.items():
        (tree / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / src, tree / dest)
    _add_checks(tree)
    out = pv.run_pytest(
        tree, [WIRING_IN_TREE], [tree], timeout=900, junit=tmp_path / "stock.xml"
    )
    # Every check of an edit fails; only the check that stock DFlash is left
    # alone, and the one that the run imports the tree, pass without edits.
    passed = {n.rsplit("::", 1)[1] for n in out.passed}
    assert passed == {
        "test_runs_against_the_patched_tree",
        "test_plain_dflash_is_untouched",
    }, f"passed on stock vLLM: {sorted(passed)}\n{out.output}"
    assert len(out.failed) >= MIN_WIRING_PASSED - 2, out.output
    print(f"stock vLLM: {len(out.failed)} of the edit checks fail, as they must")


def _download_sdist(dest: Path) -> None:
    """vLLM's release sdist from PyPI's simple index (PEP 691 JSON, as pip reads
    it), checked against the index's sha256. ``pip download --no-binary``
    would build the sdist's metadata, which needs vLLM's whole build
    toolchain."""
    req = urllib.request.Request(
        "https://pypi.org/simple/vllm/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        index = json.load(resp)
    (entry,) = [f for f in index["files"] if f["filename"] == pv.SDIST]
    with urllib.request.urlopen(entry["url"], timeout=600) as resp:
        data = resp.read()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == entry["hashes"]["sha256"], f"{pv.SDIST}: sha256 mismatch"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(dest)


def _skip_or_fail(reason: str) -> None:
    """A developer offline skips what needs the sdist; CI (.ci/run sets
    REQUIRE_SDIST_ENV) fails, so nothing that needs it goes missing unseen."""
    if pv.sdist_required():
        pytest.fail(f"{reason} ({pv.REQUIRE_SDIST_ENV}=1)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_sdist() -> Path | None:
    """vLLM's release sdist, downloaded once into the cache. None for a
    developer offline (the patched tree then lacks the series' docs edits and
    the tests that need the sdist skip); with REQUIRE_SDIST_ENV set, an
    unreachable PyPI fails."""
    sdist = pv.sdist_cache()
    if not sdist.is_file():
        try:
            _download_sdist(sdist)
        except OSError as e:
            reason = f"PyPI unreachable, no {pv.SDIST} in {sdist.parent}: {e}"
            if pv.sdist_required():
                _skip_or_fail(reason)  # fails
            print(reason)
            return None
    return sdist


@pytest.fixture(scope="session")
def vllm_sdist_tests(tmp_path_factory, vllm_sdist) -> Path:
    """vLLM 0.26.0's tests/ and pyproject.toml from its release sdist (cached)."""
    if vllm_sdist is None:
        _skip_or_fail(f"no {pv.SDIST} in {pv.sdist_cache().parent}")
    sdist = vllm_sdist
    try:
        import tblib  # noqa: F401
    except ImportError:
        _skip_or_fail("vLLM's tests/conftest.py imports tblib, not installed")
    root = tmp_path_factory.mktemp("vllm_sdist")
    prefix = f"vllm-{pv.VLLM_VERSION}/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix + "tests/")
            or m.name == prefix + "pyproject.toml"
        ]
        tar.extractall(root, members=members, filter="data")
    return root / f"vllm-{pv.VLLM_VERSION}"


def _offline_hf_home(home: Path) -> Path:
    """A Hugging Face cache (``HF_HOME``) laid out as the hub writes it, one
    snapshot per model of OFFLINE_MODELS: its config.json and the byte-level
    tokenizer of tests/models/tiny_models.py (the tests build configs and
    schedulers from these models, which load a tokenizer; none runs a model)."""
    from tests.models.tiny_models import make_tokenizer

    revision = "0" * 40
    for model, config in OFFLINE_MODELS.items():
        repo = home / "hub" / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        (snapshot / "config.json").write_text(json.dumps(config()))
        make_tokenizer(snapshot)
    return home


def test_vllm_tests_unchanged_by_the_series(vllm_sdist_tests, patched_tree, tmp_path):
    stock = pv.copy_installed_vllm(tmp_path / "stock")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "cpu_device_type.py").write_text(CPU_DEVICE_TYPE)
    env = {
        "HF_HOME": str(_offline_hf_home(tmp_path / "hf")),
        "HF_HUB_OFFLINE": "1",
    }
    runs = {}
    for name, tree in (("stock", stock), ("patched", patched_tree)):
        # vllm from the copy, vLLM's tests/ package from the sdist.
        runs[name] = pv.run_pytest(
            vllm_sdist_tests,
            ["-p", "cpu_device_type", "--continue-on-collection-errors"]
            + list(VLLM_TESTS),
            [tree, vllm_sdist_tests, plugins],
            timeout=2400,
            junit=tmp_path / f"{name}.xml",
            extra_env=env,
        )
    stock_out, patched_out = runs["stock"], runs["patched"]
    print(
        f"vLLM {pv.VLLM_VERSION} tests: stock {len(stock_out.passed)} passed, "
        f"{len(stock_out.failed)} failed; patched {len(patched_out.passed)} "
        f"passed, {len(patched_out.failed)} failed"
    )
    assert patched_out.failed <= stock_out.failed, (
        f"failing only with the series: {sorted(patched_out.failed - stock_out.failed)}"
        f"\n{patched_out.output}"
    )
    assert patched_out.passed == stock_out.passed, (
        f"passing only without the series: "
        f"{sorted(stock_out.passed - patched_out.passed)}"
    )
    assert len(stock_out.passed) >= MIN_VLLM_PASSED, stock_out.output
    # Each required test names one test (no two the same), so the count of
    # those passed is the list's length only if every one passed.
    required = {_junit_name(t) for t in REQUIRED_VLLM_TESTS}
    assert len(required) == len(REQUIRED_VLLM_TESTS)
    for name, out in runs.items():
        passed = required & out.passed
        missing = sorted(
            t for t in REQUIRED_VLLM_TESTS if _junit_name(t) not in out.passed
        )
        assert len(passed) >= len(REQUIRED_VLLM_TESTS), (
            f"{name}: required tests not passed: {missing}"
        )
    print(f"{len(REQUIRED_VLLM_TESTS)} required vLLM tests pass on both copies")
