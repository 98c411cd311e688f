//! Symbolization of CPU and heap stacks into pprof and flamegraph form.
//!
//! Both profiles record raw addresses. We resolve each distinct address once through the
//! on-disk symbol index of the object it falls in (`symindex.rs`: inlined frames
//! innermost first, as pprof expects), name functions by their demangled linkage name (the full
//! path: `pg_wal::decoder::WalStreamDecoder::feed`, not `feed`), and, for heap stacks, drop the
//! allocator's own frames from the top of every stack (jemalloc's sampling machinery, `malloc`,
//! Rust's allocator shims) so that `go tool pprof -top` charges memory to the code that asked
//! for it.
//!
//! Not here: building and checking the index (`symindex.rs`), sampling (`cpu.rs`, `heap.rs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use jemalloc_pprof::Mapping;
use pprof::protos;

use crate::jeheap::{HeapProfile, SAMPLE_TYPES};
use crate::symindex::{self, RawFrame, SymbolIndex};

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

/// The process's mappings, read once (shared libraries loaded later are not symbolized).
fn process_mappings() -> &'static [Mapping] {
    mappings::MAPPINGS.as_deref().unwrap_or(&[])
}

/// Resolves addresses to frames through the symbol indexes of the mapped objects, caching per
/// address. Opens each object's index at most once and closes them all when dropped, so the
/// pages it touched stop counting against the process.
struct Resolver<'m> {
    mappings: &'m [Mapping],
    /// Per object path: its index, or `None` if it has none (logged once).
    indexes: HashMap<PathBuf, Option<SymbolIndex>>,
    cache: HashMap<usize, Vec<Frame>>,
}

impl<'m> Resolver<'m> {
    fn new(mappings: &'m [Mapping]) -> Self {
        Resolver {
            mappings,
            indexes: HashMap::new(),
            cache: HashMap::new(),
        }
    }

    /// Frames at `addr` (the address of the instruction itself: callers subtract one from a
    /// return address), innermost (inlined) first; the address in hex if nothing is known.
    fn resolve(&mut self, addr: usize) -> &[Frame] {
        if !self.cache.contains_key(&addr) {
            let frames = self.lookup(addr);
            self.cache.insert(addr, frames);
        }
        &self.cache[&addr]
    }

    fn lookup(&mut self, addr: usize) -> Vec<Frame> {
        let mut frames = Vec::new();
        if let Some(m) = self
            .mappings
            .iter()
            .find(|m| (m.memory_start..m.memory_end).contains(&addr))
        {
            let offset = (addr - m.memory_start) as u64 + m.file_offset;
            let index = self
                .indexes
                .entry(m.pathname.clone())
                .or_insert_with(|| open_index(&m.pathname));
            if let Some(index) = index
                && let Some(vaddr) = index.vaddr_of_file_offset(offset)
            {
                let mut raw = Vec::new();
                index.lookup(vaddr, &mut raw);
                frames.extend(raw.iter().filter(|f| !f.name.is_empty()).map(frame));
            }
        }
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
    }

    /// The stack with the allocator's frames removed from the top: (address, frames) pairs,
    /// leaf first. `addrs_root_first` is a jemalloc stack as `parse_jeheap` stores it.
    fn trimmed_stack(&mut self, addrs_root_first: &[usize]) -> Vec<(usize, Vec<Frame>)> {
        let mut out: Vec<(usize, Vec<Frame>)> = Vec::with_capacity(addrs_root_first.len());
        let mut trimming = true;
        for &addr in addrs_root_first.iter().rev() {
            let mut frames = self.resolve(addr.saturating_sub(1)).to_vec();
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

fn open_index(object: &Path) -> Option<SymbolIndex> {
    let object = object_file(object)?;
    match symindex::open_or_build(&object) {
        Ok(index) => Some(index),
        Err(e) => {
            tracing::warn!(object = %object.display(), "no symbols for this object: {e:#}");
            None
        }
    }
}

/// The file behind a mapping's path. The main executable's comes as the process was started
/// (`target/release/safekeeper` when run by a relative path, which a later `chdir` would make
/// wrong): it is then the running executable itself. `None` for what has no file ([vdso],
/// [heap], anonymous mappings).
fn object_file(object: &Path) -> Option<std::path::PathBuf> {
    if object.is_absolute() {
        return Some(object.to_path_buf());
    }
    if object.as_os_str().is_empty() || object.to_string_lossy().starts_with('[') {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    (exe.file_name() == object.file_name()).then_some(exe)
}

fn frame(raw: &RawFrame) -> Frame {
    let name = match rustc_demangle::try_demangle(&raw.name) {
        Ok(d) => format!("{d:#}"),
        Err(_) => raw.name.to_string(),
    };
    Frame {
        name,
        system_name: raw.name.clone(),
        filename: raw.file.clone(),
        line: i64::from(raw.line),
    }
}

/// A pprof profile being built: mappings, deduplicated locations (one per address, one line per
/// inlined frame) and functions (one per name and file), and the string table.
struct ProfileBuilder<'m> {
    resolver: Resolver<'m>,
    strings: StringTable,
    locations: HashMap<usize, u64>,
    functions: HashMap<(String, String), u64>,
    p: protos::Profile,
}

impl<'m> ProfileBuilder<'m> {
    fn new(mappings: &'m [Mapping]) -> Self {
        let mut strings = StringTable::default();
        let mut p = protos::Profile::default();
        for (i, m) in mappings.iter().enumerate() {
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
        ProfileBuilder {
            resolver: Resolver::new(mappings),
            strings,
            locations: HashMap::new(),
            functions: HashMap::new(),
            p,
        }
    }

    fn mapping_of(&self, addr: usize) -> u64 {
        self.resolver
            .mappings
            .iter()
            .position(|m| (m.memory_start..m.memory_end).contains(&addr))
            .map(|i| i as u64 + 1)
            .unwrap_or(0)
    }

    /// The location ids of a resolved stack, leaf first.
    fn location_ids(&mut self, stack: &[(usize, Vec<Frame>)]) -> Vec<u64> {
        let mut ids = Vec::with_capacity(stack.len());
        for (addr, frames) in stack {
            let next_id = self.p.location.len() as u64 + 1;
            let id = *self.locations.entry(*addr).or_insert(next_id);
            if id == next_id {
                let line = frames.iter().map(|f| self.line(f)).collect();
                let mapping_id = self.mapping_of(*addr);
                self.p.location.push(protos::Location {
                    id,
                    mapping_id,
                    address: *addr as u64,
                    line,
                    is_folded: false,
                });
            }
            ids.push(id);
        }
        ids
    }

    fn line(&mut self, f: &Frame) -> protos::Line {
        let next_fn = self.functions.len() as u64 + 1;
        let function_id = *self
            .functions
            .entry((f.name.clone(), f.filename.clone()))
            .or_insert(next_fn);
        if function_id == next_fn {
            self.p.function.push(protos::Function {
                id: function_id,
                name: self.strings.id(&f.name),
                system_name: self.strings.id(&f.system_name),
                filename: self.strings.id(&f.filename),
                ..Default::default()
            });
        }
        protos::Line {
            function_id,
            line: f.line,
        }
    }

    fn finish(mut self) -> protos::Profile {
        self.p.string_table = self.strings.finish();
        self.p
    }
}

/// Builds a symbolized pprof profile (protobuf, not compressed) from a heap profile, with the
/// sample types it can honestly report and `default_type` (one of them) as the default.
pub(crate) fn to_pprof(profile: &HeapProfile, default_type: &str) -> protos::Profile {
    let mut b = ProfileBuilder::new(&profile.mappings);
    let types = profile.type_indices();
    for stack in &profile.stacks {
        let trimmed = b.resolver.trimmed_stack(&stack.addrs);
        let location_id = b.location_ids(&trimmed);
        b.p.sample.push(protos::Sample {
            location_id,
            value: types
                .iter()
                .map(|&i| stack.values[i].round() as i64)
                .collect(),
            label: Vec::new(),
        });
    }
    b.p.sample_type = types
        .iter()
        .map(|&i| protos::ValueType {
            ty: b.strings.id(SAMPLE_TYPES[i].0),
            unit: b.strings.id(SAMPLE_TYPES[i].1),
        })
        .collect();
    b.p.default_sample_type = b.strings.id(default_type);
    b.p.period_type = Some(protos::ValueType {
        ty: b.strings.id("space"),
        unit: b.strings.id("bytes"),
    });
    // As Go: the period is the sampling interval in bytes.
    b.p.period = profile.sampling_rate as i64;
    b.finish()
}

/// Folded stacks (`root;...;leaf weight`) of one sample type (an index into
/// [`SAMPLE_TYPES`]) for a flamegraph, with the same names as [`to_pprof`].
pub(crate) fn to_folded(profile: &HeapProfile, value: usize) -> Vec<String> {
    let mut resolver = Resolver::new(&profile.mappings);
    fold(profile.stacks.iter().map(|stack| {
        let trimmed = resolver.trimmed_stack(&stack.addrs);
        (fold_names(None, &trimmed), stack.values[value])
    }))
}

/// `root;...;leaf`, inlined frames included, after `prefix` (a thread name) if any.
fn fold_names(prefix: Option<&str>, leaf_first: &[(usize, Vec<Frame>)]) -> String {
    let names: Vec<&str> = prefix
        .into_iter()
        .chain(
            leaf_first
                .iter()
                .rev()
                .flat_map(|(_, frames)| frames.iter().rev().map(|f| f.name.as_str())),
        )
        .collect();
    names.join(";")
}

/// Sums weights per folded stack; drops what rounds to nothing; sorted, as flamegraphs take it.
fn fold(stacks: impl Iterator<Item = (String, f64)>) -> Vec<String> {
    let mut folded: HashMap<String, f64> = HashMap::new();
    for (stack, w) in stacks {
        *folded.entry(stack).or_default() += w;
    }
    let mut lines: Vec<String> = folded
        .into_iter()
        .filter(|(_, w)| *w >= 1.0)
        .map(|(stack, w)| format!("{stack} {}", w.round() as u64))
        .collect();
    lines.sort();
    lines
}

/// One resolved stack, leaf first: each frame's address and its (inlined) functions.
type ResolvedStack = Vec<(usize, Vec<Frame>)>;

/// A CPU report's stacks, resolved: (thread name, stack leaf first, sample count).
fn cpu_stacks(
    report: &pprof::UnresolvedReport,
    resolver: &mut Resolver<'_>,
) -> Vec<(String, ResolvedStack, isize)> {
    report
        .data
        .iter()
        .map(|(frames, &count)| {
            let stack = frames
                .frames
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let ip = f.ip;
                    // The leaf is the interrupted instruction itself; the others are return
                    // addresses, whose call instruction ends just before them.
                    let at = if i == 0 { ip } else { ip.saturating_sub(1) };
                    (ip, resolver.resolve(at).to_vec())
                })
                .collect();
            let n = frames.thread_name_length.min(frames.thread_name.len());
            let thread = if n > 0 {
                String::from_utf8_lossy(&frames.thread_name[..n]).into_owned()
            } else {
                format!("{:?}", frames.thread_id)
            };
            (thread, stack, count)
        })
        .collect()
}

/// Builds a symbolized pprof CPU profile (protobuf, not compressed) from pprof-rs's unresolved
/// report: Go's sample types `samples/count` and `cpu/nanoseconds`, a `thread` label per
/// sample, the sampling period, start time and duration.
pub(crate) fn cpu_pprof(report: &pprof::UnresolvedReport) -> protos::Profile {
    let mut b = ProfileBuilder::new(process_mappings());
    let frequency = report.timing.frequency.max(1) as i64;
    let period = 1_000_000_000 / frequency;
    let thread_key = b.strings.id("thread");
    for (thread, stack, count) in cpu_stacks(report, &mut b.resolver) {
        let location_id = b.location_ids(&stack);
        let thread = b.strings.id(&thread);
        b.p.sample.push(protos::Sample {
            location_id,
            value: vec![count as i64, count as i64 * period],
            label: vec![protos::Label {
                key: thread_key,
                str: thread,
                ..Default::default()
            }],
        });
    }
    let cpu = protos::ValueType {
        ty: b.strings.id("cpu"),
        unit: b.strings.id("nanoseconds"),
    };
    b.p.sample_type = vec![
        protos::ValueType {
            ty: b.strings.id("samples"),
            unit: b.strings.id("count"),
        },
        cpu.clone(),
    ];
    b.p.period_type = Some(cpu);
    b.p.period = period;
    b.p.time_nanos = report
        .timing
        .start_time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i64;
    b.p.duration_nanos = report.timing.duration.as_nanos() as i64;
    b.finish()
}

/// Folded stacks (`thread;root;...;leaf count`) of a CPU report for a flamegraph, with the
/// same names as [`cpu_pprof`].
pub(crate) fn cpu_folded(report: &pprof::UnresolvedReport) -> Vec<String> {
    let mut resolver = Resolver::new(process_mappings());
    fold(
        cpu_stacks(report, &mut resolver)
            .into_iter()
            .map(|(thread, stack, count)| (fold_names(Some(&thread), &stack), count as f64)),
    )
}

/// Returns every arena's unused dirty pages to the kernel now, instead of after jemalloc's decay
/// time: a profile's tables are freed when it is answered, and RSS should say so at once.
pub(crate) fn purge() {
    // MALLCTL_ARENAS_ALL (4096): every arena.
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: `arena.<i>.purge` must be called with no old and no new value (null pointers,
    // zero length), which is what we pass; the name is NUL-terminated.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != 0 {
        tracing::debug!(errno = rc, "jemalloc arena purge failed");
    }
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
        let mut r = Resolver::new(process_mappings());
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
