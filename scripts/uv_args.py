"""pip's configuration as `uv pip install` arguments, one per line (scripts/setup.sh).

uv reads none of pip's configuration (pip.conf, PIP_* variables): a machine whose torch lies in
a find-links folder, or whose packages come from a local index, would install something else.
Read with `pip config list` (files and environment; the environment wins, as in pip):
index-url, extra-index-url, find-links and constraint become uv's flags, and uv picks the best
version over every index as pip does (`--index-strategy unsafe-best-match`; uv's own default
stops at the first index holding a name). `--cert` prints pip's CA file instead (uv takes it as
SSL_CERT_FILE), nothing when pip has none.
"""

from __future__ import annotations

import subprocess
import sys

FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_config(listing: str) -> dict[str, str]:
    """`pip config list` lines (`scope.key='value'`) as {key: value}; `:env:` lines win."""
    config: dict[str, str] = {}
    from_env: set[str] = set()
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        if not sep or "." not in name:
            continue
        scope, key = name.split(".", 1)
        if key in from_env:
            continue
        config[key] = value.strip().strip("'\"")
        if scope == ":env:":
            from_env.add(key)
    return config


def uv_args(config: dict[str, str]) -> list[str]:
    args = ["--index-strategy", "unsafe-best-match"]
    for key, flag in FLAGS.items():
        for value in config.get(key, "").split():  # pip separates several values by whitespace
            args += [flag, value]
    return args


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    config = pip_config(listing)
    if sys.argv[1:] == ["--cert"]:
        if config.get("cert"):
            print(config["cert"])
        return
    print("\n".join(uv_args(config)))


if __name__ == "__main__":
    main()
