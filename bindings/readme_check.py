#!/usr/bin/env python3
"""Runs bindings/README.md as a new user would.

In the README, under a `## ` heading per language:
  <!-- file: NAME -->   the fenced block that follows is written to NAME;
  <!-- run -->          the ```sh block that follows runs (bash -eu) with
                        PREFIX (a fresh install prefix) and DPARALLEL (the
                        source tree) set, in that section's own empty folder;
  <!-- expect: TEXT --> the next run's output must contain TEXT.
The section "## The library" runs first in every folder: it installs the
build under test (a link named `build` in the folder points at it).

  readme_check.py --build DIR SECTION...   runs those sections
  readme_check.py --list                   prints the sections"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

LIBRARY = "The library"


def sections(readme):
    """[(title, [(kind, value, block)])], in README order."""
    found, current, pending = [], None, []
    lines = readme.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = re.match(r"## (.+?)\s*$", line)
        marker = re.match(r"<!-- (file|run|expect)(?::\s*(.*?))?\s*-->$", line.strip())
        if heading:
            current = (heading.group(1), [])
            found.append(current)
            pending = []
        elif marker and current is not None:
            pending.append((marker.group(1), marker.group(2) or ""))
        elif line.startswith("```") and pending:
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            block = "\n".join(lines[i + 1:end]) + "\n"
            for kind, value in pending:
                current[1].append((kind, value, block))
            pending = []
            i = end
        i += 1
    return found


def run_section(title, steps, folder, env):
    expected = []
    for kind, value, block in steps:
        if kind == "file":
            (folder / value).write_text(block)
        elif kind == "expect":
            expected.append(value)
        elif kind == "run":
            print(f"== {title}: running\n{block}", flush=True)
            result = subprocess.run(["bash", "-euc", block], cwd=folder, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            print(result.stdout, end="", flush=True)
            if result.returncode != 0:
                print(f"FAIL: {title}: the block above exited with {result.returncode}", file=sys.stderr)
                return False
            for text in expected:
                if text not in result.stdout:
                    print(f"FAIL: {title}: the output lacks {text!r}", file=sys.stderr)
                    return False
            expected = []
    if expected:
        print(f"FAIL: {title}: an expect marker with no run block after it", file=sys.stderr)
        return False
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--readme", type=pathlib.Path,
                        default=pathlib.Path(__file__).resolve().parent / "README.md")
    parser.add_argument("--build", type=pathlib.Path)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("section", nargs="*")
    args = parser.parse_args()
    found = dict(sections(args.readme))
    if args.list:
        print("\n".join(title for title, steps in found.items() if steps))
        return 0
    if not args.build or not args.section:
        parser.error("give --build and at least one section")
    for title in [LIBRARY] + args.section:
        if not any(kind == "run" for kind, _, _ in found.get(title, [])):
            print(f"FAIL: README has no section '{title}' with a run block", file=sys.stderr)
            return 1
    source = pathlib.Path(__file__).resolve().parent.parent
    ok = True
    for title in args.section:
        with tempfile.TemporaryDirectory(prefix="dp-readme-") as tmp:
            folder = pathlib.Path(tmp) / "work"
            folder.mkdir()
            (folder / "build").symlink_to(args.build.resolve())
            env = dict(os.environ, PREFIX=str(pathlib.Path(tmp) / "prefix"), DPARALLEL=str(source))
            for name in ("LD_LIBRARY_PATH", "DP_LIBRARY"):
                env.pop(name, None)  # only what the README sets
            ok = run_section(LIBRARY, found[LIBRARY], folder, env) and run_section(title, found[title], folder, env) and ok
            shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
