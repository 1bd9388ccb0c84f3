"""A TCP proxy, run as its own process, that fails the first N connections and then forwards.

    python flaky_proxy.py TARGET_PORT MODE N LOG

MODE ``drop``: the connection is accepted and reset at once (a dropped connection).
MODE ``throttle``: the request is read and answered ``503 SlowDown``, S3's throttling reply.
Every later connection is forwarded to 127.0.0.1:TARGET_PORT both ways. The proxy listens on a
free loopback port, prints it on the first line of its stdout, and appends one line per fault
to LOG, so a test knows the faults really happened.
"""

import socket
import struct
import sys
import threading

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def main() -> None:
    target_port, mode, faults, log = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    while True:
        client, _ = server.accept()
        if faults > 0:
            faults -= 1
            with open(log, "a") as f:  # before the fault: the client may read the log as soon as it fails
                f.write(f"{mode}\n")
            (_drop if mode == "drop" else _throttle)(client)
            continue
        upstream = socket.create_connection(("127.0.0.1", target_port))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _drop(client: socket.socket) -> None:
    # SO_LINGER 0: close sends a RST, as a load balancer or NAT that drops the connection does.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


def _throttle(client: socket.socket) -> None:
    request = b""
    while b"\r\n\r\n" not in request:
        chunk = client.recv(65536)
        if not chunk:
            break
        request += chunk
    head, _, body = request.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), 0
    )
    if b"expect: 100-continue" in head.lower():  # the client waits for our answer before the body
        length = 0
    while len(body) < length:  # read the whole request, so the client sees the answer, not a reset
        chunk = client.recv(65536)
        if not chunk:
            break
        body += chunk
    client.sendall(
        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        + f"Content-Length: {len(SLOW_DOWN)}\r\n\r\n".encode()
        + (b"" if head.startswith(b"HEAD ") else SLOW_DOWN)  # an answer to HEAD has no body
    )
    client.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


if __name__ == "__main__":
    main()
