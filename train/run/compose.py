"""The target and data groups of conf/ composed without train.py (scripts/regenerate.py,
scripts/build_pack.py): what preparing data needs, not a whole run's config."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[2]


def compose_target_data(overrides: list[str]) -> DictConfig:
    """conf/target and conf/data (defaults: the embedded SmolLM2 and corpus) and `device`,
    with Hydra overrides such as target=NAME data=NAME data.KEY=VALUE device=cpu; a group
    name that has no file is refused with the names there are."""
    chosen = {"target": "smollm2_135m", "data": "default", "device": "auto"}
    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key in chosen:
            chosen[key] = value
        else:
            rest.append(o)
    for group in ("target", "data"):  # Hydra's own message lists its whole search path
        if not (ROOT / "conf" / group / f"{chosen[group]}.yaml").is_file():
            known = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
            raise ValueError(
                f"{group}={chosen[group]}: there is no conf/{group}/{chosen[group]}.yaml; "
                f"conf/{group} has {known}"
            )
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            return compose(
                config_name=None, overrides=[f"+{k}={v}" for k, v in chosen.items()] + rest
            )
    except HydraException as err:
        raise ValueError(
            f"{err} (the arguments are overrides of the target and data groups only: "
            "target=NAME data=NAME data.KEY=VALUE target.KEY=VALUE device=cpu; no +experiment=)"
        ) from None
