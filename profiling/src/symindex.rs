//! A compact, on-disk symbol index of one ELF file: address → inlined frames → file:line.
//!
//! Symbolizing through the `backtrace` crate parsed the whole binary's DWARF onto the heap
//! (~280 MiB for the safekeeper, whose release build keeps full debug info) and kept it. Instead,
//! each ELF file a profile touches gets an index, built once and reused by every later profile
//! (and every later process of the same binary):
//!
//! - **Built outside the daemon's heap.** A binary that calls [`maybe_run_helper`] first thing in
//!   `main` is re-executed in a hidden mode that parses the DWARF (with `addr2line`), writes the
//!   index and exits; its memory goes with it. A binary that does not call it builds in-process
//!   (the same index, at the cost of the parse's transient heap).
//! - **Compact.** The address space is cut into ranges over which the answer does not change
//!   (line-table rows, function and inlined-call boundaries, symbols). A range points at a node of
//!   the inline tree (function name, the call site in its parent, the parent) plus the innermost
//!   file:line; nodes and strings are deduplicated.
//! - **Read in place, opened per symbolization.** A lookup is a binary search over the range
//!   starts and a walk up the inline tree, a few dozen `pread`s of the file (in the page cache,
//!   shared and reclaimable; not mapped, see [`SymbolIndex`]); nothing of it is loaded onto the
//!   heap, and the file is closed when the profile is done.
//! - **Never trusted blindly.** The file name carries a hash of the object's path; the header
//!   carries the object's size, mtime and inode (a rebuilt binary gets a new index) and a
//!   CRC-32C of the body, checked before the file is mapped. A corrupt, truncated or stale index
//!   is rebuilt. Written under a temporary name and renamed, so a reader never sees half a file.
//!
//! Where: `PROFILING_SYMBOL_INDEX_DIR` if set, else the directory the service gave
//! [`set_symbol_index_dir`] (the safekeeper: `<datadir>/.symcache`), else
//! `$TMPDIR/profiling-symbol-index`.
//!
//! Layout (little-endian): a 64-byte header (magic, version, body CRC-32C, the object's size,
//! mtime and inode, the table lengths, the body length), then the `PT_LOAD` segments (file
//! offset, virtual address, file size: to turn a mapping's file offset into an address), the
//! range starts (`u64`, one more than the ranges: the end of the last), the range rows (node,
//! file, line), the nodes (parent, name, call file, call line), the string offsets and the
//! string bytes. Names are stored as linkage names and demangled on lookup.
//!
//! Not here: which addresses to look up and how frames become pprof or flamegraph output
//! (`symbolize.rs`); the process's mappings (the `mappings` crate).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, bail};
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

const MAGIC: &[u8; 8] = b"SKSYMIX1";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 64;
/// "No node" / "no string".
const NONE: u32 = u32::MAX;
const SEGMENT_LEN: usize = 24;
const RANGE_LEN: usize = 12;
const NODE_LEN: usize = 16;

/// Overrides the index directory (tests share one across daemons).
pub const INDEX_DIR_ENV: &str = "PROFILING_SYMBOL_INDEX_DIR";
/// Set in the helper child: the object to index.
const HELPER_OBJECT_ENV: &str = "PROFILING_SYMBOL_INDEX_BUILD_OBJECT";
/// Set in the helper child: where to write the index.
const HELPER_OUTPUT_ENV: &str = "PROFILING_SYMBOL_INDEX_BUILD_OUTPUT";

/// Whether this binary called [`maybe_run_helper`], so re-executing it builds an index.
static HELPER_READY: AtomicBool = AtomicBool::new(false);
static INDEX_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Call first thing in `main` of a binary that serves profiles: when the process was started as
/// the symbol-index builder, this builds the index and exits (status 0, or 1 with the error on
/// stderr); otherwise it returns at once and lets profiles build their symbol index in a child
/// process, off this process's heap.
pub fn maybe_run_helper() {
    let (Some(object), Some(output)) = (
        std::env::var_os(HELPER_OBJECT_ENV),
        std::env::var_os(HELPER_OUTPUT_ENV),
    ) else {
        HELPER_READY.store(true, Ordering::Relaxed);
        return;
    };
    let result = build_to_file(Path::new(&object), Path::new(&output));
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("building the symbol index of {object:?}: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Where symbol indexes go, unless `PROFILING_SYMBOL_INDEX_DIR` says otherwise. Call once at
/// start-up; later calls are ignored. Without it: `$TMPDIR/profiling-symbol-index`.
pub fn set_symbol_index_dir(dir: impl Into<PathBuf>) {
    let _ = INDEX_DIR.set(dir.into());
}

fn index_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(INDEX_DIR_ENV) {
        return PathBuf::from(dir);
    }
    INDEX_DIR
        .get()
        .cloned()
        .unwrap_or_else(|| std::env::temp_dir().join("profiling-symbol-index"))
}

/// What an index was built from: a changed binary has another key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    size: u64,
    mtime_ns: u64,
    ino: u64,
}

impl Key {
    pub(crate) fn of(object: &Path) -> std::io::Result<Key> {
        let m = fs::metadata(object)?;
        Ok(Key {
            size: m.size(),
            mtime_ns: (m.mtime() as u64)
                .wrapping_mul(1_000_000_000)
                .wrapping_add(m.mtime_nsec() as u64),
            ino: m.ino(),
        })
    }
}

/// The index file of `object` inside `dir`.
pub(crate) fn index_path(dir: &Path, object: &Path) -> PathBuf {
    // FNV-1a of the path: two objects with one file name (two builds) get two indexes.
    let hash = object
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    let name = object
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.join(format!("{name}-{hash:016x}.symidx"))
}

/// Index files whose checksum held, by path: (inode, mtime ns, mtime s, length) when checked.
static VERIFIED: Mutex<BTreeMap<PathBuf, (u64, i64, i64, u64)>> = Mutex::new(BTreeMap::new());

/// Serializes index builds: one child at a time, and no two builds of one file.
static BUILDING: Mutex<()> = Mutex::new(());

/// The index of `object`, built first if it is missing, stale or corrupt.
pub(crate) fn open_or_build(object: &Path) -> anyhow::Result<SymbolIndex> {
    open_or_build_in(&index_dir(), object)
}

/// [`open_or_build`] with the index in `dir`.
fn open_or_build_in(dir: &Path, object: &Path) -> anyhow::Result<SymbolIndex> {
    let key = Key::of(object).with_context(|| format!("reading {}", object.display()))?;
    let path = index_path(dir, object);
    if let Ok(index) = SymbolIndex::open(&path, key) {
        return Ok(index);
    }
    let _building = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    // Another request may have built it while this one waited.
    match SymbolIndex::open(&path, key) {
        Ok(index) => return Ok(index),
        Err(OpenError::Missing) => {}
        Err(e) => tracing::warn!(index = %path.display(), "rebuilding the symbol index: {e}"),
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let started = std::time::Instant::now();
    if HELPER_READY.load(Ordering::Relaxed) {
        build_in_child(object, &path)?;
    } else {
        build_to_file(object, &path)?;
    }
    let index = SymbolIndex::open(&path, key).map_err(|e| {
        anyhow::anyhow!(
            "the freshly built index {} is unusable: {e}",
            path.display()
        )
    })?;
    tracing::info!(
        object = %object.display(),
        index = %path.display(),
        bytes = index.len,
        seconds = started.elapsed().as_secs_f64(),
        "built the symbol index"
    );
    Ok(index)
}

/// Runs this binary again as the index builder and waits for it.
fn build_in_child(object: &Path, output: &Path) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding this binary to build the symbol index")?;
    let out = std::process::Command::new(exe)
        .env(HELPER_OBJECT_ENV, object)
        .env(HELPER_OUTPUT_ENV, output)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .output()
        .context("starting the symbol index builder")?;
    if !out.status.success() {
        bail!(
            "the symbol index builder failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Builds the index of `object` and writes it to `output` atomically (temporary name, fsync,
/// rename).
pub(crate) fn build_to_file(object: &Path, output: &Path) -> anyhow::Result<()> {
    let key = Key::of(object).with_context(|| format!("reading {}", object.display()))?;
    let bytes = build(object, key)?;
    let tmp = output.with_extension(format!("tmp.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, output)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        anyhow::anyhow!("writing {}: {e}", output.display())
    })
}

/// The DWARF sections an index reads, by name.
const DWARF_SECTIONS: &[&str] = &[
    ".debug_abbrev",
    ".debug_addr",
    ".debug_aranges",
    ".debug_info",
    ".debug_line",
    ".debug_line_str",
    ".debug_loc",
    ".debug_loclists",
    ".debug_ranges",
    ".debug_rnglists",
    ".debug_str",
    ".debug_str_offsets",
    ".debug_types",
];

type Reader<'a> = gimli::EndianSlice<'a, gimli::RunTimeEndian>;

/// Builds the index bytes of `object` (whose metadata is `key`).
pub(crate) fn build(object: &Path, key: Key) -> anyhow::Result<Vec<u8>> {
    let file = File::open(object).with_context(|| format!("opening {}", object.display()))?;
    // SAFETY: the mapping is read-only and private; a binary being replaced is renamed over,
    // not rewritten in place, and its key check rejects an index of different contents.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("mapping {}", object.display()))?;
    let obj =
        object::File::parse(&*map).with_context(|| format!("parsing {}", object.display()))?;
    let endian = if obj.is_little_endian() {
        gimli::RunTimeEndian::Little
    } else {
        gimli::RunTimeEndian::Big
    };

    // Compressed sections are inflated once, here.
    let sections: Vec<(&str, Cow<'_, [u8]>)> = DWARF_SECTIONS
        .iter()
        .filter_map(|&name| {
            let data = obj.section_by_name(name)?.uncompressed_data().ok()?;
            Some((name, data))
        })
        .collect();
    let load = |id: gimli::SectionId| -> Result<Reader<'_>, gimli::Error> {
        let data = sections
            .iter()
            .find(|(n, _)| *n == id.name())
            .map(|(_, d)| &d[..])
            .unwrap_or(&[]);
        Ok(gimli::EndianSlice::new(data, endian))
    };

    let mut segments = Vec::new();
    let mut code = Vec::new();
    for seg in obj.segments() {
        let (offset, size) = seg.file_range();
        segments.push((offset, seg.address(), size));
        let executable = match seg.flags() {
            object::SegmentFlags::Elf { p_flags, .. } => p_flags.0 & object::elf::PF_X.0 != 0,
            _ => false,
        };
        if executable {
            code.push((seg.address(), seg.address() + seg.size()));
        }
    }
    let in_code = |a: u64| code.iter().any(|&(lo, hi)| (lo..hi).contains(&a));

    let symbols = Symbols::of(&obj);
    // Every address where the answer may change.
    let mut bounds: Vec<u64> = code.iter().flat_map(|&(lo, hi)| [lo, hi]).collect();
    for s in &symbols.list {
        bounds.push(s.0);
        if s.1 > 0 {
            bounds.push(s.0 + s.1);
        }
    }
    let dwarf = gimli::Dwarf::load(load).context("reading the DWARF sections")?;
    function_bounds(&dwarf, &mut bounds).context("reading DWARF functions")?;
    let ctx = addr2line::Context::from_dwarf(gimli::Dwarf::load(load)?)
        .context("reading the DWARF units")?;
    for row in ctx
        .find_location_range(0, u64::MAX)
        .context("reading DWARF line tables")?
    {
        bounds.push(row.0);
        bounds.push(row.0.saturating_add(row.1));
    }
    bounds.retain(|&a| in_code(a) || code.iter().any(|&(_, hi)| a == hi));
    bounds.sort_unstable();
    bounds.dedup();

    let mut w = Writer::default();
    let mut chain: Vec<(u32, u32, u32)> = Vec::new();
    for pair in bounds.windows(2) {
        let addr = pair[0];
        let row = if in_code(addr) {
            chain.clear();
            let mut frames = ctx
                .find_frames(addr)
                .skip_all_loads()
                .with_context(|| format!("looking up {addr:#x}"))?;
            while let Some(f) = frames.next().context("reading inlined frames")? {
                let name = match &f.function {
                    Some(func) => w.string(&func.raw_name().context("a function name")?),
                    None => symbols.name_at(addr).map_or(NONE, |n| w.string(n)),
                };
                let (file, line) = match &f.location {
                    Some(loc) => (
                        loc.file.map_or(NONE, |f| w.string(f)),
                        loc.line.unwrap_or(0),
                    ),
                    None => (NONE, 0),
                };
                chain.push((name, file, line));
            }
            if chain.is_empty()
                && let Some(name) = symbols.name_at(addr)
            {
                chain.push((w.string(name), NONE, 0));
            }
            w.row_of_chain(&chain)
        } else {
            (NONE, NONE, 0)
        };
        w.range(addr, row);
    }
    if let Some(&end) = bounds.last() {
        w.range_starts.push(end);
    }
    Ok(w.finish(key, &segments))
}

/// Adds the start and end of every function and inlined call in the DWARF.
fn function_bounds(dwarf: &gimli::Dwarf<Reader<'_>>, bounds: &mut Vec<u64>) -> gimli::Result<()> {
    let mut units = dwarf.units();
    while let Some(header) = units.next()? {
        let unit = dwarf.unit(header)?;
        let mut entries = unit.entries();
        while let Some(entry) = entries.next_dfs()? {
            if !matches!(
                entry.tag(),
                gimli::DW_TAG_subprogram | gimli::DW_TAG_inlined_subroutine
            ) {
                continue;
            }
            let mut ranges = dwarf.die_ranges(&unit, entry)?;
            while let Some(r) = ranges.next()? {
                if r.begin < r.end {
                    bounds.push(r.begin);
                    bounds.push(r.end);
                }
            }
        }
    }
    Ok(())
}

/// The object's function symbols (`.symtab`, else `.dynsym`), for code without DWARF.
struct Symbols<'a> {
    /// (address, size, name), sorted by address.
    list: Vec<(u64, u64, &'a str)>,
}

impl<'a> Symbols<'a> {
    fn of(obj: &object::File<'a>) -> Self {
        let mut list: Vec<(u64, u64, &'a str)> = obj
            .symbols()
            .chain(obj.dynamic_symbols())
            .filter(|s| s.kind() == object::SymbolKind::Text && s.address() != 0)
            .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?)))
            .filter(|s| !s.2.is_empty())
            .collect();
        list.sort_unstable();
        list.dedup_by_key(|s| s.0);
        Symbols { list }
    }

    fn name_at(&self, addr: u64) -> Option<&'a str> {
        let i = self.list.partition_point(|s| s.0 <= addr).checked_sub(1)?;
        let (start, size, name) = self.list[i];
        (size == 0 || addr < start + size).then_some(name)
    }
}

/// The tables of an index being built.
#[derive(Default)]
struct Writer {
    strings: HashMap<String, u32>,
    string_bytes: Vec<u8>,
    string_offsets: Vec<u32>,
    nodes: HashMap<[u32; 4], u32>,
    node_rows: Vec<[u32; 4]>,
    range_starts: Vec<u64>,
    range_rows: Vec<(u32, u32, u32)>,
}

impl Writer {
    fn string(&mut self, s: &str) -> u32 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.string_offsets.len() as u32;
        self.string_offsets.push(self.string_bytes.len() as u32);
        self.string_bytes.extend_from_slice(s.as_bytes());
        self.strings.insert(s.to_owned(), i);
        i
    }

    fn node(&mut self, n: [u32; 4]) -> u32 {
        let next = self.node_rows.len() as u32;
        let id = *self.nodes.entry(n).or_insert(next);
        if id == next {
            self.node_rows.push(n);
        }
        id
    }

    /// The range row of a chain of (name, file, line), innermost first: the innermost node and
    /// the innermost file:line. Each frame's location is where it is executing; an inlined
    /// frame's caller executes at the call site, which is that caller's location in the chain.
    fn row_of_chain(&mut self, chain: &[(u32, u32, u32)]) -> (u32, u32, u32) {
        let Some(&(_, file, line)) = chain.first() else {
            return (NONE, NONE, 0);
        };
        let mut parent = NONE;
        let mut call = (NONE, 0);
        for &(name, loc_file, loc_line) in chain.iter().rev() {
            parent = self.node([parent, name, call.0, call.1]);
            call = (loc_file, loc_line);
        }
        (parent, file, line)
    }

    fn range(&mut self, start: u64, row: (u32, u32, u32)) {
        if self.range_rows.last() == Some(&row) {
            return; // the previous range goes on
        }
        self.range_starts.push(start);
        self.range_rows.push(row);
    }

    fn finish(mut self, key: Key, segments: &[(u64, u64, u64)]) -> Vec<u8> {
        if self.range_starts.len() == self.range_rows.len() {
            // No end was pushed (an object without code): close with an empty end.
            let end = self.range_starts.last().copied().unwrap_or(0);
            self.range_starts.push(end);
        }
        self.string_offsets.push(self.string_bytes.len() as u32);
        let mut body = Vec::new();
        for &(off, vaddr, size) in segments {
            for v in [off, vaddr, size] {
                body.extend_from_slice(&v.to_le_bytes());
            }
        }
        for s in &self.range_starts {
            body.extend_from_slice(&s.to_le_bytes());
        }
        for &(node, file, line) in &self.range_rows {
            for v in [node, file, line] {
                body.extend_from_slice(&v.to_le_bytes());
            }
        }
        for n in &self.node_rows {
            for v in n {
                body.extend_from_slice(&v.to_le_bytes());
            }
        }
        for o in &self.string_offsets {
            body.extend_from_slice(&o.to_le_bytes());
        }
        body.extend_from_slice(&self.string_bytes);

        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        for v in [key.size, key.mtime_ns, key.ino] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [
            segments.len(),
            self.range_rows.len(),
            self.node_rows.len(),
            self.string_offsets.len() - 1,
        ] {
            out.extend_from_slice(&(v as u32).to_le_bytes());
        }
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        debug_assert_eq!(out.len(), HEADER_LEN);
        out.extend_from_slice(&body);
        out
    }
}

/// Why an index file cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    /// There is none yet.
    #[error("no index yet")]
    Missing,
    /// It was built from another version of the object.
    #[error("stale: built from another version of the object")]
    Stale,
    /// Its bytes are not an index.
    #[error("corrupt: {0}")]
    Corrupt(String),
    /// It cannot be read.
    #[error("cannot read it: {0}")]
    Io(#[from] std::io::Error),
}

/// One resolved frame.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RawFrame {
    /// The linkage name (mangled), or the plain name where there is none; empty if unknown.
    pub name: String,
    /// The source file; empty if unknown.
    pub file: String,
    /// The line; 0 if unknown.
    pub line: u32,
}

/// An open, checked index. Lookups read it with `pread`, not through a mapping: a page fault
/// on a mapped file maps its neighbours too (the kernel's fault-around, 64 KiB), so a few
/// hundred binary searches over a mapped index put ~25 MiB of it in the process's RSS
/// (measured); read, the index stays in the page cache, shared and reclaimable, and costs the
/// process nothing.
pub(crate) struct SymbolIndex {
    file: File,
    segments: usize,
    ranges: usize,
    nodes: usize,
    strings: usize,
    // Byte offsets of the tables.
    starts_at: usize,
    rows_at: usize,
    nodes_at: usize,
    offsets_at: usize,
    bytes_at: usize,
    len: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map_or(0, |s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}

impl SymbolIndex {
    /// Opens the index at `path` if it was built from the object whose metadata is `key` and its
    /// checksum holds (checked with reads, at the first open of each version of the file).
    pub(crate) fn open(path: &Path, key: Key) -> Result<SymbolIndex, OpenError> {
        let mut f = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(OpenError::Missing),
            Err(e) => return Err(e.into()),
        };
        let mut header = [0u8; HEADER_LEN];
        f.read_exact(&mut header)
            .map_err(|_| OpenError::Corrupt("shorter than its header".into()))?;
        if &header[..8] != MAGIC || u32_at(&header, 8) != VERSION {
            return Err(OpenError::Corrupt("not an index of this version".into()));
        }
        let built_from = Key {
            size: u64_at(&header, 16),
            mtime_ns: u64_at(&header, 24),
            ino: u64_at(&header, 32),
        };
        if built_from != key {
            return Err(OpenError::Stale);
        }
        let body_len = u64_at(&header, 56);
        let len = f.metadata()?.len();
        if len != HEADER_LEN as u64 + body_len {
            return Err(OpenError::Corrupt(format!(
                "{len} bytes, the header says {}",
                HEADER_LEN as u64 + body_len
            )));
        }
        // The checksum is read in full once per index file (identified by inode, mtime and
        // length) per process: a scraper's later profiles skip the ~40 MB read.
        let meta = f.metadata()?;
        let seen = (meta.ino(), meta.mtime_nsec(), meta.mtime(), len);
        let mut verified = VERIFIED.lock().unwrap_or_else(|e| e.into_inner());
        if verified.get(path) != Some(&seen) {
            let mut crc = 0u32;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                crc = crc32c::crc32c_append(crc, &buf[..n]);
            }
            if crc != u32_at(&header, 12) {
                verified.remove(path);
                return Err(OpenError::Corrupt("checksum mismatch".into()));
            }
            verified.insert(path.to_path_buf(), seen);
        }
        drop(verified);
        let (segments, ranges, nodes, strings) = (
            u32_at(&header, 40) as usize,
            u32_at(&header, 44) as usize,
            u32_at(&header, 48) as usize,
            u32_at(&header, 52) as usize,
        );
        let starts_at = HEADER_LEN + segments * SEGMENT_LEN;
        let rows_at = starts_at + (ranges + 1) * 8;
        let nodes_at = rows_at + ranges * RANGE_LEN;
        let offsets_at = nodes_at + nodes * NODE_LEN;
        let bytes_at = offsets_at + (strings + 1) * 4;
        if bytes_at as u64 > len {
            return Err(OpenError::Corrupt("tables longer than the file".into()));
        }
        Ok(SymbolIndex {
            file: f,
            segments,
            ranges,
            nodes,
            strings,
            starts_at,
            rows_at,
            nodes_at,
            offsets_at,
            bytes_at,
            len,
        })
    }

    /// `N` bytes at `at`; zeros past the end or on a read error (the checksum held at open, so
    /// only a file replaced under us reads short, and that gives unknown frames, not a panic).
    fn read<const N: usize>(&self, at: usize) -> [u8; N] {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; N];
        if self.file.read_exact_at(&mut b, at as u64).is_err() {
            b = [0u8; N];
        }
        b
    }

    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.read(at))
    }

    /// The object's virtual address of a byte at `offset` in the file (a mapping's file offset
    /// plus how far into the mapping an address is), if a loaded segment holds it.
    pub(crate) fn vaddr_of_file_offset(&self, offset: u64) -> Option<u64> {
        (0..self.segments).find_map(|i| {
            let seg: [u8; SEGMENT_LEN] = self.read(HEADER_LEN + i * SEGMENT_LEN);
            let (off, vaddr, size) = (u64_at(&seg, 0), u64_at(&seg, 8), u64_at(&seg, 16));
            (offset >= off && offset - off < size).then(|| offset - off + vaddr)
        })
    }

    fn string(&self, i: u32) -> String {
        let i = i as usize;
        if i >= self.strings {
            return String::new();
        }
        let bounds: [u8; 8] = self.read(self.offsets_at + i * 4);
        let (start, end) = (u32_at(&bounds, 0) as u64, u32_at(&bounds, 4) as u64);
        let at = self.bytes_at as u64 + start;
        if end < start || at + (end - start) > self.len {
            return String::new();
        }
        let mut b = vec![0u8; (end - start) as usize];
        use std::os::unix::fs::FileExt;
        match self.file.read_exact_at(&mut b, at) {
            Ok(()) => String::from_utf8(b).unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    fn range_start(&self, i: usize) -> u64 {
        self.u64(self.starts_at + i * 8)
    }

    /// The frames at object address `vaddr`, innermost (inlined) first, appended to `out`.
    /// Nothing is appended for an address the object has no symbol for.
    pub(crate) fn lookup(&self, vaddr: u64, out: &mut Vec<RawFrame>) {
        if self.ranges == 0 || vaddr < self.range_start(0) || vaddr >= self.range_start(self.ranges)
        {
            return;
        }
        // The last range starting at or before vaddr.
        let (mut lo, mut hi) = (0, self.ranges);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.range_start(mid) <= vaddr {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let row: [u8; RANGE_LEN] = self.read(self.rows_at + lo * RANGE_LEN);
        let (mut node, mut file, mut line) = (u32_at(&row, 0), u32_at(&row, 4), u32_at(&row, 8));
        // At most one frame per node: a corrupt parent chain cannot loop forever.
        for _ in 0..self.nodes {
            if node as usize >= self.nodes {
                break;
            }
            let n: [u8; NODE_LEN] = self.read(self.nodes_at + node as usize * NODE_LEN);
            out.push(RawFrame {
                name: self.string(u32_at(&n, 4)),
                file: self.string(file),
                line,
            });
            node = u32_at(&n, 0);
            file = u32_at(&n, 8);
            line = u32_at(&n, 12);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mapping of this process that holds a runtime address, if any, as
    /// (memory start, memory end, file offset, object file).
    fn mapping_of(addr: usize) -> Option<(usize, usize, u64, PathBuf)> {
        mappings::MAPPINGS
            .as_deref()
            .unwrap_or(&[])
            .iter()
            .find(|m| (m.memory_start..m.memory_end).contains(&addr))
            .map(|m| {
                (
                    m.memory_start,
                    m.memory_end,
                    m.file_offset,
                    m.pathname.clone(),
                )
            })
    }

    /// The object file and file offset of a runtime address of this process, if mapped.
    fn object_address(addr: usize) -> Option<(PathBuf, u64)> {
        let (start, _, file_offset, path) = mapping_of(addr)?;
        Some((path, (addr - start) as u64 + file_offset))
    }

    /// What the `backtrace` crate (addr2line over the whole DWARF) says about `addr` (which it
    /// looks up as `addr - 1`, as for a return address).
    fn reference_frames(addr: usize) -> Vec<(String, String, u32)> {
        let mut out = Vec::new();
        backtrace::resolve(addr as *mut std::ffi::c_void, |sym| {
            out.push((
                sym.name()
                    .map(|n| String::from_utf8_lossy(n.as_bytes()).into_owned())
                    .unwrap_or_default(),
                sym.filename()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                sym.lineno().unwrap_or(0),
            ));
        });
        out
    }

    #[inline(always)]
    fn inlined_caller_of_capture() -> Vec<usize> {
        capture()
    }

    #[inline(never)]
    fn capture() -> Vec<usize> {
        let mut ips = Vec::new();
        backtrace::trace(|f| {
            ips.push(f.ip() as usize);
            true
        });
        ips
    }

    #[inline(never)]
    fn outer_with_an_inlined_call() -> Vec<usize> {
        inlined_caller_of_capture()
    }

    #[test]
    fn lookups_agree_with_addr2line_inlined_frames_included() {
        let dir = tempfile::tempdir().unwrap();
        let stack = outer_with_an_inlined_call();
        let exe = std::env::current_exe().unwrap();
        let index = open_or_build_in(dir.path(), &exe).unwrap();
        let mut checked = 0;
        let mut inlined = 0;
        // The return addresses of this very stack, plus 400 addresses spread evenly over the
        // executable mapping that holds this function (wherever the linker placed it).
        let text: Vec<usize> = {
            let here = lookups_agree_with_addr2line_inlined_frames_included as *const () as usize;
            let (start, end, _, _) = mapping_of(here).expect("this test's code is mapped");
            let step = ((end - start) / 401).max(1);
            (1..=400).map(|i| start + i * step).collect()
        };
        for &addr in stack.iter().chain(&text) {
            // A return address outside any mapping (a frame of the unwinder's own) is skipped.
            let Some((object, offset)) = object_address(addr) else {
                continue;
            };
            if object != exe.canonicalize().unwrap_or(exe.clone()) && object != exe {
                continue;
            }
            let Some(vaddr) = index.vaddr_of_file_offset(offset - 1) else {
                continue;
            };
            let mut ours = Vec::new();
            index.lookup(vaddr, &mut ours);
            let ours: Vec<(String, String, u32)> =
                ours.into_iter().map(|f| (f.name, f.file, f.line)).collect();
            let reference = reference_frames(addr);
            // The one known difference: `backtrace` takes a symbol's end as inclusive, so the
            // byte just past a function without DWARF (padding; never a return address less
            // one) gets that function's name from it and none from the index.
            if ours.is_empty() && matches!(&reference[..], [(_, file, 0)] if file.is_empty()) {
                continue;
            }
            assert_eq!(ours, reference, "at {addr:#x}");
            checked += 1;
            if ours.len() > 1 {
                inlined += 1;
            }
        }
        assert!(checked > 100, "only {checked} addresses checked");
        assert!(inlined > 0, "no inlined frames among {checked} addresses");
        // This test's own stack: `capture` called from `inlined_caller_of_capture`, which is
        // inlined into `outer_with_an_inlined_call`. How many unwinder frames sit above
        // `capture` depends on the build profile, so the caller's frame is found by name.
        let frames_at = |addr: usize| {
            let mut frames = Vec::new();
            if let Some((_, offset)) = object_address(addr)
                && let Some(vaddr) = index.vaddr_of_file_offset(offset - 1)
            {
                index.lookup(vaddr, &mut frames);
            }
            frames
        };
        let demangled = |frames: &[RawFrame]| -> Vec<String> {
            frames
                .iter()
                .map(|f| format!("{:#}", rustc_demangle::demangle(&f.name)))
                .collect()
        };
        let capture_at = stack
            .iter()
            .position(|&a| {
                demangled(&frames_at(a)).first().map(String::as_str)
                    == Some("profiling::symindex::tests::capture")
            })
            .expect("`capture` is on the captured stack");
        let frames = frames_at(stack[capture_at + 1]);
        assert_eq!(
            demangled(&frames),
            [
                "profiling::symindex::tests::inlined_caller_of_capture",
                "profiling::symindex::tests::outer_with_an_inlined_call"
            ]
        );
        assert!(frames[0].file.ends_with("symindex.rs") && frames[0].line > 0);
    }

    /// libc: symbols without DWARF, small enough to rebuild quickly.
    fn libc_object() -> PathBuf {
        object_address(libc::getpid as *const () as usize)
            .expect("libc is mapped")
            .0
    }

    #[test]
    fn corrupt_index_is_detected_and_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let object = libc_object();
        let path = index_path(dir.path(), &object);
        let key = Key::of(&object).unwrap();
        let good = open_or_build_in(dir.path(), &object).unwrap();
        drop(good);
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            SymbolIndex::open(&path, key),
            Err(OpenError::Corrupt(_))
        ));
        fs::write(&path, &bytes[..100]).unwrap();
        assert!(matches!(
            SymbolIndex::open(&path, key),
            Err(OpenError::Corrupt(_))
        ));
        let rebuilt = open_or_build_in(dir.path(), &object).unwrap();
        let (_, offset) =
            object_address(libc::getpid as *const () as usize).expect("libc is mapped");
        let mut frames = Vec::new();
        rebuilt.lookup(rebuilt.vaddr_of_file_offset(offset).unwrap(), &mut frames);
        assert!(
            frames.first().is_some_and(|f| f.name.contains("getpid")),
            "{frames:?}"
        );
    }

    #[test]
    fn index_of_another_version_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let object = libc_object();
        open_or_build_in(dir.path(), &object).unwrap();
        let mut key = Key::of(&object).unwrap();
        key.mtime_ns += 1;
        assert!(matches!(
            SymbolIndex::open(&index_path(dir.path(), &object), key),
            Err(OpenError::Stale)
        ));
    }
}
