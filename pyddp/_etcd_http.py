"""The HTTP/1.1 that pyddp's etcd client speaks to etcd's JSON gateway: one request at a
time on a connection, a reply read whole (``Conn.request``) or a streamed reply read line
by line (``Conn.stream`` then ``Conn.next_line``), over plain TCP or TLS (``ssl``).

Written on the socket rather than on ``http.client`` so that every read has the
caller's deadline and a read that runs out of time never leaves a half-read line behind:
a watch waits in slices (to look at its own deadline and at the health of its member)
and must be able to go on reading after an empty slice. Nothing here knows etcd: a
member is an ``(scheme, host, port)``; errors are ``OSError`` (``TimeoutError`` for a
deadline) and ``ProtocolError`` for a reply that is not HTTP.
"""
import socket
import ssl
import time

_MAX_HEADER = 64 * 1024
_MAX_BODY = 256 * 1024 * 1024


class ProtocolError(OSError):
    """The peer did not answer in HTTP/1.1 (not an etcd member, or a broken stream)."""


class Conn:
    """One connection to one member (scheme "http" or "https"). Not thread-safe: one
    user at a time. Usable again after a complete request; after any error it is
    closed (``closed`` is True) and the caller makes a new one."""

    def __init__(self, scheme, host, port, tls=None, connect_timeout=2.0):
        """Connect to host:port within connect_timeout s; tls: an ssl.SSLContext for
        "https" (required then). Raises OSError (TimeoutError, ConnectionRefusedError,
        ssl.SSLError) on failure."""
        self.host, self.port = host, port
        sock = socket.create_connection((host, port), timeout=connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == "https":
                sock = tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._buf = bytearray()
        self._state = None          # a streamed reply: "size", "data" or "crlf" next
        self._chunk_left = 0        # ... and the bytes left in the current chunk
        self._pending = bytearray()  # ... and the decoded bytes not yet returned
        self.closed = False

    def shutdown(self):
        """From another thread: make a read in progress on this connection fail now."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self):
        if not self.closed:
            self.closed = True
            try:
                self._sock.close()
            except OSError:
                pass

    # -- reading with a deadline -----------------------------------------------------

    def _fill(self, deadline):
        """Read more bytes into the buffer; TimeoutError when deadline (monotonic) has
        passed with nothing read; ProtocolError when the peer closed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self._sock.settimeout(left)
        try:
            data = self._sock.recv(65536)
        except socket.timeout:
            raise TimeoutError("timed out") from None
        except ssl.SSLWantReadError:
            return
        if not data:
            raise ProtocolError("the connection was closed by the peer")
        self._buf += data

    def _line(self, deadline, limit=_MAX_HEADER):
        """One CRLF- or LF-terminated line (without it), waiting until deadline."""
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[:i + 1]
                return line.rstrip(b"\r")
            if len(self._buf) > limit:
                raise ProtocolError("a line of the reply is too long")
            self._fill(deadline)

    def _exact(self, n, deadline):
        while len(self._buf) < n:
            self._fill(deadline)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _head(self, deadline):
        """(status, headers dict with lower-case names) of a reply."""
        status_line = self._line(deadline)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP reply: {status_line[:80]!r}")
        headers = {}
        while True:
            line = self._line(deadline)
            if not line:
                break
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        return int(parts[1]), headers

    # -- requests ----------------------------------------------------------------------

    def _send(self, path, body, headers, deadline):
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self._sock.settimeout(left)
        try:
            self._sock.sendall(data)
        except socket.timeout:
            raise TimeoutError("timed out") from None

    def request(self, path, body, headers=None, timeout=2.0):
        """POST body (bytes) to path; (status, reply body bytes), read whole within
        timeout s. The connection stays open for the next request unless the peer
        asked to close it. Any failure closes it and raises OSError."""
        deadline = time.monotonic() + timeout
        try:
            self._send(path, body, headers, deadline)
            status, head = self._head(deadline)
            if head.get("transfer-encoding", "").lower() == "chunked":
                reply = b""
                while True:
                    n = self._chunk_size(deadline)
                    if n == 0:
                        self._line(deadline)
                        break
                    reply += self._exact(n, deadline)
                    self._line(deadline)
            else:
                n = int(head.get("content-length", "0") or 0)
                if n > _MAX_BODY:
                    raise ProtocolError(f"a reply of {n} bytes")
                reply = self._exact(n, deadline)
            if head.get("connection", "").lower() == "close":
                self.close()
            return status, reply
        except BaseException:
            self.close()
            raise

    def _chunk_size(self, deadline):
        raw = self._line(deadline).split(b";")[0].strip()
        try:
            return int(raw, 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {raw[:20]!r}") from None

    def stream(self, path, body, headers=None, timeout=2.0):
        """POST body and read the head of a streamed (chunked) reply within timeout s:
        the status; then read its lines with next_line. A reply that is not streamed
        (an error) is read whole: (status, body) with body not None."""
        deadline = time.monotonic() + timeout
        try:
            self._send(path, body, headers, deadline)
            status, head = self._head(deadline)
            if head.get("transfer-encoding", "").lower() != "chunked":
                n = int(head.get("content-length", "0") or 0)
                body = self._exact(min(n, _MAX_BODY), deadline)
                self.close()
                return status, body
            self._state, self._chunk_left = "size", 0
            self._pending = bytearray()
            return status, None
        except BaseException:
            self.close()
            raise

    def next_line(self, deadline):
        """The next newline-terminated line of a streamed reply (without the newline),
        or None when deadline passes first (the stream stays usable: only whole lines
        and buffered chunk data are consumed, so the next call goes on where this one
        stopped). Raises ProtocolError when the stream ended or is malformed."""
        while True:
            i = self._pending.find(b"\n")
            if i >= 0:
                line = bytes(self._pending[:i])
                del self._pending[:i + 1]
                return line
            try:
                if self._state != "data" and not self._has_line():
                    self._fill(deadline)
                elif self._state == "size":
                    n = self._chunk_size(deadline)
                    if n == 0:
                        raise ProtocolError("the stream ended")
                    self._chunk_left, self._state = n, "data"
                elif self._state == "crlf":
                    self._line(deadline)
                    self._state = "size"
                elif not self._buf:
                    self._fill(deadline)
                else:
                    take = min(self._chunk_left, len(self._buf))
                    self._pending += self._buf[:take]
                    del self._buf[:take]
                    self._chunk_left -= take
                    if self._chunk_left == 0:
                        self._state = "crlf"
            except TimeoutError:
                return None
            except BaseException:
                self.close()
                raise

    def _has_line(self):
        return self._buf.find(b"\n") >= 0
