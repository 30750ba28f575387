"""Training through attnfast's backward: the same models trained with attnfast and with
PyTorch's SDPA, from the same seed on the same batches; their loss curves agree to float32
noise and both learn the task.

    python examples/train_attention.py               # both parts, default sizes
    python examples/train_attention.py --steps 3000

1. The chapters' one-head example ("The cat sat ... it", causal, d = 2): W_Q, W_K, W_V learn
   to make "it" attend to "cat" (its output becomes cat's value row).
2. A tiny transformer (2 layers, 4 query heads over 2 KV heads: GQA, random init from a seed)
   on a synthetic task: at position i predict the token at position i - 5 (a causal copy
   that only attention can do).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import attnfast.integrations.torch as aft


def attend(q, k, v, backend):
    if backend == "attnfast":
        return aft.attention(q, k, v, causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


def one_head(backend, steps=300):
    """Loss per step of the one-head example (float32)."""
    X = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.2, 0.3, 0.0]])
    W = {name: nn.Parameter(torch.tensor(w)) for name, w in (
        ("Q", [[0.0, 1.0], [2.0, 0.0], [0.0, 1.0]]), ("K", [[0.5, 0.0], [4.0, 0.0], [0.0, 2.0]]),
        ("V", [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]))}
    opt = torch.optim.Adam(W.values(), lr=0.05)
    losses = []
    for _ in range(steps):
        q, k, v = ((X @ W[n])[None] for n in "QKV")   # (H=1, T=4, d=2)
        out = attend(q, k, v, backend)[0]
        loss = ((out[3] - v[0, 1].detach()) ** 2).sum()  # "it" should read "cat"
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, backend):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.backend = heads, kv_heads, dim // heads, backend
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x):
        B, T, C = x.shape
        h = self.n1(x)
        q = self.q(h).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(B, T, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        a = attend(q, k, v, self.backend).transpose(1, 2).reshape(B, T, C)
        x = x + self.o(a)
        return x + self.mlp(self.n2(x))


class Tiny(nn.Module):
    def __init__(self, backend, vocab=16, dim=64, heads=4, kv_heads=2, layers=2, T=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(T, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, backend) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


SHIFT = 5


def tiny_transformer(backend, steps=2000, seed=0, batch=32, T=32, vocab=16):
    """(loss per step, accuracy on fresh data after training) of the copy task."""
    torch.manual_seed(seed)
    model = Tiny(backend, vocab=vocab, T=T)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, T), generator=data)
        logits = model(ids)[:, SHIFT:]
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, :-SHIFT].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        ids = torch.randint(0, vocab, (256, T), generator=data)
        accuracy = (model(ids)[:, SHIFT:].argmax(-1) == ids[:, :-SHIFT]).float().mean().item()
    return losses, accuracy


def main(steps=2000, one_head_steps=300, threads=None):
    if threads:
        torch.set_num_threads(threads)
    report = {}
    a, s = one_head("attnfast", one_head_steps), one_head("sdpa", one_head_steps)
    report["one_head"] = dict(first=a[0], last=(a[-1], s[-1]),
                              max_abs_diff=max(abs(x - y) for x, y in zip(a, s)))
    print(f"one head: loss {a[0]:.4f} -> attnfast {a[-1]:.2e}, sdpa {s[-1]:.2e}; "
          f"largest |difference| over {one_head_steps} steps {report['one_head']['max_abs_diff']:.1e}")
    (la, acc_a), (ls, acc_s) = tiny_transformer("attnfast", steps), tiny_transformer("sdpa", steps)
    diffs = [abs(x - y) for x, y in zip(la, ls)]
    report["tiny"] = dict(first=la[0], last=(la[-1], ls[-1]), accuracy=(acc_a, acc_s),
                          max_abs_diff=max(diffs), losses=(la, ls))
    print(f"tiny transformer: loss {la[0]:.3f} -> attnfast {la[-1]:.4f}, sdpa {ls[-1]:.4f}; "
          f"accuracy attnfast {acc_a:.3f}, sdpa {acc_s:.3f}")
    for n in (10, 100, 1000, steps):
        if n <= steps:
            print(f"  step {n:5d}: |loss difference| max so far {max(diffs[:n]):.1e}")
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--one-head-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    main(args.steps, args.one_head_steps, args.threads)
