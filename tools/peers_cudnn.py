# ruff: noqa: N806, E501  (N, G, H, R: the names of docs/SPEC.md; tables of arguments)
"""peers_cudnn.py: cuDNN's attention through the nvidia-cudnn-frontend Python graph API (issue 21).

- dense(): the graph API's SDPA, causal (diagonal_band_right_bound=0, top-left alignment), GQA
  native, bf16 in and out, fp32 softmax: a forward graph without stats, and for
  forward+backward a forward graph with stats and an sdpa_backward graph run one after the other;
- block_mask_fwd(): the same forward with a block mask (`block_mask=`: per 128 x 128 tile one
  bit, uint8 [B, H, ceil(S_q/128), ceil(ceil(S_kv/128)/8)], the unified implementation, cuDNN
  backend >= 9.14) and the causal mask inside the diagonal tile: the pairs of a block-mask
  pattern of granularity 128, exactly. Forward only: the frontend's backward with a block mask
  needs cuDNN 9.27 and its unified backward. The order of the bits inside a byte is not
  documented: check_block_mask() compares the output on a small case with a masked fp32
  reference for the least-significant-bit-first order, then the other, and the bench uses the
  one that matches (or reports that neither does).
The frontend's separate CuTe DSL block-sparse kernels (cudnn.block_sparse_attention, SM90
paths) need nvidia-cutlass-dsl (its cu13 libraries: an 87.7 MiB wheel), not carried.
"""

from __future__ import annotations

from typing import Any

import torch
from peers_common import CannotRun, module_version, reason

TILE = 128


def pack_block_mask(mask: torch.Tensor, lsb_first: bool = True) -> torch.Tensor:
    """[H, nbq, nbk] bool -> uint8 [1, H, nbq, ceil(nbk / 8)], tile kb in bit kb % 8 of byte
    kb // 8 (lsb_first) or bit 7 - kb % 8."""
    H, nbq, nbk = mask.shape
    nbytes = (nbk + 7) // 8
    bits = torch.zeros(H, nbq, nbytes * 8, dtype=torch.int32, device=mask.device)
    bits[..., :nbk] = mask.int()
    bits = bits.view(H, nbq, nbytes, 8)
    shifts = torch.arange(8, device=mask.device)
    if not lsb_first:
        shifts = 7 - shifts
    return (bits << shifts).sum(-1).to(torch.uint8)[None].contiguous()


def load() -> tuple[Any, str]:
    try:
        import cudnn
    except Exception as e:
        raise CannotRun(f"import cudnn (nvidia-cudnn-frontend) failed: {reason(e)}") from e
    try:
        backend = cudnn.backend_version_string()
    except Exception as e:
        backend = f"unknown ({reason(e)})"
    return cudnn, f"nvidia-cudnn-frontend {module_version(cudnn)}, cuDNN backend {backend}"


class Graphs:
    """The cuDNN graphs of one shape: q [1, H, N, d], k and v [1, Hkv, N, d], bf16."""

    def __init__(self, cudnn: Any, q: torch.Tensor, k: torch.Tensor) -> None:
        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        self.q_shape, self.k_shape = tuple(q.shape), tuple(k.shape)
        self.scale = q.shape[-1] ** -0.5
        self.ws = torch.empty(0, dtype=torch.uint8, device=q.device)

    def _graph(self) -> Any:
        c = self.cudnn
        c.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        return c.pygraph(io_data_type=c.data_type.BFLOAT16, intermediate_data_type=c.data_type.FLOAT,
                         compute_data_type=c.data_type.FLOAT, handle=self.handle)  # fmt: skip

    def _tensor(self, g: Any, uid: int, shape: tuple, dtype: Any) -> Any:
        return g.tensor(
            uid=uid, dim=list(shape), stride=self._tensor_stride(shape), data_type=dtype
        )

    def _qkv(self) -> tuple[Any, Any, Any, Any]:
        """A new graph and its bf16 inputs q, k, v (uids 0, 1, 2), shared by both graphs."""
        g = self._graph()
        bf = self.cudnn.data_type.BFLOAT16
        return (g, self._tensor(g, 0, self.q_shape, bf), self._tensor(g, 1, self.k_shape, bf),
                self._tensor(g, 2, self.k_shape, bf))  # fmt: skip

    def _build(self, g: Any) -> Any:
        c = self.cudnn
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        size = g.get_workspace_size()
        if size > self.ws.numel():
            self.ws = torch.empty(size, dtype=torch.uint8, device=self.ws.device)
        return g

    def forward(self, stats: bool, block_mask: torch.Tensor | None = None) -> Any:
        """The causal forward graph; uids q 0, k 1, v 2, o 3, stats 4, block mask 5."""
        c = self.cudnn
        g, q, k, v = self._qkv()
        extra: dict[str, Any] = {}
        if block_mask is not None:
            extra["block_mask"] = self._tensor(g, 5, tuple(block_mask.shape), c.data_type.UINT8)
            extra["implementation"] = c.attention_implementation.UNIFIED
        o, st = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=stats, attn_scale=self.scale,
                       diagonal_band_right_bound=0, diagonal_alignment=c.diagonal_alignment.TOP_LEFT,
                       **extra)  # fmt: skip
        o.set_uid(3).set_output(True).set_dim(list(self.q_shape)).set_stride(
            self._tensor_stride(self.q_shape)
        )
        if stats:
            shape = (*self.q_shape[:3], 1)
            st.set_uid(4).set_output(True).set_data_type(c.data_type.FLOAT).set_dim(
                list(shape)
            ).set_stride(self._tensor_stride(shape))
        return self._build(g)

    def backward(self) -> Any:
        """The causal backward graph; uids q 0, k 1, v 2, o 3, stats 4, dO 6, dQ 7, dK 8, dV 9."""
        c = self.cudnn
        g, q, k, v = self._qkv()
        bf = c.data_type.BFLOAT16
        o = self._tensor(g, 3, self.q_shape, bf)
        st = self._tensor(g, 4, (*self.q_shape[:3], 1), c.data_type.FLOAT)
        do = self._tensor(g, 6, self.q_shape, bf)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=st,
                                     attn_scale=self.scale, diagonal_band_right_bound=0,
                                     diagonal_alignment=c.diagonal_alignment.TOP_LEFT)  # fmt: skip
        for t, uid, shape in ((dq, 7, self.q_shape), (dk, 8, self.k_shape), (dv, 9, self.k_shape)):
            t.set_uid(uid).set_output(True).set_dim(list(shape)).set_stride(
                self._tensor_stride(shape)
            )
        return self._build(g)

    @staticmethod
    def _tensor_stride(shape: tuple) -> list[int]:
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        return stride

    def run(self, g: Any, pack: dict[int, torch.Tensor]) -> None:
        g.execute(pack, self.ws, handle=self.handle)


def dense(cudnn: Any, sets: list[dict]) -> tuple[Any, Any]:
    """(fwd(i), fwd_bwd(i)) on the input sets (fwd_bwd None, with the reason printed, when the
    backward graph is refused)."""
    s0 = sets[0]
    gr = Graphs(cudnn, s0["q"], s0["k"])
    fg = gr.forward(stats=False)
    outs = [torch.empty_like(s["q"]) for s in sets]

    def fwd(i: int) -> None:
        s = sets[i % 2]
        gr.run(fg, {0: s["q"], 1: s["k"], 2: s["v"], 3: outs[i % 2]})

    try:
        tg, bg = gr.forward(stats=True), gr.backward()
    except Exception as e:
        print(f"  cudnn-fe dense: backward graph refused: {reason(e)}", flush=True)
        return fwd, None
    q0 = s0["q"]
    stats = [torch.empty((*q0.shape[:3], 1), dtype=torch.float32, device=q0.device) for _ in sets]
    grads = [
        (torch.empty_like(s["q"]), torch.empty_like(s["k"]), torch.empty_like(s["v"])) for s in sets
    ]

    def fwd_bwd(i: int) -> None:
        s, j = sets[i % 2], i % 2
        gr.run(tg, {0: s["q"], 1: s["k"], 2: s["v"], 3: outs[j], 4: stats[j]})
        dq, dk, dv = grads[j]
        gr.run(
            bg,
            {
                0: s["q"],
                1: s["k"],
                2: s["v"],
                3: outs[j],
                4: stats[j],
                6: s["dout"],
                7: dq,
                8: dk,
                9: dv,
            },
        )

    return fwd, fwd_bwd


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """fp32 causal attention restricted to the block mask [H, nb, nb] (tiles of 128; moved to
    q's device: bench_block_kernels.random_mask builds it on the CPU)."""
    mask = mask.to(q.device)
    n = q.shape[2]
    group = q.shape[1] // k.shape[1]
    i = torch.arange(n, device=q.device)
    allowed = mask[:, i[:, None] // TILE, i[None, :] // TILE] & (i[None, :] <= i[:, None])
    s = (
        torch.einsum("bhid,bhjd->bhij", q.float(), k.float().repeat_interleave(group, 1))
        * q.shape[-1] ** -0.5
    )
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum(
        "bhij,bhjd->bhid", torch.softmax(s, -1), v.float().repeat_interleave(group, 1)
    )


def check_block_mask(
    cudnn: Any, mask_small: torch.Tensor, heads: int, kv_heads: int, d: int, device: str = "cuda"
) -> tuple[bool, str]:
    """(lsb_first, note): which bit order makes the block-masked forward equal the masked
    reference on a small case (N = 128 * mask_small.shape[1]); CannotRun when neither does.
    The mask may be on the CPU (bench_block_kernels.random_mask): it is moved to the GPU, as
    the packed mask the graph reads must be."""
    n = TILE * mask_small.shape[1]
    mask_small = mask_small.to(device)
    g = torch.Generator(device=device).manual_seed(5)
    q, k, v = (torch.randn(1, h, n, d, generator=g, device=device).to(torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    ref = reference(q, k, v, mask_small)
    errs = []
    for lsb in (True, False):
        bm = pack_block_mask(mask_small, lsb)
        gr = Graphs(cudnn, q, k)
        fg = gr.forward(stats=False, block_mask=bm)
        o = torch.empty_like(q)
        gr.run(fg, {0: q, 1: k, 2: v, 3: o, 5: bm})
        if o.is_cuda:
            torch.cuda.synchronize()
        err = (o.float() - ref).abs().max().item()
        errs.append(err)
        if err <= 2e-2:
            return lsb, f"bit order {'LSB' if lsb else 'MSB'} first (max error {err:.1e} at N={n})"
    raise CannotRun(f"block-masked output differs from the masked reference (max error LSB first "
                    f"{errs[0]:.2e}, MSB first {errs[1]:.2e} at N={n})")  # fmt: skip


def block_mask_fwd(cudnn: Any, sets: list[dict], mask: torch.Tensor, lsb_first: bool) -> Any:
    """fwd(i): the block-masked causal forward on the input sets."""
    bm = pack_block_mask(mask.to(sets[0]["q"].device), lsb_first)
    gr = Graphs(cudnn, sets[0]["q"], sets[0]["k"])
    fg = gr.forward(stats=False, block_mask=bm)
    outs = [torch.empty_like(s["q"]) for s in sets]

    def fwd(i: int) -> None:
        s = sets[i % 2]
        gr.run(fg, {0: s["q"], 1: s["k"], 2: s["v"], 3: outs[i % 2], 5: bm})

    return fwd
