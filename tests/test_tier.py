"""The local tier (zarrckpt.LocalTier): host-memory steps with copies on peer nodes, restored from
whatever survived, under any world size. Nodes are simulated by node names (ZARRCKPT_NODE), each
with its own directory; every multi-rank test runs real processes over gloo."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from docexamples import run_example
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.multiprocessing.spawn import ProcessException

import zarrckpt
from zarrckpt.testing import spawn
from zarrckpt.tier import nodedir
from zarrckpt.tier.layout import Nodes, StepSeen, check_replicas, choose, senders

# --- the documented example ---


@pytest.mark.slow
def test_the_documented_example_runs_as_a_script(tmp_path: Path) -> None:
    """docs/tiers.md's example: 2 nodes of 2 ranks save; node1 is lost; 4 ranks, then 2, resume from memory."""
    done = run_example("tiers.md", "tier-example", tmp_path)
    assert done.stdout.splitlines() == ["resumed at step 14 on 4 ranks", "resumed at step 14 on 2 ranks"], done.stdout
    assert zarrckpt.committed_steps(tmp_path / "remote") == [0, 10], "the restores read local steps: 14 is not remote"


# --- the rules (pure) ---


def test_replicas_go_to_the_next_nodes_at_the_same_local_index() -> None:
    nodes = Nodes.of(["a", "a", "b", "b", "c", "c"])
    assert nodes.names == ("a", "b", "c") and nodes.ranks == ((0, 1), (2, 3), (4, 5))
    assert nodes.replica_ranks(1, 1) == [3] and nodes.replica_ranks(5, 1) == [1]
    assert nodes.replica_ranks(0, 2) == [2, 4]
    assert nodes.replica_sources(2, 1) == [0] and nodes.replica_sources(0, 2) == [2, 4]
    uneven = Nodes.of(["a", "a", "a", "b"])
    assert [uneven.replica_ranks(r, 1) for r in range(4)] == [[3], [3], [3], [0]]
    assert uneven.lead(0) and uneven.lead(3) and not uneven.lead(1)


def test_replicas_that_cannot_be_placed_are_refused() -> None:
    why = check_replicas(Nodes.of(["a", "a"]), 1)
    assert why is not None and "at least 2 nodes" in why and "ZARRCKPT_NODE" in why
    assert check_replicas(Nodes.of(["a", "a"]), 0) is None
    assert check_replicas(Nodes.of(["a", "b", "c"]), 2) is None
    assert check_replicas(Nodes.of(["a", "b"]), 2) is not None


def _seen(
    step: int, sid: str, held: tuple[int, ...], committed: bool = True, world: int = 4, at: float = 1.0
) -> StepSeen:
    return StepSeen(step, sid, world, committed, held, at)


def test_choose_the_newest_step_every_rank_of_which_survives() -> None:
    a = "a" * 32
    b = "b" * 32
    seen = {
        "n0": [_seen(20, b, (0, 1, 2, 3)), _seen(10, a, (0, 1, 2, 3))],  # (its own and its partner's)
        "n2": [_seen(10, a, (2, 3))],
    }
    got = choose(seen)
    assert got is not None and (got.step, got.save_id, got.holders) == (20, b, ("n0",))
    tie = choose(seen, newer_than=20)
    assert tie is not None and tie.step == 20, "a step in both tiers is read from the local one"
    assert choose(seen, newer_than=21) is None, "a newer remote step wins"
    partial = {"n0": [_seen(20, b, (0, 1)), _seen(10, a, (0, 1))], "n1": [_seen(10, a, (2, 3))]}
    got = choose(partial)
    assert got is not None and got.step == 10 and got.holders == ("n0", "n1"), "step 20 lost ranks 2 and 3"
    uncommitted = {"n0": [_seen(20, b, (0, 1, 2, 3), committed=False)]}
    assert choose(uncommitted) is None, "no node saw step 20 committed"
    elsewhere = {"n0": [_seen(20, b, (0, 1), committed=False)], "n1": [_seen(20, b, (2, 3))]}
    assert choose(elsewhere) is not None, "one node's committed marker is enough: every copy existed"


def test_two_saves_of_one_step_never_mix() -> None:
    old, new = "a" * 32, "b" * 32
    seen = {
        "n0": [_seen(15, old, (0, 1), at=1.0), _seen(15, new, (0, 1), at=2.0)],
        "n1": [_seen(15, old, (2, 3), at=1.0)],
    }
    got = choose(seen)
    assert got is not None and got.save_id == old, "only the old save of step 15 survives whole"
    seen["n1"].append(_seen(15, new, (2, 3), at=2.0))
    got = choose(seen)
    assert got is not None and got.save_id == new, "of two whole saves of a step, the later one"
    torn_world = {"n0": [_seen(15, old, (0, 1), world=4)], "n1": [_seen(15, old, (2, 3, 4, 5), world=6)]}
    assert choose(torn_world) is None


def test_a_node_returning_with_a_higher_step_of_an_earlier_run_restores_it_whole() -> None:
    """A job lost node0, went back to remote step 20 on node0 alone and saved to 26; node1 comes back
    holding step 28 of the earlier run, whole (a trial found it): the most progress, never a mix."""
    old, new = "a" * 32, "b" * 32
    seen = {"n0": [_seen(26, new, (0, 1), world=2, at=2.0)], "n1": [_seen(28, old, (0, 1, 2, 3), at=1.0)]}
    got = choose(seen, newer_than=20)
    assert got is not None and (got.step, got.save_id, got.holders) == (28, old, ("n1",))


def test_pruning_keeps_a_whole_step_another_node_saw_committed(tmp_path: Path) -> None:
    """A kill between two nodes' committed markers: this node's copy is whole but has none."""
    sid = "c" * 32
    step_root = tmp_path / f"step_0000000007.{sid}"
    step_root.mkdir()
    (step_root / "zarr.json").write_text("{}")
    doc = {"save_id": sid, "world_size": 1, "started": 1.0}
    nodedir.held(str(step_root), 0, doc)
    assert nodedir.doomed(str(tmp_path), 1) == [step_root.name], "uncommitted here, and nobody said otherwise"
    assert nodedir.doomed(str(tmp_path), 1, {sid}) == [], "another node saw it committed: kept"


def test_pruning_deletes_an_older_zarrckpts_restore_scratch(tmp_path: Path) -> None:
    """A restore no longer writes to the tier; the scratch directory of an older version's killed
    restore goes with the next save's pruning."""
    left = tmp_path / f".restore-{'d' * 32}.n0"
    (left / "w").mkdir(parents=True)
    (left / "w" / "c.0").write_bytes(b"x")
    assert nodedir.doomed(str(tmp_path), 1) == [left.name]
    nodedir.prune(str(tmp_path), 1)
    assert not left.exists()


def test_each_missing_object_has_one_sender() -> None:
    nodes = Nodes.of(["a", "a", "b", "b"])
    send, lost = senders(["x/c.0", "x/c.1", "y/c.0"], [[0], [0, 1], []], nodes)
    assert lost == ["y/c.0"] and set(send) == {"x/c.0", "x/c.1"}
    assert send["x/c.0"] in (0, 1)


def test_objects_are_shipped_in_bounded_batches() -> None:
    from zarrckpt.tier.ship import BATCH_BYTES, _batches

    assert _batches([]) == []
    assert _batches([("a", 0), ("b", 5)]) == [[("a", 0), ("b", 5)]], "an empty object first"
    big = BATCH_BYTES
    assert _batches([("a", 1), ("b", big), ("c", 1), ("d", big - 1)]) == [
        [("a", 1)],
        [("b", big)],
        [("c", 1), ("d", big - 1)],
    ]


def test_a_tier_without_room_is_refused_with_what_it_needs(tmp_path: Path) -> None:
    tier = zarrckpt.LocalTier(path=str(tmp_path), every=1)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(zarrckpt.TierSpaceError, match=r"needs .* MiB.*keep=2.*replicas=1.*nothing of this step"):
        nodedir.check_room(str(tmp_path), free * 4, 0, tier, ["n0", "n1"])
    nodedir.check_room(str(tmp_path), 1024, 0, tier, ["n0"])


def test_local_tier_settings_are_checked() -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match="every and keep"):
        zarrckpt.LocalTier(path="/dev/shm/x", every=0)
    with pytest.raises(zarrckpt.ZarrckptError, match="node-local"):
        zarrckpt.LocalTier(path="s3://bucket/x", every=1)
    assert zarrckpt.LocalTier(path="/x/{node}", every=1, node="n7").root() == "/x/n7"


def test_one_node_with_replicas_is_refused_at_start(tmp_path: Path) -> None:
    tier = zarrckpt.LocalTier(path=str(tmp_path / "tier"), every=1, node="only")
    with pytest.raises(zarrckpt.TierSpaceError, match="replicas=1 needs at least 2 nodes"):
        zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=10, keep_last=1, local=tier)


# --- one process ---


def _plain(step: int) -> dict[str, Any]:
    return {"w": torch.arange(64.0).reshape(8, 8) + step, "step": step}


def test_one_process_saves_and_restores_the_newest_local_step(tmp_path: Path) -> None:
    tier = zarrckpt.LocalTier(path=str(tmp_path / "tier"), every=2, keep=2, replicas=0, node="n0")
    manager = zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=4, keep_last=1, local=tier)
    for step in range(7):
        manager.save(step, _plain(step))
    manager.close()
    steps = sorted(s.step for s in nodedir.scan(str(tmp_path / "tier")))
    assert steps == [4, 6], "keep=2 local steps"
    again = zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=4, keep_last=1, local=tier)
    got = {"w": torch.zeros(8, 8), "step": -1}
    assert again.load_latest(got) == 6  # the remote holds step 4
    assert torch.equal(got["w"], _plain(6)["w"]) and got["step"] == 6
    again.close()


def test_a_state_of_constants_only_is_restored_from_the_tier(tmp_path: Path) -> None:
    """Constant arrays have no shards and the checksum table is empty (a helper found its restore failing)."""
    tier = zarrckpt.LocalTier(path=str(tmp_path / "tier"), every=5, replicas=0, node="a")
    manager = zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=10, keep_last=2, local=tier)
    manager.save(5, {"w": torch.zeros(1000), "step": 5})
    manager.close()
    got = {"w": torch.ones(1000), "step": -1}
    again = zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=10, keep_last=2, local=tier)
    assert again.load_latest(got) == 5 and got["step"] == 5 and not got["w"].any()
    again.close()


def test_a_damaged_local_step_falls_back_to_the_remote_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = zarrckpt.LocalTier(path=str(tmp_path / "tier"), every=1, keep=1, replicas=0, node="n0")
    manager = zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=4, keep_last=1, local=tier)
    for step in range(6):
        manager.save(step, _plain(step))
    manager.close()
    (newest,) = [p for p in (tmp_path / "tier").iterdir() if p.name.startswith("step_0000000005")]
    shard = next(p for p in (newest / "w").rglob("*") if p.is_file())
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    got = {"w": torch.zeros(8, 8), "step": -1}
    again = zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=4, keep_last=1, local=tier)
    assert again.load_latest(got) == 4, "the damaged local step 5 is not restored"
    assert torch.equal(got["w"], _plain(4)["w"]) and got["step"] == 4
    assert "restoring local step 5 failed" in caplog.text
    again.close()


def test_no_room_is_a_clear_error_at_the_first_save_and_nothing_is_written(tmp_path: Path) -> None:
    tier_dir = tmp_path / "tier"
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    keep = free // (2**20) + 2  # keep steps of at least 1 MiB each: more than the filesystem holds
    tier = zarrckpt.LocalTier(path=str(tier_dir), every=1, keep=keep, replicas=0, node="n0")
    manager = zarrckpt.CheckpointManager(str(tmp_path / "remote"), interval=100, keep_last=1, local=tier)
    with pytest.raises(zarrckpt.TierSpaceError, match=f"needs .* MiB .*keep={keep} steps"):
        manager.save(1, _plain(1))
    assert not [p for p in tier_dir.iterdir() if p.name.startswith("step_")], "nothing was written"
    manager.close()


# --- real processes: simulated nodes ---


def _state(step: int, world: int, fill: bool = True, offset: float = 0.0) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) + step * 1000 + offset
    experts = torch.arange(8 * 16 * 4, dtype=torch.float32).reshape(8, 16, 4) - step - offset
    if not fill:
        w, experts = torch.zeros_like(w), torch.zeros_like(experts)
    return {
        "model": {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "experts": distribute_tensor(experts, mesh, [Shard(0)]),
            "norm": torch.full((32,), float(step) + offset) if fill else torch.zeros(32),
        },
        "step": step if fill else -1,
    }


def _check(got: dict[str, Any], step: int, world: int, offset: float = 0.0) -> None:
    want = _state(step, world, offset=offset)
    for k in ("w", "experts"):
        assert torch.equal(got["model"][k].to_local(), want["model"][k].to_local()), k
    assert torch.equal(got["model"]["norm"], want["model"]["norm"]) and got["step"] == step


def _manager(
    base: str, rank: int, world: int, per_node: int, replicas: int | None = None
) -> zarrckpt.CheckpointManager:
    os.environ["ZARRCKPT_NODE"] = f"n{rank // per_node}"
    if replicas is None:
        replicas = 1 if world > per_node else 0
    tier = zarrckpt.LocalTier(path=f"{base}/tier/{{node}}", every=5, keep=2, replicas=replicas)
    return zarrckpt.CheckpointManager(f"{base}/remote", interval=10, keep_last=2, local=tier)


def _train(rank: int, world: int, base: str, per_node: int, steps: range, offset: float) -> None:
    manager = _manager(base, rank, world, per_node)
    for step in steps:
        manager.save(step, _state(step, world, offset=offset))
    manager.close()


def _restore(rank: int, world: int, base: str, per_node: int, expect: int, offset: float) -> None:
    manager = _manager(base, rank, world, per_node)
    got = _state(0, world, fill=False)
    got_step = manager.load_latest(got)
    assert got_step == expect, f"rank {rank}: restored step {got_step}, not {expect}"
    _check(got, expect, world, offset)
    manager.close()


def _remote_unreadable(base: str) -> None:
    """Every remote shard goes: a restore that reads any remote chunk fails."""
    for where, _, files in os.walk(f"{base}/remote"):
        for name in files:
            if name == "c" or name.startswith("c."):
                os.remove(os.path.join(where, name))


@pytest.mark.slow
def test_one_node_lost_restores_from_peers_on_another_world_without_remote_reads(tmp_path: Path) -> None:
    base = str(tmp_path)
    spawn(4, _train, base, 2, range(18), 0.0)  # 2 nodes of 2 ranks; local 10 and 15, remote 0 and 10
    _remote_unreadable(base)
    shutil.rmtree(f"{base}/tier/n1")  # node n1 lost: its processes died, its memory is gone
    # 3 nodes of 1 rank, two of them new (empty): all they need comes from n0 (the docs' example
    # restores on the same 4 ranks and on n0's 2 alone)
    spawn(3, _restore, base, 1, 15, 0.0)
    # the same 2 nodes of 2 ranks again: n1's two new ranks want some objects both (the small
    # tensors' rows of all ranks share objects); each receives its own copy
    spawn(4, _restore, base, 2, 15, 0.0)
    written = [os.path.join(d, f) for node in ("n1", "n2") for d, _, fs in os.walk(f"{base}/tier/{node}") for f in fs]
    assert written == [], "a restore keeps what it receives in memory: nothing lands in a tier"


def _restore_from_a_damaged_copy(rank: int, world: int, base: str) -> None:
    if rank == 0:  # what node n0 sends the lost node is damaged on its way (or in n0's memory)
        real = nodedir.read_into

        def damaged(step_root: str, path: str, view: memoryview, offset: int = 0) -> None:
            real(step_root, path, view, offset)
            if len(view):
                view[len(view) // 2] ^= 0xFF

        nodedir.read_into = damaged  # type: ignore[assignment]
    _restore(rank, world, base, 1, 10, 0.0)


def _restore_when_a_copy_cannot_be_read(rank: int, world: int, base: str) -> None:
    if rank == 0:  # n0's copy of n1's objects vanishes between the survey and the send

        def vanished(step_root: str, path: str, view: memoryview, offset: int = 0) -> None:
            raise FileNotFoundError(2, "No such file or directory", os.path.join(step_root, path))

        nodedir.read_into = vanished  # type: ignore[assignment]
    _restore(rank, world, base, 1, 10, 0.0)


@pytest.mark.slow
def test_a_copy_a_peer_cannot_read_fails_the_local_restore_on_every_rank_without_a_hang(tmp_path: Path) -> None:
    base = str(tmp_path)
    spawn(2, _train, base, 1, range(18), 0.0)  # 2 nodes of 1 rank; local 10 and 15, remote 0 and 10
    shutil.rmtree(f"{base}/tier/n1")
    spawn(2, _restore_when_a_copy_cannot_be_read, base, timeout_s=90.0)  # the remote step 10, on both ranks


@pytest.mark.slow
def test_a_damaged_copy_from_a_peer_is_caught_and_the_remote_step_restored(tmp_path: Path) -> None:
    base = str(tmp_path)
    spawn(2, _train, base, 1, range(18), 0.0)  # 2 nodes of 1 rank; local 10 and 15, remote 0 and 10
    shutil.rmtree(f"{base}/tier/n1")
    spawn(2, _restore, base, 1, 15, 0.0)  # n0's copies intact: local step 15
    spawn(2, _restore_from_a_damaged_copy, base)  # checked against step 15's record: remote step 10


@pytest.mark.slow
def test_a_node_and_its_replica_partner_lost_restores_the_remote_step(tmp_path: Path) -> None:
    base = str(tmp_path)
    spawn(3, _train, base, 1, range(18), 0.0)  # 3 nodes of 1 rank: n0 -> n1 -> n2 -> n0
    shutil.rmtree(f"{base}/tier/n1")
    shutil.rmtree(f"{base}/tier/n2")  # n1's shards lived on n1 and n2
    spawn(3, _restore, base, 1, 10, 0.0)
    shutil.rmtree(f"{base}/tier")  # the whole job lost
    spawn(2, _restore, base, 1, 10, 0.0)


def _die_while_copying(rank: int, world: int, base: str) -> None:
    from zarrckpt.tier import save as tier_save

    manager = _manager(base, rank, world, 1)
    for step in range(16):
        manager.save(step, _state(step, world))
    manager.wait()
    real = tier_save.ship

    def dying(*args: Any) -> int:
        if rank == 1:
            os._exit(9)  # killed during replication of step 25
        return real(*args)

    tier_save.ship = dying  # type: ignore[assignment]
    manager.save(25, _state(25, world))  # (a local step only: remote saves are every 10)
    manager.wait()


def _fail_to_read_a_copy(rank: int, world: int, base: str) -> None:
    manager = _manager(base, rank, world, 1)
    for step in range(16):
        manager.save(step, _state(step, world))
    manager.wait()
    if rank == 0:  # its staged shards cannot be read back to send to its replica node

        def unreadable(step_root: str, path: str, view: memoryview, offset: int = 0) -> None:
            raise OSError(5, "Input/output error", os.path.join(step_root, path))

        nodedir.read_into = unreadable  # type: ignore[assignment]
    manager.save(25, _state(25, world))  # (a local step only)
    with pytest.raises(zarrckpt.CheckpointSaveError, match="could not read"):  # on both ranks, not a hang
        manager.wait()
    manager.close()


@pytest.mark.slow
def test_a_copy_that_cannot_be_read_fails_the_local_save_on_every_rank(tmp_path: Path) -> None:
    base = str(tmp_path)
    spawn(2, _fail_to_read_a_copy, base, timeout_s=90.0)
    spawn(2, _restore, base, 1, 15, 0.0)  # step 25 was never committed


@pytest.mark.slow
def test_a_step_killed_half_replicated_is_never_restored(tmp_path: Path) -> None:
    base = str(tmp_path)
    with pytest.raises(ProcessException):  # (rank 1 died)
        spawn(2, _die_while_copying, base)  # 2 nodes of 1 rank
    found = {s.step: s for s in nodedir.scan(f"{base}/tier/n0")}
    assert 25 in found and not found[25].committed, "step 25 was begun, never committed"
    spawn(2, _restore, base, 1, 15, 0.0)


@pytest.mark.slow
def test_a_node_holding_another_save_of_the_step_is_not_mixed_in(tmp_path: Path) -> None:
    base = str(tmp_path)
    spawn(2, _train, base, 1, range(18), 0.0)  # run A, 2 nodes of 1 rank: local steps 10 and 15
    shutil.rmtree(f"{base}/tier/n1")  # n1 lost; the job restarts from remote step 10 ...
    spawn(2, _train, base, 1, range(11, 16), 7.0)  # ... and run B saves step 15 again, other values
    a = [s for s in nodedir.scan(f"{base}/tier/n0") if s.step == 15]
    assert len(a) == 2, "n0 holds both saves of step 15"
    shutil.rmtree(f"{base}/tier/n1")  # n1 lost again: n0 holds A's step 15 whole (its own + copies) and B's
    spawn(2, _restore, base, 1, 15, 7.0)  # B's: the later save of the step, never A's bytes


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 300),
    cuts=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["B", "f", "2d"])), max_size=6),
    data=st.data(),
)
def test_a_received_range_reads_as_the_same_bytes_in_a_file_would(
    tmp_path_factory: pytest.TempPathFactory, size: int, cuts: list[tuple[int, str]], data: st.DataObject
) -> None:
    """A restore reads the ranges it received of an object from memory; the oracle is the same bytes
    as a local file: a read inside a received range (vectored into buffers of any format, a range, a
    view) gives the same bytes and count; one reaching outside every range is an error, never other bytes."""
    from zarrckpt.errors import ZarrckptError
    from zarrckpt.tier.received import with_received

    root = tmp_path_factory.mktemp("received")
    raw = bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
    (root / "file").write_bytes(raw)
    bounds = sorted(data.draw(st.lists(st.integers(0, size), min_size=2, max_size=6, unique=True)))
    ranges = list(zip(bounds[::2], bounds[1::2], strict=False))  # disjoint received ranges (an odd last bound: none)
    memory = with_received(str(root), {"mem": [(a, memoryview(bytearray(raw[a:b]))) for a, b in ranges]})
    files = with_received(str(root), {})

    def buffers() -> list[memoryview]:
        out = []
        for n, kind in cuts:
            if kind == "B":
                out.append(memoryview(bytearray(n)))
            elif kind == "f":
                out.append(memoryview(np.zeros(n, np.float32)))
            else:
                out.append(memoryview(np.zeros((2, n), np.uint8)))
        return out

    a, b = buffers(), buffers()
    total = sum(x.nbytes for x in a)
    start = data.draw(st.integers(0, size))
    inside = any(lo <= start and start + total <= hi for lo, hi in ranges)
    if inside:
        assert memory.read_into("mem", start, a) == files.read_into("file", start, b)
        assert [bytes(x) for x in a] == [bytes(x) for x in b]
        assert memory.read("mem", start, start + total) == files.read("file", start, start + total)
        with memory.reading("mem", start, start + total) as got:
            assert bytes(got) == raw[start : start + total]
    else:
        with pytest.raises(ZarrckptError, match="were not received"):
            memory.read_into("mem", start, a)
    with pytest.raises(ZarrckptError, match="were not received"):
        memory.read("mem")  # whole: never all received here (nor read so by a restore)
    assert memory.read("file") == raw, "what was not received is read from the directory"
