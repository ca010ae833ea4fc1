"""FSDP2's pieces in train/parallel/strategy.py, in two gloo processes (torchrun): the trainable
weights are broadcast from rank 0 before sharding (each rank here draws its own), the
evaluation skeleton holds no storage until the weights are streamed in and none after, a
weight shared with the target stays the target's tensor, and the mixed-precision policy
computes in bf16 with float32 gradients and master weights."""

import json
import os
import subprocess
import sys
import textwrap

from tests.helpers import ROOT

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor
    from train.parallel.strategy import Strategy, eval_draft, shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # each rank its own initial weights
    frozen = nn.Linear(6, 6)  # the target's, shared by the draft (Medusa-2's backbone)
    frozen.requires_grad_(False)
    draft = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 6), frozen)
    draft.register_buffer("scale", torch.full((6,), 2.0))
    rank0 = [p.detach().clone() for p in draft.parameters()]
    dist.broadcast_object_list(box := [rank0], src=0)
    strategy = Strategy("fsdp", 2)
    target_weights = tuple(frozen.parameters())  # fully_shard replaces them in the draft
    shard(strategy, draft, torch.device("cpu"), bf16=sys.argv[1] == "bf16",
          shared=target_weights)
    out = {"skeleton_meta": all(p.is_meta for p in strategy.unsharded[0].parameters())}
    out["frozen_shared"] = strategy.unsharded[3].weight is target_weights[0]
    with eval_draft(strategy, draft) as full:
        streamed = [p.detach().clone() for p in full.parameters()]
        out["buffer"] = full.scale.tolist()
    out["equal_rank0"] = all(torch.equal(a, b) for a, b in zip(streamed, box[0], strict=True))
    out["meta_after"] = all(p.is_meta for p in strategy.unsharded[0].parameters())
    y = draft(torch.randn(3, 6))
    y.float().sum().backward()
    out["compute"] = str(y.dtype)
    out["grads"] = sorted({str(p.grad.dtype) for p in draft.parameters() if p.grad is not None})
    out["master"] = sorted({str(p.dtype) for p in draft.parameters()})
    if rank == 0:
        print("RESULT " + json.dumps(out))
    # Both ranks reach the teardown with no collective in flight. A rank still aborted now and
    # then in the interpreter's finalization after destroying its group ("terminate called
    # without an active exception", SIGABRT; once in CI, once in a local full run, the bf16
    # case both times): what the result depends on is printed, so skip finalization.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
    """
)


def run_two_ranks(tmp_path, mode: str) -> dict:
    script = tmp_path / "shard_check.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(script), mode]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_sharding_broadcasts_rank0_and_streams_the_evaluation_copy(tmp_path):
    out = run_two_ranks(tmp_path, "fp32")
    assert out["equal_rank0"], "the evaluation copy is not rank 0's initial draft"
    assert out["skeleton_meta"] and out["meta_after"], "the skeleton held storage"
    assert out["frozen_shared"], "a weight shared with the target was copied"
    assert out["buffer"] == [2.0] * 6
    assert (out["compute"], out["grads"], out["master"]) == ("torch.float32", ["torch.float32"], ["torch.float32"])  # fmt: skip


def test_mixed_precision_computes_bf16_over_float32_master_weights(tmp_path):
    out = run_two_ranks(tmp_path, "bf16")
    assert out["compute"] == "torch.bfloat16"
    assert out["grads"] == ["torch.float32"] and out["master"] == ["torch.float32"]
    assert out["equal_rank0"]
