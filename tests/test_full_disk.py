"""A write that runs out of space (a full disk, a quota; here a file size limit,
RLIMIT_FSIZE, in a child process: a write past it fails with EFBIG as one past a full disk
fails with ENOSPC): a checkpoint, a stage-1 read or a tokenized shard fails with a message
that says what was not written and what to do, leaves no partial file under any name a
reader takes, and what was written before stays intact (the previous checkpoint resumes)."""

import errno
import json
import os
import subprocess
import sys

import torch

from tests.helpers import ROOT, write_rows
from train.core.checkpoint import (
    checkpoint_damage,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
)
from train.data.local_source import write_conversations

LIMIT = 1 << 15  # bytes a file may reach in the child

CHILD = r"""
import json, resource, signal, sys
from pathlib import Path
import torch
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, not a killed process
what, root = sys.argv[1], Path(sys.argv[2])
root.mkdir(parents=True, exist_ok=True)
if what == "checkpoint":
    from train.core.checkpoint import save_checkpoint
    save_checkpoint(root, 1, {"w": torch.arange(4.0)}, "kind: x\n", {"step": 1}, keep_last=1)
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    if what == "checkpoint":  # 256 KiB of weights: over the limit
        save_checkpoint(root, 2, {"w": torch.ones(1 << 16)}, "kind: x\n", {"step": 2}, keep_last=1)
    elif what == "read":
        from train.data.local_source import write_conversations
        write_conversations(sys.argv[4], "train", "skip", root / "sources" / "key", False)
    else:
        from models.tiny_tokenizer import CHATML_TEMPLATE, build_char_tokenizer
        from train.data.local_source import tokenize_shard
        job = (sys.argv[4], str(root / "rows-00000.arrow"), build_char_tokenizer(), CHATML_TEMPLATE,
               ["<|im_end|>"], 512)
        tokenize_shard(job)
    print(json.dumps({"errno": None}))
except OSError as err:
    print(json.dumps({"errno": err.errno, "message": str(err)}))
"""


def run_child(*args) -> dict:
    cmd = [sys.executable, "-c", CHILD, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"question {i} " + "q" * 80},
                          {"role": "assistant", "content": f"answer {i} " + "a" * 200}]}
            for i in range(n)]  # fmt: skip


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_resumable(tmp_path):
    out = run_child("checkpoint", tmp_path, LIMIT)
    assert out["errno"] == errno.EFBIG
    assert "checkpoint step_00000002 not written" in out["message"]
    assert "ran out of space" in out["message"] and "step_00000001, is intact" in out["message"]
    assert "resume=auto" in out["message"]
    (step1,) = list_checkpoints(tmp_path)  # step 2 is nowhere, step 1 not pruned
    assert checkpoint_damage(step1) is None
    assert not [p.name for p in step1.parent.iterdir() if p.name != step1.name]  # no leftovers
    state, _, trainer = load_checkpoint(step1)
    assert torch.equal(state["w"], torch.arange(4.0)) and trainer == {"step": 1}
    assert resume_checkpoint(tmp_path, True, False) == step1


def test_a_source_read_that_does_not_fit_leaves_nothing(tmp_path):
    path = write_rows(tmp_path / "src.jsonl", rows(400))  # ~130 KB of Arrow
    out = run_child("read", tmp_path / "cache", LIMIT, path)
    assert out["errno"] == errno.EFBIG and "read into shards not written" in out["message"]
    assert "Free space (data.cache_dir) and rerun" in out["message"]
    assert list((tmp_path / "cache" / "sources").iterdir()) == []  # no copy, whole or partial


def test_a_tokenized_shard_that_does_not_fit_is_never_left_under_any_name(tmp_path):
    path = write_rows(tmp_path / "src.jsonl", rows(400))
    write_conversations(str(path), "train", "skip", tmp_path / "key", False)
    (shard,) = sorted((tmp_path / "key").glob("conversations-*.arrow"))
    out = run_child("tokenize", tmp_path / "rows", LIMIT, shard)
    assert out["errno"] == errno.EFBIG and "tokenized shard rows-00000.arrow" in out["message"]
    assert "the shards already written are kept" in out["message"]
    assert list((tmp_path / "rows").iterdir()) == []
    assert run_child("tokenize", tmp_path / "rows", 1 << 30, shard) == {"errno": None}
    assert [p.name for p in (tmp_path / "rows").iterdir()] == ["rows-00000.arrow"]
