//! The timeline registry: maps `(tenant, timeline)` to that timeline's [`SafeKeeper`], creating
//! one on a greeting when the connection allows it.
//!
//! Sans-IO and single-threaded: storage for a new timeline comes from a [`TimelineFactory`]
//! (files in the daemon, in-memory fakes in tests), and the caller supplies the creation time.
//! The tokio layer wraps the registry (or each timeline) in locks; this module knows nothing of
//! that.

use std::collections::HashMap;

use sk_core::protocol::{AcceptorProposerMessage, ProposerAcceptorMessage, ProposerGreeting};
use sk_core::safekeeper::{SafeKeeper, SafeKeeperError};
use sk_core::state::{Configuration, ServerInfo, TimelinePersistentState};
use sk_core::storage::{self, ControlStore, WalStore};
use sk_core::types::{NodeId, TenantTimelineId};

/// Makes the storage of a new timeline. `create` must make `state` durable before it returns
/// (neon builds the directory under a temporary name and renames it in).
pub trait TimelineFactory {
    type Ctrl: ControlStore;
    type Wal: WalStore;

    fn create(
        &mut self,
        state: &TimelinePersistentState,
    ) -> Result<(Self::Ctrl, Self::Wal), storage::Error>;
}

/// Errors of the registry.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("timeline {0} does not exist and creation is not allowed")]
    NoTimeline(TenantTimelineId),
    #[error("connection is for timeline {connection}, greeting is for {greeting}")]
    GreetingForOtherTimeline {
        connection: TenantTimelineId,
        greeting: TenantTimelineId,
    },
    #[error("timeline {0} already exists")]
    AlreadyExists(TenantTimelineId),
    #[error("creating timeline {ttid}: {source}")]
    Create {
        ttid: TenantTimelineId,
        #[source]
        source: storage::Error,
    },
    #[error(transparent)]
    SafeKeeper(#[from] SafeKeeperError),
}

/// All timelines of one safekeeper node.
pub struct Registry<F: TimelineFactory> {
    node_id: NodeId,
    factory: F,
    timelines: HashMap<TenantTimelineId, SafeKeeper<F::Ctrl, F::Wal>>,
}

impl<F: TimelineFactory> Registry<F> {
    pub fn new(node_id: NodeId, factory: F) -> Registry<F> {
        Registry {
            node_id,
            factory,
            timelines: HashMap::new(),
        }
    }

    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// Adds a timeline loaded at start-up.
    pub fn insert(&mut self, sk: SafeKeeper<F::Ctrl, F::Wal>) -> Result<(), RegistryError> {
        let ttid = sk.ttid();
        if self.timelines.contains_key(&ttid) {
            return Err(RegistryError::AlreadyExists(ttid));
        }
        self.timelines.insert(ttid, sk);
        Ok(())
    }

    pub fn get(&self, ttid: &TenantTimelineId) -> Option<&SafeKeeper<F::Ctrl, F::Wal>> {
        self.timelines.get(ttid)
    }

    pub fn get_mut(&mut self, ttid: &TenantTimelineId) -> Option<&mut SafeKeeper<F::Ctrl, F::Wal>> {
        self.timelines.get_mut(ttid)
    }

    pub fn remove(&mut self, ttid: &TenantTimelineId) -> Option<SafeKeeper<F::Ctrl, F::Wal>> {
        self.timelines.remove(ttid)
    }

    pub fn len(&self) -> usize {
        self.timelines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.timelines.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&TenantTimelineId, &SafeKeeper<F::Ctrl, F::Wal>)> {
        self.timelines.iter()
    }

    pub fn iter_mut(
        &mut self,
    ) -> impl Iterator<Item = (&TenantTimelineId, &mut SafeKeeper<F::Ctrl, F::Wal>)> {
        self.timelines.iter_mut()
    }

    /// The timeline a greeting is for; if absent and `allow_creation`, creates it empty (no
    /// membership, LSNs 0, server info from the greeting). The greeting itself is not processed.
    pub fn get_or_create(
        &mut self,
        greeting: &ProposerGreeting,
        allow_creation: bool,
        creation_ts: u64,
    ) -> Result<&mut SafeKeeper<F::Ctrl, F::Wal>, RegistryError> {
        let ttid = greeting.ttid();
        if !self.timelines.contains_key(&ttid) {
            if !allow_creation {
                return Err(RegistryError::NoTimeline(ttid));
            }
            let state = TimelinePersistentState::new(
                ttid.tenant_id,
                ttid.timeline_id,
                Configuration::default(),
                ServerInfo {
                    pg_version: greeting.pg_version,
                    system_id: greeting.system_id,
                    wal_seg_size: greeting.wal_seg_size,
                },
                creation_ts,
            );
            let (ctrl, wal) = self
                .factory
                .create(&state)
                .map_err(|source| RegistryError::Create { ttid, source })?;
            let sk = SafeKeeper::new(self.node_id, ctrl, wal)?;
            self.timelines.insert(ttid, sk);
        }
        Ok(self
            .timelines
            .get_mut(&ttid)
            .expect("present or inserted just above"))
    }

    /// Routes a message to its timeline. A greeting may create the timeline (if
    /// `allow_creation`); any other message needs an existing timeline.
    pub fn process_msg(
        &mut self,
        ttid: &TenantTimelineId,
        msg: &ProposerAcceptorMessage,
        allow_creation: bool,
        creation_ts: u64,
    ) -> Result<Option<AcceptorProposerMessage>, RegistryError> {
        let sk = match msg {
            ProposerAcceptorMessage::Greeting(g) => {
                if g.ttid() != *ttid {
                    return Err(RegistryError::GreetingForOtherTimeline {
                        connection: *ttid,
                        greeting: g.ttid(),
                    });
                }
                self.get_or_create(g, allow_creation, creation_ts)?
            }
            _ => self
                .timelines
                .get_mut(ttid)
                .ok_or(RegistryError::NoTimeline(*ttid))?,
        };
        Ok(sk.process_msg(msg)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sk_core::storage::mem::{MemControlStore, MemWalStore};
    use sk_core::types::{TenantId, TimelineId};

    struct MemFactory;

    impl TimelineFactory for MemFactory {
        type Ctrl = MemControlStore;
        type Wal = MemWalStore;

        fn create(
            &mut self,
            state: &TimelinePersistentState,
        ) -> Result<(MemControlStore, MemWalStore), storage::Error> {
            Ok((MemControlStore::new(state.clone()), MemWalStore::new()))
        }
    }

    fn greeting(tl: u8) -> ProposerGreeting {
        ProposerGreeting {
            tenant_id: TenantId([1; 16]),
            timeline_id: TimelineId([tl; 16]),
            mconf: Configuration::default(),
            pg_version: 150000,
            system_id: 42,
            wal_seg_size: 16 << 20,
        }
    }

    #[test]
    fn greeting_creates_a_timeline_only_when_allowed() {
        let mut reg = Registry::new(NodeId(1), MemFactory);
        let g = greeting(1);
        let msg = ProposerAcceptorMessage::Greeting(g.clone());
        assert!(matches!(
            reg.process_msg(&g.ttid(), &msg, false, 0),
            Err(RegistryError::NoTimeline(_))
        ));
        assert!(reg.is_empty());
        let reply = reg.process_msg(&g.ttid(), &msg, true, 7).unwrap();
        assert!(matches!(reply, Some(AcceptorProposerMessage::Greeting(_))));
        let sk = reg.get(&g.ttid()).unwrap();
        assert_eq!(sk.state().server.system_id, 42);
        assert_eq!(sk.state().creation_ts, 7);
        // Now it exists: no creation needed.
        assert!(reg.process_msg(&g.ttid(), &msg, false, 0).is_ok());
    }

    #[test]
    fn timelines_are_independent() {
        let mut reg = Registry::new(NodeId(1), MemFactory);
        for tl in [1, 2] {
            let g = greeting(tl);
            reg.process_msg(
                &g.ttid(),
                &ProposerAcceptorMessage::Greeting(g.clone()),
                true,
                0,
            )
            .unwrap();
        }
        let vote = ProposerAcceptorMessage::VoteRequest(sk_core::protocol::VoteRequest {
            generation: sk_core::types::Generation(0),
            term: sk_core::types::Term(3),
        });
        reg.process_msg(&greeting(1).ttid(), &vote, false, 0)
            .unwrap();
        assert_eq!(reg.get(&greeting(1).ttid()).unwrap().term().0, 3);
        assert_eq!(reg.get(&greeting(2).ttid()).unwrap().term().0, 0);
        assert_eq!(reg.len(), 2);
    }

    #[test]
    fn non_greeting_to_unknown_timeline_is_an_error() {
        let mut reg = Registry::new(NodeId(1), MemFactory);
        let r = reg.process_msg(
            &greeting(9).ttid(),
            &ProposerAcceptorMessage::FlushWAL,
            true,
            0,
        );
        assert!(matches!(r, Err(RegistryError::NoTimeline(_))));
    }
}
