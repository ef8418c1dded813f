"""Offline conversion between HF safetensors and Megatron dist checkpoints.

`python -m lifecycle convert SRC DST --to {hf,dist_ckpt} --tp N --pp M` starts N*M local
processes (gloo on CPU, NCCL on GPU), builds the Megatron model at that layout through mbridge,
loads SRC with the matching backend and writes DST with the other. DST appears only when every
rank has finished: the ranks write into a hidden folder beside it, renamed at the end.

Each rank leads a process group of its own (`lifecycle.procgroup`), which whatever it starts
joins (dist_checkpointing starts a multiprocessing manager in a rank that writes): when a rank
ends, or is ended because a peer failed, its whole group is killed, so no process of a
conversion outlives it. A rank whose parent died ends its group too: the parent passes its pid,
so one killed while the ranks still import is not taken for the reaper that adopted them.
A rank that fails sends its error to the parent too, which ends with every failed rank's own.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, NoReturn, TextIO

from backends.base import free_port
from lifecycle.boundary import MANIFEST, TRACKER, lstat, os_errors, parse_step, read_bytes, special_files
from lifecycle.errors import CheckpointError, ConfigError, LifecycleError, printable
from lifecycle.procgroup import end_group, exited, lead_own_group

FORMATS = ("hf", "dist_ckpt")
ERROR_BYTES = 2048
"""The most of a rank's error it sends the parent: one write to a pipe, whole even if the rank is killed."""


@dataclass(frozen=True, slots=True)
class ConvertJob:
    src: Path
    dst: Path
    to: str
    tp: int = 1
    pp: int = 1
    hf_config: Path | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def source_format(src: Path) -> str:
    if (src / "metadata.json").is_file():
        return "dist_ckpt"
    if any(src.glob("*.safetensors")):
        return "hf"
    raise ConfigError("SRC", f"{src}: neither a Megatron dist checkpoint (metadata.json) nor an HF folder "
                             "(*.safetensors)")


def architecture(job: ConvertJob, fmt: str) -> Path:
    """The folder whose config.json names the architecture: given, or SRC's own."""
    if job.hf_config is not None:
        if not (job.hf_config / "config.json").is_file():
            raise ConfigError("--hf-config", f"{job.hf_config}: no config.json")
        return job.hf_config
    if (job.src / "config.json").is_file():
        return job.src
    raise ConfigError("--hf-config", f"{job.src}: a {fmt} folder without config.json; name the architecture "
                                     "with --hf-config DIR (an HF folder of the same model)")


def max_ranks() -> int:
    """The most local processes a conversion starts: each imports torch and holds its shard."""
    return max(64, 4 * (os.cpu_count() or 1))


def _check_special(folder: Path, key: str) -> None:
    """A FIFO (or socket, device) among the folder's files would block every rank that opens it."""
    try:
        odd = special_files(folder)
    except CheckpointError as exc:
        raise ConfigError(key, str(exc)) from None
    if odd:
        raise ConfigError(key, "; ".join(odd))


def check(job: ConvertJob) -> tuple[str, Path]:
    """Every error that needs no process group, before any process starts."""
    if job.to not in FORMATS:
        raise ConfigError("--to", f"expected one of {', '.join(FORMATS)}, got {job.to!r}")
    if job.tp < 1 or job.pp < 1:
        raise ConfigError("--tp/--pp", f"must be >= 1, got tp={job.tp} pp={job.pp}")
    if job.tp * job.pp > (most := max_ranks()):
        raise ConfigError("--tp/--pp", f"tp={job.tp} x pp={job.pp} would start {job.tp * job.pp} local processes, "
                                       f"more than the {most} this machine can hold (4 per CPU, at least 64)")
    if not job.src.is_dir():
        raise ConfigError("SRC", f"{job.src}: not a folder")
    _check_special(job.src, "SRC")
    if job.hf_config is not None and job.hf_config.is_dir():
        _check_special(job.hf_config, "--hf-config")
    fmt = source_format(job.src)
    if fmt == job.to:
        raise ConfigError("--to", f"{job.src} is already {fmt}; both formats load at any TP / PP, so there "
                                  "is nothing to convert")
    if job.dst.name in ("", ".."):
        raise ConfigError("DST", f"{job.dst}: names no folder of its own, and the converted folder is renamed into "
                                 "place beside the one named: name it by its path (../NAME); nothing was written")
    if (st := lstat(job.dst)) is not None and stat.S_ISLNK(st.st_mode):
        raise ConfigError("DST", f"{job.dst}: a symlink; the converted folder is renamed into place, which a "
                                 "symlink cannot take: name the folder itself")
    if job.dst.exists() and (not job.dst.is_dir() or any(job.dst.iterdir())):
        raise ConfigError("DST", f"{job.dst}: exists and is not an empty folder; nothing was written")
    _check_destination(job)
    arch = architecture(job, fmt)
    hf_config = check_architecture(arch / "config.json", job.src)
    _check_layout(hf_config, job)
    return fmt, arch


def _check_layout(hf_config: Any, job: ConvertJob) -> None:
    """`--tp` / `--pp` that the architecture cannot be split by (heads, vocabulary, FFN, layers),
    refused before any rank starts rather than by Megatron on every rank."""
    try:
        from backends.megatron import check_layout  # imports megatron-core: not for `--help`
    except ImportError as exc:
        raise ConfigError("--to", f"converting needs the megatron extra (megatron-core and mbridge): {exc}") from None
    try:
        check_layout(hf_config, tp=job.tp, pp=job.pp)
    except ConfigError as exc:
        raise ConfigError("--tp/--pp", exc.message) from None


def _check_destination(job: ConvertJob) -> None:
    """DST outside SRC (the ranks read SRC while they write beside DST) and outside any
    checkpoint: a committed folder's manifest lists every file it holds, so a resume would take
    the step for damaged and set it aside, and a new folder among the steps would be one."""
    try:
        dst, src = job.dst.resolve(), job.src.resolve()
        if dst == src or dst.is_relative_to(src):
            raise ConfigError("DST", f"{job.dst}: inside SRC {job.src}; write the conversion elsewhere")
        for folder in (dst, *dst.parents):
            if folder != dst and _holds_a_manifest(folder):
                raise ConfigError("DST", f"{job.dst}: inside {folder}, which holds {MANIFEST}: a committed checkpoint "
                                         "lists every file it holds, and one more makes it damaged; write elsewhere")
            if _is_step_of_a_root(folder):
                raise ConfigError("DST", f"{job.dst}: {'is' if folder == dst else 'inside'} the step folder {folder} "
                                         "of a checkpoint root, which resume would take for a damaged or incomplete "
                                         "step; write elsewhere")
    except (OSError, RuntimeError, CheckpointError) as exc:  # a symlink loop, a folder that cannot be read
        raise ConfigError("DST", f"{job.dst}: cannot tell where it lies: {exc}") from None


def _is_step_of_a_root(folder: Path) -> bool:
    """A `global_step_N` folder (`lifecycle.boundary.parse_step`) beside the root's tracker, or
    holding a committed role folder."""
    if parse_step(folder.name) is None:
        return False
    if lstat(folder.parent / TRACKER) is not None:
        return True
    if not folder.is_dir():
        return False
    with os.scandir(folder) as entries:
        return any(entry.is_dir() and lstat(Path(entry.path) / MANIFEST) is not None for entry in entries)


def _holds_a_manifest(folder: Path) -> bool:
    """Whether `folder` is a committed role folder: its `manifest.json` a JSON object with this
    library's `format_version` and `files` (another project's `manifest.json` is not one)."""
    if lstat(folder / MANIFEST) is None:
        return False
    try:
        data = json.loads(read_bytes(folder / MANIFEST, 64 * 1024 * 1024, "a manifest"))
    except (CheckpointError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "format_version" in data and "files" in data


def check_architecture(config: Path, src: Path) -> Any:
    """The config every rank builds its model from, read before any starts: a JSON object whose
    sizes are positive integers, and whose parameters are no more than SRC has bytes on disk,
    counted first from the sizes (`parameter_floor`, cheap), then on the model transformers
    builds on the meta device (`backends.hf_arch.parameter_floor`: experts and every other part
    included). A config of another model, or a crafted one, would else make every rank allocate
    it (a 50M x 64 embedding is 13 GB, 4096 experts 384 GB) before a single weight is compared.
    Returns the `PretrainedConfig` it read, so later checks need not read config.json again."""
    from lifecycle.jsontree import read_config_json  # imports torch: not for `--help`

    try:
        data = read_config_json(config)
    except LifecycleError as exc:
        raise ConfigError("--hf-config", str(exc)) from None
    if not isinstance(data, dict):
        raise ConfigError("--hf-config", f"{config}: must be a JSON object, found {type(data).__name__}")
    sizes = {key: data[key] for key in SIZE_KEYS if data.get(key) is not None}
    if any(not (type(v) is int and v > 0) for v in sizes.values()):
        raise ConfigError("--hf-config", f"{config}: {', '.join(sizes)} must be positive integers, found {sizes}")
    held = allocated_bytes(src)
    if (wanted := parameter_floor(sizes)) > held:
        _too_large(config, src, wanted, held, ", ".join(f"{k} {v}" for k, v in sizes.items()))
    hf_config, built = _built_parameters(config)
    if built is not None and built > held:
        _too_large(config, src, built, held, "counted on the model transformers builds for it")
    return hf_config


def _built_parameters(config: Path) -> tuple[Any, int | None]:
    """The config's `PretrainedConfig`, and the parameters of the model transformers builds for
    it (meta device, no code of the folder's run): None for an architecture no auto class builds
    (the floor alone holds)."""
    from backends.hf_arch import parameter_floor as built_floor
    from backends.hf_arch import read_hf_config

    try:
        hf_config = read_hf_config(config.parent)
        return hf_config, built_floor(hf_config)
    except ConfigError as exc:
        raise ConfigError("--hf-config", exc.message if exc.key == "hf_config" else str(exc)) from None


def _too_large(config: Path, src: Path, wanted: int, held: int, how: str) -> NoReturn:
    raise ConfigError("--hf-config", f"{config}: its model has at least {wanted} parameters ({how}), more than "
                                     f"the {held} bytes {src} holds on disk: the config of another model?")


SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim")


def parameter_floor(sizes: dict[str, int]) -> int:
    """Parameters a decoder of these sizes has at least: one embedding, and per layer the query
    and output projections and a gated MLP (k, v, norms, biases and experts only add to it).
    A size the config lacks counts nothing, so the floor stays below the model's real count."""
    hidden, layers = sizes.get("hidden_size", 0), sizes.get("num_hidden_layers", 0)
    heads = sizes.get("num_attention_heads", 0)
    head_dim = sizes.get("head_dim") or (hidden // heads if heads else 0)
    attention = 2 * hidden * heads * head_dim
    mlp = 3 * hidden * sizes.get("intermediate_size", 0)
    return sizes.get("vocab_size", 0) * hidden + layers * (attention + mlp)


def allocated_bytes(src: Path) -> int:
    """Bytes SRC's files take on disk (blocks, not sizes: a sparse file holds none of its
    length); symlinked files counted at their target, symlinked folders not followed."""
    total = 0
    with os_errors("cannot walk the source folder", src):
        for path in src.rglob("*"):
            st = path.stat() if path.is_file() else None
            total += st.st_blocks * 512 if st is not None else 0
    return total


def _say(rank: int, out: TextIO, started: float, message: str | Callable[[], str]) -> None:
    """Progress from rank 0 only; a callable message is built there alone (it may walk folders)."""
    if rank == 0:
        text = message() if callable(message) else message
        print(f"[convert {time.perf_counter() - started:6.1f}s] {text}", file=out, flush=True)


def _folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def _rank_main(rank: int, job: ConvertJob, fmt: str, arch: Path, staging: Path, port: int, parent: int,
               errors: Connection) -> None:
    lead_own_group(parent)
    import torch
    import torch.distributed as dist

    from backends.dist_ckpt import DistCkptBackend
    from backends.mbridge import MBridgeBackend
    from backends.megatron import build_model

    started = time.perf_counter()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=job.world_size, timeout=timedelta(minutes=30))
    try:
        _say(rank, sys.stderr, started, f"building the model from {arch / 'config.json'} at TP{job.tp} PP{job.pp}")
        model = build_model(arch, tp=job.tp, pp=job.pp)
        reader, writer = (MBridgeBackend(), DistCkptBackend()) if fmt == "hf" else (DistCkptBackend(), MBridgeBackend())
        _say(rank, sys.stderr, started, lambda: f"loading {job.src} ({fmt}, {_folder_mb(job.src):.1f} MB)")
        reader.load_model(model, job.src)
        _say(rank, sys.stderr, started, f"writing {job.to} into {job.dst}")
        writer.save_model(model, staging)
        dist.barrier()
        _say(rank, sys.stderr, started, lambda: f"written: {_folder_mb(staging):.1f} MB")
    except LifecycleError as exc:
        _fail(rank, str(exc), errors)
    except Exception as exc:  # noqa: BLE001 - transformers', megatron's or torch's own: one typed line, no traceback
        _fail(rank, f"{type(exc).__name__}: {exc}", errors)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # The rank exits next: spare the interpreter's last garbage collection a walk over
        # everything torch, megatron and transformers allocated (a second or two of CPU a rank).
        gc.freeze()


def _fail(rank: int, message: str, errors: Connection) -> NoReturn:
    """The rank's error to the parent, for the line the conversion ends with (a peer it ends
    next may never print its own), and on stderr as it happens."""
    errors.send_bytes(f"{rank} {printable(message)}".encode("utf-8", "backslashreplace")[:ERROR_BYTES])
    print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _rank_errors(errors: Connection) -> dict[int, str]:
    """The errors failed ranks sent, by rank."""
    found: dict[int, str] = {}
    while errors.poll():
        rank, _, message = errors.recv_bytes(ERROR_BYTES).decode("utf-8", "replace").partition(" ")
        found[int(rank)] = message
    return found


def _failure(job: ConvertJob, procs: list[mp.process.BaseProcess], errors: dict[int, str]) -> LifecycleError:
    """Each failed rank with its own error, ranks that failed alike together; one that sent
    none (killed, or ended because a peer failed) with its exit code."""
    said: dict[str, list[str]] = {}
    silent: list[str] = []
    for rank, proc in enumerate(procs):
        if proc.exitcode != 0 and rank in errors:
            said.setdefault(errors[rank], []).append(proc.name)
        elif proc.exitcode != 0:
            silent.append(f"{proc.name} (exit code {proc.exitcode})")
    parts = [f"{', '.join(names)}: {message}" for message, names in said.items()] + silent
    return LifecycleError(f"convert {job.src} -> {job.dst} failed in {'; '.join(parts)}; nothing was written to "
                          f"{job.dst}")


def _wait(procs: list[mp.process.BaseProcess]) -> None:
    """Until all ranks end; one that fails ends the others, which would wait for it forever.

    Each rank is ended (`end_group`: its group killed, then reaped) as soon as it exits.
    """
    running = list(procs)
    while running:
        for proc in [p for p in running if exited(p) is not False]:
            running.remove(proc)
            end_group(proc)
            if proc.exitcode != 0:
                for peer in running:
                    end_group(peer)
                running.clear()
                break
        if running:
            time.sleep(0.1)


def convert(job: ConvertJob) -> Path:
    """Run the conversion; DST exists afterwards only if every rank succeeded."""
    fmt, arch = check(job)
    staging = job.dst.parent / f".{job.dst.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    port = free_port()
    ctx = mp.get_context("spawn")
    errors, sent = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank_main, args=(r, job, fmt, arch, staging, port, os.getpid(), sent),
                         name=f"convert-rank{r}") for r in range(job.world_size)]
    try:
        for p in procs:
            p.start()
        _wait(procs)
        if any(p.exitcode != 0 for p in procs):
            raise _failure(job, procs, _rank_errors(errors))
        if job.dst.is_dir():
            job.dst.rmdir()
        staging.rename(job.dst)
    finally:
        for p in procs:
            end_group(p)
        errors.close()
        sent.close()
        shutil.rmtree(staging, ignore_errors=True)
    return job.dst
