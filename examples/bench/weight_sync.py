"""Weight-sync throughput: our engines against the transport's own limits, in one run.

One sender (this process) and one receiver (a spawned process) on this host. The weights
are `--gib` GiB of float32 tensors (default 1 GiB in 4096 tensors of mixed sizes: two
embedding-like tensors of 1/16 of the total each, the rest log-uniform over three decades).

- gloo engine against (a) one broadcast of a single flat tensor of the same bytes over a
  gloo group (the transport's limit) and (b) one broadcast per tensor (the naive way);
- shm engine against one memcpy of the same bytes (`ctypes.memmove` between two flat tensors,
  this process); beside it, the same bytes in one memmove per bucket: glibc picks its copy
  loop by the size of each call, so this is what copying one bucket at a time can reach.

Engine times run from the first byte packed to the last receiver's verdict (every bucket
verified against its checksum); the group's setup is timed apart, as the baselines' is not
timed at all. The receiver takes every tensor (a view into a verified bucket) and does not
copy it into a model: that copy is the rollout's own `load_weights`, the same whichever way
the bytes came.

    python examples/bench/weight_sync.py                   # 1 GiB, 64 MiB buckets
    python examples/bench/weight_sync.py --gib 0.25 --repeat 2
    python examples/bench/weight_sync.py --scale --plot scale.png   # sizes and counts (weight_sync_scale.py)
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from record import Figure, add_write_docs, at_least, file_in_existing_folder, positive_float, positive_int, write_docs

from backends.base import free_port
from backends.engines import CheckpointEngine, CheckpointEngineRegistry, Rendezvous, flatten_parameters, receive_into
from backends.engines.options import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES
from lifecycle.config import APPLY_MODES

HOST = "127.0.0.1"
ENGINES = ("gloo", "shm")


def numels(total: int, count: int) -> list[int]:
    """The element counts of `count` float32 tensors of mixed sizes adding up to `total` bytes
    (a multiple of 4, at least `count` elements, `count` >= 3)."""
    rng = np.random.default_rng(0)
    embed = total // 16 // 4
    weights = np.exp(rng.uniform(0.0, np.log(1000.0), count - 2))
    rest = total // 4 - 2 * embed
    sizes = np.maximum(1, (weights / weights.sum() * rest).astype(np.int64))
    sizes[np.argmax(sizes)] += rest - int(sizes.sum())
    return [embed, embed, *sizes.tolist()]


def make_tensors(total: int, count: int, flat: bool = False, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """`count` float32 tensors of mixed sizes adding up to `total` bytes (a multiple of 4), on
    `device`; `flat`: moved into one storage by `flatten_parameters`, as a flattened model's are."""
    named = [(f"layer.{i}.weight", torch.rand(n, device=device)) for i, n in enumerate(numels(total, count))]
    if not flat:
        return named
    module = torch.nn.Module()
    for i, (_, tensor) in enumerate(named):
        module.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=False))
    flatten_parameters(module)
    return [(name, param.data) for (name, _), param in zip(named, module.parameters(), strict=True)]


class _Reader:
    """A rollout that takes every tensor (already verified by the engine) and keeps nothing."""

    weights_version = 0
    stale = False

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def mark_stale(self) -> None:
        self.stale = True

    def load_weights(self, named_tensors: Any) -> None:
        for _ in named_tensors:
            pass


def _group(port: int, rank: int) -> Any:
    store = dist.TCPStore(HOST, port, 2, rank == 0, timedelta(seconds=120))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=120)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return store, dist.ProcessGroupGloo(store, rank, 2, options)


def _barrier(group: Any) -> None:
    group.allreduce([torch.zeros(1)]).wait()


def _broadcast(group: Any, tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([tensor], options).wait()


def _engine(name: str, args: argparse.Namespace, verify: bool | None = None) -> CheckpointEngine:
    """`name` with the bench's options (`verify` overriding `--verify`)."""
    return CheckpointEngineRegistry.new(name, bucket_bytes=args.bucket, verify=args.verify if verify is None else verify,
                                        apply=args.apply, timeout_s=600)


def warmup(args: argparse.Namespace) -> int:
    """Untimed rounds before the timed ones: one touches every buffer; flip alternates between
    two weight sets, so it takes two."""
    return 2 if args.apply == "flip" else 1


def _variants(args: argparse.Namespace) -> dict[str, tuple[str, bool]]:
    """The engine runs of one round, by key: each engine as set, and, when it verifies, again
    without checksums (`<engine>_unverified`) to show the checksums' share of a sync."""
    variants = {name: (name, args.verify) for name in ENGINES}
    if args.verify:
        variants.update({f"{name}_unverified": (name, False) for name in ENGINES})
    return variants


def receiver(args: argparse.Namespace, ports: dict[str, int]) -> None:
    torch.set_num_threads(args.threads)
    tensors = make_tensors(args.total, args.tensors)
    flat = torch.empty(args.total, dtype=torch.uint8)
    landing = [torch.empty_like(t) for _, t in tensors]
    _, group = _group(ports["group"], 1)
    engines = {key: _engine(name, args, verify) for key, (name, verify) in _variants(args).items()}
    into = dict(make_tensors(args.total, args.tensors, flat=True)) if args.into else None
    for _ in range(args.repeat + warmup(args)):
        for name in ("flat", "per_tensor", *engines):
            _barrier(group)
            if name == "flat":
                _broadcast(group, [flat])
            elif name == "per_tensor":
                _broadcast(group, landing)
            else:
                lands = into if engines[name].name == "gloo" else None  # shm's receivers read the shared slot
                receive_into(engines[name], _Reader(), Rendezvous(HOST, ports[name]), rank=1, into=lands)
            _barrier(group)


def _timed_engine(engine: CheckpointEngine, port: int, tensors: list[tuple[str, torch.Tensor]],
                  version: int) -> tuple[float, float, dict[str, float]]:
    """(setup seconds, transfer seconds, the sender's phases) of one engine sync."""
    start = time.perf_counter()
    with engine.session(Rendezvous(HOST, port), rank=0):
        ready = time.perf_counter()
        stats = engine.send_weights(tensors, version)
        done = time.perf_counter()
    return ready - start, done - ready, stats.phases


PHASES = ("plan", "pack", "wire", "apply", "hash")
"""The sender's phases (`SyncStats.phases`): plan and answers, packing, waiting on the wire and
the receivers' checks, the receivers' last checks and apply; hashing runs on a worker alongside."""


def phase_shares(times: dict[str, list[float]], key: str) -> dict[str, float]:
    """Each phase's median seconds as a share of the engine's median sync."""
    whole = statistics.median(times[key])
    return {phase: statistics.median(times[f"{key}_phase_{phase}"]) / whole for phase in PHASES
            if times.get(f"{key}_phase_{phase}")}


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sender(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, list[float]]:
    tensors = make_tensors(args.total, args.tensors, args.flat)
    flat = torch.empty(args.total, dtype=torch.uint8).fill_(7)
    copy_dst = torch.empty_like(flat)
    _, group = _group(ports["group"], 0)
    engines = {key: _engine(name, args, verify) for key, (name, verify) in _variants(args).items()}
    times: dict[str, list[float]] = {k: [] for k in ("flat", "per_tensor", *engines, "memcpy", "memcpy_buckets",
                                                   *(f"{key}_setup" for key in engines),
                                                   *(f"{key}_phase_{phase}" for key in engines for phase in PHASES))}
    for rep in range(args.repeat + warmup(args)):
        got: dict[str, float] = {}
        for name in ("flat", "per_tensor", *engines):
            _barrier(group)
            if name == "flat":
                got[name] = _timed(lambda: (_broadcast(group, [flat]), _barrier(group)))
                continue
            if name == "per_tensor":
                got[name] = _timed(lambda: (_broadcast(group, [t for _, t in tensors]), _barrier(group)))
                continue
            got[f"{name}_setup"], got[name], phases = _timed_engine(engines[name], ports[name], tensors, rep + 1)
            got.update({f"{name}_phase_{phase}": seconds for phase, seconds in phases.items()})
            _barrier(group)
        got["memcpy"] = _timed(lambda: ctypes.memmove(copy_dst.data_ptr(), flat.data_ptr(), args.total))
        got["memcpy_buckets"] = _timed(lambda: _memmove_in_calls(copy_dst, flat, args.bucket))
        if rep >= warmup(args):  # untimed rounds touch every buffer first; first touches are not transfers
            for key, seconds in got.items():
                times[key].append(seconds)
    return times


def _memmove_in_calls(dst: torch.Tensor, src: torch.Tensor, size: int) -> None:
    """`src` into `dst` with one memmove per `size` bytes: what copying one bucket at a time can
    reach here (glibc picks its copy loop by the size of each call)."""
    for at in range(0, src.numel(), size):
        ctypes.memmove(dst.data_ptr() + at, src.data_ptr() + at, min(size, src.numel() - at))


_LANDS = " (gloo landing in the receiver's flattened tensors, into=)"


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    gbps = {k: args.total / statistics.median(v) / 1e9 for k, v in times.items()
            if not k.endswith("_setup") and "_phase_" not in k}
    print(f"{args.total / 2**30:.3g} GiB in {args.tensors} float32 tensors{' (flattened)' if args.flat else ''}, "
          f"buckets of {args.bucket / 2**20:g} MiB, checksums {'on' if args.verify else 'off'}, apply {args.apply}"
          f"{_LANDS if args.into else ''}, median of {args.repeat}, torch threads {args.threads}")
    for key, label in (("gloo", "gloo engine"), ("flat", "(a) one flat broadcast"),
                       ("per_tensor", "(b) one broadcast per tensor"), ("shm", "shm engine"),
                       ("memcpy", "one memcpy"), ("memcpy_buckets", f"one memcpy in {args.bucket / 2**20:g} MiB calls")):
        spread = ", ".join(f"{args.total / s / 1e9:.2f}" for s in times[key])
        print(f"  {label:32s} {gbps[key]:7.2f} GB/s   (runs: {spread})")
    for name in ENGINES:
        print(f"  {name} engine setup (not in the figures above): "
              f"{statistics.median(times[f'{name}_setup']) * 1e3:.1f} ms")
        if f"{name}_unverified" in gbps:
            share = 1 - gbps[name] / gbps[f"{name}_unverified"]
            print(f"  {name} engine without checksums: {gbps[f'{name}_unverified']:.2f} GB/s: checksums take "
                  f"{share:.0%} of a verified sync")
        print(f"  {name} engine, where a sync's time goes (sender): {_shares(phase_shares(times, name))}")
    print(f"  the same memcpy in bucket-sized calls: {gbps['memcpy_buckets'] / gbps['memcpy']:.2f}x of one call")
    checks = (("gloo / (a) flat broadcast", gbps["gloo"] / gbps["flat"], 0.9),
              ("gloo / (b) per-tensor broadcast", gbps["gloo"] / gbps["per_tensor"], 3.0),
              ("shm / memcpy", gbps["shm"] / gbps["memcpy"], 0.7))
    for label, ratio, target in checks:
        print(f"  {label:32s} {ratio:6.2f}x   target >= {target:g}x: {'met' if ratio >= target else 'NOT met'}")
    baselines = {"gloo / (a) flat broadcast": ("gloo", "flat", "one broadcast of one flat tensor"),
                 "gloo / (b) per-tensor broadcast": ("gloo", "per_tensor", "one broadcast per tensor"),
                 "shm / memcpy": ("shm", "memcpy", f"one memcpy of {args.total / 2**30:.3g} GiB")}
    figures = []
    for label, ratio, target in checks:
        engine, base, against = baselines[label]
        figures.append(Figure(f"`{engine}` engine against {against}", f"{gbps[engine]:.2f} GB/s",
                              f"{gbps[base]:.2f} GB/s", f"{ratio:.2f}x", f">= {target:g}x"))
    for name in ENGINES:
        if f"{name}_unverified" in gbps:
            share = 1 - gbps[name] / gbps[f"{name}_unverified"]
            figures.append(Figure(f"`{name}` engine's checksums, share of a verified sync", f"{share:.0%}",
                                  f"{gbps[f'{name}_unverified']:.2f} GB/s unverified", "", ""))
        figures.append(Figure(f"`{name}` engine, where a sync's time goes (sender)",
                              _shares(phase_shares(times, name)), "", "", ""))
    figures.append(Figure(f"one memcpy of the same bytes in {args.bucket / 2**20:g} MiB calls (what one copy a bucket "
                          "can reach), against one call", f"{gbps['memcpy_buckets']:.2f} GB/s",
                          f"{gbps['memcpy']:.2f} GB/s", f"{gbps['memcpy_buckets'] / gbps['memcpy']:.2f}x", ""))
    write_docs(args, "weight_sync.py", figures,
               f"{args.total / 2**30:.3g} GiB in {args.tensors} float32 tensors{' (flattened)' if args.flat else ''}, "
               f"{args.bucket / 2**20:g} MiB buckets, checksums {'on' if args.verify else 'off'}, apply {args.apply}"
               f"{_LANDS if args.into else ''}, "
               f"one sender and one receiver "
               f"process, median of {args.repeat} syncs after {warmup(args)} untimed round(s); each engine also ran "
               f"unverified in the same rounds.")


def _shares(shares: dict[str, float]) -> str:
    text = ", ".join(f"{phase} {share:.0%}" for phase, share in shares.items() if phase != "hash")
    return f"{text}; hash {shares['hash']:.0%} alongside, on the checksum worker" if "hash" in shares else text


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=positive_float, default=1.0, help="total weight bytes, in GiB")
    parser.add_argument("--tensors", type=at_least(3), default=4096,
                        help="how many tensors (at least 3: two embedding-like ones and the rest)")
    parser.add_argument("--bucket-mib", type=positive_float, default=64.0, help="engine.bucket_bytes, in MiB")
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="engine.verify: checksum every bucket")
    parser.add_argument("--apply", choices=APPLY_MODES,
                        help="engine.apply: atomic (the default) holds the whole sync, streamed two buckets, flip "
                             "two weight sets the rollout adopts (shm: shared with the sender); --into takes "
                             "streamed")
    parser.add_argument("--flat", action="store_true",
                        help="the sender's tensors in one flattened storage (flatten_parameters): gloo sends "
                             "its buckets from it without packing, shm and cuda_ipc pack each with one copy")
    parser.add_argument("--into", action="store_true",
                        help="the receiver's tensors flattened too, and gloo lands each bucket straight in them "
                             "(receive_into(into=...); implies --flat and --apply streamed)")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads(), help="torch threads per process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the cuda_ipc engine against one device-to-device copy, on one GPU "
                             "(weight_sync_cuda.py; atomic and streamed, or --apply flip)")
    parser.add_argument("--scale", action="store_true",
                        help="gloo and shm against their baselines over sizes (at --tensors tensors) and tensor "
                             "counts (at --gib GiB), with each side's peak memory (weight_sync_scale.py)")
    parser.add_argument("--sizes", type=positive_float, nargs="+", metavar="GIB",
                        help="--scale: the sizes of the size sweep, in GiB (default 0.25 1 2)")
    parser.add_argument("--counts", type=at_least(3), nargs="+", metavar="N",
                        help="--scale: the tensor counts of the count sweep (default 256 4096 65536)")
    parser.add_argument("--plot", type=file_in_existing_folder, metavar="FILE.png",
                        help="--scale: draw GB/s against size and against tensor count to FILE.png (matplotlib)")
    add_write_docs(parser)
    args = parser.parse_args(argv)
    args.total = int(args.gib * 2**30) // 4 * 4
    args.bucket = int(args.bucket_mib * 2**20)
    if not MIN_BUCKET_BYTES <= args.bucket <= MAX_BUCKET_BYTES:
        parser.error(f"--bucket-mib {args.bucket_mib}: engine.bucket_bytes must be in "
                     f"{MIN_BUCKET_BYTES}..{MAX_BUCKET_BYTES} bytes, got {args.bucket}")
    if not args.scale and args.tensors > args.total // 4:
        parser.error(f"--tensors {args.tensors} in --gib {args.gib}: at most one tensor per float32 "
                     f"({args.total // 4} of them)")
    if args.into:
        clash = [f"--{key} {value}" for key, value, fits in (("apply", args.apply, (None, "streamed")),
                                                               ("device", args.device, ("cpu",))) if value not in fits]
        if clash:
            parser.error("--into lands gloo's buckets in the receiver's tensors: a streamed receive on the host, "
                         f"not with {' and '.join(clash)}")
        args.apply, args.flat = "streamed", True
    args.apply = args.apply or "atomic"
    if args.device == "cuda":
        if args.scale:
            parser.error("--scale measures the host engines (gloo, shm); --device cuda is a bench of its own")
        return cuda_main(args)
    if args.scale:
        import weight_sync_scale

        return weight_sync_scale.main(parser, args)
    for flag in ("sizes", "counts", "plot"):
        if getattr(args, flag) is not None:
            parser.error(f"--{flag} is an option of --scale; add --scale")
    torch.set_num_threads(args.threads)
    ports = {key: free_port(HOST) for key in ("group", *_variants(args))}
    child = mp.get_context("spawn").Process(target=receiver, args=(args, ports), daemon=True)
    child.start()
    try:
        times = sender(args, ports)
    finally:
        child.join(60)
    report(args, times)


def cuda_main(args: argparse.Namespace) -> None:
    import weight_sync_cuda

    tensors = make_tensors(args.total, args.tensors, args.flat, device="cuda")
    rows = weight_sync_cuda.report(args, weight_sync_cuda.run(args, tensors))
    figures = [Figure(f"`{label}` against one device-to-device copy; sender's phases: {spent}", f"{gbps:.1f} GB/s",
                      f"{gbps / ratio:.1f} GB/s", f"{ratio:.2f}x", ">= 0.8x") for label, gbps, ratio, spent in rows]
    write_docs(args, "weight_sync.py --device cuda", figures,
               f"{args.total / 2**30:.3g} GiB in {args.tensors} float32 tensors"
               f"{' (flattened)' if args.flat else ''} on {torch.cuda.get_device_name()}, "
               f"{args.bucket / 2**20:g} MiB buckets, sender and receiver processes on one GPU, median of "
               f"{args.repeat} syncs after an untimed first round.")


if __name__ == "__main__":
    main()
