import os

# Tests never reach a hub or W&B servers, and stay on the CPU threads they are given.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# MKL's float32 GEMM on AVX-512 CPUs may round differently with the operands' memory
# alignment, so two processes doing the same steps can differ in the last bit (a resumed
# run against an uninterrupted one: tests/test_resume.py, 1 ulp at step 11 on an Intel Xeon
# with AMX). Strict conditional numerical reproducibility makes results alignment-free; set
# before torch loads MKL, and inherited by the runs the tests start as subprocesses.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# pyproject's addopts run the tests in pytest-xdist workers, one per core: each worker, and
# the runs it starts, gets one thread (two processes of two threads on two cores slow every
# forward several-fold). Set before torch reads it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from train.run.machine import usable_cores  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core this process may run on, as a
    run counts them. xdist's own count is psutil's physical cores, 1 where two vCPUs are one
    core's two threads: the whole suite then runs in one worker, twice as long."""
    return usable_cores()


@pytest.fixture
def tiny_target():
    from models.target_loaders import build_tiny_random

    return build_tiny_random(seed=0, device="cpu")


@pytest.fixture(scope="module")
def tiny():
    """tiny_target built once per test module (module-scoped fixtures build on it)."""
    from models.target_loaders import build_tiny_random

    return build_tiny_random(seed=0, device="cpu")


@pytest.fixture(scope="module")
def verifier_dir(target, tmp_path_factory):
    """The module's `target` saved as an HF directory: the verifier a speculators export
    names, from which the library reloads the embedding and head."""
    path = tmp_path_factory.mktemp("verifier")
    target.model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: the converted copy, else read from the GGUF."""
    from transformers import AutoTokenizer

    from models.target_loaders import DEFAULT_CACHE_DIR, smollm2_gguf_path

    converted = DEFAULT_CACHE_DIR / "smollm2-135m-instruct"
    if (converted / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(converted))
    gguf = smollm2_gguf_path()  # first use on a fresh machine: read it from the GGUF
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# The files whose runs take the longest (a SIGKILL harness, two-rank runs; ~11, 9 and 5 of
# the suite's 66 minutes in one process, Intel Xeon, 2026-12-06), run first: xdist hands the
# workers whole files in order (pyproject: --no-loadscope-reorder, not most tests first), and
# one of these begun last leaves a worker alone for minutes. Within them, and for every other
# file, pytest-randomly's order stands.
LONGEST_FIRST = ("test_fault_injection.py", "test_parallel.py", "test_resume.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
