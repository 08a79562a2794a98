# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/greedy_margins.py on a serving run's layout made here: the
trained pair's own greedy continuations as no speculation's texts, and a
config whose text takes the runner-up token at a known step."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks import greedy_margins as gm

PROMPTS = [
    "def add(a, b):\n    return",
    "import os\n\n\ndef main():\n    path = os.",
    "class Point:\n    def __init__(self, x, y):\n        self.",
]
STEPS = 12


def _write(logs, config, texts, prompts):
    logs.mkdir(exist_ok=True)
    result = logs / f"{config}_b8_t0.0.slice0.json"
    result.write_text(json.dumps({"generated_texts": texts}))
    rows = [
        {"id": str(i), "conversations": [{"from": "human", "value": p}]}
        for i, p in enumerate(prompts)
    ]
    result.with_suffix(".prompts.json").write_text(json.dumps(rows))


@pytest.fixture(scope="module")
def pair():
    tok = transformers.AutoTokenizer.from_pretrained(gm.PAIR_TARGET)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gm.PAIR_TARGET, dtype=torch.float32
    )
    return tok, model.eval()


def _greedy(tok, model, prompt, steps, swap_at=None):
    """The pair's greedy continuation; at ``swap_at`` the runner-up token
    instead. Returns (text, (best, runner-up logits at swap_at))."""
    ids = tok(prompt)["input_ids"]
    out, swapped = [], None
    for step in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([ids + out])).logits[0, -1]
        top = torch.topk(logits, 2)
        pick = top.indices[0].item()
        if step == swap_at:
            pick = top.indices[1].item()
            swapped = (top.values[0].item(), top.values[1].item())
        if pick == tok.eos_token_id:
            break
        out.append(pick)
    return tok.decode(out), swapped


def test_margin_where_a_config_parts(pair, tmp_path, capsys):
    tok, model = pair
    ref = [_greedy(tok, model, p, STEPS)[0] for p in PROMPTS]
    got, swapped = list(ref), None
    # The first prompt whose continuation re-tokenizes to the same tokens
    # (the tool compares tokenized texts) gets its runner-up at step 3.
    for i, p in enumerate(PROMPTS):
        text, best = _greedy(tok, model, p, STEPS, swap_at=3)
        if text != ref[i]:
            got[i], swapped = text, (i, best)
            break
    assert swapped is not None, "no prompt's continuation could be altered"
    logs = tmp_path / "logs"
    _write(logs, "none", ref, PROMPTS)
    _write(logs, "ddtree", got, PROMPTS)
    out = tmp_path / "margins.json"
    rc = gm.main(["--logs", str(logs), "--out", str(out), "--tolerance", "1e-9"])
    summary = json.loads(out.read_text())
    print(f"compared {summary['compared']} texts, {len(summary['partings'])} parted")
    assert summary["compared"] == len(PROMPTS)
    (row,) = summary["partings"]
    i, (best, runner_up) = swapped
    assert row["config"] == "ddtree" and row["prompt"] == i
    assert math.isclose(row["margin"], abs(best - runner_up), abs_tol=1e-3)
    assert math.isclose(row["reference_logit"], best, abs_tol=1e-3)
    # A margin above the tolerance is reported as no tie, and fails the run.
    assert (row["tie"], rc) == ((False, 2) if row["margin"] > 1e-9 else (True, 0))
    rc = gm.main(["--logs", str(logs), "--tolerance", "100"])
    assert rc == 0
    assert "1 of them at ties" in capsys.readouterr().out


def test_no_reference_fails(tmp_path):
    logs = tmp_path / "logs"
    _write(logs, "ddtree", ["x"], ["p"])
    assert gm.main(["--logs", str(logs)]) == 1


def test_fp16_spacing_and_parting():
    assert gm.fp16_spacing(12.0) == 2**-7
    assert gm.fp16_spacing(20.0) == 2**-6
    assert gm.first_parting([1, 2, 3], [1, 2, 3]) is None
    assert gm.first_parting([1, 2, 3], [1, 5, 3]) == 1
    assert gm.first_parting([1, 2], [1, 2, 3]) == 2
