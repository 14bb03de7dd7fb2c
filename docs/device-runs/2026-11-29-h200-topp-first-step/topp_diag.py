"""Why mtrain-topp's first step at 32K lost so much more than dense (3.55 against 2.08,
docs/TRAINING.md): the first training batch of the arm, on the dense 16K weights, through
  dense       torch SDPA
  lib-topp    mtrain.attention with the arm's TopP(0.9, 0.9, N, N) (kernels and selection)
  lib-static  mtrain.attention with the static arm's TopK
  ref:<sel>   an fp32 torch reference of masked attention (chunked, on the GPU) over the pattern
              of selection <sel>: lib (the library's own top-p pattern), below (SPEC's rule:
              keep while the running sum stays < p), reach (keep through the candidate that
              reaches p), below+forced / reach+forced (sinks 30 and window 100 forced as well)
  libpat:topp[+sinks|+window|+forced]  the library's top-p pattern with keys 0..29 and/or block
              diagonals 0 and 1 added, through mtrain's kernels
and per mode: the answer-token loss, the recall (dense softmax mass inside the pattern) on all
rows and on answer rows, verticals kept, heads with no vertical, whether key 0 is kept.
Usage: python topp_diag.py WEIGHTS N BATCH [OUT.json [MODES,...]]
The published table (docs/TRAINING.md) comes from the modes dense, lib-topp, lib-static and
libpat:* (cpu-diag-*.json, DIAG_DEVICE=cpu) and the first three on the GPU
(weights-and-gpu-diag.log, where the ref:* modes stopped on a dtype error, fixed since; the
ref:* modes were not run to completion and no figure comes from them)."""
import json
import sys
import time

import torch
import torch.nn.functional as F
import transformers

import mtrain
from examples.train import model as M
from examples.train.evaluate import answer_logits
from examples.train.tasks import Vocab, batch, make_task

W, N, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
OUT = sys.argv[4] if len(sys.argv) > 4 else None
G, L, P = 128, 64, 0.9
torch.backends.cuda.matmul.allow_tf32 = False
import os
dev = torch.device(os.environ.get("DIAG_DEVICE", "cuda"))
MODE = {"m": "dense"}
ST: dict = {}
ANS: dict = {}  # answer rows per batch element (positions that predict an answer)


def scores(q: torch.Tensor, k: torch.Tensor):
    """SPEC's top-p scores of one head: vertical [vlim], slash [N] (fp64)."""
    n, d = q.shape
    a = (q[n - L:].double() @ k.double().T) * d**-0.5
    rows = torch.arange(n - L, n, device=dev)[:, None]
    cols = torch.arange(n, device=dev)[None, :]
    a = a.masked_fill(cols > rows, float("-inf"))
    s = torch.softmax(a, -1) / L
    vlim = ((n - 1) // G) * G
    vert = s.sum(0)[:vlim]
    t = (rows - cols).expand(L, n)
    m = t >= 0
    sl = torch.zeros(n, dtype=torch.float64, device=dev)
    sl.index_add_(0, t[m], s[m])
    return vert, sl


def pick(sc: torch.Tensor, rule: str, forced: torch.Tensor | None):
    vals, idx = torch.sort(sc, descending=True, stable=True)
    cs = torch.cumsum(vals, 0)
    k = int((cs < P).sum())
    if rule == "reach":
        k = min(k + 1, sc.numel())
    keep = idx[:k]
    if forced is not None:
        keep = torch.unique(torch.cat([keep, forced]))
    return torch.sort(keep).values


def py_pattern(q, k, hq, hkv, rule, forced):
    heads = []
    for h in range(hq):
        vert, sl = scores(q[:, h], k[:, h // (hq // hkv)])
        fv = torch.arange(min(30, vert.numel()), device=dev) if forced in ("forced", "sinks") else None
        fs = torch.arange(100, device=dev) if forced in ("forced", "window") else None
        vs = pick(vert, rule, fv)
        ss = pick(sl, rule, fs)
        a, b = ss // G, ss % G
        diags = torch.unique(torch.cat([a, (a + 1)[b > 0], torch.zeros(1, dtype=a.dtype, device=dev)]))
        diags = diags[diags < -(-N // G)]
        heads.append((diags, vs))
    return heads


def lib_heads(q, k, budget):
    plan = mtrain.estimate_pattern(q, k, budget, granularity=G)
    pat = plan.patterns[0]
    out = []
    for h in range(pat.num_heads):
        d, v = pat.head(h)
        out.append((torch.tensor(d, device=dev, dtype=torch.long),
                    torch.tensor(v, device=dev, dtype=torch.long)))
    return out


def ref_attention(q, k, v, heads, b, stats):
    """fp32 masked attention over the pattern; accumulates recall statistics."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    o = torch.empty(n, hq, d, device=dev, dtype=torch.float32)
    ans = ANS[b]
    cols = torch.arange(n, device=dev)
    kb = cols // G
    for h in range(hq):
        diags, verts = heads[h]
        isv = torch.zeros(n, dtype=torch.bool, device=dev)
        isv[verts] = True
        isd = torch.zeros(-(-n // G) + 1, dtype=torch.bool, device=dev)
        isd[diags] = True
        qh = q[:, h].float()
        kh = k[:, h // (hq // hkv)].float()
        vh = v[:, h // (hq // hkv)].float()
        rec_all = []
        for r0 in range(0, n, 2048):
            rows = torch.arange(r0, min(n, r0 + 2048), device=dev)
            lg = (qh[rows] @ kh.T) * d**-0.5
            causal = cols[None, :] <= rows[:, None]
            diff = (rows // G)[:, None] - kb[None, :]
            allowed = (isd[diff.clamp(min=0)] | isv[None, :]) & causal
            full = torch.logsumexp(lg.masked_fill(~causal, float("-inf")), -1)
            lgm = lg.masked_fill(~allowed, float("-inf"))
            part = torch.logsumexp(lgm, -1)
            rec_all.append(torch.exp(part - full))
            o[rows, h] = torch.softmax(lgm, -1) @ vh
        rec = torch.cat(rec_all)
        stats["recall_all"].append(rec.mean().item())
        stats["recall_answer"].append(rec[ans].mean().item() if ans.numel() else float("nan"))
        stats["verticals"].append(int(verts.numel()))
        stats["key0"].append(bool(isv[0].item()))
        stats["pairs"].append(0)
    return o


def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    mode = MODE["m"]
    query, key = query.to(value.dtype), key.to(value.dtype)
    if mode == "dense":
        o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                           enable_gqa=True)
        return o.transpose(1, 2).contiguous(), None
    q = query.transpose(1, 2).contiguous()
    k = key.transpose(1, 2).contiguous()
    v = value.transpose(1, 2).contiguous()
    hq, hkv = q.shape[2], k.shape[2]
    if mode in ("lib-topp", "lib-static"):
        bud = mtrain.TopP(P, P, N, N) if mode == "lib-topp" else mtrain.TopK(30 + N // 32, 100 + N // 64)
        o = mtrain.attention(q, k, v, softmax_scale=scaling, granularity=G, budgets=bud)
        return o, None
    sel = mode.split(":", 1)[1]
    if mode.startswith("libpat:"):
        # the library's top-p pattern with forced sinks (keys 0..29) and/or window (token
        # diagonals 0..99, i.e. block diagonals 0 and 1), through mtrain's kernels
        forced = sel.partition("+")[2]
        pats = []
        for b in range(q.shape[0]):
            heads = []
            for d_, v_ in lib_heads(q[b], k[b], mtrain.TopP(P, P, N, N)):
                d2, v2 = set(d_.tolist()), set(v_.tolist())
                if forced in ("forced", "sinks"):
                    v2 |= set(range(30))
                if forced in ("forced", "window"):
                    d2 |= {0, 1}
                heads.append((sorted(d2), sorted(v2)))
            pats.append(mtrain.vertical_slash_pattern(N, heads, granularity=G))
        outs = [mtrain.attention(q[b], k[b], v[b], softmax_scale=scaling, granularity=G,
                                 pattern=pats[b]) for b in range(q.shape[0])]
        return torch.stack(outs), None
    outs = []
    for b in range(q.shape[0]):
        if sel == "lib":
            heads = lib_heads(q[b], k[b], mtrain.TopP(P, P, N, N))
        else:
            rule, _, forced = sel.partition("+")
            heads = py_pattern(q[b], k[b], hq, hkv, rule, forced)
            if sel == "below":  # the library's own selection, for comparison
                lh = lib_heads(q[b], k[b], mtrain.TopP(P, P, N, N))
                for h in range(hq):
                    ST[mode]["differs_from_lib"].append(
                        int(not (torch.equal(lh[h][0], heads[h][0]) and torch.equal(lh[h][1], heads[h][1]))))
        with torch.autocast(dev.type, enabled=False):
            outs.append(ref_attention(q[b], k[b], v[b], heads, b, ST[mode]).to(v.dtype))
    return torch.stack(outs), None


transformers.AttentionInterface.register("topp_diag", attn)
vocab = Vocab(32, 32, 256)
tasks = [make_task("mqar", N, vocab, num_pairs=4, num_queries=24),
         make_task("passkey", N, vocab, digits=5)]
model = M.build(M.SIZES["mini"], vocab.size, N, 10000.0, "topp_diag", 0)
if W != "random":
    model.load_state_dict(torch.load(W, map_location="cpu", weights_only=True))
model.to(dev).eval()
ids, labels, _, which = batch(tasks, 1, 0, B)
ids, labels = ids.to(dev), labels.to(dev)
for b in range(B):
    ANS[b] = torch.nonzero(labels[b, 1:] != -100).flatten()
modes = ["dense", "lib-topp", "lib-static", "ref:lib", "ref:below", "ref:reach",
         "ref:below+sinks", "ref:below+window", "ref:below+forced", "ref:reach+forced"]
if len(sys.argv) > 5:
    modes = sys.argv[5].split(",")
res = {}
for mode in modes:
    MODE["m"] = mode
    ST[mode] = {k: [] for k in ("recall_all", "recall_answer", "verticals", "key0", "pairs",
                                "differs_from_lib")}
    t0 = time.time()
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        logits, target, mask = answer_logits(model, ids, labels)
        per = F.cross_entropy(logits, target, reduction="none")
    # per task: the answer tokens of each batch element in order
    counts = (labels[:, 1:] != -100).sum(1).tolist()
    parts = torch.split(per, counts)
    by_task = {["mqar", "passkey"][int(which[b])]: round(parts[b].mean().item(), 4) for b in range(B)}
    acc = (logits.argmax(-1) == target).float().mean().item()
    s = ST[mode]
    row = {"loss": round(per.mean().item(), 4), "loss_by_task": by_task, "acc": round(acc, 4),
           "seconds": round(time.time() - t0, 2)}
    if s["recall_all"]:
        nz = s["verticals"]
        row.update(recall_all=round(sum(s["recall_all"]) / len(nz), 4),
                   recall_answer=round(sum(s["recall_answer"]) / len(nz), 4),
                   recall_answer_min=round(min(s["recall_answer"]), 4),
                   verticals_mean=round(sum(nz) / len(nz), 1),
                   heads_without_verticals=sum(1 for x in nz if x == 0), heads=len(nz),
                   key0_kept=sum(s["key0"]))
        if s["differs_from_lib"]:
            row["heads_differing_from_lib"] = sum(s["differs_from_lib"])
    res[mode] = row
    print(mode, json.dumps(row), flush=True)
if OUT:
    json.dump({"weights": W, "seq_len": N, "batch": B, "modes": res}, open(OUT, "w"), indent=1)
