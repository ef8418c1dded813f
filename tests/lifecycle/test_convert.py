"""The converter: HF -> dist_ckpt at TP2 -> HF gives back the same bytes, and bad input fails early."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.convert import ConvertJob, check
from lifecycle.errors import ConfigError
from tests.backends.megatron_util import hf_tensors, make_hf_checkpoint, same_tensors

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.transformers


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lifecycle", "convert", *args], capture_output=True, text=True,
                          timeout=240)


def test_hf_to_dist_ckpt_at_tp2_and_back_at_pp2_gives_byte_identical_float32_tensors(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf")
    there = _cli(str(hf), str(tmp_path / "dist"), "--to", "dist_ckpt", "--tp", "2")
    assert there.returncode == 0, there.stderr
    assert "at TP2 PP1" in there.stderr and "written:" in there.stderr
    assert (tmp_path / "dist" / "metadata.json").is_file() and (tmp_path / "dist" / "config.json").is_file()
    back = _cli(str(tmp_path / "dist"), str(tmp_path / "back"), "--to", "hf", "--pp", "2")
    assert back.returncode == 0, back.stderr
    original, returned = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert same_tensors(original, returned) == []
    assert {str(t.dtype) for t in returned.values()} == {"torch.float32"}
    assert not list(tmp_path.glob(".*partial*"))


def test_a_dist_checkpoint_without_config_needs_hf_config_and_says_so(tmp_path: Path) -> None:
    src = tmp_path / "dist"
    src.mkdir()
    (src / "metadata.json").write_text("{}")
    with pytest.raises(ConfigError, match="--hf-config"):
        check(ConvertJob(src=src, dst=tmp_path / "out", to="hf"))
    hf = make_hf_checkpoint(tmp_path / "hf")
    (src / "__0_0.distcp").write_bytes((hf / "model.safetensors").read_bytes())  # a shard's worth of bytes
    assert check(ConvertJob(src=src, dst=tmp_path / "out", to="hf", hf_config=hf)) == ("dist_ckpt", hf)


def test_converter_refuses_more_ranks_than_the_machine_can_hold_before_reading_anything(tmp_path: Path) -> None:
    from lifecycle.convert import max_ranks

    with pytest.raises(ConfigError, match="would start 10000000000 local processes") as info:
        check(ConvertJob(src=tmp_path / "absent", dst=tmp_path / "out", to="hf", tp=100_000, pp=100_000))
    assert info.value.key == "--tp/--pp" and max_ranks() >= 64 and not (tmp_path / "out").exists()


def test_converter_refuses_a_non_empty_destination_and_a_same_format_target(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty folder"):
        check(ConvertJob(src=hf, dst=tmp_path / "full", to="dist_ckpt"))
    with pytest.raises(ConfigError, match="already hf"):
        check(ConvertJob(src=hf, dst=tmp_path / "out", to="hf"))
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(("config", "says"), [
    ("{not json", "not valid JSON"),
    ("[]", "must be a JSON object, found list"),
    ('{"vocab_size": "many", "hidden_size": 64}', "must be positive integers"),
    ('{"vocab_size": 50000000, "hidden_size": 64}', "has at least 3200000000 parameters"),
], ids=["not-json", "a-list", "a-string-size", "another-models-size"])
def test_a_config_json_no_rank_could_build_from_is_refused_before_any_starts(
    tmp_path: Path, config: str, says: str,
) -> None:
    """Before: raw OSError or ValueError tracebacks from every rank, or each rank allocating a
    13 GB embedding before a single weight was compared."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    (hf / "config.json").write_text(config)
    with pytest.raises(ConfigError, match=says) as info:
        check(ConvertJob(src=hf, dst=tmp_path / "out", to="dist_ckpt"))
    assert info.value.key == "--hf-config" and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value"), [("intermediate_size", 400_000), ("num_hidden_layers", 100_000)])
def test_a_config_whose_layers_outweigh_the_source_on_disk_is_refused_even_beside_a_sparse_file(
    tmp_path: Path, key: str, value: int,
) -> None:
    """Before: only vocab_size x hidden_size was bounded, by the files' lengths, so a 400000-wide
    MLP (each rank grew to GBs) passed, and a 1 TB sparse file made any config pass."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, key: value}))
    with open(hf / "padding.bin", "wb") as fh:
        fh.truncate(10**12)
    with pytest.raises(ConfigError, match="more than the [0-9]+ bytes .* holds on disk") as info:
        check(ConvertJob(src=hf, dst=tmp_path / "out", to="dist_ckpt"))
    assert info.value.key == "--hf-config"


def test_a_fifo_in_the_source_is_refused_before_any_rank_would_block_on_it(tmp_path: Path) -> None:
    """Before: a FIFO common.pt, or a FIFO config.json beside --hf-config, blocked every rank forever."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "metadata.json").write_text("{}")
    os.mkfifo(dist / "common.pt")
    shutil.copytree(hf, tmp_path / "fifo_config")
    (tmp_path / "fifo_config" / "config.json").unlink()
    os.mkfifo(tmp_path / "fifo_config" / "config.json")
    for src, to, name in ((dist, "hf", "common.pt"), (tmp_path / "fifo_config", "dist_ckpt", "config.json")):
        with pytest.raises(ConfigError, match=f"{name}: a FIFO, not a regular file") as info:
            check(ConvertJob(src=src, dst=tmp_path / "out", to=to, hf_config=hf))
        assert info.value.key == "SRC"


def test_a_destination_that_is_a_symlink_is_refused_before_anything_is_converted(tmp_path: Path) -> None:
    """Before: every rank converted, then the final rename failed with ENOTDIR."""
    hf = make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(ConfigError, match="a symlink") as info:
        check(ConvertJob(src=hf, dst=tmp_path / "link", to="dist_ckpt"))
    assert info.value.key == "DST"


def test_a_corrupt_source_fails_every_rank_with_the_file_named_and_no_destination(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf")
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    size = (broken / "model.safetensors").stat().st_size  # as many bytes: the check of the config's sizes passes
    (broken / "model.safetensors").write_bytes(b"not safetensors".ljust(size, b"\0"))
    result = _cli(str(broken), str(tmp_path / "out"), "--to", "dist_ckpt", "--tp", "2")
    assert result.returncode == 2 and "error: convert" in result.stderr
    assert f"error: rank 0: {broken / 'model.safetensors'}" in result.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*partial*"))


def test_a_rank_that_fails_alone_ends_its_waiting_peers() -> None:
    import multiprocessing as mp
    import time

    from lifecycle.convert import _wait

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=sys.exit, args=(3,)), ctx.Process(target=time.sleep, args=(120,))]
    for p in procs:
        p.start()
    started = time.monotonic()
    _wait(procs)
    assert time.monotonic() - started < 30
    assert procs[0].exitcode == 3 and procs[1].exitcode is not None and procs[1].exitcode < 0
