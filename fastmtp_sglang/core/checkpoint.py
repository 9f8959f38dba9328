"""Lazy reading of HF safetensors checkpoints: one file or shards with an index.

Only the tensors asked for are read, and only the shards that hold them are opened: extracting a
one-layer head from a 7B (or 600B) checkpoint never loads the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fastmtp_sglang.core.errors import DraftFormatError

INDEX_NAME = "model.safetensors.index.json"


def _open_file(f: Path):
    try:
        return safe_open(str(f), framework="pt")
    except SafetensorError as exc:
        raise DraftFormatError(f"{f} is not a readable safetensors file: {exc}") from None


class CheckpointReader:
    """Names, shapes and tensors of a safetensors checkpoint, read on demand.

    ``path`` is a directory (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``, or several ``*.safetensors``) or one ``.safetensors`` file
    with ``config.json`` beside it.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise DraftFormatError(f"{path} does not exist")
        self.dir = path if path.is_dir() else path.parent
        if path.is_file():
            files = [path]
        elif (path / INDEX_NAME).is_file():
            try:
                index = json.loads((path / INDEX_NAME).read_text())
                weight_map: dict[str, str] = index["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise DraftFormatError(f"{path / INDEX_NAME} is not a valid index: {exc}") from None
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise DraftFormatError(f"{path}: shards listed in the index are missing: {missing}")
            self._where = {k: path / f for k, f in weight_map.items()}
            files = None
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise DraftFormatError(f"{path} holds no .safetensors file")
        if files is not None:  # no index: list names from the file headers (cheap)
            self._where = {}
            for f in files:
                with _open_file(f) as h:
                    for k in h.keys():
                        self._where[k] = f
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.opened: set[Path] = set()  # shards actually opened, for tests and logs

    def keys(self) -> list[str]:
        return list(self._where)

    def _open(self, name: str):
        f = self._where[name]
        self.opened.add(f)
        return _open_file(f)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            with self._open(name) as h:
                self._shapes[name] = tuple(h.get_slice(name).get_shape())
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        with self._open(name) as h:
            return h.get_tensor(name)

    def config(self) -> dict[str, Any]:
        cfg = self.dir / "config.json"
        if not cfg.is_file():
            raise DraftFormatError(f"{self.dir} has no config.json (needed for the model's shapes)")
        try:
            return json.loads(cfg.read_text())
        except json.JSONDecodeError as exc:
            raise DraftFormatError(f"{cfg} is not valid JSON: {exc}") from None
