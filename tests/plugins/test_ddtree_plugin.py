# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Installed but unused, the plugin changes nothing and costs little (CPU).

Users install vllm-ddtree where all their vLLM engines run; most never ask for
``method="ddtree"``. Each check runs vLLM in fresh processes, with the plugin
(``VLLM_PLUGINS=ddtree``, this checkout's package first on ``PYTHONPATH``) and
without it (``VLLM_PLUGINS=""``: vLLM loads no general plugin):

* loading the plugin imports none of vLLM's scheduler or GPU-worker modules and
  none of DDTree's own, and its wrappers still reach modules imported later;
* for stock engines (no speculation, dflash, eagle3, ngram, draft_model, and an
  ngram engine carrying ``additional_config`` keys named like DDTree's) what
  ``EngineArgs`` builds is identical with and without the plugin: speculative
  config, scheduler limits, capture sizes, lookahead slots, attention backend;
* another backend registered as ``AttentionBackendEnum.CUSTOM`` (vLLM's slot for
  out-of-tree backends) keeps it for every stock engine, and only a DDTree
  engine fails, with a message naming both backends and the fix.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.log_records import log_records
from tests.models.tiny_models import make_tiny_dflash, make_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]
OTHER_BACKEND = "my_pkg.attn.MyBackend"


def _env(plugin: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    env["VLLM_PLUGINS"] = "ddtree" if plugin else ""
    return env


def _python(code: str, plugin: bool) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=_env(plugin),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_loading_imports_little():
    out = _python(
        """
        import json, sys, time
        import vllm.engine.arg_utils  # vLLM loads general plugins from EngineArgs
        before = set(sys.modules)
        start = time.perf_counter()
        import vllm_ddtree
        vllm_ddtree.register()
        seconds = time.perf_counter() - start
        new = sorted(set(sys.modules) - before)
        print(json.dumps({"seconds": seconds, "new": new}))
        """,
        plugin=False,
    )
    result = json.loads(out)
    new = result["new"]
    print(
        f"plugin load: {result['seconds'] * 1e3:.1f} ms, {len(new)} new modules: {new}"
    )
    # From a checkout the plugin imports the packages it adds modules to, to
    # extend their search paths; an empty package __init__ costs nothing.
    extended = {m for m in new if _is_empty_checkout_package(m)}
    heavy = [
        m
        for m in sorted(set(new) - extended)
        if m.startswith(
            (
                "vllm.v1.worker",
                "vllm.v1.core.sched",
                "vllm.v1.engine",
                "vllm.v1.spec_decode.d",
                "vllm.v1.attention.backends.tree_attn",
                "vllm.v1.attention.ops.",
                "vllm.v1.sample.tree",
                "triton",
            )
        )
    ]
    assert not heavy, heavy
    assert len(set(new) - extended) <= 12, new


def _is_empty_checkout_package(name: str) -> bool:
    """Whether ``name`` is a vLLM package that this checkout adds modules to
    and whose own __init__.py is empty (nothing imported but the package)."""
    checkout_dir = ROOT.joinpath(*name.split("."))
    if not checkout_dir.is_dir():
        return False
    spec = importlib.util.find_spec(name)
    init = Path(spec.origin) if spec and spec.origin else None
    return init is not None and init.name == "__init__.py" and not init.read_bytes()


def test_wrappers_reach_modules_imported_later():
    out = _python(
        """
        import json
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.worker.gpu import model_runner
        from vllm.engine.arg_utils import EngineArgs
        funcs = [Scheduler.__init__, Scheduler.add_request,
                 model_runner.init_speculator, model_runner.init_model_state,
                 model_runner.GPUModelRunner.__init__,
                 model_runner.GPUModelRunner.initialize_kv_cache,
                 EngineArgs.create_speculative_config]
        # A step of DFlash's propose that stock vLLM lacks, added on import.
        from vllm.v1.worker.gpu.spec_decode.dflash.speculator import (
            DFlashSpeculator,
        )
        funcs.append(DFlashSpeculator._run_drafter)
        from vllm.v1.engine.input_processor import InputProcessor
        # Nothing is refused per request: the front end is left alone.
        funcs.append(InputProcessor._validate_params)
        print(json.dumps([getattr(f, "__ddtree_patched__", False) for f in funcs]))
        """,
        plugin=False,
    )
    assert json.loads(out) == [True] * 8 + [False]


def test_another_import_hook_never_doubles_a_wrapper():
    """An import hook of the kind tracers and profilers install (from a
    ``sitecustomize``, before vLLM loads its plugins) finds the module anew
    inside its own lookup and wraps a method after the module ran, without
    ``functools.wraps``. The plugin's wrapper must still be there once, above or
    below it: twice, a DDTree engine's step would be planned twice per step
    (``benchmarks/serve_trace/sitecustomize.py`` did that, and the adaptive
    budget's cost model learned nothing)."""
    out = _python(
        """
        import importlib.abc, importlib.util, json, sys

        NAME = "vllm.v1.worker.gpu.model_runner"

        class Hook(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name != NAME:
                    return None
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                run = spec.loader.exec_module

                def run_and_wrap(module):
                    run(module)
                    cls = module.GPUModelRunner
                    inner = cls.execute_model

                    def execute_model(self, *args, **kwargs):
                        return inner(self, *args, **kwargs)

                    execute_model.hook = True
                    cls.execute_model = execute_model

                spec.loader.exec_module = run_and_wrap
                return spec

        sys.meta_path.insert(0, Hook())
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm.v1.worker.gpu import model_runner

        layers, fn = [], model_runner.GPUModelRunner.execute_model
        while fn is not None:
            layers.append("ddtree" if getattr(fn, "__ddtree_patched__", False)
                          else "hook" if getattr(fn, "hook", False) else "vllm")
            inner = getattr(fn, "__wrapped__", None)
            if inner is None:
                cells = [c.cell_contents for c in fn.__closure__ or ()]
                inner = next((c for c in cells if callable(c)
                              and getattr(c, "__name__", "") == "execute_model"),
                             None)
            fn = inner
        print(json.dumps(layers))
        """,
        plugin=False,
    )
    layers = json.loads(out)
    assert layers.count("ddtree") == 1, layers
    assert layers.count("hook") == 1, layers


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("plugin_models")
    target = make_tiny_qwen3(root / "target")
    drafter = make_tiny_dflash(root / "drafter", target)
    # An EAGLE-3 head needs only its config to be configured.
    eagle = root / "eagle3"
    eagle.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(
        architectures=["Eagle3LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        layer_types=["full_attention"],
        draft_vocab_size=cfg["vocab_size"],
    )
    (eagle / "config.json").write_text(json.dumps(cfg))
    return {"target": str(target), "drafter": str(drafter), "eagle3": str(eagle)}


def _configs(models) -> dict[str, dict]:
    base = {"model": models["target"], "max_model_len": 1024}
    specs = {
        "none": None,
        "dflash": {
            "method": "dflash",
            "model": models["drafter"],
            "num_speculative_tokens": 15,
        },
        "eagle3": {
            "method": "eagle3",
            "model": models["eagle3"],
            "num_speculative_tokens": 3,
        },
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
        },
        "draft_model": {
            "method": "draft_model",
            "model": models["target"],
            "num_speculative_tokens": 3,
        },
    }
    configs = {
        name: {**base, "speculative_config": spec} for name, spec in specs.items()
    }
    lookalike = {"method": "ddtree", "tree_budget": 4, "draft_depth": 15}
    configs["ngram_with_ddtree_keys"] = {
        **configs["ngram"],
        "additional_config": {"ddtree": lookalike, "vllm_ddtree": lookalike},
    }
    configs["ddtree"] = {
        **base,
        "speculative_config": {
            "method": "ddtree",
            "model": models["drafter"],
            "tree_budget": 32,
        },
    }
    return configs


def _summaries(models, tmp_path, plugin: bool, custom_backend=None) -> dict:
    tag = f"{'on' if plugin else 'off'}_{'custom' if custom_backend else 'free'}"
    src, dst = tmp_path / f"{tag}.in.json", tmp_path / f"{tag}.out.json"
    src.write_text(
        json.dumps({"configs": _configs(models), "custom_backend": custom_backend})
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.plugins.engine_summary", str(src), str(dst)],
        cwd=ROOT,
        env=_env(plugin),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(dst.read_text())


STOCK = ("none", "dflash", "eagle3", "ngram", "draft_model", "ngram_with_ddtree_keys")


def _assert_stock_identical(on: dict, off: dict) -> None:
    for name in STOCK:
        assert "error" not in off[name], (name, off[name])
        assert on[name] == off[name], name
    print(f"identical with and without the plugin: {', '.join(STOCK)}")


def test_stock_engines_are_identical_with_and_without_the_plugin(models, tmp_path):
    off = _summaries(models, tmp_path, plugin=False)
    on = _summaries(models, tmp_path, plugin=True)
    _assert_stock_identical(on, off)
    # The lookalike keys stay the user's and turn nothing on.
    assert on["ngram_with_ddtree_keys"]["max_num_seqs"] == on["ngram"]["max_num_seqs"]
    # DDTree: refused by stock vLLM, built by the plugin.
    assert "ddtree" in off["ddtree"]["error"]
    ddtree = on["ddtree"]
    assert ddtree["speculative"]["method"] == "dflash"
    assert ddtree["speculative"]["num_speculative_tokens"] == 32
    assert ddtree["attention_backend"] == "AttentionBackendEnum.CUSTOM"
    assert ddtree["custom_backend"].endswith("tree_attn.TreeAttentionBackend")
    assert ddtree["lookahead_tokens"] == 16
    assert ddtree["additional_config"]["vllm_ddtree"]["method"] == "ddtree"


def test_another_custom_backend_fails_only_ddtree(models, tmp_path):
    off = _summaries(models, tmp_path, plugin=False, custom_backend=OTHER_BACKEND)
    on = _summaries(models, tmp_path, plugin=True, custom_backend=OTHER_BACKEND)
    _assert_stock_identical(on, off)
    for name in STOCK:
        assert on[name]["custom_backend"] == OTHER_BACKEND, name
    error = on["ddtree"]["error"]
    print(error)
    assert error.startswith("ValueError: method 'ddtree' verifies trees with TREE_ATTN")
    assert OTHER_BACKEND in error and "TreeAttentionBackend" in error
    assert "VLLM_PLUGINS=ddtree" in error


def test_worker_registers_tree_attn_for_ddtree_only(models, tmp_path):
    """A spawned worker unpickles the engine's config before anything else:
    MRv2's ``GPUModelRunner.__init__`` (wrapped once the runner module is
    imported) registers TREE_ATTN there for a DDTree config, before the model
    is built, and leaves CUSTOM alone for any other config."""
    configs = _configs(models)
    out = _python(
        f"""
        import json, pickle, sys
        sys.path.insert(0, {str(ROOT)!r})
        import conftest
        from vllm.platforms import current_platform
        type(current_platform).device_type = "cuda"
        from vllm.engine.arg_utils import EngineArgs
        for name in ("dflash", "ddtree"):
            cfg = EngineArgs(**json.loads({json.dumps(json.dumps(configs))})[name])
            pickle.dump(cfg.create_engine_config(),
                        open({str(tmp_path)!r} + f"/{{name}}.pkl", "wb"))
        print("ok")
        """,
        plugin=True,
    )
    assert out == "ok"
    out = _python(
        f"""
        import json, pickle, sys
        sys.path.insert(0, {str(ROOT)!r})
        import conftest
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # as a worker does at start
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.worker.gpu import model_runner
        seen = {{}}
        for name in ("dflash", "ddtree"):
            cfg = pickle.load(open({str(tmp_path)!r} + f"/{{name}}.pkl", "rb"))
            try:
                # Past the wrapper, vLLM's own __init__ needs a GPU.
                model_runner.GPUModelRunner(cfg, "cpu")
            except Exception:
                pass
            custom = AttentionBackendEnum.CUSTOM
            seen[name] = custom.get_path() if custom.is_overridden() else None
        print(json.dumps(seen))
        """,
        plugin=True,
    )
    seen = json.loads(out)
    assert seen["dflash"] is None
    assert seen["ddtree"].endswith("tree_attn.TreeAttentionBackend")


def test_an_installed_copy_is_never_taken_for_a_checkout(tmp_path):
    """Installed next to vLLM, the folder above ``vllm_ddtree/`` is
    site-packages, whose ``vllm/`` is vLLM's own package: a stray ``setup.py``
    left there by some other package must not make ``register()`` treat it as
    a source checkout (that imported every vLLM subpackage and failed)."""
    import importlib.util
    import shutil

    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "vllm_ddtree", site / "vllm_ddtree")
    (site / "setup.py").write_text("# another package's leftover\n")
    (site / "vllm" / "v1" / "spec_decode").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location(
        "installed_vllm_ddtree", site / "vllm_ddtree" / "__init__.py"
    )
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    before = set(sys.modules)
    import vllm.v1

    paths = list(vllm.v1.__path__)
    installed._use_source_checkout()
    assert set(sys.modules) - before <= {"vllm.v1"}
    assert list(vllm.v1.__path__) == paths
    # This checkout is one: its vllm/ holds only the overlay's modules.
    assert not (ROOT / "vllm" / "__init__.py").exists()


def test_register_never_raises(monkeypatch):
    """vLLM calls plugins without a try: a failing load is logged, not raised."""

    import vllm_ddtree
    from vllm_ddtree import glue

    def broken():
        raise RuntimeError("simulated")

    monkeypatch.setattr(glue, "apply", broken)
    with log_records("vllm.ddtree") as records:
        vllm_ddtree.register()
    assert any("failed to load" in r.getMessage() for r in records)
    assert records[0].exc_info is not None


def test_a_failed_ddtree_engine_leaves_no_registration():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree import glue

    from vllm.v1.attention.backends.registry import register_backend

    custom = AttentionBackendEnum.CUSTOM
    # Engines built earlier in this process may have registered TREE_ATTN.
    earlier = custom.get_path() if custom.is_overridden() else None
    custom.clear_override()

    def fails_after_registering(self):
        glue.register_tree_attn_backend()
        raise ValueError("simulated failure after the speculative config")

    try:
        with pytest.raises(ValueError, match="simulated"):
            glue._create_engine_config(fails_after_registering, object())
        assert not custom.is_overridden()
        # Registered before the engine (another DDTree engine): kept.
        glue.register_tree_attn_backend()
        with pytest.raises(ValueError, match="simulated"):
            glue._create_engine_config(fails_after_registering, object())
        assert custom.get_path() == glue.TREE_ATTN_BACKEND_PATH
    finally:
        custom.clear_override()
        if earlier is not None:
            register_backend(custom, earlier)


def test_ddtree_logs_under_vllms_logger():
    """vLLM configures the ``vllm`` logger tree: DDTree's lines must be in it
    to appear, in vLLM's format and at its level."""
    import vllm_ddtree
    from vllm.v1.spec_decode import ddtree_adaptive, ddtree_cost
    from vllm_ddtree import glue

    for module in (glue, ddtree_cost, ddtree_adaptive, vllm_ddtree):
        assert module.logger.name.startswith("vllm."), module.__name__


PAIR = ROOT / "benchmarks" / "models" / "pycode"
NO_GPU = "Failed to infer device type"
OURS = "DDTree: vLLM finds no GPU on this machine"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="what a user sees on a machine without a GPU",
)
def test_without_a_gpu_the_user_reads_what_ddtree_needs():
    """``vllm serve`` builds its argument parser before it reads any
    speculative config, and vLLM infers the device there: without a GPU it
    stops with "Failed to infer device type", which names no GPU. With the
    plugin, DDTree's line comes first; without it, vLLM's message alone. An
    engine built in code reaches DDTree's own config check, which says so."""
    spec = json.dumps({"method": "ddtree", "model": str(PAIR / "drafter")})
    serve = [
        sys.executable,
        "-c",
        "from vllm.entrypoints.cli.main import main; main()",
        "serve",
        str(PAIR / "target"),
        "--speculative-config",
        spec,
    ]
    in_code = [
        sys.executable,
        "-c",
        "from vllm import LLM; "
        f"LLM(model={str(PAIR / 'target')!r}, speculative_config={spec})",
    ]
    runs = {
        name: subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_env(plugin),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, cmd, plugin in (
            ("serve", serve, True),
            ("serve without the plugin", serve, False),
            ("in code", in_code, True),
        )
    }
    out = {}
    try:
        for name, proc in runs.items():
            out[name] = proc.communicate(timeout=600)[0]
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
    for name, proc in runs.items():
        assert proc.returncode != 0, (name, out[name][-2000:])
    served = out["serve"]
    assert 0 <= served.find(OURS) < served.find(NO_GPU), served[-3000:]
    assert NO_GPU in out["serve without the plugin"]
    assert "DDTree" not in out["serve without the plugin"]
    assert "ValueError: method 'ddtree' needs a CUDA GPU" in out["in code"]
    print({name: text.strip().splitlines()[-1][:160] for name, text in out.items()})
