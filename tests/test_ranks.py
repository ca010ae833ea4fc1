"""Every rank does its share (train/parallel/ranks.py): a 2-rank run (torchrun, gloo, the tiny target)
regenerates, builds the feature cache and evaluates with both ranks, and each result equals
what one process computes (exactly: the same batches, the same prompts, greedy).

One 2-rank run serves the three tests that read it (module fixture); each compares it with
the same work done here in one process."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import ROOT, chat_ids, compose_debug, metrics_records, untied_target
from train.core import feature_cache as fc
from train.core.checkpoint import load_draft
from train.core.schedule import global_rows
from train.data.prepare import prepare_data
from train.data.regenerate import regenerate
from train.eval.evaluate import evaluate_checkpoint
from train.parallel.ranks import DEFAULT_TIMEOUT_S
from train.run.settings import eval_settings, tracking_settings
from train.run.setup import instantiate, make_accelerator

ROWS, REGEN_BATCH, BATCH = 8, 2, 2  # 4 regeneration batches, 4 feature-cache batches
RUN = [
    "target.tie_word_embeddings=false",  # an untied head: varied answers, not one token repeated
    f"data.num_train={ROWS}",
    f"data.regen_batch_size={REGEN_BATCH}",
    f"train.batch_size={BATCH}",
    "train.feature_cache=true",
    "decode.num_prompts=3",  # rank 0 decodes prompts 0 and 2, rank 1 prompt 1
    "decode.max_new_tokens=40",
    "decode.lookup_min_match=1",  # lookup rounds, counted over both ranks' prompts
    "decode.warmup=0",  # a warm-up prompt per rank would count its rounds twice
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A 2-rank run of the debug experiment; its run dir, cache dir, and the same data
    prepared here in one process into another cache dir."""
    tmp = tmp_path_factory.mktemp("ranks")
    run_dir, cache = tmp / "two", tmp / "cache_two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "train.py", "+experiment=debug", f"run_dir={run_dir}", f"data.cache_dir={cache}",
           "train.dist_timeout_s=600", *RUN]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    torch.set_num_threads(1)  # as each rank: the same kernels, the same bits
    one = tmp / "cache_one"
    cfg = compose_debug(tmp / "unused", f"data.cache_dir={one}", *RUN)
    target = instantiate(cfg.target)
    prepared = prepare_data(target, **OmegaConf.to_container(cfg.data, resolve=True))
    return run_dir, cache, one, cfg, target, prepared


def regen_lines(cache_dir, name: str) -> list[dict]:
    (key,) = (cache_dir / "data" / "regen").iterdir()
    return [json.loads(x) for x in (key / name).read_text().splitlines()]


def test_sharded_regeneration_equals_one_process(two_ranks):
    run_dir, cache, one, *_ = two_ranks
    single = regen_lines(one, "responses.jsonl")  # one process: batch by batch, in order
    batches = [single[b : b + REGEN_BATCH] for b in range(0, ROWS, REGEN_BATCH)]
    assert len(batches) == 4
    # Rank r answered batches r, r + 2 of one process's batches, with the same answers.
    assert regen_lines(cache, "responses.jsonl") == batches[0] + batches[2]
    assert regen_lines(cache, "responses.rank1.jsonl") == batches[1] + batches[3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data_stats"]["regen"]["by_rank"] == [4, 4]
    assert summary["data_stats"]["regen"]["generated"] == ROWS


def test_sharded_feature_cache_equals_one_process(two_ranks):
    _, cache, one, cfg, target, prepared = two_ranks
    rows = prepared.train.select_columns(["input_ids", "loss_mask"])
    order = global_rows(0, len(rows), len(rows), cfg.seed)  # the loop's first epoch
    single = fc.build_feature_cache(target, rows, (), one, batch_size=BATCH, order=order,
                                    progress=False)  # fmt: skip
    # The same key: the 2-rank run trained on the very rows regenerated here.
    shared = fc._open(cache / "features" / single.path.name, fc.cache_settings(target, rows, ()))
    index = json.loads((shared.path / "index.json").read_text())
    by_rank = {r: set() for r in (0, 1)}
    for i, (shard, _, _) in enumerate(shared.rows):
        by_rank[index["shards"][shard]["rank"]].add(i)
    batches = [order[b : b + BATCH] for b in range(0, len(order), BATCH)]
    assert by_rank[1] == set(batches[1] + batches[3]) and by_rank[0] == set(batches[0] + batches[2])

    def features(cache, i):
        shard, first, n = cache.rows[i]
        return cache.shards[shard].get_slice("last")[first : first + n]

    for i in range(len(rows)):
        assert torch.equal(features(shared, i), features(single, i)), i


def test_two_rank_evaluation_equals_one_process(two_ranks):
    run_dir, _, _, _, target, prepared = two_ranks
    (ev,) = [r for r in metrics_records(run_dir) if r["kind"] == "eval"]
    assert ev["prompts_by_rank"] == [[0, 2], [1]]
    cfg = OmegaConf.load(run_dir / "config.yaml")
    ckpt = run_dir / "checkpoints" / "step_00000002"
    draft, settings = load_draft(ckpt, target), eval_settings(cfg)
    alone, _ = evaluate_checkpoint(target, draft, prepared.eval_prompts, settings, None)
    assert "prompts_by_rank" not in alone
    for key in ("accepted_per_prompt", "accept_hist", "alpha", "tau", "tau_drafted",
                "verify_rounds", "new_tokens", "ar_new_tokens", "greedy_match_rate",
                "entropy_alpha", "num_prompts", "lookup_share"):  # fmt: skip
        assert ev[f"greedy/{key}"] == alone[f"greedy/{key}"], key
    assert len(ev["greedy/accepted_per_prompt"]) == 3 and ev["greedy/new_tokens"] > 3
    assert 0 < ev["greedy/lookup_share"] < 1, ev["greedy/lookup_share"]  # both kinds of round


def test_process_group_timeout_is_a_setting():
    cfg = compose_debug("unused", "train.dist_timeout_s=123")
    accelerator = make_accelerator(cfg, tracking_settings(cfg))
    assert accelerator.init_handler.timeout.total_seconds() == 123
    default = compose_debug("unused")
    assert default.train.dist_timeout_s == DEFAULT_TIMEOUT_S == 7200
    with pytest.raises(ValueError, match=r"train.dist_timeout_s=0: .*positive"):
        cfg = compose_debug("unused", "train.dist_timeout_s=0")
        make_accelerator(cfg, tracking_settings(cfg))


class ThreadRanks:
    """Two threads standing in for two ranks (train/parallel/ranks.py's interface): a restart of one
    rank's share is tested in seconds, without launching processes."""

    def __init__(self, rank: int, world: int, barrier: threading.Barrier, slots: list):
        self.rank, self.world, self.main = rank, world, rank == 0
        self._barrier, self._slots = barrier, slots

    def barrier(self) -> None:
        self._barrier.wait(timeout=120)

    def gather(self, obj: object) -> list:
        self._slots[self.rank] = obj
        self.barrier()
        out = list(self._slots)
        self.barrier()  # nobody overwrites a slot before every rank has read them all
        return out


def regenerate_on_two_ranks(target, prompts: list[list[int]], **kw) -> list:
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def rank(r: int) -> None:
        results[r] = regenerate(target, prompts, ranks=ThreadRanks(r, 2, barrier, slots), **kw)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results), "a rank failed"
    return results


def test_sharded_regeneration_resumes_only_the_missing_answers(tmp_path):
    torch.set_num_threads(1)
    target = untied_target()
    prompts = [chat_ids(target, q) for q in ("a", "bb", "ccc", "dddd", "eeeee", "ffffff")]
    kw = {"max_new_tokens": 6, "dtype": "float32", "batch_size": 2, "progress": False}
    alone, _ = regenerate(target, prompts, cache_dir=tmp_path / "one", **kw)
    (first, s0), (same, _) = regenerate_on_two_ranks(target, prompts, cache_dir=tmp_path, **kw)
    assert first == same == alone and s0["by_rank"] == [4, 2]  # batches 0, 2 and 1
    rank1 = next((tmp_path / "data" / "regen").iterdir()) / "responses.rank1.jsonl"
    lines = rank1.read_text().splitlines()
    rank1.write_text(lines[0] + "\n" + lines[1][:20])  # rank 1 died writing its batch
    (again, s1), _ = regenerate_on_two_ranks(target, prompts, cache_dir=tmp_path, **kw)
    assert again == alone
    assert (s1["cached"], s1["generated"], s1["by_rank"]) == (5, 1, [1, 0])
