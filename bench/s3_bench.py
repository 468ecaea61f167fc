"""ckpt bucket -> bucket against a plain client copy of the same bytes, on a real S3 server.

    python bench/s3_bench.py [--gb 1.0] [--rounds 3] [--out DIR]

Starts SeaweedFS on 127.0.0.1 (tests/s3server.py: free ports, telemetry off), makes the sources
of bench.py (a 4-rank bf16 DCP for ``export``; an 8-rank fp32 model + AdamW checkpoint for
``reshard``), uploads them, then per round:

- ``s3fs copy``: download the source prefix and upload it to another prefix with s3fs (the
  library ckpt uses), in a process of its own: the floor for moving the bytes through a client;
- ``ckpt export`` / ``ckpt reshard 8→4``: bucket to bucket, as a user runs them.

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


def _llama_config(hf: Path) -> None:
    """The config.json of bench.make_hf's Llama shapes (its layer count read from the index)."""
    import json

    names = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    layers = len({n.split(".")[2] for n in names if n.startswith("model.layers.")})
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
        "num_hidden_layers": layers, "vocab_size": 32000, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-s3bench-", dir=args.out))
    server = start_server(work / "server")
    try:
        make_bucket(server, "bench")
        env = {**os.environ, **server.env()}
        os.environ.update(server.env())
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=server.endpoint)
        import ckpt_tools

        make_hf(work / "hf", args.gb, __import__("torch").bfloat16)
        _llama_config(work / "hf")  # export writes what from_pretrained loads: it needs the config
        ckpt_tools.convert(work / "hf", work / "dcp", to="dcp", world_size=4, progress=False)
        make_sharded_with_adam(work / "ws8", args.gb, 8)
        cases = []
        for name, local in (("dcp", work / "dcp"), ("ws8", work / "ws8")):
            fs.put(str(local) + "/", f"bench/src/{name}/", recursive=True)
            cases.append((name, du(local)))
        print(f"sources: DCP {cases[0][1] / 2**30:.2f} GiB (4 ranks, bf16), rank files {cases[1][1] / 2**30:.2f} GiB "
              f"(8 ranks, fp32 + AdamW)", file=sys.stderr)
        tools = [
            ("s3fs copy (DCP)", [sys.executable, "-c", COPY, "bench/src/dcp", "bench/out/copy_dcp"], "out/copy_dcp"),
            ("ckpt export (DCP → HF)", [sys.executable, "-m", "ckpt_tools", "export", "s3://bench/src/dcp",
                                       "s3://bench/out/hf", "--base", str(work / "hf"), "--quiet"], "out/hf"),
            ("s3fs copy (rank files)", [sys.executable, "-c", COPY, "bench/src/ws8", "bench/out/copy_ws8"],
             "out/copy_ws8"),
            ("ckpt reshard 8→4", [sys.executable, "-m", "ckpt_tools", "reshard", "s3://bench/src/ws8",
                                  "s3://bench/out/ws4", "--to", "4", "--quiet"], "out/ws4"),
        ]
        runs: dict[str, list[dict]] = {n: [] for n, _, _ in tools}
        for _ in range(args.rounds):
            for name, argv, out in tools:
                if fs.exists(f"bench/{out}"):
                    fs.rm(f"bench/{out}", recursive=True)
                runs[name].append(timed(argv, env, work / "tmp"))
        print("| bucket → bucket | time (s) | × s3fs copy | peak RSS (MiB) | peak anon (MiB) | peak local disk (MiB) |")
        print("|---|---|---|---|---|---|")
        base = None
        for name, _, _ in tools:
            rs = sorted(runs[name], key=lambda r: r["seconds"])
            r = rs[len(rs) // 2]
            if name.startswith("s3fs"):
                base = r["seconds"]
            print(f"| {name} | {r['seconds']:.2f} | {r['seconds'] / base:.2f} | {r['peak_rss'] / 2**20:.0f} | "
                  f"{r['peak_anon'] / 2**20:.0f} | {r['peak_disk'] / 2**20:.0f} |"
                  + ("" if all(x["ok"] for x in rs) else " FAILED"))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
