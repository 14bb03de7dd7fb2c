"""Recall and density of top-p (sinks and window forced) at 32K on the dense 16K weights, for
p and last_q choices, on the first training batch; recall = the dense softmax mass inside the
pattern, on ROWS sampled query rows per head (and on the answer rows), dense activations.
Usage: python recall_study.py WEIGHTS N BATCH [ROWS]"""
import json
import sys

import torch
import torch.nn.functional as F
import transformers

import mtrain
from examples.train import model as M
from examples.train.tasks import Vocab, batch, make_task

W, N, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ROWS = int(sys.argv[4]) if len(sys.argv) > 4 else 512
G = 128
CONFIGS = {
    "topp 0.90, L 64, forced": (mtrain.TopP(0.9, 0.9, N, N), 64, True),
    "topp 0.90, L 64, nothing forced": (mtrain.TopP(0.9, 0.9, N, N), 64, False),
    "topp 0.95, L 64, forced": (mtrain.TopP(0.95, 0.95, N, N), 64, True),
    "topp 0.90, L 256, forced": (mtrain.TopP(0.9, 0.9, N, N), 256, True),
    "topp 0.95, L 256, forced": (mtrain.TopP(0.95, 0.95, N, N), 256, True),
    "static TopK(30 + N/32, 100 + N/64)": (mtrain.TopK(30 + N // 32, 100 + N // 64), 64, True),
}
ACC = {c: {"recall": [], "recall_answer": [], "pairs": 0, "causal": 0} for c in CONFIGS}
ANS: dict = {}
gen = torch.Generator().manual_seed(7)
SAMPLE = torch.randint(0, N, (ROWS,), generator=gen)


def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    q = query.transpose(1, 2).contiguous()
    k = key.transpose(1, 2).contiguous()
    hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    for b in range(q.shape[0]):
        rows = torch.unique(torch.cat([SAMPLE, ANS[b]]))
        is_ans = torch.isin(rows, ANS[b])
        cols = torch.arange(N)
        for name, (bud, lq, forced) in CONFIGS.items():
            plan = mtrain.estimate_pattern(q[b], k[b], bud, granularity=G, last_q=lq,
                                           top_p_forced=forced if bud.__class__ is mtrain.TopP else False)
            pat = plan.patterns[0]
            a = ACC[name]
            a["pairs"] += plan.computed_pairs
            a["causal"] += hq * N * (N + 1) // 2
            for h in range(hq):
                dg, vs = pat.head(h)
                isd = torch.zeros(N // G + 2, dtype=torch.bool)
                isd[torch.tensor(dg, dtype=torch.long)] = True
                isv = torch.zeros(N, dtype=torch.bool)
                if vs:
                    isv[torch.tensor(vs, dtype=torch.long)] = True
                lg = (q[b, rows, h].double() @ k[b, :, h // (hq // hkv)].double().T) * d**-0.5
                causal = cols[None, :] <= rows[:, None]
                diff = (rows // G)[:, None] - (cols // G)[None, :]
                allowed = (isd[diff.clamp(min=0)] | isv[None, :]) & causal
                full = torch.logsumexp(lg.masked_fill(~causal, float("-inf")), -1)
                part = torch.logsumexp(lg.masked_fill(~allowed, float("-inf")), -1)
                rec = torch.exp(part - full)
                a["recall"].append(rec[~is_ans].mean().item())
                a["recall_answer"].append(rec[is_ans].mean().item())
    o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                       enable_gqa=True)
    return o.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("recall_study", attn)
vocab = Vocab(32, 32, 256)
tasks = [make_task("mqar", N, vocab, num_pairs=4, num_queries=24),
         make_task("passkey", N, vocab, digits=5)]
model = M.build(M.SIZES["mini"], vocab.size, N, 10000.0, "recall_study", 0)
model.load_state_dict(torch.load(W, map_location="cpu", weights_only=True))
model.eval()
ids, labels, _, which = batch(tasks, 1, 0, B)
for b in range(B):
    ANS[b] = torch.nonzero(labels[b, 1:] != -100).flatten()
with torch.no_grad():
    model.model(input_ids=ids)
out = {}
for name, a in ACC.items():
    out[name] = {"density": round(a["pairs"] / a["causal"], 4),
                 "recall_sampled_rows": round(sum(a["recall"]) / len(a["recall"]), 4),
                 "recall_answer_rows": round(sum(a["recall_answer"]) / len(a["recall_answer"]), 4),
                 "heads": len(a["recall"])}
    print(f"{name:40s} {json.dumps(out[name])}", flush=True)
json.dump({"weights": W, "seq_len": N, "batch": B, "rows": ROWS, "configs": out},
          open(f"/tmp/tp/recall-{N}.json", "w"), indent=1)
