"""Publish throughput: `publish()` vs a plain boto3 upload of the same shards to the same local S3 server.

    python -m benchmarks.publish --out publish.json [--mb 300] [--files 12] [--workers 4]

publish() hashes every file, writes the claim, checks the namespace, uploads with If-None-Match and writes the
manifest; the raw baseline only uploads (boto3 `upload_file`, default transfer settings, same thread count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pyarrow as pa
import pyarrow.parquet as pq

from datagen.local.localstack import LocalS3, find_weed
from datagen.publishing.storage import ObjectStore
from tasks.publishing import publish

__all__ = ["main", "make_shards"]

MB = 1_000_000


def make_shards(root: Path, total_mb: int, files: int) -> list[Path]:
    """Uncompressed parquet shards of random token ids (incompressible, like real token data is nearly)."""
    data = root / "data"
    data.mkdir(parents=True)
    per_file_values = total_mb * MB // files // 4
    paths = []
    for i in range(files):
        ids = pa.array(
            memoryview(os.urandom(per_file_values * 4)).cast("i"), type=pa.int32()
        )  # zero-copy view of random bytes
        path = data / f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"input_ids": ids}), path, compression="none", use_dictionary=False)
        paths.append(path)
    (root / "README.md").write_text("# benchmark dataset\n")
    return paths


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    weed_version = subprocess.run([str(find_weed()), "version"], capture_output=True, text=True, check=False).stdout
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "boto3": boto3.__version__,
        "weed": weed_version.strip(),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a table and write the figures to --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mb", type=int, default=300, help="Total shard size in MB.")
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        staging = Path(tmp) / "dataset"
        shards = make_shards(staging, args.mb, args.files)
        files = [p for p in staging.rglob("*") if p.is_file()]
        total_bytes = sum(p.stat().st_size for p in files)
        with LocalS3(Path(tmp) / "s3") as server:
            settings = server.settings(s3_prefix=f"bench-{secrets.token_hex(4)}")
            store = ObjectStore.from_settings(settings, max_concurrency=args.workers)
            raw = boto3.client(
                "s3",
                endpoint_url=server.endpoint_url,
                region_name="us-east-1",
                aws_access_key_id=server.access_key_id,
                aws_secret_access_key=server.secret_access_key.get_secret_value(),
            )

            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.workers) as pool:
                list(
                    pool.map(
                        lambda p: raw.upload_file(
                            str(p), server.bucket, f"{store.prefix}raw/{p.relative_to(staging).as_posix()}"
                        ),
                        files,
                    )
                )
            raw_s = time.perf_counter() - start

            start = time.perf_counter()
            result = publish(staging, "published", store, {"benchmark": True}, workers=args.workers)
            publish_s = time.perf_counter() - start

    figures = {
        "files": len(files),
        "shards": len(shards),
        "total_mb": round(total_bytes / MB, 1),
        "workers": args.workers,
        "publish_s": round(publish_s, 2),
        "raw_s": round(raw_s, 2),
        "mb_per_s": round(total_bytes / MB / publish_s, 1),
        "raw_mb_per_s": round(total_bytes / MB / raw_s, 1),
        "ratio": round(raw_s / publish_s, 2),
        "objects_published": result.objects,
        "machine": _machine(),
    }
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"{'':<10}{'seconds':>10}{'MB/s':>10}")
    print(f"{'publish':<10}{publish_s:>10.2f}{figures['mb_per_s']:>10}")
    print(f"{'raw boto3':<10}{raw_s:>10.2f}{figures['raw_mb_per_s']:>10}")
    print(f"ratio publish/raw throughput: {figures['ratio']}  ({figures['total_mb']} MB in {len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
