"""Write the fuzz targets' seed corpora (valid inputs) into DIR/store and DIR/wire.

Usage: python3 tests/fuzz/make_seeds.py DIR. Store seeds are valid request streams in
torch's TCPStore protocol (docs/design.md, "The store protocol"): VALIDATE first, then
every query pyddp serves; each seed's first byte is the target's chunk-size selector.
Wire seeds: a hello, a collective header, and handshake replies.
"""
import os
import struct
import sys

MAGIC = 0x3C85F7CE


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


def main(out):
    os.makedirs(os.path.join(out, "store"), exist_ok=True)
    os.makedirs(os.path.join(out, "wire"), exist_ok=True)
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
