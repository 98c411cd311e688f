//! In-process symbolization of heap-profile stacks into pprof and flamegraph form.
//!
//! jemalloc records raw return addresses. We resolve each distinct address once (with inlined
//! frames, innermost first, as pprof expects), name functions by their demangled linkage name
//! (the full path: `pg_wal::decoder::WalStreamDecoder::feed`, not `feed`), and drop the
//! allocator's own frames from the top of every stack (jemalloc's sampling machinery, `malloc`,
//! Rust's allocator shims) so that `go tool pprof -top` charges memory to the code that asked
//! for it.

use std::collections::HashMap;
use std::ffi::c_void;

use pprof::protos;

use crate::jeheap::{HeapProfile, SAMPLE_TYPES};

/// One resolved frame (one line of a location).
#[derive(Clone)]
struct Frame {
    name: String,
    system_name: String,
    filename: String,
    line: i64,
}

/// Whether a frame belongs to the allocator rather than to the code that allocated.
fn is_allocator_frame(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "prof_backtrace_impl",
        "prof_alloc_prep",
        "prof_tctx_create",
        "imalloc",
        "imalloc_body",
        "ialloc",
        "irealloc_prof",
        "irallocx_prof",
        "do_rallocx",
        "malloc_default",
        "malloc",
        "calloc",
        "realloc",
        "rallocx",
        "mallocx",
        "posix_memalign",
        "aligned_alloc",
        "__rust_alloc",
        "__rust_alloc_zeroed",
        "__rust_realloc",
        "__rdl_alloc",
        "__rdl_alloc_zeroed",
        "__rdl_realloc",
    ];
    EXACT.contains(&name)
        || name.starts_with("_rjem_")
        || name.starts_with("je_")
        || name.starts_with("<tikv_jemallocator::Jemalloc as core::alloc::global::GlobalAlloc>")
        // Rust's allocation API shims: charge the memory to whoever called them.
        || name.starts_with("alloc::alloc::")
        || name.starts_with("<alloc::alloc::Global")
}

/// Resolves addresses to frames, caching per address.
#[derive(Default)]
struct Resolver {
    cache: HashMap<usize, Vec<Frame>>,
}

impl Resolver {
    /// Frames at `addr`, innermost (inlined) first. `addr` is a return address, so the call
    /// instruction is just before it.
    fn resolve(&mut self, addr: usize) -> &[Frame] {
        self.cache.entry(addr).or_insert_with(|| {
            let mut frames = Vec::new();
            backtrace::resolve(addr.saturating_sub(1) as *mut c_void, |sym| {
                let Some(raw) = sym.name() else { return };
                let system_name = String::from_utf8_lossy(raw.as_bytes()).into_owned();
                let name = match rustc_demangle::try_demangle(&system_name) {
                    Ok(d) => format!("{d:#}"),
                    Err(_) => system_name.clone(),
                };
                frames.push(Frame {
                    name,
                    system_name,
                    filename: sym
                        .filename()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                    line: sym.lineno().map(i64::from).unwrap_or(0),
                });
            });
            if frames.is_empty() {
                let hex = format!("{addr:#x}");
                frames.push(Frame {
                    name: hex.clone(),
                    system_name: hex,
                    filename: String::new(),
                    line: 0,
                });
            }
            frames
        })
    }

    /// The stack with the allocator's frames removed from the top: (address, frames) pairs,
    /// leaf first. `addrs_root_first` is a jemalloc stack as `parse_jeheap` stores it.
    fn trimmed_stack(&mut self, addrs_root_first: &[usize]) -> Vec<(usize, Vec<Frame>)> {
        let mut out: Vec<(usize, Vec<Frame>)> = Vec::with_capacity(addrs_root_first.len());
        let mut trimming = true;
        for &addr in addrs_root_first.iter().rev() {
            let mut frames = self.resolve(addr).to_vec();
            if trimming {
                // Drop allocator frames, innermost first, within this address too (inlining).
                while frames.first().is_some_and(|f| is_allocator_frame(&f.name)) {
                    frames.remove(0);
                }
                if frames.is_empty() {
                    continue;
                }
                trimming = false;
            }
            out.push((addr, frames));
        }
        out
    }
}

/// Builds a symbolized pprof profile (protobuf, not compressed) from a heap profile, with the
/// sample types it can honestly report and `default_type` (one of them) as the default.
pub(crate) fn to_pprof(profile: &HeapProfile, default_type: &str) -> protos::Profile {
    let mut strings = StringTable::default();
    let mut resolver = Resolver::default();
    let mut locations: HashMap<usize, u64> = HashMap::new();
    let mut functions: HashMap<(String, String), u64> = HashMap::new();
    let mut p = protos::Profile::default();
    let types = profile.type_indices();

    for (i, m) in profile.mappings.iter().enumerate() {
        p.mapping.push(protos::Mapping {
            id: i as u64 + 1,
            memory_start: m.memory_start as u64,
            memory_limit: m.memory_end as u64,
            file_offset: m.file_offset,
            filename: strings.id(&m.pathname.display().to_string()),
            build_id: strings.id(&m
                .build_id
                .as_ref()
                .map(|b| b.to_string())
                .unwrap_or_default()),
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        });
    }
    let mapping_of = |addr: usize| {
        profile
            .mappings
            .iter()
            .position(|m| (m.memory_start..m.memory_end).contains(&addr))
            .map(|i| i as u64 + 1)
            .unwrap_or(0)
    };

    for stack in &profile.stacks {
        let trimmed = resolver.trimmed_stack(&stack.addrs);
        let mut location_ids = Vec::with_capacity(trimmed.len());
        for (addr, frames) in trimmed {
            let next_id = p.location.len() as u64 + 1;
            let id = *locations.entry(addr).or_insert(next_id);
            if id == next_id {
                let lines = frames
                    .iter()
                    .map(|f| {
                        let next_fn = functions.len() as u64 + 1;
                        let function_id = *functions
                            .entry((f.name.clone(), f.filename.clone()))
                            .or_insert(next_fn);
                        if function_id == next_fn {
                            p.function.push(protos::Function {
                                id: function_id,
                                name: strings.id(&f.name),
                                system_name: strings.id(&f.system_name),
                                filename: strings.id(&f.filename),
                                ..Default::default()
                            });
                        }
                        protos::Line {
                            function_id,
                            line: f.line,
                        }
                    })
                    .collect();
                p.location.push(protos::Location {
                    id,
                    mapping_id: mapping_of(addr),
                    address: addr as u64,
                    line: lines,
                    is_folded: false,
                });
            }
            location_ids.push(id);
        }
        p.sample.push(protos::Sample {
            location_id: location_ids,
            value: types
                .iter()
                .map(|&i| stack.values[i].round() as i64)
                .collect(),
            label: Vec::new(),
        });
    }
    p.sample_type = types
        .iter()
        .map(|&i| protos::ValueType {
            ty: strings.id(SAMPLE_TYPES[i].0),
            unit: strings.id(SAMPLE_TYPES[i].1),
        })
        .collect();
    p.default_sample_type = strings.id(default_type);
    p.period_type = Some(protos::ValueType {
        ty: strings.id("space"),
        unit: strings.id("bytes"),
    });
    // As Go: the period is the sampling interval in bytes.
    p.period = profile.sampling_rate as i64;
    p.string_table = strings.finish();
    p
}

/// Folded stacks (`root;...;leaf weight`) of one sample type (an index into
/// [`SAMPLE_TYPES`]) for a flamegraph, with the same names as [`to_pprof`].
pub(crate) fn to_folded(profile: &HeapProfile, value: usize) -> Vec<String> {
    let mut resolver = Resolver::default();
    let mut folded: HashMap<String, f64> = HashMap::new();
    for stack in &profile.stacks {
        let trimmed = resolver.trimmed_stack(&stack.addrs);
        let names: Vec<&str> = trimmed
            .iter()
            .rev()
            .flat_map(|(_, frames)| frames.iter().rev().map(|f| f.name.as_str()))
            .collect();
        *folded.entry(names.join(";")).or_default() += stack.values[value];
    }
    let mut lines: Vec<String> = folded
        .into_iter()
        .filter(|(_, w)| *w >= 1.0)
        .map(|(stack, w)| format!("{stack} {}", w.round() as u64))
        .collect();
    lines.sort();
    lines
}

#[derive(Default)]
struct StringTable {
    index: HashMap<String, i64>,
    strings: Vec<String>,
}

impl StringTable {
    fn id(&mut self, s: &str) -> i64 {
        if self.strings.is_empty() {
            // pprof requires the empty string at index 0.
            self.strings.push(String::new());
            self.index.insert(String::new(), 0);
        }
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.strings.len() as i64;
        self.strings.push(s.to_string());
        self.index.insert(s.to_string(), i);
        i
    }

    fn finish(mut self) -> Vec<String> {
        self.id("");
        self.strings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_frames_are_recognized() {
        for name in [
            "prof_backtrace_impl",
            "_rjem_je_prof_backtrace",
            "malloc",
            "__rust_alloc",
            "alloc::alloc::realloc",
            "<alloc::alloc::Global as core::alloc::Allocator>::grow",
        ] {
            assert!(is_allocator_frame(name), "{name}");
        }
        for name in [
            "alloc::raw_vec::RawVec<T>::grow_one",
            "safekeeper::main",
            "main",
        ] {
            assert!(!is_allocator_frame(name), "{name}");
        }
    }

    #[inline(never)]
    fn known_function() -> usize {
        // A return address inside this function: the address of a call site plus one.
        known_function as *const () as usize + 1
    }

    #[test]
    fn addresses_resolve_to_qualified_names() {
        let mut r = Resolver::default();
        let frames = r.resolve(known_function() + 1);
        assert!(
            frames
                .iter()
                .any(|f| f.name == "profiling::symbolize::tests::known_function"),
            "{:?}",
            frames.iter().map(|f| &f.name).collect::<Vec<_>>()
        );
    }
}
