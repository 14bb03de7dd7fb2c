"""Which of keys 0..8 (BOS and MQAR's four key-value pairs) and which block diagonals the
library's top-p pattern (TopP(0.9, 0.9, N, N), G 128) keeps, per layer and head, on the first
training batch at N tokens (dense attention carries the activations from layer to layer).
Usage: python topp_kept_keys.py WEIGHTS N BATCH"""
import sys, torch, torch.nn.functional as F, transformers, mtrain
from examples.train import model as M
from examples.train.tasks import Vocab, batch, make_task
N=int(sys.argv[2]); B=int(sys.argv[3])
def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    q = query.transpose(1, 2).contiguous(); k = key.transpose(1, 2).contiguous()
    for b in range(q.shape[0]):
        for name, bud in (("topp", mtrain.TopP(0.9, 0.9, N, N)),):
            pat = mtrain.estimate_pattern(q[b], k[b], bud, granularity=128).patterns[0]
            for h in range(pat.num_heads):
                d, v = pat.head(h)
                vs = set(v)
                print(f"layer {module.layer_idx} seq {b} head {h}: {len(v)} verticals, keys 0-8 kept {[j for j in range(9) if j in vs]}, diagonals {len(d)} first {d[:6]}")
    o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return o.transpose(1, 2).contiguous(), None
transformers.AttentionInterface.register("k", attn)
vocab = Vocab(32, 32, 256)
tasks = [make_task("mqar", N, vocab, num_pairs=4, num_queries=24), make_task("passkey", N, vocab, digits=5)]
model = M.build(M.SIZES["mini"], vocab.size, N, 10000.0, "k", 0)
model.load_state_dict(torch.load(sys.argv[1], map_location="cpu", weights_only=True)); model.eval()
ids, labels, _, which = batch(tasks, 1, 0, B)
print("answers of seq 0 at", torch.nonzero(labels[0]!=-100).flatten()[:10].tolist(), "...")
with torch.no_grad(): model.model(input_ids=ids)
