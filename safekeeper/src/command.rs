//! Parsing of the simple-query commands a safekeeper accepts on a replication connection
//! ([`parse_command`]), and of the startup `options` parameter that names the timeline
//! ([`parse_options`]).
//!
//! Keywords are case-insensitive; unquoted identifiers are lower-cased and `"quoted"` ones kept
//! as written (as PostgreSQL's replication grammar does); a trailing `;` and whitespace are
//! tolerated. Anything we do not serve is a [`CommandError`] naming the command.
//!
//! Pure code. Executing commands (and checking values such as `proto_version`) is left to the
//! connection handler.

use sk_core::types::{IdParseError, Lsn, TenantId, Term, TimelineId};

/// A parsed command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationCommand {
    /// `START_WAL_PUSH [(proto_version 'N', allow_timeline_creation 'bool')]`.
    /// Defaults as neon: protocol 2, creation allowed. The value is not range-checked here.
    StartWalPush {
        /// The protocol version the proposer speaks (we serve 3).
        proto_version: u32,
        /// Whether the greeting may create the timeline.
        allow_timeline_creation: bool,
    },
    /// `IDENTIFY_SYSTEM`: system id, timeline, flush position, database.
    IdentifySystem,
    /// neon's `TIMELINE_STATUS`: flush and commit LSN of the timeline.
    TimelineStatus,
    /// `SHOW name` (lower-cased unless quoted).
    Show(String),
    /// `READ_REPLICATION_SLOT name`.
    ReadReplicationSlot(String),
    /// `START_REPLICATION [SLOT s] [PHYSICAL] X/X [TIMELINE n] [(term='N')]`.
    StartReplication {
        /// The replication slot named, if any (we keep no slots: it is only reported).
        slot: Option<String>,
        /// Where streaming starts.
        start_lsn: Lsn,
        /// The PostgreSQL timeline asked for (we serve timeline 1).
        timeline: Option<u32>,
        /// neon's `(term='N')`: stream up to flush_lsn while the local term is N.
        term: Option<Term>,
    },
    /// `TIMELINE_HISTORY n`.
    TimelineHistory(u32),
    /// `SET datestyle ...` (psycopg2 sends it); accepted and ignored.
    SetDatestyle,
}

/// Why a query is not a command we serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// A query with no command.
    #[error("empty query")]
    Empty,
    /// Not one of our commands; `command` is its first word as sent.
    #[error("unsupported command {command}")]
    Unsupported {
        /// The first word of the query.
        command: String,
    },
    /// One of our commands, but its arguments do not parse.
    #[error("syntax error in {command}: {reason}")]
    Syntax {
        /// The command.
        command: &'static str,
        /// What does not parse.
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    /// An unquoted word (keyword, identifier, number, LSN), as written.
    Word(String),
    /// `"identifier"`
    Quoted(String),
    /// `'string'`
    Str(String),
    Punct(char),
}

fn tokenize(s: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut it = s.chars().peekable();
    while let Some(&c) = it.peek() {
        if c.is_whitespace() {
            it.next();
        } else if matches!(c, '(' | ')' | ',' | '=' | ';') {
            it.next();
            out.push(Token::Punct(c));
        } else if c == '"' || c == '\'' {
            it.next();
            let mut v = String::new();
            loop {
                match it.next() {
                    None => return Err(format!("unterminated {c}quoted{c} string")),
                    Some(d) if d == c => {
                        // A doubled quote is an escaped quote.
                        if it.peek() == Some(&c) {
                            it.next();
                            v.push(c);
                        } else {
                            break;
                        }
                    }
                    Some(d) => v.push(d),
                }
            }
            out.push(if c == '"' {
                Token::Quoted(v)
            } else {
                Token::Str(v)
            });
        } else {
            let mut w = String::new();
            while let Some(&d) = it.peek() {
                if d.is_whitespace() || matches!(d, '(' | ')' | ',' | '=' | ';' | '"' | '\'') {
                    break;
                }
                w.push(d);
                it.next();
            }
            out.push(Token::Word(w));
        }
    }
    // Trailing semicolons are tolerated; others are not.
    while out.last() == Some(&Token::Punct(';')) {
        out.pop();
    }
    Ok(out)
}

struct Parser {
    toks: std::collections::VecDeque<Token>,
    command: &'static str,
}

impl Parser {
    fn err(&self, reason: impl Into<String>) -> CommandError {
        CommandError::Syntax {
            command: self.command,
            reason: reason.into(),
        }
    }

    fn peek_keyword(&self, kw: &str) -> bool {
        matches!(self.toks.front(), Some(Token::Word(w)) if w.eq_ignore_ascii_case(kw))
    }

    fn eat_keyword(&mut self, kw: &str) -> bool {
        let yes = self.peek_keyword(kw);
        if yes {
            self.toks.pop_front();
        }
        yes
    }

    fn eat_punct(&mut self, p: char) -> bool {
        let yes = self.toks.front() == Some(&Token::Punct(p));
        if yes {
            self.toks.pop_front();
        }
        yes
    }

    /// An identifier: unquoted (lower-cased) or `"quoted"` (as written).
    fn ident(&mut self, what: &str) -> Result<String, CommandError> {
        match self.toks.pop_front() {
            Some(Token::Word(w)) => Ok(w.to_lowercase()),
            Some(Token::Quoted(q)) => Ok(q),
            _ => Err(self.err(format!("expected {what}"))),
        }
    }

    /// An option value: `'string'`, `"identifier"` or a bare word.
    fn value(&mut self, what: &str) -> Result<String, CommandError> {
        match self.toks.pop_front() {
            Some(Token::Word(w) | Token::Quoted(w) | Token::Str(w)) => Ok(w),
            _ => Err(self.err(format!("expected a value for {what}"))),
        }
    }

    fn word(&mut self, what: &str) -> Result<String, CommandError> {
        match self.toks.pop_front() {
            Some(Token::Word(w)) => Ok(w),
            _ => Err(self.err(format!("expected {what}"))),
        }
    }

    fn end(&self) -> Result<(), CommandError> {
        match self.toks.front() {
            None => Ok(()),
            Some(t) => Err(self.err(format!("unexpected {t:?}"))),
        }
    }

    /// `( key ['='] value [, ...] )`, returning lower-cased keys.
    fn options(&mut self) -> Result<Vec<(String, String)>, CommandError> {
        let mut opts = Vec::new();
        if !self.eat_punct('(') {
            return Ok(opts);
        }
        loop {
            let key = self.ident("an option name")?;
            self.eat_punct('=');
            let value = self.value(&key)?;
            opts.push((key, value));
            if self.eat_punct(',') {
                continue;
            }
            if self.eat_punct(')') {
                return Ok(opts);
            }
            return Err(self.err("expected ',' or ')' in the option list"));
        }
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "on" | "yes" | "1" | "t" | "y" => Some(true),
        "false" | "off" | "no" | "0" | "f" | "n" => Some(false),
        _ => None,
    }
}

/// Parses one command of a simple query.
pub fn parse_command(query: &str) -> Result<ReplicationCommand, CommandError> {
    let toks = tokenize(query).map_err(|reason| {
        let first = query.split_whitespace().next().unwrap_or("").to_string();
        if first.is_empty() {
            CommandError::Empty
        } else {
            CommandError::Unsupported { command: first }
        }
        .with_reason(reason)
    })?;
    let mut toks: std::collections::VecDeque<Token> = toks.into();
    let first = match toks.pop_front() {
        None => return Err(CommandError::Empty),
        Some(Token::Word(w)) => w,
        Some(t) => {
            return Err(CommandError::Unsupported {
                command: format!("{t:?}"),
            });
        }
    };
    let upper = first.to_ascii_uppercase();
    let command: &'static str = match upper.as_str() {
        "START_WAL_PUSH" => "START_WAL_PUSH",
        "IDENTIFY_SYSTEM" => "IDENTIFY_SYSTEM",
        "TIMELINE_STATUS" => "TIMELINE_STATUS",
        "SHOW" => "SHOW",
        "READ_REPLICATION_SLOT" => "READ_REPLICATION_SLOT",
        "START_REPLICATION" => "START_REPLICATION",
        "TIMELINE_HISTORY" => "TIMELINE_HISTORY",
        "SET" => "SET",
        _ => return Err(CommandError::Unsupported { command: first }),
    };
    let mut p = Parser { toks, command };
    let cmd = match command {
        "START_WAL_PUSH" => {
            let mut proto_version = 2;
            let mut allow_timeline_creation = true;
            for (k, v) in p.options()? {
                match k.as_str() {
                    "proto_version" => {
                        proto_version = v
                            .parse()
                            .map_err(|_| p.err(format!("invalid proto_version {v:?}")))?
                    }
                    "allow_timeline_creation" => {
                        allow_timeline_creation = parse_bool(&v).ok_or_else(|| {
                            p.err(format!("invalid allow_timeline_creation {v:?}"))
                        })?
                    }
                    _ => return Err(p.err(format!("unknown option {k:?}"))),
                }
            }
            ReplicationCommand::StartWalPush {
                proto_version,
                allow_timeline_creation,
            }
        }
        "IDENTIFY_SYSTEM" => ReplicationCommand::IdentifySystem,
        "TIMELINE_STATUS" => ReplicationCommand::TimelineStatus,
        "SHOW" => ReplicationCommand::Show(p.ident("a parameter name")?),
        "READ_REPLICATION_SLOT" => ReplicationCommand::ReadReplicationSlot(p.ident("a slot name")?),
        "TIMELINE_HISTORY" => {
            let w = p.word("a timeline number")?;
            ReplicationCommand::TimelineHistory(
                w.parse()
                    .map_err(|_| p.err(format!("invalid timeline {w:?}")))?,
            )
        }
        "SET" => {
            if !p.eat_keyword("datestyle") {
                return Err(CommandError::Unsupported {
                    command: "SET".to_string(),
                });
            }
            // The value is ignored: we only ever send ISO dates (there are none in our replies).
            p.toks.clear();
            ReplicationCommand::SetDatestyle
        }
        "START_REPLICATION" => {
            let slot = if p.eat_keyword("slot") {
                Some(p.ident("a slot name")?)
            } else {
                None
            };
            if p.peek_keyword("logical") {
                return Err(p.err("logical replication is not supported"));
            }
            p.eat_keyword("physical");
            let w = p.word("a start LSN X/X")?;
            let start_lsn: Lsn = w
                .parse()
                .map_err(|_| p.err(format!("invalid start LSN {w:?}")))?;
            let timeline = if p.eat_keyword("timeline") {
                let w = p.word("a timeline number")?;
                Some(
                    w.parse()
                        .map_err(|_| p.err(format!("invalid timeline {w:?}")))?,
                )
            } else {
                None
            };
            let mut term = None;
            for (k, v) in p.options()? {
                match k.as_str() {
                    "term" => {
                        term = Some(Term(
                            v.parse()
                                .map_err(|_| p.err(format!("invalid term {v:?}")))?,
                        ))
                    }
                    _ => return Err(p.err(format!("unknown option {k:?}"))),
                }
            }
            ReplicationCommand::StartReplication {
                slot,
                start_lsn,
                timeline,
                term,
            }
        }
        _ => unreachable!("command names listed above"),
    };
    p.end()?;
    Ok(cmd)
}

impl CommandError {
    /// The ERROR to answer with (SQLSTATE 42601 syntax_error, as PostgreSQL's replication
    /// grammar reports unknown commands); the connection stays usable.
    pub fn to_error_fields(&self) -> pq_proto::ErrorFields {
        pq_proto::ErrorFields::error(pq_proto::sqlstate::SYNTAX_ERROR, self.to_string())
    }

    fn with_reason(self, reason: String) -> CommandError {
        match self {
            CommandError::Unsupported { command } => {
                let known = [
                    "START_WAL_PUSH",
                    "IDENTIFY_SYSTEM",
                    "TIMELINE_STATUS",
                    "SHOW",
                    "READ_REPLICATION_SLOT",
                    "START_REPLICATION",
                    "TIMELINE_HISTORY",
                    "SET",
                ];
                match known
                    .iter()
                    .find(|k| k.eq_ignore_ascii_case(command.trim_end_matches(';')))
                {
                    Some(k) => CommandError::Syntax { command: k, reason },
                    None => CommandError::Unsupported { command },
                }
            }
            other => other,
        }
    }
}

// ------------------------------------------------------------------------------------------------
// startup `options`

/// What a connection's startup `options` parameter says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectionOptions {
    /// `tenant_id` (or neon's legacy `ztenantid`).
    pub tenant_id: Option<TenantId>,
    /// `timeline_id` (or neon's legacy `ztimelineid`).
    pub timeline_id: Option<TimelineId>,
    /// Every other `key=value`, in order (keys as written; `--a-b=v` gives key `a_b`).
    pub other: Vec<(String, String)>,
}

/// Why the `options` parameter is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// An item of `-c key=value` without its `=`.
    #[error("invalid item {0:?} in options: expected key=value")]
    NotKeyValue(String),
    /// A tenant or timeline id that does not parse.
    #[error("invalid {key} in options: {source}")]
    BadId {
        /// `tenant_id` or `timeline_id`.
        key: &'static str,
        /// Why it does not parse.
        #[source]
        source: IdParseError,
    },
}

/// Splits `options` on unescaped whitespace; a backslash escapes the next character (as
/// PostgreSQL's `pg_split_opts`).
fn split_opts(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c.is_ascii_whitespace() {
            if in_word {
                out.push(std::mem::take(&mut cur));
                in_word = false;
            }
            continue;
        }
        in_word = true;
        if c == '\\' {
            if let Some(n) = it.next() {
                cur.push(n);
            }
        } else {
            cur.push(c);
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

/// Parses the startup `options` parameter. libpq passes `options='-c tenant_id=X timeline_id=Y'`
/// through verbatim, so we accept `-c key=value`, `-ckey=value`, `--key=value` and plain
/// `key=value` items separated by whitespace.
pub fn parse_options(options: &str) -> Result<ConnectionOptions, OptionsError> {
    let mut out = ConnectionOptions::default();
    let items = split_opts(options);
    let mut i = 0;
    while i < items.len() {
        let item = &items[i];
        i += 1;
        let kv: String = if item == "-c" {
            // The value is the next item.
            match items.get(i) {
                Some(next) => {
                    i += 1;
                    next.clone()
                }
                None => return Err(OptionsError::NotKeyValue(item.clone())),
            }
        } else if let Some(rest) = item.strip_prefix("--") {
            match rest.split_once('=') {
                Some((k, v)) => format!("{}={v}", k.replace('-', "_")),
                None => return Err(OptionsError::NotKeyValue(item.clone())),
            }
        } else if let Some(rest) = item.strip_prefix("-c") {
            rest.to_string()
        } else {
            item.clone()
        };
        let Some((key, value)) = kv.split_once('=') else {
            return Err(OptionsError::NotKeyValue(kv));
        };
        match key {
            "tenant_id" | "ztenantid" => {
                out.tenant_id = Some(value.parse().map_err(|source| OptionsError::BadId {
                    key: "tenant_id",
                    source,
                })?)
            }
            "timeline_id" | "ztimelineid" => {
                out.timeline_id = Some(value.parse().map_err(|source| OptionsError::BadId {
                    key: "timeline_id",
                    source,
                })?)
            }
            _ => out.other.push((key.to_string(), value.to_string())),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ReplicationCommand as C;
    use proptest::prelude::*;

    fn ok(q: &str) -> ReplicationCommand {
        parse_command(q).unwrap_or_else(|e| panic!("{q:?} must parse: {e}"))
    }

    #[test]
    fn simple_commands_in_any_case_with_trailing_semicolon() {
        assert_eq!(ok("IDENTIFY_SYSTEM"), C::IdentifySystem);
        assert_eq!(ok("  identify_system ;  "), C::IdentifySystem);
        assert_eq!(ok("Timeline_Status;;"), C::TimelineStatus);
        assert_eq!(
            ok("SHOW data_directory_mode"),
            C::Show("data_directory_mode".into())
        );
        assert_eq!(
            ok("show WAL_SEGMENT_SIZE;"),
            C::Show("wal_segment_size".into())
        );
        assert_eq!(ok("SHOW \"Odd\""), C::Show("Odd".into()));
        assert_eq!(
            ok("READ_REPLICATION_SLOT s1"),
            C::ReadReplicationSlot("s1".into())
        );
        assert_eq!(ok("TIMELINE_HISTORY 2"), C::TimelineHistory(2));
        assert_eq!(ok("SET datestyle TO 'ISO'"), C::SetDatestyle);
        assert_eq!(ok("set DateStyle = ISO, YMD;"), C::SetDatestyle);
    }

    #[test]
    fn start_wal_push_options_and_defaults() {
        assert_eq!(
            ok("START_WAL_PUSH"),
            C::StartWalPush {
                proto_version: 2,
                allow_timeline_creation: true
            }
        );
        assert_eq!(
            ok("START_WAL_PUSH (proto_version '3')"),
            C::StartWalPush {
                proto_version: 3,
                allow_timeline_creation: true
            }
        );
        assert_eq!(
            ok("start_wal_push (proto_version '3', allow_timeline_creation 'false');"),
            C::StartWalPush {
                proto_version: 3,
                allow_timeline_creation: false
            }
        );
        assert_eq!(
            ok("START_WAL_PUSH(allow_timeline_creation=true)"),
            C::StartWalPush {
                proto_version: 2,
                allow_timeline_creation: true
            }
        );
        for bad in [
            "START_WAL_PUSH (proto_version 'x')",
            "START_WAL_PUSH (allow_timeline_creation 'maybe')",
            "START_WAL_PUSH (bogus '1')",
            "START_WAL_PUSH (proto_version '3'",
            "START_WAL_PUSH extra",
        ] {
            assert!(
                matches!(
                    parse_command(bad),
                    Err(CommandError::Syntax {
                        command: "START_WAL_PUSH",
                        ..
                    })
                ),
                "{bad:?}: {:?}",
                parse_command(bad)
            );
        }
    }

    #[test]
    fn start_replication_forms() {
        assert_eq!(
            ok("START_REPLICATION 0/1000000 TIMELINE 1"),
            C::StartReplication {
                slot: None,
                start_lsn: Lsn(0x100_0000),
                timeline: Some(1),
                term: None
            }
        );
        assert_eq!(
            ok("START_REPLICATION SLOT \"My Slot\" PHYSICAL 1/A TIMELINE 3;"),
            C::StartReplication {
                slot: Some("My Slot".into()),
                start_lsn: Lsn(0x1_0000_000A),
                timeline: Some(3),
                term: None
            }
        );
        assert_eq!(
            ok("start_replication slot S1 physical 0/3000000"),
            C::StartReplication {
                slot: Some("s1".into()),
                start_lsn: Lsn(0x300_0000),
                timeline: None,
                term: None
            }
        );
        assert_eq!(
            ok("START_REPLICATION PHYSICAL 0/16B3748 (term='5')"),
            C::StartReplication {
                slot: None,
                start_lsn: Lsn(0x16B_3748),
                timeline: None,
                term: Some(Term(5))
            }
        );
        assert_eq!(
            ok("START_REPLICATION SLOT \"a\"\"b\" 0/0"),
            C::StartReplication {
                slot: Some("a\"b".into()),
                start_lsn: Lsn(0),
                timeline: None,
                term: None
            }
        );
        for bad in [
            "START_REPLICATION",
            "START_REPLICATION PHYSICAL",
            "START_REPLICATION 0/x",
            "START_REPLICATION 0/0 TIMELINE",
            "START_REPLICATION 0/0 TIMELINE -1",
            "START_REPLICATION 0/0 (term='x')",
            "START_REPLICATION 0/0 (other='1')",
            "START_REPLICATION SLOT s LOGICAL 0/0",
            "START_REPLICATION SLOT \"unterminated 0/0",
            "START_REPLICATION 0/0 junk",
        ] {
            assert!(
                matches!(
                    parse_command(bad),
                    Err(CommandError::Syntax {
                        command: "START_REPLICATION",
                        ..
                    })
                ),
                "{bad:?}: {:?}",
                parse_command(bad)
            );
        }
    }

    #[test]
    fn unknown_commands_are_named_in_the_error() {
        let e = parse_command("BASE_BACKUP (LABEL 'x')").unwrap_err();
        assert_eq!(
            e,
            CommandError::Unsupported {
                command: "BASE_BACKUP".into()
            }
        );
        assert_eq!(e.to_string(), "unsupported command BASE_BACKUP");
        assert_eq!(e.to_error_fields().code, "42601");
        assert_eq!(e.to_error_fields().severity, "ERROR");
        assert_eq!(
            parse_command("select 1"),
            Err(CommandError::Unsupported {
                command: "select".into()
            })
        );
        assert_eq!(
            parse_command("SET search_path TO x"),
            Err(CommandError::Unsupported {
                command: "SET".into()
            })
        );
        assert_eq!(parse_command("  ;  "), Err(CommandError::Empty));
        assert_eq!(parse_command(""), Err(CommandError::Empty));
        assert!(matches!(
            parse_command("IDENTIFY_SYSTEM now"),
            Err(CommandError::Syntax {
                command: "IDENTIFY_SYSTEM",
                ..
            })
        ));
        assert!(matches!(
            parse_command("SHOW"),
            Err(CommandError::Syntax {
                command: "SHOW",
                ..
            })
        ));
    }

    const T: &str = "de200bd42b49cc1814412c7e592dd6e9";
    const L: &str = "0102030405060708090a0b0c0d0e0f10";

    #[test]
    fn options_forms_name_the_timeline() {
        let want = ConnectionOptions {
            tenant_id: Some(T.parse().unwrap()),
            timeline_id: Some(L.parse().unwrap()),
            other: vec![],
        };
        for s in [
            format!("-c tenant_id={T} timeline_id={L}"),
            format!("-c tenant_id={T} -c timeline_id={L}"),
            format!("-ctenant_id={T} -ctimeline_id={L}"),
            format!("tenant_id={T}   timeline_id={L}"),
            format!("--tenant-id={T} --timeline_id={L}"),
            format!("  ztenantid={T}\ttimeline_id={L} "),
        ] {
            assert_eq!(parse_options(&s), Ok(want.clone()), "{s:?}");
        }
        let o = parse_options(&format!(
            "-c tenant_id={T} timeline_id={L} availability_zone=a\\ b"
        ))
        .unwrap();
        assert_eq!(o.other, vec![("availability_zone".into(), "a b".into())]);
        assert_eq!(parse_options(""), Ok(ConnectionOptions::default()));
    }

    #[test]
    fn bad_options_are_errors() {
        assert!(matches!(
            parse_options("-c tenant_id=xyz"),
            Err(OptionsError::BadId {
                key: "tenant_id",
                ..
            })
        ));
        assert_eq!(
            parse_options("-c"),
            Err(OptionsError::NotKeyValue("-c".into()))
        );
        assert_eq!(
            parse_options("tenant_id"),
            Err(OptionsError::NotKeyValue("tenant_id".into()))
        );
    }

    proptest! {
        #[test]
        fn random_queries_never_panic(q in "\\PC{0,80}") {
            let _ = parse_command(&q);
            let _ = parse_options(&q);
        }

        #[test]
        fn start_replication_lsn_round_trips(v in any::<u64>(), tli in 1u32..100) {
            let q = format!("START_REPLICATION PHYSICAL {} TIMELINE {tli}", Lsn(v));
            prop_assert_eq!(parse_command(&q), Ok(C::StartReplication {
                slot: None, start_lsn: Lsn(v), timeline: Some(tli), term: None
            }));
        }
    }
}
