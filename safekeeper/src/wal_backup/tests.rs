//! Backup, verification, removal and serving from the backup, with real files: a timeline in
//! a temporary data directory and a `file://` store in another.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use pg_wal::generator::WalGenerator;
use sk_core::protocol::ProposerAcceptorMessage;
use sk_core::types::{NodeId, TenantTimelineId};

use super::*;
use crate::registry::GlobalTimelines;
use crate::test_util::{append, elected_timeline, greeting, run};

const SEG: u64 = 1 << 20;

fn store(dir: &Path) -> RemoteStorage {
    RemoteStorage::from_url(&format!("file://{}", dir.display())).unwrap()
}

fn ttid() -> TenantTimelineId {
    greeting(7, SEG).ttid()
}

fn object_file(root: &Path, segno: u64) -> std::path::PathBuf {
    let t = ttid();
    root.join(t.tenant_id.to_string())
        .join(t.timeline_id.to_string())
        .join(xlog_file_name(1, segno, SEG))
}

#[tokio::test]
async fn a_segment_is_stored_once_and_a_second_node_verifies_instead_of_overwriting() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (store(dir.path()), store(dir.path()));
    let data = Bytes::from(vec![7u8; SEG as usize]);
    let out = a.backup_segment(&ttid(), 3, SEG, &data, 0, false).await;
    assert_eq!(out.unwrap(), Outcome::Uploaded);
    assert_eq!(std::fs::read(object_file(dir.path(), 3)).unwrap(), data);
    // The other node finds it stored and verifies it.
    let out = b.backup_segment(&ttid(), 3, SEG, &data, 0, false).await;
    assert_eq!(out.unwrap(), Outcome::Verified);
    // A different local copy is an error and the stored object is left as it was.
    let mut other = vec![7u8; SEG as usize];
    other[SEG as usize - 1] = 8;
    let err = b
        .backup_segment(&ttid(), 3, SEG, &Bytes::from(other.clone()), 0, false)
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("differs"), "{err:#}");
    assert_eq!(std::fs::read(object_file(dir.path(), 3)).unwrap(), data);
    // Bytes before a node's WAL start are not compared; a different size always fails.
    let mut head_differs = data.to_vec();
    head_differs[0] = 1;
    let out = b
        .backup_segment(&ttid(), 3, SEG, &Bytes::from(head_differs), 1, true)
        .await;
    assert_eq!(out.unwrap(), Outcome::Verified);
    let short = Bytes::from(vec![7u8; SEG as usize / 2]);
    assert!(
        b.backup_segment(&ttid(), 3, SEG, &short, 0, true)
            .await
            .is_err()
    );
    assert_eq!(a.list_segments(&ttid(), SEG).await.unwrap(), vec![(3, SEG)]);
    assert_eq!(
        a.read_segment(&ttid(), 3, SEG).await.unwrap().unwrap(),
        data
    );
    assert!(a.read_segment(&ttid(), 4, SEG).await.unwrap().is_none());
}

/// Verification compares the stored object as it streams in, against the local copy read a
/// block at a time: it skips exactly the bytes before the node's WAL start (`valid_from`)
/// wherever that falls among the stream's chunks and the local blocks, and a difference
/// anywhere from it on is an error naming both copies' checksums. The file store streams 8 KiB
/// chunks (within a block); the in-memory one a single chunk over two blocks.
#[tokio::test]
async fn verification_compares_exactly_the_bytes_from_the_nodes_wal_start() {
    let dir = tempfile::tempdir().unwrap();
    let files = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap();
    let block = crate::remote_storage::VERIFY_BLOCK;
    verifies_from_wal_start(&store(dir.path()), &files, 2 * block).await;
    let memory = Arc::new(object_store::memory::InMemory::new());
    let remote = RemoteStorage::with_store(memory.clone(), "memory://");
    verifies_from_wal_start(&remote, &*memory, 2 * block).await;
}

/// The checks above on `store`, whose objects `raw` writes directly, with segments of `seg`.
async fn verifies_from_wal_start(
    store: &RemoteStorage,
    raw: &dyn object_store::ObjectStore,
    seg: u64,
) {
    let t = ttid();
    let data: Vec<u8> = (0..seg).map(|i| (i * 7 % 251) as u8).collect();
    let copy = Bytes::from(data.clone());
    let out = store.backup_segment(&t, 3, seg, &copy, 0, false).await;
    assert_eq!(out.unwrap(), Outcome::Uploaded);
    let block = crate::remote_storage::VERIFY_BLOCK as usize;
    for from in [
        1,
        4095,
        4096,
        8193,
        65537,
        block - 1,
        block,
        block + 1,
        seg as usize - 1,
    ] {
        if from >= seg as usize {
            continue;
        }
        let mut before = data.clone();
        before[from - 1] ^= 0xff;
        let before = Bytes::from(before);
        let out = store.backup_segment(&t, 3, seg, &before, from, true).await;
        assert_eq!(out.unwrap(), Outcome::Verified, "from {from}");
        let mut at = data.clone();
        at[from] ^= 0xff;
        let at = Bytes::from(at);
        let out = store.backup_segment(&t, 3, seg, &at, from, true).await;
        let err = format!("{:#}", out.unwrap_err());
        assert!(
            err.contains("differs") && err.contains("CRC-32C"),
            "from {from}: {err}"
        );
    }
    // A stored object of another size.
    let path = object_store::path::Path::from(format!(
        "{}/{}/{}",
        t.tenant_id,
        t.timeline_id,
        xlog_file_name(1, 3, seg)
    ));
    let short = Bytes::from(data[1..].to_vec());
    raw.put(&path, short.into()).await.unwrap();
    let out = store.backup_segment(&t, 3, seg, &copy, 0, true).await;
    let err = format!("{:#}", out.unwrap_err());
    assert!(err.contains("bytes, the local segment has"), "{err}");
}

/// A real `file://` store that counts the writes (puts, conditional creates included) sent
/// through it, and the reads (GETs; a HEAD is not one).
#[derive(Debug)]
struct CountedPuts {
    inner: object_store::local::LocalFileSystem,
    puts: std::sync::atomic::AtomicUsize,
    gets: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Display for CountedPuts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CountedPuts({})", self.inner)
    }
}

#[async_trait::async_trait]
impl object_store::ObjectStore for CountedPuts {
    async fn put_opts(
        &self,
        location: &object_store::path::Path,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.puts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &object_store::path::Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.puts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &object_store::path::Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        if !options.head {
            self.gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.inner.get_opts(location, options).await
    }

    async fn delete(&self, location: &object_store::path::Path) -> object_store::Result<()> {
        self.inner.delete(location).await
    }

    fn list(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
    ) -> object_store::Result<()> {
        self.puts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.copy(from, to).await
    }

    async fn copy_if_not_exists(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
    ) -> object_store::Result<()> {
        self.puts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.copy_if_not_exists(from, to).await
    }
}

/// A node that finds a segment or partial object stored sends none of it to the store: a
/// conditional create of a stored object would send (and the file store write) the whole body
/// before failing, once per segment on every node but the first.
#[tokio::test]
async fn a_node_that_finds_the_object_stored_sends_none_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let counted = Arc::new(CountedPuts {
        inner: object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap(),
        puts: Default::default(),
        gets: Default::default(),
    });
    let puts = || counted.puts.load(std::sync::atomic::Ordering::Relaxed);
    let gets = || counted.gets.load(std::sync::atomic::Ordering::Relaxed);
    let url = format!("file://{}", dir.path().display());
    let (a, b) = (
        RemoteStorage::with_store(counted.clone(), &url),
        RemoteStorage::with_store(counted.clone(), &url),
    );
    let data = Bytes::from(vec![7u8; SEG as usize]);
    let out = a.backup_segment(&ttid(), 3, SEG, &data, 0, false).await;
    assert_eq!((out.unwrap(), puts()), (Outcome::Uploaded, 1));
    let out = b.backup_segment(&ttid(), 3, SEG, &data, 0, false).await;
    assert_eq!((out.unwrap(), puts()), (Outcome::Verified, 1));
    // One read of the object: it streamed in and matched (a difference reads it again whole).
    assert_eq!(gets(), 1);
    // Still compared: a different copy is an error, and nothing is written either.
    let mut other = data.to_vec();
    other[5] = 8;
    let err = b
        .backup_segment(&ttid(), 3, SEG, &Bytes::from(other), 0, false)
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("differs"), "{err:#}");
    assert_eq!(std::fs::read(object_file(dir.path(), 3)).unwrap(), data);
    assert_eq!((puts(), gets()), (1, 3));

    let upto = Lsn(4 * SEG + 4096);
    let part = data.slice(..4096);
    let out = a
        .backup_partial(&ttid(), SEG, 2, upto, part.clone(), 0)
        .await;
    assert_eq!((out.unwrap(), puts()), (Outcome::Uploaded, 2));
    let out = b.backup_partial(&ttid(), SEG, 2, upto, part, 0).await;
    assert_eq!((out.unwrap(), puts()), (Outcome::Verified, 2));
    let out = b
        .backup_partial(&ttid(), SEG, 2, upto, Bytes::from(vec![1u8; 4096]), 0)
        .await;
    assert!(out.is_err());
    assert_eq!(puts(), 2);
}

#[test]
fn bad_urls_are_refused_naming_the_url() {
    for url in ["http://x", "file://relative/path", "s3://"] {
        let err = RemoteStorage::from_url(url).err().expect(url).to_string();
        assert!(err.contains(url.trim_end_matches('/')), "{err}");
    }
}

/// A node with one timeline holding `segs` complete committed segments (and a bit more).
fn node_with_wal(datadir: &Path, segs: u64) -> (GlobalTimelines, Arc<Timeline>, Lsn) {
    let timelines = GlobalTimelines::load(datadir, NodeId(1), true).unwrap();
    let start = Lsn(SEG);
    let tl = elected_timeline(&timelines, 7, SEG, start);
    let mut walgen = WalGenerator::new(42, SEG, start).unwrap();
    let mut wal = Vec::new();
    walgen.fill(&mut wal, (segs * SEG + SEG / 2) as usize, &[3; 1000]);
    let end = walgen.lsn();
    append(&tl, 1, start, &wal, end, true);
    // Commit everything, and tell the node the peers need nothing below the end.
    append(&tl, 1, end, &[], end, true);
    (timelines, tl, end)
}

/// Removes what the persisted state allows (a blocking section: the tests run on tokio).
fn remove(tl: &Timeline, keep: u64) -> usize {
    crate::blocking::section(|| tl.remove_old_wal(keep)).unwrap()
}

/// Saves the control file (a blocking section).
fn persist(tl: &Timeline) {
    crate::blocking::section(|| tl.maybe_persist(true)).unwrap();
}

fn local_segments(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            parse_xlog_file_name(&name, SEG).map(|(n, _)| n)
        })
        .collect();
    v.sort_unstable();
    v
}

/// A timeline whose commit LSN is still in its first segment has nothing to back up, and its
/// backed-up prefix starts at that segment: no lag is reported for the LSNs below it.
#[tokio::test]
async fn backup_lsn_starts_at_the_first_segment_of_the_wal() {
    let data = tempfile::tempdir().unwrap();
    let remote = tempfile::tempdir().unwrap();
    let timelines = GlobalTimelines::load(data.path(), NodeId(1), true).unwrap();
    let start = Lsn(5 * SEG);
    let tl = elected_timeline(&timelines, 7, SEG, start);
    let mut walgen = WalGenerator::new(42, SEG, start).unwrap();
    let mut wal = Vec::new();
    walgen.fill(&mut wal, (SEG / 2) as usize, &[3; 1000]);
    append(&tl, 1, start, &wal, walgen.lsn(), true);
    assert_eq!(tl.backup_lsn(), Lsn::INVALID);
    let backup = Backup::new(store(remote.path()), 1);
    let lsn = backup
        .backup_pass(&tl, None, &CancellationToken::new())
        .await;
    assert_eq!(lsn, start, "nothing below the WAL's first segment is owed");
    assert_eq!(tl.status().backup_lsn, start);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_committed_segments_are_backed_up_byte_identical_and_only_then_removed() {
    let data = tempfile::tempdir().unwrap();
    let remote = tempfile::tempdir().unwrap();
    let (_timelines, tl, end) = node_with_wal(data.path(), 6);
    let last_complete = end.segment_number(SEG); // exclusive
    assert_eq!(
        local_segments(&tl.dir),
        (1..=last_complete).collect::<Vec<_>>()
    );

    // No remote storage: nothing is removed, whatever the other inputs.
    assert_eq!(remove(&tl, 0), 0);
    assert_eq!(local_segments(&tl.dir).len() as u64, last_complete);

    let backup = Backup::new(store(remote.path()), 3);
    tl.set_remote(backup.storage.clone());
    // Remote storage on but nothing backed up: still nothing removed.
    assert_eq!(remove(&tl, 0), 0);
    let cancel = CancellationToken::new();
    let lsn = backup.backup_pass(&tl, None, &cancel).await;
    assert_eq!(
        lsn,
        Lsn(last_complete * SEG),
        "every complete segment, not the partial one"
    );
    for segno in 1..last_complete {
        let local = std::fs::read(segment_path(&tl.dir, segno, SEG, false)).unwrap();
        assert_eq!(
            std::fs::read(object_file(remote.path(), segno)).unwrap(),
            local
        );
    }
    assert!(!object_file(remote.path(), last_complete).exists());

    // The peers' horizon is unknown (the proposer sent no truncate_lsn): nothing goes.
    assert_eq!(remove(&tl, 0), 0);
    set_peer_horizon(&tl, end);
    // Removal goes by the control file (issue 26): nothing until it holds the new LSNs.
    assert_eq!(remove(&tl, 0), 0, "the in-memory horizon is not enough");
    persist(&tl);
    // A reader holding segment 2 stops removal there.
    let hold = tl.hold_wal(Lsn(2 * SEG + 100)).unwrap();
    assert_eq!(remove(&tl, 0), 1);
    assert_eq!(local_segments(&tl.dir)[0], 2);
    drop(hold);
    // --wal-keep-size keeps two segments below the flush LSN.
    remove(&tl, 2 * SEG);
    let kept = local_segments(&tl.dir);
    assert_eq!(
        kept[0],
        Lsn(end.0 - 2 * SEG).segment_number(SEG),
        "{kept:?}"
    );
    remove(&tl, 0);
    assert_eq!(
        local_segments(&tl.dir),
        vec![last_complete],
        "all backed up: only the partial"
    );
    assert!(tl.hold_wal(Lsn(SEG)).is_none());

    // Removed WAL is served from the backup, byte-identical.
    let mut reader = RemoteReader::default();
    let mut from_remote = Vec::new();
    let mut pos = Lsn(SEG + 40);
    while pos < Lsn(last_complete * SEG) {
        pos = reader
            .read(&tl, pos, Lsn(last_complete * SEG), &mut from_remote)
            .await
            .unwrap()
            .unwrap();
    }
    let mut expected = Vec::new();
    for segno in 1..last_complete {
        expected.extend(std::fs::read(object_file(remote.path(), segno)).unwrap());
    }
    assert_eq!(from_remote, expected[40..]);
    // A segment the store does not hold is not served.
    std::fs::remove_file(object_file(remote.path(), 1)).unwrap();
    assert!(
        RemoteReader::default()
            .read(&tl, Lsn(SEG), Lsn(2 * SEG), &mut Vec::new())
            .await
            .unwrap()
            .is_none()
    );
    assert!(!RemoteReader::probe(&tl, Lsn(SEG)).await.unwrap());
    assert!(RemoteReader::probe(&tl, Lsn(2 * SEG)).await.unwrap());
}

/// Issue 26, defect 6: remote reads are ranges of at most 1 MiB, each counted against the
/// node's budget before it is asked for: with a 2 MiB budget a third reader waits until one of
/// the first two moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_reads_are_bounded_ranges_counted_against_the_budget() {
    let data = tempfile::tempdir().unwrap();
    let remote = tempfile::tempdir().unwrap();
    let (_timelines, tl, end) = node_with_wal(data.path(), 4);
    let storage = store(remote.path()).with_reader_limits(2 * REMOTE_READ_RANGE, 0);
    let backup = Backup::new(storage, 2);
    tl.set_remote(backup.storage.clone());
    backup
        .backup_pass(&tl, None, &CancellationToken::new())
        .await;
    let _ = end;
    let mut a = RemoteReader::default();
    let mut b = RemoteReader::default();
    let mut out = Vec::new();
    let got = a.read(&tl, Lsn(SEG), Lsn(3 * SEG), &mut out).await.unwrap();
    assert_eq!(
        got,
        Some(Lsn(SEG + REMOTE_READ_RANGE)),
        "one range, not the segment"
    );
    assert_eq!(out.len() as u64, REMOTE_READ_RANGE);
    b.read(&tl, Lsn(2 * SEG), Lsn(3 * SEG), &mut out)
        .await
        .unwrap();
    let third = {
        let tl = tl.clone();
        tokio::spawn(async move {
            let mut c = RemoteReader::default();
            let mut out = Vec::new();
            c.read(&tl, Lsn(SEG), Lsn(2 * SEG), &mut out).await.unwrap();
            out.len()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !third.is_finished(),
        "the budget is spent: the third reader waits"
    );
    a.release();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), third)
            .await
            .unwrap()
            .unwrap() as u64,
        REMOTE_READ_RANGE
    );
}

fn set_peer_horizon(tl: &Timeline, lsn: Lsn) {
    use sk_core::protocol::{AppendRequest, AppendRequestHeader};
    use sk_core::types::{Generation, Term};
    let pos = tl.positions();
    run(
        tl,
        ProposerAcceptorMessage::AppendRequest(AppendRequest {
            h: AppendRequestHeader {
                generation: Generation(0),
                term: Term(1),
                begin_lsn: pos.flush_lsn,
                end_lsn: pos.flush_lsn,
                commit_lsn: pos.commit_lsn,
                truncate_lsn: lsn,
            },
            wal_data: Bytes::new(),
        }),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_lsn_survives_a_restart_and_a_node_with_removed_wal_starts_and_resumes() {
    let data = tempfile::tempdir().unwrap();
    let remote = tempfile::tempdir().unwrap();
    let (timelines, tl, end) = node_with_wal(data.path(), 4);
    let backup = Backup::new(store(remote.path()), 2);
    tl.set_remote(backup.storage.clone());
    let cancel = CancellationToken::new();
    let backed = backup.backup_pass(&tl, None, &cancel).await;
    set_peer_horizon(&tl, end);
    // The horizon is the persisted one: a kill -9 right after the unlink restarts from a
    // control file whose commit and backup LSNs still find their WAL here (issue 26).
    assert_eq!(
        remove(&tl, 0),
        0,
        "nothing goes before the control file has the horizon"
    );
    persist(&tl);
    assert!(remove(&tl, 0) > 0);
    let first_kept = local_segments(&tl.dir)[0];
    drop((tl, timelines));

    // Restart: the control file has backup_lsn; the committed WAL left is verified from the
    // first local segment; the removed segments stay removed.
    let timelines = GlobalTimelines::load(data.path(), NodeId(1), true).unwrap();
    let tl = timelines.get(&ttid()).unwrap();
    assert_eq!(tl.backup_lsn(), backed);
    assert_eq!(tl.oldest_available_lsn(), Lsn(first_kept * SEG));
    assert!(tl.hold_wal(Lsn(SEG)).is_none());
    // Resume from the listing: a node whose control file lost backup_lsn verifies the stored
    // segments instead of uploading them again.
    let listed: BTreeSet<u64> = backup
        .storage
        .list_segments(&ttid(), SEG)
        .await
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(listed, (1..backed.segment_number(SEG)).collect());
    let before = metrics::BACKUP_SEGMENTS
        .with_label_values(&["uploaded"])
        .get();
    let again = backup.backup_pass(&tl, Some(&listed), &cancel).await;
    assert_eq!(again, backed);
    assert_eq!(
        metrics::BACKUP_SEGMENTS
            .with_label_values(&["uploaded"])
            .get(),
        before,
        "nothing uploaded twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_store_backs_up_nothing_and_the_backlog_goes_when_it_returns() {
    let data = tempfile::tempdir().unwrap();
    let remote = tempfile::tempdir().unwrap();
    let (_timelines, tl, end) = node_with_wal(data.path(), 3);
    // A file where the timeline's directory must go: every upload fails.
    let t = ttid();
    let tenant_dir = remote.path().join(t.tenant_id.to_string());
    std::fs::write(&tenant_dir, b"in the way").unwrap();
    let backup = Backup::new(store(remote.path()), 2);
    tl.set_remote(backup.storage.clone());
    set_peer_horizon(&tl, end);
    let cancel = CancellationToken::new();
    let errors = metrics::BACKUP_ERRORS.get();
    let pass = {
        let (backup, tl, cancel) = (backup.clone(), tl.clone(), cancel.clone());
        tokio::spawn(async move { backup.backup_pass(&tl, None, &cancel).await })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        metrics::BACKUP_ERRORS.get() > errors,
        "failures are counted"
    );
    assert_eq!(
        tl.backup_lsn(),
        Lsn(SEG),
        "nothing backed up past the WAL's first segment start"
    );
    assert_eq!(remove(&tl, 0), 0, "nothing unbacked is removed");
    std::fs::remove_file(&tenant_dir).unwrap();
    let lsn = tokio::time::timeout(Duration::from_secs(30), pass)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lsn, Lsn(end.segment_number(SEG) * SEG));
    persist(&tl);
    assert!(remove(&tl, 0) > 0);
}
