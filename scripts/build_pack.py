"""Build a pack of target-written conversations (train/data/pack.py): one resumable command.

    python scripts/build_pack.py --self 1500 --pool 1500 --out train/data/packs/smollm2_135m
    python scripts/build_pack.py --self 4700 --pool 4700 --out packs/smollm2_1m   # the curve's 1M
    python scripts/build_pack.py --self 200 --out packs/mine target=hf target.path=DIR

`--self N` requests the target writes itself (train/data/self_prompts.py: N drawn, filtered)
and `--pool N` prompts of the embedded corpus (balanced over code / prose / Q&A, from groups
the data seed does not hold out), every one answered by the target as a run's regeneration
answers (the data group's max_new_tokens, temperature, top_p, regen_dtype on this machine,
regen_batch_size slots). Every draw and answer goes through the regeneration cache: a killed
build rerun with the same line resumes where it stopped, and a larger build reuses a smaller
one's answers. Protected, never in a pack: every prompt of the groups the data seed holds out
for evaluation and the out-of-domain prompts (train/data/ood_prompts.jsonl), and near-copies
of them (shared word 5-grams, `NearCopies`). The conversations are shuffled (seeded) so that
any prefix of the pack (`data.pack_tokens`) mixes the sources as the whole does. Arguments
after the flags are Hydra overrides of the target and data groups (conf/), as
scripts/regenerate.py takes them. Prints the manifest.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from train.data.chat import resolve_chat_template, tokenize_conversation
from train.data.corpus import embedded_conversations, held_out_prompts
from train.data.pack import git_commit, template_hash, write_pack
from train.data.prompt_file import BUILTIN_OOD, ood_prompt_texts
from train.data.regenerate import regen_dtype_choice, regenerate
from train.data.self_prompts import NearCopies, self_prompts
from train.formats.export import load_target
from train.run.compose import compose_target_data


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--self", dest="self_count", type=int, default=0, help="requests to draw")
    ap.add_argument("--pool", type=int, default=0, help="embedded-corpus prompts")
    ap.add_argument("--out", type=Path, required=True, help="the pack's directory")
    ap.add_argument("overrides", nargs="*", help="target=NAME data.KEY=VALUE device=cpu")
    args = ap.parse_args(argv)
    if args.self_count < 0 or args.pool < 0 or args.self_count + args.pool == 0:
        ap.error("give --self N and/or --pool N, counts >= 0 with at least one above 0")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out}: not a directory")
    cfg = compose_target_data(args.overrides)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    started = time.perf_counter()
    target = load_target(cfg)
    tok = target.tokenizer
    template = resolve_chat_template(tok, data["chat_template"])
    end_tokens = tok.convert_ids_to_tokens(target.eos_token_ids)

    def prompt_ids(messages: list[dict]) -> list[int]:
        return tokenize_conversation(tok, messages, True, end_tokens, template)[0]

    max_prompt = data["max_len"] // 2  # as prepare_data: half of a row for the answer

    def fits(messages: list[dict]) -> bool:
        return len(prompt_ids(messages)) <= max_prompt

    seed, cache = data["seed"], data["cache_dir"]
    protected = held_out_prompts(seed) + ood_prompt_texts()
    guard = NearCopies(protected)
    convs, drawn = [], None
    if args.pool:
        pool, _, _ = embedded_conversations(args.pool, 0, seed, fits, False, 10**9)
        for c in pool:  # the user's request (a reference answer may follow it)
            text = [m["content"] for m in c["messages"] if m["role"] == "user"][-1]
            if not guard.near(text):
                convs.append({"source": "pool", "category": c["category"], "group": c["group"],
                              "prompt": text})  # fmt: skip
    shapes = [{"ids": prompt_ids([{"role": "user", "content": "Write a short poem."}])}]
    choice = regen_dtype_choice(target, data["regen_dtype"], shapes, data["regen_batch_size"],
                                data["max_new_tokens"], cache)  # fmt: skip
    print(f"dtype {choice.describe()}", flush=True)
    if args.self_count:
        texts, drawn = self_prompts(
            target, args.self_count, template, protected, seed=seed, dtype=choice.dtype,
            batch_size=data["regen_batch_size"], cache_dir=cache,
        )  # fmt: skip
        convs += [{"source": "self", "category": "self", "group": f"self:{seed}:{i}",
                   "prompt": t} for i, t in enumerate(texts)]  # fmt: skip
        print(f"[draftlab] self prompts: {drawn['kept']} of {drawn['drawn']} kept "
              f"(dropped {drawn['dropped']})", flush=True)  # fmt: skip
    prompts = [prompt_ids([{"role": "user", "content": c["prompt"]}]) for c in convs]
    fitting = [i for i, p in enumerate(prompts) if len(p) <= max_prompt]
    convs, prompts = [convs[i] for i in fitting], [prompts[i] for i in fitting]
    answers, st = regenerate(
        target, prompts, max_new_tokens=data["max_new_tokens"], temperature=data["temperature"],
        top_p=data["top_p"], batch_size=data["regen_batch_size"], dtype=choice.dtype, seed=seed,
        cache_dir=cache, chat_template=template,
    )  # fmt: skip
    rows = [
        {**c, "answer_ids": a["ids"], "finished": a["finished"]} for c, a in zip(convs, answers)
    ]
    random.Random(seed).shuffle(rows)
    sources = {}
    for r in rows:
        s = sources.setdefault(r["source"], {"conversations": 0, "answer_tokens": 0})
        s["conversations"] += 1
        s["answer_tokens"] += len(r["answer_ids"])
    manifest = {
        "target": target.name, "weights": target.fingerprint,
        "chat_template": template_hash(template), "eos": target.eos_token_ids,
        "answers": {k: data[k] for k in ("max_new_tokens", "temperature", "top_p", "seed")}
        | {"dtype": str(choice.dtype).removeprefix("torch.")},
        "self_prompts": drawn and {k: drawn[k] for k in ("drawn", "kept", "dropped")},
        "sources": sources, "conversations": len(rows),
        "answer_tokens": sum(s["answer_tokens"] for s in sources.values()),
        "protected": {"held_out_prompts_of_seed": seed, "count": len(protected),
                      "ood": str(BUILTIN_OOD.name), "near_copy": "word 5-grams, >= 0.5 shared"},
        "regeneration": {k: st[k] for k in ("prompts", "cached", "generated", "new_tokens",
                                            "seconds", "tokens_per_s")},
        "command": " ".join(["python scripts/build_pack.py", *(argv or sys.argv[1:])]),
        "commit": git_commit(), "seconds": round(time.perf_counter() - started),
    }  # fmt: skip
    write_pack(args.out, rows, manifest)
    print(json.dumps(manifest, indent=1))
    return manifest


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as err:  # a refusal: one line, no traceback
        sys.exit(f"build_pack.py: error: {err}")
