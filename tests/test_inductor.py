"""decoding/inductor.py's cuts of a cold CPU compile under cpp-gemm (docs/fastpath.md, "Two cuts
of a cold compile"): one render of the C++ GEMM template per matmul, one vector-ISA probe."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.compile_fx  # noqa: F401  (inductor's modules in its own import order)

from decoding.inductor import Compiled


def test_cpp_gemm_renders_each_matmul_once(monkeypatch):
    """cpp-gemm lists each matmul's single C++ template candidate without rendering it
    (decoding.inductor._list_single_templates_unrendered): one render per matmul, the kernel
    the graph runs, where inductor renders two; the compiled output is still the eager one."""
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateKernel

    renders = []
    render = CppTemplateKernel.render
    monkeypatch.setattr(
        CppTemplateKernel, "render", lambda *a, **k: renders.append(1) or render(*a, **k)
    )
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(40, 72), torch.nn.ReLU(), torch.nn.Linear(72, 24))
    mlp = mlp.eval()
    compiled = Compiled(lambda x: mlp(x), "cpp-gemm", freeze=True)
    x = torch.randn(1, 40)
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        out = compiled(x)
        assert torch.allclose(out, mlp(x), atol=1e-5)
    assert len(renders) == 2  # two matmuls


def test_only_the_picked_vector_isa_is_probed(monkeypatch):
    """Inductor builds a probe for every vector ISA the CPU lists; decoding.inductor checks
    only the one it will use and then tells inductor the rest need no build
    (`cpp.vec_isa_ok`), unless the user set TORCHINDUCTOR_VEC_ISA_OK themselves."""
    from torch._inductor import config, cpu_vec_isa

    import decoding.inductor as inductor

    probed = []
    check_build = cpu_vec_isa.VecISA.check_build

    def probe(self, code):  # the ISA probes; smaller checks of single instructions pass
        if code == cpu_vec_isa.VecISA._avx_code:
            probed.append(str(self))
        return check_build(self, code)

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", probe)
    with config.patch({"cpp.vec_isa_ok": True}):  # what inductor will use, unprobed
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        used = cpu_vec_isa.pick_vec_isa()
        listed = bool(used)  # unpatched, an ISA's truth is its probe
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    if not listed:
        pytest.skip("no vector ISA listed on this CPU")
    picks = inductor._picked_vec_isa_builds.__wrapped__
    assert picks() is True
    assert probed == [str(used)]
    with config.patch({"cpp.vec_isa_ok": False}):  # the user's setting stands, unprobed
        assert picks() is False
    assert probed == [str(used)]


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(48, 48)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def test_a_released_graph_gives_its_frozen_weights_back():
    """`Compiled.release` drops its graphs and the modules inductor loaded for them (a frozen
    graph's module holds its constants: the packed weights), which inductor keeps for the
    life of the process; the graphs of another instance of the same method stay compiled,
    and a call after the release compiles anew, right."""
    import gc
    import sys
    import weakref

    from decoding.inductor import STATS

    torch.manual_seed(0)
    first, second = Layer().eval(), Layer().eval()
    released, kept = (Compiled(m.step, "default", freeze=True) for m in (first, second))
    x = torch.randn(2, 48)
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        released(x), kept(x)
        assert released.modules and kept.modules
        module = weakref.ref(released.modules[0])
        name = released.modules[0].__name__
        released.release()
        graphs = STATS.graphs
        assert torch.allclose(kept(x), second.step(x), atol=1e-5)
        assert STATS.graphs == graphs  # still compiled
        # inductor holds the newest compile's tracing state until the next compile
        Compiled(lambda t: t * 2, "default")(x)
        gc.collect()
        assert module() is None and name not in sys.modules
        assert torch.allclose(released(x), first.step(x), atol=1e-5)
        assert STATS.graphs == graphs + 2  # the lambda's, and the released one's anew
