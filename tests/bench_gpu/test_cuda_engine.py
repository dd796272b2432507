"""On the GPU (marked cuda, skipped elsewhere): the random-weight engine's MIS and SIS scores agree with each other
and with the fp32 CPU engine on the same weights within 2x torch's own bf16 error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.models import build_random_model, id_questions, labels_for
from pyscore.engine import Engine
from pyscore.model.loading import LoadedModel
from pyscore.model.rope import Rotary, inverse_frequencies

pytestmark = pytest.mark.cuda


def moved(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The same weights on another device / dtype."""

    def cast(x):
        if isinstance(x, torch.Tensor):
            return x.to(device=device, dtype=dtype)
        if isinstance(x, list):
            return [cast(v) for v in x]
        if dataclasses.is_dataclass(x):
            return dataclasses.replace(x, **{f.name: cast(getattr(x, f.name)) for f in dataclasses.fields(x)})
        return x

    inv_freq, scaling = inverse_frequencies(loaded.hf_config, loaded.cfg.head_dim)
    return dataclasses.replace(loaded, weights=cast(loaded.weights),
                               rotary=Rotary(inv_freq, scaling, loaded.cfg.max_position_embeddings, device))


@pytest.fixture(scope="module")
def engines():
    cpu = build_random_model("tiny", torch.float32, torch.device("cpu"))
    cuda = torch.device("cuda")
    return dict(ref=Engine(cpu), kernel=Engine(moved(cpu, cuda, torch.bfloat16)),
                torch_bf16=Engine(moved(cpu, cuda, torch.bfloat16), op_backend="reference"))


def scores(engine: Engine, q, mode: str) -> torch.Tensor:
    labels = labels_for(engine.cfg.vocab_size)
    result = engine.score(q.query, q.items, label_token_ids=labels, mode=mode, apply_softmax=True)
    return torch.tensor([item[0] for item in result.scores])


def test_mis_equals_sis_on_gpu_within_twice_torch_bf16_error(engines):
    for q in id_questions(9, 3, engines["ref"].cfg.vocab_size, tiny=True):
        ref = scores(engines["ref"], q, "sis")
        torch_err = (scores(engines["torch_bf16"], q, "sis") - ref).abs().max()
        tol = 2 * float(torch_err) + 1e-4
        mis, sis = scores(engines["kernel"], q, "mis"), scores(engines["kernel"], q, "sis")
        errors = dict(mis=float((mis - ref).abs().max()), sis=float((sis - ref).abs().max()),
                      mis_vs_sis=float((mis - sis).abs().max()))
        assert max(errors.values()) <= tol, f"{errors} > tol {tol} (torch bf16 error {float(torch_err):.2e})"
