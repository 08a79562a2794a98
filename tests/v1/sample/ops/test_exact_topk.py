# SPDX-License-Identifier: Apache-2.0
"""exact_topk against a stable full sort: the same set, lowest ids at a tied cut."""

import pytest
import torch

from vllm.v1.sample.ops.exact_topk import CHUNK, exact_topk

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
# The interpreter has no bf16 pointers, so bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_GPU else [])


def _reference_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(x.float().cpu(), dim=-1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=-1).values


def _check(x: torch.Tensor, k: int) -> None:
    values, ids, chunk_max, chunk_sum = exact_topk(x, k, lse_partials=True)
    assert values.dtype == x.dtype and ids.dtype == torch.int64
    assert torch.equal(ids.sort(dim=-1).values.cpu(), _reference_ids(x, k))
    assert torch.equal(values, torch.gather(x, 1, ids))
    gmax = chunk_max.max(dim=-1, keepdim=True).values
    lse = gmax[:, 0] + torch.log((chunk_sum * torch.exp(chunk_max - gmax)).sum(-1))
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), dim=-1))


CPU_SHAPES = [(1, 5, 1), (3, 100, 7), (2, CHUNK + 17, 128), (2, 1000, 1000)]
GPU_SHAPES = [(15, 151936, 1), (15, 151936, 128), (960, 151936, 256),
              (4, 151936, 1024), (7, 32000, 111), (3, 128256, 500)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", CPU_SHAPES + (GPU_SHAPES if HAS_GPU else []))
def test_matches_stable_sort(dtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 7 + k)
    _check(torch.randn(rows, n, generator=gen).to(device=DEVICE, dtype=dtype), k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_at_the_cut_keep_lowest_ids(dtype):
    n = 3 * CHUNK + 5 if HAS_GPU else 2 * CHUNK + 5
    x = torch.zeros(3, n, dtype=dtype)
    x[0, 100:110] = 1.0  # ten winners, then a sea of ties
    x[1, ::5] = -1.0
    x[2, -3:] = float("-inf")
    _check(x.to(DEVICE), 20)


def test_all_equal_and_infinite_rows():
    x = torch.full((2, 300), float("-inf"))
    x[1] = 2.5
    values, ids = exact_topk(x.to(DEVICE), 10)
    assert ids.sort(-1).values.cpu().tolist() == [list(range(10))] * 2


@pytest.mark.parametrize(
    "x,k,match",
    [
        (torch.zeros(10), 1, "2-D"),
        (torch.zeros(2, 10, dtype=torch.float64), 1, "float16, bfloat16 or float32"),
        (torch.zeros(2, 10), 0, "k must be in 1..10"),
        (torch.zeros(2, 10), 11, "k must be in 1..10"),
    ],
)
def test_bad_arguments(x, k, match):
    with pytest.raises(ValueError, match=match):
        exact_topk(x, k)
