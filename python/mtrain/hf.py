"""transformers integration through its public registries: mtrain.register_transformers
adds an attention function (AttentionInterface.register) and a mask function
(AttentionMaskInterface.register) under one name, so that
``attn_implementation="mtrain"`` runs mtrain.attention in Llama/Qwen2-family
models (dense, a given pattern, the vertical-slash estimate, or a block
selection of every call's q and k). Nothing of transformers is patched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import _lib as L
from .api import _block_options, attention, check_top_p_forced, select_blocks

__all__ = ["register_transformers"]


@dataclass
class _Settings:
    budgets: Any = None
    pattern: Any = None
    blocks: dict[str, Any] | None = None
    group: Any = None
    layout: str = "striped"
    granularity: int = 128
    backend: str | None = None
    deterministic: bool = True
    dense_above: float | str | None = None
    dense_recheck: int = 1
    estimate: dict[str, Any] = field(default_factory=dict)


_settings: dict[str, _Settings] = {}


def _attention_function(name: str) -> Any:
    def mtrain_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        s = _settings[name]
        if attention_mask is not None:
            raise L.fail(
                L.ERR_NOT_SUPPORTED,
                "attn_implementation='mtrain' got an attention mask with padding: mtrain computes "
                "causal attention over whole sequences; pack sequences instead (cu_seq_lens_q= "
                "with batch 1, or equal lengths) and drop the padding mask",
            )
        if dropout:
            raise L.fail(
                L.ERR_NOT_SUPPORTED, f"attention dropout {dropout}: mtrain has no dropout (set 0)"
            )
        if kwargs.get("sliding_window") is not None:
            raise L.fail(L.ERR_NOT_SUPPORTED, "sliding-window layers are not supported by mtrain")
        if query.shape[2] != key.shape[2]:
            raise L.fail(
                L.ERR_NOT_SUPPORTED,
                f"{query.shape[2]} queries against {key.shape[2]} keys (a KV cache): mtrain is for "
                "training, every query and key of a sequence at once",
            )
        # transformers: [B, H, N, d]; mtrain: [B, N, H, d] (one copy each way)
        q = query.transpose(1, 2).contiguous()
        k = key.transpose(1, 2).contiguous()
        v = value.transpose(1, 2).contiguous()
        info = kwargs.get("mtrain_dispatch")
        kw: dict[str, Any] = {
            "softmax_scale": scaling,
            "backend": s.backend,
            "deterministic": s.deterministic,
            **s.estimate,
        }
        if info is not None:
            kw.update(info.attention_kwargs())
        else:
            kw.update(group=s.group, layout=s.layout, granularity=s.granularity)
        cu = kwargs.get("cu_seq_lens_q")
        pos = kwargs.get("position_ids")
        if (
            cu is None
            and info is None
            and isinstance(pos, torch.Tensor)
            and pos.device.type == "cpu"
        ):
            # positions that restart are packed sequences, which need their offsets
            n = pos.shape[-1]
            if not torch.equal(pos.reshape(-1, n), torch.arange(n).expand(pos.numel() // n, n)):
                raise L.fail(
                    L.ERR_NOT_SUPPORTED,
                    "position_ids are not 0..N-1 (packed sequences?): pass cu_seq_lens_q= (and "
                    "cu_seq_lens_k=) with a batch of 1, or mtrain_dispatch= for context parallel",
                )
        if cu is not None:
            if q.shape[0] != 1:
                raise L.fail(L.ERR_INVALID_ARGUMENT, "cu_seq_lens_q needs a batch of 1")
            q, k, v = q[0], k[0], v[0]
            kw["cu_seqlens"] = cu
        layer = getattr(module, "layer_idx", None)
        if s.blocks is not None:
            # the block selection of this call's q and k, then the attention over it
            patterns = select_blocks(q, k, **s.blocks, **kw)
            o = attention(q, k, v, pattern=patterns, **kw)
        elif s.budgets is not None:
            o = attention(
                q, k, v, budgets=s.budgets, layer=layer, dense_above=s.dense_above,
                dense_recheck=s.dense_recheck, **kw,
            )  # fmt: skip
        else:
            pattern = s.pattern(layer) if callable(s.pattern) else s.pattern
            o = attention(q, k, v, pattern=pattern, **kw)
        if cu is not None:
            o = o.unsqueeze(0)
        return o, None

    return mtrain_attention


def _mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No mask for causal attention (the attention is causal by itself); a
    padding mask is passed on, for the attention function to refuse."""
    del batch_size, q_length, q_offset, kv_offset, mask_function, kwargs
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


_BLOCK_KEYS = ("method", "top_k", "top_p", "sink_blocks", "local_blocks", "stride", "head_adaptive")


def _check_blocks(blocks: Any) -> dict[str, Any]:
    """The select_blocks options of register_transformers(blocks=...), checked."""
    if not isinstance(blocks, dict):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"blocks= must be a dict of mtrain.select_blocks options, got {type(blocks).__name__}",
        )
    unknown = sorted(set(blocks) - set(_BLOCK_KEYS))
    if unknown:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"blocks= has {', '.join(unknown)}: the options are {', '.join(_BLOCK_KEYS)}",
        )
    if blocks.get("method", "antidiag") == "precise":
        raise L.fail(
            L.ERR_NOT_SUPPORTED,
            "blocks= with method 'precise': it needs the forward's LSE, which an attention call "
            "does not have before it runs (use 'antidiag' or 'meanpool', or mtrain.select_blocks "
            "with lse= by hand)",
        )
    defaults: dict[str, Any] = {"method": "antidiag", "top_k": None, "top_p": None}
    defaults.update(sink_blocks=1, local_blocks=1, stride=8, head_adaptive=False)
    _block_options(**{**defaults, **blocks})  # types, and exactly one of top_k and top_p
    return dict(blocks)


def register_transformers(
    name: str = "mtrain",
    *,
    budgets: Any = None,
    pattern: Any = None,
    blocks: dict[str, Any] | None = None,
    group: Any = None,
    layout: str = "striped",
    granularity: int = 128,
    backend: str | None = None,
    deterministic: bool = True,
    last_q: int = 64,
    num_sinks: int = 30,
    window: int = 100,
    top_p_forced: bool = False,
    dense_above: float | str | None = None,
    dense_recheck: int = 1,
) -> str:
    """Registers ``name`` with transformers' AttentionInterface and
    AttentionMaskInterface; then ``from_pretrained(..., attn_implementation=name)``
    or ``config._attn_implementation = name`` runs mtrain in every attention layer.

    Args:
        budgets: estimate each layer's pattern online every step: a budget file
            (the model's layer index selects the file's layer), mtrain.TopK / TopP,
            or a per-head list. None: ``pattern``.
        pattern: None (dense causal), an mtrain.Pattern, or a callable
            layer_idx -> pattern.
        blocks: select a block-sparse pattern online every call with
            mtrain.select_blocks from the layer's q and k: the dict of its options
            (method "antidiag" or "meanpool", top_k or top_p, sink_blocks,
            local_blocks, stride, head_adaptive); "precise" needs the forward's LSE,
            which a call does not have before it runs, and is refused.
        group, layout, granularity: context parallel defaults; a model call can
            instead pass ``mtrain_dispatch=info`` (mtrain.dispatch's DispatchInfo),
            which transformers hands to the attention function.
        backend, deterministic, last_q, num_sinks, window, top_p_forced, dense_above,
            dense_recheck: as in mtrain.attention (top_p_forced: top-p budgets keep the sinks
            and the window too; dense_above: a layer whose estimated pattern is denser runs
            torch's dense attention; "auto" for the device's measured threshold).

    Returns:
        The name registered.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if sum(x is not None for x in (budgets, pattern, blocks)) > 1:
        raise L.fail(L.ERR_INVALID_ARGUMENT, "give one of budgets=, pattern= and blocks=")
    if blocks is not None:
        blocks = _check_blocks(blocks)
    _settings[name] = _Settings(
        budgets=budgets,
        pattern=pattern,
        blocks=blocks,
        group=group,
        layout=layout,
        granularity=granularity,
        backend=backend,
        deterministic=deterministic,
        dense_above=dense_above,
        dense_recheck=dense_recheck,
        estimate=(
            {
                "last_q": last_q,
                "num_sinks": num_sinks,
                "window": window,
                "top_p_forced": bool(check_top_p_forced(top_p_forced)),
            }
            if budgets is not None
            else {}
        ),
    )
    AttentionInterface.register(name, _attention_function(name))
    AttentionMaskInterface.register(name, _mask_function)
    return name
