"""A fault-injecting HTTP proxy on loopback, in front of the GCS emulator (tests/test_run_safety_iv.py).

Why: on a pod every byte goes through object storage, whose clients meet throttling (429), transient 5xx
and dropped connections as a matter of course; the emulator alone never fails. The proxy forwards each
request to the emulator and fails a configurable share of them, by request kind, so a test can check
that the clients' retries carry a run and that an outage ends it with one clear error.

Kinds (`kind_of`, from the object name in the request): 'lock' (`run.lock`), 'array' (Orbax's OCDBT
array data and tensorstore's manifests), 'data' (array_record dataset files), 'export' (anything under
an `export` folder), 'metadata' (every other object and listing). Faults: '429' and '503' (answered by
the proxy, the request never reaches the store), 'drop' (the request is forwarded, then the connection is
closed without an answer: the store changed, the client does not know). A request to a resumable upload
session that already completed is answered as GCS answers it (200 with the object's resource, the session
lives a week) rather than with fake-gcs-server's 404: a dropped final chunk is retried by gcsfs, and real
GCS tells it the upload is done, so the proxy keeps each completed session's answer and replays it
(`completed_sessions_replayed` counts them). `outage=True` answers 503 to
every request. Everything runs on daemon threads; `close()` stops it. Bounded: every upstream call has
a timeout, and `max_faults` caps the faults injected.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import socket
import threading
import urllib.parse
from typing import Iterable, Optional

KINDS = ("lock", "array", "data", "export", "metadata")
FAULTS = ("429", "503", "drop")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}


def kind_of(method: str, target: str, body: bytes = b"") -> str:
  """The request kind of `method target` (see the module docstring); a multipart upload names its object
  in the body's JSON part, not in the URL."""
  url = urllib.parse.urlsplit(target)
  q = urllib.parse.parse_qs(url.query)
  name = urllib.parse.unquote(url.path)
  m = re.search(r"/o/(.+)$", name)
  name = m.group(1) if m else " ".join(q.get("name", []) + q.get("prefix", []))
  if not name and body:
    found = re.search(rb'"name"\s*:\s*"([^"]+)"', body[:4096])
    name = found.group(1).decode("utf-8", "replace") if found else ""
  if "run.lock" in name:
    return "lock"
  if re.search(r"(^|/)export[^/]*/", name):
    return "export"
  if "array_record" in name or ".array_record-" in name:
    return "data"
  if re.search(r"/(d|ocdbt\.process_\d+/d)/[0-9a-f]+|/manifest", name):
    return "array"
  return "metadata"


class FaultProxy:
  """`FaultProxy(upstream_port).start()`; `url` is what the clients are pointed at."""

  def __init__(
    self,
    upstream_port: int,
    *,
    rate: float = 0.0,
    kinds: Iterable[str] = KINDS,
    faults: Iterable[str] = FAULTS,
    seed: int = 1,
    max_faults: Optional[int] = None,
    timeout_s: float = 60.0,
  ):
    self.upstream_port = int(upstream_port)
    self.rate, self.kinds, self.faults = float(rate), set(kinds), tuple(faults)
    self.max_faults, self.timeout_s = max_faults, float(timeout_s)
    self.outage = False
    self.outage_kinds = None  # with `outage`: only these kinds (None: every request)
    self.delay_s, self.delay_kinds = 0.0, set()  # slow requests of these kinds (a write in progress)
    self.seen: list = []  # (kind, method, target) of every request, in order
    self.requests = {k: 0 for k in KINDS}
    self.injected = {k: 0 for k in KINDS}
    self._rng = random.Random(seed)
    self._completed_sessions: dict = {}  # upload_id -> (status, reason, headers, body) of its final answer
    self.completed_sessions_replayed = 0
    self.drop_completing = 0  # drop the answers of this many next requests that complete an upload session
    self._lock = threading.Lock()
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):  # quiet
        pass

      def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
          out = []
          while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
              while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
              return b"".join(out)
            out.append(self.rfile.read(size))
            self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

      def _handle(self):
        body = self._body()
        fault = proxy._decide(self.command, self.path, body)
        if fault in ("429", "503"):
          msg = b'{"error": {"code": %s, "message": "injected by tests/fault_proxy.py"}}' % fault.encode()
          self.send_response(int(fault))
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(msg)))
          self.end_headers()
          self.wfile.write(msg)
          return
        session = (urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("upload_id") or [None])[
          0
        ]
        with proxy._lock:
          done = proxy._completed_sessions.get(session) if session else None
          proxy.completed_sessions_replayed += done is not None
        if done is not None:  # GCS: a completed session answers with the object (module docstring)
          status, reason, rheaders, data = done
        else:
          headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
          headers["Content-Length"] = str(len(body))
          conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=proxy.timeout_s)
          try:
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            status, reason, rheaders = r.status, r.reason, r.getheaders()
          finally:
            conn.close()
          if session and status in (200, 201):
            with proxy._lock:
              proxy._completed_sessions[session] = (status, reason, rheaders, data)
              if proxy.drop_completing > 0:
                proxy.drop_completing -= 1
                fault = "drop"
        if fault == "drop":  # the store did it; the client never hears
          self.close_connection = True
          try:
            self.connection.shutdown(socket.SHUT_RDWR)
          except OSError:
            pass
          return
        self.send_response(status, reason)
        for k, v in rheaders:
          if k.lower() not in _HOP and k.lower() != "content-length":
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
          self.wfile.write(data)

      def _quiet(self):
        try:
          self._handle()
        except (BrokenPipeError, ConnectionResetError, TimeoutError, http.client.HTTPException, OSError):
          self.close_connection = True  # the client gave up, or the store did not answer: no traceback

      do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _quiet

    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self._server.daemon_threads = True
    self.port = self._server.server_address[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

  def _decide(self, method: str, target: str, body: bytes = b"") -> Optional[str]:
    kind = kind_of(method, target, body)
    if self.delay_s and kind in self.delay_kinds:
      import time  # pylint: disable=import-outside-toplevel

      time.sleep(self.delay_s)
    with self._lock:
      self.seen.append((kind, method, urllib.parse.unquote(target)))
      self.requests[kind] += 1
      if self.outage and (self.outage_kinds is None or kind in self.outage_kinds):
        self.injected[kind] += 1
        return "503"
      if kind not in self.kinds or self.rate <= 0:
        return None
      if self.max_faults is not None and sum(self.injected.values()) >= self.max_faults:
        return None
      if self._rng.random() >= self.rate:
        return None
      self.injected[kind] += 1
      return self._rng.choice(self.faults)

  def start(self) -> "FaultProxy":
    self._thread.start()
    return self

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()
    self._thread.join(timeout=10)
