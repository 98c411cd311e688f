//! The control file (`safekeeper.control`): the file implementation of [`ControlStore`].
//!
//! Format (mini-safekeeper's own, little-endian): `u32 magic 0xcafeceef`, `u32 format version`,
//! the [`TimelinePersistentState`] body (layout in [`encode`]), and a `u32` CRC-32C of all
//! preceding bytes. Loading checks magic, version and checksum (in that order of bytes, the
//! checksum before any body field is trusted) and refuses a mismatch with
//! [`Error::Corruption`] naming the file. Decoding is total and bounded: every length is checked
//! against the bytes left before anything is allocated.
//!
//! Persisting replaces the file atomically: write `safekeeper.control.partial`, fsync it,
//! rename it over `safekeeper.control`, fsync the directory. A crash leaves the old or the new
//! state, never a mix.
//!
//! The encoding lives here, with the store, not in `sk_core`: it is the on-disk format of this
//! one file, versioned and read only by this store, and the consensus core never sees bytes (it
//! hands a [`TimelinePersistentState`] to [`ControlStore::persist`]). Kept together, a format
//! change and the code that writes, fsyncs and verifies it change in one place; the core stays
//! free of file formats, as its in-memory fake shows (it persists the struct itself).
//!
//! Not here: when to persist (the consensus core decides), in-memory overlays of LSNs, and
//! timeline directory creation.

// Storage: no `unwrap()` outside tests (see sk_core).
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use std::ops::Deref;
use std::path::{Path, PathBuf};

use sk_core::state::{
    AcceptorState, Configuration, SafekeeperId, ServerInfo, TimelinePersistentState,
};
use sk_core::storage::durable::{durable_rename, fsync_dir, fsync_or_abort};
use sk_core::storage::fs::{Fs, OpenMode, SyncKind, read_full_at};
use sk_core::storage::{ControlStore, Error, Result};
use sk_core::types::{Generation, Lsn, NodeId, TenantId, Term, TermHistory, TermLsn, TimelineId};

/// File name of the control file inside a timeline directory.
pub const CONTROL_FILE_NAME: &str = "safekeeper.control";
/// Temporary name the new state is written under before the rename.
pub const CONTROL_FILE_TMP_NAME: &str = "safekeeper.control.partial";
/// First four bytes of every control file.
pub const CONTROL_FILE_MAGIC: u32 = 0xcafe_ceef;
/// Version of the layout described in [`encode`].
pub const CONTROL_FILE_FORMAT_VERSION: u32 = 4;
/// Larger files are refused before being read.
pub const MAX_CONTROL_FILE_SIZE: u64 = 1 << 20;

const HEADER_LEN: usize = 8;
const CRC_LEN: usize = 4;

/// Serializes `state` into a complete control file image.
///
/// Body layout: `[16] tenant_id`, `[16] timeline_id`; mconf = `u32 generation`, members,
/// `u8 has_new_members` (0/1) then new members if 1, where a member list is `u32 n` then n ×
/// (`u64 id`, `u32 host_len`, host UTF-8, `u16 pg_port`); acceptor state = `u64 term`, `u32 n`,
/// n × (`u64 term`, `u64 lsn`), `u32 elected_generation` (since version 2); server = `u32 pg_version`, `u64 system_id`, `u32 wal_seg_size`;
/// `u64` timeline_start_lsn, local_start_lsn, commit_lsn, peer_horizon_lsn,
/// remote_consistent_lsn; `u64 creation_ts`; `u64 backup_lsn` (since version 3); `u8 evicted` (0/1, since version 4).
pub fn encode(state: &TimelinePersistentState) -> Vec<u8> {
    let mut b = Vec::with_capacity(256);
    b.extend_from_slice(&CONTROL_FILE_MAGIC.to_le_bytes());
    b.extend_from_slice(&CONTROL_FILE_FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&state.tenant_id.0);
    b.extend_from_slice(&state.timeline_id.0);
    b.extend_from_slice(&state.mconf.generation.0.to_le_bytes());
    encode_members(&mut b, &state.mconf.members);
    match &state.mconf.new_members {
        None => b.push(0),
        Some(m) => {
            b.push(1);
            encode_members(&mut b, m);
        }
    }
    b.extend_from_slice(&state.acceptor_state.term.0.to_le_bytes());
    let hist = &state.acceptor_state.term_history.0;
    b.extend_from_slice(&(hist.len() as u32).to_le_bytes());
    for e in hist {
        b.extend_from_slice(&e.term.0.to_le_bytes());
        b.extend_from_slice(&e.lsn.0.to_le_bytes());
    }
    b.extend_from_slice(&state.acceptor_state.elected_generation.0.to_le_bytes());
    b.extend_from_slice(&state.server.pg_version.to_le_bytes());
    b.extend_from_slice(&state.server.system_id.to_le_bytes());
    b.extend_from_slice(&state.server.wal_seg_size.to_le_bytes());
    for lsn in [
        state.timeline_start_lsn,
        state.local_start_lsn,
        state.commit_lsn,
        state.peer_horizon_lsn,
        state.remote_consistent_lsn,
    ] {
        b.extend_from_slice(&lsn.0.to_le_bytes());
    }
    b.extend_from_slice(&state.creation_ts.to_le_bytes());
    b.extend_from_slice(&state.backup_lsn.0.to_le_bytes());
    b.push(u8::from(state.evicted));
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

fn encode_members(b: &mut Vec<u8>, members: &[SafekeeperId]) {
    b.extend_from_slice(&(members.len() as u32).to_le_bytes());
    for m in members {
        b.extend_from_slice(&m.id.0.to_le_bytes());
        b.extend_from_slice(&(m.host.len() as u32).to_le_bytes());
        b.extend_from_slice(m.host.as_bytes());
        b.extend_from_slice(&m.pg_port.to_le_bytes());
    }
}

/// A bounded little-endian reader over the body; errors are reasons.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if n > self.b.len() {
            return Err(format!("truncated: need {n} bytes, {} left", self.b.len()));
        }
        let (head, tail) = self.b.split_at(n);
        self.b = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> std::result::Result<u16, String> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of entries at least `min_entry` bytes each, checked against the bytes left.
    fn count(&mut self, min_entry: usize, what: &str) -> std::result::Result<usize, String> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_entry) > self.b.len() {
            return Err(format!("{what} count {n} exceeds the file"));
        }
        Ok(n)
    }

    fn members(&mut self) -> std::result::Result<Vec<SafekeeperId>, String> {
        let n = self.count(8 + 4 + 2, "member")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = NodeId(self.u64()?);
            let len = self.u32()? as usize;
            let host = std::str::from_utf8(self.take(len)?)
                .map_err(|_| "member host is not UTF-8".to_string())?
                .to_string();
            let pg_port = self.u16()?;
            out.push(SafekeeperId { id, host, pg_port });
        }
        Ok(out)
    }
}

/// Parses a control file image read from `file` (named in errors).
pub fn decode(bytes: &[u8], file: &Path) -> Result<TimelinePersistentState> {
    let corrupt = |reason: String| Error::Corruption {
        file: file.display().to_string(),
        reason,
    };
    if bytes.len() < HEADER_LEN + CRC_LEN {
        return Err(corrupt(format!(
            "control file too short ({} bytes)",
            bytes.len()
        )));
    }
    let (magic, rest) = bytes.split_at(4);
    let magic = u32::from_le_bytes(magic.try_into().expect("split at 4"));
    if magic != CONTROL_FILE_MAGIC {
        return Err(corrupt(format!("bad magic {magic:#010x}")));
    }
    let version = u32::from_le_bytes(rest[..4].try_into().expect("length checked above"));
    if !(1..=CONTROL_FILE_FORMAT_VERSION).contains(&version) {
        return Err(corrupt(format!(
            "unsupported format version {version} (this build reads 1 to {CONTROL_FILE_FORMAT_VERSION})"
        )));
    }
    let (data, crc) = bytes.split_at(bytes.len() - CRC_LEN);
    let stored = u32::from_le_bytes(crc.try_into().expect("split at len - 4"));
    let computed = crc32c::crc32c(data);
    if stored != computed {
        return Err(corrupt(format!(
            "control file checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
        )));
    }
    decode_body(&data[HEADER_LEN..], version).map_err(corrupt)
}

fn decode_body(body: &[u8], version: u32) -> std::result::Result<TimelinePersistentState, String> {
    let mut r = Reader { b: body };
    let tenant_id = TenantId(r.array()?);
    let timeline_id = TimelineId(r.array()?);
    let generation = Generation(r.u32()?);
    let members = r.members()?;
    let new_members = match r.u8()? {
        0 => None,
        1 => Some(r.members()?),
        t => return Err(format!("bad new_members tag {t}")),
    };
    let term = Term(r.u64()?);
    let n = r.count(16, "term history")?;
    let mut hist = Vec::with_capacity(n);
    for _ in 0..n {
        hist.push(TermLsn {
            term: Term(r.u64()?),
            lsn: Lsn(r.u64()?),
        });
    }
    let elected_generation = if version >= 2 {
        Generation(r.u32()?)
    } else {
        Generation::INVALID
    };
    let server = ServerInfo {
        pg_version: r.u32()?,
        system_id: r.u64()?,
        wal_seg_size: r.u32()?,
    };
    let mut lsn = || r.u64().map(Lsn);
    let (timeline_start_lsn, local_start_lsn, commit_lsn, peer_horizon_lsn, remote_consistent_lsn) =
        (lsn()?, lsn()?, lsn()?, lsn()?, lsn()?);
    let creation_ts = r.u64()?;
    let backup_lsn = if version >= 3 {
        Lsn(r.u64()?)
    } else {
        Lsn::INVALID
    };
    let evicted = if version >= 4 {
        match r.u8()? {
            0 => false,
            1 => true,
            t => return Err(format!("bad evicted flag {t}")),
        }
    } else {
        false
    };
    if !r.b.is_empty() {
        return Err(format!("{} trailing bytes", r.b.len()));
    }
    Ok(TimelinePersistentState {
        tenant_id,
        timeline_id,
        mconf: Configuration {
            generation,
            members,
            new_members,
        },
        acceptor_state: AcceptorState {
            term,
            term_history: TermHistory(hist),
            elected_generation,
        },
        server,
        timeline_start_lsn,
        local_start_lsn,
        commit_lsn,
        peer_horizon_lsn,
        remote_consistent_lsn,
        backup_lsn,
        evicted,
        creation_ts,
    })
}

/// The control file of one timeline directory.
///
/// Invariant: `state` equals what the file on disk holds (it is updated only after a
/// successful, durable persist).
///
/// A save can also run in two phases, so that its write (an fsync, a rename and a directory
/// fsync: milliseconds) runs outside the caller's lock: [`FileControlStore::begin_save`] under
/// the lock, [`PendingSave::write`] outside it, [`FileControlStore::finish_save`] under it again.
/// Every save, either kind, gets a sequence number when its state is taken, in the caller's
/// lock order, and the file only ever moves to a later one:
/// - a write whose number is not above the file's is skipped: a later state (a vote, say) is
///   already there, and this older snapshot would take it back;
/// - `state` takes a written save only if no later one was taken into it meanwhile: the file
///   may hold the later one.
#[derive(Debug)]
pub struct FileControlStore {
    writer: std::sync::Arc<Writer>,
    /// Shared with the timeline's published view ([`FileControlStore::shared`]): a new `Arc`
    /// per persist, so a reader sees one persisted state whole.
    state: std::sync::Arc<TimelinePersistentState>,
    /// The number of the last save begun (0: none since the store was opened).
    issued: u64,
    /// The number of the save `state` is (0: the state opened).
    adopted: u64,
}

/// What writes the file, shared by the store and its saves in flight.
#[derive(Debug)]
struct Writer {
    fs: Fs,
    dir: PathBuf,
    /// Skip fsyncs (tests only).
    no_sync: bool,
    /// Held while writing: one write at a time.
    state: std::sync::Mutex<WriterState>,
}

#[derive(Debug, Default)]
struct WriterState {
    /// The number of the save the file holds.
    written: u64,
    /// No write any more: the timeline is deleted (its directory may be another timeline's
    /// by now).
    closed: bool,
}

impl Writer {
    fn new(fs: Fs, dir: PathBuf, no_sync: bool) -> std::sync::Arc<Writer> {
        std::sync::Arc::new(Writer {
            fs,
            dir,
            no_sync,
            state: std::sync::Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WriterState> {
        // A panic while holding it aborted a write, which `written` never counted.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes save `seq` durably unless the file holds a later one. Returns whether it wrote.
    fn write(&self, seq: u64, state: &TimelinePersistentState) -> Result<bool> {
        let mut w = self.lock();
        if w.closed {
            return Err(Error::Rejected(format!(
                "the control file in {} is closed: the timeline was deleted",
                self.dir.display()
            )));
        }
        if seq <= w.written {
            return Ok(false);
        }
        write_durably(&self.fs, &self.dir, state, self.no_sync)?;
        w.written = seq;
        Ok(true)
    }
}

/// A save begun under the caller's lock, to be written outside it
/// ([`FileControlStore::begin_save`]).
#[derive(Debug)]
#[must_use = "a save begun is written, then finished"]
pub struct PendingSave {
    writer: std::sync::Arc<Writer>,
    seq: u64,
    state: std::sync::Arc<TimelinePersistentState>,
}

impl PendingSave {
    /// Writes the state durably (blocking, without the caller's lock). `None`: skipped, the
    /// file already holds a later save.
    pub fn write(self) -> Result<Option<WrittenSave>> {
        Ok(self
            .writer
            .write(self.seq, &self.state)?
            .then_some(WrittenSave {
                seq: self.seq,
                state: self.state,
            }))
    }
}

/// A save on disk, for [`FileControlStore::finish_save`].
#[derive(Debug)]
#[must_use = "a written save is finished under the caller's lock"]
pub struct WrittenSave {
    seq: u64,
    state: std::sync::Arc<TimelinePersistentState>,
}

impl FileControlStore {
    /// Creates the control file of a new timeline in `dir` (which must exist) holding `state`.
    /// Refuses to overwrite an existing control file.
    pub fn create_new(
        dir: impl Into<PathBuf>,
        state: TimelinePersistentState,
        no_sync: bool,
    ) -> Result<FileControlStore> {
        FileControlStore::create_new_in(Fs::real(), dir, state, no_sync)
    }

    /// [`FileControlStore::create_new`] on file system `fs`.
    pub fn create_new_in(
        fs: Fs,
        dir: impl Into<PathBuf>,
        state: TimelinePersistentState,
        no_sync: bool,
    ) -> Result<FileControlStore> {
        let dir = dir.into();
        let path = dir.join(CONTROL_FILE_NAME);
        if fs.exists(&path) {
            return Err(Error::Rejected(format!(
                "control file {} already exists",
                path.display()
            )));
        }
        write_durably(&fs, &dir, &state, no_sync)?;
        Ok(FileControlStore::opened(fs, dir, state, no_sync))
    }

    /// Loads and verifies the control file in `dir`.
    pub fn load(dir: impl Into<PathBuf>, no_sync: bool) -> Result<FileControlStore> {
        FileControlStore::load_in(Fs::real(), dir, no_sync)
    }

    /// [`FileControlStore::load`] on file system `fs`.
    pub fn load_in(fs: Fs, dir: impl Into<PathBuf>, no_sync: bool) -> Result<FileControlStore> {
        let dir = dir.into();
        let path = dir.join(CONTROL_FILE_NAME);
        let f = fs
            .open(&path, OpenMode::Read)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let mut bytes = vec![0; MAX_CONTROL_FILE_SIZE as usize + 1];
        let n = read_full_at(&*f, &mut bytes, 0)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        bytes.truncate(n);
        if bytes.len() as u64 > MAX_CONTROL_FILE_SIZE {
            return Err(Error::Corruption {
                file: path.display().to_string(),
                reason: format!("larger than {MAX_CONTROL_FILE_SIZE} bytes"),
            });
        }
        let state = decode(&bytes, &path)?;
        if !no_sync {
            // After a crash the state just read may still be only in the page cache (a rename
            // whose directory fsync never ran): make it durable before anything acts on it or
            // reveals it (a vote already given in the term it holds, say).
            fsync_or_abort(&*f, &path, SyncKind::All);
            fsync_dir(&fs, &dir)?;
        }
        Ok(FileControlStore::opened(fs, dir, state, no_sync))
    }

    fn opened(
        fs: Fs,
        dir: PathBuf,
        state: TimelinePersistentState,
        no_sync: bool,
    ) -> FileControlStore {
        FileControlStore {
            writer: Writer::new(fs, dir, no_sync),
            state: std::sync::Arc::new(state),
            issued: 0,
            adopted: 0,
        }
    }

    /// Path of the control file.
    pub fn path(&self) -> PathBuf {
        self.writer.dir.join(CONTROL_FILE_NAME)
    }

    /// Begins a save of `state` (under the caller's lock, which orders it against every other
    /// save): numbers it. Write it with [`PendingSave::write`], then finish it.
    pub fn begin_save(&mut self, state: TimelinePersistentState) -> PendingSave {
        self.issued += 1;
        PendingSave {
            writer: self.writer.clone(),
            seq: self.issued,
            state: std::sync::Arc::new(state),
        }
    }

    /// Refuses every write from now on, after waiting for one in progress: the timeline is
    /// deleted, and its directory may soon hold another timeline's control file (created again,
    /// or pulled) that a save begun before the deletion must not overwrite.
    pub fn close(&self) {
        self.writer.lock().closed = true;
    }

    /// Finishes a written save (under the caller's lock): it becomes the persisted state
    /// unless a later save did meanwhile. Returns whether it did.
    pub fn finish_save(&mut self, saved: WrittenSave) -> bool {
        if saved.seq <= self.adopted {
            return false;
        }
        self.adopted = saved.seq;
        self.state = saved.state;
        true
    }
}

/// Writes `state` to the temporary file, syncs it and renames it over the control file durably.
fn write_durably(
    fs: &Fs,
    dir: &Path,
    state: &TimelinePersistentState,
    no_sync: bool,
) -> Result<()> {
    let tmp = dir.join(CONTROL_FILE_TMP_NAME);
    let path = dir.join(CONTROL_FILE_NAME);
    let bytes = encode(state);
    let f = fs
        .open(&tmp, OpenMode::CreateTruncate)
        .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    f.write_all_at(&bytes, 0)
        .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    if !no_sync {
        // The new state is durable under the temporary name before it replaces the old one.
        fsync_or_abort(&*f, &tmp, SyncKind::All);
    }
    drop(f);
    // The rename is durable (directory fsynced) before persist returns.
    durable_rename(fs, &tmp, &path, dir, no_sync)
}

impl FileControlStore {
    /// The persisted state, shared: the same `Arc` until the next persist.
    pub fn shared(&self) -> std::sync::Arc<TimelinePersistentState> {
        self.state.clone()
    }
}

impl Deref for FileControlStore {
    type Target = TimelinePersistentState;

    fn deref(&self) -> &TimelinePersistentState {
        &self.state
    }
}

impl ControlStore for FileControlStore {
    fn persist(&mut self, state: &TimelinePersistentState) -> Result<()> {
        // Numbered like a two-phase save, so that none begun earlier overwrites this one (the
        // write waits for one in progress). Its number is the highest issued, so it is never
        // skipped; if it were, the state would not be on disk.
        match self.begin_save(state.clone()).write()? {
            Some(saved) => {
                self.finish_save(saved);
                Ok(())
            }
            None => Err(Error::Rejected(
                "a control-file save was skipped under a later one".to_string(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TimelinePersistentState {
        let member = |id: u64, host: &str| SafekeeperId {
            id: NodeId(id),
            host: host.to_string(),
            pg_port: 5454 + id as u16,
        };
        let mut s = TimelinePersistentState::new(
            "de200bd42b49cc1814412c7e592dd6e9".parse().unwrap(),
            "0123456789abcdef0123456789abcdef".parse().unwrap(),
            Configuration {
                generation: Generation(3),
                members: vec![member(1, "sk-1"), member(2, "sk-2.example"), member(3, "")],
                new_members: Some(vec![member(4, "sk-4")]),
            },
            ServerInfo {
                pg_version: 150_018,
                system_id: 0x7351_2345_6789_abcd,
                wal_seg_size: 16 << 20,
            },
            1_764_400_000,
        );
        s.acceptor_state = AcceptorState {
            term: Term(7),
            term_history: TermHistory(vec![
                TermLsn {
                    term: Term(0),
                    lsn: Lsn(0x149_F0D8),
                },
                TermLsn {
                    term: Term(5),
                    lsn: Lsn(0x200_0000),
                },
            ]),
            elected_generation: Generation(3),
        };
        s.timeline_start_lsn = Lsn(0x149_F0D8);
        s.local_start_lsn = Lsn(0x149_F0D8);
        s.commit_lsn = Lsn(0x300_0028);
        s.peer_horizon_lsn = Lsn(0x250_0000);
        s.remote_consistent_lsn = Lsn(0x240_0000);
        s.backup_lsn = Lsn(0x200_0000);
        s
    }

    /// The image of `s` in format version `version` (2: before `backup_lsn`, 3: before
    /// `evicted`), checksummed.
    fn old_image(s: &TimelinePersistentState, version: u32) -> Vec<u8> {
        let now = encode(s);
        let strip = match version {
            2 => 9,
            3 => 1,
            v => panic!("no image of version {v}"),
        };
        let mut old = now[..now.len() - CRC_LEN - strip].to_vec();
        old[4..8].copy_from_slice(&version.to_le_bytes());
        let crc = crc32c::crc32c(&old);
        old.extend_from_slice(&crc.to_le_bytes());
        old
    }

    fn version_two_image(s: &TimelinePersistentState) -> Vec<u8> {
        old_image(s, 2)
    }

    /// A version-3 file (before `evicted`) loads as a resident timeline; the flag round-trips
    /// in the current version, and a byte other than 0 or 1 is refused.
    #[test]
    fn a_version_three_file_loads_as_resident_and_the_evicted_flag_round_trips() {
        let s = sample();
        let v3 = old_image(&s, 3);
        assert_eq!(decode(&v3, Path::new("x")).unwrap(), s);
        let mut e = sample();
        e.evicted = true;
        let image = encode(&e);
        assert_eq!(decode(&image, Path::new("x")).unwrap(), e);
        let mut bad = image[..image.len() - CRC_LEN].to_vec();
        *bad.last_mut().unwrap() = 2;
        let crc = crc32c::crc32c(&bad);
        bad.extend_from_slice(&crc.to_le_bytes());
        let err = decode(&bad, Path::new("x")).unwrap_err();
        assert!(err.to_string().contains("evicted flag"), "{err}");
    }

    /// A version-2 file (before `backup_lsn`) still loads, with nothing backed up; it is
    /// written back as the current version.
    #[test]
    fn a_version_two_file_still_loads() {
        let mut s = sample();
        s.backup_lsn = Lsn::INVALID;
        let v2 = version_two_image(&s);
        assert_eq!(u32::from_le_bytes(v2[4..8].try_into().unwrap()), 2);
        assert_eq!(decode(&v2, Path::new("x")).unwrap(), s);
        // A version-3 image decodes its backup_lsn (the field is really read).
        let v3 = sample();
        assert_eq!(
            decode(&encode(&v3), Path::new("x")).unwrap().backup_lsn,
            Lsn(0x200_0000)
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CONTROL_FILE_NAME), &v2).unwrap();
        let mut store = FileControlStore::load(dir.path(), true).unwrap();
        assert_eq!(*store, s);
        store.persist(&v3).unwrap();
        let raw = std::fs::read(dir.path().join(CONTROL_FILE_NAME)).unwrap();
        assert_eq!(
            u32::from_le_bytes(raw[4..8].try_into().unwrap()),
            CONTROL_FILE_FORMAT_VERSION
        );
        assert_eq!(*FileControlStore::load(dir.path(), true).unwrap(), v3);
    }

    #[test]
    fn control_file_round_trips() {
        let s = sample();
        let bytes = encode(&s);
        assert_eq!(decode(&bytes, Path::new("x")).unwrap(), s);
        let mut empty = s.clone();
        empty.mconf = Configuration::default();
        empty.acceptor_state = AcceptorState::default();
        assert_eq!(decode(&encode(&empty), Path::new("x")).unwrap(), empty);
    }

    #[test]
    fn persisted_state_survives_reload() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = sample();
        let mut store = FileControlStore::create_new(dir.path(), s.clone(), false).unwrap();
        assert_eq!(*store, s);
        assert!(FileControlStore::create_new(dir.path(), s.clone(), false).is_err());
        s.acceptor_state.term = Term(8);
        s.commit_lsn = Lsn(0x400_0000);
        store.persist(&s).unwrap();
        assert_eq!(*store, s);
        assert!(!dir.path().join(CONTROL_FILE_TMP_NAME).exists());
        let loaded = FileControlStore::load(dir.path(), false).unwrap();
        assert_eq!(*loaded, s);
    }

    /// The two-phase save against a vote persisted between its phases: a snapshot taken
    /// before the vote never reaches the file after it, and one written before it never
    /// becomes the persisted state after it.
    #[test]
    fn a_save_taken_before_a_vote_never_takes_the_vote_back() {
        let dir = tempfile::tempdir().unwrap();
        let s0 = sample();
        let mut store = FileControlStore::create_new(dir.path(), s0.clone(), false).unwrap();
        let lazy = |base: &TimelinePersistentState, commit: u64| {
            let mut s = base.clone();
            s.commit_lsn = Lsn(commit);
            s
        };
        let vote = |base: &TimelinePersistentState, term: u64| {
            let mut s = base.clone();
            s.acceptor_state.term = Term(term);
            s
        };
        let on_disk = || (*FileControlStore::load(dir.path(), false).unwrap()).clone();

        // Alone: written, then the persisted state.
        let s1 = lazy(&s0, 0x310_0000);
        let written = store
            .begin_save(s1.clone())
            .write()
            .unwrap()
            .expect("written");
        assert_eq!(on_disk(), s1);
        assert!(store.finish_save(written));
        assert_eq!(*store, s1);

        // Taken, then a vote persisted, then written: skipped.
        let stale = store.begin_save(lazy(&s1, 0x320_0000));
        let v8 = vote(&s1, 8);
        store.persist(&v8).unwrap();
        assert!(stale.write().unwrap().is_none(), "a stale save was written");
        assert_eq!(on_disk(), v8, "the vote was taken back");
        assert_eq!(*store, v8);

        // Taken and written, then a vote persisted (from the state before it), then finished:
        // the vote stays the persisted state, as it is the file's.
        let written = store
            .begin_save(lazy(&v8, 0x330_0000))
            .write()
            .unwrap()
            .expect("written");
        let v9 = vote(&v8, 9);
        store.persist(&v9).unwrap();
        assert!(!store.finish_save(written), "an overwritten save was taken");
        assert_eq!(*store, v9);
        assert_eq!(on_disk(), v9);

        // Two saves in flight: the later one wins whatever order they are written in.
        let first = store.begin_save(lazy(&v9, 0x340_0000));
        let second = lazy(&v9, 0x350_0000);
        let later = store.begin_save(second.clone()).write().unwrap().unwrap();
        assert!(first.write().unwrap().is_none());
        assert!(store.finish_save(later));
        assert_eq!(*store, second);
        assert_eq!(on_disk(), second);
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let s = sample();
        let store = FileControlStore::create_new(dir.path(), s, true).unwrap();
        let path = store.path();
        let pristine = std::fs::read(&path).unwrap();
        for bit in 0..pristine.len() * 8 {
            let mut b = pristine.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            std::fs::write(&path, &b).unwrap();
            match FileControlStore::load(dir.path(), true) {
                Err(Error::Corruption { file, .. }) => {
                    assert_eq!(file, path.display().to_string(), "bit {bit}")
                }
                other => panic!("bit {bit}: flip not detected: {other:?}"),
            }
        }
    }

    #[test]
    fn truncated_or_overlong_files_are_refused_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileControlStore::create_new(dir.path(), sample(), true).unwrap();
        let path = store.path();
        let pristine = std::fs::read(&path).unwrap();
        for len in 0..pristine.len() {
            std::fs::write(&path, &pristine[..len]).unwrap();
            let err = FileControlStore::load(dir.path(), true).unwrap_err();
            assert!(
                err.to_string().contains(&path.display().to_string()),
                "{err}"
            );
        }
        let mut long = pristine.clone();
        long.extend_from_slice(&[0; 4]);
        std::fs::write(&path, &long).unwrap();
        assert!(matches!(
            FileControlStore::load(dir.path(), true),
            Err(Error::Corruption { .. })
        ));
    }

    /// A version-1 file (before `elected_generation`) still loads; it is written back as the
    /// current version.
    #[test]
    fn a_version_one_file_still_loads() {
        let mut s = sample();
        // Where the field sits: find a marker value in the image.
        s.acceptor_state.elected_generation = Generation(0xa5a5_a5a5);
        s.backup_lsn = Lsn::INVALID;
        let marked = version_two_image(&s);
        let hist_end = marked
            .windows(4)
            .position(|w| w == 0xa5a5_a5a5u32.to_le_bytes())
            .unwrap();
        s.acceptor_state.elected_generation = Generation::INVALID;
        let v2 = version_two_image(&s);
        let mut v1 = v2[..hist_end].to_vec();
        v1.extend_from_slice(&v2[hist_end + 4..v2.len() - CRC_LEN]);
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        let crc = crc32c::crc32c(&v1);
        v1.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&v1, Path::new("x")).unwrap(), s);
        let mut later = s.clone();
        later.acceptor_state.elected_generation = Generation(4);
        assert_eq!(decode(&encode(&later), Path::new("x")).unwrap(), later);
    }

    #[test]
    fn bogus_counts_with_a_valid_checksum_are_refused_without_allocating() {
        // A body claiming u32::MAX members, correctly checksummed: refused, not allocated.
        let mut b = Vec::new();
        b.extend_from_slice(&CONTROL_FILE_MAGIC.to_le_bytes());
        b.extend_from_slice(&CONTROL_FILE_FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&[0; 32]);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        let err = decode(&b, Path::new("/x/safekeeper.control")).unwrap_err();
        assert!(err.to_string().contains("member count"), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic_the_control_file_decoder(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            let mut b = Vec::new();
            b.extend_from_slice(&CONTROL_FILE_MAGIC.to_le_bytes());
            b.extend_from_slice(&CONTROL_FILE_FORMAT_VERSION.to_le_bytes());
            b.extend_from_slice(&body);
            let crc = crc32c::crc32c(&b);
            b.extend_from_slice(&crc.to_le_bytes());
            let _ = decode(&b, Path::new("x"));
        }
    }

    /// Promise 1 for votes: a persisted state survives a power loss that forgets every
    /// un-synced directory entry (the rename over the control file is followed by a directory
    /// fsync); without that fsync the old state comes back.
    #[test]
    fn persisted_state_survives_power_loss_that_forgets_unsynced_renames() {
        use sk_core::storage::fs::SimFs;
        let dir = Path::new("/tl");
        let (sim, fs) = SimFs::with_dir(dir);
        let mut store = FileControlStore::create_new_in(fs.clone(), dir, sample(), false).unwrap();
        for term in 8..12 {
            let mut s = sample();
            s.acceptor_state.term = Term(term);
            store.persist(&s).unwrap();
            sim.power_loss(&mut |_| 0);
            let loaded = FileControlStore::load_in(fs.clone(), dir, false).unwrap();
            assert_eq!(loaded.acceptor_state.term, Term(term));
            assert!(!fs.exists(&dir.join(CONTROL_FILE_TMP_NAME)));
        }
    }

    /// A process that died between the rename and the directory fsync of a persist leaves the
    /// new state visible but not durable; the restarted process reads it (and may act on it:
    /// refuse a vote in that term). Loading makes it durable, so a later power loss cannot
    /// bring the old state back.
    #[test]
    fn state_read_after_a_crash_survives_a_later_power_loss() {
        use sk_core::storage::fs::SimFs;
        let dir = Path::new("/tl");
        let (sim, fs) = SimFs::with_dir(dir);
        FileControlStore::create_new_in(fs.clone(), dir, sample(), false).unwrap();
        let mut s = sample();
        s.acceptor_state.term = Term(42);
        // A persist cut short after its rename: the directory fsync never ran.
        let tmp = dir.join(CONTROL_FILE_TMP_NAME);
        let f = fs.open(&tmp, OpenMode::CreateTruncate).unwrap();
        f.write_all_at(&encode(&s), 0).unwrap();
        f.sync(SyncKind::All).unwrap();
        drop(f);
        fs.rename(&tmp, &dir.join(CONTROL_FILE_NAME)).unwrap();
        sim.process_crash();
        let loaded = FileControlStore::load_in(fs.clone(), dir, false).unwrap();
        assert_eq!(loaded.acceptor_state.term, Term(42));
        drop(loaded);
        sim.power_loss(&mut |_| 0);
        let after = FileControlStore::load_in(fs.clone(), dir, false).unwrap();
        assert_eq!(
            after.acceptor_state.term,
            Term(42),
            "the state a restarted process read came back older after a power loss"
        );
    }
}
