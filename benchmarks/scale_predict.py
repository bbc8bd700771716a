"""The scale model's predictions: save and load times from counted bytes and requests under stated
assumptions (node bandwidth, request latency and concurrency, S3 request rates per prefix partition)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9
S3_MULTIPART_CHUNK = 50 * 2**20  # s3fs: one PUT below 2 x 50 MiB, else multipart of 50 MiB parts


@dataclass(frozen=True)
class Assumptions:
    ranks_per_node: int = 8
    node_bandwidth: float = 10 * GB  # bytes/s per node to (or from) the object store
    latency: float = 0.030  # seconds to first byte of one request
    in_flight: int = 16  # requests in flight per rank (zarrckpt.storage.caps.REMOTE_CONCURRENCY)
    put_rate: float = 3500.0  # PUT/s that one S3 prefix partition sustains
    get_rate: float = 5500.0  # GET/s that one S3 prefix partition sustains
    exchange_bandwidth: float = 25 * GB  # bytes/s per node between ranks (a 200 Gb/s NIC; fan-out's transfers)


@dataclass(frozen=True)
class Transfer:
    bandwidth: float  # the busiest node's bytes / node bandwidth
    latency: float  # the rank with most requests: requests x latency / requests in flight
    one_partition: float  # all requests / the rate of one prefix partition

    @property
    def scaled(self) -> float:
        """The store's request rate does not bind (the prefixes are partitioned)."""
        return max(self.bandwidth, self.latency)

    @property
    def worst(self) -> float:
        """Everything goes through one prefix partition."""
        return max(self.scaled, self.one_partition)


def transfer(per_rank_bytes: Sequence[int], per_rank_requests: Sequence[int], rate: float, a: Assumptions) -> Transfer:
    nodes = range(0, len(per_rank_bytes), a.ranks_per_node)
    busiest = max(sum(per_rank_bytes[n : n + a.ranks_per_node]) for n in nodes)
    return Transfer(
        bandwidth=busiest / a.node_bandwidth,
        latency=max(per_rank_requests) * a.latency / a.in_flight,
        one_partition=sum(per_rank_requests) / rate,
    )


def puts_for(nbytes: int) -> int:
    """PUT-class requests s3fs sends for one object (multipart from 2 x 50 MiB: create + parts + complete)."""
    if nbytes < 2 * S3_MULTIPART_CHUNK:
        return 1
    return -(-nbytes // S3_MULTIPART_CHUNK) + 2
