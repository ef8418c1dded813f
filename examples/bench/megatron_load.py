"""Time to get every rank's weights in place: HF through mbridge vs a dist checkpoint.

    python examples/bench/megatron_load.py [--hidden 1024 --layers 4 --vocab 16384] [--repeat 3]
        [--device cpu|cuda] [--tp N] [--dtype float32|bfloat16]

Makes a Qwen2 HF checkpoint with `transformers` (float32, >= 256 MiB by default), starts one
rank per TP rank, builds the Megatron model at that TP on each, and times, between two barriers:
(a) `mbridge` loading the HF folder (TP rank 0 reads every tensor and scatters the shards);
(b) `dist_ckpt` loading the same weights saved as a Megatron dist checkpoint (each rank reads
its own shards). Both read warm files (page cache); the best of `--repeat` runs of each is
reported, with the ratio. Upstream reported 109 s -> 25 s (4.36x) for a 7B model on GPUs.

`--device cpu` (the default): 2 gloo ranks, CUDA hidden from them even where there is a GPU.
`--device cuda`: NCCL, one rank per GPU (`--tp` defaults to the GPU count), the model built
on the GPUs, the timings taken after the device finished (synchronised before each barrier).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from record import Figure, add_write_docs, existing_folder, positive_int, write_docs  # noqa: E402

from tests.backends.dist_util import run_ranks  # noqa: E402

SETTINGS = "settings.json"


def _timed(fn: Callable[[], None]) -> float:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
    torch.distributed.barrier()
    started = time.perf_counter()
    fn()
    if on_gpu:
        torch.cuda.synchronize()
    torch.distributed.barrier()
    return time.perf_counter() - started


def _rank(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    from backends.dist_ckpt import DistCkptBackend
    from backends.mbridge import MBridgeBackend
    from backends.megatron import build_model

    repeat = json.loads((tmp / SETTINGS).read_text())["repeat"]
    model = build_model(tmp / "hf", tp=world_size)
    mbridge, dist_ckpt = MBridgeBackend(), DistCkptBackend()
    mbridge.load_model(model, tmp / "hf")
    dist_ckpt.save_model(model, tmp / "dist")
    times: dict[str, Any] = {"hf_mbridge": [], "dist_ckpt": [],
                             "devices": sorted({p.device.type for p in model.parameters()})}
    for _ in range(repeat):
        times["hf_mbridge"].append(_timed(lambda: mbridge.load_model(model, tmp / "hf")))
        times["dist_ckpt"].append(_timed(lambda: dist_ckpt.load_model(model, tmp / "dist")))
    profile = json.loads((tmp / SETTINGS).read_text()).get("profile")
    if profile:  # every rank loads (the loads are collective); rank 0 writes what it saw
        _profile(Path(profile) if rank == 0 else None, {"hf_mbridge": lambda: mbridge.load_model(model, tmp / "hf"),
                                 "dist_ckpt": lambda: dist_ckpt.load_model(model, tmp / "dist")})
    return times


def _profile(folder: Path | None, loads: dict[str, Callable[[], None]]) -> None:
    """One more load of each under cProfile: the 30 costliest calls to FOLDER/<name>.txt (rank 0's)."""
    import cProfile
    import io
    import pstats

    for name, load in loads.items():
        profiler = cProfile.Profile()
        profiler.runcall(load)
        if folder is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        (folder / f"{name}.txt").write_text(text.getvalue(), encoding="utf-8")


def _make_hf(folder: Path, args: argparse.Namespace) -> int:
    """Initialised on the benchmarked device (a large model initialises slowly on the CPU)."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      intermediate_size=args.intermediate, num_attention_heads=16,
                                      num_key_value_heads=4, tie_word_embeddings=False)
    with torch.device(args.device):
        model = transformers.Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(str(folder))
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@contextmanager
def _ranks_see(device: str) -> Iterator[None]:
    """On the CPU the ranks must not see a GPU: `build_model` builds on one whenever it exists."""
    if device == "cuda":
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=positive_int, default=1024)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--intermediate", type=positive_int, default=2816)
    parser.add_argument("--vocab", type=positive_int, default=16384)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model is built")
    parser.add_argument("--tp", type=positive_int, help="TP size, one rank each (default: 2 on cpu, the GPU count on cuda)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the HF checkpoint's dtype, which the Megatron model takes")
    parser.add_argument("--profile", type=existing_folder, metavar="DIR",
                        help="after the timed loads, profile one more of each (cProfile; rank 0's calls) into DIR, "
                             "an existing folder")
    add_write_docs(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    tp = args.tp or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and tp > torch.cuda.device_count():
        parser.error(f"--tp {tp}: one rank per GPU, and there are {torch.cuda.device_count()}")
    ranks = f"{tp} NCCL rank(s) on {torch.cuda.get_device_name()}" if args.device == "cuda" else f"{tp} gloo rank(s)"
    with tempfile.TemporaryDirectory(prefix="megatron_load_") as name:
        tmp = Path(name)
        size = _make_hf(tmp / "hf", args)
        (tmp / SETTINGS).write_text(json.dumps({"repeat": args.repeat,
                                                 "profile": str(args.profile.resolve()) if args.profile else None}))
        print(f"model: Qwen2, {size / 2**20:.0f} MiB {args.dtype} HF safetensors; {ranks}, TP={tp}", flush=True)
        with _ranks_see(args.device):
            times = run_ranks(_rank, tmp, world_size=tp, timeout_s=1800,
                              backend="nccl" if args.device == "cuda" else "gloo")[0]
    print(f"parameters on: {', '.join(times.pop('devices'))}")
    best = {k: min(v) for k, v in times.items()}
    for key, label in (("hf_mbridge", "HF through mbridge"), ("dist_ckpt", "dist checkpoint")):
        runs = ", ".join(f"{t:.2f}" for t in times[key])
        print(f"{label:20s} best {best[key]:6.2f} s  {size / best[key] / 1e9:5.2f} GB/s   (runs: {runs})")
    print(f"ratio (HF through mbridge / dist checkpoint): {best['hf_mbridge'] / best['dist_ckpt']:.2f}x "
          "(upstream, 7B on GPUs: 109 s / 25 s = 4.36x)")
    print(json.dumps({"bytes": size, **{f"{k}_s": round(v, 3) for k, v in best.items()}}))
    where = f"{tp} GPU rank(s), NCCL" if args.device == "cuda" else f"{tp} gloo rank(s) on the CPU"
    write_docs(args, "megatron_load.py", [Figure(
        f"every rank's weights in place, {size / 2**20:.0f} MiB {args.dtype} Qwen2 at TP={tp} on "
        f"{'the GPU' if args.device == 'cuda' else 'the CPU'}: dist checkpoint against HF through mbridge",
        f"{best['dist_ckpt']:.2f} s", f"{best['hf_mbridge']:.2f} s",
        f"{best['hf_mbridge'] / best['dist_ckpt']:.2f}x speed-up", "none (upstream: 4.36x for 7B on GPUs)")],
        f"Best of {args.repeat} loads of each, from the page cache; {where}.")


if __name__ == "__main__":
    main()
