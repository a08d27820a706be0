#!/usr/bin/env python3
"""Runs README.md's commands as a user would, in a new folder.

  readme_check.py README.md WORKDIR

The README's ```go block is written to WORKDIR/main.go; each line of its
```sh block then runs there, in order, through one bash (so that exports
carry over), with DPARALLEL_SRC, DPARALLEL_LIB and the Go settings from the
environment and DP_RUN_DIR put first on PATH. The output must hold every
line of the ```text block (ranks print in any order)."""
import os
import re
import shutil
import subprocess
import sys


def blocks(text, language):
    return re.findall(r"^```" + language + r"\n(.*?)^```", text, re.M | re.S)


def main():
    readme, work = sys.argv[1], sys.argv[2]
    text = open(readme).read()
    programs, scripts, outputs = blocks(text, "go"), blocks(text, "sh"), blocks(text, "text")
    if len(programs) != 1 or len(scripts) != 1 or len(outputs) != 1:
        print(f"readme_check: want one go, one sh and one text block; found {len(programs)}, {len(scripts)}, "
              f"{len(outputs)}", file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open(os.path.join(work, "main.go"), "w") as f:
        f.write(programs[0])
    env = dict(os.environ)
    env["PATH"] = env["DP_RUN_DIR"] + os.pathsep + env.get("PATH", "")
    script = "set -euxo pipefail\n" + scripts[0]
    run = subprocess.run(["bash", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=280)
    print(run.stdout)
    if run.returncode != 0:
        print(f"readme_check: the commands failed (exit {run.returncode})", file=sys.stderr)
        return 1
    got = run.stdout.splitlines()
    missing = [line for line in outputs[0].splitlines() if line.strip() and line not in got]
    if missing:
        print(f"readme_check: the output lacks {missing}", file=sys.stderr)
        return 1
    print("readme_check: every command ran and printed what the README says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
