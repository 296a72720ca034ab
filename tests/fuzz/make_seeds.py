"""Write the fuzz targets' seed corpora (valid inputs) into DIR/store, DIR/store_auth and
DIR/wire.

Usage: python3 tests/fuzz/make_seeds.py DIR. Store seeds are valid request streams in
torch's TCPStore protocol (docs/design.md, "The store protocol"): VALIDATE first, then
every query pyddp serves; each seed's first byte is the target's chunk-size selector.
Store-auth seeds (fuzz_store_auth.c; first byte: who authenticates, server with or without
a token, chunk size): the same requests behind a handshake the target passes itself, and
a stranger's openings (a challenge and a wrong proof, a plain VALIDATE, a pyddp client's
probe, a token sent to a server without one). Wire seeds: a hello, a collective header,
and handshake replies.
"""
import os
import struct
import sys

MAGIC = 0x3C85F7CE
AUTH_MAGIC = 0x50444441   # DDP_STORE_AUTH_MAGIC: the store handshake's challenge
AUTH_PROBE = 0x50444450   # DDP_STORE_AUTH_PROBE: a pyddp client's plain first try


def s(b):
    return struct.pack("<Q", len(b)) + b


def validate():
    return b"\x00" + struct.pack("<I", MAGIC)


def requests():
    k, v = b"/k", b"value"
    yield b"\x0d" + struct.pack("<I", 1234)                          # PING
    yield b"\x01" + s(k) + s(v)                                       # SET
    yield b"\x03" + s(k)                                              # GET
    yield b"\x04" + s(b"/n") + struct.pack("<q", 5)                   # ADD
    yield b"\x05" + struct.pack("<Q", 2) + s(k) + s(b"/n")            # CHECK
    yield b"\x06" + struct.pack("<Q", 1) + s(b"/late")                # WAIT
    yield b"\x0c"                                                     # CANCEL_WAIT
    yield b"\x02" + s(k) + s(v) + s(b"new")                           # COMPARE_SET
    yield b"\x09" + s(k) + s(b"+more")                                # APPEND
    yield b"\x0b" + struct.pack("<Q", 2) + s(b"/a") + s(b"1") + s(b"/b") + s(b"2")  # MULTI_SET
    yield b"\x0a" + struct.pack("<Q", 2) + s(b"/a") + s(b"/zz")      # MULTI_GET
    yield b"\x07"                                                     # GETNUMKEYS
    yield b"\x08" + s(k)                                              # DELETE_KEY
    yield b"\x01" + s(b"/k") + s(b"x" * 300)                          # SET, longer value


def store_auth_seeds(reqs):
    """fuzz_store_auth.c's byte 0: bit 0 the target authenticates first, bit 1 a server
    without a token, bits 2.. the chunk size."""
    challenge = b"\x70" + struct.pack("<I", AUTH_MAGIC) + bytes(range(32))
    ping = b"\x0d" + struct.pack("<I", 1234)
    plain = validate() + b"".join(reqs)
    return {"authed_all": b"\x01" + plain, "authed_all_chunked": bytes([1 | 3 << 2]) + plain,
            "authed_ping": b"\x01" + validate() + ping,
            "stranger_wrong_proof": b"\x00" + challenge + bytes(32),
            "stranger_validate": b"\x00" + validate() + ping,
            "stranger_probe": b"\x00" + validate() + b"\x0d" + struct.pack("<I", AUTH_PROBE),
            "no_token_server_challenge": b"\x02" + challenge,
            "no_token_server_all": bytes([2 | 5 << 2]) + plain}


def main(out):
    for d in ("store", "store_auth", "wire"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    reqs = list(requests())
    seeds = {"all": validate() + b"".join(reqs)}
    for i, r in enumerate(reqs):
        seeds[f"q{i}"] = validate() + r
    seeds["wait_then_set"] = validate() + b"\x06" + struct.pack("<Q", 1) + s(b"/k") + \
        b"\x01" + s(b"/k") + s(b"v")
    for name, body in seeds.items():
        for chunk in (0, 3):
            with open(os.path.join(out, "store", f"{name}_{chunk}"), "wb") as f:
                f.write(bytes([chunk]) + body)
    for name, body in store_auth_seeds(reqs).items():
        with open(os.path.join(out, "store_auth", name), "wb") as f:
            f.write(body)
    hello = struct.pack("<IIQiiII", 0x44445048, 3, 1, 1, 2, 1, 0)
    hdr = struct.pack("<IBBBBiIQQQ", 0x4C4F4344, 0, 2, 0, 0, -1, 1, 10, 3, 7)
    reply_auth = struct.pack("<II", 0x52445048, 1) + os.urandom(64)
    wire = {"hello": b"\x00" + hello, "hdr": b"\x11" + hdr,
            "connect_ok": b"\x02" + struct.pack("<II", 0x52445048, 0),
            "connect_auth": b"\x06" + reply_auth,
            "accept": b"\x07" + bytes(32) + bytes(32),
            "accept_plain": b"\x03"}
    for name, body in wire.items():
        with open(os.path.join(out, "wire", name), "wb") as f:
            f.write(body)


if __name__ == "__main__":
    main(sys.argv[1])
