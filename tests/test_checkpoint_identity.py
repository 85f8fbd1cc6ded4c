"""The checkpoint's identity covers its weights, and reads none of their bytes (issue 40, 2).

Real checkpoints written by the toolkit (``checkpoint write``): two of the same geometry and
different seeds, the same files rewritten in place, a copy; the identity reads ``config.json``,
the index and each weight file's stat. A shard on a FUSE mount whose reads never answer shows
that no weight byte is read.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from sglang_integration.daemon.checkpoint_identity import checkpoint_digest, structure_digest
from sglang_integration.testing.checkpoint import CheckpointSpec, write_checkpoint
from sglang_integration.testing.stalled_mount import fuse_available, stalled_file

SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("identity")
    return {
        seed: write_checkpoint(root / f"seed{seed}", CheckpointSpec("qwen3_moe", "bf16", seed=seed))
        for seed in (7, 8)
    }


def test_the_identity_changes_with_the_dtype_quantization_and_revision(
    seeds: dict[int, Path],
) -> None:
    loads = [
        {},
        {"dtype": "torch.bfloat16"},
        {"dtype": "torch.float16"},
        {"dtype": "torch.bfloat16", "quantization": "fp8"},
        {"dtype": "torch.bfloat16", "revision": "v2"},
    ]
    identities = [checkpoint_digest(seeds[7], **load) for load in loads]
    assert len(set(identities)) == len(loads)
    assert [checkpoint_digest(seeds[7], **load) for load in loads] == identities  # stable


def test_two_checkpoints_with_different_weight_bytes_never_share_an_identity(
    seeds: dict[int, Path], tmp_path: Path
) -> None:
    # seed 7 and 8: the same config and index, every weight differs
    for name in ("config.json", "model.safetensors.index.json"):
        assert (seeds[7] / name).read_bytes() == (seeds[8] / name).read_bytes()
    assert structure_digest(seeds[7]) == structure_digest(seeds[8])
    assert checkpoint_digest(seeds[7]) != checkpoint_digest(seeds[8])
    # in place: seed 8's bytes written into seed 7's files (same sizes), then the files' times
    # set back to what they were: the kernel's change time still moves
    local = tmp_path / "deployed"
    shutil.copytree(seeds[7], local)
    before = checkpoint_digest(local)
    shard = local / SHARD
    stat = shard.stat()
    time.sleep(0.01)
    with shard.open("r+b") as handle:
        handle.write((seeds[8] / SHARD).read_bytes())
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shard.stat().st_size == stat.st_size
    assert checkpoint_digest(local) != before
    # and by a rename over it (a new file, as a deploy writes it)
    again = checkpoint_digest(local)
    (local / "new.tmp").write_bytes((seeds[7] / SHARD).read_bytes())
    (local / "new.tmp").replace(shard)
    assert checkpoint_digest(local) not in (before, again)


def test_the_same_files_keep_their_identity(seeds: dict[int, Path]) -> None:
    assert checkpoint_digest(seeds[8]) == checkpoint_digest(seeds[8])
    assert checkpoint_digest(seeds[8], dtype="x") == checkpoint_digest(seeds[8], dtype="x")


def test_a_fifo_in_place_of_the_config_is_named_not_waited_on(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    os.mkfifo(directory / "config.json")
    started = time.monotonic()
    checkpoint_digest(directory)
    structure_digest(directory)
    assert time.monotonic() - started < 1.0


@pytest.mark.skipif(fuse_available() is not None, reason=f"no FUSE mount: {fuse_available()}")
def test_the_identity_reads_no_weight_byte(seeds: dict[int, Path], tmp_path: Path) -> None:
    """A shard whose every read blocks forever (a stalled mount): the identity is computed at
    once, so it never read a byte of it."""
    local = tmp_path / "checkpoint"
    shutil.copytree(seeds[7], local)
    with stalled_file(local / SHARD, "blocked"):
        started = time.monotonic()
        identity = checkpoint_digest(local)
        took = time.monotonic() - started
    assert took < 1.0
    assert identity != checkpoint_digest(seeds[7])  # the mount is another file
