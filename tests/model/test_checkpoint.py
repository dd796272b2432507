"""pyscore.model.checkpoint: tensors read one at a time, each a copy of its own with the shard's mapping gone
before the next (the loader's peak stays near the weights' final size); safetensors written tensor by tensor,
readable by safetensors itself, never visible half-written; the GGUF conversion streams and keeps the values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pyscore.model.checkpoint import Checkpoint, TensorSpec, write_safetensors


def mapped(path: Path) -> bool:
    """Whether this process maps the file now."""
    return any(line.rstrip().endswith(str(path)) for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.fixture
def shards(tmp_path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {"a.weight": torch.randn(16, 8).bfloat16(), "b.weight": torch.randn(8), "c.bias": torch.randn(3, 2, 4)}
    save_file({k: state[k] for k in ("a.weight",)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in ("b.weight", "c.bias")}, str(tmp_path / "model-00002-of-00002.safetensors"))
    return state


def test_reads_every_shard_by_name_and_keeps_no_mapping(tmp_path: Path, shards: dict[str, torch.Tensor]) -> None:
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.shapes() == {k: TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in shards.items()}
    got = {name: checkpoint.get(name) for name in shards}
    for name, t in shards.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert checkpoint.get("absent.weight") is None
    # each tensor owns its memory: no shard stays mapped behind the tensors handed out
    assert not any(mapped(s) for s in tmp_path.glob("*.safetensors"))
    got["a.weight"].add_(1)  # and writing to it is fine (a private copy, not the file's pages)
    assert torch.equal(Checkpoint(tmp_path).get("a.weight"), shards["a.weight"])


def test_a_pytorch_bin_checkpoint_reads_the_same_way(tmp_path: Path) -> None:
    state = {"x.weight": torch.randn(4, 4), "y.weight": torch.randn(2).half()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.shapes()["y.weight"] == TensorSpec("y.weight", torch.float16, (2,))
    assert all(torch.equal(checkpoint.get(k), v) for k, v in state.items())


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        Checkpoint(tmp_path)


def test_write_asks_for_one_tensor_at_a_time_and_safetensors_reads_it(tmp_path: Path) -> None:
    specs = [TensorSpec("w", torch.bfloat16, (5, 3)), TensorSpec("n", torch.float32, (7,)),
             TensorSpec("s", torch.float32, ())]
    values = {"w": torch.randn(5, 3).bfloat16(), "n": torch.randn(7), "s": torch.tensor(2.5)}
    asked: list[str] = []

    def tensor_of(spec: TensorSpec) -> torch.Tensor:
        asked.append(spec.name)
        assert not (tmp_path / "m.safetensors").exists()  # only the .partial file while writing
        return values[spec.name]

    write_safetensors(tmp_path / "m.safetensors", specs, tensor_of, metadata={"format": "pt"})
    assert asked == ["w", "n", "s"]
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in values.items():
            assert torch.equal(f.get_tensor(name), t), name


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"w: expected torch\.bfloat16 \[2\]"):
        write_safetensors(tmp_path / "m.safetensors", [TensorSpec("w", torch.bfloat16, (2,))],
                          lambda spec: torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_gguf_conversion_streams_and_matches_transformers(tmp_path: Path, smollm2_dir: Path, monkeypatch) -> None:
    """The embedded GGUF converted tensor by tensor equals the cached conversion, bit for bit, and the writer
    never holds more than one tensor (each asked for once, in order)."""
    import pyscore.model.gguf as gguf
    from pyscore.model.loading import embedded_gguf

    written: list[str] = []
    original = gguf.write_safetensors

    def spy(path, specs, tensor_of, metadata=None):
        def one(spec):
            written.append(spec.name)
            return tensor_of(spec)

        original(path, specs, one, metadata)

    monkeypatch.setattr(gguf, "write_safetensors", spy)
    gguf.convert_gguf(embedded_gguf(), tmp_path / "smol")
    assert len(written) == len(set(written)) == 272
    with safe_open(str(tmp_path / "smol" / "model.safetensors"), "pt") as new, \
            safe_open(str(smollm2_dir / "model.safetensors"), "pt") as old:
        assert set(new.keys()) == set(old.keys())
        for name in old.keys():  # noqa: SIM118 (safe_open has no __iter__)
            a, b = old.get_tensor(name), new.get_tensor(name)
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (tmp_path / "smol").iterdir()}


def rss_file() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssFile")


def test_copying_out_drops_the_source_pages_slab_by_slab(tmp_path: Path) -> None:
    """A tensor copied out of its mapping does not stay resident twice, even while the mapping lives (a 1.2 GB
    embedding would otherwise peak at twice its size)."""
    from pyscore.model.checkpoint import copy_out

    values = torch.randn(1024, 16 * 1024)  # 64 MiB
    save_file({"e": values}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        view = f.get_tensor("e")
        view.sum()  # every page of the mapping read: resident
        touched = rss_file()
        copy = copy_out(view)
        assert touched - rss_file() > 48 * 2**20
        assert torch.equal(copy, values) and torch.equal(view, values)  # the mapping reads back unchanged
