"""Time to get every rank's weights in place at TP=2: HF through mbridge vs a dist checkpoint.

    python examples/bench/megatron_load.py [--hidden 1024 --layers 4 --vocab 16384] [--repeat 3]

Makes a Qwen2 HF checkpoint with `transformers` (float32, >= 256 MiB by default), starts two
gloo ranks, builds the Megatron model at TP=2 on each, and times, between two barriers:
(a) `mbridge` loading the HF folder (TP rank 0 reads every tensor and scatters the shards);
(b) `dist_ckpt` loading the same weights saved as a Megatron dist checkpoint (each rank reads
its own shards). Both read warm files (page cache); the best of `--repeat` runs of each is
reported, with the ratio. Upstream reported 109 s -> 25 s (4.36x) for a 7B model on GPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from record import Figure, add_write_docs, write_docs  # noqa: E402

from tests.backends.dist_util import run_ranks  # noqa: E402


def _timed(fn: Callable[[], None]) -> float:
    torch.distributed.barrier()
    started = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - started


def _rank(rank: int, world_size: int, tmp: Path) -> dict[str, list[float]]:
    from backends.dist_ckpt import DistCkptBackend
    from backends.mbridge import MBridgeBackend
    from backends.megatron import build_model

    repeat = int((tmp / "repeat").read_text())
    model = build_model(tmp / "hf", tp=2)
    mbridge, dist_ckpt = MBridgeBackend(), DistCkptBackend()
    mbridge.load_model(model, tmp / "hf")
    dist_ckpt.save_model(model, tmp / "dist")
    times: dict[str, list[float]] = {"hf_mbridge": [], "dist_ckpt": []}
    for _ in range(repeat):
        times["hf_mbridge"].append(_timed(lambda: mbridge.load_model(model, tmp / "hf")))
        times["dist_ckpt"].append(_timed(lambda: dist_ckpt.load_model(model, tmp / "dist")))
    return times


def _make_hf(folder: Path, args: argparse.Namespace) -> int:
    import transformers

    config = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      intermediate_size=args.intermediate, num_attention_heads=16,
                                      num_key_value_heads=4, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(str(folder))
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=3)
    add_write_docs(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megatron_load_") as name:
        tmp = Path(name)
        size = _make_hf(tmp / "hf", args)
        (tmp / "repeat").write_text(str(args.repeat))
        print(f"model: Qwen2, {size / 2**20:.0f} MiB float32 HF safetensors; 2 ranks, TP=2, gloo on CPU")
        times = run_ranks(_rank, tmp, world_size=2, timeout_s=1800)[0]
    best = {k: min(v) for k, v in times.items()}
    for key, label in (("hf_mbridge", "HF through mbridge"), ("dist_ckpt", "dist checkpoint")):
        runs = ", ".join(f"{t:.2f}" for t in times[key])
        print(f"{label:20s} best {best[key]:6.2f} s  {size / best[key] / 1e9:5.2f} GB/s   (runs: {runs})")
    print(f"ratio (HF through mbridge / dist checkpoint): {best['hf_mbridge'] / best['dist_ckpt']:.2f}x "
          "(upstream, 7B on GPUs: 109 s / 25 s = 4.36x)")
    print(json.dumps({"bytes": size, **{f"{k}_s": round(v, 3) for k, v in best.items()}}))
    write_docs(args, "megatron_load.py", [Figure(
        f"every rank's weights in place, {size / 2**20:.0f} MiB Qwen2 at TP=2: dist checkpoint against HF through "
        "mbridge", f"{best['dist_ckpt']:.2f} s", f"{best['hf_mbridge']:.2f} s",
        f"{best['hf_mbridge'] / best['dist_ckpt']:.2f}x speed-up", "none (upstream: 4.36x for 7B on GPUs)")],
        f"Best of {args.repeat} loads of each, from the page cache; 2 gloo ranks on the CPU.")


if __name__ == "__main__":
    main()
