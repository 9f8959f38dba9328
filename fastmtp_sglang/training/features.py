"""`fastmtp features`: run the frozen target once over a training set and keep what training needs.

    fastmtp features --target T --data D.jsonl --out D.features [--topk 32] [--max-len 1024]
    fastmtp train ... --features D.features      # builds it there first when it is missing

Training a head never changes the target, yet ``fastmtp train`` used to run the target over every
sequence in every epoch (its in-memory cache only helps while the data fits in RAM). This stores,
per token of every usable sequence:

- ``hidden``: the target's post-norm last hidden state, in ``--feature-dtype`` (bf16 default:
  what the head reads; its own maths stays in fp32); with ``--aux-layers`` (a head that fuses
  middle layers, see core/head.py) the residual streams of those layers first, then the last
  hidden state: [N, (n+1) H];
- with ``--topk k > 0``: the target's top-k next-token log-probabilities (fp16) and their ids
  (int32), so ``--loss kl`` needs no second lm_head product per step (see objective.kl_topk_terms).

Layout: a directory with ``index.json`` (format, the key below, row -> (shard, offset, length))
and ``shard-00000.safetensors`` ... (tensors ``hidden`` [N, H], ``topk_ids`` / ``topk_logp``
[N, k]). Shards are read memory-mapped, one slice per sequence.

**Key.** The cache belongs to one (data file sha256, target weights sha256, target architecture
hash, tokenizer hash, max_len, max_sequences, feature dtype, topk) tuple. Opening a cache whose key
differs is refused with the fields that differ, so a stale cache is never read silently.

**Atomic and resumable.** Shards are written into ``.NAME.partial/`` beside the output with a
``progress.json``; an interrupted build continues from its last complete shard when rerun with
the same key, and the directory is renamed to NAME only when complete.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.core.head import head_input
from fastmtp_sglang.training.data import file_sha256

FORMAT = 1
INDEX = "index.json"
SHARD_TOKENS = 1 << 20  # tokens per shard: 1M x 576 x 2 B = 1.2 GB for SmolLM2 in bf16
STAGE_CHUNK = 8192  # positions scored per lm_head call when a batch is staged at once (per_batch)
FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class FeatureKey:
    data_sha256: str
    weights_sha256: str
    config_sha256: str
    tokenizer_sha256: str | None
    max_len: int
    max_sequences: int | None
    dtype: str
    topk: int
    aux_layers: list[int] = field(default_factory=list)  # caches from before aux layers: []

    def diff(self, other: dict[str, Any]) -> list[str]:
        have = {"aux_layers": [], **other}
        return [f"{k}: cache {have.get(k)!r}, now {v!r}" for k, v in asdict(self).items()
                if have.get(k) != v]


def weights_sha256(target_dir: str | Path) -> str:
    """sha256 over the target's weight files (names and bytes), in name order."""
    import hashlib

    d = Path(target_dir)
    files = sorted(list(d.glob("*.safetensors")) + list(d.glob("*.bin")))
    if not files:
        raise FastMTPError(f"{d} has no *.safetensors or *.bin weight files")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def make_key(target, target_dir: str | Path, data: str | Path, max_len: int,
             max_sequences: int | None, dtype: str, topk: int,
             aux_layers: tuple[int, ...] | list[int] = ()) -> FeatureKey:
    return key_from_parts(target.config, target.tokenizer, target_dir, data, max_len, max_sequences,
                          dtype, topk, aux_layers)


def key_from_parts(config: dict[str, Any], tokenizer, target_dir: str | Path, data: str | Path,
                   max_len: int, max_sequences: int | None, dtype: str, topk: int,
                   aux_layers: tuple[int, ...] | list[int] = ()) -> FeatureKey:
    """The key from the target's config.json, tokenizer and weight files, without loading its
    weights (``fastmtp distill --with-features`` writes caches the trainer's key opens)."""
    from fastmtp_sglang.core.identity import config_hash, tokenizer_hash

    if dtype not in FEATURE_DTYPES:
        raise FastMTPError(f"--feature-dtype must be one of {', '.join(FEATURE_DTYPES)}, got {dtype!r}")
    if topk < 0:
        raise FastMTPError(f"--topk must be >= 0 (0 = no logits stored), got {topk}")
    return FeatureKey(file_sha256(Path(data)), weights_sha256(target_dir), config_hash(config),
                      tokenizer_hash(tokenizer) if tokenizer is not None else None,
                      max_len, max_sequences, dtype, topk, [int(i) for i in aux_layers])


class FeatureStore:
    """Read side: ``store(i)`` -> hidden [T_i, H] (or [T_i, (n+1) H] with n aux layers) of row
    i; ``store.topk(i)`` -> (ids, logp)."""

    def __init__(self, path: str | Path, key: FeatureKey | None = None):
        from safetensors import safe_open

        self.path = Path(path)
        idx_file = self.path / INDEX
        if not idx_file.is_file():
            raise FastMTPError(f"{self.path} is not a feature cache (no {INDEX}); build it with "
                               "`fastmtp features` or let `fastmtp train --features` build it")
        self.index = json.loads(idx_file.read_text())
        if self.index.get("format") != FORMAT:
            raise FastMTPError(f"{self.path}: cache format {self.index.get('format')!r}, this "
                               f"version reads {FORMAT}: rebuild it")
        if key is not None:
            # a cache with more top-k columns serves a run that needs fewer (columns are sorted),
            # and a cache of all rows serves a run on a prefix (--max-sequences: learning curves)
            have = self.index["key"]
            bad = [d for d in key.diff(have) if not d.startswith(("topk:", "max_sequences:"))]
            if int(have.get("topk", 0)) < key.topk:
                bad.append(f"topk: cache {have.get('topk')}, need {key.topk}")
            cached_rows = have.get("max_sequences")
            if cached_rows is not None and (key.max_sequences is None or key.max_sequences > cached_rows):
                bad.append(f"max_sequences: cache {cached_rows}, now {key.max_sequences}")
            if bad:
                raise FastMTPError(f"feature cache {self.path} was built for other inputs ("
                                   + "; ".join(bad) + "): delete it or pass another --features "
                                   "path to build a new one")
        self.rows = self.index["rows"]
        self.topk_k = int(self.index["key"]["topk"])
        # a shard is one file, or (a distill sink's) one file per tensor: {"files": {name: file}}
        self._files = []
        for s in self.index["shards"]:
            main = safe_open(str(self.path / s["file"]), framework="pt")
            other = {n: safe_open(str(self.path / f), framework="pt")
                     for n, f in s.get("files", {}).items()}
            self._files.append(lambda name, main=main, other=other: other.get(name, main))

    def __len__(self) -> int:
        return len(self.rows)

    def _slice(self, i: int, name: str) -> torch.Tensor:
        shard, off, n = self.rows[i]
        return self._files[shard](name).get_slice(name)[off:off + n]

    def __call__(self, i: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H] of row i (``ids`` is accepted for HiddenStates compatibility and checked
        for length only)."""
        h = self._slice(i, "hidden")
        if ids is not None and len(ids) != h.shape[0]:
            raise FastMTPError(f"feature cache {self.path}: row {i} has {h.shape[0]} tokens, the data "
                               f"has {len(ids)}: the cache does not match the data; rebuild it")
        return h

    def topk(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k] int64, log-probabilities [T, k] fp32) of row i."""
        if not self.topk_k:
            raise FastMTPError(f"feature cache {self.path} holds no top-k logits (built with "
                               "--topk 0): rebuild it with --topk > 0")
        return self._slice(i, "topk_ids").long(), self._slice(i, "topk_logp").float()

    def stored(self, i: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Row i as stored (hidden, and the first ``k`` top-k columns, or None for k = 0): what
        a build copies from a --reuse cache."""
        if not k:
            return self._slice(i, "hidden"), None, None
        return self._slice(i, "hidden"), self._slice(i, "topk_ids")[:, :k], self._slice(i, "topk_logp")[:, :k]

    @property
    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for s in self.index["shards"]
                   for f in [s["file"], *s.get("files", {}).values()])


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc only; a no-op elsewhere). The forward's
    transient tensors grow with the sorted sequence lengths, and glibc kept the freed ones
    resident: RSS grew ~10 KB per token (6.4 GB at 0.36M tokens) with nothing kept but the
    preallocated shard buffer."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_features(target, examples, out: str | Path, key: FeatureKey, batch_tokens: int | None = None,
                   progress: bool = True, log=None, share_prompts: bool | None = None,
                   data: str | Path | None = None,
                   reuse: dict[int, tuple[FeatureStore, int]] | None = None,
                   per_batch: bool | None = None) -> FeatureStore:
    """Run the target over ``examples`` (data.Example list) and write the cache at ``out``.

    Sequences are run in batches of similar length (sorted, right-padded, at most
    ``batch_tokens`` padded tokens): a batch of short sequences costs one forward instead of
    many. Sequences that share their prompt (``fastmtp distill --n``: n samples of one prompt)
    run the prompt once and their responses on its KV cache (:func:`shared_prompt_groups`;
    ``share_prompts=False`` runs every sequence whole). ``data``: the data file's path, recorded
    in the index (a later build on other data can then copy this cache's rows). ``reuse``:
    {row: (another cache, its row)} for rows copied, not computed (features_reuse.reusable_rows).
    Returns the opened store. Resumes a partial build with the same key.

    Defaults follow the target's device. On a CPU (FLOP-bound): 8,192-token batches, shared
    prompts, each row's top-k scored on its own. On a GPU the build is latency-bound (an H200
    managed under 12K tokens/s that way: thousands of small forwards, and per row an lm_head call
    and three device-to-host copies), so: 65,536-token batches of whole sequences
    (``share_prompts`` off) and ``per_batch`` staging, the lm_head and top-k over a batch's
    positions in chunks with one copy to the host per chunk.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = Path(out)
    if (out / INDEX).is_file():
        return FeatureStore(out, key)
    if out.exists():
        raise FastMTPError(f"{out} exists and is not a feature cache: choose another path")
    part = out.parent / f".{out.name}.partial"
    prog_file = part / "progress.json"
    done_shards: list[dict[str, Any]] = []
    rows: list[list[int] | None] = [None] * len(examples)
    if prog_file.is_file():
        prog = json.loads(prog_file.read_text())
        if prog.get("key") == asdict(key):
            done_shards = prog["shards"]
            for r, loc in prog["rows"].items():
                rows[int(r)] = loc
            log(f"features: resuming {part} ({len(done_shards)} shards done)")
        else:
            log(f"features: {part} was a partial build for other inputs: starting again")
            shutil.rmtree(part)
    part.mkdir(parents=True, exist_ok=True)
    _check_disk(part, examples, target, key)

    H = int(target.config["hidden_size"])
    aux = tuple(key.aux_layers)
    width = H * (len(aux) + 1)
    fdt = FEATURE_DTYPES[key.dtype]
    model = target.model
    device = next(model.parameters()).device
    gpu = device.type != "cpu"
    batch_tokens = batch_tokens or (65536 if gpu else 8192)
    share_prompts = (not gpu) if share_prompts is None else share_prompts
    per_batch = gpu if per_batch is None else per_batch
    todo = sorted((i for i, r in enumerate(rows) if r is None), key=lambda i: len(examples[i].ids))
    total_tokens = sum(len(examples[i].ids) for i in todo)
    # One preallocated buffer per shard, filled in place: a list of per-row tensors interleaved
    # with the forward's large transient allocations fragmented the heap (RSS reached 22 GB at
    # 0.9M tokens of a 1.75M-token build, for ~1 GB of kept features).
    cap = min(SHARD_TOKENS, max(total_tokens, 1))
    buf_h = torch.empty(cap, width, dtype=fdt)
    buf_ids = torch.empty(cap, key.topk, dtype=torch.int32) if key.topk else None
    buf_lp = torch.empty(cap, key.topk, dtype=torch.float16) if key.topk else None
    buf_rows: list[tuple[int, int, int]] = []  # (row, offset, length) in the shard being filled
    filled = 0

    def flush() -> None:
        nonlocal filled, buf_rows
        if not buf_rows:
            return
        sid = len(done_shards)
        name = f"shard-{sid:05d}.safetensors"
        tensors = {"hidden": buf_h[:filled]}
        if key.topk:
            tensors["topk_ids"] = buf_ids[:filled]
            tensors["topk_logp"] = buf_lp[:filled]
        tmp = part / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, part / name)
        done_shards.append({"file": name, "tokens": filled})
        for r, off, n in buf_rows:
            rows[r] = [sid, off, n]
        _write_json(prog_file, {"key": asdict(key), "shards": done_shards,
                                "rows": {str(i): loc for i, loc in enumerate(rows) if loc is not None}})
        buf_rows, filled = [], 0

    def states(h: torch.Tensor) -> tuple:
        """(states [n, width], top-k ids, top-k log-probabilities) of n positions; the top-k of
        the log-softmax are the top-k logits less their logsumexp: no [n, V] log-softmax."""
        if not key.topk:
            return h, None, None
        z = target.lm_head(h[:, -H:]).float()
        top = z.topk(key.topk, dim=-1)
        return h, top.indices, top.values - torch.logsumexp(z, dim=-1, keepdim=True)

    def batch_states(hs: torch.Tensor, lens: list[int]) -> list[tuple]:
        """``states()`` of every row of a padded batch [B, S, width] (row b's first lens[b]
        positions), scored over the batch's positions in chunks and copied to the host once per
        chunk: one (states, top-k ids, top-k log-probabilities) per row, on the CPU."""
        flat = torch.cat([hs[b, :n] for b, n in enumerate(lens)])
        pieces = [tuple(None if t is None else t.cpu() for t in states(flat[a:a + STAGE_CHUNK]))
                  for a in range(0, len(flat), STAGE_CHUNK)]
        cols = [None if pieces[0][j] is None else torch.cat([q[j] for q in pieces]) for j in range(3)]
        out, at = [], 0
        for n in lens:
            out.append(tuple(None if c is None else c[at:at + n] for c in cols))
            at += n
        return out

    def stage(r: int, parts: list[tuple]) -> None:
        """Row r's positions (``states()`` of its pieces, in order) into the shard buffer."""
        nonlocal filled
        n = len(examples[r].ids)
        if filled and filled + n > cap:
            flush()
        at = filled
        for h, top_ids, top_lp in parts:
            buf_h[at:at + len(h)] = h
            if key.topk:
                buf_ids[at:at + len(h)] = top_ids
                buf_lp[at:at + len(h)] = top_lp
            at += len(h)
        if at != filled + n:
            raise AssertionError(f"row {r}: {at - filled} states for {n} tokens")
        buf_rows.append((r, filled, n))
        filled += n

    def forward(ids: torch.Tensor, mask: torch.Tensor | None = None, cache=None, keep: bool = False):
        """(head input [B, S, width], the KV cache when ``keep`` or continuing ``cache``)."""
        out = model.model(input_ids=ids.to(device),
                          attention_mask=None if mask is None else mask.to(device),
                          past_key_values=cache, use_cache=keep or cache is not None,
                          output_hidden_states=bool(aux))
        return head_input(out, aux), out.past_key_values

    copied = sorted((r for r in todo if r in (reuse or {})),  # in the old caches' order: one pass
                    key=lambda r: (id(reuse[r][0]), reuse[r][0].rows[reuse[r][1]]))
    todo = [r for r in todo if r not in (reuse or {})]
    shared, todo = shared_prompt_groups(examples, todo) if share_prompts else ([], todo)
    if shared:
        saved = sum((len(g) - 1) * examples[g[0]].prompt_len for g in shared)
        log(f"features: {sum(map(len, shared))} sequences share {len(shared)} prompts; each prompt "
            f"runs once ({saved / max(total_tokens, 1):.0%} of the tokens not recomputed)")
    t0 = time.perf_counter()
    groups = 0
    with torch.no_grad(), tqdm(total=total_tokens, unit="tok", desc="features", disable=not progress,
                               dynamic_ncols=True, file=sys.stderr) as bar:
        for r in copied:
            src, i = reuse[r]
            h, top_ids, top_lp = src.stored(i, key.topk)
            if len(h) != len(examples[r].ids):
                raise FastMTPError(f"--reuse {src.path}: row {i} has {len(h)} tokens, the sequence "
                                   f"{len(examples[r].ids)}: that cache is damaged; drop it")
            stage(r, [(h, top_ids, top_lp)])
            bar.update(len(h))
        for group in shared:  # one prompt, then its responses on the prompt's KV cache
            p = examples[group[0]].prompt_len
            hp, prompt_cache = forward(examples[group[0]].ids[:p][None], keep=True)
            prompt_part = states(hp[0])
            for sub in response_batches(examples, group, batch_tokens):
                T = max(len(examples[r].ids) - p for r in sub)
                ids = torch.zeros(len(sub), T, dtype=torch.long)
                mask = torch.zeros(len(sub), p + T, dtype=torch.long)
                mask[:, :p] = 1
                for b, r in enumerate(sub):
                    n = len(examples[r].ids) - p
                    ids[b, :n] = examples[r].ids[p:]
                    mask[b, p:p + n] = 1
                cache = copy.deepcopy(prompt_cache)  # the forward appends to it
                cache.batch_repeat_interleave(len(sub))
                hr, _ = forward(ids, mask, cache)
                del cache
                for b, r in enumerate(sub):
                    stage(r, [prompt_part, states(hr[b, :len(examples[r].ids) - p])])
                    bar.update(len(examples[r].ids))
                groups += 1
                if groups % 16 == 0:
                    _trim_heap()
        i = 0
        while i < len(todo):
            # a batch of similar lengths: sorted order, bounded padded size
            j = i + 1
            while j < len(todo) and (j - i + 1) * len(examples[todo[j]].ids) <= batch_tokens:
                j += 1
            group = todo[i:j]
            i = j
            T = max(len(examples[r].ids) for r in group)
            ids = torch.zeros(len(group), T, dtype=torch.long)
            mask = torch.zeros(len(group), T, dtype=torch.long)
            for b, r in enumerate(group):
                n = len(examples[r].ids)
                ids[b, :n] = examples[r].ids
                mask[b, :n] = 1
            hs, _ = forward(ids, mask)
            groups += 1
            if groups % 16 == 0:
                _trim_heap()
            lens = [len(examples[r].ids) for r in group]
            per_row = (batch_states(hs, lens) if per_batch
                       else (states(hs[b, :n]) for b, n in enumerate(lens)))
            for r, n, part_ in zip(group, lens, per_row):
                stage(r, [part_])
                bar.update(n)
        flush()
    index = {"format": FORMAT, "key": asdict(key), "hidden_size": H, "width": width,
             "shards": done_shards,
             "rows": rows, "tokens": sum(s["tokens"] for s in done_shards),
             "build_seconds": round(time.perf_counter() - t0, 1)}
    if data is not None:
        index["data"] = str(Path(data).resolve())
    _write_json(part / INDEX, index)
    prog_file.unlink()
    os.replace(part, out)
    store = FeatureStore(out, key)
    log(f"features: {index['tokens']} tokens of {len(rows)} sequences in {out} "
        f"({store.nbytes / 2**20:.0f} MiB, {index['build_seconds']} s)")
    return store


def shared_prompt_groups(examples, todo: list[int], min_group: int = 2,
                         min_prompt: int = 8) -> tuple[list[list[int]], list[int]]:
    """Split the rows ``todo`` into groups that share a prompt (the same prompt ids, at least
    ``min_group`` rows, a prompt of at least ``min_prompt`` tokens: shorter ones save less than
    a batch of their own costs) and the rest, in ``todo``'s order."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for r in todo:
        e = examples[r]
        by_prompt.setdefault(tuple(e.ids[:e.prompt_len].tolist()), []).append(r)
    groups = [g for pr, g in by_prompt.items() if len(g) >= min_group and len(pr) >= min_prompt]
    in_group = {r for g in groups for r in g}
    return groups, [r for r in todo if r not in in_group]


def response_batches(examples, group: list[int], batch_tokens: int,
                     waste: float = 0.25) -> list[list[int]]:
    """The responses of one prompt group as right-padded batches: sorted by length, a batch cut
    where padding would pass ``waste`` of its tokens or its padded size ``batch_tokens``."""
    p = examples[group[0]].prompt_len
    rows = sorted(group, key=lambda r: len(examples[r].ids))
    out: list[list[int]] = []
    cur: list[int] = []
    for r in rows:
        n = len(examples[r].ids) - p
        cand = cur + [r]
        real = sum(len(examples[x].ids) - p for x in cand)
        padded = len(cand) * n  # sorted: r is the longest so far
        if cur and (padded > batch_tokens or padded - real > waste * padded):
            out.append(cur)
            cand = [r]
        cur = cand
    if cur:
        out.append(cur)
    return out


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _check_disk(where: Path, examples, target, key: FeatureKey) -> None:
    """Refuse to start a build that cannot fit on the disk (with the numbers)."""
    tokens = sum(len(e.ids) for e in examples)
    per_tok = (int(target.config["hidden_size"]) * (len(key.aux_layers) + 1)
               * FEATURE_DTYPES[key.dtype].itemsize + key.topk * 6)
    need = tokens * per_tok
    free = shutil.disk_usage(where).free
    if need > 0.95 * free:
        raise FastMTPError(f"the feature cache needs about {need / 2**30:.1f} GiB and {where} has "
                           f"{free / 2**30:.1f} GiB free: free space, use --topk 0 / "
                           "--feature-dtype bfloat16, or --max-sequences")


def open_or_build(target, target_dir, data, examples, path, max_len: int,
                  max_sequences: int | None, dtype: str = "bfloat16", topk: int = 0,
                  progress: bool = True, log=None, aux_layers: tuple[int, ...] = (),
                  reuse: dict[int, tuple[FeatureStore, int]] | None = None) -> FeatureStore:
    """The store at ``path`` for these inputs: opened when its key matches, built when missing
    (``reuse``: rows copied from other caches, as features_reuse.reusable_rows finds them)."""
    key = make_key(target, target_dir, data, max_len, max_sequences, dtype, topk, aux_layers)
    if (Path(path) / INDEX).is_file():
        return FeatureStore(path, key)
    return build_features(target, examples, path, key, progress=progress, log=log, data=data,
                          reuse=reuse)
