"""Async save: training waits only while the state is copied to host memory.

The copy is the one part that must block, because the next optimizer step mutates the very
tensors being saved. Everything after it (the backend's write into the staging folder, the
manifest, the rename, the tracker and retention) runs on one background thread against the
copy. At most one save is in flight: the next save, resume and close wait for its commit
first, so two commits never interleave and the host buffers can be reused, which spares
the page faults of fresh memory on every save after the first.

`AsyncSaver` owns the host copy (`HostCopier`) and the background thread (`lifecycle.background`,
which also holds the `PendingSave` an async save returns)
and drives the same `lifecycle.saver.Saver` as a synchronous save: one write, agree and commit
path for both.

The copy keeps what the backends look at: the same state-dict names, tied weights still
one tensor, a module tree for `torch.distributed.checkpoint`, and an optimizer of the
worker's own class whose parameters are the copied ones (a wrapped optimizer's copy is a
`FrozenOptimizer`: the wrapper's `param_groups` would set the live optimizer's). The stand-ins
are in `lifecycle.frozen`.

From CUDA memory the copies go, non-blocking, into pinned host buffers on a side stream that
first waits for what the training's current stream has queued (the step that wrote the
weights may still be running), and that stream is synchronised once, before `save()` returns:
the next step cannot overwrite a weight still being read, and no source is freed mid-copy.
"""

from __future__ import annotations

import copy
from datetime import timedelta
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from lifecycle.background import BackgroundSaver, PendingSave
from lifecycle.contents import CONTENTS
from lifecycle.errors import CheckpointError
from lifecycle.frozen import FrozenModule, FrozenOptimizer, StateOnly, keeps_its_own_state, standing_for
from lifecycle.jsontree import NotSerializable
from lifecycle.saver import SaveJob, Saver, agree_fn
from lifecycle.store import CheckpointStore
from lifecycle.types import Parts, Progress, SaveInfo

_PLAIN = (torch.Tensor, nn.Parameter)


class NotCopyable(NotSerializable):
    """A value the host copy cannot take (`copy.deepcopy` fails on a lock, a process group): the
    cause is the copy for the background write, not the encoding a save would choose."""

    def __init__(self, where: str, key: str, value: object = None, *, type_name: str | None = None) -> None:
        super().__init__(where, key, value, type_name=type_name)
        self.args = (f"{where}: value at {key or '<root>'} of type {self.type_name} cannot be copied to host "
                     "memory for the background write",)


class HostCopier:
    """Copies state trees to host memory, into the buffers of the previous copy when they fit.

    Tensors that share a storage (tied weights, views of one flat buffer) share it in the
    copy too: each storage is copied once. A buffer is only reused once the write that read
    it has finished, which `BackgroundSaver` guarantees. Buffers for device tensors are
    pinned, so their copies are DMA transfers that need no staging through pageable memory.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: dict[str, torch.Tensor] = {}
        self._storages: dict[tuple[str, int, int], torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """id(original) -> (original, copy); holding the original keeps its id from being reused."""
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(host buffer, source bytes) of every storage met in this snapshot, copied at its end."""
        self._streams: dict[torch.device, Any] = {}
        """The side stream of each CUDA device copied from, kept across saves."""
        self.bytes = 0

    def snapshot(self, parts: Parts) -> Parts:
        """Host copies of model, optimizer and lr scheduler; the dataloader is not needed.

        Returns once every byte is in host memory: nothing of the live state is read afterwards.
        """
        self._used, self._storages, self._views, self._pending = {}, {}, {}, []
        self.bytes = 0
        try:
            model = None if parts.model is None else self._model(parts.model)
            optimizer = None if parts.optimizer is None else self._optimizer(parts.optimizer)
            scheduler = None
            if parts.lr_scheduler is not None:
                scheduler = standing_for(StateOnly(self.tree(parts.lr_scheduler.state_dict(), "lr_scheduler")),
                                          parts.lr_scheduler)
            self._copy_pending()
            self._buffers = self._used
        finally:
            self._storages, self._views, self._pending = {}, {}, []
        return Parts(model=model, optimizer=optimizer, lr_scheduler=scheduler)

    def _copy_pending(self) -> None:
        """Queue every device's copies first, copy host tensors meanwhile, then wait once per device."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for host, source in self._pending:
            by_device[source.device].append((host, source))
        host_side = by_device.pop(torch.device("cpu"), [])
        waits = [self._queue(device, pairs) for device, pairs in by_device.items()]
        for host, source in host_side:
            host.copy_(source)
        for wait in waits:
            wait()

    def _queue(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        """Non-blocking copies from one device; returns what waits for them to be done.

        CUDA: on the side stream, after all the caller's current stream has queued so far (the
        step that wrote the weights); the wait is for that stream alone, not for work on other
        streams (collectives on a communication stream). Another accelerator: on its current
        stream, then the whole device is synchronised.
        """
        if device.type != "cuda":
            for host, source in pairs:
                host.copy_(source, non_blocking=True)
            return torch.accelerator.synchronize
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for host, source in pairs:
                host.copy_(source, non_blocking=True)
        return stream.synchronize

    def tree(self, value: Any, key: str) -> Any:
        """Tensors copied to host, containers rebuilt, anything else deep-copied."""
        if isinstance(value, torch.Tensor):
            return self.tensor(value, key)
        if isinstance(value, Mapping):
            return {k: self.tree(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self.tree(v, f"{key}.{i}") for i, v in enumerate(value))
        try:
            return copy.deepcopy(value)
        except Exception as exc:  # a process group, a lock: refused typed, naming the key, as a sync save does
            raise NotCopyable("async save's host copy", key, value) from exc

    def tensor(self, t: torch.Tensor, key: str) -> torch.Tensor:
        if type(t) not in _PLAIN:
            raise CheckpointError(
                f"{key}: async save copies plain tensors, not {type(t).__name__} (sharded state); "
                "set checkpoint.save.async to false for this model"
            )
        seen = self._views.get(id(t))
        if seen is not None:
            return seen[1]
        if t.device.type == "meta":
            raise CheckpointError(f"{key}: a meta tensor holds no data; materialise it before saving")
        if t.numel() == 0:
            view = torch.empty(t.shape, dtype=t.dtype)
        else:
            host = self._storage(t, key)
            reach = (t.storage_offset() + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1) * t.itemsize
            if reach > host.numel():  # never a view past its copy (it would read other memory as weights)
                raise CheckpointError(f"{key}: the tensor reaches {reach} bytes into its storage, which holds "
                                      f"{host.numel()}")
            view = torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        self._views[id(t)] = (t, view)
        return view

    def _storage(self, t: torch.Tensor, key: str) -> torch.Tensor:
        storage = t.untyped_storage()
        # By address and size: two storages may start at one address (a numpy view's tensor) and
        # hold different lengths; each is copied whole, never one read through the other's copy.
        ident = (str(t.device), storage.data_ptr(), storage.nbytes())
        host = self._storages.get(ident)
        if host is not None:
            return host
        nbytes = storage.nbytes()
        on_device = t.device.type != "cpu"
        host = self._buffers.get(key)
        if host is None or host.numel() != nbytes or host.is_pinned() != on_device:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_device)
        source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        self._pending.append((host, source))
        self.bytes += nbytes
        self._used[key] = self._storages[ident] = host
        return host

    def _model(self, model: Any) -> Any:
        state = self.tree(model.state_dict(), "model")
        if not isinstance(model, nn.Module):
            return StateOnly(state)
        named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if n in state]
        frozen = FrozenModule(state, {n: p.requires_grad for n, p in named})
        for attr in ("config", "_tied_weights_keys"):
            if hasattr(model, attr):
                setattr(frozen, attr, getattr(model, attr))
        self._views.update({id(p): (p, frozen.get_parameter(n)) for n, p in named})
        return frozen

    def _optimizer(self, optimizer: Any) -> Any:
        if not isinstance(optimizer, torch.optim.Optimizer):
            return standing_for(StateOnly(self.tree(optimizer.state_dict(), "optimizer")), optimizer)
        groups = []
        for i, group in enumerate(optimizer.param_groups):
            hyper = self.tree({k: v for k, v in group.items() if k != "params"}, f"optimizer.group{i}")
            groups.append({**hyper, "params": [self._param(p, f"optimizer.group{i}.param{j}")
                                               for j, p in enumerate(group["params"])]})
        state: defaultdict[Any, Any] = defaultdict(dict)
        for j, (param, values) in enumerate(optimizer.state.items()):
            state[self._param(param, f"optimizer.param{j}")] = self.tree(values, f"optimizer.state{j}")
        if not keeps_its_own_state(optimizer):
            saved = self.tree(optimizer.state_dict(), "optimizer")
            defaults = self.tree(getattr(optimizer, "defaults", {}), "optimizer.defaults")
            return standing_for(FrozenOptimizer(groups, state, saved, defaults), optimizer)
        frozen = type(optimizer).__new__(type(optimizer))
        # Not the instance's own callables: an lr scheduler patches `step` onto the live optimizer,
        # bound to it, and a copy that kept it would step the live one (torch's state-dict helper
        # steps an optimizer without state once, at lr 0, to create it).
        frozen.__dict__.update({k: v for k, v in vars(optimizer).items() if not callable(v)})
        frozen.param_groups, frozen.state = groups, state
        return frozen

    def _param(self, p: torch.Tensor, key: str) -> nn.Parameter:
        """The copied model's own Parameter for a model parameter, a fresh copy otherwise."""
        copied = self.tensor(p, key)
        if not isinstance(copied, nn.Parameter):
            copied = nn.Parameter(copied, requires_grad=p.requires_grad)
            self._views[id(p)] = (p, copied)
        return copied


def _world_timeout(dist: Any) -> timedelta | None:
    """The default group's timeout, which the commit's own group keeps (a new group would take
    torch's default, 30 minutes for gloo: a stalled peer held the survivor's wait that long)."""
    try:
        default = dist.distributed_c10d._get_default_group()
        return next(default._get_backend(torch.device(kind)).options._timeout for kind in ("cpu", "cuda")
                    if torch.device(kind) in default._device_types)
    except (AttributeError, RuntimeError, StopIteration, ValueError):  # another torch, or no such backend
        return None


class AsyncSaver:
    """The async path of a `Saver`: what cannot wait is staged now, the rest in the background.

    `extra` (RNG states, data position) is written at once, as it stands at this step (the
    table's `copied_for_async`); the other contents are copied to host in the same agreed
    round, then written from the copy and committed by the same `Saver` on the background
    thread. The writer lock goes with the save and is released after its commit.
    """

    def __init__(self, saver: Saver, *, own_barrier: bool) -> None:
        """`own_barrier`: the caller gave the store a barrier of its own, which the background
        thread shares; else its commit runs on a gloo group of its own."""
        self.saver = saver
        self.copier = HostCopier()
        self.background = BackgroundSaver(saver.at.role)
        self._own_barrier = own_barrier
        self._commit_store: CheckpointStore | None = None
        self._group: Any = None
        """The gloo group the background commit's barriers and agreement run on (several ranks)."""

    def save(self, job: SaveJob, parts: Parts, progress: Progress) -> PendingSave:
        """Return once the state is copied; `committed` resolves when the background commit is done."""
        now = [c for c in job.writer.wanted if not CONTENTS[c].copied_for_async]
        collective = self.saver.at.collective()
        later = [c for c in job.writer.wanted if c not in now]
        try:
            store = self._background_store()
            staged = self.saver.stage(job, parts, progress, now, also=lambda: self.copier.snapshot(parts))
        except BaseException:
            job.release()
            raise

        def write_and_commit() -> SaveInfo:
            try:
                self._check_group(job.step, collective)
                written = self.saver.write(job, staged.folder, staged.also, progress, later, group=self._group)
                self._check_group(job.step, collective)
                return self.saver.commit(job, staged.written | written, store)
            finally:
                job.release()

        try:
            committed = self.background.submit(job.step, write_and_commit)
        except BaseException:
            if self.background.in_flight() != job.step:  # else the write runs, and releases the lock itself
                job.release()
            raise
        return PendingSave(step=job.step, path=self.saver.at.store().role_dir(job.step, self.saver.at.role),
                           contents=list(job.writer.wanted), backend=job.writer.name, bytes=self.copier.bytes,
                           seconds=time.perf_counter() - job.started, committed=committed)

    @staticmethod
    def _check_group(step: int, collective: bool) -> None:
        """A save begun across ranks goes on only while their process group exists: once it is
        destroyed, a rank would take itself for the only one (rank 0, writing what rank 0 alone
        writes) and skip the agreement its peers wait in. Wait for the save (`lc.close()`, or
        the `PendingSave`'s `wait()`) before `destroy_process_group`."""
        if collective:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise CheckpointError(f"async save of step {step}: the process group was destroyed while it was "
                                      "in flight; wait for it (lc.close()) before destroy_process_group()")

    def wait(self, *, raise_failure: bool = True) -> SaveInfo | None:
        """Block until the save in flight (if any) has committed; its failure is raised once."""
        return self.background.wait(raise_failure=raise_failure)

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread."""
        self.background.close()

    def _background_store(self) -> CheckpointStore:
        """The commit's barriers run on the background thread: never on the group training uses."""
        store, world_size = self.saver.at.store(), self.saver.at.world_size
        if world_size <= 1 or self._own_barrier:
            return store
        if self._commit_store is None:
            import torch.distributed as dist

            group = self._group = dist.new_group(backend="gloo", timeout=_world_timeout(dist))
            self._commit_store = CheckpointStore(store.root, rank=store.rank, world_size=world_size,
                                                 barrier=partial(dist.barrier, group=group),
                                                 agree=agree_fn(self.saver.at.collective(), group))
        return self._commit_store
