"""What the training loop (train/loop.py) records of a run: `RunRecords`, what it knows so
far; `checkpoint_and_evaluate`, a checkpoint (train/core/checkpoint.py) with its evaluation
(train/eval/evaluate.py), which decodes with the values of `RunEvaluations`, read from the
config once; `write_summary`, summary.json and learning_curve.png at the end."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf

from models.protocol import DraftModel
from models.target import Target
from train.core.checkpoint import rng_state, save_checkpoint, set_rng_state, trainer_state
from train.core.replay import Replay
from train.data.prepare import PreparedData
from train.disk import write_atomic
from train.eval.compiled import DecodeCopies
from train.eval.evaluate import evaluate_checkpoint, format_eval_table
from train.eval.heldout import PREFIX, HeldOut
from train.eval.settings import EvalSettings
from train.parallel.ranks import Ranks
from train.parallel.strategy import Strategy, eval_draft, full_state
from train.phase_memory import phase
from train.report.plots import save_learning_curve
from train.report.tracking import RunLog


@dataclass(frozen=True)
class RunEvaluations:
    """What a run's checkpoints are evaluated with (train/eval/settings.py) and which ones."""

    settings: EvalSettings
    at_checkpoints: bool  # train.eval_at_ckpt
    every: int | None  # train.eval_every; None: every checkpoint

    def due(self, step: int, last: bool) -> bool:
        """Whether checkpoint `step` is evaluated: with train.eval_at_ckpt, the last one and
        every one, or those at multiples of `every`."""
        return self.at_checkpoints and (last or not self.every or step % self.every == 0)


@dataclass
class RunRecords:
    """What the loop knows of the run so far; a resumed run starts from its earlier records
    (train/report/tracking.py: RunLog.earlier), so its summary covers the whole run."""

    last_train: dict | None = None  # the newest train record: alpha per offset, simulated tau
    last_heldout: dict | None = None  # the newest held-out proxy record (train/eval/heldout.py)
    evals: list[dict] = field(default_factory=list)  # eval records, oldest first
    last_checkpoint: str | None = None
    decode_copies: DecodeCopies | None = None  # built at the first evaluation, then reused
    rows_consumed: int = 0  # rows of the seeded stream trained on, all segments of the run
    schedule: dict = field(default_factory=dict)  # the LR schedule's settings, as it started
    identity: dict | None = None  # identity.json of every checkpoint (train/run/identity.py)

    @classmethod
    def resumed(cls, earlier: list[dict], checkpoint: Path | None, **facts) -> RunRecords:
        trained = [r for r in earlier if r["kind"] == "train"]
        heldout = [r for r in earlier if r["kind"] == "heldout"]
        evals = [
            {k: v for k, v in r.items() if k != "kind"} for r in earlier if r["kind"] == "eval"
        ]
        last_ckpt = str(checkpoint) if checkpoint else None
        return cls(trained[-1] if trained else None, heldout[-1] if heldout else None, evals,
                   last_ckpt, **facts)  # fmt: skip


def checkpoint_and_evaluate(
    cfg: DictConfig, evaluations: RunEvaluations, accelerator: Accelerator, strategy: Strategy,
    draft, core: DraftModel, optimizer, scheduler, replay: Replay | None, target: Target,
    prepared: PreparedData, records: RunRecords, log: RunLog, step: int, last: bool,
    train_s: float, loss: float, heldout: list[HeldOut] | None = None,
) -> None:  # fmt: skip
    """Checkpoint `step` (every rank takes part in the gathers; the main rank writes), its
    held-out proxy (train.heldout_proxy: the main rank, seconds) and, when due, its
    evaluation with the shared decoder (every rank decodes its share of the prompts,
    train/eval/evaluate.py; the main rank records), both with the full draft, never the
    FSDP-sharded module (train/parallel/strategy.py). `cfg` is what the checkpoint records."""
    with phase("checkpoint"):
        write_checkpoint(cfg, accelerator, strategy, draft, optimizer, scheduler, replay,
                         records, step, train_s, loss)  # fmt: skip
    evaluate_at(evaluations, accelerator, strategy, core, target, prepared, records, log, step,
                last, train_s, heldout)  # fmt: skip


def write_checkpoint(
    cfg: DictConfig, accelerator: Accelerator, strategy: Strategy, draft, optimizer, scheduler,
    replay: Replay | None, records: RunRecords, step: int, train_s: float, loss: float,
) -> None:  # fmt: skip
    """Gather the state (every rank takes part) and write checkpoint `step` (the main rank)."""
    tc, world = cfg.train, accelerator.num_processes
    draft_state, optim_state = full_state(strategy, accelerator, draft, optimizer)  # gathers
    rng_all = gather_object([rng_state()])  # one entry per rank
    replay_all = gather_object([replay.state_dict()]) if replay is not None else None
    if accelerator.is_main_process:
        state = trainer_state(step, records.rows_consumed, world, optim_state, scheduler, rng_all,
                              replay_all, train_s, records.schedule, strategy.kind)  # fmt: skip
        records.last_checkpoint = str(save_checkpoint(
            cfg.run_dir, step, draft_state, OmegaConf.to_yaml(cfg.draft, resolve=True), state,
            tc.keep_last, meta={"loss": loss, "name": str(cfg.name), "train_s": round(train_s, 2)},
            config_yaml=OmegaConf.to_yaml(cfg, resolve=True), identity=records.identity,
        ))  # fmt: skip


def evaluate_at(
    evaluations: RunEvaluations, accelerator: Accelerator, strategy: Strategy, core: DraftModel,
    target: Target, prepared: PreparedData, records: RunRecords, log: RunLog, step: int,
    last: bool, train_s: float, heldout: list[HeldOut] | None = None, owed: bool = False,
) -> None:  # fmt: skip
    """Checkpoint `step`'s held-out proxy and, when due, its evaluation. `owed`: a resumed
    run's first call, at the checkpoint it resumed from: only what the records lack for that
    step (a run killed after writing the checkpoint, before its evaluation ended, would
    otherwise never evaluate it, its last one included)."""
    evaluate = evaluations.due(step, last)
    if owed:  # the main rank holds the records: its view decides, for every rank alike
        recorded = Ranks.current().broadcast((
            any(e.get("step") == step for e in records.evals),
            (records.last_heldout or {}).get("step") == step,
        ))  # fmt: skip
        evaluate = evaluate and not recorded[0]
        heldout = None if recorded[1] else heldout
    if heldout is None and not evaluate:
        accelerator.wait_for_everyone()
        return
    with eval_draft(strategy, core) as full:  # under FSDP every rank streams the weights in
        if heldout is not None and accelerator.is_main_process:
            rng = rng_state()  # a draft that samples positions (DFlash) must not shift training's
            with phase("held-out proxy"):
                held = {k: v for proxy in heldout for k, v in proxy.record(full, target).items()}
            set_rng_state(rng)
            records.last_heldout = {"step": step, "train_s": round(train_s, 2), **held}
            log.write({"kind": "heldout", **records.last_heldout})
        if evaluate:
            rng = rng_state()  # evaluation must not shift the training RNG stream
            started = time.perf_counter()
            with phase("evaluation"):
                result, records.decode_copies = evaluate_checkpoint(
                    target, full, prepared.eval_prompts, evaluations.settings, records.last_train,
                    records.decode_copies, Ranks.current(),
                )  # fmt: skip
            set_rng_state(rng)
            result["step"] = step
            result["train_s"] = round(train_s, 2)  # training seconds behind it: learning curves
            result |= heldout_proxy_taus(result, records.last_heldout, step)
            result["eval_s"] = round(time.perf_counter() - started, 1)  # probes, copies, decoding
            records.evals.append(result)
            log.write({"kind": "eval", **result})  # the main rank's
    accelerator.wait_for_everyone()


def heldout_proxy_taus(result: dict, heldout: dict | None, step: int) -> dict:
    """`<tag>/heldout_proxy_tau` per decode sampling of an eval record: the held-out proxy's
    simulated tau at the same checkpoint, beside the training rows' `<tag>/proxy_tau`."""
    if heldout is None or heldout["step"] != step:
        return {}
    out = {}
    for key in [k for k in result if k.endswith("/tau")]:
        tag = key.removesuffix("/tau")
        sim = heldout.get(
            f"{PREFIX}sim_tau_greedy" if tag == "greedy" else f"{PREFIX}sim_tau_{tag}"
        )
        if sim is not None:
            out[f"{tag}/heldout_proxy_tau"] = sim
    return out


def write_summary(cfg: DictConfig, run_dir: Path, summary: dict, records: RunRecords) -> dict:
    """summary.json, and the evaluation table printed at the end of a run."""
    last_eval = records.evals[-1] if records.evals else {}
    summary |= {
        # The dtypes chosen for this run (models/dtype_choice.py), with the timings behind them
        "dtypes": {
            **summary.get("dtypes", {}),  # training: the target's dtype, the draft's autocast
            "regenerate": summary["data_stats"].get("regen_dtype"),
            **last_eval.get("dtypes", {}),
        },
        # Prompts the regeneration server refused, left out of the training rows (null: hf)
        "regen_failed": (summary["data_stats"].get("regen") or {}).get("failed"),
        "last_checkpoint": records.last_checkpoint,
        "final_train": records.last_train,
        "final_heldout": records.last_heldout,  # null without train.heldout_proxy
        "final_eval": last_eval or None,
        "tau_curve": [[e["step"], e.get("tau")] for e in records.evals],
    }
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=str))
    if "train_s" in summary:  # the stage lines of training and of the last evaluation
        print(stage_line(summary, last_eval, records.last_heldout), flush=True)
    if records.evals or records.last_heldout:  # read back from the files just written
        try:  # a figure that fails must not fail a finished run: its records are written
            print(f"learning curve -> {save_learning_curve(run_dir)}", flush=True)
        except Exception as err:  # noqa: BLE001
            print(f"learning_curve.png not written ({type(err).__name__}: {err}); "
                  f"scripts/compare.py {run_dir} draws it", flush=True)  # fmt: skip
    if records.evals:
        print(f"\n{cfg.name}: decoder evaluation (k={cfg.decode.k}) -> {run_dir}/summary.json")
        print(format_eval_table(records.evals), flush=True)
    return summary


def stage_line(summary: dict, last_eval: dict, heldout: dict | None) -> str:
    """'[draftlab] training: 358 steps in 841 s (held-out proxy sim τ 1.551 greedy);
    evaluation 629 s (compiling 123 s, 6 graphs); 1515 s from the first step to the end'."""
    line = f"[draftlab] training: {summary['steps']} steps in {summary['train_s']:.0f} s"
    sim = (heldout or {}).get("heldout/sim_tau_greedy")
    if sim is not None:
        line += f" (held-out proxy sim τ {sim:.3f} greedy)"
    if last_eval.get("eval_s") is not None:
        line += f"; evaluation {last_eval['eval_s']:.0f} s"
        graphs = last_eval.get("compiled_graphs")
        if graphs:  # this checkpoint compiled: what that took
            line += f" (compiling {last_eval['compile_s']:.0f} s, {graphs} graphs)"
    if summary.get("wall_s") is not None:
        line += f"; {summary['wall_s']:.0f} s from the first step to the end"
    return line
