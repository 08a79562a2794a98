# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/profile_step.py on the CPU: arguments, engine specs, the kernel-name
categories, per-step aggregation, the markdown table, resume and time limit (the
engine processes replaced by a fake), and the refusal to run without a GPU. The
one GPU test (skipped here) checks that the profiler sees kernels replayed from
a CUDA graph."""

import json
import re
import types
from pathlib import Path

import pytest

from benchmarks import bench_ddtree_config as bdc
from benchmarks import profile_step as ps

ROOT = Path(ps.__file__).resolve().parents[1]
MODEL_CONFIGS = ROOT / "benchmarks" / "model_configs"

# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def test_defaults(tmp_path):
    args = ps.parse_args(["--out", str(tmp_path)])
    assert args.configs == ["dflash", "ddtree-32", "ddtree-128"]
    assert args.batch == 1 and args.max_tokens == 64 and args.input_len == 1024
    assert args.max_num_seqs == 1  # follows --batch
    assert args.target == MODEL_CONFIGS / "qwen3_8b"
    assert args.drafter == MODEL_CONFIGS / "dflash_qwen3_8b"
    assert not args.trace and not args.report_only and args.limit_seconds == 0
    assert args.gpu_memory_utilization == 0.85 and args.top == 25
    args = ps.parse_args(
        [
            "--out",
            str(tmp_path),
            "--configs",
            "ddtree-512,none",
            "--batch",
            "4",
            "--max-num-seqs",
            "64",
        ]
    )
    assert args.configs == ["none", "ddtree-512"]
    assert args.batch == 4 and args.max_num_seqs == 64


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--configs", "eagle"], "unknown config 'eagle'"),
        (["--configs", "ddtree-0"], r"tree_budget must be in \[1, 1024\]"),
        (["--configs", "ddtree-schedule"], "ddtree-schedule needs --schedule"),
        (["--batch", "0"], "--batch must be >= 1"),
        (
            ["--batch", "8", "--max-num-seqs", "4"],
            "--max-num-seqs 4 is below --batch 8",
        ),
        (["--max-tokens", "1"], "--max-tokens must be >= 2"),
        (["--input-len", "4090"], "exceed --max-model-len 4096"),
        (["--top", "0"], "--top must be >= 1"),
        (["--timing-repeats", "0"], "--timing-repeats must be >= 1"),
        (["--limit-seconds", "-1"], "--limit-seconds must be >= 0"),
        (["--gpu-memory-utilization", "1.5"], r"must be in \(0, 1\]"),
        (["--target", "/nonexistent"], "--target /nonexistent: no config.json"),
    ],
)
def test_bad_arguments(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        ps.parse_args(["--out", str(tmp_path), *extra])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_out_is_required(capsys):
    with pytest.raises(SystemExit):
        ps.parse_args([])
    assert "--out" in capsys.readouterr().err


def test_worker_spec_is_bench_ddtrees_cost_engine(tmp_path):
    args = ps.parse_args(["--out", str(tmp_path), "--batch", "2"])
    for config in args.configs:
        spec = ps.worker_spec(args, config, "H200")
        assert spec["llm"] == bdc.engine_kwargs(args, config, 2)
        assert spec["llm"]["load_format"] == "dummy"
        assert spec["llm"]["skip_tokenizer_init"]
        assert not spec["llm"]["enable_prefix_caching"]
        assert spec["llm"]["max_num_seqs"] == 2
        assert spec["out_json"] == str(tmp_path / f"{config}.json")
        assert spec["trace"] is None and spec["max_tokens"] == 64
        json.dumps(spec)  # travels as JSON
    spec = ps.worker_spec(args, "dflash", "H200")
    assert spec["llm"]["compilation_config"] == {"cudagraph_capture_sizes": [16, 32]}
    assert spec["llm"]["speculative_config"]["num_speculative_tokens"] == 15
    assert (
        ps.worker_spec(args, "ddtree-128", "H200")["llm"]["speculative_config"][
            "tree_budget"
        ]
        == 128
    )
    # bench_ddtree cost's first wave at this batch: same seed, same prompts.
    assert spec["prompts"] == bdc.random_prompts(2, 1024, 0 + 2)
    assert len(spec["prompts"]) == 2 and len(spec["prompts"][0]) == 1024
    defaults = ps.parse_args(["--out", str(tmp_path), "--settings", "defaults"])
    llm = ps.worker_spec(defaults, "dflash", "H200")["llm"]
    assert "enable_prefix_caching" not in llm and "compilation_config" not in llm
    traced = ps.parse_args(["--out", str(tmp_path), "--trace"])
    assert ps.worker_spec(traced, "dflash", "H200")["trace"] == str(
        tmp_path / "dflash.trace.json.gz"
    )


PAIR = Path(ps.__file__).parent / "models" / "pycode"


def test_continuous_requests_and_the_pair(tmp_path, capsys):
    """--requests > --batch: staggered output lengths within [max/2, max], in the
    setup (absent at the default); --pair: the pair's models, held-out prompts
    (cycled), real weights, stop at EOS."""
    args = ps.parse_args(
        [
            "--out",
            str(tmp_path),
            "--batch",
            "4",
            "--requests",
            "16",
            "--max-tokens",
            "64",
        ]
    )
    spec = ps.worker_spec(args, "dflash", "H200")
    lengths = spec["output_lengths"]
    assert len(lengths) == 16 and len(spec["prompts"]) == 16
    assert min(lengths) >= 32 and max(lengths) <= 64
    assert len(set(lengths[:4])) == 4  # a wave does not finish in step
    assert spec["llm"]["max_num_seqs"] == 4 and spec["ignore_eos"]
    assert ps.setup_of(args)["requests"] == 16
    one_wave = ps.parse_args(["--out", str(tmp_path), "--batch", "4"])
    assert "requests" not in ps.setup_of(one_wave)
    assert ps.worker_spec(one_wave, "dflash", "H200")["output_lengths"] == [64] * 4
    # Under vLLM's defaults the engine still runs --batch requests at a time
    # (vLLM's own max_num_seqs would take all 16 at once); one wave sets none.
    defaults = ps.parse_args(
        ["--out", str(tmp_path), "--batch", "4", "--requests", "16"]
        + ["--settings", "defaults"]
    )
    llm = ps.worker_spec(defaults, "ddtree-auto", "H200")["llm"]
    assert llm["max_num_seqs"] == 4 and "enable_prefix_caching" not in llm
    # ... and such a profile never resumes from a tuned one.
    assert ps.setup_of(defaults)["settings"] == "defaults"
    assert "settings" not in ps.setup_of(args)
    one_wave_defaults = ps.parse_args(
        ["--out", str(tmp_path), "--batch", "4", "--settings", "defaults"]
    )
    assert (
        "max_num_seqs" not in ps.worker_spec(one_wave_defaults, "dflash", "H200")["llm"]
    )

    pair = ps.parse_args(
        [
            "--out",
            str(tmp_path),
            "--pair",
            str(PAIR),
            "--batch",
            "2",
            "--requests",
            "5",
            "--configs",
            "dflash,ddtree-auto",
        ]
    )
    assert (pair.target, pair.drafter) == (PAIR / "target", PAIR / "drafter")
    spec = ps.worker_spec(pair, "ddtree-auto", "H200")
    held_out = bdc.load_prompts(PAIR / "eval_prompts.json")
    assert spec["prompts"] == held_out[:5] and not spec["ignore_eos"]
    assert "load_format" not in spec["llm"] and "skip_tokenizer_init" not in spec["llm"]
    assert spec["llm"]["model"] == str(PAIR / "target")
    assert spec["llm"]["speculative_config"]["tree_budget"] == "auto"
    setup = ps.setup_of(pair)
    assert setup["info"]["prompts"] == str(PAIR / "eval_prompts.json")
    assert setup["prompts"] == bdc._sha(PAIR / "eval_prompts.json")
    json.dumps(spec)
    report = ps.markdown_report([_result("dflash", setup=setup)])
    assert "5 requests arriving as others finish" in report
    assert "held-out prompts of" in report and "trained weights" in report
    assert "tuned engine settings" in report
    defaults_setup = dict(setup, settings="defaults")
    report = ps.markdown_report([_result("dflash", setup=defaults_setup)])
    assert "vLLM's engine defaults" in report and "tuned" not in report

    for extra, message in (
        (["--batch", "4", "--requests", "2"], "--requests 2 is below --batch 4"),
        (
            ["--batch", "4", "--requests", "8", "--max-num-seqs", "8"],
            "drop --max-num-seqs",
        ),
        (
            ["--batch", "4", "--max-num-seqs", "8", "--settings", "defaults"],
            "--max-num-seqs has no effect under --settings defaults",
        ),
        (["--pair", str(PAIR), "--target", str(PAIR / "target")], "--pair or --target"),
        (["--pair", str(tmp_path)], "no eval_prompts.json"),
    ):
        with pytest.raises(SystemExit):
            ps.parse_args(["--out", str(tmp_path), *extra])
        assert message in capsys.readouterr().err


def test_child_env_keeps_the_engine_in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    env = ps._child_env()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] in ("spawn", "fork")


# ---------------------------------------------------------------------------
# Kernel-name categories
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, category",
    [
        (
            (
                "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"
                "_execute_segment_k_off_kernel__5x_cublas"
            ),
            "gemm",
        ),
        ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "gemm"),
        ("nvjet_hsh_192x8_64x6_2x1_v_bz_splitK_TNN", "gemm"),
        (
            (
                "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4"
                "_tn_align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8"
                "::Params)"
            ),
            "gemm",
        ),
        ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", "gemm"),
        (
            (
                "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
                "__nv_bfloat16, true, false, false>(cublasLt::cublasSplitKParams<float>, ...)"
            ),
            "gemm",
        ),
        ("triton_tem_fused_mm_0", "gemm"),
        (
            (
                "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
                "false, cutlass::bfloat16_t>, false, true, false>(flash::Flash_fwd_params)"
            ),
            "flash_attn",
        ),
        (
            "void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128>>()",
            "flash_attn",
        ),
        (
            (
                "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90"
                "<flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>>, cute::tuple<cute::"
                "C<128>>, 128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false>>>>"
                "(flash::FlashAttnFwdSm90<...>::Params)"
            ),
            "flash_attn",
        ),
        (
            (
                "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::"
                "FlashAttnFwdCombine<cute::tuple<cute::C<8>, cute::C<128>>, 7, 256, 1, false, "
                "true, cutlass::bfloat16_t, float, cutlass::arch::Sm90>>>(...)"
            ),
            "flash_attn",
        ),
        (
            "void flash::prepare_varlen_num_blocks_kernel<1, true>(int, int, int, ...)",
            "flash_attn",
        ),
        ("_tree_attention_kernel", "tree_attn"),
        ("_merge_splits_kernel", "tree_attn"),
        ("void vllm::merge_attn_states_kernel<__nv_bfloat16, 128u>(...)", "flash_attn"),
        ("_rank_row_kernel", "tree_ops"),
        ("_chunk_stats_kernel", "tree_ops"),
        ("_top_threshold_kernel", "tree_ops"),
        ("_gather_top_kernel", "tree_ops"),
        ("_sort_top_kernel", "tree_ops"),
        ("_ddtree_select_kernel", "tree_ops"),
        ("_tree_walk_kernel", "tree_ops"),
        ("_tree_kv_compaction_kernel", "tree_ops"),
        ("_write_tree_verify_inputs_kernel", "tree_ops"),
        ("_prepare_draft_inputs_kernel", "tree_ops"),
        ("_store_draft_trees_kernel", "tree_ops"),
        ("copy_and_expand_dflash_inputs_kernel", "input_prep"),
        ("eagle_prepare_inputs_padded_kernel", "input_prep"),
        ("_compute_slot_mapping_kernel", "input_prep"),
        ("_gather_block_tables_kernel", "input_prep"),
        ("_prepare_pos_seq_lens_kernel", "input_prep"),
        ("rejection_greedy_sample_kernel", "sampling"),
        ("sample_recovered_tokens_kernel", "sampling"),
        (
            "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)",
            "sampling",
        ),
        (
            (
                "void at::native::mbtopk::radixFindKthValues<float, unsigned int, unsigned int,"
                " 2>(...)"
            ),
            "sampling",
        ),
        (
            (
                "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, "
                "float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(...)"
            ),
            "sampling",
        ),
        (
            (
                "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
                "at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>>(...)"
            ),
            "sampling",
        ),
        (
            (
                "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long, "
                "at::native::LTOp<float, true>, unsigned int>(...)"
            ),
            "sampling",
        ),
        (
            (
                "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_"
                "kernel<float, 4, at::native::templates::cuda::exponential_kernel<...>>(...)"
            ),
            "sampling",
        ),
        (
            (
                "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, "
                "(vllm::Fp8KVCacheDataType)0>(...)"
            ),
            "kv_cache",
        ),
        ("triton_poi_fused__to_copy_add_mul_silu_slice_1", "elementwise"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_2", "elementwise"),
        ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>(...)", "elementwise"),
        ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)", "elementwise"),
        (
            (
                "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>,"
                " std::array<char*, 1ul>>(int, at::native::FillFunctor<int>, ...)"
            ),
            "elementwise",
        ),
        (
            "void at::native::index_elementwise_kernel<128, 4, ...>(long, ...)",
            "elementwise",
        ),
        ("Memcpy DtoD (Device -> Device)", "memcpy"),
        ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
        ("Memset (Device)", "memcpy"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_categorize(name, category):
    assert ps.categorize(name) == category


def _triton_kernels(path: Path) -> list[str]:
    text = path.read_text()
    # The decorator may span lines (``@triton.jit(\n    do_not_specialize=...\n)``).
    decorator = r"@triton\.jit(?:\([^)]*\))?[^\n]*\n"
    return re.findall(decorator + r"(?:@[^\n]*\n)*def (\w+_kernel)\(", text)


def test_every_ddtree_triton_kernel_has_its_category():
    """A renamed or new kernel of the DDTree modules must not fall into 'other'."""
    files = {
        "tree_ops": [
            "vllm/v1/spec_decode/dflash_tree_builder.py",
            "vllm/v1/sample/tree_rejection_sampler.py",
            "vllm/v1/attention/ops/tree_kv_compaction.py",
            "vllm/v1/spec_decode/ddtree_inputs.py",
            "vllm/v1/spec_decode/ddtree_verify.py",
        ],
        "tree_attn": ["vllm/v1/attention/ops/triton_tree_attention.py"],
    }
    seen = []
    for category, paths in files.items():
        for rel in paths:
            for kernel in _triton_kernels(ROOT / rel):
                assert ps.categorize(kernel) == category, (rel, kernel)
                seen.append(kernel)
    assert set(ps.TREE_OPS_KERNELS) <= set(seen)  # no stale names either
    assert "_tree_attention_kernel" in seen


# ---------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------

GEMM = "nvjet_tst_128x64_64x8_1x1_v_bz_TNT"
FA = "void flash::flash_fwd_kernel<...>"
TREE = "_tree_attention_kernel"
WALK = "_tree_walk_kernel"
NORM = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"
COPY = "Memcpy DtoD (Device -> Device)"


def test_aggregate_and_busy():
    agg = ps.aggregate(
        [
            (GEMM, 10.0),
            (GEMM, 5.0),
            (FA, 2.0),
            (COPY, 1.0),
            ("Stream Wait Event", 500.0),
            ("mystery", 0.5),
        ]
    )
    assert agg["categories"]["gemm"] == 15.0
    assert agg["categories"]["flash_attn"] == 2.0
    assert agg["categories"]["memcpy"] == 1.0
    assert agg["categories"]["other"] == 0.5
    assert set(agg["categories"]) == set(ps.CATEGORY_KEYS)
    assert agg["total_us"] == 18.5 and agg["count"] == 5 and agg["sync_count"] == 1
    assert agg["kernels"][GEMM] == [2, 15.0]
    # Overlapping streams count once; gaps are idle.
    assert ps.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert ps.busy_us([]) == 0
    w = ps.make_window(
        [(GEMM, 10.0, 0.0), (FA, 4.0, 8.0), (NORM, 1.0, 30.0)],
        steps=3,
        wall_s=0.001,
        graph_launches=2,
    )
    assert w["total_us"] == 15.0 and w["busy_us"] == 13.0
    assert w["steps"] == 3 and w["graph_launches"] == 2
    # Without start times (synthetic events), busy is the kernel sum.
    assert ps.make_window([(GEMM, 10.0)], steps=1, wall_s=1)["busy_us"] == 10.0


def _windows(
    decode_events, prefill_events, steps, *, wall_s=0.01, prefill_steps=1, graph=(0, 0)
):
    """(full, prefill) windows: the full one is prefill + ``steps`` decode steps;
    ``graph``: (graph launches, kernels linked to them) per step; 3 eager
    launches per decode step, with their kernels linked."""
    prefill = ps.make_window(
        prefill_events,
        steps=prefill_steps,
        wall_s=wall_s,
        graph_launches=graph[0],
        graph_kernels=graph[1],
    )
    full = ps.make_window(
        prefill_events + decode_events * steps,
        steps=prefill_steps + steps,
        wall_s=wall_s + steps * 0.0001,
        graph_launches=graph[0] * (1 + steps),
        graph_kernels=graph[1] * (1 + steps),
        kernel_launches=3 * steps,
        linked_kernels=3 * steps,
        host_syncs=steps,
    )
    return full, prefill


def test_decode_breakdown_subtracts_the_prefill():
    prefill_events = [(GEMM, 900.0), (FA, 300.0), (NORM, 50.0)]
    decode_events = [
        (GEMM, 40.0),
        (GEMM, 20.0),
        (TREE, 8.0),
        (WALK, 2.0),
        (NORM, 4.0),
        (COPY, 1.0),
    ]
    full, prefill = _windows(decode_events, prefill_events, steps=10, graph=(2, 30))
    d = ps.decode_breakdown(full, prefill, wall_us=125.0, top=3)
    assert d["steps"] == 10
    cats = d["categories_us"]
    assert cats["gemm"] == pytest.approx(60.0)
    assert cats["flash_attn"] == pytest.approx(0.0)  # prefill-only kernels cancel
    assert cats["tree_attn"] == pytest.approx(8.0)
    assert cats["tree_ops"] == pytest.approx(2.0)
    assert cats["elementwise"] == pytest.approx(4.0)
    assert cats["memcpy"] == pytest.approx(1.0)
    assert d["kernel_us"] == pytest.approx(75.0) == pytest.approx(sum(cats.values()))
    assert d["busy_us"] == pytest.approx(75.0)
    assert d["wall_us"] == 125.0
    assert d["wall_us_profiled"] == pytest.approx(100.0)
    assert d["busy_fraction"] == pytest.approx(0.6)
    assert d["kernels"] == pytest.approx(5.0) and d["memcpys"] == pytest.approx(1.0)
    assert d["kernel_launches"] == pytest.approx(3.0)
    assert d["host_syncs"] == pytest.approx(1.0)
    assert d["graph_launches"] == pytest.approx(2.0)
    assert d["graph_kernels_status"] == "recorded"
    top = d["top_kernels"]
    assert [k["name"] for k in top] == [GEMM, TREE, NORM]
    assert top[0]["us_per_step"] == pytest.approx(60.0)
    assert top[0]["count_per_step"] == pytest.approx(2.0)
    assert top[0]["category"] == "gemm"
    # Without an unprofiled wall the fraction uses the profiled one.
    assert ps.decode_breakdown(full, prefill)["busy_fraction"] == pytest.approx(0.75)


def test_decode_breakdown_counts_eager_kernels():
    prefill = ps.make_window([], steps=1, wall_s=0.01, eager_kernels={"a": 5, "c": 3})
    full = ps.make_window(
        [(GEMM, 1.0)], steps=11, wall_s=0.02, eager_kernels={"a": 25, "b": 10, "c": 3}
    )
    d = ps.decode_breakdown(full, prefill)
    # Per decode step, most first; kernels only the prefill pass launched drop.
    assert d["eager_kernels_per_step"] == {"a": 2.0, "b": 1.0}
    assert list(d["eager_kernels_per_step"]) == ["a", "b"]
    # Windows of an older profile_step have no record: nothing, not an error.
    old_full, old_prefill = _windows([(GEMM, 1.0)], [], steps=2)
    for w in (old_full, old_prefill):
        w.pop("eager_kernels")
    assert ps.decode_breakdown(old_full, old_prefill)["eager_kernels_per_step"] == {}


def test_markdown_report_host_placement_row():
    """Each config's process placement (bench_ddtree.host_placement) is one row:
    two processes of one config can land on different NUMA nodes."""
    near, far, old = _result("dflash"), _result("ddtree-32"), _result("ddtree-64")
    proc = {"pid": 1, "name": "python", "cpus_allowed": 16, "last_cpu": 3}
    near["info"]["host"] = {
        "gpu_numa_node": 0,
        "processes": [{**proc, "cpu_node": 0, "kib_per_node": {"0": 921600}}],
    }
    threads = [
        {"tid": 1, "name": "python", "cpu_s": 30.0, "last_cpu": 12, "core": "1/4"},
        {
            "tid": 9,
            "name": "pt_main_thread",
            "cpu_s": 12.5,
            "last_cpu": 28,
            "core": "1/4",
        },
    ]
    far["info"]["host"] = {
        "gpu_numa_node": 0,
        "processes": [
            {
                **proc,
                "last_cpu": 12,
                "cpu_node": 1,
                "kib_per_node": {"0": 5120, "1": 7168},
                "threads": threads,
            }
        ],
    }
    text = ps.markdown_report([near, far, old])
    row = next(line for line in text.splitlines() if line.startswith("| host:"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == [
        "CPU 3 / node 0; N0: 900 MiB; GPU node 0",
        "CPU 12 / node 1; N0: 5 MiB, N1: 7 MiB; GPU node 0; next thread "
        "`pt_main_thread` "
        "12.5 s CPU, on the main thread's core",
        "-",
    ]
    assert "| host:" not in ps.markdown_report([old])
    # No CPU topology (None cores): no claim that the two threads shared a core.
    for t in threads:
        t["core"] = None
    text = ps.markdown_report([far])
    assert "on the main thread's core" not in text and "`pt_main_thread`" in text


def test_markdown_report_eager_table():
    ddtree, dflash = _result("ddtree-15", 90.0, 20.0), _result("dflash")
    assert "launched from the host" not in ps.markdown_report([ddtree, dflash])
    ddtree["decode"]["eager_kernels_per_step"] = {WALK: 1.0, "memcpy32_post": 4.0}
    dflash["decode"]["eager_kernels_per_step"] = {"memcpy32_post": 5.0}
    text = ps.markdown_report([ddtree, dflash])
    lines = text.splitlines()
    assert "| eager launches / decode step | dflash | ddtree-15 |" in lines
    assert "| `memcpy32_post` | 5.00 | 4.00 |" in lines
    assert f"| `{ps.short_name(WALK)}` | - | 1.00 |" in lines
    assert "| **all** | **5.0** | **5.0** |" in lines
    # Listed most first; the kernel table stays last.
    assert lines.index("| `memcpy32_post` | 5.00 | 4.00 |") < lines.index(
        f"| `{ps.short_name(WALK)}` | - | 1.00 |"
    )
    assert lines[-1].startswith("| accept len")
    ddtree["decode"]["eager_kernels_per_step"] = {f"k{i}": 1.0 for i in range(45)}
    # 45 + DFlash's one: 46 names, 40 listed.
    assert "(6 more kernels not listed)" in ps.markdown_report([ddtree, dflash])


def test_decode_breakdown_needs_decode_steps():
    full, prefill = _windows([], [(GEMM, 1.0)], steps=0)
    with pytest.raises(ValueError, match="no decode steps"):
        ps.decode_breakdown(full, prefill)


def test_decode_breakdown_of_host_scopes():
    """Host scopes per decode step: (whole - prefill-only) / steps, a scope only
    one window saw counting as 0 in the other."""
    prefill = ps.make_window(
        [(GEMM, 1.0)],
        steps=2,
        wall_s=0.01,
        host_sync_us=10.0,
        host_scopes={"schedule": 100.0, "gone": 5.0},
    )
    full = ps.make_window(
        [(GEMM, 1.0)] * 5,
        steps=6,
        wall_s=0.02,
        host_sync_us=50.0,
        host_scopes={"schedule": 300.0, "propose": 80.0},
        host_scope_calls={"schedule": 6, "propose": 4},
    )
    d = ps.decode_breakdown(full, prefill)
    assert d["host_scope_calls"] == {
        "schedule": pytest.approx(1.5),
        "propose": pytest.approx(1.0),
    }
    assert d["host_scopes_us"] == {
        "schedule": pytest.approx(50.0),
        "propose": pytest.approx(20.0),
        "gone": pytest.approx(-1.25),
    }
    assert d["host_sync_us"] == pytest.approx(10.0)


def test_graph_status():
    # (graph launches, graph kernels, kernels linked to eager launches,
    #  kernels, eager launches)
    assert ps.graph_status(0, 0, 40, 40, 40) == "no graphs"
    assert ps.graph_status(2, 600, 40, 640, 40) == "recorded"
    # Eager kernels correlate with their launches, none with the graphs'.
    assert ps.graph_status(2, 0, 40, 40, 40) == "missing"
    # No correlation at all: judged by the kernel count.
    assert ps.graph_status(2, 0, 0, 640, 40) == "unlinked"
    assert ps.graph_status(2, 0, 0, 40, 40) == "missing"


class _FakeKinetoEvent:
    def __init__(self, name, device, dur_ns=0, start_ns=0, corr=0, annotation=False):
        self._v = (name, device, dur_ns, start_ns, corr, annotation)

    def name(self):
        return self._v[0]

    def device_type(self):
        return self._v[1]

    def duration_ns(self):
        return self._v[2]

    def start_ns(self):
        return self._v[3]

    def correlation_id(self):
        return self._v[4]

    def is_user_annotation(self):
        return self._v[5]

    def is_hidden_event(self):
        return False


def test_window_from_profiler_reads_kineto_events():
    from torch.autograd import DeviceType

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        _FakeKinetoEvent("cudaGraphLaunch", cpu, corr=7),
        _FakeKinetoEvent(GEMM, gpu, 10_000, 0, corr=7),
        _FakeKinetoEvent(FA, gpu, 2_000, 10_000, corr=7),
        _FakeKinetoEvent("cudaLaunchKernel", cpu, corr=8),
        _FakeKinetoEvent(WALK, gpu, 1_000, 20_000, corr=8),
        _FakeKinetoEvent("gpu_model_runner: forward", gpu, 50_000, 0, annotation=True),
        _FakeKinetoEvent("Stream Sync", gpu, 90_000, 0),
        _FakeKinetoEvent("aten::mm", cpu, corr=3),
        _FakeKinetoEvent("cudaStreamSynchronize", cpu, 3_000, corr=9),
        # Host scopes (record_function on the CPU): summed per name.
        _FakeKinetoEvent("schedule", cpu, 40_000, annotation=True),
        _FakeKinetoEvent("schedule", cpu, 20_000, annotation=True),
        _FakeKinetoEvent("propose (drafter, tree build)", cpu, 7_000, annotation=True),
    ]
    prof = types.SimpleNamespace(
        profiler=types.SimpleNamespace(
            kineto_results=types.SimpleNamespace(events=lambda: events)
        )
    )
    w = ps.window_from_profiler(prof, steps=2, wall_s=0.5)
    assert w["count"] == 3 and w["total_us"] == 13.0 and w["busy_us"] == 13.0
    assert w["graph_launches"] == 1 and w["graph_kernels"] == 2
    assert w["kernel_launches"] == 1 and w["host_syncs"] == 1
    assert w["linked_kernels"] == 1
    assert w["eager_kernels"] == {WALK: 1}  # the graph's kernels are not eager
    assert w["categories"]["tree_ops"] == 1.0
    # The GPU-side annotation is neither a kernel nor a host scope.
    assert w["host_scopes"] == {"schedule": 60.0, "propose (drafter, tree build)": 7.0}
    assert w["host_scope_calls"] == {"schedule": 2, "propose (drafter, tree build)": 1}
    assert w["host_sync_us"] == 3.0
    with pytest.raises(RuntimeError, match="no kineto results"):
        ps.window_from_profiler(types.SimpleNamespace(profiler=None), steps=1, wall_s=1)


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_window_from_a_real_cpu_profile():
    """The kineto result API this script reads exists in the installed torch."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    prof.start()
    torch.ones(8) @ torch.ones(8)
    prof.stop()
    w = ps.window_from_profiler(prof, steps=1, wall_s=0.1)
    assert w["count"] == 0 and w["graph_launches"] == 0


class _Engine:
    """Stands in for a vLLM class whose methods get host scopes."""

    def step(self, x):
        return self.inner(x) + 1

    def inner(self, x):
        return 2 * x


class _Child(_Engine):
    pass  # inherits step: no scope of its own


class _Override(_Engine):
    def step(self, x):  # same label as the parent's: recorded once
        return super().step(x)


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_instrument_host_scopes(monkeypatch):
    """Scopes wrap the methods a class defines, record only while switched on,
    show up in a real CPU profile as host scopes, and say which are missing."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    for name in ("step", "inner"):  # undo the patches after the test
        monkeypatch.setattr(_Engine, name, _Engine.__dict__[name])
    monkeypatch.setattr(_Override, "step", _Override.__dict__["step"])
    mod = __name__
    scopes = (
        ("engine step", 0, mod, "_Engine", "step"),
        ("inner part", 1, mod, "_Engine", "inner"),
        ("engine step", 0, mod, "_Override", "step"),
        ("child step", 0, mod, "_Child", "step"),
        ("no such class", 0, mod, "_Nope", "step"),
        ("no such module", 0, "benchmarks.no_such_module", "X", "f"),
    )
    on = threading.Event()
    missing = ps.instrument_host_scopes(scopes, on)
    assert missing == [
        f"{mod}._Child.step",
        f"{mod}._Nope.step",
        "benchmarks.no_such_module.X.f",
    ]
    # Twice is harmless: already wrapped methods are left alone.
    assert ps.instrument_host_scopes(scopes[:2], on) == []
    assert _Engine.step.__wrapped__ is not None
    assert _Engine.step.__wrapped__.__name__ == "step"
    assert getattr(_Engine.step.__wrapped__, "__profile_step_scope__", None) is None
    engine = _Engine()

    def profiled(switch: bool, obj=engine) -> tuple[dict, int]:
        """(host scopes, how many "engine step" ranges were recorded)."""
        if switch:
            on.set()
        prof = profile(activities=[ProfilerActivity.CPU])
        prof.start()
        for _ in range(3):
            assert obj.step(torch.ones(4)).sum().item() == 12.0
        prof.stop()
        on.clear()
        ranges = sum(e.name == "engine step" for e in prof.events())
        window = ps.window_from_profiler(prof, steps=3, wall_s=0.1)
        return window["host_scopes"], ranges

    recorded, ranges = profiled(True)
    assert set(recorded) == {"engine step", "inner part"} and ranges == 3
    assert recorded["engine step"] >= recorded["inner part"] > 0
    assert profiled(False) == ({}, 0)  # switched off: the methods run bare
    # An override calling its parent under the same label: one range per call.
    recorded, ranges = profiled(True, _Override())
    assert set(recorded) == {"engine step", "inner part"} and ranges == 3


def test_host_scopes_name_existing_methods_of_this_vllm():
    """Every HOST_SCOPES entry names a method its class defines (guards a vLLM
    upgrade that renames one: its row would stay empty)."""
    import importlib

    import conftest  # noqa: F401  (this tree's vllm/ modules, for DDTree's)

    previous = -1
    for label, indent, module, cls_name, method in ps.HOST_SCOPES:
        cls = getattr(importlib.import_module(module), cls_name)
        assert callable(cls.__dict__.get(method)), (label, module, cls_name)
        assert 0 <= indent <= previous + 1, label  # rows form a tree
        previous = indent


# ---------------------------------------------------------------------------
# Result files and the markdown table
# ---------------------------------------------------------------------------

SETUP = {
    "batch": 1,
    "max_tokens": 64,
    "input_len": 1024,
    "info": {"target": "/m/qwen3_8b", "drafter": "/m/dflash_qwen3_8b"},
}


def _result(
    config, gemm_us=60.0, tree_us=0.0, wall_us=7000.0, graph=(2, 30), setup=SETUP
):
    decode_events = [(GEMM, gemm_us), (NORM, 4.0)]
    if tree_us:
        decode_events += [(TREE, tree_us), (WALK, 1.0)]
    full, prefill = _windows(decode_events, [(GEMM, 900.0)], steps=10, graph=graph)
    decode = ps.decode_breakdown(full, prefill, wall_us=wall_us)
    return {
        "config": config,
        "setup": setup,
        "decode": decode,
        "acceptance_length": 1.05,
        "info": {"gpu": "NVIDIA H200"},
    }


def test_markdown_report():
    text = ps.markdown_report(
        [
            _result("ddtree-128", 90.0, 20.0, 8400.0),
            _result("dflash", 60.0, 0.0, 7000.0),
        ]
    )
    assert (
        "batch 1, 64 output tokens, 1024-token random prompts, "
        "qwen3_8b / dflash_qwen3_8b"
        in text
        and "NVIDIA H200" in text
    )
    lines = text.splitlines()
    assert "| us / decode step | dflash | ddtree-128 |" in lines  # config order
    gemm_label = dict(ps.CATEGORIES)["gemm"]
    assert f"| {gemm_label} | 60.0 | 90.0 |" in lines
    assert f"| {dict(ps.CATEGORIES)['tree_ops']} | 0.0 | 1.0 |" in lines
    assert "| **kernel total** | **64.0** | **115.0** |" in lines
    assert "| x DFlash (kernel total) | 1.00 | 1.80 |" in lines
    assert "| wall / decode step, unprofiled | 7000.0 | 8400.0 |" in lines
    assert "| x DFlash (wall) | 1.00 | 1.20 |" in lines
    assert "| GPU-busy fraction | 1% | 1% |" in lines
    assert "| graph kernels recorded | recorded | recorded |" in lines
    assert "| accept len | 1.05 | 1.05 |" in lines
    assert "Top kernels, dflash" in text and f"`{GEMM}`" in text
    assert "NOT recorded" not in text
    # the table is the end of the report (printed last)
    assert lines[-1].startswith("| accept len")


def test_markdown_report_flags_missing_graph_kernels():
    text = ps.markdown_report([_result("dflash", graph=(2, 0))])
    assert "CUDA-graph kernels were NOT recorded for dflash" in text
    assert "| graph kernels recorded | missing |" in text
    assert "| x DFlash (kernel total) | 1.00 |" in text
    text = ps.markdown_report([_result("ddtree-32")])
    assert "| x DFlash (kernel total) | - |" in text  # no DFlash column
    assert "No profiled config" in ps.markdown_report([])


def test_repeated_timing_takes_the_median():
    runs = [{"decode_ms_per_step": v, "tok_s": 1.0} for v in (5.0, 3.0, 4.0, 9.0)]
    timing = ps.repeated_timing(runs)
    assert timing["decode_ms_per_step"] == 4.5  # median of 3, 4, 5, 9
    assert timing["decode_ms_per_step_runs"] == [5.0, 3.0, 4.0, 9.0]
    assert timing["tok_s"] == 1.0  # the rest: the first run's
    assert ps.repeated_timing(runs[:1]) == runs[0]  # one run: unchanged
    assert ps.repeated_timing(runs[:3])["decode_ms_per_step"] == 4.0


def test_markdown_report_shows_the_repeats_range():
    a, b = _result("dflash"), _result("ddtree-15")
    assert "runs (min - max)" not in ps.markdown_report([a, b])
    a["unprofiled"] = {"decode_ms_per_step_runs": [4.0, 3.5, 5.25]}
    lines = ps.markdown_report([a, b]).splitlines()
    assert (
        "| wall / decode step, unprofiled: runs (min - max) | 3: 3500.0 - 5250.0 | - |"
    ) in lines


def test_markdown_report_host_table():
    ddtree, dflash = _result("ddtree-15", 90.0, 20.0), _result("dflash")
    # Older results have no host scopes: no host table.
    assert "Host (CPU) time" not in ps.markdown_report([ddtree, dflash])
    step, propose = ps.HOST_SCOPES[0][0], ps._PROPOSE
    ddtree["decode"].update(
        host_scopes_us={step: 5000.0, propose: 900.0}, host_sync_us=120.0
    )
    dflash["decode"].update(host_scopes_us={step: 4000.0}, host_sync_us=100.0)
    text = ps.markdown_report([ddtree, dflash])
    lines = text.splitlines()
    assert "| host us / decode step (calls) | dflash | ddtree-15 |" in lines
    assert f"| {step} | 4000.0 | 5000.0 |" in lines  # no calls recorded
    ddtree["decode"]["host_scope_calls"] = {step: 1.0, propose: 1.0}
    lines = ps.markdown_report([ddtree, dflash]).splitlines()
    assert f"| {step} | 4000.0 | 5000.0 (1.0) |" in lines
    # indented child rows; one row for the label two classes share
    assert f"| &nbsp;&nbsp;&nbsp;&nbsp;{propose} | - | 900.0 (1.0) |" in lines
    assert sum(propose in line for line in lines) == 1
    assert (
        "| CUDA synchronize calls (host waits for the GPU) | 100.0 | 120.0 |" in lines
    )
    # the kernel table stays last
    assert lines[-1].startswith("| accept len")
    assert text.index("host us / decode step") < text.index("| us / decode step")


def test_summarize_clock_samples():
    samples = [
        (1980, 500.0, 0),
        (1800, 700.0, 0x4),
        (1700, 690.0, 0x4 | 0x20),
        (1900, 610.0, None),
    ]
    out = ps.summarize_samples(samples)
    assert out["samples"] == 4
    assert out["sm_clock_mhz_mean"] == pytest.approx(1845)
    assert (out["sm_clock_mhz_min"], out["sm_clock_mhz_max"]) == (1700, 1980)
    assert out["power_w_mean"] == pytest.approx(625) and out["power_w_max"] == 700
    # Shares over the samples that carry reasons (3 of 4).
    assert out["power_limited_share"] == pytest.approx(2 / 3)
    assert out["thermal_limited_share"] == pytest.approx(1 / 3)
    assert ps.summarize_samples([(1000, 100.0, None)])["power_limited_share"] is None
    assert ps.summarize_samples([]) is None


def test_gpu_sampler_samples_until_the_block_ends():
    import threading

    calls, enough = [], threading.Event()

    def read():
        calls.append(1)
        if len(calls) >= 3:
            enough.set()
        return (1500 + len(calls), 400.0, 0)

    with ps.GpuSampler(read, interval_s=0.001) as sampler:
        assert enough.wait(10)
    n = len(sampler.samples)
    assert n >= 3 and sampler.summary()["samples"] == n
    assert len(calls) == n  # nothing read after the block

    def broken():
        raise OSError("NVML gone")

    with ps.GpuSampler(broken, interval_s=0.001) as failing:
        pass  # the run goes on
    assert failing.samples == [] and failing.summary() is None
    assert failing.error == "OSError: NVML gone"


def test_markdown_report_shows_clocks_where_sampled():
    clocked = _result("ddtree-15", 90.0, 20.0, 8400.0)
    clocked["gpu_clocks"] = ps.summarize_samples([(1700, 690.0, 0x4), (1900, 650.0, 0)])
    text = ps.markdown_report([clocked, _result("dflash", 60.0, 0.0, 7000.0)])
    lines = text.splitlines()
    assert "| SM clock, unprofiled run (MHz, mean / min) | - | 1800 / 1700 |" in lines
    assert "| power, unprofiled run (W, mean / max) | - | 670 / 690 |" in lines
    assert "| samples held back by power (by heat) | - | 50% (0%) |" in lines
    # Results without clocks (older JSONs) print no clock rows.
    assert "SM clock" not in ps.markdown_report([_result("dflash")])


# ---------------------------------------------------------------------------
# Orchestration (fake engines) and the GPU check
# ---------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU to the parent, and run_config replaced by one writing a result."""
    calls = []

    def fake(args, config, gpu, time_left):
        calls.append((config, gpu))
        result = _result(
            config,
            gemm_us=60.0 if config == "dflash" else 80.0,
            setup=ps.setup_of(args),
        )
        ps.result_path(args.out, config).write_text(json.dumps(result))
        return True

    monkeypatch.setattr(ps, "require_gpu", lambda: "FakeGPU")
    monkeypatch.setattr(ps, "run_config", fake)
    return calls


def test_run_writes_results_and_resumes(tmp_path, fake_gpu, capsys):
    out = tmp_path / "part1"
    assert ps.main(["--out", str(out), "--configs", "dflash,ddtree-32"]) == 0
    assert fake_gpu == [("dflash", "FakeGPU"), ("ddtree-32", "FakeGPU")]
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("| accept len")  # table last
    assert (out / "profile.md").read_text().strip() in printed
    assert json.loads((out / "dflash.json").read_text())["config"] == "dflash"
    assert ps.main(["--out", str(out), "--configs", "dflash,ddtree-32"]) == 0
    assert len(fake_gpu) == 2  # nothing to redo
    assert "profiled already" in capsys.readouterr().out
    part2 = tmp_path / "part2"
    assert (
        ps.main(
            [
                "--out",
                str(part2),
                "--resume-from",
                str(out),
                "--configs",
                "dflash,ddtree-32,ddtree-128",
            ]
        )
        == 0
    )
    assert fake_gpu[2:] == [("ddtree-128", "FakeGPU")]
    assert sorted(p.name for p in part2.glob("*.json")) == [
        "ddtree-128.json",
        "ddtree-32.json",
        "dflash.json",
    ]
    assert (
        "| us / decode step | dflash | ddtree-32 | ddtree-128 |"
        in (part2 / "profile.md").read_text()
    )


def test_run_refuses_another_setup(tmp_path, fake_gpu, capsys):
    out = tmp_path / "out"
    assert ps.main(["--out", str(out), "--configs", "dflash"]) == 0
    assert (
        ps.main(["--out", str(out), "--configs", "dflash", "--max-tokens", "32"]) == 2
    )
    assert "different setup (max_tokens: 64 there, 32 now)" in capsys.readouterr().err
    assert (
        ps.main(
            ["--out", str(tmp_path / "new"), "--resume-from", str(tmp_path / "nothing")]
        )
        == 2
    )
    assert "no such directory" in capsys.readouterr().err


def test_run_stops_at_the_time_limit(tmp_path, fake_gpu, capsys):
    assert (
        ps.main(
            [
                "--out",
                str(tmp_path),
                "--configs",
                "dflash,ddtree-32",
                "--limit-seconds",
                "50",
                "--config-seconds",
                "100",
            ]
        )
        == 0
    )
    assert fake_gpu == []
    assert "not started: dflash, ddtree-32" in capsys.readouterr().out


def test_report_only_needs_no_gpu(tmp_path, fake_gpu, monkeypatch, capsys):
    assert ps.main(["--out", str(tmp_path), "--configs", "dflash,ddtree-32"]) == 0
    (tmp_path / "profile.md").unlink()
    capsys.readouterr()

    def no_gpu():
        raise AssertionError("report-only asked for a GPU")

    monkeypatch.setattr(ps, "require_gpu", no_gpu)
    assert ps.main(["--out", str(tmp_path), "--report-only"]) == 0
    assert "| dflash | ddtree-32 |" in (tmp_path / "profile.md").read_text()
    assert ps.main(["--out", str(tmp_path / "empty"), "--report-only"]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_refuses_to_run_without_a_gpu(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ps.NoGPUError, match="no CUDA GPU visible"):
        ps.require_gpu()
    out = tmp_path / "out"
    assert ps.main(["--out", str(out)]) == 2
    assert "profile_step: error: no CUDA GPU visible" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


def test_failed_config_prints_its_log(tmp_path, monkeypatch, capsys):
    """A worker that exits non-zero: the parent prints the end of its log and
    returns 1 (the worker is a real subprocess that fails at once)."""
    monkeypatch.setattr(ps, "require_gpu", lambda: "FakeGPU")

    def failing_spec(args, config, gpu):
        return {"config": config}  # the worker fails on the missing keys

    monkeypatch.setattr(ps, "worker_spec", failing_spec)
    assert ps.main(["--out", str(tmp_path), "--configs", "dflash"]) == 1
    printed = capsys.readouterr().out
    assert "dflash failed; the end of its log" in printed
    assert "Error" in printed and "failed configs" in printed
    assert "===== dflash" in (tmp_path / ps.LOG_FILE).read_text()


def test_config_cut_by_the_time_limit_is_not_a_failure(tmp_path, monkeypatch, capsys):
    """A worker killed when --limit-seconds runs out: reported as cut (rerun
    hint, exit 0), the configs after it not started; a worker failing before
    the limit is still a failure."""
    import time as time_mod

    monkeypatch.setattr(ps, "require_gpu", lambda: "FakeGPU")
    monkeypatch.setattr(ps, "worker_spec", lambda args, config, gpu: {})

    def killed_at_the_limit(cmd, log, time_left, env):
        time_mod.sleep(min(time_left, 5.0))
        return False

    monkeypatch.setattr(ps.bdp, "_run_logged", killed_at_the_limit)
    argv = [
        "--out",
        str(tmp_path / "a"),
        "--configs",
        "dflash,ddtree-15",
        "--limit-seconds",
        "1.5",
        "--config-seconds",
        "1",
    ]
    assert ps.main(argv) == 0
    printed = capsys.readouterr().out
    assert "dflash: --limit-seconds ran out before it finished" in printed
    assert "ran out while profiling ['dflash']" in printed
    assert "failed" not in printed and "ddtree-15: starting" not in printed

    monkeypatch.setattr(ps.bdp, "_run_logged", lambda *a: False)  # fails at once
    argv[1] = str(tmp_path / "b")
    assert ps.main(argv) == 1
    assert "failed configs" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU"
)
def test_profiler_sees_cuda_graph_kernels():
    """CUPTI records the kernels a CUDA-graph replay runs, correlated with the
    graph launch (the 'graph kernels recorded' row of the report). On the GPU
    machine this answers, in seconds, whether profile_step.py's categories can
    be trusted with this torch/CUDA."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (a @ b).relu_()  # warm-up (cuBLAS handles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (a @ b).relu_()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    prof.stop()
    assert out.shape == (256, 256)
    w = ps.window_from_profiler(prof, steps=3, wall_s=1.0)
    assert w["graph_launches"] == 3
    assert w["categories"]["gemm"] > 0  # the graph's GEMM, nothing runs eagerly
    status = ps.graph_status(
        w["graph_launches"],
        w["graph_kernels"],
        w["linked_kernels"],
        w["count"] - w["memcpy_count"],
        w["kernel_launches"],
    )
    assert status == "recorded", (status, w["count"], w["kernel_launches"])


def test_nvml_reader_reads_the_gpu_or_says_why_not(capsys):
    """Without NVML (CPU machines) no reader and a message; with it, one
    sample of this process's GPU."""
    read = ps.nvml_reader(0)
    if read is None:
        assert "GPU clocks not sampled" in capsys.readouterr().out
    else:
        clock, watts, _ = read()
        assert clock > 0 and watts > 0
