"""A decode step run as a program of bound kernel calls (pyscore.model.decode_program) is the general path's step
bit for bit: every family (Qwen3 with qk-norm, Qwen2 with qkv biases, Llama with llama3 RoPE, Qwen3.5's linear and
gated attention layers), fp32 and bf16, in the dtype and in int8 (quantize="int8": linear_int8's kernel), at every
CPU tier this machine runs, sequences of several lengths stepped together across a page boundary; the program is made
once per batch size, kept within its bound, and set aside where an op leaves our kernel."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pyscore.engine import Engine
from pyscore.model import decoder
from pyscore.model.decode_program import DecodeProgram
from pyscore.ops import _ext
from pyscore.types import GenerateRequest
from tests.helpers import make_model_dir

STEPS = 8


# Qwen3.5 at value heads of 16 and of 32: at 32 a decode step's rule runs on each state's columns where they lie
# (the in-place path real models take), at 16 through a copied block.
FAMILIES = {"qwen3": {}, "qwen2": {}, "llama": {}, "qwen3_5": {}, "qwen3_5_dv32": dict(linear_value_head_dim=32)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request, tmp_path_factory):
    arch = request.param.partition("_dv")[0]
    return make_model_dir(tmp_path_factory.mktemp(request.param), arch, **FAMILIES[request.param])


def generate(e: Engine) -> list[torch.Tensor]:
    """Three sequences stepped together for STEPS tokens (the 60-token one writes past its 64th token: a new page
    whatever the device's page size); every decode step's hidden states, in order."""
    hidden = []
    decode = e.decoder.decode

    def recording(tokens, caches):
        out = decode(tokens, caches)
        hidden.append(out.clone())
        return out

    e.decoder.decode = recording
    requests = [GenerateRequest(prompt_token_ids=[5 + (11 * j + i) % 300 for j in range(n)], max_tokens=STEPS)
                for i, n in enumerate((3, 60, 17))]
    gens = [e.start_generation(r) for r in requests]
    while not all(g.finished for g in gens):
        e.step(gens)
    assert all(g.error is None for g in gens)
    del e.decoder.decode
    return hidden


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tier", _ext.runnable_cpu_tiers() if _ext.cpu_module() else [])
def test_program_steps_are_the_general_paths_bit_for_bit(model_dir, dtype, tier, quantize, monkeypatch):
    monkeypatch.setenv("PYSCORE_CPU_TIER", tier)
    e = Engine.from_pretrained(model_dir, dtype=dtype, device="cpu", threads=2, quantize=quantize)
    e.generation.eos_ids = frozenset()
    if DecodeProgram.of(e.decoder) is None:
        assert tier == "generic" or any(_ext.resolve_path(op, e.decoder.device, e.decoder.dtype)[1] != "kernel"
                                        for op in DecodeProgram.ops(e.decoder)), f"tier {tier}: the program should run"
        pytest.skip(f"tier {tier}, {dtype}: an op of the step is not our kernel, the general path runs")
    runs = []
    run = DecodeProgram.run
    monkeypatch.setattr(DecodeProgram, "run", lambda self, *a: runs.append(self) or run(self, *a))
    programmed = generate(e)
    assert len(runs) == len(programmed) == STEPS - 1  # the first token comes from the prefill
    monkeypatch.setattr(DecodeProgram, "of", staticmethod(lambda d: None))
    general = generate(e)
    assert len(runs) == STEPS - 1
    assert len(general) == len(programmed)
    for step, (a, b) in enumerate(zip(programmed, general, strict=True)):
        assert torch.equal(a, b), f"step {step}: max diff {(a.float() - b.float()).abs().max().item()}"


def test_programs_are_made_once_per_batch_size_and_bounded(model_dir, monkeypatch):
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2)
    if DecodeProgram.of(e.decoder) is None:
        pytest.skip("the step does not run as a program on this CPU")
    e.generation.eos_ids = frozenset()
    made = []
    init = DecodeProgram.__init__
    monkeypatch.setattr(DecodeProgram, "__init__", lambda self, *a: made.append(a[-1]) or init(self, *a))
    for batch in (1, 2, 1, 3, 4, 5, 2):
        gens = [e.start_generation(GenerateRequest(prompt_token_ids=[5, 6, 7 + i], max_tokens=3))
                for i in range(batch)]
        while not all(g.finished for g in gens):
            e.step(gens)
    # two decode steps each; at most 4 kept, the least recently used dropped: 5 pushes out 2 (1 ran after it), so
    # 2 is made again and pushes out 1
    assert made == [1, 2, 3, 4, 5, 2]
    assert list(e.decoder.programs) == [3, 4, 5, 2] and decoder.PROGRAMS_KEPT == 4


def test_an_op_off_our_kernel_sets_the_program_aside(model_dir, monkeypatch):
    """With the step's GEMM on torch's path (as at a tier whose table says so), the general path runs it."""
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2)
    if DecodeProgram.of(e.decoder) is None:
        pytest.skip("the step does not run as a program on this CPU")
    resolve = _ext.resolve_path

    def linear_on_torch(op, *args, **kwargs):
        module, path, why = resolve(op, *args, **kwargs)
        return (None, "torch", "test") if op == "linear" else (module, path, why)

    monkeypatch.setattr(_ext, "resolve_path", linear_on_torch)
    assert DecodeProgram.of(e.decoder) is None


def test_a_dropped_program_is_freed_at_once(model_dir):
    """No reference cycle through a program (its calls reach the step's plan through a holder, the decoder's parts
    directly): one pushed out of the bound, or the engine's, frees its buffers at once, not at a full collection."""
    e = Engine.from_pretrained(model_dir, dtype="float32", device="cpu", threads=2)
    if DecodeProgram.of(e.decoder) is None:
        pytest.skip("the step does not run as a program on this CPU")
    gens = [e.start_generation(GenerateRequest(prompt_token_ids=[5, 6, 7 + i], max_tokens=3)) for i in range(2)]
    while not all(g.finished for g in gens):
        e.step(gens)
    program = weakref.ref(e.decoder.programs[2])
    gc.disable()
    try:
        e.decoder.programs.clear()
        assert program() is None
    finally:
        gc.enable()
