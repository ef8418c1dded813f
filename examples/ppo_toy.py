"""PPO on Ray with a tiny Qwen2 actor and critic: it trains, a worker is killed, the run recovers.

    python examples/ppo_toy.py [--steps 60] [--save-every 5] [--fail-at 23] [--no-failure]
                               [--sync-save] [--root DIR] [--address ray://...]

The task: after a prompt of lowercase letters and one digit, answer with digits that count on
from it ("...q7" -> "8901..."). Each answer token earns 0.5 for being a digit and 0.5 more
for following the previous one; random weights earn about 0.02, and PPO brings that to
about 0.88 by step 60. The actor, the critic and a rollout worker are Ray actors (a local
Ray by default); every step the rollout generates, both trainers update, the actor's new
weights go to the rollout over gloo, and every few steps both trainers save (in the
background, unless --sync-save). Midway the actor's process is SIGKILLed: the driver rebuilds
the workers, every role resumes from the newest step complete for both, the rollout receives
the resumed weights, and training goes on to the last step.

The tiny models are made on the first run (a few MB, in ~/.cache/trainer-lifecycle/ppo-toy)
and init-loaded from there. JSON logs of every worker and a Chrome trace of all of them (open
it in https://ui.perfetto.dev) land in the run folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from lifecycle.data import ResumableBatchSampler
from lifecycle.logging import configure
from lifecycle.ray import Driver, DriverConfig, DriverHooks, Failure, Overdue, StepRecord, render_summary
from lifecycle.types import Parts

PROMPT, ANSWER = 8, 8
ZERO = ord("0")
MODELS = Path.home() / ".cache" / "trainer-lifecycle" / "ppo-toy"
QWEN2 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def make_models(folder: Path) -> dict[str, str]:
    """The actor (a causal LM over bytes) and the critic (a value per token), saved once as HF folders."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    paths = {"actor": folder / "actor", "critic": folder / "critic"}
    if not all((p / "model.safetensors").is_file() for p in paths.values()):
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**QWEN2)).save_pretrained(paths["actor"])
        Qwen2ForTokenClassification(Qwen2Config(**QWEN2, num_labels=1)).save_pretrained(paths["critic"])
        print(f"made the tiny Qwen2 actor and critic in {folder}")
    return {role: str(path) for role, path in paths.items()}


def reward(answers: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
    """Per token: 0.5 for a digit, 0.5 more when it is the previous digit plus one (mod 10)."""
    previous = torch.cat([prompts[:, -1:], answers[:, :-1]], 1)
    digit = (answers >= ZERO) & (answers < ZERO + 10)
    counts = digit & (previous >= ZERO) & (previous < ZERO + 10) & ((answers - ZERO) == (previous - ZERO + 1) % 10)
    return 0.5 * digit.float() + 0.5 * counts.float()


@dataclass
class CountingPPO:
    """The recipe every worker runs: models, prompts, generation, scores and PPO updates."""

    roles: tuple[str, ...] = ("actor", "critic")
    batch: int = 64
    epochs: int = 4
    lr: float = 3e-3
    clip: float = 0.2
    stall_at: int | None = None
    """A step whose actor update sleeps `stall_s` first, as a hung collective would."""
    stall_s: float = 2.5

    def build(self, role: str) -> Parts:
        from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

        torch.manual_seed(1)
        if role == "critic":
            model = Qwen2ForTokenClassification(Qwen2Config(**QWEN2, num_labels=1))
        else:
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN2))
        if role == "rollout":
            return Parts(model=model.eval())
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.3, total_iters=100)
        sampler = ResumableBatchSampler(4096, self.batch, seed=0) if role == "actor" else None
        return Parts(model=model, optimizer=optimizer, lr_scheduler=schedule, dataloader=sampler)

    def prompts(self, parts: Parts, step: int) -> torch.Tensor:
        """Prompt i of the data set: letters, then a digit, all fixed by i."""
        index = torch.tensor(next(iter(parts.dataloader)))
        letters = 97 + (index[:, None] * 31 + torch.arange(PROMPT - 1) * 7) % 26
        return torch.cat([letters, ZERO + (index[:, None] % 10)], 1)

    def generate(self, model: Any, prompts: torch.Tensor, step: int) -> dict[str, Any]:
        torch.manual_seed(step)
        with torch.no_grad():
            sequences = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                                       max_new_tokens=ANSWER, min_new_tokens=ANSWER, pad_token_id=0,
                                       eos_token_id=None)
        scores = reward(sequences[:, PROMPT:], prompts)
        return {"sequences": sequences, "token_rewards": scores, "reward": scores.mean().item()}

    def score(self, role: str, parts: Parts, batch: Mapping[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            if role == "critic":
                return {"values": self._values(parts.model, batch["sequences"])}
            return {"old_logp": self._logp(parts.model, batch["sequences"])}

    def update(self, role: str, parts: Parts, batch: Mapping[str, Any], step: int) -> dict[str, float]:
        if role == "actor" and step == self.stall_at:
            time.sleep(self.stall_s)
        seq = batch["sequences"]
        returns = batch["token_rewards"].flip(1).cumsum(1).flip(1)
        lr = parts.optimizer.param_groups[0]["lr"]
        for _ in range(self.epochs):
            if role == "critic":
                loss = F.mse_loss(self._values(parts.model, seq), returns)
            else:
                advantage = returns - batch["values"]
                advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-6)
                ratio = (self._logp(parts.model, seq) - batch["old_logp"]).exp()
                loss = -torch.min(ratio * advantage, ratio.clamp(1 - self.clip, 1 + self.clip) * advantage).mean()
            parts.optimizer.zero_grad()
            loss.backward()
            parts.optimizer.step()
        parts.lr_scheduler.step()
        return {"loss": loss.item(), "lr": lr, "reward": batch["reward"]}

    @staticmethod
    def _logp(model: Any, seq: torch.Tensor) -> torch.Tensor:
        logits = model(seq).logits[:, PROMPT - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, seq[:, PROMPT:, None])[..., 0]

    @staticmethod
    def _values(model: Any, seq: torch.Tensor) -> torch.Tensor:
        return model(seq).logits[:, PROMPT - 1:-1, 0]


class Progress(DriverHooks):
    """One line per step; kills `victim` just before step `fail_at` trains (first worker group only)."""

    def __init__(self, fail_at: int | None, victim: str) -> None:
        self.fail_at, self.victim = fail_at, victim
        self.started = time.perf_counter()

    def on_start(self, driver: Driver, step: int) -> None:
        start = f"resumed from step {step}" if step else "init-loaded from the tiny models"
        self.say(f"workers up ({', '.join(driver.workers)}), {start}; the rollout holds weights v{driver.version}")

    def on_phase(self, driver: Driver, phase: str, step: int) -> None:
        if (phase, step) == ("train", self.fail_at) and driver.incarnation == 0:
            pid = driver.kill(self.victim)
            self.say(f"step {step:3d}  >>> killed the {self.victim} worker (pid {pid}) on purpose, mid-run")

    def on_step(self, driver: Driver, record: StepRecord) -> None:
        m = record.metrics
        saved = "  saved" if record.saved else ""
        self.say(f"step {record.step:3d}  reward {m['actor/reward']:.3f}  actor loss {m['actor/loss']:+.3f}  "
                 f"critic loss {m['critic/loss']:.3f}  lr {m['actor/lr']:.2e}  weights v{driver.version}{saved}")

    def on_failure(self, driver: Driver, failure: Failure) -> None:
        self.say(f"step {failure.step:3d}  !!! {failure.worker} failed in {failure.phase}: "
                 f"{failure.error.splitlines()[0][:80]}; rebuilding the workers")

    def on_resume(self, driver: Driver, failure: Failure) -> None:
        self.say(f"step {failure.step:3d}  <<< every role resumed from step {failure.resumed_at} in "
                 f"{failure.recovery_s:.1f} s; the rollout holds weights v{driver.version}")

    def on_overdue(self, driver: Driver, overdue: Overdue) -> None:
        step = "  -" if overdue.step is None else f"{overdue.step:3d}"
        self.say(f"step {step}  ... {overdue.line()} (at {overdue.where or 'an unknown frame'})")

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f}s] {text}", flush=True)


def _count(text: str) -> int:
    """An argparse type for steps and CPUs: an integer >= 1."""
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=_count, default=60)
    parser.add_argument("--save-every", type=_count, default=5)
    parser.add_argument("--fail-at", type=_count, help="step whose training the kill interrupts (default: 23, or "
                        "none when --steps is under 23)")
    parser.add_argument("--no-failure", action="store_true", help="do not kill a worker")
    parser.add_argument("--victim", default="actor", choices=["actor", "critic", "rollout0"], help="worker to kill")
    parser.add_argument("--sync-save", action="store_true", help="save synchronously (default: async save)")
    parser.add_argument("--root", type=Path, help="run folder (default: a new temp folder)")
    parser.add_argument("--models", type=Path, default=MODELS, help="where the tiny models are made and kept")
    parser.add_argument("--address", help="Ray cluster to join (default: start a local Ray)")
    parser.add_argument("--num-cpus", type=_count, default=2, help="CPUs of the local Ray")
    parser.add_argument("--stall-at", type=_count, help="step whose actor update stalls past watchdog.train_step_s")
    args = parser.parse_args(argv)
    if args.fail_at is None and not args.no_failure:
        args.fail_at, args.no_failure = (23, False) if args.steps >= 23 else (None, True)
    if not args.no_failure and args.fail_at > args.steps:
        parser.error(f"--fail-at {args.fail_at} is past --steps {args.steps}: no worker would be killed "
                     "(give a --fail-at within the run, or --no-failure)")
    if args.stall_at is not None and args.stall_at > args.steps:
        parser.error(f"--stall-at {args.stall_at} is past --steps {args.steps}: no update would stall")
    root = args.root or Path(tempfile.mkdtemp(prefix="ppo-toy-"))
    (root / "logs").mkdir(parents=True, exist_ok=True)
    configure(json=True, file=open(root / "logs" / "driver.jsonl", "a", buffering=1))
    models = make_models(args.models)
    config = {"checkpoint": {"root": str(root / "checkpoints"), "keep_last": 2,
                             "save": {"async": not args.sync_save}},
              "engine": {"backend": "gloo", "bucket_bytes": 16 << 20, "timeout_s": 60}}
    recipe = CountingPPO(stall_at=args.stall_at)
    if args.stall_at is not None:  # a budget the stall overruns: reported as the phase runs
        config["watchdog"] = {"train_step_s": recipe.stall_s / 2}
    overrides = {role: {"checkpoint": {"pre_load": {"path": models["actor" if role == "rollout" else role]}}}
                 for role in ("actor", "critic", "rollout")}
    settings = DriverConfig(steps=args.steps, save_every=args.save_every, max_failures=2, work_dir=str(root),
                            address=args.address, num_cpus=None if args.address else args.num_cpus)
    print(f"PPO on a tiny Qwen2, {args.steps} steps, run folder {root}")
    hooks = Progress(None if args.no_failure else args.fail_at, args.victim)
    summary = Driver(recipe, config, settings, hooks, overrides=overrides).run()
    print(render_summary(summary, "actor/reward"))
    print(f"logs: {root / 'logs'}   trace: {summary.trace}   checkpoints: {root / 'checkpoints'}")


if __name__ == "__main__":
    main()
