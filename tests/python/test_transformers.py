"""attn_implementation="mtrain" in a Qwen2 model (a small config, random
weights, nothing downloaded): at full budget the logits and every parameter
gradient match the model run with SDPA (both against the model in float64,
SPEC.md section 7's rule: mtrain's error at most twice SDPA's, or 1e-4 of the
largest value); with the real Qwen2.5-3B budgets the step runs sparse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mtrain

transformers = pytest.importorskip("transformers")

BUDGETS = Path(__file__).resolve().parents[2] / "data" / "budgets"


def qwen2(heads: int, kv_heads: int, layers: int, seed: int, attn: str) -> torch.nn.Module:
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=heads * 64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    model.config._attn_implementation = attn
    return model


def step(model: torch.nn.Module, ids: torch.Tensor, **kw: object) -> dict[str, torch.Tensor]:
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": out.logits.detach(), **grads}


def test_full_budget_matches_sdpa(gen: torch.Generator) -> None:
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    name = mtrain.register_transformers(
        "mtrain_full", budgets=mtrain.TopK(10**6, 10**6), granularity=64
    )
    ids = torch.randint(0, 512, (2, 200), generator=gen)
    got = step(qwen2(4, 2, 2, seed, name), ids)
    sdpa = step(qwen2(4, 2, 2, seed, "sdpa"), ids)
    ref = step(qwen2(4, 2, 2, seed, "sdpa").double(), ids)
    assert got.keys() == ref.keys() and len(got) > 10
    for key, r in ref.items():
        e_mtrain = (got[key].double() - r).abs().max().item()
        e_sdpa = (sdpa[key].double() - r).abs().max().item()
        bound = max(2 * e_sdpa, 1e-4 * r.abs().max().item())
        assert e_mtrain <= bound, (
            f"{key}: mtrain error {e_mtrain:.3e} > {bound:.3e} (sdpa {e_sdpa:.3e})"
        )


def test_budget_file_and_sparse_budgets(gen: torch.Generator) -> None:
    """16 query and 2 kv heads as Qwen2.5-3B, each layer's pattern estimated
    online. With the real budget file (layer index = the model's layer) at
    512 tokens every head keeps >= 800 slashes: all of them, the dense
    pattern, so the layers' outputs equal SDPA's; with top-k (4, 64) they are
    sparse and differ."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    qwen_file = BUDGETS / "Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"
    file_name = mtrain.register_transformers("mtrain_qwen", budgets=qwen_file, granularity=32)
    sparse_name = mtrain.register_transformers(
        "mtrain_sparse", budgets=mtrain.TopK(4, 64), granularity=32, window=16, num_sinks=4
    )
    ids = torch.randint(0, 512, (1, 512), generator=gen)
    outs: dict[str, torch.Tensor] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for attn in (file_name, sparse_name, "sdpa"):
        model = qwen2(16, 2, 2, seed, attn)
        layer = model.model.layers[1].self_attn
        layer.register_forward_hook(lambda m, i, o, a=attn: outs.__setitem__(a, o[0].detach()))
        grads[attn] = step(model, ids)
        assert all(torch.isfinite(t).all() for t in grads[attn].values())
    scale = outs["sdpa"].abs().max()
    assert (outs[file_name] - outs["sdpa"]).abs().max() <= 1e-4 * scale
    assert (outs[sparse_name] - outs["sdpa"]).abs().max() > 0.05 * scale


def test_top_p_forced_reaches_the_estimate(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """register_transformers(top_p_forced=True): every layer's mtrain.attention call gets it,
    and the model's outputs differ from the unforced estimate's (top-p budgets that keep little
    mass: the forced sinks and window change the pattern); a bad value is refused at
    registration."""
    from mtrain import hf

    seen: list[object] = []
    real = hf.attention

    def spy(*args: object, **kw: object) -> object:
        seen.append(kw.get("top_p_forced"))
        return real(*args, **kw)

    monkeypatch.setattr(hf, "attention", spy)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    budget = mtrain.TopP(0.2, 0.2, 64, 64)
    forced = mtrain.register_transformers(
        "mtrain_topp_forced", budgets=budget, granularity=32, top_p_forced=True
    )
    plain = mtrain.register_transformers("mtrain_topp_plain", budgets=budget, granularity=32)
    ids = torch.randint(0, 512, (1, 256), generator=gen)
    logits = {name: step(qwen2(4, 2, 2, seed, name), ids)["logits"] for name in (forced, plain)}
    assert seen == [True, True, False, False]  # two layers each
    assert all(torch.isfinite(x).all() for x in logits.values())
    assert (logits[forced] - logits[plain]).abs().max() > 1e-3
    with pytest.raises(mtrain.MtrainError, match="top_p_forced"):
        mtrain.register_transformers("mtrain_bad", budgets=budget, top_p_forced=2)


def test_packed_and_masks(gen: torch.Generator) -> None:
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    name = mtrain.register_transformers("mtrain_dense", granularity=32)
    model = qwen2(4, 2, 1, seed, name)
    ids = torch.randint(0, 512, (1, 150), generator=gen)
    # packed sequences (FlashAttention kwargs): the same as running them apart
    cu = torch.tensor([0, 60, 150], dtype=torch.int32)
    pos = torch.cat([torch.arange(60), torch.arange(90)])[None]
    packed = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits
    a = model(input_ids=ids[:, :60]).logits
    b = model(input_ids=ids[:, 60:]).logits
    torch.testing.assert_close(packed, torch.cat([a, b], dim=1), rtol=1e-5, atol=1e-5)
    # restarting positions without offsets (packing mtrain cannot see) are refused
    with pytest.raises(mtrain.MtrainError) as info:
        model(input_ids=ids, position_ids=pos)
    assert info.value.status == "MTRAIN_ERR_NOT_SUPPORTED" and "cu_seq_lens_q" in info.value.message
    # an all-ones mask is no mask; a padding mask is refused
    ones = torch.ones(1, 150, dtype=torch.long)
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=ones).logits, model(input_ids=ids).logits
    )
    pad = ones.clone()
    pad[0, :10] = 0
    with pytest.raises(mtrain.MtrainError) as info:
        model(input_ids=ids, attention_mask=pad)
    assert info.value.status == "MTRAIN_ERR_NOT_SUPPORTED" and "padding" in info.value.message
