#!/usr/bin/env python3
"""Fails on CUDA calls in src/ that wait for the whole device or run on the
legacy default stream, outside tests/cuda_lint_allow.txt (each entry with
its reason): cudaMallocHost, cudaFreeHost, cudaMalloc(, cudaFree(,
cudaDeviceSynchronize, synchronous cudaMemcpy*/cudaMemset*, and a literal
stream 0 (an *Async call, cudaEventRecord or a kernel launch). Such a call
may wait for every kernel on the device, another group's NCCL kernel
spinning for a peer among them. An allow-list entry that matches nothing
fails too, so the list stays true. With a build directory, also fails on an
include directory named SYSTEM in its compile commands (a CMake keyword
misplaced in target_include_directories).
  tests/cuda_lint.py [BUILD_DIR]"""
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOW = os.path.join(ROOT, "tests", "cuda_lint_allow.txt")

WHOLE_DEVICE = [
    (re.compile(r"\bcudaMallocHost\s*\("), "cudaMallocHost"),
    (re.compile(r"\bcudaFreeHost\s*\("), "cudaFreeHost"),
    (re.compile(r"\bcudaMalloc\s*\("), "cudaMalloc("),
    (re.compile(r"\bcudaFree\s*\("), "cudaFree("),
    (re.compile(r"\bcudaDeviceSynchronize\s*\("), "cudaDeviceSynchronize"),
    (re.compile(r"\bcudaMemcpy(2D|3D|Peer|3DPeer|ToSymbol|FromSymbol|2DToArray|2DFromArray)?\s*\("),
     "synchronous cudaMemcpy"),
    (re.compile(r"\bcudaMemset(2D|3D)?\s*\("), "synchronous cudaMemset"),
]
ZERO = r"(0|nullptr|NULL|cudaStreamLegacy)"
DEFAULT_STREAM = [
    # Every *Async call takes its stream last.
    (re.compile(r"\bcuda\w*Async\s*\((?:[^;]*),\s*" + ZERO + r"\s*\)\s*[;,)]"), "an Async call on stream 0"),
    (re.compile(r"\bcudaEventRecord\s*\([^,;]+,\s*" + ZERO + r"\s*\)"), "cudaEventRecord on stream 0"),
    (re.compile(r"<<<[^>]*,[^>]*,[^>]*,\s*" + ZERO + r"\s*>>>"), "a kernel launch on stream 0"),
]


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def statements(text):
    """(line number, statement text) for each statement, joined across lines."""
    start, line = 0, 1
    for m in re.finditer(r"[;{}]", text):
        chunk = text[start:m.end()]
        yield line + chunk[: len(chunk) - len(chunk.lstrip())].count("\n"), " ".join(chunk.split())
        line += chunk.count("\n")
        start = m.end()


def load_allow():
    entries = []
    with open(ALLOW, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            raw = raw.strip()
            if not raw or raw.startswith("#"):
                continue
            parts = [p.strip() for p in raw.split("|")]
            if len(parts) != 3 or not all(parts):
                sys.exit(f"{ALLOW}:{n}: expected 'path | fragment | reason'")
            entries.append({"path": parts[0], "fragment": parts[1], "reason": parts[2], "used": False, "line": n})
    return entries


def main():
    allow = load_allow()
    findings = []
    for base, _, files in os.walk(os.path.join(ROOT, "src")):
        for name in sorted(files):
            if not name.endswith((".cpp", ".h", ".cu", ".cuh")):
                continue
            path = os.path.join(base, name)
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as f:
                text = strip_comments(f.read())
            for line, stmt in statements(text):
                for pattern, what in WHOLE_DEVICE + DEFAULT_STREAM:
                    if not pattern.search(stmt):
                        continue
                    allowed = [e for e in allow if e["path"] == rel and e["fragment"] in stmt]
                    for e in allowed:
                        e["used"] = True
                    if not allowed:
                        findings.append(f"{rel}:{line}: {what}: {stmt[:160]}")
    stale = [f"{ALLOW}:{e['line']}: matches nothing in {e['path']}: {e['fragment']}" for e in allow if not e["used"]]
    if len(sys.argv) > 1:
        commands = os.path.join(sys.argv[1], "compile_commands.json")
        if os.path.exists(commands):
            with open(commands, encoding="utf-8") as f:
                for entry in json.load(f):
                    command = entry.get("command") or " ".join(entry.get("arguments", []))
                    m = re.search(r"-I\s*(\S*/SYSTEM)\b", command)
                    if m:
                        findings.append(f"{entry['file']}: include directory {m.group(1)}: SYSTEM misplaced in "
                                        "target_include_directories (it goes right after the target)")
                        break
    for text in findings + stale:
        print(text)
    if findings or stale:
        print(f"{len(findings)} finding(s), {len(stale)} stale allow-list entr(y/ies); "
              "see tests/cuda_lint_allow.txt for the format")
        return 1
    print("no CUDA call in src/ waits for the whole device or uses the default stream outside the allow-list")
    return 0


if __name__ == "__main__":
    sys.exit(main())
