"""The launch's strategy read from the environment accelerate launch / torchrun set, and every
FSDP setting the run cannot honour refused with its reason (no processes started here; the
2-rank runs are tests/test_parallel.py)."""

from types import SimpleNamespace

import pytest
import torch

from train.parallel.strategy import Strategy, check_processes, launch_strategy, strategy_ran

PLAIN = {"replay": False, "optimizer": "adamw"}  # replay.enabled, optim.name
# What `accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 2` exports.
FSDP_ENV = {
    "WORLD_SIZE": "2",
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
}


def test_the_launch_names_the_strategy():
    assert launch_strategy(**PLAIN, env={}) == Strategy("single", 1)
    assert launch_strategy(**PLAIN, env={"WORLD_SIZE": "2"}) == Strategy("ddp", 2)
    muon = PLAIN | {"optimizer": "muon"}  # Muon under DDP runs
    assert launch_strategy(**muon, env={"WORLD_SIZE": "2"}) == Strategy("ddp", 2)
    fsdp = launch_strategy(**PLAIN, env=FSDP_ENV)
    assert (fsdp.kind, fsdp.world_size, fsdp.wrap_classes) == ("fsdp", 2, ("LlamaDecoderLayer",))
    assert fsdp.reshard_after_forward is True
    no_wrap = launch_strategy(**PLAIN, env=FSDP_ENV | {"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"})
    assert no_wrap.wrap_classes == ()


@pytest.mark.parametrize(
    "change, asked, reason",
    [
        ({"FSDP_VERSION": "1"}, PLAIN, "set fsdp_config.fsdp_version: 2"),
        ({"WORLD_SIZE": "1"}, PLAIN, "FSDP over one process shards nothing"),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, PLAIN, "set fsdp_offload_params: false"),
        ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, PLAIN, "fsdp_activation_checkpointing: false"),
        ({"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}, PLAIN, "written once as full state"),
        ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, PLAIN, "fsdp_auto_wrap_policy SIZE_BASED"),
        ({}, PLAIN | {"replay": True}, "set replay.enabled=false"),
        ({}, PLAIN | {"optimizer": "muon"}, "optim=muon: Muon over FSDP2"),
    ],
)
def test_an_fsdp_launch_the_run_cannot_honour_is_refused(change, asked, reason):
    with pytest.raises(ValueError, match="the launch asks for FSDP, which this run cannot") as err:
        launch_strategy(**asked, env=FSDP_ENV | change)
    assert reason in str(err.value)


def test_accelerate_joining_other_processes_is_refused():
    one = SimpleNamespace(num_processes=1, distributed_type="NO")
    with pytest.raises(ValueError, match="launch started 2 processes but accelerate joined 1"):
        check_processes(Strategy("fsdp", 2), one)
    check_processes(Strategy("single", 1), one)


def test_a_module_that_is_not_what_was_launched_is_refused():
    one = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    draft = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="asked for fsdp over 2 processes but the draft is"):
        strategy_ran(Strategy("fsdp", 2), one, draft)
    ran = strategy_ran(Strategy("single", 1), one, draft)
    assert ran["kind"] == "single" and ran["draft_sharded"] is False
