#!/usr/bin/env python3
"""An independent reader for files ofl writes: parses the safetensors layout
with the standard library only and recomputes every value.

Usage: check_safetensors.py WRITER_EXE DIR [ARGS...]
         (runs WRITER_EXE DIR/sample.safetensors ARGS...)
       check_safetensors.py --file PATH     (checks an existing file's layout)
Prints TAP."""
import json
import os
import struct
import subprocess
import sys
import tempfile

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
         "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
         "F64": 8, "U16": 2, "U32": 4, "U64": 8}

results = []


def check(cond, what):
    results.append((bool(cond), what))
    return cond


def parse(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    check((8 + n) % 8 == 0, "data starts on an 8-byte boundary")
    raw = blob[8:8 + n]
    check(raw.rstrip(b" ").endswith(b"}"), "header is JSON padded with spaces")
    header = json.loads(raw.decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k)
                   for k, v in header.items())
    at = 0
    for begin, end, name in spans:
        check(begin == at, "tensor %r is contiguous (begin %d, expected %d)"
              % (name, begin, at))
        info = header[name]
        elems = 1
        for d in info["shape"]:
            elems *= d
        check(end - begin == elems * SIZES[info["dtype"]],
              "tensor %r size matches shape and dtype" % name)
        check(begin % SIZES[info["dtype"]] == 0,
              "tensor %r is aligned to its element size" % name)
        at = end
    check(at == len(data), "data section has no trailing bytes")
    return header, meta, data


def expected(dtype, j):
    f = (j - 3.0) * 0.25
    if dtype == "F32" or dtype == "F16" or dtype == "F64":
        return f
    if dtype == "U16":
        return 65535 - j * 1000
    if dtype == "U32":
        return 4000000000 - j * 100000
    if dtype == "U64":
        return 18000000000000000000 - j * 1000000000000
    if dtype == "BF16":
        return struct.unpack("<I", struct.pack("<f", f))[0] >> 16
    if dtype == "I64":
        return j * 1000000000000 - 5
    if dtype == "I32":
        return j * 100000 - 7
    if dtype == "I16":
        return j * 1000 - 30000
    if dtype == "BOOL":
        return 1 if j % 3 == 0 else 0
    if dtype == "I8":
        v = (j * 7 + 1) & 0xFF
        return v - 256 if v > 127 else v
    return (j * 7 + 1) & 0xFF


FMT = {"F32": "<f", "F16": "<e", "BF16": "<H", "I64": "<q", "I32": "<i",
       "I16": "<h", "I8": "<b", "U8": "<B", "BOOL": "<B", "F8_E4M3": "<B",
       "F8_E5M2": "<B", "F64": "<d", "U16": "<H", "U32": "<I", "U64": "<Q"}


def check_values(header, data):
    check(len(header) == len(SIZES), "one tensor of each of the %d dtypes"
          % len(SIZES))
    for name, info in sorted(header.items()):
        dt = info["dtype"]
        check(name == 'model."%s"\\w\t%d' % (dt, list(SIZES).index(dt)),
              "escaped name %r decodes to the name ofl was given" % name)
        begin, end = info["data_offsets"]
        size = SIZES[dt]
        wrong = 0
        for j in range((end - begin) // size):
            (v,) = struct.unpack_from(FMT[dt], data, begin + j * size)
            if v != expected(dt, j):
                wrong += 1
        check(wrong == 0, "%s values recomputed (%d wrong)" % (dt, wrong))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--file":
        parse(sys.argv[2])
    elif len(sys.argv) >= 3:
        with tempfile.TemporaryDirectory(dir=sys.argv[2]) as d:
            path = os.path.join(d, "sample.safetensors")
            rc = subprocess.run([sys.argv[1], path] + sys.argv[3:]).returncode
            if not check(rc == 0, "ofl writer exited 0"):
                pass
            else:
                header, meta, data = parse(path)
                check(meta == {"format": "pt", "writer": "ofl"},
                      "metadata round trip")
                check_values(header, data)
                check(sorted(os.listdir(d)) == ["sample.safetensors"],
                      "no temporary file left next to the checkpoint")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print("TAP version 13")
    print("1..%d" % len(results))
    for i, (ok, what) in enumerate(results, 1):
        print("%sok %d - %s" % ("" if ok else "not ", i, what))
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
