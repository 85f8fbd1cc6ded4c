"""Checkpoint reads in a child process (issue 40, 1): the bytes are safetensors' own, a file that
is not a regular one is refused at once, a read that blocks ends at its deadline naming the file,
and cancelling ends every read at once.

Real checkpoints written by the toolkit (Qwen3-MoE BF16, DeepSeek-V3 FP8 blocks), read back by
the daemon's reader (``ChildReader``: a child interpreter per session) and compared with
safetensors' ``get_tensor``; the blocked and refused files are real FUSE mounts over a shard
(``testing.stalled_mount``).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sglang_integration.daemon.checkpoint_reads import ChildReader, ReadFailed, tensors_of
from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
from sglang_integration.testing.stalled_mount import fuse_available, stalled_file

SHARD = "model-00002-of-00002.safetensors"  # layer 1's experts
PREFIXES = ["model.layers.1.mlp.experts.0.", "model.layers.1.mlp.experts.3."]
NO_FUSE = fuse_available()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reads")
    return {
        model: write_checkpoint(root / model, CheckpointSpec(model, dtype, seed=7))
        for model, dtype in (("qwen3_moe", "bf16"), ("deepseek_v3", "fp8_block"))
    }


@pytest.fixture
def checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the Qwen3-MoE checkpoint this test may spoil."""
    return Path(shutil.copytree(checkpoints["qwen3_moe"], tmp_path / "checkpoint"))


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_the_child_reads_exactly_what_safetensors_reads(
    checkpoints: dict[str, Path], model: str
) -> None:
    directory = checkpoints[model]
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    session = ChildReader(30).session(str(directory))
    try:
        entries, mapped, read, files = session.read_layer(PREFIXES)
        tensors = dict(tensors_of(entries, mapped))
    finally:
        session.close()
    expected = sorted(name for name in weight_map if name.startswith(tuple(PREFIXES)))
    assert sorted(tensors) == expected and files == 1
    assert read == sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    for name, tensor in tensors.items():
        with safe_open(str(directory / weight_map[name]), framework="pt") as handle:
            reference = handle.get_tensor(name)
        assert (tensor.dtype, tensor.shape) == (reference.dtype, reference.shape)
        assert torch.equal(tensor.view(torch.uint8), reference.view(torch.uint8))
    del tensors
    mapped.close()


def test_a_fifo_in_place_of_a_shard_is_refused_at_once_naming_it(checkpoint: Path) -> None:
    shard = checkpoint / SHARD
    shard.unlink()
    os.mkfifo(shard)
    session = ChildReader(30).session(str(checkpoint))
    started = time.monotonic()
    try:
        with pytest.raises(ReadFailed) as failed:
            session.read_layer(PREFIXES)
    finally:
        session.close()
    assert time.monotonic() - started < 5
    assert (failed.value.path, failed.value.cause) == (
        str(shard),
        "it is a FIFO, not a regular file: refused without reading it, a read could block",
    )


def test_a_truncated_or_missing_shard_is_named_with_its_cause(checkpoint: Path) -> None:
    shard = checkpoint / SHARD
    original = shard.read_bytes()
    shard.write_bytes(original[: len(original) // 2])
    reader = ChildReader(30)
    session = reader.session(str(checkpoint))
    with pytest.raises(ReadFailed, match=r"a truncated file\?"):
        session.read_layer(["model.layers.1.mlp.experts.7."])
    session.close()
    shard.unlink()
    session = reader.session(str(checkpoint))
    with pytest.raises(ReadFailed) as failed:
        session.read_layer(PREFIXES)
    session.close()
    assert (failed.value.path, failed.value.cause) == (
        str(shard),
        "No such file or directory (ENOENT)",
    )


@pytest.mark.skipif(NO_FUSE is not None, reason=f"no FUSE mount here: {NO_FUSE}")
def test_a_shard_the_reader_may_not_open_is_named_permission_denied(checkpoint: Path) -> None:
    session = ChildReader(30).session(str(checkpoint))
    with stalled_file(checkpoint / SHARD, "denied"), pytest.raises(ReadFailed) as failed:
        session.read_layer(PREFIXES)
    session.close()
    assert failed.value.cause == "Permission denied (EACCES)"


@pytest.mark.skipif(NO_FUSE is not None, reason=f"no FUSE mount here: {NO_FUSE}")
def test_a_read_that_blocks_ends_at_its_deadline_naming_the_file(checkpoint: Path) -> None:
    shard = checkpoint / SHARD
    with stalled_file(shard, "blocked"):
        started = time.monotonic()
        session = ChildReader(2.0).session(str(checkpoint))
        with pytest.raises(ReadFailed) as failed:
            session.read_layer(PREFIXES)
        took = time.monotonic() - started
        session.close()
    assert 2.0 <= took < 3.5
    assert (failed.value.path, failed.value.cause) == (
        str(shard),
        "no answer within the deadline of 2 s (--expert-layout-heal-timeout), the reader was "
        "killed: is it on a mount that stopped answering?",
    )


@pytest.mark.skipif(NO_FUSE is not None, reason=f"no FUSE mount here: {NO_FUSE}")
def test_cancel_ends_a_blocked_read_at_once_and_refuses_new_ones(checkpoint: Path) -> None:
    reader = ChildReader(60.0)
    failures: list[ReadFailed] = []

    def read() -> None:
        session = reader.session(str(checkpoint))
        try:
            session.read_layer(PREFIXES)
        except ReadFailed as exc:
            failures.append(exc)
        finally:
            session.close()

    with stalled_file(checkpoint / SHARD, "blocked"):
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        time.sleep(1.0)
        started = time.monotonic()
        reader.cancel()
        thread.join(10)
        took = time.monotonic() - started
    assert took < 2.0 and not thread.is_alive()
    assert [failure.cause for failure in failures] == [
        "the daemon is stopping, its read was stopped"
    ]
    with pytest.raises(ReadFailed, match="the daemon is stopping; no checkpoint read starts now"):
        reader.session(str(checkpoint))
