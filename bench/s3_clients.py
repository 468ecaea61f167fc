"""The two S3 clients the object-storage issue names, measured against a real server on loopback:
fsspec + s3fs (what ckpt uses) and obstore (Rust ``object_store``; ``pip install obstore``).

    python bench/s3_clients.py [--mb 512]

For each: a multipart upload of one MB-sized file (8 MiB parts, 4 in flight), a download of it
in ranged parts, and a safetensors-header-sized ranged read (8 KB), with the bytes the client
took off the wire for that read counted by a proxy. Peak anonymous memory is not separated
here (both run in this process); see bench/s3_bench.py for the commands' memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent)]

from s3server import ACCESS_KEY, SECRET_KEY, CountingProxy, make_bucket, start_server  # noqa: E402

PART = 8 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-s3clients-"))
    server = start_server(work / "server")
    try:
        make_bucket(server, "bench")
        os.environ.update(server.env())
        src = work / "blob.bin"
        with open(src, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        size = src.stat().st_size
        rows = []

        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=server.endpoint, default_cache_type="none")
        t = time.perf_counter()
        fs.put_file(str(src), "bench/s3fs/blob.bin", chunksize=PART, max_concurrency=4)
        up = time.perf_counter() - t
        t = time.perf_counter()
        fs.get_file("bench/s3fs/blob.bin", str(work / "s3fs.bin"), chunksize=PART, max_concurrency=4)
        down = time.perf_counter() - t
        proxy = CountingProxy(int(server.endpoint.rsplit(":", 1)[1]))
        pfs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=proxy.endpoint, default_cache_type="none")
        pfs.info("bench/s3fs/blob.bin")
        proxy.reset()
        head = pfs.cat_file("bench/s3fs/blob.bin", start=0, end=8192)
        rows.append(("s3fs", up, down, proxy.to_client, len(head)))
        proxy.close()

        import obstore
        from obstore.store import S3Store

        store = S3Store("bench", endpoint=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                        region="us-east-1", client_options={"allow_http": True})
        t = time.perf_counter()
        with open(src, "rb") as f:
            obstore.put(store, "obstore/blob.bin", f, chunk_size=PART, max_concurrency=4)
        up = time.perf_counter() - t
        t = time.perf_counter()
        with open(work / "obstore.bin", "wb") as out:
            offsets = list(range(0, size, PART))
            for i in range(0, len(offsets), 4):
                group = offsets[i: i + 4]
                for data in obstore.get_ranges(store, "obstore/blob.bin", starts=group,
                                               ends=[min(o + PART, size) for o in group]):
                    out.write(memoryview(data))
        down = time.perf_counter() - t
        proxy = CountingProxy(int(server.endpoint.rsplit(":", 1)[1]))
        pstore = S3Store("bench", endpoint=proxy.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                         region="us-east-1", client_options={"allow_http": True})
        proxy.reset()
        head = obstore.get_range(pstore, "obstore/blob.bin", start=0, end=8192)
        rows.append(("obstore", up, down, proxy.to_client, len(head)))
        proxy.close()

        assert (work / "s3fs.bin").read_bytes() == src.read_bytes() == (work / "obstore.bin").read_bytes()
        print(f"| client ({size >> 20} MiB object) | upload MB/s | download MB/s | bytes received for an 8 KB range |")
        print("|---|---|---|---|")
        for name, up, down, moved, n in rows:
            print(f"| {name} | {size / up / 1e6:.0f} | {size / down / 1e6:.0f} | {moved:,} (for {n:,}) |")
    finally:
        server.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
