"""A draft kind other than draft_lm under a 2-rank FSDP launch (`accelerate launch
--config_file conf/accelerate/fsdp.yaml --num_processes 2`, gloo on the CPU): Medusa-2, whose
path differs most from a draft LM's. Its draft holds a private copy of the target's backbone
with LoRA adapters (frozen base weights and trained LoRA matrices in the same FSDP units, the
backbone's LlamaDecoderLayers sharded one by one) and Medusa heads; its checkpoints drop the
frozen base weights through a state-dict hook, and evaluation decodes against the LoRA-merged
target. The other kinds were run the same way by hand (docs/scaling.md's table).

- summary.json: FSDP, the draft sharded, the adapted backbone's layers as their own units;
- the 2-rank run (batch 2 per rank) trains like one process with batch 4: each step's loss
  and grad_norm within rel 1e-5 (> 0), final weights within atol 1e-5 + rtol 1e-4 (the
  tolerances of tests/test_parallel.py), and the LoRA matrices moved from their zero start;
- the checkpoint holds the trained weights only (LoRA + heads) and evaluates in one process
  (scripts/evaluate.py) exactly as the run did.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, TINY_CPU_RUN, compose_train
from tests.test_parallel import ENV, deterministic, ev, final_weights, ran, train_records
from train.core.checkpoint import list_checkpoints

RUN = [
    *TINY_CPU_RUN,
    "draft=medusa2",
    "name=medusa2_fsdp",  # the default name reads hydra's runtime, unset in-process
    "train.steps=2",
    "train.ckpt_every=2",
    "train.log_every=1",
    "optim.lr=3e-3",
    "optim.warmup_steps=1",
    "decode.temperatures=[0.0,0.7]",  # sampled acceptance: sensitive to every weight
    "decode.num_prompts=2",
    "decode.max_new_tokens=8",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The 2-rank FSDP run (batch 2 per rank) and one process with batch 4."""
    from train.loop import run

    root = tmp_path_factory.mktemp("medusa2")
    fsdp, single = root / "fsdp", root / "single"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "conf" / "accelerate" / "fsdp.yaml"),
        "--num_processes", "2", "train.py", *RUN, "train.batch_size=2", f"run_dir={fsdp}",
    ]  # fmt: skip
    with open(root / "fsdp.log", "w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                              timeout=600)  # fmt: skip
    assert proc.returncode == 0, (root / "fsdp.log").read_text()[-4000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank ran
    try:
        run(compose_train(*RUN, "train.batch_size=4", f"run_dir={single}"))
    finally:
        torch.set_num_threads(threads)
    return {"fsdp": fsdp, "single": single}


def test_medusa2_is_sharded_with_its_lora_backbone_layers_as_units(runs):
    record = ran(runs["fsdp"])
    assert (record["kind"], record["world_size"], record["draft_sharded"]) == ("fsdp", 2, True)
    assert record["fsdp_units"] == ["adapted.layers.0", "adapted.layers.1", "<draft>"]


def test_medusa2_under_fsdp_trains_like_one_process(runs):
    ref, got = train_records(runs["single"]), train_records(runs["fsdp"])
    assert [x["step"] for x in got] == [1, 2]
    for a, b in zip(ref, got, strict=True):
        assert b["grad_norm"] > 0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    want, have = final_weights(runs["single"]), final_weights(runs["fsdp"])
    assert set(have) == set(want)
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    lora_b = [n for n in have if "lora_B" in n]
    assert lora_b and all(have[n].abs().max() > 0 for n in lora_b)  # zero at the start


def test_medusa2_fsdp_checkpoint_holds_trained_weights_and_evaluates_in_one_process(runs):
    weights = final_weights(runs["fsdp"])
    adapted = [n for n in weights if n.startswith("adapted.")]
    assert adapted and all("lora_" in n for n in adapted), adapted  # no frozen base weights
    final = json.loads((runs["fsdp"] / "summary.json").read_text())["final_eval"]
    assert final["step"] == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = ev.main([str(list_checkpoints(runs["fsdp"])[-1])])
    finally:
        torch.set_num_threads(threads)
    for tag in ("greedy", "T0.7"):
        assert result[f"{tag}/accept_hist"] == final[f"{tag}/accept_hist"], tag
    assert deterministic(result) == deterministic(final)
