//! The remote store of WAL segments (`--remote-storage URL`), through the `object_store` crate:
//! `file:///path` (local files, the embedded default) or `s3://bucket/prefix` (the usual AWS
//! environment: `AWS_ENDPOINT_URL`, `AWS_REGION`, keys). A leaf below the timelines: it knows
//! objects, segments and the readers' budget, not timelines (issue 26: the timeline imports it,
//! and nothing here imports the timeline back).
//!
//! Objects are laid out as `<prefix>/<tenant_id>/<timeline_id>/<segment name>`. Several
//! safekeepers hold the same segment: each one stores it with a conditional create
//! (`PutMode::Create`, create-if-absent, after a HEAD that finds most of them stored), so a
//! segment is stored once; a node that finds it already stored compares its size and bytes,
//! as they stream in, with its own copy instead of overwriting it (no election between nodes). A
//! mismatch is an error (naming both copies' CRC-32C) and the segment is never counted as
//! backed up here.
//!
//! With `file://`, an object is fsynced (file and directories) before it counts as stored:
//! `object_store`'s local store renames its objects in without syncing them.
//!
//! Partial segments (the committed part of a segment not yet complete, `--partial-backup-timeout`)
//! are objects of their own, `<segment name>_<term>_<end LSN>.partial` (16 hex digits each):
//! never parsed as a complete segment, and each name holds one content (the WAL of that term
//! below that end), so they are stored with the same conditional create and verification.
//!
//! Not here: when segments are backed up ([`crate::manager`], [`crate::wal_backup`]).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};
use pg_wal::format::{parse_xlog_file_name, xlog_file_name};
use sk_core::types::{Lsn, TenantTimelineId};
use tokio::sync::Semaphore;

use crate::metrics;

/// A remote store of WAL segments.
pub struct RemoteStorage {
    store: Arc<dyn ObjectStore>,
    /// Key prefix (no leading or trailing `/`), empty for the store's root.
    prefix: String,
    url: String,
    /// The directory of a `file://` store (its objects are fsynced there).
    local_root: Option<PathBuf>,
    /// Readers' remote reads in progress, in KiB: a read takes its size before it starts
    /// (`--remote-read-budget`).
    read_budget: Arc<Semaphore>,
    /// `--max-reader-hold`: how far behind the flush LSN a reader may hold local WAL (0: readers
    /// hold nothing; removed WAL is served from the store).
    max_reader_hold: u64,
}

/// The default of `--remote-read-budget`.
pub const DEFAULT_REMOTE_READ_BUDGET: u64 = 64 << 20;
/// The largest range one remote read asks for (and a reader buffers).
pub const REMOTE_READ_RANGE: u64 = 1 << 20;

/// How much of a local segment verification reads at a time.
pub const VERIFY_BLOCK: u64 = 1 << 20;

/// A node's own copy of a segment, read as the store needs it: the timeline's file in the
/// daemon, bytes in memory for a partial object.
pub trait LocalSegment: Sync {
    /// Fills `buf` with the copy's bytes from `offset` on and hands it back.
    fn read_at(
        &self,
        offset: u64,
        buf: Vec<u8>,
    ) -> impl std::future::Future<Output = anyhow::Result<Vec<u8>>> + Send;

    /// The copy's first `size` bytes, whole (for an upload, or an error naming checksums).
    fn read_whole(
        &self,
        size: u64,
    ) -> impl std::future::Future<Output = anyhow::Result<Bytes>> + Send {
        async move { Ok(Bytes::from(self.read_at(0, vec![0; size as usize]).await?)) }
    }
}

impl LocalSegment for Bytes {
    /// Shares the bytes instead of copying them.
    async fn read_whole(&self, size: u64) -> anyhow::Result<Bytes> {
        let to = usize::try_from(size).unwrap_or(usize::MAX);
        self.get(..to)
            .map(|_| self.slice(..to))
            .with_context(|| format!("reading {size} bytes of a {}-byte copy", self.len()))
    }

    async fn read_at(&self, offset: u64, mut buf: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        let from = usize::try_from(offset).unwrap_or(usize::MAX);
        let bytes = from
            .checked_add(buf.len())
            .and_then(|to| self.get(from..to))
            .with_context(|| {
                format!(
                    "reading {} bytes at {offset} of a {}-byte copy",
                    buf.len(),
                    self.len()
                )
            })?;
        buf.copy_from_slice(bytes);
        Ok(buf)
    }
}

/// How a segment came to be backed up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This node stored it.
    Uploaded,
    /// It was already stored (by another node, or before a restart) and matches the local copy.
    Verified,
}

impl RemoteStorage {
    /// Opens the store of `url`: `file:///absolute/path` (created if missing) or
    /// `s3://bucket[/prefix]` configured from the AWS environment (an `http://`
    /// `AWS_ENDPOINT_URL`, as of a local S3 server, is allowed).
    pub fn from_url(url: &str) -> anyhow::Result<RemoteStorage> {
        let url = url.trim_end_matches('/').to_string();
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                bail!("--remote-storage {url}: a file:// URL needs an absolute path");
            }
            let root = PathBuf::from(path);
            std::fs::create_dir_all(&root)
                .with_context(|| format!("--remote-storage {url}: creating {path}"))?;
            let store = object_store::local::LocalFileSystem::new_with_prefix(&root)
                .with_context(|| format!("--remote-storage {url}"))?;
            return Ok(RemoteStorage {
                store: Arc::new(store),
                prefix: String::new(),
                url,
                local_root: Some(root),
                read_budget: budget(DEFAULT_REMOTE_READ_BUDGET),
                max_reader_hold: 0,
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                bail!("--remote-storage {url}: no bucket name");
            }
            let mut builder =
                object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
            if std::env::var("AWS_ENDPOINT_URL").is_ok_and(|e| e.starts_with("http://")) {
                builder = builder.with_allow_http(true);
            }
            let store = builder
                .build()
                .with_context(|| format!("--remote-storage {url}"))?;
            return Ok(RemoteStorage {
                store: Arc::new(store),
                prefix: prefix.trim_matches('/').to_string(),
                url,
                local_root: None,
                read_budget: budget(DEFAULT_REMOTE_READ_BUDGET),
                max_reader_hold: 0,
            });
        }
        bail!("--remote-storage {url}: unsupported URL (use file:///path or s3://bucket/prefix)")
    }

    /// A store over `store` (the simulation's in-memory one, say), shown as `url`.
    pub fn with_store(store: Arc<dyn ObjectStore>, url: &str) -> RemoteStorage {
        RemoteStorage {
            store,
            prefix: String::new(),
            url: url.to_string(),
            local_root: None,
            read_budget: budget(DEFAULT_REMOTE_READ_BUDGET),
            max_reader_hold: 0,
        }
    }

    /// Sets the readers' limits: `--remote-read-budget` bytes of remote reads in progress or
    /// buffered on the node, and `--max-reader-hold`.
    pub fn with_reader_limits(mut self, read_budget: u64, max_reader_hold: u64) -> RemoteStorage {
        self.read_budget = budget(read_budget.max(REMOTE_READ_RANGE));
        self.max_reader_hold = max_reader_hold;
        self
    }

    /// `--max-reader-hold` (0: readers hold no local WAL).
    pub fn max_reader_hold(&self) -> u64 {
        self.max_reader_hold
    }

    /// Whether segment `segno` of `ttid` is stored (a HEAD request: nothing is downloaded).
    pub async fn has_segment(
        &self,
        ttid: &TenantTimelineId,
        segno: u64,
        seg_size: u64,
    ) -> anyhow::Result<bool> {
        let path = self.object(ttid, segno, seg_size);
        match self.store.head(&path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("probing {path}")),
        }
    }

    /// Bytes `range` of stored segment `segno`, read once the node's read budget has room
    /// for them (the permit is returned with the bytes: the budget counts them while they are
    /// buffered); `None` if the segment is not stored.
    pub async fn read_range(
        &self,
        ttid: &TenantTimelineId,
        segno: u64,
        seg_size: u64,
        range: std::ops::Range<u64>,
    ) -> anyhow::Result<Option<(Bytes, BudgetPermit)>> {
        let kib = range.end.saturating_sub(range.start).div_ceil(1024).max(1) as u32;
        let permit = self
            .read_budget
            .clone()
            .acquire_many_owned(kib)
            .await
            .context("remote read budget")?;
        let permit = BudgetPermit::new(permit, u64::from(kib) * 1024);
        let path = self.object(ttid, segno, seg_size);
        match self.store.get_range(&path, range.clone()).await {
            Ok(b) => {
                metrics::REMOTE_READ_BYTES.inc_by(b.len() as u64);
                Ok(Some((b, permit)))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {path} {range:?}")),
        }
    }

    /// Deletes every object of a timeline (`Some`) or of a whole tenant (`None`): what a
    /// delete of it leaves to do in the store. Returns how many objects it deleted. Deleting
    /// what is already gone succeeds.
    pub async fn delete_objects(
        &self,
        tenant_id: &sk_core::types::TenantId,
        timeline_id: Option<&sk_core::types::TimelineId>,
    ) -> anyhow::Result<usize> {
        let prefix = ObjPath::from(self.key(match timeline_id {
            Some(t) => format!("{tenant_id}/{t}"),
            None => tenant_id.to_string(),
        }));
        let mut n = 0;
        let mut list = self.store.list(Some(&prefix));
        let mut paths = Vec::new();
        while let Some(meta) = list.next().await {
            paths.push(
                meta.with_context(|| format!("listing {}/{prefix}", self.url))?
                    .location,
            );
        }
        drop(list);
        for path in paths {
            match self.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => n += 1,
                Err(e) => return Err(e).with_context(|| format!("deleting {path}")),
            }
        }
        if let Some(root) = self.local_root.clone() {
            // The removals are durable before the deletion counts as done.
            let dir = root.join(prefix.as_ref());
            crate::blocking::spawn(move || -> anyhow::Result<()> {
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(e).with_context(|| format!("removing {}", dir.display()));
                    }
                }
                // The nearest directory above that still exists (a timeline or tenant that
                // never had an object has no directory) holds the removal: it and every one
                // above it are synced, or the deletion is not done (and is retried).
                let mut parent = dir.parent();
                while let Some(p) = parent
                    && p != root
                    && !p.exists()
                {
                    parent = p.parent();
                }
                match parent {
                    Some(p) if p.starts_with(&root) => sync_dirs_up_to(&root, p),
                    _ => Ok(()),
                }
            })
            .await
            .context("fsync task")??;
        }
        Ok(n)
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `key` under the store's prefix.
    fn key(&self, key: String) -> String {
        if self.prefix.is_empty() {
            key
        } else {
            format!("{}/{key}", self.prefix)
        }
    }

    fn timeline_key(&self, ttid: &TenantTimelineId) -> String {
        self.key(format!("{}/{}", ttid.tenant_id, ttid.timeline_id))
    }

    /// Where a timeline's segments are stored, for the status page.
    pub fn timeline_location(&self, ttid: &TenantTimelineId) -> String {
        timeline_location(&self.url, ttid)
    }

    fn object(&self, ttid: &TenantTimelineId, segno: u64, seg_size: u64) -> ObjPath {
        ObjPath::from(format!(
            "{}/{}",
            self.timeline_key(ttid),
            xlog_file_name(1, segno, seg_size)
        ))
    }

    /// The segments stored for `ttid`, with their sizes.
    pub async fn list_segments(
        &self,
        ttid: &TenantTimelineId,
        seg_size: u64,
    ) -> anyhow::Result<Vec<(u64, u64)>> {
        let mut out = Vec::new();
        for meta in self.timeline_objects(ttid).await? {
            if let Some(name) = meta.location.filename()
                && let Some((segno, false)) = parse_xlog_file_name(name, seg_size)
            {
                out.push((segno, meta.size));
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// The stored segment `segno` of `ttid`, or `None` if it is not stored.
    pub async fn read_segment(
        &self,
        ttid: &TenantTimelineId,
        segno: u64,
        seg_size: u64,
    ) -> anyhow::Result<Option<Bytes>> {
        self.read_object(&self.object(ttid, segno, seg_size)).await
    }

    /// Stores segment `segno` of `ttid` (`seg_size` bytes of `local`) unless it is already
    /// stored, in which case the stored object must equal `local` from byte `valid_from` on (the
    /// bytes before a node's WAL start differ between nodes) and have the same size.
    /// `known_stored` skips looking (the remote listing showed the object).
    ///
    /// It looks first (a HEAD request): a conditional create of a stored object still sends the
    /// whole body (`object_store`'s file store writes it to a staging file before the link
    /// fails, and S3 takes it in before answering 412), and every node but the first finds the
    /// object stored. Verification then reads the local copy a block at a time; only an upload
    /// reads it whole. The create stays conditional for a node that looked before another
    /// stored it.
    pub async fn backup_segment(
        &self,
        ttid: &TenantTimelineId,
        segno: u64,
        seg_size: u64,
        local: &impl LocalSegment,
        valid_from: usize,
        known_stored: bool,
    ) -> anyhow::Result<Outcome> {
        let path = self.object(ttid, segno, seg_size);
        self.store_or_verify(&path, seg_size, local, valid_from, known_stored)
            .await?
            .with_context(|| format!("{path} vanished while being verified"))
    }

    /// Stores `size` bytes of `local` at `path` unless an object is there (`known_stored`, or a
    /// HEAD finds it), which must then equal `local` from `valid_from` on; synced once stored.
    /// `None` if the object vanished while being verified.
    async fn store_or_verify(
        &self,
        path: &ObjPath,
        size: u64,
        local: &impl LocalSegment,
        valid_from: usize,
        known_stored: bool,
    ) -> anyhow::Result<Option<Outcome>> {
        let outcome = if known_stored || self.is_stored(path).await? {
            Outcome::Verified
        } else {
            self.create_once(path, &local.read_whole(size).await?)
                .await?
        };
        if outcome == Outcome::Verified && !self.verify(path, size, local, valid_from).await? {
            return Ok(None);
        }
        self.sync_local(path).await?;
        Ok(Some(outcome))
    }

    /// Whether an object is stored at `path` (a HEAD request).
    async fn is_stored(&self, path: &ObjPath) -> anyhow::Result<bool> {
        match self.store.head(path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("looking up {path}")),
        }
    }

    fn partial_object(
        &self,
        ttid: &TenantTimelineId,
        segno: u64,
        seg_size: u64,
        term: u64,
        upto: Lsn,
    ) -> ObjPath {
        ObjPath::from(format!(
            "{}/{}",
            self.timeline_key(ttid),
            partial_name(segno, seg_size, term, upto)
        ))
    }

    /// Stores the committed part of segment `segno` (`data`: its bytes from 0 to `upto`'s
    /// offset) as a partial object of `term`, unless an object of that name is stored, which
    /// must then equal `data` from `valid_from` on.
    pub async fn backup_partial(
        &self,
        ttid: &TenantTimelineId,
        seg_size: u64,
        term: u64,
        upto: Lsn,
        data: Bytes,
        valid_from: usize,
    ) -> anyhow::Result<Outcome> {
        let segno = upto.segment_number(seg_size);
        let path = self.partial_object(ttid, segno, seg_size, term, upto);
        let size = data.len() as u64;
        let outcome = self
            .store_or_verify(&path, size, &data, valid_from, false)
            .await?;
        // Vanished while being verified: only a node holding more of this WAL in the store (a
        // longer partial object, or the complete segment) removes one, so it is stored;
        // creating it again would bring back a superseded object.
        Ok(outcome.unwrap_or(Outcome::Verified))
    }

    /// The partial objects stored for `ttid`: `(segment, term, end LSN, object)`, by end LSN.
    pub async fn list_partials(
        &self,
        ttid: &TenantTimelineId,
        seg_size: u64,
    ) -> anyhow::Result<Vec<(u64, u64, Lsn, ObjPath)>> {
        let mut out = Vec::new();
        for meta in self.timeline_objects(ttid).await? {
            if let Some(name) = meta.location.filename()
                && let Some((segno, term, upto)) = parse_partial_name(name, seg_size)
            {
                out.push((segno, term, upto, meta.location.clone()));
            }
        }
        out.sort_unstable_by_key(|p| (p.2, p.1));
        Ok(out)
    }

    /// The object at `path` (as listed), or `None` if it is not stored.
    pub async fn read_object(&self, path: &ObjPath) -> anyhow::Result<Option<Bytes>> {
        match self.store.get(path).await {
            Ok(r) => Ok(Some(
                r.bytes().await.with_context(|| format!("reading {path}"))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {path}")),
        }
    }

    /// Compares the object at `path` with `size` bytes of `local` from byte `valid_from` on, as
    /// the object streams in, reading `local` [`VERIFY_BLOCK`] at a time into one buffer (no
    /// copy is held whole): `Ok(false)` if it is not stored. A difference reads both again
    /// whole, for [`verify_stored`]'s error naming both copies' checksums.
    async fn verify(
        &self,
        path: &ObjPath,
        size: u64,
        local: &impl LocalSegment,
        valid_from: usize,
    ) -> anyhow::Result<bool> {
        let got = match self.store.get(path).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(e).with_context(|| format!("reading {path}")),
        };
        let mut same = got.meta.size == size;
        // `block` holds `local`'s bytes from `block_at`; `off` is the stream's position.
        let (mut block, mut block_at, mut off) = (Vec::new(), 0, 0);
        let mut chunks = got.into_stream();
        while same && let Some(chunk) = chunks.next().await {
            let chunk = chunk.with_context(|| format!("reading {path}"))?;
            // object_store's file store yields empty chunks without end for a file cut short
            // after it was opened: the whole read below sees its size.
            same = !chunk.is_empty();
            let mut rest = &chunk[..];
            while same && !rest.is_empty() {
                if off >= size {
                    same = false;
                    break;
                }
                if off >= block_at + block.len() as u64 {
                    let mut buf = std::mem::take(&mut block);
                    buf.resize(VERIFY_BLOCK.min(size - off) as usize, 0);
                    block = local.read_at(off, buf).await?;
                    block_at = off;
                }
                let at = (off - block_at) as usize;
                let take = rest.len().min(block.len() - at);
                let skip = ((valid_from as u64).clamp(off, off + take as u64) - off) as usize;
                same = rest[skip..take] == block[at + skip..at + take];
                rest = &rest[take..];
                off += take as u64;
            }
        }
        if same && off == size {
            return Ok(true);
        }
        drop(chunks);
        let whole = local.read_whole(size).await?;
        match self.read_object(path).await? {
            Some(stored) => verify_stored(path, &stored, &whole, valid_from).map(|()| true),
            None => Ok(false),
        }
    }

    /// Deletes `ttid`'s partial objects whose WAL ends below `below`; returns how many.
    pub async fn remove_partials_below(
        &self,
        ttid: &TenantTimelineId,
        seg_size: u64,
        below: Lsn,
    ) -> anyhow::Result<usize> {
        let mut n = 0;
        for (_, _, upto, path) in self.list_partials(ttid, seg_size).await? {
            if upto >= below {
                continue;
            }
            match self.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => n += 1,
                Err(e) => return Err(e).with_context(|| format!("deleting {path}")),
            }
        }
        Ok(n)
    }

    /// Stores `data` at `path` unless an object is there already (conditional create):
    /// [`Outcome::Uploaded`] if this call stored it, [`Outcome::Verified`] (still to be
    /// checked by the caller) if it was there.
    async fn create_once(&self, path: &ObjPath, data: &Bytes) -> anyhow::Result<Outcome> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        match self
            .store
            .put_opts(path, PutPayload::from(data.clone()), opts)
            .await
        {
            Ok(_) => Ok(Outcome::Uploaded),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(Outcome::Verified),
            Err(e) => Err(e).with_context(|| format!("storing {path}")),
        }
    }

    /// Every object stored under `ttid`'s prefix: its path and size.
    async fn timeline_objects(
        &self,
        ttid: &TenantTimelineId,
    ) -> anyhow::Result<Vec<object_store::ObjectMeta>> {
        let prefix = ObjPath::from(self.timeline_key(ttid));
        let mut out = Vec::new();
        let mut list = self.store.list(Some(&prefix));
        while let Some(meta) = list.next().await {
            out.push(meta.with_context(|| format!("listing {}", self.timeline_location(ttid)))?);
        }
        Ok(out)
    }

    /// With `file://`: fsyncs the object's file and every directory from it up to the root.
    async fn sync_local(&self, path: &ObjPath) -> anyhow::Result<()> {
        let Some(root) = self.local_root.clone() else {
            return Ok(());
        };
        let file = root.join(path.as_ref());
        crate::blocking::spawn(move || -> anyhow::Result<()> {
            std::fs::File::open(&file)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("fsync {}", file.display()))?;
            match file.parent() {
                Some(dir) => sync_dirs_up_to(&root, dir),
                None => Ok(()),
            }
        })
        .await
        .context("fsync task")?
    }
}

/// fsyncs directory `dir` and every one above it up to `root` (a `file://` store's).
fn sync_dirs_up_to(root: &std::path::Path, dir: &std::path::Path) -> anyhow::Result<()> {
    let mut d = Some(dir);
    while let Some(p) = d {
        std::fs::File::open(p)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("fsync {}", p.display()))?;
        if p == root {
            break;
        }
        d = p.parent();
    }
    Ok(())
}

fn budget(bytes: u64) -> Arc<Semaphore> {
    let kib = (bytes / 1024).clamp(1, u64::from(u32::MAX >> 4)) as usize;
    Arc::new(Semaphore::new(kib))
}

/// Bytes of the node's remote read budget held by one reader's buffer (released on drop).
pub struct BudgetPermit {
    _permit: tokio::sync::OwnedSemaphorePermit,
    bytes: u64,
}

impl BudgetPermit {
    fn new(permit: tokio::sync::OwnedSemaphorePermit, bytes: u64) -> BudgetPermit {
        metrics::REMOTE_READ_BUFFERED.add(bytes as i64);
        BudgetPermit {
            _permit: permit,
            bytes,
        }
    }
}

impl Drop for BudgetPermit {
    fn drop(&mut self) {
        metrics::REMOTE_READ_BUFFERED.sub(self.bytes as i64);
    }
}

/// Checks a stored object against the local segment image.
fn verify_stored(
    path: &ObjPath,
    stored: &[u8],
    local: &[u8],
    valid_from: usize,
) -> anyhow::Result<()> {
    if stored.len() != local.len() {
        bail!(
            "{path} is stored with {} bytes, the local segment has {}: not overwritten",
            stored.len(),
            local.len()
        );
    }
    // Compared byte for byte (memcmp: several times faster than checksumming both copies,
    // which every verifying node of every segment did); the checksums only name a difference.
    if stored[valid_from..] != local[valid_from..] {
        let (a, b) = (
            crc32c::crc32c(&stored[valid_from..]),
            crc32c::crc32c(&local[valid_from..]),
        );
        bail!(
            "{path} differs from the local segment (CRC-32C {a:#010x} stored, {b:#010x} here, \
             from byte {valid_from}): not overwritten"
        );
    }
    Ok(())
}

/// The object name of a partial segment: segment `segno`'s WAL of `term` below `upto`.
pub fn partial_name(segno: u64, seg_size: u64, term: u64, upto: Lsn) -> String {
    format!(
        "{}_{term:016X}_{:016X}.partial",
        xlog_file_name(1, segno, seg_size),
        upto.0
    )
}

/// `(segment, term, end LSN)` of a [`partial_name`]; `None` for any other name (complete
/// segments included) and for an end outside its segment.
pub fn parse_partial_name(name: &str, seg_size: u64) -> Option<(u64, u64, Lsn)> {
    let rest = name.strip_suffix(".partial")?;
    let mut parts = rest.split('_');
    let (seg, term, upto) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || term.len() != 16 || upto.len() != 16 {
        return None;
    }
    let (segno, false) = parse_xlog_file_name(seg, seg_size)? else {
        return None;
    };
    let term = u64::from_str_radix(term, 16).ok()?;
    let upto = Lsn(u64::from_str_radix(upto, 16).ok()?);
    (upto.segment_number(seg_size) == segno && upto.segment_offset(seg_size) != 0)
        .then_some((segno, term, upto))
}

/// Where timeline `ttid`'s segments are in the store at `url` (its status's `remote_location`).
pub fn timeline_location(url: &str, ttid: &TenantTimelineId) -> String {
    format!("{url}/{}/{}", ttid.tenant_id, ttid.timeline_id)
}
