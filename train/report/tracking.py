"""W&B for training runs: offline unless a key is configured, run names/groups/tags derived
from the run directory, and the flat final numbers put into each run's summary (so W&B's own
table and parallel coordinates compare runs). What it logs with, `TrackingSettings`, the
set-up reads from the config once (train/run/settings.py: tracking_settings).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from accelerate import Accelerator

from train.disk import write_atomic
from train.report.runs import eval_tags, flatten


@dataclass(frozen=True)
class TrackingSettings:
    """cfg.logger (conf/logger/*.yaml) and the run's resolved config, which W&B records and
    names the run from (`wandb_run_settings`)."""

    kind: str  # logger.kind: "wandb" or "none"
    project: str | None = None  # logger.project
    entity: str | None = None  # logger.entity; None: W&B's default
    run_config: dict = field(default_factory=dict)  # the whole config, resolved (W&B only)


def setup_wandb_env() -> None:
    """Offline unless a key is configured; an explicit WANDB_MODE always wins."""
    if "WANDB_MODE" in os.environ:
        return
    netrc = Path.home() / ".netrc"
    has_netrc_key = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    if not os.environ.get("WANDB_API_KEY") and not has_netrc_key:
        os.environ["WANDB_MODE"] = "offline"


def data_mode(data: dict) -> str:
    """'embedded-regen', 'chat.jsonl-orig': where the data came from and who answered it."""
    source = str(data.get("source", "embedded"))
    name = PurePosixPath(source.rstrip("/")).name or source
    return f"{name}-{'regen' if data.get('regenerate', True) else 'orig'}"


def wandb_run_settings(config: dict) -> dict:
    """W&B `name`, `group`, `tags` of a run and the `summary_keys` wandb_summary will fill.

    group = runs that differ only in seed: the experiment name plus the overrides that
    conf/train.yaml puts into run_dir (runs/<name>/<overrides>/seed<N>); a run_dir outside
    that scheme groups by draft kind, loss and data mode instead. Tags make every axis
    filterable in W&B's run table. `config`: a run's resolved config."""
    flat = flatten(config)
    exp, seed = str(flat.get("name")), int(flat.get("seed") or 0)
    kind, loss = str(flat.get("draft.kind")), str(flat.get("loss.name"))
    data = data_mode(config.get("data") or {})
    parts = PurePosixPath(str(flat.get("run_dir"))).parts
    if parts and parts[-1] == f"seed{seed}" and exp in parts[:-1]:
        at = len(parts) - 2 - parts[:-1][::-1].index(exp)  # the last `exp` before seed<N>
        group = "/".join([exp, *parts[at + 1 : -1]])
    else:
        group = f"{exp}/{kind}-{loss}-{data}"
    temps = [float(t) for t in flat.get("decode.temperatures") or [0.0]]
    tags = sorted(("greedy" if t == 0.0 else f"T{t:g}" for t in temps), key=lambda t: t != "greedy")
    keys = ["final/tau", "final/speedup", "final/train_wall_s", "final/train_s", "final/steps"]
    keys += ["final/loss", "final/sim_tau"]
    for tag in tags:  # as train/eval/evaluate.py names them
        keys += [f"final/{tag}/{m}" for m in ("tau", "speedup", "proxy_tau", "entropy_slope")]
        keys += [f"final/{tag}/alpha_{i}" for i in range(1, int(flat.get("decode.k") or 4) + 1)]
    return {
        "name": f"{group}/seed{seed}",
        "group": group,
        "tags": [f"draft:{kind}", f"loss:{loss}", f"data:{data}", f"exp:{exp}"],
        "summary_keys": keys,
    }


def wandb_summary(summary: dict) -> dict[str, float | None]:
    """Flat final numbers for the W&B run summary (W&B keeps only the last value of each
    logged key and drops lists such as alpha; these land in its table and parallel
    coordinates): final tau/speedup, per temperature tau, speedup, proxy tau, α_i and the
    slope of acceptance on the target's entropy."""
    ev = summary.get("final_eval") or {}
    tr = summary.get("final_train") or {}
    out: dict[str, float | None] = {
        "final/tau": ev.get("tau"),
        "final/speedup": ev.get("speedup"),
        "final/train_wall_s": summary.get("wall_s"),
        "final/train_s": summary.get("train_s"),
        "final/steps": summary.get("steps"),
        "final/loss": tr.get("loss"),
        "final/sim_tau": tr.get("sim_tau"),
    }
    for tag in eval_tags(ev):
        for m in ("tau", "speedup", "proxy_tau"):
            out[f"final/{tag}/{m}"] = ev.get(f"{tag}/{m}")
        out[f"final/{tag}/entropy_slope"] = (ev.get(f"{tag}/entropy_alpha") or {}).get("slope")
        for i, a in enumerate(ev.get(f"{tag}/alpha") or [], 1):
            out[f"final/{tag}/alpha_{i}"] = a
    return out


def tracker(tracking: TrackingSettings) -> str | None:
    """accelerate's `log_with` for logger.kind: "wandb" (offline unless a key is
    configured) or None."""
    if tracking.kind == "wandb":
        setup_wandb_env()
        return "wandb"
    if tracking.kind != "none":
        raise ValueError(f"logger.kind must be 'wandb' or 'none', got {tracking.kind!r}")
    return None


def init_tracking(accelerator: Accelerator, tracking: TrackingSettings, run_dir: Path) -> None:
    """Start the W&B run: group = runs differing only in seed; tags = kind, loss, data."""
    if tracking.kind != "wandb":
        return
    wb = wandb_run_settings(tracking.run_config)
    accelerator.init_trackers(
        tracking.project,
        config=tracking.run_config,
        init_kwargs={
            "wandb": {
                "name": wb["name"],
                "group": wb["group"],
                "tags": wb["tags"],
                "dir": str(run_dir),
                "entity": tracking.entity,
                # no run-history and summary tables on the console at the end (~30 lines):
                # they are in the run's files and W&B; where the run is saved is still said
                "settings": {"quiet": True},
            }
        },
    )


def finish_tracking(accelerator: Accelerator, tracking: TrackingSettings, summary: dict) -> None:
    """Final τ, speedup and α_i into W&B's own run table."""
    if tracking.kind == "wandb" and summary:
        accelerator.get_tracker("wandb", unwrap=True).summary.update(wandb_summary(summary))


class RunLog:
    """A run's records (train and eval lines) into metrics.jsonl and the tracker, from the
    main process. A resumed run drops the lines past its checkpoint and keeps the earlier
    ones in `earlier`, so its summary covers the whole run."""

    def __init__(self, run_dir: Path, accelerator: Accelerator, resumed_at: int | None):
        self.path, self.accelerator = run_dir / "metrics.jsonl", accelerator
        self.main = accelerator.is_main_process
        self.earlier: list[dict] = []
        if self.main and resumed_at is not None and self.path.exists():
            lines = [ln for ln in self.path.read_text().splitlines() if ln]
            records = [json.loads(ln) for ln in lines[:-1]]
            with contextlib.suppress(json.JSONDecodeError):  # a kill in the middle of an append
                records += [json.loads(ln) for ln in lines[-1:]]
            self.earlier = [r for r in records if r["step"] <= resumed_at]
            # atomic: Ctrl-C here must not lose the records the run is resumed with
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.earlier))

    def write(self, record: dict) -> None:
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float)}
        self.accelerator.log(numbers, step=record["step"])
