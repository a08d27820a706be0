#!/usr/bin/env python3
"""Every C entry point is wrapped in Java, C#, Rust and Go, or excluded.

The entry points are the slots of DP_API_SLOTS (include/dparallel/dp_api.h).
A language wraps `dp_NAME` when its sources call it:
  java, csharp  dp_NAME( in bindings/swig (the shared C++ classes and
                interfaces) or in that language's own sources;
  rust          (....NAME)( through the table, in bindings/rust/src (not the
                table's mirror, sys.rs);
  go            C.dpgo_NAME( in the package's .go files (not its tests), or
                a->NAME( in its C side.
The fields of the option and statistics structs (STRUCTS below) count too:
a language uses FIELD of dp_STRUCT when one of its source files (as above;
for Rust, not sys.rs) names dp_STRUCT and `.FIELD` or `->FIELD`, so an option appended to a struct is set by every binding.
bindings/EXCLUDED.md lists, under a heading per language, the entry points
and fields that language leaves out on purpose, each with its reason:
  ## Java
  - `dp_NAME`: why a user of Java does not need it
  - `dp_STRUCT.FIELD`: why a user of Java does not need it
An entry point or field neither wrapped nor excluded fails the check, as do
an exclusion without a reason, one for a name that is not a slot or field,
and one for what the language wraps after all.

  coverage.py [--root DIR] [--extra-slot NAME]... [--extra-field STRUCT.FIELD]...
--extra-slot and --extra-field add a slot or a field (the self-tests: a new,
unwrapped entry point or option must fail the check)."""
import argparse
import pathlib
import re
import sys

LANGUAGES = {"Java": "java", "C#": "csharp", "Rust": "rust", "Go": "go"}


def slots(root):
    text = (root / "include/dparallel/dp_api.h").read_text()
    block = text[text.index("#define DP_API_SLOTS(X)"):]
    block = block[: block.index("/* clang-format on */")]
    return re.findall(r"X\(\s*[^,]+,\s*(\w+)\s*,", block)


# (header, struct) whose fields every binding must reach; struct_size is the
# binding's own business.
STRUCTS = [("dp_dist.h", "dp_process_group_options"), ("dp_ddp.h", "dp_ddp_options"),
           ("dp_ddp.h", "dp_ddp_stats"), ("dp_fsdp.h", "dp_fsdp_options"), ("dp_base.h", "dp_memory_stats")]


def fields(root):
    """["STRUCT.FIELD"] of STRUCTS without the dp_ prefix, in declaration order."""
    found = []
    for header, struct in STRUCTS:
        text = (root / "include/dparallel" / header).read_text()
        start = text.index("typedef struct " + struct + " {")
        body = text[text.index("{", start) + 1: text.index("} " + struct + ";", start)]
        body = re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.S)
        names = re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*;", body)
        if len(names) != body.count(";"):
            raise ValueError(f"{header}: {struct} has {body.count(';')} members but {len(names)} were read")
        found += [f"{struct[3:]}.{name}" for name in names if name != "struct_size"]
    return found


def read_all(paths):
    """Each file's text."""
    return [p.read_text(errors="replace") for p in paths if p.is_file()]


def sources(root):
    b = root / "bindings"
    swig = list((b / "swig").glob("*.hpp")) + list((b / "swig").glob("*.i"))
    return {
        "java": read_all(swig + list((b / "swig/java").rglob("*")) + list((b / "java/src").rglob("*.java"))),
        "csharp": read_all(swig + list((b / "swig/csharp").rglob("*")) + list((b / "csharp/src").rglob("*.cs"))),
        "rust": read_all(p for p in (b / "rust/src").rglob("*.rs") if p.name != "sys.rs"),
        "go": read_all([p for p in (b / "go").glob("*.go") if not p.name.endswith("_test.go")]
                       + list((b / "go").glob("*.c"))),
    }


def wraps(language, files, name):
    if "." in name:  # a struct field: a member access in a file that names the struct
        struct, field = name.split(".", 1)
        return any(re.search(r"\bdp_" + struct + r"\b", text) and re.search(r"(\.|->)\s*" + field + r"\b", text)
                   for text in files)
    text = "\n".join(files)
    if language in ("java", "csharp"):
        pattern = r"\bdp_" + name + r"\s*\("
    elif language == "rust":
        pattern = r"\.\s*" + name + r"\s*\)\s*\("
    else:
        pattern = r"\bC\.dpgo_" + name + r"\s*\(|->\s*" + name + r"\s*\("
    return re.search(pattern, text) is not None


def exclusions(path, problems):
    """{language: {name: reason}} from EXCLUDED.md."""
    found = {lang: {} for lang in LANGUAGES.values()}
    language = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        heading = re.match(r"##\s+(.+?)\s*$", line)
        if heading:
            language = LANGUAGES.get(heading.group(1))
            if language is None:
                problems.append(f"{path.name}:{number}: heading '{heading.group(1)}' is not one of "
                                f"{', '.join(LANGUAGES)}")
            continue
        entry = re.match(r"-\s+`dp_(\w+(?:\.\w+)?)`\s*:?\s*(.*)$", line)
        if not entry:
            continue
        if language is None:
            problems.append(f"{path.name}:{number}: `dp_{entry.group(1)}` is under no language heading")
            continue
        name, reason = entry.group(1), entry.group(2).strip()
        if len(reason.split()) < 4:
            problems.append(f"{path.name}:{number}: `dp_{name}` ({language}) needs a reason a user would accept")
        found[language][name] = reason
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent, type=pathlib.Path)
    parser.add_argument("--extra-slot", action="append", default=[])
    parser.add_argument("--extra-field", action="append", default=[])
    args = parser.parse_args()
    entry_points = slots(args.root) + args.extra_slot
    if len(entry_points) < 100:
        print(f"coverage: read only {len(entry_points)} slots from dp_api.h; the parser is out of date",
              file=sys.stderr)
        return 2
    try:
        struct_fields = fields(args.root)
    except ValueError as e:
        print(f"coverage: {e}; the parser is out of date", file=sys.stderr)
        return 2
    struct_fields += [f[3:] if f.startswith("dp_") else f for f in args.extra_field]
    if len(struct_fields) < 30:
        print(f"coverage: read only {len(struct_fields)} struct fields; the parser is out of date", file=sys.stderr)
        return 2
    names = entry_points + struct_fields
    problems = []
    excluded = exclusions(args.root / "bindings/EXCLUDED.md", problems)
    texts = sources(args.root)
    wrapped_count = {}
    for language, text in texts.items():
        wrapped_count[language] = 0
        for name in names:
            wrapped = wraps(language, text, name)
            wrapped_count[language] += wrapped
            if wrapped and name in excluded[language]:
                problems.append(f"{language}: dp_{name} is wrapped but listed in EXCLUDED.md; drop the entry")
            elif not wrapped and name not in excluded[language]:
                problems.append(f"{language}: dp_{name} is neither wrapped nor listed in EXCLUDED.md")
        for name in excluded[language]:
            if name not in names:
                problems.append(f"{language}: EXCLUDED.md lists dp_{name}, which is not an entry point")
    for language, count in wrapped_count.items():
        print(f"{language}: {count} of {len(names)} entry points and struct fields wrapped, "
              f"{len(excluded[language])} excluded with a reason")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
