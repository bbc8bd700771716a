"""The commit protocol as a model, checked: zarrckpt's own save, load, delete, gc and manager code, run
as concurrent actors against an in-memory object store whose every request is one step of an explicit
schedule, under a virtual clock.

Each actor is a thread running real zarrckpt code. Every request it makes to the store (list, read,
write, create-only write, delete, stat) first stops at a gate; the scheduler lets exactly one stopped
actor make its request at a time, so a schedule is a sequence of single requests, and a seed picks it.
Between requests the scheduler may also let virtual time pass (heartbeats fall due, leases run out)
or kill a process (its actors never make another request: kill -9). Heartbeats are actors too, waking
on the virtual clock, so a schedule can starve one past its lease (a paused process).

After every step and at the end the invariants of docs/FORMAT.md §6 are checked:

- I1 a save that returned OK stays committed, and verifies, until a deletion asked for it;
- I2 no live save's location is taken away (its pending marker deleted, its manifest's place taken)
  but by a deletion that was told to (``rm --force``);
- I3 nothing is stored that ``ls`` cannot see: every non-empty location has a state;
- I4 a load returns the data of one save that committed, never a mix, never an uncommitted one;
- I5 once every actor has ended and the leases have run out, ``gc`` leaves committed checkpoints only.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import fsspec
import torch
from fsspec.spec import AbstractFileSystem

import zarrckpt
import zarrckpt.lifecycle
from zarrckpt.engine import clock, markers, writerid
from zarrckpt.engine.prefix import state
from zarrckpt.format.manifest import MANIFEST, PENDING, tombstone_marker
from zarrckpt.storage import remote

ROOT = "zmodel://run"
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
CLIENT = __name__.split(".", 1)[0]  # what zarrckpt calls the model's client (its module's name)


class Killed(BaseException):
    """A killed process's actor meets this at its next request (nothing on the way catches it)."""


class Hang(AssertionError):
    """An actor neither reached a request nor ended in real time: a deadlock outside the model."""


@dataclass(eq=False)
class Proc:
    """A process: its actors share its identity and die together."""

    name: str
    pid: int
    host: str  # "here" (the model's own kernel and PID namespace) or another's
    killed: bool = False
    actors: list[Actor] = field(default_factory=list)

    @property
    def identity(self) -> dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "boot": f"boot-{self.host}", "pidns": "pid:[1]", "start": 1}

    def ended(self) -> bool:
        return self.killed or all(a.state == "done" for a in self.actors)


@dataclass(eq=False)
class Actor:
    name: str
    proc: Proc
    state: str = "run"  # run | gate | sleep | join | done
    op: str = ""
    wake: float = 0.0
    event: threading.Event | None = None
    joining: Actor | None = None
    deadline: float | None = None  # its next request relies on a check valid until then (clock.relying_until)
    asking: str | None = None  # a deletion of this url was asked for: recorded when its next request (its look) runs
    go: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    thread: threading.Thread | None = None


@dataclass
class Save:
    """What a save actor did: its value (every element of its tensors), url and, once prepared, save id."""

    proc: Proc
    url: str
    value: int
    save_id: str | None = None
    ok: bool = False
    done_at: int = -1  # the step at which it returned OK


class World:
    """One schedule: the store, the clock, the actors, the scheduler and the invariants' evidence."""

    def __init__(self, seed: int, *, kill_rate: float = 0.02, tick_rate: float = 0.15) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.kill_rate, self.tick_rate = kill_rate, tick_rate
        # odd seeds schedule by priorities (PCT): the highest-priority actor that can go goes, and at a
        # few random steps the one going drops to the lowest, which starves it (a paused process) until
        # only lower ones are left: the long stalls races need, found far more often than by coin flips
        self.pct = seed % 2 == 1
        self.priority: dict[int, float] = {}
        self.drops = {self.rng.randrange(1, 150) for _ in range(3)}
        self.cond = threading.Condition()
        self.now = 0.0
        self.files: dict[str, tuple[bytes, float]] = {}  # path -> (bytes, virtual mtime)
        self.procs: list[Proc] = []
        self.actors: list[Actor] = []
        self.steps = 0
        self.trace: list[str] = []
        self.violations: list[str] = []
        self.saves: list[Save] = []
        self.committed: dict[str, int] = {}  # save id -> value, once a real manifest of it was created
        self.commit_step: dict[str, int] = {}  # save id -> the step that created its manifest
        self.lapsed: set[str] = set()  # locations whose save once went a lease without a heartbeat
        self.values: dict[str, int] = {}  # save id -> value (from its pending marker's creator)
        self.forced: set[str] = set()  # procs allowed to take a live save's place (rm --force)
        self.asked: dict[str, list[int]] = {}  # url -> steps at which a requested deletion started there

    # -- actors -----------------------------------------------------------------------------
    def process(self, name: str, *, host: str = "here") -> Proc:
        proc = Proc(name, 1000 + len(self.procs), host)
        self.procs.append(proc)
        return proc

    def spawn(self, proc: Proc, name: str, fn: Callable[[], Any]) -> Actor:
        actor = Actor(name, proc)
        proc.actors.append(actor)

        def run() -> None:
            _here.actor = actor
            try:
                actor.result = fn()
            except BaseException as e:  # (Killed included)
                actor.error = e
            finally:
                with self.cond:
                    actor.state = "done"
                    self.cond.notify_all()

        thread = threading.Thread(target=run, name=f"model-{name}", daemon=True)
        actor.thread = thread
        with self.cond:
            self.actors.append(actor)
        thread.start()
        return actor

    def current(self) -> Actor:
        actor: Actor | None = getattr(_here, "actor", None)
        if actor is None or actor not in self.actors:
            raise AssertionError(f"a thread outside the model made a request: {threading.current_thread().name}")
        return actor

    def _block(self, actor: Actor, how: str) -> None:
        """Stop ``actor`` (the calling thread) until the scheduler lets it go on."""
        with self.cond:
            if actor.proc.killed:
                raise Killed(actor.name)
            actor.state = how
            actor.go.clear()
            self.cond.notify_all()
        actor.go.wait()
        if actor.proc.killed:
            raise Killed(actor.name)

    def gate(self, op: str) -> None:
        actor = self.current()
        actor.op = op
        self._block(actor, "gate")

    def sleep(self, seconds: float, event: threading.Event | None = None) -> bool:
        actor = self.current()
        actor.wake, actor.event = self.now + seconds, event
        self._block(actor, "sleep")
        return event is not None and event.is_set()

    def join(self, thread: threading.Thread) -> None:
        actor = self.current()
        target = next(a for a in self.actors if a.thread is thread)
        if target.state == "done":
            return
        actor.joining = target
        self._block(actor, "join")

    # -- the scheduler ----------------------------------------------------------------------
    def _settled(self) -> bool:
        return all(a.state != "run" for a in self.actors)

    def _runnable(self, a: Actor) -> bool:
        if a.state == "gate":
            return True
        if a.state == "sleep":
            return a.wake <= self.now or (a.event is not None and a.event.is_set())
        if a.state == "join":
            return a.joining is not None and a.joining.state == "done"
        return False

    def run(self, max_steps: int = 3000, hang_seconds: float = 30.0) -> None:
        while True:
            with self.cond:
                deadline = time.monotonic() + hang_seconds
                while not self._settled():
                    if not self.cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                        raise Hang(self._stacks())
                live = [a for a in self.actors if a.state != "done"]
                if not live:
                    return
                ready = [a for a in live if self._runnable(a)]
                self.steps += 1
                if self.steps > max_steps:
                    raise AssertionError(f"seed {self.seed}: no end after {max_steps} steps\n" + self.tail())
                sleepers = [a for a in live if a.state == "sleep"]
                if not ready or (sleepers and self.rng.random() < self.tick_rate):
                    if not sleepers:
                        raise AssertionError(f"seed {self.seed}: every actor waits on another\n" + self.tail())
                    if self._tick(min(a.wake for a in sleepers) if not ready else None) or not ready:
                        continue
                victims = [p for p in self.procs if not p.ended() and p.name != "final"]
                if victims and self.rng.random() < self.kill_rate:
                    victim = self.rng.choice(victims)
                    victim.killed = True
                    self.trace.append(f"{self.steps} t={self.now:.0f} KILL {victim.name}")
                    for a in victim.actors:
                        if a.state != "done":
                            a.state = "run"  # (unwinding now: waited for like any running actor)
                        a.go.set()
                    continue
                actor = self._choose(ready)
                if actor.state == "gate":
                    actor.deadline = None  # the request it relied on a check for runs now
                if actor.asking is not None and actor.state == "gate":
                    self.asked.setdefault(actor.asking, []).append(self.steps)
                    actor.asking = None
                self.trace.append(
                    f"{self.steps} t={self.now:.0f} {actor.name}: {actor.op if actor.state == 'gate' else actor.state}"
                )
                actor.state = "run"
                actor.go.set()
            self.check_visible()

    def _choose(self, ready: list[Actor]) -> Actor:
        if not self.pct:
            return self.rng.choice(ready)
        for a in ready:
            self.priority.setdefault(id(a), self.rng.random())
        actor = max(ready, key=lambda a: self.priority[id(a)])
        if self.steps in self.drops:
            self.priority[id(actor)] = -self.rng.random()
            actor = max(ready, key=lambda a: self.priority[id(a)])
        return actor

    def _tick(self, until: float | None) -> bool:
        """Let time pass (to ``until`` at least), but never to an armed actor's deadline: the protocol's
        assumption that no process pauses that long between a check and the request relying on it."""
        step = self.rng.choice((1.0, 4.0, 11.0, 31.0))
        target = max(self.now + step, until or 0.0)
        armed = [a.deadline for a in self.actors if a.deadline is not None and a.state != "done" and not a.proc.killed]
        if armed:
            target = min(target, min(armed) - 0.5)
        if target <= self.now:
            return False
        self.now = target
        self.trace.append(f"{self.steps} t={self.now:.1f} (time passes)")
        return True

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.trace[-n:])

    def _stacks(self) -> str:
        frames = sys._current_frames()
        out = [f"seed {self.seed}: an actor hangs outside the model"]
        for a in self.actors:
            if a.state == "run" and a.thread is not None and a.thread.ident in frames:
                out.append(f"--- {a.name}\n" + "".join(traceback.format_stack(frames[a.thread.ident])))
        return "\n".join(out) + "\n" + self.tail()

    # -- the store ----------------------------------------------------------------------------
    def stored(self, path: str) -> tuple[bytes, float]:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path]

    def put(self, path: str, data: bytes, create: bool) -> None:
        if create and path in self.files:
            raise FileExistsError(path)
        actor = self.current()
        name = path.rsplit("/", 1)[-1]
        if name == PENDING and create:
            doc = json.loads(data)
            self.values[doc["save_id"]] = _VALUE.get(actor.proc.name, -1)
            for s in self.saves:
                if s.proc is actor.proc and s.url.endswith(path.rsplit("/", 1)[0].split("/", 1)[-1]):
                    s.save_id = doc["save_id"]
        if name == MANIFEST and path.count("/") == 2:
            if tombstone_marker(data) is not None:
                if create:
                    self._taking(actor, path.rsplit("/", 1)[0], "its manifest's place taken")
            else:
                save_id = json.loads(data)["attributes"]["zarrckpt"]["save_id"]
                self.committed[save_id] = self.values.get(save_id, -1)
                self.commit_step.setdefault(save_id, self.steps)
        if name.startswith(PENDING):  # a save's heartbeat: did it ever go a lease without one?
            prefix = path.rsplit("/", 1)[0]
            last = max((m for p, (_, m) in self.files.items() if p.startswith(f"{prefix}/{PENDING}")), default=None)
            if last is not None and self.now - last >= markers.lease_seconds():
                self.lapsed.add(prefix)
            elif name == PENDING:
                self.lapsed.discard(prefix)
        self.files[path] = (data, self.now)

    def remove(self, path: str) -> None:
        if path not in self.files:
            raise FileNotFoundError(path)
        actor = self.current()
        prefix = path.rsplit("/", 1)[0]
        claimed = tombstone_marker(self.files.get(f"{prefix}/{MANIFEST}", (b"", 0.0))[0]) is not None
        if path.rsplit("/", 1)[-1] == PENDING and not claimed:  # (once claimed, I2 was judged at the claim)
            self._taking(actor, prefix, "its pending marker deleted, its manifest's place not taken first")
        if path.rsplit("/", 1)[-1] == MANIFEST and path.count("/") == 2:
            raw = self.files[path][0]
            if tombstone_marker(raw) is None:
                save_id = json.loads(raw)["attributes"]["zarrckpt"]["save_id"]
                for s in self.saves:
                    if s.save_id == save_id and s.ok and not self._asked_after(s):
                        self.violations.append(
                            f"I1 step {self.steps}: {actor.name} deleted the manifest of {s.proc.name}'s save, "
                            "which returned OK and no deletion asked for"
                        )
        del self.files[path]

    def _asked_after(self, save: Save) -> bool:
        """Whether a deletion of ``save``'s location was asked for (rm, overwrite, retention) once it committed."""
        committed = self.commit_step.get(save.save_id or "", save.done_at)
        return any(step >= committed for step in self.asked.get(save.url, []))

    def _taking(self, actor: Actor, prefix: str, how: str) -> None:
        """I2: ``actor`` takes the location ``prefix`` away from the save holding it (decides to: takes its
        manifest's place): fine unless that save is live (its save call running, its marker's objects
        written within the lease, and never a lease apart since it began) and ``actor`` was not told to."""
        doc = json.loads(self.files.get(f"{prefix}/{PENDING}", (b"{}", 0.0))[0] or b"{}")
        for s in self.saves:
            if s.save_id != doc.get("save_id") or s.proc is actor.proc:
                continue
            running = any(a.state != "done" and a.name == s.proc.name for a in s.proc.actors)
            fresh = [m for p, (_, m) in self.files.items() if p.startswith(f"{prefix}/{PENDING}")]
            fresh_now = fresh and self.now - max(fresh) < markers.lease_seconds()
            live = running and not s.proc.killed and fresh_now and prefix not in self.lapsed
            if live and actor.proc.name not in self.forced:
                self.violations.append(
                    f"I2 step {self.steps}: {actor.name} took {prefix} from live {s.proc.name} ({how})"
                )

    def listing(self, prefix: str) -> list[str]:
        return sorted(p for p in self.files if p.startswith(prefix.rstrip("/") + "/"))

    def check_visible(self) -> None:
        """I3: every location under the root that holds objects has a state ``ls`` shows."""
        locations: dict[str, set[str]] = {}
        for path in self.files:
            parts = path.split("/")
            if len(parts) >= 3:
                locations.setdefault("/".join(parts[:2]), set()).add(parts[2])
        for loc, names in locations.items():
            if state(names) is None:
                self.violations.append(f"I3 step {self.steps}: {loc} holds {sorted(names)} but no marker or manifest")


_VALUE: dict[str, int] = {}  # process name -> the value its save writes
_here = threading.local()  # .actor: the actor a model thread runs
WORLD: World | None = None


class ModelFS(AbstractFileSystem):
    """The object store of the current :data:`WORLD`: every request is one scheduled, atomic step."""

    protocol = "zmodel"
    cachable = False

    @property
    def w(self) -> World:
        assert WORLD is not None
        return WORLD

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        self.w.gate(f"GET {path}")
        return self.w.stored(path)[0][start:end]

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> None:
        self.w.gate(f"{'CREATE' if mode == 'create' else 'PUT'} {path}")
        self.w.put(path, bytes(value), mode == "create")

    def rm_file(self, path: str) -> None:
        self.w.gate(f"DELETE {path}")
        self.w.remove(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        """One request (S3's DeleteObjects) deleting every path given, or all under ``path``."""
        self.w.gate(f"DELETE {path if isinstance(path, str) else ' '.join(path)}{'/**' if recursive else ''}")
        for p in list(path) if isinstance(path, list) else self.w.listing(path) if recursive else [path]:
            if p in self.w.files:
                self.w.remove(p)

    def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
        path = path.rstrip("/")
        self.w.gate(f"LIST {path}/")
        entries: dict[str, dict[str, Any]] = {}
        for p in self.w.listing(path):
            head = p[len(path) + 1 :].split("/", 1)
            name = f"{path}/{head[0]}"
            if len(head) == 1:
                entries[name] = {"name": name, "type": "file", "size": len(self.w.files[p][0])}
            else:
                entries.setdefault(name, {"name": name, "type": "directory", "size": 0})
        if not entries:
            raise FileNotFoundError(path)
        return list(entries.values()) if detail else sorted(entries)

    def find(
        self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kw: Any
    ) -> Any:
        self.w.gate(f"LIST {path}/**")
        found = {p: {"name": p, "type": "file", "size": len(self.w.files[p][0])} for p in self.w.listing(path)}
        return found if detail else sorted(found)

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        self.w.gate(f"HEAD {path}")
        return {"name": path, "type": "file", "size": len(self.w.stored(path)[0])}

    def modified(self, path: str) -> datetime:
        self.w.gate(f"HEAD {path}")
        return EPOCH + timedelta(seconds=self.w.stored(path)[1])

    def exists(self, path: str, **kw: Any) -> bool:
        self.w.gate(f"HEAD {path}")
        return path in self.w.files

    def invalidate_cache(self, path: str | None = None) -> None:
        pass


fsspec.register_implementation("zmodel", ModelFS, clobber=True)


@contextmanager
def modelled(world: World) -> Iterator[World]:
    """Run zarrckpt against ``world``: its store, clocks, heartbeats and process identities."""
    global WORLD
    saved = (
        clock.wall, clock.monotonic, clock.sleep, clock.wait, clock.relying_until, writerid.writer_identity,
        writerid.proc_stat, markers._Heartbeat.start, markers._Heartbeat.stop, remote.ATOMIC_CREATE_CLIENTS,
    )  # fmt: skip

    def start(self: markers._Heartbeat) -> None:
        key = (self.storage.url, self.name, markers.token(self.doc))
        with self._lock:
            self._running[key] = self
            markers._STARTED[key] = self.doc["started"]
        actor = world.current()
        self.thread = world.spawn(actor.proc, f"{actor.proc.name}-beat", self._run).thread  # type: ignore[assignment]

    def stop(cls: type[markers._Heartbeat], url: str, save_id: str, name: str) -> None:
        with cls._lock:
            beat = cls._running.pop((url, name, save_id), None)
        if beat is not None:
            beat.stopped.set()
            world.join(beat.thread)

    def proc_stat(pid: int) -> tuple[str, int] | None:
        found = [p for p in world.procs if p.pid == pid]
        return None if not found or found[0].ended() else ("S", 1)

    import zarrckpt.deleter as deleter_module

    retention_delete = deleter_module.delete

    def retention(url: str, **kwargs: Any) -> bool:  # retention asks for a committed checkpoint's deletion
        world.current().asking = url
        return retention_delete(url, **kwargs)

    WORLD = world
    deleter_module.delete = retention  # type: ignore[assignment]
    clock.wall = lambda: EPOCH + timedelta(seconds=world.now)  # type: ignore[assignment]
    clock.monotonic = lambda: world.now  # type: ignore[assignment]
    clock.sleep = lambda seconds: world.sleep(seconds) and None  # type: ignore[assignment,func-returns-value]
    clock.wait = lambda event, seconds: world.sleep(seconds, event)  # type: ignore[assignment]
    clock.relying_until = lambda deadline: setattr(world.current(), "deadline", deadline)  # type: ignore[assignment]
    writerid.writer_identity = lambda: dict(world.current().proc.identity)  # type: ignore[assignment]
    writerid.proc_stat = proc_stat  # type: ignore[assignment]
    markers._Heartbeat.start = start  # type: ignore[method-assign]
    markers._Heartbeat.stop = classmethod(stop)  # type: ignore[method-assign,assignment]
    remote.ATOMIC_CREATE_CLIENTS = (*remote.ATOMIC_CREATE_CLIENTS, CLIENT)
    try:
        yield world
    finally:
        (
            clock.wall, clock.monotonic, clock.sleep, clock.wait, clock.relying_until, writerid.writer_identity,
            writerid.proc_stat, markers._Heartbeat.start, markers._Heartbeat.stop, remote.ATOMIC_CREATE_CLIENTS,
        ) = saved  # fmt: skip
        deleter_module.delete = retention_delete  # type: ignore[assignment]
        WORLD = None


# -- the actors' programs -------------------------------------------------------------------------
def tensors(value: int) -> dict[str, Any]:
    return {"a": torch.full((4,), float(value)), "b": torch.full((2, 2), float(value)), "step": value}


def url_of(step: int) -> str:
    return f"{ROOT}/step_{step:010d}"


class Inline:
    """The manager's deleter, run on the calling actor (its requests join the schedule)."""

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from concurrent.futures import Future

        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Killed:
            raise
        except BaseException as e:
            future.set_exception(e)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


class Scenario:
    """Processes of one schedule, and what they are allowed to delete."""

    def __init__(self, world: World) -> None:
        self.w = world
        self.value = 0

    def _proc(self, kind: str, *, host: str = "here") -> Proc:
        return self.w.process(f"{kind}{len(self.w.procs)}", host=host)

    def _record(self, proc: Proc, url: str) -> Save:
        self.value += 1
        _VALUE[proc.name] = self.value
        rec = Save(proc, url, self.value)
        self.w.saves.append(rec)
        return rec

    def _asking(self, url: str) -> None:
        """The calling actor is about to decide on deleting ``url`` as asked (rm, overwrite, retention)."""
        self.w.current().asking = url

    def save(self, step: int, *, overwrite: bool = False, restart: bool = False, host: str = "here") -> None:
        proc = self._proc("restart" if restart else "overwrite" if overwrite else "save", host=host)
        rec = self._record(proc, url_of(step))

        def run() -> None:
            if restart:
                zarrckpt.lifecycle.await_dead_save(rec.url)
            if overwrite:
                self._asking(rec.url)
            zarrckpt.save(tensors(rec.value), rec.url, overwrite=overwrite)
            rec.ok, rec.done_at = True, self.w.steps

        self.w.spawn(proc, proc.name, run)

    def manager(self, steps: list[int], *, keep_last: int = 100, host: str = "here") -> None:
        proc = self._proc("manager", host=host)
        recs = [self._record(proc, url_of(s)) for s in steps]

        def run() -> None:
            m = zarrckpt.CheckpointManager(ROOT, interval=1, keep_last=keep_last, async_save=False)
            m.deleter.pool = Inline()  # type: ignore[assignment]
            for step, rec in zip(steps, recs, strict=True):
                _VALUE[proc.name] = rec.value
                try:
                    m.save(step, tensors(rec.value))
                    rec.ok, rec.done_at = True, self.w.steps
                except zarrckpt.CheckpointSaveError:
                    pass

        self.w.spawn(proc, proc.name, run)

    def gc(self, rounds: int = 2) -> None:
        proc = self._proc("gc")

        def run() -> None:
            for _ in range(rounds):
                zarrckpt.collect_garbage(ROOT, grace_seconds=0)
                clock.sleep(self.w.rng.choice((1.0, 11.0, 31.0)))

        self.w.spawn(proc, proc.name, run)

    def cleanup(self) -> None:
        proc = self._proc("cleanup")

        def run() -> None:
            m = zarrckpt.CheckpointManager(ROOT, interval=1, keep_last=100, async_save=False, grace_seconds=0)
            m.deleter.pool = Inline()  # type: ignore[assignment]
            m.cleanup()

        self.w.spawn(proc, proc.name, run)

    def delete(self, step: int, *, force: bool = False) -> None:
        proc = self._proc("rmforce" if force else "rm")
        if force:
            self.w.forced.add(proc.name)

        def run() -> None:
            self._asking(url_of(step))
            zarrckpt.delete(url_of(step), force=force)

        self.w.spawn(proc, proc.name, run)

    def read(self, step: int) -> None:
        proc = self._proc("read")
        url = url_of(step)

        def run() -> None:
            got = tensors(-1)
            zarrckpt.load(got, url)
            values = {int(got["a"][0]), int(got["b"][0, 0]), int(got["step"])}
            whole = torch.equal(got["a"], torch.full((4,), float(got["step"])))
            committed = set(self.w.committed.values())
            if len(values) != 1 or not whole or not values <= committed:
                self.w.violations.append(f"I4: {proc.name} loaded {values} from {url}; committed: {committed}")

        self.w.spawn(proc, proc.name, run)


def finish(world: World) -> None:
    """I5 and I1 once every actor has ended: the leases run out, ``gc`` runs twice (lingering deletions
    finish on the second), and then only committed checkpoints are left, each verifying; every save
    that returned OK and that no deletion was asked for is among them."""
    proc = world.process("final")
    report: dict[str, Any] = {}

    def run() -> None:
        rounds = 0
        for attempt in range(8):  # (a deletion whose heartbeat the schedule starved stops: it goes again)
            clock.sleep(3 * markers.lease_seconds())
            try:
                zarrckpt.collect_garbage(ROOT, grace_seconds=0)
            except zarrckpt.ZarrckptError as e:
                world.trace.append(f"final gc, attempt {attempt}: {e}")
                continue
            rounds += 1
            if rounds == 2:
                break
        for name, st in zarrckpt.list_checkpoints(ROOT).items():
            url = f"{ROOT}/{name}"
            if st != "committed":
                report[url] = f"left {st}"
                continue
            ckpt = zarrckpt.open(url)
            problems = ckpt.verify()["problems"]
            report[url] = (ckpt.manifest.save_id, problems)

    world.spawn(proc, proc.name, run)
    world.kill_rate = world.tick_rate = 0.0  # quiet now: time passes only when every actor waits for it,
    world.pct = False  # and no heartbeat starves
    world.run()
    final = proc.actors[0]
    if final.error is not None:
        world.violations.append(f"I5: the final gc failed: {final.error!r}")
        return
    for url, what in report.items():
        if isinstance(what, str) or what[1]:
            world.violations.append(f"I5: {url}: {what}")
    world.check_visible()
    for path in world.files:
        prefix = "/".join(path.split("/")[:2])
        if f"zmodel://{prefix}" not in report:
            world.violations.append(f"I5: {path} is left outside any checkpoint")
    for s in world.saves:
        if s.ok and not world._asked_after(s):
            found = report.get(s.url)
            if not isinstance(found, tuple) or found[0] != s.save_id:
                world.violations.append(f"I1: {s.proc.name}'s save to {s.url} returned OK, and is gone: {found}")


def explore(seed: int, build: Callable[[Scenario], None]) -> World:
    """Run one schedule of the scenario ``build`` makes; returns the world (``violations`` empty: it held)."""
    world = World(seed)
    with modelled(world):
        build(Scenario(world))
        world.run()
        for a in world.actors:
            if a.error is not None and not isinstance(a.error, (Killed, zarrckpt.ZarrckptError)):
                world.violations.append(f"{a.name} failed unexpectedly: {a.error!r}")
        finish(world)
    return world


# -- the families of schedules (tests/test_protocol_model.py) --------------------------------------
def _no_deletions_asked(sc: Scenario) -> None:
    """Two to four of: saves, restarted jobs (on this host or another), gc, manager cleanup, loads, managers."""
    r = sc.w.rng
    for _ in range(r.randint(2, 4)):
        kind, step, host = r.choice(KINDS), r.choice([1, 2]), r.choice(["here", "other"])
        if kind == "save":
            sc.save(step, host=host)
        elif kind == "restart":
            sc.save(step, restart=True, host=host)
        elif kind == "gc":
            sc.gc()
        elif kind == "cleanup":
            sc.cleanup()
        elif kind == "read":
            sc.read(step)
        else:
            sc.manager(r.sample([1, 2, 3], 2), host=host)


def _deletions_asked(sc: Scenario) -> None:
    """As :func:`_no_deletions_asked`, and one deletion asked for: rm, rm --force, overwrite, retention of one."""
    _no_deletions_asked(sc)
    r = sc.w.rng
    kind, step = r.choice(["rm", "rmforce", "overwrite", "retain"]), r.choice([1, 2])
    if kind == "rm":
        sc.delete(step)
    elif kind == "rmforce":
        sc.delete(step, force=True)
    elif kind == "overwrite":
        sc.save(step, overwrite=True)
    else:
        sc.manager([3, 4], keep_last=1)


def _stalled_save(sc: Scenario) -> None:
    """One save against a gc loop, maybe a restarted job and a manager cleanup: leases run out."""
    r = sc.w.rng
    sc.save(1, host=r.choice(["here", "other"]))
    sc.gc(rounds=6)
    if r.random() < 0.5:
        sc.save(1, restart=True, host=r.choice(["here", "other"]))
    if r.random() < 0.5:
        sc.cleanup()


KINDS = ("save", "save", "restart", "gc", "cleanup", "read", "manager")
FAMILIES: dict[str, Callable[[Scenario], None]] = {"a": _no_deletions_asked, "b": _deletions_asked, "c": _stalled_save}

if __name__ == "__main__":  # python tests/protocol_model.py FAMILY SEED: replay one schedule, print its trace
    import os

    os.environ["ZARRCKPT_CONCURRENCY"] = "1"
    replayed = explore(int(sys.argv[2]), FAMILIES[sys.argv[1]])
    print("\n".join(replayed.trace))
    print("\n".join(replayed.violations) or "every invariant held")
