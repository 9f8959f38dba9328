"""`fastmtp init-head`: a new FastMTP head for a target that has no MTP layer.

The block is a copy of the target's last decoder layer and ``final_norm`` a copy of the target's
final norm, so ``lm_head(final_norm(block(x)))`` is exactly the target's last layer and head. What
is missing is ``x``: at position i the target's last layer sees its residual stream r_{i+1} at
position i+1, which the head cannot see; it sees h_i (the target's output at i) and the embedding
of x_{i+1}. The default init (``lstsq``) fits the input projection by ridge regression so that
``proj(hnorm(h_i), enorm(e_{i+1})) ~ r_{i+1}`` on calibration text that ships with Python
(``pydoc_data.topics``): the head then starts as the target's own last layer on an estimated
residual stream, i.e. as close to a next-next-token predictor as a linear map allows. Positions
shift by one uniformly, which rotary attention does not see. Alternatives for comparison:
``hidden`` (x = h_i) and ``embed`` (x = e_{i+1}).

``--aux-layers 3,15`` makes a head that also reads those middle layers of the target (EAGLE-3's
multi-layer features; core/head.py): the same init plus ``fc`` = [0 .. 0 | I] and unit aux
norms, so it starts as exactly the last-layer head. ``--from DRAFT`` takes the other weights
from an existing draft directory instead of fitting them (an ablation from the same start).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

from fastmtp_sglang.core.draft_dir import make_draft_config, save_draft_dir
from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import MODEL_TYPE_TO_BLOCK, FastMTPHead, HeadConfig, head_input
from fastmtp_sglang.core.identity import target_identity
from fastmtp_sglang.core.target import Target, load_target

INIT_METHODS = ("lstsq", "hidden", "embed")


def calibration_ids(tokenizer, max_tokens: int, from_end: bool = False) -> torch.Tensor:
    """Up to ``max_tokens`` ids of the calibration text (English prose and code: the Python docs
    shipped with the interpreter, ``pydoc_data.topics``, PSF licence), tokenized topic by
    topic, from its start (the fit) or from its end (held-out scoring: disjoint while fit +
    held-out < ~110K tokens)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for k in sorted(topics, reverse=from_end):
        ids += tokenizer(topics[k] + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens])


@torch.no_grad()
def _calibration_pairs(target: Target, num_tokens: int, chunk: int = 256
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_i, e_{i+1}, r_{i+1}, x_{i+2}) over calibration chunks; each [N, H] (ids [N])."""
    if target.tokenizer is None:
        raise FastMTPError("init-head --init-proj lstsq needs the target's tokenizer")
    ids = calibration_ids(target.tokenizer, num_tokens + chunk)
    n_chunks = max(1, min(len(ids) // chunk, math.ceil(num_tokens / chunk)))
    model = target.model
    hs, es, rs, ys = [], [], [], []
    for c in range(n_chunks):
        x = ids[c * chunk:(c + 1) * chunk][None].to(model.device)
        out = model.model(input_ids=x, output_hidden_states=True)
        h = out.last_hidden_state[0].float()        # [T, H] post-norm
        r = out.hidden_states[-2][0].float()         # [T, H] input of the last layer
        e = target.embed(x)[0].float()               # [T, H]
        hs.append(h[:-2]); es.append(e[1:-1]); rs.append(r[1:-1]); ys.append(x[0, 2:])
    return torch.cat(hs), torch.cat(es), torch.cat(rs), torch.cat(ys)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def fit_projection(h: torch.Tensor, e: torch.Tensor, r: torch.Tensor, hnorm_w: torch.Tensor,
                   enorm_w: torch.Tensor, eps: float, ridge: float = 1e-3
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge fit of r ~ W_h hnorm(h) + W_e enorm(e). Returns (W_e, W_h), each [H, H]."""
    feats = torch.cat([_rms(e, enorm_w, eps), _rms(h, hnorm_w, eps)], dim=-1).double()  # [N, 2H]
    gram = feats.T @ feats
    lam = ridge * gram.diagonal().mean()
    w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), feats.T @ r.double())
    w = w.T.float()  # [H, 2H]
    hsz = h.shape[-1]
    return w[:, :hsz], w[:, hsz:]


def init_state_dict(target: Target, layout: str, method: str, calib_tokens: int
                    ) -> tuple[HeadConfig, dict[str, torch.Tensor], dict[str, Any]]:
    tcfg = target.config
    block = MODEL_TYPE_TO_BLOCK.get(tcfg.get("model_type", ""))
    cfg = make_draft_config(tcfg, layout, block=block, dtype="float32")
    head_cfg = HeadConfig.from_dict(cfg)
    inner = target.model.model
    last = inner.layers[-1].state_dict()
    sd = {"layer." + k: v.detach().float().clone() for k, v in last.items()}
    h = head_cfg.hidden_size
    sd["final_norm.weight"] = inner.norm.weight.detach().float().clone()
    # h_i already left the target's final norm: scaling it by those weights again would square them
    sd["hnorm.weight"] = torch.ones(h)
    # raw embeddings enter the target through its first layer's input norm: reuse that scale
    sd["enorm.weight"] = inner.layers[0].input_layernorm.weight.detach().float().clone()
    info: dict[str, Any] = {"method": method}
    if method == "lstsq":
        hh, ee, rr, _ = _calibration_pairs(target, calib_tokens)
        we, wh = fit_projection(hh, ee, rr, sd["hnorm.weight"], sd["enorm.weight"], head_cfg.rms_norm_eps)
        info.update(calibration="pydoc_data.topics", calibration_tokens=int(hh.shape[0]))
    else:
        eye, zero = torch.eye(h), torch.zeros(h, h)
        we, wh = (zero, eye) if method == "hidden" else (eye, zero)
    from fastmtp_sglang.core.convert import change_layout

    sd.update(change_layout({"e_proj.weight": we, "h_proj.weight": wh}, "split", layout))
    return head_cfg, sd, info


@torch.no_grad()
def step1_accuracy(target: Target, head: FastMTPHead, num_tokens: int = 2048, chunk: int = 256) -> float:
    """Top-1 accuracy of step 1 (predicting x_{i+2} from h_i, x_{i+1}) on calibration text held
    out from the fit (the chunks after the fitted ones)."""
    ids = calibration_ids(target.tokenizer, num_tokens, from_end=True)  # not used by the fit
    hits = total = 0
    for c in range(len(ids) // chunk):
        x = ids[c * chunk:(c + 1) * chunk][None]
        aux = head.cfg.aux_hidden_states
        hidden = head_input(target.model.model(input_ids=x, output_hidden_states=bool(aux)), aux)
        pos = torch.arange(chunk - 2)[None]
        _, logits = head(hidden[:, :-2], x[:, 1:-1], pos)
        hits += int((logits.argmax(-1) == x[:, 2:]).sum())
        total += chunk - 2
    return hits / max(total, 1)


def add_aux_layers(head_cfg: HeadConfig, sd: dict[str, torch.Tensor], aux: list[int],
                   num_layers: int) -> HeadConfig:
    """Give a head's state dict (in place) the fused input of ``aux`` middle layers: ``fc`` =
    [0 .. 0 | I] and unit aux norms, the identity on the last hidden state. Returns the config."""
    from dataclasses import replace

    bad = [i for i in aux if not 1 <= i < num_layers]
    if bad or len(set(aux)) != len(aux):
        raise FastMTPError(f"--aux-layers {aux}: give distinct middle layers 1 <= i < {num_layers} "
                           "(i = the residual stream leaving decoder layer i-1)")
    cfg = replace(head_cfg, aux_hidden_states=tuple(aux))
    h, n = cfg.hidden_size, len(aux)
    fc = torch.zeros(h, (n + 1) * h)
    fc[:, n * h:] = torch.eye(h)
    sd["fc.weight"] = fc
    sd.update({f"aux_norms.{j}.weight": torch.ones(h) for j in range(n)})
    return cfg


def init_head(target_path: str | Path, out: str | Path, layout: str = "deepseek",
              method: str = "lstsq", calib_tokens: int = 16384, dtype: str = "bfloat16",
              overwrite: bool = False, evaluate: bool = True, target: Target | None = None,
              aux_layers: list[int] | None = None, from_draft: str | Path | None = None) -> Path:
    if method not in INIT_METHODS:
        raise FastMTPError(f"unknown --init-proj {method!r}; choose one of {', '.join(INIT_METHODS)}")
    out = Path(out)
    if out.exists() and not overwrite:  # fail before the expensive part
        raise FastMTPError(f"{out} already exists; choose another output path or pass --overwrite")
    target = target or load_target(target_path, dtype="float32")
    if from_draft is not None:
        from fastmtp_sglang.core.draft_dir import load_draft_dir
        from fastmtp_sglang.core.target import require_fits

        src = load_draft_dir(from_draft)
        require_fits(src.config, target.config, target.tokenizer, where=str(from_draft))
        if src.head_config.aux_hidden_states:
            raise FastMTPError(f"{from_draft} already reads aux layers "
                               f"{list(src.head_config.aux_hidden_states)}")
        layout = src.head_config.layout
        head_cfg = src.head_config
        sd = {k: v.float() for k, v in src.state_dict.items()}
        info = {**(src.meta.get("init") or {}), "from": str(from_draft)}
    else:
        head_cfg, sd, info = init_state_dict(target, layout, method, calib_tokens)
    if aux_layers:
        head_cfg = add_aux_layers(head_cfg, sd, list(aux_layers),
                                  int(target.config.get("num_hidden_layers") or 0))
    if evaluate and target.tokenizer is not None:
        head = FastMTPHead(head_cfg, target.embed, target.lm_head)
        head.load_state_dict(sd)
        info["heldout_step1_top1"] = round(step1_accuracy(target, head.eval()), 4)
        print(f"init-head: step-1 top-1 accuracy on held-out calibration text: "
              f"{info['heldout_step1_top1']:.3f} ({method})", file=sys.stderr)
    ident = target_identity(target.name, target.config, target.tokenizer)
    extra: dict[str, Any] = {"init": info}
    if aux_layers:
        extra["aux_hidden_states"] = list(head_cfg.aux_hidden_states)
    cfg = make_draft_config(target.config, layout, base_model=ident, dtype=dtype, extra=extra)
    return save_draft_dir(out, cfg, sd, overwrite=overwrite)
