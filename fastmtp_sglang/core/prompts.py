"""Prompt files: one JSON object per line, the format recognised row by row.

| format     | fields                                | id           | category        | text     |
|------------|---------------------------------------|--------------|-----------------|----------|
| Spec-Bench | question_id, category, turns          | question_id  | category        | turns[0] |
| C-Eval     | id, question, category, answer        | category-id  | category        | question |
| training   | id, source, prompt                    | id           | category/source | prompt   |
| generic    | prompt or text (+ id, category)       | id/stem:line | category/stem   | the text |

Spec-Bench rows are multi-turn; only the first turn is used (the benchmark measures a single
assistant reply per prompt). C-Eval's `id` numbers questions within a subject (three repeat in
our 51 rows), so the prompt id is `<category>-<id>`, e.g. `accountant-327`. A generic row without
`id` gets `<file stem>:<line>`; without `category` it gets the file's stem. Ids must be unique
within a file. Blank lines are skipped.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fastmtp_sglang.core.errors import FastMTPError


@dataclass(frozen=True)
class Prompt:
    """One prompt: `text` is the user's message, before any chat template."""

    id: str
    category: str
    text: str


def parse_prompt_row(row: object, *, default_id: str, default_category: str) -> Prompt:
    """One decoded JSON row -> Prompt. Raises ValueError saying what is wrong with the row."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if "turns" in row:  # Spec-Bench
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError("Spec-Bench row: 'turns' must be a non-empty list of strings")
        return _prompt(row, "question_id", turns[0], default_id, _required(row, "category"))
    if "question" in row:  # C-Eval: ids count within a subject, so prefix the subject
        category = _required(row, "category")
        prompt = _prompt(row, "id", row["question"], default_id, category)
        return Prompt(id=f"{category}-{prompt.id}", category=prompt.category, text=prompt.text)
    if "prompt" in row:  # training prompt, or generic
        category = row.get("category", row.get("source", default_category))
        return _prompt(row, "id", row["prompt"], default_id, category)
    if "text" in row:  # generic
        return _prompt(row, "id", row["text"], default_id, row.get("category", default_category))
    raise ValueError(
        f"unrecognised row with keys {sorted(row)}; expected Spec-Bench (question_id, category, "
        f"turns), C-Eval (id, question, category, answer), training (id, source, prompt) or a "
        f"row with 'prompt' or 'text'"
    )


def load_prompts(
    paths: str | Path | Iterable[str | Path],
    limit_per_category: int | None = None,
    categories: Iterable[str] | None = None,
) -> list[Prompt]:
    """Read prompt files (JSONL, any mix of the formats above) in order.

    Parameters
    ----------
    paths : path or iterable of paths
        Files to read, concatenated in the order given.
    limit_per_category : int or None
        Keep only the first N prompts of each category (over all files); None keeps all.
    categories : iterable of str or None
        Keep only these categories; None keeps all. Naming a category that no file has is an
        error (the message lists the ones there are).

    Raises
    ------
    FastMTPError
        A file is missing or unreadable, a line is not a recognised row (the message gives file
        and line number), an id repeats within a file, or the arguments are invalid.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise FastMTPError("no prompt files given")
    if limit_per_category is not None and limit_per_category < 1:
        raise FastMTPError(f"limit_per_category must be at least 1, got {limit_per_category}")
    wanted = None if categories is None else list(dict.fromkeys(categories))

    prompts: list[Prompt] = []
    for path in paths:
        prompts.extend(_read_file(path))

    if wanted is not None:
        present = {p.category for p in prompts}
        unknown = [c for c in wanted if c not in present]
        if unknown:
            raise FastMTPError(
                f"no prompts in category {', '.join(unknown)} in {', '.join(map(str, paths))}; "
                f"categories there: {', '.join(sorted(present))}"
            )
        prompts = [p for p in prompts if p.category in wanted]
    if limit_per_category is not None:
        taken: Counter[str] = Counter()
        kept = []
        for p in prompts:
            if taken[p.category] < limit_per_category:
                taken[p.category] += 1
                kept.append(p)
        prompts = kept
    return prompts


def render_chat(tokenizer, text: str, system: str | None = None) -> str:
    """The chat-templated string for one user message, ending with the assistant's turn opener.

    `system`, if given, becomes a system message before the user's; otherwise the template's own
    default (if any) applies. Tokenize the result without adding special tokens again: the
    template already wrote them.
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise FastMTPError(
            f"tokenizer {name} has no chat template, so prompts cannot be rendered as chat; "
            f"use an instruct/chat model's tokenizer, or set tokenizer.chat_template"
        )
    messages = [{"role": "user", "content": text}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_prompt_ids(tokenizer, paths, limit, categories, chat: bool):
    """(id, category, text, ids) with the chat template applied (the server applies none)."""
    out = []
    for p in load_prompts(paths, limit_per_category=limit, categories=categories):
        text = render_chat(tokenizer, p.text) if chat else p.text
        ids = tokenizer(text, add_special_tokens=not chat).input_ids
        out.append((p.id, p.category, text, ids))
    if not out:
        raise FastMTPError("no prompts to run")
    return out


def read_lines(path: Path, what: str = "prompt file") -> list[str]:
    """The lines of a UTF-8 text file; a FastMTPError naming ``what`` and the path when it is
    missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise FastMTPError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FastMTPError(f"cannot read {what} {path}: {exc}") from None


def _read_file(path: Path) -> list[Prompt]:
    lines = read_lines(path)
    prompts: list[Prompt] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FastMTPError(
                f"{where}: not valid JSON ({exc.msg}); prompt files hold one JSON object per line"
            ) from None
        try:
            prompt = parse_prompt_row(row, default_id=f"{path.stem}:{lineno}",
                                      default_category=path.stem)
        except ValueError as exc:
            raise FastMTPError(f"{where}: {exc}") from None
        if prompt.id in first_line:
            raise FastMTPError(
                f"{where}: id {prompt.id!r} already used on line {first_line[prompt.id]}"
            )
        first_line[prompt.id] = lineno
        prompts.append(prompt)
    return prompts


def _prompt(row: dict, id_key: str, text: object, default_id: str, category: object) -> Prompt:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the prompt text is empty or not a string")
    if not isinstance(category, str) or not category:
        raise ValueError(f"'category' must be a non-empty string, got {category!r}")
    raw_id = row.get(id_key, default_id)
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool) or raw_id == "":
        raise ValueError(f"{id_key!r} must be a string or an integer, got {raw_id!r}")
    return Prompt(id=str(raw_id), category=category, text=text)


def _required(row: dict, key: str) -> object:
    if key not in row:
        raise ValueError(f"missing field {key!r}")
    return row[key]
