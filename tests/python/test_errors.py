"""Every bad input at the Python boundary raises mtrain.MtrainError with
mtrain's status name and a message naming the problem."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import mtrain
from conftest import randn
from mtrain import _core

BUDGETS = Path(__file__).resolve().parents[2] / "data" / "budgets"


def expect(status: str, words: str, fn: Callable[[], object]) -> mtrain.MtrainError:
    with pytest.raises(mtrain.MtrainError) as info:
        fn()
    err = info.value
    assert err.status == status, f"{err.status}: {err.message}"
    for w in words.split("|"):
        assert w.lower() in err.message.lower(), f"{w!r} not in {err.message!r}"
    assert str(err).startswith(status)
    return err


@pytest.fixture
def qkv(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return randn(gen, 64, 4, 64), randn(gen, 64, 2, 64), randn(gen, 64, 2, 64)


def test_tensor_checks(qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    q, k, v = qkv
    a = mtrain.attention
    expect("MTRAIN_ERR_UNSUPPORTED_DTYPE", "int32", lambda: a(q.int(), k.int(), v.int()))
    expect("MTRAIN_ERR_UNSUPPORTED_DTYPE", "k is torch.bfloat16", lambda: a(q, k.bfloat16(), v))
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT",
        "not contiguous|strides",
        lambda: a(q.transpose(0, 1).contiguous().transpose(0, 1), k, v),
    )
    wide = randn(torch.Generator().manual_seed(0), 64, 4, 128)
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "not contiguous", lambda: a(wide[:, :, ::2], k, v))
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "expected [tokens, heads, head_dim]", lambda: a(q[0], k, v))
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "k has shape (2, 64)", lambda: a(q, k[0], v))
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "3, 4, 3 dimensions", lambda: a(q, k[None], v))
    expect(
        "MTRAIN_ERR_HEAD_MISMATCH",
        "4 heads and k/v 3",
        lambda: a(q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1)),
    )
    expect(
        "MTRAIN_ERR_SHAPE_MISMATCH",
        "head_dim 64 but k has 32",
        lambda: a(q, k[..., :32].contiguous(), v[..., :32].contiguous()),
    )
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "64, 63, 63 tokens", lambda: a(q, k[:63], v[:63]))
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "must agree", lambda: a(q, k, v[:, :1].contiguous()))
    expect(
        "MTRAIN_ERR_NOT_SUPPORTED",
        "device meta",
        lambda: a(q.to("meta"), k.to("meta"), v.to("meta")),
    )
    expect("MTRAIN_ERR_NOT_SUPPORTED", "k is on device meta", lambda: a(q, k.to("meta"), v))
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "is not a tensor", lambda: a([1.0], k, v))  # type: ignore[arg-type]
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "softmax_scale", lambda: a(q, k, v, softmax_scale=-1.0))


def test_library_checks(qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Errors found by libmtrain itself come with its status and message."""
    q, k, v = qkv
    expect(
        "MTRAIN_ERR_BACKEND_NOT_FOUND", "nope", lambda: mtrain.attention(q, k, v, backend="nope")
    )
    expect(
        "MTRAIN_ERR_INVALID_PATTERN",
        "head 0",
        lambda: mtrain.vertical_slash_pattern(64, [([0, 3, 2], [])], granularity=16),
    )
    above = torch.zeros(1, 4, 4, dtype=torch.bool)
    above[0, 0, 3] = True
    expect(
        "MTRAIN_ERR_INVALID_PATTERN",
        "block mask head 0",
        lambda: mtrain.block_mask_pattern(above, 64, 16),
    )
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT",
        "layout 'spiral'",
        lambda: mtrain.attention(q, k, v, layout="spiral"),
    )
    big = [torch.zeros(64, h, 1000) for h in (4, 2, 2)]
    expect(
        "MTRAIN_ERR_UNSUPPORTED_HEAD_DIM",
        "head_dim 1..512, got 1000",
        lambda: mtrain.attention(*big),
    )


def test_pattern_and_batch_checks(qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    q, k, v = qkv
    a = mtrain.attention
    p = mtrain.dense_pattern(60, 4, 16)
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "seq_len 60|seq_len 64", lambda: a(q, k, v, pattern=p))
    p = mtrain.dense_pattern(64, 2, 16)
    expect("MTRAIN_ERR_HEAD_MISMATCH", "2 heads|4 heads", lambda: a(q, k, v, pattern=p))
    p = mtrain.dense_pattern(64, 4, 16)
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT",
        "granularity=32",
        lambda: a(q, k, v, pattern=p, granularity=32),
    )
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "pattern= must be", lambda: a(q, k, v, pattern=3))
    cu = torch.tensor([0, 30, 20, 64])
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "increase strictly", lambda: a(q, k, v, cu_seqlens=cu))
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT", "int32 or int64", lambda: a(q, k, v, cu_seqlens=cu.float())
    )
    cu = torch.tensor([0, 30, 60])
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "q has 64 tokens", lambda: a(q, k, v, cu_seqlens=cu))
    expect(
        "MTRAIN_ERR_SHAPE_MISMATCH",
        "2 patterns for 3",
        lambda: a(
            q,
            k,
            v,
            pattern=[mtrain.dense_pattern(20, 4, 16)] * 2,
            cu_seqlens=torch.tensor([0, 20, 40, 64]),
        ),
    )
    q4 = q.view(2, 32, 4, 64)
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT",
        "batched",
        lambda: a(q4, k.view(2, 32, 2, 64), v.view(2, 32, 2, 64), cu_seqlens=cu),
    )
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT",
        "transpose(1, 2)",
        lambda: a(q4.transpose(1, 2), k.view(2, 32, 2, 64), v.view(2, 32, 2, 64)),
    )


def test_budget_checks(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    q, k, _ = qkv
    e = mtrain.estimate_pattern
    qwen = BUDGETS / "Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"
    expect("MTRAIN_ERR_HEAD_MISMATCH", "16 heads but q has 4", lambda: e(q, k, qwen, 0))
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "layer 36 not in [0, 36)", lambda: e(q, k, qwen, 36))
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "needs layer=", lambda: e(q, k, qwen))
    expect("MTRAIN_ERR_IO", "missing.json", lambda: e(q, k, tmp_path / "missing.json", 0))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"0": ["vertical_and_slash", 10]}]')
    expect("MTRAIN_ERR_FORMAT", "bad.json", lambda: e(q, k, bad, 0))
    expect("MTRAIN_ERR_INVALID_BUDGET", "head 0", lambda: e(q, k, mtrain.TopP(1.5, 0.5)))
    expect(
        "MTRAIN_ERR_HEAD_MISMATCH",
        "3 budgets given for 4",
        lambda: e(q, k, [mtrain.TopK(1, 2)] * 3),
    )
    expect("MTRAIN_ERR_INVALID_ARGUMENT", "budgets= must be", lambda: e(q, k, 7))


def test_files_and_handles(tmp_path: Path) -> None:
    expect("MTRAIN_ERR_IO", "nothing.json", lambda: mtrain.load_pattern(tmp_path / "nothing.json"))
    f = tmp_path / "p.json"
    f.write_text('{"granularity": 16, "seq_len": 64, "heads": [{"diagonal": [0]}]}')
    expect("MTRAIN_ERR_FORMAT", "p.json", lambda: mtrain.load_pattern(f))
    q = torch.zeros(64, 4, 64)
    fake = torch.tensor([1, 2, 3])
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT",
        "not an mtrain handle",
        lambda: torch.ops.mtrain.attn_fwd(q, q, q, fake),
    )
    p = mtrain.dense_pattern(64, 4, 16)
    expect(
        "MTRAIN_ERR_INVALID_ARGUMENT",
        "handle of this kind",
        lambda: torch.ops.mtrain.attn_fwd(q, q, q, p.handle),
    )


def test_backward_op_checks(qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    q, k, v = qkv
    opts = _core.Options(pattern="dense", granularity=16).encode()
    plan = torch.ops.mtrain.pattern_plan(q, [], None, opts)
    o, lse = torch.ops.mtrain.attn_fwd(q, k, v, plan)
    bwd = torch.ops.mtrain.attn_bwd
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "lse is", lambda: bwd(o, q, k, v, o, lse.double(), plan))
    expect(
        "MTRAIN_ERR_SHAPE_MISMATCH",
        "dout is",
        lambda: bwd(o[:, :2].contiguous(), q, k, v, o, lse, plan),
    )
    other = torch.ops.mtrain.pattern_plan(q[:32], [], None, opts)
    expect("MTRAIN_ERR_SHAPE_MISMATCH", "plan has 32", lambda: bwd(o, q, k, v, o, lse, other))


def test_error_object() -> None:
    err = expect("MTRAIN_ERR_IO", "", lambda: mtrain.load_pattern("/nonexistent/p.json"))
    assert err.code == -10
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.status, back.message) == (err.code, err.status, err.message)
    assert isinstance(err, RuntimeError)
