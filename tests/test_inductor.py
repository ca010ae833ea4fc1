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
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    if not used:
        pytest.skip("no vector ISA listed on this CPU")
    picks = inductor._picked_vec_isa_builds.__wrapped__
    assert picks() is True
    assert probed == [str(used)]
    with config.patch({"cpp.vec_isa_ok": False}):  # the user's setting stands, unprobed
        assert picks() is False
    assert probed == [str(used)]
