"""The target's forward in the reference engine, with the same numbers and fewer calls.

Through transformers' ``LlamaModel`` a decode step builds the mask, goes through the cache and
attention interfaces and a Python wrapper per projection, and spends eight PyTorch calls on each
RMSNorm and fourteen on the rotary embedding of q and k. At 3-5 us of dispatch per call on the
2-core CPUs this project runs on, that was about half of a bf16 plain step of the demo target
(34.9 ms through transformers against 22.2 ms here, with the same AMX products;
bench/results/speculation_pays/costs/, design section 6.9).

:class:`LeanForward` runs the same decoder layers on the same modules and the engine's
:class:`~fastmtp_sglang.decode.slot_cache.SlotCache`:

- the attention mask built once per forward from the engine's 2-D slot mask (transformers'
  causal + padding rule, a bool mask; None for one new token and no holes);
- rotary embedding applied to q and k as one tensor (their columns are adjacent in q/k/v);
- q/k/v and gate/up as one product each where the engine packed the model
  (cpu_kernels/packed_linear.py, bit-identical to the separate products up to
  ``FUSED_MAX_ROWS`` rows); separate ``F.linear``
  calls otherwise (fp32: MKL may pick another kernel for a wider matrix).

On PyTorch's kernels this is **bit-identical** to transformers (tests/test_lean_forward.py:
hidden states, kept layers and caches, fp32 and bf16, Llama and Qwen2, padding holes). On bf16
CPUs with AMX (cpu_kernels/amx.py) each elementwise step is one C call with transformers'
roundings and each product one call on AMX tiles (on AVX-512 bf16 CPUs without AMX, the same
calls of the kernels' vector build); on bf16 CPUs with AVX-512 a one-token step's
attention is one pass over the cache (cpu_kernels/decode_attention.py): the same maths within bf16
rounding (``FASTMTP_CPU_KERNELS=off`` keeps PyTorch's kernels, bit-identical).

It covers Llama-style dense decoders (``llama``, ``qwen2``, ``mistral`` without a sliding
window): :func:`unsupported` says why another model is left to transformers' own forward.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fastmtp_sglang.core.attention import fold_mask, grouped_attention
from fastmtp_sglang.cpu_kernels import amx, decode_attention
from fastmtp_sglang.cpu_kernels.packed_linear import FUSED_MAX_ROWS, _apply, fused_group, packed_weight, runs_packed

MODEL_TYPES = ("llama", "qwen2", "mistral")
ENV = "FASTMTP_LEAN_FORWARD"  # "auto" (default) or "off"


def lean_forward_for(model, mode: str | None = None) -> "LeanForward | None":
    """The engine's choice: a :class:`LeanForward` for ``model`` where it is covered and
    ``mode`` (None: ``$FASTMTP_LEAN_FORWARD``, default "auto") is not "off"; "on" insists."""
    mode = mode if mode is not None else os.environ.get(ENV, "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"lean forward mode must be auto, on or off, not {mode!r}")
    if mode == "off":
        return None
    if mode == "auto" and unsupported(model) is not None:
        return None
    return LeanForward(model)


def covers(model, mode: str | None = None) -> bool:
    """Whether :func:`lean_forward_for` gives ``model`` a lean forward (without building one)."""
    mode = mode if mode is not None else os.environ.get(ENV, "auto")
    return mode == "on" or (mode == "auto" and unsupported(model) is None)


def unsupported(model) -> str | None:
    """Why :class:`LeanForward` cannot run ``model`` (a transformers causal LM), or None."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in MODEL_TYPES:
        return f"model type {mt!r} (lean forward covers {', '.join(MODEL_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", mt == "mistral"):
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "mlp bias"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no decoder stack (model.model.layers, rotary_emb)"
    for layer in inner.layers:
        a = getattr(layer, "self_attn", None)
        if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention without q/k/v/o projections"
        if hasattr(a, "q_norm") or hasattr(a, "k_norm"):
            return "q/k norms"
    if next(model.parameters()).device.type != "cpu":
        return "not on the CPU"
    return None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, amask: torch.Tensor | None,
            scale: float, S: int) -> torch.Tensor:
    """Attention of a layer: a bf16 decode step (one new token per row) through the one-pass
    kernel where the CPU has AVX-512 (cpu_kernels/decode_attention.py: PyTorch's kernel took ~4x
    the time to read the cache at one query per row), anything else through grouped_attention."""
    if S == 1 and decode_attention.fits(q, k) and decode_attention.available():
        B, T = k.shape[0], k.shape[2]
        return decode_attention.decode_attention(q, k, v, None if amask is None else amask.view(B, T), scale)
    if S > 1 and amask is not None:  # folded once per forward by LeanForward (fold_mask)
        return grouped_attention(q, k, v, amask, scale, folded=True)
    return grouped_attention(q, k, v, amask, scale, causal=bool(S > 1 and amask is None))


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm (fp32 statistics, weight applied in the input's dtype). Written out:
    torch's fused ``rms_norm`` gives the same values but took 2x longer on CPU (torch 2.14)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class _Proj:
    """Products of one input with one or more ``nn.Linear`` members, concatenated. Where the
    engine packed the layers (cpu_kernels/packed_linear.py): one call on the fused group's prepared
    weight (the copy the layers' own forwards use), or one per member on theirs; one
    ``F.linear`` per member otherwise."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members

    def tiles(self) -> tuple | None:
        """(the AMX-tiled weight, fp32 bias or None) the members' packed forwards use (fused
        where they are fused), or None where they do not run on tiles."""
        ms = self.members
        if len(ms) > 1:
            group = fused_group(ms)
            if group is None:
                return None
            w, b = group.weight()
        else:
            w, b = packed_weight(ms[0]), ms[0].bias
        if not isinstance(w, amx.Packed) or w.k % amx.TILE_K:
            return None
        return w, (None if b is None else b.detach().float().contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ms = self.members
        if runs_packed(ms[0], x):
            group = fused_group(ms) if len(ms) > 1 and x.shape[0] <= FUSED_MAX_ROWS else None
            if group is not None:
                return _apply(x, *group.weight())
            outs = [_apply(x, packed_weight(m), m.bias) for m in ms]
        else:
            outs = [F.linear(x, m.weight, m.bias) for m in ms]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


class TileSet:
    """The AMX tiles of a list of :class:`_Proj`, resolved once and re-resolved only when a
    member's weight changed in place (version counter) or was replaced (another tensor): the
    check runs on every forward, so it reads the tensors directly (~0.2 us each) rather than
    through the modules. ``watch``: other modules whose ``weight`` is checked the same way (a
    caller that reads them by address rebuilds what it made when :meth:`get` returns a new
    list)."""

    def __init__(self, projs: list[_Proj], watch: list[torch.nn.Module] = ()):
        self.projs = projs
        self.watch = list(watch)   # other modules whose ``weight`` the caller reads beside the tiles
        self._seen: list | None = None    # [(the module's parameter dict, the weight tensor)]
        self._key = None
        self._tiles: list | None = None

    def _stamp(self):
        seen = self._seen
        if seen is None or any(p["weight"] is not w for p, w in seen):
            return None
        try:
            return tuple(w._version for _, w in seen)
        except RuntimeError:  # an inference tensor: no version counter, cannot change in place
            return ()

    def get(self) -> list | None:
        """[(tiles, fp32 bias or None)] per product, or None where any does not run on tiles."""
        key = self._stamp()
        if key is None or key != self._key:
            tiles = [p.tiles() for p in self.projs]
            self._tiles = None if any(t is None for t in tiles) else tiles
            mods = [m for p in self.projs for m in p.members] + self.watch
            self._seen = [(m._parameters, m._parameters["weight"]) for m in mods]
            self._key = self._stamp()
        return self._tiles


class LeanForward:
    """``model.model``'s forward over the engine's slot cache in fewer calls (module docstring).

    Call as ``lean(ids, pos, mask, cache, keep=())`` -> (post-norm hidden [B, S, H], hidden
    states or None): ``mask`` [B, slots + S] 0/1 as the engine passes transformers; ``keep`` the
    indices of transformers' ``hidden_states`` tuple wanted (0 = embeddings, i = after layer i,
    the last = the final norm's output), returned as a dict; ``tree`` [S, S] bool, what each new
    token sees of the new ones (default: the causal rule)."""

    def __init__(self, model):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the lean forward does not cover this model: {why}")
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = []
        for layer in self.inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm, _Proj([a.q_proj, a.k_proj, a.v_proj]),
                                _Proj([a.o_proj]), layer.post_attention_layernorm,
                                _Proj([mlp.gate_proj, mlp.up_proj]), _Proj([mlp.down_proj]),
                                float(a.scaling)))
        self._tileset = TileSet([pr for layer in self.layers for pr in (layer[1], layer[2], layer[4], layer[5])])

    # a bf16 verify's attention (2 to amx.MULTI_MAX_S tokens a row) on AMX tiles
    # (amx.multi_query_attention); False: PyTorch's attention with the folded mask, as before
    # (probes compare the two; a cycle's verify ~1.2-1.5 ms faster on tiles, docs/design.md 6.9)
    TILE_ATTENTION = True

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache,
                 keep: tuple[int, ...] = (), tree: torch.Tensor | None = None) -> tuple[torch.Tensor, dict | None]:
        B, S = ids.shape
        N, nh, nkv, D = B * S, self.n_heads, self.n_kv, self.head_dim
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, pos)
        cos, sin = cos.reshape(N, 1, D), sin.reshape(N, 1, D)
        x = x.reshape(N, -1)
        T = mask.shape[1]
        if tree is not None:  # [S, S]: which new tokens each new token sees (decode/leaves.py)
            if tree.shape != (S, S):
                raise ValueError(f"tree must be [S, S] = [{S}, {S}], got {tuple(tree.shape)}")
            seen = torch.ones(S, T, dtype=torch.bool, device=ids.device)
            seen[:, T - S:] = tree
            amask = seen[None, None] & mask.bool()[:, None, None, :]
        elif S == 1 and bool(mask.all()):
            amask = None
        else:  # key j is seen by new token i when it is filled and no later than i's own slot
            kv = torch.arange(T, device=ids.device)
            qi = torch.arange(T - S, T, device=ids.device)
            amask = (kv[None, :] <= qi[:, None])[None, None] & mask.bool()[:, None, None, :]
        L = len(self.layers)
        tiles = (self._tiles() if x.dtype == torch.bfloat16 and amx.available()
                 and runs_packed(self.layers[0][2].members[0], x) else None)
        if S > 1 and amask is not None:
            if tiles is not None and self.TILE_ATTENTION and amx.takes_multi(S, D):
                amask = amask.view(B, S, T).contiguous()  # per token: the tiles' attention (_bf16_kernels)
            else:  # the layers share it: fold it for grouped_attention once
                amask = fold_mask(amask, nh, nkv, x.dtype)
        if tiles is not None:
            return self._bf16_kernels(x.contiguous(), cos.reshape(N, D), sin.reshape(N, D), amask,
                                      cache, B, S, keep, tiles)
        hs = ({0: x.view(B, S, -1)} if 0 in keep else {}) if keep else None
        qk = (nh + nkv) * D
        for i, (ln1, qkv, o_proj, ln2, gate_up, down, scale) in enumerate(self.layers):
            h = qkv(_rms(ln1, x))
            q_k = _rotate(h[:, :qk].view(N, nh + nkv, D), cos, sin)
            q = q_k[:, :nh].view(B, S, nh, D).transpose(1, 2)
            k = q_k[:, nh:].view(B, S, nkv, D).transpose(1, 2)
            v = h[:, qk:].view(B, S, nkv, D).transpose(1, 2)
            k, v = cache.update(k, v, i)
            a = _attend(q, k, v, amask, scale, S)
            x = x + o_proj(a.transpose(1, 2).reshape(N, nh * D))
            g = gate_up(_rms(ln2, x))
            half = g.shape[-1] // 2
            x = x + down(F.silu(g[:, :half]) * g[:, half:])
            if hs is not None and i + 1 in keep and i + 1 < L:
                hs[i + 1] = x.view(B, S, -1)
        out = _rms(self.inner.norm, x).view(B, S, -1)
        if hs is not None and L in keep:
            hs[L] = out
        return out, hs

    def _tiles(self) -> list | None:
        """Per layer, the four products' (tiles, bias): the packed layers' own copies; None if
        any does not run on AMX tiles."""
        flat = self._tileset.get()
        return None if flat is None else [flat[i:i + 4] for i in range(0, len(flat), 4)]

    def _bf16_kernels(self, x, cos, sin, amask, cache, B, S, keep, tiles):
        """The same layers with each elementwise step one call of cpu_kernels/amx.py (bf16,
        AMX CPUs, or the vector build on AVX-512 bf16 ones): the residual add fused into the
        next RMSNorm, rotary embedding in place on the q/k/v product, silu(gate) * up in one
        pass."""
        N, nh, nkv, D = B * S, self.n_heads, self.n_kv, self.head_dim
        L, qk = len(self.layers), (nh + nkv) * D
        hs = ({0: x.view(B, S, -1).clone()} if 0 in keep else {}) if keep else None
        h = torch.empty_like(x)
        ln1 = self.layers[0][0]
        # the first calls checked (the norms' and rotary tables' layout, the same in every
        # layer), the rest through the kernels' unchecked entries: 120 calls a forward
        amx.add_rms_(x, None, ln1.weight, ln1.variance_epsilon, h)
        for t, name in ((cos, "cos"), (sin, "sin"), (self.inner.norm.weight, "norm")):
            amx.check_rows(t, name)
        lin, add_rms, rope = amx.linear_rows, amx.add_rms_rows, amx.rope_rows
        multi, tiles_fit = amask is not None and amask.dim() == 3, None
        for i, (_, _, _, ln2, _, _, scale) in enumerate(self.layers):
            (wqkv, bqkv), (wo, bo), (wgu, bgu), (wd, bd) = tiles[i]
            p = lin(h, wqkv, bqkv)
            rope(p, cos, sin, nh + nkv, D)
            q = p[:, : nh * D].view(B, S, nh, D).transpose(1, 2)
            k = p[:, nh * D: qk].view(B, S, nkv, D).transpose(1, 2)
            v = p[:, qk:].view(B, S, nkv, D).transpose(1, 2)
            k, v = cache.update(k, v, i)
            if multi:  # (a bool mask per token, [B, S, T]: LeanForward.__call__ chose the tiles)
                if tiles_fit is None:  # checked once: every layer's q, k, v have the first one's layout
                    tiles_fit = amx.fits_multi(q, k)
                a = (amx.multi_query_attention_rows(q, k, v, amask, scale) if tiles_fit
                     else grouped_attention(q, k, v, amask[:, None], scale))
            else:
                a = _attend(q, k, v, amask, scale, S)
            o = lin(a.transpose(1, 2).reshape(N, nh * D).contiguous(), wo, bo)
            add_rms(x, o, ln2.weight, ln2.variance_epsilon, h)
            d = lin(amx.silu_mul_rows(lin(h, wgu, bgu)), wd, bd)
            nxt = self.layers[i + 1][0] if i + 1 < L else self.inner.norm
            add_rms(x, d, nxt.weight, nxt.variance_epsilon, h)
            if hs is not None and i + 1 in keep and i + 1 < L:
                hs[i + 1] = x.view(B, S, -1).clone()
        out = h.view(B, S, -1)
        if hs is not None and L in keep:
            hs[L] = out
        return out, hs
