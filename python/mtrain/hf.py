"""transformers integration through its public registries: mtrain.register_transformers
adds an attention function (AttentionInterface.register) and a mask function
(AttentionMaskInterface.register) under one name, so that
``attn_implementation="mtrain"`` runs mtrain.attention in Llama/Qwen2-family
models. Nothing of transformers is patched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import _lib as L
from .api import attention

__all__ = ["register_transformers"]


@dataclass
class _Settings:
    budgets: Any = None
    pattern: Any = None
    group: Any = None
    layout: str = "striped"
    granularity: int = 128
    backend: str | None = None
    deterministic: bool = True
    dense_above: float | str | None = None
    dense_recheck: int = 1
    estimate: dict[str, int] = field(default_factory=dict)


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
        if s.budgets is not None:
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


def register_transformers(
    name: str = "mtrain",
    *,
    budgets: Any = None,
    pattern: Any = None,
    group: Any = None,
    layout: str = "striped",
    granularity: int = 128,
    backend: str | None = None,
    deterministic: bool = True,
    last_q: int = 64,
    num_sinks: int = 30,
    window: int = 100,
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
        group, layout, granularity: context parallel defaults; a model call can
            instead pass ``mtrain_dispatch=info`` (mtrain.dispatch's DispatchInfo),
            which transformers hands to the attention function.
        backend, deterministic, last_q, num_sinks, window, dense_above, dense_recheck: as in
            mtrain.attention (dense_above: a layer whose estimated pattern is denser runs
            torch's dense attention; "auto" for the device's measured threshold).

    Returns:
        The name registered.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if budgets is not None and pattern is not None:
        raise L.fail(L.ERR_INVALID_ARGUMENT, "give budgets= or pattern=, not both")
    _settings[name] = _Settings(
        budgets=budgets,
        pattern=pattern,
        group=group,
        layout=layout,
        granularity=granularity,
        backend=backend,
        deterministic=deterministic,
        dense_above=dense_above,
        dense_recheck=dense_recheck,
        estimate=(
            {"last_q": last_q, "num_sinks": num_sinks, "window": window}
            if budgets is not None
            else {}
        ),
    )
    AttentionInterface.register(name, _attention_function(name))
    AttentionMaskInterface.register(name, _mask_function)
    return name
