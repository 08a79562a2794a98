# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trained pair embedded exactly in real model shapes.

Writes a target with Qwen3-8B's shapes and a DFlash drafter with
z-lab/Qwen3-8B-DFlash-b16's shapes whose outputs equal the small trained pair's
(``models/pycode``), so that every GEMM, attention and MLP of a step runs at
full size while the drafter is accepted exactly as often as the pair's.

The construction (the small model's dims live in the big one's first dims; all
else is arranged to add exactly zero):

* Residual stream: small dims ``0..h-1``. Every write-side matrix (``o_proj``,
  ``down_proj``, the embedding, the drafter's ``fc``) is zero outside the
  embedded block, so the other dims stay exactly 0. Read-side matrices (q/k/v,
  gate/up, the LM head) are random outside it, so the big GEMMs run on real
  data at their real cost.
* RMSNorm over the hidden size: weight ``w / sqrt(H / h)`` (the zeros shrink
  the mean square by ``H / h``).
* Heads: small q head ``i`` of kv head ``i // gs`` goes to big head
  ``(i // gs) * gb + i % gs`` (``gs``, ``gb``: the query heads per kv head);
  kv head ``k`` to ``k``. In a head, small dim ``i`` goes to ``r * i`` and
  ``d/2 + i`` to ``D/2 + r * i`` (``r = D / d``): with the same RoPE theta, neox
  RoPE rotates the same pairs at bit-identical frequencies. The other dims of a
  real head are zero, so ``q_norm``/``k_norm`` see a mean square ``r`` times
  smaller: ``k_norm`` takes ``w / sqrt(r)``, ``q_norm`` keeps ``w`` (its
  ``sqrt(r)`` cancels the softmax scale's ``1 / sqrt(r)``).
* Layers: small layer 0 at big layer 0, small layer ``s >= 1`` at big layer
  ``target_layer_ids[s - 1]`` of the big drafter; every other big layer is an
  identity (write side zero). DFlash reads the residual stream after layer
  ``id``, which after big layer ``P[s]`` equals the small one after layer
  ``s``; the big ``fc`` reads the blocks of the small drafter's ids and is zero
  on the others. Drafter layers past the small drafter's are identities.
* Vocabulary: the pair's (exact at every temperature), or the big config's
  (``--vocab full``, T=0 only): LM-head rows past the pair's repeat the pad
  token's, whose logit they tie, so an argmax (the lowest id among ties) never
  picks one and greedy output stays exact. The drafter's probabilities, and so
  DDTree's trees, spread over the copies: that variant measures the cost of the
  full LM head and builder, not the pair's tree acceptance.

Usage (about 16 GB written; on a GPU the random weights are drawn there)::

    python3 benchmarks/embed_pair.py --out /data/pycode-8b
    vllm serve /data/pycode-8b/target --speculative-config \\
      '{"method": "ddtree", "model": "/data/pycode-8b/drafter"}'
"""

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "benchmarks" / "models" / "pycode"
MODEL_CONFIGS = ROOT / "benchmarks" / "model_configs"
# Tokenizer and generation files the target directory takes from the pair.
TARGET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)
# Fields of the pair's config that the embedded models keep: the same tokens,
# positions, RoPE and dtype make the outputs equal.
PAIR_FIELDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "dtype",
)
# Read-side weights outside the embedded block: random, of a trained model's
# scale, so that the big GEMMs see real data.
RANDOM_STD = 0.02
SHARD_BYTES = 4 << 30


# ---------------------------------------------------------------------------
# The map from small to big
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The attention and MLP sizes of one Qwen3 model (target or drafter)."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> "Shape":
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            head_dim=config.get(
                "head_dim", config["hidden_size"] // config["num_attention_heads"]
            ),
            vocab=config["vocab_size"],
        )


@dataclass(frozen=True)
class EmbeddingMap:
    """Where each small index lands in the big model, for one model pair."""

    small: Shape
    big: Shape

    def check(self) -> None:
        s, b = self.small, self.big
        need = {
            "hidden_size": (s.hidden, b.hidden),
            "intermediate_size": (s.intermediate, b.intermediate),
            "num_key_value_heads": (s.num_kv_heads, b.num_kv_heads),
            "query heads per kv head": (
                s.num_heads // s.num_kv_heads,
                b.num_heads // b.num_kv_heads,
            ),
            "vocab_size": (s.vocab, b.vocab),
        }
        for name, (small, big) in need.items():
            if small > big:
                raise ValueError(f"{name}: the small model's {small} > the big {big}")
        if b.head_dim % s.head_dim or s.head_dim % 2:
            raise ValueError(
                f"head_dim {b.head_dim} must be a multiple of the small {s.head_dim}"
            )

    @property
    def norm_scale(self) -> float:
        """RMSNorm weight factor over the hidden size."""
        return math.sqrt(self.small.hidden / self.big.hidden)

    @property
    def head_ratio(self) -> int:
        return self.big.head_dim // self.small.head_dim

    def head_dims(self) -> torch.Tensor:
        """``[d]``: the big in-head dim of each small in-head dim (neox halves)."""
        d, r = self.small.head_dim, self.head_ratio
        i = torch.arange(d // 2)
        return torch.cat([r * i, self.big.head_dim // 2 + r * i])

    def q_heads(self) -> torch.Tensor:
        """``[num_heads]``: the big query head of each small one."""
        gs = self.small.num_heads // self.small.num_kv_heads
        gb = self.big.num_heads // self.big.num_kv_heads
        i = torch.arange(self.small.num_heads)
        return (i // gs) * gb + i % gs

    def rows(self, heads: torch.Tensor) -> torch.Tensor:
        """Big projection rows of the small heads ``0..len(heads)-1``, in the
        small rows' order."""
        dims = self.head_dims()
        return (heads[:, None] * self.big.head_dim + dims[None, :]).flatten()


def layer_slots(small_layers: int, big_ids: list[int], big_layers: int) -> list[int]:
    """``P``: the big layer of each small target layer. Layer 0 stays; small
    layer ``s >= 1`` goes to the big drafter's ``target_layer_ids[s - 1]``."""
    slots = [0, *big_ids]
    if len(big_ids) != small_layers - 1:
        raise ValueError(
            f"the big drafter reads {len(big_ids)} target layers; embedding a "
            f"{small_layers}-layer target needs {small_layers - 1}"
        )
    if slots != sorted(set(slots)) or slots[-1] >= big_layers:
        raise ValueError(
            f"target_layer_ids {big_ids} must rise from 1 and stay below "
            f"{big_layers} layers"
        )
    return slots


def fc_blocks(small_ids: list[int], slots: list[int], big_ids: list[int]) -> list[int]:
    """The big ``fc`` input block of each small one: small id ``s`` is the
    stream after big layer ``slots[s]``."""
    if not all(1 <= s < len(slots) for s in small_ids):
        raise ValueError(
            f"the small drafter's target_layer_ids {small_ids} must lie in "
            f"1..{len(slots) - 1} (layer 0 stays in place and is read by none)"
        )
    return [big_ids.index(slots[s]) for s in small_ids]


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


class Weights:
    """Makes the big tensors: zero, random or embedding a small one."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int):
        self.device = device
        self.dtype = dtype
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def ones(self, *shape: int) -> torch.Tensor:
        return torch.ones(shape, dtype=self.dtype, device=self.device)

    def random(self, *shape: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        return out.normal_(0.0, RANDOM_STD, generator=self.gen)

    def put(
        self,
        big: torch.Tensor,
        small: torch.Tensor,
        rows: torch.Tensor | None = None,
        cols: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``big[rows][:, cols] = small`` (ranges from 0 where None)."""
        small = small.to(device=self.device, dtype=self.dtype)
        rows = torch.arange(small.shape[0]) if rows is None else rows
        if small.dim() == 1:
            big[rows.to(self.device)] = small
            return big
        cols = torch.arange(small.shape[1]) if cols is None else cols
        big[rows.to(self.device)[:, None], cols.to(self.device)[None, :]] = small
        return big

    def read_side(self, out_dim: int, in_dim: int, real_rows: torch.Tensor):
        """A read-side matrix: random, with the embedded rows zero but for the
        small block (put by the caller)."""
        w = self.random(out_dim, in_dim)
        w[real_rows.to(self.device)] = 0
        return w


def hidden_norm(w: Weights, m: EmbeddingMap, small: torch.Tensor | None):
    """An RMSNorm over the hidden size: the small weight scaled, or ones."""
    big = w.ones(m.big.hidden)
    if small is not None:
        w.put(big, small.float() * m.norm_scale)
    return big


def head_norm(w: Weights, m: EmbeddingMap, small: torch.Tensor, scale: float):
    """``q_norm``/``k_norm``: the small weight at its dims times ``scale``."""
    big = w.ones(m.big.head_dim)
    return w.put(big, small.float() * scale, m.head_dims())


def attention(
    w: Weights, m: EmbeddingMap, small: dict[str, torch.Tensor] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's ``self_attn.*`` tensors (``small``: the small layer's, by name
    below ``self_attn.``; None: an identity layer)."""
    b = m.big
    none = torch.zeros(0, dtype=torch.long)
    q_rows = m.rows(m.q_heads()) if small else none
    kv_rows = m.rows(torch.arange(m.small.num_kv_heads)) if small else none
    hid = torch.arange(m.small.hidden)
    for name, rows, heads in (
        ("q_proj", q_rows, b.num_heads),
        ("k_proj", kv_rows, b.num_kv_heads),
        ("v_proj", kv_rows, b.num_kv_heads),
    ):
        # Real heads are zero but for the small rows: the head norms see the
        # zeros, and no random value reaches the embedded output.
        real = (rows // b.head_dim).unique()
        block = (real[:, None] * b.head_dim + torch.arange(b.head_dim)).flatten()
        big = w.read_side(heads * b.head_dim, b.hidden, block)
        if small:
            w.put(big, small[f"{name}.weight"], rows, hid)
        yield f"{name}.weight", big
    o = w.zeros(b.hidden, b.num_heads * b.head_dim)
    if small:
        w.put(o, small["o_proj.weight"], hid, q_rows)
    yield "o_proj.weight", o
    if small:
        yield "q_norm.weight", head_norm(w, m, small["q_norm.weight"], 1.0)
        k_scale = m.head_ratio**-0.5
        yield "k_norm.weight", head_norm(w, m, small["k_norm.weight"], k_scale)
    else:
        yield "q_norm.weight", w.ones(b.head_dim)
        yield "k_norm.weight", w.ones(b.head_dim)


def mlp(
    w: Weights, m: EmbeddingMap, small: dict[str, torch.Tensor] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's ``mlp.*`` tensors, as :func:`attention`."""
    b = m.big
    neurons = torch.arange(m.small.intermediate if small else 0)
    for name in ("gate_proj", "up_proj"):
        big = w.read_side(b.intermediate, b.hidden, neurons)
        if small:
            w.put(big, small[f"{name}.weight"])
        yield f"{name}.weight", big
    down = w.zeros(b.hidden, b.intermediate)
    if small:
        w.put(down, small["down_proj.weight"])
    yield "down_proj.weight", down


def below(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` under ``prefix``, named below it."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def decoder_layer(
    w: Weights, m: EmbeddingMap, small: dict[str, torch.Tensor] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One decoder layer's tensors, named below the layer (``small``: the small
    layer's, likewise; None: an identity layer)."""
    for part, make in (("self_attn.", attention), ("mlp.", mlp)):
        for name, t in make(w, m, below(small, part) if small else None):
            yield part + name, t
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        yield name, hidden_norm(w, m, small[name] if small else None)


def target_tensors(
    w: Weights,
    m: EmbeddingMap,
    state: dict[str, torch.Tensor],
    slots: list[int],
    pad_id: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The target's tensors; small layer ``s`` at big layer ``slots[s]``;
    LM-head rows past the pair's vocabulary repeat row ``pad_id``."""
    b, sv, sh = m.big, m.small.vocab, m.small.hidden
    embed = w.zeros(b.vocab, b.hidden)
    yield "model.embed_tokens.weight", w.put(embed, state["model.embed_tokens.weight"])
    small_of = {big: s for s, big in enumerate(slots)}
    for i in range(b.num_layers):
        small = below(state, f"model.layers.{small_of[i]}.") if i in small_of else None
        for name, t in decoder_layer(w, m, small):
            yield f"model.layers.{i}.{name}", t
    yield "model.norm.weight", hidden_norm(w, m, state["model.norm.weight"])
    head = w.zeros(b.vocab, b.hidden)
    head[:sv] = w.random(sv, b.hidden)
    head[:sv, :sh] = state["lm_head.weight"].to(head)
    # The pad token is never predicted; the rows repeating it tie its logit,
    # and an argmax takes the lower, real id.
    head[sv:] = head[pad_id]
    yield "lm_head.weight", head


def drafter_tensors(
    w: Weights,
    m: EmbeddingMap,
    state: dict[str, torch.Tensor],
    fc_in: tuple[int, int],
    blocks: list[int],
    num_blocks: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The drafter's tensors. ``fc_in``: the small and big targets' hidden
    sizes; small ``fc`` input block ``j`` goes to big block ``blocks[j]`` of
    ``num_blocks``."""
    small_in, big_in = fc_in
    fc = w.zeros(m.big.hidden, big_in * num_blocks)
    cols = torch.cat([blk * big_in + torch.arange(small_in) for blk in blocks])
    yield "fc.weight", w.put(fc, state["fc.weight"], None, cols)
    yield "hidden_norm.weight", hidden_norm(w, m, state["hidden_norm.weight"])
    for i in range(m.big.num_layers):
        small = below(state, f"layers.{i}.") if i < m.small.num_layers else None
        for name, t in decoder_layer(w, m, small):
            yield f"layers.{i}.{name}", t
    yield "norm.weight", hidden_norm(w, m, state["norm.weight"])


# ---------------------------------------------------------------------------
# Configs and files
# ---------------------------------------------------------------------------


def embedded_config(big: dict, pair: dict, vocab: str) -> dict:
    """The big config with the pair's tokens, positions, RoPE and dtype."""
    config = {
        k: v
        for k, v in big.items()
        if k not in ("rope_theta", "rope_scaling", "torch_dtype", "max_window_layers")
    }
    config.update({k: pair[k] for k in PAIR_FIELDS if k in pair})
    config["layer_types"] = ["full_attention"] * big["num_hidden_layers"]
    if vocab == "pair":
        config["vocab_size"] = pair["vocab_size"]
    return config


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


class ShardWriter:
    """Writes tensors into safetensors shards of about ``limit`` bytes, with
    the index vLLM and transformers read."""

    def __init__(self, out: Path, limit: int, label: str):
        self.out, self.limit, self.label = out, limit, label
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[list[str]] = []
        self.total = 0
        self.start = time.monotonic()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        self.pending[name] = tensor.to("cpu", non_blocking=False).contiguous()
        self.size += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        index = len(self.files)
        save_file(
            self.pending,
            str(self.out / f"part-{index:05d}.safetensors"),
            metadata={"format": "pt"},
        )
        self.files.append(list(self.pending))
        self.total += self.size
        print(
            f"embed_pair: {self.label} shard {index + 1}: {self.size / 1e9:.2f} GB "
            f"({self.total / 1e9:.1f} GB in {time.monotonic() - self.start:.0f} s)",
            flush=True,
        )
        self.pending, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        if n == 1:
            (self.out / "part-00000.safetensors").rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"part-{i:05d}.safetensors").rename(self.out / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=1) + "\n"
        )


def write_model(out: Path, config: dict, tensors, label: str, shard_bytes: int):
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    writer = ShardWriter(out, shard_bytes, label)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return writer.total


def embed_pair(
    out: Path,
    pair: Path = PAIR,
    target_config: Path = MODEL_CONFIGS / "qwen3_8b" / "config.json",
    drafter_config: Path = MODEL_CONFIGS / "dflash_qwen3_8b" / "config.json",
    vocab: str = "pair",
    device: str | None = None,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
) -> dict:
    """Writes ``out/target`` and ``out/drafter``; returns what was written."""
    if vocab not in ("pair", "full"):
        raise ValueError(f"vocab must be 'pair' or 'full', not {vocab!r}")
    pair = Path(pair)
    small_t = json.loads((pair / "target" / "config.json").read_text())
    small_d = json.loads((pair / "drafter" / "config.json").read_text())
    big_t = embedded_config(json.loads(Path(target_config).read_text()), small_t, vocab)
    big_d = embedded_config(
        json.loads(Path(drafter_config).read_text()), small_d, vocab
    )
    big_ids = list(big_d["dflash_config"]["target_layer_ids"])
    small_ids = list(small_d["dflash_config"]["target_layer_ids"])
    big_d["dflash_config"] = {
        **big_d["dflash_config"],
        "mask_token_id": small_d["dflash_config"]["mask_token_id"],
    }
    big_d["block_size"] = small_d["block_size"]
    if big_d.get("target_hidden_size", big_t["hidden_size"]) != big_t["hidden_size"]:
        raise ValueError("the big drafter's target_hidden_size is not the target's")
    big_d["target_hidden_size"] = big_t["hidden_size"]
    big_d["num_target_layers"] = big_t["num_hidden_layers"]

    tm = EmbeddingMap(Shape.of(small_t), Shape.of(big_t))
    dm = EmbeddingMap(Shape.of(small_d), Shape.of(big_d))
    tm.check()
    dm.check()
    if dm.small.num_layers > dm.big.num_layers:
        raise ValueError("the big drafter has fewer layers than the small one")
    slots = layer_slots(tm.small.num_layers, big_ids, tm.big.num_layers)
    blocks = fc_blocks(small_ids, slots, big_ids)
    out = Path(out)
    # What the weights depend on: an embedding made from the same is kept.
    made_from = {
        "pair": _digest(pair / "target" / "model.safetensors")
        + _digest(pair / "drafter" / "model.safetensors"),
        "target": big_t,
        "drafter": big_d,
        "vocab_mode": vocab,
        "seed": seed,
    }
    done = out / "embedding.json"
    if done.is_file() and json.loads(done.read_text()).get("made_from") == made_from:
        print(f"embed_pair: {out} is up to date")
        return json.loads(done.read_text())
    done.unlink(missing_ok=True)

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, small_t.get("dtype", "float16"))
    w = Weights(dev, dtype, seed)
    with torch.inference_mode():
        t_bytes = write_model(
            out / "target",
            big_t,
            target_tensors(
                w,
                tm,
                load_state(pair / "target"),
                slots,
                small_t.get("pad_token_id", 0),
            ),
            "target",
            shard_bytes,
        )
        d_bytes = write_model(
            out / "drafter",
            big_d,
            drafter_tensors(
                w,
                dm,
                load_state(pair / "drafter"),
                (tm.small.hidden, tm.big.hidden),
                blocks,
                len(big_ids),
            ),
            "drafter",
            # One file, as DFlash drafters ship (about 2 GB at 8B).
            1 << 40,
        )
    for name in TARGET_FILES:
        if (pair / "target" / name).is_file():
            shutil.copy(pair / "target" / name, out / "target" / name)
    summary = {
        "pair": str(pair),
        "target_config": str(target_config),
        "drafter_config": str(drafter_config),
        "vocab": big_t["vocab_size"],
        "layer_slots": slots,
        "fc_blocks": blocks,
        "seed": seed,
        "target_bytes": t_bytes,
        "drafter_bytes": d_bytes,
        "made_from": made_from,
    }
    (out / "embedding.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pair", type=Path, default=PAIR)
    p.add_argument(
        "--target-config", type=Path, default=MODEL_CONFIGS / "qwen3_8b" / "config.json"
    )
    p.add_argument(
        "--drafter-config",
        type=Path,
        default=MODEL_CONFIGS / "dflash_qwen3_8b" / "config.json",
    )
    p.add_argument(
        "--vocab",
        choices=("pair", "full"),
        default="pair",
        help="pair: the pair's vocabulary, exact at any temperature; full: the "
        "big config's (T=0 only: its padded rows tie the pad token's logit)",
    )
    p.add_argument("--device", default=None, help="where random weights are drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=SHARD_BYTES / (1 << 30))
    args = p.parse_args(argv)
    start = time.monotonic()
    summary = embed_pair(
        args.out,
        args.pair,
        args.target_config,
        args.drafter_config,
        args.vocab,
        args.device,
        args.seed,
        int(args.shard_gb * (1 << 30)),
    )
    total = summary["target_bytes"] + summary["drafter_bytes"]
    print(
        f"embed_pair: wrote {args.out} ({total / 1e9:.1f} GB, "
        f"layers {summary['layer_slots']}, fc blocks {summary['fc_blocks']}) in "
        f"{time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
