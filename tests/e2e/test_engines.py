# SPDX-License-Identifier: Apache-2.0
"""The e2e engine runner's result cache (CPU): reused only for the same
configuration and sources; failures are reported, never cached."""

import json
import subprocess

from tests.e2e import engines


class FakeEngineProcess:
    """Stands in for ``subprocess.run`` of ``tests.e2e.generate``."""

    def __init__(self, returncode: int = 0):
        self.calls = 0
        self.returncode = returncode

    def __call__(self, argv, **kwargs):
        self.calls += 1
        config = json.loads(open(argv[-2]).read())
        if self.returncode == 0:
            with open(argv[-1], "w") as f:
                json.dump({"runs": {"echo": config, "call": self.calls}}, f)
        return subprocess.CompletedProcess(argv, self.returncode, "engine log")


def test_results_are_reused_for_the_same_config_and_sources(tmp_path, monkeypatch):
    monkeypatch.setenv(engines.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    fake = FakeEngineProcess()
    monkeypatch.setattr(engines.subprocess, "run", fake)
    configs = {"a": {"llm": {"model": "m"}}, "b": {"llm": {"model": "n"}}}
    first = engines.run_engines(configs, tmp_path, "t")
    assert fake.calls == 2
    again = engines.run_engines(configs, tmp_path, "t")
    assert fake.calls == 2 and again == first
    # A different configuration runs.
    engines.run_engines({"a": {"llm": {"model": "other"}}}, tmp_path, "t")
    assert fake.calls == 3
    # Changed sources invalidate every result.
    monkeypatch.setattr(engines, "_source_digest", lambda: "changed")
    engines.run_engines(configs, tmp_path, "t")
    assert fake.calls == 5


def test_failures_are_reported_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(engines.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    failing = FakeEngineProcess(returncode=1)
    monkeypatch.setattr(engines.subprocess, "run", failing)
    out = engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")
    assert out["a"] == {"error": "engine log"}
    working = FakeEngineProcess()
    monkeypatch.setattr(engines.subprocess, "run", working)
    assert "runs" in engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")["a"]
    assert working.calls == 1


def test_without_cache_dir_every_run_starts_an_engine(tmp_path, monkeypatch):
    monkeypatch.delenv(engines.CACHE_ENV, raising=False)
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    fake = FakeEngineProcess()
    monkeypatch.setattr(engines.subprocess, "run", fake)
    engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")
    engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")
    assert fake.calls == 2
