"""Quickstart: a small torch model through init-load, training, saves, and a resume in a fresh process.

    python examples/quickstart.py [--root DIR] [--steps 6] [--save-every 2]

The first process trains and saves every few steps, then stops. A second, fresh process
resumes from the newest complete checkpoint, checks that the weights, optimizer and step are
exactly the saved ones, and trains on. JSON logs and a Chrome trace of each process land
in the root folder.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from lifecycle import Lifecycle, LifecycleConfig
from lifecycle.logging import configure


class Batches:
    """A deterministic stream of regression batches whose position is checkpointed."""

    def __init__(self, batch_size: int = 32) -> None:
        self.batch_size = batch_size
        self.position = 0
        self._teacher = torch.nn.Linear(16, 1)
        torch.nn.init.constant_(self._teacher.weight, 0.5)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.position)
        self.position += 1
        x = torch.randn(self.batch_size, 16, generator=gen)
        with torch.no_grad():
            return x, self._teacher(x)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def build(root: Path) -> tuple[Lifecycle, Batches]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    batches = Batches()
    config = LifecycleConfig.from_dict({
        "checkpoint": {"root": str(root / "checkpoints"), "keep_last": 2,
                       "save": {"format": "hf", "contents": ["model", "optimizer", "extra"]}},
        "resume": {"mode": "auto"},
    })
    lc = Lifecycle(config, role="actor", model=model, optimizer=optimizer,
                   lr_scheduler=scheduler, dataloader=batches)
    return lc, batches


def train(lc: Lifecycle, batches: Batches, until: int, save_every: int) -> dict[str, torch.Tensor]:
    """Train to step `until`, saving every `save_every` steps; returns the weights the last save held."""
    model, optimizer = lc.parts.model, lc.parts.optimizer
    saved: dict[str, torch.Tensor] = {}
    for step in range(lc.progress.step + 1, until + 1):
        with lc.train_step(step):
            x, y = batches.next()
            loss_t = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss_t.backward()
            optimizer.step()
            lc.parts.lr_scheduler.step()
            loss = loss_t.item()
        print(f"  step {step:3d}  loss {loss:.4f}  lr {optimizer.param_groups[0]['lr']:.2e}")
        if step % save_every == 0:
            info = lc.save(step)
            print(f"  saved step {step} -> {info.path} ({info.bytes / 1e6:.2f} MB, {info.gbps:.2f} GB/s)")
            saved = {name: t.clone() for name, t in model.state_dict().items()}
    return saved


def first_run(root: Path, steps: int, save_every: int) -> None:
    lc, batches = build(root)
    print(f"[process 1] {lc}: init-load, train {steps} steps, save every {save_every}")
    lc.init_load()
    torch.save(train(lc, batches, steps, save_every), root / "expected_weights.pt")
    lc.export_chrome_trace(root / "trace_process1.json")
    lc.close()


def second_run(root: Path, steps: int, save_every: int) -> None:
    lc, batches = build(root)
    step = lc.resume()
    print(f"[process 2] {lc}: resumed at step {step}, data position {batches.position}, "
          f"lr {lc.parts.optimizer.param_groups[0]['lr']:.2e}")
    expected = torch.load(root / "expected_weights.pt", weights_only=True)
    same = all(torch.equal(expected[k], v) for k, v in lc.parts.model.state_dict().items())
    print(f"  weights equal to what process 1 saved at step {step}: {same}")
    if not same or step != steps - steps % save_every:
        raise SystemExit("resume did not restore the saved state")
    train(lc, batches, steps + 2, save_every)
    lc.export_chrome_trace(root / "trace_process2.json")
    lc.close()
    print("\n  trigger        src      -> dst      step  seconds")
    for record in lc.history:
        print(f"  {record.trigger:<14} {record.src.name:<8} -> {record.dst.name:<8} "
              f"{str(record.step):>4}  {record.duration_s:.4f}")


def _count(text: str) -> int:
    """An argparse type for --steps and --save-every: an integer >= 1."""
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, help="working folder, created when missing (default: a new temp folder)")
    parser.add_argument("--steps", type=_count, default=6)
    parser.add_argument("--save-every", type=_count, default=2, help="at most --steps: the second process "
                        "resumes from the last save")
    parser.add_argument("--phase", choices=["first", "second"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.save_every > args.steps:
        parser.error(f"--save-every {args.save_every} > --steps {args.steps}: nothing would be saved, "
                     "so the second process would have nothing to resume")
    root = args.root or Path(tempfile.mkdtemp(prefix="lifecycle-quickstart-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.phase:
        with open(root / f"log_{args.phase}.jsonl", "a") as sink:
            configure(json=True, file=sink)
            (first_run if args.phase == "first" else second_run)(root, args.steps, args.save_every)
        return
    for phase in ("first", "second"):
        cmd = [sys.executable, __file__, "--root", str(root), "--steps", str(args.steps),
               "--save-every", str(args.save_every), "--phase", phase]
        if (code := subprocess.run(cmd, check=False).returncode) != 0:
            raise SystemExit(f"the {phase} process failed (exit code {code}): see its output above")
    records = [json.loads(line) for line in (root / "log_second.jsonl").read_text().splitlines()]
    resumed = next(r for r in records if r.get("trigger") == "resume")
    print(f"\nresume record: {json.dumps({k: resumed[k] for k in ('trigger', 'src', 'dst', 'ok', 'step')})}")
    print(f"logs and traces in {root}")


if __name__ == "__main__":
    main()
