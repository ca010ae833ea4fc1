"""scripts/uv_args.py: pip's configuration handed to uv (scripts/setup.sh installs with uv)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("uv_args", ROOT / "scripts" / "uv_args.py")
uv_args = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_args)

LISTING = """\
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
user.index-url='https://mirror.example/simple'
"""


def test_every_index_find_links_and_constraint_become_uv_flags():
    config = uv_args.pip_config(LISTING)
    assert uv_args.uv_args(config) == [
        "--index-strategy", "unsafe-best-match",
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]  # fmt: skip
    assert config["cert"] == "/etc/ssl/certs/ca-certificates.crt"


def test_the_environment_wins_over_pip_conf_in_either_order():
    """PIP_FIND_LINKS beats pip.conf's find-links, as in pip, whichever line comes first."""
    env_last = "global.find-links='/elsewhere'\n:env:.find-links='/opt/wheels'\n"
    env_first = ":env:.find-links='/opt/wheels'\nglobal.find-links='/elsewhere'\n"
    assert uv_args.pip_config(env_last)["find-links"] == "/opt/wheels"
    assert uv_args.pip_config(env_first)["find-links"] == "/opt/wheels"


def test_no_configuration_is_uv_with_pip_s_version_choice_only():
    assert uv_args.uv_args(uv_args.pip_config("")) == ["--index-strategy", "unsafe-best-match"]


def test_the_script_reads_this_machine_s_pip(tmp_path):
    """Run as setup.sh runs it: pip's own listing, one argument per line."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /some/wheels\n")
    env = {"PIP_CONFIG_FILE": str(conf), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "uv_args.py")],
        capture_output=True, text=True, env=env, check=True,
    ).stdout.split("\n")  # fmt: skip
    assert out[:2] == ["--index-strategy", "unsafe-best-match"]
    assert "/some/wheels" in out
