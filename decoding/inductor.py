"""torch.compile through one counting backend (decoding/compiled.py builds the compiled
decoding path on it; docs/fastpath.md): the compile modes and their inductor settings
(`MODES`, `MODE_OPTIONS`, `resolve_mode`), `Compiled` (fixed shapes, full graphs, frozen
weights where asked), what compiling cost so far (`STATS`) and inductor's on-disk cache
under the project's cache root (`use_compile_cache`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial
from types import CodeType, FunctionType, MethodType, ModuleType

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from models.dtype_choice import cache_root

MODES = (
    "auto",
    "cpp-gemm",
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
    "aot_eager",
)


@dataclass
class CompileStats:
    graphs: int = 0  # graphs compiled so far (a recompile adds one)
    cudagraphs: int = 0  # CUDA graphs recorded so far (a graph's second call records it)
    seconds: float = 0.0  # wall time of the calls that compiled or recorded, those runs included
    # those seconds per graph: `graph_label` ("<Compiled name> [input shape] dtype") -> seconds
    # (a recompile adds)
    by_graph: dict[str, float] = field(default_factory=dict)

    def graphs_since(self, before: dict[str, float]) -> dict[str, float]:
        """The seconds each graph added since `before` (a copy of `by_graph`)."""
        return {label: took - before.get(label, 0.0) for label, took in self.by_graph.items()
                if took > before.get(label, 0.0)}  # fmt: skip


STATS = CompileStats()
# modules inductor loaded for a compile (the backend's), until its `Compiled` takes them
UNCLAIMED: list[ModuleType] = []


@cache
def counts_recordings() -> bool:
    """Count every CUDA-graph recording in STATS (torch announces each to dynamo's callbacks;
    registered once, when the first `Compiled` is built). False where this torch announces
    none (before 2.8: no CallbackTrigger): STATS.cudagraphs then stays 0, uncounted."""
    try:
        from torch._dynamo.callback import CallbackTrigger, callback_handler
    except ImportError:
        return False

    def count(args) -> None:
        if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
            STATS.cudagraphs += 1

    callback_handler.register_start_callback(count)
    return True


# Inductor settings per mode beyond torch.compile's own (`list_mode_options`). cpp-gemm: every
# matmul of a frozen weight through inductor's C++ GEMM template and nothing else, so nothing is
# benchmarked (a single candidate is taken as it is), and linears that read one input (q/k/v,
# gate/up) concatenated into one GEMM at freezing. Measured side by side against `default` and
# `max-autotune-no-cudagraphs` by scripts/bench_compiled_forward.py (docs/fastpath.md, "Compile
# modes"). The template packs its weights at freezing: a graph whose weights stay inputs (a
# draft's, reloaded per checkpoint) has no candidate (NoValidChoicesError) and compiles as
# `default` (`_backend`).
MODE_OPTIONS = {
    "cpp-gemm": ("max-autotune-no-cudagraphs",
                 {"max_autotune_gemm_backends": "CPP", "cpp.enable_concat_linear": True}),
}  # fmt: skip


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}; use one of {MODES}")
    if mode == "auto":  # CPU: the mode scripts/bench_compile.py measured best (docs/fastpath.md)
        return "reduce-overhead" if device.type == "cuda" else "cpp-gemm"
    return mode


def user_compile_cache() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR as the user set it: None where unset or where inductor set it
    to its own temporary default (importing some of torch does, before any compile)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return None if path in (None, default_cache_dir()) else path


def use_compile_cache(cache_dir: str | None) -> str | None:
    """Inductor's on-disk cache (generated kernels, compiled C++, autotuning results) in
    <cache root>/inductor (models.dtype_choice.cache_root, beside the dtype verdicts) instead
    of a temporary directory that every new machine and every cleaned /tmp compiles into
    again; a TORCHINDUCTOR_CACHE_DIR the user set stays. Inductor
    reads the variable when it compiles, so this only has to run before the first compile.
    Frozen CPU graphs hold packed weights its graph cache cannot store, so a warm cache saves
    code generation and the C++ compiler, not the tracing (docs/fastpath.md). -> the dir."""
    if user_compile_cache() is not None:
        return user_compile_cache()
    path = str(cache_root(cache_dir) / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


@cache
def _backend(mode: str, freeze: bool) -> Callable:
    """One backend object per setting: dynamo reuses a compiled graph only under the backend
    that compiled it, so every `Compiled` of the same setting must share it."""
    if mode == "aot_eager":
        inner = torch._dynamo.lookup_backend("aot_eager")
    else:
        # Imported here, as only code-generating modes need it: the import is slow, and every
        # eager decode and the aot_eager tests would pay for it otherwise.
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        _memoize_kernel_templates()
        _list_single_templates_unrendered()
        unfrozen_cpp = mode == "cpp-gemm" and not freeze  # no packed weights: no template
        base, extra = ("default", {}) if unfrozen_cpp else MODE_OPTIONS.get(mode, (mode, {}))
        options = {**list_mode_options(base), "freezing": freeze, **extra}
        if _picked_vec_isa_builds():  # the other ISAs inductor would probe go unbuilt
            options["cpp.vec_isa_ok"] = True

        def inner(gm, example_inputs):
            from torch._inductor.codecache import PyCodeCache

            loaded = len(PyCodeCache.modules)
            compiled = compile_fx(gm, example_inputs, config_patches=options)
            UNCLAIMED.extend(PyCodeCache.modules[loaded:])  # the calling `Compiled` takes them
            return compiled

    def backend(gm, example_inputs):
        STATS.graphs += 1
        return inner(gm, example_inputs)

    return backend


@cache
def _memoize_kernel_templates() -> None:
    """Inductor compiles a kernel template's jinja source anew for every GEMM it lowers and
    renders (twice per matmul of a 30-layer target): a third of a CPU compile's seconds in
    cProfile (SmolLM2, cpp-gemm). The source is a module constant and a jinja Template renders
    without side effects, so one compiled Template per source serves them all."""
    from torch._inductor.codegen.common import KernelTemplate

    compile_source = KernelTemplate._template_from_string
    KernelTemplate._template_from_string = staticmethod(cache(compile_source))


@cache
def _picked_vec_isa_builds() -> bool:
    """Whether the vector ISA inductor will generate C++ for (the widest the CPU's flags list,
    or ATEN_CPU_CAPABILITY's) compiles and loads here. Inductor checks it by building and
    loading a probe for every ISA the flags list (AMX, AVX-512 VNNI, AVX-512, AVX2: four
    builds and four child processes, ~11 s of the first compile of a process on an Intel Xeon
    with AMX, measured) before it uses the first; only the first is used. True: its probe
    passed, and the others need not be built (`cpp.vec_isa_ok`); False where the user set
    TORCHINDUCTOR_VEC_ISA_OK or the probe failed: inductor then checks every ISA itself."""
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None:
        return False
    listed = cpu_vec_isa.valid_vec_isa_list  # cached: filled below with every flagged ISA
    with config.patch({"cpp.vec_isa_ok": True}):
        listed.cache_clear()
        picked = cpu_vec_isa.pick_vec_isa()
        # truth is a build outside the patch (the probe again: twice on an AVX2-only EPYC)
        vector = bool(picked)
    listed.cache_clear()
    return vector and picked.check_build(cpu_vec_isa.VecISA._avx_code)


@cache
def _list_single_templates_unrendered() -> None:
    """Inductor renders a C++ GEMM template twice per matmul: when it lists the matmul's
    candidates (the source a benchmark would compile, thrown away otherwise) and when it
    writes the kernel the graph runs. Where the C++ template is the only GEMM backend
    (cpp-gemm, MODE_OPTIONS) it is each matmul's only candidate, taken without a benchmark,
    so the first render is waste: ~6 s of a ~55 s compile of the 30-layer target per width
    (Intel Xeon with AMX, measured). There the candidate is listed unrendered; every other
    setting keeps inductor's `generate`."""
    import torch._inductor.compile_fx  # noqa: F401  (inductor's modules in its own import order)
    from torch._inductor import config
    from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate
    from torch._inductor.codegen.cpp_template import CppTemplate
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller, CppTemplateKernel
    from torch._inductor.utils import Placeholder

    listed_rendered = CppTemplate.generate

    def generate(self, **kwargs):
        if config.max_autotune_gemm_backends != "CPP" or not isinstance(self, CppGemmTemplate):
            return listed_rendered(self, **kwargs)

        def make_kernel_render(template_node, flag_template_buffer_has_other_users,
                               epilogue_nodes=None):  # fmt: skip
            kernel = CppTemplateKernel(str(Placeholder.KERNEL_NAME), self.num_threads)
            render = partial(
                kernel.render, self, template_buffer_node=template_node, epilogue_nodes=epilogue_nodes,
                flag_template_buffer_has_other_users=flag_template_buffer_has_other_users, **kwargs,
            )  # fmt: skip
            return kernel, render

        output = self.output_node[0] if isinstance(self.output_node, list) else self.output_node
        # bmreq None: a benchmark (never run for a single candidate) would fail loudly
        return CppTemplateCaller(f"cpp_{self.name}_{self.index}", self.name, self.input_nodes,
                                 output.get_layout(), make_kernel_render, None, self)  # fmt: skip

    CppTemplate.generate = generate


class Compiled:
    """`fn` under torch.compile: fixed shapes (one graph per input shape), full graphs (a
    graph break raises). `freeze`: the weights `fn` reads become constants of the graph
    (inductor freezing; only for weights that never change, the target's). `name` labels its
    graphs' compile seconds in STATS.by_graph (default: fn's qualified name)."""

    def __init__(self, fn: Callable, mode: str, freeze: bool = False, name: str | None = None):
        if mode not in MODES or mode == "auto":
            raise ValueError(f"compile mode {mode!r}; resolve it first (resolve_mode)")
        # Drafters compile one step per module and width (MTP: one module per depth); the
        # default limit of 8 graphs per code object would silently fall back to eager.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
        counts_recordings()
        self.freeze = freeze and mode != "aot_eager"
        self.name = name or getattr(fn, "__qualname__", "graph")
        self.cudagraphs = mode in ("reduce-overhead", "max-autotune")
        # dynamo keeps a function's graphs on its code object, which every instance of a
        # method shares: a copy of the code keeps this one's apart, for `release`
        fn, self.code = with_own_code(fn)
        self.modules: list[ModuleType] = []  # what inductor loaded for these graphs
        self.fn = torch.compile(
            fn, backend=_backend(mode, self.freeze), fullgraph=True, dynamic=False
        )

    def __call__(self, *args):
        args = tuple(dense(a) if isinstance(a, Tensor) else a for a in args)
        before, t0 = (STATS.graphs, STATS.cudagraphs), time.perf_counter()
        if self.cudagraphs:  # a new replay: outputs of the previous one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if self.freeze:  # dynamo reads the flag when it traces: weights become constants
            with torch._inductor.config.patch(freezing=True):
                out = self.fn(*args)
        else:
            out = self.fn(*args)
        if self.cudagraphs:  # CUDA-graph outputs live in memory the next replay reuses
            out = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, out)
        if (STATS.graphs, STATS.cudagraphs) != before:
            took = time.perf_counter() - t0
            STATS.seconds += took
            label = graph_label(self.name, args)
            STATS.by_graph[label] = STATS.by_graph.get(label, 0.0) + took
            self.modules += UNCLAIMED  # what inductor loaded for the graphs this call compiled
            UNCLAIMED.clear()
        return out

    def release(self) -> None:
        """Drop this function's graphs and the modules inductor loaded for them, which it
        keeps for the life of the process (`PyCodeCache`, `sys.modules`): with freezing each
        module holds its graph's constants, the frozen weights (two 2-layer proxies of the
        SmolLM2 target kept 514 MiB, docs/memory.md). A call after it compiles anew."""
        from torch._dynamo.eval_frame import reset_code
        from torch._inductor.codecache import PyCodeCache

        if self.code is not None:
            reset_code(self.code)
        dropped = {id(mod) for mod in self.modules}
        PyCodeCache.modules[:] = [m for m in PyCodeCache.modules if id(m) not in dropped]
        for mod in self.modules:
            PyCodeCache.modules_no_attr.pop(getattr(mod, "__file__", None), None)
            if sys.modules.get(mod.__name__) is mod:
                del sys.modules[mod.__name__]
        self.modules = []

    @property
    def warm_calls(self) -> int:
        """Calls per shape that leave nothing to compile or record: 2 with CUDA graphs."""
        return 2 if self.cudagraphs else 1


def graph_label(name: str, args: tuple) -> str:
    """`name`, the first tensor's shape and, unless `name` says it, the first floating
    tensor's dtype: "EagleDrafter._layer [1, 4, 576] bfloat16" (one drafter compiled in two
    dtypes, as the compiled draft verdict does, keeps two labels)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    label = f"{name} {list(tensors[0].shape) if tensors else []}"
    dtype = next(
        (str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()), ""
    )
    return label if dtype in name else f"{label} {dtype}"


def with_own_code(fn: Callable) -> tuple[Callable, CodeType | None]:
    """`fn` (a function or a bound method) as a function of the same behaviour over a copy
    of its code object, and that copy; any other callable as it is, and None."""
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, FunctionType):
        return fn, None
    code = func.__code__.replace()  # equal, not the same object
    own = FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
    bound = getattr(fn, "__self__", None)
    return (own if bound is None else MethodType(own, bound)), code


def dense(x: Tensor) -> Tensor:
    """x with the strides of a fresh contiguous tensor. Dynamo guards input strides, and a
    slice of a growing sequence ([B, 1] taken from [B, T]: strides (T, 1)) would compile a
    new graph for every T; `.contiguous()` keeps such a slice as it is (a size-1 dim's
    stride does not count for contiguity), so copy it."""
    expected, stride = [], 1
    for size in reversed(x.shape):
        expected.append(stride)
        stride *= size
    if x.stride() == tuple(reversed(expected)):
        return x
    return x.clone(memory_format=torch.contiguous_format)
