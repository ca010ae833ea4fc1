"""`dtype: auto`: pick float32 or bfloat16 for one use of the target by timing both on this
machine, per shape, and remember the verdict per machine.

Why: which dtype is faster depends on the CPU and on the shape, not on habit. With native
bf16 kernels a bf16 verify of k+1 tokens costs about one step; on a CPU with AVX2 only the
same bf16 verify costs several steps while float32 costs less than two, and batched bf16
regeneration runs several times slower than float32 (docs/portable.md has the figures and
the commands that measured them). So every use is decided on its own shapes: the
regeneration batch, the AR step and the verify width of decoding.

A choice is keyed by the machine (CPU model, ATen's CPU capability, the oneDNN ISA cap, the
torch version, the thread count), the use and its shapes, and cached as one JSON file per
key under `<cache>/dtype/`, so later runs on the same machine reuse it without measuring.
On CUDA the answer is bfloat16 without measuring. An explicit dtype is never replaced.

The target's own dtype (`target.dtype: auto`) is chosen before its weights are read, so it
loads straight into the dtype it runs in (a float32 load cast afterwards peaked at 3x the
bf16 weights' bytes): `choose_target_dtype` times a slice of the target built from its
config alone (`target_slice`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from models.dtypes import cast_keep_rotary, resolve_dtype
from models.target import Target

CANDIDATES = ("float32", "bfloat16")
# A candidate one of whose timed calls takes over LOSING x the best median measured so far cannot
# win: its timing stops at that call, which is its recorded time (bf16 on a CPU without native
# bf16 kernels: a training probe at 4-5 s a call against under 1 s in float32).
LOSING = 2.0
_lost_above = [float("inf")]  # seconds; set by choose_measured while it times a candidate
PROBE_TOKENS = 256  # tokens of the target's probe forward (a training row's scale of GEMM)


@dataclass
class DtypeChoice:
    use: str  # "decode", "regenerate", ... ("compile": the decode path, not a dtype)
    dtype: str  # "float32" | "bfloat16" (or the explicit setting); "eager" | "compiled"
    source: str  # "explicit" | "cuda" | "measured" | "cached"
    seconds: dict[str, float] = field(default_factory=dict)  # median per candidate
    shapes: dict = field(default_factory=dict)

    def as_record(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
        return f"{self.use}: {self.dtype} ({self.source}{'; ' + times if times else ''})"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else platform's word)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> dict[str, str | int]:
    """What makes timings on one machine valid on another: the same CPU model, the same
    kernels ATen and oneDNN may use, the same torch, the same number of threads."""
    return {
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def pick_fastest(seconds: dict[str, float]) -> str:
    """The candidate with the smallest time; on a tie the first listed (float32 first:
    exact where bf16 rounds)."""
    if not seconds:
        raise ValueError("pick_fastest needs at least one timing")
    return min(seconds, key=lambda name: (seconds[name], list(seconds).index(name)))


def cache_root(cache_dir: str | Path | None) -> Path:
    """data.cache_dir, else $DRAFTLAB_CACHE, else ~/.cache/draftlab."""
    return Path(
        cache_dir or os.environ.get("DRAFTLAB_CACHE") or Path.home() / ".cache" / "draftlab"
    ).expanduser()


def cache_file(cache_dir: str | Path | None, key: dict) -> Path:
    root = cache_root(cache_dir)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "dtype" / f"{digest}.json"


def choose_dtype(
    use: str,
    setting: str,
    shapes: dict,
    measure: Callable[[torch.dtype], float],
    device: torch.device,
    cache_dir: str | Path | None = None,
) -> DtypeChoice:
    """The dtype for `use`: `setting` itself unless it is "auto"; on CUDA bfloat16; else the
    faster of CANDIDATES by `measure(dtype)` (seconds), read from the cache when this machine
    measured the same use and shapes before, and written to it otherwise."""
    if setting != "auto":
        name = str(resolve_dtype(setting)).removeprefix("torch.")
        return DtypeChoice(use, name, "explicit", shapes=shapes)
    if device.type == "cuda":
        return DtypeChoice(use, "bfloat16", "cuda", shapes=shapes)
    return choose_measured(use, shapes, lambda name: measure(resolve_dtype(name)), cache_dir)


def choose_measured(
    use: str,
    shapes: dict,
    measure: Callable[[str], float],
    cache_dir: str | Path | None = None,
    candidates: tuple[str, ...] = CANDIDATES,
) -> DtypeChoice:
    """The faster of `candidates` by `measure(name)` (seconds; the first listed wins a tie),
    read from the cache when this machine measured the same use and shapes before, and
    written to it otherwise. Dtypes use it through `choose_dtype`; the compiled path's choice
    (train/eval/plan.py, `decode.compile=auto`) with candidates ("eager", "compiled")."""
    key = {**machine_key(), "use": use, "shapes": shapes}
    path = cache_file(cache_dir, key)
    if path.is_file():
        cached = json.loads(path.read_text())
        return DtypeChoice(use, cached["dtype"], "cached", cached["seconds"], shapes)
    seconds: dict[str, float] = {}
    for name in candidates:
        _lost_above[0] = LOSING * min(seconds.values(), default=float("inf"))
        try:
            seconds[name] = measure(name)
        finally:
            _lost_above[0] = float("inf")
    choice = DtypeChoice(use, pick_fastest(seconds), "measured", seconds, shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "dtype": choice.dtype, "seconds": seconds}, indent=1))
    tmp.replace(path)  # atomic: a reader sees the whole verdict or none
    return choice


@torch.no_grad()
def time_forward(
    target: Target, dtype: torch.dtype, rows: int, new_tokens: int, cached: int, repeats: int = 5
) -> float:
    """Median seconds of one target forward of [rows, new_tokens] tokens over a KV cache of
    `cached` tokens, on a copy of the target in `dtype` (float32 rotary, as decoding casts).
    The cache is filled once from one row, without logits, and repeated to `rows` rows (a
    many-row prefill with its [rows, cached, V] head output, in bf16 on a CPU without native
    bf16, would cost far more than every timed forward together); it is cropped back after
    each timed forward. Timing depends on the cache's size, not its contents. While
    choose_measured times a losing candidate, the first timed call past its bound is returned."""
    model = (
        target.model
        if target.dtype == dtype
        else cast_keep_rotary(copy.deepcopy(target.model), dtype)
    )
    probe = Target(model, target.tokenizer, name=target.name)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (1, cached), generator=g).to(target.device)
    step = torch.randint(0, target.vocab_size, (rows, new_tokens), generator=g).to(target.device)
    cache = probe(prefix, use_cache=True, logits=False).cache
    if rows > 1:
        cache.batch_repeat_interleave(rows)
    times = []
    for _ in range(repeats + 1):  # the first call warms the kernels and is not counted
        t0 = time.perf_counter()
        probe(step, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache.crop(-new_tokens)  # back to `cached` entries
        if len(times) > 1 and times[-1] > _lost_above[0]:
            return times[-1]  # this candidate has lost (choose_measured)
    return statistics.median(times[1:])


def median_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall time of `fn` over `repeats` calls after one warm-up call (or the first call
    past the losing bound, while choose_measured times a candidate)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if times[-1] > _lost_above[0]:
            return times[-1]  # this candidate has lost (choose_measured)
    return statistics.median(times)


def target_slice(config: PretrainedConfig) -> nn.Module:
    """A float32 model of the target's architecture and widths, randomly initialised, with
    one decoder layer per layer type, each called where the target has a layer of its type.
    A forward through it does the target's whole forward's work (every layer's matmuls,
    the full-vocabulary head) while holding the weights of one or two layers and one [V, H]
    table (the head tied to the embedding): timing it needs no weights read. The global
    RNG is left as it was (a run's seed is set before)."""
    types = list(getattr(config, "layer_types", None) or [])
    kinds = list(dict.fromkeys(types)) or [None]
    small = copy.deepcopy(config)
    small.num_hidden_layers = len(kinds)
    small.tie_word_embeddings = True  # the head's matmul costs the same; its memory halves
    if types:
        small.layer_types = kinds
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    built = model.model.layers
    order = [kinds.index(t) for t in types] if types else [0] * config.num_hidden_layers
    model.model.layers = nn.ModuleList([built[i] for i in order])  # shared modules
    for cfg in {
        id(model.config): model.config,
        id(model.model.config): model.model.config,
    }.values():
        cfg.num_hidden_layers = config.num_hidden_layers  # the forward runs every entry
        if types:
            cfg.layer_types = types
    return model.eval().requires_grad_(False)


def choose_target_dtype(
    setting: str,
    config: PretrainedConfig,
    name: str,
    device: torch.device,
    tokens: int = PROBE_TOKENS,
    cache_dir: str | Path | None = None,
    timer: Callable[[Callable[[], object]], float] = median_seconds,
) -> DtypeChoice:
    """The target's training dtype before its weights are loaded: `setting` unless "auto";
    on CUDA bfloat16; on a CPU the faster of float32 and bfloat16 for one training forward
    (no grad, logits over `tokens` positions), timed by `timer` on `target_slice(config)`,
    or this machine's earlier verdict for the same target and shapes."""
    positions = getattr(config, "max_position_embeddings", None) or tokens
    tokens = max(1, min(int(tokens), int(positions)))
    shapes = {"target": name, "rows": 1, "tokens": tokens, "probe": "slice"}

    def measure(dtype: torch.dtype) -> float:
        # One slice alive at a time, cast in place: the choice's memory stays below the
        # load's (a cached or explicit choice builds none)
        model = cast_keep_rotary(target_slice(config), dtype)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (1, tokens), generator=g)
        with torch.no_grad():
            return timer(lambda: model(input_ids=ids, use_cache=False))

    return choose_dtype("train_target", setting, shapes, measure, device, cache_dir)
