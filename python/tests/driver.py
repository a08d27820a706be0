"""Runs one of the package's tests as a user would: installs the wheel with
pip (offline) into a fresh folder, then runs the test with that folder on
the path and nothing pointing at the build tree. Exits 77 (ctest's skip)
with the reason when the interpreter, its pip or torch is missing, except
in CI (--ci non-empty), where that fails the test: CI installs them.
  driver.py --python PY --wheel WHL --work DIR [--ci CI] [--need-torch] SCRIPT [ARGS...]"""
import argparse
import os
import shutil
import subprocess
import sys

SKIP = 77


CI = False


def skip(reason):
    if CI:
        print(f"FAIL: {reason} (CI installs it: tests/run.sh)", flush=True)
        return 1
    print(f"SKIP: {reason}", flush=True)
    return SKIP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", required=True)
    parser.add_argument("--wheel", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--need-torch", action="store_true")
    parser.add_argument("--ci", default="")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args()
    global CI
    CI = bool(a.ci)
    if not a.python or not os.access(a.python, os.X_OK):
        return skip(f"no Python interpreter at '{a.python}' (tests/run.sh makes build/torch2 with PyTorch from PyPI; "
                    "or configure with -DDP_TORCH_PYTHON=/path/to/python)")
    if subprocess.run([a.python, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        return skip(f"{a.python} has no pip to install the wheel with")
    if a.need_torch:
        probe = subprocess.run([a.python, "-c", "import torch; v = tuple(int(x) for x in torch.__version__.split('.')[:2]);"
                                " print(torch.__version__); assert v >= (2, 1), 'PyTorch 2.1 or later is needed'"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            return skip(f"{a.python} cannot import PyTorch 2.1 or later: {last}")
    site = os.path.join(a.work, "site")
    shutil.rmtree(site, ignore_errors=True)
    install = subprocess.run([a.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                              "--disable-pip-version-check", "--target", site, a.wheel])
    if install.returncode != 0:
        print(f"FAIL: pip could not install {a.wheel}", file=sys.stderr)
        return 1
    env = dict(os.environ, PYTHONPATH=site, DP_TEST_INSTALLED=site)
    env.pop("DP_LIBRARY", None)
    return subprocess.run([a.python, a.script] + a.args, env=env, cwd=a.work).returncode


if __name__ == "__main__":
    sys.exit(main())
