# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sizes of each step at the two scales, and where each step keeps its files.

``full`` is the pair the benchmarks use (trained on an H200, each step well under
eight minutes there); ``tiny`` runs the same code on a CPU in seconds, for tests.
"""

from dataclasses import dataclass
from pathlib import Path

SEED = 1234
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<mask>")
PAD, EOS, BOS, MASK = SPECIAL_TOKENS


@dataclass(frozen=True)
class CorpusScale:
    train_bytes: int  # the cap: files are taken in hash order until it is reached
    heldout_bytes: int
    heldout_per_mille: int  # the share of files (by path hash) held out
    max_file_bytes: int


@dataclass(frozen=True)
class TokenizerScale:
    vocab_size: int  # specials included
    train_bytes: int  # the first bytes of the training part the BPE is learned on
    num_prompts: int  # held-out evaluation prompts
    prompt_tokens: int


@dataclass(frozen=True)
class TargetScale:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    eval_every: int
    eval_windows: int


@dataclass(frozen=True)
class ContinuationScale:
    prompt_len: int
    new_tokens: int
    num_train: int
    num_eval: int
    batch_size: int


@dataclass(frozen=True)
class DrafterScale:
    num_layers: int
    block_size: int
    anchors_per_seq: int
    batch_size: int  # sequences per step
    steps: int
    lr: float
    warmup: int
    loss_gamma: float  # block position k is weighted exp(-(k - 1) / gamma)
    eval_every: int
    eval_anchor_stride: int


@dataclass(frozen=True)
class Scale:
    name: str
    corpus: CorpusScale
    tokenizer: TokenizerScale
    target: TargetScale
    continuations: ContinuationScale
    drafter: DrafterScale
    time_limit: float  # seconds a training step runs before it saves and stops


MB = 1 << 20

FULL = Scale(
    name="full",
    corpus=CorpusScale(
        train_bytes=128 * MB,
        heldout_bytes=4 * MB,
        heldout_per_mille=30,
        max_file_bytes=512 * 1024,
    ),
    tokenizer=TokenizerScale(
        vocab_size=4096, train_bytes=32 * MB, num_prompts=128, prompt_tokens=128
    ),
    target=TargetScale(
        hidden_size=256,
        intermediate_size=768,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seq_len=512,
        batch_size=64,
        steps=4000,
        lr=2e-3,
        warmup=200,
        eval_every=500,
        eval_windows=128,
    ),
    continuations=ContinuationScale(
        prompt_len=128,
        new_tokens=384,
        num_train=16384,
        num_eval=256,
        batch_size=1024,
    ),
    drafter=DrafterScale(
        num_layers=2,
        block_size=16,
        anchors_per_seq=32,
        batch_size=64,
        steps=4000,
        lr=1e-3,
        warmup=200,
        loss_gamma=7.0,
        eval_every=1000,
        eval_anchor_stride=8,
    ),
    time_limit=450.0,
)

TINY = Scale(
    name="tiny",
    corpus=CorpusScale(
        train_bytes=MB,
        heldout_bytes=MB // 4,
        heldout_per_mille=30,
        max_file_bytes=64 * 1024,
    ),
    tokenizer=TokenizerScale(
        vocab_size=512, train_bytes=MB, num_prompts=4, prompt_tokens=32
    ),
    target=TargetScale(
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        seq_len=64,
        batch_size=8,
        steps=30,
        lr=3e-3,
        warmup=5,
        eval_every=15,
        eval_windows=8,
    ),
    continuations=ContinuationScale(
        prompt_len=16, new_tokens=48, num_train=32, num_eval=8, batch_size=16
    ),
    drafter=DrafterScale(
        num_layers=1,
        block_size=16,
        anchors_per_seq=4,
        batch_size=8,
        steps=20,
        lr=3e-3,
        warmup=5,
        loss_gamma=7.0,
        eval_every=10,
        eval_anchor_stride=4,
    ),
    time_limit=600.0,
)

SCALES = {s.name: s for s in (FULL, TINY)}


class MissingStepError(RuntimeError):
    """A step's input from an earlier step is not in the output directory."""


class Paths:
    """Every file the steps read and write, relative to ``--out``."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.summary = self.out / "summary.json"
        self.corpus = self.out / "corpus"
        self.train_docs = self.corpus / "train.jsonl"
        self.heldout_docs = self.corpus / "heldout.jsonl"
        self.manifest = self.corpus / "manifest.json"
        self.tokenizer = self.out / "tokenizer"
        self.tokens = self.out / "tokens"
        self.train_tokens = self.tokens / "train.npy"
        self.heldout_tokens = self.tokens / "heldout.npy"
        self.eval_prompts = self.out / "eval_prompts.json"
        self.target = self.out / "target"  # HF checkpoint + tokenizer, for vLLM
        self.target_state = self.out / "state" / "target.pt"
        self.continuations = self.out / "continuations"
        self.drafter = self.out / "drafter"  # vLLM DFlashDraftModel checkpoint
        self.drafter_state = self.out / "state" / "drafter.pt"

    def log(self, step: str) -> Path:
        return self.out / "logs" / f"{step}.log"

    def require(self, path: Path, step: str) -> Path:
        if not path.exists():
            raise MissingStepError(
                f"{path} is missing: run the `{step}` step first "
                f"(python -m benchmarks.train_pair {step} --out {self.out})"
            )
        return path
