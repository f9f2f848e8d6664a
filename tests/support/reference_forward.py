"""A plain numpy forward pass of a qwen3moe GGUF model: the second oracle beside llama.cpp.

Written from the model's definition (Qwen3-MoE as llama.cpp computes it), independently of
moepass's converter: it reads the file with the gguf package's own reader and dequantizer and
uses none of moepass's code. Float64 throughout, so its own rounding does not matter.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class Qwen3MoeReference:
    def __init__(self, path):
        reader = GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items()}
        a = meta["general.architecture"]
        self.n_layers = meta[f"{a}.block_count"]
        self.n_heads = meta[f"{a}.attention.head_count"]
        self.n_kv = meta[f"{a}.attention.head_count_kv"]
        self.head_dim = meta[f"{a}.attention.key_length"]
        self.eps = meta[f"{a}.attention.layer_norm_rms_epsilon"]
        self.base = meta[f"{a}.rope.freq_base"]
        self.top_k = meta[f"{a}.expert_used_count"]
        self.w = {}
        for t in reader.tensors:
            values = dequantize(np.asarray(t.data), t.tensor_type)
            self.w[t.name] = values.reshape(tuple(reversed([int(d) for d in t.shape]))).astype(np.float64)

    def _rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, positions):
        """NeoX rotary embedding: rotate the two halves of each head. x: [S, heads, d]."""
        d = self.head_dim
        inv_freq = self.base ** (-np.arange(0, d, 2) / d)
        angles = positions[:, None] * inv_freq[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def logits(self, ids):
        """Logits [S, vocab] for a whole sequence (causal attention over it)."""
        return self.forward(ids)[0]

    def forward(self, ids, squares: dict | None = None):
        """(logits [S, vocab], per layer the experts chosen for each token [S, top_k]). `squares`: where
        given, each matrix's inputs' squares are added to it, as llama.cpp's imatrix collects them:
        name -> [sums of squares per column ([experts, columns] for an expert tensor), rows counted]."""
        w, S = self.w, len(ids)
        self.router_near_ties = 0

        def seen(name, rows, expert=None):
            """rows [n, columns] went into matrix `name` (its expert `expert`)."""
            if squares is None:
                return
            columns = rows.shape[-1]
            experts = w[name].shape[0] if expert is not None else 1
            sums, counts = squares.setdefault(name, [np.zeros((experts, columns)), np.zeros(experts)])
            sums[expert or 0] += (rows * rows).sum(axis=0)
            counts[expert or 0] += rows.shape[0]

        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        positions = np.arange(S, dtype=np.float64)
        x = w["token_embd.weight"][np.asarray(ids)]
        causal = np.triu(np.full((S, S), -np.inf), 1)
        routing = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self._rms(x, w[p + "attn_norm.weight"])
            for name in ("attn_q", "attn_k", "attn_v"):
                seen(p + name + ".weight", h)
            q = (h @ w[p + "attn_q.weight"].T).reshape(S, nh, d)
            k = (h @ w[p + "attn_k.weight"].T).reshape(S, nkv, d)
            v = (h @ w[p + "attn_v.weight"].T).reshape(S, nkv, d)
            q = self._rope(self._rms(q, w[p + "attn_q_norm.weight"]), positions)
            k = self._rope(self._rms(k, w[p + "attn_k_norm.weight"]), positions)
            out = np.empty((S, nh, d))
            for head in range(nh):
                kv = head // (nh // nkv)
                scores = q[:, head] @ k[:, kv].T / np.sqrt(d) + causal
                probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
                probs /= probs.sum(axis=-1, keepdims=True)
                out[:, head] = probs @ v[:, kv]
            seen(p + "attn_output.weight", out.reshape(S, nh * d))
            x = x + out.reshape(S, nh * d) @ w[p + "attn_output.weight"].T
            h = self._rms(x, w[p + "ffn_norm.weight"])
            seen(p + "ffn_gate_inp.weight", h)
            router = h @ w[p + "ffn_gate_inp.weight"].T
            probs = np.exp(router - router.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            moe = np.zeros_like(x)
            routing.append(np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k])
            ranked = -np.sort(-probs, axis=-1)  # a k-th and (k+1)-th within 1e-4: either may be taken
            self.router_near_ties += int((ranked[:, self.top_k - 1] - ranked[:, self.top_k] < 1e-4).sum())
            for t in range(S):
                chosen = routing[-1][t]
                weights = probs[t, chosen] / probs[t, chosen].sum()
                for e, weight in zip(chosen, weights):
                    gate = w[p + "ffn_gate_exps.weight"][e] @ h[t]
                    up = w[p + "ffn_up_exps.weight"][e] @ h[t]
                    act = gate / (1.0 + np.exp(-gate)) * up
                    seen(p + "ffn_gate_exps.weight", h[t][None], e)
                    seen(p + "ffn_up_exps.weight", h[t][None], e)
                    seen(p + "ffn_down_exps.weight", act[None], e)
                    moe[t] += weight * (w[p + "ffn_down_exps.weight"][e] @ act)
            x = x + moe
        h = self._rms(x, w["output_norm.weight"])
        head = w.get("output.weight", w["token_embd.weight"])
        return h @ head.T, routing
