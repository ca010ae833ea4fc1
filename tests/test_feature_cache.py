"""The offline feature cache (train/core/feature_cache.py) on the tiny random target: the loss and
gradients it gives equal the online target's bit for bit, a run with it equals a run without,
its key follows target, data and taps, and a partial or damaged cache is rebuilt, not read."""

import json
import re

import hydra.utils
import pytest
import torch

import train.core.feature_cache as fc
from models.target import Target
from models.target_loaders import build_tiny_random
from tests.helpers import TINY_CPU_RUN, compose_train, metrics_records
from train.core.checkpoint import load_checkpoint
from train.core.step import StepStats, aux_loss, offset_losses
from train.data.prepare import collate
from train.run.settings import eval_settings
from train.run.setup import step_setup


def _cfg(*overrides: str):
    return compose_train(
        *TINY_CPU_RUN, "name=fc",
        "optim.lr=3e-3", "optim.warmup_steps=1", "train.batch_size=4", "train.log_every=1",
        "decode.temperatures=[0.0,0.7]", *overrides,
    )  # fmt: skip


def _rows(n: int = 10, seed: int = 0) -> list[dict]:
    """Rows of different lengths (so batches pad), the first quarter of each a prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in torch.randint(6, 40, (n,), generator=g).tolist():
        ids = torch.randint(1, 128, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [int(t >= length // 4) for t in range(length)]})
    return rows


def _loss_and_grads(cfg, draft, target, batch, t_out):
    """One micro-batch of the loop: draft forward, offset losses + aux, backward."""
    draft.zero_grad(set_to_none=True)
    out = draft(target, batch["input_ids"], t_out, batch["attention_mask"], batch["loss_mask"])
    setup = step_setup(cfg, out.offsets, eval_settings(cfg).samplings)
    counts = torch.tensor([float(batch["loss_mask"][:, o:].sum()) for o in setup.offsets])
    stats = StepStats.zeros(len(setup.offsets), len(setup.samplings))
    loss = offset_losses(out, t_out.logits, batch, counts, setup, stats)
    aux = aux_loss(out, t_out.logits, batch["attention_mask"])
    if aux is not None:
        loss = loss + aux
    loss.backward()
    return (
        loss.detach(),
        stats.flat(),
        {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize(
    "arch,dtype,draft_args",
    [
        ("llama", "float32", ["draft=eagle", "draft.model.layers=[1,2,3]", "draft.model.ttt_steps=3"]),
        ("llama", "bfloat16", ["draft=eagle", "draft.model.layers=[1,2,3]", "draft.model.ttt_steps=3"]),
        ("gemma2", "float32", ["draft=eagle", "draft.model.layers=[1,4]", "draft.model.ttt_steps=2"]),
        ("llama", "float32", ["draft=eagle1", "draft.model.feature_loss_weight=0.5"]),
        ("llama", "bfloat16", ["draft=medusa", "draft.model.num_heads=3"]),
        ("llama", "float32", ["draft=mtp"]),
        ("llama", "float32", ["draft=draft_lm", "draft.model.num_layers=1"]),
    ],
)  # fmt: skip
def test_cached_loss_and_grads_equal_the_online_target(tmp_path, arch, dtype, draft_args):
    cfg = _cfg(*draft_args)
    target = build_tiny_random(seed=0, num_layers=4, arch=arch, dtype=dtype, device="cpu")
    rows = _rows()
    counts = torch.ones(target.vocab_size)
    torch.manual_seed(0)
    draft = hydra.utils.instantiate(cfg.draft.model, target=target, token_counts=counts)
    layers = tuple(draft.hidden_layers)
    order = [3, 7, 1, 0, 9, 4, 2, 8, 6, 5]  # a first epoch's shuffled batches of 4, 4, 2
    cache = fc.build_feature_cache(
        target, rows, layers, tmp_path, batch_size=4, order=order, shard_bytes=2048,
        progress=False,
    )  # fmt: skip
    assert len(cache.shards) > 1  # rows are read across shard files
    for start in range(0, len(order), 4):
        chunk = order[start : start + 4]
        batch = collate([rows[i] for i in chunk], target.tokenizer.pad_token_id)
        online = target(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            hidden_layers=layers,
            use_cache=False,
        )
        cached = fc.cached_target_output(cache, target, chunk, batch)
        assert list(cached.hidden) == list(online.hidden)
        real = batch["attention_mask"].bool()  # [B, T]; padding differs (zeros here)
        assert torch.equal(cached.logits[real], online.logits[real])
        for la in layers:
            assert torch.equal(cached.hidden[la][real], online.hidden[la][real])
        loss_on, stats_on, grads_on = _loss_and_grads(cfg, draft, target, batch, online)
        loss_c, stats_c, grads_c = _loss_and_grads(cfg, draft, target, batch, cached)
        assert torch.equal(loss_c, loss_on) and torch.equal(stats_c, stats_on)
        assert grads_c.keys() == grads_on.keys() and grads_on
        for name in grads_on:
            assert torch.equal(grads_c[name], grads_on[name]), name


@pytest.mark.parametrize("pad", [1, 8])  # train.pad_multiple: the loop's and the pass's widths
def test_training_run_with_cache_equals_run_without(tmp_path, monkeypatch, capsys, pad):
    from train.loop import run

    monkeypatch.setattr(fc, "default_cache_root", lambda: tmp_path / "cache")
    writes, batch_calls, widths = [], [], []  # cache passes; target forwards over a micro-batch
    real_write, real_call = fc._write, Target.__call__
    monkeypatch.setattr(fc, "_write", lambda *a, **k: writes.append(1) or real_write(*a, **k))

    def spy(self, input_ids, *args, **kwargs):
        if kwargs.get("logits", True) and "attention_mask" in kwargs:  # not preflight / tap scale
            batch_calls.append(input_ids.shape[0])
            widths.append(input_ids.shape[1])
        return real_call(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(Target, "__call__", spy)
    common = ["draft=eagle", "draft.model.ttt_steps=2", "train.batch_size=2", "train.grad_accum=2",
              "train.steps=3", "train.ckpt_every=3", "train.eval_at_ckpt=false",
              f"train.pad_multiple={pad}"]  # fmt: skip
    run(_cfg(*common, f"run_dir={tmp_path / 'online'}"))
    assert writes == [] and batch_calls == [2] * 3 * 2
    assert widths and all(w % pad == 0 for w in widths)
    capsys.readouterr()
    run(_cfg(*common, f"run_dir={tmp_path / 'cached'}", "train.feature_cache=true"))
    assert writes == [1] and batch_calls == [2] * 3 * 2  # + the pass (logits=False)
    out = capsys.readouterr().out  # the stage lines: the feature pass, then training
    assert re.search(r"^\[draftlab\] features: the target's taps \(.+\) over \d+ rows, ready in "
                     r"[\d.]+ s$", out, re.M), out  # fmt: skip
    assert re.search(r"^\[draftlab\] training: 3 steps in \d+ s", out, re.M), out
    final = "checkpoints/step_00000003"
    online, _, _ = load_checkpoint(tmp_path / "online" / final)
    cached, _, _ = load_checkpoint(tmp_path / "cached" / final)
    assert online.keys() == cached.keys()
    for name in online:
        assert torch.equal(cached[name], online[name]), name
    losses = [[x["loss"] for x in metrics_records(tmp_path / d)] for d in ("online", "cached")]
    assert losses[0] == losses[1]

    # Another seed on the same data reads the cache: no rebuild, no target forward per step.
    batch_calls.clear()
    summary = run(
        _cfg(*common, f"run_dir={tmp_path / 'seed1'}", "seed=1", "train.feature_cache=true")
    )
    assert summary["steps"] == 3 and writes == [1] and batch_calls == []


def test_key_changes_with_target_data_and_taps():
    target = build_tiny_random(seed=0, num_layers=4, device="cpu")
    rows = _rows()

    def key(t=target, r=rows, layers=(1, 3, -1)):
        return fc.cache_key(fc.cache_settings(t, r, layers))

    base = key()
    assert key(r=[dict(x) for x in rows]) == base  # equal content, equal key
    assert key(layers=(1, 2, -1)) != base
    assert fc.cache_key(fc.cache_settings(target, rows, (1, 3, -1), pad_multiple=1)) == base
    assert fc.cache_key(fc.cache_settings(target, rows, (1, 3, -1), pad_multiple=64)) != base
    assert key(layers=(1, 3)) != base
    changed = [dict(x) for x in rows]
    changed[5] = {**rows[5], "input_ids": rows[5]["input_ids"][:-1] + [0]}
    assert key(r=changed) != base
    assert key(r=rows[:-1]) != base
    moved = rows[:-1]
    moved[-1] = {**moved[-1], "input_ids": moved[-1]["input_ids"] + rows[-1]["input_ids"][:1]}
    assert key(r=moved + [{**rows[-1], "input_ids": rows[-1]["input_ids"][1:]}]) != base
    assert key(t=build_tiny_random(seed=1, num_layers=4, device="cpu")) != base
    assert key(t=build_tiny_random(seed=0, num_layers=4, dtype="bfloat16", device="cpu")) != base


def test_partial_or_damaged_cache_is_rebuilt_not_read(tmp_path, monkeypatch):
    target = build_tiny_random(seed=0, num_layers=4, device="cpu")
    rows = _rows()
    args = (target, rows, (1, -1), tmp_path)
    kwargs = {"batch_size": 4, "shard_bytes": 2048, "progress": False}
    real_save = fc.save_file
    saved = []

    def save_then_crash(tensors, path):  # an interrupted build: the second shard never lands
        if saved:
            raise KeyboardInterrupt
        saved.append(path)
        real_save(tensors, path)

    monkeypatch.setattr(fc, "save_file", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        fc.build_feature_cache(*args, **kwargs)
    assert saved and list((tmp_path / "features").iterdir()) == []
    # A crash that could not clean up (killed) leaves its temporary directory: never read.
    key = fc.cache_key(fc.cache_settings(target, rows, (1, -1)))
    stale = tmp_path / "features" / f".tmp-{key}-1"
    stale.mkdir()
    (stale / "index.json").write_text("{}")
    monkeypatch.setattr(fc, "save_file", real_save)

    def features(cache):
        batch = collate(rows, target.tokenizer.pad_token_id)
        out = fc.cached_target_output(cache, target, list(range(len(rows))), batch)
        return out.logits[batch["attention_mask"].bool()]

    good = features(fc.build_feature_cache(*args, **kwargs))
    path = tmp_path / "features" / key
    shards = sorted(path.glob("shard_*.safetensors"))
    assert len(shards) > 1

    writes = []
    real_write = fc._write
    monkeypatch.setattr(fc, "_write", lambda *a, **k: writes.append(1) or real_write(*a, **k))
    assert torch.equal(features(fc.build_feature_cache(*args, **kwargs)), good) and not writes
    for damage in (
        lambda: shards[1].write_bytes(shards[1].read_bytes()[:-64]),  # a short shard
        lambda: shards[0].unlink(),
        lambda: shards[0].write_bytes(b"\xff" * 8 + shards[0].read_bytes()[8:]),  # its header
        lambda: (path / "index.json").write_text(
            json.dumps({**json.loads((path / "index.json").read_text()), "rows": [[0, 0, 5]]})
        ),
        lambda: (path / "index.json").write_text('{"settings": '),
    ):
        damage()
        with pytest.warns(UserWarning, match="damaged feature cache"):
            rebuilt = fc.build_feature_cache(*args, **kwargs)
        assert torch.equal(features(rebuilt), good)
    assert len(writes) == 5


def test_rows_must_match_the_cache(tmp_path):
    target = build_tiny_random(seed=0, num_layers=4, device="cpu")
    rows = _rows()
    cache = fc.build_feature_cache(target, rows, (-1,), tmp_path, progress=False)
    batch = collate([rows[0], rows[1]], target.tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="row 2 has .* tokens in the batch but"):
        fc.cached_target_output(cache, target, [0, 2], batch)
    with pytest.raises(ValueError, match="permutation"):
        fc.build_feature_cache(target, rows, (1,), tmp_path, order=[0, 0, 1], progress=False)


def test_feature_noise_perturbs_the_taps_within_their_rms_and_never_the_labels():
    """train.feature_noise (train/core/step.py: noisy_features): each tap plus uniform noise of at
    most scale x its per-position RMS, spread over that whole range, drawn from the global
    generator (a resumed run draws the same); the logits are the same tensor; 0 is a no-op."""
    from models.target import TargetOutput
    from train.core.step import noisy_features

    g = torch.Generator().manual_seed(0)
    hidden = {2: 3.0 * torch.randn(2, 5, 64, generator=g), -1: torch.randn(2, 5, 64, generator=g)}
    out = TargetOutput(logits=torch.randn(2, 5, 11, generator=g), hidden=hidden, cache=None)
    assert noisy_features(out, 0.0) is out
    torch.manual_seed(1)
    noisy = noisy_features(out, 0.1)
    torch.manual_seed(1)
    again = noisy_features(out, 0.1)
    assert noisy.logits is out.logits
    for layer, h in hidden.items():
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()
        ratio = (noisy.hidden[layer] - h) / (0.1 * rms)  # in [-1, 1], spread over it
        assert ratio.abs().max() <= 1 + 1e-5 and ratio.abs().max() > 0.9
        assert ratio.mean().abs() < 0.1
        assert torch.equal(noisy.hidden[layer], again.hidden[layer])
