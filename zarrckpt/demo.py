"""Demo: train a small MoE transformer under PPxEPxEP-DP, checkpoint it, resume it elsewhere.

    python -m zarrckpt.demo [--url DIR_OR_URL] [--k STEPS] [--storage-option KEY=VALUE ...]

Run A trains 2K steps on 8 ranks (PP2 x EP2 x EP-DP2, experts sharded over EP-DP) and saves a
checkpoint at step K. The checkpoint is then resumed (a) on the same 8-rank layout, (b) on 4
ranks (PP1 x EP4), (c) on 1 rank; each run re-saves what it restored (compared tensor by
tensor with the checkpoint) and trains steps K+1..2K, compared with run A. Without ``--url``
everything goes to an S3 endpoint embedded in this process (moto's server on loopback,
:class:`zarrckpt.testing.S3Server`).
All ranks are real processes joined by a gloo process group on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

from zarrckpt.cli.args import CliError, parse_storage_options
from zarrckpt.errors import ZarrckptError
from zarrckpt.example import scenario
from zarrckpt.storage.store import Storage

PROBE = ".zarrckpt-demo-probe"


def check_writable(root: str, options: dict[str, Any] | None) -> None:
    """Write one small object under ``root`` and delete it: a missing bucket, wrong credentials or a
    read-only location fail here, in a second, instead of after run A's training (a StorageError
    naming the bucket or the refusal)."""
    storage = Storage(root, options)
    storage.write(PROBE, [b"zarrckpt demo: can this location be written?"])
    storage.delete(PROBE)
    storage.prune()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="where to write: a directory, file://, s3://bucket/prefix or gs://bucket/prefix")
    parser.add_argument("--k", type=int, default=10, help="steps before the checkpoint and after each resume")
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option for --url (repeatable), e.g. endpoint_url=http://localhost:9000",
    )
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error("--k must be at least 1")
    start = time.perf_counter()
    if args.url:
        root = f"{args.url.rstrip('/')}/demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        try:
            options = parse_storage_options(args.storage_option)
            check_writable(root, options)
        except (ZarrckptError, CliError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
        report = scenario.run(root, options, k=args.k)
    else:
        from zarrckpt.testing import s3_server

        with s3_server("zarrckpt-demo") as s3:
            root = f"{s3.url}/demo"
            print(f"embedded S3 endpoint {s3.endpoint}, writing to {root}")
            report = scenario.run(root, s3.storage_options, k=args.k)
    print()
    print(report.table())
    print(
        f"\nrun A losses: step 1 {report.run_a_losses[0]:.4f}, step {args.k} {report.run_a_losses[args.k - 1]:.4f}, "
        f"step {2 * args.k} {report.run_a_losses[-1]:.4f}"
    )
    print(
        "restored tensors must be bit-exact; the same topology must reproduce run A's losses bit for bit; "
        f"another topology within {scenario.LOSS_TOLERANCE:g} (reduction order changes float rounding)."
    )
    problems = report.problems()
    for p in problems:
        print(f"FAILED: {p}")
    print(f"\n{'all checks passed' if not problems else 'checks failed'} in {time.perf_counter() - start:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
