"""ckpt bucket -> bucket against a plain client copy of the same bytes, on a real S3 server.

    python bench/s3_bench.py [--gb 1.0] [--hidden 4096] [--rounds 3] [--cases export,reshard] [--out DIR]

Starts SeaweedFS on 127.0.0.1 (tests/s3server.py: free ports, telemetry off), makes the sources
of bench.py (a 4-rank bf16 DCP for ``export``; an 8-rank fp32 model + AdamW checkpoint for
``reshard``), uploads them, then per round:

- ``s3fs copy``: download the source prefix and upload it to another prefix with s3fs (the
  library ckpt uses), in a process of its own: the floor for moving the bytes through a client;
- ``boto3 copy``: the same with boto3's transfer manager (``download_file`` then ``upload_file``
  of each object, its default 8 MiB parts and 10 threads), when ``import boto3`` works in the
  benchmark's environment (``PYTHONPATH`` may point at a ``pip install --target`` of boto3 and
  s3transfer matching the installed botocore);
- ``ckpt export`` / ``ckpt reshard 8→4``: bucket to bucket, as a user runs them.

``--hidden 2048 --gb 0.3`` makes a 347 MiB source (one layer of a 2048-wide Llama and its
embeddings) for the export case alone (``--cases export``).

Medians over rounds; peak RSS and peak anonymous RSS sampled from /proc every 20 ms; peak local
disk (allocated blocks under the run's own TMPDIR: the stand-in of the source and the staging
tree; the s3fs copy's temporary directory) every 100 ms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent)]

from bench import Peak, du, make_hf, make_sharded_with_adam  # noqa: E402
from s3server import make_bucket, start_server  # noqa: E402

COPY = """
import os, sys, tempfile, s3fs
fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=os.environ["AWS_ENDPOINT_URL"])
src, dst = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as d:
    fs.get(src + "/", d + "/x/", recursive=True)
    fs.put(d + "/x/", dst + "/", recursive=True)
"""

BOTO3_COPY = """
import os, sys, tempfile, boto3
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
bucket, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=src + "/")
        for o in page.get("Contents", [])]
with tempfile.TemporaryDirectory() as d:
    for k in keys:
        local = os.path.join(d, k[len(src) + 1:])
        os.makedirs(os.path.dirname(local), exist_ok=True)
        s3.download_file(bucket, k, local)
    for k in keys:
        s3.upload_file(os.path.join(d, k[len(src) + 1:]), bucket, dst + k[len(src):])
"""


def has_boto3(env: dict[str, str]) -> bool:
    return subprocess.run([sys.executable, "-c", "import boto3"], env=env, capture_output=True).returncode == 0


class PeakDisk:
    """Samples the disk allocated under a directory (a run's TMPDIR: stand-in and staging) until stopped."""

    def __init__(self, root: Path):
        self.root, self.peak, self._stop = root, 0, False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            used = 0
            for d, _, names in os.walk(self.root):
                for n in names:
                    try:
                        used += os.lstat(os.path.join(d, n)).st_blocks * 512
                    except OSError:
                        pass
            self.peak = max(self.peak, used)
            time.sleep(0.1)

    def stop(self):
        self._stop = True
        self._t.join()


def timed(argv: list[str], env: dict[str, str], tmp: Path) -> dict:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**env, "TMPDIR": str(tmp)})
    peak, disk = Peak(p.pid), PeakDisk(tmp)
    _, err = p.communicate()
    dt = time.perf_counter() - t0
    peak.stop()
    disk.stop()
    if p.returncode:
        print(f"{argv[:4]} failed: {err.decode()[-2000:]}", file=sys.stderr)
    return {"seconds": dt, "peak_rss": peak.rss, "peak_anon": peak.anon, "peak_disk": disk.peak,
            "ok": p.returncode == 0}


def _llama_config(hf: Path, hidden: int = 4096) -> None:
    """The config.json of bench.make_hf's Llama shapes (its layer count read from the index)."""
    import json

    names = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    layers = len({n.split(".")[2] for n in names if n.startswith("model.layers.")})
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": hidden * 11008 // 4096, "num_attention_heads": hidden // 128,
        "num_key_value_heads": hidden // 128,
        "num_hidden_layers": layers, "vocab_size": 32000, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--cases", default="export,reshard")
    args = ap.parse_args()
    wanted = set(args.cases.split(","))
    work = Path(tempfile.mkdtemp(prefix="ckpt-s3bench-", dir=args.out))
    server = start_server(work / "server")
    try:
        make_bucket(server, "bench")
        env = {**os.environ, **server.env()}
        os.environ.update(server.env())
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=server.endpoint)
        import ckpt_tools

        boto3 = has_boto3(env)
        tools = []
        if "export" in wanted:
            make_hf(work / "hf", args.gb, __import__("torch").bfloat16, hidden=args.hidden)
            _llama_config(work / "hf", args.hidden)  # export writes what from_pretrained loads: it needs the config
            ckpt_tools.convert(work / "hf", work / "dcp", to="dcp", world_size=4, progress=False)
            fs.put(str(work / "dcp") + "/", "bench/src/dcp/", recursive=True)
            print(f"source: DCP {du(work / 'dcp') / 2**20:.0f} MiB (4 ranks, bf16)", file=sys.stderr)
            tools += [("s3fs copy (DCP)", [sys.executable, "-c", COPY, "bench/src/dcp", "bench/out/copy_dcp"],
                       "out/copy_dcp")]
            tools += [("boto3 copy (DCP)", [sys.executable, "-c", BOTO3_COPY, "bench", "src/dcp", "out/b3_dcp"],
                       "out/b3_dcp")] if boto3 else []
            tools += [("ckpt export (DCP → HF)", [sys.executable, "-m", "ckpt_tools", "export", "s3://bench/src/dcp",
                                                 "s3://bench/out/hf", "--base", str(work / "hf"), "--quiet"], "out/hf")]
        if "reshard" in wanted:
            make_sharded_with_adam(work / "ws8", args.gb, 8)
            fs.put(str(work / "ws8") + "/", "bench/src/ws8/", recursive=True)
            print(f"source: rank files {du(work / 'ws8') / 2**30:.2f} GiB (8 ranks, fp32 + AdamW)", file=sys.stderr)
            tools += [("s3fs copy (rank files)", [sys.executable, "-c", COPY, "bench/src/ws8", "bench/out/copy_ws8"],
                       "out/copy_ws8")]
            tools += [("boto3 copy (rank files)", [sys.executable, "-c", BOTO3_COPY, "bench", "src/ws8", "out/b3_ws8"],
                       "out/b3_ws8")] if boto3 else []
            tools += [("ckpt reshard 8→4", [sys.executable, "-m", "ckpt_tools", "reshard", "s3://bench/src/ws8",
                                            "s3://bench/out/ws4", "--to", "4", "--quiet"], "out/ws4")]
        if not boto3:
            print("boto3 is not importable here: no boto3 baseline", file=sys.stderr)
        print(f"load average before: {os.getloadavg()}", file=sys.stderr)
        runs: dict[str, list[dict]] = {n: [] for n, _, _ in tools}
        for _ in range(args.rounds):
            for name, argv, out in tools:
                if fs.exists(f"bench/{out}"):
                    fs.rm(f"bench/{out}", recursive=True)
                runs[name].append(timed(argv, env, work / "tmp"))
        print(f"load average after: {os.getloadavg()}", file=sys.stderr)
        print("| bucket → bucket | time (s) | × s3fs copy | × boto3 copy | peak RSS (MiB) | peak anon (MiB) | "
              "peak local disk (MiB) |")
        print("|---|---|---|---|---|---|---|")
        base = b3 = None
        for name, _, _ in tools:
            rs = sorted(runs[name], key=lambda r: r["seconds"])
            r = rs[len(rs) // 2]
            if name.startswith("s3fs"):
                base, b3 = r["seconds"], None
            if name.startswith("boto3"):
                b3 = r["seconds"]
            print(f"| {name} | {r['seconds']:.2f} | {r['seconds'] / base:.2f} | "
                  f"{'%.2f' % (r['seconds'] / b3) if b3 else '–'} | {r['peak_rss'] / 2**20:.0f} | "
                  f"{r['peak_anon'] / 2**20:.0f} | {r['peak_disk'] / 2**20:.0f} |"
                  + ("" if all(x["ok"] for x in rs) else " FAILED"))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
