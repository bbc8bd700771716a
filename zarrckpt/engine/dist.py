"""The only module that makes process-group calls. Without torch.distributed it is a 1-rank no-op.

Everything exchanged is JSON encoded into uint8 tensors, so no pickle crosses ranks either.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as torch_dist

from zarrckpt import errors
from zarrckpt.errors import ZarrckptError
from zarrckpt.format.gcpause import gc_paused

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")
_side_groups: dict[tuple[int, str], ProcessGroup] = {}
MAX_DISTINCT = 256  # distinct objects sent one broadcast each; more: one all-gather of them all
INLINE_MAX = 1024  # bytes per rank a gather's or broadcast's first collective carries (the length included)
INLINE_TOTAL = 64 * 1024  # ... and at most this in all, over the ranks of a gather
GATHER_MAX = 2**20  # on gloo, an all-gather of at most this in all goes as a gather and a tree broadcast


class Group:
    """The ranks taking part in one save or load."""

    def __init__(self, process_group: ProcessGroup | None = None) -> None:
        self.pg = process_group
        self.active = torch_dist.is_available() and torch_dist.is_initialized()
        self.rank = torch_dist.get_rank(process_group) if self.active else 0
        self.size = torch_dist.get_world_size(process_group) if self.active else 1
        if self.size == 1:
            self.active = False
        backend = torch_dist.get_backend(process_group) if self.active else "gloo"
        self.gloo = backend == "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable), in rank order: one all-gather where every
        object fits in :meth:`inline_bytes`, else a second one of what was left over."""
        raw = _encode(obj)
        if not self.active:
            return [json.loads(raw)]
        return _decode(self._all_gather_bytes(raw))

    def _all_gather_bytes(self, raw: bytes) -> list[bytes]:
        cap = self.inline_bytes() - 8  # (8 bytes: the length)
        head = self._joined([len(raw).to_bytes(8, "little"), raw[:cap]], cap + 8)
        firsts = self._on_host(self._all_gather(head))
        lengths = [int.from_bytes(h[:8].tobytes(), "little") for h in firsts]
        longest = max(lengths)
        if longest <= cap:
            return [h[8 : 8 + n].tobytes() for h, n in zip(firsts, lengths, strict=True)]
        rest = self._padded(raw[cap:], longest - cap)
        return [
            b"".join((h[8 : 8 + min(n, cap)].data, r[: max(n - cap, 0)].data))  # (one copy)
            for h, r, n in zip(firsts, self._on_host(self._all_gather(rest)), lengths, strict=True)
        ]

    def _all_gather(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``buf`` (as long on every rank), in rank order. On gloo, up to
        :data:`GATHER_MAX` in all goes to rank 0 and back in a tree broadcast: gloo's all-gather is a
        ring, a step per rank (8 processes on 2 cores: 13 ms and 21 ms of CPU against 3.2 ms and 4.7 ms;
        2 processes: 1.5 ms against 0.7 ms). Larger ones take the ring (its bytes sent do not grow
        with the group's depth)."""
        n = buf.numel()
        if self.gloo and 0 < n * self.size <= GATHER_MAX:
            out = torch.empty(n * self.size, dtype=torch.uint8)
            parts = list(out.split(n))
            torch_dist.gather(buf, parts if self.rank == 0 else None, group=self.pg, group_dst=0)
            torch_dist.broadcast(out, group=self.pg, group_src=0)
            return parts
        bufs = [torch.empty_like(buf) for _ in range(self.size)]
        torch_dist.all_gather(bufs, buf, group=self.pg)
        return bufs

    def _on_host(self, bufs: list[torch.Tensor]) -> list[np.ndarray]:
        """Gathered buffers as host arrays: views of them on CPU, one device-to-host copy of them
        all on a GPU (not one per rank)."""
        if self.device.type == "cpu":
            return [b.numpy() for b in bufs]
        return list(torch.stack(bufs).cpu().numpy())

    def inline_bytes(self) -> int:
        """Bytes per rank of a gather's first collective (an object's length and its first bytes):
        up to 1 KiB, at most 64 KiB in all (16 bytes a rank from 4,096 ranks on, which still holds a
        ``[null]``), so small objects travel in one collective at any scale."""
        return max(16, min(INLINE_MAX, INLINE_TOTAL // self.size))

    def all_gather_alike_json(self, obj: Any, max_distinct: int = MAX_DISTINCT) -> list[Any]:
        """As :meth:`all_gather_json`, for objects most ranks share (a load's key lists: every rank
        of a pipeline stage asks for the same keys): a 16-byte digest per rank, then each distinct
        object once, broadcast by the lowest rank holding it. Received per rank: ``16 x world``
        bytes plus the distinct objects, not every rank's copy (2.4 GB at 8,192 ranks asking for
        6,000 keys each). More than ``max_distinct`` distinct objects: gathered as they are.
        Ranks holding equal objects get the same (shared) decoded object."""
        raw = _encode(obj)
        if not self.active:
            return [json.loads(raw)]
        digests = self.all_gather_fixed(hashlib.sha256(raw).digest()[:16])
        first: dict[bytes, int] = {}
        for rank, d in enumerate(digests):
            first.setdefault(d, rank)
        if len(first) > max_distinct:  # every rank alike: the same digests everywhere
            return self.all_gather_json(obj)
        found = {d: json.loads(self.broadcast_from(r, raw if r == self.rank else b"")) for d, r in first.items()}
        return [found[d] for d in digests]

    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable) in rank order on rank 0; ``[]`` on the others."""
        if not self.active:
            return self.all_gather_json(obj)
        raw = _encode(obj)
        lengths = [int(n) for n in self.all_gather_json(len(raw))]
        buf = self._padded(raw, max(lengths))
        bufs = [torch.empty_like(buf) for _ in range(self.size)] if self.rank == 0 else None
        torch_dist.gather(buf, bufs, group=self.pg, group_dst=0)
        return (
            [] if bufs is None else _decode([b.cpu().numpy()[:n].tobytes() for b, n in zip(bufs, lengths, strict=True)])
        )

    def all_gather_fixed(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order; every rank passes the same number of bytes (one collective)."""
        if not self.active:
            return [data]
        return [bytes(b) for b in self._on_host(self._all_gather(self._padded(data, len(data))))]

    def broadcast_from(self, root: int, data: bytes) -> bytes:
        """Group rank ``root``'s ``data`` on every rank (what the others pass is ignored)."""
        return self._broadcast(root, data, 0)[1]

    def _broadcast(self, root: int, data: bytes, flag: int) -> tuple[int, bytes]:
        """Rank ``root``'s ``flag`` (0-255) and ``data`` on every rank: one broadcast of the length,
        the flag and the first bytes (:data:`INLINE_MAX` in all), a second of the rest."""
        if not self.active:
            return flag, data
        src = torch_dist.get_global_rank(self.pg, root) if self.pg is not None else root
        cap = INLINE_MAX - 9
        mine = data if self.rank == root else b""
        head = self._joined([len(mine).to_bytes(8, "little"), bytes([flag]), mine[:cap]], cap + 9)
        torch_dist.broadcast(head, src, group=self.pg)
        first = head.cpu().numpy()
        n, got = int.from_bytes(first[:8].tobytes(), "little"), int(first[8])
        if n <= cap:
            return got, first[9 : 9 + n].tobytes()
        rest = self._padded(mine[cap:], n - cap)
        torch_dist.broadcast(rest, src, group=self.pg)
        return got, b"".join((first[9:].data, rest.cpu().numpy().data))  # (one copy)

    def all_reduce_min(self, values: np.ndarray) -> np.ndarray:
        """The elementwise minimum over ranks of an int64 vector."""
        if not self.active:
            return values
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)
        n = t.numel()
        if self.gloo and 0 < 8 * n * self.size <= GATHER_MAX:  # (gloo's all-reduce: a ring too, 18 ms for 54 values)
            every = torch.empty(n * self.size, dtype=torch.int64)
            torch_dist.gather(t, list(every.split(n)) if self.rank == 0 else None, group=self.pg, group_dst=0)
            low = every.view(self.size, n).amin(0) if self.rank == 0 else torch.empty_like(t)
            torch_dist.broadcast(low, group=self.pg, group_src=0)
            return np.asarray(low.numpy())
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MIN, group=self.pg)
        return np.asarray(t.cpu().numpy())

    def gather_to0(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` on rank 0 (``[]`` elsewhere); padded to the longest, whose length
        comes from a MAX all-reduce, so the other ranks receive 8 bytes."""
        if not self.active:
            return [data]
        longest = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        torch_dist.all_reduce(longest, op=torch_dist.ReduceOp.MAX, group=self.pg)
        buf = self._padded(len(data).to_bytes(8, "little") + data, 8 + int(longest.item()))
        bufs = [torch.empty_like(buf) for _ in range(self.size)] if self.rank == 0 else None
        torch_dist.gather(buf, bufs, group=self.pg, group_dst=0)
        out = [bytes(b.cpu().numpy()) for b in bufs or []]
        return [b[8 : 8 + int.from_bytes(b[:8], "little")] for b in out]

    def scatter_from0(self, parts: list[bytes]) -> bytes:
        """Rank 0's ``parts[r]`` on rank r (what the others pass is ignored); padded to the longest."""
        if not self.active:
            return parts[0]
        longest = max(map(len, parts)) if self.rank == 0 else 0
        size = int.from_bytes(self.broadcast_from(0, longest.to_bytes(8, "little")), "little") + 8
        bufs = [self._padded(len(p).to_bytes(8, "little") + p, size) for p in parts] if self.rank == 0 else None
        out = torch.empty(size, dtype=torch.uint8, device=self.device)
        torch_dist.scatter(out, bufs, group=self.pg, group_src=0)
        raw = bytes(out.cpu().numpy())
        return raw[8 : 8 + int.from_bytes(raw[:8], "little")]

    def to_group_rank(self, global_rank: int) -> int:
        """The rank in this group of a global rank (a DeviceMesh holds global ranks)."""
        if not self.active or self.pg is None:
            return global_rank
        return int(torch_dist.get_group_rank(self.pg, global_rank))

    def _padded(self, raw: bytes, size: int) -> torch.Tensor:
        """``raw`` in a uint8 tensor of ``size`` bytes on this group's device (zero-padded)."""
        return self._joined([raw], size)

    def _joined(self, pieces: Sequence[Any], size: int) -> torch.Tensor:
        """The byte buffers ``pieces`` back to back in a uint8 tensor of ``size`` bytes on this
        group's device (zero-padded): one copy of each on the host (numpy arrays are taken as
        their bytes, which must be contiguous)."""
        host = torch.empty(size, dtype=torch.uint8)
        view, at = host.numpy(), 0
        for piece in pieces:
            raw = np.frombuffer(piece, dtype=np.uint8) if not isinstance(piece, np.ndarray) else piece.reshape(-1)
            raw = raw.view(np.uint8)
            view[at : at + raw.size] = raw
            at += raw.size
        view[at:] = 0
        return host if self.device.type == "cpu" else host.to(self.device)

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's ``data`` on every rank (what the others pass is ignored)."""
        return self.broadcast_from(0, data)

    def start_exchange(
        self, sends: Sequence[tuple[int, np.ndarray]], recvs: Sequence[tuple[int, np.ndarray]]
    ) -> Transfers:
        """Post point-to-point transfers, all at once; :meth:`Transfers.wait` completes them.

        Args:
            sends: ``(group rank, buffer)``: the buffer goes to that rank.
            recvs: ``(group rank, buffer)``: the buffer is filled from that rank.
                Buffers are C-contiguous uint8 host arrays, left alone until the wait. Between two
                ranks, the n-th send from one fills the n-th receive of the other, so both must
                list them in the same order (and sizes). On a GPU backend (NCCL) the bytes go
                through device buffers.

        Returns:
            The transfers in flight.

        Raises:
            ZarrckptError: a transfer could not be posted.
        """
        if not self.active or not (sends or recvs):
            return Transfers(self.rank, [], [])
        ops: list[torch_dist.P2POp] = []
        landing: list[tuple[torch.Tensor, np.ndarray]] = []
        counts: dict[tuple[str, int], int] = {}

        def tag(way: str, peer: int) -> int:  # the n-th transfer between this pair: matched on both sides
            n = counts[way, peer] = counts.get((way, peer), -1) + 1
            return n

        try:
            for peer, buf in sends:
                t = torch.from_numpy(buf).to(self.device)
                ops.append(torch_dist.P2POp(torch_dist.isend, t, group=self.pg, tag=tag("send", peer), group_peer=peer))
            for peer, buf in recvs:
                t = (
                    torch.from_numpy(buf)
                    if self.device.type == "cpu"
                    else torch.empty(len(buf), dtype=torch.uint8, device=self.device)
                )
                landing.append((t, buf))
                ops.append(torch_dist.P2POp(torch_dist.irecv, t, group=self.pg, tag=tag("recv", peer), group_peer=peer))
            return Transfers(self.rank, torch_dist.batch_isend_irecv(ops), landing)
        except RuntimeError as e:
            raise ZarrckptError(f"rank {self.rank}: sending or receiving data between ranks failed: {e}") from e

    def on_rank0(self, fn: Callable[[], bytes], what: str) -> bytes:
        """Run ``fn`` on rank 0 only and hand its result to every rank; if it fails, every rank
        raises an error of the same zarrckpt type (the others with the message of rank 0's)."""
        if not self.active:
            return fn()
        result, error = b"", None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:
                error = e
        failed = error is not None
        sent = json.dumps(_describe(error)).encode() if failed else result
        flag, got = self._broadcast(0, sent, int(failed))  # (one broadcast: its outcome and its result)
        if error is not None:
            raise error
        if flag:
            status = json.loads(got)
            kind = getattr(errors, status[0], None)
            if isinstance(kind, type) and issubclass(kind, ZarrckptError):
                raise kind(status[1])
            raise ZarrckptError(f"{what} failed on rank 0: {status[0]}: {status[1]}")
        return got

    def exchange_bytes(self, outgoing: Sequence[Sequence[Any]]) -> list[memoryview]:
        """All-to-all: send the byte buffers ``outgoing[r]`` (bytes, or contiguous numpy arrays),
        back to back, to rank r; return what each rank sent this one, in rank order, as views of one
        received buffer (one exchange of sizes, one of data; each byte copied once into the send
        buffer and never out of the received one)."""
        counts = [sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in pieces) for pieces in outgoing]
        if not self.active:
            return [self._joined(outgoing[0], counts[0]).numpy().data]
        sent = torch.tensor(counts, dtype=torch.int64, device=self.device)
        sizes = torch.empty_like(sent)
        torch_dist.all_to_all_single(sizes, sent, group=self.pg)
        lengths = [int(n) for n in sizes.tolist()]
        data = self._joined([p for pieces in outgoing for p in pieces], sum(counts))
        out = torch.empty(sum(lengths), dtype=torch.uint8, device=self.device)
        torch_dist.all_to_all_single(out, data, lengths, counts, group=self.pg)
        raw = out.cpu().numpy().data
        ends = itertools.accumulate(lengths)  # (not a sum per rank: O(world) here, at 16,384 ranks too)
        return [raw[end - n : end] for end, n in zip(ends, lengths, strict=True)]

    def barrier(self) -> None:
        if self.active:
            torch_dist.barrier(group=self.pg)

    def run_together(self, fn: Callable[[], T], what: str, *, share: bool = False) -> T:
        """Run ``fn`` on this rank; if it fails on any rank, raise on every rank.

        The failing rank re-raises its own exception; the others raise a ZarrckptError naming it.
        ``share``: every rank returns rank 0's result (JSON), sent along in the same collective.
        """
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except Exception as e:
            error = e
        failure = None if error is None else f"{type(error).__name__}: {error}"
        shared = share and self.rank == 0 and error is None
        status = self.all_gather_json([failure, result] if shared else [failure])
        if error is not None:
            raise error
        failed = [(r, s[0]) for r, s in enumerate(status) if s[0] is not None]
        if failed:
            rank, msg = failed[0]
            raise ZarrckptError(f"{what} failed on rank {rank}: {msg}")
        return status[0][1] if share else result  # type: ignore[return-value]


class Transfers:
    """Point-to-point transfers in flight (:meth:`Group.start_exchange`)."""

    def __init__(self, rank: int, works: list[torch_dist.Work], landing: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        self.rank, self.works, self.landing = rank, works, landing

    def wait(self) -> None:
        """Complete the transfers (once; later calls return at once): the receive buffers are filled.

        Raises:
            ZarrckptError: a transfer failed (a peer gone, a size mismatch).
        """
        works, self.works = self.works, []
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            raise ZarrckptError(f"rank {self.rank}: sending or receiving data between ranks failed: {e}") from e
        landing, self.landing = self.landing, []
        for t, buf in landing:
            if t.device.type != "cpu":
                buf[:] = t.cpu().numpy()


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _decode(raws: list[bytes]) -> list[Any]:
    with gc_paused():
        return [json.loads(raw) for raw in raws]


def _describe(error: BaseException | None) -> list[str] | None:
    return None if error is None else [type(error).__name__, str(error)]


def side_group(process_group: ProcessGroup | None = None, name: str = "") -> Group:
    """A :class:`Group` over the same ranks as ``process_group`` on a gloo group of its own (made once per
    group and ``name``, collectively on first use), so collectives of a background thread never interleave
    with the caller's, nor with another background thread's (each names its own)."""
    group = Group(process_group)
    if not group.active:
        return group
    key = (id(process_group), name)
    if key not in _side_groups:
        ranks = torch_dist.get_process_group_ranks(process_group) if process_group is not None else None
        _side_groups[key] = torch_dist.new_group(ranks=ranks, backend="gloo")
    return Group(_side_groups[key])
