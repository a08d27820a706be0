//! Checks the crate's mirror of `struct dp_api` against the header:
//!
//!   api_mirror include/dparallel/dp_api.h
//!
//! The mirror's slot names, in order, must be the header's first slots (the
//! table is append-only, so a newer header may have more). Reads the slots
//! either from the X-macro list (`X(type, name, (params))`) or from the
//! struct's function-pointer fields (`type (*name)(params);`).

use std::process::ExitCode;

use dparallel::sys::SLOT_NAMES;

fn header_slots(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut body = String::new();
    let mut in_struct = false;
    for line in text.lines() {
        let line = line.trim_start();
        if line.starts_with("typedef struct dp_api {") {
            in_struct = true;
        } else if in_struct && line.starts_with('}') {
            in_struct = false;
        } else if in_struct {
            body.push_str(line);
            body.push(' ');
        } else if let Some(rest) = line.strip_prefix("X(") {
            if let Some(name) = rest.split(',').nth(1) {
                names.push(name.trim().to_string());
            }
        }
    }
    // One field per declaration: its first "(*name)"; a parameter that is
    // itself a function pointer comes later in the same declaration.
    for field in body.split(';') {
        if let Some(at) = field.find("(*") {
            let rest = &field[at + 2..];
            names.push(rest[..rest.find(')').unwrap_or(rest.len())].trim().to_string());
        }
    }
    names
}

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: api_mirror path/to/dp_api.h");
        return ExitCode::from(2);
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("api_mirror: {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let header = header_slots(&text);
    println!("{path}: {} slots; the Rust mirror: {}", header.len(), SLOT_NAMES.len());
    let mut ok = header.len() >= SLOT_NAMES.len();
    if !ok {
        eprintln!("FAIL: the header has fewer slots than the mirror");
    }
    // The first difference says it; the rest would follow from it.
    if let Some((i, mirror)) =
        SLOT_NAMES.iter().enumerate().find(|(i, m)| header.get(*i).map(String::as_str) != Some(**m))
    {
        let want = header.get(i).map_or("(none)", String::as_str);
        eprintln!("FAIL: slot {i}: the mirror has '{mirror}', dp_api.h '{want}'");
        ok = false;
    }
    if ok {
        println!("the mirror's {} slots are dp_api.h's first, in order", SLOT_NAMES.len());
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
