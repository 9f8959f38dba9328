"""Features from the run that writes the data: ``fastmtp distill --url URL --with-features F``
(and in process, ``--target T``: the engine's kept states and top-k, decode/capture.py, written
here the same way, the top-k as files of their own beside the states).

Each ``/generate`` request also asks for the target's hidden states (SGLang's
``return_hidden_states: true``; the server must run with ``--enable-return-hidden-states``), and
each kept sample's states are appended here; at the end of the run they become the feature cache
``fastmtp train --features F`` opens (training/features.py: same ``index.json``, key and tensor
``hidden``), so the target is never loaded in transformers. docs/scale.md, "Features from SGLang
servers", says what SGLang 0.5.23 returns and why it is the head's input.

What a reply holds (SGLang 0.5.23, ``return_hidden_states: true``): ``meta_info["hidden_states"]``
is ``[prefill, row, row, ...]``: ``prefill`` the rows of the prompt positions the prefill computed
([P][H] as nested lists), then one row [H] per decode step, the state of the token that step fed.
The last generated token is never fed, so a reply covers positions 0 .. P + N - 2 of prompt +
response: every position the head reads (design 1.1; the state at the last position predicts a
token after the sequence, which no loss term scores). The cache stores T rows per sequence, as
``fastmtp features`` does; its last row is stored as zeros.

Layout while a run is on (``.F.distill/`` beside F): ``shard-00000.safetensors``, rows appended
to its data region behind a reserved header (written, and the file cut to its rows, when the run
ends); ``staged.jsonl``, one ``{"id", "row", "rows"}`` line per sample, appended after its rows
are flushed and before its line is written to the data file, so every line of the data file has
its rows. At the end the rows of the data file's usable sequences (``load_examples``, the
trainer's reading, ``--max-len``) are indexed and the directory renamed to F. A rerun moves F back
and continues.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.training.features import (FEATURE_DTYPES, FORMAT, INDEX, FeatureKey,
                                              FeatureStore, _write_json)

SOURCE = "fastmtp distill --with-features"
DATA = "shard-00000.safetensors"
# with top-k (in-process generation keeps them: decode/capture.py): one file per tensor, rows
# appended in step with DATA's
TOPK_FILES = {"topk_ids": "topk-ids.safetensors", "topk_logp": "topk-logp.safetensors"}
STAGED = "staged.jsonl"
META = "staging.json"
HEADER_BYTES = 4096 - 8   # reserved for the safetensors header (one tensor's JSON: ~80 bytes)
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32"}
ENABLE = ("start it with --enable-return-hidden-states (SGLang, or `fastmtp serve --engine "
          "reference`)")


class NoHiddenStates(Exception):
    """A server answered without usable hidden states; the message is one line saying why."""


def hidden_rows(reply: dict[str, Any], url: str, prompt_len: int, width: int) -> torch.Tensor:
    """The rows of one reply's ``meta_info["hidden_states"]``: [P + N - 1, width] fp32 (P prompt,
    N output tokens). The JSON floats are the server's values widened to float64, so fp32 and
    bf16 states come back exactly.

    Raises NoHiddenStates when there are none, when they do not cover every fed position (a
    cached prefix or a chunked prefill returns its last part only) or have another width."""
    meta = reply.get("meta_info") or {}
    hs = meta.get("hidden_states")
    out_ids = reply.get("output_ids")
    if not hs or not isinstance(hs, list):
        raise NoHiddenStates(f"{url} returned no hidden states: {ENABLE}")
    if not isinstance(out_ids, list) or not out_ids:
        raise NoHiddenStates(f"{url} returned hidden states without output_ids: the rows cannot "
                             "be placed")
    try:
        blocks = [torch.tensor(b, dtype=torch.float32) for b in hs]
        blocks = [b[None] if b.ndim == 1 else b for b in blocks]
        rows = torch.cat(blocks) if all(b.ndim == 2 for b in blocks) else None
    except (TypeError, ValueError, RuntimeError):
        rows = None
    if rows is None:
        raise NoHiddenStates(f"{url} returned hidden states of an unknown shape (expected "
                             "[prompt rows, row, row, ...] as SGLang 0.5.23 sends them)")
    want = prompt_len + len(out_ids) - 1
    if rows.shape[1] != width:
        raise NoHiddenStates(f"{url} returned hidden states of width {rows.shape[1]}, the target's "
                             f"hidden size is {width}: it serves another model, or returns aux "
                             "layers (--enable-return-aux-hidden-states)")
    if rows.shape[0] != want:
        raise NoHiddenStates(f"{url} returned hidden states for {rows.shape[0]} of the {want} "
                             "positions: a cached prefix or a chunked prefill returns its last "
                             "part only; start SGLang with --disable-radix-cache "
                             "--chunked-prefill-size -1")
    return rows


def _header(rows: int, width: int, dtype: torch.dtype, name: str = "hidden") -> bytes:
    nbytes = rows * width * dtype.itemsize
    h = json.dumps({name: {"dtype": _ST_DTYPES[dtype], "shape": [rows, width],
                           "data_offsets": [0, nbytes]}}).encode()
    return struct.pack("<Q", HEADER_BYTES) + h + b" " * (HEADER_BYTES - len(h))


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype.itemsize == 2:
        t = t.view(torch.int16)  # numpy has no bfloat16
    return t.numpy().tobytes()


class FeatureSink:
    """The hidden states of one ``distill --with-features`` run (see the module docstring).

    ``width``: the row width (the target's hidden size); ``dtype``: a FEATURE_DTYPES name;
    ``topk``: top-k columns kept per row beside them (0: none, what a server returns)."""

    def __init__(self, out: str | Path, width: int, dtype: str, topk: int = 0):
        if dtype not in FEATURE_DTYPES:
            raise FastMTPError(f"--feature-dtype must be one of {', '.join(FEATURE_DTYPES)}, "
                               f"got {dtype!r}")
        self.out = Path(out)
        self.work = self.out.parent / f".{self.out.name}.distill"
        self.width, self.dtype_name, self.dtype = width, dtype, FEATURE_DTYPES[dtype]
        self.row_bytes = width * self.dtype.itemsize
        self.topk = topk
        # file -> (tensor name, columns, dtype): the states, and the top-k when kept
        self.files = {DATA: ("hidden", width, self.dtype)}
        if topk:
            self.files[TOPK_FILES["topk_ids"]] = ("topk_ids", topk, torch.int32)
            self.files[TOPK_FILES["topk_logp"]] = ("topk_logp", topk, torch.float16)
        self.staged: dict[str, tuple[int, int]] = {}  # sample id -> (first row, rows)
        self.rows = 0
        self._f: dict[str, Any] = {}
        self._fs = None

    @property
    def meta(self) -> dict[str, Any]:
        return {"width": self.width, "dtype": self.dtype_name, **({"topk": self.topk} if self.topk else {})}

    # -- opening (resuming) -----------------------------------------------------------------
    def check(self) -> None:
        """Refuse an output path that holds something else, and read which samples have rows,
        without changing anything (before any request is sent)."""
        if self.out.exists():
            idx = _read_json(self.out / INDEX)
            if not isinstance(idx, dict) or idx.get("source") != SOURCE:
                raise FastMTPError(f"{self.out} exists and is not a feature cache written by "
                                   "`fastmtp distill --with-features`: choose another path")
            if self.work.exists():
                raise FastMTPError(f"both {self.out} and {self.work} exist: remove the one "
                                   "you do not want")
        where = self.work if self.work.exists() else self.out if self.out.exists() else None
        if where is not None:
            meta = _read_json(where / META)
            if meta != self.meta:
                raise FastMTPError(f"{where} holds hidden states of {meta}, this run's are "
                                   f"{self.meta}: use another --with-features path (or the same "
                                   "--feature-dtype and --feature-topk)")
        self.staged = self._read_staged(where)
        self.rows = max((a + n for a, n in self.staged.values()), default=0)

    def _read_staged(self, where: Path | None) -> dict[str, tuple[int, int]]:
        """Sample id -> (first row, rows), for the samples whose rows are all in the data file.
        A later line for an id wins (a sample asked again)."""
        if where is None or not (where / STAGED).is_file() or not all((where / f).is_file()
                                                                      for f in self.files):
            return {}
        have = min(((where / f).stat().st_size - 8 - HEADER_BYTES) // (cols * dt.itemsize)
                   for f, (_, cols, dt) in self.files.items())
        staged: dict[str, tuple[int, int]] = {}
        lines = (where / STAGED).read_text(encoding="utf-8", errors="replace").split("\n")
        for line in lines[:-1]:  # the last piece: "" or a line cut by a crash
            try:
                r = json.loads(line)
                a, n = int(r["row"]), int(r["rows"])
            except (ValueError, KeyError, TypeError):
                continue
            if a + n <= have:
                staged[str(r["id"])] = (a, n)
        return staged

    def open(self) -> None:
        """Take over a finished cache or a run's leftovers (rows past the last recorded sample,
        written by a run that stopped in between, are cut), or start empty."""
        from fastmtp_sglang.training.distill_io import atomic_write

        self.check()
        if self.out.exists():
            os.replace(self.out, self.work)
            (self.work / INDEX).unlink(missing_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        _write_json(self.work / META, self.meta)
        for f, (name, cols, dt) in self.files.items():
            if not (self.work / f).exists():
                (self.work / f).write_bytes(_header(0, cols, dt, name))
        # staged.jsonl again, whole lines only, in row order (drops cut and orphaned lines)
        atomic_write(self.work / STAGED, "".join(
            json.dumps({"id": i, "row": a, "rows": n}) + "\n"
            for i, (a, n) in sorted(self.staged.items(), key=lambda kv: kv[1][0])))
        for f, (_, cols, dt) in self.files.items():
            fh = self._f[f] = open(self.work / f, "r+b")
            fh.truncate(8 + HEADER_BYTES + self.rows * cols * dt.itemsize)
            fh.seek(0, os.SEEK_END)
        self._fs = open(self.work / STAGED, "a", encoding="utf-8")

    def missing(self, ids: list[str]) -> list[str]:
        """The sample ids among ``ids`` that have no rows here."""
        return [i for i in ids if i not in self.staged]

    # -- writing ----------------------------------------------------------------------------
    def add(self, sample_id: str, rows: torch.Tensor,
            topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Append one sample's rows [P + N - 1, width] (and the zero row of its last position),
        with ``topk`` (ids, log-probabilities) [P + N - 1, k] when the sink keeps them; call
        before its line goes to the data file."""
        parts = [rows]
        if self.topk:
            if topk is None or topk[0].shape != (len(rows), self.topk):
                raise AssertionError(f"sample {sample_id}: top-k of shape "
                                     f"{None if topk is None else tuple(topk[0].shape)}, need "
                                     f"({len(rows)}, {self.topk})")
            parts += list(topk)
        for f, t in zip(self.files, parts):
            _, cols, dt = self.files[f]
            self._f[f].write(_raw(torch.cat([t.to(dt), torch.zeros(1, cols, dtype=dt)])))
            self._f[f].flush()
        t = parts[0]
        self._fs.write(json.dumps({"id": sample_id, "row": self.rows, "rows": len(t) + 1}) + "\n")
        self._fs.flush()
        self.staged[sample_id] = (self.rows, len(t) + 1)
        self.rows += len(t) + 1

    def close(self) -> None:
        for f in [*self._f.values(), self._fs]:
            if f is not None:
                f.close()
        self._f, self._fs = {}, None

    # -- the cache ----------------------------------------------------------------------------
    def finish(self, data_file: str | Path, key: FeatureKey, tokenizer, vocab_size: int,
               hidden_size: int) -> FeatureStore:
        """Index the rows of ``data_file``'s usable sequences as ``fastmtp train`` reads them
        (``key``: the cache key for that file) and publish the directory as the cache.

        When some of its samples have no rows here (written by a run without --with-features),
        the cache covers the others: their lines are copied to ``data.jsonl`` inside it, the
        key is that file's, and the index says ``"partial"``; ``fastmtp features --data
        DATA_FILE --reuse CACHE`` then builds the whole file's cache running the target over
        the missing rows only. Either way the index records its data file (``"data"``)."""
        from fastmtp_sglang.training.data import file_sha256, load_examples
        from fastmtp_sglang.training.distill_io import atomic_write

        self.close()
        data_file = Path(data_file)
        line_ids = _line_ids(data_file)
        examples, _ = load_examples(data_file, tokenizer, vocab_size, key.max_len, 1, key.max_sequences)
        missing = [e for e in examples if line_ids.get(e.line) not in self.staged]
        partial = None
        (self.work / "data.jsonl").unlink(missing_ok=True)  # an earlier stop's, when partial
        if missing:  # the lines whose samples have rows, as a data file of their own
            lines = data_file.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
            keep = [ln for n, ln in enumerate(lines, start=1) if line_ids.get(n) in self.staged]
            atomic_write(self.work / "data.jsonl", "".join(keep))
            partial = {"rows": len(examples) - len(missing), "of": len(examples), "file": str(data_file)}
            data_file = self.work / "data.jsonl"
            key = replace(key, data_sha256=file_sha256(data_file))
            line_ids = _line_ids(data_file)
            examples, _ = load_examples(data_file, tokenizer, vocab_size, key.max_len, 1, key.max_sequences)
        index_rows, lost = [], []
        for e in examples:
            sid = line_ids.get(e.line)
            loc = self.staged.get(sid) if sid is not None else None
            if loc is None or len(e.ids) > loc[1]:
                lost.append(str(sid))
                continue
            index_rows.append([0, loc[0], len(e.ids)])
        if lost:
            raise FastMTPError(f"{len(lost)} samples of {data_file} have fewer rows than tokens in "
                               f"{self.work} (first {lost[0]!r}): distil into a new --out")
        for f, (name, cols, dt) in self.files.items():
            with open(self.work / f, "r+b") as fh:
                fh.truncate(8 + HEADER_BYTES + self.rows * cols * dt.itemsize)
                fh.write(_header(self.rows, cols, dt, name))
        shard = {"file": DATA, "tokens": self.rows}
        if self.topk:
            shard["files"] = dict(TOPK_FILES)
        index = {"format": FORMAT, "key": asdict(key), "hidden_size": hidden_size,
                 "width": self.width, "shards": [shard],
                 "rows": index_rows, "tokens": sum(r[2] for r in index_rows),
                 "source": SOURCE, "last_row": "zeros (no server returns it; no loss reads it)",
                 "data": str((self.out / "data.jsonl").resolve() if partial else data_file.resolve())}
        if partial:
            index["partial"] = partial
        _write_json(self.work / INDEX, index)
        os.replace(self.work, self.out)
        return FeatureStore(self.out, key)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _line_ids(path: Path) -> dict[int, str]:
    """Line number (1-based, as load_examples counts) -> the ``id`` of that line's record."""
    out: dict[int, str] = {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                out[n] = str(rec["id"])
    return out
