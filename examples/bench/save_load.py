"""Lifecycle save and resume against the raw library call on the same tensors.

    python examples/bench/save_load.py [--gib 1.0] [--tensors 200] [--repeats 3] [--formats hf torch_dcp]

hf: `lc.save` / `lc.resume` (staging, manifest with the checksum of every file, rename,
tracker; resume verifies every checksum and loads into the model) against
`safetensors.torch.save_file` / `load_file` + `load_state_dict`: both end with the weights
in a model. torch_dcp: the same lifecycle calls against `dcp.save` / `dcp.load` in place.
Prints GB/s of each and the ratio; best of `--repeats` runs (the lifecycle's, then the raw
call's), in one process.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import torch
from record import Figure, add_write_docs, existing_folder, positive_float, positive_int, write_docs

from lifecycle import Lifecycle


class Blob(torch.nn.Module):
    """A model that is just named tensors of mixed sizes."""

    def __init__(self, sizes: list[int], fill: float | None = None) -> None:
        super().__init__()
        for i, numel in enumerate(sizes):
            data = torch.full((numel,), fill) if fill is not None else torch.randn(numel)
            self.register_parameter(f"t{i:04d}", torch.nn.Parameter(data, requires_grad=False))


def tensor_sizes(total_bytes: int, count: int) -> list[int]:
    """`count` float32 tensors from small to large, summing to about `total_bytes`."""
    weights = [1 + (i % 20) for i in range(count)]
    scale = total_bytes / 4 / sum(weights)
    return [max(1, int(w * scale)) for w in weights]


def best(fn: Callable[[], None], repeats: int, before: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_format(fmt: str, sizes: list[int], work: Path, repeats: int, verify: bool = True) -> dict[str, float]:
    source = Blob(sizes)
    target = Blob(sizes, fill=0.0)
    raw_target = Blob(sizes, fill=0.0)
    state = source.state_dict()
    root = work / f"lifecycle_{fmt}"
    raw_dir = work / f"raw_{fmt}"
    config = {"checkpoint": {"root": str(root), "save": {"format": fmt, "contents": ["model"]},
                             "load": {"contents": ["model"], "verify": verify}}}
    saver = Lifecycle(config, role="actor", model=source)
    saver.init_load()
    step = iter(range(1, 10_000))

    def clean() -> None:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(raw_dir, ignore_errors=True)
        raw_dir.mkdir(parents=True)

    def raw_save() -> None:
        if fmt == "hf":
            from safetensors.torch import save_file

            save_file(state, str(raw_dir / "model.safetensors"))
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=str(raw_dir))

    def raw_load() -> None:
        if fmt == "hf":
            from safetensors.torch import load_file

            raw_target.load_state_dict(load_file(str(raw_dir / "model.safetensors")))
        else:
            import torch.distributed.checkpoint as dcp

            into = raw_target.state_dict()
            dcp.load(into, checkpoint_id=str(raw_dir))

    def lc_resume() -> None:
        resumer = Lifecycle(config, role="actor", model=target)
        if resumer.resume() is None:
            raise RuntimeError("nothing resumed")

    out = {
        "lc_save": best(lambda: saver.save(next(step)), repeats, clean),
        "raw_save": best(raw_save, repeats, clean),
    }
    clean()
    saver.save(next(step))
    raw_save()
    out["lc_load"] = best(lc_resume, repeats, lambda: None)
    out["raw_load"] = best(raw_load, repeats, lambda: None)
    for model in (target, raw_target):
        if not all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), model.state_dict().values())):
            raise RuntimeError(f"{fmt}: loaded weights differ from the saved ones")
    clean()
    return out


RAW = {("hf", "save"): "`safetensors.torch.save_file`", ("hf", "load"): "`load_file` + `load_state_dict`",
       ("torch_dcp", "save"): "`dcp.save`", ("torch_dcp", "load"): "`dcp.load`"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=positive_float, default=1.0)
    parser.add_argument("--tensors", type=positive_int, default=200)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--formats", nargs="+", choices=["hf", "torch_dcp"], default=["hf", "torch_dcp"])
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="checkpoint.load.verify: check every checksum on resume")
    parser.add_argument("--dir", type=existing_folder,
                        help="an existing work folder, kept after (default: a temp folder, removed after)")
    add_write_docs(parser)
    args = parser.parse_args(argv)
    sizes = tensor_sizes(int(args.gib * 1024**3), args.tensors)
    nbytes = 4 * sum(sizes)
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-save-load-"))
    print(f"{len(sizes)} float32 tensors, {nbytes / 1e9:.3f} GB, best of {args.repeats}, "
          f"resume checksums {'verified' if args.verify else 'not verified'}, in {work}")
    figures = []
    try:
        for fmt in args.formats:
            r = bench_format(fmt, sizes, work, args.repeats, args.verify)
            raw_name = "save_file/load_file" if fmt == "hf" else "dcp.save/dcp.load"
            for op in ("save", "load"):
                lc_gbps, raw_gbps = nbytes / r[f"lc_{op}"] / 1e9, nbytes / r[f"raw_{op}"] / 1e9
                print(f"{fmt:>9} {op}: lifecycle {lc_gbps:6.2f} GB/s  raw {raw_name} {raw_gbps:6.2f} GB/s  "
                      f"ratio {lc_gbps / raw_gbps:5.2f}x (target >= 0.9x)")
                figures.append(Figure(f"`{fmt}` {'save' if op == 'save' else 'resume'} against {RAW[fmt, op]}",
                                      f"{lc_gbps:.2f} GB/s", f"{raw_gbps:.2f} GB/s", f"{lc_gbps / raw_gbps:.2f}x",
                                      ">= 0.9x"))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    write_docs(args, "save_load.py", figures, f"{nbytes / 1e9:.3f} GB in {len(sizes)} float32 tensors, best of "
               f"{args.repeats}; resume checksums {'verified' if args.verify else 'not verified'}.")


if __name__ == "__main__":
    main()
