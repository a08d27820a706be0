"""Writes the dparallel wheel: the pure-Python package under python/dparallel
with the built library inside it, as a zip with the wheel's metadata
(PEP 427). Needs neither the network nor setuptools.
  python3 build_wheel.py --library libdparallel.so.0 --version 0.1.0 --out DIR"""
import argparse
import base64
import hashlib
import os
import sys
import sysconfig
import zipfile

# A fixed date makes the same inputs give the same bytes.
_DATE = (2020, 1, 1, 0, 0, 0)
_LIB_NAME = "libdparallel.so.0"


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _add(zf, name, data, executable=False):
    info = zipfile.ZipInfo(name, _DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o755 if executable else 0o644) << 16
    zf.writestr(info, data)


def platform_tag():
    # The library is built for this machine: linux_x86_64 and the like.
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def build(library, version, out, platform):
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.join(here, "dparallel")
    tag = f"py3-none-{platform}"
    dist_info = f"dparallel-{version}.dist-info"
    files = []
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                files.append((f"dparallel/{name}", f.read(), False))
    with open(library, "rb") as f:
        files.append((f"dparallel/lib/{_LIB_NAME}", f.read(), True))
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        "Name: dparallel",
        f"Version: {version}",
        "Summary: Data-parallel training (DDP reducer) for PyTorch over the dparallel library",
        "Requires-Python: >=3.8",
        "Provides-Extra: torch",
        "Requires-Dist: torch>=2.1; extra == 'torch'",
        "",
    ]).encode()
    wheel = "\n".join([
        "Wheel-Version: 1.0",
        "Generator: dparallel build_wheel.py",
        "Root-Is-Purelib: false",
        f"Tag: {tag}",
        "",
    ]).encode()
    files.append((f"{dist_info}/METADATA", metadata, False))
    files.append((f"{dist_info}/WHEEL", wheel, False))
    record = [_record_line(n, d) for n, d, _ in files] + [f"{dist_info}/RECORD,,"]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"dparallel-{version}-{tag}.whl")
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w") as zf:
        for name, data, executable in files:
            _add(zf, name, data, executable)
        _add(zf, f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode())
    os.replace(tmp, path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", required=True, help="the built libdparallel.so.0")
    parser.add_argument("--version", required=True)
    parser.add_argument("--out", required=True, help="folder for the .whl")
    parser.add_argument("--platform", default=platform_tag(), help="the platform tag (default: this machine's)")
    args = parser.parse_args()
    print(build(args.library, args.version, args.out, args.platform))
    return 0


if __name__ == "__main__":
    sys.exit(main())
