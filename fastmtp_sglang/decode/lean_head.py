"""The head's forward in the reference engine on the bf16 CPU kernels (AMX machines).

A draft step of the shipped head is one decoder layer, its input fusion and norms: ~60 PyTorch
calls around 5 products, 3.1-3.3 ms in a cycle where reading its weights and its vocabulary
table takes ~1.1 ms (bench/results/speculation_pays/costs/). :class:`LeanHead` runs the same
maths the way decode/lean_forward.py runs the target's layers on AMX machines: each product on
the AMX-tiled weights the head's packed layers already keep (cpu_kernels/packed_linear.py), each
elementwise step one call of cpu_kernels/amx.py with the module's roundings.

A draft step (one new token per row) goes further: the whole step is one call of the kernel
(``amx.HeadStep``: the same functions and roundings, attention over the row's cached keys in
fp32), 0.96 -> 0.53 ms for the shipped head's block right after a target step on the AMX Xeon,
where its ~37 calls had paid a few microseconds of dispatch each (docs/design.md section 6.9).
So does a draft extend or a short catch-up (up to ``ONE_CALL_POSITIONS`` positions a row;
every key is written before any position attends, as the calls do): 0.52 -> 0.27 ms over 3
positions at one row, 0.84 -> 0.45 ms at four rows (hot, AMX Xeon;
bench/probes/head_extend_probe.py). Prefills keep the calls.

It covers heads without aux layers whose products all run on tiles (bf16, packed, widths a
multiple of 32); :meth:`LeanHead.__call__` returns None otherwise, and the engine calls the
module. Under autograd it is never used (training calls the module). The numbers differ from
the module's in the last bits, as the target's bf16 kernels do (tests/test_lean_head.py); fp32
never takes this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastmtp_sglang.core.attention import grouped_attention
from fastmtp_sglang.cpu_kernels import amx
from fastmtp_sglang.cpu_kernels.packed_linear import runs_packed
from fastmtp_sglang.decode.lean_forward import TileSet, _Proj


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


class LeanHead:
    """``lean(hidden, ids, positions, cache)`` -> the head's output hidden [B, S, H] after its
    final norm (``FastMTPHead.forward(..., return_logits=False)[0]``), or None where it does not
    apply (the caller then runs the module)."""

    # positions per row up to which a call runs as one kernel call (draft steps, draft extends
    # and short catch-ups); longer ones (prompts) keep the calls, whose attention is batched
    ONE_CALL_POSITIONS = 16

    def __init__(self, head):
        self.head = head
        cfg = head.cfg
        self.ok = (not cfg.aux_hidden_states and cfg.hidden_act == "silu"
                   and cfg.head_dim <= 512 and amx.available())
        a, m = head.layer.self_attn, head.layer.mlp
        if cfg.layout == "mimo":
            fuse = [_Proj([head.input_proj])]
        elif cfg.layout == "deepseek":
            fuse = [_Proj([head.eh_proj])]
        else:
            fuse = [_Proj([head.e_proj]), _Proj([head.h_proj])]
        self.projs = fuse + [_Proj([a.q_proj, a.k_proj, a.v_proj]), _Proj([a.o_proj]),
                             _Proj([m.gate_proj, m.up_proj]), _Proj([m.down_proj])]
        layer = head.layer
        # what the one-call step reads by address beside the tiles: the norms (watched by the
        # tile set, as the products' modules are) and the target's embedding (which
        # ``set_embed_and_head`` may swap: looked up on every call)
        self._norms = [head.enorm, head.hnorm, layer.input_layernorm, layer.post_attention_layernorm,
                       head.final_norm]
        self._tileset = TileSet(self.projs, watch=self._norms)
        self._step: tuple | None = None   # (tiles, amx.HeadStep or None, addresses, their tensors)
        self.H = cfg.hidden_size
        self._packed_probe = self.projs[-1].members[0]

    def _one_call(self, tiles: list) -> amx.HeadStep | None:
        """The whole step in one call of the kernel (:class:`amx.HeadStep`), for these tiles;
        None where its inputs are not all bf16 or its shapes do not fit it."""
        # the kernel reads the norms and the embedding by address: the tile set watches the
        # norms' weights (replaced or changed in place: a new tiles list), the embedding's is
        # looked up here, and a weight moved to new storage (``.to()``, ``.data =``) changes its
        # address; any of these rebuilds the step, never leaves it reading the old one.
        # (Checked every call: ~2 us.)
        embed = self.head.embed_tokens
        if embed is None:  # (a head without the target's parts: nothing to read)
            return None
        emb = embed.weight
        s = self._step
        if (s is not None and s[0] is tiles and s[3][-1] is emb
                and s[2] == tuple(t.data_ptr() for t in s[3])):
            return s[1]
        hd, cfg = self.head, self.head.cfg
        layer = hd.layer
        norms = [m.weight for m in self._norms]
        nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        step = None
        if (all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in norms + [emb])
                and D % 16 == 0 and D <= 256 and nh % nkv == 0):
            layout = {"mimo": 1, "deepseek": 2}.get(cfg.layout, 0)
            fuse = tiles[:-4]
            f0, f1 = fuse[0], (fuse[1] if layout == 0 else (None, None))
            (wqkv, bqkv), (wo, bo), (wgu, bgu), (wd, bd) = tiles[-4:]
            data = lambda p: None if p is None else p.data  # noqa: E731
            weights = [emb, norms[0], norms[1], data(f0[0]), f0[1], data(f1[0]), f1[1], norms[2],
                       wqkv.data, bqkv, wo.data, bo, norms[3], wgu.data, bgu, wd.data, bd, norms[4]]
            eps = (hd.enorm.eps, hd.hnorm.eps, layer.input_layernorm.eps,
                   layer.post_attention_layernorm.eps, hd.final_norm.eps)
            step = amx.HeadStep(weights, (cfg.hidden_size, layout, nh, nkv, D, wd.k, emb.shape[0]), eps)
        read = norms + [emb]
        self._step = (tiles, step, tuple(t.data_ptr() for t in read), read)
        return step

    def run(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The lean path where it applies, the module otherwise (what the engine and the cost
        curve call)."""
        out = self(hidden, ids, positions, cache)
        if out is None:
            out = self.head(hidden, ids, positions, cache, return_logits=False)[0]
        return out

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, cache):
        # (every operation here runs once per draft step, in ~1 ms right after a target step
        # has swept the caches, where each costs several microseconds: kept few)
        hd, H = self.head, self.H
        if (not self.ok or cache is None or torch.is_grad_enabled() or hidden.shape[-1] != H
                or hidden.dtype != torch.bfloat16 or not runs_packed(self._packed_probe, hidden)):
            return None
        tiles = self._tileset.get()
        if tiles is None:
            return None
        lin, ck = amx.linear_rows, amx
        B, S = ids.shape
        N = B * S
        step = (self._one_call(tiles) if S <= self.ONE_CALL_POSITIONS and cache._k.dtype == torch.bfloat16
                else None)
        if step is not None:  # a draft step or a short extend: one call
            need = (int(positions) if N == 1 else int(positions.max())) + 1
            tab = hd._rope_table
            if tab is None or tab[0].shape[0] < need or tab[0].dtype != torch.bfloat16:
                hd._cos_sin(hidden[:1, :1], positions)  # (grows the table to cover need)
                tab = hd._rope_table
            if tab is not None and tab[0].shape[0] >= need and tab[0].dtype == torch.bfloat16:
                cache.reserve(need)
                # (the kernel reads [B, S] as [N] and [B, S, H] as [N, H]: no reshapes)
                return step(_dense(ids), _dense(hidden), _dense(positions), cache._k, cache._v,
                            tab[0], tab[1], S, (B, S, H))
        nh, nkv, D = hd.cfg.num_attention_heads, hd.cfg.num_key_value_heads, hd.cfg.head_dim
        e = hd.embed_tokens(ids).to(torch.bfloat16).reshape(N, H).contiguous()
        h = hidden.reshape(N, H).contiguous()
        en, hn = torch.empty_like(e), torch.empty_like(h)
        ck.add_rms_(e, None, hd.enorm.weight, hd.enorm.eps, en)
        ck.add_rms_(h, None, hd.hnorm.weight, hd.hnorm.eps, hn)
        if hd.cfg.layout == "mimo":
            x = lin(torch.cat([hn, en], -1), *tiles[0])
        elif hd.cfg.layout == "deepseek":
            x = lin(torch.cat([en, hn], -1), *tiles[0])
        else:
            x = lin(en, *tiles[0]) + lin(hn, *tiles[1])
        (wqkv, bqkv), (wo, bo), (wgu, bgu), (wd, bd) = tiles[-4:]
        cos, sin = hd._cos_sin(x.view(B, S, H), positions)
        cos, sin = cos.reshape(N, D).contiguous(), sin.reshape(N, D).contiguous()
        layer = hd.layer
        t = torch.empty_like(x)
        ck.add_rms_(x, None, layer.input_layernorm.weight, layer.input_layernorm.eps, t)
        p = lin(t, wqkv, bqkv)
        ck.rope_(p, cos, sin, nh + nkv, D)
        qk = (nh + nkv) * D
        q = p[:, : nh * D].view(B, S, nh, D).transpose(1, 2)
        k = p[:, nh * D: qk].view(B, S, nkv, D).transpose(1, 2)
        v = p[:, qk:].view(B, S, nkv, D).transpose(1, 2)
        cache.write(positions, k, v)
        n = int(positions.max()) + 1
        keys, vals = cache.k[:, :, :n], cache.v[:, :, :n]
        if B == 1 and S == 1:  # one query at the last key sees every key (as the module does)
            a = F.scaled_dot_product_attention(q.reshape(1, nkv, nh // nkv, D), keys, vals)
        else:
            mask = torch.arange(n, device=ids.device)[None, None, None, :] <= positions[:, None, :, None]
            a = grouped_attention(q, keys, vals, mask).transpose(1, 2)
        o = lin(a.reshape(N, nh * D).contiguous(), wo, bo)
        ck.add_rms_(x, o, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, t)
        d = lin(ck.silu_mul(lin(t, wgu, bgu)), wd, bd)
        ck.add_rms_(x, d, hd.final_norm.weight, hd.final_norm.eps, t)
        return t.view(B, S, H)
