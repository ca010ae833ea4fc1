"""Medusa-2 over a large target without hidden copies (models/medusa.py): its backbone is new
modules over the target's own weight tensors, its LoRA matrices and their AdamW state are
float32 over a bf16 base, and an evaluation (the decode copy of the draft, the adapted
decoding target, a decode) does not grow the process by the backbone: checked by the peak
RSS of a subprocess around it, on a ~80M-parameter random Llama."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from models import medusa
from models.dtypes import draft_decode_copy
from models.target import decode_copy
from models.target_loaders import build_tiny_random
from tests.helpers import ROOT

MEASURE = textwrap.dedent(
    """
    import json, resource, torch
    from models import medusa
    from models.target_loaders import build_tiny_random
    from models.dtypes import draft_decode_copy
    from decoding.drafters import make_drafter
    from decoding.spec import generate

    torch.manual_seed(0)
    target = build_tiny_random(seed=0, vocab_size=32000, hidden_size=768, num_layers=8,
                               num_heads=12, num_kv_heads=4, intermediate_size=2048)
    ids = torch.randint(0, 32000, (1, 24))
    target(ids, hidden_layers=(-1,))  # its first forward's buffers before the baseline
    backbone = sum(p.numel() * p.element_size() for p in target.model.model.parameters())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    heads = medusa.from_target(target, medusa2=True, lora_rank=8, num_heads=2)
    with torch.no_grad():
        copy_ = draft_decode_copy(heads, torch.float32)
        decode_target = copy_.decoding_target(target)
        generate(decode_target, ids, make_drafter(copy_, decode_target), k=2, max_new_tokens=8)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"backbone": backbone, "growth": after - before}))
    """
)


def test_medusa2_evaluation_does_not_grow_by_the_backbone(tmp_path):
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    # a copy of the backbone would add 1x (each of the old draft copy and merged target: 2x+)
    assert got["growth"] < 0.2 * got["backbone"], got


def test_medusa2_lora_and_its_optimizer_state_are_float32_over_a_bf16_base():
    target = decode_copy(build_tiny_random(seed=0), torch.bfloat16)
    heads = medusa.from_target(target, medusa2=True, lora_rank=4, num_heads=2)
    lora = {n: p for n, p in heads.named_parameters() if "lora_" in n}
    assert lora and {p.dtype for p in lora.values()} == {torch.float32}
    assert all(p.requires_grad for p in lora.values())
    base = heads.adapted.layers[0].self_attn.q_proj.base_layer.weight
    own = target.model.model.layers[0].self_attn.q_proj.weight
    assert base is own and base.dtype == torch.bfloat16  # the target's tensor, not a copy
    ids = torch.randint(0, target.vocab_size, (2, 12))
    out = heads(target, ids, target(ids, hidden_layers=(-1,)))
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    (sum(x.float().logsumexp(-1).mean() for x in out.logits) + out.adapted_logits.float().mean()).backward()  # fmt: skip
    optimizer.step()
    states = [optimizer.state[p] for p in lora.values()]
    assert all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert any(
        float(p.detach().abs().sum()) > 0 for n, p in lora.items() if "lora_B" in n
    )  # it moved
    # The eval copy refers to the same LoRA and adapts the decoding target alike
    copy_ = draft_decode_copy(heads, torch.bfloat16)
    assert copy_.adapted is heads.adapted and "adapted.layers.0" not in dict(copy_.named_modules())
    adapted = copy_.decoding_target(target)
    assert adapted.model.model.layers[0].self_attn.q_proj.base_layer.weight is own
    with torch.no_grad():
        want = heads.adapted(input_ids=ids, use_cache=False).last_hidden_state
        got = adapted(ids, hidden_layers=(-1,)).hidden[-1]
    torch.testing.assert_close(got, want.to(got.dtype), atol=0, rtol=0)
